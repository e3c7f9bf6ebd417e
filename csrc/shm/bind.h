// Python bindings of the shared-memory backend, called once from csrc/module.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace pycomm {

void bind_shm(pybind11::module& m);

}  // namespace pycomm
