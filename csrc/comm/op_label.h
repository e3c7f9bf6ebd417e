// What a DDP bucket's collective reduces, as the reducer knows it: handed to a backend that
// can compare it across ranks (See Note [Collective identity] in shm/collectives.cpp).
#pragma once

#include <cstdint>

namespace pycomm::comm {

struct OpLabel {
  int64_t bucket = -1;   // the bucket's index; -1: not a bucket's collective
  int64_t forwards = 0;  // forwards with grad enabled since the last synchronized backward
  int64_t step = 0;      // synchronized backwards this rank finished before this one
  bool labelled() const { return bucket >= 0; }
};

}  // namespace pycomm::comm
