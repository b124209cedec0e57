// The nanobind extension: exposes every FFI handler as a capsule in
// registrations(), for jax.ffi.register_ffi_target(..., platform="CUDA").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

// Handlers, defined next to their kernels (csrc/<family>/*_ffi.cc). CMake defines
// MILA_WITH_<FAMILY> for each kernel family it builds (JAX_MILA_KERNELS).
#ifdef MILA_WITH_QUANTIZE
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaQuantizeActivations);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaQuantizeGeglu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaRmsNormQuantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaAddRmsNormQuantize);
#endif
#ifdef MILA_WITH_NORM_ROPE
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaRmsNormRope);
#endif
#ifdef MILA_WITH_FLASH256
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaFlashAttentionD256);
#endif
#ifdef MILA_WITH_FLASH512
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaFlashAttentionD512);
#endif
#ifdef MILA_WITH_W4A8
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaW4A8Matmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaGroupedW4A8Matmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaW4A8Gemv);
#endif
#ifdef MILA_WITH_DECODE_ATTENTION
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaDecodeAttention);
#endif
#ifdef MILA_WITH_FLASH512_SM90
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaFlashAttentionD512Sm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaFlashAttentionD512Sm90RotaryKeys);
#endif
#ifdef MILA_WITH_FLASH256_SM90
XLA_FFI_DECLARE_HANDLER_SYMBOL(MilaFlashAttentionD256Sm90);
#endif

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_mila_cuda, m) {
  m.doc() = "jax_mila CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict targets;
#ifdef MILA_WITH_QUANTIZE
    targets["jax_mila_quantize_activations"] = EncapsulateFfiHandler(MilaQuantizeActivations);
    targets["jax_mila_quantize_geglu"] = EncapsulateFfiHandler(MilaQuantizeGeglu);
    targets["jax_mila_rms_norm_quantize"] = EncapsulateFfiHandler(MilaRmsNormQuantize);
    targets["jax_mila_add_rms_norm_quantize"] = EncapsulateFfiHandler(MilaAddRmsNormQuantize);
#endif
#ifdef MILA_WITH_NORM_ROPE
    targets["jax_mila_rms_norm_rope"] = EncapsulateFfiHandler(MilaRmsNormRope);
#endif
#ifdef MILA_WITH_FLASH256
    targets["jax_mila_flash_attention_d256"] = EncapsulateFfiHandler(MilaFlashAttentionD256);
#endif
#ifdef MILA_WITH_FLASH512
    targets["jax_mila_flash_attention_d512"] = EncapsulateFfiHandler(MilaFlashAttentionD512);
#endif
#ifdef MILA_WITH_W4A8
    targets["jax_mila_w4a8_matmul"] = EncapsulateFfiHandler(MilaW4A8Matmul);
    targets["jax_mila_grouped_w4a8_matmul"] = EncapsulateFfiHandler(MilaGroupedW4A8Matmul);
    targets["jax_mila_w4a8_gemv"] = EncapsulateFfiHandler(MilaW4A8Gemv);
#endif
#ifdef MILA_WITH_DECODE_ATTENTION
    targets["jax_mila_decode_attention"] = EncapsulateFfiHandler(MilaDecodeAttention);
#endif
#ifdef MILA_WITH_FLASH512_SM90
    targets["jax_mila_flash_attention_d512_sm90"] =
        EncapsulateFfiHandler(MilaFlashAttentionD512Sm90);
    targets["jax_mila_flash_attention_d512_sm90_rotary_keys"] =
        EncapsulateFfiHandler(MilaFlashAttentionD512Sm90RotaryKeys);
#endif
#ifdef MILA_WITH_FLASH256_SM90
    targets["jax_mila_flash_attention_d256_sm90"] =
        EncapsulateFfiHandler(MilaFlashAttentionD256Sm90);
#endif
    return targets;
  });
  m.def("build_info", []() {
    nb::dict info;
    info["cuda_archs"] = JAX_MILA_CUDA_ARCHS;
    info["cuda_version"] = JAX_MILA_CUDA_VERSION;
    info["kernels"] = JAX_MILA_KERNELS;
    return info;
  });
}
