// Host side of the sm90 launchers (mla_decode_sm90.cu, gemv_sm90.cu): a kernel launch through
// cudaLaunchKernelEx with programmatic dependent launch (PDL) on request, and the environment
// switches that decide it. The switches are read at each launch; a CUDA graph keeps what its
// capture saw.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace kimi_ops::sm90 {
namespace {

// Whether the environment variable `name` is set to exactly `value`.
bool env_equals(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// KIMI_OPS_PDL=0 turns PDL off for every kernel of the library (the Triton kernels too:
// kimi_ops/kernels/pdl.py).
bool pdl_env_allows() { return !env_equals("KIMI_OPS_PDL", "0"); }

// kernel<<<grid, threads, smem, stream>>>(params); with `pdl`, the launch may start while the
// kernels before it on the stream finish (cudaLaunchAttributeProgrammaticStreamSerialization): the
// kernel must wait for them (ptx.cuh: wait_prior_grid) before it reads what they write.
template <typename Params>
void launch(void (*kernel)(const Params), dim3 grid, unsigned threads, size_t smem, cudaStream_t stream,
            const Params& params, bool pdl) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace
}  // namespace kimi_ops::sm90
