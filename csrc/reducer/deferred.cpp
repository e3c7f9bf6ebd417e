// The launch gate (LaunchGate in reducer.h): buckets launched together at the end of
// backward, after a callback has seen all of them (clipping local gradients before the
// all-reduce, csrc/reducer/local_clip.cpp).
//
// Note [Deferred launch]
// With a gate, mark_ready fills buckets but launches none, and copy_into_bucket does not
// pre-divide (divides_in_copy): the buckets hold this rank's local gradients. At the end of
// backward (finalize_backward, in the engine's final callback) the gate runs once over all
// buckets with the divisor the reducer skipped, then every bucket launches in index order
// (See Note [Bucket order]) and finalize waits for them as usual. The cost is overlap:
//
//   backward:  [grads of bucket 0][grads of bucket 1][grads of bucket 2]
//   gate:                                                              [norm][scale]
//   comm:                                                                          [b0][b1][b2]
#include "reducer/reducer.h"

namespace pycomm::reducer {

void Reducer::set_launch_gate(LaunchGate gate) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(progress_.state != State::kBackward, "cannot set a launch gate during backward");
  ext_.gate = std::move(gate);
  replan();
}

void Reducer::open_launch_gate() {
  for (const auto& bucket : layout_.buckets()) {
    if (bucket->pending != 0) return;  // finalize reports the missing parameters
  }
  std::vector<at::Tensor> buffers;
  buffers.reserve(layout_.size());
  for (const auto& bucket : layout_.buckets()) buffers.push_back(bucket->buffer);
  const double divide = plan_.reducer_averages ? 1.0 / static_cast<double>(averaging_.divisor)
                                               : 1.0;
  try {
    ext_.gate(buffers, divide);
  } catch (...) {
    reset_step();
    progress_.state = State::kIdle;
    throw;
  }
  launch_ready_buckets();
}

}  // namespace pycomm::reducer
