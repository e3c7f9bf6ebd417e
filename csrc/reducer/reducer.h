// The bucketed gradient reducer: autograd hooks -> grad copied (pre-scaled) into its bucket
// slot -> the bucket's collective launched the moment it is complete -> one finalize at
// the end of backward that leaves every param.grad as torch's DDP would. Bucket layout is
// bucket.h's; how a bucket is reduced is comm_hook.h's; this file owns when.
//
// Its state is split by feature into parts that own their fields, each with its file and
// Note: the bucket layout (BucketLayout, bucket.h), parameter usage and static_graph's
// hook counts (Usage, usage.h), the recorded step and the one rebuild (RebuildRecorder,
// rebuild.h), fp32 main gradients (MainGrads, main_grad.h), step timing (StepTiming,
// timeline.h), and what is decided once, the plan (Plan, plan.h). The Reducer itself owns
// the step's progress (Progress), the averaging, the gradient hooks, the extension points
// (comm hook, bucket callbacks, launch gate) and the lock; in-place reduction
// (in_place.cpp) keeps its per-step state in each Bucket.
//
//   backward:  [grads of bucket 0 land][grads of bucket 1 land][grads of bucket 2 land]
//   comm:                   [allreduce b0 ........][allreduce b1 .......][allreduce b2 ..]
//   finalize:                                                     wait b0,b1,b2 -> grads
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/c10d.h"
#include "reducer/bucket.h"
#include "reducer/comm_hook.h"
#include "reducer/main_grad.h"
#include "reducer/plan.h"
#include "reducer/rebuild.h"
#include "reducer/timeline.h"
#include "reducer/usage.h"

namespace pycomm::reducer {

// Note [Reducer options]
// The reducer's options are DDPConfig's fields of the same names (pycomm/config.py, which
// documents each and owns every default); the binding reads them from the DDPConfig by
// name (options_from in bind.cpp), never by position, and exposes the list as
// _C.REDUCER_OPTIONS, which tests/ddp/test_config.py holds against DDPConfig's fields. A
// new reducer option is one field in config.py, one line here and its use.
//   X(type, DDPConfig field name)
#define PYCOMM_REDUCER_OPTIONS(X)                     \
  X(bool, gradient_as_bucket_view)                    \
  X(bool, find_unused_parameters)                     \
  X(bool, static_graph)                               \
  X(bool, record_timeline)                            \
  X(int64_t, timeline_steps)                          \
  X(std::optional<at::ScalarType>, grad_reduce_dtype) \
  X(bool, skip_all_reduce_unused_params)              \
  X(bool, batched_grad_copy)                          \
  X(bool, lazy_bucket_allocation)                     \
  X(bool, inline_collectives)                         \
  X(bool, streaming_copies)                           \
  X(bool, in_place_reduction)                         \
  X(bool, main_grad_only)                             \
  X(comm::Wire, wire_format)

// What each means inside the reducer, where it is not plain from DDPConfig's text:
// - skip_all_reduce_unused_params: a bucket whose parameters are all unused on this rank
//   this step is not reduced and its grads are left untouched; the unused set must be the
//   same on every rank (as torch requires), else the collectives mismatch.
// - batched_grad_copy: grads land in their bucket unscaled, copied all at once (one
//   _foreach_copy_) when the bucket is complete, then one division of the whole bucket by
//   the world size (torch's numerics in that mode: x / n, not x * (1/n)).
// - lazy_bucket_allocation: See Note [Bucket memory] in bucket.cpp.
// - inline_collectives: see Note [Inline collectives] in launch.cpp; comm hooks stay
//   asynchronous.
// - streaming_copies: copies past kStreamCopyMinBytes with non-temporal stores (See Note
//   [Streaming copies] in stream_copy.cpp).
// - in_place_reduction: See Note [Gradients reduced in place] in in_place.cpp.
// - main_grad_only: with grad_reduce_dtype, param.grad is left None for widened parameters
//   after the reduction (See Note [main_grad accumulation]).
// - wire_format: DDPConfig's wire and wire_error_feedback, parsed once by DDPConfig (See
//   Note [The wire as a value] in comm/wire.h); the default hook hands it whole to a
//   backend spanning hosts (Note [Low-precision wire] in shm/wire_codec.h). Where it is in
//   effect, every bucket's dtype is checked against it when the buckets are laid out.
struct ReducerOptions {
#define PYCOMM_OPTION_FIELD(type, name) type name{};
  PYCOMM_REDUCER_OPTIONS(PYCOMM_OPTION_FIELD)
#undef PYCOMM_OPTION_FIELD
};

// Extension point: called with a bucket whose gradients are all in, before its collective
// (pre_launch), or whose collective completed, before finalize (post_done; runs in the
// collective's completion callback, possibly on a communication thread, while backward
// goes on). Throwing fails the step with the bucket named. A post_done callback that
// reads only Bucket::grads when Bucket::in_place is set is added with reads_buffer false;
// one that reads the buffer keeps the reducer from reducing in place.
using BucketCallback = std::function<void(Bucket&)>;

// Extension point (See Note [Deferred launch] in reducer/deferred.cpp): with a launch gate,
// no bucket is launched while backward runs; at its end the gate gets every bucket buffer
// (local, unaveraged gradients) and the averaging factor the reducer did not apply
// (1/world, or 1 when a comm hook averages) to fold into its one pass; then every bucket
// is launched in order.
using LaunchGate = std::function<void(const std::vector<at::Tensor>& buffers, double divide)>;

class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          const std::vector<std::vector<size_t>>& assignment, comm::ProcessGroupPtr pg,
          ReducerOptions options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Forward of a synchronized step (grad enabled, outside no_sync): arms the hooks.
  // Both return a non-empty note when the previous backward did not finish (see Note
  // [Abandoned step]); the step it left is drained and discarded first.
  std::string prepare_for_backward(const std::vector<at::Tensor>& outputs);
  // Forward inside no_sync (or without grad): hooks only record usage.
  std::string prepare_no_sync();
  void rebuild_buckets(const std::vector<std::vector<size_t>>& assignment);
  bool should_rebuild_buckets() const;
  // A joined rank shadowed a synchronized step (join): it counts as the recorded step, so
  // this rank takes part in the one bucket rebuild with the ranks that ran it. When the
  // step reduced parameter usage (tracks_usage()), `global_used` is the shadowed result:
  // static_graph learns its unused set from it, as the ranks that ran the step did.
  void note_shadowed_step(const std::optional<at::Tensor>& global_used);
  // Whether the next synchronized step all-reduces parameter usage after its last bucket
  // (find_unused_parameters, or static_graph's first step).
  bool tracks_usage() const;
  // Parameter indices in the order their grads became ready in the recorded step,
  // completed with the never-ready ones (reverse index order) so every rank has them all.
  std::vector<size_t> ready_order() const;
  // Per parameter, the gradient group it was in during the recorded step (See Note
  // [Gradient groups] in rebuild.cpp): equal ids were produced by one autograd node.
  std::vector<int64_t> ready_groups() const;

  // A user's communication hook (torch's protocol): before the first backward, once, as
  // torch's; not with a sharder's hook.
  void set_comm_hook(std::unique_ptr<CommHook> hook);
  // A sharder attaches (pycomm.ZeroRedundancyOptimizer; See Note [The reducer's plan]):
  // its mode, and with kReleased the hook that reduces each bucket and keeps its range.
  // Also between steps once training began (Note [Wrapped after the optimizer] in
  // pycomm/zero/binding.py), and again to replace its hook (its in-place form, once its
  // shards are final), never during a backward.
  void attach_sharding(Sharding sharding, std::unique_ptr<CommHook> hook);
  // Read without mutex_: every replan() runs from Python, under the GIL, as these reads do.
  const Plan& plan() const { return plan_; }
  // Whether a communication hook (a user's or a sharder's) reduces the buckets.
  bool has_comm_hook() const { return !plan_.wire.has_value(); }
  // What the default all-reduce sends across hosts (fp32 where the group spans no hosts),
  // or nullopt while a communication hook reduces the buckets.
  std::optional<comm::Wire> wire() const { return plan_.wire; }
  // Elements of the label each synchronized step exchanges before its first bucket (See
  // Note [Step labels over the group] in comm/step_label.cpp); 0: none.
  int64_t step_label_elements() const {
    return layout_.device().is_cpu() ? ext_.hook->step_label_elements() : 0;
  }
  // Reducer indices of the parameters the last synchronized step left unreduced because
  // no rank used them (find_unused_parameters, static_graph): their param.grad stays as
  // it was, as torch's DDP leaves it.
  std::vector<size_t> unused_parameters() const;
  void add_pre_launch(BucketCallback callback);
  void add_post_done(BucketCallback callback, bool reads_buffer = true);
  void set_launch_gate(LaunchGate gate);
  // The averaging divisor of the next steps (world size by default; join lowers it).
  void set_divide_factor(int64_t factor);
  // Where the group's ranks are, for failure messages when it spans hosts: (address,
  // "hostname: ranks ...") per host. See Note [Peers in failure messages] in finalize.cpp.
  void set_peer_hosts(std::vector<std::pair<std::string, std::string>> hosts) {
    peer_hosts_ = std::move(hosts);
  }

  // Manual backward finalization (See Note [Manual backward finalization] in finalize.cpp):
  // while on, backward leaves each synchronized step for finalize_backward_manual() to end.
  // Switched outside a synchronized step only.
  void set_manual_finalization(bool required);
  bool manual_finalization() const;
  // Whether this step's finalize must wait until backward has returned (manual mode only).
  bool should_finalize_after_backward() const;
  void finalize_backward_manual();

  std::vector<StepTimeline> timelines(size_t n) const;
  const std::vector<std::unique_ptr<Bucket>>& buckets() const { return layout_.buckets(); }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }
  int64_t rank() const { return pg_->getRank(); }
  const comm::ProcessGroupPtr& process_group() const { return pg_; }
  // The bucket view holding parameter `index`'s gradient (fp32 with grad_reduce_dtype).
  at::Tensor grad_view(size_t index) const;

  // Called by hooks (public for them; not part of the Python API).
  void autograd_hook(size_t index);
  void on_backward_start();

 private:
  enum class State { kIdle, kPrepared, kBackward, kReduced };

  void install_hooks();
  void remove_hooks();
  void reset_step();
  void begin_backward_locked();
  void mark_ready(size_t index, bool used);
  void mark_counted();  // See Note [Static graph hook counts]
  void copy_into_bucket(Bucket& bucket, size_t slot);
  void launch_ready_buckets();
  void launch(Bucket& bucket);
  void finalize_backward();
  void finalize_locked(int64_t finalize_start);
  // A step that backward left for finalize_backward_manual(): every gradient is in.
  bool awaits_manual_finalize() const;
  void refuse_unfinalized() const;
  void wait_bucket(Bucket& bucket);
  void finalize_bucket(Bucket& bucket);
  void fail_unready();
  // How many parameters no hook marked ready this step, and the first `shown` names.
  std::pair<size_t, std::string> unmarked_params(size_t shown) const;
  // A step that ends in an error or is abandoned: its collectives drained, its state and
  // usage dropped.
  void discard_step();
  std::string abandon_unfinished_step();
  void drain_launched() noexcept;
  std::string reduced_in_place_note() const;
  bool skips(const Bucket& bucket) const;
  void flush_batched(Bucket& bucket);
  // See Note [The reducer's plan]; under mutex_.
  void replan();
  // in_place.cpp (See Note [Gradients reduced in place]).
  bool in_place_allowed() const;  // by the options and extension points (replan reads it)
  bool grads_share_memory() const;
  bool keeps_in_place(Bucket& bucket, size_t slot);
  bool qualifies_in_place(const Bucket& bucket, size_t slot) const;
  void leave_in_place(Bucket& bucket, size_t except);
  bool launches_in_place(Bucket& bucket);
  static void release_in_place(Bucket& bucket, const std::vector<at::Tensor>& params);
  void queue_finalize();
  // deferred.cpp (See Note [Deferred launch]).
  // lazy_bucket_allocation: whether `bucket` gives its buffer's memory back after finalize
  // (a buffer that is no parameter's grad or main_grad). See Note [Bucket memory].
  bool lends_buffer(const Bucket& bucket) const;
  bool divides_in_copy() const { return plan_.divides_in_copy; }
  void open_launch_gate();
  // Whether a plain copy from or into `grad` may stream (options, and no create_graph).
  bool streams(const at::Tensor& grad) const {
    return options_.streaming_copies && !grad.requires_grad();
  }

  // What the reducer reduces, over which group, with which options.
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  comm::ProcessGroupPtr pg_;
  ReducerOptions options_;
  // Where the group's ranks are (set_peer_hosts), for failure messages.
  std::vector<std::pair<std::string, std::string>> peer_hosts_;

  // The post-hooks on the parameters' gradient accumulators that drive the step.
  struct GradHooks {
    std::vector<AccumulatorPtr> accumulators;
    std::vector<uintptr_t> keys;
    std::shared_ptr<Reducer*> self;  // weak handle for hooks that may outlive us
  };
  GradHooks grad_hooks_;

  // Extension points: what reduces a bucket and what runs around its collective. Set
  // between steps; each change replans.
  struct Extensions {
    std::unique_ptr<CommHook> hook;
    std::vector<BucketCallback> pre_launch;
    std::vector<BucketCallback> post_done;
    bool post_done_reads_buffer = false;
    LaunchGate gate;
  };
  Extensions ext_;
  Plan plan_;  // See Note [The reducer's plan]; replan() writes it

  // The averaging: the divisor (world size; join lowers it: set_divide_factor), and the
  // factor each gradient is multiplied by, 1 / divisor, taken when a backward begins.
  struct Averaging {
    int64_t divisor = 1;
    at::Tensor scale;  // a wrapped scalar
    double scale_value = 1.0;  // the same, for stream_copy
  };
  Averaging averaging_;

  // The parts (see the top of this file); guarded by mutex_ like the rest.
  BucketLayout layout_;
  Usage usage_;
  RebuildRecorder recorder_;
  MainGrads main_grads_;
  StepTiming timing_;

  mutable std::mutex mutex_;
  bool manual_finalization_ = false;  // See Note [Manual backward finalization]
  // The step's progress.
  struct Progress {
    State state = State::kIdle;
    size_t next_launch = 0;  // buckets launched so far, in index order (Note [Bucket order])
    std::vector<uint8_t> marked;  // per parameter: marked ready this step
    int64_t last_hooked = -1;     // the last parameter a hook marked ready this step
    bool finalize_queued = false;  // finalize_backward is queued on a graph task
    int64_t step = 0;              // synchronized steps finalized
    // Forwards with grad enabled (synchronized or under no_sync) since the last
    // synchronized backward: part of each bucket's label (See Note [Collective identity]
    // in shm/collectives.cpp).
    int64_t forwards = 0;
    // This step's label went out (See Note [Step labels over the group] in
    // comm/step_label.cpp).
    bool labelled = false;
  };
  Progress progress_;
};

}  // namespace pycomm::reducer
