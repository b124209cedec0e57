// FFI handler of the W4A8 GEMM. Validates again what the Python wrapper validated at trace time
// (dtypes, shapes, supported N and K, alignment, device); every failure is an ffi::Error.
// No allocations (wgmma_ws's stream-K scratch is a second result that XLA allocates); at most a
// memset of its flags and one kernel launch: CUDA-graph compatible.
#include <cstdint>

#include "common/ffi_helpers.h"
#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {

constexpr const char* kOp = "w4a8_matmul";

ffi::Error W4A8MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::U8> packed,
                          ffi::Buffer<ffi::U8> scales, ffi::Buffer<ffi::U8> channel_exp,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t variant) {
  // x is an AnyBuffer (this FFI header has no native type for F8E4M3FN arguments).
  if (x.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(kOp, "x_fp8: dtype must be float8_e4m3fn, got ",
                           DTypeName(x.element_type()));
  }
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2) {
    return InvalidArgument(kOp, "x_fp8: expected rank 2 [M, K], got shape ", ShapeString(xd));
  }
  const int64_t m = xd[0], k = xd[1];
  if (m < 1 || k < 1) return InvalidArgument(kOp, "x_fp8: empty shape ", ShapeString(xd));
  if (pd.size() != 2 || pd[1] * 2 != k) {
    return InvalidArgument(kOp, "w.packed: expected [N, K/2] = [N, ", k / 2, "], got ",
                           ShapeString(pd));
  }
  const int64_t n = pd[0];
  if (k % kW4A8KMultiple != 0 || k > INT32_MAX) {
    return InvalidArgument(kOp, "x_fp8, w: K=", k, " is not supported: K must be a multiple of ",
                           kW4A8KMultiple, " up to 2^31-1");
  }
  if (n < 1 || n % kW4A8NMultiple != 0 || n > INT32_MAX) {
    return InvalidArgument(kOp, "w: N=", n, " is not supported: N must be a positive multiple of ",
                           kW4A8NMultiple, " up to 2^31-1");
  }
  if (sd.size() != 2 || sd[0] != n || sd[1] != k / 32) {
    return InvalidArgument(kOp, "w.scales: expected [N, K/32] = [", n, ", ", k / 32, "], got ",
                           ShapeString(sd));
  }
  if (channel_exp.dimensions().size() != 1 || channel_exp.dimensions()[0] != n) {
    return InvalidArgument(kOp, "w.channel_exp: expected [N] = [", n, "], got ",
                           ShapeString(channel_exp.dimensions()));
  }
  if (x_scale.dimensions().size() != 1 || x_scale.dimensions()[0] != m) {
    return InvalidArgument(kOp, "x_scale: expected [M] = [", m, "], got ",
                           ShapeString(x_scale.dimensions()));
  }
  const bool out_f32 = out->element_type() == ffi::DataType::F32;
  if (!out_f32 && out->element_type() != ffi::DataType::BF16) {
    return InvalidArgument(kOp, "out: dtype must be bfloat16 or float32, got ",
                           DTypeName(out->element_type()));
  }
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != m || od[1] != n) {
    return InvalidArgument(kOp, "out: expected [M, N] = [", m, ", ", n, "], got ", ShapeString(od));
  }
  const void* aligned[] = {x.untyped_data(), packed.untyped_data(), out->untyped_data()};
  for (const void* p : aligned) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return InvalidArgument(kOp, "x_fp8/w.packed/out: buffers must be 16-byte aligned");
    }
  }
  if (reinterpret_cast<uintptr_t>(scales.untyped_data()) % 4 != 0) {
    return InvalidArgument(kOp, "w.scales: buffer must be 4-byte aligned");
  }
  if (variant < 0 || variant > kW4A8LastVariant) {
    return InvalidArgument(kOp, "variant=", variant,
                           " (0 auto, 1 mma.sync, 2 wgmma, 3 warp-specialized wgmma, 4 the same "
                           "without stream-K, 5 the same on 2-CTA clusters, 6 and 7: 3 and 5 on "
                           "weights expanded to e4m3, 8 auto with room for the expanded weights)");
  }
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1) {
    return InvalidArgument(kOp, "workspace: expected a uint8 vector, got ",
                           DTypeName(workspace->element_type()), " of shape ",
                           ShapeString(workspace->dimensions()));
  }
  if (reinterpret_cast<uintptr_t>(workspace->untyped_data()) % 16 != 0) {
    return InvalidArgument(kOp, "workspace: buffer must be 16-byte aligned");
  }
  const int cc = CurrentComputeCapability();
  if (cc < kW4A8MinComputeCapability) {
    return Unimplemented(kOp, "needs FP8 tensor cores (compute capability >= 8.9), this device is ",
                         cc / 10, ".", cc % 10, "; jax_mila routes such devices to the reference");
  }
  const W4A8Variant resolved = ResolveW4A8Variant(static_cast<W4A8Variant>(variant), cc);
  if (resolved != W4A8Variant::kMmaSync && cc != 90) {
    return Unimplemented(kOp, "the wgmma kernel needs compute capability 9.0, this device is ",
                         cc / 10, ".", cc % 10);
  }
  int compiled_for = 0;
  if (const char* why = W4A8CodeProblem(static_cast<W4A8Variant>(variant), cc, &compiled_for)) {
    return Unimplemented(kOp, "variant=", variant, ": ", why, " (device ", cc / 10, ".", cc % 10,
                         compiled_for > 0 ? Concat(", its code compiled for compute_",
                                                   compiled_for) : std::string(),
                         "); rebuild with JAX_MILA_CUDA_ARCHS covering it (default "
                         "80-real;89-real;90a)");
  }
  if ((resolved == W4A8Variant::kWgmmaWsE4m3 || resolved == W4A8Variant::kWgmmaWsE4m3Cluster) &&
      static_cast<int64_t>(workspace->size_bytes()) < W4A8ExpandBytes(n, k)) {
    return InvalidArgument(kOp, "workspace: ", workspace->size_bytes(), " bytes; variant ",
                           static_cast<int>(resolved), " expands the weights into it and needs "
                           "at least N x K + ", kW4A8ExpandAlign, " = ", W4A8ExpandBytes(n, k));
  }
  W4A8Args args;
  args.x = reinterpret_cast<const uint8_t*>(x.untyped_data());
  args.x_scale = x_scale.typed_data();
  args.packed = packed.typed_data();
  args.scales = scales.typed_data();
  args.channel_exp = channel_exp.typed_data();
  args.out = out->untyped_data();
  args.workspace = workspace->untyped_data();
  args.workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  args.out_f32 = out_f32;
  args.m = m;
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  return CheckLaunch(kOp, LaunchW4A8Matmul(args, resolved, cc, stream));
}

}  // namespace
}  // namespace mila

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaW4A8Matmul, mila::W4A8MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                   // x_fp8 [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()       // x_scale [M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // packed [N, K/2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // scales [N, K/32]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // channel_exp [N]
                                  .Ret<xla::ffi::AnyBuffer>()                   // out [M, N] bf16/f32
                                  .Ret<xla::ffi::AnyBuffer>()                   // workspace u8
                                  .Attr<int64_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
