// Launch entry of the Hopper (sm_90a) head-dim-512 flash attention (flash512_sm90.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/attention_params.h"

namespace mila {

// Same contract as LaunchFlashAttentionD512 (common/attention_params.h), plus: the device
// must be compute capability 9.0 (else cudaErrorInvalidDeviceFunction) and Hq / Hkv must
// divide 64 (else cudaErrorInvalidConfiguration; jax_mila/ffi/attention.py routes only
// such calls here).
cudaError_t LaunchFlashAttentionD512Sm90(const AttentionParams& p, cudaStream_t stream);

// The same, except that the scores read K only in its column blocks [0:64] and [256:320] (the
// ones Gemma 4's proportional RoPE rotates) and V in all others: jax_mila.ffi.flash_attention
// with rotary_keys_only=64 (reference.keys_except_rotary). flash512_sm90_seesaw.cu: the two
// consumers alternate tiles, so one's softmax overlaps the other's wgmmas.
cudaError_t LaunchFlashAttentionD512Sm90RotaryKeys(const AttentionParams& p, cudaStream_t stream);

}  // namespace mila
