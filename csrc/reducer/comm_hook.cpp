// Bucket reductions (see comm_hook.h).
#include "reducer/comm_hook.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <utility>

#include "comm/step_label.h"

namespace pycomm::reducer {

namespace py = pybind11;

FuturePtr CommHook::run_in_place(Bucket& bucket, size_t /*bucket_count*/,
                                 const std::vector<at::Tensor>& /*params*/,
                                 std::vector<at::Tensor> /*grads*/, double /*scale*/,
                                 const comm::OpLabel& /*label*/) {
  TORCH_CHECK(false, "bucket ", bucket.index, ": this communication hook reduces buckets only");
}

AllreduceSumHook::AllreduceSumHook(comm::ProcessGroupPtr pg, bool run_inline, comm::Wire wire)
    : pg_(std::move(pg)),
      alone_(pg_->getSize() == 1),
      run_inline_(run_inline),
      backend_(comm::cpu_backend(pg_)),
      bucket_ops_(comm::bucket_allreduce(backend_)),
      wire_ops_(comm::wire_collectives(backend_)) {
  if (wire_ops_ != nullptr) wire_ = wire;
}

int64_t AllreduceSumHook::step_label_elements() const {
  return alone_ || bucket_ops_ != nullptr ? 0 : comm::step_label_elements(pg_->getSize());
}

void AllreduceSumHook::begin_step(const comm::OpLabel& label) {
  const int rank = pg_->getRank();
  at::Tensor sums = comm::step_label_tensor(pg_->getSize(), rank, label);
  step_label_ = comm::start_allreduce(pg_, sums, c10d::ReduceOp::SUM)
                    ->getFuture()
                    ->then(
                        [sums, rank, label](c10::ivalue::Future& done) {
                          done.value();  // rethrows the all-reduce's error
                          comm::check_step_label(sums, rank, label);
                          return c10::IValue(sums);
                        },
                        c10::TensorType::get());
}

// On a backend that compares labels (pycomm's shared memory) the bucket goes to it
// directly, with its label; elsewhere through the group, as torch's reducer does, the
// step's first bucket completing only with the step's label exchange (See Note [Step
// labels over the group] in comm/step_label.cpp).
FuturePtr AllreduceSumHook::run(Bucket& bucket, size_t /*bucket_count*/,
                                const std::vector<at::Tensor>& /*params*/,
                                const comm::OpLabel& label) {
  if (bucket_ops_ != nullptr && bucket.buffer.device().is_cpu()) {
    return finish(bucket_ops_->allreduce_sum(bucket.buffer, label));
  }
  FuturePtr reduced;
  if (wire_ops_ != nullptr && !wire_.exact() && bucket.buffer.device().is_cpu()) {
    if (!bucket.wire_residual) bucket.wire_residual = std::make_shared<comm::WireResidual>();
    reduced = finish(wire_ops_->allreduce_wire(bucket.buffer, wire_, bucket.wire_residual));
  } else {
    reduced = finish(comm::start_allreduce(pg_, bucket.buffer, c10d::ReduceOp::SUM));
  }
  return with_step_label(reduced);
}

// `reduced`, completing only with the step's label exchange when begin_step started one for
// this bucket (the step's first).
FuturePtr AllreduceSumHook::with_step_label(const FuturePtr& reduced) {
  FuturePtr step_label = std::exchange(step_label_, FuturePtr());
  if (!step_label) return reduced;
  c10::List<FuturePtr> both(c10::FutureType::create(c10::AnyType::get()));
  both.push_back(step_label);
  both.push_back(reduced);
  // collectAll fails at the first error, the other future perhaps still running (a dead
  // peer fails the bucket before the label): rethrow that error, read neither.
  return c10::collectAll(both)->then(
      [step_label, reduced](c10::ivalue::Future& all) {
        if (all.hasError()) std::rethrow_exception(all.exception_ptr());
        step_label->value();  // completed: a label mismatch would have failed `all`
        return reduced->value();
      },
      reduced->elementType());
}

// Note [One rank reduces nothing]
// On a group of one rank the all-reduce's sum is the rank's own gradients: torch's reducer
// still copies each into its bucket, all-reduces the bucket alone and copies it back, two
// passes over every gradient (DDP 1.34x its no_sync step on the bench MLP on CPU,
// benchmarks/results/ddp_one_rank_cpu.md). Here the bucket takes the in-place path (Note
// [Gradients reduced in place] in in_place.cpp, with every condition it sets) on any
// backend and device, in any floating dtype (a one-GPU NCCL group too, where torch's DDP
// still copies every gradient twice and runs NCCL over one rank), and its "collective" is
// the scaling alone: none at all when the scale is 1, as it is unless join() changed the
// divisor. param.grad ends with the bits the bucket gives (x * 1.0 == x), so the
// parameters stay bitwise torch's. No step label either: there is no other rank to
// disagree with.
FuturePtr AllreduceSumHook::run_in_place(Bucket& bucket, size_t /*bucket_count*/,
                                         const std::vector<at::Tensor>& /*params*/,
                                         std::vector<at::Tensor> grads, double scale,
                                         const comm::OpLabel& label) {
  if (alone_) {
    if (scale != 1.0) {
      for (auto& grad : grads) grad.mul_(scale);
    }
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    done->markCompleted(c10::IValue(bucket.buffer));
    return done;
  }
  if (bucket_ops_ != nullptr) {
    return finish(bucket_ops_->allreduce_pieces(std::move(grads), scale, label));
  }
  // Across hosts (Note [Hierarchical all-reduce of pieces] in shm/hier_allreduce.cpp): the
  // step label goes over the group, as the bucket's own all-reduce would take it.
  TORCH_CHECK(wire_ops_ != nullptr, "bucket ", bucket.index,
              ": in-place reduction needs a pycomm shared-memory or hierarchical group");
  if (!wire_.exact() && !bucket.wire_residual) {
    bucket.wire_residual = std::make_shared<comm::WireResidual>();
  }
  return with_step_label(finish(wire_ops_->allreduce_pieces_wire(std::move(grads), scale, wire_,
                                                                 bucket.wire_residual)));
}

FuturePtr AllreduceSumHook::finish(const comm::WorkPtr& work) {
  if (run_inline_ && !inline_failed_) {
    try {
      work->wait();
    } catch (...) {
      // The work's future holds the same error; finalize reports it with the bucket named.
      // Later buckets are no longer awaited here: each would wait out the timeout again.
      inline_failed_ = true;
    }
  }
  return work->getFuture();
}

PythonCommHook::PythonCommHook(py::object state, py::object hook)
    : state_(std::move(state)), hook_(std::move(hook)) {}

PythonCommHook::~PythonCommHook() {
  py::gil_scoped_acquire gil;
  state_ = py::object();
  hook_ = py::object();
}

py::object make_grad_bucket(Bucket& bucket, size_t bucket_count,
                            const std::vector<at::Tensor>& params, const at::Tensor& buffer) {
  std::vector<at::Tensor> members;
  members.reserve(bucket.params.size());
  for (size_t index : bucket.params) members.push_back(params[index]);
  c10d::GradBucket grad_bucket(bucket.index, bucket_count, buffer, bucket.offsets, bucket.lengths,
                               bucket.sizes, std::move(members), std::nullopt);
  return py::cast(std::move(grad_bucket));
}

FuturePtr PythonCommHook::call(Bucket& bucket, const std::function<py::object()>& body) {
  py::gil_scoped_acquire gil;
  try {
    py::object result = body();
    auto ivalue = torch::jit::toIValue(result, c10::FutureType::create(c10::AnyType::get()));
    return ivalue.toFuture();
  } catch (py::error_already_set& e) {
    std::string what = e.what();
    TORCH_CHECK(false, "communication hook failed on bucket ", bucket.index, ": ", what);
  } catch (const py::cast_error&) {
    TORCH_CHECK(false, "communication hook must return a torch.futures.Future (bucket ",
                bucket.index, ")");
  }
}

FuturePtr PythonCommHook::run(Bucket& bucket, size_t bucket_count,
                              const std::vector<at::Tensor>& params,
                              const comm::OpLabel& /*label*/) {
  return call(bucket, [&] {
    return hook_(state_, make_grad_bucket(bucket, bucket_count, params, bucket.buffer));
  });
}

at::Tensor result_tensor(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor();
  if (value.isPyObject()) {  // a Python hook's future (e.g. fut.then(fn) in torch's hooks)
    py::gil_scoped_acquire gil;
    py::object obj = torch::jit::toPyObject(value);
    if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
      py::sequence seq = obj;
      TORCH_CHECK(seq.size() == 1, "the communication hook's future holds ", seq.size(),
                  " values; it must hold one tensor shaped like bucket.buffer()");
      obj = seq[0];
    }
    TORCH_CHECK(THPVariable_Check(obj.ptr()), "the communication hook's future holds a ",
                py::str(obj.get_type().attr("__name__")),
                "; it must hold one tensor shaped like bucket.buffer()");
    return py::cast<at::Tensor>(obj);
  }
  if (value.isTensorList()) {
    auto list = value.toTensorVector();
    TORCH_CHECK(list.size() == 1, "bucket future holds ", list.size(), " tensors, expected 1");
    return list.front();
  }
  if (value.isList()) {
    auto list = value.toListRef();
    TORCH_CHECK(list.size() == 1 && list[0].isTensor(),
                "bucket future must hold one tensor, got a list of ", list.size());
    return list[0].toTensor();
  }
  TORCH_CHECK(false, "the bucket's future holds a ", value.tagKind(),
              "; it must hold one tensor shaped like bucket.buffer()");
}

}  // namespace pycomm::reducer
