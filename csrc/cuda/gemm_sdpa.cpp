// eval of the GEMM family: for each block of keys,
//   S = scale * log2(e) * Q K^T      (cuBLAS, f32 out)
//   fold: row max and sum, weights P over S in the query's dtype, O rescaled
//   O += P V                         (cuBLAS, f32 accumulator)
// then out = O / l. Each GEMM is captured into the evaluation's CUDA graph
// (MLX's CaptureContext, as MLX's own matmuls are). Every node reads and
// writes one scratch buffer, so they run in order; the buffer is reused by
// every block and every call on the stream (see stream_scratch): the same
// loop written with MLX ops would allocate per block, and MLX's CUDA backend
// keeps each of those allocations until the whole graph completes.
#include "cuda/gemm_sdpa.h"

#include <cublasLt.h>

#include <algorithm>
#include <list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "cuda/launch.h"
#include "mlx/backend/cuda/utils.h"

namespace mlxq::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(8) << 20;
constexpr float kLog2eHost = 1.4426950408889634f;

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(
        std::string("[mlxq] cuBLASLt ") + what + " failed with status " + std::to_string(int(s)));
  }
}

cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = handles.find(device);
  if (it == handles.end()) {
    cublasLtHandle_t h = nullptr;
    check(cublasLtCreate(&h), "cublasLtCreate");
    it = handles.emplace(device, h).first;
  }
  return it->second;
}

// One column-major GEMM C[m x n] (+)= alpha op(A) op(B), batched by strides,
// A and B in `ab` (f16/bf16), C in f32.
struct Gemm {
  bool trans_a;
  int m, n, k;
  int64_t lda, ldb, ldc;
  int batch;
  int64_t stride_a, stride_b, stride_c;
  cudaDataType_t ab;
  bool accumulate; // beta = 1

  auto key() const {
    return std::make_tuple(
        trans_a, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, int(ab), accumulate);
  }
};

// The heuristic's algorithm for a GEMM shape, looked up once per shape (a
// lookup costs tens of microseconds of host time; a prefill repeats a few
// shapes per layer). Bounded: least recently used shapes are dropped.
class AlgoCache {
 public:
  using Key = decltype(std::declval<Gemm>().key());
  bool find(const Key& k, cublasLtMatmulHeuristicResult_t& out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = map_.find(k);
    if (it == map_.end()) {
      return false;
    }
    order_.splice(order_.begin(), order_, it->second.second);
    out = it->second.first;
    return true;
  }
  void insert(const Key& k, const cublasLtMatmulHeuristicResult_t& r) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (map_.count(k)) {
      return;
    }
    order_.push_front(k);
    map_.emplace(k, std::make_pair(r, order_.begin()));
    if (map_.size() > kCapacity) {
      map_.erase(order_.back());
      order_.pop_back();
    }
  }

 private:
  static constexpr size_t kCapacity = 256;
  std::mutex mutex_;
  std::list<Key> order_;
  std::map<Key, std::pair<cublasLtMatmulHeuristicResult_t, std::list<Key>::iterator>> map_;
};

AlgoCache& algo_cache() {
  static auto* cache = new AlgoCache();
  return *cache;
}

// Descriptors of one GEMM, destroyed with it (creating them is host-only and
// cheap next to the heuristic).
class GemmDescs {
 public:
  explicit GemmDescs(const Gemm& g) {
    check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    check(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
        "set TRANSA");
    check(
        cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
        "set TRANSB");
    a_ = layout(g.ab, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.batch, g.stride_a);
    b_ = layout(g.ab, g.k, g.n, g.ldb, g.batch, g.stride_b);
    c_ = layout(CUDA_R_32F, g.m, g.n, g.ldc, g.batch, g.stride_c);
  }
  ~GemmDescs() {
    cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatmulDescDestroy(op_);
  }
  GemmDescs(const GemmDescs&) = delete;
  GemmDescs& operator=(const GemmDescs&) = delete;

  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;

 private:
  static cublasLtMatrixLayout_t
  layout(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int batch, int64_t stride) {
    cublasLtMatrixLayout_t l = nullptr;
    check(cublasLtMatrixLayoutCreate(&l, t, rows, cols, ld), "MatrixLayoutCreate");
    if (batch > 1) {
      check(
          cublasLtMatrixLayoutSetAttribute(
              l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)),
          "set BATCH_COUNT");
      check(
          cublasLtMatrixLayoutSetAttribute(
              l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
          "set STRIDED_BATCH_OFFSET");
    }
    return l;
  }
};

cublasLtMatmulHeuristicResult_t algo_for(cublasLtHandle_t h, const Gemm& g, const GemmDescs& d) {
  cublasLtMatmulHeuristicResult_t r{};
  if (algo_cache().find(g.key(), r)) {
    return r;
  }
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate");
  const uint64_t ws = kWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(h, d.op_, d.a_, d.b_, d.c_, d.c_, pref, 1, &r, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  check(s, "MatmulAlgoGetHeuristic");
  if (found == 0) {
    throw std::runtime_error(
        "[mlxq] cuBLASLt has no algorithm for an attention GEMM of " + std::to_string(g.m) + "x" +
        std::to_string(g.n) + "x" + std::to_string(g.k));
  }
  algo_cache().insert(g.key(), r);
  return r;
}

// Adds the GEMM to the evaluation's graph as a captured child node, after
// the last writer of `scratch` (which it reads and writes) and of `reads`.
void run_gemm(
    mx::cu::CommandEncoder& enc,
    const Gemm& g,
    const void* a,
    const void* b,
    float* c,
    float alpha,
    void* workspace,
    std::initializer_list<const mx::array*> reads,
    const mx::array& scratch) {
  const cublasLtHandle_t h = lt_handle(enc.device().cuda_device());
  const GemmDescs d(g);
  const cublasLtMatmulHeuristicResult_t r = algo_for(h, g, d);
  const float beta = g.accumulate ? 1.0f : 0.0f;
  for (const auto* x : reads) {
    enc.set_input_array(*x);
  }
  enc.set_input_array(scratch);
  enc.set_output_array(scratch);
  auto capture = enc.capture_context();
  check(
      cublasLtMatmul(
          h,
          d.op_,
          &alpha,
          a,
          d.a_,
          b,
          d.b_,
          &beta,
          c,
          d.c_,
          c,
          d.c_,
          &r.algo,
          workspace,
          kWorkspaceBytes,
          static_cast<cudaStream_t>(enc.stream())),
      "Matmul");
}

// The scratch of every GEMM-family call on one stream: one buffer, grown to
// the largest call so far (a 32k-key prefill of Gemma 4's global layers
// needs ~310 MB) and kept. Every node of a call is registered as reading and
// writing it, so MLX orders the calls of a stream one after another (their
// layers are ordered by data anyway) and no call overwrites scores another
// has yet to read. Calls past kMaxKeptBytes get scratch of their own.
constexpr size_t kMaxKeptBytes = size_t(1) << 30;

mx::array stream_scratch(mx::cu::CommandEncoder& enc, int64_t floats) {
  auto fresh = [&] {
    mx::array a({int(floats)}, mx::float32, nullptr, {});
    allocate(a, enc);
    return a;
  };
  if (size_t(floats) * 4 > kMaxKeptBytes) {
    return fresh();
  }
  return stream_array(
      enc,
      StreamSlot::GemmScratch,
      [&](const mx::array& a) { return int64_t(a.size()) >= floats; },
      fresh);
}

} // namespace

void eval_gemm(
    mx::cu::CommandEncoder& enc,
    const SdpaProblem& p,
    const Plan& plan,
    const std::vector<mx::array>& in,
    const mx::array& dense,
    const void* kd,
    const void* vd,
    mx::array& out,
    mx::array* lse) {
  const mx::array& q = in[kInQ];
  const int G = p.B * p.Hkv, M = p.rows(), D = p.Dk, Dv = p.Dv;
  const int ld = plan.block_keys;
  const int64_t rows = int64_t(G) * M;
  // Scratch, in floats: scores/weights [G, M, ld], output accumulator
  // [G, M, Dv], row max and sum, a contiguous query when q is strided, and
  // cuBLAS's workspace.
  const bool q_contiguous =
      q.flags().row_contiguous && reinterpret_cast<uintptr_t>(mx::gpu_ptr<void>(q)) % 256 == 0;
  const int64_t q_floats = q_contiguous ? 0 : (q.size() + 1) / 2;
  const int64_t s_floats = rows * ld, o_floats = rows * Dv;
  const int64_t ws_floats = int64_t(kWorkspaceBytes / 4);
  // Every part starts 256-byte aligned: cuBLASLt's heuristic assumes that
  // of its operands by default, and its GEMM refuses a pointer that is not
  // (CUBLAS_STATUS_INVALID_VALUE).
  auto aligned = [](int64_t x) { return (x + 63) / 64 * 64; };
  const int64_t total =
      aligned(s_floats) + aligned(o_floats) + 2 * aligned(rows) + aligned(q_floats) + ws_floats;
  mx::array scratch = stream_scratch(enc, total);
  float* s = mx::gpu_ptr<float>(scratch);
  float* o = s + aligned(s_floats);
  float* m = o + aligned(o_floats);
  float* l = m + aligned(rows);
  float* qcopy = l + aligned(rows);
  void* workspace = qcopy + aligned(q_floats);

  const void* qg = mx::gpu_ptr<void>(q);
  if (!q_contiguous) {
    GemmGatherArgs ga{};
    ga.q = qg;
    ga.dst = qcopy;
    std::copy_n(p.q_st, 4, ga.q_st);
    ga.Hq = p.Hq;
    ga.L = p.L;
    ga.D = D;
    ga.total = int64_t(q.size());
    const auto addr = reinterpret_cast<uintptr_t>(qg);
    ga.vec = addr % 16 == 0 && ga.q_st[3] == 1 && D % 8 == 0 && ga.q_st[0] % 8 == 0 &&
        ga.q_st[1] % 8 == 0 && ga.q_st[2] % 8 == 0;
    const int64_t steps = ga.total / (ga.vec ? 8 : 1);
    const unsigned blocks =
        unsigned(std::min<int64_t>((steps + kGemmThreads - 1) / kGemmThreads, 32L * sm_count()));
    launch(
        enc,
        gemm_gather_kernel(),
        dim3(blocks),
        dim3(kGemmThreads),
        0,
        ga,
        {&q, &scratch},
        {&scratch});
    qg = qcopy;
  }

  const cudaDataType_t ab = p.q_dtype == kF16 ? CUDA_R_16F : CUDA_R_16BF;
  const size_t item = 2;
  GemmFoldArgs fa{};
  fa.s = s;
  fa.o = o;
  fa.m = m;
  fa.l = l;
  fa.ld = ld;
  fa.causal = p.mask == kMaskCausal;
  fa.rows = M;
  fa.L = p.L;
  fa.N = p.N;
  fa.Dv = Dv;
  for (int n0 = 0; n0 < p.N; n0 += ld) {
    const int keys = std::min(ld, p.N - n0);
    // Scores, transposed: column-major S^T [keys x M] = K_blk [keys x D] . Q^T.
    const Gemm scores{
        true,
        keys,
        M,
        D,
        D,
        D,
        ld,
        G,
        int64_t(p.N) * D,
        int64_t(M) * D,
        int64_t(M) * ld,
        ab,
        false};
    run_gemm(
        enc,
        scores,
        static_cast<const char*>(kd) + int64_t(n0) * D * item,
        qg,
        s,
        p.scale * kLog2eHost,
        workspace,
        {&q, &dense},
        scratch);
    fa.keys = keys;
    fa.n0 = n0;
    fa.first = n0 == 0;
    launch(
        enc,
        gemm_fold_kernel(p.q_dtype),
        dim3(unsigned(rows)),
        dim3(kGemmThreads),
        0,
        fa,
        {&scratch},
        {&scratch});
    // Output, transposed: O^T [Dv x M] (+)= V_blk^T [Dv x keys] . P^T, with
    // P over the scores' bytes (row stride 2 * ld in 16-bit elements).
    const Gemm values{
        false,
        Dv,
        M,
        keys,
        Dv,
        2 * int64_t(ld),
        Dv,
        G,
        int64_t(p.N) * Dv,
        2 * int64_t(M) * ld,
        int64_t(M) * Dv,
        ab,
        n0 > 0};
    run_gemm(
        enc,
        values,
        static_cast<const char*>(vd) + int64_t(n0) * Dv * item,
        s,
        o,
        1.0f,
        workspace,
        {&dense},
        scratch);
  }
  GemmFinishArgs fin{};
  fin.o = o;
  fin.m = m;
  fin.l = l;
  fin.sinks = p.sinks_input >= 0 ? mx::gpu_ptr<float>(in[p.sinks_input]) : nullptr;
  fin.out = mx::gpu_ptr<void>(out);
  fin.Hq = p.Hq;
  fin.Hkv = p.Hkv;
  fin.L = p.L;
  fin.Dv = Dv;
  fin.rep = p.rep;
  fin.rows = M;
  fin.out_dtype = p.q_dtype;
  fin.lse = lse ? mx::gpu_ptr<float>(*lse) : nullptr;
  if (p.sinks_input >= 0) {
    enc.set_input_array(in[p.sinks_input]);
  }
  if (lse) {
    enc.set_output_array(*lse);
  }
  launch(
      enc,
      gemm_finish_kernel(),
      dim3(unsigned(rows)),
      dim3(kGemmThreads),
      0,
      fin,
      {&scratch, &out},
      {&out});
}

} // namespace mlxq::cuda
