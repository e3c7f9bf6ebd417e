// Python bindings of the reducer (pycomm._C.Reducer, pycomm._C.assign_buckets).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace pycomm {
void bind_reducer(pybind11::module& m);
}  // namespace pycomm
