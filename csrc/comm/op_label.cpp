// Labels of bucket collectives (see op_label.h).
#include "comm/op_label.h"

#include <sstream>

namespace pycomm::comm {

bool same_label(const OpLabel& a, const OpLabel& b) {
  if (!a.labelled() || !b.labelled()) return true;
  return a.bucket == b.bucket && a.forwards == b.forwards;
}

std::string describe(const OpLabel& label) {
  std::ostringstream out;
  out << "bucket " << label.bucket << " of its synchronized step " << label.step << ", after "
      << label.forwards << " forward(s) with grad enabled since its last synchronized backward";
  return out.str();
}

const char* const kLabelsDifferHint =
    "a rank skipped a backward, ran a no_sync micro-step the others did not, or ran a forward "
    "with grad enabled that the others did not (evaluate under torch.no_grad())";

}  // namespace pycomm::comm
