// WindowAttention on the CPU: one query row at a time, float32 throughout
// (the window is a few hundred rows; the quantized part dominates a step).
#include <cmath>
#include <limits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"

#include "debug.h"
#include "window_attention.h"

namespace mlxq {

namespace {

template <typename T>
void attend_window(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const mx::array& out_q,
    const mx::array& lse_q,
    mx::array& out,
    float scale) {
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Dk = q.shape(3);
  const int Hkv = k.shape(1), T_ = k.shape(2), Dv = v.shape(3);
  const int rep = Hq / Hkv;
  const auto &qs = q.strides(), &ks = k.strides(), &vs = v.strides(), &os = out_q.strides();
  const auto& ls = lse_q.strides();
  const T* qp = q.data<T>();
  const T* kp = k.data<T>();
  const T* vp = v.data<T>();
  const T* op = out_q.data<T>();
  const float* lp = lse_q.data<float>();
  T* dst = out.data<T>();
  std::vector<float> qrow(Dk), scores(T_), acc(Dv);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / rep;
      for (int l = 0; l < L; ++l) {
        const T* qr = qp + b * qs[0] + h * qs[1] + l * qs[2];
        for (int d = 0; d < Dk; ++d) {
          qrow[d] = scale * static_cast<float>(qr[d * qs[3]]);
        }
        float m = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < T_; ++j) {
          const T* kr = kp + b * ks[0] + kvh * ks[1] + j * ks[2];
          float s = 0.0f;
          for (int d = 0; d < Dk; ++d) {
            s += qrow[d] * static_cast<float>(kr[d * ks[3]]);
          }
          scores[j] = s;
          m = std::max(m, s);
        }
        float sum = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int j = 0; j < T_; ++j) {
          const float p = std::exp(scores[j] - m);
          sum += p;
          const T* vr = vp + b * vs[0] + kvh * vs[1] + j * vs[2];
          for (int d = 0; d < Dv; ++d) {
            acc[d] += p * static_cast<float>(vr[d * vs[3]]);
          }
        }
        // Merge: weights exp(lse_i - lse) over the union's log-sum-exp.
        const float lw = m + std::log(sum);
        const float lq = lp[b * ls[0] + h * ls[1] + l * ls[2]];
        const float hi = std::max(lq, lw);
        const float lse = hi + std::log1p(std::exp(-std::abs(lq - lw)));
        const float wq = std::exp(lq - lse); // 0 where the other keys were none
        const float ww = std::exp(m - lse);
        const T* orow = op + b * os[0] + h * os[1] + l * os[2];
        T* drow = dst + ((int64_t(b) * Hq + h) * L + l) * Dv;
        for (int d = 0; d < Dv; ++d) {
          drow[d] = static_cast<T>(wq * static_cast<float>(orow[d * os[3]]) + ww * acc[d]);
        }
      }
    }
  }
}

} // namespace

void WindowAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
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
                out = mx::array::unsafe_weak_copy(out),
                scale = scale_]() mutable {
    poison_if_enabled(out);
    switch (q.dtype()) {
      case mx::float16:
        attend_window<mx::float16_t>(q, k, v, oq, lq, out, scale);
        break;
      case mx::bfloat16:
        attend_window<mx::bfloat16_t>(q, k, v, oq, lq, out, scale);
        break;
      default:
        attend_window<float>(q, k, v, oq, lq, out, scale);
        break;
    }
  });
}

} // namespace mlxq
