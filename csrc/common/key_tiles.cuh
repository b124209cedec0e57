// The key tiles one CTA of a flash-attention kernel visits, over a key buffer cut into
// segments (AttentionParams::kv_segments, common/attention_params.h).
//
// The buffer's S keys are kv_segments equal segments of L = S / kv_segments slots; slot
// seg * L + j holds position kv_offset[seg] + j. One segment is the plain contract (key j at
// *kv_offset + j). Several serve context parallelism: a device's share of a position-sharded
// cache is its segments side by side, and one call attends to all of them (one launch and no
// merge of per-segment partials, jax_mila/parallel/chunked.py).
//
// Per segment, the tiles that hold a key some row of [qpos_min, qpos_max] may see (causal:
// position <= qpos_max; window W: position > qpos_min - W) form one range; the cursor walks
// those ranges segment after segment, so producer and consumers of a CTA, which walk the
// same cursor, agree on every tile's index. A tile never spans two segments: the last tile
// of a segment reaches past its end (into the next segment's slots, or past S where loads
// zero-fill), and keys_left() says how many of its keys belong to it.
#pragma once

#include <cstdint>

#include "common/attention_params.h"

namespace mila {

template <int kBlockN>
struct KeyTileCursor {
  const int32_t* starts;  // kv_offset: one position per segment
  int segments, seg_len;
  int64_t qpos_min, qpos_max;
  bool causal;
  int window;
  // The current tile: tile index `tile` of segment `seg` (valid() while seg < segments).
  int seg, tile, tile_end;
  int64_t seg_start;

  __device__ __forceinline__ KeyTileCursor(const AttentionParams& p, int64_t qmin, int64_t qmax)
      : starts(p.kv_offset), segments(p.kv_segments), seg_len(p.s / p.kv_segments),
        qpos_min(qmin), qpos_max(qmax), causal(p.causal), window(p.window), seg(-1), tile(0),
        tile_end(0), seg_start(0) {
    NextSegment();
  }

  __device__ __forceinline__ bool valid() const { return seg < segments; }
  // Slot of the tile's first key (the row a TMA box or cp.async starts at).
  __device__ __forceinline__ int n0() const { return seg * seg_len + tile * kBlockN; }
  // Position of that key; key n0 + j sits at kpos0() + j for j < keys_left().
  __device__ __forceinline__ int64_t kpos0() const { return seg_start + int64_t(tile) * kBlockN; }
  __device__ __forceinline__ int keys_left() const { return seg_len - tile * kBlockN; }

  __device__ __forceinline__ void Advance() {
    if (++tile >= tile_end) NextSegment();
  }

 private:
  __device__ __forceinline__ void NextSegment() {
    while (++seg < segments) {
      seg_start = starts[seg];
      // Key range of the segment relative to its first slot: [lo, hi) = its keys up to the
      // span's latest row (causal), from its earliest row's window start (window).
      int64_t lo = 0, hi = seg_len;
      if (causal) hi = hi < qpos_max - seg_start + 1 ? hi : qpos_max - seg_start + 1;
      if (window > 0)
        lo = lo > qpos_min - window + 1 - seg_start ? lo : qpos_min - window + 1 - seg_start;
      if (hi > lo) {
        tile = static_cast<int>(lo / kBlockN);
        tile_end = static_cast<int>((hi + kBlockN - 1) / kBlockN);
        return;
      }
    }
  }
};

}  // namespace mila
