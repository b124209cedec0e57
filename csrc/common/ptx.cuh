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

// ---- fast math -------------------------------------------------------------

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- flash512 ---------------------------------------------------------------

// Barrier among `nthreads` threads (a multiple of 32, whole warps) that use the
// same `id` (1..15; 0 is __syncthreads). Orders shared-memory accesses among them.
__device__ __forceinline__ void named_barrier_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

}  // namespace mila::ptx

// ---- w4a8 (FP8 activations x MXFP4 weights) --------------------------------

namespace mila::ptx {

// 4-byte global->shared copy (cp.async.ca: sizes 4 and 8 must go through L1). Zero-fills the
// destination without reading the source when `valid` is false.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid = true) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
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

// Four e2m1 codes (nibbles of sel[15:0], code i -> byte i) -> four e4m3 bytes.
// lut_lo/lut_hi: the e4m3 byte of magnitude code 0..3 / 4..7 (byte 0 of lut_lo must be 0).
// Magnitude: one prmt on the 3-bit codes. Sign: a prmt whose table is all 0x80 returns 0x80 for
// a positive code and, because bit 3 switches prmt to sign-replicate mode, 0xFF for a negative
// one; bit 0 of that byte, moved to bit 7, is the e4m3 sign.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t sel, uint32_t lut_lo,
                                                     uint32_t lut_hi) {
  const uint32_t mag = prmt(lut_lo, lut_hi, sel & 0x7777u);
  const uint32_t neg = prmt(0x80808080u, 0x80808080u, sel);
  return mag | ((neg << 7) & 0x80808080u);
}

}  // namespace mila::ptx
