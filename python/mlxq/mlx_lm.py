"""Use mlxq as mlx-lm's quantized-KV backend: one call, reversible.

>>> import mlxq.mlx_lm
>>> mlxq.mlx_lm.enable()                 # or: with mlxq.mlx_lm.enabled(): ...
>>> mlx_lm.generate(model, tokenizer, prompt, kv_bits=4, quantized_kv_start=0)
>>> mlxq.mlx_lm.disable()

While enabled, mlx-lm (0.32) runs with:

* **attention** — ``mlx_lm.models.base.scaled_dot_product_attention`` and
  ``quantized_scaled_dot_product_attention`` (and the same names already
  imported into loaded ``mlx_lm.*`` modules, model modules included) send
  quantized ``(packed, scales, biases)`` keys/values to mlxq's fused kernel,
  with attention sinks (gpt-oss) and with no cache at all (Gemma's KV-shared
  layers hand over a donor's quantized tuples). Plain K/V still go to
  ``mx.fast.scaled_dot_product_attention`` through mlx-lm's own function.
* **KV quantization** — ``maybe_quantize_kv_cache`` (what ``generate_step``
  calls with ``kv_bits``) turns mlx-lm's ``KVCache`` into mlxq's
  ``QuantizedKVCache`` and ``RotatingKVCache`` into mlxq's
  ``RotatingQuantizedKVCache``, so sliding-window models (Gemma 3/4,
  gpt-oss, ``max_kv_size``) can quantize; their updates quantize in place.
* **cache creation** — ``make_prompt_cache(model, max_kv_size=None, *,
  kv_bits=None, kv_group_size=64)`` takes ``kv_bits`` to return quantized
  caches from the first token (without it, exactly mlx-lm's caches), and
  ``generate_step`` (so ``generate``/``stream_generate``) with ``kv_bits``
  applies the ``quantized_kv_start`` rule before the first prefill chunk
  too: with ``quantized_kv_start=0`` the cache is quantized from the first
  token.
* **prompt-cache files** — ``RotatingQuantizedKVCache`` is registered in
  ``mlx_lm.models.cache``, so mlx-lm's ``load_prompt_cache`` loads files that
  hold one.

Everything mlxq does not handle goes to the original functions unchanged: no
``kv_bits``, bits/group sizes or head dims outside mlxq's kernels, cache
classes other than mlx-lm's ``KVCache``/``RotatingKVCache`` (batch, chunked,
SSM caches...), and devices that mlxq has no kernels for. :func:`disable`
puts back every attribute it changed, by identity.
"""

import contextlib
import dataclasses
import importlib
import sys
import threading
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from .arguments import as_int, renamed
from .attention import is_quantized, quantized_sdpa, recent_split_sdpa
from .cache import RotatingQuantizedKVCache
from .cache.base import BaseCache
from .kv_format import BITS, GROUP_SIZES, FormattedTriple
from .lm_caches import as_mlxq, device_supported, quantize_caches
from .settings import DEFAULT, settings
from .settings import install as install_settings
from .split import is_split

_lock = threading.RLock()
# (object, attribute, had it, previous value) for every change, in order.
_patches: Optional[List[Tuple[Any, str, bool, Any]]] = None
# original function -> its replacement, while enabled.
_replacements: Dict[Any, Any] = {}
_originals: Dict[str, Any] = {}
_counts: Counter = Counter()

# The fused kernel the attention dispatch calls (tests swap in the reference).
_attend = quantized_sdpa


# --------------------------------------------------------------- attention
def _mlxq_attention(queries, keys, values, scale, mask, sinks, group_size, bits):
    """mlxq's kernel, or None when it does not take these inputs."""
    if not (is_quantized(keys) and is_quantized(values)):
        return None
    # Only mlxq can attend K/V in a format of its own (mlx-lm would
    # silently read them wrong): those never fall back.
    rotated = isinstance(keys, FormattedTriple) or isinstance(values, FormattedTriple)
    if mask is not None and not isinstance(mask, (str, mx.array)):
        return _declined(rotated, f"a mask of type {type(mask).__name__}")
    if not device_supported():
        return _declined(rotated, f"no mlxq kernels on {mx.default_device()}")
    try:
        out = _attend(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=group_size,
            bits=bits,
        )
    except ValueError as e:  # a shape, dtype, bits or mask outside mlxq's kernels
        return _declined(rotated, str(e))
    _counts["mlxq"] += 1
    return out


def _declined(only_mlxq: bool, why: str):
    """None (mlx-lm's function takes the call), except for K/V that only
    mlxq can attend (in the Hadamard basis, or values quantized apart from
    the keys): mlx-lm would silently read them wrong."""
    if only_mlxq:
        raise ValueError(
            f"[mlxq.mlx_lm] K/V in the Hadamard basis (hadamard) and values quantized apart "
            f"from the keys (v_bits) need mlxq's kernel: {why}"
        )
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's attention dispatch, with quantized K/V on mlxq's fused kernel.

    Quantized ``(packed, scales, biases)`` keys and values go to
    :func:`mlxq.quantized_sdpa`, with or without ``sinks``, with the bits and
    group size of ``cache`` (or inferred from the shapes when there is no
    cache, as in Gemma's KV-shared layers). Anything else goes to mlx-lm's
    original function.
    """
    if is_split(keys):  # a recent-window cache's fetch: only mlxq can attend it
        _counts["mlxq"] += 1
        return recent_split_sdpa(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
            group_size=getattr(cache, "group_size", None),
            bits=getattr(cache, "bits", None),
        )
    if is_quantized(keys):
        group_size = getattr(cache, "group_size", None) if hasattr(cache, "bits") else None
        bits = getattr(cache, "bits", None) if group_size is not None else None
        out = _mlxq_attention(queries, keys, values, scale, mask, sinks, group_size, bits)
        if out is not None:
            return out
    _counts["mlx_lm"] += 1
    return _originals["scaled_dot_product_attention"](
        queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
    )


def quantized_scaled_dot_product_attention(
    queries, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8
):
    """mlx-lm's quantized attention composition, replaced by mlxq's fused kernel."""
    out = _mlxq_attention(queries, q_keys, q_values, scale, mask, None, group_size, bits)
    if out is not None:
        return out
    _counts["mlx_lm"] += 1
    return _originals["quantized_scaled_dot_product_attention"](
        queries, q_keys, q_values, scale, mask, group_size=group_size, bits=bits
    )


# ------------------------------------------------------------------ caches
def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    """mlx-lm's ``maybe_quantize_kv_cache``, quantizing into mlxq's caches.

    Same rule as mlx-lm (a cache is quantized once its ``offset`` reaches
    ``quantized_kv_start``), but mlx-lm's ``KVCache`` becomes mlxq's
    ``QuantizedKVCache`` and ``RotatingKVCache`` mlxq's
    ``RotatingQuantizedKVCache`` (mlx-lm raises for the latter), as the
    settings in force say (:func:`mlxq.settings.settings`). Other caches are
    left to mlx-lm.
    """
    quantize_caches(prompt_cache, quantized_kv_start, kv_group_size, kv_bits, settings())


def make_prompt_cache(
    model,
    max_kv_size: Optional[int] = None,
    *,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
):
    """mlx-lm's ``make_prompt_cache``, optionally quantized from the first token.

    Without ``kv_bits`` this is exactly mlx-lm's. With it, every ``KVCache``
    and ``RotatingKVCache`` the model asks for is created as mlxq's
    ``QuantizedKVCache`` / ``RotatingQuantizedKVCache`` (empty), so prefill
    runs on the fused kernel and the cache never holds unquantized K/V.
    """
    cache = _originals["make_prompt_cache"](model, max_kv_size=max_kv_size)
    if kv_bits is not None:
        maybe_quantize_kv_cache(cache, 0, kv_group_size, kv_bits)
    return cache


def mark_private(prompt_cache) -> None:
    """Marks mlxq's caches in ``prompt_cache`` as seen by one generation loop
    only: mlx-lm reads their state after each prefill chunk just to evaluate
    it, so their writes may stay in place (see ``BaseCache._private``). For
    caches nobody else holds, such as the ones a loop makes for itself."""
    for c in prompt_cache:
        if isinstance(c, BaseCache):
            c._private = True


def generate_step(
    prompt,
    model,
    *args,
    prompt_cache=None,
    max_kv_size=None,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=None,
    **kwargs,
):
    """mlx-lm's ``generate_step``, with the cache quantized before the first chunk.

    mlx-lm applies its ``quantized_kv_start`` rule only after each model call,
    so even with ``quantized_kv_start=0`` its first prefill chunk (2048
    tokens) runs on a bf16 cache that is then converted. When mlx-lm makes the
    cache (no ``prompt_cache`` given) and ``kv_bits`` is set, the same rule is
    applied once more before the first chunk: with ``quantized_kv_start=0``
    every KV cache is quantized from the first token, so prefill runs on
    quantized K/V and never holds a bf16 copy of the prompt's cache.
    """
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    if quantized_kv_start is None:
        quantized_kv_start = DEFAULT_QUANTIZED_KV_START
    compiled_decode = settings().compiled_decode
    made = prompt_cache is None and (kv_bits is not None or compiled_decode)
    if made:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
        if kv_bits is not None:
            maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits)
    if compiled_decode:
        model = _compiled_model(model, prompt_cache)
    if made:
        mark_private(prompt_cache)
    return _originals["generate_step"](
        prompt,
        model,
        *args,
        prompt_cache=prompt_cache,
        max_kv_size=max_kv_size,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        **kwargs,
    )


def _compiled_model(model, prompt_cache):
    """``model`` with its one-token steps compiled (mlxq.compiled), and
    mlx-lm's plain caches in ``prompt_cache`` swapped for mlxq's (the same
    tokens and arithmetic, with the compiled step's protocol)."""
    from .compiled import CompiledModel

    if isinstance(model, CompiledModel):
        return model
    for i, c in enumerate(prompt_cache):
        ours = as_mlxq(c)
        if ours is not None:
            prompt_cache[i] = ours
    return CompiledModel(model)


# ---------------------------------------------------------- enable/disable
def _mlx_lm_modules():
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))
    ]


# Every mlx-lm function enable() replaces: the module that defines it, its
# name, and mlxq's replacement.
_PATCHED = (
    ("mlx_lm.models.base", "scaled_dot_product_attention", scaled_dot_product_attention),
    (
        "mlx_lm.models.base",
        "quantized_scaled_dot_product_attention",
        quantized_scaled_dot_product_attention,
    ),
    ("mlx_lm.models.cache", "make_prompt_cache", make_prompt_cache),
    ("mlx_lm.generate", "maybe_quantize_kv_cache", maybe_quantize_kv_cache),
    ("mlx_lm.generate", "generate_step", generate_step),
)


# The mlx-lm releases mlxq's integration is tested against (pyproject.toml's
# extras pin the same range): it replaces private mlx-lm functions.
MLX_LM_VERSIONS = ((0, 32, 0), (0, 33, 0))
MLX_LM_RANGE = ">=0.32.0,<0.33"


def check_mlx_lm_version(version: str) -> None:
    """Raises RuntimeError unless ``version`` is in :data:`MLX_LM_RANGE`."""
    try:
        found = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        found = None
    low, high = MLX_LM_VERSIONS
    if found is None or not (low <= found < high):
        raise RuntimeError(
            f"[mlxq.mlx_lm.enable] mlxq supports mlx-lm {MLX_LM_RANGE}, found {version}: "
            f"pip install 'mlx-lm{MLX_LM_RANGE}'."
        )


# (module, name) pairs enable() has warned about: each warns once per process.
_warned_bindings: set = set()


def _warn_early_bindings(table) -> None:
    """Warn once for each name that a module outside mlx-lm and mlxq bound to
    one of mlx-lm's originals before enable(): calls through that name keep
    stock behaviour (``from mlx_lm.generate import generate_step`` before
    enable() runs the first prefill chunk on an unquantized cache)."""
    originals = {id(_originals[name]): (module, name) for module, name, _ in table}
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] in ("mlx_lm", "mlxq"):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            origin = originals.get(id(value))
            # The originals stay alive in _originals, so an equal id is the object.
            if origin is None or (mod_name, attr) in _warned_bindings:
                continue
            _warned_bindings.add((mod_name, attr))
            warnings.warn(
                f"{mod_name}.{attr} is mlx-lm's {origin[0]}.{origin[1]}, bound before "
                "mlxq.mlx_lm.enable(): calls through it keep mlx-lm's own behaviour. "
                f"Import it after enable(), or call {origin[0]}.{origin[1]}.",
                stacklevel=3,
            )


def _patch_table():
    """Every (module, name, replacement) enable() installs: the functions
    above and the batch-generation ones (mlxq.batching)."""
    from . import batching

    return _PATCHED + batching.PATCHED


def _set(obj, name: str, value) -> None:
    had = name in vars(obj)
    _patches.append((obj, name, had, vars(obj).get(name)))
    setattr(obj, name, value)


class _Handle:
    """What :func:`enable` returns: a context manager that disables on exit
    (only if this call was the one that enabled)."""

    def __init__(self, owns: bool):
        self._owns = owns

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._owns:
            disable()
        return False


def enable(
    kv_hadamard: Optional[bool] = None,
    v_bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    kv_recent: Optional[int] = None,
    compiled_decode: Optional[bool] = None,
    *,
    kv_rotate: Optional[bool] = None,
    kv_keep_recent: Optional[int] = None,
) -> _Handle:
    """Make mlx-lm use mlxq (see the module docstring). Idempotent.

    Every option is set when given, even when mlxq is already enabled, and
    reset by :func:`disable`.

    Args:
        kv_hadamard (bool, optional): Whether the caches mlxq quantizes for
          mlx-lm (``kv_bits``) store their rows in the Hadamard basis
          (mlxq.hadamard): opt-in, measured per model in
          docs/results/accuracy.md. Default False.
        v_bits (int, optional): The values' bits in those caches, apart from
          the keys' ``kv_bits`` (``kv_bits=8`` with ``v_bits=4``: 8-bit keys,
          4-bit values). Default: ``kv_bits``.
        v_group_size (int, optional): The values' group size. Default:
          ``kv_group_size``.
        kv_recent (int, optional): How many of the most recent tokens
          those caches also keep exact (mlxq.cache.recent; the quantized
          rows before them and the exact window merge by log-sum-exp); a
          sliding-window layer keeps at most its ring's ``max_size - keep -
          1``. Default 0.
        compiled_decode (bool, optional): Whether ``generate_step`` (so
          ``generate`` / ``stream_generate``) runs its one-token steps
          through one ``mx.compile``d graph per model (mlxq.compiled):
          bit-identical tokens and logits, a fraction of the host time.
          Steps it cannot compile decode eagerly (the reason goes to the
          ``mlxq.compiled`` debug log). Default False.
        kv_rotate, kv_keep_recent: Deprecated names of ``kv_hadamard`` and
          ``kv_recent``.

    Returns a context manager: ``with mlxq.mlx_lm.enable(): ...`` disables
    again on exit.
    """
    where = "mlxq.mlx_lm.enable"
    kv_hadamard = renamed(kv_hadamard, kv_rotate, "kv_hadamard", "kv_rotate", where)
    kv_recent = renamed(kv_recent, kv_keep_recent, "kv_recent", "kv_keep_recent", where)
    import mlx_lm

    check_mlx_lm_version(mlx_lm.__version__)
    global _patches
    changes = {}
    if compiled_decode is not None:
        if not isinstance(compiled_decode, bool):
            raise ValueError(
                f"[mlxq.mlx_lm.enable] compiled_decode must be a bool, got {compiled_decode!r}."
            )
        changes["compiled_decode"] = compiled_decode
    if kv_recent is not None:
        changes["kv_recent"] = as_int(kv_recent, "kv_recent", where, minimum=0)
    if kv_hadamard is not None:
        if not isinstance(kv_hadamard, bool):
            raise ValueError(f"[{where}] kv_hadamard must be a bool, got {kv_hadamard!r}.")
        changes["kv_hadamard"] = kv_hadamard
    if v_bits is not None or v_group_size is not None:
        if v_bits is not None and v_bits not in BITS:
            raise ValueError(f"[mlxq.mlx_lm.enable] v_bits must be one of {BITS}, got {v_bits!r}.")
        if v_group_size is not None and v_group_size not in GROUP_SIZES:
            raise ValueError(
                f"[mlxq.mlx_lm.enable] v_group_size must be one of {GROUP_SIZES}, "
                f"got {v_group_size!r}."
            )
        changes.update(v_group_size=v_group_size, v_bits=v_bits)
    install_settings(dataclasses.replace(settings(), **changes))
    with _lock:
        if _patches is not None:
            return _Handle(owns=False)
        from mlx_lm.models import cache as lm_cache

        from . import batching

        table = _patch_table()
        # import_module, not attribute access: the mlx_lm package's
        # `generate` attribute is the function, not the module.
        _originals.update(
            {name: getattr(importlib.import_module(module), name) for module, name, _ in table}
        )
        _replacements.clear()
        _replacements.update({id(_originals[name]): fn for _, name, fn in table})
        _patches = []
        # Every name bound to an original in a loaded mlx_lm module (the
        # model modules imported `scaled_dot_product_attention` by value).
        for module in _mlx_lm_modules():
            for name, value in list(vars(module).items()):
                if callable(value) and id(value) in _replacements:
                    _set(module, name, _replacements[id(value)])
        _set(lm_cache, "RotatingQuantizedKVCache", RotatingQuantizedKVCache)
        for cls in batching.TO_QUANTIZED:
            _set(cls, "to_quantized", batching.batch_to_quantized)
        _warn_early_bindings(table)
        return _Handle(owns=True)


def disable() -> None:
    """Undo :func:`enable`: every attribute it changed gets its old value back.

    Names that modules imported while mlxq was enabled (bound to mlxq's
    replacements) are pointed back at mlx-lm's originals too. Idempotent.
    """
    global _patches
    with _lock:
        install_settings(DEFAULT)
        if _patches is None:
            return
        for obj, name, had, old in reversed(_patches):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        back = {id(fn): _originals[name] for _, name, fn in _patch_table()}
        for module in _mlx_lm_modules():
            for name, value in list(vars(module).items()):
                if id(value) in back and callable(value):
                    setattr(module, name, back[id(value)])
        _patches = None
        _replacements.clear()


def is_enabled() -> bool:
    """Whether mlx-lm currently runs on mlxq."""
    return _patches is not None


@contextlib.contextmanager
def enabled():
    """``with mlxq.mlx_lm.enabled(): ...`` — mlxq inside the block only
    (left enabled if it already was)."""
    handle = enable()
    try:
        yield
    finally:
        handle.__exit__(None, None, None)


def counters() -> Dict[str, int]:
    """Attention calls since the last :func:`reset_counters`: ``"mlxq"`` (fused
    kernel) and ``"mlx_lm"`` (handed to mlx-lm's original function)."""
    return dict(_counts)


def reset_counters() -> None:
    _counts.clear()


__all__ = [
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "counters",
    "reset_counters",
    "scaled_dot_product_attention",
    "quantized_scaled_dot_product_attention",
    "make_prompt_cache",
    "maybe_quantize_kv_cache",
    "generate_step",
]
