// XLA FFI handler of the head-dim-256 flash attention (decoding and checks shared with
// flash512 in common/attention_ffi.h).
#include "common/attention_ffi.h"

MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD256, 256, mila::LaunchFlashAttentionD256);
