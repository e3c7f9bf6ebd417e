// HierBackend: its operations, and the pipelines of reduce_scatter_tensor and
// all_gather_into_tensor (see hier.h). The all-reduce's pipeline: hier_allreduce.cpp.
#include "shm/hier.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shm/coalesced.h"
#include "shm/hier_phase.h"
#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"
#include "shm/wire_codec.h"

namespace pycomm::shm {

HierBackend::HierBackend(int rank, int size, int host, std::vector<std::vector<int>> ranks,
                         c10::intrusive_ptr<ShmBackend> local,
                         c10::intrusive_ptr<c10d::Backend> cross,
                         c10::intrusive_ptr<c10d::Backend> flat, comm::Wire wire)
    : c10d::Backend(rank, size),
      host_(host),
      hosts_(static_cast<int>(ranks.size())),
      ranks_(std::move(ranks)),
      wire_(wire),
      local_(std::move(local)),
      cross_(std::move(cross)),
      flat_(std::move(flat)),
      lane_(std::make_shared<Executor>()) {
  TORCH_CHECK_VALUE(local_ && cross_ && flat_, "pycomm hierarchical group: a sub-group is null");
  check_group_wire(wire_);
  TORCH_CHECK_VALUE(local_->getSize() * hosts_ == size && cross_->getSize() == hosts_ &&
                        flat_->getSize() == size,
                    "pycomm hierarchical group: ", hosts_, " hosts of ", local_->getSize(),
                    " ranks do not make a group of ", size, " (cross group ", cross_->getSize(),
                    ", flat group ", flat_->getSize(), ")");
  std::vector<bool> seen(size, false);
  for (const auto& host_ranks : ranks_) {
    TORCH_CHECK_VALUE(static_cast<int64_t>(host_ranks.size()) == local_->getSize(),
                      "pycomm hierarchical group: every host needs ", local_->getSize(),
                      " ranks, one has ", host_ranks.size());
    for (int r : host_ranks) {
      TORCH_CHECK_VALUE(r >= 0 && r < size && !seen[r], "pycomm hierarchical group: rank ", r,
                        " is out of range or on two hosts");
      seen[r] = true;
    }
  }
  TORCH_CHECK_VALUE(host_ >= 0 && host_ < hosts_ && ranks_[host_][local_->getRank()] == rank,
                    "pycomm hierarchical group: rank ", rank, " is not local rank ",
                    local_->getRank(), " of host ", host_);
}

HierBackend::~HierBackend() { lane_->shutdown(); }

void HierBackend::check_group_wire(const comm::Wire& wire) {
  TORCH_CHECK_VALUE(!wire.error_feedback, "pycomm.shm.Options(wire=", wire.name(),
                    "): a group's reduce-scatters keep no error-feedback residual (they have ",
                    "no tensor to keep it for); give wire='", wire.dtype_name(),
                    "', or use DDPConfig(wire_error_feedback=True) for a DDP's buckets");
}

comm::Wire HierBackend::reduce_scatter_wire_for(at::ScalarType dtype,
                                                c10d::ReduceOp::RedOpType reduce) const {
  // Wire::carries owns which dtypes a wire encodes; an fp32 wire carries any, as it is
  const bool carried = wire_.carries(dtype) &&
                       (reduce == c10d::ReduceOp::SUM || reduce == c10d::ReduceOp::AVG);
  return carried ? wire_ : comm::Wire{};
}

#if PYCOMM_TORCH_AT_LEAST(2, 6)
void HierBackend::shutdown() {
  lane_->shutdown();  // first: its operations use the three groups
  local_->shutdown();
  cross_->shutdown();
  flat_->shutdown();
}
#endif

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single("all_reduce", tensors);
  check_reduction("all_reduce", t.scalar_type(), opts.reduceOp);
  const auto reduce = opts.reduceOp.op_;
  return enqueue("all_reduce", c10d::OpType::ALLREDUCE, {t},
                 [this, t, reduce, piece = piece_bytes_](uint64_t seq) {
                   run("all_reduce", seq, piece, t, reduce);
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  for (const auto& t : tensors) {
    check_dense("all_reduce_coalesced", t);
    check_reduction("all_reduce_coalesced", t.scalar_type(), opts.reduceOp);
  }
  const auto reduce = opts.reduceOp.op_;
  return enqueue("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors,
                 [this, tensors, reduce, piece = piece_bytes_](uint64_t seq) {
                   // See Note [Coalesced all-reduce] in tensor_args.h
                   reduce_coalesced(tensors, [&](const at::Tensor& flat) {
                     run("all_reduce_coalesced", seq, piece, flat, reduce);
                   });
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_dense("reduce_scatter_tensor", output);
  check_like("reduce_scatter_tensor", input, output, output.numel() * size_);
  check_reduction("reduce_scatter_tensor", output.scalar_type(), opts.reduceOp);
  const auto reduce = opts.reduceOp.op_;
  const comm::Wire wire = reduce_scatter_wire_for(output.scalar_type(), reduce);
  return enqueue("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [this, output, input, reduce, wire, piece = piece_bytes_](uint64_t seq) {
                   reduce_scatter_tensor(seq, piece, output, input, reduce, wire);
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* op = "reduce_scatter_tensor_coalesced";
  const at::ScalarType dtype = check_reduce_scatter_list(op, outputs, inputs, size_, opts.reduceOp);
  const auto reduce = opts.reduceOp.op_;
  const comm::Wire wire = reduce_scatter_wire_for(dtype, reduce);
  return enqueue(op, c10d::OpType::COALESCED, outputs,
                 [this, ins = inputs, outs = outputs, dtype, reduce, wire,
                  piece = piece_bytes_](uint64_t seq) {
                   // See Note [Coalesced into-tensor collectives] in coalesced.h
                   at::Tensor packed = pack_by_rank(ins, outs, size_, dtype);
                   at::Tensor mine = at::empty({packed.numel() / size_}, packed.options());
                   reduce_scatter_tensor(seq, piece, mine, packed, reduce, wire);
                   unpack_block(mine, outs);
                 });
}

comm::WorkPtr HierBackend::reduce_scatter_wire(at::Tensor output, at::Tensor input,
                                               const comm::Wire& wire,
                                               std::shared_ptr<comm::WireResidual> residual) {
  const char* op = local_phase_names(wire).first;
  check_dense(op, output);
  check_like(op, input, output, output.numel() * size_);
  check_wire(op, output, wire, residual != nullptr);
  return enqueue(op, c10d::OpType::_REDUCE_SCATTER_BASE, {output},
                 [this, output, input, wire, residual, piece = piece_bytes_](uint64_t seq) {
                   reduce_scatter_tensor(seq, piece, output, input, c10d::ReduceOp::SUM, wire,
                                         residual.get());
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions& opts) {
  check_dense("all_gather_into_tensor", input);
  check_like("all_gather_into_tensor", output, input, input.numel() * size_);
  return enqueue("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, {output},
                 [this, output, input, piece = piece_bytes_](uint64_t seq) {
                   all_gather_tensor(seq, piece, output, input);
                 });
}

c10::intrusive_ptr<c10d::Work> HierBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_into_tensor_coalesced";
  check_coalesced(op, outputs, inputs, size_, /*gather=*/true);
  return enqueue(op, c10d::OpType::COALESCED, outputs,
                 [this, ins = inputs, outs = outputs, piece = piece_bytes_](uint64_t seq) {
                   // See Note [Coalesced into-tensor collectives] in coalesced.h: this
                   // rank's inputs as one block of bytes, gathered as one tensor
                   at::Tensor mine = pack_block(ins);
                   at::Tensor all = at::empty({mine.numel() * size_}, mine.options());
                   all_gather_tensor(seq, piece, all, mine);
                   unpack_gathered(all, mine.numel(), ins, outs, size_);
                 });
}

#if PYCOMM_C10D_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> HierBackend::gather_single(at::Tensor& output, at::Tensor& input,
                                                          const c10d::GatherOptions& opts) {
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank_ == opts.rootRank) {
    check_like("gather_single", output, input, input.numel() * size_);
    TORCH_CHECK_VALUE(output.is_contiguous(), "pycomm gather_single (root ", opts.rootRank,
                      "): the output tensor must be contiguous");
    at::Tensor flat = output.reshape({-1});
    outputs.emplace_back();
    for (int r = 0; r < size_; ++r)
      outputs[0].push_back(flat.narrow(0, r * input.numel(), input.numel()).view(input.sizes()));
  }
  std::vector<at::Tensor> inputs{input};
  return flat_->gather(outputs, inputs, opts);
}
#endif

c10::intrusive_ptr<c10d::Work> HierBackend::enqueue(const char* op, c10d::OpType type,
                                                    std::vector<at::Tensor> outputs,
                                                    std::function<void(uint64_t seq)> body) {
  auto work = c10::make_intrusive<ShmWork>(rank_, type, outputs, lane_);
  uint64_t seq = next_seq_++;
  lane_->submit(work, [this, op, seq, body = std::move(body)] {
    {
      std::lock_guard<std::mutex> lock(failure_mutex_);
      TORCH_CHECK_WITH(DistBackendError, failure_.empty(), "pycomm ", op, " #", seq, " on rank ",
                       rank_, ": the group is unusable after an earlier failure: ", failure_);
    }
    try {
      body(seq);
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

void HierBackend::set_piece_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes > 0, "pycomm hierarchical group: piece_bytes must be positive, got ",
                    bytes);
  piece_bytes_ = bytes;
}

void HierBackend::permute(const at::Tensor& group_order, const at::Tensor& chunk_order, int64_t s,
                          int64_t begin, int64_t len, bool to_chunks) const {
  const int64_t L = local_->getSize();
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < hosts_; ++h) {
      at::Tensor chunk = chunk_order.narrow(0, (l * hosts_ + h) * len, len);
      at::Tensor range = group_order.narrow(0, ranks_[h][l] * s + begin, len);
      to_chunks ? chunk.copy_(range) : range.copy_(chunk);
    }
  }
}

namespace {

// The blocks of the tensor forms' pipelines (Note [Hierarchical reduce-scatter and
// all-gather]): block j is elements [begin(j), begin(j) + len(j)) of every rank's range of
// s elements, one piece each; `data` is what crosses hosts or came across, `across` the
// cross-host collective in flight.
struct RangeBlocks {
  struct Block {
    at::Tensor data;
    c10::intrusive_ptr<c10d::Work> across;
    at::Tensor sent;  // with a low-precision wire: the H encoded ranges, until they crossed
  };

  RangeBlocks(int64_t s, int64_t piece_bytes, const at::Tensor& t)
      : s(s),
        c(std::max<int64_t>(1, piece_bytes / t.element_size())),
        count((s + c - 1) / c),
        state(count) {}

  int64_t begin(int64_t j) const { return j * c; }
  int64_t len(int64_t j) const { return std::min(c, s - j * c); }
  std::string detail(int64_t j) const {
    return c10::str(", ", s, " elements per rank, block ", j, " of ", count);
  }

  const int64_t s, c, count;
  std::vector<Block> state;
};

}  // namespace

void HierBackend::reduce_scatter_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                                        const at::Tensor& input, c10d::ReduceOp::RedOpType reduce,
                                        comm::Wire wire, comm::WireResidual* residual) {
  const char* op = local_phase_names(wire).first;
  const int64_t s = output.numel(), H = hosts_, L = local_->getSize();
  if (s == 0) return;
  // The low-precision wire encodes from and sums into float32 (Note [Low-precision wire]).
  const at::Tensor in = wire.exact() ? input.contiguous().view({-1})
                                     : input.contiguous().view({-1}).to(at::kFloat);
  RangeBlocks blocks(s, piece_bytes, in);
  Dense out(output);
  const at::Tensor home = out.work.view({-1});
  // the wire's float32 sums: the output itself, or a buffer every block writes whole
  const at::Tensor sums = wire.exact() || home.scalar_type() == at::kFloat
                              ? home
                              : at::empty({s}, home.options().dtype(at::kFloat));
  char* result = static_cast<char*>(sums.data_ptr());
  float* sent_residual = nullptr;
  std::unique_lock<std::mutex> lock;
  if (!wire.exact() && wire.error_feedback) {
    // Block j's H ranges start at H x begin(j) of the rank's residual, range h at h x len(j)
    // after that: H x s in all. The layout's five entries tell it from an all-reduce's.
    lock = std::unique_lock<std::mutex>(residual->mutex);
    std::vector<int64_t> layout{s, blocks.c, L, H, /*reduce-scatter*/ 1};
    if (residual->layout != layout) {
      residual->sent = at::zeros({H * s}, in.options());
      residual->summed = at::Tensor();
      residual->layout = std::move(layout);
    }
    sent_residual = residual->sent.data_ptr<float>();
  }
  // AVG: both stages sum, and the last divides once by the group's size.
  const bool average = reduce == c10d::ReduceOp::AVG;
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = c10d::ReduceOp(average ? c10d::ReduceOp::SUM : reduce);
  // Block j: into the chunk order (a copy: the output may be the rank's own range of the
  // input), reduce-scattered within the host, then across hosts on Gloo's threads: range
  // h of `mine` goes to host h, this rank's range comes back from each (into `data`), in
  // the wire's form where it has one.
  auto within = [&](int64_t j) {
    const int64_t len = blocks.len(j);
    at::Tensor chunks = at::empty({L * H * len}, in.options());
    permute(in, chunks, s, blocks.begin(j), len, /*to_chunks=*/true);
    at::Tensor mine = chunks;  // one rank per host: nothing to combine (Note [One rank per
    if (L > 1) {  // host] in hier_allreduce.cpp)
      mine = at::empty({H * len}, in.options());
      wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
                 "the reduce-scatter within the host",
                 local_->reduce_scatter_tensor_as(op, mine, chunks, rs));
    }
    auto& k = blocks.state[j];
    if (!wire.exact()) {  // each host's range encoded on its own
      const int64_t slot = wire_bytes(wire.dtype, len);
      k.sent = at::empty({H * slot}, in.options().dtype(at::kByte));
      for (int64_t h = 0; h < H; ++h) {
        float* r = sent_residual ? sent_residual + H * blocks.begin(j) + h * len : nullptr;
        wire_encode(wire.dtype, mine.const_data_ptr<float>() + h * len, len,
                    k.sent.data_ptr<uint8_t>() + h * slot, r);
      }
      mine = k.sent;
    }
    k.data = at::empty_like(mine);
    std::vector<int64_t> equal;  // empty splits: equal ones
    c10d::AllToAllOptions a2a;
    k.across = cross_->alltoall_base(k.data, mine, equal, equal, a2a);
  };
  // Block j's H ranges summed in host order into the output (decoded into float32 sums).
  auto finish = [&](int64_t j) {
    auto& k = blocks.state[j];
    const int64_t len = blocks.len(j);
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the all-to-all across hosts", k.across);
    if (!wire.exact()) {
      const int64_t slot = wire_bytes(wire.dtype, len);
      float* range = reinterpret_cast<float*>(result) + blocks.begin(j);
      for (int64_t h = 0; h < H; ++h) {
        wire_decode(wire.dtype, k.data.const_data_ptr<uint8_t>() + h * slot, len, range,
                    /*add=*/h > 0);
      }
      k = {};
      return;
    }
    std::vector<const void*> srcs;
    for (int64_t h = 0; h < H; ++h) srcs.push_back(k.data.narrow(0, h * len, len).const_data_ptr());
    reduce_buffers(output.scalar_type(), reduce, result + blocks.begin(j) * output.element_size(),
                   srcs.data(), static_cast<int>(H), len, size_);
    k = {};
  };
  for (int64_t j = 0; j < blocks.count; ++j) {
    within(j);
    if (j > 0) finish(j - 1);
  }
  finish(blocks.count - 1);
  // The wire's sums are float32 sums (Note [A group's wire]): AVG divides them once.
  if (average && !wire.exact()) sums.div_(size_);
  if (!sums.is_same(home)) home.copy_(sums);
  out.write_back();
}

void HierBackend::all_gather_tensor(uint64_t seq, int64_t piece_bytes, const at::Tensor& output,
                                    const at::Tensor& input) {
  const char* op = "all_gather_into_tensor";
  const int64_t s = input.numel(), H = hosts_, L = local_->getSize();
  if (s == 0) return;
  RangeBlocks blocks(s, piece_bytes, input);
  const at::Tensor in = input.contiguous().view({-1});
  Dense out(output);
  const at::Tensor home = out.work.view({-1});
  // Block j across hosts first, on Gloo's threads, into chunk l of this host (`data`: block
  // j of ranks[0][l], ..., ranks[H-1][l]).
  auto cross = [&](int64_t j) {
    auto& k = blocks.state[j];
    k.data = at::empty({H * blocks.len(j)}, in.options());
    at::Tensor part = in.narrow(0, blocks.begin(j), blocks.len(j));
    c10d::AllgatherOptions ag;
    k.across = cross_->_allgather_base(k.data, part, ag);
  };
  // Then within the host, and the ranges home.
  auto within = [&](int64_t j) {
    auto& k = blocks.state[j];
    wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
               "the all-gather across hosts", k.across);
    at::Tensor chunks = k.data;  // one rank per host: nothing to gather within it
    if (L > 1) {
      chunks = at::empty({L * H * blocks.len(j)}, in.options());
      c10d::AllgatherOptions ag;
      wait_phase(op, seq, blocks.detail(j), rank_, host_, hosts_, *local_,
                 "the all-gather within the host", local_->_allgather_base(chunks, k.data, ag));
    }
    permute(home, chunks, s, blocks.begin(j), blocks.len(j), /*to_chunks=*/false);
    k = {};
  };
  cross(0);
  for (int64_t j = 0; j < blocks.count; ++j) {
    if (j + 1 < blocks.count) cross(j + 1);
    within(j);
  }
  out.write_back();
}

}  // namespace pycomm::shm
