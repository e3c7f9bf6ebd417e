// What a DDP bucket's collective reduces, as the reducer knows it: handed to a backend that
// can compare it across ranks (See Note [Collective identity] in shm/collectives.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace pycomm::comm {

struct OpLabel {
  int64_t bucket = -1;   // the bucket's index; -1: not a bucket's collective
  int64_t forwards = 0;  // forwards with grad enabled since the last synchronized backward
  int64_t step = 0;      // synchronized backwards this rank finished before this one
  bool labelled() const { return bucket >= 0; }
};

// Whether two ranks' labels may meet in one collective: the same bucket after as many
// forwards. Steps are named, not compared: counts of synchronized backwards may differ
// rightly (the steps a rank shadowed under join() do not count). A collective without a
// label (a joined rank's shadow) meets any.
bool same_label(const OpLabel& a, const OpLabel& b);

// "bucket 0 of its synchronized step 2, after 1 forward(s) with grad enabled since its
// last synchronized backward": what a labelled collective is, for messages.
std::string describe(const OpLabel& label);

// What makes two ranks' labels differ, for the end of the message that names them.
extern const char* const kLabelsDifferHint;

}  // namespace pycomm::comm
