// The launch contract shared by the flash-attention kernels (flash256/, flash512/,
// flash256_sm90/, flash512_sm90/) and their FFI handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mila {

// q [B, T, Hq, D], k and v [B, S, Hkv, D], o [B, T, Hq, D]: bf16, contiguous.
// lse [B, Hq, T] fp32 (may be null). Query head n reads KV head n / (Hq / Hkv).
// Query i sits at position *q_offset + i, key j at *kv_offset + j (device scalars, so
// chunked prefill never recompiles). Head dim 512 also takes keys in kv_segments equal
// segments of L = s / kv_segments slots, slot seg * L + j at position kv_offset[seg] + j
// (kv_offset then points at kv_segments device ints; common/key_tiles.cuh); the other
// kernels take kv_segments == 1. With causal, key j is visible to query i when
// k_pos <= q_pos; with window > 0 also when q_pos - k_pos < window. A row with no
// visible key writes zeros to o and -inf to lse.
struct AttentionParams {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  __nv_bfloat16* o;
  float* lse;  // nullable
  const int32_t* q_offset;   // device scalar
  const int32_t* kv_offset;  // device scalar, or kv_segments of them
  int kv_segments;           // >= 1, divides s
  int batch, t, s, hq, hkv;
  float scale;
  bool causal;
  int window;  // 0: no window
};

cudaError_t LaunchFlashAttentionD256(const AttentionParams& p, cudaStream_t stream);
cudaError_t LaunchFlashAttentionD512(const AttentionParams& p, cudaStream_t stream);

}  // namespace mila
