// A synchronized step's label exchanged over the group itself, for groups whose backend
// cannot compare labels (Gloo, the hierarchy across hosts).
// See Note [Step labels over the group] in step_label.cpp.
#pragma once

#include <ATen/ATen.h>

#include "comm/op_label.h"

namespace pycomm::comm {

// Elements (int64) of the exchange in a group of `world` ranks.
int64_t step_label_elements(int world);

// What this rank all-reduces (sum): zeros, and its record of `label` in its own slot.
at::Tensor step_label_tensor(int world, int rank, const OpLabel& label);

// After the sum: compare every rank's record with this rank's and throw
// (c10::DistBackendError) naming both ranks and what each was at when two differ. Every
// rank reads the same sums, so every rank throws.
void check_step_label(const at::Tensor& sums, int rank, const OpLabel& label);

}  // namespace pycomm::comm
