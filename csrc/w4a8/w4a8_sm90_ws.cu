// Warp-specialized W4A8 GEMM for sm_90a (kernel "wgmma_ws"), dense and grouped. Computes y^T
// tiles: 128 weight rows (the wgmma A operand) x 256 activation rows (the shared-memory B
// operand) per tile. docs/design/w4a8.md has the design and the measurements behind it.
//
//   * warpgroup 0, the producer (setmaxnreg.dec to 24 registers): one thread issues the TMA
//     loads of each K tile (activations with the 128-byte swizzle the wgmma descriptor expects;
//     packed weights, or the expanded e4m3 weights of the kE4m3 instance) into a 5-stage ring of
//     full/empty mbarriers; the 32 lanes of its first warp copy the tile's block exponents with
//     cp.async (their K/32-byte rows are no TMA box) and arrive on the full barrier when their
//     copies land. The other producer warps exit at once.
//   * warpgroups 1 and 2, the consumers (setmaxnreg.inc to 240): weight rows 64 w .. 64 w + 63
//     of the tile each, all activation rows. Per promotion chain of two K tiles, the chain's
//     weight blocks are converted into e4m3 A fragments, then per n128 half of the activation
//     rows 8 wgmmas run into a fresh partial sum, which is waited for and added into the float32
//     masters (Hopper's FP8 wgmma accumulates at ~14 bits). The two warpgroups are not
//     synchronized with each other: while one drains and adds, the other's batch runs.
//   * persistent: units (CTAs, or 2-CTA clusters) walk their list of pieces (below); the
//     producer runs ahead into the next tile while the consumers store the previous one.
//   * epilogue: x_scale[m] * 2^(channel_exp - 133), bf16 rounding, staged per warpgroup through
//     its own shared buffer with stmatrix.trans, 16-byte row-contiguous stores; float32 output
//     is stored directly. Rows past the tile's end and columns >= N are not stored.
//   * every mbarrier wait traps after 20 s: a protocol bug fails the launch, not the GPU.
//
// Instances: kCluster 2 (dense): two CTAs of a cluster take adjacent weight tiles of one
// activation tile and each multicasts half of every activation stage into both. kE4m3 (dense):
// the weights were expanded to e4m3 [N, Kp] into the workspace (w4a8_expand.cu) and are the
// shared-memory A operand of wgmma.m64n192k32 (192 activation rows per tile, no conversion).
// kGrouped: tiles are (entry of the device-built tile list, weight tile), whole tiles only.
//
// Sizes: Kp % 128 == 0 (an odd number of K tiles ends with a one-tile chain); activation
// columns past K read as zeros (TMA bounds); N % 8 == 0 (weight rows past N read as zero
// weights, or the next expert's rows, never stored); any M >= 1 below 2^31.

#include <algorithm>
#include <atomic>
#include <cmath>
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

// Named barriers (id 0 is __syncthreads): one per consumer warpgroup, for its epilogue buffer
// and its stream-K partials.
enum class Barrier : int { kConsumer0 = 1, kConsumer1 = 2 };
__device__ __forceinline__ int consumer_barrier(int cw) {
  return static_cast<int>(Barrier::kConsumer0) + cw;
}

// Tiles and shared memory of the two instances. Activation rows per tile: 256, two n128 halves
// of wgmmas, or (kE4m3) 192 in one n192 part, whose partial sum of 96 registers fits beside 96
// masters. A stage holds the activation tile (32 or 24 KiB) and the weight tile: packed codes
// (8 KiB) and block exponents (512 B), or (kE4m3) the expanded e4m3 weights (16 KiB, 128-byte
// rows in the 128-byte swizzle). 5 stages of 40.5 or 40 KiB.
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
  // x_scale of the tile's rows, per consumer warpgroup: copied in with cp.async at the tile's
  // start and read from shared memory in the epilogue.
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
  static_assert(kE4m3 ? (kWOffset | kWStage) % 1024 == 0
                      : kKBlocks == 4 && kPackedTile == 4 * 16 && (kWOffset | kWStage) % 16 == 0 &&
                            (kEOffset | kEStage) % 4 == 0,
                "alignment of the weight tiles");
};
static_assert(Smem<false>::kBM == kW4A8WsGroupRows, "the grouped tile list's rows per tile");

// ---- PTX (sm_90a) ---------------------------------------------------------------------------

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// A wait longer than this traps (the launch fails with "unspecified launch failure") instead of
// hanging the GPU. Every legitimate wait here lasts microseconds, even under compute-sanitizer.
constexpr uint64_t kWatchdogNs = 20000000000ull;  // 20 s
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (ptx::sm90::mbar_try_wait(bar, parity)) return;  // the common case: no timer read
  const uint64_t t0 = global_timer_ns();
  while (!ptx::sm90::mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - t0 > kWatchdogNs) __trap();
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
// A unit is one CTA, or with kCluster = 2 a cluster of two CTAs that run the same pieces on
// adjacent weight tiles (tiles then count pairs of weight tiles).
//
// Dense: whole tiles [0, dp_tiles) go round-robin, one per unit and wave (data-parallel). The
// tiles of the last, partial wave are cut along K (stream-K): their K tiles, counted tile after
// tile, are dealt out in runs of sk_share to units 0 .. sk_units - 1. A run that starts inside a
// tile (k0 > 0) is its unit's first stream-K piece: it leaves a float32 partial in the CTA's
// workspace slot and raises the slot's flag. The run holding k = 0 of a tile (its owner) ends
// its unit's list and adds the later runs' partials, in unit order, before the epilogue. An
// owner waits only for the first pieces of higher units, which wait for nobody: no cycle, with
// every CTA resident (the launcher sizes the grid to what fits at once).
//
// Grouped: whole tiles only, t = entry * tiles_n + weight tile, round-robin over the units; the
// number of entries is read from the tile list.
struct Schedule {
  int dp_tiles;
  int sk_units;  // 0: no stream-K
  int sk_share;  // K tiles per stream-K unit, fewer than a tile's
  int sk_iters;  // K tiles of all stream-K tiles
};

// A unit's piece of work: K tiles [k0, k1) of output tile `tile`.
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

// Output tiles of a grouped call.
__device__ __forceinline__ int grouped_tiles(const W4A8Args& args) {
  return group_tile_count(args) * ((args.n + kBN - 1) / kBN);
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
template <int kCluster, bool kGrouped>
__device__ __forceinline__ int first_piece(const Schedule& s, const W4A8Args& args) {
  if constexpr (kGrouped) return unit_id<kCluster>() < grouped_tiles(args) ? unit_id<kCluster>() : -1;
  if (unit_id<kCluster>() < s.dp_tiles) return unit_id<kCluster>();
  return sk_begin<kCluster>(s) < sk_end<kCluster>(s) ? s.dp_tiles + sk_begin<kCluster>(s) : -1;
}
template <int kCluster, bool kGrouped>
__device__ __forceinline__ Piece piece_at(const Schedule& s, int kt_count, int cursor) {
  if (kGrouped || cursor < s.dp_tiles) return {cursor, 0, kt_count};
  const int it = cursor - s.dp_tiles, u = it / kt_count, k0 = it - u * kt_count;
  return {s.dp_tiles + u, k0, min(kt_count, k0 + sk_end<kCluster>(s) - it)};
}
template <int kCluster, bool kGrouped>
__device__ __forceinline__ int next_piece(const Schedule& s, const W4A8Args& args, int cursor,
                                          const Piece& p) {
  if constexpr (kGrouped) {
    const int t = cursor + unit_count<kCluster>();
    return t < grouped_tiles(args) ? t : -1;
  }
  if (cursor < s.dp_tiles) {
    const int t = cursor + unit_count<kCluster>();
    if (t < s.dp_tiles) return t;
    return sk_begin<kCluster>(s) < sk_end<kCluster>(s) ? s.dp_tiles + sk_begin<kCluster>(s) : -1;
  }
  const int it = cursor - s.dp_tiles + p.k1 - p.k0;
  return it < sk_end<kCluster>(s) ? s.dp_tiles + it : -1;
}

// The rows and weight rows of output tile `tile` for this CTA.
template <int kCluster, bool kGrouped, int kBM>
__device__ __forceinline__ Tile tile_of(const W4A8Args& args, int tile) {
  const int tiles_n = ((args.n + kBN - 1) / kBN + kCluster - 1) / kCluster;
  if constexpr (kGrouped) {
    static_assert(kCluster == 1, "grouped calls run on single CTAs");
    return group_tile(args, tile / tiles_n, tile % tiles_n, kBN);
  }
  int tm, tn;
  tile_coords(tile, static_cast<int>((args.m + kBM - 1) / kBM), tiles_n, kGroupM, tm, tn);
  return dense_tile(args, tm, tn * kCluster + cta_rank<kCluster>(), kBM, kBN);
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
    if (global_timer_ns() - t0 > kWatchdogNs) __trap();
  }
}

// ---- kernel ---------------------------------------------------------------------------------
//
// kCluster 2: each CTA's full barrier expects the whole stage (its own weights and both
// activation halves) and one expect_tx arrival of its own producer; the empty barriers count
// every consumer thread of their CTA and one lane per consumer warp of the other CTA (either
// producer overwrites the stage in both). Every wait and arrival keeps the CTA scope, as
// CUTLASS's cluster pipelines do (cluster-scope acquire/release cost an L1 invalidation after
// every wait). barrier.cluster at the start: both CTAs' barriers are initialised before any
// multicast or remote arrival. None at the end: a producer leaves only after its tail has seen
// every stage released by both CTAs' consumers.
template <typename OutT, int kCluster, bool kE4m3, bool kGrouped>
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
  const int N = args.n;
  const int kt_count = args.kp / kBK;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::sm90::mbar_init(full_bar + 8 * s, L::kFullArrivals);
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
  // i / kStages, tracked incrementally by a RingPos.
  if (tid < 128) {
    // ---------------- producer ----------------
    ptx::sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid >= (kE4m3 ? 1 : 32)) return;  // one thread issues the TMA, a warp the cp.async
    RingPos<kStages> pos;
    for (int cursor = first_piece<kCluster, kGrouped>(sched, args); cursor >= 0;) {
      const Piece piece = piece_at<kCluster, kGrouped>(sched, kt_count, cursor);
      cursor = next_piece<kCluster, kGrouped>(sched, args, cursor, piece);
      const Tile t = tile_of<kCluster, kGrouped, kBM>(args, piece.tile);
      // Byte offset of this lane's first exponent row of the tile (rows tid + 32 i below;
      // 32-bit: the launcher refuses E x N x Kp/32 >= 2^31, and the producer has 24 registers).
      const uint32_t scale_row = static_cast<uint32_t>(args.kp / 32);
      [[maybe_unused]] const uint32_t lane_scales =
          static_cast<uint32_t>(t.w_row0 + tid) * scale_row;
      for (int kt = piece.k0; kt < piece.k1; ++kt, pos.advance()) {
        const uint32_t s = pos.stage;
        // A fresh barrier counts as having completed the pass before pass 0 (parity 1), so the
        // first kStages waits return at once.
        mbar_wait(empty_bar + 8 * s, pos.phase ^ 1);
        const uint32_t fb = full_bar + 8 * s;
        if (tid == 0) {
          ptx::sm90::mbar_arrive_expect_tx(fb, L::kTxBytes);
          const int row = static_cast<int>(t.m0);
          if constexpr (kCluster == 1) {
            ptx::sm90::tma_load_2d(smem_base + s * kXStage, &tmap_x, fb, kt * kBK, row);
          } else {  // this CTA's half of the activation rows, into both CTAs
            const int rank = cta_rank<kCluster>();
            ptx::sm90::tma_load_2d_multicast(smem_base + s * kXStage + rank * L::kXHalf, &tmap_x,
                                             fb, kt * kBK, row + rank * (kBM / 2), 0x3);
          }
          ptx::sm90::tma_load_2d(smem_base + L::kWOffset + s * L::kWStage, &tmap_w, fb,
                                 kt * (kE4m3 ? kBK : kPackedTile), static_cast<int>(t.w_row0));
        }
        if constexpr (!kE4m3) {
          // Exponents of weight rows tid + 32 i; rows past N are zero-filled (zero weights).
#pragma unroll
          for (int i = 0; i < kBN / 32; ++i) {
            const int row = tid + 32 * i;
            const bool valid = t.n0 + row < N;
            const uint8_t* src =
                args.scales + (valid ? lane_scales + 32u * i * scale_row + kt * kKBlocks : 0u);
            ptx::w4a8::cp_async_4(smem_base + L::kEOffset + s * L::kEStage + row * kKBlocks, src,
                                  valid);
          }
          ptx::sm90::cp_async_mbar_arrive(fb);
        }
      }
    }
    // Producer tail: wait until the consumers have released the last kStages real steps (steps
    // before 0 pass at once), so every full-barrier phase this warp armed has completed before
    // the issuing threads exit; with kCluster 2 the releases are both CTAs' consumers', so this
    // CTA's multicasts have landed in both.
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

  // A stage's release: every consumer thread arrives on its own CTA's empty barrier, and with
  // kCluster 2 one lane per warp also on the other CTA's, whose producer multicasts into this CTA.
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
  for (int cursor = first_piece<kCluster, kGrouped>(sched, args); cursor >= 0;) {
    const Piece piece = piece_at<kCluster, kGrouped>(sched, kt_count, cursor);
    // A whole tile, or the piece that owns a split one, stores the tile; the others leave
    // their partial sums to the owner.
    const bool stores_tile = piece.k0 == 0;
    RowLut lut[2];
    {
      const Tile t = tile_of<kCluster, kGrouped, kBM>(args, piece.tile);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = t.n0 + wrow0 + 8 * h;
        lut[h] = row_lut(n < N ? args.channel_exp[t.w_row0 + wrow0 + 8 * h] : 0u);
      }
      // Stage the tile's row scales for the epilogue now, with cp.async so that the main loop
      // does not wait for them (rows past the tile's end: zeros). Every thread of this
      // warpgroup has passed the previous tile's last read of s_xs (the barrier before its
      // stores) before getting here.
      if constexpr (!std::is_same_v<OutT, float>) if (stores_tile) {
        const uint32_t s_xs_addr = smem_base + L::kXsOffset + cw * kBM * 4;
#pragma unroll
        for (int i = 0; i < (kBM + 127) / 128; ++i) {
          if (kBM % 128 != 0 && wtid + 128 * i >= kBM) break;
          const int64_t row = t.m0 + wtid + 128 * i;
          ptx::w4a8::cp_async_4(s_xs_addr + (wtid + 128 * i) * 4,
                                args.x_scale + (row < t.m_end ? row : 0), row < t.m_end);
        }
        ptx::cp_async_commit();
      }
    }

    // This thread's two weight rows of one stage: its word of each block (kernel order puts the
    // four blocks' words of quad column q in bytes 16q..16q+15) and the row's four block
    // exponents (byte kb), loaded whole right after the stage's full barrier, ahead of the
    // conversion. A warp reads 512 contiguous bytes per row half and 8 exponent words, each
    // broadcast to its quad.
    struct RowWords {
      uint4 w;
      uint32_t e;
    };
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
    // A fragment of block kb: {row g k 4q.., row g+8 k 4q.., row g k 16+4q.., row g+8 k 16+4q..}.
    auto convert = [&](const RowWords (&r)[2], int kb, uint32_t (&a)[4]) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4& w = r[h].w;
        const uint32_t word = kb == 0 ? w.x : kb == 1 ? w.y : kb == 2 ? w.z : w.w;
        word_to_e4m3(word, (r[h].e >> (8 * kb)) & 0xFFu, lut[h], a[h], a[2 + h]);
      }
    };

    // Master sums, m64 x kBM layout: acc[kWgN / 2 * h + i] = part h's partial[i].
    constexpr int kPart = L::kWgN / 2;  // registers of one partial sum
    float acc[kBM / 2];
#pragma unroll
    for (int i = 0; i < kBM / 2; ++i) acc[i] = 0.f;

    // One promotion chain: kChain consecutive K tiles (the next kChain steps), per part of the
    // activation rows (two n128 halves; kE4m3: one n192) 4 kChain wgmmas into a fresh partial
    // sum, waited for and added into the masters. The chain's weight blocks are all converted
    // into their own registers first, then one fence and the half's wgmmas back to back; the
    // second half reuses the fragments.
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
          for (int kb = 0; kb < kKBlocks; ++kb) convert(rows, kb, a[c][kb]);
        }
#pragma unroll
        for (int h = 0; h < L::kParts; ++h) {
          ptx::sm90::wgmma_fence();
          wgmma_chain_half(part, a, [&](int c, int kb) {
            return ptx::sm90::desc_k128b(sx[c] + h * L::kWgN * kBK + kb * 32);
          });
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
    const Piece done = piece_at<kCluster, kGrouped>(sched, kt_count, ptx::w4a8::opaque(cursor));
    cursor = next_piece<kCluster, kGrouped>(sched, args, cursor, done);

    if constexpr (!kGrouped) {
      if (done.k0 != 0) {
        // This CTA's first stream-K piece: publish the partial sums for the tile's owner.
        float4* slot = sk_slot(args, blockIdx.x, cw, wtid);
#pragma unroll
        for (int j = 0; j < kBM / 8; ++j)
          __stcg(slot + 128 * j, make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2],
                                             acc[4 * j + 3]));
        // The whole warpgroup's stores, then the release.
        ptx::named_barrier_sync(consumer_barrier(cw), 128);
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
    }

    // Epilogue: acc[4j + e] = y^T[weight row wrow0 (+8 if e >= 2)][activation row 8j + 2q
    // (+1 if e odd)].
    const Tile t = tile_of<kCluster, kGrouped, kBM>(args, done.tile);
    const uint8_t* channel_exp = args.channel_exp + (t.w_row0 - t.n0);
    const float ws0 = channel_scale(channel_exp, t.n0 + wrow0, N);
    const float ws1 = channel_scale(channel_exp, t.n0 + wrow0 + 8, N);
    if constexpr (std::is_same_v<OutT, float>) {
      store_f32_tile<kBM>(acc, static_cast<float*>(args.out), args.x_scale, t.m0, t.m_end, t.n0,
                          wrow0, N, ws0, ws1, q);
    } else {
      const uint8_t* so = smem + L::kOutOffset + cw * kOutBytes;
      const float* s_xs = reinterpret_cast<const float*>(smem + L::kXsOffset + cw * kBM * 4);
      const int bar_id = consumer_barrier(cw);
      // Staged through shared memory with stmatrix.trans: the accumulator is y^T (weight rows
      // x activation rows) and the output row-major y, so each 8 x 8 block is transposed on the
      // way. Lane l gives the address of row l % 8 of matrix l / 8 = (activation block l / 16,
      // weight half l / 8 % 2).
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
          const int64_t row = t.m0 + p * kOutRows + r;
          const int col = t.n0 + cw * 64 + ch * 8;
          if (row < t.m_end && col < N) {
            const uint4 v = *reinterpret_cast<const uint4*>(so + (r * kOutPitch + ch * 8) * 2);
            *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(args.out) + row * N + col) = v;
          }
        }
      }
    }
  }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __trap();  // an sm_90 image without the sm_90a features: fail loudly
#endif  // older archs compile an empty kernel that the launcher never starts
}

// ---- host -----------------------------------------------------------------------------------

// 2-D uint8 tensor [rows, cols] (row stride `stride` bytes), box [box_rows, box_cols].
cudaError_t EncodeMap(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                      uint64_t stride, uint32_t box_rows, uint32_t box_cols,
                      CUtensorMapSwizzle swizzle) {
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                            strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // out of bounds: zeros
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Stream-K only where it pays. Each piece is at least kMinStreamKTiles K tiles long, and the
// last wave must shrink by at least one K tile per kPartialsPerSavedTile stream-K CTAs (their
// partials pass through L2 at about the same time).
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

// Units resident at once: one CTA per SM, or as many clusters as the GPCs hold (asked once per
// device: the answer depends only on the kernel and the GPU).
template <int kCluster, typename Kernel>
cudaError_t ResidentUnits(Kernel kernel, int device, int sms, cudaLaunchConfig_t& cfg,
                          int* units) {
  *units = sms;
  if constexpr (kCluster > 1) {
    static std::atomic<int> cluster_units[64] = {};  // per device ordinal; 0: not asked yet
    if (device < 0 || device >= 64) return cudaErrorInvalidDevice;
    int n = cluster_units[device].load(std::memory_order_relaxed);
    if (n == 0) {
      cfg.gridDim = dim3(static_cast<unsigned>(kCluster * (sms / kCluster)));
      cudaError_t err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
      if (err != cudaSuccess) return err;
      if (n <= 0) return cudaErrorInvalidConfiguration;
      cluster_units[device].store(n, std::memory_order_relaxed);
    }
    *units = n;
  }
  return cudaSuccess;
}

// Dense calls: kCluster 2; kE4m3 on the weights expanded into the workspace's end
// (W4A8ExpandBytes), the stream-K scratch before them. Grouped calls: kCluster 1, the tile list
// at the workspace's start.
template <typename OutT, int kCluster, bool kE4m3, bool kGrouped>
cudaError_t LaunchTyped(const W4A8Args& args, cudaStream_t stream) {
  constexpr int kBM = Smem<kE4m3>::kBM;
  // TMA coordinates are int32; tile counts fit an int.
  if (args.m > INT32_MAX - kBM) return cudaErrorInvalidConfiguration;
  // The producer addresses block exponents with 32-bit offsets.
  if (static_cast<int64_t>(args.experts) * args.n * (args.kp / 32) > INT32_MAX)
    return cudaErrorInvalidConfiguration;
  const int64_t tiles_n = ((args.n + kBN - 1) / kBN + kCluster - 1) / kCluster;
  const int64_t tiles = kGrouped ? W4A8GroupTileCapacity(args.m, args.experts, kBM) * tiles_n
                                 : ((args.m + kBM - 1) / kBM) * tiles_n;
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  int64_t scratch_bytes = args.workspace != nullptr ? args.workspace_bytes : 0;
  uint8_t* weights_e4m3 = nullptr;
  if constexpr (kE4m3) {
    if (scratch_bytes < W4A8ExpandBytes(args.n, args.kp)) return cudaErrorInvalidValue;
    const auto base = reinterpret_cast<uintptr_t>(args.workspace);
    const uintptr_t e4m3 = (base + scratch_bytes - static_cast<int64_t>(args.n) * args.kp) &
                           ~static_cast<uintptr_t>(kW4A8ExpandAlign - 1);
    weights_e4m3 = reinterpret_cast<uint8_t*>(e4m3);
    scratch_bytes = static_cast<int64_t>(e4m3 - base);
  }
  CUtensorMap tmap_x, tmap_w;
  // kCluster 2: each CTA multicasts half of the activation rows of a stage.
  cudaError_t err = EncodeMap(&tmap_x, args.x, static_cast<uint64_t>(args.m),
                              static_cast<uint64_t>(args.k), static_cast<uint64_t>(args.k),
                              kBM / kCluster, kBK, CU_TENSOR_MAP_SWIZZLE_128B);
  if (err != cudaSuccess) return err;
  const uint64_t weight_rows = static_cast<uint64_t>(args.experts) * args.n;
  err = kE4m3 ? EncodeMap(&tmap_w, weights_e4m3, weight_rows, args.kp, args.kp, kBN, kBK,
                          CU_TENSOR_MAP_SWIZZLE_128B)
              : EncodeMap(&tmap_w, args.packed, weight_rows, args.kp / 2, args.kp / 2, kBN,
                          kPackedTile, CU_TENSOR_MAP_SWIZZLE_NONE);
  if (err != cudaSuccess) return err;
  // Not stream operations: allowed while a CUDA graph is being captured.
  int device = 0, sms = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return err;
  constexpr int kSmemBytes = Smem<kE4m3>::kBytes;
  auto kernel = w4a8_wgmma_ws_kernel<OutT, kCluster, kE4m3, kGrouped>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // The grid is set below, once the schedule is known.
  ClusterLaunchConfig launch(dim3(1), dim3(kThreads), kSmemBytes, stream, kCluster);
  cudaLaunchConfig_t& cfg = launch.cfg;
  int units = sms;
  if ((err = ResidentUnits<kCluster>(kernel, device, sms, cfg, &units)) != cudaSuccess) return err;
  Schedule sched{static_cast<int>(tiles), 0, 0, 0};
  int64_t grid_units = std::min<int64_t>(tiles, units);
  if constexpr (kGrouped) {
    if ((err = LaunchW4A8GroupTiles(args, kBM, stream)) != cudaSuccess) return err;
  } else {
    const int64_t slots =
        scratch_bytes > kW4A8FlagBytes ? (scratch_bytes - kW4A8FlagBytes) / kW4A8SlotBytes : 0;
    sched = PlanSchedule(tiles, args.kp / kBK, units,
                         std::min<int64_t>(slots, kMaxStreamKCtas) / kCluster);
    if (sched.sk_units > 0) {
      // Flags down; a stream operation, so it is captured with the launch into a CUDA graph.
      err = cudaMemsetAsync(args.workspace, 0,
                            static_cast<size_t>(sched.sk_units) * kCluster * 8, stream);
      if (err != cudaSuccess) return err;
    }
    // Every unit gets a whole tile per full wave; with no full wave, the stream-K units only.
    if (sched.dp_tiles == 0) grid_units = std::max(sched.sk_units, 1);
  }
  cfg.gridDim = dim3(static_cast<unsigned>(kCluster * grid_units));
  if constexpr (kE4m3) {
    if ((err = LaunchW4A8ExpandWeights(args, weights_e4m3, stream)) != cudaSuccess) return err;
  }
  return cudaLaunchKernelEx(&cfg, kernel, tmap_x, tmap_w, args, sched);
}

}  // namespace ws
}  // namespace

cudaError_t LaunchW4A8WgmmaWs(const W4A8Args& args, bool e4m3, cudaStream_t stream) {
  if (args.group_sizes != nullptr) {
    if (e4m3) return cudaErrorInvalidValue;  // grouped calls convert in registers
    return args.out_f32 ? ws::LaunchTyped<float, 1, false, true>(args, stream)
                        : ws::LaunchTyped<__nv_bfloat16, 1, false, true>(args, stream);
  }
  if (e4m3)
    return args.out_f32 ? ws::LaunchTyped<float, 2, true, false>(args, stream)
                        : ws::LaunchTyped<__nv_bfloat16, 2, true, false>(args, stream);
  return args.out_f32 ? ws::LaunchTyped<float, 2, false, false>(args, stream)
                      : ws::LaunchTyped<__nv_bfloat16, 2, false, false>(args, stream);
}

}  // namespace mila
