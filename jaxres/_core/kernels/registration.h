// The kernels' registry: every kernel file registers its FFI handlers here by target name
// (JAXRES_REGISTER_KERNEL, run when the library loads), and module.cc hands them all to
// Python, where jaxres/_core/kernels/native.py registers them with XLA for the CPU. A new
// kernel file (a storage folder's kernels.cc) touches nothing outside its own folder.

#ifndef JAXRES_CORE_KERNELS_REGISTRATION_H_
#define JAXRES_CORE_KERNELS_REGISTRATION_H_

#include <vector>

#include "xla/ffi/api/c_api.h"

namespace jaxres {

struct Kernel {
  const char* target;  // the custom call's name, "jaxres_..."
  XLA_FFI_Handler* handler;
};

// Every registered kernel (defined in module.cc).
std::vector<Kernel>& Kernels();

struct RegisterKernel {
  RegisterKernel(const char* target, XLA_FFI_Handler* handler) { Kernels().push_back({target, handler}); }
};

}  // namespace jaxres

// Registers `handler` (defined by XLA_FFI_DEFINE_HANDLER_SYMBOL) as the CPU kernel of `target`.
#define JAXRES_REGISTER_KERNEL(target, handler) \
  static const ::jaxres::RegisterKernel jaxres_register_##handler(target, handler)

#endif  // JAXRES_CORE_KERNELS_REGISTRATION_H_
