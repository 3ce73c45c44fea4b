"""One sequence's own failure ends that sequence only, not its batch.

A batch runs every sequence's own code, its sampler and logits processors
(from the request's temperature, top_p, logit_bias, penalties...), inside
one step; in mlx-lm an exception there ends the step for the whole batch
and, in the server, the generation loop. :func:`isolating` guards that code
per sequence: a sequence whose sampler or processor raises gets its step
from the unprocessed logits (greedy) so the batch's step completes, and is
then ended with ``finish_reason="error"`` (its cache handed back as for any
finished sequence), while the others go on with the same tokens.

The server's loop runs more of a request's own code: building its sampler
and processors, detokenizing its tokens and formatting its top log-probs.
:func:`guarding_requests` guards those too. A sampler or processor that
cannot be built becomes one that raises, which the guard above ends; a
detokenizer or formatter that raises marks the response the loop puts next
(on the same thread, for the same request) as failed, and the request's
queue (mlxq.server.supervision) turns it into the request's failure and
stops it, so the loop drops it from the batch at that step.
"""

import logging
import threading

import mlx.core as mx

log = logging.getLogger("mlxq.server")

ERROR = "error"  # the finish reason of a sequence whose own code raised

# The failure of the request whose response this thread puts next.
_pending = threading.local()


def fail_next_response(error: Exception) -> None:
    """The response this thread puts next belongs to a request whose own
    code raised ``error``: it fails that request (the first error kept)."""
    log.error("mlxq: a request's own code failed: %r", error)
    if getattr(_pending, "error", None) is None:
        _pending.error = error


def take_pending() -> "Exception | None":
    """The failure :func:`fail_next_response` set on this thread, cleared."""
    error = getattr(_pending, "error", None)
    _pending.error = None
    return error


class _GuardedDetokenizer:
    """A request's streaming detokenizer whose failure fails that request
    only: after it, tokens add nothing and the text is empty."""

    def __init__(self, inner):
        self._inner, self._failed = inner, False

    def _guarded(self, fn, *args):
        if self._failed:
            return ""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  (this request only)
            self._failed = True
            fail_next_response(e)
            return ""

    def add_token(self, token):
        self._guarded(self._inner.add_token, token)

    def finalize(self):
        self._guarded(self._inner.finalize)

    def reset(self):
        self._inner.reset()
        self._failed = False

    @property
    def last_segment(self):
        return self._guarded(lambda: self._inner.last_segment)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _raising(error: Exception):
    def raise_it(*args):
        raise error

    return raise_it


def guarding_requests(server, tokenizer_wrapper) -> None:
    """Patch mlx-lm's server module ``server`` and its ``TokenizerWrapper``
    class: a request's sampler and processors that cannot be built raise
    when used (isolated by :func:`isolating`), and its detokenizer and
    top-log-probs formatting fail only that request."""
    make_sampler, make_processors = server._make_sampler, server._make_logits_processors
    format_top = server._format_top_logprobs
    detokenizer = tokenizer_wrapper.detokenizer

    def _make_sampler(args, tokenizer):
        try:
            return make_sampler(args, tokenizer)
        except Exception as e:  # noqa: BLE001  (this request only)
            return _raising(e)

    def _make_logits_processors(args):
        try:
            return make_processors(args)
        except Exception as e:  # noqa: BLE001  (this request only)
            return [_raising(e)]

    def _format_top_logprobs(logprobs, top_n, tokenizer):
        try:
            return format_top(logprobs, top_n, tokenizer)
        except Exception as e:  # noqa: BLE001  (this request only)
            fail_next_response(e)
            return ()

    server._make_sampler = _make_sampler
    server._make_logits_processors = _make_logits_processors
    server._format_top_logprobs = _format_top_logprobs
    tokenizer_wrapper.detokenizer = property(
        lambda self: _GuardedDetokenizer(detokenizer.fget(self))
    )


class _Slot:
    """Which uid a guarded function belongs to (known once inserted)."""

    uid = None


def isolating(base):
    """mlx-lm's BatchGenerator class ``base`` with per-sequence isolation."""

    class Isolating(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._failed = {}  # uid -> the exception its code raised
            self._failed_lock = threading.Lock()

        def _record(self, slot, e) -> None:
            log.error("mlxq: sequence %s failed in its own sampling code: %r", slot.uid, e)
            with self._failed_lock:
                self._failed.setdefault(slot.uid, e)

        def _guard_sampler(self, sampler, slot):
            def sample(logprobs):
                try:
                    return sampler(logprobs)
                except Exception as e:  # noqa: BLE001  (this sequence only)
                    self._record(slot, e)
                    return mx.argmax(logprobs, axis=-1)

            return sample

        def _guard_processor(self, processor, slot):
            def process(tokens, logits):
                try:
                    return processor(tokens, logits)
                except Exception as e:  # noqa: BLE001  (this sequence only)
                    self._record(slot, e)
                    return logits

            return process

        def insert_segments(self, segments, *args, samplers=None, logits_processors=None, **kw):
            slots = [_Slot() for _ in segments]
            if samplers:
                samplers = [
                    None if s is None else self._guard_sampler(s, slot)
                    for s, slot in zip(samplers, slots)
                ]
            if logits_processors:
                logits_processors = [
                    [self._guard_processor(p, slot) for p in (ps or ())]
                    for ps, slot in zip(logits_processors, slots)
                ]
            uids = super().insert_segments(
                segments, *args, samplers=samplers, logits_processors=logits_processors, **kw
            )
            for slot, uid in zip(slots, uids):
                slot.uid = uid
            return uids

        def _next(self):
            prompt_responses, gen_responses = super()._next()
            with self._failed_lock:
                failed, self._failed = self._failed, {}
            if failed:
                gen_responses = [self._ended(r) if r.uid in failed else r for r in gen_responses]
            return prompt_responses, gen_responses

        def _ended(self, r):
            """``r`` as the last response of its sequence, which leaves the batch."""
            if r.finish_reason is not None:  # it finished this step anyway
                return r
            cache, tokens = self.remove([r.uid], return_prompt_caches=True)[r.uid]
            return type(r)(
                uid=r.uid,
                token=r.token,
                logprobs=r.logprobs,
                finish_reason=ERROR,
                prompt_cache=cache,
                all_tokens=tokens,
            )

    return Isolating
