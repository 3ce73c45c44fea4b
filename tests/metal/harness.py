"""Runs mlxq's Metal kernels on the emulator the way csrc/metal/*.cpp does.

Every dispatch takes its kernel name, grid, threadgroup size, argument block
and buffer slots from mlxq._ext._metal_plan_* -- the C++ grid arithmetic that
the Metal host code calls -- and binds buffers with their views' strides and
offsets, as MLX's set_input_array does. Absent optional buffers (mask, sinks,
partials) get the output buffer bound in their slot, as the host code does.
Outputs and partial buffers are poisoned (NaN / 0xFF) before each run.
"""

import mlx.core as mx
import numpy as np
from emu import Buffer

import mlxq

DT = {"f32": 0, "f16": 1, "bf16": 2}
MX_TAG = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
NP_STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
# MaskCode and DtypeCode (csrc/sdpa_codes.h): an array mask is kind 2 with its element code.
MASK_KIND = {"none": 0, "causal": 1, "array": 2}
MASK_DTYPE = {**DT, "bool": 3}


def to_np(x: mx.array) -> np.ndarray:
    """An MLX array as NumPy storage (bfloat16 as its uint16 bits)."""
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16))
    return np.array(x)


def to_mx(a: np.ndarray, tag: str) -> mx.array:
    a = np.ascontiguousarray(a)
    return mx.array(a).view(mx.bfloat16) if tag == "bf16" else mx.array(a)


def poisoned(shape, tag):
    if tag == "bf16":
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, NP_STORAGE[tag])


def in_buffer(view, extra_rows=0, axis=2, rng=None, pad_cols=False):
    """`view` copied into a larger garbage-filled buffer and returned as a
    strided view of it: `extra_rows` more along `axis` (like a cache's
    buffer[..., :n, :]), and with pad_cols one more element per row (rows at
    an odd offset and stride)."""
    if not extra_rows and not pad_cols:
        return view
    shape = list(view.shape)
    shape[axis] += extra_rows
    shape[-1] += int(pad_cols)
    rng = rng or np.random.default_rng(0)
    if view.dtype == np.uint32:
        big = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    elif view.dtype == np.uint16:  # bf16: NaN garbage
        big = np.full(shape, 0x7FC1, np.uint16)
    else:
        big = np.full(shape, np.nan, view.dtype)
    start = extra_rows // 2
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(start, start + view.shape[axis])
    idx[-1] = slice(int(pad_cols), None)
    sub = big[tuple(idx)]
    sub[...] = view
    return sub


def run_sdpa(
    emu,
    q,
    q_tag,
    keys,
    values,
    s_tag,
    *,
    scale,
    bits,
    group_size,
    v_bits=None,
    v_group_size=None,
    mask=None,
    mask_tag="none",
    sinks=None,
    mode=0,
    check=True,
    **plan_overrides,
):
    """Dispatches QuantizedSDPA on NumPy storage views; returns (out, plan).

    q: [B, Hq, L, Dk] view; keys/values: (packed, scales, biases) views of
    [B, Hkv, N, *]; mask: None, "causal" or a view broadcastable to
    [B, Hq, L, N] in `mask_tag` storage; sinks: float32 [Hq] view;
    plan_overrides: extra keys of the plan's problem dict (with_lse=True:
    also each row's log-sum-exp, returned as plan["lse"]).
    """
    B, Hq, L, Dk = q.shape
    Hkv, N = keys[0].shape[1], keys[0].shape[2]
    v_bits = bits if v_bits is None else v_bits
    v_group_size = group_size if v_group_size is None else v_group_size
    Dv = values[0].shape[3] * 32 // v_bits
    bufs = {}
    qb, qs, _ = Buffer.of_view(q)
    bufs["q"] = qb
    problem = dict(
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        L=L,
        N=N,
        Dk=Dk,
        Dv=Dv,
        bits=bits,
        group_size=group_size,
        v_bits=v_bits,
        v_group_size=v_group_size,
        q_dtype=DT[q_tag],
        scale_dtype=DT[s_tag],
        scale=scale,
        q_strides=qs,
        mode=mode,
    )
    for prefix, triple in (("k", keys), ("v", values)):
        for part, arr in zip(("packed", "scales", "biases"), triple):
            assert arr.strides[-1] == arr.itemsize, "K/V rows must be contiguous"
            b, st, off = Buffer.of_view(arr)
            bufs[f"{prefix}_{part}"] = b
            problem[f"{prefix}_{part}_strides"] = st[:3]
            if part == "packed":
                problem[f"{prefix}_packed_offset"] = off
    if isinstance(mask, str):
        assert mask == "causal"
        problem["mask_kind"] = MASK_KIND["causal"]
    elif mask is not None:
        mview = np.broadcast_to(mask, (B, Hq, L, N))
        b, st, _ = Buffer.of_view(mview)
        bufs["mask"] = b
        problem["mask_kind"] = MASK_KIND["array"]
        problem["mask_dtype"] = MASK_DTYPE[mask_tag]
        problem["mask_strides"] = st
    if sinks is not None:
        b, st, _ = Buffer.of_view(sinks)
        bufs["sinks"] = b
        problem["has_sinks"] = True
        problem["sinks_stride"] = st[0]
    problem.update(plan_overrides)  # target_threadgroups, min_block_keys, max_threads
    plan = mlxq._ext._metal_plan_sdpa(problem)

    out = poisoned((B, Hq, L, Dv), q_tag)
    bufs["out"] = out
    if problem.get("with_lse"):  # each row's log-sum-exp, written by the merge
        bufs["lse"] = plan["lse"] = np.full((B, Hq, L), np.nan, np.float32)
    if plan["merge"]:
        bufs["partial_o"] = np.full(plan["partial_o_floats"], np.nan, np.float32)
        bufs["partial_ml"] = np.full(plan["partial_ml_floats"], np.nan, np.float32)
    slots = plan["slots"]
    if plan["prefill"]:
        slots = {k: v for k, v in slots.items() if not k.startswith("partial")}
    args = [None] * (max(slots.values()) + 1)
    for name, i in slots.items():
        args[i] = plan["params"] if name == "params" else bufs.get(name, out)
    ok, diag = emu.dispatch(plan["kernel"], args, plan["grid"], plan["group"])
    if check:
        assert ok and not diag, diag
    if plan["merge"]:
        ms = plan["merge_slots"]
        margs = [None] * (max(ms.values()) + 1)
        for name, i in ms.items():
            margs[i] = plan["params"] if name == "params" else bufs.get(name, out)
        ok2, diag2 = emu.dispatch(
            plan["merge_kernel"], margs, plan["merge_grid"], plan["merge_group"]
        )
        if check:
            assert ok2 and not diag2, diag2
        ok, diag = ok and ok2, diag + diag2
    plan["ok"], plan["diagnostics"] = ok, diag
    return out, plan


def run_ring_update(emu, buffer, update, pos, *, check=True):
    """RingUpdate on NumPy storage: `buffer` is the row-contiguous output
    (updated in place), `update` a view; pos an int. Returns the plan."""
    B, H, S, D = buffer.shape
    T = update.shape[2]
    ub, us, _ = Buffer.of_view(update)
    plan = mlxq._ext._metal_plan_ring_update(
        dict(B=B, H=H, S=S, T=T, D=D, itemsize=buffer.itemsize, update_strides=us)
    )
    bufs = {"update": ub, "pos": np.array([pos], np.int32), "out": buffer}
    _dispatch(emu, plan, bufs, check)
    return plan


PARTS = ("packed", "scales", "biases")  # QuantizedRingUpdate's part 0, 1, 2


def run_quantized_ring_update_part(
    emu, part, out, update, pos, *, group_size, bits, tag, others=None, check=True
):
    """One QuantizedRingUpdate primitive: writes part `part` (0 codes, 1
    scales, 2 biases) of the new rows into `out`, the row-contiguous array of
    that part (updated in place). As the host code does, `out` is bound to
    all three array slots unless `others` ({slot name: array}) gives other
    arrays for the slots that are not the part's. Returns the plan."""
    B, H, S, _ = out.shape
    T, D = update.shape[2], update.shape[3]
    ub, us, _ = Buffer.of_view(update)
    plan = mlxq._ext._metal_plan_quantized_ring_update(
        dict(
            B=B,
            H=H,
            S=S,
            T=T,
            D=D,
            group_size=group_size,
            bits=bits,
            dtype=DT[tag],
            part=part,
            update_strides=us,
        )
    )
    assert plan["part"] == part
    bufs = {"update": ub, "pos": np.array([pos], np.int32)}
    for i, name in enumerate(PARTS):
        bufs[name] = out if i == part or others is None else others[name]
    _dispatch(emu, plan, bufs, check)
    return plan


def run_quantized_ring_update(emu, triple, update, pos, *, group_size, bits, tag, check=True):
    """quantized_ring_update: one dispatch per part, as its three primitives
    run, each writing its own array of `triple` in place. Returns the plans
    (the last one's kernel name, ok and diagnostics at the top level)."""
    plans = [
        run_quantized_ring_update_part(
            emu,
            part,
            triple[part],
            update,
            pos,
            group_size=group_size,
            bits=bits,
            tag=tag,
            check=check,
        )
        for part in range(3)
    ]
    plan = dict(plans[-1])
    plan["ok"] = all(p["ok"] for p in plans)
    plan["diagnostics"] = "".join(p["diagnostics"] for p in plans)
    plan["parts"] = plans
    return plan


def run_copy4d(emu, src):
    """A row-contiguous copy of the strided view `src` made by mlxq_copy4d."""
    sb, st, _ = Buffer.of_view(src)
    plan = mlxq._ext._metal_plan_copy4d(dict(shape=src.shape, strides=st, itemsize=src.itemsize))
    dst = np.full(src.nbytes, 0xFF, np.uint8).view(src.dtype).reshape(src.shape)  # poisoned
    _dispatch(emu, plan, {"src": sb, "dst": dst}, True)
    return dst


def _dispatch(emu, plan, bufs, check):
    plan["ok"], plan["diagnostics"] = True, ""
    if 0 in plan["grid"]:  # nothing to write (T = 0): the host skips the dispatch too
        return
    slots = plan["slots"]
    args = [None] * (max(slots.values()) + 1)
    for name, i in slots.items():
        args[i] = plan["params"] if name == "params" else bufs[name]
    ok, diag = emu.dispatch(
        plan["kernel"], args, plan["grid"], plan["group"], threads=plan["grid_is_threads"]
    )
    if check:
        assert ok and not diag, diag
    plan["ok"], plan["diagnostics"] = ok, diag


def run_fill(emu, dst, n_words, tag, *, check=True):
    """mlxq_fill_u32 over the first `n_words` 32-bit words of `dst` with the
    poison word of `tag`, as DequantizeInto's host code poisons its output on
    the GPU. Returns the plan."""
    plan = mlxq._ext._metal_plan_fill(dict(n_words=n_words, dtype=DT[tag]))
    _dispatch(emu, plan, {"dst": dst}, check)
    return plan


def run_dequantize_into(
    emu, workspace, packed, scales, biases, *, group_size, bits, s_tag, out_tag, check=True
):
    """DequantizeInto as csrc/metal/dequantize_into.cpp dispatches it with
    poisoning on: `workspace` (1-D storage of `out_tag`, at least B*H*N*D
    elements) is the output's memory; mlxq_fill_u32 poisons the output's
    words, then mlxq_dequantize_into writes them from the packed / scales /
    biases views (any strides). Returns ([B, H, N, D] view of the workspace,
    plan)."""
    B, H, N, W = packed.shape
    D = W * 32 // bits
    problem = dict(
        B=B,
        H=H,
        N=N,
        D=D,
        group_size=group_size,
        bits=bits,
        out_dtype=DT[out_tag],
        scale_dtype=DT[s_tag],
    )
    bufs = {"out": workspace}
    for name, arr in (("packed", packed), ("scales", scales), ("biases", biases)):
        b, st, _ = Buffer.of_view(arr)
        bufs[name] = b
        problem[f"{name}_strides"] = st
    size = B * H * N * D
    assert workspace.ndim == 1 and workspace.size >= size
    fill = run_fill(emu, workspace, size * workspace.itemsize // 4, out_tag, check=check)
    plan = mlxq._ext._metal_plan_dequantize_into(problem)
    _dispatch(emu, plan, bufs, check)
    plan["ok"] = plan["ok"] and fill["ok"]
    plan["diagnostics"] = fill["diagnostics"] + plan["diagnostics"]
    plan["fill"] = fill
    return workspace[:size].reshape(B, H, N, D), plan
