"""Inputs of the QuantizedSDPA emulator tests: random cases as MLX arrays (for
the float64 oracle) and NumPy storage views (for the emulator), masks, sinks."""

import mlx.core as mx
import numpy as np
from harness import in_buffer, run_sdpa, to_mx, to_np
from support.helpers import DTYPES, assert_close, random_inputs, random_sinks
from support.masks import make_mask
from support.reference64 import sdpa64

MODES = {"auto": 0, "decode": 1, "prefill": 2}


class Case:
    """Random inputs as MLX arrays (for the oracle) and NumPy storage views
    (for the emulator), optionally inside larger buffers."""

    def __init__(
        self,
        rng,
        *,
        B=1,
        Hq=8,
        Hkv=2,
        L=1,
        N=64,
        Dk=128,
        Dv=None,
        bits=4,
        group_size=64,
        q_dtype="f32",
        kv_dtype="f32",
        kv_extra_rows=0,
        kv_pad_cols=False,
        q_layout="contiguous",
        v_bits=None,
        v_group_size=None,
    ):
        self.bits, self.group_size, self.q_tag, self.s_tag = bits, group_size, q_dtype, kv_dtype
        self.v_bits = bits if v_bits is None else v_bits
        self.v_group_size = group_size if v_group_size is None else v_group_size
        self.q, self.k, self.v = random_inputs(
            rng,
            B=B,
            Hq=Hq,
            Hkv=Hkv,
            L=L,
            N=N,
            Dk=Dk,
            Dv=Dv,
            bits=bits,
            group_size=group_size,
            q_dtype=DTYPES[q_dtype],
            kv_dtype=DTYPES[kv_dtype],
            v_bits=self.v_bits,
            v_group_size=self.v_group_size,
        )
        self.shape = (B, Hq, L, N)
        q = to_np(self.q)
        if q_layout == "transposed":  # [B, L, H, D] projections viewed as [B, H, L, D]
            q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        elif q_layout == "strided_last":  # every other element of a wider array
            wide = np.zeros(q.shape[:3] + (2 * q.shape[3],), q.dtype)
            wide[..., ::2] = q
            q = wide[..., ::2]
        self.q_np = q

        def views(triple):
            out = []
            for a in map(to_np, triple):
                # pad: rows of W words at a stride of W + 1 (no 16-byte loads)
                out.append(in_buffer(a, kv_extra_rows, rng=rng, pad_cols=kv_pad_cols))
            return tuple(out)

        self.k_np, self.v_np = views(self.k), views(self.v)

    def run(
        self,
        emu,
        *,
        scale=None,
        mask=None,
        mask_np=None,
        mask_tag="none",
        sinks=None,
        sinks_np=None,
        mode="auto",
        **plan_kw,
    ):
        """Runs the kernels, checks against float64; returns (out, plan)."""
        scale = self.q.shape[-1] ** -0.5 if scale is None else scale
        if sinks is not None and sinks_np is None:
            sinks_np = np.array(sinks.astype(mx.float32))
        out, plan = run_sdpa(
            emu,
            self.q_np,
            self.q_tag,
            self.k_np,
            self.v_np,
            self.s_tag,
            scale=scale,
            bits=self.bits,
            group_size=self.group_size,
            v_bits=self.v_bits,
            v_group_size=self.v_group_size,
            mask="causal" if mask == "causal" else mask_np,
            mask_tag=mask_tag,
            sinks=sinks_np,
            mode=MODES[mode],
            **plan_kw,
        )
        ref = sdpa64(
            self.q,
            self.k,
            self.v,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=self.group_size,
            bits=self.bits,
            v_bits=self.v_bits,
            v_group_size=self.v_group_size,
            return_lse=bool(plan_kw.get("with_lse")),
        )
        if plan_kw.get("with_lse"):
            ref, ref_lse = ref
            got = plan["lse"].astype(np.float64)
            empty = np.isneginf(ref_lse)
            assert (np.isneginf(got) == empty).all(), "rows with no key: lse must be -inf"
            assert np.isfinite(got[~empty]).all(), "a row's lse is not finite"
            err = np.max(np.abs(got[~empty] - ref_lse[~empty]), initial=0.0)
            assert err < 1e-3, f"lse off by {err:.3g}"
        assert_close(to_mx(out, self.q_tag), ref, dtype=DTYPES[self.q_tag])
        return out, plan


MASK_TAGS = {mx.bool_: "bool", mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}


def emu_mask(kind, rng, B, Hq, L, N):
    """support.masks' mask as (mlx mask for the oracle, NumPy storage view for
    the kernel, mask tag): the storage keeps a transposed mask's strides."""
    m = make_mask(kind, rng, B, Hq, L, N)
    if m is None:
        return None, None, "none"
    if isinstance(m, str):
        return m, None, m
    view = np.array(m.T).T if kind == "bool_transposed" else to_np(m)
    return m, view, MASK_TAGS[m.dtype]


def run_case(emu, case, rng, mask_kind="none", with_sinks=False, **kw):
    B, Hq, L, N = case.shape
    mask, mask_np, tag = emu_mask(mask_kind, rng, B, Hq, L, N)
    sinks = random_sinks(rng, Hq) if with_sinks else None
    return case.run(emu, mask=mask, mask_np=mask_np, mask_tag=tag, sinks=sinks, **kw)
