// Device memory for mlxq's CUDA kernel outputs and scratch.
//
// Why not mx::allocator::malloc: on MLX's CUDA backend it hands out managed
// memory, and when its buffer cache holds a free *device* buffer of a
// matching size (every MLX op allocates device memory, so it often does), it
// first converts that buffer to managed memory: a fresh cudaMallocManaged
// plus a synchronous cudaMemcpy, on the host, inside our eval_gpu. The
// stream-ordered allocator MLX's own ops use (cu::malloc_async) is not
// exported by libmlx. So mlxq keeps device memory of its own, wrapped in
// MLX's CudaBuffer so that every MLX kernel reads it as it reads its own:
//
// - a host-side cache of freed blocks by size (as MLX's buffer cache does):
//   a decode step reuses the same few sizes, and a driver call per
//   allocation measured ~10 us of host time each;
// - behind it, a stream-ordered driver pool per GPU for cache misses (so
//   that MLX may hand a block back with cudaFreeAsync when it moves one to
//   managed memory for a host read). It holds kernel outputs and scratch,
//   never a cache's buffers (see take_or_copy in ring_update.cpp).
//
// A block returns to the cache only once its array is gone, which allocate()
// delays until the evaluation's work has completed: a cached block is idle
// and any later kernel may take it.
#include <cuda.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "cuda/launch.h"
#include "debug.h"
#include "environment.h"
#include "mlx/backend/cuda/allocator.h"
#include "mlx/memory.h"

namespace mlxq::cuda {

namespace {

// Cached bytes beyond this go back to the driver pool.
constexpr size_t kMaxCachedBytes = size_t(1) << 30;
constexpr size_t kPage = 16384;

struct Device {
  CUmemoryPool pool = nullptr;
  CUcontext context = nullptr;
  CUstream free_stream = nullptr; // frees wait on nothing: their memory is idle
  std::mutex mutex; // guards free_blocks and cached
  std::multimap<size_t, void*> free_blocks; // by rounded size
  size_t cached = 0;
};

// MLXQ_CUDA_POOL=0 sends outputs back to MLX's allocator (for comparisons).
// Read once: blocks must go back to the allocator they came from.
bool pool_enabled() {
  static const bool on = environment().cuda_pool;
  return on;
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    cuGetErrorString(r, &msg);
    throw std::runtime_error(
        std::string("[mlxq] ") + what + " failed: " + (msg ? msg : "unknown CUDA error"));
  }
}

// Makes a device's primary context current for a scope (the deleter runs on
// MLX's completion thread, where none may be); ok() is false once the driver
// is gone at exit.
class ContextScope {
 public:
  explicit ContextScope(CUcontext context) : ok_(cuCtxPushCurrent(context) == CUDA_SUCCESS) {}
  ~ContextScope() {
    if (ok_) {
      CUcontext popped;
      cuCtxPopCurrent(&popped);
    }
  }
  bool ok() const {
    return ok_;
  }

 private:
  bool ok_;
};

// Sizes as MLX rounds them: powers of two below a page, whole pages above.
size_t rounded(size_t n) {
  if (n >= kPage) {
    return (n + kPage - 1) / kPage * kPage;
  }
  size_t r = 256;
  while (r < n) {
    r *= 2;
  }
  return r;
}

Device& device_state(int device) {
  static std::mutex mutex;
  static auto* devices = new std::unordered_map<int, Device>(); // outlives exit
  std::lock_guard<std::mutex> lock(mutex);
  Device& d = (*devices)[device];
  if (!d.pool) {
    // All or nothing: d is usable only once every handle exists.
    CUdevice dev = 0;
    check(cuDeviceGet(&dev, device), "cuDeviceGet");
    if (!d.context) {
      check(cuDevicePrimaryCtxRetain(&d.context, dev), "cuDevicePrimaryCtxRetain");
    }
    if (!d.free_stream) {
      ContextScope scope(d.context);
      check(scope.ok() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT, "cuCtxPushCurrent");
      check(cuStreamCreate(&d.free_stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    }
    CUmemPoolProps props{};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = device;
    // The pool's default release threshold (0): what the host-side cache
    // does not keep goes back to the driver at the next synchronization.
    check(cuMemPoolCreate(&d.pool, &props), "cuMemPoolCreate");
  }
  return d;
}

// A cached block of at least n bytes and less than twice that (its size in
// `size`), or null.
void* take_cached(Device& d, size_t n, size_t& size) {
  std::lock_guard<std::mutex> lock(d.mutex);
  auto it = d.free_blocks.lower_bound(n);
  if (it == d.free_blocks.end() || it->first >= 2 * n) {
    return nullptr;
  }
  void* p = it->second;
  size = it->first;
  d.cached -= it->first;
  d.free_blocks.erase(it);
  return p;
}

// Hands every cached block back to the driver pool.
void trim(Device& d) {
  std::lock_guard<std::mutex> lock(d.mutex);
  for (auto& [size, p] : d.free_blocks) {
    cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), d.free_stream);
  }
  d.free_blocks.clear();
  d.cached = 0;
}

void release(mx::allocator::Buffer b, Device& d, int64_t n) {
  auto* buf = static_cast<mx::cu::CudaBuffer*>(b.ptr());
  if (buf->device < 0) {
    // MLX moved it to managed memory (pinned host memory on GPUs without
    // managed memory) for a host read (Buffer::raw_ptr) and has already
    // given our block back to the pool.
    if (ContextScope scope(d.context); scope.ok()) {
      unsigned type = 0;
      const auto ptr = reinterpret_cast<CUdeviceptr>(buf->data);
      if (cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) == CUDA_SUCCESS &&
          type == CU_MEMORYTYPE_HOST) {
        cuMemFreeHost(buf->data);
      } else {
        cuMemFree(ptr);
      }
    }
  } else {
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.cached + buf->size <= kMaxCachedBytes) {
      d.free_blocks.emplace(buf->size, buf->data);
      d.cached += buf->size;
    } else if (ContextScope scope(d.context); scope.ok()) {
      cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(buf->data), d.free_stream);
    } // else: the process is exiting and the driver is gone
  }
  delete buf;
  note_device_bytes(-n);
}

} // namespace

void allocate(mx::array& a, mx::cu::CommandEncoder& enc) {
  if (a.nbytes() == 0 || !pool_enabled()) {
    allocate_cached(a);
    enc.add_temporary(a); // scratch must outlive its graph here too
    return;
  }
  const size_t n = rounded(a.nbytes());
  const int device = enc.device().cuda_device();
  Device& d = device_state(device);
  size_t size = n;
  void* data = take_cached(d, n, size);
  if (!data) {
    const auto stream = reinterpret_cast<CUstream>(static_cast<cudaStream_t>(enc.stream()));
    CUdeviceptr ptr = 0;
    CUresult r = cuMemAllocFromPoolAsync(&ptr, n, d.pool, stream);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      // Our cached blocks and MLX's go back to their pools; a
      // synchronization returns the pools' unused memory to the driver.
      trim(d);
      mx::clear_cache();
      cuCtxSynchronize();
      cuMemPoolTrimTo(d.pool, 0);
      r = cuMemAllocFromPoolAsync(&ptr, n, d.pool, stream);
    }
    check(r, ("allocating " + std::to_string(n) + " bytes on the GPU").c_str());
    data = reinterpret_cast<void*>(ptr);
  }
  note_device_bytes(int64_t(size));
  auto* buf = new mx::cu::CudaBuffer{data, size, device};
  const int64_t bytes = int64_t(size);
  a.set_data(mx::allocator::Data(mx::allocator::Buffer(buf), [&d, bytes](mx::allocator::Buffer b) {
    release(b, d, bytes);
  }));
  // Held until the evaluation's work completes, so the block goes back to
  // the cache only when no kernel of this graph can still touch it.
  enc.add_temporary(a);
}

void allocate_cached(mx::array& a) {
  a.set_data(mx::allocator::malloc(a.nbytes()));
}

} // namespace mlxq::cuda
