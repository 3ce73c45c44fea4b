"""The generation thread outlives any failure, and a failed request gets an answer.

mlx-lm's server runs every request through one generation thread; an
exception anywhere in its loop ends the thread, and from then on every
request, valid or not, is answered 404 ("generation thread died"). Here:

* :func:`supervised` makes the thread's loop restart after a failure. The
  requests the failed loop had taken (and not finished) get the error on
  their response queues; the requests still waiting in the queue are served
  by the new loop. The log records each failure, and ``failures`` counts
  them.
* :func:`answering_errors` makes the HTTP handler answer such a request with
  500 and a JSON error (not mlx-lm's 404), or, when its stream has started,
  end the stream with an error event and ``data: [DONE]``.
* ``--max-kv-memory`` admits a new request only while the KV in use (the
  running sequences' and the prompt cache's, as quantized) is under the
  budget; otherwise it waits in the queue.
* A client that hangs up is noticed at its next token, streaming or not
  (mlx-lm notices only a failed write, so never for a non-streaming
  request): its request stops, and the loop drops it from the batch, with
  its cache, at its next step.

Both report to the server's metrics (mlxq.server.metrics) when given them.
"""

import json
import logging
import select
import socket
import sys
import threading
import weakref

from .isolation import ERROR, take_pending

log = logging.getLogger("mlxq.server")


class GenerationFailed(RuntimeError):
    """What a request held by a failed generation loop gets: a server error."""


# The client socket of the request a handler thread is serving.
_serving = threading.local()


def client_gone(sock) -> bool:
    """Whether the client at ``sock`` has closed its side (EOF waiting)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class _Counting:
    """A request's response queue as the generation loop sees it: each token
    it puts is counted (metrics); a response that ends the sequence with an
    error, or that follows a failure of the request's own code on this
    thread (mlxq.server.isolation), becomes :class:`GenerationFailed` and
    stops the request (the loop drops it from the batch at that step), and
    what the loop puts after it is dropped."""

    def __init__(self, rqueue, metrics=None):
        self._rqueue, self._metrics, self._ended = rqueue, metrics, False
        self._context = None  # the request's GenerationContext, once the loop puts it

    def put(self, item, *args, **kwargs):
        if self._ended:
            return
        if hasattr(item, "_should_stop") and hasattr(item, "stop"):
            self._context = item
        if hasattr(item, "token") and hasattr(item, "finish_reason"):  # a Response
            error = take_pending()
            if error is not None or item.finish_reason == ERROR:
                self._ended = True
                if self._context is not None:
                    self._context.stop()
                item = GenerationFailed(
                    "generation failed: this request's own code (sampling, detokenizing or "
                    f"formatting) raised{f': {error!r}' if error is not None else ''} "
                    "(see the server log)"
                )
            elif self._metrics is not None:
                self._metrics.generated(1)
        self._rqueue.put(item, *args, **kwargs)


def supervised(base, metrics=None, max_kv_bytes=None):
    """mlx-lm's ResponseGenerator class ``base``, with a loop that restarts
    (and, given ``metrics``, that reports to them: tokens, queue length,
    prompt-cache bytes and lookups, failures). With ``max_kv_bytes`` (and
    ``metrics``, which say what is in use), a new request waits in the queue
    while the running sequences' KV and the prompt cache's fill that budget;
    the prompt cache is trimmed first, and a request is always taken when
    nothing is decoding."""

    class Supervised(base):
        failures = 0

        def __init__(self, *args, **kwargs):
            # The response queues of requests the loop has taken: a finished
            # request's handler drops its queue, which leaves the set.
            self._taken = weakref.WeakSet()
            super().__init__(*args, **kwargs)
            if metrics is not None:
                self._report_to(metrics)

        def _report_to(self, m) -> None:
            m.queue_length = self.requests.qsize
            m.prompt_cache_bytes = lambda: self.prompt_cache.nbytes
            m.failures = lambda: self.failures
            fetch = self.prompt_cache.fetch_nearest_cache

            def fetch_nearest_cache(model, tokens):
                cache, rest = fetch(model, tokens)
                m.prompt_cache_lookup(cache is not None and len(rest) < len(tokens))
                return cache, rest

            self.prompt_cache.fetch_nearest_cache = fetch_nearest_cache

        def generate(self, request, generation_args, progress_callback=None):
            ctx, tokens = super().generate(request, generation_args, progress_callback)
            sock = getattr(_serving, "socket", None)
            if sock is None:
                return ctx, tokens

            def watched():
                for item in tokens:
                    if client_gone(sock):
                        ctx.stop()  # the loop drops the request at its next step
                        raise ConnectionAbortedError("the client disconnected")
                    yield item

            return ctx, watched()

        def _admits(self) -> bool:
            if max_kv_bytes is None or metrics is None or len(self._taken) == 0:
                return True  # no budget, or nothing running: progress first
            if metrics.unreported:  # the batch has not counted a taken request yet
                return False
            room = max_kv_bytes - metrics.active_kv_bytes
            if self.prompt_cache.nbytes > max(room, 0):
                self.prompt_cache.trim_to(n_bytes=max(room, 0))
            return metrics.active_kv_bytes + self.prompt_cache.nbytes < max_kv_bytes

        def _next_request(self, timeout=None):
            if not self._admits():  # the request waits in the queue
                return None
            request = super()._next_request(timeout)
            if request is not None:
                self._taken.add(request[0])
                if metrics is not None:
                    metrics.taken()
                request = (_Counting(request[0], metrics),) + tuple(request[1:])
            return request

        def _run_generate(self):
            while not self._stop:
                try:
                    self._generate()
                    return
                except Exception as e:  # noqa: BLE001  (any failure: restart)
                    self.failures += 1
                    log.exception("mlxq: the generation loop failed (%s); restarting it", e)
                    error = GenerationFailed(f"generation failed: {e}")
                    for rqueue in list(self._taken):
                        rqueue.put(error)
                    self._taken = weakref.WeakSet()

    return Supervised


def answering_errors(handler, metrics=None) -> None:
    """Patch mlx-lm's APIHandler class ``handler``: a completion that fails
    after validation is answered 500 (or ends its stream with an error);
    given ``metrics``, completion answers are counted by status and
    ``GET /metrics`` renders them."""
    original_completion = handler.handle_completion
    original_headers = handler._set_completion_headers
    original_stream_headers = handler._set_stream_headers
    if metrics is not None:
        _report(handler, metrics)

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm answers every failed generate() 404, inside its except block:
        # a failed loop is the server's fault (an unknown model stays 404).
        if status_code == 404 and isinstance(sys.exc_info()[1], GenerationFailed):
            status_code = 500
        original_headers(self, status_code)

    def _set_stream_headers(self, status_code: int = 200):
        self._mlxq_streaming = True
        original_stream_headers(self, status_code)

    def handle_completion(self, request, stop_words):
        _serving.socket = getattr(self, "connection", None)
        try:
            original_completion(self, request, stop_words)
        except ConnectionError:  # the client hung up: nobody to answer
            log.info("mlxq: the client disconnected; its request stopped")
        except Exception as e:  # noqa: BLE001  (the failure goes to the client)
            message = str(e) if isinstance(e, GenerationFailed) else f"generation failed: {e}"
            log.error("mlxq: request failed: %s", message)
            if getattr(self, "_mlxq_streaming", False):
                event = json.dumps({"error": message})
                self.wfile.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                return
            self._headers_buffer = []  # the 200 not yet sent: answer 500 instead
            original_headers(self, 500)
            self.end_headers()
            self.wfile.write(json.dumps({"error": message}).encode())
            self.wfile.flush()
        finally:
            _serving.socket = None

    handler._set_completion_headers = _set_completion_headers
    handler._set_stream_headers = _set_stream_headers
    handler.handle_completion = handle_completion


def _report(handler, metrics) -> None:
    original_send = handler.send_response
    original_get = handler.do_GET

    def send_response(self, code, message=None):
        if self.command == "POST":
            metrics.answered(code)
        original_send(self, code, message)

    def do_GET(self):
        if self.path != "/metrics":
            return original_get(self)
        body = metrics.render().encode()
        original_send(self, 200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    handler.send_response = send_response
    handler.do_GET = do_GET
