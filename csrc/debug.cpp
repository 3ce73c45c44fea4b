#include "debug.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <limits>

#include "mlx/types/half_types.h"

namespace mlxq {

namespace mx = mlx::core;

namespace {
std::atomic<bool> g_poison{false};
std::atomic<const char*> g_last_sdpa_kernel{""};
std::atomic<int64_t> g_device_active{0};
std::atomic<int64_t> g_device_peak{0};

template <typename T>
void fill(mx::array& out, T value) {
  T* p = out.data<T>();
  for (size_t i = 0; i < out.data_size(); ++i) {
    p[i] = value;
  }
}
} // namespace

void set_poison_outputs(bool enabled) {
  g_poison.store(enabled);
}

bool poison_outputs() {
  return g_poison.load();
}

void note_sdpa_kernel(const char* name) {
  g_last_sdpa_kernel.store(name);
}

const char* take_last_sdpa_kernel() {
  return g_last_sdpa_kernel.exchange("");
}

void note_device_bytes(int64_t delta) {
  const int64_t now = g_device_active.fetch_add(delta) + delta;
  int64_t peak = g_device_peak.load();
  while (now > peak && !g_device_peak.compare_exchange_weak(peak, now)) {
  }
}

int64_t device_bytes_active() {
  return g_device_active.load();
}

int64_t take_device_bytes_peak() {
  return g_device_peak.exchange(g_device_active.load());
}

void poison_if_enabled(mx::array& out) {
  if (!g_poison.load()) {
    return;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  switch (out.dtype()) {
    case mx::float32:
      fill<float>(out, nan);
      break;
    case mx::float16:
      fill<mx::float16_t>(out, mx::float16_t(nan));
      break;
    case mx::bfloat16:
      fill<mx::bfloat16_t>(out, mx::bfloat16_t(nan));
      break;
    default:
      std::memset(out.data<void>(), 0xFF, out.nbytes());
      break;
  }
}

namespace {
void print_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}
} // namespace

void install_crash_backtrace() {
  signal(SIGSEGV, print_backtrace);
  signal(SIGABRT, print_backtrace);
}

} // namespace mlxq
