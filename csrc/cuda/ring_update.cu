// CUDA RingUpdate and QuantizedRingUpdate.
//
// ring_kernel: one block per written row; threads copy its elements from the
// (possibly strided) update into row (pos + t) mod S of the buffer.
// copy_kernel: the whole-buffer copy used when the buffer cannot be donated.
// quant_ring_kernel: one block per written row, one warp per quantization
// group (looping); it writes one part of the quantized rows (a.part: codes,
// scales or biases -- one launch per QuantizedRingUpdate part).
// quant_kv_kernel: the same per row, for K and V rows (grid y) and all three
// parts at once (QuantizedKVUpdate: one launch per cache write, K8/V4 pairs
// included: quant_kv_k8v4_kernel). Both reproduce
// MLX's CUDA affine quantize exactly: the group
// max starts at 0 and the min at FLT_MAX, scale = max((max - min) / n_bins,
// 1e-7) signed towards the larger-magnitude edge, the edge snapped to a
// whole code, round() (half away from zero) for every code.
#include <cfloat>

#include "cuda/device_utils.cuh"

namespace mlxq::cuda {

namespace {

__device__ __forceinline__ void copy_element(const char* src, char* dst, int itemsize) {
  switch (itemsize) {
    case 1:
      *dst = *src;
      break;
    case 2:
      *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
      break;
    case 8:
      *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src);
      break;
    default:
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
      break;
  }
}

__device__ __forceinline__ int ring_row(int64_t p, int t, int S) {
  return static_cast<int>((((p % S) + S) % S + t) % S);
}

__device__ __forceinline__ int ring_row(const int32_t* pos, int t, int S) {
  return ring_row(int64_t(pos[0]), t, S);
}

__global__ void ring_kernel_impl(RingArgs a) {
  const int row = blockIdx.x; // (b, h, t)
  const int t = row % a.T, bh = row / a.T;
  const int h = bh % a.H, b = bh / a.H;
  const int s = ring_row(a.pos, t, a.S);
  const char* src = static_cast<const char*>(a.src) +
      (b * a.src_st[0] + h * a.src_st[1] + t * a.src_st[2]) * a.itemsize;
  char* dst = static_cast<char*>(a.dst) + ((int64_t(bh) * a.S + s) * a.D) * a.itemsize;
  for (int i = threadIdx.x; i < a.D; i += blockDim.x) {
    copy_element(src + i * a.src_st[3] * a.itemsize, dst + int64_t(i) * a.itemsize, a.itemsize);
  }
}

__global__ void copy_kernel_impl(CopyArgs a) {
  const int64_t row = blockIdx.x; // (b, h, s)
  const int s = row % a.S;
  const int64_t bh = row / a.S;
  const int h = bh % a.H, b = bh / a.H;
  const char* src = static_cast<const char*>(a.src) +
      (b * a.src_st[0] + h * a.src_st[1] + s * a.src_st[2]) * a.itemsize;
  char* dst = static_cast<char*>(a.dst) + row * a.D * a.itemsize;
  for (int i = threadIdx.x; i < a.D; i += blockDim.x) {
    copy_element(src + i * a.src_st[3] * a.itemsize, dst + int64_t(i) * a.itemsize, a.itemsize);
  }
}

// Quantizes one update row (element i at src[src0 + i * st3]) into ring row
// `dst_row` of whichever of codes / scales / biases are non-null. One warp per
// quantization group (looping over groups); `stage` is this warp's
// shared-memory line for the group's codes. Words of one group are assembled
// from its staged codes; groups start on word boundaries (group_size * bits
// is a multiple of 32).
template <int BITS, int GS>
__device__ __forceinline__ void quantize_row(
    const void* src,
    int64_t src0,
    int64_t st3,
    int dtype,
    int G,
    int W,
    int64_t dst_row,
    uint32_t* codes_out,
    void* scales,
    void* biases,
    uint8_t* stage) {
  constexpr int kPerLane = GS / 32;
  constexpr float n_bins = float((1 << BITS) - 1);
  constexpr int kWordsPerGroup = GS * BITS / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int g = warp; g < G; g += blockDim.x / 32) {
    float w[kPerLane];
    float w_min = FLT_MAX, w_max = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int i = g * GS + lane * kPerLane + k;
      w[k] = load_float(src, src0 + i * st3, dtype);
      w_min = fminf(w_min, w[k]);
      w_max = fmaxf(w_max, w[k]);
    }
    w_min = warp_min(w_min);
    w_max = warp_max(w_max);
    float scale = fmaxf((w_max - w_min) / n_bins, 1e-7f);
    const bool side = fabsf(w_min) > fabsf(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = roundf(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    const float bias = at_zero ? 0.0f : edge;
    if (lane == 0 && scales) {
      store_float(scales, dst_row * G + g, dtype, scale);
    }
    if (lane == 0 && biases) {
      store_float(biases, dst_row * G + g, dtype, bias);
    }
    if (!codes_out) {
      continue; // uniform: the whole warp moves on
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const float c = fminf(fmaxf(roundf((w[k] - bias) / scale), 0.0f), n_bins);
      stage[lane * kPerLane + k] = static_cast<uint8_t>(c);
    }
    __syncwarp();
    for (int wi = lane; wi < kWordsPerGroup; wi += 32) {
      uint32_t word = 0;
      const int first = (wi * 32) / BITS, last = (wi * 32 + 31) / BITS;
      for (int e = first; e <= last; ++e) {
        const int shift = e * BITS - wi * 32;
        const uint32_t c = stage[e];
        word |= shift >= 0 ? (c << shift) : (c >> -shift);
      }
      codes_out[dst_row * W + g * kWordsPerGroup + wi] = word;
    }
    __syncwarp();
  }
}

// One part of a QuantizedRingUpdate: one block per written row.
template <int BITS, int GS>
__global__ void quant_ring_kernel_impl(QuantRingArgs a) {
  __shared__ uint8_t codes[4][GS];
  const int row = blockIdx.x; // (b, h, t)
  const int t = row % a.T, bh = row / a.T;
  const int h = bh % a.H, b = bh / a.H;
  const int64_t src0 = b * a.src_st[0] + h * a.src_st[1] + t * a.src_st[2];
  const int64_t dst_row = int64_t(bh) * a.S + ring_row(a.pos, t, a.S);
  quantize_row<BITS, GS>(
      a.src,
      src0,
      a.src_st[3],
      a.dtype,
      a.G,
      a.W,
      dst_row,
      a.part == 0 ? static_cast<uint32_t*>(a.dst) : nullptr,
      a.part == 1 ? a.dst : nullptr,
      a.part == 2 ? a.dst : nullptr,
      codes[threadIdx.x / 32]);
}

// QuantizedKVUpdate: block (row, side) quantizes one row of K (side 0) or V
// (side 1) into all three arrays of that side, and copies the row given for
// a recent window into its ring (in the same launch: a graph node less per
// ring and step).
template <int BITS, int GS>
__device__ __forceinline__ void
quant_kv_row(const QuantKVArgs& a, const QuantKVSide& d, uint8_t* stage) {
  const int row = blockIdx.x; // (b, h, t)
  const int t = row % a.T, bh = row / a.T;
  const int h = bh % a.H, b = bh / a.H;
  const int64_t src0 = b * d.src_st[0] + h * d.src_st[1] + t * d.src_st[2];
  const int64_t p = a.pos ? int64_t(a.pos[0]) : int64_t(a.pos_value);
  const int64_t dst_row = int64_t(bh) * a.S + ring_row(p, t, a.S);
  quantize_row<BITS, GS>(
      d.src, src0, d.src_st[3], a.dtype, d.G, d.W, dst_row, d.codes, d.scales, d.biases, stage);
  if (d.recent) { // the row as it came, into the window's ring
    const char* rsrc = static_cast<const char*>(d.recent_src) +
        (b * d.recent_src_st[0] + h * d.recent_src_st[1] + t * d.recent_src_st[2]) * d.itemsize;
    const int64_t rp = !a.recent_own_pos ? p
        : a.recent_pos                   ? int64_t(a.recent_pos[0])
                                         : int64_t(a.recent_pos_value);
    char* rdst = static_cast<char*>(d.recent) +
        (int64_t(bh) * d.R + ring_row(rp, t, d.R)) * d.D * d.itemsize;
    for (int i = threadIdx.x; i < d.D; i += blockDim.x) {
      copy_element(
          rsrc + i * d.recent_src_st[3] * d.itemsize, rdst + int64_t(i) * d.itemsize, d.itemsize);
    }
  }
}

// K and V of one quantization (grid y: the side; side[0] alone where the
// grid is one high).
template <int BITS, int GS>
__global__ void quant_kv_kernel_impl(QuantKVArgs a) {
  __shared__ uint8_t codes[4][GS];
  quant_kv_row<BITS, GS>(a, a.side[blockIdx.y], codes[threadIdx.x / 32]);
}

// 8-bit keys with 4-bit values in one group size (the 4-bit recipe's pair)
// in one launch too: grid y picks the side, and with it the instance, the
// same for the whole block.
template <int GS>
__global__ void quant_kv_k8v4_kernel_impl(QuantKVArgs a) {
  __shared__ uint8_t codes[4][GS];
  if (blockIdx.y == 0) {
    quant_kv_row<8, GS>(a, a.side[0], codes[threadIdx.x / 32]);
  } else {
    quant_kv_row<4, GS>(a, a.side[1], codes[threadIdx.x / 32]);
  }
}

template <int BITS>
void* quant_ring_for_group(int gs, bool kv) {
  switch (gs) {
    case 32:
      return kv ? handle<quant_kv_kernel_impl<BITS, 32>>()
                : handle<quant_ring_kernel_impl<BITS, 32>>();
    case 64:
      return kv ? handle<quant_kv_kernel_impl<BITS, 64>>()
                : handle<quant_ring_kernel_impl<BITS, 64>>();
    default:
      return kv ? handle<quant_kv_kernel_impl<BITS, 128>>()
                : handle<quant_ring_kernel_impl<BITS, 128>>();
  }
}

void* quant_for_bits(int bits, int gs, bool kv) {
  switch (bits) {
    case 2:
      return quant_ring_for_group<2>(gs, kv);
    case 3:
      return quant_ring_for_group<3>(gs, kv);
    case 4:
      return quant_ring_for_group<4>(gs, kv);
    case 5:
      return quant_ring_for_group<5>(gs, kv);
    case 6:
      return quant_ring_for_group<6>(gs, kv);
    default:
      return quant_ring_for_group<8>(gs, kv);
  }
}

} // namespace

void* ring_kernel() {
  return handle<ring_kernel_impl>();
}

void* copy_kernel() {
  return handle<copy_kernel_impl>();
}

void* quant_ring_kernel(int bits, int gs) {
  return quant_for_bits(bits, gs, false);
}

void* quant_kv_kernel(int bits, int gs) {
  return quant_for_bits(bits, gs, true);
}

void* quant_kv_pair_kernel(int k_bits, int k_group_size, int v_bits, int v_group_size) {
  if (k_bits != 8 || v_bits != 4 || k_group_size != v_group_size) {
    return nullptr;
  }
  switch (k_group_size) {
    case 32:
      return handle<quant_kv_k8v4_kernel_impl<32>>();
    case 64:
      return handle<quant_kv_k8v4_kernel_impl<64>>();
    default:
      return handle<quant_kv_k8v4_kernel_impl<128>>();
  }
}

} // namespace mlxq::cuda
