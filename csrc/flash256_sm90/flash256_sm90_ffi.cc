// FFI handler of the Hopper head-dim-256 flash attention: same binding, decoding and checks
// as jax_mila_flash_attention_d256 (common/attention_ffi.h); the kernel is flash256_sm90.cu.
#include "common/attention_ffi.h"
#include "flash256_sm90/flash256_sm90.h"

MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD256Sm90, 256, mila::LaunchFlashAttentionD256Sm90,
                              mila::HopperPackingLimits);
