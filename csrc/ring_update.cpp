#include "ring_update.h"

#include <algorithm>
#include <atomic>

#include "prefix_view.h"
#include "quantization.h"
#include "validation.h"

namespace mlxq {

namespace {

// Checks the position and turns it into a one-element int32 array input.
mx::array position_input(const char* op, const Position& pos, mx::StreamOrDevice s) {
  if (std::holds_alternative<int>(pos)) {
    int p = std::get<int>(pos);
    if (p < 0) {
      fail(op, "pos must be >= 0, got ", p, ".");
    }
    return mx::array(p, mx::int32);
  }
  const auto& a = std::get<mx::array>(pos);
  if (a.size() != 1) {
    fail(
        op,
        "pos must be an int or a one-element integer array, got shape ",
        shape_str(a.shape()),
        ".");
  }
  if (!mx::issubdtype(a.dtype(), mx::integer)) {
    fail(op, "pos array must have an integer dtype, got ", dtype_str(a.dtype()), ".");
  }
  // A position that is already computed is checked here; one computed inside a
  // compiled step is wrapped modulo the ring size by the kernel.
  if (a.is_available()) {
    int64_t v = 0;
    switch (a.dtype()) {
      case mx::int8:
        v = *a.data<int8_t>();
        break;
      case mx::int16:
        v = *a.data<int16_t>();
        break;
      case mx::int32:
        v = *a.data<int32_t>();
        break;
      case mx::int64:
        v = *a.data<int64_t>();
        break;
      default:
        v = 0;
        break; // unsigned: never negative
    }
    if (v < 0) {
      fail(op, "pos must be >= 0, got ", v, ".");
    }
  }
  return mx::reshape(mx::astype(a, mx::int32, s), {}, s);
}

void check_rows(const char* op, const mx::array& rows, const char* name) {
  if (rows.ndim() != 4) {
    fail(op, name, " must be 4-D [B, H, S, D], got shape ", shape_str(rows.shape()), ".");
  }
}

void check_update_fits(const char* op, const mx::array& buffer, const mx::array& update) {
  for (int d : {0, 1}) {
    if (update.shape(d) != buffer.shape(d)) {
      fail(
          op,
          "update shape ",
          shape_str(update.shape()),
          " does not match the buffer shape ",
          shape_str(buffer.shape()),
          " in [B, H].");
    }
  }
  if (update.shape(2) > buffer.shape(2)) {
    fail(
        op, "update has ", update.shape(2), " rows but the ring holds only ", buffer.shape(2), ".");
  }
  if (buffer.shape(2) < 1) {
    fail(op, "the buffer has no rows.");
  }
}

// Checks one (packed, scales, biases) triple and the update rows it takes.
void check_triple(
    const char* op,
    const char* what,
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& update,
    int group_size,
    int bits) {
  check_triple_arrays(op, what, "S", packed, scales, biases);
  check_rows(op, update, "update");
  if (update.dtype() != scales.dtype()) {
    fail(
        op,
        what,
        "update dtype ",
        dtype_str(update.dtype()),
        " must match the scales dtype ",
        dtype_str(scales.dtype()),
        " (mx.quantize keeps the input's dtype for scales and biases).");
  }
  check_update_fits(op, packed, update);
  const int D = update.shape(3);
  if (D % group_size != 0 || scales.shape(3) * group_size != D ||
      packed.shape(3) * 32 != D * bits) {
    fail(
        op,
        what,
        "update rows of ",
        D,
        " elements do not fit packed width ",
        packed.shape(3),
        " and scales width ",
        scales.shape(3),
        " at ",
        bits,
        " bits, group size ",
        group_size,
        ".");
  }
}

// The window part of a quantized_kv_update (see RecentWrite).
void check_recent_write(
    const char* op,
    const RecentWrite& r,
    const mx::array& k_update,
    const mx::array& v_update) {
  const std::pair<const mx::array*, const mx::array*> sides[2] = {
      {&r.keys, &r.key_rows}, {&r.values, &r.value_rows}};
  const mx::array* updates[2] = {&k_update, &v_update};
  const char* names[2] = {"recent keys", "recent values"};
  for (int kv = 0; kv < 2; ++kv) {
    const auto& [ring, rows] = sides[kv];
    check_rows(op, *ring, names[kv]);
    check_rows(op, *rows, "recent rows");
    check_update_fits(op, *ring, *rows);
    const auto& u = *updates[kv];
    if (rows->shape() != u.shape() || rows->dtype() != ring->dtype() ||
        ring->shape(3) != rows->shape(3)) {
      fail(
          op,
          names[kv],
          ": rows ",
          shape_str(rows->shape()),
          " of ",
          dtype_str(rows->dtype()),
          " must have the update's shape ",
          shape_str(u.shape()),
          " and the ring's dtype ",
          dtype_str(ring->dtype()),
          " and width (ring ",
          shape_str(ring->shape()),
          ").");
    }
  }
  if (r.keys.shape(2) != r.values.shape(2)) {
    fail(
        op,
        "recent keys ",
        shape_str(r.keys.shape()),
        " and values ",
        shape_str(r.values.shape()),
        " must have as many rows.");
  }
}

// `prefix` names the arguments in errors ("v_" for the values' own).
void check_quantization(const char* op, int group_size, int bits, const char* prefix = "") {
  if (!is_supported_bits(bits)) {
    fail(op, prefix, "bits must be ", supported_bits_text(), ", got ", bits, ".");
  }
  if (!is_supported_group_size(group_size)) {
    fail(
        op, prefix, "group_size must be ", supported_group_sizes_text(), ", got ", group_size, ".");
  }
}

} // namespace

mx::array ring_update(
    const mx::array& buffer,
    const mx::array& update,
    const Position& pos,
    bool owned,
    mx::StreamOrDevice s) {
  constexpr const char* op = "mlxq.ring_update";
  check_rows(op, buffer, "buffer");
  check_rows(op, update, "update");
  if (buffer.dtype() != update.dtype()) {
    fail(
        op,
        "update dtype ",
        dtype_str(update.dtype()),
        " does not match the buffer dtype ",
        dtype_str(buffer.dtype()),
        ".");
  }
  check_update_fits(op, buffer, update);
  if (update.shape(3) != buffer.shape(3)) {
    fail(
        op,
        "update shape ",
        shape_str(update.shape()),
        " does not match the buffer shape ",
        shape_str(buffer.shape()),
        " in the last dimension.");
  }
  auto p = position_input(op, pos, s);
  return mx::array(
      buffer.shape(),
      buffer.dtype(),
      std::make_shared<RingUpdate>(mx::to_stream(s), owned),
      {buffer, update, p});
}

std::vector<mx::array> window_step(
    const mx::array& keys_ring,
    const mx::array& values_ring,
    const mx::array& keys,
    const mx::array& values,
    int start,
    int span,
    int pos,
    mx::StreamOrDevice s) {
  constexpr const char* op = "mlxq.window_step";
  check_rows(op, keys_ring, "keys_ring");
  check_rows(op, values_ring, "values_ring");
  check_rows(op, keys, "keys");
  check_rows(op, values, "values");
  const int slots = keys_ring.shape(2);
  if (values_ring.shape(2) != slots) {
    fail(
        op,
        "the keys and values rings must have as many slots, got ",
        slots,
        " and ",
        values_ring.shape(2),
        ".");
  }
  if (start < 0 || start >= slots || span < 0 || span >= slots) {
    fail(
        op,
        "start must lie in [0, ",
        slots,
        ") and span in [0, ",
        slots,
        "), got ",
        start,
        " and ",
        span,
        ".");
  }
  auto exact = [&](const mx::array& ring, const mx::array& rows) {
    if (span == 0) {
      return rows;
    }
    const int first = std::min(span, slots - start);
    std::vector<mx::array> parts = {detail::row_range(ring, start, start + first, s)};
    if (first < span) {
      parts.push_back(detail::row_range(ring, 0, span - first, s));
    }
    parts.push_back(rows);
    return mx::concatenate(std::move(parts), 2, s);
  };
  auto newest = [&](const mx::array& rows) {
    const int T = rows.shape(2);
    return T > slots ? detail::row_range(rows, T - slots, T, s) : rows;
  };
  auto exact_keys = exact(keys_ring, keys);
  auto exact_values = exact(values_ring, values);
  return {
      std::move(exact_keys),
      std::move(exact_values),
      ring_update(keys_ring, newest(keys), pos, false, s),
      ring_update(values_ring, newest(values), pos, false, s)};
}

std::vector<mx::array> quantized_ring_update(
    const mx::array& packed,
    const mx::array& scales,
    const mx::array& biases,
    const mx::array& update,
    const Position& pos,
    int group_size,
    int bits,
    bool owned,
    mx::StreamOrDevice s) {
  constexpr const char* op = "mlxq.quantized_ring_update";
  check_quantization(op, group_size, bits);
  check_triple(op, "", packed, scales, biases, update, group_size, bits);
  auto p = position_input(op, pos, s);
  using Part = QuantizedRingUpdate::Part;
  const mx::array* buffers[3] = {&packed, &scales, &biases};
  const Part parts[3] = {Part::Codes, Part::Scales, Part::Biases};
  std::vector<mx::array> out;
  out.reserve(3);
  for (int i = 0; i < 3; ++i) {
    const mx::array& b = *buffers[i];
    out.emplace_back(
        b.shape(),
        b.dtype(),
        std::make_shared<QuantizedRingUpdate>(mx::to_stream(s), group_size, bits, parts[i], owned),
        std::vector<mx::array>{b, update, p});
  }
  return out;
}

std::vector<mx::array> quantized_kv_update(
    const std::vector<mx::array>& k_triple,
    const std::vector<mx::array>& v_triple,
    const mx::array& k_update,
    const mx::array& v_update,
    const Position& pos,
    int group_size,
    int bits,
    int fetch,
    std::optional<int> v_group_size,
    std::optional<int> v_bits,
    const std::optional<RecentWrite>& recent,
    mx::StreamOrDevice s) {
  constexpr const char* op = "mlxq.quantized_kv_update";
  const int vg = v_group_size.value_or(group_size), vb = v_bits.value_or(bits);
  check_quantization(op, group_size, bits);
  check_quantization(op, vg, vb, "v_");
  if (k_triple.size() != 3 || v_triple.size() != 3) {
    fail(op, "keys and values must each be a (packed, scales, biases) triple.");
  }
  check_triple(op, "keys: ", k_triple[0], k_triple[1], k_triple[2], k_update, group_size, bits);
  check_triple(op, "values: ", v_triple[0], v_triple[1], v_triple[2], v_update, vg, vb);
  for (int d = 0; d < 3; ++d) {
    if (k_triple[0].shape(d) != v_triple[0].shape(d) || k_update.shape(d) != v_update.shape(d)) {
      fail(
          op,
          "keys ",
          shape_str(k_triple[0].shape()),
          " / ",
          shape_str(k_update.shape()),
          " and values ",
          shape_str(v_triple[0].shape()),
          " / ",
          shape_str(v_update.shape()),
          " must agree on [B, H, S] and [B, H, T].");
    }
  }
  const int S = k_triple[0].shape(2);
  if (fetch < -1 || fetch > S) {
    fail(op, "fetch rows [0, ", fetch, ") do not fit the buffers' ", S, " rows.");
  }
  if (recent) {
    check_recent_write(op, *recent, k_update, v_update);
  }
  auto p = position_input(op, pos, s);
  std::vector<mx::array> inputs;
  for (const auto* t : {&k_triple, &v_triple}) {
    inputs.insert(inputs.end(), t->begin(), t->end());
  }
  inputs.push_back(k_update);
  inputs.push_back(v_update);
  inputs.push_back(p);
  int recent_pos = QuantizedKVUpdate::kSamePos;
  if (recent) {
    inputs.insert(
        inputs.end(), {recent->keys, recent->values, recent->key_rows, recent->value_rows});
    if (recent->pos) {
      inputs.push_back(position_input(op, *recent->pos, s));
      recent_pos = std::holds_alternative<int>(*recent->pos) ? std::get<int>(*recent->pos) : -1;
    }
  }
  // A fetch of every row is the buffers themselves.
  const int views = fetch >= 0 && fetch < S ? fetch : -1;
  auto primitive = std::make_shared<QuantizedKVUpdate>(
      mx::to_stream(s),
      std::array<int, 2>{group_size, vg},
      std::array<int, 2>{bits, vb},
      std::holds_alternative<int>(pos) ? std::get<int>(pos) : -1,
      views,
      recent.has_value(),
      recent && recent->owned,
      recent_pos);
  std::vector<mx::Dtype> dtypes;
  for (int i = 0; i < (views >= 0 ? 12 : 6); ++i) {
    dtypes.push_back(inputs[i % 6].dtype());
  }
  if (recent) {
    dtypes.push_back(recent->keys.dtype());
    dtypes.push_back(recent->values.dtype());
  }
  auto out = mx::array::make_arrays(primitive->output_shapes(inputs), dtypes, primitive, inputs);
  if (fetch == S) { // the buffers again as the fetch, before the rings
    std::vector<mx::array> all(out.begin(), out.begin() + 6);
    all.insert(all.end(), out.begin(), out.begin() + 6);
    all.insert(all.end(), out.begin() + 6, out.end());
    return all;
  }
  return out;
}

std::vector<mx::Shape> QuantizedKVUpdate::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (int i = 0; i < 6; ++i) {
    shapes.push_back(inputs[i].shape());
  }
  for (int i = 0; fetch_ >= 0 && i < 6; ++i) {
    if (fetch_ > inputs[i].shape(2)) {
      fail(
          "mlxq.quantized_kv_update",
          "fetch rows [0, ",
          fetch_,
          ") do not fit the buffers' ",
          inputs[i].shape(2),
          " rows.");
    }
    auto view = inputs[i].shape();
    view[2] = fetch_;
    shapes.push_back(view);
  }
  if (recent_) { // the two rings
    shapes.push_back(inputs[9].shape());
    shapes.push_back(inputs[10].shape());
  }
  return shapes;
}

namespace detail {

void set_prefix_views(std::vector<mx::array>& outputs, bool views) {
  for (int i = 6; views && i < 12; ++i) {
    set_prefix_view(outputs[i - 6], outputs[i]);
  }
}

bool can_update_in_place(const mx::array& buffer, bool owned) {
  return (owned || buffer.is_donatable()) && buffer.flags().row_contiguous &&
      buffer.data_size() == buffer.size();
}

namespace {
std::atomic<int> ring_copies{0};
} // namespace

void note_ring_copy() {
  ring_copies.fetch_add(1, std::memory_order_relaxed);
}

int take_ring_copies() {
  return ring_copies.exchange(0, std::memory_order_relaxed);
}

} // namespace detail

bool QuantizedKVUpdate::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedKVUpdate&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && static_pos_ == o.static_pos_ &&
      fetch_ == o.fetch_ && recent_ == o.recent_ && recent_owned_ == o.recent_owned_ &&
      recent_pos_ == o.recent_pos_;
}

bool QuantizedRingUpdate::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedRingUpdate&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && part_ == o.part_ && owned_ == o.owned_;
}

} // namespace mlxq
