// FFI handler for the activation quantizer. Validates again what the Python
// wrapper validated at trace time; every failure is an ffi::Error.
#include <cstdint>

#include "common/ffi_helpers.h"
#include "quantize/quantize_kernel.h"

namespace mila {
namespace {

constexpr const char* kOp = "quantize_activations";

// q is an AnyBuffer: the FFI header has no native C++ type for F8E4M3FN, so a typed
// Buffer<F8E4M3FN> does not compile; its dtype is checked by hand instead.
ffi::Error QuantizeActivationsImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> x,
                                   ffi::Result<ffi::AnyBuffer> q,
                                   ffi::ResultBuffer<ffi::F32> scale) {
  if (q->element_type() != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(kOp, "q: result dtype must be float8_e4m3fn");
  }
  const auto dims = x.dimensions();
  if (dims.size() < 2) {
    return InvalidArgument(kOp, "x: expected rank >= 2 ([..., M, K]), got shape ", ShapeString(dims));
  }
  const int64_t cols = dims.back();
  const int64_t rows = cols > 0 ? static_cast<int64_t>(x.element_count()) / cols : 0;
  if (rows == 0 || cols == 0) {
    return InvalidArgument(kOp, "x: empty array of shape ", ShapeString(dims), " is not supported");
  }
  if (cols % kQuantColsMultiple != 0) {
    return InvalidArgument(kOp, "x: K=", cols, " (last dim of ", ShapeString(dims),
                           ") must be a multiple of ", kQuantColsMultiple);
  }
  if (rows > INT32_MAX) {
    return InvalidArgument(kOp, "x: ", rows, " rows exceed the supported 2^31-1");
  }
  if (!SameDims(q->dimensions(), dims)) {
    return InvalidArgument(kOp, "q: result shape ", ShapeString(q->dimensions()),
                           " must equal x's shape ", ShapeString(dims));
  }
  if (static_cast<int64_t>(scale->element_count()) != rows) {
    return InvalidArgument(kOp, "scale: result has ", scale->element_count(),
                           " elements, expected one per row (", rows, ")");
  }
  const void* ptrs[] = {x.untyped_data(), q->untyped_data()};
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return InvalidArgument(kOp, "x/q: buffers must be 16-byte aligned");
    }
  }
  const cudaError_t err = LaunchQuantizeActivations(
      reinterpret_cast<const __nv_bfloat16*>(x.untyped_data()),
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
