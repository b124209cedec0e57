// The key tiles a block of query rows visits, and the masks inside them, for every
// flash-attention kernel (flash256/, flash512/, flash256_sm90/, flash512_sm90/).
//
// The key buffer's S keys are kv_segments equal segments of L = S / kv_segments slots; slot
// seg * L + j holds position kv_offset[seg] + j (AttentionParams, common/attention_params.h).
// One segment is the plain contract (key j at *kv_offset + j). Several serve context
// parallelism: a device's share of a position-sharded cache is its segments side by side, and
// one call attends to all of them (one launch and no merge of per-segment partials).
//
// Per segment, the tiles that hold a key some row of [qpos_min, qpos_max] may see (causal:
// position <= qpos_max; window W: position > qpos_min - W) form one range (SegmentKeyRange).
// KeyTileCursor walks those ranges segment after segment, so the roles of a CTA that walk the
// same cursor agree on every tile's index. A tile never spans two segments: the last tile of a
// segment reaches past its end (into the next segment's slots, or past S where loads
// zero-fill), and keys_left() says how many of its keys belong to it.
//
// Masks: a tile that crosses the causal diagonal or the window's far edge of some row, or that
// runs past its segment, is masked element by element (MaskedTiles says which tiles, MaskTile
// does it on a wgmma accumulator fragment); the others need no test.
#pragma once

#include <cstdint>

#include "common/attention_params.h"
#include "common/softmax_fragments.cuh"

namespace mila {

// Key tiles [lo, hi) of kBlockN keys each.
struct KeyTileRange {
  int lo, hi;
  __device__ __forceinline__ bool empty() const { return hi <= lo; }
};

// The tiles that hold keys [lo, hi) of a segment (lo < hi).
template <int kBlockN>
__device__ __forceinline__ KeyTileRange TilesOfKeys(int64_t lo, int64_t hi) {
  return {static_cast<int>(lo / kBlockN), static_cast<int>((hi + kBlockN - 1) / kBlockN)};
}

// The keys of one segment (seg_len slots from position seg_start) that some row at positions
// [qpos_min, qpos_max] may see: slots [lo, hi) of the segment, none when hi <= lo (causal: up
// to the latest row; window: from the earliest row's window start).
__device__ __forceinline__ void SegmentKeyRange(int seg_len, int64_t seg_start, int64_t qpos_min,
                                                int64_t qpos_max, bool causal, int window,
                                                int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = seg_len;
  if (causal) hi = hi < qpos_max - seg_start + 1 ? hi : qpos_max - seg_start + 1;
  if (window > 0)
    lo = lo > qpos_min - window + 1 - seg_start ? lo : qpos_min - window + 1 - seg_start;
}

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
      int64_t lo, hi;
      SegmentKeyRange(seg_len, seg_start, qpos_min, qpos_max, causal, window, lo, hi);
      if (hi > lo) {
        const KeyTileRange r = TilesOfKeys<kBlockN>(lo, hi);
        tile = r.lo;
        tile_end = r.hi;
        return;
      }
    }
  }
};

// Which key tiles need the element-wise mask for rows at positions [qpos_min, qpos_max]: a tile
// whose keys sit at kpos0 .. kpos0 + kBlockN - 1 needs it when its last key comes after the
// first row (causal), when its first key is out of the last row's window, or when fewer than
// kBlockN of its keys belong to its segment.
template <int kBlockN>
struct MaskedTiles {
  int64_t causal_from;   // kpos0 >= causal_from: crosses the first row's diagonal
  int64_t window_until;  // kpos0 <= window_until: reaches below the last row's window

  __device__ __forceinline__ MaskedTiles(int64_t qpos_min, int64_t qpos_max, bool causal,
                                         int window)
      : causal_from(causal ? qpos_min - (kBlockN - 2) : INT64_MAX),
        window_until(window > 0 ? qpos_max - window : INT64_MIN) {}

  __device__ __forceinline__ bool operator()(int64_t kpos0, int keys_left) const {
    return keys_left < kBlockN || kpos0 >= causal_from || kpos0 <= window_until;
  }
};

// The element-wise mask on accumulator elements [kFirst, kFirst + kCount) of a 64-key tile of
// scores (an m64n64 wgmma fragment, common/softmax_fragments.cuh: element e holds row
// (e >> 1) & 1, key 8 (e >> 2) + 2 t4 + (e & 1) of the tile): -inf where the key is not visible.
// dist[r] = position of the thread's row r minus the position of the tile's first key;
// keys_left of the tile's keys belong to its segment. Each row's visible keys form one interval
// [lo, hi] of the tile, bounded in int64 and then clamped into [-1, 64], so the per-element
// tests are int32.
template <int kFirst = 0, int kCount = 32>
__device__ __forceinline__ void MaskTile(float (&s)[32], int t4, const int64_t (&dist)[2],
                                         int keys_left, bool causal, int window) {
  constexpr int kTileKeys = 64;
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int64_t l = 0, u = static_cast<int64_t>(keys_left) - 1;
    if (causal) u = u < dist[r] ? u : dist[r];
    if (window > 0) l = dist[r] - window + 1 > 0 ? dist[r] - window + 1 : 0;
    lo[r] = static_cast<int>(l < kTileKeys ? l : kTileKeys);
    hi[r] = static_cast<int>(u < -1 ? -1 : u < kTileKeys ? u : kTileKeys);
  }
#pragma unroll
  for (int e = kFirst; e < kFirst + kCount; ++e) {
    const int kofs = 8 * (e >> 2) + 2 * t4 + (e & 1);  // key - the tile's first key
    const int r = (e >> 1) & 1;
    if (kofs < lo[r] || kofs > hi[r]) s[e] = softmax_fragments::NegInf();
  }
}

}  // namespace mila
