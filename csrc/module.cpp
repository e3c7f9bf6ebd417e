// The one Python module of the extension (pycomm._C). Stateless math lives in
// TORCH_LIBRARY ops (csrc/ops.cpp); only stateful C++ objects and the c10d handoff are
// bound here.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include "comm/c10d.h"
#include "comm/shard_split.h"
#include "reducer/bind.h"
#include "shm/bind.h"

namespace pycomm {

// A blocking all-reduce issued from C++ on a ProcessGroup handed over from Python: the
// path pycomm's reducer launches its bucket collectives on.
void allreduce_(const comm::ProcessGroupPtr& pg, at::Tensor tensor, const std::string& op) {
  auto work = comm::start_allreduce(pg, tensor, comm::reduce_op(op));
  pybind11::gil_scoped_release no_gil;
  work->wait();
}

void bind_wire(pybind11::module& m);          // csrc/comm/wire_bind.cpp
void bind_clip(pybind11::module& m);          // csrc/grad/clip_bind.cpp
void bind_sharded_clip(pybind11::module& m);  // csrc/grad/sharded_clip_bind.cpp

}  // namespace pycomm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pycomm's C++ extension: stateful objects and the c10d handoff";
  m.def("_allreduce_", &pycomm::allreduce_, pybind11::arg("process_group"), pybind11::arg("tensor"),
        pybind11::arg("op") = "sum",
        "All-reduce `tensor` in place from C++ on a torch.distributed ProcessGroup and wait.");
  m.def(
      "shard_split",
      [](int64_t n, int64_t world) {
        const auto split = pycomm::comm::shard_split(n, world);
        return pybind11::make_tuple(split.range, split.tail);
      },
      pybind11::arg("n"), pybind11::arg("world"),
      "(range, tail): n elements cut over `world` ranks (See Note [Equal ranges and a tail] "
      "in csrc/comm/shard_split.h).");
  pycomm::bind_wire(m);  // first: the reducer's and the backends' bindings take a Wire
  pycomm::bind_reducer(m);
  pycomm::bind_clip(m);
  pycomm::bind_sharded_clip(m);
  pycomm::bind_shm(m);
  m.attr("cuda") = pybind11::bool_(
#ifdef PYCOMM_WITH_CUDA
      true
#else
      false
#endif
  );
}
