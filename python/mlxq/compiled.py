"""Compiled decode: a model's one-token step as one ``mx.compile``d graph.

mlx-lm rebuilds the decode step's graph in Python for every token (2.5 ms of
host time per token for an 8B model on an H200). :class:`CompiledDecode`
traces the step once and replays it: per token it only does the caches'
bookkeeping (``prepare_decode``), one call of the compiled graph, in which
the caches' writes run in place at array positions and the fused attention
reads the whole buffers (mlxq's primitives are real MLX primitives, so they
live inside the graph), and ``adopt_decode``. See mlxq/cache/decode_step.py
for the cache side.

A graph is kept per step signature: the input shape and each cache's plan
kind and capacity. Growing buffers change capacity every 256 tokens, so the
step retraces that often (and never once every ring is full); the last few
graphs are kept, older ones released.

Anything it cannot compile falls back to eager decode, with a one-line reason
in the ``mlxq.compiled`` debug log: model classes it has not been checked
against (and gemma4 on CUDA), unquantized caches, caches without the
protocol (mlx-lm's own, ``recent`` windows), Metal;
prefill chunks and input embeddings always run eagerly.
"""

import logging
import warnings
from collections import OrderedDict
from typing import List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import decode_step
from .cache.base import BaseCache
from .cache.decode_step import DecodeView

log = logging.getLogger("mlxq.compiled")

# mlx-lm model modules whose decode step is checked bit-identical to eager
# (tests/lm/test_compiled_decode.py): they read a cache's offset only as RoPE's
# offset and its mask only through make_mask.
MODEL_MODULES = frozenset(
    "mlx_lm.models." + m
    for m in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "gemma3",
        "gpt_oss",
        "gemma4_text",
        "gemma4",
    )
)


# Model modules whose compiled step MLX's CUDA kernel fusion makes differ
# from eager by rounding (measured on an H200: gemma4's logits by one bf16
# ulp): they decode eagerly there.
CUDA_EAGER_MODULES = frozenset({"mlx_lm.models.gemma4_text", "mlx_lm.models.gemma4"})


class NotCompiled(Exception):
    """A step the compiled path does not take (the message says why)."""


def _weights_key(model) -> tuple:
    """Identity of the model's weights: the graphs hold them as constants."""
    return tuple(id(a) for _, a in tree_flatten(model.parameters()))


class CompiledDecode:
    """A model's compiled one-token step (see the module docstring).

    Args:
        model: An mlx-lm model (``model(inputs, cache=...)``).
        max_graphs (int): Graphs kept at once (one per step signature).
        compile (bool): False runs the same step function uncompiled (each
          step traced anew), to tell compilation's effects from the step's.

    Attributes:
        traces (int): Graphs traced so far (the retrace count).
        steps (int): Steps run through a compiled graph.
        declined (str or None): Why the model decodes eagerly, once it does.
    """

    def __init__(self, model, max_graphs: int = 4, compile: bool = True):
        self.model = model
        self._compile = compile
        self.max_graphs = max_graphs
        self.traces = 0
        self.steps = 0
        self.declined: Optional[str] = None
        self._graphs: "OrderedDict[tuple, object]" = OrderedDict()
        self._reasons = set()
        self._weights = _weights_key(model)

    def matches(self, model) -> bool:
        """Whether this decoder's graphs hold ``model``'s current weights."""
        return model is self.model and _weights_key(model) == self._weights

    # ------------------------------------------------------------------ step
    def __call__(self, inputs: mx.array, cache: List) -> Optional[mx.array]:
        """The step's logits, or None: decode this step eagerly."""
        if self.declined is not None:
            return None
        if not (isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[1] == 1):
            return None  # prefill chunks and speculative steps: eager by design
        why = self._why_not(cache)
        if why is not None:
            return self._decline(why, for_good=why.startswith("model"))
        if inputs.dtype != mx.uint32:  # the prompt's last token (int64), then samples
            inputs = inputs.astype(mx.uint32)  # one graph for both: the same rows
        try:
            plans = [decode_step.prepare_step(c) for c in cache]  # _why_not asked refusal
        except ValueError as e:
            self._forget(cache)
            return self._decline(str(e))
        values, slots = _step_scalars(plans)
        # The stream too: a graph's primitives run on the one it was traced on.
        stream = str(mx.default_stream(mx.default_device()))
        sig = (stream, tuple(inputs.shape), inputs.dtype, tuple(slots))
        sig += tuple(DecodeView.signature_of(c, p) for c, p in zip(cache, plans))
        graph = self._graphs.get(sig)
        fresh = graph is None
        if fresh:
            graph = self._graph(cache, plans, slots)
        try:
            out = graph(*_graph_inputs(inputs, cache, values))
        except (NotCompiled, ValueError) as e:
            if not fresh:
                raise
            self._forget(cache)
            return self._decline(f"model {type(self.model).__module__}: {e}", for_good=True)
        if fresh:
            self._keep(sig, graph)
        self._graphs.move_to_end(sig)
        logits, i = out[0], 1
        for c, p in zip(cache, plans):
            n = 3 if c._store.quantized else 1
            k = tuple(out[i : i + n]) if n == 3 else out[i]
            v = tuple(out[i + n : i + 2 * n]) if n == 3 else out[i + n]
            decode_step.adopt_step(c, p, k, v)
            i += 2 * n
        self.steps += 1
        return logits

    def _why_not(self, cache) -> Optional[str]:
        module = type(self.model).__module__
        if module not in MODEL_MODULES:
            return f"model {module}.{type(self.model).__name__} is not one compiled decode knows"
        if not isinstance(cache, list) or not cache:
            return "no cache list"
        gpu = mx.default_device().type == mx.gpu
        if gpu and not mx.cuda.is_available():
            return "Metal: compiled decode is checked on the CPU and CUDA only"
        if gpu and module in CUDA_EAGER_MODULES:
            return f"model {module} decodes eagerly on CUDA (its fused graph rounds differently)"
        for i, c in enumerate(cache):
            if not isinstance(c, BaseCache):
                return f"cache {type(c).__module__}.{type(c).__name__} has no compiled step"
            if not c._store.quantized:
                # A whole-buffer fetch sends unquantized K/V to mx.fast with a
                # mask: on CUDA its masked composition, not eager's one-token
                # kernel (other bits); on the CPU it measured slower than the
                # host time saved (0.96x eager at 2k, 0.60x at 32k keys).
                return (
                    f"layer {i}: unquantized caches decode eagerly (compiled decode needs kv_bits)"
                )
            refusal = decode_step.refusal(c)
            if refusal is not None:
                return f"layer {i}: {refusal}"
        return None

    def _decline(self, why: str, for_good: bool = False):
        if why not in self._reasons:  # one line per reason
            self._reasons.add(why)
            log.debug("mlxq compiled decode: eager step (%s)", why)
            if decode_step.WINDOW_REFUSAL in why:  # asked for, and not given: say so
                warnings.warn(
                    "[mlxq.compiled] compiled_decode: caches with a recent window (the "
                    "4-bit recipe keeps one unless kv_recent=0) decode eagerly; "
                    "enable(kv_recent=0) compiles their steps.",
                    stacklevel=3,
                )
        if for_good:
            self.declined = why
        return None

    @staticmethod
    def _forget(cache) -> None:
        for c in cache:
            if isinstance(c, BaseCache):
                c._pending_decode = None

    def _keep(self, sig, graph) -> None:
        self._graphs[sig] = graph
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)  # releases its compiled graph

    # ------------------------------------------------------------- the graph
    def _graph(self, cache, plans, slots):
        model = self.model
        n_scalars = 1 + max(max(s) for s in slots)
        layout = [
            (DecodeView.static_of(c), p, 3 if c._store.quantized else 1)
            for c, p in zip(cache, plans)
        ]

        def step(*flat):
            self.traces += 1  # runs only while tracing
            scalars = flat[1 : 1 + n_scalars]
            views, i = [], 1 + n_scalars
            for (static, p, n), slot in zip(layout, slots):
                k = tuple(flat[i : i + n]) if n == 3 else flat[i]
                v = tuple(flat[i + n : i + 2 * n]) if n == 3 else flat[i + n]
                i += 2 * n
                views.append(DecodeView(static, p, k, v, *(scalars[j] for j in slot)))
            logits = model(flat[0], cache=views)
            _check_views(views)
            out = [logits]
            for view, (_, _, n) in zip(views, layout):
                out.extend(view.keys if n == 3 else [view.keys])
                out.extend(view.values if n == 3 else [view.values])
            return out

        return mx.compile(step) if self._compile else step


def _step_scalars(plans):
    """The step's (write row, RoPE offset, ring shift) int32 scalars and each
    cache's indices into them: caches with equal plans share one set (in the
    graph too, which is how a mask is known to fit them); plans that merely
    happen to hold equal numbers do not, so the grouping, part of the
    signature, stays put from step to step."""
    groups, slots, values = {}, [], []
    for p in plans:
        base = groups.get(p)
        if base is None:
            base = groups[p] = len(values)
            values.extend(p.inputs())
        slots.append((base, base + 1, base + 2))
    return values, slots


def _graph_inputs(inputs, cache, values) -> list:
    """The graph's inputs: the tokens, the step's int32 scalars, then each
    cache's buffers."""
    flat = [inputs] + [
        mx.array(v) if hasattr(v, "dtype") else mx.array(v, dtype=mx.int32) for v in values
    ]
    for c in cache:
        if c._store.quantized:
            flat.extend(c.keys)
            flat.extend(c.values)
        else:
            flat.extend((c.keys, c.values))
    return flat


def _check_views(views) -> None:
    """NotCompiled unless every cache was written once and every masked
    fetch had its mask asked for (by it or a cache with the same plan)."""
    for i, v in enumerate(views):
        if v.writes != 1:
            raise NotCompiled(f"layer {i}'s cache was written {v.writes} times in one step")
        if v._plan.kind == "ring":
            continue
        if not any(
            w.masks and w._pos is v._pos and w._plan.capacity == v._plan.capacity for w in views
        ):
            raise NotCompiled(
                f"layer {i} attends a whole buffer but the model asked no cache like it for a mask"
            )


def decoder_for(model) -> CompiledDecode:
    """The model's :class:`CompiledDecode` (made once per model and set of
    weights; new weights get new graphs)."""
    dec = getattr(model, "_mlxq_compiled_decode", None)
    if dec is None or not dec.matches(model):
        dec = CompiledDecode(model)
        object.__setattr__(model, "_mlxq_compiled_decode", dec)
    return dec


class CompiledModel:
    """``model`` as mlx-lm's generate loop calls it, with one-token cached
    steps through its :class:`CompiledDecode` (others, and steps it
    declines, run the model eagerly). Other attributes are the model's."""

    def __init__(self, model, decoder: Optional[CompiledDecode] = None):
        self._model = model
        self.decoder = decoder or decoder_for(model)

    def __call__(self, inputs, cache=None, **kwargs):
        if cache is not None and not kwargs:
            logits = self.decoder(inputs, cache)
            if logits is not None:
                return logits
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


__all__ = ["CompiledDecode", "CompiledModel", "NotCompiled", "decoder_for", "MODEL_MODULES"]
