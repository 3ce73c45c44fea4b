"""MLX's own Metal `affine_quantize` kernel, run on the emulator: the oracle
for QuantizedRingUpdate's claim to be bit-identical to mx.quantize on the GPU.

The kernel source is taken, at test time, from the MLX headers installed with
the mlx package we build against (include/mlx/backend/metal/kernels/
quantized.h): the kernel template and the two pack helpers it uses are cut
out of that header (the rest of it needs steel GEMM headers the emulator does
not support) into a generated .metal file in the build cache. Nothing of
MLX's source is kept in this repository.

`metal_quantize_model` is an independent NumPy statement of the same
arithmetic, and `cpu_quantize_differs` says where it is expected to differ
from MLX's CPU quantizer (which rounds half to even and starts the group max
at -inf rather than 0).
"""

import os
import re

import mlx.core as mx
import numpy as np
from emu import Emulator, build, cache_root

BITS = [2, 3, 4, 5, 6, 8]
GROUP_SIZES = [32, 64, 128]
TYPES = {"f32": "float", "f16": "half", "bf16": "bfloat16_t"}


def mlx_include_dir():
    import mlx

    for root in mlx.__path__:
        d = os.path.join(root, "include")
        if os.path.exists(os.path.join(d, "mlx", "backend", "metal", "kernels", "quantized.h")):
            return d
    return None


def _extract(src, signature):
    m = re.search(signature, src)
    if not m:
        raise RuntimeError(f"MLX's quantized.h has no match for {signature!r}")
    depth = 0
    for j in range(src.index("{", m.end()), len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[m.start() : j + 1]
    raise RuntimeError("unbalanced braces in quantized.h")


def generate_source(path):
    inc = mlx_include_dir()
    with open(os.path.join(inc, "mlx", "backend", "metal", "kernels", "quantized.h")) as f:
        src = f.read()
    parts = [
        _extract(
            src, r"template <int bits, int wsize = 8>\s*inline constexpr short get_pack_factor\(\)"
        ),
        _extract(
            src,
            r"template <int bits, int wsize = 8>\s*inline constexpr short get_bytes_per_pack\(\)",
        ),
        _extract(
            src,
            r"template <typename T, int group_size, int bits[^>]*>\s*\[\[kernel\]\] void affine_quantize\(",
        ),
    ]
    lines = [
        f"// generated from MLX {mx.__version__}'s installed quantized.h by tests/metal/mlx_oracle.py",
        '#include "mlx/backend/metal/kernels/utils.h"',
        "using namespace metal;",
    ] + parts
    for tag, t in TYPES.items():
        for gs in GROUP_SIZES:
            for bits in BITS:
                lines.append(
                    f'template [[host_name("mlx_affine_quantize_{tag}_gs{gs}_b{bits}")]] [[kernel]] '
                    f"decltype(affine_quantize<{t}, {gs}, {bits}>) affine_quantize<{t}, {gs}, {bits}>;"
                )
    text = "\n".join(lines) + "\n"
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def build_oracle():
    os.makedirs(cache_root(), exist_ok=True)
    src = generate_source(os.path.join(cache_root(), "mlx_affine_quantize.metal"))
    return Emulator(
        build(
            [src],
            include_dirs=[mlx_include_dir()],
            name="mlx_quantize",
            defines=[f"MQ_ORACLE_MLX_VERSION={mx.__version__.replace('.', '_')}"],
        )
    )


def mlx_metal_quantize(oracle, x, group_size, bits, tag):
    """mx.quantize's GPU kernel on rows `x` ([..., D] storage of `tag`):
    (packed uint32 [..., D*bits/32], scales, biases) as storage arrays."""
    x = np.ascontiguousarray(x)
    D = x.shape[-1]
    rows = x.size // D
    out = np.zeros(rows * D * bits // 8, np.uint8)
    storage = x.dtype
    scales = np.zeros(rows * D // group_size, storage)
    biases = np.zeros_like(scales)
    nthreads = x.size // (group_size // 32)
    ok, diag = oracle.dispatch(
        f"mlx_affine_quantize_{tag}_gs{group_size}_b{bits}",
        [x, out, scales, biases],
        (nthreads, 1, 1),
        (min(nthreads, 256), 1, 1),
        threads=True,
    )
    assert ok and not diag, diag
    lead = x.shape[:-1]
    return (
        out.view(np.uint32).reshape(lead + (D * bits // 32,)),
        scales.reshape(lead + (D // group_size,)),
        biases.reshape(lead + (D // group_size,)),
    )


def _round_away(x):
    x = x.astype(np.float64)
    return (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.float32)


def _to_storage(x, tag):
    if tag == "f32":
        return x.astype(np.float32)
    if tag == "f16":
        return x.astype(np.float16)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_storage(a, tag):
    if tag == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def metal_quantize_model(x, group_size, bits, tag):
    """NumPy statement of MLX's Metal affine quantize (float32 arithmetic)."""
    w = _from_storage(np.ascontiguousarray(x), tag)
    lead, D = w.shape[:-1], w.shape[-1]
    g = w.reshape(-1, group_size)
    f = np.float32
    n_bins = f(2**bits - 1)
    w_min = np.minimum(g.min(axis=1), f(np.inf))
    w_max = np.maximum(g.max(axis=1), f(0))  # the GPU kernel starts the max at 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.maximum((w_max - w_min) / n_bins, f(1e-7))
        side = np.abs(w_min) > np.abs(w_max)
        scale = np.where(side, scale, -scale)
        edge = np.where(side, w_min, w_max)
        q0_raw = edge / scale
        q0 = _round_away(q0_raw)
        at_zero = q0 == 0
        scale = np.where(at_zero, scale, edge / q0).astype(f)
        bias = np.where(at_zero, f(0), edge).astype(f)
        q = (g - bias[:, None]) / scale[:, None]
    codes = np.minimum(_round_away(q), n_bins).astype(np.uint64)
    bitpos = np.arange(D, dtype=np.uint64) * np.uint64(bits)
    flat = codes.reshape(-1, D)
    words = np.zeros((flat.shape[0], D * bits // 32 + 1), np.uint64)
    for e in range(D):  # little-endian bit stream, value e at bits [e*bits, (e+1)*bits)
        wi, off = int(bitpos[e]) // 32, int(bitpos[e]) % 32
        words[:, wi] |= (flat[:, e] << np.uint64(off)) & np.uint64(0xFFFFFFFF)
        if off + bits > 32:
            words[:, wi + 1] |= flat[:, e] >> np.uint64(32 - off)
    packed = words[:, :-1].astype(np.uint32).reshape(lead + (D * bits // 32,))
    G = D // group_size
    return (
        packed,
        _to_storage(scale, tag).reshape(lead + (G,)),
        _to_storage(bias, tag).reshape(lead + (G,)),
        dict(
            q=q.reshape(lead + (G, group_size)),
            q0=q0_raw.reshape(lead + (G,)),
            w_max=g.max(axis=1).reshape(lead + (G,)),
        ),
    )


def cpu_quantize_differs(info):
    """Groups where MLX's CPU quantizer may differ from the GPU one: an
    exact .5 tie (rint vs round) in a code or in the snapped edge q0, or a
    group whose values are all negative (max starts at -inf vs 0)."""

    def tie(v):
        return np.abs(v - np.trunc(v)) == 0.5

    return tie(info["q"]).any(axis=-1) | tie(info["q0"]) | (info["w_max"] < 0)
