// How a QuantizedSDPA problem's rows and keys are cut into tasks, shared by
// the CPU task plan and CUDA's plan (csrc/cuda/sdpa/plan.cpp); the Metal plan
// in csrc/metal/dispatch.cpp has its own limits.
//
// The rep * L rows of one KV head (query heads x positions) go in tiles of at
// most `max_rows`, so each K/V row is unpacked once per tile for all of them.
// Keys are split only while batch x KV heads x row tiles is below
// `want_tasks` (decode: few KV heads), in pieces of at least `min_split_keys`
// keys rounded up to a multiple of `key_multiple`; each split then writes a
// partial that a log-sum-exp pass merges.
#pragma once

#include <algorithm>

namespace mlxq {

struct RowTiling {
  int rows;
  int row_tile;
  int row_tiles;
  int splits;
  int split_keys;
};

inline RowTiling plan_row_tiles(
    int B,
    int Hkv,
    int rep,
    int L,
    int N,
    int max_rows,
    long want_tasks,
    int min_split_keys,
    int key_multiple) {
  RowTiling p{};
  p.rows = rep * L;
  const int tiles = (p.rows + max_rows - 1) / max_rows;
  p.row_tile = std::max(1, (p.rows + tiles - 1) / std::max(1, tiles));
  p.row_tiles = (p.rows + p.row_tile - 1) / p.row_tile;
  const long units = long(B) * Hkv * p.row_tiles;
  int splits = 1;
  if (units > 0 && units < want_tasks) {
    splits = static_cast<int>((want_tasks + units - 1) / units);
    splits = std::min(splits, std::max(1, N / min_split_keys));
  }
  int keys = (N + splits - 1) / splits;
  keys = (keys + key_multiple - 1) / key_multiple * key_multiple;
  p.split_keys = std::max(key_multiple, keys);
  p.splits = std::max(1, (N + p.split_keys - 1) / p.split_keys);
  return p;
}

} // namespace mlxq
