// One reused buffer per stream for the dense K/V of a routed prefill layer.
//
// A prefill layer routed to MLX's fused attention (prefill_route.h) needs its
// K and V dequantized: an O(N * D) copy of one layer. mx::dequantize would
// make a fresh one per layer, and MLX's GPU backends keep every kernel's
// inputs until the command buffer (Metal) or CUDA graph that ran it
// completes, with several in flight: at 128k tokens on an 8B model (0.5 GB
// per layer) tens of layers' copies were alive at once. So on CUDA and Metal
// every layer writes into the same two buffers (dequantize_into), each write
// ordered after the previous routed attention, the last reader of their
// contents.
//
// The buffers grow geometrically with the context and are dropped at the
// next decode-sized quantized_sdpa on the same stream (release), so a
// generation does not keep a layer's worth of dense K/V after its prefill.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>

#include "mlx/ops.h"

namespace mlxq {

namespace mx = mlx::core;

namespace workspace {

// K and V dequantized into `s`'s workspace buffers, after the previous routed
// attention on the stream. Pair with note_reader.
std::pair<mx::array, mx::array> dequantize_kv(
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    mx::Dtype dtype,
    mx::Stream s);

// `out` read this stream's workspace: the next write waits for it.
void note_reader(mx::Stream s, const mx::array& out);

// Drops the workspaces of `s`; their memory returns once in-flight work is
// done.
void release(mx::Stream s);
void release_all();

// Bytes of workspace held by one stream, or by all.
size_t held_bytes(std::optional<mx::Stream> s = std::nullopt);

} // namespace workspace

} // namespace mlxq
