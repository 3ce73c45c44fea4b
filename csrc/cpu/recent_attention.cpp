// RecentAttention on the CPU: query rows spread over mlxq's worker pool, each
// row in float32 (its scaled query, the window's scores, the softmax-weighted
// values), the window's rows converted to float32 once per task group so the
// inner loops run over contiguous floats (vectorised; see CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

#include "cpu/parallel.h"
#include "debug.h"
#include "recent_attention.h"

namespace mlxq {

namespace {

// Rows [0, n) of one KV head's keys or values as contiguous float32.
template <typename T>
void rows_to_float(const mx::array& a, int b, int h, int n, float* dst) {
  const auto& st = a.strides();
  const int D = a.shape(3);
  const T* base = a.data<T>() + b * st[0] + h * st[1];
  for (int j = 0; j < n; ++j) {
    const T* row = base + j * st[2];
    for (int d = 0; d < D; ++d) {
      dst[int64_t(j) * D + d] = static_cast<float>(row[d * st[3]]);
    }
  }
}

// Row (b, h, l) of a mask view over the window's first n rows, as additive
// biases: -inf where a bool mask hides a row.
template <typename M>
void mask_row(const mx::array& m, int b, int h, int l, int n, float* bias) {
  const auto& st = m.strides();
  const M* p = m.data<M>() + b * st[0] + h * st[1] + l * st[2];
  for (int j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<M, bool>) {
      bias[j] = p[j * st[3]] ? 0.0f : -std::numeric_limits<float>::infinity();
    } else {
      bias[j] = static_cast<float>(p[j * st[3]]);
    }
  }
}

void mask_row(const mx::array& m, int b, int h, int l, int n, float* bias) {
  switch (m.dtype()) {
    case mx::bool_:
      return mask_row<bool>(m, b, h, l, n, bias);
    case mx::float16:
      return mask_row<mx::float16_t>(m, b, h, l, n, bias);
    case mx::bfloat16:
      return mask_row<mx::bfloat16_t>(m, b, h, l, n, bias);
    default:
      return mask_row<float>(m, b, h, l, n, bias);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    s += a[i] * b[i];
  }
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

template <typename T>
void attend_window(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& out_q,
    const mx::array& lse_q,
    const std::optional<mx::array>& mask,
    mx::array& out,
    float scale,
    bool causal) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Dk = q.shape(3);
  const int Hkv = k.shape(1), T_ = k.shape(2), Dv = v.shape(3);
  const int rep = Hq / Hkv;
  // A task: one (batch, KV head) and a block of query positions, so each
  // task converts its head's window once and reuses it for rep * rows rows.
  const int row_block = std::max(1, std::min(L, 64));
  const int blocks = (L + row_block - 1) / row_block;
  const int tasks = B * Hkv * blocks;
  const int workers = cpu::num_threads();
  std::vector<std::vector<float>> scratch(workers);
  cpu::parallel_for(tasks, [&](int task, int worker) {
    const int blk = task % blocks;
    const int kvh = (task / blocks) % Hkv;
    const int b = task / (blocks * Hkv);
    const int l0 = blk * row_block, l1 = std::min(L, l0 + row_block);
    // The rows this block's queries can see: all, or (causal) up to the last one's.
    const int visible = causal ? std::min(T_, l1 - 1 + T_ - L + 1) : T_;
    auto& buf = scratch[worker];
    buf.resize(size_t(visible) * (Dk + Dv) + Dk + Dv + 2 * visible);
    float* kf = buf.data();
    float* vf = kf + size_t(visible) * Dk;
    float* qrow = vf + size_t(visible) * Dv;
    float* acc = qrow + Dk;
    float* scores = acc + Dv;
    float* bias = scores + visible;
    rows_to_float<T>(k, b, kvh, visible, kf);
    rows_to_float<T>(v, b, kvh, visible, vf);
    const auto &qs = q.strides(), &os = out_q.strides(), &ls = lse_q.strides();
    for (int h = kvh * rep; h < (kvh + 1) * rep; ++h) {
      for (int l = l0; l < l1; ++l) {
        const int n = causal ? std::min(T_, l + T_ - L + 1) : T_;
        const T* qr = q.data<T>() + b * qs[0] + h * qs[1] + l * qs[2];
        for (int d = 0; d < Dk; ++d) {
          qrow[d] = scale * static_cast<float>(qr[d * qs[3]]);
        }
        if (mask) {
          mask_row(*mask, b, h, l, n, bias);
        }
        float m = kNegInf;
        for (int j = 0; j < n; ++j) {
          // A hidden row costs no dot product (a sliding window hides most).
          const float add = mask ? bias[j] : 0.0f;
          scores[j] = add == kNegInf ? kNegInf : dot(qrow, kf + int64_t(j) * Dk, Dk) + add;
          m = std::max(m, scores[j]);
        }
        float sum = 0.0f;
        std::fill(acc, acc + Dv, 0.0f);
        for (int j = 0; j < n && m != kNegInf; ++j) {
          if (scores[j] == kNegInf) {
            continue;
          }
          const float p = std::exp(scores[j] - m);
          sum += p;
          axpy(acc, p, vf + int64_t(j) * Dv, Dv);
        }
        // Merge: weights exp(lse_i - lse) over the union's log-sum-exp; a
        // part that saw no key (lse -inf) has weight 0, and a row that saw
        // none in either part gets zeros.
        const float lq = lse_q.data<float>()[b * ls[0] + h * ls[1] + l * ls[2]];
        float wq = lq == kNegInf ? 0.0f : 1.0f, ww = 0.0f;
        if (m != kNegInf) {
          const float lw = m + std::log(sum);
          const float lse = std::max(lq, lw) + std::log1p(std::exp(-std::abs(lq - lw)));
          wq = std::exp(lq - lse);
          ww = std::exp(m - lse);
        }
        const T* orow = out_q.data<T>() + b * os[0] + h * os[1] + l * os[2];
        T* drow = out.data<T>() + ((int64_t(b) * Hq + h) * L + l) * Dv;
        for (int d = 0; d < Dv; ++d) {
          drow[d] = static_cast<T>(wq * static_cast<float>(orow[d * os[3]]) + ww * acc[d]);
        }
      }
    }
  });
}

} // namespace

void RecentAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([q = inputs[0],
                k = inputs[1],
                v = inputs[2],
                oq = inputs[3],
                lq = inputs[4],
                mask = inputs.size() > 5 ? std::optional<mx::array>(inputs[5]) : std::nullopt,
                out = mx::array::unsafe_weak_copy(out),
                scale = scale_,
                causal = causal_]() mutable {
    poison_if_enabled(out);
    switch (q.dtype()) {
      case mx::float16:
        attend_window<mx::float16_t>(q, k, v, oq, lq, mask, out, scale, causal);
        break;
      case mx::bfloat16:
        attend_window<mx::bfloat16_t>(q, k, v, oq, lq, mask, out, scale, causal);
        break;
      default:
        attend_window<float>(q, k, v, oq, lq, mask, out, scale, causal);
        break;
    }
  });
}

} // namespace mlxq
