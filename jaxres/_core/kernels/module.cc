// The Python module `jaxres._core.kernels._kernels`: the FFI handlers that the kernel
// files registered (registration.h), by target name; jaxres/_core/kernels/native.py
// registers them with XLA.
//
// The kernels live beside what they accelerate: the shared claims and row kernels in
// shared.cc, each storage's in its folder under jaxres/_core/storages/.

#include <Python.h>

#include <vector>

#include "registration.h"

std::vector<jaxres::Kernel>& jaxres::Kernels() {
  static std::vector<Kernel> kernels;
  return kernels;
}

namespace {

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* targets = PyDict_New();
  for (const jaxres::Kernel& kernel : jaxres::Kernels()) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(kernel.handler), nullptr, nullptr);
    PyDict_SetItemString(targets, kernel.target, capsule);
    Py_DECREF(capsule);
  }
  return targets;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "The FFI handlers of this module, by target name, as capsules."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels", "CPU kernels of jaxres tables (XLA FFI).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kModule); }

