// MXFP4 weights -> e4m3 [N, Kp] in natural K order, for the kernels that take the weights as a
// shared-memory wgmma operand (kWgmmaWsE4m3*). Each value is the byte the register-operand
// kernels build from the same word (word_to_e4m3: the block exponent folded into the e4m3
// exponent relative to the channel's, exact for every block the quantizer writes), so both
// paths multiply the same FP8 products. Memory-bound: reads 0.53 and writes 1 byte a weight.
//
// Thread layout: one thread per (weight row, K tile, block kb). Its block's 32 codes sit in
// four words, one in each quad column's 16 bytes of the row's 64-byte tile (word kb of each:
// codes k 4q..4q+3 and 16+4q..16+4q+3 of quad q, w4a8.cu's kernel order), and become 32
// contiguous e4m3 bytes: two 16-byte stores. Four consecutive threads cover a row's tile, so
// a warp reads 512 contiguous packed bytes and writes 1 KiB.
#include <cstdint>

#include "w4a8/w4a8_convert.cuh"
#include "w4a8/w4a8_kernel.h"

namespace mila {
namespace {

constexpr int kExpandThreads = 256;

__global__ void __launch_bounds__(kExpandThreads)
    w4a8_expand_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales,
                       const uint8_t* __restrict__ channel_exp, uint8_t* __restrict__ out,
                       int n, int kp) {
  const int blocks_per_row = kp / 32;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  if (i >= static_cast<int64_t>(n) * blocks_per_row) return;
  const int row = static_cast<int>(i / blocks_per_row);
  const int b = static_cast<int>(i - static_cast<int64_t>(row) * blocks_per_row);
  const int kt = b / kKBlocks, kb = b % kKBlocks;
  const RowLut lut = row_lut(channel_exp[row]);
  const uint32_t block_exp = scales[i];
  const uint8_t* tile = packed + static_cast<int64_t>(row) * (kp / 2) + kt * kPackedTile;
  uint32_t lo[4], hi[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(tile + 16 * q + 4 * kb);
    word_to_e4m3(word, block_exp, lut, lo[q], hi[q]);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * kp + 32 * b);
  dst[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);  // k 0..15 of the block
  dst[1] = make_uint4(hi[0], hi[1], hi[2], hi[3]);  // k 16..31
}

}  // namespace

cudaError_t LaunchW4A8ExpandWeights(const W4A8Args& args, uint8_t* out, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(args.n) * (args.kp / 32);
  const int64_t blocks = (threads + kExpandThreads - 1) / kExpandThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  w4a8_expand_kernel<<<static_cast<unsigned>(blocks), kExpandThreads, 0, stream>>>(
      args.packed, args.scales, args.channel_exp, out, args.n, args.kp);
  return cudaGetLastError();
}

}  // namespace mila
