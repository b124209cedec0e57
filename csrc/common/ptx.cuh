// Inline-PTX wrappers used by every kernel family. One header, so the exact
// instruction forms (and their arch requirements) live in one place.
//
// Conventions: shared-memory addresses are 32-bit `.shared` state-space
// addresses from smem_addr(); an ldmatrix/cp.async on a generic address is
// undefined behaviour that a numerical oracle does not catch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace mila::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async (sm_80+) -----------------------------------------------------

// 16-byte global->shared copy that bypasses L1. When `valid` is false the
// destination is zero-filled (src-size 0) and the source is not read.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix (sm_75+) -----------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// ---- mma.sync --------------------------------------------------------------

// D = A * B + D, bf16 inputs, fp32 accumulators (sm_80+).
// A: 16x16 row-major fragment (4 regs), B: 16x8 col-major fragment (2 regs), D: 16x8 (4 floats).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A * B + D, fp16 inputs, fp32 accumulators (sm_80+). Fragments as mma_bf16_16816.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4],
                                              const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A * B + D, e4m3 inputs, fp32 accumulators (sm_89+). A: 16x32 (4 regs), B: 32x8 (2 regs).
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // callers dispatch on compute capability; never reached below sm_89
#endif
}

// ---- conversions -----------------------------------------------------------

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two floats -> packed e4m3x2 (lo in the low byte), round to nearest even, saturating to +-448.
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// Two float8_e4m3fn values (lo in bits 0-7, hi in bits 8-15 of `x`; bits 16-31 ignored) ->
// packed bf16x2, exactly (sm_80+: no fp8 conversion instruction needed). Each byte's exponent
// and mantissa bits are placed at the bottom of an fp32 exponent / the top of its mantissa,
// which reads 2^-120 times the e4m3 value (subnormals included: fp32 keeps them without ftz);
// the multiply by 2^120 is exact and so is the rounding to bf16 (4 significant bits). NaN
// (0x7f / 0xff) reads as +-480: the caches hold finite values.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t x) {
  const float lo = __uint_as_float(((x & 0x80u) << 24) | ((x & 0x7fu) << 20)) * 0x1p120f;
  const float hi = __uint_as_float(((x & 0x8000u) << 16) | ((x & 0x7f00u) << 12)) * 0x1p120f;
  return pack_bf16x2(lo, hi);
}

// 32-bit shared-memory load at a .shared address (smem_addr()).
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// ---- fast math -------------------------------------------------------------

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- named barriers (ids: attention_sm90::NamedBarrier for the Hopper kernels) ----

// Barrier among `nthreads` threads (a multiple of 32, whole warps) that use the
// same `id` (1..15; 0 is __syncthreads). Orders shared-memory accesses among them.
__device__ __forceinline__ void named_barrier_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// The same barrier without .aligned: its threads may reach it from different instructions
// (e.g. two template instances of one loop, one per warpgroup) and need not be converged.
// bar.sync is barrier.sync.aligned, undefined in that case (compute-sanitizer synccheck:
// "Divergent thread(s) in block").
__device__ __forceinline__ void named_barrier_sync_unaligned(int id, int nthreads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// ---- predicated 16-byte global loads (rms_norm_quantize) --------------------

// 16 bytes from global memory through the non-coherent path, or zeros (and no access) where
// !valid. kNoAllocate: L1::no_allocate, for data read once, so that it does not evict data that
// is reused (the norm weights, read by every row).
template <bool kNoAllocate>
__device__ __forceinline__ uint4 ld_nc_v4_or_zero(const void* ptr, bool valid) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (kNoAllocate) {
    asm("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
        "@p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
        : "l"(ptr), "r"(static_cast<int>(valid)));
  } else {
    asm("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
        "@p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
        : "l"(ptr), "r"(static_cast<int>(valid)));
  }
  return v;
}

// ---- flags between CTAs (w4a8 stream-K) -------------------------------------

// A 32-bit flag in global memory, read with acquire / written with release at GPU scope: the
// writer's earlier global stores (of every thread that synchronized with it first, by
// cumulativity) are visible to a reader that saw the value.
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

}  // namespace mila::ptx

// ---- w4a8 (FP8 activations x MXFP4 weights) --------------------------------
// In namespace ptx::w4a8 so that generic names (prmt, wgmma_fence, ...) cannot collide with
// wrappers other families append; hoist them into ptx:: when a second user appears.

namespace mila::ptx::w4a8 {

// 4-byte global->shared copy (cp.async.ca: sizes 4 and 8 must go through L1). Zero-fills the
// destination without reading the source when `valid` is false.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid = true) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// threadIdx.x through a volatile read: values computed from it cannot be hoisted out of loops
// (recomputing a few addresses per iteration is cheaper than holding them in registers).
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// v through a register move the compiler cannot see through: what is computed from it is
// recomputed where it is needed instead of being held in registers from an earlier use.
__device__ __forceinline__ int opaque(int v) {
  int r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
  return r;
}

// Byte permute: d.byte[i] = {b:a}.byte[sel nibble i] (nibble bit 3 = replicate that byte's sign
// bit). Only sel[15:0] is read.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  // volatile: keeps the conversion where the kernel interleaves it with the mmas (otherwise
  // ptxas hoists a whole K tile of converted fragments and spills).
  asm volatile("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Eight e2m1 codes of one word in the sign-swizzled layout (jax_mila.quant.mxfp4, format
// version 2) -> two registers of four e4m3 bytes. Nibble i holds the magnitude bits of code i
// in its bits 0-2, codes 0-3 giving `lo` bytes 0-3 and codes 4-7 `hi` bytes 0-3; bit 3 of the
// nibbles holds the signs, lo byte j's at bit 8j + 7 (where e4m3 wants it) and hi byte j's at
// bit 8j + 3 (4 below). Magnitude: one prmt per register on the 3-bit codes (bit 3 cleared:
// it would switch prmt to sign-replicate mode). Seven instructions for eight values; the
// version-1 layout (each code's sign in its own nibble) took eleven.
// lut_lo / lut_hi: the e4m3 byte of magnitude code 0..3 / 4..7 (byte 0 of lut_lo must be 0).
__device__ __forceinline__ void e2m1x8_to_e4m3x8(uint32_t word, uint32_t lut_lo, uint32_t lut_hi,
                                                 uint32_t& lo, uint32_t& hi) {
  const uint32_t mag = word & 0x77777777u;
  lo = prmt(lut_lo, lut_hi, mag) | (word & 0x80808080u);
  hi = prmt(lut_lo, lut_hi, mag >> 16) | ((word << 4) & 0x80808080u);
}

}  // namespace mila::ptx::w4a8

// ---- w4a8: Hopper warpgroup MMA (sm_90a) ------------------------------------

// The Hopper primitives (mbarrier, TMA, wgmma synchronization, descriptors) live in
// ptx_sm90.cuh; here only the FP8 wgmma shape of the W4A8 kernels.
#include "common/ptx_sm90.cuh"

namespace mila::ptx::w4a8 {

// D[64 x 128] = A[64 x 32] * B[32 x 128] + (kAccumulate ? D : 0): e4m3 inputs, fp32 accumulators.
// A from registers (the m16n8k32 A-fragment layout per warp, warp w holding rows 16w..16w+15),
// B from shared memory through `desc_b` (K-major). kAccumulate = false (scale-d = 0) starts a
// fresh accumulation without zeroing D first. Asynchronous: commit_group / wait_group; D and A
// must not be touched until the wait (fence_operand pins them).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4],
                                                         uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{" MILA_WGMMA_REGS0 ", " MILA_WGMMA_REGS1 "}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : MILA_WGMMA_D32(d, 0), MILA_WGMMA_D32(d, 32)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}

// As wgmma_m64n128k32_e4m3_rs with A from shared memory too (`desc_a`, K-major): the operand
// roles the W4A8 kernels would have with their weights converted into shared memory
// (benchmarks/micro/wgmma_alu_overlap.cu compares the two).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t desc_a,
                                                         uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{" MILA_WGMMA_REGS0 ", " MILA_WGMMA_REGS1 "}, "
      "%64, %65, p, 1, 1;\n}\n"
      : MILA_WGMMA_D32(d, 0), MILA_WGMMA_D32(d, 32)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}

// D[64 x 192] = A[64 x 32] * B[32 x 192] + (kAccumulate ? D : 0), both from shared memory
// (K-major): the W4A8 kernel on expanded e4m3 weights, whose 192-row activation tiles leave
// room for a fifth pipeline stage and one promotion wait per chain.
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n192k32_e4m3_ss(float (&d)[96], uint64_t desc_a,
                                                         uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 "
      "{" MILA_WGMMA_REGS0 ", " MILA_WGMMA_REGS1 ", " MILA_WGMMA_REGS2 "}, "
      "%96, %97, p, 1, 1;\n}\n"
      : MILA_WGMMA_D32(d, 0), MILA_WGMMA_D32(d, 32), MILA_WGMMA_D32(d, 64)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}

// D[64 x 64] = A[64 x 32] * B[32 x 64] + (kAccumulate ? D : 0): as wgmma_m64n128k32_e4m3_rs
// over 64 columns of B (half the accumulator registers, so that two batches can be in flight).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[32], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{" MILA_WGMMA_REGS0 "}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : MILA_WGMMA_D32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}

}  // namespace mila::ptx::w4a8
