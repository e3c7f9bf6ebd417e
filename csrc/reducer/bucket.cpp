// Bucket assignment and buffer layout (see bucket.h).
#include "reducer/bucket.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace pycomm::reducer {

namespace {

using Key = std::tuple<c10::DeviceType, c10::DeviceIndex, at::ScalarType>;

Key key_of(const at::Tensor& t) { return {t.device().type(), t.device().index(), t.scalar_type()}; }

struct OpenBucket {
  std::vector<size_t> params;
  int64_t bytes = 0;
  size_t limit_index = 0;
};

int64_t bytes_of(const at::Tensor& p) { return p.numel() * static_cast<int64_t>(p.element_size()); }

// Per position of `order`: the bytes of its parameter's group (and key) that come after it.
std::vector<int64_t> group_bytes_after(const std::vector<at::Tensor>& params,
                                       const std::vector<size_t>& order,
                                       const std::vector<int64_t>& groups) {
  std::vector<int64_t> after(order.size(), 0);
  if (groups.empty()) return after;
  std::map<std::pair<int64_t, Key>, int64_t> tail;
  for (size_t pos = order.size(); pos-- > 0;) {
    const at::Tensor& p = params[order[pos]];
    int64_t& rest = tail[{groups[order[pos]], key_of(p)}];
    after[pos] = rest;
    rest += bytes_of(p);
  }
  return after;
}

}  // namespace

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                const std::vector<size_t>& order,
                                                const std::vector<int64_t>& byte_limits,
                                                const std::vector<int64_t>& groups) {
  TORCH_CHECK_VALUE(!byte_limits.empty(), "assign_buckets: byte_limits is empty");
  TORCH_CHECK_VALUE(order.size() == params.size(), "assign_buckets: order has ", order.size(),
                    " entries for ", params.size(), " parameters");
  TORCH_CHECK_VALUE(groups.empty() || groups.size() == params.size(),
                    "assign_buckets: ", groups.size(), " groups for ", params.size(),
                    " parameters");
  std::vector<bool> seen(params.size(), false);
  for (size_t index : order) {
    TORCH_CHECK_VALUE(index < params.size() && !seen[index],
                      "assign_buckets: order is not a permutation (index ", index, ")");
    seen[index] = true;
  }
  const std::vector<int64_t> after = group_bytes_after(params, order, groups);
  auto limit_at = [&](size_t k) { return byte_limits[std::min(k, byte_limits.size() - 1)]; };
  std::map<Key, OpenBucket> open;
  std::vector<std::vector<size_t>> result;
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const size_t index = order[pos];
    const at::Tensor& p = params[index];
    OpenBucket& b = open[key_of(p)];
    b.params.push_back(index);
    b.bytes += bytes_of(p);
    // Inside a group, close only if the rest of the group fills the next bucket by itself.
    const bool may_close = after[pos] == 0 || after[pos] >= limit_at(b.limit_index + 1);
    if (b.bytes >= limit_at(b.limit_index) && may_close) {
      result.push_back(std::move(b.params));
      b = OpenBucket{{}, 0, b.limit_index + 1};
    }
  }
  for (auto& [key, b] : open) {
    if (!b.params.empty()) result.push_back(std::move(b.params));
  }
  // Launch order = order of each bucket's first parameter in `order`.
  std::vector<size_t> position(params.size());
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::stable_sort(result.begin(), result.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  return result;
}

namespace {

// A view of `buffer` shaped like `param`, with the parameter's strides when it is dense
// (so a channels-last weight gets a channels-last gradient, as torch's reducer does).
at::Tensor view_for(const at::Tensor& buffer, const at::Tensor& param, int64_t offset) {
  if (param.is_non_overlapping_and_dense()) {
    return buffer.as_strided(param.sizes(), param.strides(), offset);
  }
  return buffer.narrow(0, offset, param.numel()).view(param.sizes());
}

}  // namespace

void ensure_storage(const at::Tensor& buffer) {
  const auto need = static_cast<size_t>((buffer.storage_offset() + buffer.numel()) *
                                        static_cast<int64_t>(buffer.element_size()));
  if (buffer.storage().nbytes() >= need) return;
  at::Tensor bytes = at::empty({0}, buffer.options().dtype(at::kByte));
  bytes.set_(buffer.storage());
  bytes.resize_({static_cast<int64_t>(need)});  // grows the shared storage in place
}

void release_storage(const at::Tensor& buffer) {
  c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, buffer.device()));  // frees the old bytes
  storage->set_nbytes(0);
}

// Note [Bucket memory]
// A bucket's buffer is allocated, not written: every step writes each slot before the
// collective reads it (the gradient's copy, or zeros for a parameter without one), so its
// first contents are never read, and on a CPU pages never written are never resident. A
// bucket reduced in place (Note [Gradients reduced in place]) never writes its buffer at all:
// over pycomm's shared-memory group the DDP then holds no copy of the gradients, at
// construction or after (benchmarks/results/ddp_bucket_memory_cpu.md), where zeros cost a
// resident copy of every gradient from construction on. A widened bucket (grad_reduce_dtype)
// is zeroed: its views are the parameters' main_grad, which the user may read first.
// With lazy_bucket_allocation (torch 2.15's option) a bucket that goes through its buffer
// also gives the memory back once backward is finalized (release_storage) and takes it
// again at its first copy of the next step (ensure_storage, before anything writes or
// reads the buffer: the copy in, the launch), so between steps only param.grad holds the
// gradients; not a bucket whose views are param.grad (gradient_as_bucket_view) or
// param.main_grad (a widened one), which live on.
std::vector<std::unique_ptr<Bucket>> build_buckets(
    const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
    const std::vector<std::vector<size_t>>& assignment,
    std::optional<at::ScalarType> grad_reduce_dtype) {
  std::vector<std::unique_ptr<Bucket>> buckets;
  std::vector<bool> placed(params.size(), false);
  for (size_t bi = 0; bi < assignment.size(); ++bi) {
    const auto& members = assignment[bi];
    TORCH_CHECK_VALUE(!members.empty(), "bucket ", bi, " is empty");
    auto bucket = std::make_unique<Bucket>();
    bucket->index = bi;
    const at::Tensor& first = params.at(members.front());
    int64_t total = 0;
    for (size_t index : members) {
      TORCH_CHECK_VALUE(index < params.size() && !placed[index], "bucket ", bi,
                        ": parameter index ", index, " is out of range or in two buckets");
      placed[index] = true;
      const at::Tensor& p = params[index];
      TORCH_CHECK_VALUE(key_of(p) == key_of(first), "bucket ", bi, " mixes devices or dtypes (",
                        names[index], " is ", p.dtype(), " on ", p.device(), ", ",
                        names[members.front()], " is ", first.dtype(), " on ", first.device(), ")");
      bucket->params.push_back(index);
      bucket->offsets.push_back(static_cast<size_t>(total));
      bucket->lengths.push_back(static_cast<size_t>(p.numel()));
      bucket->sizes.push_back(p.sizes());
      total += p.numel();
    }
    // Only low-precision floating buckets are widened (bf16/fp16 grads reduced in fp32).
    const bool widen = grad_reduce_dtype && at::isReducedFloatingType(first.scalar_type());
    // See Note [Bucket memory]: only a widened bucket (param.main_grad) is read before written.
    const auto options = first.options().dtype(widen ? *grad_reduce_dtype : first.scalar_type());
    bucket->buffer = widen ? at::zeros({total}, options) : at::empty({total}, options);
    for (size_t slot = 0; slot < members.size(); ++slot) {
      bucket->views.push_back(view_for(bucket->buffer, params[members[slot]],
                                       static_cast<int64_t>(bucket->offsets[slot])));
    }
    buckets.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(placed[i], "parameter ", names[i], " is in no bucket");
  }
  return buckets;
}

void Bucket::reset_step() {
  pending = params.size();
  unused = 0;
  skipped = false;
  deferred.clear();
  path = BucketPath::kBuffer;
  grads.clear();
  future.reset();
  ready_ns = launch_ns = -1;
  done_ns.store(-1);
  ready_stamp = -1;
  done_stamp.store(-1);
}

void BucketLayout::build(const std::vector<at::Tensor>& params,
                         const std::vector<std::string>& names,
                         const std::vector<std::vector<size_t>>& assignment,
                         std::optional<at::ScalarType> grad_reduce_dtype, bool grads_as_views) {
  buckets_ = build_buckets(params, names, assignment, grad_reduce_dtype);
  locator_.assign(params.size(), {0, 0});
  for (auto& bucket : buckets_) {
    for (size_t slot = 0; slot < bucket->params.size(); ++slot) {
      const size_t index = bucket->params[slot];
      locator_[index] = {bucket->index, slot};
      at::Tensor& grad = params[index].mutable_grad();
      at::Tensor& view = bucket->views[slot];
      if (grads_as_views && grad.defined() && grad.scalar_type() == view.scalar_type()) {
        view.copy_(grad);
        grad = view;
      }
    }
  }
}

}  // namespace pycomm::reducer
