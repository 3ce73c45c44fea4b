"""Every field of a completion request checked before it reaches the queue.

mlx-lm's server checks some fields' types and hands the rest to its
generation thread, where one bad value (``"stop": 12``, ``"prompt": 5``)
raises inside the thread that serves every request. Here each field the
server reads is checked for type and range first; a failure is a
:class:`RequestError` naming the field, which the handler answers with 400.
"""

import math
import numbers
from typing import Optional


class RequestError(ValueError):
    """A request field that the server cannot serve: 400, naming ``field``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _ranged(body, field, is_kind, kind: str, low=None, high=None, also=()):
    """``body[field]``, when given (not null), is ``kind`` and within
    ``[low, high]``, or one of ``also``."""
    v = body.get(field)
    if v is None or (v in also and is_kind(v)):
        return
    if not is_kind(v):
        raise RequestError(field, f"must be {kind}, got {v!r}.")
    if low is not None and v < low:
        raise RequestError(field, f"must be at least {low}, got {v}.")
    if high is not None and v > high:
        raise RequestError(field, f"must be at most {high}, got {v}.")


def _int(body, field, low=None, high=None, also=()):
    _ranged(body, field, _is_int, "an integer", low, high, also)


def _number(body, field, low=None, high=None):
    _ranged(body, field, _is_number, "a finite number", low, high)


def _of_type(body, field, kind, name):
    if field in body and body[field] is not None and not isinstance(body[field], kind):
        raise RequestError(field, f"must be {name}, got {body[field]!r}.")


def _check_stop(body) -> None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            "stop", f"must be a string or a list of non-empty strings, got {stop!r}."
        )


def _check_prompt(body) -> None:
    if "prompt" not in body:
        raise RequestError("prompt", "is required for /v1/completions.")
    prompt = body["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt", f"must be a non-empty string, got {prompt!r}.")


def _check_messages(body) -> None:
    if "messages" not in body:
        raise RequestError("messages", "is required for chat completions.")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", f"must be a non-empty list, got {messages!r}.")
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(field, f"must be an object, got {m!r}.")
        if not isinstance(m.get("role"), str):
            raise RequestError(f"{field}.role", f"must be a string, got {m.get('role')!r}.")
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(
            isinstance(p, dict) and isinstance(p.get("type"), str) for p in content
        ):
            raise RequestError(
                f"{field}.content",
                "must be a string, null or a list of parts with a string 'type'.",
            )


def _check_logit_bias(body) -> None:
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise RequestError("logit_bias", f"must be an object of token id to number, got {bias!r}.")
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise RequestError("logit_bias", f"keys must be token ids, got {k!r}.") from None
        if token < 0:
            raise RequestError("logit_bias", f"token ids must be >= 0, got {token}.")
        if not _is_number(v):
            raise RequestError("logit_bias", f"values must be finite numbers, got {v!r}.")


def check_request(path: str, body, max_tokens: Optional[int] = None) -> None:
    """Raises :class:`RequestError` unless ``body`` (a parsed JSON request to
    ``path``) is one the server can serve; ``max_tokens`` caps the tokens a
    request may ask for."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object.")
    if path == "/v1/completions":
        _check_prompt(body)
    else:
        _check_messages(body)
    for field in ("max_tokens", "max_completion_tokens"):
        _int(body, field, low=1, high=max_tokens)
    _of_type(body, "stream", bool, "true or false")
    _of_type(body, "logprobs", bool, "true or false")
    _of_type(body, "stream_options", dict, "an object")
    _of_type(body, "model", str, "a string")
    _of_type(body, "draft_model", str, "a string")
    _of_type(body, "adapters", str, "a string")
    _of_type(body, "role_mapping", dict, "an object")
    _of_type(body, "chat_template_kwargs", dict, "an object")
    _of_type(body, "tools", list, "a list")
    _number(body, "temperature", low=0)
    _number(body, "top_p", low=0, high=1)
    _number(body, "min_p", low=0, high=1)
    _int(body, "top_k", low=0)
    _number(body, "repetition_penalty", low=0)
    _number(body, "presence_penalty")
    _number(body, "frequency_penalty")
    _number(body, "xtc_probability", low=0, high=1)
    _number(body, "xtc_threshold", low=0, high=1)
    for field in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _int(body, field, low=0)
    _int(body, "top_logprobs", low=0, high=11, also=(-1,))
    _int(body, "seed", low=0, high=2**63 - 1)
    _int(body, "num_draft_tokens", low=0)
    _check_stop(body)
    _check_logit_bias(body)
