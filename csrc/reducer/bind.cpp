// Python face of the C++ reducer: construction, per-step calls from pycomm/ddp/, comm
// hooks, the bucket callbacks (see BucketCallback in reducer.h) and the timeline dicts.
#include "reducer/bind.h"

#include "reducer/reducer.h"
#include "reducer/shard_hook.h"
#include "reducer/stream_copy.h"

namespace pycomm {

namespace py = pybind11;
using reducer::Bucket;
using reducer::Reducer;

namespace {

py::dict timeline_dict(const reducer::StepTimeline& step, const std::vector<std::string>& names) {
  py::list buckets;
  for (const auto& b : step.buckets) {
    py::dict d;
    d["index"] = b.index;
    d["nbytes"] = b.nbytes;
    d["param_indices"] = b.param_indices;
    d["ready_ns"] = b.ready_ns;
    d["launch_ns"] = b.launch_ns;
    d["done_ns"] = b.done_ns;
    d["in_place"] = b.in_place;
    buckets.append(std::move(d));
  }
  py::dict d;
  d["step"] = step.step;
  d["rank"] = step.rank;
  d["backward_start_ns"] = step.backward_start_ns;
  d["param_ready_ns"] = step.param_ready_ns;
  d["param_names"] = names;
  d["buckets"] = std::move(buckets);
  d["finalize_start_ns"] = step.finalize_start_ns;
  d["finalize_end_ns"] = step.finalize_end_ns;
  d["manual_finalization"] = step.manual_finalization;
  return d;
}

// A Python callable fn(bucket_index: int, buffer: Tensor) as a BucketCallback. The callable
// is kept alive by a shared handle released under the GIL.
reducer::BucketCallback python_bucket_callback(py::function fn) {
  auto holder = std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* f) {
    py::gil_scoped_acquire gil;
    delete f;
  });
  return [holder](Bucket& bucket) {
    py::gil_scoped_acquire gil;
    try {
      (*holder)(bucket.index, bucket.buffer);
    } catch (py::error_already_set& e) {
      std::string what = e.what();
      TORCH_CHECK(false, "bucket callback failed on bucket ", bucket.index, ": ", what);
    }
  };
}

std::vector<std::vector<size_t>> bucket_indices(const Reducer& r) {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : r.buckets()) out.push_back(b->params);
  return out;
}

py::list zeros_like_grad_buckets(const Reducer& r) {
  py::list out;
  for (const auto& b : r.buckets()) {
    out.append(reducer::make_grad_bucket(*b, r.buckets().size(), r.params(),
                                         at::zeros_like(b->buffer)));
  }
  return out;
}

// The reducer's options read from a DDPConfig by field name (See Note [Reducer options]).
reducer::ReducerOptions options_from(const py::handle& config) {
  reducer::ReducerOptions o;
#define PYCOMM_READ_OPTION(type, name)                                                     \
  if (!py::hasattr(config, #name)) {                                                       \
    throw py::attribute_error("Reducer: the config has no field '" #name                   \
                              "' (See Note [Reducer options] in csrc/reducer/reducer.h)"); \
  }                                                                                        \
  o.name = config.attr(#name).cast<type>();
  PYCOMM_REDUCER_OPTIONS(PYCOMM_READ_OPTION)
#undef PYCOMM_READ_OPTION
  return o;
}

py::tuple option_names() {
  py::list names;
#define PYCOMM_OPTION_NAME(type, name) names.append(#name);
  PYCOMM_REDUCER_OPTIONS(PYCOMM_OPTION_NAME)
#undef PYCOMM_OPTION_NAME
  return py::tuple(names);
}

py::dict plan_dict(const Reducer& r) {
  const reducer::Plan& plan = r.plan();
  py::list paths;
  for (const auto path : plan.paths) paths.append(reducer::path_name(path));
  py::dict d;
  d["sharding"] = reducer::sharding_name(plan.sharding);
  d["reduction"] = reducer::reduction_name(plan.reduction);
  d["wire"] = plan.wire.has_value() ? py::cast(*plan.wire) : py::none();
  d["releases"] = plan.releases;
  d["reducer_averages"] = plan.reducer_averages;
  d["paths"] = std::move(paths);
  return d;
}

// Python drops its last reference to a Reducer with the GIL held; ~Reducer may wait on
// launched collectives whose completion runs Python (a comm hook's future callbacks), so
// the GIL is released around the delete, else that wait deadlocks.
struct ReleaseGilDelete {
  void operator()(Reducer* reducer) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      delete reducer;
    } else {
      delete reducer;
    }
  }
};
using ReducerHolder = std::unique_ptr<Reducer, ReleaseGilDelete>;

}  // namespace

void bind_bucket_norms(py::module& m);  // reducer/bucket_norms.cpp
void bind_local_clip(py::module& m);    // reducer/local_clip.cpp

namespace {

// The reducer's module-level functions and constants.
void bind_reducer_functions(py::module& m) {
  m.def("_stream_copy", &reducer::stream_copy, py::arg("dst"), py::arg("src"),
        py::arg("scale") = std::nullopt,
        "The reducer's gradient copy with non-temporal stores (Note [Streaming copies]): "
        "dst = src (* float(scale)); False, touching nothing, where it does not apply.");
  m.attr("_STREAM_COPY_MIN_BYTES") = reducer::kStreamCopyMinBytes;
  m.attr("REDUCER_OPTIONS") = option_names();
  m.def("assign_buckets", &reducer::assign_buckets, py::arg("params"), py::arg("order"),
        py::arg("byte_limits"), py::arg("groups") = std::vector<int64_t>{},
        "Greedy bucket assignment of params (in `order`) per (device, dtype), keeping "
        "gradient groups whole; see bucket.h.");
}

}  // namespace

void bind_reducer(py::module& m) {
  py::enum_<reducer::Sharding>(m, "Sharding",
                               "Who keeps the reduced gradients (See Note [The reducer's plan])")
      .value("NONE", reducer::Sharding::kNone)
      .value("OPTIMIZER_STATE", reducer::Sharding::kOptimizerState)
      .value("RELEASED", reducer::Sharding::kReleased);
  bind_bucket_norms(m);
  bind_local_clip(m);
  reducer::bind_shard_keep(m);
  bind_reducer_functions(m);
  py::class_<Reducer, ReducerHolder>(m, "Reducer",
                                     "pycomm's C++ bucketed gradient reducer (see reducer.h)")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const std::vector<std::vector<size_t>>& assignment,
                       const comm::ProcessGroupPtr& pg, const py::object& config) {
             return ReducerHolder(new Reducer(std::move(params), std::move(names), assignment, pg,
                                              options_from(config)));
           }),
           py::arg("params"), py::arg("names"), py::arg("assignment"), py::arg("process_group"),
           py::arg("config"))
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("prepare_no_sync", &Reducer::prepare_no_sync, py::call_guard<py::gil_scoped_release>())
      .def("rebuild_buckets", &Reducer::rebuild_buckets, py::arg("assignment"))
      .def("should_rebuild_buckets", &Reducer::should_rebuild_buckets)
      .def("note_shadowed_step", &Reducer::note_shadowed_step,
           py::arg("global_used") = std::nullopt)
      .def("tracks_usage", &Reducer::tracks_usage)
      .def("ready_order", &Reducer::ready_order)
      .def("ready_groups", &Reducer::ready_groups)
      .def("bucket_indices", &bucket_indices)
      .def("grad_view", &Reducer::grad_view, py::arg("index"))
      .def("set_divide_factor", &Reducer::set_divide_factor, py::arg("factor"))
      .def("set_peer_hosts", &Reducer::set_peer_hosts, py::arg("hosts"),
           "[(address, 'hostname: ranks ...')] per host, named in failure messages")
      .def(
          "register_comm_hook",
          [](Reducer& r, py::object state, py::object hook) {
            r.set_comm_hook(std::make_unique<reducer::PythonCommHook>(std::move(state),
                                                                      std::move(hook)));
          },
          py::arg("state"), py::arg("hook"),
          "a user's hook (torch's protocol), before the first backward, once")
      .def(
          "attach_sharding",
          [](Reducer& r, reducer::Sharding sharding, std::shared_ptr<reducer::ShardKeep> keep,
             bool final) {
            std::unique_ptr<reducer::CommHook> hook;
            if (keep) hook = std::make_unique<reducer::ShardHook>(std::move(keep), final);
            r.attach_sharding(sharding, std::move(hook));
          },
          py::arg("sharding"), py::arg("keep") = nullptr, py::arg("final") = false,
          "A sharder attaches, whole (See Note [The reducer's plan] in "
          "csrc/reducer/plan.h): its mode, and with Sharding.RELEASED the ShardKeep that "
          "keeps each bucket's range (Note [Shards kept in C++] in "
          "csrc/reducer/shard_hook.h), `final` once its shards are; between steps")
      .def_property_readonly("plan", &plan_dict,
                             "the reducer's plan (See Note [The reducer's plan]): sharding, "
                             "reduction, wire, releases, reducer_averages, and per bucket its path")
      .def("has_comm_hook", &Reducer::has_comm_hook)
      .def("unused_parameters", &Reducer::unused_parameters)
      .def(
          "add_pre_launch",
          [](Reducer& r, py::function fn) {
            r.add_pre_launch(python_bucket_callback(std::move(fn)));
          },
          py::arg("fn"), "fn(bucket_index, bucket_buffer) before the bucket's collective")
      .def(
          "add_post_done",
          [](Reducer& r, py::function fn) {
            r.add_post_done(python_bucket_callback(std::move(fn)));
          },
          py::arg("fn"), "fn(bucket_index, reduced_buffer) when the bucket's collective is done")
      .def_property_readonly("manual_finalization", &Reducer::manual_finalization)
      .def("set_manual_finalization", &Reducer::set_manual_finalization, py::arg("required"),
           "See Note [Manual backward finalization] in csrc/reducer/finalize.cpp")
      .def("should_finalize_after_backward", &Reducer::should_finalize_after_backward)
      .def("finalize_backward_manual", &Reducer::finalize_backward_manual,
           py::call_guard<py::gil_scoped_release>())
      .def("zeros_like_grad_buckets", &zeros_like_grad_buckets)
      .def("step_label_elements", &Reducer::step_label_elements)
      .def_property_readonly("wire", &Reducer::wire,
                             "what the default all-reduce sends across hosts, a pycomm.Wire "
                             "(fp32 where the group spans no hosts); None under a comm hook")
      .def(
          "timelines",
          [](const Reducer& r, size_t n) {
            py::list out;
            for (const auto& step : r.timelines(n)) out.append(timeline_dict(step, r.names()));
            return out;
          },
          py::arg("n") = 1);
}

}  // namespace pycomm
