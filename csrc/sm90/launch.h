// Host side of the sm90 launchers (mla_decode_sm90.cu, gemv_sm90.cu): a kernel launch through
// cudaLaunchKernelEx with programmatic dependent launch (PDL) and thread-block clusters on request,
// a kernel's dynamic shared-memory limit, a device attribute, and the environment switches' readers
// (those that decide PDL among them). The switches are read at each launch; a CUDA graph keeps what
// its capture saw.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kimi_ops::sm90 {
namespace {

// Whether the environment variable `name` is set to exactly `value`.
bool env_equals(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

// The environment variable `name` as a non-negative integer (a negative one: 0), or `fallback`
// when it is unset or empty.
int env_nonnegative_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::max(0, std::atoi(v)) : fallback;
}

// KIMI_OPS_PDL=0 turns PDL off for every kernel of the library (the Triton kernels too:
// kimi_ops/kernels/pdl.py).
bool pdl_env_allows() { return !env_equals("KIMI_OPS_PDL", "0"); }

// An attribute of the current device (the SM count, the shared memory a SM has).
int current_device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// Raises kKernel's dynamic shared-memory limit to `smem` bytes where the current device's is lower
// (a per-function, per-context attribute: each kernel instance keeps its own `configured`).
template <auto kKernel>
void allow_dynamic_smem(size_t smem) {
  static size_t configured[64] = {};  // per device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || configured[device] < smem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    if (device < 64) configured[device] = smem;
  }
}

// kernel<<<grid, threads, smem, stream>>>(params); with `pdl`, the launch may start while the
// kernels before it on the stream finish (cudaLaunchAttributeProgrammaticStreamSerialization): the
// kernel must wait for them (ptx.cuh: wait_prior_grid) before it reads what they write. cluster_y > 1:
// thread-block clusters of (1, cluster_y, 1) CTAs (grid.y a multiple of it).
template <typename Params>
void launch(void (*kernel)(const Params), dim3 grid, unsigned threads, size_t smem, cudaStream_t stream,
            const Params& params, bool pdl, unsigned cluster_y = 1) {
  cudaLaunchAttribute attr[2];
  unsigned n_attrs = 0;
  if (pdl) {
    attr[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_y > 1) {
    attr[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[n_attrs].val.clusterDim.x = 1;
    attr[n_attrs].val.clusterDim.y = cluster_y;
    attr[n_attrs++].val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n_attrs;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace
}  // namespace kimi_ops::sm90
