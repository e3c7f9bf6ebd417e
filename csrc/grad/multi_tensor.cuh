// One CUDA launch over many tensors (apex's multi-tensor idea, written for pycomm): the
// tensors' pointers and a block -> (tensor, chunk) table travel in the kernel's parameter
// space, so 1,000 gradients cost a handful of launches instead of 1,000. Host side packs
// tables and launches; device side finds a block's chunk and loads it vectorized.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace pycomm {

// Sized so that ChunkTable<2> plus the other kernel arguments fits the classic 4 KiB
// kernel-parameter limit (no reliance on CUDA 12.1's larger parameter space).
constexpr int kTableTensors = 96;
constexpr int kTableBlocks = 320;
constexpr int64_t kCudaChunk = 1 << 16;  // elements per block: one partial per chunk

template <int Depth>
struct ChunkTable {
  void* ptr[Depth][kTableTensors];
  int64_t numel[kTableTensors];
  uint8_t tensor_of_block[kTableBlocks];
  int32_t chunk_of_block[kTableBlocks];
};
static_assert(sizeof(ChunkTable<2>) + 64 <= 4096, "kernel parameters must fit 4 KiB");

// A block's piece: `n` elements starting at chunk * kCudaChunk of table slot `slot`.
struct BlockPiece {
  int slot;
  int64_t offset;
  int64_t n;
};

template <int Depth>
__device__ inline BlockPiece block_piece(const ChunkTable<Depth>& t) {
  const int slot = t.tensor_of_block[blockIdx.x];
  const int64_t offset = static_cast<int64_t>(t.chunk_of_block[blockIdx.x]) * kCudaChunk;
  const int64_t rest = t.numel[slot] - offset;
  return {slot, offset, rest < kCudaChunk ? rest : kCudaChunk};
}

// N elements of T loaded or stored as one access; the default N makes it sixteen bytes,
// the widest load every architecture issues in one instruction.
template <typename T, int N = 16 / sizeof(T)>
struct alignas(sizeof(T) * N) Pack {
  static constexpr int kSize = N;
  T v[N];
};

template <typename P, typename T>
__device__ inline bool is_aligned_for(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(P) == 0;
}

// Host: the chunks of a list of same-dtype tensors, packed into tables and launched by
// `launch(table, blocks, first_block)`; `first_block` numbers blocks across launches.
template <int Depth, typename Launch>
void launch_chunks(const std::vector<std::array<void*, Depth>>& ptrs,
                   const std::vector<int64_t>& numels, Launch&& launch) {
  ChunkTable<Depth> table;
  int tensors = 0, blocks = 0;
  int64_t first_block = 0;
  const auto flush = [&] {
    if (blocks > 0) launch(table, blocks, first_block);
    first_block += blocks;
    tensors = blocks = 0;
  };
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const int64_t chunks = (numels[i] + kCudaChunk - 1) / kCudaChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (c == 0 || tensors == 0) {  // a new tensor, or the rest of one after a flush
        if (tensors == kTableTensors) flush();
        for (int d = 0; d < Depth; ++d) table.ptr[d][tensors] = ptrs[i][d];
        table.numel[tensors++] = numels[i];
      }
      table.tensor_of_block[blocks] = static_cast<uint8_t>(tensors - 1);
      table.chunk_of_block[blocks++] = static_cast<int32_t>(c);
      if (blocks == kTableBlocks) flush();
    }
  }
  flush();
}

inline int64_t count_chunks(const std::vector<int64_t>& numels) {
  int64_t chunks = 0;
  for (int64_t n : numels) chunks += (n + kCudaChunk - 1) / kCudaChunk;
  return chunks;
}

}  // namespace pycomm
