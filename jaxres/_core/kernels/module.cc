// The Python module `jaxres._core.kernels._kernels`: the FFI handlers of every
// kernel file, by target name (jaxres/_core/kernels/native.py registers them with XLA).
//
// The kernels live beside what they accelerate: the shared claims and row kernels in
// shared.cc, each storage's in its folder under jaxres/_core/storages/. A new kernel
// declares its handler here and adds it to Targets.

#include <Python.h>

#include "xla/ffi/api/c_api.h"

// Defined with XLA_FFI_DEFINE_HANDLER_SYMBOL in the kernel files.
extern "C" XLA_FFI_Error* JaxresLocate(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresLookup(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresSearch(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresOwner(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresPrefixSum(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresUpsert(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresEvict(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresWriteRows(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresTakeRows(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresGroupSums(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxresReadRows(XLA_FFI_CallFrame* call_frame);

namespace {

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* targets = PyDict_New();
  auto add = [&](const char* name, XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(fn), nullptr, nullptr);
    PyDict_SetItemString(targets, name, capsule);
    Py_DECREF(capsule);
  };
  add("jaxres_locate", JaxresLocate);
  add("jaxres_lookup", JaxresLookup);
  add("jaxres_search", JaxresSearch);
  add("jaxres_owner", JaxresOwner);
  add("jaxres_upsert", JaxresUpsert);
  add("jaxres_prefix_sum", JaxresPrefixSum);
  add("jaxres_evict", JaxresEvict);
  add("jaxres_read_rows", JaxresReadRows);
  add("jaxres_write_rows", JaxresWriteRows);
  add("jaxres_take_rows", JaxresTakeRows);
  add("jaxres_group_sums", JaxresGroupSums);
  return targets;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "The FFI handlers of this module, by target name, as capsules."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels", "CPU kernels of jaxres tables (XLA FFI).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kModule); }

