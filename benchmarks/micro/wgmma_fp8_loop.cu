// W4A8 main-loop roofline on sm_90a: the wgmma_ws consumers' loop (csrc/w4a8/w4a8_sm90_ws.cu)
// with the loads taken away, to tell whether its structure or its feeding bounds the kernel,
// and with the kernel's surroundings put back one at a time (the ring variants), to find where
// the kernel loses against the loop. kernel_ring and kernel_loads hold a marked copy of the
// kernel's consumer chain (kernel_ring_convert_first and kernel_ring_fixed_lut that copy with
// one change each): keep the copy in step with the kernel.
// wgmma_loop: one CTA per SM, two consumer warpgroups; B (activations) is a fixed 32 KB
// shared-memory tile in the kernel's 128-byte swizzle, A (weights) comes from registers. Per
// "K tile", as in the kernel: 64 x 256 x 128 per warpgroup (e4m3, fp32 accumulation).
// Variants:
//   chained    2 halves x 4 wgmma.m64n128k32 into one fixed accumulator, one commit and
//              wait<1> per K tile (at most two batches in flight): the loop without promotion.
//   promoted   per n128 half: a fresh partial (scale-d 0), commit, wait<0>, 64 fp32 adds into
//              the masters: the kernel's promotion until 2026-11-30.
//   convert    promoted + the kernel's weight conversion per K tile (two 16-byte and two
//              4-byte shared loads and word_to_e4m3, from a fixed packed tile): the kernel's
//              consumer loop until 2026-11-30, without TMA, mbarriers or a producer.
//   pipelined  convert, then four n64 quarters (4 wgmma.m64n64k32 each) in two partial sums:
//              quarter j runs while quarter j - 1 is added (wait<1>); wait<0> at the end of
//              the K tile (tried in the kernel on 2026-11-30: no faster).
//   chain256   convert two K tiles, then per n128 half 8 wgmmas (a 256-long chain) into a
//              fresh partial, wait<0>, add: the kernel's promotion chain without TMA,
//              mbarriers or a producer (the tile count must be even), and with the whole
//              chain converted first (the kernel now converts each block of the first half
//              just before its wgmma: kernel_ring below). With the version-2
//              (sign-swizzled) weight words: 1,788 TFLOP/s against 1,678 with version 1 in
//              the same run (2026-12-01, docs/performance.md). Both K tiles are converted from
//              the one packed tile, and ptxas merges most of the second conversion into the
//              first: 309 SASS instructions per chain and warp, 20 prmt where the 16 words
//              need 32 (chain256_2tiles: 420 with 32; the kernel's chain: ~500).
//   chain256_const, chain256_random   chain256 compiled with the tiles' contents a kernel
//              argument (ptxas schedules the loop with a few instructions swapped against
//              chain256's, so the pair is one binary), run with chain256's constant tiles
//              (1.0 x 0.5: few bits toggle in the tensor cores) and with random ones (finite
//              e4m3 activations, random packed words, block exponents 120..127 under channel
//              exponent 127): the tensor cores' data-dependent power and clock.
//   chain256_2tiles   chain256_const with the chain's second K tile (activations, packed
//              words, exponents) in its own shared memory, so that ptxas cannot merge its
//              conversion away: chain256's full work per chain, the ring variants' baseline.
// ring_loop: the kernel's launch shape, 384 threads: a producer warpgroup of which only warp 0
// stays (setmaxnreg.dec to 24 registers, the other three warps exit) and the two consumer
// warpgroups (setmaxnreg.inc to 240), with the kernel's 5-stage ring of full/empty mbarriers
// (each stage its own 32 KiB activations, 8 KiB packed weights and 512 B exponents, all filled
// once at the start, constant or random as a kernel argument says; full barriers count 33
// arrivals, empty ones 256). The consumers wait on each K tile's full barrier (parity tracked
// as the kernel's RingPos), read its packed rows from that stage and after the chain arrive
// on both stages' empty barriers; the producer waits on empty (parity ^ 1) and arms full,
// then waits for the last stages' release (the kernel's producer tail). Every mbarrier wait
// traps after kWatchdogNs, so a protocol bug fails the launch instead of hanging the GPU.
//   chain256_ring     chain256's consumer loop on the ring (against chain256_2tiles: the ring
//              protocol, the producer warp and the 240-register budget); the producer only
//              arrives, 33 plain arrivals per stage (each lane once, lane 0 twice), no data.
//   chain256_ring_random   chain256_ring with random stages (each stage different; the same
//              binary as chain256_ring).
//   chain256_ring_tma      chain256_ring_random where lane 0 issues the kernel's two TMA loads
//              per stage (activations 256 x 128 B with the 128-byte swizzle, packed weights
//              128 x 64 B) with expect_tx, from 8 random K tiles in global memory that stay in
//              L2 (cycled; block b starts at tile b % 8); the 32 lanes arrive plainly, so the
//              exponents stay as filled at the start.
//   chain256_ring_loads    chain256_ring_tma with the kernel's whole producer: the 32 lanes
//              also copy the stage's block exponents with cp.async (4 bytes, 4 rows a lane)
//              and arrive when they land (cp.async.mbarrier.arrive.noinc).
//   kernel_ring / kernel_loads   chain256_ring_random / chain256_ring_loads with the kernel's
//              own chain (the marked copy of w4a8_sm90_ws.cu's `chain` lambda: a row's packed
//              words and exponents loaded whole per stage, the first half converting each
//              block just before its wgmma behind its own wgmma.fence, per-row exponent
//              tables from a global array): the kernel's main loop as one endless output tile
//              (no tile loop, no epilogue). kernel_ring is the loop of the kernel's TIMING_ONLY
//              build, kernel_loads that of the normal build with every load an L2 hit.
//   kernel_ring_convert_first   kernel_ring with one change: the chain's whole conversion
//              (every block of both K tiles, still from the rows loaded whole per stage and
//              the per-row tables) before the first wgmma, then one wgmma.fence and the first
//              half's 8 wgmmas back to back, as chain256 (the second half as before).
//   kernel_ring_fixed_lut   kernel_ring with one change: one fixed row_lut(127) for every row,
//              as chain256_ring_random, instead of the per-row tables from the channel
//              exponent array (which holds 127 too, but as loaded values). The stages' block
//              exponents are fill_tile's random 120..127, within that table's -12..0.
// Prints one line per variant: TFLOP/s over all SMs and the SM clock block 0 saw (values are
// not checked: not a test).
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -DMILA_HAS_SM90A -I csrc \
//        benchmarks/micro/wgmma_fp8_loop.cu -o /tmp/wgmma_fp8_loop && /tmp/wgmma_fp8_loop
// (benchmarks/wgmma_loop.py builds and runs it; the argument is the K tiles per CTA, even,
// default 4096.) -DMILA_WGMMA_LOOP_DEBUG: a watchdog trap first prints the barrier it waited on.

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "common/ptx.cuh"
#include "common/tensor_map.h"
#include "w4a8/w4a8_convert.cuh"
#include "sm90_device.h"

namespace mila::bench {

enum Variant : int {
  kChained = 0,
  kPromoted = 1,
  kConvert = 2,
  kPipelined = 3,
  kChain2 = 4,
  kChain2Tiles = 5,  // chain256_2tiles
};

constexpr int kThreads = 256;          // two consumer warpgroups
constexpr int kHalfBytes = 128 * 128;  // 128 activation rows x 128 K bytes: one n128 half
constexpr int kXBytes = 2 * kHalfBytes;
constexpr int kWBytes = 128 * kPackedTile;  // packed weight rows of one K tile
constexpr int kEBytes = 128 * kKBlocks;     // their block exponents
constexpr int kSmemBytes = kXBytes + kWBytes + kEBytes + 1024;  // + alignment slack
// chain256_2tiles: a second K tile from here (1024-byte aligned for the 128-byte swizzle).
constexpr int kTile1Offset = (kXBytes + kWBytes + kEBytes + 1023) / 1024 * 1024;
constexpr int kSmemBytes2Tiles = kTile1Offset + kXBytes + kWBytes + kEBytes + 1024;
constexpr double kFlopPerTile = 2.0 * 4 * 2 * 64.0 * 128 * 32 * 2;  // 2 WG x 2 halves x 4 wgmma

// ---- tile contents -----------------------------------------------------------------------

// What the tiles hold: constants (e4m3 1.0 activations, packed weight codes 1 = 0.5, block
// exponent 127) or random finite values. Chosen at run time where a variant pair compares
// the two (data_kind): ptxas schedules a kernel's main loop differently for a different fill
// code before it, and the comparison should be of one binary.
enum class Data : int { kConst = 0, kRandom = 1 };
enum class Field : uint32_t { kActivations = 0, kCodes = 1, kExponents = 2 };

// Integer hash (lowbias32): random words from their index, no generator state to carry.
__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// Word `index` of a field. Random: activations any e4m3fn byte but the NaNs 0x7F / 0xFF (made
// 0x7E / 0xFE, +-448); packed words any 32 bits (every version-2 word is 8 valid codes);
// block exponents 120..127, so that with channel exponent 127 (row_lut(127)) the offset
// block - channel is -7..0 and word_to_e4m3's byte-wise table (valid for -12..0) stays finite.
template <Data kData>
__device__ __forceinline__ uint32_t fill_word(Field field, uint32_t index) {
  if constexpr (kData == Data::kConst) {
    return field == Field::kActivations ? 0x38383838u
           : field == Field::kCodes     ? 0x11111111u
                                        : 0x7F7F7F7Fu;
  } else {
    uint32_t v = hash32(3u * index + static_cast<uint32_t>(field));
    if (field == Field::kActivations) {
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (((v >> (8 * b)) & 0x7Fu) == 0x7Fu) v ^= 1u << (8 * b);
    } else if (field == Field::kExponents) {
      v = 0x78787878u + (v & 0x07070707u);
    }
    return v;
  }
}

// One K tile's activations (x, kXBytes), packed weight rows (w, kWBytes) and block exponents
// (e, kEBytes), written by threads tid, tid + nthreads, ...; `tile` makes random tiles differ.
// Generic-proxy stores: the caller fences (fence_proxy_async_shared) before wgmma or TMA.
template <Data kData>
__device__ __forceinline__ void fill_tile(uint8_t* x, uint8_t* w, uint8_t* e, uint32_t tile,
                                          int tid, int nthreads) {
  for (int i = tid; i < kXBytes / 4; i += nthreads)
    reinterpret_cast<uint32_t*>(x)[i] =
        fill_word<kData>(Field::kActivations, tile * (kXBytes / 4) + i);
  for (int i = tid; i < kWBytes / 4; i += nthreads)
    reinterpret_cast<uint32_t*>(w)[i] = fill_word<kData>(Field::kCodes, tile * (kWBytes / 4) + i);
  for (int i = tid; i < kEBytes / 4; i += nthreads)
    reinterpret_cast<uint32_t*>(e)[i] =
        fill_word<kData>(Field::kExponents, tile * (kEBytes / 4) + i);
}
// fill_tile with the contents chosen at run time.
__device__ __forceinline__ void fill_tile(Data data, uint8_t* x, uint8_t* w, uint8_t* e,
                                          uint32_t tile, int tid, int nthreads) {
  if (data == Data::kRandom)
    fill_tile<Data::kRandom>(x, w, e, tile, tid, nthreads);
  else
    fill_tile<Data::kConst>(x, w, e, tile, tid, nthreads);
}

// ---- wgmma_loop: the consumers' loop alone ---------------------------------------------------

// Adds a retired partial sum of N accumulator registers into the masters at acc[N * j ..]
// (the m64nN and m64n256 accumulator layouts agree column block by column block).
template <int N>
__device__ __forceinline__ void promote(float (&part)[N], float (&acc)[128], int j) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::sm90::fence_operand(part[i]);
#pragma unroll
  for (int i = 0; i < N; ++i) acc[N * j + i] += part[i];
}

// kDataArg: the tiles' contents are data_kind (a Data), else constants (the first five
// variants, whose code stays as first timed: any other fill code moves ptxas's schedule of
// their loops).
template <int kVariant, bool kDataArg = false>
__global__ void __launch_bounds__(kThreads, 1) wgmma_loop(int tiles, float* sink,
                                                          unsigned long long* clocks,
                                                          int data_kind) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  if constexpr (!kDataArg) {
    // e4m3 1.0 activations, packed weight codes 1 (0.5) with block exponent 127: finite values
    // that toggle few bits in the tensor cores (chain256_random has random ones).
    for (int i = threadIdx.x; i < kXBytes / 4; i += kThreads)
      reinterpret_cast<uint32_t*>(smem)[i] = 0x38383838u;
    for (int i = threadIdx.x; i < (kWBytes + kEBytes) / 4; i += kThreads)
      reinterpret_cast<uint32_t*>(smem + kXBytes)[i] = i < kWBytes / 4 ? 0x11111111u : 0x7F7F7F7Fu;
  } else {
    fill_tile(static_cast<Data>(data_kind), smem, smem + kXBytes, smem + kXBytes + kWBytes, 0,
              threadIdx.x, kThreads);
    if constexpr (kVariant == kChain2Tiles) {
      uint8_t* tile1 = smem + kTile1Offset;
      fill_tile(static_cast<Data>(data_kind), tile1, tile1 + kXBytes, tile1 + kXBytes + kWBytes,
                1, threadIdx.x, kThreads);
    }
  }
  ptx::sm90::fence_proxy_async_shared();  // generic-proxy stores, read by wgmma
  __syncthreads();

  const int cw = threadIdx.x / 128, lane = threadIdx.x % 32, wwarp = (threadIdx.x % 128) / 32;
  const int wrow0 = cw * 64 + wwarp * 16 + lane / 4, q = lane % 4;
  const RowLut lut = row_lut(127);
  uint32_t a[kKBlocks][4];
#pragma unroll
  for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[kb][e] = 0x38383838u;

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  // The kernel's conversion of this thread's two weight rows of one K tile (fixed tile here;
  // chain256_2tiles: tile 0 or 1 at byte `tile_offset`).
  auto convert = [&](uint32_t (&frag)[kKBlocks][4], int tile_offset = 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wrow0 + 8 * h;
      const uint8_t* tile = smem + tile_offset;
      const uint4 v = *reinterpret_cast<const uint4*>(tile + kXBytes + row * kPackedTile + q * 16);
      const uint32_t exps = *reinterpret_cast<const uint32_t*>(tile + kXBytes + kWBytes +
                                                               row * kKBlocks);
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        const uint32_t word = kb == 0 ? v.x : kb == 1 ? v.y : kb == 2 ? v.z : v.w;
        word_to_e4m3(word, (exps >> (8 * kb)) & 0xFFu, lut, frag[kb][h], frag[kb][2 + h]);
      }
    }
  };

  // SM cycles and nanoseconds of block 0's loop: the clock the tensor cores ran at, to set
  // against the real kernel's (ncu's "SM Frequency"; power draw moves it).
  const long long cycle0 = clock64();
  unsigned long long ns0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));

  for (int t = 0; t < tiles; ++t) {
    if constexpr (kVariant == kChain2 || kVariant == kChain2Tiles) {
      // Two K tiles per iteration (t advances twice), each converted into its own fragments.
      // chain256 converts both from the same tile, and ptxas merges most of the second
      // conversion into the first (the SASS loop is 309 instructions per chain, with 20 of the
      // 32 prmt); chain256_2tiles reads the second K tile from its own shared memory.
      constexpr int kTile1 = kVariant == kChain2Tiles ? kTile1Offset : 0;
      uint32_t a2[2][kKBlocks][4];
      convert(a2[0]);
      convert(a2[1], kTile1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float part[64];
        ptx::sm90::wgmma_fence();
        wgmma_chain_half(part, a2, [&](int c, int kb) {
          return ptx::sm90::desc_k128b(base + c * kTile1 + h * kHalfBytes + kb * 32);
        });
        ptx::sm90::wgmma_commit();
        ptx::sm90::wgmma_wait<0>();
        promote(part, acc, h);
      }
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
          for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a2[c][kb][e]);
      ++t;
      continue;
    }
    if constexpr (kVariant == kConvert || kVariant == kPipelined) convert(a);
    if constexpr (kVariant == kChained) {
      // Both halves into one accumulator (the sums are meaningless; the tensor work is the
      // kernel's): two accumulators with two batches in flight made ptxas serialize the
      // wgmmas for want of registers (C7512).
      float(&chain)[64] = *reinterpret_cast<float(*)[64]>(acc);
      ptx::sm90::wgmma_fence();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(
              chain, a[kb], ptx::sm90::desc_k128b(base + h * kHalfBytes + kb * 32));
      ptx::sm90::wgmma_commit();
      ptx::sm90::wgmma_wait<1>();
    } else if constexpr (kVariant == kPipelined) {
      float part[2][32];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float(&p)[32] = part[j % 2];
        ptx::sm90::wgmma_fence();
        ptx::w4a8::wgmma_m64n64k32_e4m3_rs<false>(p, a[0], ptx::sm90::desc_k128b(base + j * 8192));
#pragma unroll
        for (int kb = 1; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n64k32_e4m3_rs<true>(
              p, a[kb], ptx::sm90::desc_k128b(base + j * 8192 + kb * 32));
        ptx::sm90::wgmma_commit();
        if (j > 0) {
          ptx::sm90::wgmma_wait<1>();
          promote(part[(j - 1) % 2], acc, j - 1);
        }
      }
      ptx::sm90::wgmma_wait<0>();
      promote(part[1], acc, 3);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float part[64];
        ptx::sm90::wgmma_fence();
        ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(
            part, a[0], ptx::sm90::desc_k128b(base + h * kHalfBytes));
#pragma unroll
        for (int kb = 1; kb < kKBlocks; ++kb)
          ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(
              part, a[kb], ptx::sm90::desc_k128b(base + h * kHalfBytes + kb * 32));
        ptx::sm90::wgmma_commit();
        ptx::sm90::wgmma_wait<0>();
        promote(part, acc, h);
      }
    }
#pragma unroll
    for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
      for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a[kb][e]);
  }
  ptx::sm90::wgmma_wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  sink[blockIdx.x * kThreads + threadIdx.x] = sum;  // keeps the loop alive
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long ns1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
    clocks[0] = static_cast<unsigned long long>(clock64() - cycle0);
    clocks[1] = ns1 - ns0;
  }
#endif
}

// ---- ring_loop: the loop on the kernel's mbarrier ring, with its producer warp ---------------

namespace ring {

// The kernel's (w4a8_sm90_ws.cu) launch shape, ring and register split.
constexpr int kStages = 5;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
constexpr int kXStage = kXBytes;  // 32 KiB, 1024-byte aligned (128B swizzle atoms)
constexpr int kWStage = kWBytes;  // 8 KiB
constexpr int kEStage = kEBytes;  // 512 B
constexpr int kWOffset = kStages * kXStage;
constexpr int kEOffset = kWOffset + kStages * kWStage;
constexpr int kBarOffset = kEOffset + kStages * kEStage;
constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8 + 1024;  // + alignment slack
constexpr uint32_t kFullArrivals = 1 + 32;  // the kernel's expect_tx arrive + 32 lane arrivals
constexpr uint32_t kTxBytes = kXStage + kWStage;  // TMA bytes per stage
// The TMA feeds' global K tiles: 8 x 40.5 KiB, read by every CTA, stay in L2.
constexpr int kGlobalTiles = 8;
constexpr int kXRowBytes = kGlobalTiles * kBK;          // activations [256][8 x 128 B]
constexpr int kWRowBytes = kGlobalTiles * kPackedTile;  // packed weights [128][8 x 64 B]
constexpr int kERowBytes = kGlobalTiles * kKBlocks;     // block exponents [128][8 x 4 B]
static_assert(kSmemBytes <= 227 * 1024, "shared memory");
static_assert(kConsumerThreads * kConsumerRegs + (kThreads - kConsumerThreads) * kProducerRegs <=
                  65536 / kThreads / 8 * 8 * kThreads,
              "setmaxnreg redistributes only the registers the CTA was launched with");
static_assert((kWOffset | kWStage) % 16 == 0 && (kEOffset | kEStage) % 4 == 0 &&
                  kBarOffset % 8 == 0,
              "alignment");

// A wait longer than this traps (the launch fails) instead of hanging the GPU: every
// legitimate wait here lasts microseconds.
constexpr uint64_t kWatchdogNs = 4000000000ull;  // 4 s

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// The kernel's mbar_wait: one try without reading the timer (the common case), then polls
// that give up after kWatchdogNs and trap. The trap comes after the polling loop, not inside
// it as in the kernel: inside, ptxas (CUDA 13.0) did not give the consumers' loop here the
// 240 registers of setmaxnreg (it used up to R194 and spilled 556 bytes).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (ptx::sm90::mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = global_timer_ns();
  bool late = false;
  while (!ptx::sm90::mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - t0 > kWatchdogNs) {
      late = true;
      break;
    }
  }
  if (late) {
#ifdef MILA_WGMMA_LOOP_DEBUG
    printf("wgmma loop watchdog: block %d thread %d barrier smem 0x%x parity %u\n", blockIdx.x,
           threadIdx.x, bar, parity);
#endif
    __trap();
  }
}

// Stage and parity of a pipeline step (the kernel's RingPos).
struct RingPos {
  uint32_t stage = 0, phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// What the producer warp does per stage, after waiting for the stage's release.
enum class Feed {
  kArrive,  // 33 plain arrivals on the full barrier, no data (the kernel's TIMING_ONLY build)
  kTma,     // lane 0: expect_tx and the kernel's two TMA loads; 32 plain lane arrivals
  kLoads,   // kTma, the lanes copying the exponents with cp.async: the kernel's producer
};

// The producer warp (warp 0, 24 registers): `tiles` pipeline steps, then the kernel's tail.
// The TMA feeds load global K tile k into step t's stage, k = (blockIdx.x + t) % kGlobalTiles.
template <Feed kFeed>
__device__ __forceinline__ void produce(int tiles, uint32_t smem_base, uint32_t full_bar,
                                        uint32_t empty_bar, const CUtensorMap* tmap_x,
                                        const CUtensorMap* tmap_w, const uint8_t* scales) {
  const uint32_t lane = threadIdx.x;
  RingPos pos;
  uint32_t k = blockIdx.x % kGlobalTiles;
  for (int t = 0; t < tiles; ++t, pos.advance()) {
    const uint32_t s = pos.stage;
    // A fresh barrier counts as having completed the pass before pass 0 (parity 1), so the
    // first kStages waits return at once.
    mbar_wait(empty_bar + 8 * s, pos.phase ^ 1);
    const uint32_t fb = full_bar + 8 * s;
    if constexpr (kFeed == Feed::kArrive) {
      ptx::sm90::mbar_arrive(fb);
      if (lane == 0) ptx::sm90::mbar_arrive(fb);
    } else {
      if (lane == 0) {
        ptx::sm90::mbar_arrive_expect_tx(fb, kTxBytes);
        ptx::sm90::tma_load_2d(smem_base + s * kXStage, tmap_x, fb, k * kBK, 0);
        ptx::sm90::tma_load_2d(smem_base + kWOffset + s * kWStage, tmap_w, fb, k * kPackedTile,
                               0);
      }
      if constexpr (kFeed == Feed::kTma) {
        ptx::sm90::mbar_arrive(fb);  // the exponents stay as filled at the start
      } else {
        // The kernel's exponent copies: 4 bytes of weight rows lane + 32 i each, arriving
        // once they land.
#pragma unroll
        for (int i = 0; i < 128 / 32; ++i) {
          const uint32_t row = lane + 32 * i;
          ptx::w4a8::cp_async_4(smem_base + kEOffset + s * kEStage + row * kKBlocks,
                                scales + row * kERowBytes + k * kKBlocks);
        }
        ptx::sm90::cp_async_mbar_arrive(fb);
      }
      k = (k + 1) % kGlobalTiles;
    }
  }
  // The kernel's producer tail: wait until the consumers have released the last kStages
  // steps (steps before 0 pass at once), so that every TMA load and cp.async arrive-on this
  // warp issued has landed before it exits.
#pragma unroll 1
  for (int j = 0; j < kStages; ++j, pos.advance())
    mbar_wait(empty_bar + 8 * pos.stage, pos.phase ^ 1);
  if constexpr (kFeed == Feed::kLoads) {
    // Uncommitted cp.async belong to no group: commit, then wait, before the threads exit.
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
  }
}

// A consumer thread's place: consumer warpgroup cw (0 / 1) takes weight rows 64 cw .. 64 cw +
// 63 of each K tile; this thread rows wrow0 and wrow0 + 8 (quad column q).
struct ConsumerIds {
  int wrow0, q;
  __device__ __forceinline__ ConsumerIds() {
    const int tid = threadIdx.x - (kThreads - kConsumerThreads);
    const int cw = tid / 128, lane = tid % 32, wwarp = (tid % 128) / 32;
    wrow0 = cw * 64 + wwarp * 16 + lane / 4;
    q = lane % 4;
  }
};

// chain256's loop (wgmma_loop<kChain2>) on the ring: per chain, wait for each of its two
// stages and convert that K tile's weight rows from it (the whole chain converted before the
// first wgmma, as chain256), 8 wgmmas per n128 half into a fresh partial, wait, add, then
// release both stages as the kernel does. Returns the masters' sum (keeps the loop alive).
__device__ __forceinline__ float consume_chain256(int tiles, const uint8_t* smem,
                                                  uint32_t smem_base, uint32_t full_bar,
                                                  uint32_t empty_bar) {
  const ConsumerIds id;
  const RowLut lut = row_lut(127);
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  // chain256's conversion of this thread's two weight rows of the K tile in stage s.
  auto convert = [&](uint32_t s, uint32_t (&frag)[kKBlocks][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = id.wrow0 + 8 * h;
      const uint4 v = *reinterpret_cast<const uint4*>(smem + kWOffset + s * kWStage +
                                                      row * kPackedTile + id.q * 16);
      const uint32_t exps =
          *reinterpret_cast<const uint32_t*>(smem + kEOffset + s * kEStage + row * kKBlocks);
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb) {
        const uint32_t word = kb == 0 ? v.x : kb == 1 ? v.y : kb == 2 ? v.z : v.w;
        word_to_e4m3(word, (exps >> (8 * kb)) & 0xFFu, lut, frag[kb][h], frag[kb][2 + h]);
      }
    }
  };

  RingPos pos;
  for (int t = 0; t < tiles; t += 2) {
    uint32_t a2[2][kKBlocks][4];
    uint32_t st[2];
#pragma unroll
    for (int c = 0; c < 2; ++c, pos.advance()) {
      st[c] = pos.stage;
      mbar_wait(full_bar + 8 * st[c], pos.phase);
      convert(st[c], a2[c]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float part[64];
      ptx::sm90::wgmma_fence();
      wgmma_chain_half(part, a2, [&](int c, int kb) {
        return ptx::sm90::desc_k128b(smem_base + st[c] * kXStage + h * kHalfBytes + kb * 32);
      });
      ptx::sm90::wgmma_commit();
      ptx::sm90::wgmma_wait<0>();
      promote(part, acc, h);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
        for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a2[c][kb][e]);
      // Both halves retired and the packed rows were read above: the stage may be refilled.
      ptx::sm90::mbar_arrive(empty_bar + 8 * st[c]);
    }
  }
  ptx::sm90::wgmma_wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  return sum;
}

// The consumers' loop of a ring variant.
enum class Body {
  kChain256,            // chain256's (consume_chain256)
  kKernel,              // the kernel's (consume_kernel)
  kKernelConvertFirst,  // the kernel's, the whole chain converted before its first wgmma
  kKernelFixedLut,      // the kernel's, one fixed row_lut(127) for every row
};

// ---- marked copy of w4a8_sm90_ws.cu's consumers: keep in step ------------------------------
// The kernel's consumer loop over one endless output tile (kernel_ring, kernel_loads): its
// thread indices, row tables (the tile's channel exponents, here one 128-byte array), RowWords,
// load_rows, convert and chain as in the kernel, kChain = 2 (`tiles` is even); without the tile
// loop, the row scales' cp.async and the epilogue. Returns the masters' sum. kBody: kKernel is
// the copy as is; the two one-change variants (header comment) differ only where they test
// kBody (`if constexpr`).
template <Body kBody>
__device__ __forceinline__ float consume_kernel(int tiles, const uint8_t* smem,
                                                uint32_t smem_base, uint32_t full_bar,
                                                uint32_t empty_bar, const uint8_t* channel_exp) {
  const int tid = threadIdx.x;
  const int cw = tid / 128 - 1;  // consumer warpgroup 0 / 1: weight rows 64 cw ..
  const int wtid = tid % 128;
  const int lane = tid % 32, wwarp = wtid / 32;
  const int g = lane / 4, q = lane % 4;
  const int wrow0 = cw * 64 + wwarp * 16 + g;  // tile-local weight rows wrow0, wrow0 + 8

  RingPos pos;
  RowLut lut[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (kBody == Body::kKernelFixedLut)
      lut[h] = row_lut(127);  // kernel_ring_fixed_lut: chain256's one fixed table
    else
      lut[h] = row_lut(channel_exp[wrow0 + 8 * h]);
  }

  struct RowWords {
    uint4 w;
    uint32_t e;
  };
  auto load_rows = [&](uint32_t s, RowWords (&r)[2]) {
    const uint8_t* sw = smem + kWOffset + s * kWStage;
    const uint8_t* se = smem + kEOffset + s * kEStage;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wrow0 + 8 * h;
      r[h].w = *reinterpret_cast<const uint4*>(sw + row * kPackedTile + q * 16);
      r[h].e = *reinterpret_cast<const uint32_t*>(se + row * kKBlocks);
    }
  };
  auto convert = [&](const RowWords (&r)[2], int kb, uint32_t (&a)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4& w = r[h].w;
      const uint32_t word = kb == 0 ? w.x : kb == 1 ? w.y : kb == 2 ? w.z : w.w;
      word_to_e4m3(word, (r[h].e >> (8 * kb)) & 0xFFu, lut[h], a[h], a[2 + h]);
    }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  auto chain = [&](auto tiles_in_chain) {
    constexpr int kChain = decltype(tiles_in_chain)::value;
    uint32_t a[kChain][kKBlocks][4];
    uint32_t st[kChain], sx[kChain];
    float part[64];  // never read before written (scale-d = 0 on each half's first wgmma)
#pragma unroll
    for (int c = 0; c < kChain; ++c, pos.advance()) {
      st[c] = pos.stage;
      sx[c] = smem_base + st[c] * kXStage;
      mbar_wait(full_bar + 8 * st[c], pos.phase);
      RowWords rows[2];
      load_rows(st[c], rows);
      if constexpr (kBody == Body::kKernelConvertFirst) {
        // kernel_ring_convert_first: convert the K tile whole; its wgmmas follow the chain.
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb) convert(rows, kb, a[c][kb]);
      } else {
#pragma unroll
        for (int kb = 0; kb < kKBlocks; ++kb) {
          convert(rows, kb, a[c][kb]);
          ptx::sm90::wgmma_fence();  // the fragment's registers were just written
          const uint64_t desc = ptx::sm90::desc_k128b(sx[c] + kb * 32);
          if (c == 0 && kb == 0)
            ptx::w4a8::wgmma_m64n128k32_e4m3_rs<false>(part, a[c][kb], desc);
          else
            ptx::w4a8::wgmma_m64n128k32_e4m3_rs<true>(part, a[c][kb], desc);
        }
      }
    }
    if constexpr (kBody == Body::kKernelConvertFirst) {
      // kernel_ring_convert_first: one fence, then the first half's 8 wgmmas back to back.
      ptx::sm90::wgmma_fence();
      wgmma_chain_half(part, a,
                       [&](int c, int kb) { return ptx::sm90::desc_k128b(sx[c] + kb * 32); });
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h == 1) {
        ptx::sm90::wgmma_fence();
        wgmma_chain_half(part, a, [&](int c, int kb) {
          return ptx::sm90::desc_k128b(sx[c] + kHalfBytes + kb * 32);
        });
      }
      ptx::sm90::wgmma_commit();
      ptx::sm90::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 64; ++i) ptx::sm90::fence_operand(part[i]);
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[64 * h + i] += part[i];
    }
#pragma unroll
    for (int c = 0; c < kChain; ++c) {
#pragma unroll
      for (int kb = 0; kb < kKBlocks; ++kb)
#pragma unroll
        for (int e = 0; e < 4; ++e) ptx::sm90::fence_operand(a[c][kb][e]);
      // Both halves retired and the packed rows were read above: the stage may be refilled.
      ptx::sm90::mbar_arrive(empty_bar + 8 * st[c]);
    }
  };
  for (int kt = 0; kt < tiles; kt += 2) chain(std::integral_constant<int, 2>{});
  // ---- end of the copy ----
  ptx::sm90::wgmma_wait<0>();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  return sum;
}

// The kernel's launch shape and ring around a consumer loop (header comment). tmap_x, tmap_w,
// scales: the TMA feeds' global K tiles, channel_exp: consume_kernel's 128 channel exponents
// (RingInputs); data_kind: the stages' contents (a Data), filled once; tiles: K tiles per CTA
// (even).
template <Feed kFeed, Body kBody>
__global__ void __launch_bounds__(kThreads, 1)
    ring_loop(const __grid_constant__ CUtensorMap tmap_x,
              const __grid_constant__ CUtensorMap tmap_w, const uint8_t* scales,
              const uint8_t* channel_exp, int data_kind, int tiles, float* sink,
              unsigned long long* clocks) {
#if defined(__CUDA_ARCH__) && defined(MILA_HAS_SM90A)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t smem_base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - raw);
  const uint32_t full_bar = smem_base + kBarOffset;  // stage s: + 8 s
  const uint32_t empty_bar = full_bar + 8 * kStages;
  const int tid = threadIdx.x;

  // Every stage its own K tile (random stages differ), as the kernel's ring holds.
  for (int s = 0; s < kStages; ++s)
    fill_tile(static_cast<Data>(data_kind), smem + s * kXStage, smem + kWOffset + s * kWStage,
              smem + kEOffset + s * kEStage, s, tid, kThreads);
  ptx::sm90::fence_proxy_async_shared();  // generic-proxy stores, read by wgmma (and TMA writes)
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::sm90::mbar_init(full_bar + 8 * s, kFullArrivals);
      ptx::sm90::mbar_init(empty_bar + 8 * s, kConsumerThreads);
    }
    ptx::sm90::mbar_init_fence();
  }
  __syncthreads();

  if (tid < kThreads - kConsumerThreads) {
    // The kernel's producer warpgroup: all four warps give registers back, three exit.
    ptx::sm90::setmaxnreg_dec<kProducerRegs>();
    if (tid >= 32) return;
    produce<kFeed>(tiles, smem_base, full_bar, empty_bar, &tmap_x, &tmap_w, scales);
    return;
  }
  ptx::sm90::setmaxnreg_inc<kConsumerRegs>();
  // SM cycles and nanoseconds of block 0's consumer loop (see wgmma_loop).
  const long long cycle0 = clock64();
  const uint64_t ns0 = global_timer_ns();
  float sum;
  if constexpr (kBody == Body::kChain256)
    sum = consume_chain256(tiles, smem, smem_base, full_bar, empty_bar);
  else
    sum = consume_kernel<kBody>(tiles, smem, smem_base, full_bar, empty_bar, channel_exp);
  sink[blockIdx.x * kConsumerThreads + tid - (kThreads - kConsumerThreads)] = sum;
  if (blockIdx.x == 0 && tid == kThreads - kConsumerThreads) {
    const uint64_t ns1 = global_timer_ns();
    clocks[0] = static_cast<unsigned long long>(clock64() - cycle0);
    clocks[1] = ns1 - ns0;
  }
#endif
}

}  // namespace ring

struct Timing {
  float ms;    // best of 5
  double mhz;  // block 0's SM clock during that run
};

// Times `launch` (one launch of a variant over all SMs): a warm-up, then the best of 5. A
// failed launch (a watchdog trap) ends the program with the variant's name: the context is
// lost, so no later variant could run.
template <typename Launch>
Timing time_runs(const char* name, Launch launch, unsigned long long* clocks, cudaEvent_t start,
                 cudaEvent_t stop) {
  launch();  // warm-up
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("%s: CUDA error: %s\n", name, cudaGetErrorString(err));
    std::exit(1);
  }
  Timing best{1e30f, 0.0};
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    if (ms < best.ms) {
      unsigned long long c[2] = {0, 1};
      cudaMemcpy(c, clocks, sizeof(c), cudaMemcpyDeviceToHost);
      best = {ms, c[1] > 0 ? 1e3 * static_cast<double>(c[0]) / static_cast<double>(c[1]) : 0.0};
    }
  }
  return best;
}

// data: the tiles' contents where kDataArg, else ignored (constants).
template <int kVariant, bool kDataArg = false>
Timing time_loop(const char* name, Data data, int blocks, int tiles, float* sink,
                 unsigned long long* clocks, cudaEvent_t start, cudaEvent_t stop) {
  auto kernel = wgmma_loop<kVariant, kDataArg>;
  constexpr int kBytes = kVariant == kChain2Tiles ? kSmemBytes2Tiles : kSmemBytes;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  const int data_kind = static_cast<int>(data);
  return time_runs(
      name, [&] { kernel<<<blocks, kThreads, kBytes>>>(tiles, sink, clocks, data_kind); },
      clocks, start, stop);
}

// Random words of `field` (the TMA feeds' global K tiles).
__global__ void fill_global(uint32_t* words, int count, Field field) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    words[i] = fill_word<Data::kRandom>(field, static_cast<uint32_t>(i));
}

// The kernel's EncodeMap: 2-D uint8 tensor [rows, cols] (row stride `cols` bytes), box
// [box_rows, box_cols]. False if the driver refuses it.
bool encode_u8_map(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                   uint32_t box_rows, uint32_t box_cols, CUtensorMapSwizzle swizzle) {
  const tma::EncodeTiledFn encode = tma::Encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides,
                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Global memory of the ring variants. The TMA feeds': ring::kGlobalTiles random K tiles in
// the kernel's layouts (activations [256][8 x 128 B], packed weights [128][8 x 64 B], block
// exponents [128][8 x 4 B]) and the kernel's two tensor maps over them (boxes 256 x 128 B with
// the 128-byte swizzle, 128 x 64 B unswizzled). consume_kernel's: the 128 weight rows'
// channel exponents (127, as wgmma_loop's row_lut(127)).
struct RingInputs {
  uint8_t* x = nullptr;
  uint8_t* w = nullptr;
  uint8_t* e = nullptr;
  uint8_t* channel_exp = nullptr;
  CUtensorMap tmap_x{}, tmap_w{};

  bool init() {
    constexpr int kXSize = 256 * ring::kXRowBytes, kWSize = 128 * ring::kWRowBytes,
                  kESize = 128 * ring::kERowBytes;
    if (cudaMalloc(&x, kXSize) != cudaSuccess || cudaMalloc(&w, kWSize) != cudaSuccess ||
        cudaMalloc(&e, kESize) != cudaSuccess || cudaMalloc(&channel_exp, 128) != cudaSuccess ||
        cudaMemset(channel_exp, 127, 128) != cudaSuccess)
      return false;
    fill_global<<<64, 256>>>(reinterpret_cast<uint32_t*>(x), kXSize / 4, Field::kActivations);
    fill_global<<<64, 256>>>(reinterpret_cast<uint32_t*>(w), kWSize / 4, Field::kCodes);
    fill_global<<<64, 256>>>(reinterpret_cast<uint32_t*>(e), kESize / 4, Field::kExponents);
    return cudaDeviceSynchronize() == cudaSuccess &&
           encode_u8_map(&tmap_x, x, 256, ring::kXRowBytes, 256, kBK,
                         CU_TENSOR_MAP_SWIZZLE_128B) &&
           encode_u8_map(&tmap_w, w, 128, ring::kWRowBytes, 128, kPackedTile,
                         CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  ~RingInputs() {
    cudaFree(x);
    cudaFree(w);
    cudaFree(e);
    cudaFree(channel_exp);
  }
};

// The ring variants: data (a Data) fills the stages; the TMA feeds and consume_kernel read
// `in`.
template <ring::Feed kFeed, ring::Body kBody>
Timing time_ring(const char* name, Data data, const RingInputs& in, int blocks, int tiles,
                 float* sink, unsigned long long* clocks, cudaEvent_t start, cudaEvent_t stop) {
  auto kernel = ring::ring_loop<kFeed, kBody>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring::kSmemBytes);
  const int data_kind = static_cast<int>(data);
  return time_runs(
      name,
      [&] {
        kernel<<<blocks, ring::kThreads, ring::kSmemBytes>>>(
            in.tmap_x, in.tmap_w, in.e, in.channel_exp, data_kind, tiles, sink, clocks);
      },
      clocks, start, stop);
}

struct Result {
  const char* name;
  Timing timing;
};

}  // namespace mila::bench

int main(int argc, char** argv) {
  using namespace mila::bench;
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 4096;
  if (tiles < 2 || tiles % 2 != 0) {  // the chain256 variants run two K tiles per chain
    std::printf("tiles must be an even number >= 2, got %d\n", tiles);
    return 2;
  }
  const int sms = Sm90MultiprocessorCount();
  if (sms == 0) return 2;
  LoopOutputs outputs;
  if (!outputs.Allocate(sms, kThreads)) return 2;
  float* const sink = outputs.sink;
  unsigned long long* const clocks = outputs.clocks;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  RingInputs inputs;
  if (!inputs.init()) {
    std::printf("the ring variants' global inputs or tensor maps failed\n");
    return 1;
  }
  auto loop = [&](auto variant, const char* name) {
    constexpr int kVariant = decltype(variant)::value;
    return Result{name, time_loop<kVariant>(name, Data::kConst, sms, tiles, sink, clocks, start,
                                            stop)};
  };
  // A variant compiled with the tiles' contents an argument.
  auto loop_data = [&](auto variant, Data data, const char* name) {
    constexpr int kVariant = decltype(variant)::value;
    return Result{name, time_loop<kVariant, true>(name, data, sms, tiles, sink, clocks, start,
                                                  stop)};
  };
  auto ring_variant = [&](auto feed_kind, auto body, Data data, const char* name) {
    constexpr ring::Feed kFeed = decltype(feed_kind)::value;
    constexpr ring::Body kBody = decltype(body)::value;
    return Result{name, time_ring<kFeed, kBody>(name, data, inputs, sms, tiles, sink, clocks,
                                                start, stop)};
  };
  using Arrive = std::integral_constant<ring::Feed, ring::Feed::kArrive>;
  using Tma = std::integral_constant<ring::Feed, ring::Feed::kTma>;
  using Loads = std::integral_constant<ring::Feed, ring::Feed::kLoads>;
  using Chain256 = std::integral_constant<ring::Body, ring::Body::kChain256>;
  using Kernel = std::integral_constant<ring::Body, ring::Body::kKernel>;
  using KernelConvertFirst =
      std::integral_constant<ring::Body, ring::Body::kKernelConvertFirst>;
  using KernelFixedLut = std::integral_constant<ring::Body, ring::Body::kKernelFixedLut>;
  const Result runs[] = {
      loop(std::integral_constant<int, kChained>{}, "chained"),
      loop(std::integral_constant<int, kPromoted>{}, "promoted"),
      loop(std::integral_constant<int, kConvert>{}, "convert"),
      loop(std::integral_constant<int, kPipelined>{}, "pipelined"),
      loop(std::integral_constant<int, kChain2>{}, "chain256"),
      loop_data(std::integral_constant<int, kChain2>{}, Data::kConst, "chain256_const"),
      loop_data(std::integral_constant<int, kChain2>{}, Data::kRandom, "chain256_random"),
      loop_data(std::integral_constant<int, kChain2Tiles>{}, Data::kConst, "chain256_2tiles"),
      ring_variant(Arrive{}, Chain256{}, Data::kConst, "chain256_ring"),
      ring_variant(Arrive{}, Chain256{}, Data::kRandom, "chain256_ring_random"),
      ring_variant(Tma{}, Chain256{}, Data::kRandom, "chain256_ring_tma"),
      ring_variant(Loads{}, Chain256{}, Data::kRandom, "chain256_ring_loads"),
      ring_variant(Arrive{}, Kernel{}, Data::kRandom, "kernel_ring"),
      ring_variant(Loads{}, Kernel{}, Data::kRandom, "kernel_loads"),
      ring_variant(Arrive{}, KernelConvertFirst{}, Data::kRandom, "kernel_ring_convert_first"),
      ring_variant(Arrive{}, KernelFixedLut{}, Data::kRandom, "kernel_ring_fixed_lut"),
      // The last four again, in reverse order: whether a variant's clock is its own (the two
      // runs agree) or the GPU's state at that point of the sequence (they drift with it).
      ring_variant(Arrive{}, KernelFixedLut{}, Data::kRandom, "kernel_ring_fixed_lut (again)"),
      ring_variant(Arrive{}, KernelConvertFirst{}, Data::kRandom,
                   "kernel_ring_convert_first (again)"),
      ring_variant(Arrive{}, Kernel{}, Data::kRandom, "kernel_ring (again)"),
      ring_variant(Arrive{}, Chain256{}, Data::kRandom, "chain256_ring_random (again)"),
  };
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  std::printf("| variant | ms | TFLOP/s | SM clock MHz |\n|---|---|---|---|\n");
  for (const Result& r : runs)
    std::printf("| %s | %.3f | %.0f | %.0f |\n", r.name, r.timing.ms,
                kFlopPerTile * sms * tiles / (r.timing.ms * 1e-3) / 1e12, r.timing.mhz);
  return 0;
}
