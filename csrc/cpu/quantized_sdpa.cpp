// CPU QuantizedSDPA.
//
// Work split: a task is (batch, KV head, row tile, key split). A row is one
// (query position, query head) of the KV head's GQA group, so all query heads
// of a KV head sit in one tile and every K/V row is unpacked once for all of
// them. When (batch x KV heads x row tiles) alone cannot keep every thread
// busy (decode of few KV heads), the keys are also split; each split writes an
// unnormalised partial output with its running (max, sum), and a second pass
// merges them by log-sum-exp. With one split the tile normalises and writes
// the output directly, so large L needs no memory beyond per-thread scratch.
//
// Inside a task, keys go in chunks of kChunk:
//   scores  s = scale*q . (code*k_scale) + sum_g k_bias_g * (scale * sum_{i in g} q_i)
//   mask    causal limit / bool / additive, then an online softmax update
//   values  o += p * (code*v_scale), and per group obias_g += p * v_bias_g
// Dequantized rows live only in a D-float scratch line.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/types/half_types.h"
#include "prefix_view.h"

#include "cpu/int_dot.h"
#include "cpu/parallel.h"
#include "cpu/quantized_codes.h"
#include "cpu/simd_math.h"
#include "debug.h"
#include "environment.h"
#include "quantization.h"
#include "quantized_sdpa.h"
#include "row_tiling.h"
#include "sdpa_problem.h"

namespace mlxq {

namespace {

using mx::bfloat16_t;
using mx::float16_t;

constexpr int kChunk = 32; // keys per softmax update
// Rows sharing one unpacked K/V row. 64 measured 7-10% faster than 32 for
// L >= 16 (speculative steps, prefill) and the same for decode.
constexpr int kMaxRowTile = 64;
constexpr int kMinSplitKeys = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A 4-D strided view; strides in elements, last dimension contiguous.
struct View {
  const char* data;
  int64_t stride[4];
  size_t itemsize;

  template <typename T>
  const T* at(int64_t i0, int64_t i1, int64_t i2) const {
    return reinterpret_cast<const T*>(
        data + (i0 * stride[0] + i1 * stride[1] + i2 * stride[2]) * itemsize);
  }

  // Row (i0, i1, i2) of n elements as a contiguous pointer: the row itself
  // when its last axis is contiguous (every cache and mx.quantize output),
  // else gathered into `tmp`.
  template <typename T>
  const T* row(int64_t i0, int64_t i1, int64_t i2, int n, T* tmp) const {
    const T* p = at<T>(i0, i1, i2);
    if (stride[3] == 1) {
      return p;
    }
    for (int i = 0; i < n; ++i) {
      tmp[i] = p[i * stride[3]];
    }
    return tmp;
  }
};

// The task plan: SdpaProblem's shapes and codes, the operands' views and the
// row / key tiling.
struct Problem : SdpaProblem {
  View q, kw, ks, kb, vw, vs, vb, m;
  const cpu::IntDot* ints; // integer products (int_dot.h), or null: f32
  const float* sinks; // [Hq] or null
  float* lse; // [B, Hq, L] or null: each row's log-sum-exp
  int row_tile;
  int row_tiles;
  int splits;
  int split_keys;
};

inline float load_float(const void* p, DtypeCode dt) {
  switch (dt) {
    case kF16:
      return static_cast<float>(*static_cast<const float16_t*>(p));
    case kBF16:
      return static_cast<float>(*static_cast<const bfloat16_t*>(p));
    default:
      return *static_cast<const float*>(p);
  }
}

template <typename T>
inline void store_row(void* dst, const float* src, int n) {
  T* d = static_cast<T*>(dst);
  for (int i = 0; i < n; ++i) {
    d[i] = static_cast<T>(src[i]);
  }
}

inline void store_output(DtypeCode dt, void* dst, const float* src, int n) {
  switch (dt) {
    case kF16:
      store_row<float16_t>(dst, src, n);
      break;
    case kBF16:
      store_row<bfloat16_t>(dst, src, n);
      break;
    default:
      store_row<float>(dst, src, n);
      break;
  }
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] += a * x[i];
  }
}

inline void scale_inplace(float* __restrict y, float a, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] *= a;
  }
}

// Per-worker scratch, sized for the largest tile it has seen.
struct Scratch {
  std::vector<float> buf;
  float *qf, *qsum, *s, *o, *obias, *m, *l, *kbuf, *vbuf, *kbias, *vbias, *wscale, *gscale, *onat,
      *pc, *qpair, *qscale, *peak;
  int act[kChunk];
  uint32_t words[kMaxHeadDim * 8 / 32 + 1];

  void prepare(const Problem& P) {
    const size_t RT = P.row_tile, Gk = P.Dk / P.k_group_size, Gv = P.Dv / P.v_group_size;
    const size_t sizes[] = {
        RT * P.Dk,
        RT * Gk,
        RT * kChunk,
        RT * P.Dv,
        RT * Gv * cpu::kMaxBiasLanes,
        RT,
        RT,
        kChunk * size_t(P.Dk),
        kChunk * size_t(P.Dv),
        kChunk * Gk,
        kChunk * Gv,
        size_t(std::max(P.Dk, P.Dv)),
        std::max(Gk, Gv),
        size_t(P.Dv),
        kChunk,
        RT * P.Dk / 2,
        RT * Gk,
        RT};
    float** slots[] = {
        &qf,
        &qsum,
        &s,
        &o,
        &obias,
        &m,
        &l,
        &kbuf,
        &vbuf,
        &kbias,
        &vbias,
        &wscale,
        &gscale,
        &onat,
        &pc,
        &qpair,
        &qscale,
        &peak};
    constexpr int n = sizeof(sizes) / sizeof(sizes[0]);
    static_assert(n == sizeof(slots) / sizeof(slots[0]));
    size_t total = 16;
    for (size_t sz : sizes) {
      total += (sz + 15) & ~size_t(15); // 64-byte aligned sub-buffers
    }
    if (buf.size() < total) {
      buf.assign(total, 0.0f);
    }
    float* p = buf.data();
    p += (16 - (reinterpret_cast<uintptr_t>(p) / sizeof(float)) % 16) % 16;
    for (int i = 0; i < n; ++i) {
      *slots[i] = p;
      p += (sizes[i] + 15) & ~size_t(15);
    }
  }
};

// Loads one row's group scales, and its group biases into bias[g * bias_stride]
// (the kernels keep biases transposed: [group][key], so that the bias terms of
// a whole chunk of keys are one vector FMA per group).
inline void load_group_params(
    const View& sv,
    const View& bv,
    DtypeCode dt,
    int b,
    int h,
    int n,
    int G,
    float* scale,
    float* bias,
    int bias_stride) {
  const char* sp = sv.data + (b * sv.stride[0] + h * sv.stride[1] + n * sv.stride[2]) * sv.itemsize;
  const char* bp = bv.data + (b * bv.stride[0] + h * bv.stride[1] + n * bv.stride[2]) * bv.itemsize;
  const int64_t ss = sv.stride[3] * sv.itemsize, bs = bv.stride[3] * bv.itemsize;
  for (int g = 0; g < G; ++g) {
    scale[g] = load_float(sp + g * ss, dt);
    bias[g * bias_stride] = load_float(bp + g * bs, dt);
  }
}

// y += sum_a w[a] * x[a*d .. a*d+d). With D fixed at compile time the
// compiler keeps y in registers across all n rows of x. (Restrict on function
// parameters is what lets it; on local pointers GCC ignores it.)
template <int D>
inline void accumulate_weighted(
    float* __restrict y,
    const float* __restrict w,
    const float* __restrict x,
    int n,
    int d) {
  const int dim = D ? D : d;
  for (int a = 0; a < n; ++a) {
    const float wa = w[a];
    const float* __restrict xa = x + size_t(a) * dim;
    for (int i = 0; i < dim; ++i) {
      y[i] += wa * xa[i];
    }
  }
}

// s[j] = q . k[j*d .. j*d+d), for j < n.
template <int D>
inline void
dot_rows(float* __restrict s, const float* __restrict q, const float* __restrict k, int n, int d) {
  const int dim = D ? D : d;
  for (int j = 0; j < n; ++j) {
    const float* __restrict kj = k + size_t(j) * dim;
    float acc = 0.0f;
    for (int i = 0; i < dim; ++i) {
      acc += q[i] * kj[i];
    }
    s[j] = acc;
  }
}

// One tile: rows [r0, r1) of (b, kvh) against keys [n0, n1). DK/DV are the
// head dims when known at compile time (0: read from the problem); fixed dims
// let the compiler keep a query row, or an output row's accumulators, in
// registers across a whole chunk of keys. Keys and values have their own
// widths (KBITS, VBITS) and group sizes.
template <int KBITS, int VBITS, int DK, int DV>
class TileKernel {
  using CK = cpu::Codes<KBITS>;
  using CV = cpu::Codes<VBITS>;

 public:
  TileKernel(const Problem& P, Scratch& S)
      : P_(P), S_(S), Dk_(DK ? DK : P.Dk), Dv_(DV ? DV : P.Dv) {}

  void run(int b, int kvh, int r0, int r1, int n0, int n1) {
    const int R = r1 - r0;
    load_queries(b, kvh, r0, R);
    std::fill(S_.o, S_.o + R * Dv_, 0.0f);
    std::fill(S_.obias, S_.obias + R * (Dv_ / P_.v_group_size) * bias_lanes(), 0.0f);
    std::fill(S_.m, S_.m + R, kNegInf);
    std::fill(S_.l, S_.l + R, 0.0f);
    if (P_.mask == kMaskCausal) {
      // Keys past the last row's causal limit are hidden from every row.
      int last_l = P_.position(r1 - 1);
      n1 = std::min(n1, last_l + P_.N - P_.L + 1);
    }
    for (int c0 = n0; c0 < n1; c0 += kChunk) {
      const int cn = std::min(kChunk, n1 - c0);
      scores(b, kvh, R, c0, cn);
      apply_mask(b, kvh, r0, R, c0, cn);
      for (int rr = 0; rr < R; ++rr) {
        std::fill(S_.s + rr * kChunk + cn, S_.s + (rr + 1) * kChunk, kNegInf);
      }
      if (P_.ints && P_.ints->softmax) {
        P_.ints->softmax(R, S_.s, S_.m, S_.l, S_.peak, S_.o, Dv_, S_.obias, Dv_ / P_.v_group_size);
      } else {
        softmax_update(R, kChunk);
      }
      values(b, kvh, R, c0, cn);
    }
  }

  // Natural-order unnormalised output of tile row rr (valid after run()).
  const float* natural_output(int rr) {
    const float* o = S_.o + size_t(rr) * Dv_;
    const float* ob = S_.obias + size_t(rr) * (Dv_ / P_.v_group_size) * bias_lanes();
    if (P_.ints) {
      const int lanes = bias_lanes();
      float bias[kMaxHeadDim];
      for (int g = 0; g < Dv_ / P_.v_group_size; ++g) {
        bias[g] = 0.0f;
        for (int t = 0; t < lanes; ++t) {
          bias[g] += ob[g * lanes + t];
        }
      }
      for (int lane = 0; lane < Dv_; ++lane) {
        const int i = P_.ints->element(VBITS, lane);
        S_.onat[i] = o[lane] + bias[i / P_.v_group_size];
      }
      return S_.onat;
    }
    for (int i = 0; i < Dv_; ++i) {
      S_.onat[i] = o[CV::slot(i, Dv_)] + ob[i / P_.v_group_size];
    }
    return S_.onat;
  }

 private:
  // Partial sums per (row, group) in obias: the integer kernels' own count.
  int bias_lanes() const {
    return P_.ints ? P_.ints->bias_lanes : 1;
  }

  void load_queries(int b, int kvh, int r0, int R) {
    const int gs = P_.k_group_size, Gk = Dk_ / gs;
    const int64_t qstep = P_.q.stride[3] * P_.q.itemsize;
    for (int rr = 0; rr < R; ++rr) {
      const int r = r0 + rr, l = P_.position(r), h = P_.query_head(kvh, r);
      const char* qrow = P_.q.data +
          (b * P_.q.stride[0] + h * P_.q.stride[1] + l * P_.q.stride[2]) * P_.q.itemsize;
      float* qf = S_.qf + size_t(rr) * Dk_;
      float* qs = S_.qsum + size_t(rr) * Gk;
      for (int g = 0; g < Gk; ++g) {
        float sum = 0.0f;
        for (int i = g * gs; i < (g + 1) * gs; ++i) {
          const float v = load_float(qrow + i * qstep, P_.q_dtype) * P_.scale;
          if (!P_.ints) { // the integer path multiplies quantize_query's copy
            qf[CK::slot(i, Dk_)] = v;
          }
          sum += v;
        }
        qs[g] = sum;
      }
      if (P_.ints) {
        quantize_query(qrow, qstep, rr);
      }
    }
  }

  // The integer path's query: row rr's scaled query quantized per K group
  // to int16 (qscale: the step), laid out as int_dot's key pairs.
  void quantize_query(const char* qrow, int64_t qstep, int rr) {
    const int gs = P_.k_group_size, Gk = Dk_ / gs;
    int16_t qi[kMaxHeadDim];
    for (int g = 0; g < Gk; ++g) {
      float peak = 0.0f;
      for (int i = g * gs; i < (g + 1) * gs; ++i) {
        peak = std::max(peak, std::fabs(load_float(qrow + i * qstep, P_.q_dtype) * P_.scale));
      }
      const float inv = peak > 0.0f ? 32767.0f / peak : 0.0f;
      S_.qscale[rr * Gk + g] = peak / 32767.0f;
      for (int i = g * gs; i < (g + 1) * gs; ++i) {
        const float v = load_float(qrow + i * qstep, P_.q_dtype) * P_.scale;
        qi[i] = int16_t(std::lrintf(v * inv));
      }
    }
    int32_t* pairs = reinterpret_cast<int32_t*>(S_.qpair) + size_t(rr) * (Dk_ / 2);
    for (int m = 0; m < Dk_ / 2; ++m) {
      int i0, i1;
      cpu::key_pair(KBITS, m, i0, i1);
      pairs[m] = int32_t(uint32_t(uint16_t(qi[i0])) | (uint32_t(uint16_t(qi[i1])) << 16));
    }
  }

  // s[rr][j] = q_rr . (codes_j * scale_j) + sum_g bias_j,g * qsum_rr,g
  void scores(int b, int kvh, int R, int c0, int cn) {
    const int Dk = Dk_, Gk = Dk / P_.k_group_size;
    if (P_.ints) {
      const cpu::IntRows rows{R, reinterpret_cast<const int32_t*>(S_.qpair), S_.qscale, S_.qsum};
      P_.ints->scores(
          int_keys(P_.kw, P_.ks, P_.kb, b, kvh, c0, cn, KBITS, Dk, P_.k_group_size), rows, S_.s);
      return;
    }
    for (int j = 0; j < cn; ++j) {
      load_group_params(
          P_.ks, P_.kb, P_.scale_dtype, b, kvh, c0 + j, Gk, S_.gscale, S_.kbias + j, kChunk);
      CK::unpack_scaled(
          P_.kw.row<uint32_t>(b, kvh, c0 + j, Dk * KBITS / 32, S_.words),
          S_.gscale,
          Dk,
          P_.k_group_size,
          S_.kbuf + size_t(j) * Dk,
          S_.wscale);
    }
    // Whole chunks, whatever cn: a key's score then takes the same
    // instructions wherever the chunk ends (a masked whole-buffer step and
    // an exact one agree to the bit, see row_tiling.h). Rows past cn hold
    // an earlier chunk's (or zero) scratch; run() hides their scores.
    for (int rr = 0; rr < R; ++rr) {
      dot_rows<DK>(S_.s + rr * kChunk, S_.qf + size_t(rr) * Dk, S_.kbuf, kChunk, Dk);
    }
    add_key_bias(R);
  }

  // s[rr][j] += sum_g bias_j,g * qsum_rr,g (the scaled query's group sums).
  void add_key_bias(int R) {
    const int Gk = Dk_ / P_.k_group_size;
    for (int rr = 0; rr < R; ++rr) {
      const float* qs = S_.qsum + size_t(rr) * Gk;
      for (int g = 0; g < Gk; ++g) {
        axpy(S_.s + rr * kChunk, qs[g], S_.kbias + g * kChunk, kChunk);
      }
    }
  }

  void apply_mask(int b, int kvh, int r0, int R, int c0, int cn) {
    if (P_.mask == kMaskCausal) {
      for (int rr = 0; rr < R; ++rr) {
        const int l = P_.position(r0 + rr);
        const int first_hidden = std::max(l + P_.N - P_.L + 1 - c0, 0);
        float* s = S_.s + rr * kChunk;
        for (int j = first_hidden; j < cn; ++j) {
          s[j] = kNegInf;
        }
      }
    } else if (P_.mask == kMaskArray) {
      const View& mv = P_.m;
      for (int rr = 0; rr < R; ++rr) {
        const int r = r0 + rr, l = P_.position(r), h = P_.query_head(kvh, r);
        const char* row = mv.data +
            (b * mv.stride[0] + h * mv.stride[1] + l * mv.stride[2] + c0 * mv.stride[3]) *
                mv.itemsize;
        const int64_t step = mv.stride[3] * mv.itemsize;
        float* s = S_.s + rr * kChunk;
        if (P_.mask_dtype == kBool) {
          for (int j = 0; j < cn; ++j) {
            if (!*reinterpret_cast<const bool*>(row + j * step)) {
              s[j] = kNegInf;
            }
          }
        } else {
          for (int j = 0; j < cn; ++j) {
            s[j] += load_float(row + j * step, P_.mask_dtype);
          }
        }
      }
    }
  }

  // Online softmax: turns the chunk's scores into weights relative to each
  // row's running max, rescaling what was accumulated under the old max.
  void softmax_update(int R, int cn) {
    const int Dv = Dv_, Gv = Dv / P_.v_group_size;
    for (int rr = 0; rr < R; ++rr) {
      float* s = S_.s + rr * kChunk;
      float chunk_max = kNegInf;
      for (int j = 0; j < cn; ++j) {
        chunk_max = std::max(chunk_max, s[j]);
      }
      const float m_old = S_.m[rr];
      const float m_new = std::max(m_old, chunk_max);
      if (m_new == kNegInf) {
        // Every key so far is masked: no weight, nothing to rescale.
        std::fill(s, s + cn, 0.0f);
        continue;
      }
      float sum = 0.0f;
      for (int j = 0; j < cn; ++j) {
        s[j] = cpu::exp_nonpositive(s[j] - m_new);
        sum += s[j];
      }
      const float corr = cpu::exp_nonpositive(m_old - m_new);
      if (corr != 1.0f) {
        scale_inplace(S_.o + size_t(rr) * Dv, corr, Dv);
        scale_inplace(S_.obias + size_t(rr) * Gv, corr, Gv);
      }
      S_.l[rr] = S_.l[rr] * corr + sum;
      S_.m[rr] = m_new;
    }
  }

  // o_rr += sum_j p_rr,j * codes_j * scale_j ; obias_rr,g += sum_j p_rr,j * bias_j,g
  // Only keys some row gives weight to are unpacked (masked keys are skipped).
  void values(int b, int kvh, int R, int c0, int cn) {
    const int Dv = Dv_, Gv = Dv / P_.v_group_size;
    if (P_.ints) {
      P_.ints->values(
          int_keys(P_.vw, P_.vs, P_.vb, b, kvh, c0, cn, VBITS, Dv, P_.v_group_size),
          R,
          S_.s,
          S_.peak,
          S_.o,
          S_.obias);
      return;
    }
    int na = 0;
    for (int j = 0; j < cn; ++j) {
      bool any = false;
      for (int rr = 0; rr < R; ++rr) {
        any |= S_.s[rr * kChunk + j] != 0.0f;
      }
      if (!any) {
        continue;
      }
      load_group_params(
          P_.vs, P_.vb, P_.scale_dtype, b, kvh, c0 + j, Gv, S_.gscale, S_.vbias + na, kChunk);
      CV::unpack_scaled(
          P_.vw.row<uint32_t>(b, kvh, c0 + j, Dv * VBITS / 32, S_.words),
          S_.gscale,
          Dv,
          P_.v_group_size,
          S_.vbuf + size_t(na) * Dv,
          S_.wscale);
      S_.act[na++] = j;
    }
    for (int rr = 0; rr < R; ++rr) {
      const float* s = S_.s + rr * kChunk;
      float* __restrict pc = S_.pc;
      for (int a = 0; a < na; ++a) {
        pc[a] = s[S_.act[a]];
      }
      accumulate_weighted<DV>(S_.o + size_t(rr) * Dv, pc, S_.vbuf, na, Dv);
      // Bias terms: one register accumulator per group (not a store chain).
      float* ob = S_.obias + size_t(rr) * Gv;
      for (int g = 0; g < Gv; ++g) {
        float acc = ob[g];
        const float* vb = S_.vbias + g * kChunk;
        for (int a = 0; a < na; ++a) {
          acc += pc[a] * vb[a];
        }
        ob[g] = acc;
      }
    }
  }

  // Keys [c0, c0 + n) of (b, h) for the integer kernels.
  cpu::IntKeys int_keys(
      const View& w,
      const View& sc,
      const View& bi,
      int b,
      int h,
      int c0,
      int n,
      int bits,
      int D,
      int group_size) const {
    return cpu::IntKeys{
        w.at<uint32_t>(b, h, c0),
        w.stride[2],
        sc.at<char>(b, h, c0),
        bi.at<char>(b, h, c0),
        sc.stride[2],
        P_.scale_dtype,
        n,
        bits,
        D,
        group_size};
  }

  const Problem& P_;
  Scratch& S_;
  const int Dk_, Dv_;
};

// Softmax denominator and output scale of one row, given its running max and
// sum over keys and the optional sink logit. Rows that see no key (and no
// sink mass) get 0 output.
inline float inverse_denominator(float m, float l, const float* sink) {
  float denom = l;
  if (sink) {
    const float mm = std::max(m, *sink);
    denom =
        (m == kNegInf ? 0.0f : l * cpu::exp_nonpositive(m - mm)) + cpu::exp_nonpositive(*sink - mm);
    // Output terms carry exp(-m); rescale them to exp(-mm).
    const float carried = m == kNegInf ? 0.0f : cpu::exp_nonpositive(m - mm);
    return denom > 0.0f ? carried / denom : 0.0f;
  }
  return denom > 0.0f ? 1.0f / denom : 0.0f;
}

// The row's log-sum-exp (natural log of its softmax denominator, the sink
// included), -inf for a row with no key and no sink.
inline float log_denominator(float m, float l, const float* sink) {
  const float mm = sink ? std::max(m, *sink) : m;
  if (mm == kNegInf) {
    return kNegInf;
  }
  float denom = m == kNegInf ? 0.0f : l * std::exp(m - mm);
  if (sink) {
    denom += std::exp(*sink - mm);
  }
  return denom > 0.0f ? mm + std::log(denom) : kNegInf;
}

template <int KBITS, int VBITS, int DK, int DV>
void run_problem(const Problem& P, void* out_data) {
  const int n_tasks = P.B * P.Hkv * P.row_tiles * P.splits;
  const size_t out_row = size_t(P.Dv) * (P.q_dtype == kF32 ? 4 : 2);
  auto out_ptr = [&](int b, int h, int l) {
    return static_cast<char*>(out_data) + ((size_t(b) * P.Hq + h) * P.L + l) * out_row;
  };
  const int threads = cpu::num_threads();
  std::vector<Scratch> scratch(threads);
  std::vector<float> part_o, part_m, part_l;
  if (P.splits > 1) {
    part_o.assign(size_t(n_tasks) * P.row_tile * P.Dv, 0.0f);
    part_m.assign(size_t(n_tasks) * P.row_tile, kNegInf);
    part_l.assign(size_t(n_tasks) * P.row_tile, 0.0f);
  }
  std::vector<float> normalised(size_t(threads) * P.Dv);
  // A finished row: y (its unnormalised output, this worker's scratch)
  // scaled by the softmax denominator from (m, lsum) and the head's sink,
  // stored, and the row's log-sum-exp when asked for.
  auto finish_row = [&](int b, int h, int l, float* y, float m, float lsum) {
    const float* sink = P.sinks ? P.sinks + h : nullptr;
    scale_inplace(y, inverse_denominator(m, lsum, sink), P.Dv);
    store_output(P.q_dtype, out_ptr(b, h, l), y, P.Dv);
    if (P.lse) {
      P.lse[(size_t(b) * P.Hq + h) * P.L + l] = log_denominator(m, lsum, sink);
    }
  };

  cpu::parallel_for(n_tasks, [&](int task, int worker) {
    int t = task;
    const int split = t % P.splits;
    t /= P.splits;
    const int tile = t % P.row_tiles;
    t /= P.row_tiles;
    const int kvh = t % P.Hkv;
    const int b = t / P.Hkv;
    const int r0 = tile * P.row_tile;
    const int r1 = std::min(r0 + P.row_tile, P.rows());
    const int n0 = split * P.split_keys;
    const int n1 = std::min(n0 + P.split_keys, P.N);
    Scratch& S = scratch[worker];
    S.prepare(P);
    TileKernel<KBITS, VBITS, DK, DV> kernel(P, S);
    kernel.run(b, kvh, r0, r1, n0, n1);
    for (int rr = 0; rr < r1 - r0; ++rr) {
      const int r = r0 + rr, l = P.position(r), h = P.query_head(kvh, r);
      const float* o = kernel.natural_output(rr);
      if (P.splits > 1) {
        const size_t slot = size_t(task) * P.row_tile + rr;
        std::memcpy(&part_o[slot * P.Dv], o, sizeof(float) * P.Dv);
        part_m[slot] = S.m[rr];
        part_l[slot] = S.l[rr];
      } else {
        float* y = &normalised[size_t(worker) * P.Dv];
        std::copy(o, o + P.Dv, y);
        finish_row(b, h, l, y, S.m[rr], S.l[rr]);
      }
    }
  });
  if (P.splits == 1) {
    return;
  }

  // Merge the splits of each row by log-sum-exp.
  const int merge_rows = P.B * P.Hkv * P.rows();
  cpu::parallel_for(merge_rows, [&](int row, int worker) {
    const int r = row % P.rows();
    const int bk = row / P.rows(); // b * Hkv + kvh
    const int kvh = bk % P.Hkv, b = bk / P.Hkv;
    const int tile = r / P.row_tile, rr = r % P.row_tile;
    const int l = P.position(r), h = P.query_head(kvh, r);
    auto slot = [&](int split) {
      return (size_t(bk * P.row_tiles + tile) * P.splits + split) * P.row_tile + rr;
    };
    float m = kNegInf;
    for (int sp = 0; sp < P.splits; ++sp) {
      m = std::max(m, part_m[slot(sp)]);
    }
    float* y = &normalised[size_t(worker) * P.Dv];
    std::fill(y, y + P.Dv, 0.0f);
    float lsum = 0.0f;
    if (m != kNegInf) {
      for (int sp = 0; sp < P.splits; ++sp) {
        const size_t s = slot(sp);
        if (part_m[s] == kNegInf) {
          continue;
        }
        const float w = cpu::exp_nonpositive(part_m[s] - m);
        lsum += w * part_l[s];
        axpy(y, w, &part_o[s * P.Dv], P.Dv);
      }
    }
    finish_row(b, h, l, y, m, lsum);
  });
}

// Compile-time head dims for the common shapes of the word-aligned widths,
// for equal K/V widths and the 8-bit-key / 4-bit-value pair (llama.cpp's
// q8_0-K / q4_0-V default); every other pair runs with run-time dims.
template <int KBITS, int VBITS>
void dispatch_dims(const Problem& P, void* out) {
  if constexpr (32 % KBITS == 0 && (KBITS == VBITS || (KBITS == 8 && VBITS == 4))) {
    if (P.Dk == P.Dv) {
      switch (P.Dk) {
        case 64:
          return run_problem<KBITS, VBITS, 64, 64>(P, out);
        case 128:
          return run_problem<KBITS, VBITS, 128, 128>(P, out);
        case 256:
          return run_problem<KBITS, VBITS, 256, 256>(P, out);
        default:
          break;
      }
    }
  }
  run_problem<KBITS, VBITS, 0, 0>(P, out);
}

template <int KBITS>
void dispatch_values(const Problem& P, void* out) {
  switch (P.v_bits) {
    case 2:
      return dispatch_dims<KBITS, 2>(P, out);
    case 3:
      return dispatch_dims<KBITS, 3>(P, out);
    case 4:
      return dispatch_dims<KBITS, 4>(P, out);
    case 5:
      return dispatch_dims<KBITS, 5>(P, out);
    case 6:
      return dispatch_dims<KBITS, 6>(P, out);
    default:
      return dispatch_dims<KBITS, 8>(P, out);
  }
}

void dispatch(const Problem& P, void* out) {
  switch (P.k_bits) {
    case 2:
      return dispatch_values<2>(P, out);
    case 3:
      return dispatch_values<3>(P, out);
    case 4:
      return dispatch_values<4>(P, out);
    case 5:
      return dispatch_values<5>(P, out);
    case 6:
      return dispatch_values<6>(P, out);
    default:
      return dispatch_values<8>(P, out);
  }
}

// The integer kernels (cpu/int_dot.h) that serve P, or null: bf16/f16
// queries (f32 ones keep the f32 path's exactness), widths and dims they
// cover, and packed words contiguous along each row.
const cpu::IntDot* integer_products(const Problem& P) {
  // Keys a positive stride apart, each key's words and groups read as runs.
  auto rows_fit = [](const View& w) { return w.stride[3] == 1 && w.stride[2] > 0; };
  auto params_fit = [](const View& s, const View& b) {
    return s.stride[3] == 1 && b.stride[3] == 1 && s.stride[2] == b.stride[2];
  };
  const cpu::IntDot* k = cpu::int_dot();
  const bool fits = k && (P.q_dtype == kF16 || P.q_dtype == kBF16) &&
      cpu::int_dot_covers(P.k_bits, P.Dk, P.k_group_size) &&
      cpu::int_dot_covers(P.v_bits, P.Dv, P.v_group_size) && rows_fit(P.kw) && rows_fit(P.vw) &&
      params_fit(P.ks, P.kb) && params_fit(P.vs, P.vb);
  return fits ? k : nullptr;
}

View view_of(const mx::array& a) {
  View v{reinterpret_cast<const char*>(a.data<char>()), {0, 0, 0, 0}, a.itemsize()};
  for (int d = 0; d < 4; ++d) {
    v.stride[d] = a.strides()[d];
  }
  return v;
}

// Tasks per thread below which keys are split (MLXQ_SPLIT_TASKS_PER_THREAD
// overrides the default, for measuring; 0 disables splitting).
//
// Measured on the 2-core CI machine class (4-bit, D=128, bf16 q; ms):
//   Hq/Hkv  L  N       no split  split (1, 2, 4 or 8 tasks per thread)
//   8/1     1  32768   3.37      1.77 - 1.85
//   16/2    1  32768   3.45      3.37 - 3.55
//   32/8    1  32768   8.9       8.7 - 9.1
//   32/8    4  8192    5.8       5.7 - 5.9
//   8/1     8  8192    2.6       2.55 - 2.72
// Splitting pays exactly when there are fewer independent tasks than threads
// and costs nothing measurable otherwise (the merge touches only rows x Dv
// floats per split); 4 per thread leaves room to balance uneven tasks
// (causal tiles) on machines with more cores.
int split_tasks_per_thread() {
  return int(std::max<int64_t>(0, tuning().split_tasks_per_thread));
}

void plan(Problem& P) {
  const auto p = plan_row_tiles(
      P.B,
      P.Hkv,
      P.rep,
      P.L,
      P.N,
      kMaxRowTile,
      long(split_tasks_per_thread()) * cpu::num_threads(),
      kMinSplitKeys,
      1);
  P.row_tile = p.row_tile;
  P.row_tiles = p.row_tiles;
  P.splits = p.splits;
  P.split_keys = p.split_keys;
}

} // namespace

void QuantizedSDPA::eval_cpu(const std::vector<mx::array>& given, std::vector<mx::array>& outs) {
  const auto in = detail::with_prefix_rows(given, 1, 6, params_.rows);
  mx::array& out = outs[0];
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& o : outs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
    poison_if_enabled(o);
    enc.set_output_array(o);
  }
  for (const auto& a : in) {
    enc.set_input_array(a);
  }

  Problem P{};
  static_cast<SdpaProblem&>(P) = SdpaProblem::from(in, params_, out);
  P.q = view_of(in[kInQ]);
  View* kv[6] = {&P.kw, &P.ks, &P.kb, &P.vw, &P.vs, &P.vb};
  for (int i = 0; i < 6; ++i) {
    *kv[i] = view_of(in[kInKPacked + i]);
  }
  if (P.mask_input >= 0) {
    P.m = view_of(in[P.mask_input]);
  }
  P.sinks = P.sinks_input >= 0 ? in[P.sinks_input].data<float>() : nullptr;
  P.lse = outs.size() > 1 ? outs[1].data<float>() : nullptr;
  plan(P);
  P.ints = integer_products(P);
  note_sdpa_kernel(P.ints ? "cpu_int16" : "cpu_f32");
  // `in` is captured to keep the input buffers alive until the task runs.
  enc.dispatch([P, in, out_data = out.data<void>()]() {
    if (P.B > 0 && P.Hq > 0 && P.L > 0) {
      dispatch(P, out_data);
    }
  });
}

} // namespace mlxq
