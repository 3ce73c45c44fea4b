#include "prefill_workspace.h"

#include <map>
#include <mutex>
#include <tuple>

#include "dequantize_into.h"

namespace mlxq::workspace {

namespace {

using StreamKey = std::pair<int, int>; // (device type, stream index)
using BufferKey = std::tuple<StreamKey, char, int>; // stream, 'k' or 'v', dtype

StreamKey key_of(const mx::Stream& s) {
  return {static_cast<int>(s.device.type), s.index};
}

// Never destroyed: arrays must not be freed after MLX's allocator at exit.
struct State {
  std::mutex mutex;
  std::map<BufferKey, mx::array> buffers;
  std::map<StreamKey, mx::array> last_reader;
};

State& state() {
  static State* s = new State();
  return *s;
}

mx::array&
buffer(State& st, const BufferKey& key, int64_t elements, mx::Dtype dtype, mx::Stream s) {
  auto it = st.buffers.find(key);
  if (it == st.buffers.end() || static_cast<int64_t>(it->second.size()) < elements) {
    int64_t size = it == st.buffers.end()
        ? elements
        : std::max<int64_t>(elements, 2 * static_cast<int64_t>(it->second.size()));
    // zeros is materialised as a full buffer (not a broadcast scalar), so the
    // kernel can write into it.
    auto buf = mx::zeros({static_cast<int>(size)}, dtype, s);
    it = st.buffers.insert_or_assign(key, std::move(buf)).first;
  }
  return it->second;
}

} // namespace

std::pair<mx::array, mx::array> dequantize_kv(
    const mx::array& k_packed,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v_packed,
    const mx::array& v_scales,
    const mx::array& v_biases,
    int k_group_size,
    int k_bits,
    int v_group_size,
    int v_bits,
    mx::Dtype dtype,
    mx::Stream s) {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  auto skey = key_of(s);
  std::vector<mx::array> after;
  if (auto it = st.last_reader.find(skey); it != st.last_reader.end()) {
    after.push_back(it->second);
  }
  auto one = [&](char side,
                 const mx::array& packed,
                 const mx::array& scales,
                 const mx::array& biases,
                 int group_size,
                 int bits) {
    int64_t elements = static_cast<int64_t>(packed.shape(0)) * packed.shape(1) * packed.shape(2) *
        (static_cast<int64_t>(packed.shape(3)) * 32 / bits);
    auto& buf = buffer(st, {skey, side, static_cast<int>(dtype.val())}, elements, dtype, s);
    return dequantize_into(buf, packed, scales, biases, group_size, bits, after, s);
  };
  auto k = one('k', k_packed, k_scales, k_biases, k_group_size, k_bits);
  auto v = one('v', v_packed, v_scales, v_biases, v_group_size, v_bits);
  return {std::move(k), std::move(v)};
}

void note_reader(mx::Stream s, const mx::array& out) {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.last_reader.insert_or_assign(key_of(s), out);
}

void release(mx::Stream s) {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.buffers.empty() && st.last_reader.empty()) {
    return;
  }
  auto skey = key_of(s);
  std::erase_if(st.buffers, [&](const auto& kv) { return std::get<0>(kv.first) == skey; });
  st.last_reader.erase(skey);
}

void release_all() {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.buffers.clear();
  st.last_reader.clear();
}

size_t held_bytes(std::optional<mx::Stream> s) {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  size_t total = 0;
  for (const auto& [key, buf] : st.buffers) {
    if (!s || std::get<0>(key) == key_of(*s)) {
      total += buf.nbytes();
    }
  }
  return total;
}

} // namespace mlxq::workspace
