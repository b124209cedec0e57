// The last step of the Hopper attention kernels (flash512_sm90, flash512_sm90_seesaw,
// flash256_sm90): a consumer thread writes its two accumulator rows of O / l in bf16 and their
// log-sum-exp, once l holds the rows' complete sums.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "common/attention_params.h"
#include "common/ptx.cuh"
#include "common/softmax_fragments.cuh"

namespace mila::attention_sm90 {

// Packed rows pr0 and pr0 + 8 of KV head h of batch b (position pr / G, query head h G + pr % G;
// rows from rows_total on are padding and not written), O columns [col0, col0 + 256) of head
// dim kD, of which this thread holds 8 j + 2 t4 + {0, 1} (the m64n256 accumulator layout,
// common/softmax_fragments.cuh). m_run: the row maxima in log2 units; a row with no visible key
// (l = 0) gets O = 0 and lse = -inf. write_lse: whether this thread's quad writes lse (one
// consumer per row when two hold the same row's statistics).
template <int kD>
__device__ __forceinline__ void StoreOutputRows(const AttentionParams& p, const float (&o)[128],
                                                const float (&m_run)[2], const float (&l_run)[2],
                                                int pr0, int col0, bool write_lse, int t4, int G,
                                                int rows_total, int h, int b) {
  constexpr float kLn2 = 0.6931471805599453f;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pr = pr0 + 8 * r;
    if (pr >= rows_total) continue;
    const int tq = pr / G, gq = pr % G;
    if (write_lse && t4 == 0 && p.lse != nullptr) {
      p.lse[(static_cast<size_t>(b) * p.hq + h * G + gq) * p.t + tq] =
          l_run[r] > 0.f ? (m_run[r] + log2f(l_run[r])) * kLn2 : softmax_fragments::NegInf();
    }
    __nv_bfloat16* orow =
        p.o + ((static_cast<size_t>(b) * p.t + tq) * p.hq + h * G + gq) * kD + col0 + 2 * t4;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<uint32_t*>(orow + 8 * j) =
          ptx::pack_bf16x2(o[4 * j + 2 * r] * inv[r], o[4 * j + 2 * r + 1] * inv[r]);
    }
  }
}

}  // namespace mila::attention_sm90
