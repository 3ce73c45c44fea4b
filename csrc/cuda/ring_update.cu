// CUDA RingUpdate and QuantizedRingUpdate.
//
// ring_kernel: one block per written row; threads copy its elements from the
// (possibly strided) update into row (pos + t) mod S of the buffer.
// copy_kernel: the whole-buffer copy used when the buffer cannot be donated.
// quant_ring_kernel: one block per written row, one warp per quantization
// group (looping); it writes one part of the quantized rows (a.part: codes,
// scales or biases -- one launch per QuantizedRingUpdate part), reproducing
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
    case 1: *dst = *src; break;
    case 2: *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src); break;
    case 8: *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src); break;
    default: *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src); break;
  }
}

__device__ __forceinline__ int ring_row(const int32_t* pos, int t, int S) {
  const int64_t p = pos[0];
  return static_cast<int>((((p % S) + S) % S + t) % S);
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

// Words of one group are assembled from its codes staged in shared memory;
// groups start on word boundaries (group_size * bits is a multiple of 32).
template <int BITS, int GS>
__global__ void quant_ring_kernel_impl(QuantRingArgs a) {
  constexpr int kPerLane = GS / 32;
  constexpr float n_bins = float((1 << BITS) - 1);
  constexpr int kWordsPerGroup = GS * BITS / 32;
  __shared__ uint8_t codes[4][GS];
  const int row = blockIdx.x; // (b, h, t)
  const int t = row % a.T, bh = row / a.T;
  const int h = bh % a.H, b = bh / a.H;
  const int s = ring_row(a.pos, t, a.S);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t src0 = b * a.src_st[0] + h * a.src_st[1] + t * a.src_st[2];
  const int64_t dst_row = int64_t(bh) * a.S + s;
  for (int g = warp; g < a.G; g += blockDim.x / 32) {
    float w[kPerLane];
    float w_min = FLT_MAX, w_max = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int i = g * GS + lane * kPerLane + k;
      w[k] = load_float(a.src, src0 + i * a.src_st[3], a.dtype);
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
    if (a.part != 0) { // scales (1) or biases (2): one value per group
      if (lane == 0) {
        store_float(a.dst, dst_row * a.G + g, a.dtype, a.part == 1 ? scale : bias);
      }
      continue; // a.part is uniform: the whole warp moves on
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const float c = fminf(fmaxf(roundf((w[k] - bias) / scale), 0.0f), n_bins);
      codes[warp][lane * kPerLane + k] = static_cast<uint8_t>(c);
    }
    __syncwarp();
    uint32_t* packed = static_cast<uint32_t*>(a.dst);
    for (int wi = lane; wi < kWordsPerGroup; wi += 32) {
      uint32_t word = 0;
      const int first = (wi * 32) / BITS, last = (wi * 32 + 31) / BITS;
      for (int e = first; e <= last; ++e) {
        const int shift = e * BITS - wi * 32;
        const uint32_t c = codes[warp][e];
        word |= shift >= 0 ? (c << shift) : (c >> -shift);
      }
      packed[dst_row * a.W + g * kWordsPerGroup + wi] = word;
    }
    __syncwarp();
  }
}

template <int BITS>
void* quant_ring_for_group(int gs) {
  switch (gs) {
    case 32: return handle<quant_ring_kernel_impl<BITS, 32>>();
    case 64: return handle<quant_ring_kernel_impl<BITS, 64>>();
    default: return handle<quant_ring_kernel_impl<BITS, 128>>();
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
  switch (bits) {
    case 2: return quant_ring_for_group<2>(gs);
    case 3: return quant_ring_for_group<3>(gs);
    case 4: return quant_ring_for_group<4>(gs);
    case 5: return quant_ring_for_group<5>(gs);
    case 6: return quant_ring_for_group<6>(gs);
    default: return quant_ring_for_group<8>(gs);
  }
}

} // namespace mlxq::cuda
