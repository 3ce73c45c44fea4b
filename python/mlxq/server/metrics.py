"""What ``GET /metrics`` reports, in Prometheus' text format.

The server's handler threads and its generation thread record here (one
lock); ``GET /metrics`` renders:

* ``mlxq_requests_total{status="..."}``: completion requests answered, by
  HTTP status;
* ``mlxq_generated_tokens_total`` and ``mlxq_tokens_per_second`` (over the
  last ``WINDOW_S`` seconds);
* ``mlxq_batch_size``: sequences the batch decodes now;
* ``mlxq_queue_length``: requests waiting for the generation thread;
* ``mlxq_kv_bytes{where="active"|"prompt_cache"}``: the real (quantized)
  bytes of the running sequences' caches (counted when the batch changes,
  and at most 0.25 s apart while it decodes) and of the prompt-cache LRU;
* ``mlxq_prompt_cache_total{result="hit"|"miss"}``: prompt-cache lookups;
* ``mlxq_generation_failures_total``: generation loop restarts.
"""

import collections
import threading
import time
from typing import Callable, Dict, Optional

WINDOW_S = 10.0


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Dict[int, int] = collections.Counter()
        self._tokens = 0
        self._recent = collections.deque()  # (time, tokens) of the last WINDOW_S
        self._cache = collections.Counter()
        self.batch_size = 0
        self.active_kv_bytes = 0
        self.unreported = 0  # requests taken since the batch last reported its KV
        # Read when rendering (set by the server): queue length, LRU bytes, failures.
        self.queue_length: Callable[[], int] = lambda: 0
        self.prompt_cache_bytes: Callable[[], int] = lambda: 0
        self.failures: Callable[[], int] = lambda: 0

    def answered(self, status: int) -> None:
        with self._lock:
            self._requests[int(status)] += 1

    def generated(self, n: int = 1, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._tokens += n
            self._recent.append((now, n))

    def prompt_cache_lookup(self, hit: bool) -> None:
        with self._lock:
            self._cache["hit" if hit else "miss"] += 1

    def decoding(self, batch_size: int, kv_bytes: int) -> None:
        with self._lock:
            self.batch_size, self.active_kv_bytes = batch_size, kv_bytes
            self.unreported = 0

    def taken(self) -> None:
        """A request went to the generation loop (its KV is not counted yet)."""
        with self._lock:
            self.unreported += 1

    def tokens_per_second(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / WINDOW_S

    def render(self) -> str:
        rate = self.tokens_per_second()
        queue, lru, failures = self.queue_length(), self.prompt_cache_bytes(), self.failures()
        with self._lock:
            lines = ["# TYPE mlxq_requests_total counter"]
            lines += [
                f'mlxq_requests_total{{status="{s}"}} {n}'
                for s, n in sorted(self._requests.items())
            ]
            lines += [
                "# TYPE mlxq_generated_tokens_total counter",
                f"mlxq_generated_tokens_total {self._tokens}",
                "# TYPE mlxq_tokens_per_second gauge",
                f"mlxq_tokens_per_second {rate:.3f}",
                "# TYPE mlxq_batch_size gauge",
                f"mlxq_batch_size {self.batch_size}",
                "# TYPE mlxq_queue_length gauge",
                f"mlxq_queue_length {queue}",
                "# TYPE mlxq_kv_bytes gauge",
                f'mlxq_kv_bytes{{where="active"}} {self.active_kv_bytes}',
                f'mlxq_kv_bytes{{where="prompt_cache"}} {lru}',
                "# TYPE mlxq_prompt_cache_total counter",
                f'mlxq_prompt_cache_total{{result="hit"}} {self._cache["hit"]}',
                f'mlxq_prompt_cache_total{{result="miss"}} {self._cache["miss"]}',
                "# TYPE mlxq_generation_failures_total counter",
                f"mlxq_generation_failures_total {failures}",
            ]
        return "\n".join(lines) + "\n"
