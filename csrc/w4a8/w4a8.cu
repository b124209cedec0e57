// The mma.sync W4A8 kernel (sm_89+), dense and grouped, and the dispatch of every W4A8 call.
// Shared by all W4A8 kernels (w4a8_convert.cuh):
//   * the weight's kernel order gives each lane, from one 16-byte load per weight row and
//     128-wide K tile, the 32-bit words (8 e2m1 codes) of that row for the tile's 4 blocks;
//   * a word becomes two e4m3 fragment registers through an 8-entry byte table per
//     (row, block): e4m3(code * 2^(6 + d)), d = block exponent - channel exponent in [-11, 0],
//     built with two IMADs. Exact: code * 2^6 spans [2^5, 1.5 * 2^8] and 2^(5 - 11) is e4m3's
//     smallest normal; the quantizer guarantees d >= -11 for every nonzero block;
//   * the epilogue multiplies by 2^(channel_exp - 133) (exact) and x_scale[m], rounds once.
#include <atomic>
#include <type_traits>

#include "common/ptx.cuh"
#include "w4a8/w4a8_convert.cuh"
#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {

// ============================================================================================
// mma.sync kernel: block tile 128 (M) x 128 (N) x 128 (K), 8 warps of 64 x 32, 4-stage cp.async
// pipeline for activations (128-byte rows, 16-byte chunks XOR-swizzled by row for
// conflict-free ldmatrix), packed weights (64-byte rows) and block exponents. One block per
// output tile: dense tiles in the grouped raster of w4a8_convert.cuh, grouped tiles as
// (list entry, N tile), blocks past the list's end exiting at once.
// ============================================================================================
namespace mma {

constexpr int kBM = 128, kBN = 128;
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;
constexpr int kWM = 64, kWN = 32;
constexpr int kMT = kWM / 16, kNT = kWN / 8;  // 4 x 4 mma tiles per warp
constexpr int kASize = kBM * kBK;
constexpr int kBSize = kBN * kPackedTile;
constexpr int kSSize = kBN * kKBlocks;
constexpr int kStageBytes = kASize + kBSize + kSSize;
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kGroupM = 16;

template <typename OutT, bool kGrouped>
__global__ void __launch_bounds__(kThreads, 1) w4a8_mma_kernel(const W4A8Args args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int g = lane / 4, q = lane % 4;
  const int K = args.k, N = args.n;
  const int tiles_n = (N + kBN - 1) / kBN;

  Tile tile;
  if constexpr (kGrouped) {
    const int mt = blockIdx.x / tiles_n;
    if (mt >= group_tile_count(args)) return;
    tile = group_tile(args, mt, blockIdx.x % tiles_n, kBN);
  } else {
    int tm, tn;
    tile_coords(blockIdx.x, static_cast<int>((args.m + kBM - 1) / kBM), tiles_n, kGroupM, tm, tn);
    tile = dense_tile(args, tm, tn, kBM, kBN);
  }
  const int64_t m0 = tile.m0, m_end = tile.m_end, w_row0 = tile.w_row0;
  const int n0 = tile.n0;
  const int kt_count = args.kp / kBK;
  const int64_t packed_row = args.kp / 2, scale_row = args.kp / 32;
  const uint32_t smem_base = ptx::smem_addr(smem);

  auto load_stage = [&](int stage, int kt) {
    const uint32_t sa = smem_base + stage * kStageBytes;
    const uint32_t sb = sa + kASize;
    const uint32_t ss = sb + kBSize;
#pragma unroll
    for (int i = 0; i < kASize / 16 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c / 8, chunk = c % 8;
      const int col = kt * kBK + chunk * 16;
      // Columns past K (the last tile of a K that is not a multiple of 128): zeros.
      const bool valid = m0 + row < m_end && col < K;
      const uint8_t* src = args.x + (valid ? (m0 + row) * K + col : 0);
      ptx::cp_async_16(sa + row * kBK + ((chunk ^ (row & 7)) * 16), src, valid);
    }
#pragma unroll
    for (int i = 0; i < kBSize / 16 / kThreads; ++i) {
      const int c = tid + i * kThreads, row = c / 4, chunk = c % 4;
      const bool valid = n0 + row < N;
      const uint8_t* src =
          args.packed + (valid ? (w_row0 + row) * packed_row : 0) + kt * kPackedTile + chunk * 16;
      ptx::cp_async_16(sb + row * kPackedTile + chunk * 16, src, valid);
    }
    if (tid < kBN) {
      const int row = tid;
      const bool valid = n0 + row < N;
      const uint8_t* src = args.scales + (valid ? (w_row0 + row) * scale_row : 0) + kt * kKBlocks;
      ptx::w4a8::cp_async_4(ss + row * kKBlocks, src, valid);
    }
  };

  RowLut lut_c[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int n = n0 + wn * kWN + j * 8 + g;
    lut_c[j] = row_lut(n < N ? args.channel_exp[w_row0 - n0 + n] : 0u);
  }

  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < kt_count) load_stage(s, s);
    ptx::cp_async_commit();
  }

  const int a_row = wm * kWM + (lane % 16);  // + 16 i; (a_row + 16 i) & 7 == lane & 7
  const int a_half = lane / 16;

  for (int kt = 0; kt < kt_count; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < kt_count) load_stage(next % kStages, next);
      ptx::cp_async_commit();
    }
    const int stage = kt % kStages;
    const uint32_t sa = smem_base + stage * kStageBytes;
    const uint8_t* sb = smem + stage * kStageBytes + kASize;
    const uint8_t* ss = sb + kBSize;

    uint4 bw[kNT];     // this lane's words of its weight rows, all 4 blocks
    uint32_t sc[kNT];  // their 4 block exponents
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int row = wn * kWN + j * 8 + g;
      bw[j] = *reinterpret_cast<const uint4*>(sb + row * kPackedTile + q * 16);
      sc[j] = *reinterpret_cast<const uint32_t*>(ss + row * kKBlocks);
    }

#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int i = 0; i < kMT; ++i) {
        const int chunk = kb * 2 + a_half;
        ptx::ldmatrix_x4(a[i], sa + (a_row + i * 16) * kBK + ((chunk ^ (lane & 7)) * 16));
      }
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint32_t word = kb == 0 ? bw[j].x : kb == 1 ? bw[j].y : kb == 2 ? bw[j].z : bw[j].w;
        uint32_t b[2];
        word_to_e4m3(word, (sc[j] >> (8 * kb)) & 0xFFu, lut_c[j], b[0], b[1]);
#pragma unroll
        for (int i = 0; i < kMT; ++i) ptx::mma_e4m3_16832(acc[i][j], a[i], b);
      }
    }
  }
  ptx::cp_async_wait<0>();

  float wscale[kNT][2];
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = n0 + wn * kWN + j * 8 + 2 * q + e;
      wscale[j][e] = channel_scale(args.channel_exp + (w_row0 - n0), n, N);
    }
  // Direct stores of column pairs: 4 lanes write 16 (bf16) or 32 (f32) contiguous bytes of a
  // row; output traffic is ~1/K of the work, so staging it through smem is not worth a barrier.
#pragma unroll
  for (int i = 0; i < kMT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m0 + wm * kWM + i * 16 + h * 8 + g;
      if (row >= m_end) continue;
      const float xs = args.x_scale[row];
      OutT* out_row = static_cast<OutT*>(args.out) + row * N;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int col = n0 + wn * kWN + j * 8 + 2 * q;
        if (col >= N) continue;
        const float v0 = acc[i][j][2 * h] * wscale[j][0] * xs;
        const float v1 = acc[i][j][2 * h + 1] * wscale[j][1] * xs;
        if constexpr (std::is_same_v<OutT, float>) {
          *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<uint32_t*>(out_row + col) = ptx::pack_bf16x2(v0, v1);
        }
      }
    }
  }
#endif  // older archs compile an empty kernel that the launcher never starts
}

template <bool kGrouped>
cudaError_t LaunchMma(const W4A8Args& args, cudaStream_t stream) {
  const int64_t tiles_n = (args.n + kBN - 1) / kBN;
  int64_t tiles;
  if constexpr (kGrouped) {
    cudaError_t err = LaunchW4A8GroupTiles(args, kBM, stream);
    if (err != cudaSuccess) return err;
    tiles = W4A8GroupTileCapacity(args.m, args.experts, kBM) * tiles_n;
  } else {
    tiles = ((args.m + kBM - 1) / kBM) * tiles_n;
  }
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  auto kernel = args.out_f32 ? w4a8_mma_kernel<float, kGrouped>
                             : w4a8_mma_kernel<__nv_bfloat16, kGrouped>;
  // Not a stream operation, so it is allowed while a CUDA graph is being captured.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(tiles), kThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace mma

#ifdef MILA_BUILD_HAS_SM90A
constexpr bool kBuildHasSm90a = true;
#else
constexpr bool kBuildHasSm90a = false;
#endif

}  // namespace

// Dense calls of up to kW4A8GemvMaxRows rows (decode) read memory, not the tensor cores: the
// GEMV. Hopper runs FP8 mma.sync at the fp16 rate; its native FP8 path is wgmma
// (docs/design/w4a8.md). Dense calls of kW4A8ExpandMinRows rows or more run on weights expanded
// to e4m3 once per call.
W4A8Variant ResolveW4A8Variant(W4A8Variant variant, const W4A8Args& args, int cc) {
  if (variant != W4A8Variant::kAuto) return variant;
  if (args.group_sizes == nullptr && args.m <= kW4A8GemvMaxRows) return W4A8Variant::kGemv;
  if (cc != 90 || !kBuildHasSm90a) return W4A8Variant::kMmaSync;
  return args.group_sizes == nullptr && args.m >= kW4A8ExpandMinRows ? W4A8Variant::kWgmmaWsE4m3
                                                                     : W4A8Variant::kWgmmaWs;
}

int64_t W4A8RequiredWorkspace(W4A8Variant variant, const W4A8Args& args) {
  if (variant == W4A8Variant::kGemv) {  // the fewest splits; more where the workspace has room
    return W4A8GemvRequiredWorkspace(args, W4A8GemvWeightOf(args));
  }
  if (args.group_sizes != nullptr) {
    const int rows = variant == W4A8Variant::kMmaSync ? mma::kBM : kW4A8WsGroupRows;
    return W4A8GroupListBytes(args.m, args.experts, rows);
  }
  return variant == W4A8Variant::kWgmmaWsE4m3 ? W4A8ExpandBytes(args.n, args.kp) : 0;
}

const char* W4A8KernelPtxVersion(const void* kernel, std::atomic<int>* cache, int* version) {
  *version = 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kW4A8MaxDevices) {
    cudaGetLastError();
    return "cannot tell which device runs the call";
  }
  // The answer depends on the build and the GPU; -1: no code for this device.
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess) {
      v = attr.ptxVersion;
    } else {
      cudaGetLastError();  // not sticky: keep it out of the handler's launch check
      v = -1;
    }
    cache[device].store(v, std::memory_order_relaxed);
  }
  if (v < 0) return "this build has no code for this device";
  *version = v;
  return nullptr;
}

const char* W4A8CodeProblem(W4A8Variant variant, int cc, int* compiled_for) {
  *compiled_for = 0;
  if (variant == W4A8Variant::kGemv) return W4A8GemvCodeProblem(compiled_for);
  if (variant != W4A8Variant::kMmaSync) {  // the device's 9.0 is the handler's own check
    return kBuildHasSm90a ? nullptr : "the wgmma kernels need sm_90a code, which this build lacks";
  }
  static std::atomic<int> ptx_version[kW4A8MaxDevices] = {};
  int version = 0;
  const char* problem = W4A8KernelPtxVersion(
      reinterpret_cast<const void*>(mma::w4a8_mma_kernel<float, false>), ptx_version, &version);
  if (problem != nullptr) return problem;
  *compiled_for = version;
  return version >= kW4A8MinComputeCapability
             ? nullptr
             : "FP8 mma.sync needs code compiled for compute_89 or newer";
}

cudaError_t LaunchW4A8Matmul(const W4A8Args& args, W4A8Variant variant, int cc,
                             cudaStream_t stream) {
  if (cc < kW4A8MinComputeCapability) return cudaErrorNoKernelImageForDevice;
  variant = ResolveW4A8Variant(variant, args, cc);
  if (variant == W4A8Variant::kGemv) return LaunchW4A8Gemv(args, stream);
  if (variant != W4A8Variant::kMmaSync) {
    if (cc != 90) return cudaErrorNoKernelImageForDevice;
    return LaunchW4A8WgmmaWs(args, variant == W4A8Variant::kWgmmaWsE4m3, stream);
  }
  return args.group_sizes != nullptr ? mma::LaunchMma<true>(args, stream)
                                     : mma::LaunchMma<false>(args, stream);
}

}  // namespace mila
