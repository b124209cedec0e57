// The last step both Hopper D=512 kernels share (flash512_sm90.cu, flash512_sm90_seesaw.cu):
// a consumer thread writes its two accumulator rows of O / l in bf16 and, from consumer 0, their
// log-sum-exp, once l holds the complete row sums.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "common/attention_params.h"
#include "common/ptx.cuh"
#include "common/softmax_fragments.cuh"
#include "flash512_sm90/flash512_sm90_common.h"

namespace mila::flash512_sm90 {

// Rows m0 + row and m0 + row + 8 of the M tile (packed rows: position pr / G, query head
// h G + pr % G; those past rows_total are padding), O columns [256 c, 256 c + 256) of which this
// thread holds 2 t4 + 8 j + {0, 1} (the m64n256 accumulator layout). m_run: the row maxima in
// log2 units; a row with no visible key (l = 0) gets O = 0 and lse = -inf.
__device__ __forceinline__ void StoreOutputRows(const AttentionParams p, const float (&o)[128],
                                                const float (&m_run)[2], const float (&l_run)[2],
                                                int m0, int row, int c, int t4, int G,
                                                int rows_total, int h, int b) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pr = m0 + row + 8 * r;
    if (pr >= rows_total) continue;
    const int tq_r = pr / G, gq = pr % G;
    if (c == 0 && t4 == 0 && p.lse != nullptr) {
      p.lse[(static_cast<size_t>(b) * p.hq + h * G + gq) * p.t + tq_r] =
          l_run[r] > 0.f ? (m_run[r] + log2f(l_run[r])) * kLn2 : softmax_fragments::NegInf();
    }
    __nv_bfloat16* orow =
        p.o + ((static_cast<size_t>(b) * p.t + tq_r) * p.hq + h * G + gq) * kD + 256 * c + 2 * t4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<uint32_t*>(orow + 8 * j) =
          ptx::pack_bf16x2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  }
}

}  // namespace mila::flash512_sm90
