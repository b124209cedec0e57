// W4A8 GEMM: y[M, N] = (x_fp8[M, K] * x_scale[M]) @ W[N, K]^T, W in MXFP4 (jax_mila/quant/mxfp4.py:
// e2m1 codes packed in kernel order, e8m0 block exponents, a per-channel reference exponent),
// on FP8 tensor cores with float32 accumulation; the weights stay 4-bit in memory. The grouped
// form multiplies rows sorted by expert with their expert's weight (mixture of experts).
// Design: docs/design/w4a8.md. Kernels:
//   wgmma_ws (sm_90a, w4a8_sm90_ws.cu): warp-specialized (TMA producer warpgroup, mbarrier ring,
//     two consumer warpgroups), persistent; the weights become e4m3 register A operands of
//     wgmma.m64n128k32 (activations are the shared-memory B operand: y^T tiles), partial sums
//     promoted to float32 every 256 of K. Dense problems run it on 2-CTA clusters sharing each
//     activation tile through TMA multicast, with stream-K for the last wave's tiles; from
//     kW4A8ExpandMinRows rows on weights expanded to e4m3 first (w4a8_expand.cu) as the
//     shared-memory A operand. Grouped problems walk a tile list built on the device
//     (w4a8_groups.cu).
//   mma.sync (sm_89+, w4a8.cu): m16n8k32 FP8 mma, dense and grouped. Native on sm_89; on sm_90
//     ptxas lowers FP8 mma.sync to fp16 HMMA, so Hopper uses wgmma_ws.
//   gemv (w4a8_gemv.cu): decode, 1 to kW4A8GemvMaxRows rows, dense. Streams the MXFP4 codes
//     and exponents straight from memory (no e4m3 expansion), dequantizes them in registers to
//     fp16 and multiplies on fp16 mma.sync (the weights are the m16 operand, the few activation
//     rows n8), K split across CTAs where N alone cannot fill the GPU (W4A8GemvPlan).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace mila {

// K: the weights are stored in groups of 128 (kW4A8KMultiple) values of K, zero-padded; the
// activations may be shorter by less than a group, in whole MXFP4 blocks (kW4A8KBlock). Output
// rows are written in 8-column groups. M is free (rows past M are masked).
constexpr int kW4A8KMultiple = 128;
constexpr int kW4A8KBlock = 32;
constexpr int kW4A8NMultiple = 8;
// Minimum compute capability (10 * major + minor) of the FP8 mma.
constexpr int kW4A8MinComputeCapability = 89;
// wgmma_ws's stream-K workspace (jax_mila/ffi/w4a8.py sizes it): flags of up to 512 CTAs, then
// per CTA one float32 partial of its 128 x 256 output tile.
constexpr int64_t kW4A8FlagBytes = 4096;
constexpr int64_t kW4A8SlotBytes = 128 * 256 * 4;
// The e4m3 instance expands the weights into the workspace's last N x Kp bytes (from a 256-byte
// aligned address; the stream-K scratch is what lies before).
constexpr int64_t kW4A8ExpandAlign = 256;
// Activation rows from which kAuto expands the weights on Hopper (the caller must then size the
// workspace for it: W4A8WorkspaceBytes).
constexpr int64_t kW4A8ExpandMinRows = 4096;
// Grouped problems: at most this many experts, each a contiguous run of rows; wgmma_ws cuts
// them into tiles of kW4A8WsGroupRows rows (mma.sync: 128).
constexpr int kW4A8MaxExperts = 1024;
constexpr int kW4A8WsGroupRows = 256;

struct W4A8Args {
  const uint8_t* x;            // float8_e4m3fn [M, K]
  const float* x_scale;        // [M]
  const uint8_t* packed;       // [E x N, Kp / 2], e2m1 codes in kernel order
  const uint8_t* scales;       // [E x N, Kp / 32], e8m0
  const uint8_t* channel_exp;  // [E x N], max over blocks of scales
  void* out;                   // [M, N], bfloat16 or float32 (out_f32)
  // Scratch (jax_mila/ffi/w4a8.py sizes it): dense wgmma_ws takes its stream-K flags and
  // partials, and the expanded weights; grouped calls take their tile list.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // Grouped problems: rows [offset_e, offset_e + group_sizes[e]) use expert e's weight
  // (offset_e = the sum of the sizes before e), nullptr for a dense problem (E = 1).
  const int32_t* group_sizes = nullptr;
  int experts = 1;
  bool out_f32 = false;
  int64_t m = 0;
  int n = 0;   // output columns per expert
  int k = 0;   // activation columns: a multiple of kW4A8KBlock, kp - 128 < k <= kp
  int kp = 0;  // the weights' stored K, a multiple of kW4A8KMultiple
};

// Which kernel runs. kAuto: the GEMV for dense calls of at most kW4A8GemvMaxRows rows; else
// wgmma_ws on compute capability 9.0 when the build has sm_90a code (dense: on expanded weights
// from kW4A8ExpandMinRows rows up), mma.sync otherwise. The others name one kernel (tests and
// benchmarks): kWgmmaWs converts the weights in registers, kWgmmaWsE4m3 expands them first
// (dense only), kGemv takes dense calls of 1 to kW4A8GemvMaxRows rows.
enum class W4A8Variant : int {
  kAuto = 0,
  kMmaSync = 1,
  kWgmmaWs = 2,
  kWgmmaWsE4m3 = 3,
  kGemv = 4,
};
constexpr int64_t kW4A8LastVariant = static_cast<int64_t>(W4A8Variant::kGemv);

// What kAuto runs for `args` on a device of compute capability `cc` (10 * major + minor); any
// other variant as it is.
W4A8Variant ResolveW4A8Variant(W4A8Variant variant, const W4A8Args& args, int cc);

// The scratch a call of `variant` needs at least (the handler refuses less): the grouped tile
// list, or for kWgmmaWsE4m3 the expanded weights. Stream-K slots beyond that are optional.
int64_t W4A8RequiredWorkspace(W4A8Variant variant, const W4A8Args& args);

// Requires the sizes above, 16-byte aligned x, packed and out, and compute capability >= 8.9
// (`cc`); the wgmma variants require cc == 90 and a build for sm_90a. Kernels compiled for
// older archs are empty: W4A8CodeProblem says when the build would launch one.
cudaError_t LaunchW4A8Matmul(const W4A8Args& args, W4A8Variant variant, int cc,
                             cudaStream_t stream);

// Why this build cannot run `variant` (resolved) on a device of compute capability `cc`, or
// nullptr. The mma.sync kernel needs code compiled for compute_89 or newer, the wgmma kernels
// sm_90a code: a build whose architectures lack them would give such a device an empty kernel
// (its PTX of an older arch, JIT-compiled) that returns without writing the output.
// `compiled_for` receives the PTX version (10 * major + minor) of the mma.sync code the device
// loads, 0 if it has none.
const char* W4A8CodeProblem(W4A8Variant variant, int cc, int* compiled_for);

// ---- pieces shared by the launchers (not kernels' public API) ------------------------------

// wgmma_ws (w4a8_sm90_ws.cu); cc must be 90. Dense: 2-CTA clusters, stream-K where the
// workspace has slots, e4m3 = on expanded weights (needs W4A8ExpandBytes). Grouped: one CTA per
// unit on the tile list that LaunchW4A8GroupTiles wrote into the workspace.
cudaError_t LaunchW4A8WgmmaWs(const W4A8Args& args, bool e4m3, cudaStream_t stream);

// ---- the GEMV (w4a8_gemv.cu) -----------------------------------------------------------------

// Rows the GEMV takes (its activation rows are one or two n8 operands of m16n8k16).
constexpr int64_t kW4A8GemvMaxRows = 16;
// A CTA computes kW4A8GemvCtaRows output columns (weight rows) over kc groups of 128 of K, with
// the activations of those groups in shared memory as fp16 (rows padded to 8 or 16, each row
// padded by 64 bytes): kc <= 47 for 1-8 rows, 23 for 9-16 (at most 96 KiB). Two CTAs an SM.
constexpr int kW4A8GemvCtaRows = 128;
constexpr int kW4A8GemvCtasPerSm = 2;
constexpr int kW4A8GemvMaxKcSmall = 47;  // rows <= 8
constexpr int kW4A8GemvMaxKcLarge = 23;  // rows 9..16
// How many splits the plan may consider past the fewest (a bound on the host's search).
constexpr int kW4A8GemvSplitSearch = 64;
// A CTA's fixed cost in the plan, in groups of its stream: its first loads' latency, the
// activations' staging, the partial's write and the last arrival's sum.
constexpr int kW4A8GemvCtaOverhead = 2;

// Split-K through a thread-block cluster (sm_90a code on a 9.0 device): the splits of a tile
// are one cluster and add their partials in distributed shared memory, in split order. No
// workspace and no counters to zero before each call. At most this many splits (the portable
// cluster size); a K that needs more runs on the counters below.
constexpr int kW4A8GemvMaxClusterSplits = 8;

// The launch of one GEMV: tiles of kW4A8GemvCtaRows output columns, K split into `splits`
// ranges of `kc` groups (the last may be shorter). Split-K partials without a cluster: per
// (tile, split) one float32 [rows8][kW4A8GemvCtaRows] slot in the workspace after one arrival
// counter per tile, zeroed before the launch.
struct W4A8GemvPlan {
  int64_t tiles = 0;
  int splits = 1;
  int kc = 0;
  int rows8 = 8;  // activation rows padded: 8 or 16
  bool cluster = false;  // the splits of a tile are one cluster (splits > 1 only)
};

inline int64_t W4A8CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The split rule (jax_mila/ffi/w4a8.py, _gemv_plan, is the same function) for `tiles` tiles of
// output columns. Splits that share their K ranges with fewer splits
// (ceil(groups / ceil(groups / s)) < s) are never chosen.
//  * At least s_min splits: a CTA's K range must fit its shared memory (kc <= kc_max).
//  * One wave where it can: the most splits whose CTAs all fit on the GPU at once
//    (kW4A8GemvCtasPerSm x SMs slots); N alone fills it from 256 tiles (N = 32768) on.
//  * Else (s_min splits already exceed a wave) the splits that minimize the longest stream,
//    ceil(CTAs / slots) waves x (kc + kW4A8GemvCtaOverhead) groups, ties to fewer splits.
//  * `cluster` (the device and build can run cluster split-K) and s_min <=
//    kW4A8GemvMaxClusterSplits: the same rule with at most that many splits, as clusters, where
//    the slots of s splits are `cluster_slots[s]` when given: the CTAs that clusters of s fit on
//    the GPU at once, fewer than the SMs' slots where a GPC's SMs do not divide into clusters
//    (an H100: 62 clusters of 4, 248 CTAs, not 264).
// `sms` <= 0: s_min (the least workspace).
inline W4A8GemvPlan W4A8GemvMakePlan(int64_t tiles, int kp, int64_t m, int sms, bool cluster,
                                     const int64_t* cluster_slots = nullptr) {
  W4A8GemvPlan p;
  p.tiles = tiles;
  p.rows8 = m <= 8 ? 8 : 16;
  const int64_t groups = kp / kW4A8KMultiple;
  const int64_t kc_max = m <= 8 ? kW4A8GemvMaxKcSmall : kW4A8GemvMaxKcLarge;
  const int64_t s_min = W4A8CeilDiv(groups, kc_max);
  cluster = cluster && s_min <= kW4A8GemvMaxClusterSplits;
  const int64_t s_cap = cluster && groups > kW4A8GemvMaxClusterSplits ? kW4A8GemvMaxClusterSplits
                                                                       : groups;
  int64_t s = s_min;
  if (sms > 0) {
    const int64_t slots = static_cast<int64_t>(kW4A8GemvCtasPerSm) * sms;
    auto slots_of = [&](int64_t c) {
      return cluster && c > 1 && cluster_slots != nullptr ? cluster_slots[c] : slots;
    };
    if (p.tiles * s_min <= slots_of(s_min)) {
      s = slots / p.tiles < s_cap ? slots / p.tiles : s_cap;
      while (s > s_min && p.tiles * s > slots_of(s)) --s;
      s = s < s_min ? s_min : s;
    } else {
      int64_t best_cost = -1;
      const int64_t s_end = s_cap < s_min + kW4A8GemvSplitSearch ? s_cap
                                                                 : s_min + kW4A8GemvSplitSearch;
      for (int64_t c = s_min; c <= s_end; ++c) {
        const int64_t kc = W4A8CeilDiv(groups, c);
        if (W4A8CeilDiv(groups, kc) != c) continue;
        const int64_t cost = W4A8CeilDiv(p.tiles * c, slots_of(c)) * (kc + kW4A8GemvCtaOverhead);
        if (best_cost < 0 || cost < best_cost) best_cost = cost, s = c;
      }
    }
  }
  p.kc = static_cast<int>(W4A8CeilDiv(groups, s));
  p.splits = static_cast<int>(W4A8CeilDiv(groups, p.kc));
  p.cluster = cluster && p.splits > 1;
  return p;
}

// Scratch of a plan: nothing without split-K or with clusters; else the counters (256-byte
// aligned) and slots.
inline int64_t W4A8GemvWorkspaceBytes(const W4A8GemvPlan& p) {
  if (p.splits <= 1 || p.cluster) return 0;
  return W4A8CeilDiv(4 * p.tiles, 256) * 256 +
         p.tiles * p.splits * p.rows8 * kW4A8GemvCtaRows * 4;
}

// Weights that one GEMV launch multiplies by the same activations (attention's q, k and v
// projections; the MLP's gate and up): their tiles form one list, weight by weight, and share
// one plan. Each weight has its own N (a multiple of kW4A8NMultiple) and output [M, N]; K, Kp,
// the activations and the output dtype are the call's (W4A8Args).
constexpr int kW4A8GemvMaxWeights = 3;
struct W4A8GemvWeights {
  int count = 0;
  const uint8_t* packed[kW4A8GemvMaxWeights] = {};
  const uint8_t* scales[kW4A8GemvMaxWeights] = {};
  const uint8_t* channel_exp[kW4A8GemvMaxWeights] = {};
  void* out[kW4A8GemvMaxWeights] = {};
  int n[kW4A8GemvMaxWeights] = {};
  int64_t tile_end[kW4A8GemvMaxWeights] = {};  // one past each weight's last tile in the list
};
// Adds a weight (its arrays and output) to `w` (count < kW4A8GemvMaxWeights).
inline void W4A8GemvAddWeight(W4A8GemvWeights& w, const uint8_t* packed, const uint8_t* scales,
                              const uint8_t* channel_exp, void* out, int n) {
  const int i = w.count++;
  w.packed[i] = packed;
  w.scales[i] = scales;
  w.channel_exp[i] = channel_exp;
  w.out[i] = out;
  w.n[i] = n;
  w.tile_end[i] = (i > 0 ? w.tile_end[i - 1] : 0) + W4A8CeilDiv(n, kW4A8GemvCtaRows);
}

// The one weight of a dense call (args.packed ... args.out, args.n) as W4A8GemvWeights.
inline W4A8GemvWeights W4A8GemvWeightOf(const W4A8Args& args) {
  W4A8GemvWeights w;
  W4A8GemvAddWeight(w, args.packed, args.scales, args.channel_exp, args.out, args.n);
  return w;
}
// The plan of the GEMV of `w` with the activations of `args` on the current device: its SMs,
// and clusters where the device and the build run them; with `sized` the plan must also fit
// args.workspace_bytes, else the fewest splits (what W4A8GemvRequiredWorkspace demands).
W4A8GemvPlan W4A8GemvDevicePlan(const W4A8Args& args, const W4A8GemvWeights& w, bool sized);
// The least workspace the GEMV of `w` needs on the current device (the handlers refuse less).
int64_t W4A8GemvRequiredWorkspace(const W4A8Args& args, const W4A8GemvWeights& w);
// The GEMV on `args` (dense, 1 <= m <= kW4A8GemvMaxRows), its one weight args.packed ...
cudaError_t LaunchW4A8Gemv(const W4A8Args& args, cudaStream_t stream);
// ... or on the weights of `w` (args' weight and output fields unused).
cudaError_t LaunchW4A8GemvWeights(const W4A8Args& args, const W4A8GemvWeights& w,
                                  cudaStream_t stream);
// Why this build cannot run the GEMV on the current device, or nullptr (as W4A8CodeProblem).
const char* W4A8GemvCodeProblem(int* compiled_for);
// The PTX version (10 * major + minor) of the code `kernel` has for the current device, asked
// once per device and kept in `cache` (kW4A8MaxDevices slots, zero-initialized): nullptr with
// *version set, or why it cannot tell (no code for this device, no current device).
constexpr int kW4A8MaxDevices = 64;
const char* W4A8KernelPtxVersion(const void* kernel, std::atomic<int>* cache, int* version);

// The least workspace the e4m3 instance takes: the expanded weights and their alignment.
inline int64_t W4A8ExpandBytes(int n, int kp) {
  return static_cast<int64_t>(n) * kp + kW4A8ExpandAlign;
}

// MXFP4 weights (args.packed, scales, channel_exp; args.n x args.kp) -> e4m3 [N, Kp] at `out`
// (16-byte aligned), K in natural order (w4a8_expand.cu). Any compute capability.
cudaError_t LaunchW4A8ExpandWeights(const W4A8Args& args, uint8_t* out, cudaStream_t stream);

// Grouped problems (w4a8_groups.cu). The tile list in the workspace: a header of 16 bytes (the
// number of M tiles, int32), then one W4A8GroupTile per M tile of `rows` activation rows, in
// expert order. Group sizes are read on the device: negative sizes count as 0, and groups end at
// row M. Rows past the last group are written with zeros by the same launch.
struct W4A8GroupTile {
  int32_t expert;
  int32_t row0;   // first activation row
  int32_t row_end;  // one past the tile's last row of this expert (row0 + rows at most)
  int32_t pad;
};
constexpr int64_t kW4A8GroupHeaderBytes = 16;
inline int64_t W4A8GroupTileCapacity(int64_t m, int experts, int rows) {
  return (m + rows - 1) / rows + experts;
}
inline int64_t W4A8GroupListBytes(int64_t m, int experts, int rows) {
  return kW4A8GroupHeaderBytes + W4A8GroupTileCapacity(m, experts, rows) * 16;
}
cudaError_t LaunchW4A8GroupTiles(const W4A8Args& args, int rows, cudaStream_t stream);

}  // namespace mila
