// XLA FFI handler of decode attention. It validates again what jax_mila/ffi/decode_attention.py
// validated at trace time (dtypes, shapes, limits, the workspace of `pieces`); every failure is
// an ffi::Error naming the argument. No allocation (the partials are results XLA allocates, which
// the wrapper drops), no host synchronization: CUDA-graph compatible.
#include <cmath>
#include <array>
#include <cstdint>

#include "common/ffi_helpers.h"
#include "decode_attention/decode_attention.h"

namespace mila {
namespace {

constexpr const char* kOp = "decode_attention";
constexpr int64_t kMaxGrid = 65535;  // B and Hkv are grid z / y

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error DecodeAttentionImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_len,
                               ffi::Result<ffi::Buffer<ffi::BF16>> o,
                               ffi::Result<ffi::Buffer<ffi::F32>> o_part,
                               ffi::Result<ffi::Buffer<ffi::F32>> ml_part, float scale,
                               int64_t window, bool ring, int64_t rotary, int64_t pieces) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) return InvalidArgument(kOp, "q: expected [B, T, Hq, D], got ", ShapeString(qd));
  if (kd.size() != 4) return InvalidArgument(kOp, "k: expected [B, S, Hkv, D], got ", ShapeString(kd));
  const auto kt = k.element_type();
  if (kt != ffi::DataType::BF16 && kt != ffi::DataType::F8E4M3FN) {
    return InvalidArgument(kOp, "k: dtype ", DTypeName(kt), " is not supported (supported: "
                           "bfloat16, float8_e4m3fn)");
  }
  if (v.element_type() != kt || !SameDims(vd, kd)) {
    return InvalidArgument(kOp, "v: must match k (", ShapeString(kd), " ", DTypeName(kt),
                           "), got ", ShapeString(vd), " ", DTypeName(v.element_type()));
  }
  const int64_t b = qd[0], t = qd[1], hq = qd[2], d = qd[3], s = kd[1], hkv = kd[2];
  if (d != 256 && d != 512) {
    return InvalidArgument(kOp, "q: head dim ", d, " is not supported (supported: 256, 512)");
  }
  if (kd[0] != b || kd[3] != d) {
    return InvalidArgument(kOp, "k: batch and head dim must match q ", ShapeString(qd), ", got ",
                           ShapeString(kd));
  }
  if (b < 1 || t < 1 || hq < 1 || s < 1 || hkv < 1) {
    return InvalidArgument(kOp, "empty q ", ShapeString(qd), " or k ", ShapeString(kd));
  }
  if (t > kDecodeMaxNewTokens) {
    return InvalidArgument(kOp, "q: T=", t, " new tokens per row; supported: 1 to ",
                           kDecodeMaxNewTokens);
  }
  if (hq % hkv != 0 || hq / hkv > kDecodeMaxGroups) {
    return InvalidArgument(kOp, "q: query heads ", hq, " must be a multiple of the KV heads ", hkv,
                           ", at most ", kDecodeMaxGroups, " per KV head");
  }
  if (b > kMaxGrid || hkv > kMaxGrid || s > INT32_MAX - 64) {
    return InvalidArgument(kOp, "sizes out of range: q ", ShapeString(qd), " k ", ShapeString(kd),
                           " (supported: B and Hkv up to ", kMaxGrid, ", S up to 2^31 - 65)");
  }
  const auto ld = kv_len.dimensions();
  if (ld.size() != 1 || ld[0] != b) {
    return InvalidArgument(kOp, "kv_len: one length per row: expected [", b, "], got ",
                           ShapeString(ld));
  }
  if (!std::isfinite(scale)) return InvalidArgument(kOp, "scale=", scale, " must be finite");
  if (window < 0 || window > INT32_MAX) {
    return InvalidArgument(kOp, "window=", window, " is out of range (0 for none, or 1 to 2^31 - 1)");
  }
  if (ring && (window == 0 || s < window + t - 1)) {
    return InvalidArgument(kOp, "ring: a ring of ", s, " slots needs a window and S >= window + "
                           "T - 1 (window ", window, ", T ", t, ")");
  }
  if (rotary < 0 || rotary > d / 2 || rotary % 16 != 0) {
    return InvalidArgument(kOp, "rotary_keys_only: ", rotary, " is not supported by the kernel "
                           "(a multiple of 16 in [0, D/2 = ", d / 2, "])");
  }
  const int64_t groups = hq / hkv, rows = t * groups;
  const int64_t row_blocks = (rows + DecodeRowsPerCta(int(rows)) - 1) / DecodeRowsPerCta(int(rows));
  if (pieces < 1 || pieces * row_blocks > INT32_MAX) {
    return InvalidArgument(kOp, "pieces=", pieces, " is out of range (1 to 2^31 / ", row_blocks, ")");
  }
  if (!SameDims(o->dimensions(), qd)) {
    return InvalidArgument(kOp, "o: shape ", ShapeString(o->dimensions()), " must equal q's ",
                           ShapeString(qd));
  }
  const std::array<int64_t, 5> want_o{b, hkv, pieces, rows, d}, want_ml{b, hkv, pieces, rows, 2};
  if (!SameDims(o_part->dimensions(), want_o) || !SameDims(ml_part->dimensions(), want_ml)) {
    return InvalidArgument(kOp, "workspace: expected o_part ", ShapeString(want_o), " and ml_part ",
                           ShapeString(want_ml), " for pieces=", pieces, ", got ",
                           ShapeString(o_part->dimensions()), " and ",
                           ShapeString(ml_part->dimensions()));
  }
  if (!Aligned16(q.untyped_data()) || !Aligned16(k.untyped_data()) ||
      !Aligned16(v.untyped_data()) || !Aligned16(o->untyped_data()) ||
      !Aligned16(o_part->untyped_data()) || !Aligned16(ml_part->untyped_data())) {
    return InvalidArgument(kOp, "buffers must be 16-byte aligned");
  }

  DecodeAttentionParams p{};
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.untyped_data());
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.kv_len = kv_len.typed_data();
  p.o = reinterpret_cast<__nv_bfloat16*>(o->untyped_data());
  p.o_part = o_part->typed_data();
  p.ml_part = ml_part->typed_data();
  p.batch = int(b);
  p.t = int(t);
  p.hq = int(hq);
  p.hkv = int(hkv);
  p.s = int(s);
  p.d = int(d);
  p.groups = int(groups);
  p.rows = int(rows);
  p.pieces = int(pieces);
  p.rotary = int(rotary);
  p.scale = scale;
  p.window = int(window);
  p.ring = ring;
  p.fp8 = kt == ffi::DataType::F8E4M3FN;
  const cudaError_t launched = LaunchDecodeAttention(p, stream);
  if (launched == cudaErrorInvalidValue) {
    return Unimplemented(kOp, "no configuration of the kernel fits this device's shared memory");
  }
  return CheckLaunch(kOp, launched);
}

}  // namespace
}  // namespace mila

// args q (bf16), k, v (bf16 or float8_e4m3fn), kv_len (int32 [B]);
// rets o (bf16, q's shape), o_part (f32 [B, Hkv, pieces, M, D]), ml_part (f32 [.., M, 2]);
// attrs scale (f32), window (i64, 0 = none), ring (bool), rotary (i64: K columns of the scores,
// D/2 = all), pieces (i64).
XLA_FFI_DEFINE_HANDLER_SYMBOL(MilaDecodeAttention, mila::DecodeAttentionImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::BF16>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("ring")
                                  .Attr<int64_t>("rotary")
                                  .Attr<int64_t>("pieces"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
