// msl_emu/msl_emu.h -- CPU emulation of the Metal Shading Language standard
// library for compute kernels.  Included (via <metal_stdlib>) by kernels that
// were passed through mslpp.py.
//
// Everything the kernel source sees lives in namespace `metal` (so both
// `using namespace metal;` and `metal::exp(...)` work).  The MSL address-space
// keywords are defined as empty macros at the very end of this file, after
// every standard header has been included.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstddef>
#include <climits>
#include <cfloat>
#include <type_traits>
#include <limits>
#include <utility>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include "types.h"
#include "runtime.h"

namespace metal {
using ::msl::emu::half;
using ::msl::emu::bfloat;
using ::msl::emu::vec;
using ::msl::emu::as_vec;
using ::msl::emu::is_vec_v;

// ------------------------------------------------------------ type traits
using std::integral_constant; using std::true_type; using std::false_type; using std::bool_constant;
using std::is_same; using std::enable_if; using std::enable_if_t; using std::conditional;
using std::conditional_t; using std::is_integral; using std::is_signed; using std::is_unsigned;
using std::remove_cv; using std::remove_cv_t; using std::remove_reference; using std::remove_reference_t;
using std::remove_const_t; using std::decay; using std::decay_t; using std::make_signed;
using std::make_signed_t; using std::make_unsigned; using std::make_unsigned_t; using std::void_t;
using std::is_convertible; using std::is_convertible_v; using std::is_pointer; using std::declval; using std::is_void;
template <class A, class B> constexpr bool is_same_v = std::is_same<A, B>::value;
template <class T> constexpr bool is_integral_v = std::is_integral<T>::value;
template <class T> constexpr bool is_signed_v = std::is_signed<T>::value || ::msl::emu::is_float_like<T>::value;
template <class T> constexpr bool is_unsigned_v = std::is_unsigned<T>::value;
template <class T> struct is_floating_point : ::msl::emu::is_float_like<std::remove_cv_t<T>> {};
template <class T> constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_arithmetic : ::msl::emu::is_scalar_like<std::remove_cv_t<T>> {};
template <class T> constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : is_arithmetic<T> {};
template <class T> constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_vector : std::integral_constant<bool, ::msl::emu::is_vec_v<T>> {};
template <class T> constexpr bool is_vector_v = is_vector<T>::value;
template <class T, size_t N> using array = std::array<T, N>;

template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr int digits = 11;
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half denorm_min() { return half(5.960464477539063e-08f); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, has_infinity = true;
  static constexpr int digits = 8;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
};

template <class T, class U> T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type<T>(u) needs sizeof(T) == sizeof(U)");
  T t; std::memcpy(static_cast<void*>(&t), &u, sizeof(T)); return t;
}

// ------------------------------------------------------------------ math
namespace detail {
template <class A, class B> struct common {
  using type = std::conditional_t<std::is_same<A, B>::value, A, decltype(std::declval<A>() + std::declval<B>())>;
};
template <class A, class B, class F> auto ew2(const A& a, const B& b, F f) {
  if constexpr (::msl::emu::is_vec_v<A> || ::msl::emu::is_vec_v<B>) {
    using T = typename ::msl::emu::binop_elem<A, B>::type;
    constexpr int N = ::msl::emu::binop_n<A, B>();
    auto x = ::msl::emu::bcast<T, N>(a); auto y = ::msl::emu::bcast<T, N>(b);
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r.v[i] = T(f(x.v[i], y.v[i]));
    return r;
  } else {
    return f(a, b);
  }
}
template <class A, class B, class C, class F> auto ew3(const A& a, const B& b, const C& c, F f) {
  if constexpr (::msl::emu::is_vec_v<A> || ::msl::emu::is_vec_v<B> || ::msl::emu::is_vec_v<C>) {
    using V = std::conditional_t<::msl::emu::is_vec_v<A>, A, std::conditional_t<::msl::emu::is_vec_v<B>, B, C>>;
    using T = typename ::msl::emu::vec_traits<std::decay_t<V>>::elem;
    constexpr int N = ::msl::emu::vec_traits<std::decay_t<V>>::n;
    auto x = ::msl::emu::bcast<T, N>(a); auto y = ::msl::emu::bcast<T, N>(b); auto z = ::msl::emu::bcast<T, N>(c);
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r.v[i] = T(f(x.v[i], y.v[i], z.v[i]));
    return r;
  } else {
    return f(a, b, c);
  }
}
}  // namespace detail

// unary float functions: float/half scalars (computed in float) + vectors.
// Apple's metal_stdlib has no bfloat overloads (MLX adds them in bf16_math.h);
// define MSL_EMU_BFLOAT_MATH to get them from the emulator instead.
#if defined(MSL_EMU_BFLOAT_MATH)
#define MSL_EMU_BF_MATH(...) __VA_ARGS__
#else
#define MSL_EMU_BF_MATH(...)
#endif
#define MSL_EMU_UNARY(name, expr)                                                              \
  inline float name(float x) { return (expr); }                                                \
  inline half name(half h) { float x = float(h); return half(expr); }                          \
  MSL_EMU_BF_MATH(inline bfloat name(bfloat b) { float x = float(b); return bfloat(expr); })   \
  template <class V, std::enable_if_t<::msl::emu::is_vec_v<V>, int> = 0> auto name(const V& v) { \
    auto r = as_vec(v); for (auto& e : r.v) e = name(e); return r;                             \
  }
MSL_EMU_UNARY(exp, std::exp(x)) MSL_EMU_UNARY(exp2, std::exp2(x)) MSL_EMU_UNARY(exp10, std::pow(10.0f, x))
MSL_EMU_UNARY(log, std::log(x)) MSL_EMU_UNARY(log2, std::log2(x)) MSL_EMU_UNARY(log10, std::log10(x))
MSL_EMU_UNARY(sqrt, std::sqrt(x)) MSL_EMU_UNARY(rsqrt, 1.0f / std::sqrt(x)) MSL_EMU_UNARY(recip, 1.0f / x)
MSL_EMU_UNARY(sin, std::sin(x)) MSL_EMU_UNARY(cos, std::cos(x)) MSL_EMU_UNARY(tan, std::tan(x))
MSL_EMU_UNARY(asin, std::asin(x)) MSL_EMU_UNARY(acos, std::acos(x)) MSL_EMU_UNARY(atan, std::atan(x))
MSL_EMU_UNARY(sinh, std::sinh(x)) MSL_EMU_UNARY(cosh, std::cosh(x)) MSL_EMU_UNARY(tanh, std::tanh(x))
MSL_EMU_UNARY(asinh, std::asinh(x)) MSL_EMU_UNARY(acosh, std::acosh(x)) MSL_EMU_UNARY(atanh, std::atanh(x))
MSL_EMU_UNARY(floor, std::floor(x)) MSL_EMU_UNARY(ceil, std::ceil(x)) MSL_EMU_UNARY(round, std::round(x))
MSL_EMU_UNARY(rint, std::nearbyint(x)) MSL_EMU_UNARY(trunc, std::trunc(x)) MSL_EMU_UNARY(fabs, std::fabs(x))
MSL_EMU_UNARY(fract, x - std::floor(x)) MSL_EMU_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSL_EMU_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f))
MSL_EMU_UNARY(sinpi, std::sin(float(M_PI) * x)) MSL_EMU_UNARY(cospi, std::cos(float(M_PI) * x))
#undef MSL_EMU_UNARY
inline float abs(float x) { return std::fabs(x); }
inline half abs(half x) { return half(std::fabs(float(x))); }
MSL_EMU_BF_MATH(inline bfloat abs(bfloat x) { return bfloat(std::fabs(float(x))); })
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0> I abs(I x) { return x < 0 ? I(-x) : x; }
template <class V, std::enable_if_t<::msl::emu::is_vec_v<V>, int> = 0> auto abs(const V& v) {
  auto r = as_vec(v); for (auto& e : r.v) e = abs(e); return r;
}
#define MSL_EMU_PRED(name, expr)                                                               \
  inline bool name(float x) { return (expr); }                                                 \
  inline bool name(half h) { float x = float(h); return (expr); }                              \
  MSL_EMU_BF_MATH(inline bool name(bfloat b) { float x = float(b); return (expr); })          \
  template <class V, std::enable_if_t<::msl::emu::is_vec_v<V>, int> = 0> auto name(const V& v) { \
    auto t = as_vec(v); constexpr int N = ::msl::emu::vec_traits<std::decay_t<V>>::n;          \
    vec<bool, N> r; for (int i = 0; i < N; ++i) r.v[i] = name(t.v[i]); return r;               \
  }
MSL_EMU_PRED(isnan, std::isnan(x)) MSL_EMU_PRED(isinf, std::isinf(x)) MSL_EMU_PRED(isfinite, std::isfinite(x))
MSL_EMU_PRED(signbit, std::signbit(x)) MSL_EMU_PRED(isnormal, std::isnormal(x))
#undef MSL_EMU_PRED

namespace detail {
template <class X> float f32(X x) { return float(x); }
template <class A, class B> using common_t = typename common<A, B>::type;
// Function constants are plain values in MSL (`min(n, blocks)` with `constant
// int blocks [[function_constant(0)]]`); here they are objects: unwrap them.
template <class X> const X& fcv(const X& x) { return x; }
template <class T> const T& fcv(const ::msl::emu::function_constant<T>& x) { return x.get(); }
template <class T> const T& fcv(const ::msl::emu::derived_constant<T>& x) { return x.get(); }
template <class X> using fcv_t = std::decay_t<decltype(fcv(std::declval<const X&>()))>;
template <class X>
constexpr bool math_arg_v = ::msl::emu::is_scalar_like<fcv_t<X>>::value || ::msl::emu::is_vec_v<fcv_t<X>>;
}
#define MSL_EMU_BINARY(name, expr)                                                              \
  template <class A, class B, std::enable_if_t<detail::math_arg_v<A> && detail::math_arg_v<B>, int> = 0> \
  auto name(const A& a_, const B& b_) {                                                         \
    return detail::ew2(detail::fcv(a_), detail::fcv(b_), [](auto a, auto b) {                  \
      using R = detail::common_t<decltype(a), decltype(b)>;                                     \
      return R(expr);                                                                           \
    });                                                                                         \
  }
// min/max follow fmin/fmax NaN rules for floating point, plain compare for integers
MSL_EMU_BINARY(max, (::msl::emu::is_float_like<R>::value ? R(std::fmax(float(a), float(b))) : (a < b ? R(b) : R(a))))
MSL_EMU_BINARY(min, (::msl::emu::is_float_like<R>::value ? R(std::fmin(float(a), float(b))) : (b < a ? R(b) : R(a))))
MSL_EMU_BINARY(fmax, std::fmax(float(a), float(b))) MSL_EMU_BINARY(fmin, std::fmin(float(a), float(b)))
MSL_EMU_BINARY(pow, std::pow(float(a), float(b))) MSL_EMU_BINARY(powr, std::pow(float(a), float(b)))
MSL_EMU_BINARY(fmod, std::fmod(float(a), float(b))) MSL_EMU_BINARY(atan2, std::atan2(float(a), float(b)))
MSL_EMU_BINARY(copysign, std::copysign(float(a), float(b))) MSL_EMU_BINARY(fdim, std::fdim(float(a), float(b)))
MSL_EMU_BINARY(step, float(b) < float(a) ? 0.0f : 1.0f)  // step(edge, x)
MSL_EMU_BINARY(divide, float(a) / float(b))
MSL_EMU_BINARY(absdiff, (a > b ? a - b : b - a))
MSL_EMU_BINARY(mulhi, (sizeof(R) == 4 ? R((int64_t(a) * int64_t(b)) >> 32) : R(0)))
#undef MSL_EMU_BINARY

template <class A, class B, class C> auto clamp(const A& x, const B& lo, const C& hi) { return min(max(x, lo), hi); }
template <class A, class B, class C> auto fma(const A& a, const B& b, const C& c) {
  return detail::ew3(detail::fcv(a), detail::fcv(b), detail::fcv(c), [](auto x, auto y, auto z) {
    using R = detail::common_t<detail::common_t<decltype(x), decltype(y)>, decltype(z)>;
    return R(std::fma(float(x), float(y), float(z)));
  });
}
template <class A, class B, class C> auto mad(const A& a, const B& b, const C& c) { return fma(a, b, c); }
template <class A, class B, class C> auto mix(const A& x, const B& y, const C& t) {
  return detail::ew3(detail::fcv(x), detail::fcv(y), detail::fcv(t), [](auto a, auto b, auto c) {
    using R = detail::common_t<decltype(a), decltype(b)>;
    return R(float(a) + (float(b) - float(a)) * float(c));
  });
}
template <class A, class B, class C> auto smoothstep(const A& e0, const B& e1, const C& x) {
  return detail::ew3(detail::fcv(e0), detail::fcv(e1), detail::fcv(x), [](auto a, auto b, auto c) {
    float t = std::fmin(std::fmax((float(c) - float(a)) / (float(b) - float(a)), 0.0f), 1.0f);
    return decltype(c)(t * t * (3.0f - 2.0f * t));
  });
}
// select(a, b, c): c ? b : a (component-wise for vectors)
template <class A, class B, class C> auto select(const A& a, const B& b, const C& c) {
  if constexpr (::msl::emu::is_vec_v<A>) {
    auto x = as_vec(a); auto y = as_vec(b);
    constexpr int N = ::msl::emu::vec_traits<std::decay_t<A>>::n;
    for (int i = 0; i < N; ++i) {
      bool ci; if constexpr (::msl::emu::is_vec_v<C>) ci = as_vec(c).v[i]; else ci = c;
      if (ci) x.v[i] = y.v[i];
    }
    return x;
  } else {
    return c ? A(b) : a;
  }
}
template <class V> bool all(const V& v) { auto t = as_vec(v); for (auto e : t.v) if (!e) return false; return true; }
template <class V> bool any(const V& v) { auto t = as_vec(v); for (auto e : t.v) if (e) return true; return false; }
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

template <class A, class B> auto dot(const A& a, const B& b) {
  auto x = as_vec(a); auto y = as_vec(b);
  using T = typename ::msl::emu::vec_traits<decltype(x)>::elem;
  T s = T(0);
  for (int i = 0; i < ::msl::emu::vec_traits<decltype(x)>::n; ++i) s = T(s + x.v[i] * y.v[i]);
  return s;
}
template <class A> auto length(const A& a) { return sqrt(dot(a, a)); }
template <class A> auto length_squared(const A& a) { return dot(a, a); }
template <class A, class B> auto distance(const A& a, const B& b) { return length(as_vec(a) - as_vec(b)); }
template <class A> auto normalize(const A& a) { auto x = as_vec(a); return x * rsqrt(dot(x, x)); }
template <class A, class B> auto cross(const A& a, const B& b) {
  auto x = as_vec(a); auto y = as_vec(b);
  return decltype(x)(x.y * y.z - x.z * y.y, x.z * y.x - x.x * y.z, x.x * y.y - x.y * y.x);
}

// integer helpers
template <class I> I popcount(I x) { return I(__builtin_popcountll((unsigned long long)(std::make_unsigned_t<I>)x)); }
template <class I> I clz(I x) {
  using U = std::make_unsigned_t<I>; constexpr int B = sizeof(I) * 8;
  return x == 0 ? I(B) : I(__builtin_clzll((unsigned long long)(U)x) - (64 - B));
}
template <class I> I ctz(I x) { return x == 0 ? I(sizeof(I) * 8) : I(__builtin_ctzll((unsigned long long)x)); }
template <class I> I extract_bits(I x, uint offset, uint bits) {
  using U = std::make_unsigned_t<I>;
  U m = bits >= sizeof(I) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
  return I((U(x) >> offset) & m);
}
template <class I> I reverse_bits(I x) {
  using U = std::make_unsigned_t<I>; U u = U(x), r = 0;
  for (unsigned i = 0; i < sizeof(I) * 8; ++i) { r = U((r << 1) | (u & 1)); u >>= 1; }
  return I(r);
}

// precise:: and fast:: variants map to the same (libm-accurate) functions.
// NOTE: on the GPU, metal::fast (the default under -ffast-math) is *less*
// accurate than this; compare with tolerances, not bit-exactly.
// using-*declarations* (not a using-directive): code such as MLX's bf16_math.h adds
// overloads to metal::fast / metal::precise, and qualified lookup would then stop
// looking through a using-directive and silently pick the bfloat overload.
namespace precise { using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2; using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::recip; using metal::sin; using metal::cos; using metal::tan; using metal::asin; using metal::acos; using metal::atan; using metal::sinh; using metal::cosh; using metal::tanh; using metal::asinh; using metal::acosh; using metal::atanh; using metal::floor; using metal::ceil; using metal::round; using metal::rint; using metal::trunc; using metal::fabs; using metal::fract; using metal::saturate; using metal::sign; using metal::sinpi; using metal::cospi; using metal::abs; using metal::max; using metal::min; using metal::fmax; using metal::fmin; using metal::pow; using metal::powr; using metal::fmod; using metal::atan2; using metal::copysign; using metal::fdim; using metal::step; using metal::divide; using metal::clamp; using metal::fma; using metal::mad; using metal::mix; using metal::smoothstep; using metal::normalize; using metal::length; using metal::distance; using metal::isnan; using metal::isinf; using metal::isfinite; }
namespace fast { using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2; using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::recip; using metal::sin; using metal::cos; using metal::tan; using metal::asin; using metal::acos; using metal::atan; using metal::sinh; using metal::cosh; using metal::tanh; using metal::asinh; using metal::acosh; using metal::atanh; using metal::floor; using metal::ceil; using metal::round; using metal::rint; using metal::trunc; using metal::fabs; using metal::fract; using metal::saturate; using metal::sign; using metal::sinpi; using metal::cospi; using metal::abs; using metal::max; using metal::min; using metal::fmax; using metal::fmin; using metal::pow; using metal::powr; using metal::fmod; using metal::atan2; using metal::copysign; using metal::fdim; using metal::step; using metal::divide; using metal::clamp; using metal::fma; using metal::mad; using metal::mix; using metal::smoothstep; using metal::normalize; using metal::length; using metal::distance; using metal::isnan; using metal::isinf; using metal::isfinite; }

// ------------------------------------------------------------ barriers
enum class mem_flags : int {
  mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
  mem_threadgroup_imageblock = 8, mem_object_data = 16
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::msl::emu::barrier(0, file, line);
}
inline void simdgroup_barrier(mem_flags, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::msl::emu::barrier(1, file, line);
}
enum memory_order { memory_order_relaxed, memory_order_seq_cst };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };
inline void atomic_thread_fence(mem_flags, memory_order, thread_scope = thread_scope::thread_scope_device) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// ------------------------------------------------------------ SIMD-group
namespace detail {
enum SimdOp { OP_SUM = 1, OP_PROD, OP_MIN, OP_MAX, OP_AND, OP_OR, OP_XOR, OP_SHUFFLE, OP_PREFIX, OP_VOTE, OP_QUAD };
constexpr int W = ::msl::emu::kSimdWidth;
template <class T> ::msl::emu::SimdView xchg(const T& x, int op, const char* f, int l) {
  static_assert(sizeof(T) <= ::msl::emu::kMaxSimdPayload, "SIMD payload too large for the emulator");
  return ::msl::emu::simd_exchange(&x, sizeof(T), op, f, l);
}
template <class T> T at(const ::msl::emu::SimdView& v, int lane) {
  T t; std::memcpy(static_cast<void*>(&t), v.slots + lane * ::msl::emu::kMaxSimdPayload, sizeof(T)); return t;
}
inline bool active(const ::msl::emu::SimdView& v, int lane) { return lane >= 0 && lane < W && ((v.mask >> lane) & 1u); }
// Butterfly (shuffle_xor 16,8,4,2,1) reduction -- the usual tree shape on
// SIMD hardware.  Inactive lanes contribute `ident` (or, when no identity is
// given, the value of the first active lane).  The first lane to get here
// computes the results of all lanes; the others read theirs.
template <class T, class F> T butterfly(const ::msl::emu::SimdView& v, F op, const T* ident) {
  if (!*v.result_ready) {
    T vals[W];
    int first = __builtin_ctz(v.mask);
    for (int i = 0; i < W; ++i) vals[i] = active(v, i) ? at<T>(v, i) : (ident ? *ident : at<T>(v, first));
    for (int k = W / 2; k >= 1; k >>= 1) {
      T nv[W];
      for (int i = 0; i < W; ++i) nv[i] = op(vals[i], vals[i ^ k]);
      for (int i = 0; i < W; ++i) vals[i] = nv[i];
    }
    std::memcpy(static_cast<void*>(v.result), vals, sizeof(vals));
    *v.result_ready = true;
  }
  T r;
  std::memcpy(static_cast<void*>(&r), v.result + v.lane * sizeof(T), sizeof(T));
  return r;
}
template <class T> T zero() { return T(0); }
template <class T> T one() { return T(1); }
}  // namespace detail

#define MSL_SITE_ARGS const char* file_ = __builtin_FILE(), int line_ = __builtin_LINE()
template <class T> T simd_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SUM, file_, line_); T z = detail::zero<T>();
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return T(a + b); }, &z);
}
template <class T> T simd_product(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_PROD, file_, line_); T o = detail::one<T>();
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return T(a * b); }, &o);
}
template <class T> T simd_max(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_MAX, file_, line_);
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return T(max(a, b)); }, nullptr);
}
template <class T> T simd_min(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_MIN, file_, line_);
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return T(min(a, b)); }, nullptr);
}
namespace detail {
template <class T> T bitop(const T& a, const T& b, int op) {
  if constexpr (std::is_integral<T>::value || std::is_same<T, bool>::value) {
    return op == 0 ? T(a & b) : op == 1 ? T(a | b) : T(a ^ b);
  } else {
    unsigned char x[sizeof(T)], y[sizeof(T)];
    std::memcpy(x, &a, sizeof(T)); std::memcpy(y, &b, sizeof(T));
    for (size_t i = 0; i < sizeof(T); ++i) x[i] = op == 0 ? (x[i] & y[i]) : op == 1 ? (x[i] | y[i]) : (x[i] ^ y[i]);
    T r; std::memcpy(static_cast<void*>(&r), x, sizeof(T)); return r;
  }
}
}
template <class T> T simd_and(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_AND, file_, line_);
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 0); }, nullptr);
}
template <class T> T simd_or(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_OR, file_, line_); T z = detail::zero<T>();
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 1); }, &z);
}
template <class T> T simd_xor(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_XOR, file_, line_); T z = detail::zero<T>();
  return detail::butterfly<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 2); }, &z);
}
template <class T> T simd_prefix_exclusive_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_PREFIX, file_, line_); T s = detail::zero<T>();
  for (int i = 0; i < int(v.lane); ++i) if (detail::active(v, i)) s = T(s + detail::at<T>(v, i));
  return s;
}
template <class T> T simd_prefix_inclusive_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_PREFIX, file_, line_); T s = detail::zero<T>();
  for (int i = 0; i <= int(v.lane); ++i) if (detail::active(v, i)) s = T(s + detail::at<T>(v, i));
  return s;
}
template <class T> T simd_prefix_exclusive_product(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_PREFIX, file_, line_); T s = detail::one<T>();
  for (int i = 0; i < int(v.lane); ++i) if (detail::active(v, i)) s = T(s * detail::at<T>(v, i));
  return s;
}
namespace detail {
template <class T> T read_lane(const ::msl::emu::SimdView& v, int src, const T& self, const char* what) {
  if (!active(v, src)) { ::msl::emu::simd_inactive_read(src, what); return self; }
  return at<T>(v, src);
}
}
template <class T> T simd_shuffle(T x, ushort lane, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::read_lane<T>(v, lane, x, "simd_shuffle");
}
template <class T> T simd_broadcast(T x, ushort lane, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::read_lane<T>(v, lane, x, "simd_broadcast");
}
template <class T> T simd_broadcast_first(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::at<T>(v, __builtin_ctz(v.mask));
}
// shuffle_down: the upper `delta` lanes keep their own value
template <class T> T simd_shuffle_down(T x, ushort delta, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  int src = int(v.lane) + delta;
  return src >= detail::W ? x : detail::read_lane<T>(v, src, x, "simd_shuffle_down");
}
// shuffle_up: the lower `delta` lanes keep their own value
template <class T> T simd_shuffle_up(T x, ushort delta, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  int src = int(v.lane) - delta;
  return src < 0 ? x : detail::read_lane<T>(v, src, x, "simd_shuffle_up");
}
template <class T> T simd_shuffle_xor(T x, ushort mask, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) ^ mask) & (detail::W - 1), x, "simd_shuffle_xor");
}
template <class T> T simd_shuffle_rotate_down(T x, ushort delta, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) + delta) % detail::W, x, "simd_shuffle_rotate_down");
}
template <class T> T simd_shuffle_rotate_up(T x, ushort delta, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_SHUFFLE, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) + detail::W - delta % detail::W) % detail::W, x, "simd_shuffle_rotate_up");
}
template <class T> T simd_shuffle_and_fill_down(T x, T fill, ushort delta, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_SHUFFLE, file_, line_);
  int src = int(v.lane) + delta;
  if (src < detail::W) return detail::read_lane<P>(v, src, p, "simd_shuffle_and_fill_down").a;
  return detail::read_lane<P>(v, src - detail::W, p, "simd_shuffle_and_fill_down").b;
}
template <class T> T simd_shuffle_and_fill_down(T x, T fill, ushort delta, ushort modulo, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_SHUFFLE, file_, line_);
  int base = int(v.lane) / modulo * modulo, src = int(v.lane) % modulo + delta;
  if (src < modulo) return detail::read_lane<P>(v, base + src, p, "simd_shuffle_and_fill_down").a;
  return detail::read_lane<P>(v, base + src - modulo, p, "simd_shuffle_and_fill_down").b;
}
template <class T> T simd_shuffle_and_fill_up(T x, T fill, ushort delta, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_SHUFFLE, file_, line_);
  int src = int(v.lane) - delta;
  if (src >= 0) return detail::read_lane<P>(v, src, p, "simd_shuffle_and_fill_up").a;
  return detail::read_lane<P>(v, src + detail::W, p, "simd_shuffle_and_fill_up").b;
}
template <class T> T simd_shuffle_and_fill_up(T x, T fill, ushort delta, ushort modulo, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_SHUFFLE, file_, line_);
  int base = int(v.lane) / modulo * modulo, src = int(v.lane) % modulo - delta;
  if (src >= 0) return detail::read_lane<P>(v, base + src, p, "simd_shuffle_and_fill_up").a;
  return detail::read_lane<P>(v, base + src + modulo, p, "simd_shuffle_and_fill_up").b;
}
struct simd_vote {
  using vote_t = uint64_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xffffffffull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_VOTE, file_, line_); uint64_t m = 0;
  for (int i = 0; i < detail::W; ++i) if (detail::active(v, i) && detail::at<bool>(v, i)) m |= 1ull << i;
  return simd_vote(m);
}
inline bool simd_all(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_VOTE, file_, line_);
  for (int i = 0; i < detail::W; ++i) if (detail::active(v, i) && !detail::at<bool>(v, i)) return false;
  return true;
}
inline bool simd_any(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_VOTE, file_, line_);
  for (int i = 0; i < detail::W; ++i) if (detail::active(v, i) && detail::at<bool>(v, i)) return true;
  return false;
}
inline bool simd_is_first(MSL_SITE_ARGS) {
  auto v = detail::xchg(0, detail::OP_VOTE, file_, line_);
  return int(v.lane) == __builtin_ctz(v.mask);
}
inline simd_vote simd_active_threads_mask(MSL_SITE_ARGS) {
  auto v = detail::xchg(0, detail::OP_VOTE, file_, line_); return simd_vote(v.mask);
}
// quad-group (4 lanes) variants
namespace detail {
// Reduction over the active lanes of the caller's quad, butterfly (xor 2, 1);
// inactive lanes contribute `ident` (or the quad's first active lane).
template <class T, class F> T quad_reduce(const ::msl::emu::SimdView& v, F op, const T* ident) {
  const int b = int(v.lane) & ~3;
  int first = b;
  while (!active(v, first)) ++first;
  T vals[4];
  for (int i = 0; i < 4; ++i) vals[i] = active(v, b + i) ? at<T>(v, b + i) : (ident ? *ident : at<T>(v, first));
  for (int k = 2; k >= 1; k >>= 1) {
    T nv[4];
    for (int i = 0; i < 4; ++i) nv[i] = op(vals[i], vals[i ^ k]);
    for (int i = 0; i < 4; ++i) vals[i] = nv[i];
  }
  return vals[v.lane & 3];
}
inline uint32_t quad_bits(const ::msl::emu::SimdView& v, uint32_t lanes) { return (lanes >> (v.lane & ~3u)) & 0xfu; }
}  // namespace detail
template <class T> T quad_shuffle(T x, ushort l, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) & ~3) | (l & 3), x, "quad_shuffle");
}
template <class T> T quad_broadcast(T x, ushort l, MSL_SITE_ARGS) { return quad_shuffle(x, l, file_, line_); }
template <class T> T quad_broadcast_first(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::at<T>(v, (int(v.lane) & ~3) + __builtin_ctz(detail::quad_bits(v, v.mask)));
}
template <class T> T quad_shuffle_xor(T x, ushort m, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) & ~3) | ((int(v.lane) ^ m) & 3), x, "quad_shuffle_xor");
}
template <class T> T quad_shuffle_down(T x, ushort d, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  int q = int(v.lane) & 3; return q + d >= 4 ? x : detail::read_lane<T>(v, int(v.lane) + d, x, "quad_shuffle_down");
}
template <class T> T quad_shuffle_up(T x, ushort d, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  int q = int(v.lane) & 3; return q < d ? x : detail::read_lane<T>(v, int(v.lane) - d, x, "quad_shuffle_up");
}
template <class T> T quad_shuffle_rotate_down(T x, ushort d, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) & ~3) | ((int(v.lane) + d) & 3), x, "quad_shuffle_rotate_down");
}
template <class T> T quad_shuffle_rotate_up(T x, ushort d, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::read_lane<T>(v, (int(v.lane) & ~3) | ((int(v.lane) + 4 - d % 4) & 3), x, "quad_shuffle_rotate_up");
}
template <class T> T quad_shuffle_and_fill_down(T x, T fill, ushort delta, ushort modulo = 4, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_QUAD, file_, line_);
  int q = int(v.lane) & 3, base = (int(v.lane) & ~3) + q / modulo * modulo, src = q % modulo + delta;
  if (src < modulo) return detail::read_lane<P>(v, base + src, p, "quad_shuffle_and_fill_down").a;
  return detail::read_lane<P>(v, base + src - modulo, p, "quad_shuffle_and_fill_down").b;
}
template <class T> T quad_shuffle_and_fill_up(T x, T fill, ushort delta, ushort modulo = 4, MSL_SITE_ARGS) {
  struct P { T a, b; } p{x, fill};
  auto v = detail::xchg(p, detail::OP_QUAD, file_, line_);
  int q = int(v.lane) & 3, base = (int(v.lane) & ~3) + q / modulo * modulo, src = q % modulo - delta;
  if (src >= 0) return detail::read_lane<P>(v, base + src, p, "quad_shuffle_and_fill_up").a;
  return detail::read_lane<P>(v, base + src + modulo, p, "quad_shuffle_and_fill_up").b;
}
template <class T> T quad_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T z = detail::zero<T>();
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return T(a + b); }, &z);
}
template <class T> T quad_product(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T o = detail::one<T>();
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return T(a * b); }, &o);
}
template <class T> T quad_max(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return T(max(a, b)); }, nullptr);
}
template <class T> T quad_min(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return T(min(a, b)); }, nullptr);
}
template <class T> T quad_and(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_);
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 0); }, nullptr);
}
template <class T> T quad_or(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T z = detail::zero<T>();
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 1); }, &z);
}
template <class T> T quad_xor(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T z = detail::zero<T>();
  return detail::quad_reduce<T>(v, [](const T& a, const T& b) { return detail::bitop(a, b, 2); }, &z);
}
template <class T> T quad_prefix_exclusive_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T s = detail::zero<T>();
  for (int i = int(v.lane) & ~3; i < int(v.lane); ++i) if (detail::active(v, i)) s = T(s + detail::at<T>(v, i));
  return s;
}
template <class T> T quad_prefix_inclusive_sum(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T s = detail::zero<T>();
  for (int i = int(v.lane) & ~3; i <= int(v.lane); ++i) if (detail::active(v, i)) s = T(s + detail::at<T>(v, i));
  return s;
}
template <class T> T quad_prefix_exclusive_product(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T s = detail::one<T>();
  for (int i = int(v.lane) & ~3; i < int(v.lane); ++i) if (detail::active(v, i)) s = T(s * detail::at<T>(v, i));
  return s;
}
template <class T> T quad_prefix_inclusive_product(T x, MSL_SITE_ARGS) {
  auto v = detail::xchg(x, detail::OP_QUAD, file_, line_); T s = detail::one<T>();
  for (int i = int(v.lane) & ~3; i <= int(v.lane); ++i) if (detail::active(v, i)) s = T(s * detail::at<T>(v, i));
  return s;
}
// quad_vote: bit k is lane k of the caller's quad
struct quad_vote {
  using vote_t = ushort;
  vote_t v;
  explicit constexpr quad_vote(vote_t x = 0) : v(x) {}
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xf; }
  bool any() const { return v != 0; }
};
inline quad_vote quad_ballot(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_QUAD, file_, line_); uint32_t m = 0;
  for (int i = 0; i < 4; ++i) {
    int l = (int(v.lane) & ~3) + i;
    if (detail::active(v, l) && detail::at<bool>(v, l)) m |= 1u << i;
  }
  return quad_vote(ushort(m));
}
inline quad_vote quad_active_threads_mask(MSL_SITE_ARGS) {
  auto v = detail::xchg(0, detail::OP_QUAD, file_, line_); return quad_vote(ushort(detail::quad_bits(v, v.mask)));
}
inline bool quad_all(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_QUAD, file_, line_);
  for (int l = int(v.lane) & ~3, e = l + 4; l < e; ++l) if (detail::active(v, l) && !detail::at<bool>(v, l)) return false;
  return true;
}
inline bool quad_any(bool b, MSL_SITE_ARGS) {
  auto v = detail::xchg(b, detail::OP_QUAD, file_, line_);
  for (int l = int(v.lane) & ~3, e = l + 4; l < e; ++l) if (detail::active(v, l) && detail::at<bool>(v, l)) return true;
  return false;
}
inline bool quad_is_first(MSL_SITE_ARGS) {
  auto v = detail::xchg(0, detail::OP_QUAD, file_, line_);
  return int(v.lane & 3) == __builtin_ctz(detail::quad_bits(v, v.mask));
}
inline bool quad_is_helper_thread() { return false; }  // compute kernels have no helper threads
#undef MSL_SITE_ARGS

// ------------------------------------------------------------- atomics
template <class T> struct atomic {
  static_assert(sizeof(std::atomic<T>) == sizeof(T), "atomic layout");
  std::atomic<T> a;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<uint>;
using atomic_bool = atomic<bool>;
using atomic_float = atomic<float>;
template <class T, class U> void atomic_store_explicit(atomic<T>* p, U v, memory_order) { p->a.store(T(v), std::memory_order_relaxed); }
template <class T> T atomic_load_explicit(const atomic<T>* p, memory_order) { return p->a.load(std::memory_order_relaxed); }
template <class T, class U> T atomic_exchange_explicit(atomic<T>* p, U v, memory_order) { return p->a.exchange(T(v), std::memory_order_relaxed); }
template <class T, class F> T atomic_rmw(atomic<T>* p, F f) {
  T old = p->a.load(std::memory_order_relaxed);
  while (!p->a.compare_exchange_weak(old, f(old), std::memory_order_relaxed)) {}
  return old;
}
template <class T, class U> T atomic_fetch_add_explicit(atomic<T>* p, U v, memory_order) { return atomic_rmw(p, [&](T o) { return T(o + T(v)); }); }
template <class T, class U> T atomic_fetch_sub_explicit(atomic<T>* p, U v, memory_order) { return atomic_rmw(p, [&](T o) { return T(o - T(v)); }); }
template <class T, class U> T atomic_fetch_max_explicit(atomic<T>* p, U v, memory_order) { return atomic_rmw(p, [&](T o) { return o < T(v) ? T(v) : o; }); }
template <class T, class U> T atomic_fetch_min_explicit(atomic<T>* p, U v, memory_order) { return atomic_rmw(p, [&](T o) { return T(v) < o ? T(v) : o; }); }
template <class T, class U> T atomic_fetch_or_explicit(atomic<T>* p, U v, memory_order) { return p->a.fetch_or(T(v), std::memory_order_relaxed); }
template <class T, class U> T atomic_fetch_and_explicit(atomic<T>* p, U v, memory_order) { return p->a.fetch_and(T(v), std::memory_order_relaxed); }
template <class T, class U> T atomic_fetch_xor_explicit(atomic<T>* p, U v, memory_order) { return p->a.fetch_xor(T(v), std::memory_order_relaxed); }
template <class T, class U> bool atomic_compare_exchange_weak_explicit(atomic<T>* p, T* expected, U desired, memory_order, memory_order) {
  return p->a.compare_exchange_weak(*expected, T(desired), std::memory_order_relaxed);
}

using ::msl::emu::is_function_constant_defined;

// <metal_logging> (Metal 3.2): accepted, printed to stderr when MSL_EMU_LOG is set
struct os_log {
  constexpr os_log(const char*, const char*) {}
  template <class... A> void log(const char* fmt, A... a) const { if (getenv("MSL_EMU_LOG")) fprintf(stderr, fmt, a...); }
  template <class... A> void log_debug(const char* fmt, A... a) const { log(fmt, a...); }
  template <class... A> void log_info(const char* fmt, A... a) const { log(fmt, a...); }
  template <class... A> void log_error(const char* fmt, A... a) const { log(fmt, a...); }
};
}  // namespace metal

// Apple-internal builtins that real code (MLX's bf16_math.h, nax.h) calls directly.
#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#define __METAL_MAYBE_FAST_MATH__ true
#define MSL_EMU_FWD1(n) template <class T, class... M> auto __metal_##n(T x, M...) { return metal::n(x); }
#define MSL_EMU_FWD2(n) template <class T, class U, class... M> auto __metal_##n(T x, U y, M...) { return metal::n(x, y); }
MSL_EMU_FWD1(exp) MSL_EMU_FWD1(exp2) MSL_EMU_FWD1(exp10) MSL_EMU_FWD1(log) MSL_EMU_FWD1(log2) MSL_EMU_FWD1(log10)
MSL_EMU_FWD1(sqrt) MSL_EMU_FWD1(rsqrt) MSL_EMU_FWD1(sin) MSL_EMU_FWD1(cos) MSL_EMU_FWD1(tan) MSL_EMU_FWD1(asin)
MSL_EMU_FWD1(acos) MSL_EMU_FWD1(atan) MSL_EMU_FWD1(sinh) MSL_EMU_FWD1(cosh) MSL_EMU_FWD1(tanh) MSL_EMU_FWD1(asinh)
MSL_EMU_FWD1(acosh) MSL_EMU_FWD1(atanh) MSL_EMU_FWD1(floor) MSL_EMU_FWD1(ceil) MSL_EMU_FWD1(round) MSL_EMU_FWD1(rint)
MSL_EMU_FWD1(trunc) MSL_EMU_FWD1(fabs) MSL_EMU_FWD1(fract) MSL_EMU_FWD1(sinpi) MSL_EMU_FWD1(cospi)
MSL_EMU_FWD2(pow) MSL_EMU_FWD2(powr) MSL_EMU_FWD2(fmod) MSL_EMU_FWD2(atan2) MSL_EMU_FWD2(fmax) MSL_EMU_FWD2(fmin)
MSL_EMU_FWD2(copysign) MSL_EMU_FWD2(fdim) MSL_EMU_FWD2(divide)
template <class T, class... M> T __metal_tanpi(T x, M...) { return T(std::tan(float(M_PI) * float(x))); }
template <class T, class... M> T __metal_fma(T a, T b, T c, M...) { return T(std::fma(float(a), float(b), float(c))); }
template <class T, class... M> T __metal_fmax3(T a, T b, T c, M...) { return T(std::fmax(std::fmax(float(a), float(b)), float(c))); }
template <class T, class... M> T __metal_fmin3(T a, T b, T c, M...) { return T(std::fmin(std::fmin(float(a), float(b)), float(c))); }
template <class T, class... M> T __metal_fmedian3(T a, T b, T c, M...) {
  float x = float(a), y = float(b), z = float(c);
  return T(std::fmax(std::fmin(x, y), std::fmin(std::fmax(x, y), z)));
}
template <class T, class... M> T __metal_ldexp(T x, int k, M...) { return T(std::ldexp(float(x), k)); }
template <class T, class I> T __metal_frexp(T x, I* e) { int ie; float r = std::frexp(float(x), &ie); *e = I(ie); return T(r); }
template <class T> T __metal_nextafter(T x, T y) { return T(std::nextafter(float(x), float(y))); }
template <class T> T __metal_get_thread_index_in_simdgroup(T) { return T(::msl::emu::current_thread().thread_index_in_simdgroup); }
template <class T> T __metal_get_simdgroup_size(T) { return T(::msl::emu::kSimdWidth); }
#define MSL_EMU_SFWD(n) template <class T, class... A> T __metal_##n(T x, A... a) { return metal::n(x, a...); }
MSL_EMU_SFWD(simd_sum) MSL_EMU_SFWD(simd_product) MSL_EMU_SFWD(simd_max) MSL_EMU_SFWD(simd_min) MSL_EMU_SFWD(simd_xor)
MSL_EMU_SFWD(simd_and) MSL_EMU_SFWD(simd_or) MSL_EMU_SFWD(simd_prefix_exclusive_sum) MSL_EMU_SFWD(simd_prefix_inclusive_sum)
MSL_EMU_SFWD(simd_prefix_exclusive_product) MSL_EMU_SFWD(simd_broadcast) MSL_EMU_SFWD(simd_shuffle)
MSL_EMU_SFWD(simd_shuffle_down) MSL_EMU_SFWD(simd_shuffle_up) MSL_EMU_SFWD(simd_shuffle_xor)
MSL_EMU_SFWD(simd_shuffle_rotate_down) MSL_EMU_SFWD(simd_shuffle_rotate_up) MSL_EMU_SFWD(simd_shuffle_and_fill_down)
MSL_EMU_SFWD(simd_shuffle_and_fill_up)
template <class T> T __metal_simd_prefix_inclusive_product(T x) {
  return T(metal::simd_prefix_exclusive_product(x) * x);
}

// `half` literals (1.5h, 2h): mslpp.py rewrites them to half(1.5f); for
// sources compiled without mslpp, GCC also accepts them through this
// literal operator (suffixes without '_' are reserved -> warning silenced).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wliteral-suffix"
inline half operator"" h(long double x) { return half(float(x)); }
inline half operator"" h(unsigned long long x) { return half(float(x)); }
#pragma GCC diagnostic pop
#endif

// MSL predefined constants
#ifndef MAXFLOAT
#define MAXFLOAT FLT_MAX
#endif
#define HUGE_VALH ((half)INFINITY)
#define MAXHALF 65504.0f
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define HALF_EPSILON 0.0009765625f
#define M_E_F 2.718281828459045f
#define M_LOG2E_F 1.442695040888963f
#define M_LOG10E_F 0.434294481903252f
#define M_LN2_F 0.693147180559945f
#define M_LN10_F 2.302585092994046f
#define M_PI_F 3.141592653589793f
#define M_PI_2_F 1.570796326794897f
#define M_PI_4_F 0.785398163397448f
#define M_1_PI_F 0.318309886183791f
#define M_2_PI_F 0.636619772367581f
#define M_2_SQRTPI_F 1.128379167095513f
#define M_SQRT2_F 1.414213562373095f
#define M_SQRT1_2_F 0.707106781186548f

typedef bfloat bfloat16_t;  // MLX-style name (MLX's own headers typedef it the same way on Metal >= 3.1)

// ------------------------------------------------- MSL keywords (last!)
#define kernel
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define METAL_FUNC inline __attribute__((always_inline))
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 320
#endif
#ifndef __METAL_MACOS__
#define __METAL_MACOS__ 1
#endif
#ifndef __HAVE_BFLOAT__
#define __HAVE_BFLOAT__ 1
#endif
#define MSL_EMU 1
