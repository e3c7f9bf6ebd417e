// Calls into c10d (see c10d.h for why they are gathered here).
#include "comm/c10d.h"

#include <c10/util/Exception.h>

namespace pycomm::comm {

c10d::ReduceOp reduce_op(const std::string& name) {
  if (name == "sum") return c10d::ReduceOp::SUM;
  if (name == "avg") return c10d::ReduceOp::AVG;
  if (name == "max") return c10d::ReduceOp::MAX;
  if (name == "min") return c10d::ReduceOp::MIN;
  if (name == "product") return c10d::ReduceOp::PRODUCT;
  TORCH_CHECK_VALUE(false, "unknown reduce op '", name,
                    "': expected sum, avg, max, min or product");
}

c10::intrusive_ptr<c10d::Backend> cpu_backend(const ProcessGroupPtr& pg) {
  TORCH_CHECK(pg, "cpu_backend: process group is null");
  try {
    return pg->getBackend(c10::DeviceType::CPU);
  } catch (const c10::Error&) {
    return {};  // no backend for CPU tensors (an accelerator-only group)
  }
}

BucketAllreduce* bucket_allreduce(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return dynamic_cast<BucketAllreduce*>(backend.get());
}

WireCollectives* wire_collectives(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return dynamic_cast<WireCollectives*>(backend.get());
}

std::string error_message(const c10::ivalue::Future& future) {
  try {
    std::rethrow_exception(future.exception_ptr());
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

WorkPtr start_allreduce(const ProcessGroupPtr& pg, at::Tensor& tensor, c10d::ReduceOp op) {
  TORCH_CHECK(pg, "start_allreduce: process group is null");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return pg->allreduce(tensors, opts);
}

WorkPtr start_reduce_scatter(const ProcessGroupPtr& pg, at::Tensor& output, at::Tensor& input) {
  TORCH_CHECK(pg, "start_reduce_scatter: process group is null");
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
#if PYCOMM_TORCH_AT_LEAST(2, 13)
  return pg->reduce_scatter_single(output, input, opts);  // 2.13's name; the old one warns
#else
  return pg->_reduce_scatter_base(output, input, opts);
#endif
}

}  // namespace pycomm::comm
