// Decoding and validation shared by the flash-attention FFI handlers. Both head
// dims bind the same operands, so the C++ checks mirror jax_mila/ffi/attention.py
// in one place.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention_params.h"
#include "common/ffi_helpers.h"

namespace mila {

constexpr const char* kAttentionOp = "flash_attention";
constexpr int kMaxGroups = 16;  // query heads per KV head
// CUDA grid limits: B and Hkv are grid y/z dimensions of some kernels.
constexpr int64_t kMaxBatch = 65535;
constexpr int64_t kMaxKvHeads = 65535;

// Fills `p` from the FFI buffers of a call with head dim `d`, or returns the error.
inline ffi::Error DecodeAttention(int d, ffi::Buffer<ffi::BF16> q, ffi::Buffer<ffi::BF16> k,
                                  ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> q_offset,
                                  ffi::Buffer<ffi::S32> kv_offset,
                                  ffi::Result<ffi::Buffer<ffi::BF16>>& o,
                                  ffi::Result<ffi::Buffer<ffi::F32>>& lse, float scale,
                                  bool causal, int64_t window, AttentionParams& p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) return InvalidArgument(kAttentionOp, "q: expected [B, T, Hq, D], got ", ShapeString(qd));
  if (kd.size() != 4) return InvalidArgument(kAttentionOp, "k: expected [B, S, Hkv, D], got ", ShapeString(kd));
  if (!SameDims(vd, kd)) {
    return InvalidArgument(kAttentionOp, "v: shape ", ShapeString(vd), " must equal k's ", ShapeString(kd));
  }
  if (qd[3] != d || kd[3] != d) {
    return InvalidArgument(kAttentionOp, "head dim: this kernel takes D=", d, ", got q ",
                           ShapeString(qd), " k ", ShapeString(kd));
  }
  if (qd[0] != kd[0]) {
    return InvalidArgument(kAttentionOp, "batch: q has ", qd[0], ", k has ", kd[0]);
  }
  const int64_t hq = qd[2], hkv = kd[2];
  if (hq <= 0 || hkv <= 0 || hq % hkv != 0 || hq / hkv > kMaxGroups) {
    return InvalidArgument(kAttentionOp, "heads: Hq=", hq, " must be a multiple of Hkv=", hkv,
                           " with at most ", kMaxGroups, " query heads per KV head");
  }
  if (qd[0] == 0 || qd[1] == 0 || kd[1] == 0) {
    return InvalidArgument(kAttentionOp, "empty q ", ShapeString(qd), " or k ", ShapeString(kd));
  }
  if (qd[1] > INT32_MAX || kd[1] > INT32_MAX || qd[0] > kMaxBatch || hkv > kMaxKvHeads) {
    return InvalidArgument(kAttentionOp, "sizes out of range: q ", ShapeString(qd), " k ",
                           ShapeString(kd), " (supported: T and S up to 2^31-1, B up to ",
                           kMaxBatch, ", Hkv up to ", kMaxKvHeads, ")");
  }
  // The kernels index the packed rows (position x query head of one KV head) in int32.
  if (qd[1] * (hq / hkv) > INT32_MAX) {
    return InvalidArgument(kAttentionOp, "q: T * Hq / Hkv = ", qd[1] * (hq / hkv),
                           " packed rows per KV head exceed INT32_MAX; got q ", ShapeString(qd),
                           " k ", ShapeString(kd));
  }
  if (q_offset.element_count() != 1) {
    return InvalidArgument(kAttentionOp, "q_offset must be an int32 scalar, got ",
                           ShapeString(q_offset.dimensions()));
  }
  // kv_offset: one start position per key segment (attention_params.h); head dim 512 only.
  const int64_t segments = static_cast<int64_t>(kv_offset.element_count());
  if (kv_offset.dimensions().size() > 1 || segments < 1 || kd[1] % segments != 0 ||
      (segments > 1 && d != 512)) {
    return InvalidArgument(kAttentionOp, "kv_offset: expected an int32 scalar, or (head dim "
                           "512) a vector of N segment starts with N dividing S=", kd[1],
                           "; got ", ShapeString(kv_offset.dimensions()), " at head dim ", d);
  }
  if (window < 0 || window > INT32_MAX) {
    return InvalidArgument(kAttentionOp, "window=", window, " is out of range (supported: 0 for "
                           "none, or 1 to 2^31-1)");
  }
  if (window > 0 && !causal) {
    return InvalidArgument(kAttentionOp, "window=", window, ": a sliding window needs causal=True");
  }
  if (!std::isfinite(scale)) {
    return InvalidArgument(kAttentionOp, "scale=", scale, " must be finite");
  }
  if (!SameDims(o->dimensions(), qd)) {
    return InvalidArgument(kAttentionOp, "o: result shape ", ShapeString(o->dimensions()),
                           " must equal q's ", ShapeString(qd));
  }
  const auto ld = lse->dimensions();
  if (ld.size() != 3 || ld[0] != qd[0] || ld[1] != hq || ld[2] != qd[1]) {
    return InvalidArgument(kAttentionOp, "lse: result shape ", ShapeString(ld), " must be [B, Hq, T]");
  }
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.untyped_data());
  p.k = reinterpret_cast<const __nv_bfloat16*>(k.untyped_data());
  p.v = reinterpret_cast<const __nv_bfloat16*>(v.untyped_data());
  p.o = reinterpret_cast<__nv_bfloat16*>(o->untyped_data());
  p.lse = lse->typed_data();
  p.q_offset = q_offset.typed_data();
  p.kv_offset = kv_offset.typed_data();
  p.kv_segments = static_cast<int>(segments);
  p.batch = static_cast<int>(qd[0]);
  p.t = static_cast<int>(qd[1]);
  p.s = static_cast<int>(kd[1]);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.scale = scale;
  p.causal = causal;
  p.window = static_cast<int>(window);
  return ffi::Error::Success();
}

// The binding both head dims use:
//   args q, k, v (bf16), q_offset (int32 scalar), kv_offset (int32 scalar or [N] segments);
//   rets o (bf16, q's shape), lse (f32 [B, Hq, T]);
//   attrs scale (f32), causal (bool), window (i64, 0 = none).
#define MILA_ATTENTION_BINDING()                                   \
  xla::ffi::Ffi::Bind()                                            \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()               \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()                     \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()                     \
      .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()                     \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                      \
      .Arg<xla::ffi::Buffer<xla::ffi::S32>>()                      \
      .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()                     \
      .Ret<xla::ffi::Buffer<xla::ffi::F32>>()                      \
      .Attr<float>("scale")                                        \
      .Attr<bool>("causal")                                        \
      .Attr<int64_t>("window")

// A target's own limits beyond DecodeAttention's (its grid, its tile shapes).
inline ffi::Error NoTargetLimits(const AttentionParams&) { return ffi::Error::Success(); }

// The Hopper kernels pack the G = Hq / Hkv query heads of a KV head into 64-row tiles.
inline ffi::Error HopperPackingLimits(const AttentionParams& p) {
  const int g = p.hq / p.hkv;
  if (64 % g != 0) {
    return InvalidArgument(kAttentionOp, "heads: Hq / Hkv = ", g, " query heads per KV head; "
                           "the Hopper kernels need a divisor of 64 (1, 2, 4, 8 or 16)");
  }
  return ffi::Error::Success();
}

// Defines the handler symbol `Name` for head dim `D`, launching `Launch(params, stream)` once
// DecodeAttention and `Limits(params)` accept the call.
#define MILA_DEFINE_ATTENTION_HANDLER(Name, D, Launch, Limits)                                \
  static xla::ffi::Error Name##Impl(                                                          \
      cudaStream_t stream, xla::ffi::Buffer<xla::ffi::BF16> q,                                \
      xla::ffi::Buffer<xla::ffi::BF16> k, xla::ffi::Buffer<xla::ffi::BF16> v,                 \
      xla::ffi::Buffer<xla::ffi::S32> q_offset, xla::ffi::Buffer<xla::ffi::S32> kv_offset,    \
      xla::ffi::Result<xla::ffi::Buffer<xla::ffi::BF16>> o,                                   \
      xla::ffi::Result<xla::ffi::Buffer<xla::ffi::F32>> lse, float scale, bool causal,        \
      int64_t window) {                                                                       \
    mila::AttentionParams p{};                                                                \
    if (auto err = mila::DecodeAttention(D, q, k, v, q_offset, kv_offset, o, lse, scale,      \
                                         causal, window, p);                                  \
        err.failure()) {                                                                      \
      return err;                                                                             \
    }                                                                                         \
    if (auto err = Limits(p); err.failure()) return err;                                      \
    return mila::CheckLaunch(mila::kAttentionOp, Launch(p, stream));                          \
  }                                                                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, Name##Impl, MILA_ATTENTION_BINDING(),                   \
                                {xla::ffi::Traits::kCmdBufferCompatible})

}  // namespace mila
