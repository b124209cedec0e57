// XLA FFI handler of the head-dim-256 flash attention (decoding and checks shared with
// flash512 in common/attention_ffi.h).
#include "common/attention_ffi.h"

namespace {

// The kernel's grid y holds its blocks of 64 (sm_86, sm_89) or 128 query rows (flash256.cu).
constexpr int64_t kMaxQueries = 65535LL * 64;

xla::ffi::Error Flash256Limits(const mila::AttentionParams& p) {
  if (p.t > kMaxQueries) {
    return mila::InvalidArgument(mila::kAttentionOp, "q: T=", p.t, " queries are more than "
                                 "this kernel takes (at most ", kMaxQueries, ")");
  }
  return xla::ffi::Error::Success();
}

}  // namespace

MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD256, 256, mila::LaunchFlashAttentionD256,
                              Flash256Limits);
