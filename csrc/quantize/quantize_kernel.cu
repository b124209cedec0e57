// The activation quantizer on bf16 rows as they are (the shared row kernel is in
// quantize_rows.cuh).
#include "quantize/quantize_kernel.h"

#include "quantize/quantize_rows.cuh"

namespace mila {
namespace {

struct Bf16Rows {
  using Raw = uint4;
  const uint4* x;
  __device__ __forceinline__ Raw load(int64_t i) const { return __ldg(x + i); }
  __device__ __forceinline__ static uint4 make(const Raw& v) { return v; }
};

}  // namespace

cudaError_t LaunchQuantizeActivations(const __nv_bfloat16* x, uint8_t* q, float* scale,
                                      int64_t rows, int64_t cols, cudaStream_t stream) {
  return quantize_rows::launch(Bf16Rows{reinterpret_cast<const uint4*>(x)}, q, scale, rows, cols,
                               stream);
}

}  // namespace mila
