// The CUDA passes of clipping: pycomm::norm_partial and pycomm::scale_ on CUDA, and the
// eager clip of one device's gradients in two launches. Each pass is one launch over a
// list's tiles (tile_plan.cuh), its table on the device, built once per list and reused.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "grad/block_reduce.cuh"
#include "grad/clip.h"
#include "grad/grad_math.h"
#include "grad/multi_tensor.cuh"
#include "grad/tile_plan.cuh"

namespace pycomm {

// Note [Tile plans]
// A clip is two passes over the gradients (the norm, then the scale), and on a GPU each
// pass should cost what its bytes cost. Two things stood in the way (GPT-2 small's 148
// fp32 gradients: 60% of the copy bandwidth clipping, 44% not; 1,000 gradients of 1,024
// elements: 226 us, nearly all of it host work and launches):
// - the pointers travelled in kernel parameters, 96 tensors and 320 blocks a launch, so a
//   pass was several launches of too few blocks to fill the device, each behind the last;
// - every call rebuilt those tables on the host, and they could not be replayed by a graph
//   other than by capturing every launch.
// Here a list is cut once into tiles of kTileElements (a tensor's last tile shorter), and
// the table of tiles (pointer, length, dtype: 16 bytes each) is written to the device
// once, by launches that carry it in their parameters (no host memory for a graph to
// read). The plan is kept, keyed by the list's pointers, sizes and dtypes: the same
// gradients in the next step find it, and reading the key costs what reading .grad costs.
// Each pass is then one launch of a fixed grid (a few blocks per multiprocessor), whose
// blocks stride over the tiles; a block switches on a tile's dtype, so a list of mixed
// dtypes is one launch too.
// - The norm pass leaves one partial per block in the plan's workspace; the last block to
//   finish (a counter, reset by that block) folds them in block order, so the result is
//   the same bits on every run of the same plan, with no second launch.
// - The scale pass reads its coefficient on the device; the eager clip computes it there
//   from the norm's partial (with clip_coef's arithmetic: every block the same), so the
//   clip is two launches and no host sync; a coefficient of 1 returns before any load.
// - The scale pass walks the tiles last to first: the norm pass ended on the last tiles,
//   and what of them is still in L2 is read from there.
// Under CUDA graph capture a plan is used as outside it; one made during capture (the
// gradients of a captured backward are new tensors) is filled by captured launches, and
// filled again before any use outside a replay. A plan a graph has used is never evicted:
// the graph reads its table at every replay. The others are evicted least recently used
// first, beyond kMaxPlans.

namespace {

constexpr int kBlocksPerSM = 4;  // 1,024 threads each with four 16-byte loads in flight
constexpr size_t kMaxPlans = 64;
constexpr int kFillBatch = 200;  // tiles a filling launch carries (3,200 bytes of parameters)

TileDtype tile_dtype(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return TileDtype::kFloat;
    case at::kHalf: return TileDtype::kHalf;
    case at::kBFloat16: return TileDtype::kBFloat16;
    case at::kDouble: return TileDtype::kDouble;
    default:
      TORCH_CHECK(false, op, ": CUDA gradients must be float32, float64, float16 or bfloat16, got ",
                  t);
  }
}

// Calls f(static_cast<T*>(nullptr)) for the tile's element type T.
template <typename F>
__device__ inline void with_tile_type(int32_t dtype, F&& f) {
  switch (static_cast<TileDtype>(dtype)) {
    case TileDtype::kFloat: f(static_cast<float*>(nullptr)); break;
    case TileDtype::kHalf: f(static_cast<at::Half*>(nullptr)); break;
    case TileDtype::kBFloat16: f(static_cast<at::BFloat16*>(nullptr)); break;
    default: f(static_cast<double*>(nullptr)); break;
  }
}

// Calls visit(element) for every element of a tile this thread owns: 16-byte loads four
// deep where the tile is aligned for them, element loads for the rest.
template <typename T, typename Visit>
__device__ inline void read_tile(const Tile& tile, Visit&& visit) {
  using P = Pack<T>;
  const T* x = reinterpret_cast<const T*>(tile.ptr);
  int start = 0;
  if (is_aligned_for<P>(x)) {
    const int packs = tile.n / P::kSize;
    const P* xp = reinterpret_cast<const P*>(x);
    int i = threadIdx.x;
    for (; i + 3 * kThreads < packs; i += 4 * kThreads) {
      P v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = xp[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) visit(v[u].v[k]);
    }
    for (; i < packs; i += kThreads) {
      const P v = xp[i];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) visit(v.v[k]);
    }
    start = packs * P::kSize;
  }
  for (int i = start + threadIdx.x; i < tile.n; i += kThreads) visit(x[i]);
}

// x *= c over a tile this block owns, in T's opmath type, as read_tile reads.
template <typename T>
__device__ inline void scale_tile(const Tile& tile, double c) {
  using Acc = at::opmath_type<T>;
  using P = Pack<T>;
  const Acc ca = static_cast<Acc>(c);
  const auto scaled = [ca](T e) { return static_cast<T>(static_cast<Acc>(e) * ca); };
  T* x = reinterpret_cast<T*>(tile.ptr);
  int start = 0;
  if (is_aligned_for<P>(x)) {
    const int packs = tile.n / P::kSize;
    P* xp = reinterpret_cast<P*>(x);
    int i = threadIdx.x;
    for (; i + 3 * kThreads < packs; i += 4 * kThreads) {
      P v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = xp[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) v[u].v[k] = scaled(v[u].v[k]);
        xp[i + u * kThreads] = v[u];
      }
    }
    for (; i < packs; i += kThreads) {
      P v = xp[i];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) v.v[k] = scaled(v.v[k]);
      xp[i] = v;
    }
    start = packs * P::kSize;
  }
  for (int i = start + threadIdx.x; i < tile.n; i += kThreads) x[i] = scaled(x[i]);
}

struct TileBatch {
  Tile tiles[kFillBatch];
};

__global__ void fill_tiles_kernel(const TileBatch batch, int count, Tile* __restrict__ table) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) table[i] = batch.tiles[i];
}

// One norm partial (Note [Norm partials]) of every tile into out = [acc, nonfinite 0/1]:
// a partial per block, then the last block done folds them in block order.
template <NormKind K, typename Acc>
__global__ void __launch_bounds__(kThreads)
    tile_norm_kernel(const Tile* __restrict__ tiles, int64_t count, Acc* partials,
                     unsigned int* counter, Acc* out, double p) {
  const Acc pa = static_cast<Acc>(p);
  Acc acc(0), nf(0);
  for (int64_t t = blockIdx.x; t < count; t += gridDim.x) {
    const Tile tile = tiles[t];
    with_tile_type(tile.dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      read_tile<T>(tile, [&](T e) {
        const Acc v = static_cast<Acc>(e);
        acc = norm_step<K, Acc>(acc, v, pa);
        nf += v - v;
      });
    });
  }
  acc = block_reduce(acc, Combine<K, Acc>{});
  nf = block_reduce(nf, Plus<Acc>{});
  __shared__ bool last;
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = acc;
    partials[2 * blockIdx.x + 1] = nf;
    __threadfence();  // the partial is visible before the count says so
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  acc = Acc(0);
  nf = Acc(0);
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += kThreads) {
    acc = norm_combine<K, Acc>(acc, __ldcg(partials + 2 * b));  // from L2: other SMs wrote them
    nf += __ldcg(partials + 2 * b + 1);
  }
  acc = block_reduce(acc, Combine<K, Acc>{});
  nf = block_reduce(nf, Plus<Acc>{});
  if (threadIdx.x == 0) {
    out[0] = acc;
    out[1] = nf != nf ? Acc(1) : Acc(0);
    *counter = 0u;  // ready for the next pass (and the next replay)
  }
}

// The scale pass's coefficient, read from a one-element tensor (pycomm::scale_).
template <typename C>
struct FactorFrom {
  const C* factor;
  __device__ double operator()() const { return static_cast<double>(factor[0]); }
};

// The clip's coefficient from the norm's partial, with clip_coef's arithmetic (the norm
// rounded to the gradients' promoted dtype NormT, then torch's min(max / (norm + 1e-6), 1));
// block 0 stores the total norm the clip returns.
template <typename P, typename NormT>
struct ClipFrom {
  const P* partial;
  NormT* total;
  double p;
  double max_norm;
  NormKind kind;
  __device__ double operator()() const {
    using Acc = at::opmath_type<NormT>;
    const NormT t = static_cast<NormT>(norm_finish<Acc>(static_cast<Acc>(partial[0]), kind,
                                                        static_cast<Acc>(p)));
    if (blockIdx.x == 0 && threadIdx.x == 0) *total = t;
    return static_cast<double>(clip_coefficient<NormT>(t, static_cast<Acc>(max_norm)));
  }
};

// x *= coefficient over every tile, last tile first (Note [Tile plans]).
template <typename Coef>
__global__ void __launch_bounds__(kThreads)
    tile_scale_kernel(const Tile* __restrict__ tiles, int64_t count, Coef coef_of) {
  const double c = coef_of();
  if (c == 1.0) return;
  for (int64_t t = blockIdx.x; t < count; t += gridDim.x) {
    const Tile tile = tiles[count - 1 - t];
    with_tile_type(tile.dtype,
                   [&](auto* tag) { scale_tile<std::remove_pointer_t<decltype(tag)>>(tile, c); });
  }
}

// ---- plans -------------------------------------------------------------------------------

struct PlanEntry {
  std::vector<uint64_t> key;
  std::shared_ptr<TilePlan> plan;
  std::vector<Tile> host;  // the table, to fill again outside a graph
  c10::StreamId stream;    // the stream its tensors were allocated on
  uint64_t used;
};

struct PlanCache {
  std::mutex mutex;
  std::vector<PlanEntry> entries;
  uint64_t clock = 0;
};

PlanCache& plan_cache() {
  static auto* cache = new PlanCache();  // never destroyed: plans outlive static teardown
  return *cache;
}

std::vector<uint64_t> plan_key(const SpanList& l, c10::Device device, at::ScalarType acc) {
  std::vector<uint64_t> key;
  key.reserve(3 * l.spans.size() + 2);
  key.push_back((static_cast<uint64_t>(device.index()) << 8) | static_cast<uint64_t>(acc));
  key.push_back(l.spans.size());
  for (const Span& s : l.spans) {
    key.push_back(reinterpret_cast<uint64_t>(s.data));
    key.push_back(static_cast<uint64_t>(s.numel));
    key.push_back(static_cast<uint64_t>(s.dtype));
  }
  return key;
}

std::vector<Tile> cut_tiles(const SpanList& l, const char* op) {
  std::vector<Tile> tiles;
  for (const Span& s : l.spans) {
    const int32_t code = static_cast<int32_t>(tile_dtype(s.dtype, op));
    const int64_t size = static_cast<int64_t>(c10::elementSize(s.dtype));
    for (int64_t off = 0; off < s.numel; off += kTileElements) {
      tiles.push_back({reinterpret_cast<uint64_t>(s.data) + static_cast<uint64_t>(off * size),
                       static_cast<int32_t>(std::min<int64_t>(kTileElements, s.numel - off)),
                       code});
    }
  }
  return tiles;
}

void fill(const TilePlan& plan, const std::vector<Tile>& host, cudaStream_t stream) {
  Tile* table = reinterpret_cast<Tile*>(plan.tiles.mutable_data_ptr<int64_t>());
  TileBatch batch{};
  for (size_t first = 0; first < host.size(); first += kFillBatch) {
    const int count = static_cast<int>(std::min<size_t>(kFillBatch, host.size() - first));
    std::copy_n(host.begin() + static_cast<int64_t>(first), count, batch.tiles);
    fill_tiles_kernel<<<1, kThreads, 0, stream>>>(batch, count, table + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

PlanEntry make_plan(const SpanList& l, c10::Device device, at::ScalarType acc, bool capturing,
                    const char* op) {
  PlanEntry e;
  e.host = cut_tiles(l, op);
  auto plan = std::make_shared<TilePlan>();
  plan->device = device;
  plan->count = static_cast<int64_t>(e.host.size());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device.index()));
  plan->blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(plan->count, static_cast<int64_t>(sms) * kBlocksPerSM)));
  plan->acc_dtype = acc;
  const auto opts = at::TensorOptions().device(device);
  plan->tiles = at::empty({2 * std::max<int64_t>(plan->count, 1)}, opts.dtype(at::kLong));
  plan->partials = at::empty({2 * plan->blocks}, opts.dtype(acc));
  plan->result = at::empty({2}, opts.dtype(acc));
  plan->counter = at::zeros({1}, opts.dtype(at::kInt));
  plan->filled_in_graph = capturing;
  plan->pinned = capturing;
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  fill(*plan, e.host, stream.stream());
  e.stream = stream.id();
  e.plan = std::move(plan);
  return e;
}

// A plan used on another stream than its tensors': their blocks wait for that stream too
// before the allocator reuses them (once the plan is evicted).
void record_use(const PlanEntry& e, const c10::cuda::CUDAStream& stream) {
  if (stream.id() == e.stream) return;
  for (const at::Tensor* t :
       {&e.plan->tiles, &e.plan->partials, &e.plan->result, &e.plan->counter}) {
    c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream);
  }
}

at::ScalarType acc_dtype_of(const SpanList& l) {
  for (const Span& s : l.spans)
    if (s.dtype == at::kDouble) return at::kDouble;
  return at::kFloat;
}

// ---- launches ----------------------------------------------------------------------------

const Tile* table_of(const TilePlan& plan) {
  return reinterpret_cast<const Tile*>(plan.tiles.const_data_ptr<int64_t>());
}

// The norm pass into `out` (plan.acc_dtype, two elements).
void launch_norm(const TilePlan& plan, NormKind kind, double p, void* out, cudaStream_t stream) {
  with_norm_kind(kind, [&](auto k) {
    AT_DISPATCH_FLOATING_TYPES(plan.acc_dtype, "tile_norm", [&] {
      tile_norm_kernel<decltype(k)::value, scalar_t><<<plan.blocks, kThreads, 0, stream>>>(
          table_of(plan), plan.count, plan.partials.mutable_data_ptr<scalar_t>(),
          reinterpret_cast<unsigned int*>(plan.counter.mutable_data_ptr<int32_t>()),
          static_cast<scalar_t*>(out), p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

template <typename Coef>
void launch_scale(const TilePlan& plan, Coef coef, cudaStream_t stream) {
  tile_scale_kernel<Coef><<<plan.blocks, kThreads, 0, stream>>>(table_of(plan), plan.count, coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---- the ops -----------------------------------------------------------------------------

at::Tensor norm_partial_cuda(at::TensorList tensors, double norm_type) {
  constexpr const char* op = "pycomm::norm_partial";
  const NormKind kind = norm_kind(norm_type, op);
  const c10::Device device = check_tensor_list(tensors, op, "tensors");
  const c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> copies;
  const SpanList l = read_spans(tensors, copies);
  const at::ScalarType acc = partial_dtype(tensors);
  auto out = at::empty({2}, tensors[0].options().dtype(acc));
  if (l.spans.empty()) return out.zero_();
  // copies are new tensors each call: planned, not kept
  const auto plan = tile_plan(l, device, acc, copies.empty());
  launch_norm(*plan, kind, norm_type, out.mutable_data_ptr(),
              c10::cuda::getCurrentCUDAStream(device.index()).stream());
  return out;
}

// x *= factor. The factor is read on the device first: at 1 (clipping inactive) every
// block returns before touching memory, so skipping the pass needs no host sync.
void scale_cuda_(at::TensorList tensors, const at::Tensor& factor_in) {
  constexpr const char* op = "pycomm::scale_";
  const c10::Device device = check_tensor_list(tensors, op, "tensors");
  TORCH_CHECK(factor_in.numel() == 1 && at::isFloatingType(factor_in.scalar_type()), op,
              ": factor must be a one-element floating tensor, got shape ", factor_in.sizes(),
              " and dtype ", factor_in.scalar_type());
  TORCH_CHECK(factor_in.device() == device || factor_in.device().is_cpu(), op, ": factor is on ",
              factor_in.device(), " but tensors are on ", device);
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor factor = factor_in;
  if (factor.device().is_cpu()) {  // a host value: decide here, move it without a sync
    const double c = factor.item<double>();
    if (c == 1.0) return;
    factor = at::full({}, c, tensors[0].options().dtype(at::kDouble));
  }
  std::vector<size_t> strided;
  const SpanList l = write_spans(tensors, strided);
  for (size_t i : strided) tensors[i].mul_(factor);
  if (l.spans.empty()) return;
  const auto plan = tile_plan(l, device, acc_dtype_of(l), /*cache=*/true);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, factor.scalar_type(), "scale_cuda_", [&] {
        launch_scale(*plan, FactorFrom<scalar_t>{factor.const_data_ptr<scalar_t>()}, stream);
      });
}

// The eager clip of one device's gradients (See Note [Tile plans]): the norm pass, then
// the scale pass computing the coefficient itself. Returns the total norm.
at::Tensor clip_spans_cuda(const SpanList& l, c10::Device device, double max_norm, double norm_type,
                           at::ScalarType norm_dtype) {
  constexpr const char* op = "pycomm::clip_grad_norm_";
  const NormKind kind = norm_kind(norm_type, op);
  const c10::cuda::CUDAGuard guard(device);
  const auto opts = at::TensorOptions().device(device);
  if (l.spans.empty()) return at::zeros({}, opts.dtype(norm_dtype));
  const auto plan = tile_plan(l, device, acc_dtype_of(l), /*cache=*/true);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  auto total = at::empty({}, opts.dtype(norm_dtype));
  launch_norm(*plan, kind, norm_type, plan->result.mutable_data_ptr(), stream);
  AT_DISPATCH_FLOATING_TYPES(plan->acc_dtype, "clip_spans_cuda", [&] {
    using P = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, norm_dtype, "clip_spans_norm", [&] {
      launch_scale(*plan,
                   ClipFrom<P, scalar_t>{plan->result.const_data_ptr<P>(),
                                         total.mutable_data_ptr<scalar_t>(), norm_type, max_norm,
                                         kind},
                   stream);
    });
  });
  return total;
}

std::pair<int64_t, int64_t> plan_counts() {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  int64_t pinned = 0;
  for (const auto& e : cache.entries) pinned += e.plan->pinned;
  return {static_cast<int64_t>(cache.entries.size()), pinned};
}

void clear_plans() {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.entries.erase(std::remove_if(cache.entries.begin(), cache.entries.end(),
                                     [](const PlanEntry& e) { return !e.plan->pinned; }),
                      cache.entries.end());
}

const CudaClip kCudaClip{&clip_spans_cuda, &plan_counts, &clear_plans};
const bool kRegistered = (cuda_clip() = &kCudaClip, true);

}  // namespace

std::shared_ptr<TilePlan> tile_plan(const SpanList& l, c10::Device device, at::ScalarType acc,
                                    bool cache_it) {
  constexpr const char* op = "pycomm tile plan";
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
                         c10::cuda::CaptureStatus::None;
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  if (!cache_it) return make_plan(l, device, acc, capturing, op).plan;
  std::vector<uint64_t> key = plan_key(l, device, acc);
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  for (PlanEntry& e : cache.entries) {
    if (e.key.size() != key.size() ||
        std::memcmp(e.key.data(), key.data(), key.size() * sizeof(uint64_t)) != 0)
      continue;
    e.used = ++cache.clock;
    TilePlan& plan = *e.plan;
    if (capturing) {
      plan.pinned = true;
    } else {
      if (plan.filled_in_graph) {  // its table and counter were only ever written by a graph
        fill(plan, e.host, stream.stream());
        plan.counter.zero_();
        plan.filled_in_graph = false;
      }
      record_use(e, stream);
    }
    return e.plan;
  }
  PlanEntry e = make_plan(l, device, acc, capturing, op);
  e.key = std::move(key);
  e.used = ++cache.clock;
  if (cache.entries.size() >= kMaxPlans) {
    auto oldest = cache.entries.end();
    for (auto it = cache.entries.begin(); it != cache.entries.end(); ++it) {
      if (!it->plan->pinned && (oldest == cache.entries.end() || it->used < oldest->used))
        oldest = it;
    }
    if (oldest != cache.entries.end()) cache.entries.erase(oldest);
  }
  cache.entries.push_back(std::move(e));
  return cache.entries.back().plan;
}

TORCH_LIBRARY_IMPL(pycomm, CUDA, m) {
  m.impl("norm_partial", &norm_partial_cuda);
  m.impl("scale_", &scale_cuda_);
}

}  // namespace pycomm
