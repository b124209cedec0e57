// FFI handler of rms_norm_rope: validates again what the Python wrapper (jax_mila/ffi/norm_rope.py)
// validated at trace time; every failure is an ffi::Error, never an exception.
#include <cmath>
#include <cstdint>

#include "common/ffi_helpers.h"
#include "norm_rope/norm_rope_kernel.h"

namespace mila {
namespace {

constexpr const char* kOp = "rms_norm_rope";

bool SupportedHeadDim(int64_t d) {
  for (int supported : kNormRopeHeadDims) {
    if (d == supported) return true;
  }
  return false;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error RmsNormRopeImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::BF16> cos,
                           ffi::Buffer<ffi::BF16> sin, ffi::ResultBuffer<ffi::BF16> out,
                           float eps) {
  const auto dims = x.dimensions();
  if (dims.size() < 3) {
    return InvalidArgument(kOp, "x: expected rank >= 3 ([..., T, H, D]), got shape ",
                           ShapeString(dims));
  }
  const int64_t d = dims[dims.size() - 1];
  const int64_t heads = dims[dims.size() - 2];
  const int64_t t = dims[dims.size() - 3];
  if (!SupportedHeadDim(d)) {
    return InvalidArgument(kOp, "x: head dim D=", d, " (last dim of ", ShapeString(dims),
                           ") is not supported (supported: 256, 512)");
  }
  const int64_t elements = static_cast<int64_t>(x.element_count());
  if (elements == 0) {
    return InvalidArgument(kOp, "x: empty array of shape ", ShapeString(dims),
                           " is not supported");
  }
  const int64_t rows = elements / d;
  if (rows > INT32_MAX) {
    return InvalidArgument(kOp, "x: ", rows, " rows (tokens x heads) exceed the supported 2^31-1");
  }
  const auto wdims = weight.dimensions();
  if (wdims.size() != 1 || wdims[0] != d) {
    return InvalidArgument(kOp, "weight: shape ", ShapeString(wdims), " must be [", d,
                           "] (one weight per element of a head)");
  }
  const auto cdims = cos.dimensions();
  if (cdims.size() != 2 || cdims[0] != t || cdims[1] != d) {
    return InvalidArgument(kOp, "cos: shape ", ShapeString(cdims), " must be [", t, ", ", d,
                           "] ([T, D] of x ", ShapeString(dims), ")");
  }
  if (!SameDims(sin.dimensions(), cdims)) {
    return InvalidArgument(kOp, "sin: shape ", ShapeString(sin.dimensions()),
                           " must equal cos's shape ", ShapeString(cdims));
  }
  if (!SameDims(out->dimensions(), dims)) {
    return InvalidArgument(kOp, "out: result shape ", ShapeString(out->dimensions()),
                           " must equal x's shape ", ShapeString(dims));
  }
  if (!(std::isfinite(eps) && eps > 0.f)) {
    return InvalidArgument(kOp, "eps: ", eps, " must be a finite number > 0");
  }
  if (!Aligned16(x.untyped_data()) || !Aligned16(weight.untyped_data()) ||
      !Aligned16(cos.untyped_data()) || !Aligned16(sin.untyped_data()) ||
      !Aligned16(out->untyped_data())) {
    return InvalidArgument(kOp, "x/weight/cos/sin/out: buffers must be 16-byte aligned");
  }
  const cudaError_t err = LaunchRmsNormRope(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()), weight.typed_data(),
      reinterpret_cast<const __nv_bfloat16*>(cos.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(sin.untyped_data()), eps,
      reinterpret_cast<__nv_bfloat16*>(out->untyped_data()), rows, heads, t, d, stream);
  return CheckLaunch(kOp, err);
}

}  // namespace
}  // namespace mila

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaRmsNormRope, mila::RmsNormRopeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // weight
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // cos
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // sin
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // out
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
