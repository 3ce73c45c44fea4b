"""``python -m mlxq.server``: mlx-lm's HTTP server, batching with quantized KV.

The test starts the real server on 127.0.0.1 (a random-weight llama saved
by ``save_random_model``, float32 so that batched and one-at-a-time greedy
decoding agree: see test_batch_generate.py) with ``--kv-bits 4``, sends
each request alone, then all of them at once (chat and completions,
streaming and not), and checks that every concurrent request completes
with the text it got alone, that the server's log shows them decoded in
one batch, that bad requests get a 4xx while the server keeps serving, and
stops the server itself.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import LRUPromptCache

import mlxq
import mlxq.mlx_lm as mlxq_lm
from mlxq.random_models import random_model, save_random_model

MAX_TOKENS = 24
LONG_TOKENS = 4000
STARTUP_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(root, max_tokens, *options, inject=""):
    """The real server on a free port of 127.0.0.1 (a saved random llama,
    --kv-bits 4, --max-tokens ``max_tokens``, then ``options``; the Python
    code ``inject`` runs in its process first): yields (url, log path)."""
    model = save_random_model(str(root / "model"), "llama", seed=11, dtype=mx.float32)
    port = free_port()
    log_path = root / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_path, "w") as log:
        start = ["-m", "mlxq.server"]
        if inject:
            start = [
                "-c",
                inject + "\nimport runpy; runpy.run_module('mlxq.server', run_name='__main__')",
            ]
        proc = subprocess.Popen(
            [sys.executable, *start, "--model", model, "--port", str(port)]
            + ["--kv-bits", "4", "--max-tokens", str(max_tokens), *options],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("server"), MAX_TOKENS)


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """A server whose KV budget holds one sequence: the rest wait. Its
    caches keep the last 8 tokens exact (--kv-recent)."""
    yield from serving(
        tmp_path_factory.mktemp("tight"), 160, "--max-kv-memory", "1K", "--kv-recent", "8"
    )


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """A server whose requests may run long enough to hang up on."""
    yield from serving(tmp_path_factory.mktemp("long_server"), LONG_TOKENS)


def post(url, path, body, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def text_of(kind, stream, status, raw):
    """The generated text of a response (streamed deltas joined)."""
    assert status == 200, raw
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    parts = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: ") :])["choices"]
        if not choice:
            continue
        if kind == "chat":
            parts.append(choice[0].get("delta", {}).get("content") or "")
        else:
            parts.append(choice[0].get("text") or "")
    assert raw.rstrip().endswith("data: [DONE]")
    return "".join(parts)


REQUESTS = [
    ("completion", False, "alpha: the quick brown fox"),
    ("completion", True, "bravo: jumps over the lazy dog"),
    ("chat", False, "charlie: tell me a story about a cat"),
    ("chat", True, "delta: what is the capital of France?"),
    ("completion", False, "echo: 0123456789 " * 3),
    ("chat", True, "foxtrot: short"),
]


def send(url, request):
    kind, stream, prompt = request
    body = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return text_of(kind, stream, *post(url, "/v1/chat/completions", body))
    body["prompt"] = prompt
    return text_of(kind, stream, *post(url, "/v1/completions", body))


def test_concurrent_requests_are_batched_and_equal_sequential_ones(server):
    url, log_path = server
    alone = [send(url, r) for r in REQUESTS]
    assert all(len(t) > 0 for t in alone)
    mark = len(log_path.read_text())
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: send(url, r), REQUESTS))
    assert together == alone
    sizes = [int(n) for n in re.findall(r"decoding (\d+) sequence", log_path.read_text()[mark:])]
    assert max(sizes) >= 2, f"never batched: {sizes}"
    assert "kv_bits=4" in log_path.read_text()


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    url, _ = server
    status, _ = post(url, "/v1/completions", b"{not json")
    assert 400 <= status < 500
    status, _ = post(
        url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "model": "no/such-model-here"}
    )
    assert 400 <= status < 500
    assert send(url, REQUESTS[0]) == send(url, REQUESTS[0])


# (path, body, the field the 400 names): each once killed mlx-lm's
# generation thread, was accepted without a limit, or got a wrong status.
MALFORMED = [
    ("/v1/completions", {"prompt": "x", "stop": 12}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", 3]}, "stop"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ["a", 7]}, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -1}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
    ),
]


def test_malformed_requests_get_400_naming_the_field(server):
    url, _ = server
    before = send(url, REQUESTS[0])
    for path, body, field in MALFORMED:
        status, raw = post(url, path, body)
        assert status == 400, (body, status, raw)
        assert json.loads(raw)["error"].startswith(f"{field}:"), (body, raw)
    assert send(url, REQUESTS[0]) == before  # the generation thread lives on


def test_a_request_without_max_tokens_gets_the_servers_limit(server):
    url, _ = server
    status, raw = post(url, "/v1/completions", {"prompt": "golf", "temperature": 0.0})
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= MAX_TOKENS


def test_check_request_names_each_field():
    from mlxq.server.requests import RequestError, check_request

    for path, body, field in MALFORMED:
        body = json.loads(body) if isinstance(body, bytes) else body
        with pytest.raises(RequestError) as e:
            check_request(path, body, max_tokens=MAX_TOKENS)
        assert e.value.field == field, body
    good = {"prompt": "x", "max_tokens": 3, "stop": ["\n"], "logit_bias": {"5": -1.5}}
    check_request("/v1/completions", dict(good, top_logprobs=-1, xtc_probability=0))
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    check_request("/v1/chat/completions", chat, max_tokens=None)


def test_the_limit_defaults_to_the_context_length():
    from mlxq.server import context_length

    model, _ = random_model("llama", seed=1)
    assert context_length(model) == model.args.max_position_embeddings == 131072
    assert context_length(object()) is None  # no limit but --max-tokens then


def test_prompt_cache_holds_quantized_caches_at_their_real_size():
    """What the server's LRU prompt cache holds after a batch: mlxq's
    quantized caches, counted at their quantized size, and reusable in a
    new batch."""
    model, tok = random_model("llama", seed=12, dtype=mx.float32)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 255, n)] for n in (40, 70)]
    # (kv_recent=0, k_bits=4: 4-bit rows alone; the recipe's exact window
    # would outweigh these short prompts' quantized rows, and nbytes counts
    # it too)
    with mlxq_lm.enable(kv_recent=0, k_bits=4):
        from mlx_lm.generate import batch_generate

        got = batch_generate(
            model,
            tok,
            prompts,
            max_tokens=4,
            kv_bits=4,
            return_prompt_caches=True,
            return_token_ids=True,
        )
        lru = LRUPromptCache(max_size=4)
        held = [p + ids for p, ids in zip(prompts, got.token_ids)]  # what each cache holds
        for tokens, cache in zip(held, got.caches):
            assert all(isinstance(c, mlxq.QuantizedKVCache) for c in cache)
            assert cache[0].offset == len(tokens)
            lru.insert_cache("m", tokens, cache)
        real = sum(c.nbytes for cache in got.caches for c in cache)
        assert lru.nbytes == real
        heads, dim = model.args.num_key_value_heads, model.args.head_dim
        tokens = sum(c[0].offset for c in got.caches)
        bf16 = 2 * len(model.layers) * tokens * heads * dim * 2
        assert real < 0.35 * bf16
        cache, rest = lru.fetch_nearest_cache("m", held[1] + [5, 6])
        assert rest == [5, 6] and cache[0].offset == len(held[1])
        again = batch_generate(model, tok, [rest], prompt_caches=[cache], max_tokens=2, kv_bits=4)
        assert len(again.texts) == 1


def test_the_generation_loop_restarts_and_fails_only_the_requests_it_held():
    # A stand-in for mlx-lm's ResponseGenerator: one thread, one loop taking
    # requests from a queue; a request "boom" fails the loop while it holds
    # "held" too. The requests behind them must still be served.
    import queue
    import threading

    from mlxq.server.supervision import GenerationFailed, supervised

    class Loop:
        def __init__(self):
            self.requests = queue.Queue()
            self._stop = False
            self._generation_thread = threading.Thread(target=self._run_generate, daemon=True)
            self._generation_thread.start()

        def _run_generate(self):
            self._generate()

        def _next_request(self, timeout=None):
            try:
                return self.requests.get(timeout=timeout)
            except queue.Empty:
                return None

        def _generate(self):
            held = []
            while not self._stop:
                request = self._next_request(timeout=0.02)
                if request is None:
                    continue
                rqueue, prompt = request
                if prompt == "held":
                    held.append(rqueue)
                elif prompt == "boom":
                    raise ValueError("injected")
                else:
                    rqueue.put(prompt.upper())
                    rqueue.put(None)

    gen = supervised(Loop)()
    queues = {p: queue.Queue() for p in ("a", "held", "boom", "b", "c")}
    for p, q in queues.items():
        gen.requests.put((q, p))
    try:
        for p in ("a", "b", "c"):
            assert queues[p].get(timeout=10) == p.upper() and queues[p].get(timeout=10) is None
        for p in ("held", "boom"):
            err = queues[p].get(timeout=10)
            assert isinstance(err, GenerationFailed) and "injected" in str(err)
        assert gen.failures == 1 and gen._generation_thread.is_alive()
    finally:
        gen._stop = True
        gen._generation_thread.join(timeout=10)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_completion_is_answered_500_or_ends_its_stream(stream):
    # A stand-in for mlx-lm's APIHandler: answering_errors patches the same
    # three methods.
    import io

    from mlxq.server.supervision import GenerationFailed, answering_errors

    class Handler:
        def __init__(self, error):
            self.wfile, self.sent, self.error = io.BytesIO(), [], error

        def _set_completion_headers(self, status_code=200):
            self.sent.append(status_code)

        def _set_stream_headers(self, status_code=200):
            self.sent.append(("stream", status_code))

        def end_headers(self):
            pass

        def handle_completion(self, request, stop_words):
            try:  # mlx-lm's answer to a failed generate(): 404, in its except block
                raise self.error
            except Exception:
                self._set_completion_headers(404)
            (self._set_stream_headers if stream else self._set_completion_headers)(200)
            raise GenerationFailed("generation failed: boom")

    answering_errors(Handler)
    unknown_model = Handler(ValueError("no such model"))
    unknown_model.handle_completion(None, [])
    failed = Handler(GenerationFailed("generation failed: boom"))
    failed.handle_completion(None, [])
    assert unknown_model.sent[0] == 404 and failed.sent[0] == 500
    body = failed.wfile.getvalue().decode()
    if stream:
        assert body.endswith('data: {"error": "generation failed: boom"}\n\ndata: [DONE]\n\n')
    else:
        assert failed.sent[-1] == 500 and json.loads(body)["error"].endswith("boom")


def scrape(url):
    """GET /metrics as {"name{labels}": value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_count_what_the_server_did(server):
    url, _ = server
    before = scrape(url)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: send(url, r), REQUESTS[:3]))
    post(url, "/v1/completions", {"prompt": 5})
    after = scrape(url)
    ok, bad = 'mlxq_requests_total{status="200"}', 'mlxq_requests_total{status="400"}'
    assert after[ok] == before.get(ok, 0) + 3 and after[bad] == before.get(bad, 0) + 1
    tokens = after["mlxq_generated_tokens_total"] - before["mlxq_generated_tokens_total"]
    assert 3 <= tokens <= 3 * MAX_TOKENS
    assert after["mlxq_tokens_per_second"] > 0
    lookups = ('mlxq_prompt_cache_total{result="hit"}', 'mlxq_prompt_cache_total{result="miss"}')
    assert sum(after[k] for k in lookups) >= sum(before[k] for k in lookups) + 3
    # Every request done: nothing decoding, nothing queued, no active KV;
    # the prompt cache keeps what the requests left.
    assert after["mlxq_batch_size"] == 0 and after["mlxq_queue_length"] == 0
    assert after['mlxq_kv_bytes{where="active"}'] == 0
    assert after['mlxq_kv_bytes{where="prompt_cache"}'] > 0
    assert after["mlxq_generation_failures_total"] == 0


def test_the_batch_generator_reports_its_size_and_kv_bytes():
    from mlxq.server import _logging_batch_generator
    from mlxq.server.metrics import Metrics

    class Base:  # mlx-lm's BatchGenerator, as far as the server's wrapper reads it
        def __init__(self, model, **kwargs):
            self._generation_batch = ["a", "b", "c"]

        @property
        def prompt_cache_nbytes(self):
            return 1000 * len(self._generation_batch)

        def _next(self):
            return []

        def remove(self, uids):
            self._generation_batch = [u for u in self._generation_batch if u not in uids]

    m = Metrics()
    gen = _logging_batch_generator(Base, 4, 64, 0, m)(None)
    gen._next()
    assert (m.batch_size, m.active_kv_bytes) == (3, 3000)
    gen.remove(["a", "b", "c"])  # hung up: the slots and their KV go
    assert (m.batch_size, m.active_kv_bytes) == (0, 0)
    text = m.render()
    assert "mlxq_batch_size 0\n" in text and 'mlxq_kv_bytes{where="active"} 0\n' in text


def settled(url, timeout=20.0):
    """/metrics once nothing is decoding and no KV is active (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["mlxq_batch_size"] == 0 and m['mlxq_kv_bytes{where="active"}'] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_slot_and_kv(long_server, stream):
    url, log_path = long_server
    port = int(url.rsplit(":", 1)[1])
    body = {"prompt": "hang up on me", "max_tokens": LONG_TOKENS, "temperature": 0.0}
    data = json.dumps(dict(body, stream=stream)).encode()
    mark = len(log_path.read_text())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )
    deadline = time.monotonic() + 60
    while scrape(url)["mlxq_batch_size"] < 1:  # decoding
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.02)
    started = scrape(url)["mlxq_generated_tokens_total"]
    sock.close()
    after = settled(url)
    assert after["mlxq_batch_size"] == 0 and after['mlxq_kv_bytes{where="active"}'] == 0
    assert after["mlxq_generated_tokens_total"] - started < LONG_TOKENS / 2  # cut short
    assert "the client disconnected" in log_path.read_text()[mark:]
    # and the server goes on serving
    status, raw = post(url, "/v1/completions", dict(body, max_tokens=4))
    assert status == 200, raw


def test_requests_beyond_the_kv_budget_wait_in_the_queue(tight_server):
    url, log_path = tight_server
    log = log_path.read_text()
    assert "mlxq: KV cache 8-bit K (group 64), 4-bit V (group 64)" in log
    assert "--k-bits 4 turns them off), the last 8 tokens exact" in log
    requests = [("completion", False, f"request {i}: " + "abc " * i) for i in range(4)]
    body = lambda r: dict(  # noqa: E731
        prompt=r[2], max_tokens=160, temperature=0.0
    )
    alone = [text_of("completion", False, *post(url, "/v1/completions", body(r))) for r in requests]
    seen = {"queue": 0, "batch": 0}
    done = False

    def watch():
        while not done:
            m = scrape(url)
            seen["queue"] = max(seen["queue"], m["mlxq_queue_length"])
            seen["batch"] = max(seen["batch"], m["mlxq_batch_size"])
            time.sleep(0.005)

    mark = len(log_path.read_text())
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        watcher = pool.submit(watch)
        together = list(
            pool.map(
                lambda r: text_of("completion", False, *post(url, "/v1/completions", body(r))),
                requests,
            )
        )
        done = True
        watcher.result()
    assert together == alone  # every request served, as it was alone
    assert seen["batch"] == 1 and seen["queue"] >= 1  # one at a time, the rest queued
    sizes = [int(n) for n in re.findall(r"decoding (\d+) sequence", log_path.read_text()[mark:])]
    assert max(sizes) == 1
    assert settled(url)["mlxq_queue_length"] == 0


def hang_up(url, body, after_bytes=0):
    """Send ``body`` to /v1/completions on a raw socket and close it, at once
    or after ``after_bytes`` bytes of the answer."""
    port = int(url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(data)
            + data
        )
        if after_bytes:
            sock.recv(after_bytes)


def test_a_mixed_load_of_48_clients(server):
    """Valid requests (streaming and not), clients that hang up and malformed
    requests, 48 at once: every valid one is served with its answer alone,
    every malformed one gets a 4xx, and the server ends as it began."""
    url, _ = server
    valid = [
        (kind, stream, f"load {i}: " + "xyz " * (i % 5))
        for i, (kind, stream) in enumerate(
            [("completion", False), ("completion", True), ("chat", False), ("chat", True)] * 4
        )
    ]
    alone = {r: send(url, r) for r in valid}
    before = settled(url)
    jobs = [("valid", r) for r in valid for _ in range(2)]  # 32
    jobs += [("hang-up", i) for i in range(8)]
    jobs += [("malformed", m) for m in MALFORMED[:8]]

    def run(job):
        kind, what = job
        if kind == "valid":
            return send(url, what) == alone[what]
        if kind == "hang-up":
            body = {"prompt": f"bye {what}", "max_tokens": MAX_TOKENS, "stream": what % 2 == 0}
            hang_up(url, body, after_bytes=64 * (what % 3))
            return True
        path, body, _ = what
        return 400 <= post(url, path, body)[0] < 500

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert all(results), [j for j, ok in zip(jobs, results) if not ok]
    after = settled(url)
    assert after["mlxq_batch_size"] == 0 and after["mlxq_queue_length"] == 0
    assert after['mlxq_kv_bytes{where="active"}'] == before['mlxq_kv_bytes{where="active"}'] == 0
    assert after["mlxq_generation_failures_total"] == 0
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200


def test_a_sequence_whose_sampling_raises_ends_alone():
    """In a running batch (mlxq's quantized BatchGenerator, as the server
    builds it), one sequence's logits processor raises at its 4th token: that
    sequence ends with finish_reason "error" and its cache, and the others
    finish with the tokens they get when nothing fails."""
    from mlxq.mlx_lm.batching import BatchGenerator
    from mlxq.server.isolation import ERROR, isolating

    model, _ = random_model("llama", seed=13, dtype=mx.float32)
    prompts = [[5, 9, 13, 40], [7, 7, 8, 100, 3, 2], [60, 61, 62]]
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731

    def run(fail_at):
        calls = {"n": 0}

        def flaky(tokens, logits):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise RuntimeError("injected")
            return logits

        with mlxq_lm.enabled():
            gen = isolating(BatchGenerator)(model, kv_bits=4, stream=mx.default_stream(mx.cpu))
            uids = gen.insert_segments(
                segments=[[p] for p in prompts],
                max_tokens=[12] * 3,
                samplers=[greedy] * 3,
                logits_processors=[[], [flaky], []],
            )
            tokens, ends = {u: [] for u in uids}, {}
            while len(ends) < len(uids):
                _, responses = gen.next()
                for r in responses:
                    tokens[r.uid].append(r.token)
                    if r.finish_reason is not None:
                        ends[r.uid] = r
            gen.close()
        return uids, tokens, ends

    uids, tokens, ends = run(fail_at=4)
    _, clean, clean_ends = run(fail_at=None)
    failing = uids[1]
    assert ends[failing].finish_reason == ERROR and ends[failing].prompt_cache is not None
    assert len(tokens[failing]) < 12
    for u in (uids[0], uids[2]):
        assert tokens[u] == clean[u] and ends[u].finish_reason == clean_ends[u].finish_reason


def test_an_ended_sequence_reaches_its_client_as_a_failure():
    # What the generation loop puts on a request's queue, as the handler
    # reads it: the tokens, then GenerationFailed (500, or an error event)
    # instead of the error response and the end marker after it.
    import collections
    import queue

    from mlxq.server.isolation import ERROR
    from mlxq.server.metrics import Metrics
    from mlxq.server.supervision import GenerationFailed, _Counting

    Response = collections.namedtuple("Response", "text token logprob finish_reason top_tokens")
    q, m = queue.Queue(), Metrics()
    loop_side = _Counting(q, m)
    for r in (Response("a", 1, 0.0, None, ()), Response("", 2, 0.0, ERROR, ()), None):
        loop_side.put(r)
    assert q.get_nowait().token == 1
    assert isinstance(q.get_nowait(), GenerationFailed) and q.empty()
    assert "mlxq_generated_tokens_total 1\n" in m.render()


# In the server's process: every detokenizer raises on one (ASCII) token.
FAILING_DETOKENIZER = """
import mlx_lm.tokenizer_utils as tu
def _failing(add_token):
    def add(self, token):
        if token == {marker}:
            raise RuntimeError("injected detokenizer failure")
        return add_token(self, token)
    return add
for cls in (tu.NaiveStreamingDetokenizer, tu.SPMStreamingDetokenizer, tu.BPEStreamingDetokenizer):
    cls.add_token = _failing(cls.add_token)
"""


def test_a_request_whose_detokenizer_raises_fails_alone(server, tmp_path):
    """Two requests of a running batch (one streaming) force a token their
    detokenizer fails on (logit_bias): they alone get a 500 or an error
    event, the others get the tokens a server where nothing fails gives
    them, and the generation loop never restarts."""
    alone = [send(server[0], r) for r in REQUESTS]
    # A byte the model never writes here (ASCII: one token, one character).
    marker = next(c for c in "~^|`{}" if not any(c in t for t in alone))
    token = ord(marker)
    served = serving(tmp_path, MAX_TOKENS, inject=FAILING_DETOKENIZER.format(marker=token))
    url, log_path = next(served)
    try:

        def forced(stream):
            body = {"prompt": "golf: forced", "max_tokens": MAX_TOKENS, "temperature": 0.0}
            body.update(stream=stream, logit_bias={str(token): 100.0})
            return post(url, "/v1/completions", body)

        with ThreadPoolExecutor(len(REQUESTS) + 2) as pool:
            others = [pool.submit(send, url, r) for r in REQUESTS]
            failed = [pool.submit(forced, stream) for stream in (False, True)]
            together = [f.result() for f in others]
            (status, raw), (s_status, s_raw) = (f.result() for f in failed)
        if mx.is_available(mx.gpu):
            # The servers run on the GPU, where MLX's f32 matmuls round as
            # TF32 and differently for batches of other sizes: random
            # weights' near ties may then part; every answer must still come.
            assert len(together) == len(alone) and all(together)
        else:
            assert together == alone
        assert status == 500 and "injected detokenizer failure" in raw
        assert s_status == 200 and '"error"' in s_raw and "injected detokenizer failure" in s_raw
        assert s_raw.rstrip().endswith("data: [DONE]")
        assert send(url, REQUESTS[0]) == alone[0]  # still serving
        assert "the generation loop failed" not in log_path.read_text()
    finally:
        served.close()
