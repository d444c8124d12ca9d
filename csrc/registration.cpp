// kimi_ops._C: the compiled half of kimi_ops.
//
// Importing kimi_ops._C loads this library, whose static initializers register
// its ops with the dispatcher (torch.ops.kimi_ops.*). The public ops are
// defined in Python (kimi_ops/ops.py); this library adds private ops that the
// Python dispatch layer (kimi_ops/dispatch.py) calls for the `cuda` backend:
// _build_info always, and on a CUDA build the Hopper ops of csrc/sm90/ (schemas here, their CUDA
// kernels bound by csrc/sm90/ops.h's impl_sm90_ops; the tensors' layouts there).

#include <Python.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>

#if !defined(USE_ROCM)
#include "sm90/ops.h"
#endif

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

#if !defined(USE_ROCM)
TORCH_LIBRARY_FRAGMENT(kimi_ops, m) {
  m.def(
      "_mla_decode_splitkv_sm90(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? seq_lens, int qlen, float qk_scale_log2, float kv_scale, int num_splits, int dcp_rank, "
      "int dcp_world_size, int rows_per_cta, int stages, int balance_ctas, bool zero_empty, "
      "Tensor? q_scale=None, bool constant_kv=False) -> (Tensor, Tensor)");
  m.def(
      "_mla_decode_sm90(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? seq_lens, int qlen, float qk_scale_log2, float kv_scale, int num_splits, int dcp_rank, "
      "int dcp_world_size, int rows_per_cta, int stages, int balance_ctas, Tensor? q_scale=None, "
      "bool constant_kv=False) -> (Tensor, Tensor)");
  m.def("_mla_merge_sm90(Tensor o_part, Tensor lse_part) -> (Tensor, Tensor)");
  m.def("_gemv_sm90(Tensor x, Tensor w, Tensor? w_scale_inv, int block_n, bool constant_w=False) -> Tensor");
  m.def(
      "_norm_q_b_sm90(Tensor q_c, Tensor kv_c, Tensor k_pe, Tensor q_norm_weight, Tensor kv_norm_weight, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor w, Tensor? w_scale_inv, Tensor? g, int block_n, "
      "float eps, float kv_scale, bool constant_w=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kimi_ops, CUDA, m) {
  kimi_ops::sm90::impl_sm90_ops(m);
  kimi_ops::sm90::impl_sm90_gemv_ops(m);
}
#endif

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "kimi_ops compiled ops", -1, nullptr};
  return PyModule_Create(&module);
}
