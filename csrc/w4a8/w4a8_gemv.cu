// The W4A8 GEMV / skinny GEMM of decode: y[M, N] = (x_fp8[M, K] * x_scale[M]) @ W[N, K]^T for
// 1 <= M <= 16 rows, W in MXFP4 (jax_mila/quant/mxfp4.py), read straight from memory: no e4m3
// expansion, no N x K scratch. Design: docs/design/w4a8.md, "The GEMV".
//
// Bytes and FLOPs. A weight value costs 0.5 + 1/32 bytes (codes and block exponents) and 2M
// FLOP: 3.8 FLOP a byte at M = 1, 60 at M = 16. Streaming 4.8 TB/s (H200) is 9.0e12 values/s,
// i.e. 290 TFLOP/s at M = 16: four times the FP32 pipe of an H100 (67 TFLOP/s), and Hopper runs
// FP8 mma.sync as fp16 HMMA anyway (ptxas inserts the operand conversions). So the codes become
// fp16 in registers and fp16 mma.sync m16n8k16 (float32 accumulation) does the products, the
// weights as the m16 operand and the activation rows as one or two n8 operands: 8 HMMA per
// warp, 16 weight rows and 128 of K per n8 (the tensor rate this asks for at M = 16 is about
// half of what mma.sync gives on Hopper). Each value is exact in fp16: code * 2^d with
// d = block exponent - channel exponent in [-11, 0] spans [2^-12, 6] (fp16 normals from 2^-14),
// and every e4m3 activation is an fp16 value. So the kernel differs from the reference only by
// float32 summation order.
//
// Dequantization. The 16-byte chunk q of a row's 64-byte kernel-order group holds the words
// (q, b) of its 4 blocks b; word (q, b) carries k = 32b + 4q + {0..3} and 32b + 16 + 4q + {0..3}.
// ptx::w4a8::e2m1x8_to_e4m3x8 with a table of fp16 high bytes instead of e4m3 bytes (the sign
// sits at bit 7 in both; a block's offset d adds 4d to the high byte) gives those 8 values as
// high bytes; two byte permutes per 4 values put them into fp16x2 registers (low bytes zero):
// 11 instructions per 8 values plus 2 IMADs per row and block for the table. m16n8k16 lets each
// lane choose which k its two slot pairs hold, as long as its A and B registers agree: lane
// (g, q) takes its rows g and g + 8 from word (q, b), and its activation fragment is one
// 16-byte shared-memory load of the same 8 k, which the staging wrote in that order.
//
// Work split. A CTA (8 warps) computes 128 output columns (weight rows, 16 a warp) over a range
// of kc groups of K; its activation rows of that range sit in shared memory as fp16 (converted
// once per CTA). Each lane streams 16-byte ld.global.nc.L1::no_allocate loads of its two rows,
// 4 groups a batch, the next batch in flight while the current one is converted and multiplied
// (8 loads of 16 bytes a lane, 32 KiB a CTA, 64 KiB an SM at two CTAs). One launch may hold up
// to three weights that multiply the same activations (W4A8GemvWeights): their tiles are one
// list. Where the tiles cannot fill the GPU, K is split (W4A8GemvMakePlan). On Hopper the
// splits of a tile are one thread-block cluster: each CTA leaves its float32 partial tile in
// its shared memory, and after a cluster barrier each CTA adds up a share of the tile's
// elements across the cluster's CTAs (distributed shared memory) in split order. Elsewhere (or
// past kW4A8GemvMaxClusterSplits splits) each CTA writes its partial to a workspace slot,
// raises its tile's counter (zeroed before the launch), and the CTA that arrives last adds the
// slots in split order. Either way the result does not depend on which CTA finished when
// (bitwise repeatable), and only the rows below M are written and added.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <type_traits>

#include "common/cluster_launch.h"
#include "common/ptx.cuh"
#include "common/ptx_sm90.cuh"
#include "w4a8/w4a8_kernel.h"

// Archs below the kernel's minimum compile its body away and leave these unused.
#pragma nv_diag_suppress 177

namespace mila {
namespace {
namespace gemv {

#ifdef MILA_BUILD_HAS_SM90A
constexpr bool kBuildHasSm90a = true;
#else
constexpr bool kBuildHasSm90a = false;
#endif
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kW4A8GemvCtaRows;
static_assert(kRows == 16 * kWarps, "a warp computes 16 weight rows");
constexpr int kGroupBytes = kW4A8KMultiple / 2;  // packed bytes of a row per group
constexpr int kBatch = 4;                        // groups a lane loads at once
constexpr int kRowPad = 64;  // activation rows 64 bytes past a multiple of 128: no conflicts
constexpr int kMaxSmem = 96 * 1024;

// fp16 high bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5 / 2, 3, 4, 6; a block exponent offset d
// adds 4 d to the nonzero ones (the fp16 exponent field starts at bit 2 of the high byte).
constexpr uint32_t kLutLo = 0x3E3C3800u;
constexpr uint32_t kLutHi = 0x46444240u;
constexpr uint32_t kStepLo = 0x04040400u;
constexpr uint32_t kStepHi = 0x04040404u;
constexpr int kChannelShift = 127;  // weight = fp16 value * 2^(channel_exp - 127)

__host__ __device__ constexpr int act_stride(int kc) {
  return kc * kW4A8KMultiple * 2 + kRowPad;
}
__host__ __device__ constexpr int smem_bytes(int rows8, int kc) { return rows8 * act_stride(kc); }
static_assert(smem_bytes(8, kW4A8GemvMaxKcSmall) <= kMaxSmem, "activations of 1-8 rows");
static_assert(smem_bytes(16, kW4A8GemvMaxKcLarge) <= kMaxSmem, "activations of 9-16 rows");

// 8 codes of one word -> fp16x2 registers of k offsets {0, 1}, {2, 3}, {16, 17}, {18, 19}
// (+ 4q within the block), the table already shifted by the block's offset.
__device__ __forceinline__ void word_to_f16(uint32_t word, uint32_t lut_lo, uint32_t lut_hi,
                                            uint32_t (&h)[4]) {
  uint32_t lo, hi;
  ptx::w4a8::e2m1x8_to_e4m3x8(word, lut_lo, lut_hi, lo, hi);
  h[0] = ptx::w4a8::prmt(lo, 0u, 0x1404u);  // {0, byte 0, 0, byte 1}
  h[1] = ptx::w4a8::prmt(lo, 0u, 0x3424u);  // {0, byte 2, 0, byte 3}
  h[2] = ptx::w4a8::prmt(hi, 0u, 0x1404u);
  h[3] = ptx::w4a8::prmt(hi, 0u, 0x3424u);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int b) {
  return b == 0 ? v.x : b == 1 ? v.y : b == 2 ? v.z : v.w;
}

// Two e4m3 bytes (the low 16 bits) -> fp16x2, exact (hardware cvt on sm_89+, else software).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// One of a launch's weights (W4A8GemvWeights), chosen without indexing the kernel parameter
// arrays (which would copy them to local memory).
template <typename T>
__device__ __forceinline__ T pick(const T (&a)[kW4A8GemvMaxWeights], int i) {
  static_assert(kW4A8GemvMaxWeights == 3, "pick chooses among three");
  return i == 0 ? a[0] : i == 1 ? a[1] : a[2];
}

// Grid: plan.tiles x plan.splits CTAs, blockIdx.x = tile * splits + split (the tiles of all the
// weights of `w`, in order); kCluster: clusters of plan.splits CTAs, one a tile. kMT: n8
// activation tiles (1: M <= 8, 2: M <= 16).
template <typename OutT, int kMT, bool kCluster>
__global__ void __launch_bounds__(kThreads, kW4A8GemvCtasPerSm)
    w4a8_gemv_kernel(const W4A8Args args, const W4A8GemvWeights w, const W4A8GemvPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int last_arrival;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, q = lane % 4;
  const int64_t M = args.m, K = args.k;
  const int64_t list_tile = blockIdx.x / plan.splits;  // in the launch's list
  const int split = static_cast<int>(blockIdx.x % plan.splits);
  // This CTA's weight and its tile of that weight.
  const int wi = (w.count > 1 && list_tile >= w.tile_end[0]) +
                 (w.count > 2 && list_tile >= w.tile_end[1]);
  const int64_t tile = list_tile - (wi == 0 ? 0 : pick(w.tile_end, wi - 1));
  const int N = pick(w.n, wi);
  const int groups = args.kp / kW4A8KMultiple;
  const int j0 = split * plan.kc;
  const int kc = min(plan.kc, groups - j0);  // >= 1: the plan has no empty split
  const int stride = act_stride(plan.kc);

  // This lane's weight rows r0 and r1 = r0 + 8 (masked past N: zero codes, no access).
  const int64_t n0 = tile * kRows + warp * 16;
  const int64_t r0 = n0 + g, r1 = r0 + 8;
  const bool v0 = r0 < N, v1 = r1 < N;
  const int64_t packed_row = args.kp / 2, scale_row = args.kp / 32;
  const uint8_t* packed = pick(w.packed, wi);
  const uint8_t* code0 = packed + (v0 ? r0 : 0) * packed_row + j0 * kGroupBytes + q * 16;
  const uint8_t* code1 = packed + (v1 ? r1 : 0) * packed_row + j0 * kGroupBytes + q * 16;
  // A group's 4 block exponents of a row: one 32-bit word (rows are Kp/32 bytes, Kp % 128 == 0).
  const uint8_t* scales = pick(w.scales, wi);
  const uint32_t* exp0 =
      reinterpret_cast<const uint32_t*>(scales + (v0 ? r0 : 0) * scale_row) + j0;
  const uint32_t* exp1 =
      reinterpret_cast<const uint32_t*>(scales + (v1 ? r1 : 0) * scale_row) + j0;
  const uint8_t* channel_exp = pick(w.channel_exp, wi);

  // A batch: each lane's two 16-byte chunks of kBatch groups, and of its rows' exponent words
  // the one of group jb + q (the four lanes of a row hold the batch's four; shuffled out below).
  static_assert(kBatch == 4, "one exponent word a lane of a row's quad");
  auto load = [&](int jb, uint4 (&wc)[2][kBatch], uint32_t (&e)[2]) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool in = jb + u < kc;
      wc[0][u] = ptx::ld_nc_v4_or_zero<true>(code0 + (jb + u) * kGroupBytes, in && v0);
      wc[1][u] = ptx::ld_nc_v4_or_zero<true>(code1 + (jb + u) * kGroupBytes, in && v1);
    }
    const bool in = jb + q < kc;
    e[0] = in && v0 ? __ldg(exp0 + jb + q) : 0u;
    e[1] = in && v1 ? __ldg(exp1 + jb + q) : 0u;
  };

  const bool warp_active = n0 < N;  // warp-uniform
  uint4 cur_w[2][kBatch];
  uint32_t cur_e[2];
  if (warp_active) load(0, cur_w, cur_e);  // in flight while the activations are staged

  // Activations of groups [j0, j0 + kc) as fp16, rows padded to 8 kMT with zeros (and zeros
  // past K): row r at r * stride; block lb (local) at lb * 64 bytes; in it the 16 bytes of q
  // hold k = 4q..4q+3 and 16+4q..16+4q+3, the order of word_to_f16.
  {
    // kStageLoads (row, block) items a thread at once: their loads in flight together (at 16
    // rows and kc = 23 that is 2 L2 round trips before the first product, not 6).
    constexpr int kStageLoads = 4;
    const int blocks = kc * 4, items = 8 * kMT * blocks;
    for (int i0 = tid; i0 < items; i0 += kThreads * kStageLoads) {
      uint4 a[kStageLoads], b[kStageLoads];
#pragma unroll
      for (int s = 0; s < kStageLoads; ++s) {
        const int i = i0 + s * kThreads;
        const int r = i / blocks, lb = i % blocks;
        const int64_t k = static_cast<int64_t>(j0) * kW4A8KMultiple + lb * 32;
        const bool in = i < items && r < M && k < K;  // K % 32 == 0: blocks wholly in or out
        const uint8_t* src = args.x + (in ? r * K + k : 0);
        a[s] = ptx::ld_nc_v4_or_zero<false>(src, in);
        b[s] = ptx::ld_nc_v4_or_zero<false>(src + 16, in);
      }
#pragma unroll
      for (int s = 0; s < kStageLoads; ++s) {
        const int i = i0 + s * kThreads;
        if (i >= items) break;
        const uint32_t aw[4] = {a[s].x, a[s].y, a[s].z, a[s].w};
        const uint32_t bw[4] = {b[s].x, b[s].y, b[s].z, b[s].w};
        uint8_t* dst = smem + (i / blocks) * stride + (i % blocks) * 64;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          *reinterpret_cast<uint4*>(dst + 16 * c) =
              make_uint4(e4m3x2_to_f16x2(aw[c]), e4m3x2_to_f16x2(aw[c] >> 16),
                         e4m3x2_to_f16x2(bw[c]), e4m3x2_to_f16x2(bw[c] >> 16));
        }
      }
    }
  }
  __syncthreads();

  float acc[kMT][4];
#pragma unroll
  for (int t = 0; t < kMT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

  const uint32_t ch0 = v0 ? channel_exp[r0] : 0u, ch1 = v1 ? channel_exp[r1] : 0u;
  if (warp_active) {
    // Table constants: block exponent s gives table s * step + c (c folds -R * step in).
    const uint32_t clo0 = kLutLo - ch0 * kStepLo, chi0 = kLutHi - ch0 * kStepHi;
    const uint32_t clo1 = kLutLo - ch1 * kStepLo, chi1 = kLutHi - ch1 * kStepHi;
    const uint8_t* act = smem + g * stride + q * 16;
    for (int jb = 0; jb < kc; jb += kBatch) {
      uint4 next_w[2][kBatch];
      uint32_t next_e[2];
      load(jb + kBatch, next_w, next_e);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (jb + u >= kc) break;
        const uint32_t e0 = __shfl_sync(0xFFFFFFFFu, cur_e[0], (lane & ~3) | u);
        const uint32_t e1 = __shfl_sync(0xFFFFFFFFu, cur_e[1], (lane & ~3) | u);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const uint32_t s0 = (e0 >> (8 * b)) & 0xFFu;
          const uint32_t s1 = (e1 >> (8 * b)) & 0xFFu;
          uint32_t h0[4], h1[4];
          word_to_f16(word_of(cur_w[0][u], b), s0 * kStepLo + clo0, s0 * kStepHi + chi0, h0);
          word_to_f16(word_of(cur_w[1][u], b), s1 * kStepLo + clo1, s1 * kStepHi + chi1, h1);
          const uint32_t a_lo[4] = {h0[0], h1[0], h0[1], h1[1]};
          const uint32_t a_hi[4] = {h0[2], h1[2], h0[3], h1[3]};
#pragma unroll
          for (int t = 0; t < kMT; ++t) {
            const uint4 xb = *reinterpret_cast<const uint4*>(act + 8 * t * stride +
                                                             ((jb + u) * 4 + b) * 64);
            const uint32_t b_lo[2] = {xb.x, xb.y}, b_hi[2] = {xb.z, xb.w};
            ptx::mma_f16_16816(acc[t], a_lo, b_lo);
            ptx::mma_f16_16816(acc[t], a_hi, b_hi);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int u = 0; u < kBatch; ++u) cur_w[h][u] = next_w[h][u];
        cur_e[h] = next_e[h];
      }
    }
  }

  // acc[t] = {y(m, r0), y(m + 1, r0), y(m, r1), y(m + 1, r1)} before scaling, m = 8t + 2q.
  const int c0 = warp * 16 + g, c1 = c0 + 8;  // columns within the tile
  // This thread's part of the partial tile [M][kRows] at `dst` (rows below M only).
  auto write_partial = [&](float* dst) {
#pragma unroll
    for (int t = 0; t < kMT; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = 8 * t + 2 * q + e;
        if (m < M) {
          dst[m * kRows + c0] = acc[t][e];
          dst[m * kRows + c1] = acc[t][2 + e];
        }
      }
  };
  // out[m, col] = y in the output's dtype.
  auto store = [&](int64_t m, int64_t col, float y) {
    OutT* out = static_cast<OutT*>(pick(w.out, wi));
    if constexpr (std::is_same_v<OutT, float>) {
      out[m * N + col] = y;
    } else {
      out[m * N + col] = __float2bfloat16_rn(y);
    }
  };
  if constexpr (kCluster) {
    // The partial tile [M][kRows] in this CTA's shared memory (the activations are done with),
    // then each CTA of the cluster sums a share of its elements over the cluster in split
    // order (the cluster rank is the split: the splits of a tile are consecutive CTAs).
    __syncthreads();
    float* partial = reinterpret_cast<float*>(smem);
    write_partial(partial);
    ptx::sm90::cluster_sync();  // every partial written and visible to the cluster
    const uint32_t base = ptx::smem_addr(partial);
    const int elems = static_cast<int>(M) * kRows;
    for (int i = split * kThreads + tid; i < elems; i += plan.splits * kThreads) {
      float part[kW4A8GemvMaxClusterSplits];
#pragma unroll
      for (int s = 0; s < kW4A8GemvMaxClusterSplits; ++s) {
        part[s] = s < plan.splits ? ptx::sm90::ld_shared_cluster_f32(ptx::sm90::map_to_cta(base + 4 * i, s))
                                  : 0.f;
      }
      float sum = 0.f;
#pragma unroll
      for (int s = 0; s < kW4A8GemvMaxClusterSplits; ++s) {
        if (s < plan.splits) sum += part[s];
      }
      const int m = i / kRows;
      const int64_t col = tile * kRows + i % kRows;
      if (col < N) {
        const float ws = ldexpf(1.f, static_cast<int>(channel_exp[col]) - kChannelShift);
        store(m, col, sum * ws * args.x_scale[m]);
      }
    }
    ptx::sm90::cluster_sync();  // no CTA leaves while another may still read its partial
    return;
  } else if (plan.splits > 1) {
    uint32_t* counters = static_cast<uint32_t*>(args.workspace);
    float* slots = reinterpret_cast<float*>(static_cast<uint8_t*>(args.workspace) +
                                            (4 * plan.tiles + 255) / 256 * 256);  // W4A8GemvWorkspaceBytes
    const int64_t slot_elems = static_cast<int64_t>(plan.rows8) * kRows;
    float* mine = slots + (list_tile * plan.splits + split) * slot_elems;
    // The rows below M of the slot, zeros included (columns past N, idle warps); the last
    // arrival reads those rows only.
    write_partial(mine);
    __threadfence();  // the slot before the arrival, at GPU scope
    __syncthreads();
    if (tid == 0) {
      last_arrival =
          atomicAdd(counters + list_tile, 1u) == static_cast<uint32_t>(plan.splits - 1);
    }
    __syncthreads();
    if (!last_arrival) return;
    __threadfence();
    // Every element's sum in split order (the same sums every run); the splits outside, so
    // that the loads of several splits and all of a lane's elements are in flight together.
    const float* slot = slots + list_tile * plan.splits * slot_elems + 2 * q * kRows;
#pragma unroll
    for (int t = 0; t < kMT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;
#pragma unroll 4
    for (int s = 0; s < plan.splits; ++s, slot += slot_elems) {
#pragma unroll
      for (int t = 0; t < kMT; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (8 * t + 2 * q + e < M) {
            acc[t][e] += __ldcg(slot + (8 * t + e) * kRows + c0);
            acc[t][2 + e] += __ldcg(slot + (8 * t + e) * kRows + c1);
          }
        }
    }
  }

  if (!warp_active) return;
  const float ws0 = v0 ? ldexpf(1.f, static_cast<int>(ch0) - kChannelShift) : 0.f;
  const float ws1 = v1 ? ldexpf(1.f, static_cast<int>(ch1) - kChannelShift) : 0.f;
#pragma unroll
  for (int t = 0; t < kMT; ++t)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t m = 8 * t + 2 * q + e;
      if (m >= M) continue;
      const float xs = args.x_scale[m];
      if (v0) store(m, r0, acc[t][e] * ws0 * xs);
      if (v1) store(m, r1, acc[t][2 + e] * ws1 * xs);
    }
#endif  // older archs compile an empty kernel that the launcher never starts
}

// Dynamic shared memory: the activations, and with clusters the partial tile after them.
int SmemBytes(const W4A8GemvPlan& plan) {
  const int act = smem_bytes(plan.rows8, plan.kc);
  const int partial = plan.rows8 * kRows * 4;
  return plan.cluster && partial > act ? partial : act;
}

template <typename OutT, int kMT, bool kCluster>
cudaError_t Launch(const W4A8Args& args, const W4A8GemvWeights& w, const W4A8GemvPlan& plan,
                   cudaStream_t stream) {
  auto kernel = w4a8_gemv_kernel<OutT, kMT, kCluster>;
  // Not a stream operation, so it is allowed while a CUDA graph is being captured.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
  if (err != cudaSuccess) return err;
  if (plan.splits > 1 && !kCluster) {
    // The tiles' arrival counters down; a stream operation, captured with the launch.
    err = cudaMemsetAsync(args.workspace, 0, 4 * plan.tiles, stream);
    if (err != cudaSuccess) return err;
  }
  ClusterLaunchConfig launch(dim3(static_cast<unsigned>(plan.tiles * plan.splits)),
                             dim3(kThreads), SmemBytes(plan), stream,
                             kCluster ? static_cast<unsigned>(plan.splits) : 1u);
  err = cudaLaunchKernelEx(&launch.cfg, kernel, args, w, plan);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <bool kCluster>
cudaError_t LaunchFor(const W4A8Args& args, const W4A8GemvWeights& w, const W4A8GemvPlan& plan,
                      cudaStream_t stream) {
  if (plan.rows8 == 8) {
    return args.out_f32 ? Launch<float, 1, kCluster>(args, w, plan, stream)
                        : Launch<__nv_bfloat16, 1, kCluster>(args, w, plan, stream);
  }
  return args.out_f32 ? Launch<float, 2, kCluster>(args, w, plan, stream)
                      : Launch<__nv_bfloat16, 2, kCluster>(args, w, plan, stream);
}

int DeviceSms() {
  static std::atomic<int> sms[kW4A8MaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kW4A8MaxDevices) {
    cudaGetLastError();
    return 0;
  }
  int v = sms[device].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;  // the fewest splits: correct, maybe slower
    }
    sms[device].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether the current device runs the cluster split-K: the kernel's code for it is sm_90a's
// (cluster instructions; other archs compile them away).
bool DeviceRunsClusters() {
  static std::atomic<int> ptx_version[kW4A8MaxDevices] = {};
  int version = 0;
  return W4A8KernelPtxVersion(reinterpret_cast<const void*>(w4a8_gemv_kernel<float, 1, true>),
                              ptx_version, &version) == nullptr &&
         version >= 90 && kBuildHasSm90a;
}

// The CTAs that clusters of s CTAs (s = 2 .. kW4A8GemvMaxClusterSplits) fit on the current
// device at once (cudaOccupancyMaxActiveClusters x s, for the kernel at its most shared
// memory), asked once per device; where it cannot tell, every SM's slots.
const int64_t* ClusterSlots() {
  constexpr int kSizes = kW4A8GemvMaxClusterSplits + 1;
  static std::atomic<int64_t> slots[kW4A8MaxDevices][kSizes] = {};
  static std::atomic<bool> asked[kW4A8MaxDevices] = {};
  static thread_local int64_t out[kSizes];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kW4A8MaxDevices) {
    cudaGetLastError();
    return nullptr;
  }
  if (!asked[device].load(std::memory_order_acquire)) {
    auto kernel = w4a8_gemv_kernel<float, 1, true>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem) !=
        cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    for (int s = 2; s < kSizes; ++s) {
      // Not a stream operation: allowed while a CUDA graph is being captured.
      ClusterLaunchConfig launch(dim3(s), dim3(kThreads), kMaxSmem, nullptr, s);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.cfg) != cudaSuccess) {
        cudaGetLastError();
        clusters = 0;
      }
      slots[device][s].store(static_cast<int64_t>(clusters) * s, std::memory_order_relaxed);
    }
    asked[device].store(true, std::memory_order_release);
  }
  const int64_t every_sm = static_cast<int64_t>(kW4A8GemvCtasPerSm) * DeviceSms();
  for (int s = 0; s < kSizes; ++s) {
    const int64_t v = s < 2 ? 0 : slots[device][s].load(std::memory_order_relaxed);
    out[s] = v > 0 ? v : every_sm;
  }
  return out;
}

}  // namespace gemv
}  // namespace

W4A8GemvPlan W4A8GemvDevicePlan(const W4A8Args& args, const W4A8GemvWeights& w, bool sized) {
  const int64_t tiles = w.count > 0 ? w.tile_end[w.count - 1] : 0;
  const bool cluster = gemv::DeviceRunsClusters();
  W4A8GemvPlan plan = W4A8GemvMakePlan(tiles, args.kp, args.m, gemv::DeviceSms(), cluster,
                                       cluster ? gemv::ClusterSlots() : nullptr);
  if (sized && W4A8GemvWorkspaceBytes(plan) > args.workspace_bytes) {
    plan = W4A8GemvMakePlan(tiles, args.kp, args.m, 0, cluster);
  }
  return plan;
}

int64_t W4A8GemvRequiredWorkspace(const W4A8Args& args, const W4A8GemvWeights& w) {
  const int64_t tiles = w.count > 0 ? w.tile_end[w.count - 1] : 0;
  return W4A8GemvWorkspaceBytes(
      W4A8GemvMakePlan(tiles, args.kp, args.m, 0, gemv::DeviceRunsClusters()));
}

cudaError_t LaunchW4A8GemvWeights(const W4A8Args& args, const W4A8GemvWeights& w,
                                  cudaStream_t stream) {
  if (args.group_sizes != nullptr || args.m < 1 || args.m > kW4A8GemvMaxRows || w.count < 1 ||
      w.count > kW4A8GemvMaxWeights) {
    return cudaErrorInvalidValue;  // the handlers refuse these first
  }
  const W4A8GemvPlan plan = W4A8GemvDevicePlan(args, w, /*sized=*/true);
  if (W4A8GemvWorkspaceBytes(plan) > args.workspace_bytes) return cudaErrorInvalidValue;
  if (plan.tiles * plan.splits > INT32_MAX) return cudaErrorInvalidConfiguration;
  return plan.cluster ? gemv::LaunchFor<true>(args, w, plan, stream)
                      : gemv::LaunchFor<false>(args, w, plan, stream);
}

cudaError_t LaunchW4A8Gemv(const W4A8Args& args, cudaStream_t stream) {
  return LaunchW4A8GemvWeights(args, W4A8GemvWeightOf(args), stream);
}

const char* W4A8GemvCodeProblem(int* compiled_for) {
  *compiled_for = 0;
  static std::atomic<int> ptx_version[kW4A8MaxDevices] = {};
  int version = 0;
  const char* problem = W4A8KernelPtxVersion(
      reinterpret_cast<const void*>(gemv::w4a8_gemv_kernel<float, 1, false>), ptx_version,
      &version);
  if (problem != nullptr) return problem;
  *compiled_for = version;
  return version >= 80 ? nullptr : "the GEMV needs code compiled for compute_80 or newer";
}

}  // namespace mila
