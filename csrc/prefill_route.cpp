#include "prefill_route.h"

#include <atomic>
#include <mutex>

#include "mlx/fast.h"

#include "environment.h"
#include "prefill_workspace.h"
#include "prefix_view.h"
#include "ring_update.h"

namespace mlxq {

namespace {

constexpr int kCudaMaxHeadDim = 128; // cuDNN SDPA: multiples of 8, at most 128
constexpr int kMetalFullHeadDims[] = {64, 80, 128}; // MLX's Metal full attention, L > 8

bool is_half(mx::Dtype t) {
  return t == mx::float16 || t == mx::bfloat16;
}

std::mutex counts_mutex;
std::map<std::string, int> route_counts;

void note_route(const char* name) {
  std::lock_guard<std::mutex> lock(counts_mutex);
  ++route_counts[name];
}

} // namespace

bool mlx_has_fused_attention(GpuBackend backend, const PrefillProblem& p) {
  if (!is_half(p.dtype) || p.L <= 8) {
    return false;
  }
  if (p.mask == kMaskCausal && p.L > p.N) { // neither backend aligns causal with L > N
    return false;
  }
  switch (backend) {
    case GpuBackend::Cuda:
      return p.Dk % 8 == 0 && p.Dv % 8 == 0 && p.Dk <= kCudaMaxHeadDim && p.Dv <= kCudaMaxHeadDim;
    case GpuBackend::Metal:
      if (p.Dk != p.Dv) {
        return false;
      }
      for (int d : kMetalFullHeadDims) {
        if (p.Dk == d) {
          return true;
        }
      }
      return false;
    case GpuBackend::None:
      return false;
  }
  return false;
}

bool route_to_mx_fast(GpuBackend backend, const PrefillProblem& p) {
  if (!environment().dequantized_prefill || backend == GpuBackend::None) {
    return false;
  }
  // Half-precision queries and causal masks with L <= N: mlx_has_fused_attention.
  if (p.scales_dtype != p.dtype || p.mask == kMaskArray) {
    return false;
  }
  if (p.sinks_dtype && *p.sinks_dtype != p.dtype) {
    return false;
  }
  if (p.L * (p.Hq / std::max(p.Hkv, 1)) < kMinRoutedQueryRows) {
    return false;
  }
  return mlx_has_fused_attention(backend, p);
}

std::optional<mx::array> routed_prefill(
    const mx::array& q,
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const PrefillProblem& p,
    float scale,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    const std::optional<mx::array>& sinks,
    mx::Stream s,
    const std::optional<ExactRows>& exact) {
  GpuBackend backend = s.device == mx::Device::gpu ? gpu_backend() : GpuBackend::None;
  if (!route_to_mx_fast(backend, p)) {
    return std::nullopt;
  }
  auto out = dequantized_attention(
      q,
      k_packed,
      k_scales,
      k_biases,
      v_packed,
      v_scales,
      v_biases,
      p,
      scale,
      k_group_size,
      k_bits,
      v_group_size,
      v_bits,
      sinks,
      exact,
      /*force_fused=*/true,
      s);
  if (out) {
    note_route("mx_fast");
  }
  return out;
}

std::optional<mx::array> dequantized_attention(
    const mx::array& q,
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const PrefillProblem& p,
    float scale,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    const std::optional<mx::array>& sinks,
    const std::optional<ExactRows>& exact,
    bool force_fused,
    mx::Stream s) {
  auto first_rows = [&](const mx::array& a, int n) { return detail::row_range(a, 0, n, s); };
  // Into the workspace when every dense row has a quantized row to be
  // dequantized in its place: the exact rows are then written over theirs.
  const bool reused = environment().prefill_workspace && k_packed.shape(2) >= p.N;
  std::optional<mx::array> k, v;
  if (reused) {
    auto [dk, dv] = workspace::dequantize_kv(
        first_rows(k_packed, p.N),
        first_rows(k_scales, p.N),
        first_rows(k_biases, p.N),
        first_rows(v_packed, p.N),
        first_rows(v_scales, p.N),
        first_rows(v_biases, p.N),
        k_group_size,
        k_bits,
        v_group_size,
        v_bits,
        q.dtype(),
        s);
    k = std::move(dk);
    v = std::move(dv);
    if (exact) {
      k = ring_update(*k, exact->keys, exact->n, /*owned=*/true, s);
      v = ring_update(*v, exact->values, exact->n, /*owned=*/true, s);
    }
  } else {
    const int n = exact ? exact->n : p.N;
    auto dense = [&](const mx::array& packed,
                     const mx::array& scales,
                     const mx::array& biases,
                     int group_size,
                     int bits) {
      return mx::dequantize(
          first_rows(packed, n),
          first_rows(scales, n),
          first_rows(biases, n),
          group_size,
          bits,
          "affine",
          std::nullopt,
          std::nullopt,
          s);
    };
    k = dense(k_packed, k_scales, k_biases, k_group_size, k_bits);
    v = dense(v_packed, v_scales, v_biases, v_group_size, v_bits);
    if (exact) {
      k = mx::concatenate({*k, exact->keys}, 2, s);
      v = mx::concatenate({*v, exact->values}, 2, s);
    }
  }
  std::optional<mx::array> out;
  try {
    out = mx::fast::scaled_dot_product_attention(
        q,
        *k,
        *v,
        scale,
        p.mask == kMaskCausal ? "causal" : "",
        std::nullopt,
        sinks,
        force_fused,
        s);
  } catch (const std::exception&) { // MLX has no fused kernel here after all
    return std::nullopt;
  }
  if (reused) {
    workspace::note_reader(s, *out);
  }
  return out;
}

std::map<std::string, int> take_route_counts() {
  std::lock_guard<std::mutex> lock(counts_mutex);
  auto counts = std::move(route_counts);
  route_counts.clear();
  return counts;
}

} // namespace mlxq
