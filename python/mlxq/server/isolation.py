"""One sequence's own failure ends that sequence only, not its batch.

A batch runs every sequence's own code, its sampler and logits processors
(from the request's temperature, top_p, logit_bias, penalties...), inside
one step; in mlx-lm an exception there ends the step for the whole batch
and, in the server, the generation loop. :func:`isolating` guards that code
per sequence: a sequence whose sampler or processor raises gets its step
from the unprocessed logits (greedy) so the batch's step completes, and is
then ended with ``finish_reason="error"`` (its cache handed back as for any
finished sequence), while the others go on with the same tokens.
"""

import logging
import threading

import mlx.core as mx

log = logging.getLogger("mlxq.server")

ERROR = "error"  # the finish reason of a sequence whose own code raised


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
