// Host side of the Hopper kernels' TMA copies: cuTensorMapEncodeTiled, fetched from the driver
// through the runtime (no -lcuda link), and the bf16 tensor map the attention kernels share.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only)
#include <cuda_runtime.h>

#include <cstdint>

namespace mila::tma {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, looked up once per process; nullptr if unavailable.
inline EncodeTiledFn Encoder() {
  static const EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &status);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &ptr, cudaEnableDefault, &status);
#endif
    return (err == cudaSuccess && status == cudaDriverEntryPointSuccess)
               ? reinterpret_cast<EncodeTiledFn>(ptr)
               : nullptr;
  }();
  return fn;
}

// A 4-D bf16 tensor {d0, d1, d2, d3} (row-major, innermost first; d0 * 2 bytes a row) with the
// 128-byte swizzle and box {64, box1, box2, 1}: one box row is one 128-byte swizzle row.
// Out-of-bounds elements read as zeros. False if the driver refuses it.
inline bool EncodeBf16Swizzled(EncodeTiledFn encode, CUtensorMap* map, const void* ptr,
                               uint64_t d0, uint64_t d1, uint64_t d2, uint64_t d3, uint32_t box1,
                               uint32_t box2) {
  const cuuint64_t dims[4] = {d0, d1, d2, d3};
  const cuuint64_t strides[3] = {d0 * 2, d0 * 2 * d1, d0 * 2 * d1 * d2};  // bytes
  const cuuint32_t box[4] = {64, box1, box2, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(ptr), dims, strides,
                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace mila::tma
