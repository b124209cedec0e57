// FlashAttention prefill for head dim 256 on Hopper (sm_90a): target *_d256_sm90. Same contract
// and results as the portable mma.sync kernel (flash256/flash256.cu), which stays the oracle.
// Design: docs/design/attention_sm90.md ("D = 256: persistent ping-pong").
//
// Persistent: one CTA per SM walks work items (an M tile of 128 packed rows of one KV head and
// batch) in TileScheduler's order (longest first, balanced over the CTAs). Producer (warpgroup 0):
// per item, Q half c for consumer c, then the item's K and V tiles through a ring of two stages.
// Consumer c (warpgroup 1 + c) owns the item's rows [m0 + 64c, m0 + 64c + 64) whole (S 64 x 64 and
// O 64 x 256 fit its registers), so the consumers share only the K/V ring. A consumer's loop issues
// S_i and then P_{i-1} V_{i-1} as two commit groups, and runs the softmax of S_i while P_{i-1}
// V_{i-1} is on the tensor cores; the two consumers take turns issuing their wgmmas (ping-pong on
// the named barriers ConsumerTurn(c)), so one's softmax overlaps the other's wgmmas. A tile of the
// item's range that a consumer's rows cannot see is still waited for and released (skip_tile), so
// every barrier phase gets all the arrivals it counts; each consumer goes through the same number
// of turns per item.
#include <cuda.h>  // CUtensorMap and its enums (the driver entry point is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/attention_epilogue.cuh"
#include "common/attention_params.h"
#include "common/attention_sm90.cuh"
#include "common/attention_sm90_launch.h"
#include "common/key_tiles.cuh"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/softmax_fragments.cuh"
#include "flash256_sm90/flash256_sm90.h"

namespace mila {
namespace {

namespace px = ::mila::ptx;
namespace hx = ::mila::ptx::sm90;
namespace sf = ::mila::softmax_fragments;
namespace att = ::mila::attention_sm90;
using att::kColBlockBytes;
using sf::NegInf;

struct KernelTraits : att::Traits<256, 128> {
  static constexpr int kRowsPerConsumer = kRowsPerBox;  // 64
  static constexpr int kStages = 2;                     // K/V ring depth
  // Shared memory from the 1024-byte aligned base; the tiles' offsets are multiples of 1024.
  struct SharedStorage {
    unsigned char q[2][kTileBytes];  // consumer c's 64 rows of the item
    unsigned char k[kStages][kTileBytes];
    unsigned char v[kStages][kTileBytes];
    uint64_t q_full[2], q_empty[2];
    struct StageBarriers {
      uint64_t k_full, k_empty, v_full, v_empty;
    } stage[kStages];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + kSmemAlign;
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory");
};
using T = KernelTraits;
using Smem = T::SharedStorage;
static_assert(offsetof(Smem, k) % T::kSmemAlign == 0 && offsetof(Smem, v) % T::kSmemAlign == 0,
              "TMA boxes and wgmma operands of the 128-byte swizzle are 1024-byte aligned");
constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
constexpr int kRowsPerConsumer = T::kRowsPerConsumer;
constexpr int kConsumerThreads = T::kConsumerThreads;

// The key tiles that packed rows [r_first, r_last] can see (none when r_first > r_last). The
// keys are one segment (this kernel takes kv_segments == 1) starting at position kv_off.
__device__ __forceinline__ KeyTileRange RowsKeyTiles(const AttentionParams& p, int q_off,
                                                     int kv_off, int G, int r_first, int r_last) {
  KeyTileRange tiles{0, 0};
  if (r_first > r_last) return tiles;
  int64_t lo, hi;
  SegmentKeyRange(p.s, kv_off, static_cast<int64_t>(q_off) + r_first / G,
                  static_cast<int64_t>(q_off) + r_last / G, p.causal, p.window, lo, hi);
  if (hi > lo) tiles = TilesOfKeys<kBlockN>(lo, hi);
  return tiles;
}

// One work item: the M tile of packed rows m0 .. m0 + 127 of KV head h of batch b.
struct WorkItem {
  int m0, h, b;
};

// The static tile scheduler. Item w of num_items = num_m_blocks x Hkv x B: (head, batch)
// fastest, the last (longest under a causal mask) M tile first, so the list is sorted by
// length. Round r of the grid takes items [r G, r G + G) (G = gridDim.x), CTA k the k-th of an
// even round and the (G - 1 - k)-th of an odd one: under a causal mask each CTA's long and
// short items pair up and the CTAs finish together, and the items of a round (the same few M
// tiles of every head) start together and stream the same key tiles, which L2 then serves
// once for all of them. Producer and consumers walk the same sequence.
struct TileScheduler {
  int num_m_blocks, num_items;

  // The CTA's j-th item, or num_items or more once it has none left.
  __device__ __forceinline__ int Item(uint32_t j) const {
    const int k = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
    return static_cast<int>(j) * g + ((j & 1) ? g - 1 - k : k);
  }
  __device__ __forceinline__ WorkItem Decode(const AttentionParams& p, int w) const {
    const int hb_count = p.hkv * p.batch;
    const int mb = w / hb_count, hb = w - mb * hb_count;
    return {(num_m_blocks - 1 - mb) * kBlockM, hb % p.hkv, hb / p.hkv};
  }
};

__global__ void __launch_bounds__(T::kThreads, 1)
    Flash256Sm90Kernel(const __grid_constant__ CUtensorMap tm_q,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                       const TileScheduler sched) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const att::AlignedSmem smem = att::AlignSmem(smem_raw);
  const uint32_t sQ = smem.base + offsetof(Smem, q), sK = smem.base + offsetof(Smem, k);
  const uint32_t sV = smem.base + offsetof(Smem, v);
  // Barriers: q_full[c], q_empty[c], and per stage k_full, k_empty, v_full, v_empty.
  using StageBarriers = Smem::StageBarriers;
  const uint32_t bars_q_full = smem.base + offsetof(Smem, q_full);
  const uint32_t bars_q_empty = smem.base + offsetof(Smem, q_empty);
  const uint32_t bars_stage = smem.base + offsetof(Smem, stage);
  constexpr uint32_t kStageBarBytes = sizeof(StageBarriers);
  auto bar_q_full = [&](int c) { return bars_q_full + 8 * c; };
  auto bar_q_empty = [&](int c) { return bars_q_empty + 8 * c; };
  auto bar_stage = [&](int st, uint32_t member) -> uint32_t {
    return bars_stage + kStageBarBytes * st + member;
  };
  auto bar_k_full = [&](int st) { return bar_stage(st, offsetof(StageBarriers, k_full)); };
  auto bar_k_empty = [&](int st) { return bar_stage(st, offsetof(StageBarriers, k_empty)); };
  auto bar_v_full = [&](int st) { return bar_stage(st, offsetof(StageBarriers, v_full)); };
  auto bar_v_empty = [&](int st) { return bar_stage(st, offsetof(StageBarriers, v_empty)); };

  const int tid = threadIdx.x, wg = tid / 128;
  const int G = p.hq / p.hkv;
  const int rows_total = p.t * G;  // fits int32: the FFI handler checks it
  const int q_off = *p.q_offset, kv_off = *p.kv_offset;

  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      hx::mbar_init(bar_q_full(c), 1);
      hx::mbar_init(bar_q_empty(c), 4);  // the consumer's warps
    }
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      hx::mbar_init(bar_k_full(st), 1);
      hx::mbar_init(bar_k_empty(st), 8);  // every consumer warp
      hx::mbar_init(bar_v_full(st), 1);
      hx::mbar_init(bar_v_empty(st), 8);
    }
    hx::mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier (the roles split below)

  if (wg == 0) {
    // ---------------- producer ----------------
    hx::setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      uint32_t ring = 0;  // the CTA's key tiles so far, over all its items
      uint32_t j = 0;     // the CTA's items so far
      for (int w = sched.Item(j); w < sched.num_items; w = sched.Item(++j)) {
        const WorkItem wi = sched.Decode(p, w);
        // The key tiles any row of the item can see: the union of both consumers' ranges
        // (each is monotone in the row, so the union is the range of [m0, last row]).
        const KeyTileRange tiles =
            RowsKeyTiles(p, q_off, kv_off, G, wi.m0, min(wi.m0 + kBlockM, rows_total) - 1);
        // Q half c once consumer c is done with the previous item's (every item loads Q,
        // even one without key tiles, so that the q phases count items).
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (j > 0) hx::mbar_wait(bar_q_empty(c), (j - 1) & 1);
          hx::mbar_arrive_expect_tx(bar_q_full(c), T::kTileBytes);
          att::LoadColumnBlocks<T::kColBlocks>(sQ + c * T::kTileBytes, &tm_q, bar_q_full(c), 0,
                                               wi.h * G, (wi.m0 + kRowsPerConsumer * c) / G, wi.b);
        }
        for (int tile = tiles.lo; tile < tiles.hi; ++tile, ++ring) {
          const int n0 = tile * kBlockN, st = ring & 1;
          const uint32_t empty_parity = ((ring >> 1) - 1) & 1;  // ring tile - 2's release
          if (ring >= kStages) hx::mbar_wait(bar_k_empty(st), empty_parity);
          hx::mbar_arrive_expect_tx(bar_k_full(st), T::kTileBytes);
          att::LoadColumnBlocks<T::kColBlocks>(sK + st * T::kTileBytes, &tm_k, bar_k_full(st), 0,
                                               wi.h, n0, wi.b);
          if (ring >= kStages) hx::mbar_wait(bar_v_empty(st), empty_parity);
          hx::mbar_arrive_expect_tx(bar_v_full(st), T::kTileBytes);
          att::LoadColumnBlocks<T::kColBlocks>(sV + st * T::kTileBytes, &tm_v, bar_v_full(st), 0,
                                               wi.h, n0, wi.b);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;  // rows [m0 + 64c, m0 + 64c + 64) of each item
  const att::FragmentThread ft(tid - 128 * wg);
  const int t4 = ft.t4, row = ft.row();
  auto release = [&](uint32_t bar) { att::ReleaseByWarp(bar, ft.lane); };
  const uint32_t q_mine = sQ + c * T::kTileBytes;
  const float scale_log2 = p.scale * T::kLog2e;

  // Per item: which key tiles need the element-wise mask for this consumer's rows, and for
  // this thread's accumulator rows the distance dq = q_pos - kv_off (int64; rows past T take
  // row T - 1's), so that key index j is visible when causal implies j <= dq and a window W
  // implies j > dq - W.
  MaskedTiles<kBlockN> masked(0, 0, false, 0);
  int64_t dq[2] = {0, 0};
  float o[128];
  float m_run[2], l_run[2];
  float s[32];        // S accumulators, then P (fp32)
  uint32_t pa[4][4];  // P of the tile whose PV is next, as wgmma A fragments

  // wgmma descriptors, built per use from bases that pass through an empty asm, so that the
  // compiler cannot hoist the 16 + 4 per-k-step descriptors out of the loops and hold them in
  // registers; a k-step adds its byte offset to the descriptor's address field (DescSw128).
  // Issue S = Q_c K_st^T (no fence, no commit).
  auto issue_s = [&](int st) {
    uint32_t qb = q_mine, kb = sK + st * T::kTileBytes;
    asm volatile("" : "+r"(qb), "+r"(kb));
    const hx::DescSw128 dq(qb, 16, 1024), dk(kb, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
      if (kk == 0) {
        hx::wgmma_m64n64k16_ss<false>(s, dq.at(off), dk.at(off));
      } else {
        hx::wgmma_m64n64k16_ss<true>(s, dq.at(off), dk.at(off));
      }
    }
  };
  // Issue O += P V_st (no fence, no commit).
  auto issue_pv = [&](int st) {
    uint32_t vb = sV + st * T::kTileBytes;
    asm volatile("" : "+r"(vb));
    const hx::DescSw128 dv(vb, kColBlockBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv.at(kk * 16 * 128));
  };
  auto fence_s = [&] { hx::fence_operands(s); };
  auto fence_o_pa = [&] {
    hx::fence_operands(o);
    hx::fence_operands(pa);
  };
  // Online softmax of the retired S of key tile `tile` (keys n0 = 64 tile ..): updates m_run
  // and l_run, leaves P (fp32) in s and returns the O rescale factors in alpha.
  auto softmax = [&](int tile, float (&alpha)[2]) {
    const int n0 = tile * kBlockN;
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] *= scale_log2;
    if (masked(static_cast<int64_t>(kv_off) + n0, p.s - n0)) {
      const int64_t dist[2] = {dq[0] - n0, dq[1] - n0};
      MaskTile(s, t4, dist, p.s - n0, p.causal, p.window);
    }
    sf::OnlineSoftmax(s, m_run, l_run, alpha);
  };
  // P (in s) as wgmma A fragments: k-step kk of P V covers keys 16kk.. = accumulator n8 blocks
  // 2kk, 2kk+1. Only once the previous P V retired: pa is its A operand (writing other
  // registers meanwhile also makes ptxas serialize the wgmmas, C7513).
  auto convert_p = [&] {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) sf::PackPFragment(s, kk, pa[kk]);
  };
  auto rescale_o = [&](const float (&alpha)[2]) { sf::RescaleRows(o, alpha); };
  // Ping-pong turns: consumer c issues the wgmmas of its turn e after consumer 1 - c issued
  // those of its turn e - 1 (c = 0) or e (c = 1).
  auto turn_begin = [&] { px::named_barrier_sync(att::ConsumerTurn(c), kConsumerThreads); };
  auto turn_end = [&] { hx::named_barrier_arrive(att::ConsumerTurn(1 - c), kConsumerThreads); };
  // Ring slot of the CTA's key tile number r (over all its items): stage and phase parity.
  auto stage = [](uint32_t r) { return static_cast<int>(r & 1); };
  auto parity = [](uint32_t r) { return (r >> 1) & 1; };
  // A tile of the item's range that this consumer's rows cannot see: wait until it landed,
  // then give it back; it still takes its turn.
  auto skip_tile = [&](uint32_t r) {
    hx::mbar_wait(bar_k_full(stage(r)), parity(r));
    release(bar_k_empty(stage(r)));
    hx::mbar_wait(bar_v_full(stage(r)), parity(r));
    release(bar_v_empty(stage(r)));
    turn_begin();
    turn_end();
  };

  // Consumer 0 takes the first turn.
  if (c == 1) hx::named_barrier_arrive(att::ConsumerTurn(0), kConsumerThreads);
  uint32_t ring = 0;  // the CTA's key tiles before this item (as the producer counts them)
  uint32_t j = 0;     // the CTA's items before this one
  for (int w = sched.Item(j); w < sched.num_items; w = sched.Item(++j)) {
    // The item's key tiles (as the producer loads them), this consumer's sub-range of them,
    // and its rows' positions.
    const int mc = sched.Decode(p, w).m0 + kRowsPerConsumer * c;
    const int m0 = mc - kRowsPerConsumer * c;
    const KeyTileRange tiles =
        RowsKeyTiles(p, q_off, kv_off, G, m0, min(m0 + kBlockM, rows_total) - 1);
    const KeyTileRange mine =
        RowsKeyTiles(p, q_off, kv_off, G, mc, min(mc + kRowsPerConsumer, rows_total) - 1);
    masked = MaskedTiles<kBlockN>(
        static_cast<int64_t>(q_off) + min(p.t - 1, mc / G),
        static_cast<int64_t>(q_off) + min(p.t - 1, (mc + kRowsPerConsumer - 1) / G), p.causal,
        p.window);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      dq[r] = static_cast<int64_t>(q_off) +
              att::QueryIndex(mc + row + 8 * r, rows_total, G, p.t) - kv_off;
    }
#pragma unroll
    for (int e = 0; e < 128; ++e) o[e] = 0.f;
    m_run[0] = m_run[1] = NegInf();
    l_run[0] = l_run[1] = 0.f;
    // The first wgmma of a tile ignores the S accumulators (scale-d = 0), and the first P V
    // reads P only after the first softmax; zeroed so that no indeterminate value is ever an
    // asm operand, and per item so that the previous item's values are dead (not kept in
    // registers) through its epilogue.
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = 0u;

    hx::mbar_wait(bar_q_full(c), j & 1);
    // Tiles before this consumer's range, its range, and after it (every tile is skipped when
    // it has none). Tile i of the item is the CTA's tile ring + i.
    const int n_tiles = tiles.hi - tiles.lo;
    const bool has_tiles = !mine.empty();
    const int i_lo = has_tiles ? mine.lo - tiles.lo : n_tiles;
    const int i_hi = has_tiles ? mine.hi - tiles.lo : n_tiles;
    if (n_tiles > 0) {
      for (int i = 0; i < i_lo; ++i) skip_tile(ring + i);

      if (has_tiles) {
        // First tile of the range: S and softmax alone (O is still zero: no rescale).
        {
          const uint32_t r = ring + i_lo;
          hx::mbar_wait(bar_k_full(stage(r)), parity(r));
          fence_s();
          turn_begin();
          hx::wgmma_fence();
          issue_s(stage(r));
          hx::wgmma_commit();
          turn_end();
          hx::wgmma_wait<0>();
          fence_s();
          release(bar_k_empty(stage(r)));
          float alpha[2];
          softmax(tiles.lo + i_lo, alpha);
          convert_p();
        }
        for (int i = i_lo + 1; i < i_hi; ++i) {
          const uint32_t r = ring + i, r_prev = r - 1;
          // Both full waits before the first wgmma: a wait (a spin loop, a divergent path
          // to ptxas) between the two batches makes ptxas serialize the wgmmas (C7520).
          hx::mbar_wait(bar_k_full(stage(r)), parity(r));
          hx::mbar_wait(bar_v_full(stage(r_prev)), parity(r_prev));
          fence_s();  // the previous tile's softmax wrote s: keep it before the fence
          fence_o_pa();
          turn_begin();
          hx::wgmma_fence();
          issue_s(stage(r));  // S_i ...
          hx::wgmma_commit();
          issue_pv(stage(r_prev));  // ... then O += P_{i-1} V_{i-1}, behind it
          hx::wgmma_commit();
          turn_end();
          hx::wgmma_wait<1>();  // S_i retired; P_{i-1} V_{i-1} may still run
          fence_s();
          release(bar_k_empty(stage(r)));
          float alpha[2];
          softmax(tiles.lo + i, alpha);  // overlaps P_{i-1} V_{i-1}
          hx::wgmma_wait<0>();
          fence_o_pa();
          release(bar_v_empty(stage(r_prev)));
          convert_p();
          rescale_o(alpha);
        }
        // Last tile's O += P V.
        {
          const uint32_t r = ring + i_hi - 1;
          hx::mbar_wait(bar_v_full(stage(r)), parity(r));
          fence_o_pa();
          turn_begin();
          hx::wgmma_fence();
          issue_pv(stage(r));
          hx::wgmma_commit();
          turn_end();
          hx::wgmma_wait<0>();
          fence_o_pa();
          release(bar_v_empty(stage(r)));
        }
      } else {
        // No tile of its own: the turn a consumer with tiles spends on its last P V.
        turn_begin();
        turn_end();
      }
      for (int i = i_hi; i < n_tiles; ++i) skip_tile(ring + i);
    }
    // Every wgmma of this item retired (each turn ends with wait_group 0): Q_c is free for
    // the producer's next item, while this consumer writes its output.
    release(bar_q_empty(c));
    ring += n_tiles;

    // ---- Epilogue: row sums over the quad, lse, O / l in bf16. The item is decoded again
    // from an opaque copy of w, so that the compiler cannot keep the first decoding's values
    // live (in registers) through the main loop.
    int w_epi = w;
    asm volatile("" : "+r"(w_epi));
    const WorkItem wi = sched.Decode(p, w_epi);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    att::StoreOutputRows<T::kD>(p, o, m_run, l_run, wi.m0 + kRowsPerConsumer * c + row, 0, true,
                                t4, G, rows_total, wi.h, wi.b);
  }
  // Consumer 1's last turn_end (after the epilogue: the stores need not wait for it).
  if (c == 0) px::named_barrier_sync(att::ConsumerTurn(0), kConsumerThreads);
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

}  // namespace

cudaError_t LaunchFlashAttentionD256Sm90(const AttentionParams& p, cudaStream_t stream) {
  att::LaunchSetup l;
  if (const cudaError_t err = att::PrepareLaunch<T>(p, &l); err != cudaSuccess) return err;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return err;
  const int64_t items64 = static_cast<int64_t>(l.num_m_blocks) * p.hkv * p.batch;
  // Item indices are int32, with room for TileScheduler::Item's last value (below num_items +
  // 2 gridDim.x; 2^30 items of 128 rows would be terabytes of q).
  if (items64 > INT32_MAX / 2) return cudaErrorInvalidValue;
  const int num_items = static_cast<int>(items64);
  if ((err = att::PrepareKernel<T>(Flash256Sm90Kernel, T::kSmemBytes)) != cudaSuccess) return err;
  // One CTA per SM (its 193 KB of shared memory allow no second).
  const int grid = std::min(num_items, std::max(sms, 1));
  Flash256Sm90Kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(
      l.tm_q, l.tm_k, l.tm_v, p, TileScheduler{l.num_m_blocks, num_items});
  return cudaGetLastError();
}

}  // namespace mila
