// FFI handlers of the activation quantizer: quantize_activations (bf16 rows),
// quantize_geglu (rows of gelu_tanh(gate) * up) and add_rms_norm_quantize (RMS-normed rows,
// after a residual add of a normed branch or of x alone). Each validates again what its Python
// wrapper validated at trace time; every failure is an ffi::Error.
#include <cmath>
#include <cstdint>

#include "common/ffi_helpers.h"
#include "quantize/quantize_kernel.h"

namespace mila {
namespace {

// The [..., K] input `arg` as rows x cols, or the error naming it.
template <typename Dims>
ffi::Error RowsOf(const char* op, const char* arg, const Dims& dims, int64_t element_count,
                  int64_t& rows, int64_t& cols) {
  if (dims.size() < 2) {
    return InvalidArgument(op, arg, ": expected rank >= 2 ([..., M, K]), got shape ",
                           ShapeString(dims));
  }
  cols = dims.back();
  rows = cols > 0 ? element_count / cols : 0;
  if (rows == 0 || cols == 0) {
    return InvalidArgument(op, arg, ": empty array of shape ", ShapeString(dims),
                           " is not supported");
  }
  if (cols % kQuantColsMultiple != 0) {
    return InvalidArgument(op, arg, ": K=", cols, " (last dim of ", ShapeString(dims),
                           ") must be a multiple of ", kQuantColsMultiple);
  }
  if (rows > INT32_MAX || cols > INT32_MAX) {
    return InvalidArgument(op, arg, ": ", rows, " rows of K=", cols,
                           " are not supported (at most 2^31-1 of each)");
  }
  return ffi::Error::Success();
}

// q is an AnyBuffer: the FFI header has no native C++ type for F8E4M3FN, so a typed
// Buffer<F8E4M3FN> does not compile; its dtype is checked by hand instead.
template <typename Dims>
ffi::Error CheckResults(const char* op, const char* arg, const Dims& dims, int64_t rows,
                        const ffi::AnyBuffer& q, int64_t scale_count) {
  if (q.element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(op, "q: result dtype must be float8_e4m3fn");
  }
  if (!SameDims(q.dimensions(), dims)) {
    return InvalidArgument(op, "q: result shape ", ShapeString(q.dimensions()), " must equal ",
                           arg, "'s shape ", ShapeString(dims));
  }
  if (scale_count != rows) {
    return InvalidArgument(op, "scale: result has ", scale_count,
                           " elements, expected one per row (", rows, ")");
  }
  return ffi::Error::Success();
}

int64_t ScaleCount(ffi::ResultBuffer<ffi::F32> scale) {
  return static_cast<int64_t>(scale->element_count());
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error QuantizeActivationsImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                                   ffi::Result<ffi::AnyBuffer> q,
                                   ffi::ResultBuffer<ffi::F32> scale) {
  constexpr const char* kOp = "quantize_activations";
  const auto dims = x.dimensions();
  int64_t rows = 0, cols = 0;
  if (ffi::Error e = RowsOf(kOp, "x", dims, static_cast<int64_t>(x.element_count()), rows, cols);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckResults(kOp, "x", dims, rows, *q, ScaleCount(scale)); e.failure()) return e;
  if (!Aligned16(x.untyped_data()) || !Aligned16(q->untyped_data())) {
    return InvalidArgument(kOp, "x/q: buffers must be 16-byte aligned");
  }
  const cudaError_t err = LaunchQuantizeActivations(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
      reinterpret_cast<uint8_t*>(q->untyped_data()), scale->typed_data(), rows, cols, stream);
  return CheckLaunch(kOp, err);
}

ffi::Error QuantizeGegluImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> gate,
                             ffi::Buffer<ffi::BF16> up, ffi::Result<ffi::AnyBuffer> q,
                             ffi::ResultBuffer<ffi::F32> scale) {
  constexpr const char* kOp = "quantize_geglu";
  const auto dims = gate.dimensions();
  int64_t rows = 0, cols = 0;
  if (ffi::Error e =
          RowsOf(kOp, "gate", dims, static_cast<int64_t>(gate.element_count()), rows, cols);
      e.failure()) {
    return e;
  }
  if (!SameDims(up.dimensions(), dims)) {
    return InvalidArgument(kOp, "up: shape ", ShapeString(up.dimensions()),
                           " must equal gate's shape ", ShapeString(dims));
  }
  if (ffi::Error e = CheckResults(kOp, "gate", dims, rows, *q, ScaleCount(scale)); e.failure()) return e;
  if (!Aligned16(gate.untyped_data()) || !Aligned16(up.untyped_data()) ||
      !Aligned16(q->untyped_data())) {
    return InvalidArgument(kOp, "gate/up/q: buffers must be 16-byte aligned");
  }
  const cudaError_t err = LaunchQuantizeGeglu(
      reinterpret_cast<const __nv_bfloat16*>(gate.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(up.untyped_data()),
      reinterpret_cast<uint8_t*>(q->untyped_data()), scale->typed_data(), rows, cols, stream);
  return CheckLaunch(kOp, err);
}

// A norm weight: float32 [cols].
ffi::Error CheckWeight(const char* op, const char* arg, const ffi::Buffer<ffi::F32>& w,
                       int64_t cols) {
  const auto dims = w.dimensions();
  if (dims.size() != 1 || dims[0] != cols) {
    return InvalidArgument(op, arg, ": shape ", ShapeString(dims), " must be [", cols,
                           "] (one weight per column of x)");
  }
  return ffi::Error::Success();
}

ffi::Error CheckEps(const char* op, float eps) {
  if (!(std::isfinite(eps) && eps > 0.f)) {
    return InvalidArgument(op, "eps: ", eps, " must be a finite number > 0");
  }
  return ffi::Error::Success();
}

// rms_norm_quantize: (q, scale) of bf16(rms_norm(x, norm_weight)).
ffi::Error RmsNormQuantizeImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::F32> norm_weight, ffi::Result<ffi::AnyBuffer> q,
                               ffi::ResultBuffer<ffi::F32> scale, float eps) {
  constexpr const char* kOp = "add_rms_norm_quantize";
  const auto dims = x.dimensions();
  int64_t rows = 0, cols = 0;
  if (ffi::Error e = RowsOf(kOp, "x", dims, static_cast<int64_t>(x.element_count()), rows, cols);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckWeight(kOp, "norm_weight", norm_weight, cols); e.failure()) return e;
  if (ffi::Error e = CheckEps(kOp, eps); e.failure()) return e;
  if (ffi::Error e = CheckResults(kOp, "x", dims, rows, *q, ScaleCount(scale)); e.failure()) return e;
  if (!Aligned16(x.untyped_data()) || !Aligned16(norm_weight.untyped_data()) ||
      !Aligned16(q->untyped_data())) {
    return InvalidArgument(kOp, "x/norm_weight/q: buffers must be 16-byte aligned");
  }
  const cudaError_t err = LaunchAddRmsNormQuantize(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()), nullptr, nullptr,
      norm_weight.typed_data(), eps, nullptr, reinterpret_cast<uint8_t*>(q->untyped_data()),
      scale->typed_data(), rows, cols, stream);
  return CheckLaunch(kOp, err);
}

// add_rms_norm_quantize: h = bf16(x + bf16(rms_norm(branch, branch_weight))) and (q, scale) of
// bf16(rms_norm(h, norm_weight)).
ffi::Error AddRmsNormQuantizeImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                                  ffi::Buffer<ffi::BF16> branch,
                                  ffi::Buffer<ffi::F32> branch_weight,
                                  ffi::Buffer<ffi::F32> norm_weight,
                                  ffi::ResultBuffer<ffi::BF16> h, ffi::Result<ffi::AnyBuffer> q,
                                  ffi::ResultBuffer<ffi::F32> scale, float eps) {
  constexpr const char* kOp = "add_rms_norm_quantize";
  const auto dims = x.dimensions();
  int64_t rows = 0, cols = 0;
  if (ffi::Error e = RowsOf(kOp, "x", dims, static_cast<int64_t>(x.element_count()), rows, cols);
      e.failure()) {
    return e;
  }
  if (!SameDims(branch.dimensions(), dims)) {
    return InvalidArgument(kOp, "branch: shape ", ShapeString(branch.dimensions()),
                           " must equal x's shape ", ShapeString(dims));
  }
  if (ffi::Error e = CheckWeight(kOp, "branch_weight", branch_weight, cols); e.failure()) return e;
  if (ffi::Error e = CheckWeight(kOp, "norm_weight", norm_weight, cols); e.failure()) return e;
  if (ffi::Error e = CheckEps(kOp, eps); e.failure()) return e;
  if (!SameDims(h->dimensions(), dims)) {
    return InvalidArgument(kOp, "h: result shape ", ShapeString(h->dimensions()),
                           " must equal x's shape ", ShapeString(dims));
  }
  if (ffi::Error e = CheckResults(kOp, "x", dims, rows, *q, ScaleCount(scale)); e.failure()) return e;
  if (!Aligned16(x.untyped_data()) || !Aligned16(branch.untyped_data()) ||
      !Aligned16(branch_weight.untyped_data()) || !Aligned16(norm_weight.untyped_data()) ||
      !Aligned16(h->untyped_data()) || !Aligned16(q->untyped_data())) {
    return InvalidArgument(kOp, "x/branch/branch_weight/norm_weight/h/q: buffers must be "
                                "16-byte aligned");
  }
  const cudaError_t err = LaunchAddRmsNormQuantize(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
      reinterpret_cast<const __nv_bfloat16*>(branch.untyped_data()), branch_weight.typed_data(),
      norm_weight.typed_data(), eps, reinterpret_cast<__nv_bfloat16*>(h->untyped_data()),
      reinterpret_cast<uint8_t*>(q->untyped_data()), scale->typed_data(), rows, cols, stream);
  return CheckLaunch(kOp, err);
}

}  // namespace
}  // namespace mila

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaQuantizeActivations, mila::QuantizeActivationsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaQuantizeGeglu, mila::QuantizeGegluImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // gate
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // up
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaRmsNormQuantize, mila::RmsNormQuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // norm_weight
                                  .Ret<xla::ffi::AnyBuffer>()               // q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // scale
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaAddRmsNormQuantize, mila::AddRmsNormQuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()  // branch
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // branch_weight
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // norm_weight
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()  // h
                                  .Ret<xla::ffi::AnyBuffer>()               // q
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // scale
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
