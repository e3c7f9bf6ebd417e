// What a collective's Work and a future's callbacks capture of the issuing thread's state.
#pragma once

#include <ATen/ThreadLocalPythonObjects.h>

#include <utility>

namespace pycomm::comm {

// Note [No Python object in a collective's thread state]
// A c10d Work (Gloo's AsyncWork) and every callback added to a c10::ivalue::Future keep a
// copy of the issuing thread's at::ThreadLocalState, and drop it on the thread that
// completes them: Gloo's worker. During a backward that state holds a Python object: torch
// stashes the caller's contextvars.Context in it for the whole backward
// (torch/autograd/graph.py, _engine_run_backward). So the worker that drops the last copy
// takes the GIL to release it. When that happens as the interpreter finalizes (a script
// that ends right after its last step without destroy_process_group), Python ends the
// worker thread (pthread_exit) inside that noexcept destructor, and the process aborts:
// "terminate called without an active exception", SIGABRT, its work done. Core dumps of
// such exits show exactly this stack (~AsyncAllreduceWork -> ~ThreadLocalState ->
// SafePyObject -> gil_scoped_acquire -> take_gil -> pthread_exit). The reducer therefore
// issues its collectives and registers their callbacks with the thread's Python objects
// set aside (this guard, around Reducer::launch_ready_buckets), so what Gloo's threads
// drop is C++ only; the objects are back in place when it returns. Nothing a collective
// runs reads them: they carry Python-side context (contextvars, compiler state) for Python
// code, and the reducer's collectives and callbacks run none. A Python comm hook runs
// inside the guard too, so the collectives it issues capture none either.
class WithoutPythonObjects {
 public:
  WithoutPythonObjects() : saved_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state({});
  }
  ~WithoutPythonObjects() { at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_)); }
  WithoutPythonObjects(const WithoutPythonObjects&) = delete;
  WithoutPythonObjects& operator=(const WithoutPythonObjects&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects saved_;
};

}  // namespace pycomm::comm
