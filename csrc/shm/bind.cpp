// Python face of the shared-memory backend: pycomm._C.ShmBackend, a subclass of torch's
// c10d Backend type, built by pycomm/shm.py's creator after the store rendezvous.
#include "shm/bind.h"

#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "shm/backend.h"
#include "shm/hier.h"
#include "shm/segment.h"
#include "shm/wire_codec.h"

namespace pycomm {

namespace {

// ShmBackend.flight_record(): the entries as the dicts pycomm.shm.flight_record documents.
pybind11::list flight_record_dicts(const shm::ShmBackend& backend) {
  namespace py = pybind11;
  static const char* states[] = {"queued", "started", "completed", "failed"};
  py::list out;
  for (const shm::FlightEntry& e : backend.flight_record()) {
    py::dict d;
    d["seq"] = e.seq;
    d["op"] = e.op;
    d["bytes"] = e.bytes;
    d["dtype"] = e.dtype == c10::ScalarType::Undefined ? "" : shm::dtype_name(e.dtype);
    d["bucket"] = e.label.bucket;
    d["forwards"] = e.label.forwards;
    d["step"] = e.label.step;
    d["state"] = states[static_cast<int>(e.state)];
    d["queued_ns"] = e.queued_ns;
    d["started_ns"] = e.started_ns;
    d["ended_ns"] = e.ended_ns;
    d["error"] = e.error;
    out.append(std::move(d));
  }
  return out;
}

void bind_hier(pybind11::module& m);

// Note [Destroyed without the GIL]
// A backend's destructor stops its lanes and waits for their worker threads, and a worker
// that drops the last reference to a finished operation's tensors takes the GIL to release
// their Python objects: a destructor run with the GIL held waits for ever. It runs so when
// Python drops the last reference, which since torch 2.14 is the usual end of a group's
// backend: a c10d::Backend keeps its Python object while it lives, and the group's
// destructor ends the backend through it (seen: a rank of the hierarchical group hung at
// exit in 1 run of 5 of tests/hosts' collectives benchmark). pybind11 3 releases the GIL
// around the destructor when the class asks. Earlier pybind11 (older torch) cannot; there a
// group drops its backend without the GIL, and only a backend Python held last is exposed.
template <typename Class>
Class bind_backend(pybind11::module& m, const char* name, const char* doc) {
#if PYBIND11_VERSION_MAJOR >= 3
  return Class(m, name, doc, pybind11::release_gil_before_calling_cpp_dtor());
#else
  return Class(m, name, doc);
#endif
}

}  // namespace

void bind_shm(pybind11::module& m) {
  namespace py = pybind11;
  // The base type is registered by torch.distributed's C extension.
  py::module::import("torch.distributed");
  // How the error of a /dev/shm too small for a new group's segment starts (pycomm.shm).
  m.attr("SHM_NO_SPACE") = shm::kNoSpaceMessage;
  bind_backend<py::class_<shm::ShmBackend, c10d::Backend, c10::intrusive_ptr<shm::ShmBackend>>>(
      m, "ShmBackend", "c10d backend over a shared-memory segment (see pycomm/shm.py)")
      .def(py::init([](const std::string& name, int rank, int size, int64_t timeout_ms,
                       bool create) {
             return c10::make_intrusive<shm::ShmBackend>(name, rank, size,
                                                         std::chrono::milliseconds(timeout_ms),
                                                         create);
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"), py::arg("timeout_ms"),
           py::arg("create"), py::call_guard<py::gil_scoped_release>())
      .def("allreduce_inline", &shm::ShmBackend::allreduce_inline, py::arg("tensor"), py::arg("op"),
           py::call_guard<py::gil_scoped_release>(),
           "A blocking all_reduce in place with no Work (see pycomm.shm.all_reduce).")
      .def(
          "allreduce_pieces",
          [](shm::ShmBackend& b, std::vector<at::Tensor> tensors, double scale, int64_t bucket,
             int64_t forwards, int64_t step) {
            b.allreduce_pieces(std::move(tensors), scale, comm::OpLabel{bucket, forwards, step})
                ->wait();
          },
          py::arg("tensors"), py::arg("scale"), py::arg("bucket") = -1, py::arg("forwards") = 0,
          py::arg("step") = 0, py::call_guard<py::gil_scoped_release>(),
          "Blocking: sum all-reduce of `tensors` as one buffer, each rank's elements times "
          "`scale` first, results in place (the reducer's path; See Note [Pieces all-reduce]), "
          "labelled as the reducer labels a bucket's (See Note [Collective identity]).")
      .def(
          "reduce_scatter_pieces",
          [](shm::ShmBackend& b, std::vector<at::Tensor> tensors, double scale, at::Tensor out,
             int64_t bucket, int64_t forwards, int64_t step) {
            b.reduce_scatter_pieces(std::move(tensors), scale, std::move(out),
                                    comm::OpLabel{bucket, forwards, step})
                ->wait();
          },
          py::arg("tensors"), py::arg("scale"), py::arg("out"), py::arg("bucket") = -1,
          py::arg("forwards") = 0, py::arg("step") = 0, py::call_guard<py::gil_scoped_release>(),
          "Blocking: sum reduce-scatter of `tensors` as one buffer, each rank's elements times "
          "`scale` first, into `out`: this rank's range, then the tail every rank gets (the "
          "sharded optimizer's path; See Note [Pieces reduce-scatter]).")
      .def(
          "allreduce_sum",
          [](shm::ShmBackend& b, at::Tensor tensor, int64_t bucket, int64_t forwards,
             int64_t step) {
            b.allreduce_sum(std::move(tensor), comm::OpLabel{bucket, forwards, step})->wait();
          },
          py::arg("tensor"), py::arg("bucket") = -1, py::arg("forwards") = 0, py::arg("step") = 0,
          py::call_guard<py::gil_scoped_release>(),
          "Blocking: sum all-reduce of `tensor` in place, labelled as the reducer labels a "
          "bucket's (See Note [Collective identity]).")
      .def("stats", &shm::ShmBackend::stats,
           "Counters since the group was created (see pycomm.shm.stats).")
      .def("flight_record", &flight_record_dicts,
           "This rank's last operations on the group, oldest first (see "
           "pycomm.shm.flight_record).")
      .def("dump_flight_record", &shm::ShmBackend::dump_flight_record, py::arg("path"),
           py::call_guard<py::gil_scoped_release>(), "Write the flight record to `path` (JSON).")
      .def("flight_record_name", &shm::ShmBackend::flight_record_name,
           "The file name of this rank's record in a directory.")
      .def_static("unlink", &shm::Segment::unlink, py::arg("name"),
                  "Remove segment `name` from /dev/shm (mappings stay valid).");
  bind_hier(m);
}

namespace {

// A Work's future as Python's torch.futures.Future (the GIL held).
pybind11::object future_object(const comm::WorkPtr& work) {
  return torch::jit::toPyObject(c10::IValue(work->getFuture()));
}

// A wire collective's `wire` (a pycomm.Wire, or its name, parsed here: a misspelt one is
// DDPConfig's ValueError), with error feedback switched on by `error_feedback` as well.
comm::Wire wire_arg(const pybind11::handle& wire, bool error_feedback) {
  const comm::Wire parsed = pybind11::isinstance<pybind11::str>(wire)
                                ? comm::Wire::parse(wire.cast<std::string>(), false)
                                : wire.cast<comm::Wire>();
  return error_feedback ? comm::Wire::of(parsed.dtype, true) : parsed;
}

void bind_hier(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<comm::WireResidual, std::shared_ptr<comm::WireResidual>>(
      m, "WireResidual",
      "The error-feedback residuals of one tensor's low-precision all-reduces, kept from one "
      "call to the next (Note [Low-precision wire] in csrc/shm/wire_codec.h)")
      .def(py::init<>())
      .def_property_readonly(
          "sent", [](const comm::WireResidual& r) { return r.sent; },
          "what the wire lost of this rank's share when it sent it (empty before the first)")
      .def_property_readonly(
          "summed", [](const comm::WireResidual& r) { return r.summed; },
          "what the wire lost of the sums this rank formed");
  m.def(
      "wire_bytes",
      [](const py::handle& wire, int64_t n) {
        return shm::wire_bytes(wire_arg(wire, false).dtype, n);
      },
      py::arg("wire"), py::arg("n"), "bytes n float32 values take in the wire's form");
  bind_backend<py::class_<shm::HierBackend, c10d::Backend, c10::intrusive_ptr<shm::HierBackend>>>(
      m, "HierBackend",
      "c10d backend of a group over several hosts: all-reduce, reduce_scatter_tensor and "
      "all_gather_into_tensor hierarchically (shared memory within a host, `cross` across "
      "hosts), the rest on `flat` (see csrc/shm/hier.h). ranks[h][l]: the group rank of "
      "host h's local rank l; `wire`: what its reduce-scatters send across hosts (Note [A "
      "group's wire])")
      .def(py::init([](int rank, int size, int host, std::vector<std::vector<int>> ranks,
                       c10::intrusive_ptr<shm::ShmBackend> local,
                       c10::intrusive_ptr<c10d::Backend> cross,
                       c10::intrusive_ptr<c10d::Backend> flat, const comm::Wire& wire) {
             return c10::make_intrusive<shm::HierBackend>(rank, size, host, std::move(ranks),
                                                          std::move(local), std::move(cross),
                                                          std::move(flat), wire);
           }),
           py::arg("rank"), py::arg("size"), py::arg("host"), py::arg("ranks"), py::arg("local"),
           py::arg("cross"), py::arg("flat"), py::arg("wire") = comm::Wire{})
      .def_property_readonly("wire", &shm::HierBackend::wire,
                             "what the group's reduce-scatters send across hosts (a pycomm.Wire)")
      .def_static("check_group_wire", &shm::HierBackend::check_group_wire, py::arg("wire"),
                  "a ValueError unless `wire` can be a group's (pycomm.shm.Options.wire)")
      .def_property_readonly("host", &shm::HierBackend::host, "this rank's host (0-based)")
      .def_property_readonly("hosts", &shm::HierBackend::hosts, "the number of hosts")
      .def_property_readonly("local", &shm::HierBackend::local,
                             "the shared-memory group of this rank's host")
      .def(
          "allreduce_wire",
          [](shm::HierBackend& b, at::Tensor tensor, const py::handle& wire, bool error_feedback,
             std::shared_ptr<comm::WireResidual> residual, bool async_op) -> py::object {
            const comm::Wire sent = wire_arg(wire, error_feedback);
            comm::WorkPtr work;
            {
              py::gil_scoped_release nogil;
              work = b.allreduce_wire(std::move(tensor), sent, std::move(residual));
              if (!async_op) work->wait();
            }
            return async_op ? future_object(work) : py::none();
          },
          py::arg("tensor"), py::arg("wire"), py::arg("error_feedback") = false,
          py::arg("residual") = nullptr, py::arg("async_op") = false,
          "Sum all-reduce of `tensor` in place whose cross-host leg carries `wire` (a "
          "pycomm.Wire, or 'fp32', 'bf16', 'int8') with float32 sums (Note [Low-precision wire]); "
          "returns when it is "
          "done, or with async_op a torch.futures.Future of it. "
          "error_feedback (int8) keeps its residuals in `residual` (a WireResidual) from one "
          "call to the next")
      .def(
          "reduce_scatter_wire",
          [](shm::HierBackend& b, at::Tensor output, at::Tensor input, const py::handle& wire,
             bool error_feedback, std::shared_ptr<comm::WireResidual> residual,
             bool async_op) -> py::object {
            const comm::Wire sent = wire_arg(wire, error_feedback);
            comm::WorkPtr work;
            {
              py::gil_scoped_release nogil;
              work = b.reduce_scatter_wire(std::move(output), std::move(input), sent,
                                           std::move(residual));
              if (!async_op) work->wait();
            }
            return async_op ? future_object(work) : py::none();
          },
          py::arg("output"), py::arg("input"), py::arg("wire"), py::arg("error_feedback") = false,
          py::arg("residual") = nullptr, py::arg("async_op") = false,
          "Sum reduce_scatter_tensor of `input` into `output` whose cross-host all-to-all "
          "carries `wire` (a pycomm.Wire, or 'fp32', 'bf16', 'int8'): each host's sums of this "
          "rank's range "
          "cross once, encoded, and are added in float32 (Note [Low-precision wire]); returns "
          "when it is done, or with async_op a torch.futures.Future of it. error_feedback "
          "(int8) keeps its residuals in `residual` (a WireResidual)")
      .def_property("piece_bytes", &shm::HierBackend::piece_bytes,
                    &shm::HierBackend::set_piece_bytes,
                    "bytes per rank that cross hosts per step of the pipelines (See Note "
                    "[Hierarchical pipeline]); every rank of the group must set the same");
}

}  // namespace

}  // namespace pycomm
