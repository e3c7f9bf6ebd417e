// Argument checks and queueing of gather, scatter, the list all_to_all and the coalesced
// into-tensor collectives of ShmBackend (the others are in backend.cpp and
// backend_buckets.cpp). The algorithms are in gather_scatter.cpp
// and collectives.cpp.
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "shm/backend.h"
#include "shm/coalesced.h"
#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

namespace {

// `t` (the `what` tensor number `index`) must be dense with `like`'s dtype and `numel`.
void check_entry(const char* op, int root, const char* what, size_t index, const at::Tensor& t,
                 const at::Tensor& like, int64_t numel) {
  check_dense(op, t);
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type() && t.numel() == numel, "pycomm ", op,
                    " (root ", root, "): ", what, " tensor ", index, " is ", t.scalar_type(),
                    " with ", t.numel(), " elements, expected ", like.scalar_type(), " with ",
                    numel, " elements");
}

// The root's list of `world` tensors, each checked against `like` (dtype, numel); every
// other rank passes none (or one empty list). Checks `root` too.
std::vector<at::Tensor> root_list(const char* op, const char* what, int rank, int root, int world,
                                  const std::vector<std::vector<at::Tensor>>& lists,
                                  const at::Tensor& like) {
  check_rank(op, "root", root, world);
  if (rank != root) {
    TORCH_CHECK_VALUE(lists.empty() || (lists.size() == 1 && lists[0].empty()), "pycomm ", op,
                      " (root ", root, "): rank ", rank, " is not the root and must pass no ", what,
                      " tensors");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && static_cast<int>(lists[0].size()) == world, "pycomm ", op,
                    " (root ", root, "): the root expects one list of ", world, " ", what,
                    " tensors (one per rank), got ", lists.size(), " lists of ",
                    lists.empty() ? 0 : lists[0].size());
  for (size_t i = 0; i < lists[0].size(); ++i) {
    check_entry(op, root, what, i, lists[0][i], like, like.numel());
  }
  return lists[0];
}

// Byte offsets and lengths of `tensors` laid end to end in one buffer, and its element count.
Split packed_split(const std::vector<at::Tensor>& tensors, int64_t* numel) {
  Split s;
  size_t off = 0;
  *numel = 0;
  for (const auto& t : tensors) {
    s.offset.push_back(off);
    s.bytes.push_back(t.nbytes());
    off += t.nbytes();
    *numel += t.numel();
  }
  return s;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ShmBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::GatherOptions& opts) {
  const at::Tensor& in = single("gather", inputs);
  int root = static_cast<int>(opts.rootRank);
  auto outs = root_list("gather", "output", rank_, root, size_, outputs, in);
  return enqueue(
      "gather", c10d::OpType::GATHER, outs,
      [this, in, outs, root](const OpContext& c) {
        Dense d(in);
        DenseList dense(outs);
        channel_->gather(d.data(), d.bytes(), dense.ptrs, root, c);
        dense.write_back();
      },
      opts);
}

#if PYCOMM_C10D_GATHER_SINGLE
c10::intrusive_ptr<c10d::Work> ShmBackend::gather_single(at::Tensor& output, at::Tensor& input,
                                                         const c10d::GatherOptions& opts) {
  constexpr const char* op = "gather_single";
  check_dense(op, input);
  const int root = static_cast<int>(opts.rootRank);
  check_rank(op, "root", root, size_);
  std::vector<at::Tensor> outs;  // the root's output; nothing elsewhere
  if (rank_ == root) {
    check_like(op, output, input, input.numel() * size_);
    TORCH_CHECK_VALUE(output.is_contiguous(), "pycomm ", op, " (root ", root,
                      "): the output tensor must be contiguous");
    outs.push_back(output);
  }
  return enqueue(
      op, c10d::OpType::GATHER, outs,
      [this, input, outs, root](const OpContext& c) {
        Dense in(input);
        std::vector<char*> blocks;
        for (const auto& out : outs) {  // the root: rank r's bytes at r x the input's
          for (int r = 0; r < size_; ++r)
            blocks.push_back(static_cast<char*>(out.data_ptr()) + r * in.bytes());
        }
        channel_->gather(in.data(), in.bytes(), blocks, root, c);
      },
      opts);
}
#endif

c10::intrusive_ptr<c10d::Work> ShmBackend::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single("scatter", outputs);
  int root = static_cast<int>(opts.rootRank);
  auto ins = root_list("scatter", "input", rank_, root, size_, inputs, out);
  auto body = [this, out, ins, root](const OpContext& c) {
    Dense d(out);
    DenseList dense(ins);
    channel_->scatter(dense.const_ptrs(), d.data(), d.bytes(), root, c);
    d.write_back();
  };
  return enqueue("scatter", c10d::OpType::SCATTER, {out}, std::move(body), opts);
}

// Sizes may differ per peer; that what rank p sends to rank q is as long as what q expects
// from p cannot be checked locally (as for all_to_all_single's split sizes).
c10::intrusive_ptr<c10d::Work> ShmBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ &&
                        static_cast<int>(inputs.size()) == size_,
                    "pycomm all_to_all: expects ", size_, " output and ", size_,
                    " input tensors (one per rank), got ", outputs.size(), " and ", inputs.size());
  const auto dtype = inputs[0].scalar_type();
  for (const auto* list : {&inputs, &outputs}) {
    for (size_t i = 0; i < list->size(); ++i) {
      const at::Tensor& t = (*list)[i];
      check_dense("all_to_all", t);
      TORCH_CHECK_VALUE(t.scalar_type() == dtype,
                        "pycomm all_to_all: ", list == &inputs ? "input" : "output", " tensor ", i,
                        " is ", t.scalar_type(), ", input tensor 0 is ", dtype,
                        ": all tensors must share one dtype");
    }
  }
  int64_t in_numel = 0, out_numel = 0;
  Split send = packed_split(inputs, &in_numel);
  Split recv = packed_split(outputs, &out_numel);
  auto ins = inputs, outs = outputs;
  // Channel::alltoall works on one buffer per side (all_to_all_single's layout): the inputs
  // are packed into one and the outputs unpacked from another. That costs one copy each
  // way, which a non-contiguous tensor would need anyway.
  return enqueue(
      "all_to_all", c10d::OpType::ALLTOALL, outs,
      [this, ins, outs, send, recv, in_numel, out_numel, dtype](const OpContext& c) {
        at::Tensor in = at::empty({in_numel}, at::TensorOptions().dtype(dtype));
        at::Tensor out = at::empty({out_numel}, at::TensorOptions().dtype(dtype));
        for (int64_t p = 0, off = 0; p < size_; off += ins[p].numel(), ++p) {
          in.narrow(0, off, ins[p].numel()).view(ins[p].sizes()).copy_(ins[p]);
        }
        channel_->alltoall(static_cast<const char*>(in.data_ptr()), send,
                           static_cast<char*>(out.data_ptr()), recv, c);
        for (int64_t p = 0, off = 0; p < size_; off += outs[p].numel(), ++p) {
          outs[p].copy_(out.narrow(0, off, outs[p].numel()).view(outs[p].sizes()));
        }
      },
      opts);
}

at::Tensor ShmBackend::gather_packed(const std::vector<at::Tensor>& ins, int64_t block,
                                     const OpContext& c) {
  at::Tensor mine = pack_block(ins);
  at::Tensor all = at::empty({block * size_}, mine.options());
  std::vector<char*> ptrs;
  for (int r = 0; r < size_; ++r) ptrs.push_back(static_cast<char*>(all.data_ptr()) + r * block);
  channel_->allgather(static_cast<const char*>(mine.data_ptr()), block, ptrs, c);
  return all;
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_into_tensor_coalesced";
  check_coalesced(op, outputs, inputs, size_, /*gather=*/true);
  auto ins = inputs, outs = outputs;
  const int64_t block = packed_bytes(ins);  // one rank's inputs, packed
  return enqueue(
      op, c10d::OpType::COALESCED, outs,
      [this, ins, outs, block](const OpContext& c) {
        unpack_gathered(gather_packed(ins, block, c), block, ins, outs, size_);
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  constexpr const char* op = "all_gather_coalesced";
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "pycomm ", op, ": ", outputs.size(),
                    " output lists for a group of ", size_);
  for (size_t r = 0; r < outputs.size(); ++r) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "pycomm ", op, ": output list ", r,
                      " holds ", outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_dense(op, inputs[i]);
      check_like(op, outputs[r][i], inputs[i], inputs[i].numel());
    }
  }
  auto ins = inputs;
  auto outs = outputs;
  std::vector<at::Tensor> flat_outs;
  for (const auto& list : outs) flat_outs.insert(flat_outs.end(), list.begin(), list.end());
  const int64_t block = packed_bytes(ins);  // one rank's inputs, packed
  return enqueue(
      op, c10d::OpType::ALLGATHER_COALESCED, flat_outs,
      [this, ins, outs, block](const OpContext& c) {
        at::Tensor all = gather_packed(ins, block, c);
        for (int r = 0; r < size_; ++r) {
          for (int64_t i = 0, off = 0; i < static_cast<int64_t>(ins.size()); ++i) {
            const int64_t n = static_cast<int64_t>(ins[i].nbytes());
            const at::Tensor& out = outs[r][i];
            out.copy_(all.narrow(0, r * block + off, n).view(out.scalar_type()).view(out.sizes()));
            off += n;
          }
        }
      },
      opts);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  constexpr const char* op = "reduce_scatter_tensor_coalesced";
  const at::ScalarType dtype = check_reduce_scatter_list(op, outputs, inputs, size_, opts.reduceOp);
  auto ins = inputs, outs = outputs;
  auto reduce = opts.reduceOp.op_;
  int64_t block = 0;  // elements of one rank's outputs, packed
  for (const auto& t : outs) block += t.numel();
  return enqueue(
      op, c10d::OpType::COALESCED, outs,
      [this, ins, outs, block, dtype, reduce](const OpContext& c) {
        at::Tensor packed = pack_by_rank(ins, outs, size_, dtype);
        at::Tensor mine = at::empty({block}, packed.options());
        // Gloo reduces each entry's input as a buffer of its own (Note [Gloo's summation
        // order]): this rank's block is its part of each, back to back.
        SumOrder order;
        for (const auto& t : outs)
          order.then(t.numel(), t.numel() * size_, t.numel() * rank_, GlooRing::kAllreduce);
        channel_->reduce_scatter(static_cast<char*>(packed.data_ptr()),
                                 static_cast<char*>(mine.data_ptr()), block, dtype, reduce, order,
                                 c);
        unpack_block(mine, outs);
      },
      opts);
}

}  // namespace pycomm::shm
