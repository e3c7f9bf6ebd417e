// The bucket all-reduces of ShmBackend that pycomm's reducer calls through
// comm::BucketAllreduce (the other operations are in backend.cpp): a bucket through its
// buffer, and a bucket reduced where its gradients are, each with the reducer's label.
#include <c10/util/Exception.h>

#include "comm/shard_split.h"
#include "shm/backend.h"
#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

// A DDP bucket's all-reduce through its buffer, with the reducer's label (See Note
// [Collective identity] in collectives.cpp): the collective allreduce() runs.
c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce_sum(at::Tensor tensor,
                                                         const comm::OpLabel& label) {
  check_dense("all_reduce", tensor);
  check_reduction("all_reduce", tensor.scalar_type(), c10d::ReduceOp::SUM);
  auto body = [this, tensor](const OpContext& c) {
    allreduce_body(tensor, c10d::ReduceOp::SUM, c);
  };
  return enqueue("all_reduce", c10d::OpType::ALLREDUCE, {tensor}, std::move(body), collectives_,
                 false, label);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::allreduce_pieces(std::vector<at::Tensor> tensors,
                                                            double scale,
                                                            const comm::OpLabel& label) {
  const c10::ScalarType dtype = check_pieces("all_reduce of pieces", tensors);
  auto body = [this, tensors, dtype, scale](const OpContext& c) {
    Pieces pieces;
    for (const auto& t : tensors) pieces.add(static_cast<char*>(t.data_ptr()), t.nbytes());
    channel_->allreduce_pieces(pieces, dtype, scale, c);
  };
  return enqueue("all_reduce", c10d::OpType::ALLREDUCE, tensors, std::move(body), collectives_,
                 false, label);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter_pieces(std::vector<at::Tensor> tensors,
                                                                 double scale, at::Tensor out,
                                                                 const comm::OpLabel& label) {
  const char* op = "reduce_scatter of pieces";
  const c10::ScalarType dtype = check_pieces(op, tensors);
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  const comm::ShardSplit split = comm::shard_split(n, size_);  // Note [Equal ranges and a tail]
  const int64_t s = split.range, tail = split.tail;
  check_dense(op, out);
  TORCH_CHECK_VALUE(out.scalar_type() == dtype && out.numel() == s + tail && out.is_contiguous(),
                    "pycomm ", op, ": the output must be a contiguous ", dtype, " tensor of ",
                    s + tail, " elements (", n, " elements over ", size_, " ranks: a range of ", s,
                    " and a tail of ", tail, "), got a ", out.scalar_type(), " tensor of ",
                    out.numel(), out.is_contiguous() ? "" : ", not contiguous");
  std::vector<at::Tensor> all = tensors;
  all.push_back(out);
  TORCH_CHECK_VALUE(!any_overlap(all), "pycomm ", op, ": the output shares memory with an input");
  auto body = [this, tensors, out, dtype, scale, s, tail](const OpContext& c) {
    Pieces pieces;
    for (const auto& t : tensors) pieces.add(static_cast<char*>(t.data_ptr()), t.nbytes());
    char* to = static_cast<char*>(out.data_ptr());
    const size_t elem = c10::elementSize(dtype);
    if (s > 0) channel_->reduce_scatter_pieces(pieces, dtype, scale, to, s, c);
    if (tail > 0) {  // the tail scaled into place, then all-reduced there
      char* rest = to + s * elem;
      pieces.each(s * size_ * elem, tail * elem, [&](char* piece, size_t off, size_t bytes) {
        scale_copy(dtype, rest + off, piece, static_cast<int64_t>(bytes / elem), scale);
      });
      channel_->allreduce(rest, tail, dtype, c10d::ReduceOp::SUM, c);
    }
  };
  return enqueue("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, {out},
                 std::move(body), collectives_, false, label);
}

c10::intrusive_ptr<c10d::Work> ShmBackend::reduce_scatter_pieces_as(
    const char* op, Pieces pieces, c10::ScalarType dtype, double scale, at::Tensor& output) {
  check_dense(op, output);
  TORCH_CHECK_VALUE(output.scalar_type() == dtype && output.is_contiguous(), "pycomm ", op,
                    ": the output must be a contiguous ", dtype, " tensor, got ",
                    output.scalar_type(), output.is_contiguous() ? "" : ", not contiguous");
  const int64_t n = output.numel();
  TORCH_CHECK_VALUE(static_cast<int64_t>(pieces.bytes()) ==
                        n * size_ * static_cast<int64_t>(c10::elementSize(dtype)),
                    "pycomm ", op, ": the pieces hold ", pieces.bytes(), " bytes, not ", size_,
                    " ranges of ", n, " ", dtype, " elements");
  auto body = [this, pieces = std::move(pieces), dtype, scale, output, n](const OpContext& c) {
    channel_->reduce_scatter_pieces(pieces, dtype, scale, static_cast<char*>(output.data_ptr()), n,
                                    c);
  };
  return enqueue(op, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, std::move(body), collectives_);
}

}  // namespace pycomm::shm
