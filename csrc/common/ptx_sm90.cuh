// Inline-PTX wrappers of the Hopper (sm_90a) kernels: mbarriers, TMA, clusters, setmaxnreg,
// wgmma synchronization and shared-memory descriptors, and the bf16 wgmma shapes of the
// attention kernels (the W4A8 kernels' FP8 shape is in ptx.cuh). Outside sm_90a code
// (MILA_HAS_SM90A undefined) the instructions that need it compile to nothing; kernels built
// from them guard their bodies with the same macro.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define MILA_HAS_SM90A 1
#endif

// Operand lists of the wgmma wrappers' fp32 accumulators, 32 registers at a time: d[o] ..
// d[o + 31] as read-write asm operands, and the operand numbers of chunk c in the template.
// An m64nN accumulator of N / 2 registers stacks N / 64 of each.
#define MILA_WGMMA_D32(d, o) \
  "+f"((d)[(o) + 0]), "+f"((d)[(o) + 1]), "+f"((d)[(o) + 2]), "+f"((d)[(o) + 3]), \
  "+f"((d)[(o) + 4]), "+f"((d)[(o) + 5]), "+f"((d)[(o) + 6]), "+f"((d)[(o) + 7]), \
  "+f"((d)[(o) + 8]), "+f"((d)[(o) + 9]), "+f"((d)[(o) + 10]), "+f"((d)[(o) + 11]), \
  "+f"((d)[(o) + 12]), "+f"((d)[(o) + 13]), "+f"((d)[(o) + 14]), "+f"((d)[(o) + 15]), \
  "+f"((d)[(o) + 16]), "+f"((d)[(o) + 17]), "+f"((d)[(o) + 18]), "+f"((d)[(o) + 19]), \
  "+f"((d)[(o) + 20]), "+f"((d)[(o) + 21]), "+f"((d)[(o) + 22]), "+f"((d)[(o) + 23]), \
  "+f"((d)[(o) + 24]), "+f"((d)[(o) + 25]), "+f"((d)[(o) + 26]), "+f"((d)[(o) + 27]), \
  "+f"((d)[(o) + 28]), "+f"((d)[(o) + 29]), "+f"((d)[(o) + 30]), "+f"((d)[(o) + 31])
#define MILA_WGMMA_REGS0 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MILA_WGMMA_REGS1 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MILA_WGMMA_REGS2 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define MILA_WGMMA_REGS3 \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

namespace mila::ptx::sm90 {

// ---- mbarrier ---------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() {
#ifdef MILA_HAS_SM90A
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef MILA_HAS_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
// One plain arrival (release semantics: this thread's earlier shared-memory accesses are
// ordered before the phase completes).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Whether the phase of `bar` with parity `parity` has completed (acquire, CTA scope); the
// hardware may suspend the thread for a while before answering no.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
#endif
  return done != 0;
}
// Spins until the phase with parity `parity` has completed (acquire semantics).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// One arrival on `bar` once all of this thread's earlier cp.async have landed, counted as one
// of the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ---- TMA --------------------------------------------------------------------

// 2-D tiled copy global -> shared of the box at (c0 = innermost coordinate, c1), completion
// counted in bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

// 4-D tiled copy global -> shared (box and swizzle from the tensor map), completion counted
// in bytes on `bar`. Out-of-bounds elements are zero-filled and still counted.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1, int c2, int c3) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}
__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
#ifdef MILA_HAS_SM90A
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
#endif
}

// ---- clusters (TMA multicast to the CTAs of a cluster) --------------------------

__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r = 0;
#ifdef MILA_HAS_SM90A
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}
// The shared::cluster address of this CTA's shared variable `addr` in CTA `rank`.
__device__ __forceinline__ uint32_t map_to_cta(uint32_t addr, uint32_t rank) {
  uint32_t r = addr;
#ifdef MILA_HAS_SM90A
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
#endif
  return r;
}
// A float of another CTA's shared memory (`cluster_addr` from map_to_cta).
__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t cluster_addr) {
  float v = 0.f;
#ifdef MILA_HAS_SM90A
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(cluster_addr) : "memory");
#endif
  return v;
}
// All threads of every CTA of the cluster (not .aligned: callers may arrive diverged).
__device__ __forceinline__ void cluster_sync() {
#ifdef MILA_HAS_SM90A
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}
// tma_load_4d into the same shared-memory offset of every CTA in `cta_mask`, each CTA's
// barrier at offset `bar` receiving the bytes that land in that CTA.
__device__ __forceinline__ void tma_load_4d_multicast(uint32_t dst, const void* tmap, uint32_t bar,
                                                      int c0, int c1, int c2, int c3,
                                                      uint16_t cta_mask) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "h"(cta_mask)
      : "memory");
#endif
}

// tma_load_2d into the same shared-memory offset of every CTA in `cta_mask`, each CTA's
// barrier at offset `bar` receiving the bytes that land in that CTA.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const void* tmap, uint32_t bar,
                                                      int c0, int c1, uint16_t cta_mask) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
#endif
}
// Arrival on a barrier of another CTA of the cluster (`cluster_addr` from map_to_cta) with the
// default .release.cta semantics, as CUTLASS's ClusterBarrier::arrive(cta_id): for a consumer
// that releases a stage the other CTA's producer will overwrite, its reads have returned before
// it arrives, which is all that producer needs. Waits stay mbar_wait (CTA scope) too: the bytes
// a full barrier counts, multicast included, are visible once its phase completes. (At cluster
// scope ptxas puts a MEMBAR.ALL.GPU before each arrival and a CCTL.IVALL after each wait, which
// costs a cluster kernel much of its speed.)
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_addr) {
#ifdef MILA_HAS_SM90A
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
#endif
}

// ---- matrix stores ------------------------------------------------------------------

// Four 8 x 8 b16 matrices stored transposed. Register i holds matrix i in the mma fragment
// layout (thread t: row t / 4, columns 2 (t % 4) and 2 (t % 4) + 1, the lower column in the low
// half); it lands transposed, fragment column c as stored row c, 16 contiguous bytes whose
// address thread 8 i + c gives (16-byte aligned). One instruction replaces 8 scalar 2-byte
// stores per thread of an accumulator written out with its rows and columns swapped.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
#ifdef MILA_HAS_SM90A
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#endif
}

// ---- named barriers between warpgroups -------------------------------------------

// Arrival without waiting on named barrier `id` (1..15), whose phase completes when
// `nthreads` threads (whole warps) have arrived or synced on it (ptx::named_barrier_sync).
// Pairs one side's signal with the other side's bar.sync (flash256_sm90's ping-pong turns).
__device__ __forceinline__ void named_barrier_arrive(int id, int nthreads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

// ---- register reallocation between warpgroups ---------------------------------

template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef MILA_HAS_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef MILA_HAS_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// ---- wgmma --------------------------------------------------------------------

// Shared-memory matrix descriptor, 128-byte swizzle (16-byte chunk c of a 128-byte row r
// stored at chunk c ^ (r % 8); atoms of 8 rows x 128 B = 1024 B, 1024-byte aligned).
//   K-major operand (rows = M or N, 64 K elements per 128-byte row): sbo = 1024 (next 8
//     rows), lbo unused (16); step along K inside the 128-byte row by adding bytes to addr.
//   MN-major operand (rows = K, 64 N elements per 128-byte row): sbo = 1024 (next 8 K rows),
//     lbo = the byte distance to the next 64 N columns (the next swizzle column block).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// desc_sw128 split into its two 32-bit words, for operands walked k-step by k-step: the
// descriptor of a step `bytes` past the base is at(bytes), the base's low word plus bytes / 16
// and the same high word. The start-address field (bits 0-13) cannot carry into the leading
// byte offset above it, since shared addresses stay below 256 KB; so a step costs one 32-bit
// add instead of desc_sw128's masks, shifts and ORs (about five instructions per descriptor).
struct DescSw128 {
  uint32_t lo, hi;
  __device__ __forceinline__ DescSw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    const uint64_t d = desc_sw128(addr, lbo, sbo);
    lo = static_cast<uint32_t>(d);
    hi = static_cast<uint32_t>(d >> 32);
  }
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const {
    return (static_cast<uint64_t>(hi) << 32) | (lo + (bytes >> 4));
  }
};

// desc_sw128 of a K-major tile with 128-byte rows (w4a8's activation tiles): leading byte
// offset 16 (unused by this swizzle), stride byte offset 1024 (one 8-row swizzle atom).
__device__ __forceinline__ uint64_t desc_k128b(uint32_t addr) { return desc_sw128(addr, 16, 1024); }

__device__ __forceinline__ void wgmma_fence() {
#ifdef MILA_HAS_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef MILA_HAS_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef MILA_HAS_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Makes generic-proxy writes to shared memory (st.shared, cp.async) visible to the async proxy
// (wgmma operand reads, TMA). Run by the writing threads after their writes land.
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef MILA_HAS_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Pins a register at this point (no code), so that it is neither read nor written between a
// wgmma that uses it and the wait that retires that wgmma.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
// Every register of a wgmma accumulator or of its A fragments.
template <int N>
__device__ __forceinline__ void fence_operands(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(x[i]);
}
template <int M, int N>
__device__ __forceinline__ void fence_operands(uint32_t (&x)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) fence_operand(x[i][j]);
}

// S[64 x 64] (+)= A[64 x 16] * B[16 x 64]^T: A and B K-major in shared memory (descriptors),
// bf16 in, fp32 accumulators in the m64nNk16 accumulator layout. kAccumulate = false starts
// a fresh sum (scale-d = 0), so d need not be zeroed.
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{" MILA_WGMMA_REGS0 "}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : MILA_WGMMA_D32(d, 0)
      : "l"(desc_a), "l"(desc_b), "n"(kAccumulate ? 1 : 0));
#else
  __trap();
#endif
}

// O[64 x 256] += P[64 x 16] * V[16 x 256]: P from registers (the m16n8k16 A-fragment layout
// per warp, warp w holding rows 16w..16w+15), V from shared memory MN-major (imm-trans-b = 1).
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], const uint32_t (&a)[4],
                                                       uint64_t desc_b) {
#ifdef MILA_HAS_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{" MILA_WGMMA_REGS0 ", " MILA_WGMMA_REGS1 ", " MILA_WGMMA_REGS2 ", " MILA_WGMMA_REGS3 "}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : MILA_WGMMA_D32(d, 0), MILA_WGMMA_D32(d, 32), MILA_WGMMA_D32(d, 64), MILA_WGMMA_D32(d, 96)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
#else
  __trap();
#endif
}

}  // namespace mila::ptx::sm90
