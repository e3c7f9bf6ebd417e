// See coalesced.h.
#include "shm/coalesced.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "shm/reduce_kernels.h"
#include "shm/tensor_args.h"

namespace pycomm::shm {

void check_coalesced(const char* op, const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, int world, bool gather) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm ", op, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& in = inputs[i];
    const at::Tensor& out = outputs[i];
    check_dense(op, in);
    check_dense(op, out);
    const int64_t expect = gather ? in.numel() * world : in.numel() / world;
    TORCH_CHECK_VALUE(out.scalar_type() == in.scalar_type() && out.numel() == expect &&
                          (gather || in.numel() == out.numel() * world),
                      "pycomm ", op, ": entry ", i, " has a ", in.scalar_type(), " input of ",
                      in.numel(), " elements and a ", out.scalar_type(), " output of ", out.numel(),
                      "; expected the output ", gather ? "world x" : "1/world of",
                      " the input (world ", world, ") in the input's dtype");
  }
}

at::ScalarType check_reduce_scatter_list(const char* op, const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, int world,
                                         const c10d::ReduceOp& reduce) {
  check_coalesced(op, outputs, inputs, world, /*gather=*/false);
  TORCH_CHECK_VALUE(!inputs.empty(), "pycomm ", op, ": an empty list");
  const at::ScalarType dtype = inputs[0].scalar_type();
  for (size_t i = 1; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(inputs[i].scalar_type() == dtype, "pycomm ", op, ": entry ", i, " is ",
                      inputs[i].scalar_type(), ", entry 0 is ", dtype,
                      ": a reduction takes one dtype per call");
  }
  check_reduction(op, dtype, reduce);
  return dtype;
}

int64_t packed_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

at::Tensor pack_block(const std::vector<at::Tensor>& inputs) {
  at::Tensor mine = at::empty({packed_bytes(inputs)}, at::TensorOptions().dtype(at::kByte));
  for (int64_t i = 0, off = 0; i < static_cast<int64_t>(inputs.size()); ++i) {
    const int64_t n = static_cast<int64_t>(inputs[i].nbytes());
    mine.narrow(0, off, n).copy_(inputs[i].contiguous().reshape({-1}).view(at::kByte));
    off += n;
  }
  return mine;
}

void unpack_gathered(const at::Tensor& all, int64_t block, const std::vector<at::Tensor>& inputs,
                     const std::vector<at::Tensor>& outputs, int world) {
  for (int64_t i = 0, off = 0; i < static_cast<int64_t>(outputs.size()); ++i) {
    const int64_t n = static_cast<int64_t>(inputs[i].nbytes());
    at::Tensor packed = at::empty({n * world}, all.options());
    for (int r = 0; r < world; ++r)
      packed.narrow(0, r * n, n).copy_(all.narrow(0, r * block + off, n));
    outputs[i].copy_(packed.view(outputs[i].scalar_type()).view(outputs[i].sizes()));
    off += n;
  }
}

at::Tensor pack_by_rank(const std::vector<at::Tensor>& inputs,
                        const std::vector<at::Tensor>& outputs, int world, at::ScalarType dtype) {
  int64_t block = 0;  // elements of one rank's outputs, packed
  for (const auto& t : outputs) block += t.numel();
  at::Tensor packed = at::empty({block * world}, at::TensorOptions().dtype(dtype));
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0, off = 0; i < static_cast<int64_t>(inputs.size()); ++i) {
      const int64_t n = outputs[i].numel();
      packed.narrow(0, r * block + off, n)
          .copy_(inputs[i].contiguous().reshape({-1}).narrow(0, r * n, n));
      off += n;
    }
  }
  return packed;
}

void unpack_block(const at::Tensor& block, const std::vector<at::Tensor>& outputs) {
  for (int64_t i = 0, off = 0; i < static_cast<int64_t>(outputs.size()); ++i) {
    const int64_t n = outputs[i].numel();
    outputs[i].copy_(block.narrow(0, off, n).view(outputs[i].sizes()));
    off += n;
  }
}

}  // namespace pycomm::shm
