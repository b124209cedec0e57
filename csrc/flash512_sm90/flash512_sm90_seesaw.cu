// Head-dim-512 flash attention on Hopper with rotary keys (target *_d512_sm90_rotary_keys,
// jax_mila.ffi.flash_attention(..., rotary_keys_only=64)): the scores read K only in its
// RoPE-rotated column blocks 0 and 4 ([0:64] and [256:320]) and V in the other six, which is
// exact for Gemma 4's K=V layers once k_norm's weight is folded into q there. Same contract,
// masking and geometry as flash512_sm90.cu otherwise (64 packed rows of one KV head per CTA,
// a producer warpgroup and two consumers, each owning half of O's 512 columns).
//
// Why a second kernel: flash512_sm90.cu splits S's D contraction over its two consumers, so
// both run the softmax of the same tile at the same time and the tensor cores idle through it
// (ncu, eighteenth round: a third of each consumer's time). Here the consumers alternate tiles
// (FlashMLA's "seesaw"): consumer c computes S and the softmax of the tiles i with i % 2 == c
// over all 512 dims, hands its P and row maxima to the other through shared memory, and both
// add every tile's P V into their own O half, in tile order. While one consumer runs a softmax,
// the other's S or P V keeps the tensor cores busy.
//
// Shared memory: Q 64 KB (resident); per stage s = i % 2: V 64 KB and K's two rotated column
// blocks 16 KB (S reads V for the other six); row maxima handed over, float [2][64]; 1 KB of
// row sums for the end; 11 mbarriers. 224 KB + 1 KB + barriers.
//
// Half groups: a stage is two groups h = 0, 1, each V's column blocks 4h..4h+3 plus K block h
// (column block 4h), filled under full[s][h] and released under empty[s][h] by consumer h
// alone, after its P V of the tile (and, for the tile's non-owner, after reading the handoff,
// which the owner writes into the non-owner's K block once S has read it). So each half of a
// stage returns to the producer as soon as its consumer is done with it, and the owner of tile
// i + 2 can start S on its own half while the other half is still loading.
//
// Consumer c, own tile i (stage c):
//   1. wait full[c][c], issue S_i over D half c (16 x wgmma m64n64k16);
//   2. the other's tile i - 1: wait hand[1 - c], take its row maxima (alpha = exp2(m_run -
//      m_new), the same bits the owner computed) and P fragments, rescale O, issue P V_{i-1}
//      into this consumer's O half;
//   3. wait full[c][1 - c], issue S_i over the other D half; once the first half and P V_{i-1}
//      retired, release this consumer's group of tile i - 1;
//   4. when S_i retired: softmax (masking as flash512_sm90.cu), P_i to registers and into the
//      handoff, m_i; arrive on hand[c];
//   5. rescale O, issue P_i V_i, wait, release this consumer's group of tile i.
//   A tile the other consumer owns and that is the CTA's last is added after the loop.
// Measured and dropped (twentieth round): a ping-pong order (the chain P V_{i-1} + all of S_i
// first, the owner's P V_i only once the other consumer had issued its chain) was 3% slower;
// the consumers then waited on each other's turn, and S's wgmma issue stalled on a full
// tensor-core queue.
// Every wait depends on an earlier tile only, so the order cannot deadlock. The handoff's
// generic stores to a K block are fenced to the async proxy (fence.proxy.async) before the
// release that lets TMA overwrite them.
// Row sums: each consumer sums its own tiles' P, rescaled by every tile's alpha; the two sums
// are added at the end (both relative to the same final maximum).
// Instructions per tile: the kernel steps wgmma descriptors from a base (hx::DescSw128) and
// keeps a lazy row maximum (sf::OnlineSoftmaxLazy), so O is rescaled only on tiles that move a
// maximum of the warp by more than 2^8; the handoff carries the maxima as before, and the other
// consumer skips its rescale on the same tiles. Both cut the consumers' instructions (ncu,
// nineteenth round: 484 a warp per tile, 128 of them O's rescale, ~190 rebuilding descriptors)
// but bought only 1-2% (twentieth round): those instructions were off the critical path.
// (No watchdog on the waits: a trap in the consumers' wait loops made ptxas spill 800 bytes of
// their registers.)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/attention_params.h"
#include "common/cluster_launch.h"
#include "common/key_tiles.cuh"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/softmax_fragments.cuh"
#include "common/tensor_map.h"
#include "flash512_sm90/flash512_sm90.h"
#include "flash512_sm90/flash512_sm90_common.h"
#include "flash512_sm90/flash512_sm90_epilogue.cuh"


namespace mila {
namespace {

namespace px = ::mila::ptx;
namespace hx = ::mila::ptx::sm90;
namespace sf = ::mila::softmax_fragments;
using namespace ::mila::flash512_sm90;  // geometry (flash512_sm90_common.h)

constexpr uint32_t kKrBytes = 2 * kColBlockBytes;     // K column blocks 0 and 4 of one tile
constexpr int kOffQ = 0;
constexpr int kOffV = kOffQ + kTileBytes;             // V stages 0, 1
constexpr int kOffKr = kOffV + 2 * kTileBytes;        // K block stages 0, 1 (then P handoffs)
constexpr int kOffM = kOffKr + 2 * kKrBytes;          // float [2][64]: handed-over row maxima
constexpr int kOffL = kOffM + 2 * 64 * 4;             // float [2][64]: row sums at the end
constexpr int kOffBar = kOffL + 2 * 64 * 4;           // q, full[2][2], empty[2][2], hand[2]
constexpr int kSmemBytes = kOffBar + 11 * 8 + 1024;   // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory per block is 227 KB");
static_assert(4 * 128 * 16 <= static_cast<int>(kKrBytes), "P handoff must fit the K blocks");
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

using sf::NegInf;

__global__ void __launch_bounds__(kThreads, 1)
    Flash512Sm90SeesawKernel(const __grid_constant__ CUtensorMap tm_q,
                             const __grid_constant__ CUtensorMap tm_k,
                             const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                             const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = px::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base + kOffQ, sV = base + kOffV, sKr = base + kOffKr;
  const uint32_t bar_q = base + kOffBar;
  // Half-tile groups: group (s, h) = stage s's V column blocks 4h..4h+3 and K block h, filled
  // under full[s][h] = bar_full + 8 (2 s + h) and released under empty[s][h] = bar_empty +
  // 8 (2 s + h) by consumer h alone (see "Half groups" above). hand[s] = bar_hand + 8 s.
  const uint32_t bar_full = bar_q + 8, bar_empty = bar_q + 40, bar_hand = bar_q + 72;

  const int tid = threadIdx.x;
  // Warp-uniform to the compiler (CUTLASS's canonical_warp_group_idx): the consumers branch on
  // their index around wgmmas, and a branch ptxas must assume divergent serializes every wgmma
  // of the kernel (C7518: a wait after each one).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int h = blockIdx.y, b = blockIdx.z;
  const int G = p.hq / p.hkv;
  const int rows_total = p.t * G;  // fits int32: the FFI handler checks it
  const int q_off = *p.q_offset;
  const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x);  // longest first
  const int m0 = m_block * kBlockM;
  const int64_t qpos_min = static_cast<int64_t>(q_off) + min(p.t - 1, m0 / G);
  const int64_t qpos_max = static_cast<int64_t>(q_off) + min(p.t - 1, (m0 + kBlockM - 1) / G);
  const KeyTileCursor<kBlockN> first_tile(p, qpos_min, qpos_max);

  if (tid == 0) {
    hx::mbar_init(bar_q, 1);
    for (int s = 0; s < 2; ++s) {
      for (int hh = 0; hh < 2; ++hh) {
        hx::mbar_init(bar_full + 16 * s + 8 * hh, 1);
        hx::mbar_init(bar_empty + 16 * s + 8 * hh, 4);  // consumer hh's 4 warps
      }
      hx::mbar_init(bar_hand + 8 * s, 128);  // every thread of the owning consumer
    }
    hx::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: Q once, then V and the two K blocks of every tile ----------
    hx::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0 && first_tile.valid()) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      hx::mbar_arrive_expect_tx(bar_q, kTileBytes);
#pragma unroll
      for (int cb = 0; cb < 8; ++cb)
        hx::tma_load_4d(sQ + cb * kColBlockBytes, &tm_q, bar_q, cb * 64, h * G, m0 / G, b);
      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); tile.Advance(), ++i) {
        const uint32_t st = i & 1;
        // The owner's half first: its consumer released it after its own P V two tiles back;
        // the other half waits for the other consumer's P V of that tile.
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const uint32_t hh = st ^ k, full = bar_full + 16 * st + 8 * hh;
          if (i >= 2) hx::mbar_wait(bar_empty + 16 * st + 8 * hh, ((i >> 1) - 1) & 1);
          const uint32_t v_dst = sV + st * kTileBytes + 4 * hh * kColBlockBytes;
          hx::mbar_arrive_expect_tx(full, 5 * kColBlockBytes);
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // V's column blocks 4hh..4hh+3
            hx::tma_load_4d(v_dst + j * kColBlockBytes, &tm_v, full, (4 * hh + j) * 64, h,
                            tile.n0(), b);
          }
          // K's rotated column block 4hh
          hx::tma_load_4d(sKr + st * kKrBytes + hh * kColBlockBytes, &tm_k, full, 256 * hh, h,
                          tile.n0(), b);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;           // O columns [256c, 256c + 256); owns the tiles i % 2 == c
  const int ct = tid - 128 * wg;  // thread in the warpgroup
  const int lane = ct & 31, wq = ct >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int row = 16 * wq + g;  // accumulator rows of this thread: row, row + 8
  int tq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pr = m0 + row + 8 * r;
    tq[r] = pr < rows_total ? pr / G : p.t - 1;
  }
  auto release = [&](int tile) {  // this consumer's half group of the tile is done with
    __syncwarp();
    if (lane == 0) hx::mbar_arrive(bar_empty + 16 * (tile & 1) + 8 * c);
  };
  float* hand_m = reinterpret_cast<float*>(smem + kOffM);

  float o[128];
#pragma unroll
  for (int e = 0; e < 128; ++e) o[e] = 0.f;
  float m_run[2] = {NegInf(), NegInf()};
  float l_run[2] = {0.f, 0.f};  // this consumer's tiles only, rescaled by every tile's alpha
  const float scale_log2 = p.scale * kLog2e;

  if (first_tile.valid()) {
    float s[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] = 0.f;
    uint32_t pa[4][4];  // P of the next P V, as wgmma A fragments
    hx::mbar_wait(bar_q, 0);

    auto fence_pv_operands = [&] {
      hx::fence_operands(o);
      hx::fence_operands(pa);
    };
    // O_c = O_c P V_tile[:, 256c : 256c + 256] with P in pa (O already rescaled): issued and
    // committed.
    auto issue_pv = [&](int tile) {
      uint32_t vh = sV + (tile & 1) * kTileBytes + 4 * c * kColBlockBytes;
      asm volatile("" : "+r"(vh));
      fence_pv_operands();
      hx::wgmma_fence();
      const hx::DescSw128 dv(vh, kColBlockBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv.at(kk * 16 * 128));
      hx::wgmma_commit();
    };
    // The other consumer's tile: its row maxima and P from the handoff; O rescaled to the new
    // maxima (alpha from the same bits the owner used; skipped where the owner moved no row
    // maximum of this warp) and l with it.
    auto take_handoff = [&](int tile) {
      hx::mbar_wait(bar_hand + 8 * (tile & 1), (tile >> 1) & 1);
      const float* hm = hand_m + (tile & 1) * 64;
      float alpha[2];
      bool moved = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = hm[row + 8 * r];
        const float base_r = m_new == NegInf() ? 0.f : m_new;
        const bool up = m_new != m_run[r];
        alpha[r] = up ? px::exp2_approx(m_run[r] - base_r) : 1.f;
        moved |= up;
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      // In the stage's K block c (this consumer's half group; the owner's S read it before).
      const uint4* hp = reinterpret_cast<const uint4*>(smem + kOffKr + (tile & 1) * kKrBytes +
                                                       c * kColBlockBytes);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint4 v = hp[kk * 128 + ct];
        pa[kk][0] = v.x;
        pa[kk][1] = v.y;
        pa[kk][2] = v.z;
        pa[kk][3] = v.w;
      }
      if (__any_sync(0xffffffffu, moved)) sf::RescaleRows(o, alpha);
    };
    // Element e of S holds row 16wq+g (+8 if bit 1 of e), key kpos0 + 8(e/4) + 2t4 (+1 if bit
    // 0 of e): -inf where that key is not visible to that row (as in flash512_sm90.cu).
    auto need_mask = [&](int64_t kpos0, int keys_left) {
      return (keys_left < kBlockN) || (p.causal && kpos0 + kBlockN - 1 > qpos_min) ||
             (p.window > 0 && kpos0 + p.window <= qpos_max);
    };
    auto mask = [&](float& x, int e, int64_t kpos0, int keys_left) {
      const int kofs = 8 * (e >> 2) + 2 * t4 + (e & 1);
      const int64_t delta = static_cast<int64_t>(q_off) + tq[(e >> 1) & 1] - kpos0 - kofs;
      const bool visible = kofs < keys_left && (!p.causal || delta >= 0) &&
                           (p.window <= 0 || delta < p.window);
      if (!visible) x = NegInf();
    };

    // Own tile i (stage c) at positions kpos0.., keys_left of them in its segment. kPending
    // (compile time: a wgmma under a branch ptxas cannot prove uniform serializes every wgmma
    // of the kernel, C7518): whether the other consumer's tile i - 1 is added in between; true
    // for every own tile but consumer 0's first.
    auto own_tile = [&](int i, int64_t kpos0, int keys_left, auto with_pending) {
      constexpr bool kPending = decltype(with_pending)::value;
      const uint32_t st = i & 1;  // == c
      // S_i over D half hh (group (c, hh)) into s; `first`: its first wgmma ignores s.
      auto issue_s_half = [&](int hh, auto first) {
        uint32_t qb = sQ + 4 * hh * kColBlockBytes;
        uint32_t vb = sV + st * kTileBytes + 4 * hh * kColBlockBytes;
        uint32_t kb = sKr + st * kKrBytes + hh * kColBlockBytes;
        asm volatile("" : "+r"(qb), "+r"(vb), "+r"(kb));
        const hx::DescSw128 dq(qb, 16, 1024), dvb(vb, 16, 1024), dkb(kb, 16, 1024);
        hx::mbar_wait(bar_full + 16 * st + 8 * hh, (i >> 1) & 1);
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
          // Column block 4hh is K's rotated block (the group's K block); the others are V's.
          const uint64_t da = dq.at(off), db = kk < 4 ? dkb.at((kk & 3) * 32) : dvb.at(off);
          if (decltype(first)::value && kk == 0) {
            hx::wgmma_m64n64k16_ss<false>(s, da, db);
          } else {
            hx::wgmma_m64n64k16_ss<true>(s, da, db);
          }
        }
        hx::wgmma_commit();
      };
      hx::fence_operands(s);
      // 1. S_i over this consumer's half of D (group (c, c), released by its own P V two tiles
      // back: usually loaded).
      issue_s_half(c, std::true_type{});
      // 2. The other consumer's tile i - 1, as soon as its P is handed over.
      if constexpr (kPending) {
        take_handoff(i - 1);
        issue_pv(i - 1);
      }
      // 3. S_i over the other half of D (group (c, 1 - c): released by the other consumer's P V
      // two tiles back).
      issue_s_half(1 - c, std::false_type{});
      if constexpr (kPending) {
        // The first half of S and P V_{i-1} retired: this consumer's group of tile i - 1 (its V
        // half and the handoff it read) goes back to the producer, for tile i + 1.
        hx::wgmma_wait<1>();
        fence_pv_operands();
        release(i - 1);
      }
      hx::wgmma_wait<0>();
      hx::fence_operands(s);
      // 4. Softmax of S_i; P_i and m_i handed over.
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] *= scale_log2;
      if (need_mask(kpos0, keys_left)) {
#pragma unroll
        for (int e = 0; e < 32; ++e) mask(s[e], e, kpos0, keys_left);
      }
      float alpha[2];
      const bool rescale = sf::OnlineSoftmaxLazy(s, m_run, l_run, alpha);
      // The handoff goes into the other consumer's K block of this stage (its half group: read
      // by S_i's second half, retired).
      uint4* hp = reinterpret_cast<uint4*>(smem + kOffKr + st * kKrBytes +
                                           (1 - c) * kColBlockBytes);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        sf::PackPFragment(s, kk, pa[kk]);
        hp[kk * 128 + ct] = make_uint4(pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
      }
      if (t4 == 0) {
        hand_m[st * 64 + row] = m_run[0];
        hand_m[st * 64 + row + 8] = m_run[1];
      }
      // TMA refills these bytes (tile i + 2's K blocks) once the stage is released.
      hx::fence_proxy_async_shared();
      hx::mbar_arrive(bar_hand + 8 * st);
      // 5. P_i V_i.
      if (rescale) sf::RescaleRows(o, alpha);
      issue_pv(i);
      hx::wgmma_wait<0>();
      fence_pv_operands();
      release(i);
    };

    KeyTileCursor<kBlockN> tile = first_tile;
    int i = 0;
    if (c == 0) {  // tile 0: nothing before it
      own_tile(0, tile.kpos0(), tile.keys_left(), std::false_type{});
      tile.Advance();
      i = 1;
    }
    bool pending = false;  // the other consumer's latest tile, not yet added
    for (; tile.valid(); tile.Advance(), ++i) {
      if ((i & 1) != c) {
        pending = true;
        continue;
      }
      own_tile(i, tile.kpos0(), tile.keys_left(), std::true_type{});
      pending = false;
    }
    const int pending_tile = i - 1;  // the last tile
    if (pending) {  // the CTA's last tile is the other consumer's
      take_handoff(pending_tile);
      issue_pv(pending_tile);
      hx::wgmma_wait<0>();
      fence_pv_operands();
      release(pending_tile);
    }
  }

  // ---- Epilogue: row sums over the quad and both consumers, then O / l and lse.
  float* xl = reinterpret_cast<float*>(smem + kOffL);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if (t4 == 0) {
    xl[c * 64 + row] = l_run[0];
    xl[c * 64 + row + 8] = l_run[1];
  }
  px::named_barrier_sync(1, 256);
  l_run[0] += xl[(1 - c) * 64 + row];  // the same sum in both: fp32 + commutes
  l_run[1] += xl[(1 - c) * 64 + row + 8];
  StoreOutputRows(p, o, m_run, l_run, m0, row, c, t4, G, rows_total, h, b);
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

}  // namespace

cudaError_t LaunchFlashAttentionD512Sm90RotaryKeys(const AttentionParams& p, cudaStream_t stream) {
  LaunchSetup l;
  if (const cudaError_t err = PrepareLaunch(p, &l); err != cudaSuccess) return err;
  if (const cudaError_t err =
          PrepareKernel(Flash512Sm90SeesawKernel, kSmemBytes, kThreads, kProducerRegs,
                        kConsumerRegs);
      err != cudaSuccess) {
    return err;
  }
  const ClusterLaunchConfig launch(
      dim3(static_cast<unsigned>(l.num_m_blocks), static_cast<unsigned>(p.hkv),
           static_cast<unsigned>(p.batch)),
      dim3(kThreads), kSmemBytes, stream, 1);
  return cudaLaunchKernelEx(&launch.cfg, Flash512Sm90SeesawKernel, l.tm_q, l.tm_k, l.tm_v, p,
                            l.num_m_blocks);
}

}  // namespace mila
