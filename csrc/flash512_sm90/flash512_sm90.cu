// FlashAttention prefill for head dim 512 on Hopper (sm_90a): wgmma, TMA, mbarriers and
// warp specialisation, written with inline PTX (common/ptx_sm90.cuh). Same contract and results as
// the portable mma.sync kernel (flash512/flash512.cu), which stays the oracle.
//
// Geometry (non-persistent; see "Not yet" below).
//   * One CTA = 3 warpgroups (384 threads) per M tile of 64 packed rows (4 positions x 16
//     query heads of one KV head, packed row r = t * G + g, as in flash512.cu), so every
//     K/V tile is read once for all G heads. Grid (M tiles reversed: longest first, Hkv, B).
//   * WG0 = producer (setmaxnreg.dec to 24): one thread issues every TMA copy. WG1, WG2 =
//     consumers c = 0, 1 (setmaxnreg.inc to 240). (Cluster variant: 40 / 232.)
//   * O = 64 x 512 fp32 does not fit one warpgroup (256 registers a thread), so the output
//     columns are split: consumer c owns O[:, 256c : 256c+256] (128 fp32 a thread).
//   * S = Q K^T (64 rows x 64 keys) has its D contraction split the same way: consumer c
//     computes S_c over D[256c, 256c+256) (16 x wgmma m64n64k16, Q and K from shared memory
//     through K-major descriptors), writes its 32 fp32 a thread to shared memory, and after
//     a 256-thread named barrier adds the other's partial: S = S_c + S_{1-c}. fp32 addition
//     commutes, so both consumers hold bit-identical S and compute bit-identical softmax
//     statistics and P -- no second exchange is needed. Why not both computing the full S:
//     that doubles the S FLOPs (+50% tensor work); the exchange costs 16 KB written and read
//     per consumer per tile.
//   * O_c += P V[:, 256c..] : 4 x wgmma m64n256k16 with P from registers (the S accumulator
//     layout converted to the A-fragment layout in place, as in FA-3) and V from shared
//     memory through an MN-major (transposed-B) descriptor.
// Shared memory (1024-byte aligned): Q 64 KB (resident), K 64 KB, V 64 KB (one buffer each),
// S exchange 2 x 16 KB (+1 KB for the split softmax's row maxima and sums), 5 mbarriers:
// 225 KB + 40 B (+1 KB alignment slack).
// Every 64 x 512 tile is 8 TMA boxes of 64 rows x 64 columns (128 bytes, the 128-byte
// swizzle's row), box i at byte 8192 i: column block i holds D[64i, 64i+64).
//   Q box: tensor map over q [B, T, Hq, 512] as 4-D {512, Hq, T, B}, box {64, G, 64/G, 1}
//     at {64i, hG, m0/G, b}: the box's rows come out in packed-row order (t-major, then g).
//     G must divide 64 (G = 1, 2, 4, 8, 16); positions >= T are zero-filled by TMA.
//   K/V box: {512, Hkv, S, B}, box {64, 1, 64, 1} at {64i, h, n0, b}; keys >= S zero-filled.
//   Descriptors: S = Q K^T reads A = Q and B = K K-major: k-step kk (16 of D) of consumer c
//     starts at column block 4c + kk/4, +32 bytes per kk % 4 (inside the swizzled row),
//     SBO 1024 (8 rows). P V reads B = V MN-major: k-step kk (16 keys) starts at key row 16kk
//     (+2048 bytes) of column block 4c, SBO 1024 (next 8 keys), LBO 8192 (next 64 columns).
//
// Pipeline and barriers (phase parities count the tiles the CTA has visited, i = 0, 1, ...):
//   q_full (count 1): producer arrive.expect_tx(64 KB) + 8 Q boxes, once. Consumers wait
//     parity 0.
//   k_full / v_full (count 1): producer arrive.expect_tx(64 KB) + 8 boxes of tile i;
//     consumers wait parity i & 1 before the S (resp. PV) wgmmas of tile i.
//   k_empty / v_empty (count 8: lane 0 of each consumer warp, after __syncwarp): a consumer
//     warp arrives on k_empty after its S wgmmas retired (wait_group 0) AND after it read the
//     other consumer's S partial (see below); on v_empty after its PV wgmmas retired. The
//     producer waits parity (i-1) & 1 of k_empty (v_empty) before refilling K (V) with tile i.
//   So K_{i+1} streams in during softmax_i + PV_i, V_{i+1} during S_{i+1} + softmax_{i+1}.
//   The producer issues in the consumers' order (K_i, V_i, K_{i+1}, ...), so it never waits
//   on a release that comes after one it is blocked behind.
//   S exchange buffer red[c] (written by consumer c, read by 1-c), one per consumer: written
//   at tile i+1 only after consumer c waited k_full of tile i+1, which completes after the
//   producer saw k_empty of tile i, which consumer 1-c's warps arrive on only after reading
//   red[c] of tile i; and directly by named barrier 2 + c (reader arrives after its read of
//   tile i, writer syncs before its write of tile i+1). Within a tile, the named barrier (id 1,
//   256 threads) orders both writes before both reads.
//   wgmma register hazards: wgmma.fence before each batch (orders the preceding register
//   writes: O rescale, P conversion); wait_group 0 then fence_operand on every accumulator /
//   A register before any thread touches them. The producer never writes shared memory with
//   generic stores, so no fence.proxy.async is needed for the operands; the mbarrier inits
//   are fenced (fence.mbarrier_init + fence.proxy.async) before the CTA barrier that
//   precedes the first TMA.
//
// Masking (same semantics as flash512.cu): the CTA's visible key range [n_lo, n_hi) comes from
// the device-side offsets; only tiles in it are loaded. Tiles crossing the causal diagonal, the
// window's far edge or S are masked element-wise to -inf. A row that never sees a key keeps
// m = -inf (exp2 base 0, so P = 0 and alpha = 0), l = 0, and writes o = 0, lse = -inf; a CTA
// with no tile at all skips the loop and writes the same. Rows past T (packed row >= T * G)
// compute on zero-filled Q and are never written.
// Who writes what: consumer c writes o[..., 256c : 256c+256] of its rows (bf16, 4-byte stores
// straight from the accumulators); consumer 0's quad leaders write lse (both consumers hold
// the same m and l).
//
// Cluster variant (opt-in, JAX_MILA_FLASH512_SM90_CLUSTER=2; kCluster = 2): the two CTAs of a
// cluster take adjacent M tiles (2 pair, 2 pair + 1) and load the union of their key ranges
// (computed identically in both from the pair's rows), so that each K/V tile leaves L2 once
// for 128 rows: CTA rank r issues column blocks 4r..4r+3 with .multicast::cluster (mask 0b11)
// into the same offsets of both CTAs. Per CTA: k_full / v_full still expect 64 KB and one
// arrival (its own producer's): 32 KB come from each CTA's copies, and bytes that land before
// the expect_tx only drive the tx-count negative while the arrival is still pending.
// k_empty / v_empty count 16: every consumer warp of the cluster arrives on both CTAs'
// barriers (the other's through mapa), because either producer overwrites the tile in both
// CTAs. Waits and arrivals keep the CTA scope (CUTLASS's cluster pipelines do the same; at
// cluster scope ptxas adds a MEMBAR.ALL.GPU before every arrival and an L1 invalidation after
// every wait, which held the W4A8 cluster kernel at ~55% of its speed). No copy of tile i+1
// can reach a CTA before that CTA's own full phase i completed (the other producer first waits
// for this CTA's consumers' releases of tile i).
// Each CTA masks with its own rows' positions (a tile beyond its own causal or window range is
// fully masked; a CTA past the last M tile, when the count is odd, computes on zero-filled Q
// and writes nothing). barrier.cluster at the start (the other CTA's barriers initialised
// before any multicast or remote arrival) and at the end (no CTA exits while the other may
// still arrive on its barriers).
//
// Split softmax (kSplit, the default; JAX_MILA_FLASH512_SM90_SOFTMAX=shared for the scheme
// above): after the S wgmmas consumer c finishes S only for its key half (keys 32c..32c+31),
// so each exponential is computed once per CTA instead of once per consumer: (A) it sends the
// other key half of its D-half partial (8 KB) and adds the other's partial of its own half,
// (B) the two consumers swap their halves' row maxima, (C) they swap their halves' P fragments
// (thread ct of both holds the same rows and keys, so each exchange is a copy at index ct); l
// is summed over both halves once, at the end. ncu (ninth round) put 15% of the consumers'
// stall samples in the exchange and 15% in the softmax; the split made S=16K / 32K 8-11%
// faster (docs/performance.md, tenth round). Each consumer runs its own template instance
// (kHalf = c: the halves index registers), so the two meet at different barrier instructions,
// which only the unaligned barrier.sync allows (bar.sync is .aligned: synccheck reported
// "Divergent thread(s) in block").
//
// Tried and dropped (eleventh round, docs/performance.md): FA-3's overlap of tile i's softmax
// with tile i-1's P V (S_i issued before P_{i-1} V_{i-1}, P V reading P from shared memory).
// It ran 424-442 TFLOP/s against 494-502 in the serial order in the same call. Our reading,
// an estimate that ncu has not confirmed: per tile the CTA moves ~370 KB through shared memory
// (S's Q and K operands 128 KB, V 64 KB, the TMA writes of K and V 128 KB, the exchanges),
// ~2,900 cycles at 128 B/cycle against 2,048 cycles of tensor work. In the serial order the
// TMA writes fall in the softmax phases, when no wgmma reads shared memory; overlapped, every
// stream competes at once, and K_{i+1} and V_i have one wgmma batch each to arrive in.
//
// Measured on the H200 (S=16K, docs/performance.md): 491-509 TFLOP/s with the split softmax in
// serial order (474 before), tensor pipe 56% busy, issue slots 30%. The bound is the serial
// chain per tile, not shared-memory bytes (eighteenth round: 80 instead of 128 KB of TMA writes
// per tile, with K and V sharing a tile, changed nothing; ncu puts a third of each consumer's
// time in the softmax and exchanges, when neither consumer has a wgmma in flight). Next step of
// issue 7: FlashMLA's "seesaw" (each warpgroup computes S and the softmax of every other tile
// and both add every P V into their O halves), which needs the shared K/V tile to fit two
// tiles (branch rotary-keys). The 2-CTA multicast variant exists and is slower.
#include <cuda.h>  // CUtensorMap and its enums (the driver entry point is fetched at run time)
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

constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;
constexpr int kOffV = kOffK + kTileBytes;
// The softmax's exchange buffers: per consumer c, S partials of the other's key half (float4
// [4][128]) and P fragments of its own key half (uint4 [2][128]); row maxima (float [64]) and,
// at the end, row sums (float [64]).
constexpr int kOffXs = kOffV + kTileBytes;               // float4 [2][4][128]
constexpr int kOffXp = kOffXs + 2 * 4 * 128 * 16;        // uint4 [2][2][128]
constexpr int kOffXm = kOffXs + 2 * 8 * 128 * 16;        // float [2][64]
constexpr int kOffXl = kOffXm + 2 * 64 * 4;              // float [2][64]
constexpr int kOffBar = kOffXl + 2 * 64 * 4;             // 5 x uint64
static_assert(kOffXp + 2 * 2 * 128 * 16 <= kOffXm, "exchange layout");
constexpr int kSmemBytes = kOffBar + 5 * 8 + 1024;       // + slack to align the base
static_assert(kSmemBytes <= 227 * 1024, "sm_90 opt-in shared memory per block is 227 KB");
// setmaxnreg targets: 128 x producer + 256 x consumer must stay 64,512 = 384 x 168 (the launch
// allocation); the consumers spill at 232.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

using sf::NegInf;

__global__ void __launch_bounds__(kThreads, 1)
    Flash512Sm90Kernel(const __grid_constant__ CUtensorMap tm_q,
                       const __grid_constant__ CUtensorMap tm_k,
                       const __grid_constant__ CUtensorMap tm_v, const AttentionParams p,
                       const int num_m_blocks) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = px::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const uint32_t sQ = base + kOffQ, sK = base + kOffK, sV = base + kOffV;
  const uint32_t bar_q = base + kOffBar, bar_k_full = bar_q + 8, bar_k_empty = bar_q + 16;
  const uint32_t bar_v_full = bar_q + 24, bar_v_empty = bar_q + 32;

  const int tid = threadIdx.x, wg = tid / 128;
  const int h = blockIdx.y, b = blockIdx.z;
  const int G = p.hq / p.hkv;
  const int rows_total = p.t * G;  // fits int32: the FFI handler checks it
  const int q_off = *p.q_offset;
  const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x);  // longest first
  const int m0 = m_block * kBlockM;

  // Positions of this CTA's rows, in int64 as in flash512.cu.
  const int64_t qpos_min = static_cast<int64_t>(q_off) + min(p.t - 1, m0 / G);
  const int64_t qpos_max = static_cast<int64_t>(q_off) + min(p.t - 1, (m0 + kBlockM - 1) / G);
  // The key tiles they see, segment by segment (common/key_tiles.cuh); every role walks its own
  // copy of this cursor, so all agree on tile i.
  const KeyTileCursor<kBlockN> first_tile(p, qpos_min, qpos_max);

  if (tid == 0) {
    hx::mbar_init(bar_q, 1);
    hx::mbar_init(bar_k_full, 1);
    hx::mbar_init(bar_k_empty, 8);  // every consumer warp
    hx::mbar_init(bar_v_full, 1);
    hx::mbar_init(bar_v_empty, 8);
    hx::mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier (the roles split below)

  if (wg == 0) {
    // ---------------- producer ----------------
    hx::setmaxnreg_dec<kProducerRegs>();
    if (tid == 0 && first_tile.valid()) {
      hx::tma_prefetch_desc(&tm_q);
      hx::tma_prefetch_desc(&tm_k);
      hx::tma_prefetch_desc(&tm_v);
      hx::mbar_arrive_expect_tx(bar_q, kTileBytes);
#pragma unroll
      for (int cb = 0; cb < 8; ++cb)
        hx::tma_load_4d(sQ + cb * kColBlockBytes, &tm_q, bar_q, cb * 64, h * G, m0 / G, b);
      // One K or V tile: wait until the consumers released the buffer's previous tile, then
      // refill it.
      auto load_tile = [&](int i, int n0, uint32_t empty, uint32_t full, uint32_t dst,
                           const CUtensorMap* map) {
        if (i > 0) hx::mbar_wait(empty, (i - 1) & 1);
        hx::mbar_arrive_expect_tx(full, kTileBytes);
#pragma unroll
        for (int cb = 0; cb < 8; ++cb)
          hx::tma_load_4d(dst + cb * kColBlockBytes, map, full, cb * 64, h, n0, b);
      };
      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); tile.Advance(), ++i) {
        load_tile(i, tile.n0(), bar_k_empty, bar_k_full, sK, &tm_k);
        load_tile(i, tile.n0(), bar_v_empty, bar_v_full, sV, &tm_v);
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  hx::setmaxnreg_inc<kConsumerRegs>();
  const int c = wg - 1;              // output columns [256c, 256c+256), D half c of S
  const int ct = tid - 128 * wg;     // thread in the warpgroup
  const int lane = ct & 31, wq = ct >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // Accumulator rows of this thread: rr[0] = 16 wq + g, rr[1] = rr[0] + 8.
  int tq[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pr = m0 + 16 * wq + g + 8 * r;
    tq[r] = pr < rows_total ? pr / G : p.t - 1;
  }
  auto release = [&](uint32_t bar) {
    __syncwarp();  // every lane of this warp is done with the buffer
    if (lane == 0) hx::mbar_arrive(bar);
  };

  // The consumer's main loop and epilogue, for key half kHalf (= c; a compile-time index into
  // the accumulator registers).
  auto consume = [&](auto half) {
    constexpr int kHalf = decltype(half)::value;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {NegInf(), NegInf()};
    float l_run[2] = {0.f, 0.f};  // over this consumer's key halves only
    const float scale_log2 = p.scale * kLog2e;

    if (first_tile.valid()) {
      const uint32_t q_half = sQ + 4 * c * kColBlockBytes;
      const uint32_t k_half = sK + 4 * c * kColBlockBytes;
      const uint32_t v_half = sV + 4 * c * kColBlockBytes;
      // S accumulators: the first wgmma of a tile ignores their value (scale-d = 0); zeroed once
      // so that no indeterminate value is ever an asm operand.
      float s[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = 0.f;
      // P of the next O += P V as wgmma A fragments: k-step kk covers keys 16kk.. = accumulator
      // n8 blocks 2kk, 2kk+1.
      uint32_t pa[4][4];
      hx::mbar_wait(bar_q, 0);

      // ---- S_c = Q[:, D half c] K[:, D half c]^T (64 x 64, fp32) of the tile in the K buffer
      // (k_full parity `parity`): issued and committed; the caller waits.
      auto issue_s = [&](uint32_t parity) {
        hx::mbar_wait(bar_k_full, parity);
        // Opaque copies of the bases, so that the 32 descriptors below are computed per tile:
        // loop-invariant, they may be hoisted out of the tile loop and hold 64 registers across
        // it (the overlapped variant of this loop spilled 208 bytes from exactly that).
        uint32_t qh = q_half, kh = k_half;
        asm volatile("" : "+r"(qh), "+r"(kh));
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
          const uint64_t da = hx::desc_sw128(qh + off, 16, 1024);
          const uint64_t db = hx::desc_sw128(kh + off, 16, 1024);
          if (kk == 0) {
            hx::wgmma_m64n64k16_ss<false>(s, da, db);
          } else {
            hx::wgmma_m64n64k16_ss<true>(s, da, db);
          }
        }
        hx::wgmma_commit();
      };
      // After the wait_group that retires S: no read of s may move above it.
      auto s_retired = [&] { hx::fence_operands(s); };
      // ---- O_c = O_c * alpha + P V[:, 256c : 256c+256] (v_full parity `parity`): issued and
      // committed; the caller waits, then calls pv_retired.
      auto rescale_o = [&](const float (&alpha)[2]) { sf::RescaleRows(o, alpha); };
      // P V's register operands, O and P, pinned: no access to them moves across this point.
      auto fence_pv_operands = [&] {
        hx::fence_operands(o);
        hx::fence_operands(pa);
      };
      // The caller has rescaled O by the tile's alpha (rescale_o).
      auto issue_pv = [&](uint32_t parity) {
        hx::mbar_wait(bar_v_full, parity);
        // The rescaled O and the P fragments are written before the fence that orders these
        // register writes ahead of the wgmmas (the compiler may not sink them past it).
        fence_pv_operands();
        hx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t dv = hx::desc_sw128(v_half + kk * 16 * 128, kColBlockBytes, 1024);
          hx::wgmma_m64n256k16_rs_tb(o, pa[kk], dv);
        }
        hx::wgmma_commit();
      };
      // After the wait_group that retires P V. Until here O and P are the wgmmas' operands: the
      // operand fences keep them live and in place (the compiler may neither reuse P's
      // registers nor touch O while the wgmmas run), and V's buffer is released.
      auto pv_retired = [&] {
        fence_pv_operands();
        release(bar_v_empty);
      };

      // Accumulator element e holds row 16wq+g (+8 if bit 1 of e), key n0 + 8(e/4) + 2t4
      // (+1 if bit 0 of e): -inf where that key is not visible to that row. The tile's first
      // key sits at position kpos0; keys_left of its keys are in the buffer's segment.
      auto need_mask = [&](int64_t kpos0, int keys_left) {
        return (keys_left < kBlockN) || (p.causal && kpos0 + kBlockN - 1 > qpos_min) ||
               (p.window > 0 && kpos0 + p.window <= qpos_max);
      };
      auto mask = [&](float& x, int e, int64_t kpos0, int keys_left) {
        const int kofs = 8 * (e >> 2) + 2 * t4 + (e & 1);  // key - n0
        const int64_t delta = static_cast<int64_t>(q_off) + tq[(e >> 1) & 1] - kpos0 - kofs;
        const bool visible = kofs < keys_left && (!p.causal || delta >= 0) &&
                             (p.window <= 0 || delta < p.window);
        if (!visible) x = NegInf();
      };

      // ---- Split softmax: consumer c finishes S only for its key half (keys 32c.., the
      // accumulator elements 16c..16c+15), so each exponential is computed once per CTA, not
      // once per consumer, and half the partials cross shared memory. Three exchanges, each
      // behind one 256-thread barrier (id 1): (A) the other half of this consumer's partial,
      // (B) row maxima of each half, (C) each half's P fragments. Every buffer is rewritten
      // one tile later only after the barrier that follows its reader's read (xs: read
      // before B; xm: before C; xp: before the next A), which this writer has passed by
      // then, so bar.sync alone orders every reuse. Thread ct of both consumers holds the
      // same rows and key columns of the accumulator (and of P's A fragments), so every
      // exchange is a plain copy at index ct.
      // It leaves P's A fragments in pa: its own half from s, the other's from xp.
      constexpr int kOther = 1 - kHalf;
      float4* xs = reinterpret_cast<float4*>(smem + kOffXs);
      uint4* xp = reinterpret_cast<uint4*>(smem + kOffXp);
      float* xm = reinterpret_cast<float*>(smem + kOffXm);
      auto pack_p = [&](int kk, uint32_t (&f)[4]) { sf::PackPFragment(s, kk, f); };
      auto split_softmax = [&](int64_t kpos0, int keys_left, float (&alpha)[2]) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 16 * kOther + 4 * j;
          xs[(kHalf * 4 + j) * 128 + ct] = make_float4(s[e], s[e + 1], s[e + 2], s[e + 3]);
        }
        // The two consumers run different instances of this code (kHalf), so they meet at
        // different barrier instructions: every split-path barrier is the unaligned form.
        px::named_barrier_sync_unaligned(1, 256);  // (A)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 16 * kHalf + 4 * j;
          const float4 v = xs[(kOther * 4 + j) * 128 + ct];
          s[e] += v.x;
          s[e + 1] += v.y;
          s[e + 2] += v.z;
          s[e + 3] += v.w;
        }
#pragma unroll
        for (int e = 16 * kHalf; e < 16 * kHalf + 16; ++e) s[e] *= scale_log2;
        if (need_mask(kpos0, keys_left)) {
#pragma unroll
          for (int e = 16 * kHalf; e < 16 * kHalf + 16; ++e) mask(s[e], e, kpos0, keys_left);
        }
        float mx[2] = {NegInf(), NegInf()};
#pragma unroll
        for (int j = 4 * kHalf; j < 4 * kHalf + 4; ++j) {
          mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
          mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        const int row = 16 * wq + g;  // and row + 8
        if (t4 == 0) {
          xm[kHalf * 64 + row] = mx[0];
          xm[kHalf * 64 + row + 8] = mx[1];
        }
        px::named_barrier_sync_unaligned(1, 256);  // (B)
        mx[0] = fmaxf(mx[0], xm[kOther * 64 + row]);
        mx[1] = fmaxf(mx[1], xm[kOther * 64 + row + 8]);
        // fmaxf is exact and commutative: both consumers hold the same maxima, bases and alphas.
        float base_r[2], rowsum[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m_run[r], mx[r]);
          base_r[r] = m_new == NegInf() ? 0.f : m_new;  // all masked so far: exp2(-inf) = 0
          alpha[r] = px::exp2_approx(m_run[r] - base_r[r]);
          m_run[r] = m_new;
        }
#pragma unroll
        for (int e = 16 * kHalf; e < 16 * kHalf + 16; ++e) {
          s[e] = px::exp2_approx(s[e] - base_r[(e >> 1) & 1]);
          rowsum[(e >> 1) & 1] += s[e];
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
#pragma unroll
        for (int kk = 2 * kHalf; kk < 2 * kHalf + 2; ++kk) {
          uint32_t f[4];
          pack_p(kk, f);
          xp[(kHalf * 2 + kk - 2 * kHalf) * 128 + ct] = make_uint4(f[0], f[1], f[2], f[3]);
        }
        px::named_barrier_sync_unaligned(1, 256);  // (C)
#pragma unroll
        for (int kk = 2 * kHalf; kk < 2 * kHalf + 2; ++kk) pack_p(kk, pa[kk]);
#pragma unroll
        for (int kk = 2 * kOther; kk < 2 * kOther + 2; ++kk) {
          const uint4 v = xp[(kOther * 2 + kk - 2 * kOther) * 128 + ct];
          pa[kk][0] = v.x;
          pa[kk][1] = v.y;
          pa[kk][2] = v.z;
          pa[kk][3] = v.w;
        }
      };

      int i = 0;
      for (KeyTileCursor<kBlockN> tile = first_tile; tile.valid(); ++i) {
        const int64_t kpos0 = tile.kpos0();  // position of the tile's first key
        const int keys_left = tile.keys_left();
        tile.Advance();  // tile.valid(): a next tile follows
        const uint32_t parity = i & 1;
        issue_s(parity);
        hx::wgmma_wait<0>();
        s_retired();
        float alpha[2];

        release(bar_k_empty);  // this warp's S wgmmas retired: done with K_i
        split_softmax(kpos0, keys_left, alpha);

        rescale_o(alpha);
        issue_pv(parity);
        hx::wgmma_wait<0>();
        pv_retired();
      }
    }

    // ---- Epilogue: row sums over the quad and over both consumers' key halves, lse
    // (consumer 0), O / l in bf16.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
    {
      // Both consumers take this path, tiles or not. xl is written once, after the last (C).
      float* xl = reinterpret_cast<float*>(smem + kOffXl);
      const int row = 16 * wq + g;
      if (t4 == 0) {
        xl[kHalf * 64 + row] = l_run[0];
        xl[kHalf * 64 + row + 8] = l_run[1];
      }
      px::named_barrier_sync_unaligned(1, 256);
      l_run[0] += xl[(1 - kHalf) * 64 + row];  // the same sum in both: fp32 + commutes
      l_run[1] += xl[(1 - kHalf) * 64 + row + 8];
    }
    StoreOutputRows(p, o, m_run, l_run, m0, 16 * wq + g, c, t4, G, rows_total, h, b);
  };
  if (c == 1) {
    consume(std::integral_constant<int, 1>{});
  } else {
    consume(std::integral_constant<int, 0>{});
  }
#else
  __trap();  // built for sm_90a only; the launcher checks the device
#endif
}

cudaError_t LaunchKernel(const CUtensorMap& tm_q, const CUtensorMap& tm_k, const CUtensorMap& tm_v,
                         const AttentionParams& p, int num_m_blocks, cudaStream_t stream) {
  auto* kernel = Flash512Sm90Kernel;
  if (const cudaError_t err =
          PrepareKernel(kernel, kSmemBytes, kThreads, kProducerRegs, kConsumerRegs);
      err != cudaSuccess) {
    return err;
  }
  const ClusterLaunchConfig launch(
      dim3(static_cast<unsigned>(num_m_blocks), static_cast<unsigned>(p.hkv),
           static_cast<unsigned>(p.batch)),
      dim3(kThreads), kSmemBytes, stream, 1);
  return cudaLaunchKernelEx(&launch.cfg, kernel, tm_q, tm_k, tm_v, p, num_m_blocks);
}

}  // namespace

cudaError_t LaunchFlashAttentionD512Sm90(const AttentionParams& p, cudaStream_t stream) {
  LaunchSetup l;
  if (const cudaError_t err = PrepareLaunch(p, &l); err != cudaSuccess) return err;
  return LaunchKernel(l.tm_q, l.tm_k, l.tm_v, p, l.num_m_blocks, stream);
}

}  // namespace mila
