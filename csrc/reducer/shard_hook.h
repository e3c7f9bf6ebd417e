// How a sharded optimizer's buckets are reduced when it releases the gradients
// (pycomm.ZeroRedundancyOptimizer(release_gradients=True), attached to the reducer with
// Sharding::kReleased): each rank keeps its range of every bucket and the tail, in C++,
// from the collective's launch to the optimizer's step (See Note [Shards kept in C++]).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "comm/c10d.h"
#include "reducer/comm_hook.h"

namespace pycomm::reducer {

// Note [Shards kept in C++]
// A released bucket is reduced and its result kept without a trip through Python: the
// reducer's launch thread starts the collectives, the backend's completion thread keeps
// the rank's range and frees the bucket's storage, and the optimizer reads what was kept
// after finalize (ShardKeep's grads and fresh). Per bucket index it keeps the averaged
// gradients of this rank's range and of the tail, back to back (pycomm/zero/layout.py's
// Ranges.kept_mine and kept_tail; the cut is comm::shard_split's), reused from step to
// step while the bucket keeps its size, added to when several synchronized backwards run
// before the optimizer's zero_grad (as param.grad accumulates). Before the DDP's one
// bucket re-cut (Note [The first step's buckets] in pycomm/zero/binding.py) whole buckets
// are all-reduced and each parameter's whole gradient is kept instead (`first`).
//
// The reducer pre-divides each gradient as it copies it into the bucket, so the
// collectives only sum (DDP's numerics). On the buffer path:
// - with a real reduce-scatter (NCCL's, pycomm's: `reduce_scatter`), the ranges are
//   reduce-scattered (straight into what the rank keeps when nothing is added to it and
//   the bucket is released) and the tail, fewer elements than ranks, all-reduced in
//   float32; across hosts on a low-precision wire the reduce-scatter carries it, with the
//   bucket's error-feedback residuals (Bucket::wire_residual, their one owner);
// - otherwise (Gloo, whose reduce-scatter is an all-reduce per rank) the bucket is
//   all-reduced and the rank copies its range.
// In place (once the shards are final, over pycomm's shared memory) the gradients are
// reduce-scattered where they are, into what the rank keeps (Note [Pieces
// reduce-scatter] in shm/collectives.cpp), and the reducer drops them when done (Note
// [Released gradients] in launch.cpp).
//
// A failed collective keeps and frees nothing: the bucket's future fails with its error
// and finalize names the bucket.
class ShardKeep : public std::enable_shared_from_this<ShardKeep> {
 public:
  // Over `pg`; `reduce_scatter`: whether its backend's reduce-scatter is a real one;
  // `wire`: DDPConfig.wire_format, in effect where the group's backend spans hosts.
  ShardKeep(comm::ProcessGroupPtr pg, bool reduce_scatter, comm::Wire wire);

  // Start reducing bucket `index`'s `buffer` (pre-scaled), whose slots are parameters
  // `members` (reducer indices) of `lengths` elements; `final`: the shards are final;
  // `release`: free the buffer's storage once kept; `residual`: the wire's error feedback
  // of this bucket (made here when needed). Completes with `buffer`.
  FuturePtr reduce(int64_t index, const at::Tensor& buffer, const std::vector<size_t>& members,
                   const std::vector<size_t>& lengths, bool final, bool release,
                   std::shared_ptr<comm::WireResidual>& residual);
  // Start reduce-scattering `grads` (a bucket's, in slot order, of `numel` elements in
  // all) times `scale` where they are, on `ops`, into what the rank keeps of bucket `index`.
  FuturePtr reduce_in_place(int64_t index, const at::Tensor& buffer, std::vector<at::Tensor> grads,
                            double scale, comm::BucketAllreduce& ops, const comm::OpLabel& label);

  // What the optimizer reads (after finalize): per bucket index, the kept range and tail.
  std::map<int64_t, at::Tensor> grads() const;
  // The buckets reduced since clear().
  std::set<int64_t> fresh() const;
  // The optimizer's zero_grad: nothing reduced since (what is kept is reused).
  void clear();
  // Forget bucket `index`'s kept tensor (the bucket changed).
  void drop(int64_t index);
  // The whole gradients kept per parameter before the re-cut, handed over and forgotten.
  std::map<int64_t, at::Tensor> take_first();
  bool has_first() const;

  const comm::ProcessGroupPtr& process_group() const { return pg_; }
  bool reduce_scatter() const { return reduce_scatter_; }
  // The wire the buckets cross hosts in, or nullptr for float32.
  const comm::Wire* wire() const { return wire_ops_ != nullptr ? &wire_ : nullptr; }

 private:
  // What the rank keeps of bucket `index` (reused while its size and dtype hold), and
  // whether this backward's sums add to it.
  std::pair<at::Tensor, bool> kept(int64_t index, const at::Tensor& buffer);
  // Before the re-cut: the whole bucket all-reduced, each parameter's gradient kept.
  FuturePtr reduce_whole(const at::Tensor& buffer, const std::vector<size_t>& members,
                         const std::vector<size_t>& lengths, bool release,
                         std::shared_ptr<comm::WireResidual>& residual);
  bool on_wire(const at::Tensor& buffer) const {
    return wire_ops_ != nullptr && buffer.device().is_cpu();
  }

  comm::ProcessGroupPtr pg_;
  int rank_;
  int world_;
  bool reduce_scatter_;
  comm::Wire wire_;
  c10::intrusive_ptr<c10d::Backend> backend_;  // keeps wire_ops_ alive
  comm::WireCollectives* wire_ops_ = nullptr;  // with a low-precision wire_ only

  mutable std::mutex mutex_;  // the maps below: launch and completion threads, and Python
  std::map<int64_t, at::Tensor> grads_;
  std::set<int64_t> fresh_;
  std::map<int64_t, at::Tensor> first_;
};

// The released mode's hook: a ShardKeep's reductions, attached with the sharder's mode
// (Reducer::attach_sharding). `final`: the shards are final (the buckets re-cut); then a
// bucket whose gradients qualify is reduced where they are, over a group whose CPU backend
// offers the pieces reduce-scatter.
class ShardHook final : public CommHook {
 public:
  ShardHook(std::shared_ptr<ShardKeep> keep, bool final);
  Reduction reduction() const override { return Reduction::kShardKeep; }
  bool reducer_divides() const override { return true; }
  bool reduces_in_place() const override { return final_ && bucket_ops_ != nullptr; }
  FuturePtr run(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                const comm::OpLabel& label) override;
  FuturePtr run_in_place(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                         std::vector<at::Tensor> grads, double scale,
                         const comm::OpLabel& label) override;

 private:
  std::shared_ptr<ShardKeep> keep_;
  bool final_;
  c10::intrusive_ptr<c10d::Backend> backend_;    // keeps bucket_ops_ alive
  comm::BucketAllreduce* bucket_ops_ = nullptr;  // what backend_ offers, if it does
};

// The ShardKeep class, bound as pycomm._C.ShardKeep.
void bind_shard_keep(pybind11::module_& m);

}  // namespace pycomm::reducer
