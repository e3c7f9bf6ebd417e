// How a bucket is reduced: the default sum all-reduce on a c10d::ProcessGroup, or a Python
// communication hook with torch's protocol (hook(state, dist.GradBucket) ->
// torch.futures.Future[Tensor]). The reducer owns when; a CommHook owns how.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <functional>

#include "comm/c10d.h"
#include "reducer/bucket.h"

namespace pycomm::reducer {

// What reduces the buckets (Plan::reduction).
enum class Reduction : uint8_t {
  kAllreduce,   // the default sum all-reduce (AllreduceSumHook)
  kPythonHook,  // a user's communication hook, in Python (PythonCommHook)
  kShardKeep,   // a sharded optimizer's reduce-scatter, kept in C++ (ShardHook)
};

const char* reduction_name(Reduction reduction);

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual Reduction reduction() const = 0;
  // Start reducing `bucket` (all its gradients are in); the future completes with the
  // reduced tensor (the bucket's buffer or a new tensor of the same numel). `label` says
  // which step and bucket it is, for a backend that compares it across ranks.
  virtual FuturePtr run(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                        const comm::OpLabel& label) = 0;
  // Whether the reducer pre-divides by the world size while copying into the bucket
  // (the default all-reduce) or leaves averaging to the hook (torch's hooks divide).
  virtual bool reducer_divides() const = 0;
  // Whether run_in_place can reduce a bucket's gradients where they are (See Note
  // [Gradients reduced in place] in reducer/in_place.cpp).
  virtual bool reduces_in_place() const { return false; }
  // Whether it can for a bucket of `buffer`'s device and dtype: the shared-memory pieces
  // take float32 and float64 CPU buckets.
  virtual bool reduces_in_place_on(const at::Tensor& buffer) const {
    const at::ScalarType dtype = buffer.scalar_type();
    return buffer.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble);
  }
  // Start reducing every rank's `grads` (the bucket's, in slot order) times `scale` where
  // they are: the default all-reduce writes the sum back into them; the future completes
  // when the hook's result is in place.
  virtual FuturePtr run_in_place(Bucket& bucket, size_t bucket_count,
                                 const std::vector<at::Tensor>& params,
                                 std::vector<at::Tensor> grads, double scale,
                                 const comm::OpLabel& label);
  // Elements of the step label this hook exchanges before a step's first bucket (See Note
  // [Step labels over the group] in comm/step_label.cpp); 0: none. A joined rank's shadow
  // all-reduces as many zeros first.
  virtual int64_t step_label_elements() const { return 0; }
  // Called before `run` for the step's first bucket when step_label_elements() > 0: start
  // the exchange; that bucket's future then fails if the ranks' labels differ.
  virtual void begin_step(const comm::OpLabel& /*label*/) {}
  // The wire this hook sends buckets across hosts in, where the reducer decides it (the
  // default all-reduce); nullptr where the hook decides what it sends.
  virtual const comm::Wire* wire() const { return nullptr; }
};

// torch's default without a hook: sum all-reduce of the pre-scaled bucket. With
// `run_inline` the launching thread waits for the collective before returning (see
// Note [Inline collectives] in launch.cpp). With a low-precision `wire` on a group whose
// backend spans hosts (comm::WireCollectives), each bucket crosses hosts in it (Note
// [Low-precision wire] in shm/wire_codec.h); on a group that does not, no bucket
// crosses a host and the wire changes nothing.
class AllreduceSumHook final : public CommHook {
 public:
  AllreduceSumHook(comm::ProcessGroupPtr pg, bool run_inline, comm::Wire wire = {});
  Reduction reduction() const override { return Reduction::kAllreduce; }
  // The wire the buckets cross hosts in: `wire`, or fp32 where the group's backend
  // offers no low-precision all-reduce.
  const comm::Wire* wire() const override { return &wire_; }
  FuturePtr run(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                const comm::OpLabel& label) override;
  bool reducer_divides() const override { return true; }
  // On a group whose CPU backend offers an all-reduce of pieces (pycomm's shared memory and
  // its hierarchy across hosts), and on a group of one rank, whose sum is the gradients
  // themselves (See Note [One rank reduces nothing] in comm_hook.cpp).
  bool reduces_in_place() const override {
    return alone_ || bucket_ops_ != nullptr || wire_ops_ != nullptr;
  }
  // Alone, on any device and floating dtype: there is nothing to move. Across hosts on a
  // low-precision wire, float32 buckets (the wire encodes from float32).
  bool reduces_in_place_on(const at::Tensor& buffer) const override {
    if (alone_) return true;
    if (bucket_ops_ == nullptr && !wire_.exact() && buffer.scalar_type() != at::kFloat) {
      return false;
    }
    return CommHook::reduces_in_place_on(buffer);
  }
  FuturePtr run_in_place(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                         std::vector<at::Tensor> grads, double scale,
                         const comm::OpLabel& label) override;
  // On a group whose backend compares no labels itself (Gloo, the hierarchy).
  int64_t step_label_elements() const override;
  void begin_step(const comm::OpLabel& label) override;

 private:
  FuturePtr finish(const comm::WorkPtr& work);
  FuturePtr with_step_label(const FuturePtr& reduced);

  comm::ProcessGroupPtr pg_;
  bool alone_;  // a group of one rank
  bool run_inline_;
  bool inline_failed_ = false;
  c10::intrusive_ptr<c10d::Backend> backend_;  // keeps bucket_ops_ alive
  comm::BucketAllreduce* bucket_ops_ = nullptr;    // what backend_ offers, if it does
  comm::WireCollectives* wire_ops_ = nullptr;     // likewise, across hosts
  comm::Wire wire_;
  FuturePtr step_label_;  // begin_step's exchange, until the next run takes it
};

// A user's communication hook, torch's protocol: hook(state, dist.GradBucket) ->
// torch.futures.Future[Tensor]; the hook averages (torch's hooks divide).
class PythonCommHook final : public CommHook {
 public:
  PythonCommHook(pybind11::object state, pybind11::object hook);
  ~PythonCommHook() override;
  Reduction reduction() const override { return Reduction::kPythonHook; }
  FuturePtr run(Bucket& bucket, size_t bucket_count, const std::vector<at::Tensor>& params,
                const comm::OpLabel& label) override;
  bool reducer_divides() const override { return false; }

 private:
  // The hook's call (`body`, under the GIL) and its future, errors naming the bucket.
  FuturePtr call(Bucket& bucket, const std::function<pybind11::object()>& body);

  pybind11::object state_;
  pybind11::object hook_;
};

// A real torch GradBucket over `bucket` (its buffer, or `buffer` when given).
pybind11::object make_grad_bucket(Bucket& bucket, size_t bucket_count,
                                  const std::vector<at::Tensor>& params, const at::Tensor& buffer);

// The tensor a bucket future completed with (a Tensor or a list holding one).
at::Tensor result_tensor(const c10::IValue& value);

}  // namespace pycomm::reducer
