// The Python extension: hands JAX one capsule per FFI target and platform.
#include <nanobind/nanobind.h>

#include "common/targets.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

#define JAXNORM_DECLARE(platform, name) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(platform##_##name);
#define JAXNORM_DECLARE_CPU(name) JAXNORM_DECLARE(cpu, name)
JAXNORM_FFI_TARGETS(JAXNORM_DECLARE_CPU)
#ifdef JAXNORM_WITH_CUDA
#define JAXNORM_DECLARE_CUDA(name) JAXNORM_DECLARE(cuda, name)
JAXNORM_CUDA_FFI_TARGETS(JAXNORM_DECLARE_CUDA)
#endif

namespace {

nb::capsule capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict cpu_targets() {
  nb::dict d;
#define JAXNORM_ADD_CPU(name) d[#name] = capsule(cpu_##name);
  JAXNORM_FFI_TARGETS(JAXNORM_ADD_CPU)
  return d;
}

nb::dict cuda_targets() {
  nb::dict d;
#ifdef JAXNORM_WITH_CUDA
#define JAXNORM_ADD_CUDA(name) d[#name] = capsule(cuda_##name);
  JAXNORM_CUDA_FFI_TARGETS(JAXNORM_ADD_CUDA)
#endif
  return d;
}

}  // namespace

NB_MODULE(_jaxnorm, m) {
  m.doc() = "XLA FFI handlers of jaxnorm's kernels.";
  m.def("cpu_targets", &cpu_targets, "FFI target name -> CPU handler capsule.");
  m.def("cuda_targets", &cuda_targets,
        "FFI target name -> CUDA handler capsule (empty without CUDA).");
  m.attr("xla_ffi_api_version") =
      nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
