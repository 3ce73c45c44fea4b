"""mlx-lm's HTTP server with quantized KV that keeps continuous batching.

    python -m mlxq.server --model <path or repo> --kv-bits 4 [mlx-lm's options]

``mlx_lm.server --kv-bits`` serves requests one at a time: mlx-lm cannot
batch quantized caches. This is the same server (same options, same
OpenAI-style endpoints) with :mod:`mlxq.mlx_lm` enabled, where:

* requests are batched with quantized KV (``BatchGenerator(kv_bits=...)``,
  mlxq's batch caches); only what mlx-lm never batches (a ``seed``, a draft
  model, images) is still served alone, on mlxq's caches;
* the prompt cache (LRU) holds mlxq's quantized caches, and its
  ``--prompt-cache-bytes`` limit counts their real (quantized) size;
* ``--quantized-kv-start`` defaults to 0: a served request's KV is
  quantized from its first token (mlx-lm's default, 5000, would leave
  short requests unquantized);
* every field of a request is checked before it reaches the generation
  thread (mlxq.server.requests): a bad one gets 400 naming the field;
* ``--max-tokens`` caps what a request may ask for (400 above it) and is
  the default for requests that do not say; without it, both are the
  model's context length;
* a request whose own sampling code raises ends alone, the batch goes on
  (mlxq.server.isolation); the generation thread restarts its loop after
  any other failure, and the requests it held get 500 or an error event
  (mlxq.server.supervision);
* ``GET /metrics`` reports requests by status, tokens/s, batch size, queue
  length, KV bytes and prompt-cache hits (mlxq.server.metrics);
* ``--max-kv-memory BYTES`` (``512M``, ``2G``) makes new requests wait in
  the queue while the KV in use fills the budget;
* ``--kv-recent N`` keeps every sequence's last ``N`` tokens exact beside
  the quantized cache (``enable(kv_recent=N)``; a sliding-window layer
  keeps what its ring holds). Without it, ``--kv-bits 4`` or fewer keeps
  the recipe's 128 (``--kv-recent 0`` turns it off);
* ``--k-bits N`` stores keys at ``N`` bits (``enable(k_bits=N)``). Without
  it, ``--kv-bits 4`` stores the recipe's 8-bit keys with 4-bit values
  (``--k-bits 4`` turns them off). The server prints its KV setting at
  start.

Each time the decoding batch changes size, the log says how many
sequences it decodes together.
"""

import argparse
import functools
import importlib
import logging
import sys
import time
from http.server import ThreadingHTTPServer
from typing import List, Optional

from .. import mlx_lm as bridge
from .isolation import guarding_requests, isolating
from .metrics import Metrics
from .requests import check_request
from .supervision import answering_errors, supervised

log = logging.getLogger("mlxq.server")


def _batching_response_generator(base):
    class ResponseGenerator(base):
        """mlx-lm's ResponseGenerator, batching requests with ``kv_bits`` too."""

        def _is_batchable(self, args):
            return self.model_provider.is_batchable and args.seed is None

    return ResponseGenerator


# The longest the reported KV bytes of a running batch may lag (seconds).
REPORT_S = 0.25


def _logging_batch_generator(base, kv_bits, kv_group_size, quantized_kv_start, metrics=None):
    class BatchGenerator(base):
        """mlxq's BatchGenerator with the server's KV settings; logs the batch
        size and reports it, with the active sequences' KV bytes, to ``metrics``."""

        __init__ = functools.partialmethod(
            base.__init__,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
        )
        _logged = 0
        _reported_at = -REPORT_S  # monotonic time of the last KV count

        def _next(self):
            responses = super()._next()
            n = len(self._generation_batch)
            if n != self._logged:
                self._logged = n
                log.info("mlxq: decoding %d sequence(s) in one batch (kv_bits=%s)", n, kv_bits)
            self._report(n)
            return responses

        def remove(self, *args, **kwargs):  # a finished or abandoned request's slot
            out = super().remove(*args, **kwargs)
            self._report(len(self._generation_batch), force=True)
            return out

        def _report(self, n: int, force: bool = False) -> None:
            # Counting KV bytes walks every layer's cache (~80 us per step for
            # 64 layers on a 2-core CPU): per decode step only when the batch
            # changed or took a request (admission waits on that), else at
            # most every REPORT_S.
            if metrics is None:
                return
            now = time.monotonic()
            changed = force or n != metrics.batch_size or metrics.unreported
            if not changed and now - self._reported_at < REPORT_S:
                return
            self._reported_at = now
            metrics.decoding(n, self.prompt_cache_nbytes)

    return BatchGenerator


class _HTTPServer(ThreadingHTTPServer):
    # The listen backlog: the standard library's 5 resets connections when
    # dozens of clients connect at once (measured: 48).
    request_queue_size = 512


def _kv_options(argv: List[str]):
    """``(argv, kv_bits, kv_group_size, quantized_kv_start, max_tokens)``:
    the options as mlx-lm's parser will read them (abbreviations included),
    and the command line with our default start added when none is given
    (``max_tokens`` None when not given)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--kv-group-size", type=int, default=64)
    p.add_argument("--quantized-kv-start", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    known, _ = p.parse_known_args(argv)
    start = known.quantized_kv_start
    if start is None:
        start, argv = 0, argv + ["--quantized-kv-start", "0"]
    return argv, known.kv_bits, known.kv_group_size, start, known.max_tokens


def _own_options(argv: List[str]):
    """``(argv without them, max_kv_memory, kv_recent, k_bits)``: the options
    mlxq-server adds to mlx-lm's (whose parser refuses what it does not know)."""
    p = argparse.ArgumentParser(prog="mlxq-server", add_help=False, allow_abbrev=False)
    p.add_argument("--max-kv-memory", type=_bytes, default=None)
    p.add_argument("--kv-recent", type=_tokens, default=None)
    p.add_argument("--k-bits", type=int, default=None)
    known, rest = p.parse_known_args(argv)
    return rest, known.max_kv_memory, known.kv_recent, known.k_bits


def _tokens(text: str) -> int:
    """A token count (>= 0)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return n


def _bytes(text: str) -> int:
    """``"2000000"``, ``"512M"`` or ``"2G"`` as bytes (> 0)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    scale = units.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        n = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return n


def context_length(model) -> Optional[int]:
    """The longest sequence ``model`` (an mlx-lm model) was configured for, or None."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length"):
        n = getattr(args, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _validating(original, max_tokens: Optional[int]):
    """mlx-lm's ``APIHandler.validate_model_parameters``, run after
    :func:`check_request` has checked every field of the request (a
    RequestError is a ValueError, which mlx-lm answers with 400).
    ``max_tokens``: the server's limit, else the model's context length."""

    def validate_model_parameters(self):
        limit = max_tokens
        if limit is None:
            limit = context_length(self.response_generator.model_provider.model)
        check_request(self.path, self.body, limit)
        if limit is not None and not {"max_tokens", "max_completion_tokens"} & set(self.body):
            self.max_tokens = limit
        # mlx-lm's own check wants floats where a JSON integer is as good.
        for name in ("xtc_probability", "xtc_threshold"):
            setattr(self, name, float(getattr(self, name)))
        original(self)

    return validate_model_parameters


def main(argv: Optional[List[str]] = None) -> None:
    """Run mlx-lm's server (``mlx_lm.server.main``) with mlxq enabled."""
    from ..kv_format import BITS, GROUP_SIZES

    argv = list(sys.argv[1:] if argv is None else argv)
    argv, max_kv_memory, kv_recent, k_bits = _own_options(argv)
    argv, kv_bits, kv_group_size, start, max_tokens = _kv_options(argv)
    if kv_bits is not None and kv_bits not in BITS:
        raise SystemExit(f"mlxq.server: --kv-bits must be one of {BITS}, got {kv_bits}.")
    if kv_bits is not None and kv_group_size not in GROUP_SIZES:
        raise SystemExit(
            f"mlxq.server: --kv-group-size must be one of {GROUP_SIZES}, got {kv_group_size}."
        )
    if kv_recent is not None and kv_bits is None:
        raise SystemExit("mlxq.server: --kv-recent keeps recent tokens exact beside --kv-bits.")
    if k_bits is not None and (kv_bits is None or k_bits not in BITS):
        raise SystemExit(f"mlxq.server: --k-bits needs --kv-bits and one of {BITS}, got {k_bits}.")
    bridge.enable(kv_recent=kv_recent, k_bits=k_bits)
    if kv_bits is not None:  # (before mlx-lm's server configures logging)
        kv = bridge.settings().describe(kv_bits, kv_group_size, cli=True)
        print(f"mlxq: KV cache {kv}", file=sys.stderr)
    server = importlib.import_module("mlx_lm.server")
    metrics = Metrics()
    server.ResponseGenerator = supervised(
        _batching_response_generator(server.ResponseGenerator), metrics, max_kv_memory
    )
    server.BatchGenerator = _logging_batch_generator(
        isolating(server.BatchGenerator), kv_bits, kv_group_size, start, metrics
    )
    guarding_requests(server, importlib.import_module("mlx_lm.tokenizer_utils").TokenizerWrapper)
    handler = server.APIHandler
    handler.validate_model_parameters = _validating(handler.validate_model_parameters, max_tokens)
    answering_errors(handler, metrics)
    server._run_http_server = functools.partial(server._run_http_server, server_class=_HTTPServer)
    sys.argv = [sys.argv[0]] + argv
    server.main()


if __name__ == "__main__":
    main()
