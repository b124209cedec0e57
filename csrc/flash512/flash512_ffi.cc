// FFI handler of the head-dim-512 flash attention: decoding and checks are shared
// with flash256 (common/attention_ffi.h); the kernel is in flash512.cu.
#include "common/attention_ffi.h"

MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD512, 512, mila::LaunchFlashAttentionD512,
                              mila::NoTargetLimits);
