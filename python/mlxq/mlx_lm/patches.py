"""enable() / disable(): which mlx-lm attributes mlxq replaces, and how they come back."""

import contextlib
import dataclasses
import importlib
import sys
import threading
import warnings
from typing import Any, List, Optional, Tuple

from .. import prompt_cache
from ..arguments import as_int, renamed
from ..cache import ChunkedQuantizedKVCache, RotatingQuantizedKVCache
from ..kv_format import BITS, GROUP_SIZES
from . import attention, generation
from .originals import record, recorded
from .settings import DEFAULT, layers_from, settings
from .settings import install as install_settings

_lock = threading.RLock()
# (object, attribute, had it, previous value) for every change, in order.
_patches: Optional[List[Tuple[Any, str, bool, Any]]] = None
# id(original function) -> its replacement, while enabled.
_replacements = {}


def _mlx_lm_modules():
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))
    ]


# Every mlx-lm function enable() replaces: the module that defines it, its
# name, and mlxq's replacement.
_PATCHED = (
    ("mlx_lm.models.base", "scaled_dot_product_attention", attention.scaled_dot_product_attention),
    (
        "mlx_lm.models.base",
        "quantized_scaled_dot_product_attention",
        attention.quantized_scaled_dot_product_attention,
    ),
    ("mlx_lm.models.cache", "make_prompt_cache", generation.make_prompt_cache),
    # Files of every mlxq format (Hadamard basis, K/V of two widths, MLA
    # latents, chunked caches) through mlx-lm's loader, and its commands'.
    ("mlx_lm.models.cache", "load_prompt_cache", prompt_cache.load_prompt_cache),
    ("mlx_lm.generate", "maybe_quantize_kv_cache", generation.maybe_quantize_kv_cache),
    ("mlx_lm.generate", "generate_step", generation.generate_step),
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
    stock = recorded()
    originals = {id(stock[name]): (module, name) for module, name, _ in table}
    for mod_name, module in list(sys.modules.items()):
        if module is None or mod_name.split(".")[0] in ("mlx_lm", "mlxq"):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            origin = originals.get(id(value))
            # The originals stay alive (mlxq.mlx_lm.originals), so an equal id is the object.
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
    above and the batch-generation ones (mlxq.mlx_lm.batching)."""
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
    k_bits: Optional[int] = None,
    kv_layers=None,
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
          the keys' (``kv_bits=8`` with ``v_bits=4``: 8-bit keys, 4-bit
          values). Default: ``kv_bits``.
        k_bits (int, optional): The keys' bits in those caches, apart from
          the values' ``kv_bits`` (or ``v_bits``). Default: the recipe, 8
          for ``kv_bits=4`` unless ``v_bits`` is given (K8/V4: retrieval at
          32k tokens equal to bf16's, where 4-bit keys miss keys;
          docs/results/accuracy.md), else ``kv_bits``. ``k_bits=4`` keeps
          4-bit keys.
        v_group_size (int, optional): The values' group size. Default:
          ``kv_group_size``.
        kv_recent (int, optional): How many of the most recent tokens
          those caches also keep exact (mlxq.cache.recent; the quantized
          rows before them and the exact window merge by log-sum-exp); a
          sliding-window layer keeps at most its ring's ``max_size - keep -
          1``. Default: the recipe, 128 for caches of 4 bits or fewer
          (``kv_bits=4`` within 1% of unquantized perplexity on the
          packaged models, docs/results/accuracy.md) and 0 above; MLA
          latent and chunked-attention caches keep none. 0 turns it off.
        compiled_decode (bool, optional): Whether ``generate_step`` (so
          ``generate`` / ``stream_generate``) runs its one-token steps
          through one ``mx.compile``d graph per model (mlxq.compiled):
          bit-identical tokens and logits, a fraction of the host time.
          Steps it cannot compile decode eagerly (the reason goes to the
          ``mlxq.compiled`` debug log). Default False.
        kv_layers (dict or path, optional): Caches quantized otherwise than
          ``kv_bits`` and the options above say: prompt-cache index to a KV
          setting (``{0: "8", 5: "8/4+hadamard"}``, the grammar of
          mlxq.kv_spec, or bits as an int), or the path of a JSON file with
          ``{"kv_layers": {...}}`` (``mlxq-fidelity --write-layers``). They
          apply whenever ``kv_bits`` is set. ``{}`` clears them.
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
    if kv_layers is not None:
        changes["kv_layers"] = layers_from(kv_layers, where)
    if kv_hadamard is not None:
        if not isinstance(kv_hadamard, bool):
            raise ValueError(f"[{where}] kv_hadamard must be a bool, got {kv_hadamard!r}.")
        changes["kv_hadamard"] = kv_hadamard
    if k_bits is not None:
        if type(k_bits) is not int or k_bits not in BITS:
            raise ValueError(f"[{where}] k_bits must be one of {BITS}, got {k_bits!r}.")
        changes["k_bits"] = k_bits
    if v_bits is not None or v_group_size is not None:
        if v_bits is not None and (type(v_bits) is not int or v_bits not in BITS):
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
        record({name: getattr(importlib.import_module(module), name) for module, name, _ in table})
        stock = recorded()
        _replacements.clear()
        _replacements.update({id(stock[name]): fn for _, name, fn in table})
        _patches = []
        # Every name bound to an original in a loaded mlx_lm module (the
        # model modules imported `scaled_dot_product_attention` by value).
        for module in _mlx_lm_modules():
            for name, value in list(vars(module).items()):
                if callable(value) and id(value) in _replacements:
                    _set(module, name, _replacements[id(value)])
        _set(lm_cache, "RotatingQuantizedKVCache", RotatingQuantizedKVCache)
        _set(lm_cache, "ChunkedQuantizedKVCache", ChunkedQuantizedKVCache)
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
        stock = recorded()
        back = {id(fn): stock[name] for _, name, fn in _patch_table()}
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
