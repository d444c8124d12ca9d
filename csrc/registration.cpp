// kimi_ops._C: the compiled half of kimi_ops.
//
// Importing kimi_ops._C loads this library, whose static initializers register
// its ops with the dispatcher (torch.ops.kimi_ops.*). The public ops are
// defined in Python (kimi_ops/ops.py); this library adds private ops that the
// Python dispatch layer (kimi_ops/dispatch.py) calls for the `cuda` backend.

#include <Python.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>

namespace kimi_ops {

// What this build holds: the torch it was built against and the GPU platform.
std::string build_info() {
#if defined(USE_ROCM)
  const char* platform = "ROCm (host registration only; AMD runs the Triton kernels)";
#else
  const char* platform = "CUDA (sm_90a device code)";
#endif
  return std::string("kimi_ops._C for torch ") + std::to_string(TORCH_VERSION_MAJOR) + "." +
         std::to_string(TORCH_VERSION_MINOR) + ", " + platform;
}

}  // namespace kimi_ops

TORCH_LIBRARY_FRAGMENT(kimi_ops, m) {
  m.def("_build_info() -> str", &kimi_ops::build_info);
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "kimi_ops compiled ops", -1, nullptr};
  return PyModule_Create(&module);
}
