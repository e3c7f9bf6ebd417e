// The hierarchical all-reduce of HierBackend (see Note [Hierarchical all-reduce], hier.h).
#include "shm/hier.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

HierBackend::HierBackend(int rank, int size, int host, int hosts,
                         c10::intrusive_ptr<ShmBackend> local,
                         c10::intrusive_ptr<c10d::Backend> cross,
                         c10::intrusive_ptr<c10d::Backend> flat)
    : c10d::Backend(rank, size),
      host_(host),
      hosts_(hosts),
      local_(std::move(local)),
      cross_(std::move(cross)),
      flat_(std::move(flat)),
      lane_(std::make_shared<Executor>()) {
  TORCH_CHECK_VALUE(local_ && cross_ && flat_, "pycomm hierarchical group: a sub-group is null");
  TORCH_CHECK_VALUE(local_->getSize() * hosts_ == size && cross_->getSize() == hosts_ &&
                        flat_->getSize() == size,
                    "pycomm hierarchical group: ", hosts_, " hosts of ", local_->getSize(),
                    " ranks do not make a group of ", size, " (cross group ",
                    cross_->getSize(), ", flat group ", flat_->getSize(), ")");
}

HierBackend::~HierBackend() { lane_->shutdown(); }

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single("all_reduce", tensors);
  check_reduction("all_reduce", t.scalar_type(), opts.reduceOp);
  return enqueue("all_reduce", c10d::OpType::ALLREDUCE, {t}, opts.reduceOp.op_);
}

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) {
    check_dense("all_reduce_coalesced", t);
    check_reduction("all_reduce_coalesced", t.scalar_type(), opts.reduceOp);
  }
  return enqueue("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                 opts.reduceOp.op_);
}

c10::intrusive_ptr<c10d::Work> HierBackend::enqueue(const char* op, c10d::OpType type,
                                                    std::vector<at::Tensor> tensors,
                                                    c10d::ReduceOp::RedOpType reduce) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, tensors, lane_);
  uint64_t seq = next_seq_++;
  lane_->submit(work, [this, op, seq, tensors, reduce] {
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      TORCH_CHECK_WITH(DistBackendError, failure_.empty(), "pycomm ", op, " #", seq,
                       " on rank ", rank_, ": the group is unusable after an earlier failure: ",
                       failure_);
    }
    try {
      for (const auto& t : tensors) run(op, seq, t, reduce);
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (auto* c = dynamic_cast<const c10::Error*>(&e)) what = c->what_without_backtrace();
      std::lock_guard<std::mutex> lock(failure_mutex_);
      if (failure_.empty()) failure_ = what;
      throw;
    }
  });
  return work;
}

void HierBackend::run(const char* op, uint64_t seq, const at::Tensor& t,
                      c10d::ReduceOp::RedOpType reduce) {
  Dense d(t);
  const int64_t n = d.work.numel();
  if (n == 0) return;
  const int64_t ranks_per_host = local_->getSize();
  const int64_t shard = (n + ranks_per_host - 1) / ranks_per_host;
  at::Tensor flat = d.work.view({-1});
  // The shards need one buffer of L x shard elements: the tensor itself when L divides it.
  at::Tensor buffer = flat;
  if (shard * ranks_per_host != n) {
    buffer = at::empty({shard * ranks_per_host}, flat.options());
    buffer.narrow(0, 0, n).copy_(flat);
    buffer.narrow(0, n, shard * ranks_per_host - n).zero_();
  }
  at::Tensor mine = at::empty({shard}, flat.options());
  // Gloo has no AVG: sum in both stages, divide once at the end.
  const bool average = reduce == c10d::ReduceOp::AVG;
  const c10d::ReduceOp stage_op(average ? c10d::ReduceOp::SUM : reduce);

  auto phase = [&](const char* what, const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      std::string why = e.what();
      if (auto* c = dynamic_cast<const c10::Error*>(&e)) why = c->what_without_backtrace();
      TORCH_CHECK_WITH(DistBackendError, false, "pycomm ", op, " #", seq, " (hierarchical, ",
                       n, " elements) on rank ", rank_, " (host ", host_, " of ", hosts_,
                       ", local rank ", local_->getRank(), " of ", ranks_per_host, "): ",
                       what, " failed: ", why);
    }
  };

  c10d::ReduceScatterOptions rs;
  rs.reduceOp = stage_op;
  phase("the reduce-scatter within the host",
        local_->_reduce_scatter_base(mine, buffer, rs));
  std::vector<at::Tensor> across{mine};
  c10d::AllreduceOptions ar;
  ar.reduceOp = stage_op;
  phase("the all-reduce across hosts", cross_->allreduce(across, ar));
  c10d::AllgatherOptions ag;
  phase("the all-gather within the host", local_->_allgather_base(buffer, mine, ag));

  if (!buffer.is_same(flat)) flat.copy_(buffer.narrow(0, 0, n));
  if (average) flat.div_(size_);
  d.write_back();
}

}  // namespace pycomm::shm
