// Launch entry of the Hopper (sm_90a) head-dim-256 flash attention (flash256_sm90.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"

namespace mila {

// Same contract as LaunchFlashAttentionD256 (common/attention_params.h), plus: the device
// must be compute capability 9.0 (else cudaErrorInvalidDeviceFunction) and Hq / Hkv must
// divide 64 (else cudaErrorInvalidConfiguration; jax_mila/ffi/attention.py routes only
// such calls here).
cudaError_t LaunchFlashAttentionD256Sm90(const AttentionParams& p, cudaStream_t stream);

}  // namespace mila
