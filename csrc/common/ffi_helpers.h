// Shared plumbing for the FFI handlers: argument checks that return ffi::Error
// (never throw), and the launch check every handler runs after its kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace mila {

namespace ffi = xla::ffi;

// Message building without iostreams: inside an FFI handler the C++ runtime's locale
// may not be initialised for our module (an ostringstream << long segfaulted there), so
// messages are assembled from std::string, std::to_string and snprintf only.
inline void AppendPart(std::string& s, const std::string& v) { s += v; }
inline void AppendPart(std::string& s, const char* v) { s += v; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void AppendPart(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    s += v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<T>) {
    // %g, not std::to_string's %f: an eps of 1e-7 reads "1e-07", not "0.000000".
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    s += buf;
  } else {
    s += std::to_string(v);
  }
}

// The NumPy name of an FFI dtype, for messages ("float8_e4m3fn", not an enum number).
inline std::string DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "FFI dtype " + std::to_string(static_cast<int>(t));
  }
}

template <typename... Parts>
std::string Concat(const Parts&... parts) {
  std::string s;
  (AppendPart(s, parts), ...);
  return s;
}

// An InvalidArgument error whose message names the op and the argument, e.g.
// "jax_mila.quantize_activations: x: K=30 must be a multiple of 16".
template <typename... Parts>
ffi::Error InvalidArgument(const char* op, const Parts&... parts) {
  return ffi::Error::InvalidArgument(Concat("jax_mila.", op, ": ", parts...));
}

template <typename... Parts>
ffi::Error Unimplemented(const char* op, const Parts&... parts) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, Concat("jax_mila.", op, ": ", parts...));
}

template <typename Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

template <typename DimsA, typename DimsB>
bool SameDims(const DimsA& a, const DimsB& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// Every launch is followed by this: a bad configuration surfaces as an XLA
// runtime error naming the kernel, not as a silent no-op.
inline ffi::Error CheckLaunch(const char* op, cudaError_t launch_status = cudaSuccess) {
  cudaError_t err = launch_status != cudaSuccess ? launch_status : cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_mila.") + op +
                                ": CUDA launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// Compute capability of the device that owns `stream`'s current context, as 10*major+minor.
inline int CurrentComputeCapability() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return 10 * major + minor;
}

}  // namespace mila
