// The reducer's plan, decided once (See Note [The reducer's plan] in plan.h).
#include "reducer/plan.h"

#include "reducer/reducer.h"

namespace pycomm::reducer {

const char* sharding_name(Sharding sharding) {
  switch (sharding) {
    case Sharding::kNone: return "none";
    case Sharding::kOptimizerState: return "optimizer_state";
    case Sharding::kReleased: return "released";
  }
  return "?";
}

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::kAllreduce: return "allreduce";
    case Reduction::kPythonHook: return "python_hook";
    case Reduction::kShardKeep: return "shard_keep";
  }
  return "?";
}

const char* path_name(BucketPath path) {
  switch (path) {
    case BucketPath::kBuffer: return "buffer";
    case BucketPath::kInPlace: return "in_place";
    case BucketPath::kReleased: return "released";
    case BucketPath::kReleasedInPlace: return "released_in_place";
  }
  return "?";
}

void Reducer::replan() {
  plan_.reduction = ext_.hook->reduction();
  const comm::Wire* wire = ext_.hook->wire();
  plan_.wire = wire != nullptr ? std::optional<comm::Wire>(*wire) : std::nullopt;
  plan_.releases = plan_.sharding == Sharding::kReleased && !options_.grad_reduce_dtype.has_value();
  plan_.reducer_averages = ext_.hook->reducer_divides();
  plan_.divides_in_copy = plan_.reducer_averages && !ext_.gate && !options_.batched_grad_copy;
  const bool allowed = in_place_allowed();
  plan_.paths.clear();
  plan_.any_in_place = false;
  for (const auto& bucket : layout_.buckets()) {
    const bool here = allowed && ext_.hook->reduces_in_place_on(bucket->buffer);
    plan_.any_in_place = plan_.any_in_place || here;
    plan_.paths.push_back(plan_.releases
                              ? (here ? BucketPath::kReleasedInPlace : BucketPath::kReleased)
                              : (here ? BucketPath::kInPlace : BucketPath::kBuffer));
  }
}

}  // namespace pycomm::reducer
