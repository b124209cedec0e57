// FlashAttention prefill for head dim 256 on Hopper (sm_90a): wgmma, TMA, mbarriers and
// warp specialisation, written with inline PTX (common/ptx_sm90.cuh). Same contract and results as
// the portable mma.sync kernel (flash256/flash256.cu), which stays the oracle. Structure,
// tensor maps, descriptors and masking follow flash512_sm90/flash512_sm90.cu; what differs is
// said here.
//
// Geometry (the FA-3 recipe for D = 256; Gemma 4's local layers: causal, W = 1024, G = 2).
//   * Work item = an M tile of 128 packed rows (packed row r = t * G + g over the G = Hq / Hkv
//     query heads of one KV head, as in flash512.cu; every K/V tile is read once for all G
//     heads) of one (KV head, batch). Items are numbered M tile fastest, last M tile first.
//   * Persistent: one CTA per SM (grid = min(items, SMs)); CTA k runs items k, k + grid, ...
//     (JAX_MILA_FLASH256_SM90_PERSISTENT=0: grid = items, one each; same code). The producer
//     loads the next item's Q and K/V while the consumers finish the current one and write it.
//   * One CTA = 3 warpgroups (384 threads). WG0 = producer (setmaxnreg.dec to 24): one thread
//     issues every TMA copy. WG1, WG2 = consumers c = 0, 1 (setmaxnreg.inc to 240).
//   * Consumer c owns the item's packed rows [m0 + 64c, m0 + 64c + 64) whole: its S (64 x 64
//     fp32, 32 a thread) and its full 64 x 256 fp32 output (128 a thread) fit its registers,
//     so unlike D = 512 the consumers exchange nothing; they share only the K/V ring.
//   * S = Q_c K^T: 16 x wgmma m64n64k16, Q_c and K K-major from shared memory.
//     O_c += P V: 4 x wgmma m64n256k16, P from registers (the S accumulator layout converted to
//     the A-fragment layout in place, as in FA-3) and V MN-major from shared memory.
//   * Consumer main loop, one of three (JAX_MILA_FLASH256_SM90_LOOP, read once per process):
//     - serial: per tile S, wait, softmax, P V, wait.
//     - overlap (FA-3's intra-warpgroup pipelining): per tile i the consumer issues S_i and then
//       O += P_{i-1} V_{i-1} as two commit groups, waits for the first only (wait_group 1) and
//       runs the softmax of S_i on the CUDA cores while the tensor cores run P_{i-1} V_{i-1};
//       then it waits for the second, rescales O by exp2(m_{i-1} - m_i) (O already holds
//       P_{i-1} V_{i-1}, computed relative to m_{i-1}: the rescale covers it) and converts P_i
//       to A fragments (only then: pa is P_{i-1} V_{i-1}'s operand). Registers: O 128 + S 32 +
//       P 16 live at once.
//     - pingpong (the default): overlap, and the two consumers take turns issuing their wgmmas
//       (named barriers), so that the tensor cores run one consumer's batch while the other
//       runs its softmax. See "Ping-pong".
// Shared memory (1024-byte aligned): Q 64 KB (one 32 KB half per consumer), K and V rings of
// 2 stages x 32 KB, 12 mbarriers: 192 KB + 96 B (+1 KB alignment slack).
// Every 64-row x 256 tile is 4 TMA boxes of 64 rows x 64 columns (128 bytes, the 128-byte
// swizzle's row), box i at byte 8192 i: column block i holds D[64i, 64i+64).
//   Q: tensor map over q [B, T, Hq, 256] as 4-D {256, Hq, T, B}, box {64, G, 64/G, 1}; consumer
//     c's half (32 KB at 32768 c) is 4 boxes at {64i, hG, (m0 + 64c)/G, b}: the box's rows come
//     out in packed-row order (t-major, then g). G must divide 64 (G = 1, 2, 4, 8, 16);
//     positions >= T are zero-filled by TMA (and still counted in the transaction bytes).
//   K/V box: {256, Hkv, S, B}, box {64, 1, 64, 1} at {64i, h, n0, b}; keys >= S zero-filled.
//   Descriptors: S reads A = Q_c and B = K K-major: k-step kk (16 of D) starts at column block
//     kk/4, +32 bytes per kk % 4 (inside the swizzled row), SBO 1024 (8 rows). P V reads B = V
//     MN-major: k-step kk (16 keys) starts at key row 16kk (+2048 bytes) of column block 0,
//     SBO 1024 (next 8 keys), LBO 8192 (next 64 columns).
//
// Pipeline and barriers. The ring index r = 0, 1, ... counts the CTA's key tiles over all its
// items (producer and consumers count alike: both derive every item's tile range from the
// same function); stage st = r % 2, whose barrier phase for r has parity (r / 2) & 1. The
// item index j = 0, 1, ... counts the CTA's items.
//   q_full[c] (count 1): producer arrive.expect_tx(32 KB) + 4 boxes of Q half c of item j
//     (every item, even one without key tiles); consumer c waits parity j & 1.
//   q_empty[c] (count 4: consumer c's warps): arrived on once every wgmma of the item retired;
//     the producer waits parity (j - 1) & 1 before loading Q half c of item j >= 1.
//   k_full[st] / v_full[st] (count 1): producer arrive.expect_tx(32 KB) + 4 boxes of tile r;
//     consumers wait parity (r / 2) & 1 before the S (resp. PV) wgmmas of tile r.
//   k_empty[st] / v_empty[st] (count 8: lane 0 of each warp of both consumers, after
//     __syncwarp): a warp arrives on k_empty after its S wgmmas of tile r retired, on v_empty
//     after its PV wgmmas of tile r retired. The producer waits parity (r / 2 - 1) & 1 before
//     refilling stage st with tile r >= 2.
//   The producer issues in the consumers' order (Q_j, then K_r, V_r, K_{r+1}, ...) and blocks
//   only on releases of earlier tiles / items, which need only earlier loads: no cycle. A
//   consumer whose rows see none of a tile of the item's range (the item's range is the union
//   of both consumers' ranges; see "Masking") still waits for the tile's full barriers and then
//   releases it, so each barrier phase gets every arrival it counts, in order, and a stage is
//   never refilled while a copy into it may still be in flight.
//   wgmma register hazards: wgmma.fence before each batch (orders the preceding register
//   writes: O rescale, P conversion, the zeroed accumulators); wait_group then fence_operand
//   on every accumulator / A register the retired groups used before any thread touches them.
//   No full-barrier wait sits between the two batches of an event (ptxas would serialize the
//   wgmmas: C7520). The producer never writes shared memory with generic stores, so no
//   fence.proxy.async is needed for the operands; the mbarrier inits are fenced
//   (fence.mbarrier_init + fence.proxy.async) before the CTA barrier that precedes the first
//   TMA.
//
// Ping-pong: per item, each consumer goes through the same number of events, (item tiles) + 1:
//   its first tile (S only), each later tile of its range (S_i + P_{i-1} V_{i-1}), its last
//   P V, and one empty event per skipped tile (one more when it has no tile). It issues an
//   event's wgmmas between bar.sync(1 + c) and bar.arrive(2 - c) (256 threads each: one
//   warpgroup syncs, the other arrives). Consumer 1 arrives once on barrier 1 before its first
//   event and consumer 0 syncs once on it after its last epilogue, so each barrier sees as
//   many arrivals as syncs and no phase is left open at exit. Event e of consumer 0 waits for
//   event e - 1 of consumer 1, event e of consumer 1 for event e of consumer 0; an event's
//   mbarrier waits need only tiles whose loads depend on releases made in earlier events: no
//   cycle.
//
// Masking (same semantics as flash256.cu): an item's visible key range [n_lo, n_hi) comes from
// the device-side offsets and its rows' positions; only tiles in it are loaded (O(T * W) work
// with a window). Each consumer computes the sub-range its own 64 rows can see and skips the
// rest (see above). Tiles crossing the causal diagonal, the window's far edge or S (found by
// per-item tile thresholds) are masked element-wise to -inf, with per-row key bounds computed
// in int64 and clamped into the tile. A row that never sees a key keeps m = -inf (exp2 base 0,
// so P = 0 and alpha = 0), l = 0, and writes o = 0, lse = -inf; so does a consumer with no
// tile at all. Rows past T (packed row >= T * G) compute on zero-filled Q, never written.
// Who writes what: consumer c writes o and lse of its own rows (bf16 4-byte stores straight
// from the accumulators; lse by the quad leaders).
//
// Not yet (next steps of issue 7): staged (TMA) output stores; the next item's Q loaded before
// the current item's last tiles are consumed (a second Q buffer does not fit beside the ring).
#include <cuda.h>  // CUtensorMap and its enums (the driver entry point is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/attention_params.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "common/softmax_fragments.cuh"
#include "common/tensor_map.h"
#include "flash256_sm90/flash256_sm90.h"

namespace mila {
namespace {

namespace px = ::mila::ptx;
namespace hx = ::mila::ptx::sm90;
namespace sf = ::mila::softmax_fragments;

constexpr int kD = 256;
constexpr int kRowsPerConsumer = 64;
constexpr int kBlockM = 2 * kRowsPerConsumer;  // packed rows per CTA
constexpr int kBlockN = 64;                    // keys per tile
constexpr int kStages = 2;                     // K/V ring depth
constexpr int kThreads = 384;
constexpr int kColBlockBytes = 64 * 64 * 2;              // one TMA box: 64 rows x 128 bytes
constexpr uint32_t kTileBytes = 4 * kColBlockBytes;      // 64 x 256 bf16: a Q half, a K or V tile
constexpr int kOffQ = 0;                                  // [consumer][column block]
constexpr int kOffK = kOffQ + 2 * kTileBytes;             // [stage][column block]
constexpr int kOffV = kOffK + kStages * kTileBytes;
constexpr int kOffBar = kOffV + kStages * kTileBytes;     // 4 + 4 * kStages x uint64
constexpr int kNumBars = 4 + 4 * kStages;
constexpr int kSmemBytes = kOffBar + kNumBars * 8 + 1024;  // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory per block is 227 KB");
// setmaxnreg targets: 128 x producer + 256 x consumer must stay 64,512 = 384 x 168 (the launch
// allocation under __launch_bounds__(384, 1)).
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "register split");
// Named barriers kBarTurn0 + c: consumer c's turn (ping-pong; 0 is __syncthreads).
[[maybe_unused]] constexpr int kBarTurn0 = 1;
[[maybe_unused]] constexpr float kLog2e = 1.4426950408889634f;
[[maybe_unused]] constexpr float kLn2 = 0.6931471805599453f;

using sf::NegInf;

// Key tiles [tile_lo, tile_hi) that packed rows [r_first, r_last] can see (empty when
// r_first > r_last). Positions in int64, as in flash512.cu.
[[maybe_unused]] __device__ __forceinline__ void VisibleTiles(const AttentionParams& p, int q_off,
                                                             int kv_off, int G, int r_first,
                                                             int r_last, int& tile_lo,
                                                             int& tile_hi) {
  tile_lo = tile_hi = 0;
  if (r_first > r_last) return;
  const int64_t qpos_min = static_cast<int64_t>(q_off) + r_first / G;
  const int64_t qpos_max = static_cast<int64_t>(q_off) + r_last / G;
  int64_t n_lo = 0, n_hi = p.s;
  if (p.causal) n_hi = min(n_hi, qpos_max - kv_off + 1);
  if (p.window > 0) n_lo = max(n_lo, qpos_min - p.window + 1 - kv_off);
  if (n_hi > n_lo) {
    tile_lo = static_cast<int>(n_lo / kBlockN);
    tile_hi = static_cast<int>((n_hi + kBlockN - 1) / kBlockN);
  }
}

// One work item: the M tile of packed rows m0 .. m0 + 127 of KV head h of batch b. Item w of
// num_items = num_m_blocks x Hkv x B: M tiles fastest, the last (longest under a causal mask)
// first, so the CTAs running at once share the K/V tiles of one head in L2.
struct WorkItem {
  int m0, h, b;
};

[[maybe_unused]] __device__ __forceinline__ WorkItem DecodeItem(const AttentionParams& p,
                                                                int num_m_blocks, int w) {
  const int hb = w / num_m_blocks;
  return {(num_m_blocks - 1 - (w - hb * num_m_blocks)) * kBlockM, hb % p.hkv, hb / p.hkv};
}

__global__ void __launch_bounds__(kThreads, 1)
    Flash256Sm90Kernel(const __grid_constant__ CUtensorMap tm_q,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                       const int num_m_blocks, const int num_items) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = px::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t sQ = base + kOffQ, sK = base + kOffK, sV = base + kOffV;
  // Barriers: q_full[2], q_empty[2], then per stage k_full, k_empty, v_full, v_empty.
  const uint32_t bars = base + kOffBar;
  auto bar_q_full = [&](int c) { return bars + 8 * c; };
  auto bar_q_empty = [&](int c) { return bars + 16 + 8 * c; };
  auto bar_k_full = [&](int st) { return bars + 32 + 32 * st; };
  auto bar_k_empty = [&](int st) { return bars + 40 + 32 * st; };
  auto bar_v_full = [&](int st) { return bars + 48 + 32 * st; };
  auto bar_v_empty = [&](int st) { return bars + 56 + 32 * st; };

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
    hx::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      uint32_t ring = 0;  // the CTA's key tiles so far, over all its items
      uint32_t j = 0;     // the CTA's items so far
      for (int w = blockIdx.x; w < num_items; w += gridDim.x, ++j) {
        const WorkItem wi = DecodeItem(p, num_m_blocks, w);
        // The key tiles any row of the item can see: the union of both consumers' ranges
        // (each is monotone in the row, so the union is the range of [m0, last row]).
        int tile_lo, tile_hi;
        VisibleTiles(p, q_off, kv_off, G, wi.m0, min(wi.m0 + kBlockM, rows_total) - 1, tile_lo,
                     tile_hi);
        // Q half c once consumer c is done with the previous item's (every item loads Q,
        // even one without key tiles, so that the q phases count items).
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (j > 0) hx::mbar_wait(bar_q_empty(c), (j - 1) & 1);
          hx::mbar_arrive_expect_tx(bar_q_full(c), kTileBytes);
#pragma unroll
          for (int cb = 0; cb < 4; ++cb)
            hx::tma_load_4d(sQ + c * kTileBytes + cb * kColBlockBytes, &tm_q, bar_q_full(c),
                            cb * 64, wi.h * G, (wi.m0 + kRowsPerConsumer * c) / G, wi.b);
        }
        for (int tile = tile_lo; tile < tile_hi; ++tile, ++ring) {
          const int n0 = tile * kBlockN, st = ring & 1;
          const uint32_t empty_parity = ((ring >> 1) - 1) & 1;  // ring tile - 2's release
          if (ring >= kStages) hx::mbar_wait(bar_k_empty(st), empty_parity);
          hx::mbar_arrive_expect_tx(bar_k_full(st), kTileBytes);
#pragma unroll
          for (int cb = 0; cb < 4; ++cb)
            hx::tma_load_4d(sK + st * kTileBytes + cb * kColBlockBytes, &tm_k, bar_k_full(st),
                            cb * 64, wi.h, n0, wi.b);
          if (ring >= kStages) hx::mbar_wait(bar_v_empty(st), empty_parity);
          hx::mbar_arrive_expect_tx(bar_v_full(st), kTileBytes);
#pragma unroll
          for (int cb = 0; cb < 4; ++cb)
            hx::tma_load_4d(sV + st * kTileBytes + cb * kColBlockBytes, &tm_v, bar_v_full(st),
                            cb * 64, wi.h, n0, wi.b);
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;           // rows [m0 + 64c, m0 + 64c + 64) of each item
  const int ct = tid - 128 * wg;  // thread in the warpgroup
  const int lane = ct & 31, wq = ct >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  auto release = [&](uint32_t bar) {
    __syncwarp();  // every lane of this warp is done with the buffer
    if (lane == 0) hx::mbar_arrive(bar);
  };
  const uint32_t q_mine = sQ + c * kTileBytes;
  const float scale_log2 = p.scale * kLog2e;

  // Per item: the key tiles that need the element-wise mask because they cross the causal
  // diagonal (tile >= causal_from) or the window's far edge (tile <= window_until) for some of
  // this consumer's rows, and for this thread's accumulator rows 16 wq + g and + 8 the
  // distance dq = q_pos - kv_off (int64; rows past T take row T - 1's), so that key index j
  // is visible when causal implies j <= dq and a window W implies j > dq - W.
  int causal_from = 0, window_until = 0;
  int64_t dq[2] = {0, 0};
  float o[128];
  float m_run[2], l_run[2];
  float s[32];        // S accumulators, then P (fp32)
  uint32_t pa[4][4];  // P of the tile whose PV is next, as wgmma A fragments

  // Descriptors of k-step 0; a later k-step adds its byte offset / 16 to the address field
  // (no carry: shared addresses < 2^18). The bases pass through an empty asm at each use, so
  // that the compiler cannot hoist the 16 + 4 per-k-step descriptors out of the loops and hold
  // them in registers (that spilled).
  const uint64_t desc_q = hx::desc_sw128(q_mine, 16, 1024);
  const uint64_t desc_k = hx::desc_sw128(sK, 16, 1024);
  const uint64_t desc_v = hx::desc_sw128(sV, kColBlockBytes, 1024);
  // Issue S = Q_c K_st^T (no fence, no commit).
  auto issue_s = [&](int st) {
    uint64_t da = desc_q, db = desc_k + ((st * kTileBytes) >> 4);
    asm volatile("" : "+l"(da), "+l"(db));
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint32_t off16 = ((kk >> 2) * kColBlockBytes + (kk & 3) * 32) >> 4;
      if (kk == 0) {
        hx::wgmma_m64n64k16_ss<false>(s, da + off16, db + off16);
      } else {
        hx::wgmma_m64n64k16_ss<true>(s, da + off16, db + off16);
      }
    }
  };
  // Issue O += P V_st (no fence, no commit).
  auto issue_pv = [&](int st) {
    uint64_t dv = desc_v + ((st * kTileBytes) >> 4);
    asm volatile("" : "+l"(dv));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv + ((kk * 16 * 128) >> 4));
  };
  auto fence_s = [&] { hx::fence_operands(s); };
  auto fence_o_pa = [&] {
    hx::fence_operands(o);
    hx::fence_operands(pa);
  };
  // Online softmax of the retired S of the tile at key n0, rows 16wq+g (+8), keys
  // n0 + 8j + 2t4 + {0,1}: updates m_run and l_run, leaves P (fp32) in s and returns the O
  // rescale factors in alpha.
  auto softmax = [&](int tile, float (&alpha)[2]) {
    const int n0 = tile * kBlockN;
    const bool need_mask = p.s - n0 < kBlockN || tile >= causal_from || tile <= window_until;
#pragma unroll
    for (int e = 0; e < 32; ++e) s[e] *= scale_log2;
    if (need_mask) {
      // Row r sees the keys n0 + kofs with lo[r] <= kofs <= hi[r]: the bounds in int64, then
      // clamped into [-1, 64] (exact for kofs in [0, 64)), so the 32 tests are int32.
      int lo[2], hi[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int64_t l = 0, u = static_cast<int64_t>(p.s) - 1 - n0;
        if (p.causal) u = u < dq[r] - n0 ? u : dq[r] - n0;
        if (p.window > 0) l = dq[r] - n0 - p.window + 1 > 0 ? dq[r] - n0 - p.window + 1 : 0;
        lo[r] = static_cast<int>(l < kBlockN ? l : kBlockN);
        hi[r] = static_cast<int>(u < -1 ? -1 : u < kBlockN ? u : kBlockN);
      }
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int kofs = 8 * (e >> 2) + 2 * t4 + (e & 1);  // key - n0
        const int r = (e >> 1) & 1;
        if (kofs < lo[r] || kofs > hi[r]) s[e] = NegInf();
      }
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
  // Ping-pong turns (kPingPong only; see "Ping-pong"): consumer c issues the wgmmas of its
  // event e after consumer 1 - c issued those of its event e - 1 (c = 0) or e (c = 1).
  auto turn_begin = [&] {
    px::named_barrier_sync(kBarTurn0 + c, 256);
  };
  auto turn_end = [&] {
    hx::named_barrier_arrive(kBarTurn0 + 1 - c, 256);
  };
  // Ring slot of the CTA's key tile number r (over all its items): stage and phase parity.
  auto stage = [](uint32_t r) { return static_cast<int>(r & 1); };
  auto parity = [](uint32_t r) { return (r >> 1) & 1; };
  // A tile of the item's range that this consumer's rows cannot see: wait until it landed,
  // then give it back (see "Pipeline and barriers"); with ping-pong it still takes its turn.
  auto skip_tile = [&](uint32_t r) {
    hx::mbar_wait(bar_k_full(stage(r)), parity(r));
    release(bar_k_empty(stage(r)));
    hx::mbar_wait(bar_v_full(stage(r)), parity(r));
    release(bar_v_empty(stage(r)));
    turn_begin();
    turn_end();
  };

  if (c == 1) hx::named_barrier_arrive(kBarTurn0, 256);  // consumer 0 takes the first turn
  uint32_t ring = 0;  // the CTA's key tiles before this item (as the producer counts them)
  uint32_t j = 0;     // the CTA's items before this one
  for (int w = blockIdx.x; w < num_items; w += gridDim.x, ++j) {
    // The item's key tiles (as the producer loads them), this consumer's sub-range of them,
    // and its rows' positions.
    int tile_lo, tile_hi, c_lo, c_hi;
    const int mc = DecodeItem(p, num_m_blocks, w).m0 + kRowsPerConsumer * c;
    const int m0 = mc - kRowsPerConsumer * c;
    VisibleTiles(p, q_off, kv_off, G, m0, min(m0 + kBlockM, rows_total) - 1, tile_lo, tile_hi);
    VisibleTiles(p, q_off, kv_off, G, mc, min(mc + kRowsPerConsumer, rows_total) - 1, c_lo,
                 c_hi);
    {
      // A tile needs the mask when its last key comes after the first row's position
      // (n0 + 63 + kv_off > qpos_min) or its first key is out of the last row's window
      // (n0 + kv_off + W <= qpos_max); int64, then clamped into [-1, INT32_MAX].
      const int64_t qpos_min = static_cast<int64_t>(q_off) + min(p.t - 1, mc / G);
      const int64_t qpos_max =
          static_cast<int64_t>(q_off) + min(p.t - 1, (mc + kRowsPerConsumer - 1) / G);
      const int64_t x = qpos_min - kv_off - (kBlockN - 1);  // mask iff 64 tile > x
      const int64_t y = qpos_max - kv_off - p.window;       // mask iff 64 tile <= y
      const int64_t from = x < 0 ? 0 : x / kBlockN + 1;
      const int64_t until = y < 0 ? -1 : y / kBlockN;
      causal_from = p.causal ? static_cast<int>(from < INT32_MAX ? from : INT32_MAX) : INT32_MAX;
      window_until = p.window > 0 ? static_cast<int>(until < INT32_MAX ? until : INT32_MAX) : -1;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pr = mc + 16 * wq + g + 8 * r;
      dq[r] = static_cast<int64_t>(q_off) + (pr < rows_total ? pr / G : p.t - 1) - kv_off;
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
    // Tiles before this consumer's range, its range, and after it (c_lo = c_hi = 0 when it
    // has none: every tile is skipped). Tile i of the item is the CTA's tile ring + i.
    const int n_tiles = tile_hi - tile_lo;
    const bool has_tiles = c_lo < c_hi;
    const int i_lo = has_tiles ? c_lo - tile_lo : n_tiles;
    const int i_hi = has_tiles ? c_hi - tile_lo : n_tiles;
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
          softmax(tile_lo + i_lo, alpha);
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
          softmax(tile_lo + i, alpha);  // overlaps P_{i-1} V_{i-1}
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
    // Every wgmma of this item retired (each event ends with wait_group 0): Q_c is free for
    // the producer's next item, while this consumer writes its output.
    release(bar_q_empty(c));
    ring += n_tiles;

    // ---- Epilogue: row sums over the quad, lse, O / l in bf16. The item is decoded again
    // from an opaque copy of w, so that the compiler cannot keep the first decoding's values
    // live (in registers) through the main loop.
    int w_epi = w;
    asm volatile("" : "+r"(w_epi));
    const WorkItem wi = DecodeItem(p, num_m_blocks, w_epi);
    const int mc_epi = wi.m0 + kRowsPerConsumer * c;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
      inv[r] = l_run[r] > 0.f ? 1.f / l_run[r] : 0.f;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pr = mc_epi + 16 * wq + g + 8 * r;
      if (pr >= rows_total) continue;
      const int tq_r = pr / G, gq = pr % G;
      if (t4 == 0 && p.lse != nullptr) {
        p.lse[(static_cast<size_t>(wi.b) * p.hq + wi.h * G + gq) * p.t + tq_r] =
            l_run[r] > 0.f ? (m_run[r] + log2f(l_run[r])) * kLn2 : NegInf();
      }
      __nv_bfloat16* orow =
          p.o + ((static_cast<size_t>(wi.b) * p.t + tq_r) * p.hq + wi.h * G + gq) * kD + 2 * t4;
#pragma unroll
      for (int jj = 0; jj < 32; ++jj) {
        *reinterpret_cast<uint32_t*>(orow + 8 * jj) =
            px::pack_bf16x2(o[4 * jj + 2 * r] * inv[r], o[4 * jj + 2 * r + 1] * inv[r]);
      }
    }
  }
  // Consumer 1's last turn_end (after the epilogue: the stores need not wait for it).
  if (c == 0) px::named_barrier_sync(kBarTurn0, 256);
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

// A 4-D bf16 tensor map {256, d1, d2, d3} (row-major, innermost first) with 128-byte swizzle.
bool EncodeMap(tma::EncodeTiledFn encode, CUtensorMap* map, const void* ptr, uint64_t d1,
               uint64_t d2, uint64_t d3, uint32_t box1, uint32_t box2) {
  return tma::EncodeBf16Swizzled(encode, map, ptr, kD, d1, d2, d3, box1, box2);
}

cudaError_t LaunchKernel(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                         const AttentionParams& p, int num_m_blocks, int num_items,
                         int grid, cudaStream_t stream) {
  auto* kernel = Flash256Sm90Kernel;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // setmaxnreg moves registers within the CTA: the consumers' increase must be covered by what
  // the producer releases, which holds only if the kernel was allocated 168 registers a thread
  // (ptxas's choice under __launch_bounds__(384, 1)). Fewer would make setmaxnreg.inc wait
  // forever: refuse to launch instead of hanging.
  cudaFuncAttributes attr{};
  if ((err = cudaFuncGetAttributes(&attr, kernel)) != cudaSuccess) return err;
  if (attr.numRegs * kThreads < 128 * kProducerRegs + 256 * kConsumerRegs) {
    return cudaErrorInvalidConfiguration;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(tm_q, tm_k, tm_v, p, num_m_blocks, num_items);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFlashAttentionD256Sm90(const AttentionParams& p, cudaStream_t stream) {
  int device = 0, major = 0, minor = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess)
    return err;
  if ((err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
    return err;
  if (major != 9 || minor != 0) return cudaErrorInvalidDeviceFunction;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return err;
  const int G = p.hq / p.hkv;
  if (G <= 0 || kRowsPerConsumer % G != 0) return cudaErrorInvalidConfiguration;
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;

  CUtensorMap tm_q, tm_k, tm_v;
  if (!EncodeMap(encode, &tm_q, p.q, p.hq, p.t, p.batch, G, kRowsPerConsumer / G) ||
      !EncodeMap(encode, &tm_k, p.k, p.hkv, p.s, p.batch, 1, kBlockN) ||
      !EncodeMap(encode, &tm_v, p.v, p.hkv, p.s, p.batch, 1, kBlockN)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = static_cast<int64_t>(p.t) * G;
  const int64_t num_m_blocks = (rows + kBlockM - 1) / kBlockM;
  const int64_t items64 = num_m_blocks * p.hkv * p.batch;
  // Item indices are int32, with room for w + gridDim.x (2^30 items of 128 rows would be
  // terabytes of q).
  if (items64 > INT32_MAX / 2) return cudaErrorInvalidValue;
  const int m_blocks = static_cast<int>(num_m_blocks), num_items = static_cast<int>(items64);
  // One CTA per SM (its 193 KB of shared memory allow no second), or one per item.
  const int grid = std::min(num_items, std::max(sms, 1));
  return LaunchKernel(tm_q, tm_k, tm_v, p, m_blocks, num_items, grid, stream);
}

}  // namespace mila
