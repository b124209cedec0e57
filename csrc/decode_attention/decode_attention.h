// The launch contract of the decode attention kernels (decode_attention.cu) and their FFI
// handler (decode_attention_ffi.cc). The op's semantics: jax_mila/reference/decode_attention.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mila {

constexpr int kDecodeMaxNewTokens = 16;  // T
constexpr int kDecodeMaxGroups = 16;     // Hq / Hkv
// Query rows (new token x query head of one KV head) per CTA of the split kernel: 16 or 32.
// Calls with more rows (T * Hq / Hkv up to 256) run ceil(rows / 32) CTAs per piece, adjacent in
// the grid so that their K/V reads meet in L2.
constexpr int kDecodeRowsSmall = 16;
constexpr int kDecodeRowsLarge = 32;

// q [B, T, Hq, D] bf16; k, v [B, S, Hkv, D] (bf16 or float8_e4m3fn, `fp8`); kv_len [B] int32 on
// the device; o [B, T, Hq, D] bf16. Row b's query i sits at position kv_len[b] - T + i; slot s
// holds position s, or with `ring` the newest p < kv_len[b] with p % S == s.
// Workspace: o_part [B, Hkv, pieces, M, D] and ml_part [B, Hkv, pieces, M, 2] fp32, M = T * G:
// each piece's unnormalized output, running maximum (log2 units) and sum.
struct DecodeAttentionParams {
  const __nv_bfloat16* q;
  const void* k;
  const void* v;
  const int32_t* kv_len;
  __nv_bfloat16* o;
  float* o_part;
  float* ml_part;
  int batch, t, hq, hkv, s, d;
  int groups;      // Hq / Hkv
  int rows;        // M = T * groups
  int pieces;      // key pieces per (row, KV head)
  int rotary;      // scores read k in columns [0, rotary) and [D/2, D/2 + rotary), v elsewhere;
                   // D / 2: k everywhere. A multiple of 16.
  float scale;
  int window;      // 0: none
  bool ring;
  bool fp8;        // k and v are float8_e4m3fn
};

// The split kernel's CTAs for one piece of one (row, KV head), per rows block (see above).
inline int DecodeRowsPerCta(int rows) {
  return rows <= kDecodeRowsSmall ? kDecodeRowsSmall : kDecodeRowsLarge;
}

// Launches the split kernel and the combine on `stream`. Returns cudaErrorInvalidValue when
// no configuration fits the device's shared memory, else the launch status.
cudaError_t LaunchDecodeAttention(const DecodeAttentionParams& p, cudaStream_t stream);

}  // namespace mila
