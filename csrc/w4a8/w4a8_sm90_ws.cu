// Warp-specialized W4A8 GEMM for sm_90a (variant kWgmmaWs, kernel="wgmma_ws"). Same math and
// operand roles as w4a8.cu's `wg` kernel (y^T tiles: converted weights are the register A
// operand of wgmma.m64n128k32, activations the shared-memory B operand; FP8 sums are promoted
// into fp32 master registers), with the data movement taken off the math warps:
//
//   * warpgroup 0, the producer (setmaxnreg.dec to 24 registers): one thread issues two TMA
//     loads per K tile (activations 256 x 128 B with the 128-byte swizzle that the wgmma
//     descriptor expects; packed weights 128 x 64 B, unswizzled) into a 5-stage ring of
//     full/empty mbarriers; the 32 lanes of its first warp copy the tile's block exponents
//     (4 bytes per weight row: TMA cannot take them, the K/32-byte row stride is not a multiple
//     of 16) with cp.async and arrive on the stage's full barrier when their copies land
//     (cp.async.mbarrier.arrive). The other three producer warps exit at once (one polling warp
//     per SM sub-partition would take issue slots from the consumers). Before exiting, the
//     first warp waits until the consumers have released the last stages (producer tail).
//   * warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240): weight rows 64 w .. 64 w + 63
//     of the tile each, all 256 activation rows. Per promotion chain of two K tiles (256 long),
//     per n128 half of the activation rows: 8 wgmmas into a fresh partial sum (every block's
//     two weight rows per thread are first converted into e4m3 A fragments, which both halves
//     use), wait, add it into the masters; then release both stages. The two warpgroups are not
//     synchronized with each other: while one drains and adds, the other's batch runs.
//     Why two tiles per chain: a warpgroup's drain-add-reissue turnaround (~400 cycles) was
//     longer than the other warpgroup's 4-wgmma batch (~256 cycles at full rate), so the tensor
//     cores idled: benchmarks/wgmma_loop.py ran the loop at 1,437 TFLOP/s promoted per K tile
//     against 1,943 unpromoted, and n64 batches with one in flight during the adds (same work
//     queued) did not help (1,321 with conversion, against 1,341).
//   * persistent: grid = min(#SMs, tiles), tile t = blockIdx.x + i * gridDim.x in the grouped
//     raster of w4a8_convert.cuh (8 M tiles per N tile: the weight tile and the group's
//     activation tiles are reused from L2). The producer runs ahead into the next tile's stages
//     while the consumers store the previous tile, so the epilogue overlaps the loads. The
//     tiles of a last, partial wave may be split along K over all SMs (stream-K, "schedule"
//     below), their float32 partial sums passed through a workspace in global memory.
//   * epilogue: x_scale[m] * 2^(channel_exp - 133), bf16 rounding, staged per warpgroup through
//     its own 64 x 64 shared buffer with stmatrix.trans (four passes of 64 activation rows;
//     named barrier of the warpgroup only; the row scales were copied in at the tile's start),
//     16-byte row-contiguous stores; rows >= M and columns >= N are not stored.
//     float32 output: direct stores (8 lanes write 32 contiguous bytes).
//   * every mbarrier wait traps after 20 s (MILA_W4A8_WS_WATCHDOG_NS): a protocol bug fails the
//     launch instead of hanging the GPU.
//
// Accuracy: FP8 wgmma accumulates at ~14 bits (truncated), so the error grows with the chain
// length; 256-long chains against the 128 of w4a8.cu's `wg` (tests/test_w4a8.py holds both to
// 4e-4 relative Frobenius at K = 15360; unpromoted: 1.6e-3).
//
// Tile choice: 128 weight rows x 256 activation rows x 128 K per stage. Consumer registers:
// masters m64 x n256 fp32 = 128, one n128 partial = 64, A fragments of two K tiles 32, row
// tables 4, addresses: ptxas fits the 240 that setmaxnreg gives without spills (232 spilled),
// and the producer warp fits 24 with 32-bit exponent offsets and an incremental stage/phase.
// setmaxnreg only moves registers within the CTA's launch allocation (168 x 384 = 64,512):
// 2 x 128 x 240 + 128 x 24 = 64,512 (with 32 for the producer the consumers' setmaxnreg.inc
// waited forever). Shared memory per stage: 32 KiB activations + 8 KiB packed weights + 512 B
// exponents = 40.5 KiB; 5 stages (202.5 KiB, so that the producer stays 3 stages ahead of the
// two a chain holds) + 2 x 9 KiB epilogue buffers + barriers = 223.6 KiB of the 227.
//
// The e4m3 instance (kE4m3; kernel="wgmma_ws_e4m3" and "wgmma_ws_e4m3_cluster"), on weights
// that w4a8_expand.cu wrote as e4m3 [N, K] into the workspace before the launch: the producer's
// thread loads them with TMA like the activations (128 x 128 B, 128-byte swizzle; no exponent
// copies, one arrival per full barrier), and the consumers issue wgmma.m64n192k32 with both
// operands in shared memory: no conversion and no fragments in registers. Its tile is 128 weight
// rows x 192 activation rows: one n192 partial (96 registers) beside 96 masters, so a chain is
// one batch of 8 wgmmas and one wait, and 5 stages of 40 KiB fit (24 KiB activations + 16 KiB
// weights; 256 rows would leave room for 4 of 48, two stages of lookahead instead of three).
// Each output element gets the same products in the same order as in the register-A instance.
// Measured on the H200 (docs/performance.md, twenty-eighth and twenty-ninth rounds): ncu puts
// the tensor pipe at 93.7% of the cycles on down (M = 16384), 0.4% more cycles than cuBLASLt
// (93.4%), against 80% for the register-A instance; the 256-row, 4-stage version ran 5-10%
// faster with its loads taken away (MILA_W4A8_WS_TIMING_ONLY), one-tile chains (3 stages of
// lookahead) 7-11% slower, chains of 3 or 4 K tiles 10-28% slower, and the consumers taking
// turns (ping-pong) 2-5% slower.
//
// Sizes: K % 128 == 0 (an odd number of K tiles ends with a one-tile chain), N % 8 == 0 (weight
// rows past N: TMA zero-fill -> zero weights; exponents zero-filled by cp.async), any M >= 1
// (rows past M: TMA zero-fill, never stored), M < 2^31, N x K/32 < 2^31.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>  // printf of the watchdog (MILA_W4A8_WS_DEBUG)
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "common/cluster_launch.h"
#include "common/ptx.cuh"
#include "common/tensor_map.h"
#include "w4a8/w4a8_convert.cuh"
#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {
namespace ws {

constexpr int kBN = 128;     // weight rows per tile (2 consumer warpgroups x 64)
constexpr int kChainTiles = 2;  // K tiles per promotion chain (256 long)
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
constexpr int kOutRows = 64;                // activation rows per epilogue pass
constexpr int kOutPitch = 64 + 8;           // bf16 per staged row: conflict-free writes
constexpr int kOutBytes = kOutRows * kOutPitch * 2;  // one consumer warpgroup's buffer
constexpr int kGroupM = 8;
static_assert(kConsumerThreads * kConsumerRegs + (kThreads - kConsumerThreads) * kProducerRegs <=
                  65536 / kThreads / 8 * 8 * kThreads,
              "setmaxnreg redistributes only the registers the CTA was launched with");

// Tiles and shared memory of the two instances. Activation rows per tile: 256, two n128 halves
// of wgmmas, or (kE4m3) 192 in one n192 part, whose partial sum of 96 registers fits beside 96
// masters (one promotion wait per chain instead of two). A stage holds the activation tile
// (32 or 24 KiB) and the weight tile: packed codes (8 KiB) and block exponents (512 B) that the
// consumers convert into register A fragments, or (kE4m3) the expanded e4m3 weights (16 KiB,
// 128-byte rows in the 128-byte swizzle: the shared-memory A operand). 5 stages of 40.5 or 40
// KiB (256 activation rows with e4m3 weights would leave room for 4 of 48).
template <bool kE4m3>
struct Smem {
  static constexpr int kBM = kE4m3 ? 192 : 256;  // activation rows per tile
  static constexpr int kWgN = kE4m3 ? 192 : 128;  // activation rows per wgmma (its N)
  static constexpr int kParts = kBM / kWgN;       // wgmma batches (partial sums) per chain
  static constexpr int kStages = 5;
  static constexpr int kXStage = kBM * kBK;       // 1024-byte aligned (128B swizzle atoms)
  static constexpr int kXHalf = kBM / 2 * kBK;    // kCluster 2: each CTA's multicast half
  static constexpr int kWStage = kE4m3 ? kBN * kBK : kBN * kPackedTile;
  static constexpr int kEStage = kE4m3 ? 0 : kBN * kKBlocks;
  static constexpr int kWOffset = kStages * kXStage;
  static constexpr int kEOffset = kWOffset + kStages * kWStage;
  static constexpr int kOutOffset = kEOffset + kStages * kEStage;
  // x_scale of the tile's 256 rows, per consumer warpgroup: copied in with cp.async at the
  // tile's start and read from shared memory in the epilogue (global loads there were hoisted
  // by the compiler, all 64 at once, and spilled; loaded at the epilogue, their latency was
  // exposed).
  static constexpr int kXsOffset = kOutOffset + 2 * kOutBytes;
  static constexpr int kBarOffset = kXsOffset + 2 * kBM * 4;
  static_assert(kXStage % 1024 == 0 && kXHalf % 1024 == 0 && kBM % kOutRows == 0, "tiles");
  static constexpr int kBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + alignment slack
  static constexpr uint32_t kTxBytes = kXStage + kWStage;  // TMA bytes per stage (OOB fill counts)
  // The producer's expect_tx arrive, and one cp.async arrive per lane of its warp for the
  // exponents.
  static constexpr uint32_t kFullArrivals = kE4m3 ? 1 : 1 + 32;
  static_assert(kBytes <= 227 * 1024, "shared memory");
  static_assert(kOutBytes % 16 == 0 && kBarOffset % 8 == 0, "alignment");
  // kE4m3: the A tiles start on 1024-byte swizzle atoms. Otherwise the consumers load a row's
  // packed words of one stage with one 16-byte load per quad column and its exponents with one
  // 4-byte load.
  static_assert(kE4m3 ? (kWOffset | kWStage) % 1024 == 0
                      : kKBlocks == 4 && kPackedTile == 4 * 16 && (kWOffset | kWStage) % 16 == 0 &&
                            (kEOffset | kEStage) % 4 == 0,
                "alignment of the weight tiles");
};

// ---- PTX (sm_90a) ---------------------------------------------------------------------------

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// Watchdog: a wait longer than this traps (the launch fails with "unspecified launch failure")
// instead of hanging the GPU. Every legitimate wait here lasts microseconds (one stage of
// loads or math, one tile's epilogue), even under compute-sanitizer; 0 turns the check off.
// Define MILA_W4A8_WS_WATCHDOG_NS=0 once the kernel has a record on the GPU, if preferred.
#ifndef MILA_W4A8_WS_WATCHDOG_NS
#define MILA_W4A8_WS_WATCHDOG_NS 20000000000ull  // 20 s
#endif
// mbar_wait with the watchdog.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (ptx::sm90::mbar_try_wait(bar, parity)) return;  // the common case: no timer read
  if constexpr (MILA_W4A8_WS_WATCHDOG_NS > 0) {
    const uint64_t t0 = global_timer_ns();
    while (!ptx::sm90::mbar_try_wait(bar, parity)) {
      if (global_timer_ns() - t0 > MILA_W4A8_WS_WATCHDOG_NS) {
#ifdef MILA_W4A8_WS_DEBUG
        printf("w4a8 wgmma_ws watchdog: block %d thread %d barrier smem 0x%x parity %u\n",
               blockIdx.x, threadIdx.x, bar, parity);
#endif
        __trap();
      }
    }
  } else {
    ptx::sm90::mbar_wait(bar, parity);
  }
}

// Stage and parity of a pipeline step in a ring of kStages.
template <int kStages>
struct RingPos {
  uint32_t stage = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// ---- schedule ---------------------------------------------------------------------------------
//
// The schedule deals output tiles to units: a unit is one CTA, or with kCluster = 2 a cluster
// of two CTAs that run the same pieces on adjacent weight tiles (tiles then count pairs of
// weight tiles) and share every activation tile through TMA multicast.
// Whole tiles [0, dp_tiles) go round-robin, one per unit and wave (data-parallel). The tiles of
// the last, partial wave are cut along K (stream-K): their K tiles, counted tile after tile, are
// dealt out in runs of sk_share to units 0 .. sk_units - 1, so that every SM works until the end
// instead of a third of them idling through the last wave (480 tiles of the 12B's down_proj at
// M = 4096 are 3.64 waves on 132 SMs). A run that starts inside a tile (k0 > 0) is its unit's
// first stream-K piece: it leaves a float32 partial in the CTA's workspace slot and raises the
// slot's flag. The run holding k = 0 of a tile (its owner) ends its unit's list, since the tile
// goes on past it, and adds the later runs' partials, in unit order, before the epilogue. An
// owner thus waits only for the first pieces of higher units, which wait for nobody: no cycle,
// with every CTA resident (the launcher sizes the grid to what fits at once).
struct Schedule {
  int dp_tiles;
  int sk_units;  // 0: no stream-K
  int sk_share;  // K tiles per stream-K unit, fewer than a tile's
  int sk_iters;  // K tiles of all stream-K tiles
};

// A unit's piece of work: K tiles [k0, k1) of output tile `tile` (raster order).
struct Piece {
  int tile, k0, k1;
};

// This CTA's rank in its cluster, read where it is used (the consumers have no register to
// hold it across their main loop).
template <int kCluster>
__device__ __forceinline__ int cta_rank() {
  return kCluster == 1 ? 0 : static_cast<int>(ptx::sm90::cluster_ctarank());
}
template <int kCluster>
__device__ __forceinline__ int unit_id() {
  return static_cast<int>(blockIdx.x) / kCluster;
}
template <int kCluster>
__device__ __forceinline__ int unit_count() {
  return static_cast<int>(gridDim.x) / kCluster;
}

// This unit's pieces, walked with one int (the consumers hold it across their main loop, where
// every register counts): a whole tile t < dp_tiles, or dp_tiles + the stream-K K tile the piece
// starts at, or -1 past the last piece. The producer and the consumers walk the same list.
template <int kCluster>
__device__ __forceinline__ int sk_begin(const Schedule& s) {
  return unit_id<kCluster>() < s.sk_units ? unit_id<kCluster>() * s.sk_share : 0;
}
template <int kCluster>
__device__ __forceinline__ int sk_end(const Schedule& s) {
  return unit_id<kCluster>() < s.sk_units ? min(sk_begin<kCluster>(s) + s.sk_share, s.sk_iters)
                                          : 0;
}
template <int kCluster>
__device__ __forceinline__ int first_piece(const Schedule& s) {
  if (unit_id<kCluster>() < s.dp_tiles) return unit_id<kCluster>();
  return sk_begin<kCluster>(s) < sk_end<kCluster>(s) ? s.dp_tiles + sk_begin<kCluster>(s) : -1;
}
template <int kCluster>
__device__ __forceinline__ Piece piece_at(const Schedule& s, int kt_count, int cursor) {
  if (cursor < s.dp_tiles) return {cursor, 0, kt_count};
  const int it = cursor - s.dp_tiles, u = it / kt_count, k0 = it - u * kt_count;
  return {s.dp_tiles + u, k0, min(kt_count, k0 + sk_end<kCluster>(s) - it)};
}
template <int kCluster>
__device__ __forceinline__ int next_piece(const Schedule& s, int cursor, const Piece& p) {
  if (cursor < s.dp_tiles) {
    const int t = cursor + unit_count<kCluster>();
    if (t < s.dp_tiles) return t;
    return sk_begin<kCluster>(s) < sk_end<kCluster>(s) ? s.dp_tiles + sk_begin<kCluster>(s) : -1;
  }
  const int it = cursor - s.dp_tiles + p.k1 - p.k0;
  return it < sk_end<kCluster>(s) ? s.dp_tiles + it : -1;
}

// Stream-K scratch: flags [CTA][consumer warpgroup], then per CTA the partial sums of its two
// consumer warpgroups, float4 [warpgroup][32][128 threads] (thread-contiguous: coalesced).
__device__ __forceinline__ uint32_t* sk_flag(const W4A8Args& args, int cta, int cw) {
  return static_cast<uint32_t*>(args.workspace) + 2 * cta + cw;
}
__device__ __forceinline__ float4* sk_slot(const W4A8Args& args, int cta, int cw, int wtid) {
  return reinterpret_cast<float4*>(static_cast<uint8_t*>(args.workspace) + kW4A8FlagBytes) +
         (static_cast<size_t>(cta) * 2 + cw) * 32 * 128 + wtid;
}
// Spins until another CTA has raised `flag` (acquire), with the mbarrier waits' watchdog.
__device__ __forceinline__ void wait_flag(const uint32_t* flag) {
  if (ptx::ld_acquire_gpu(flag) != 0) return;
  const uint64_t t0 = global_timer_ns();
  while (ptx::ld_acquire_gpu(flag) == 0) {
    __nanosleep(64);
    if constexpr (MILA_W4A8_WS_WATCHDOG_NS > 0) {
      if (global_timer_ns() - t0 > MILA_W4A8_WS_WATCHDOG_NS) __trap();
    }
  }
}

// ---- kernel ---------------------------------------------------------------------------------

#if defined(MILA_W4A8_WS_CONVERT_TWICE) && defined(MILA_W4A8_WS_NO_CONVERT)
#error "MILA_W4A8_WS_CONVERT_TWICE and MILA_W4A8_WS_NO_CONVERT are two separate diagnostic builds"
#endif
#ifdef MILA_W4A8_WS_CONVERT_TWICE
// Diagnostic build (BUILD.md): the consumers convert every weight word a second time, from
// copies the compiler cannot prove equal to the first (XOR with this zero, read from global
// memory), and AND the two results. The sums stay exact; a benchmark of this build against the
// plain one measures what one more conversion costs the consumers' turnaround.
__device__ uint32_t g_convert_twice_zero = 0;
#endif

// kInterleave: the first half's wgmma of each weight block is issued right after that block's
// conversion, behind its own wgmma.fence (JAX_MILA_W4A8_WS_CONVERT=interleaved, kept for
// comparison); by default the chain's blocks are all converted first, then one fence and the
// half's 8 wgmmas back to back. Same wgmmas in the same order, so the same sums; measured on
// the H200 (2026-12-01, docs/performance.md) convert-first ran 4.5% more FLOP per SM clock in
// benchmarks/micro/wgmma_fp8_loop.cu and 5-19% faster in the kernel (qkv, gate+up, down at
// M = 16384), where the interleaved order had looked ~1% better in an ncu profile. Every order
// that converts while this warpgroup's own wgmmas run has lost: interleaved, the next chain
// converted ahead (n64 quarters, 2026-12-02: -4..-7%), each K tile converted under the tile
// before's wgmmas (2026-12-02: -3..-7%, ncu 76% tensor-pipe activity against 80%). A
// warpgroup's integer work does not hide under its own register-A wgmmas as it does under
// shared-memory-A ones or under the other warpgroup's: 8 conversions per 8-wgmma batch left
// 91% of the tensor rate, against 100% in both other cases
// (benchmarks/micro/wgmma_alu_overlap.cu).
//
// kCluster 2 (kernel="wgmma_ws_cluster"; convert-first only): two CTAs of a cluster take
// adjacent weight tiles of one activation tile, and each loads half of every activation stage
// (128 rows) into both CTAs with TMA multicast: a CTA reads 24 KiB from L2 per K tile instead
// of 40. Each CTA's full
// barrier still expects the whole stage (its own weights and both halves) and one expect_tx
// arrival of its own producer (bytes that land first only drive the transaction count below
// zero while that arrival is pending); the empty barriers count every consumer thread of their
// CTA and one lane per consumer warp of the other CTA (either producer overwrites the stage in
// both). Every wait and arrival keeps the CTA scope, as CUTLASS's cluster pipelines do: the
// bytes a full barrier counts, the peer's multicast included, are visible to the threads that
// see its phase complete, and a consumer's reads of a stage have returned before it releases
// it. Cluster-scope acquire and release cost an L1 invalidation (CCTL.IVALL) after every wait
// and a MEMBAR.ALL.GPU before every remote arrival: with them the kernel ran at ~55% of its
// speed on the H200. barrier.cluster at the start: both
// CTAs' barriers are initialised before any multicast or remote arrival. None at the end: a
// CTA's producer leaves only after its tail has seen every stage released by both CTAs'
// consumers, so by then each of its multicasts has landed in both CTAs and every remote
// arrival on its barriers has been made; nothing else crosses CTAs. (A barrier.cluster at
// the end of the consumers' path made ptxas spill ~1.3 KB of their registers.)
//
// kE4m3 (kernel="wgmma_ws_e4m3", "wgmma_ws_e4m3_cluster"): tmap_w maps the weights expanded to
// e4m3 [N, K] (w4a8_expand.cu), which the producer loads like the activations, and each
// consumer issues its wgmmas with A from shared memory (its 64 rows of the stage's weight
// tile): no conversion, no exponent copies, and the same products summed in the same order as
// the register-A instance, so the two give equal outputs.
template <typename OutT, bool kInterleave, int kCluster, bool kE4m3>
__global__ void __launch_bounds__(kThreads, 1)
    w4a8_wgmma_ws_kernel(const __grid_constant__ CUtensorMap tmap_x,
                         const __grid_constant__ CUtensorMap tmap_w, const W4A8Args args,
                         const Schedule sched) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  using L = Smem<kE4m3>;
  constexpr int kStages = L::kStages, kBM = L::kBM, kXStage = L::kXStage;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_base = ptx::smem_addr(smem_raw);
  const uint32_t smem_base = (raw_base + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - raw_base);
  const uint32_t full_bar = smem_base + L::kBarOffset;  // stage s: + 8 s
  const uint32_t empty_bar = full_bar + 8 * kStages;

  const int tid = threadIdx.x;
  const int K = args.k, N = args.n;
  const int64_t M = args.m;
  const int tiles_m = static_cast<int>((M + kBM - 1) / kBM);
  // The raster's N tiles: weight tiles, or (kCluster 2) pairs of them.
  const int tiles_n = ((N + kBN - 1) / kBN + kCluster - 1) / kCluster;
  const int kt_count = K / kBK;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::sm90::mbar_init(full_bar + 8 * s, L::kFullArrivals);
      // Every consumer thread of this CTA, and (kCluster 2) one lane per consumer warp of the
      // other CTA.
      ptx::sm90::mbar_init(empty_bar + 8 * s, kConsumerThreads + (kCluster - 1) * 8);
    }
    ptx::sm90::mbar_init_fence();
  }
  if constexpr (kCluster == 1) {
    __syncthreads();
  } else {
    ptx::sm90::cluster_sync();
  }

  // Pipeline steps (one K tile of one output tile each) are counted over the CTA's whole tile
  // sequence, identically by producer and consumers: step i uses stage i % kStages in pass
  // i / kStages, tracked incrementally by a RingPos (kStages = 5 makes % and / cost registers).
  if (tid < 128) {
    // ---------------- producer ----------------
    ptx::sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid >= (kE4m3 ? 1 : 32)) return;  // one thread issues the TMA, a warp the cp.async
    RingPos<kStages> pos;
#ifdef MILA_W4A8_WS_TIMING_ONLY
    bool timing_only_filled = false;
#endif
    for (int cursor = first_piece<kCluster>(sched); cursor >= 0;) {
      const Piece piece = piece_at<kCluster>(sched, kt_count, cursor);
      cursor = next_piece<kCluster>(sched, cursor, piece);
      int tm, tn;
      tile_coords(piece.tile, tiles_m, tiles_n, kGroupM, tm, tn);
      const int n0 = (tn * kCluster + cta_rank<kCluster>()) * kBN;
      // Byte offset of this lane's first exponent row of the tile (rows tid + 32 i below;
      // 32-bit: the launcher refuses N * K / 32 >= 2^31, and the producer has 24 registers).
      [[maybe_unused]] const uint32_t lane_scales =
          static_cast<uint32_t>(n0 + tid) * static_cast<uint32_t>(K / 32);
      for (int kt = piece.k0; kt < piece.k1; ++kt, pos.advance()) {
        const uint32_t s = pos.stage;
        // A fresh barrier counts as having completed the pass before pass 0 (parity 1), so the
        // first kStages waits return at once.
        mbar_wait(empty_bar + 8 * s, pos.phase ^ 1);
        const uint32_t fb = full_bar + 8 * s;
#ifdef MILA_W4A8_WS_TIMING_ONLY
        // Diagnostic build, wrong results: once every stage holds a real tile the producer only
        // arrives (33 arrivals, no bytes), so the consumers run on stale tiles and the time
        // left is the kernel without its loads (docs/performance.md: feeding against structure).
        if (timing_only_filled) {
          ptx::sm90::mbar_arrive(fb);
          if (!kE4m3 && tid == 0) ptx::sm90::mbar_arrive(fb);
          continue;
        }
        timing_only_filled = s == kStages - 1;
#endif
        if (tid == 0) {
          ptx::sm90::mbar_arrive_expect_tx(fb, L::kTxBytes);
          if constexpr (kCluster == 1) {
            ptx::sm90::tma_load_2d(smem_base + s * kXStage, &tmap_x, fb, kt * kBK, tm * kBM);
          } else {  // this CTA's half of the activation rows, into both CTAs
            const int rank = cta_rank<kCluster>();
            ptx::sm90::tma_load_2d_multicast(smem_base + s * kXStage + rank * L::kXHalf, &tmap_x,
                                             fb, kt * kBK, tm * kBM + rank * (kBM / 2), 0x3);
          }
          ptx::sm90::tma_load_2d(smem_base + L::kWOffset + s * L::kWStage, &tmap_w, fb,
                                 kt * (kE4m3 ? kBK : kPackedTile), n0);
        }
        if constexpr (!kE4m3) {
          // Exponents of weight rows tid + 32 i; rows past N are zero-filled (zero weights).
#pragma unroll
          for (int i = 0; i < kBN / 32; ++i) {
            const int row = tid + 32 * i;
            const bool valid = n0 + row < N;
            const uint8_t* src =
                args.scales + (valid ? lane_scales + 32u * i * (K / 32) + kt * kKBlocks : 0u);
            ptx::w4a8::cp_async_4(smem_base + L::kEOffset + s * L::kEStage + row * kKBlocks, src,
                                  valid);
          }
          ptx::sm90::cp_async_mbar_arrive(fb);
        }
      }
    }
    // Producer tail (as CUTLASS's producer_tail): acquire the next kStages steps, i.e. wait
    // until the consumers have released the last kStages real steps (steps before 0 pass at
    // once). Then every full-barrier phase this warp armed has completed (its TMA loads and
    // cp.async arrive-ons landed) before the issuing threads exit; cannot hang, since the
    // consumers release every step they wait for. kCluster 2: the releases are both CTAs'
    // consumers', so this CTA's multicasts have landed in both and no remote arrival on its
    // barriers is still to come (the kernel's end needs no barrier.cluster).
#pragma unroll 1
    for (int j = 0; j < kStages; ++j, pos.advance())
      mbar_wait(empty_bar + 8 * pos.stage, pos.phase ^ 1);
    // Uncommitted cp.async belong to no group: commit, then wait, before the threads exit.
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    return;
  }

  // ---------------- consumers ----------------
  ptx::sm90::setmaxnreg_inc<kConsumerRegs>();
  const int cw = tid / 128 - 1;  // consumer warpgroup 0 / 1: weight rows 64 cw ..
  const int wtid = tid % 128;
  const int lane = tid % 32, wwarp = wtid / 32;
  const int g = lane / 4, q = lane % 4;
  const int wrow0 = cw * 64 + wwarp * 16 + g;  // tile-local weight rows wrow0, wrow0 + 8

  // A stage's release: every consumer thread arrives on its own CTA's empty barrier (the
  // producer's cp.async of the exponents then follows each thread's reads), and with kCluster 2
  // one lane per warp also on the other CTA's, whose producer multicasts into this CTA.
  auto release = [&](uint32_t stage) {
    const uint32_t bar = empty_bar + 8 * stage;
    ptx::sm90::mbar_arrive(bar);
    if constexpr (kCluster == 2) {
      __syncwarp();  // every lane of this warp is done with the stage
      if (threadIdx.x % 32 == 0)
        ptx::sm90::mbar_arrive_remote(ptx::sm90::map_to_cta(bar, cta_rank<kCluster>() ^ 1));
    }
  };

  RingPos<kStages> pos;
  for (int cursor = first_piece<kCluster>(sched); cursor >= 0;) {
    const Piece piece = piece_at<kCluster>(sched, kt_count, cursor);
    int tm, tn;
    tile_coords(piece.tile, tiles_m, tiles_n, kGroupM, tm, tn);
    // A whole tile, or the piece that owns a split one, stores the tile; the others leave
    // their partial sums to the owner.
    const bool stores_tile = piece.k0 == 0;
    const int64_t m0 = static_cast<int64_t>(tm) * kBM;
    const int n0 = (tn * kCluster + cta_rank<kCluster>()) * kBN;
    RowLut lut[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n0 + wrow0 + 8 * h;
      lut[h] = row_lut(n < N ? args.channel_exp[n] : 0u);
    }
    // Stage the tile's row scales for the epilogue now, with cp.async so that the main loop
    // does not wait for them (rows >= M: zeros). Every thread of this warpgroup has passed the
    // previous tile's last read of s_xs (the barrier before its stores) before getting here.
    if constexpr (!std::is_same_v<OutT, float>) if (stores_tile) {
      const uint32_t s_xs_addr = smem_base + L::kXsOffset + cw * kBM * 4;
#pragma unroll
      for (int i = 0; i < (kBM + 127) / 128; ++i) {
        if (kBM % 128 != 0 && wtid + 128 * i >= kBM) break;
        const int64_t row = m0 + wtid + 128 * i;
        ptx::w4a8::cp_async_4(s_xs_addr + (wtid + 128 * i) * 4,
                              args.x_scale + (row < M ? row : 0), row < M);
      }
      ptx::cp_async_commit();
    }

    // This thread's two weight rows of one stage: its word of each block (the 8 codes of k
    // 4q.. and 16+4q..; kernel order puts the four blocks' words of quad column q in bytes
    // 16q..16q+15) and the row's four block exponents (byte kb). Loaded whole right after the
    // stage's full barrier, ahead of the conversion: per-block loads put a
    // shared-memory round trip in front of every block's conversion (ncu: short-scoreboard
    // stalls at the exponent IMADs), and their 4-byte words at a 16-byte stride hit each bank
    // 4 times per warp. Held, they cost 10 registers per stage, which the 240 cover.
    struct RowWords {
      uint4 w;
      uint32_t e;
    };
    // A warp reads 512 contiguous bytes per row half (four 128-byte wavefronts, no conflicts)
    // and 8 exponent words, each broadcast to its quad.
    auto load_rows = [&](uint32_t s, RowWords (&r)[2]) {
      const uint8_t* sw = smem + L::kWOffset + s * L::kWStage;
      const uint8_t* se = smem + L::kEOffset + s * L::kEStage;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wrow0 + 8 * h;
        r[h].w = *reinterpret_cast<const uint4*>(sw + row * kPackedTile + q * 16);
        r[h].e = *reinterpret_cast<const uint32_t*>(se + row * kKBlocks);
      }
    };
#ifdef MILA_W4A8_WS_CONVERT_TWICE
    const uint32_t twice_zero = *static_cast<volatile uint32_t*>(&g_convert_twice_zero);
#endif
    // A fragment of block kb: {row g k 4q.., row g+8 k 4q.., row g k 16+4q.., row g+8 k 16+4q..}.
    auto convert = [&](const RowWords (&r)[2], int kb, uint32_t (&a)[4]) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4& w = r[h].w;
        const uint32_t word = kb == 0 ? w.x : kb == 1 ? w.y : kb == 2 ? w.z : w.w;
#ifdef MILA_W4A8_WS_NO_CONVERT
        // Diagnostic build, wrong results: the packed word's bits as e4m3 fragments (masked so
        // that no byte is a NaN), three instructions instead of the conversion's ~10 and no
        // exponent tables: a benchmark of it bounds what taking the conversion off the
        // consumers could buy.
        a[h] = word & 0x77777777u;
        a[2 + h] = (word >> 1) & 0x77777777u;
#else
        word_to_e4m3(word, (r[h].e >> (8 * kb)) & 0xFFu, lut[h], a[h], a[2 + h]);
#endif
#ifdef MILA_W4A8_WS_CONVERT_TWICE
        uint32_t lo2, hi2;
        word_to_e4m3(word ^ twice_zero, ((r[h].e ^ twice_zero) >> (8 * kb)) & 0xFFu, lut[h],
                     lo2, hi2);
        a[h] &= lo2;
        a[2 + h] &= hi2;
#endif
      }
    };

    // Master sums, m64 x kBM layout: acc[kWgN / 2 * h + i] = part h's partial[i].
    constexpr int kPart = L::kWgN / 2;  // registers of one partial sum
    float acc[kBM / 2];
#pragma unroll
    for (int i = 0; i < kBM / 2; ++i) acc[i] = 0.f;

    // One promotion chain: kChain consecutive K tiles (the next kChain steps), per part of the
    // activation rows (two n128 halves; kE4m3: one n192) 4 kChain wgmmas into a fresh partial
    // sum, waited for and added into the masters. Two tiles per chain halve the waits and adds
    // per wgmma: the tensor cores idle while a warpgroup drains, adds and reissues, and a
    // 4-wgmma batch (~256 cycles) of the other warpgroup did not cover that
    // (benchmarks/wgmma_loop.py: 1,437 TFLOP/s promoted per tile against 1,943 unpromoted; the
    // e4m3 instance with one-tile chains: -7 to -11%). The chain's weight blocks are converted
    // into their own registers first (or, kInterleave, each just before its first-half wgmma,
    // behind its own fence: see the kernel's template parameter for why that is no longer the
    // default); the second half reuses the fragments.
    auto chain = [&](auto tiles_in_chain) {
      constexpr int kChain = decltype(tiles_in_chain)::value;
      uint32_t st[kChain], sx[kChain];
      float part[kPart];  // never read before written (scale-d = 0 on a part's first wgmma)
      // Part h's wgmmas are issued: wait for them and add their partial into the masters.
      auto promote = [&](int h) {
        ptx::sm90::wgmma_commit();
        ptx::sm90::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kPart; ++i) ptx::sm90::fence_operand(part[i]);
#pragma unroll
        for (int i = 0; i < kPart; ++i) acc[kPart * h + i] += part[i];
      };
      if constexpr (kE4m3) {
#pragma unroll
        for (int c = 0; c < kChain; ++c, pos.advance()) {
          st[c] = pos.stage;
          sx[c] = smem_base + st[c] * kXStage;
          mbar_wait(full_bar + 8 * st[c], pos.phase);
        }
        // This warpgroup's 64 weight rows of a stage: 8 KiB in, on a swizzle atom.
        const uint32_t sw = smem_base + L::kWOffset + cw * 64 * kBK;
        static_assert(L::kParts == 1 && L::kWgN == 192, "one n192 part");
        ptx::sm90::wgmma_fence();
#pragma unroll
        for (int c = 0; c < kChain; ++c)
#pragma unroll
          for (int kb = 0; kb < kKBlocks; ++kb) {
            const uint64_t da = ptx::sm90::desc_k128b(sw + st[c] * L::kWStage + kb * 32);
            const uint64_t db = ptx::sm90::desc_k128b(sx[c] + kb * 32);
            if (c == 0 && kb == 0)
              ptx::w4a8::wgmma_m64n192k32_e4m3_ss<false>(part, da, db);
            else
              ptx::w4a8::wgmma_m64n192k32_e4m3_ss<true>(part, da, db);
          }
        promote(0);
        // The chain's wgmmas retired: the stages may be refilled.
#pragma unroll
        for (int c = 0; c < kChain; ++c) release(st[c]);
      } else {
        uint32_t a[kChain][kKBlocks][4];
#pragma unroll
        for (int c = 0; c < kChain; ++c, pos.advance()) {
          st[c] = pos.stage;
          sx[c] = smem_base + st[c] * kXStage;
          mbar_wait(full_bar + 8 * st[c], pos.phase);
          RowWords rows[2];
          load_rows(st[c], rows);
#pragma unroll
          for (int kb = 0; kb < kKBlocks; ++kb) {
            convert(rows, kb, a[c][kb]);
            if constexpr (kInterleave) {
              ptx::sm90::wgmma_fence();  // the fragment's registers were just written
              const uint64_t desc = ptx::sm90::desc_k128b(sx[c] + kb * 32);
              if (c == 0 && kb == 0)
                ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(part, a[c][kb], desc);
              else
                ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(part, a[c][kb], desc);
            }
          }
        }
#pragma unroll
        for (int h = 0; h < L::kParts; ++h) {
          if (h == 1 || !kInterleave) {
            ptx::sm90::wgmma_fence();
            wgmma_chain_half(part, a, [&](int c, int kb) {
              return ptx::sm90::desc_k128b(sx[c] + h * L::kWgN * kBK + kb * 32);
            });
          }
          promote(h);
        }
#pragma unroll
        for (int c = 0; c < kChain; ++c) {
#pragma unroll
          for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
            for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a[c][kb][e]);
          // Both halves retired and the packed rows were read above: the stage may be refilled.
          release(st[c]);
        }
      }
    };
    // Counted down: one register across the chains (the piece's bounds are not held).
    int left = piece.k1 - piece.k0;
    for (; left >= kChainTiles; left -= kChainTiles)
      chain(std::integral_constant<int, kChainTiles>{});
    if (left > 0) chain(std::integral_constant<int, 1>{});  // odd piece length
    // The piece again from the cursor (an opaque copy: recomputed, not held in registers).
    const Piece done = piece_at<kCluster>(sched, kt_count, ptx::w4a8::opaque(cursor));
    cursor = next_piece<kCluster>(sched, cursor, done);

    if (done.k0 != 0) {
      // This CTA's first stream-K piece: publish the partial sums for the tile's owner.
      float4* slot = sk_slot(args, blockIdx.x, cw, wtid);
#pragma unroll
      for (int j = 0; j < kBM / 8; ++j)
        __stcg(slot + 128 * j, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                                           acc[4 * j + 3]));
      ptx::named_barrier_sync(1 + cw, 128);  // the whole warpgroup's stores, then the release
      if (wtid == 0) ptx::st_release_gpu(sk_flag(args, blockIdx.x, cw), 1u);
      continue;
    }
    if (done.k1 < kt_count) {
      // The owner of a split tile: add the partials of the CTAs that ran the rest of its K.
      const int first = (done.tile - sched.dp_tiles) * kt_count;
      const int last_unit = (first + kt_count - 1) / sched.sk_share;
      for (int u = unit_id<kCluster>() + 1; u <= last_unit; ++u) {
        const int c = u * kCluster + cta_rank<kCluster>();  // unit u's CTA on these rows
        wait_flag(sk_flag(args, c, cw));
        const float4* slot = sk_slot(args, c, cw, wtid);
#pragma unroll
        for (int j = 0; j < kBM / 8; ++j) {
          const float4 v = __ldcg(slot + 128 * j);
          acc[4 * j] += v.x;
          acc[4 * j + 1] += v.y;
          acc[4 * j + 2] += v.z;
          acc[4 * j + 3] += v.w;
        }
      }
    }

    // Epilogue: acc[4j + e] = y^T[weight row wrow0 (+8 if e >= 2)][activation row 8j + 2q
    // (+1 if e odd)].
    const float ws0 = channel_scale(args.channel_exp, n0 + wrow0, N);
    const float ws1 = channel_scale(args.channel_exp, n0 + wrow0 + 8, N);
    if constexpr (std::is_same_v<OutT, float>) {
      store_f32_tile<kBM>(acc, static_cast<float*>(args.out), args.x_scale, m0, M, n0, wrow0,
                          N, ws0, ws1, q);
    } else {
      const uint8_t* so = smem + L::kOutOffset + cw * kOutBytes;
      const float* s_xs = reinterpret_cast<const float*>(smem + L::kXsOffset + cw * kBM * 4);
      const int bar_id = 1 + cw;  // named barrier of this warpgroup (0 is __syncthreads)
      // Staged through shared memory with stmatrix.trans: the accumulator is y^T (weight rows
      // x activation rows) and the output row-major y, so each 8 x 8 block is transposed on the
      // way (16 stmatrix per thread and tile instead of 128 two-byte stores). Lane l gives the
      // address of row l % 8 of matrix l / 8 = (activation block l / 16, weight half l / 8 % 2).
      const int mi = lane / 8, mr = lane % 8;
      const uint32_t st_addr = smem_base + L::kOutOffset + cw * kOutBytes +
                               ((8 * (mi / 2) + mr) * kOutPitch + wwarp * 16 + 8 * (mi % 2)) * 2;
      ptx::cp_async_wait<0>();  // this thread's row scales (staged at the tile start)
#pragma unroll
      for (int p = 0; p < kBM / kOutRows; ++p) {
        // Pass 0: every thread's row scales landed. Later: the previous pass's rows were read.
        ptx::named_barrier_sync(bar_id, 128);
#pragma unroll
        for (int jj = 0; jj < kOutRows / 8; jj += 2) {
          uint32_t r[4];
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int j = p * (kOutRows / 8) + jj + b;  // activation rows 8j + 2q, 8j + 2q + 1
            const float2 xs = *reinterpret_cast<const float2*>(s_xs + 8 * j + 2 * q);
            r[2 * b] = ptx::pack_bf16x2(acc[4 * j] * ws0 * xs.x, acc[4 * j + 1] * ws0 * xs.y);
            r[2 * b + 1] =
                ptx::pack_bf16x2(acc[4 * j + 2] * ws1 * xs.x, acc[4 * j + 3] * ws1 * xs.y);
          }
          ptx::sm90::stmatrix_x4_trans(st_addr + jj * 8 * kOutPitch * 2, r[0], r[1], r[2], r[3]);
        }
        ptx::named_barrier_sync(bar_id, 128);
        // 64 rows x 8 chunks of 16 bytes: 8 threads per row, 128 contiguous bytes.
#pragma unroll
        for (int i = 0; i < kOutRows * 8 / 128; ++i) {
          const int c = wtid + i * 128, r = c / 8, ch = c % 8;
          const int64_t row = m0 + p * kOutRows + r;
          const int col = n0 + cw * 64 + ch * 8;
          if (row < M && col < N) {
            const uint4 v = *reinterpret_cast<const uint4*>(so + (r * kOutPitch + ch * 8) * 2);
            *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(args.out) + row * N + col) = v;
          }
        }
      }
    }
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // an sm_90 image without the sm_90a features: fail loudly (see w4a8.cu)
#endif  // older archs compile an empty kernel that the launcher never starts
}

// ---- host -----------------------------------------------------------------------------------

// 2-D uint8 tensor [rows, cols] (row stride `cols` bytes), box [box_rows, box_cols].
cudaError_t EncodeMap(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                      uint32_t box_rows, uint32_t box_cols, CUtensorMapSwizzle swizzle) {
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                            strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // out of bounds: zeros
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Stream-K only where it pays. Each piece is at least kMinStreamKTiles K tiles long. The
// stream-K CTAs write and read their 128 KiB partials at about the same time, through L2: on
// the H200 (2026-12-01) a round of 131 partials cost ~12 us, ~12 K-tile times of one CTA at
// M = 4096 (qkv 8192 x 3840: 7 K tiles saved per CTA, 2.3% slower than whole tiles; down
// 3840 x 15360: 43 saved, 3.1% faster). So the last wave must shrink by at least one K tile
// per kPartialsPerSavedTile stream-K CTAs.
constexpr int kMinStreamKTiles = 8;
constexpr int kPartialsPerSavedTile = 10;
constexpr int kMaxStreamKCtas = static_cast<int>(kW4A8FlagBytes / 8);  // two flags of 4 bytes

// The schedule of `tiles` output tiles of kt_count K tiles each on `units` units (CTAs or
// clusters), stream-K over at most `sk_max` units (0: whole tiles only).
Schedule PlanSchedule(int64_t tiles, int kt_count, int units, int64_t sk_max) {
  Schedule s{static_cast<int>(tiles), 0, 0, 0};
  const int64_t rest = tiles % units;
  const int64_t sk_units = std::min<int64_t>(units, sk_max);
  if (rest == 0 || sk_units <= 0) return s;
  const int64_t iters = rest * kt_count;
  const int64_t share = std::max<int64_t>((iters + sk_units - 1) / sk_units, kMinStreamKTiles);
  const int64_t used = (iters + share - 1) / share;
  if ((kt_count - share) * kPartialsPerSavedTile < used) return s;
  s.dp_tiles = static_cast<int>(tiles - rest);
  s.sk_share = static_cast<int>(share);
  s.sk_iters = static_cast<int>(iters);
  s.sk_units = static_cast<int>(used);
  return s;
}

// kE4m3: the weights expanded to e4m3 at the workspace's end (W4A8ExpandBytes), the stream-K
// scratch before them.
template <typename OutT, int kCluster, bool kE4m3>
cudaError_t LaunchTyped(const W4A8Args& args, bool stream_k, cudaStream_t stream) {
  constexpr int kBM = Smem<kE4m3>::kBM;
  // TMA coordinates are int32; tile counts fit an int.
  if (args.m > INT32_MAX - kBM) return cudaErrorInvalidConfiguration;
  // Output tiles of the schedule: one weight tile each, or (kCluster 2) a pair.
  const int64_t tiles =
      ((args.m + kBM - 1) / kBM) * (((args.n + kBN - 1) / kBN + kCluster - 1) / kCluster);
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  // The producer addresses block exponents with 32-bit offsets (N x K/32 bytes: 32 GiB of
  // packed weights before this matters).
  if (static_cast<int64_t>(args.n) * (args.k / 32) > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  int64_t scratch_bytes = args.workspace != nullptr ? args.workspace_bytes : 0;
  uint8_t* weights_e4m3 = nullptr;
  if constexpr (kE4m3) {
    if (scratch_bytes < W4A8ExpandBytes(args.n, args.k)) return cudaErrorInvalidValue;
    const auto base = reinterpret_cast<uintptr_t>(args.workspace);
    const uintptr_t e4m3 = (base + scratch_bytes - static_cast<int64_t>(args.n) * args.k) &
                           ~static_cast<uintptr_t>(kW4A8ExpandAlign - 1);
    weights_e4m3 = reinterpret_cast<uint8_t*>(e4m3);
    scratch_bytes = static_cast<int64_t>(e4m3 - base);
  }
  CUtensorMap tmap_x, tmap_w;
  // kCluster 2: each CTA multicasts half of the activation rows of a stage.
  cudaError_t err = EncodeMap(&tmap_x, args.x, static_cast<uint64_t>(args.m),
                              static_cast<uint64_t>(args.k), kBM / kCluster, kBK,
                              CU_TENSOR_MAP_SWIZZLE_128B);
  if (err != cudaSuccess) return err;
  err = kE4m3 ? EncodeMap(&tmap_w, weights_e4m3, static_cast<uint64_t>(args.n),
                          static_cast<uint64_t>(args.k), kBN, kBK, CU_TENSOR_MAP_SWIZZLE_128B)
              : EncodeMap(&tmap_w, args.packed, static_cast<uint64_t>(args.n),
                          static_cast<uint64_t>(args.k / 2), kBN, kPackedTile,
                          CU_TENSOR_MAP_SWIZZLE_NONE);
  if (err != cudaSuccess) return err;
  // Not stream operations: allowed while a CUDA graph is being captured.
  int device = 0, sms = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return err;
  static const bool interleave = [] {
    const char* v = std::getenv("JAX_MILA_W4A8_WS_CONVERT");
    return v != nullptr && std::string_view(v) == "interleaved";
  }();
  constexpr int kSmemBytes = Smem<kE4m3>::kBytes;
  auto kernel = kCluster == 2 || kE4m3 ? w4a8_wgmma_ws_kernel<OutT, false, kCluster, kE4m3>
                : interleave          ? w4a8_wgmma_ws_kernel<OutT, true, 1, false>
                                      : w4a8_wgmma_ws_kernel<OutT, false, 1, false>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // The grid is set below, once the schedule is known.
  ClusterLaunchConfig launch(dim3(1), dim3(kThreads), kSmemBytes, stream, kCluster);
  cudaLaunchConfig_t& cfg = launch.cfg;
  // Units that are resident at once: one CTA per SM, or as many clusters as the GPCs hold (a
  // GPC with an odd number of free SMs leaves one idle). Stream-K needs every unit resident.
  // Queried once per device (the answer depends only on the kernel and the GPU).
  int units = sms;
  if constexpr (kCluster > 1) {
    // Per device ordinal; 0: not asked yet. Atomic: devices launch from their own threads.
    static std::atomic<int> cluster_units[64] = {};
    if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
    units = cluster_units[device].load(std::memory_order_relaxed);
    if (units == 0) {
      cfg.gridDim = dim3(static_cast<unsigned>(kCluster * (sms / kCluster)));
      if ((err = cudaOccupancyMaxActiveClusters(&units, kernel, &cfg)) != cudaSuccess) return err;
      if (units <= 0) return cudaErrorInvalidConfiguration;
      cluster_units[device].store(units, std::memory_order_relaxed);
    }
  }
  const int64_t slots = stream_k && scratch_bytes > kW4A8FlagBytes
                            ? (scratch_bytes - kW4A8FlagBytes) / kW4A8SlotBytes
                            : 0;
  const Schedule sched = PlanSchedule(tiles, args.k / kBK, units,
                                      std::min<int64_t>(slots, kMaxStreamKCtas) / kCluster);
  if (sched.sk_units > 0) {
    // Flags down; a stream operation, so it is captured with the launch into a CUDA graph.
    err = cudaMemsetAsync(args.workspace, 0,
                          static_cast<size_t>(sched.sk_units) * kCluster * 8, stream);
    if (err != cudaSuccess) return err;
  }
  // Every unit gets a whole tile per full wave; with no full wave, the stream-K units only.
  const int64_t grid_units =
      sched.dp_tiles > 0 ? std::min<int64_t>(tiles, units) : std::max(sched.sk_units, 1);
  cfg.gridDim = dim3(static_cast<unsigned>(kCluster * grid_units));
  if constexpr (kE4m3) {
    if ((err = LaunchW4A8ExpandWeights(args, weights_e4m3, stream)) != cudaSuccess) return err;
  }
  return cudaLaunchKernelEx(&cfg, kernel, tmap_x, tmap_w, args, sched);
}

}  // namespace ws
}  // namespace

cudaError_t LaunchW4A8WgmmaWs(const W4A8Args& args, bool stream_k, int cluster, bool e4m3,
                              cudaStream_t stream) {
  auto launch = [&](auto cluster_size, auto expand) {
    constexpr int kCluster = decltype(cluster_size)::value;
    constexpr bool kE4m3 = decltype(expand)::value;
    return args.out_f32 ? ws::LaunchTyped<float, kCluster, kE4m3>(args, stream_k, stream)
                        : ws::LaunchTyped<__nv_bfloat16, kCluster, kE4m3>(args, stream_k, stream);
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (e4m3) return cluster == 2 ? launch(Two{}, std::true_type{}) : launch(One{}, std::true_type{});
  return cluster == 2 ? launch(Two{}, std::false_type{}) : launch(One{}, std::false_type{});
}

}  // namespace mila
