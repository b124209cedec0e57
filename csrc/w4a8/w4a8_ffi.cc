// FFI handlers of the W4A8 GEMM, dense and grouped. They validate again what the Python wrappers
// validated at trace time (dtypes, shapes, supported N and K, alignment, device); every failure
// is an ffi::Error. No allocations (the scratch is a second result that XLA allocates) and only
// stream operations: CUDA-graph compatible. Group sizes are read on the device only.
#include <cstdint>
#include <string>

#include "common/ffi_helpers.h"
#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {

constexpr const char* kOp = "w4a8_matmul";
constexpr const char* kGroupedOp = "grouped_w4a8_matmul";
constexpr const char* kGemvOp = "w4a8_gemv";

// Shapes of x [M, K], x_scale [M], the weight arrays [(E,) N, Kp / 2], [(E,) N, Kp / 32],
// [(E,) N] and out [M, N]: fills `args` or says what is wrong. `experts` is 0 for a dense call
// (2-D weights), else E (3-D weights).
ffi::Error CheckShapes(const char* op, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale,
                       ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scales,
                       ffi::Buffer<ffi::U8> channel_exp, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t experts, W4A8Args* args) {
  // x is an AnyBuffer (this FFI header has no native type for F8E4M3FN arguments).
  if (x.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(op, "x_fp8: dtype must be float8_e4m3fn, got ",
                           DTypeName(x.element_type()));
  }
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scales.dimensions(),
             cd = channel_exp.dimensions();
  if (xd.size() != 2) {
    return InvalidArgument(op, "x_fp8: expected rank 2 [M, K], got shape ", ShapeString(xd));
  }
  const int64_t m = xd[0], k = xd[1];
  if (m < 1 || k < 1) return InvalidArgument(op, "x_fp8: empty shape ", ShapeString(xd));
  if (m > INT32_MAX - 256) {
    return InvalidArgument(op, "x_fp8: M=", m, " rows are not supported (at most 2^31 - 257)");
  }
  const size_t lead = experts > 0 ? 1 : 0;  // the expert dimension of the weight arrays
  const std::string e_dims = experts > 0 ? Concat(experts, ", ") : std::string();
  if (pd.size() != 2 + lead || (experts > 0 && pd[0] != experts)) {
    return InvalidArgument(op, "w.packed: expected [", experts > 0 ? "E, " : "", "N, Kp/2]",
                           experts > 0 ? Concat(" with E = ", experts) : std::string(),
                           ", got ", ShapeString(pd));
  }
  const int64_t n = pd[lead], kp = pd[lead + 1] * 2;
  if (kp % kW4A8KMultiple != 0 || kp > INT32_MAX || kp < 1) {
    return InvalidArgument(op, "w.packed: Kp=", kp, " is not supported: the stored K must be a "
                           "positive multiple of ", kW4A8KMultiple);
  }
  if (k % kW4A8KBlock != 0 || k > kp || k <= kp - kW4A8KMultiple) {
    return InvalidArgument(op, "x_fp8, w: K=", k, " does not fit the weight's stored K=", kp,
                           ": K must be a multiple of ", kW4A8KBlock, " in (", kp - kW4A8KMultiple,
                           ", ", kp, "]");
  }
  if (n < 1 || n % kW4A8NMultiple != 0 || n > INT32_MAX) {
    return InvalidArgument(op, "w: N=", n, " is not supported: N must be a positive multiple of ",
                           kW4A8NMultiple);
  }
  if (sd.size() != 2 + lead || (experts > 0 && sd[0] != experts) || sd[lead] != n ||
      sd[lead + 1] != kp / 32) {
    return InvalidArgument(op, "w.scales: expected [", e_dims, n, ", ", kp / 32, "], got ",
                           ShapeString(sd));
  }
  if (cd.size() != 1 + lead || (experts > 0 && cd[0] != experts) || cd[lead] != n) {
    return InvalidArgument(op, "w.channel_exp: expected [", e_dims, n, "], got ",
                           ShapeString(cd));
  }
  if (x_scale.dimensions().size() != 1 || x_scale.dimensions()[0] != m) {
    return InvalidArgument(op, "x_scale: expected [M] = [", m, "], got ",
                           ShapeString(x_scale.dimensions()));
  }
  const bool out_f32 = out->element_type() == ffi::DataType::F32;
  if (!out_f32 && out->element_type() != ffi::DataType::BF16) {
    return InvalidArgument(op, "out: dtype must be bfloat16 or float32, got ",
                           DTypeName(out->element_type()));
  }
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != m || od[1] != n) {
    return InvalidArgument(op, "out: expected [M, N] = [", m, ", ", n, "], got ", ShapeString(od));
  }
  const void* aligned[] = {x.untyped_data(), packed.untyped_data(), out->untyped_data(),
                           workspace->untyped_data()};
  for (const void* p : aligned) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return InvalidArgument(op, "x_fp8/w.packed/out/workspace: buffers must be 16-byte aligned");
    }
  }
  if (reinterpret_cast<uintptr_t>(scales.untyped_data()) % 4 != 0) {
    return InvalidArgument(op, "w.scales: buffer must be 4-byte aligned");
  }
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1) {
    return InvalidArgument(op, "workspace: expected a uint8 vector, got ",
                           DTypeName(workspace->element_type()), " of shape ",
                           ShapeString(workspace->dimensions()));
  }
  args->x = reinterpret_cast<const uint8_t*>(x.untyped_data());
  args->x_scale = x_scale.typed_data();
  args->packed = packed.typed_data();
  args->scales = scales.typed_data();
  args->channel_exp = channel_exp.typed_data();
  args->out = out->untyped_data();
  args->workspace = workspace->untyped_data();
  args->workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  args->out_f32 = out_f32;
  args->m = m;
  args->n = static_cast<int>(n);
  args->k = static_cast<int>(k);
  args->kp = static_cast<int>(kp);
  return ffi::Error::Success();
}

// The variant, the device and the build: runs the call or says why not.
ffi::Error Run(const char* op, cudaStream_t stream, W4A8Args& args, int64_t variant) {
  if (variant < 0 || variant > kW4A8LastVariant) {
    return InvalidArgument(op, "variant=", variant,
                           " (0 auto, 1 mma.sync, 2 warp-specialized wgmma, 3 the same on "
                           "weights expanded to e4m3, 4 the GEMV of 1 to ", kW4A8GemvMaxRows,
                           " rows)");
  }
  const int cc = CurrentComputeCapability();
  if (cc < kW4A8MinComputeCapability) {
    return Unimplemented(op, "needs FP8 tensor cores (compute capability >= 8.9), this device is ",
                         cc / 10, ".", cc % 10, "; jax_mila routes such devices to the reference");
  }
  const W4A8Variant resolved = ResolveW4A8Variant(static_cast<W4A8Variant>(variant), args, cc);
  if (resolved == W4A8Variant::kGemv) {
    if (args.group_sizes != nullptr) {
      return InvalidArgument(op, "variant=", variant, ": the GEMV takes dense calls only");
    }
    if (args.m > kW4A8GemvMaxRows) {
      return InvalidArgument(op, "variant=", variant, ": the GEMV takes 1 to ", kW4A8GemvMaxRows,
                             " rows, x_fp8 has M=", args.m);
    }
  }
  const bool wgmma =
      resolved == W4A8Variant::kWgmmaWs || resolved == W4A8Variant::kWgmmaWsE4m3;
  if (wgmma && cc != 90) {
    return Unimplemented(op, "the wgmma kernel needs compute capability 9.0, this device is ",
                         cc / 10, ".", cc % 10);
  }
  if (resolved == W4A8Variant::kWgmmaWsE4m3 && args.group_sizes != nullptr) {
    return InvalidArgument(op, "variant=", variant, ": grouped calls convert the weights in "
                           "registers (variants 0, 1, 2)");
  }
  int compiled_for = 0;
  if (const char* why = W4A8CodeProblem(resolved, cc, &compiled_for)) {
    return Unimplemented(op, "variant=", variant, ": ", why, " (device ", cc / 10, ".", cc % 10,
                         compiled_for > 0 ? Concat(", its code compiled for compute_",
                                                   compiled_for) : std::string(),
                         "); rebuild with JAX_MILA_CUDA_ARCHS covering it (default "
                         "80-real;89-real;90a)");
  }
  const int64_t need = W4A8RequiredWorkspace(resolved, args);
  if (args.workspace_bytes < need) {
    return InvalidArgument(op, "workspace: ", args.workspace_bytes, " bytes; variant ",
                           static_cast<int>(resolved), " needs at least ", need);
  }
  return CheckLaunch(op, LaunchW4A8Matmul(args, resolved, cc, stream));
}

ffi::Error W4A8MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale,
                          ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scales,
                          ffi::Buffer<ffi::U8> channel_exp, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t variant) {
  W4A8Args args;
  if (ffi::Error e = CheckShapes(kOp, x, x_scale, packed, scales, channel_exp, out, workspace, 0,
                                 &args);
      e.failure()) {
    return e;
  }
  return Run(kOp, stream, args, variant);
}

ffi::Error GroupedW4A8MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::U8> packed,
                                 ffi::Buffer<ffi::U8> scales, ffi::Buffer<ffi::U8> channel_exp,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace, int64_t variant) {
  const auto gd = group_sizes.dimensions();
  if (gd.size() != 1 || gd[0] < 1 || gd[0] > kW4A8MaxExperts) {
    return InvalidArgument(kGroupedOp, "group_sizes: expected [E] with 1 <= E <= ",
                           kW4A8MaxExperts, ", got ", ShapeString(gd));
  }
  W4A8Args args;
  if (ffi::Error e = CheckShapes(kGroupedOp, x, x_scale, packed, scales, channel_exp, out,
                                 workspace, gd[0], &args);
      e.failure()) {
    return e;
  }
  args.group_sizes = group_sizes.typed_data();
  args.experts = static_cast<int>(gd[0]);
  return Run(kGroupedOp, stream, args, variant);
}

// The GEMV of up to kW4A8GemvMaxWeights weights that multiply the same activations, one launch:
// x_fp8 [M, K], x_scale [M], then (packed, scales, channel_exp) of each weight; results: each
// weight's out [M, N_i] (one dtype, bfloat16 or float32), then the workspace.
ffi::Error W4A8GemvImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scale,
                        ffi::RemainingArgs weight_arrays, ffi::RemainingRets results) {
  const size_t arrays = weight_arrays.size();
  if (arrays % 3 != 0 || arrays < 3 || arrays > 3 * kW4A8GemvMaxWeights) {
    return InvalidArgument(kGemvOp, "weights: expected 1 to ", kW4A8GemvMaxWeights,
                           " (packed, scales, channel_exp) triples after x_fp8 and x_scale, got ",
                           arrays, " arrays");
  }
  const size_t count = arrays / 3;
  if (results.size() != count + 1) {
    return InvalidArgument(kGemvOp, "results: expected one output per weight (", count,
                           ") and the workspace, got ", results.size());
  }
  auto workspace = results.get<ffi::AnyBuffer>(count);
  if (workspace.has_error()) {
    return InvalidArgument(kGemvOp, "workspace: ", workspace.error().message());
  }
  W4A8Args args;
  W4A8GemvWeights w;
  for (size_t i = 0; i < count; ++i) {
    const std::string op = Concat(kGemvOp, " (weight ", i, ")");
    auto packed = weight_arrays.get<ffi::Buffer<ffi::U8>>(3 * i);
    auto scales = weight_arrays.get<ffi::Buffer<ffi::U8>>(3 * i + 1);
    auto channel_exp = weight_arrays.get<ffi::Buffer<ffi::U8>>(3 * i + 2);
    auto out = results.get<ffi::AnyBuffer>(i);
    if (packed.has_error() || scales.has_error() || channel_exp.has_error()) {
      return InvalidArgument(op.c_str(), "w.packed, w.scales, w.channel_exp must be uint8 arrays");
    }
    if (out.has_error()) return InvalidArgument(op.c_str(), "out: ", out.error().message());
    W4A8Args a;
    if (ffi::Error e = CheckShapes(op.c_str(), x, x_scale, *packed, *scales, *channel_exp, *out,
                                   *workspace, 0, &a);
        e.failure()) {
      return e;
    }
    if (i > 0 && a.kp != args.kp) {
      return InvalidArgument(op.c_str(), "w: stored K=", a.kp, "; every weight of a launch must "
                             "have the first's (", args.kp, ")");
    }
    if (i > 0 && a.out_f32 != args.out_f32) {
      return InvalidArgument(op.c_str(), "out: ", DTypeName((*out)->element_type()),
                             "; every output of a launch must have the first's dtype");
    }
    if (i == 0) args = a;
    W4A8GemvAddWeight(w, a.packed, a.scales, a.channel_exp, a.out, a.n);
  }
  if (args.m > kW4A8GemvMaxRows) {
    return InvalidArgument(kGemvOp, "the GEMV takes 1 to ", kW4A8GemvMaxRows,
                           " rows, x_fp8 has M=", args.m);
  }
  const int cc = CurrentComputeCapability();
  if (cc < kW4A8MinComputeCapability) {
    return Unimplemented(kGemvOp, "needs compute capability >= 8.9, this device is ", cc / 10, ".",
                         cc % 10, "; jax_mila routes such devices to the reference");
  }
  int compiled_for = 0;
  if (const char* why = W4A8GemvCodeProblem(&compiled_for)) {
    return Unimplemented(kGemvOp, why, " (device ", cc / 10, ".", cc % 10, "); rebuild with "
                         "JAX_MILA_CUDA_ARCHS covering it (default 80-real;89-real;90a)");
  }
  const int64_t need = W4A8GemvRequiredWorkspace(args, w);
  if (args.workspace_bytes < need) {
    return InvalidArgument(kGemvOp, "workspace: ", args.workspace_bytes, " bytes; the GEMV of "
                           "these weights needs at least ", need);
  }
  return CheckLaunch(kGemvOp, LaunchW4A8GemvWeights(args, w, stream));
}

}  // namespace
}  // namespace mila

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaW4A8Matmul, mila::W4A8MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                   // x_fp8 [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()       // x_scale [M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // packed [N, Kp/2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // scales [N, Kp/32]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()        // channel_exp [N]
                                  .Ret<xla::ffi::AnyBuffer>()                   // out [M, N] bf16/f32
                                  .Ret<xla::ffi::AnyBuffer>()                   // workspace u8
                                  .Attr<int64_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaGroupedW4A8Matmul, mila::GroupedW4A8MatmulImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()                // x_fp8 [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()    // x_scale [M]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()     // packed [E, N, Kp/2]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()     // scales [E, N, Kp/32]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()     // channel_exp [E, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()    // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()                // out [M, N] bf16/f32
                                  .Ret<xla::ffi::AnyBuffer>()                // workspace u8
                                  .Attr<int64_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaW4A8Gemv, mila::W4A8GemvImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // x_fp8 [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x_scale [M]
                                  .RemainingArgs()  // (packed, scales, channel_exp) per weight
                                  .RemainingRets(),  // out [M, N_i] per weight, workspace u8
                              {xla::ffi::Traits::kCmdBufferCompatible});
