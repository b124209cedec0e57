// FFI handlers of the Hopper head-dim-512 flash attention: same binding, decoding and checks
// as jax_mila_flash_attention_d512 (common/attention_ffi.h); the kernel is flash512_sm90.cu.
// The second takes the scores' keys from V outside RoPE's rotated columns (flash512_sm90.h).
#include "common/attention_ffi.h"
#include "flash512_sm90/flash512_sm90.h"

MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD512Sm90, 512, mila::LaunchFlashAttentionD512Sm90,
                              mila::HopperPackingLimits);
MILA_DEFINE_ATTENTION_HANDLER(MilaFlashAttentionD512Sm90RotaryKeys, 512,
                              mila::LaunchFlashAttentionD512Sm90RotaryKeys,
                              mila::HopperPackingLimits);
