// The hierarchical all-reduce of HierBackend (see Note [Hierarchical all-reduce], hier.h).
#include "shm/hier.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

namespace {
// Elements per piece of a block (See Note [Hierarchical pipeline]): 2 MiB crosses a
// 1 Gbit/s link in 17 ms, and a host's reduce-scatter of its block takes about 1 ms.
constexpr int64_t kPieceBytes = 2 << 20;

// One hierarchical all-reduce of `flat` (See Note [Hierarchical pipeline]): blocks of L
// pieces, each reduce-scattered within the host, its piece all-reduced across hosts on
// Gloo's threads while the next block is reduce-scattered, then all-gathered within the
// host. Every rank takes the same steps in the same order (they depend on n and L only),
// so the host's shared-memory rounds and the Gloo collectives match across ranks.
class BlockPipeline {
 public:
  struct Where {  // what a failure names
    const char* op;
    uint64_t seq;
    int rank, host, hosts;
  };

  BlockPipeline(Where where, at::Tensor flat, c10d::Backend& local, c10d::Backend& cross,
                c10d::ReduceOp op)
      : where_(where),
        flat_(std::move(flat)),
        local_(local),
        cross_(cross),
        op_(op),
        n_(flat_.numel()),
        L_(local.getSize()),
        // The last block may be shorter, and is padded to a multiple of L in a buffer of
        // its own.
        block_max_(std::max<int64_t>(1, kPieceBytes / flat_.element_size()) * L_),
        blocks_((n_ + block_max_ - 1) / block_max_),
        state_(blocks_) {}

  void run() {
    for (int64_t b = 0; b < blocks_; ++b) {
      reduce_within(b);
      if (b > 0) gather_within(b - 1);
    }
    gather_within(blocks_ - 1);
  }

 private:
  struct Block {
    at::Tensor whole;  // L x piece elements: a view of the tensor, or a padded copy
    at::Tensor mine;   // this rank's piece, reduced within the host, then across hosts
    at::Tensor user;   // the tensor's elements of this block (copied back when padded)
    c10::intrusive_ptr<c10d::Work> across;
  };

  void wait(const char* what, int64_t block, const c10::intrusive_ptr<c10d::Work>& w) const {
    try {
      w->wait();
    } catch (const std::exception& e) {
      std::string why = e.what();
      if (auto* c = dynamic_cast<const c10::Error*>(&e)) why = c->what_without_backtrace();
      TORCH_CHECK_WITH(DistBackendError, false, "pycomm ", where_.op, " #", where_.seq,
                       " (hierarchical, ", n_, " elements, block ", block, " of ", blocks_,
                       ") on rank ", where_.rank, " (host ", where_.host, " of ", where_.hosts,
                       ", local rank ", local_.getRank(), " of ", L_, "): ", what,
                       " failed: ", why);
    }
  }

  void reduce_within(int64_t b) {
    Block& k = state_[b];
    const int64_t begin = b * block_max_, len = std::min(block_max_, n_ - begin);
    const int64_t piece = (len + L_ - 1) / L_;
    k.user = flat_.narrow(0, begin, len);
    k.whole = k.user;
    if (piece * L_ != len) {
      k.whole = at::zeros({piece * L_}, flat_.options());
      k.whole.narrow(0, 0, len).copy_(k.user);
    }
    k.mine = at::empty({piece}, flat_.options());
    c10d::ReduceScatterOptions rs;
    rs.reduceOp = op_;
    wait("the reduce-scatter within the host", b, local_._reduce_scatter_base(k.mine, k.whole, rs));
    std::vector<at::Tensor> across{k.mine};
    c10d::AllreduceOptions ar;
    ar.reduceOp = op_;
    k.across = cross_.allreduce(across, ar);  // runs on Gloo's threads meanwhile
  }

  void gather_within(int64_t b) {
    Block& k = state_[b];
    wait("the all-reduce across hosts", b, k.across);
    c10d::AllgatherOptions ag;
    wait("the all-gather within the host", b, local_._allgather_base(k.whole, k.mine, ag));
    if (!k.whole.is_same(k.user)) k.user.copy_(k.whole.narrow(0, 0, k.user.numel()));
    k = Block{};  // the block's buffers go as soon as it is done
  }

  const Where where_;
  const at::Tensor flat_;
  c10d::Backend& local_;
  c10d::Backend& cross_;
  const c10d::ReduceOp op_;
  const int64_t n_, L_, block_max_, blocks_;
  std::vector<Block> state_;
};
}  // namespace

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
                    " ranks do not make a group of ", size, " (cross group ", cross_->getSize(),
                    ", flat group ", flat_->getSize(), ")");
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
      TORCH_CHECK_WITH(DistBackendError, failure_.empty(), "pycomm ", op, " #", seq, " on rank ",
                       rank_, ": the group is unusable after an earlier failure: ", failure_);
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
  if (d.work.numel() == 0) return;
  at::Tensor flat = d.work.view({-1});
  // Gloo has no AVG: sum in both stages, divide once at the end.
  const bool average = reduce == c10d::ReduceOp::AVG;
  BlockPipeline({op, seq, rank_, host_, hosts_}, flat, *local_, *cross_,
                c10d::ReduceOp(average ? c10d::ReduceOp::SUM : reduce))
      .run();
  if (average) flat.div_(size_);
  d.write_back();
}

}  // namespace pycomm::shm
