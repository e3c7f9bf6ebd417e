// The coalesced into-tensor collectives' lists (all_gather_into_tensor and
// reduce_scatter_tensor issued inside torch's coalescing manager), shared by ShmBackend
// (backend_tensor_lists.cpp) and HierBackend (hier.cpp): their checks, and the packing
// that makes a list one collective.
//
// Note [Coalesced into-tensor collectives]
// all_gather_into_tensor and reduce_scatter_tensor issued inside torch's coalescing
// manager (FSDP2 issues them so) arrive as one list, and all_gather_coalesced's list of
// lists is the same all-gather laid out per rank. Each runs as one collective over the
// whole list, not one round per entry: the entries are packed into one buffer, rank by
// rank (for the all-gather, this rank's inputs back to back; for the reduce-scatter,
// every entry's block for rank 0, then for rank 1, ...), the one collective runs on it,
// and the results are unpacked into the outputs. The packing copies each byte once each
// way, as Gloo's own coalesced path does, and makes the result independent of how the
// entries alias. The all-gather moves bytes, so entries of any dtypes mix; a reduction
// needs one dtype, so a mixed reduce-scatter list is refused by entry.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <vector>

namespace pycomm::shm {

// Entry i of a coalesced list: its input and output, checked for an all-gather (output
// world x input) or a reduce-scatter (input world x output).
void check_coalesced(const char* op, const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, int world, bool gather);

// A reduce-scatter list checked whole: its entries (check_coalesced), one dtype for all of
// them (a ValueError naming the first entry of another; an empty list refused) and
// `reduce` on it (check_reduction). Returns that dtype.
at::ScalarType check_reduce_scatter_list(const char* op, const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, int world,
                                         const c10d::ReduceOp& reduce);

// Bytes of `tensors` packed back to back: one rank's block in a coalesced all-gather.
int64_t packed_bytes(const std::vector<at::Tensor>& tensors);

// This rank's inputs packed back to back, as bytes: its block of a coalesced all-gather.
at::Tensor pack_block(const std::vector<at::Tensor>& inputs);

// A coalesced all-gather's result: `all` holds `world` blocks of `block` bytes, block r
// rank r's inputs back to back; entry i's ranges go into outputs[i] in rank order.
void unpack_gathered(const at::Tensor& all, int64_t block, const std::vector<at::Tensor>& inputs,
                     const std::vector<at::Tensor>& outputs, int world);

// A reduce-scatter list's inputs packed rank by rank, `world` blocks of the outputs'
// total elements: block r holds range r of every entry, in list order.
at::Tensor pack_by_rank(const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs, int world, at::ScalarType dtype);

// This rank's block of a reduce-scatter list back into its outputs, in list order.
void unpack_block(const at::Tensor& block, const std::vector<at::Tensor>& outputs);

}  // namespace pycomm::shm
