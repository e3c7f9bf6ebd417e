// Step labels over the group (see step_label.h).
#include "comm/step_label.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace pycomm::comm {

// Note [Step labels over the group]
// pycomm's shared-memory backend compares every bucket collective's label with its peers'
// in shared memory (See Note [Collective identity] in shm/collectives.cpp). A Gloo group,
// and the hierarchy's Gloo phase across hosts, pair collectives by issue order alone: a
// rank that skipped a backward all-reduces its step 2 with the others' step 1, and every
// rank finishes with averaged gradients of different steps.
//
// So on those groups each synchronized step exchanges its label once: just before the
// step's first bucket collective, each rank sum-all-reduces a small int64 vector, zeros but
// for its own slot [1, bucket, forwards, step]; afterwards slot r holds rank r's label
// exactly. The first bucket's future completes only after this exchange, and fails when
// two ranks' labels differ (same_label), so every rank raises at that bucket, before any
// param.grad is written. A joined rank's shadow sends zeros (no label).
//
// Why not inside each bucket's all-reduce (a tail of extra elements, no extra
// collective): the tail moves the boundaries of Gloo's ring chunks, so at 3 ranks and
// more the order of the sums changes and the gradients stop being bitwise equal to
// torch's DDP (tried: 1.2e-10 apart at 3 ranks). One exchange per step suffices: within a
// step every rank launches the same buckets in the same order (See Note [Bucket order] in
// reducer/launch.cpp), so ranks can only fall out of line between steps.
//
// Cost: one all-reduce of 32 bytes per rank per step, started asynchronously behind the
// step's first bucket, one read of it when that bucket completes. GPU buckets (NCCL)
// exchange nothing: reading the sums would synchronize the stream every step.
namespace {

constexpr int64_t kRecord = 4;  // present, bucket, forwards, step

OpLabel read(const int64_t* in) { return OpLabel{in[1], in[2], in[3]}; }

}  // namespace

int64_t step_label_elements(int world) { return kRecord * world; }

at::Tensor step_label_tensor(int world, int rank, const OpLabel& label) {
  TORCH_CHECK(rank >= 0 && rank < world, "step label: rank ", rank, " is not in a group of ",
              world);
  at::Tensor out = at::zeros({step_label_elements(world)}, at::kLong);
  int64_t* slot = out.mutable_data_ptr<int64_t>() + kRecord * rank;
  slot[0] = 1;
  slot[1] = label.bucket;
  slot[2] = label.forwards;
  slot[3] = label.step;
  return out;
}

void check_step_label(const at::Tensor& sums, int rank, const OpLabel& label) {
  const int64_t* in = sums.const_data_ptr<int64_t>();
  const int world = static_cast<int>(sums.numel() / kRecord);
  for (int p = 0; p < world; ++p) {
    const int64_t* theirs = in + kRecord * p;
    if (p == rank || theirs[0] == 0) continue;  // no label: a joined rank's shadow
    TORCH_CHECK_WITH(DistBackendError, theirs[0] == 1, "pycomm DDP bucket ", label.bucket,
                     " (rank ", rank, "): rank ", p, "'s step label arrived as ", theirs[0],
                     " copies: the ranks did not all-reduce the same thing here");
    const OpLabel other = read(theirs);
    TORCH_CHECK_WITH(DistBackendError, same_label(label, other), "pycomm DDP bucket ", label.bucket,
                     " (rank ", rank, "): ranks ", rank, " and ", p,
                     " are in different collectives: rank ", rank, " is at ", describe(label),
                     ", rank ", p, " at ", describe(other), ": ", kLabelsDifferHint);
  }
}

}  // namespace pycomm::comm
