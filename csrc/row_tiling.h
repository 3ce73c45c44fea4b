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
//
// Splits are sized from N rounded up to a whole key class (kKeyClass keys,
// a cache's growth step) and counted over that class: a decode step over a
// cache's whole buffer with its unwritten tail masked (compiled decode,
// mlxq.compiled) then cuts the written keys exactly as a step over those
// keys alone, and the masked splits add exact zeros, so both give the same
// bits. Splits past N are empty (every kernel already skips empty causal
// splits).
#pragma once

#include <algorithm>

namespace mlxq {

constexpr int kKeyClass = 256;

// N rounded up to a whole key class (at least one class).
inline int key_class(int N) {
  return std::max(1, (N + kKeyClass - 1) / kKeyClass) * kKeyClass;
}

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
  const int n_class = key_class(N);
  int splits = 1;
  if (units > 0 && units < want_tasks) {
    splits = static_cast<int>((want_tasks + units - 1) / units);
    splits = std::min(splits, std::max(1, n_class / min_split_keys));
  }
  int keys = (n_class + splits - 1) / splits;
  keys = (keys + key_multiple - 1) / key_multiple * key_multiple;
  p.split_keys = std::max(key_multiple, keys);
  p.splits = std::max(1, (n_class + p.split_keys - 1) / p.split_keys);
  return p;
}

} // namespace mlxq
