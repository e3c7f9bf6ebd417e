// The reducer's plan: what it does with each bucket, decided once (See Note [The reducer's
// plan]).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/wire.h"
#include "reducer/bucket.h"
#include "reducer/comm_hook.h"

namespace pycomm::reducer {

// Note [The reducer's plan]
// Everything about a step that does not depend on the step's gradients is decided once,
// into one Plan, by the reducer itself (Reducer::replan): when it is built, when its
// buckets are rebuilt, and when what reduces them changes: a communication hook registered,
// a sharder attached (whole, in one call: Reducer::attach_sharding), a bucket callback or
// the launch gate added. Those are configuration, made before training or between steps;
// nothing sets a mode piece by piece afterwards. A step then only checks what depends on
// its own gradients: whether two of them share memory (the whole step goes through the
// buffers; Note [Gradients reduced in place] in in_place.cpp), and per gradient whether it
// qualifies to stay where it is.
//
//   DDPConfig --(options, once)--> Reducer --replan()--> Plan --> each step's bucket paths
//   sharder ---(attach_sharding: mode, hooks)---^
//   comm hook, bucket callbacks, launch gate ----^

// Who keeps the reduced gradients (pycomm.ZeroRedundancyOptimizer's modes; Note [Sharding
// on the reducer] in pycomm/zero/binding.py).
enum class Sharding : uint8_t {
  kNone,            // every rank, in param.grad (torch's DDP): no sharder attached
  kOptimizerState,  // every rank, in param.grad; a sharder steps its shard of them
  kReleased,        // a sharder's hook keeps the rank's range of each bucket
};

const char* sharding_name(Sharding sharding);

struct Plan {
  Sharding sharding = Sharding::kNone;
  // What reduces the buckets: the default all-reduce, a user's hook (in Python), or a
  // sharder's reduce-scatter (in C++: Note [Shards kept in C++] in shard_hook.h).
  Reduction reduction = Reduction::kAllreduce;
  // What the bucket all-reduce sends across hosts; nullopt while a hook reduces buckets.
  std::optional<comm::Wire> wire;
  // Each gradient is dropped once in its bucket, the bucket's storage freed after its hook
  // kept its range (Note [Released gradients] in launch.cpp): kReleased without
  // grad_reduce_dtype (whose buckets hold no_sync's wide sums from step to step).
  bool releases = false;
  // The reducer averages (scales by 1/world) and the collective only sums; otherwise the
  // hook averages (torch's hooks do).
  bool reducer_averages = true;
  // ... and it scales as it copies each gradient into its bucket (not with a launch gate,
  // which scales all buckets at once, nor batched_grad_copy, which divides the bucket).
  bool divides_in_copy = true;
  // Per bucket, its path unless this step's gradients send it through its buffer (Note
  // [Bucket paths] in bucket.h).
  std::vector<BucketPath> paths;
  // Whether any path reduces in place (a step then checks its gradients for shared memory).
  bool any_in_place = false;
};

const char* path_name(BucketPath path);

}  // namespace pycomm::reducer
