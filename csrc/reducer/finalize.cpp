// The end of a synchronized backward: wait for every bucket's collective in index order,
// write the reduced gradients back to param.grad as torch's DDP does, and end the step in
// each part (usage, the recorded step, timing); or fail, or abandon, the step with a
// message that says what was reduced (see reducer.h).
#include <torch/csrc/autograd/utils/grad_layout_contract.h>

#include <algorithm>
#include <sstream>

#include "reducer/reducer.h"
#include "reducer/stream_copy.h"

namespace pycomm::reducer {

namespace {

std::string describe_params(const Bucket& bucket, const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    out << (slot ? ", " : "") << names[bucket.params[slot]];
    if (slot == 7 && bucket.params.size() > 9) {
      out << ", ... (" << bucket.params.size() - 8 << " more)";
      break;
    }
  }
  return out.str();
}

// Note [Peers in failure messages]
// Across hosts a bucket fails because a peer died (Gloo: "Read error [10.77.0.2]:41150:
// Connection reset by peer") or went silent ("Timed out waiting 8000ms for recv"). Gloo
// names a peer by address only, and for a timeout not at all; pycomm's DDP hands the
// reducer each host's address and ranks (pycomm.shm.ranks_by_host), so the message names
// the ranks behind the address, or lists the hosts when no address is named.
std::string describe_peers(const std::string& error,
                           const std::vector<std::pair<std::string, std::string>>& hosts) {
  if (hosts.empty()) return "";
  std::ostringstream named;
  for (const auto& [address, who] : hosts) {
    if (error.find("[" + address + "]") != std::string::npos) {
      named << (named.tellp() > 0 ? "; " : "") << "the peer at " << address << " is " << who;
    }
  }
  if (named.tellp() > 0) return " (" + named.str() + ")";
  std::ostringstream all;
  for (const auto& [address, who] : hosts) {
    all << (all.tellp() > 0 ? "; " : "") << who << " at " << address;
  }
  return " (the group spans hosts: " + all.str() + ")";
}

}  // namespace

void Reducer::finalize_backward() {
  const int64_t finalize_start = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  progress_.finalize_queued = false;
  if (progress_.state != State::kBackward) return;  // a backward that reached no parameter
  finalize_locked(finalize_start);
}

// Note [Manual backward finalization]
// torch 2.15's DDP lets the caller end a synchronized step: with
// require_manual_backward_finalization set, backward queues no finalize; the caller calls
// finalize_backward() once every gradient is in, after backward returns or from a hook of
// its own late in backward, and work placed before that call (sparse collectives, an
// optimizer step over parameters the DDP does not reduce) runs while the buckets'
// collectives are still in flight. The step's timeline says finalize was the caller's
// (manual_finalization), and its finalize_start_ns is when the caller called, so the report
// shows how much communication the caller's work covered. The mode is the reducer's, and it
// changes only outside a synchronized step: never between a forward that armed one and its
// finalize. A step waiting for the caller is not abandoned by the next forward: one with
// grad enabled (synchronized or under no_sync) raises and leaves it for finalize_backward(),
// one without grad (an evaluation) runs and leaves it too. Only static_graph's first step must
// be finalized after backward returns: its hook counts are complete only then (Note [Static
// graph hook counts]); any other step may be finalized as soon as its last gradient is in.
void Reducer::set_manual_finalization(bool required) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (required == manual_finalization_) return;
  TORCH_CHECK(progress_.state != State::kPrepared && progress_.state != State::kBackward,
              "pycomm DDP (rank ", rank(),
              "): require_manual_backward_finalization can only change before a forward or "
              "after the step's backward was finalized, not between a synchronized forward and "
              "the end of its backward");
  manual_finalization_ = required;
}

bool Reducer::manual_finalization() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return manual_finalization_;
}

bool Reducer::should_finalize_after_backward() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return manual_finalization_ && usage_.counting_hooks();
}

bool Reducer::lends_buffer(const Bucket& bucket) const {
  return options_.lazy_bucket_allocation && !options_.gradient_as_bucket_view &&
         bucket.buffer.scalar_type() == params_[bucket.params.front()].scalar_type();
}

bool Reducer::awaits_manual_finalize() const {
  return manual_finalization_ && progress_.state == State::kBackward &&
         (usage_.counting_hooks() || std::all_of(progress_.marked.begin(), progress_.marked.end(),
                                                 [](uint8_t m) { return m != 0; }));
}

void Reducer::finalize_backward_manual() {
  const int64_t finalize_start = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(manual_finalization_, "pycomm DDP (rank ", rank(),
              "): finalize_backward() was called, but this DDP finalizes each backward itself: "
              "set require_manual_backward_finalization = True first");
  TORCH_CHECK(progress_.state == State::kBackward, "pycomm DDP (rank ", rank(),
              "): finalize_backward() was called, but no synchronized backward awaits it: the "
              "last forward ran under no_sync() or without grad, its backward reached no "
              "parameter or has not run, or finalize_backward() already ended it");
  if (!awaits_manual_finalize()) {
    const auto [count, missing] = unmarked_params(8);
    TORCH_CHECK(false, "pycomm DDP (rank ", rank(),
                "): finalize_backward() was called before "
                "every gradient of the backward was in: ",
                progress_.next_launch, " of ", layout_.size(), " buckets launched, ", count,
                " parameter(s) still to come (", missing,
                "). Call it after backward returns, or from a hook that runs after the last "
                "parameter's gradient is accumulated");
  }
  finalize_locked(finalize_start);
}

void Reducer::finalize_locked(int64_t finalize_start) {
  progress_.state = State::kReduced;
  if (usage_.counting_hooks()) mark_counted();  // See Note [Static graph hook counts]
  if (ext_.gate) open_launch_gate();
  if (progress_.next_launch < layout_.size()) fail_unready();
  for (auto& bucket : layout_.buckets()) wait_bucket(*bucket);
  usage_.wait_sum();
  for (auto& bucket : layout_.buckets()) {
    finalize_bucket(*bucket);
    bucket->grads.clear();  // param.grad may be freed (zero_grad) before the next step
    if (bucket->path == BucketPath::kBuffer && lends_buffer(*bucket)) {
      release_storage(bucket->buffer);  // See Note [Bucket memory] in bucket.cpp
    }
  }
  usage_.end_step();
  recorder_.end_step();
  if (timing_.recording()) {
    timing_.push(progress_.step, rank(), layout_, finalize_start, manual_finalization_);
  }
  ++progress_.step;
  progress_.forwards = 0;
}

// static_graph's first step: every parameter is marked ready now, at the end of backward,
// the ones no hook reached as unused (See Note [Static graph hook counts]).
void Reducer::mark_counted() {
  const std::vector<int32_t>& counts = usage_.end_counting();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (counts[i] == 0) ++layout_.bucket_of(i).unused;
  }
  for (size_t i = 0; i < params_.size(); ++i) mark_ready(i, /*used=*/counts[i] > 0);
}

void Reducer::wait_bucket(Bucket& bucket) {
  if (bucket.skipped) return;
  bucket.future->wait();
  if (!bucket.future->hasError()) return;
  std::string error = comm::error_message(*bucket.future);
  const size_t failed = bucket.index;
  const std::string members = describe_params(bucket, names_);
  const int64_t nbytes = bucket.nbytes();
  drain_launched();
  const std::string reduced = reduced_in_place_note();
  reset_step();
  progress_.state = State::kIdle;
  TORCH_CHECK(false, "pycomm DDP (rank ", rank(), "): the collective of bucket ", failed, " of ",
              layout_.size(), " (", nbytes, " bytes; parameters ", members,
              ") failed or timed out: ", error, describe_peers(error, peer_hosts_), reduced);
}

// Mirrors torch's finalize_bucket_dense: a globally unused parameter keeps its grad;
// otherwise grad becomes (or receives) the reduced bucket slot.
void Reducer::finalize_bucket(Bucket& bucket) {
  if (bucket.skipped) return;  // torch leaves a skipped bucket's grads untouched
  // reduced in place, the grads hold the result; released, the hook took it (See Note
  // [Bucket paths] in bucket.h)
  if (bucket.path != BucketPath::kBuffer) return;
  for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
    const size_t index = bucket.params[slot];
    if (usage_.globally_unused(index)) continue;
    const at::Tensor& view = bucket.views[slot];
    const at::Tensor& param = params_[index];
    at::Tensor& grad = params_[index].mutable_grad();
    const bool same_dtype = view.scalar_type() == param.scalar_type();
    if (!same_dtype && options_.main_grad_only) continue;  // the fp32 view is the result
    if (options_.gradient_as_bucket_view && same_dtype) {
      if (!grad.defined()) {
        grad = view;
      } else if (!grad.is_alias_of(view)) {
        grad.copy_(view);  // the user replaced .grad; keep their tensor, give it the result
      }
    } else if (!grad.defined()) {
      grad = torch::autograd::utils::clone_obey_contract(view, param).to(param.scalar_type());
    } else if (!streams(grad) || !stream_copy(grad, view, std::nullopt)) {
      grad.copy_(view);  // (See Note [Streaming copies] in stream_copy.cpp)
    }
  }
}

std::vector<size_t> Reducer::unused_parameters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<size_t> out;
  if (progress_.step == 0) return out;  // no usage summed yet
  for (size_t i = 0; i < params_.size(); ++i) {
    if (usage_.globally_unused(i)) out.push_back(i);
  }
  return out;
}

std::pair<size_t, std::string> Reducer::unmarked_params(size_t shown) const {
  std::ostringstream missing;
  size_t count = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (progress_.marked[i]) continue;
    if (count++ < shown) missing << (count > 1 ? ", " : "") << names_[i];
  }
  if (count > shown) missing << ", ... (" << count - shown << " more)";
  return {count, missing.str()};
}

void Reducer::fail_unready() {
  const auto [count, missing] = unmarked_params(16);
  const size_t first_unlaunched = progress_.next_launch;
  discard_step();
  progress_.state = State::kIdle;
  TORCH_CHECK(false, "pycomm DDP (rank ", rank(), "): ", count,
              " parameter(s) did not receive "
              "a gradient in this backward, so bucket ",
              first_unlaunched,
              " and later were "
              "never reduced: ",
              missing,
              ". These parameters were not used to compute "
              "the loss: pass find_unused_parameters=True to DistributedDataParallel, or make "
              "sure every parameter takes part (or set requires_grad=False before wrapping).");
}

// Note [Abandoned step]
// A backward that raised (or was interrupted) never reaches finalize_backward: the engine
// drops its queued callbacks. The next forward finds the step still in kBackward. Its
// launched collectives are waited for (they complete when every rank launched them, which
// holds when the failure is the same on every rank; else they fail within the group's
// timeout and the error names the bucket), the step is discarded, and the forward goes on
// with a note saying exactly what was abandoned. torch's DDP instead refuses every later
// forward ("Expected to have finished reduction in the prior iteration").
std::string Reducer::abandon_unfinished_step() {
  size_t ready = 0;
  for (uint8_t m : progress_.marked) ready += m;
  const size_t launched = progress_.next_launch;
  std::ostringstream note;
  note << "pycomm DDP (rank " << rank() << "): the previous backward did not finish (an "
       << "exception was raised in it, or it was interrupted): " << ready << " of "
       << params_.size() << " parameters had their gradient ready";
  if (progress_.last_hooked >= 0) note << ", the last one " << names_[progress_.last_hooked];
  note << "; " << launched << " of " << layout_.size() << " buckets had launched";
  if (launched < layout_.size()) {
    note << ", bucket " << launched << " of " << layout_.size() << " (parameters "
         << describe_params(layout_[launched], names_) << ") and later had not";
  }
  drain_launched();
  const std::string reduced = reduced_in_place_note();
  for (size_t b = 0; b < launched; ++b) {
    const FuturePtr& future = layout_[b].future;
    if (future && future->hasError()) {
      const std::string error = comm::error_message(*future);
      discard_step();
      progress_.state = State::kIdle;
      TORCH_CHECK(false, note.str(), ". Waiting for the collective of bucket ", b,
                  " it launched failed (did another rank fail elsewhere in that backward?): ",
                  error, reduced);
    }
  }
  discard_step();
  recorder_.discard_partial();
  note << ". Its launched collectives completed and the step was discarded; param.grad may "
       << "still hold this rank's unreduced gradients from it" << reduced
       << " (zero_grad() before the next backward).";
  return note.str();
}

// For a step that ends in an error: which launched buckets were reduced in place, so that
// their param.grad already holds the reduced values while the others' hold local ones.
// A failed bucket reduced in place is named apart: its collective may have written part of
// the sums before it failed.
std::string Reducer::reduced_in_place_note() const {
  std::ostringstream done, failed;
  for (size_t b = 0; b < progress_.next_launch; ++b) {
    const Bucket& bucket = layout_[b];
    if (!in_place(bucket.path) || bucket.skipped) continue;
    std::ostringstream& out = bucket.future && bucket.future->hasError() ? failed : done;
    out << (out.tellp() > 0 ? ", " : "") << b;
  }
  std::string note;
  if (done.tellp() > 0) {
    note += "; the gradients of bucket(s) " + done.str() +
            ", reduced in place (Note [Gradients reduced in place]), are already the reduced "
            "ones in param.grad";
  }
  if (failed.tellp() > 0) {
    note += "; bucket(s) " + failed.str() +
            ", reduced in place, failed partway: their param.grad may hold partly reduced "
            "values";
  }
  return note;
}

void Reducer::drain_launched() noexcept {
  for (auto& bucket : layout_.buckets()) {
    if (bucket->future) bucket->future->wait();
  }
  usage_.drain();
}

void Reducer::discard_step() {
  drain_launched();
  reset_step();
  usage_.discard_step();
}

}  // namespace pycomm::reducer
