"""llama.cpp's CPU flash attention (ggml's FLASH_ATTN_EXT) driven through ctypes,
for bench/kernels/decode.py's comparison column.

ggml comes from an installed ``llama-cpp-python`` (its package ships libggml*),
or from a directory of ggml shared libraries named by ``MLXQ_GGML_LIB`` (for
example a build of llama.cpp's ``ggml`` target). PyPI has ``llama-cpp-python``
only as a source distribution that builds llama.cpp (about 10 minutes on 2
cores), so neither is installed by default; ``available()`` says why not.

The graph is one ggml_flash_attn_ext node: q f32 [D, 1, Hq], K/V of type
q4_0 / q8_0 / f16 [D, N, Hkv] (quantized from the same normal values by ggml's
own quantize_chunk), no mask, computed with ggml_graph_compute_with_ctx on
``threads`` threads. llama.cpp's CPU kernel converts the query to K's dot
format and, unlike mlxq, reads each K/V row once per query head.
"""

import ctypes
import glob
import os
import statistics
import time

import numpy as np

GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}
_GGML_TYPE_F32 = 0


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


def _library_dirs():
    env = os.environ.get("MLXQ_GGML_LIB")
    if env:
        yield env
    try:
        import llama_cpp  # noqa: F401  (its import loads the libraries too)

        base = os.path.dirname(llama_cpp.__file__)
        yield os.path.join(base, "lib")
        yield base
    except Exception:
        pass


def _load():
    for d in _library_dirs():
        found = {
            name: sorted(glob.glob(os.path.join(d, f"lib{name}.so*")))
            for name in ("ggml-base", "ggml-cpu", "ggml")
        }
        if all(found.values()):
            libs = [ctypes.CDLL(found[n][0], mode=ctypes.RTLD_GLOBAL) for n in found]
            return libs, d
    return None, None


_LIBS, _DIR = _load()


def available():
    """(True, where) or (False, why not)."""
    if _LIBS is None:
        return False, (
            "no ggml: llama-cpp-python is not installed (PyPI has only its sdist) "
            "and MLXQ_GGML_LIB is not set"
        )
    return True, _DIR


def _api():
    base, cpu, _ = _LIBS
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.argtypes = [_InitParams]
    base.ggml_init.restype = vp
    base.ggml_free.argtypes = [vp]
    base.ggml_new_tensor_4d.argtypes = [vp, ctypes.c_int, i64, i64, i64, i64]
    base.ggml_new_tensor_4d.restype = vp
    base.ggml_get_data.argtypes = [vp]
    base.ggml_get_data.restype = vp
    base.ggml_nbytes.argtypes = [vp]
    base.ggml_nbytes.restype = ctypes.c_size_t
    base.ggml_flash_attn_ext.argtypes = [vp, vp, vp, vp, vp] + [ctypes.c_float] * 3
    base.ggml_flash_attn_ext.restype = vp
    base.ggml_new_graph.argtypes = [vp]
    base.ggml_new_graph.restype = vp
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, vp, vp, i64, i64, i64, vp]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    return base, cpu


def _fill(base, tensor, values, type_id):
    """Writes float32 `values` (rows of the tensor's ne0) in the tensor's type."""
    dst = base.ggml_get_data(tensor)
    src = np.ascontiguousarray(values, dtype=np.float32)
    n_per_row = src.shape[-1]
    if type_id == _GGML_TYPE_F32:
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)
    elif type_id == GGML_TYPES["f16"]:
        h = src.astype(np.float16)
        ctypes.memmove(dst, h.ctypes.data, h.nbytes)
    else:
        rows = src.size // n_per_row
        base.ggml_quantize_chunk(type_id, src.ctypes.data, dst, 0, rows, n_per_row, None)


def time_decode(Hq, Hkv, D, N, kv_type, threads=2, warmup=2, repeats=10, seed=0):
    """Median / min ms of one decode step (L=1) of ggml's flash attention."""
    base, cpu = _api()
    t = GGML_TYPES[kv_type]
    rng = np.random.default_rng(seed)
    kv_bytes = 2 * Hkv * N * D * 2  # f16 is the largest type used
    ctx = base.ggml_init(_InitParams(kv_bytes + Hq * D * 8 + (256 << 20), None, False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        q = base.ggml_new_tensor_4d(ctx, _GGML_TYPE_F32, D, 1, Hq, 1)
        k = base.ggml_new_tensor_4d(ctx, t, D, N, Hkv, 1)
        v = base.ggml_new_tensor_4d(ctx, t, D, N, Hkv, 1)
        _fill(base, q, rng.standard_normal((Hq, D)), _GGML_TYPE_F32)
        for tensor in (k, v):
            _fill(base, tensor, rng.standard_normal((Hkv * N, D)), t)
        out = base.ggml_flash_attn_ext(ctx, q, k, v, None, D**-0.5, 0.0, 0.0)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, out)
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            if cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
                raise RuntimeError("ggml_graph_compute_with_ctx failed")
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": times}
    finally:
        base.ggml_free(ctx)
