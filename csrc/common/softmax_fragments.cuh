// Online-softmax steps on a Hopper wgmma accumulator fragment, shared by the sm_90a attention
// kernels (flash256_sm90, flash512_sm90, flash512_sm90_seesaw). Layout (m64nN, fp32, one
// warp's 16 rows): element 4j + {0, 1} belongs to row g = lane / 4, elements 4j + {2, 3} to
// row g + 8, columns 8j + 2 (lane % 4) + {0, 1}; a row's values are spread over the 4 lanes of
// its quad. The steps that take a range [first, last) of elements or of 4-element groups j let
// a kernel work on part of a 64-key tile (flash512_sm90's consumers: one 32-key half each).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace mila::softmax_fragments {

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// Each row's maximum over this thread's values in groups [kJ0, kJ1) of the tile (all 32 values
// by default); QuadMax completes it.
template <int kJ0 = 0, int kJ1 = 8>
__device__ __forceinline__ void ThreadRowMax(const float (&s)[32], float (&mx)[2]) {
  mx[0] = mx[1] = NegInf();
#pragma unroll
  for (int j = kJ0; j < kJ1; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
}

// A row's maximum over the 4 lanes of its quad, which together hold the row.
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// One row's running maximum m_run moved to max(m_run, mx): returns the base of the tile's
// exponentials (the new maximum, or 0 while the row has seen no key: exp2(-inf - 0) = 0) and
// sets alpha, the factor that rescales what was summed relative to the old maximum.
__device__ __forceinline__ float UpdateRowMax(float mx, float& m_run, float& alpha) {
  const float m_new = fmaxf(m_run, mx);
  const float base = m_new == NegInf() ? 0.f : m_new;
  alpha = ptx::exp2_approx(m_run - base);
  m_run = m_new;
  return base;
}

// P = exp2(s - base) in place on elements [kE0, kE1), and l = l * alpha + each row's sum of P.
template <int kE0 = 0, int kE1 = 32>
__device__ __forceinline__ void ExpAndSum(float (&s)[32], const float (&base)[2],
                                          const float (&alpha)[2], float (&l_run)[2]) {
  float rowsum[2] = {0.f, 0.f};
#pragma unroll
  for (int e = kE0; e < kE1; ++e) {
    s[e] = ptx::exp2_approx(s[e] - base[(e >> 1) & 1]);
    rowsum[(e >> 1) & 1] += s[e];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
}

// Online softmax of one 64-key S tile (32 values a thread, already scaled to log2 units and
// masked to -inf): updates the running row maxima and sums, leaves P = exp2(s - max) in s and
// returns each row's rescale factor for O in alpha. A row with no visible key so far keeps
// m = -inf and takes base 0, so its P and alpha are exp2(-inf) = 0.
__device__ __forceinline__ void OnlineSoftmax(float (&s)[32], float (&m_run)[2],
                                              float (&l_run)[2], float (&alpha)[2]) {
  float mx[2], base_r[2];
  ThreadRowMax(s, mx);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = QuadMax(mx[r]);
    base_r[r] = UpdateRowMax(mx[r], m_run[r], alpha[r]);
  }
  ExpAndSum(s, base_r, alpha, l_run);
}

// OnlineSoftmaxLazy's slack in log2 units: a row's maximum stays put while a tile's exceeds it by
// at most this much, so P = exp2(s - m) <= 2^8. bf16 P keeps its relative precision at that
// size, and the fp32 l and O carry the same factor, which O / l cancels.
constexpr float kLazyMaxSlack = 8.f;

// OnlineSoftmax with a lazy maximum (FlashAttention-4's conditional rescaling): a row's m moves
// only when the tile's row maximum exceeds it by more than kLazyMaxSlack, and then to that
// maximum; otherwise its alpha is exactly 1. Returns whether any row of the warp moved
// (warp-uniform), i.e. whether O needs RescaleRows at all: on most tiles it does not.
__device__ __forceinline__ bool OnlineSoftmaxLazy(float (&s)[32], float (&m_run)[2],
                                                  float (&l_run)[2], float (&alpha)[2]) {
  float mx[2], base_r[2];
  ThreadRowMax(s, mx);
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = QuadMax(mx[r]);
    // m = -inf (no visible key yet): -inf + slack is -inf, so the first finite maximum moves it,
    // with alpha = exp2(-inf) = 0 (O and l are still 0).
    const bool up = mx[r] > m_run[r] + kLazyMaxSlack;
    alpha[r] = up ? ptx::exp2_approx(m_run[r] - mx[r]) : 1.f;
    if (up) m_run[r] = mx[r];
    moved |= up;
    base_r[r] = m_run[r] == NegInf() ? 0.f : m_run[r];
  }
  ExpAndSum(s, base_r, alpha, l_run);
  return __any_sync(0xffffffffu, moved);
}

// O *= alpha, row by row (rows g and g + 8).
template <int N>
__device__ __forceinline__ void RescaleRows(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    o[4 * j] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// P's wgmma A fragment (bf16) for k-step kk of P V: keys 16kk.. = accumulator n8 blocks 2kk and
// 2kk + 1, i.e. elements 8kk .. 8kk + 7.
__device__ __forceinline__ void PackPFragment(const float (&s)[32], int kk, uint32_t (&f)[4]) {
  f[0] = ptx::pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
  f[1] = ptx::pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
  f[2] = ptx::pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
  f[3] = ptx::pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
}

}  // namespace mila::softmax_fragments
