"""Soak: mlxq-server under a bounded mixed load, on 127.0.0.1 only.

Starts ``python -m mlxq.server`` with a saved random-weight llama of mlx-lm's
class (float32, ``--kv-bits 4``; no download), takes each valid request's
answer alone, then runs rounds of concurrent clients until ``--rounds`` or
``--minutes`` is reached, whichever comes first. A round is:

  valid       the valid requests (completion and chat, streaming and not),
              each twice, with temperature 0
  hang-up     clients that send a request and close the connection, at once
              or after the first bytes of the answer
  malformed   requests with a bad field (a 4xx expected)

Per round and in total it reports: requests served, wrong answers (a valid
request's text differs from its answer alone), malformed requests not
answered 4xx, latency p50/p99 of the valid requests, tokens/s from the
server's /metrics, the generation loop's failures, and whether the server
was healthy and back to no active KV after the round.

With ``--against-stock R`` it then measures throughput alone: the valid
requests (non-streaming, so that each answer counts its tokens), all at
once, in R rounds alternating between ``mlxq-server --kv-bits 4`` and stock
``mlx_lm.server`` without ``--kv-bits`` (the only way stock batches: its
``--kv-bits`` serves one request at a time) on the same model, and reports
both tokens/s and their ratio.

    python bench/e2e/soak.py                          # at most 5 minutes, 30 rounds
    python bench/e2e/soak.py --minutes 1 --rounds 3   # a quick look
    python bench/e2e/soak.py --rounds 30 --against-stock 5
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import mlx.core as mx  # noqa: E402

from mlxq.random_models import save_random_model  # noqa: E402

MALFORMED = [
    {"prompt": "x", "stop": 12},
    {"prompt": 5},
    {"prompt": ["a", 7]},
    {"prompt": "x", "max_tokens": 10**12},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": "x", "top_p": 1.5},
    {"prompt": "x", "logit_bias": {"a": 1}},
    {"prompt": "x", "seed": "s"},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, path, body, timeout=300):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def text_of(kind, stream, raw):
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if kind == "chat" else choice["text"]
    parts = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"]
            if choice:
                delta = choice[0].get("delta", {}).get("content") if kind == "chat" else None
                parts.append(delta or choice[0].get("text") or "")
    return "".join(parts)


def request(url, req, max_tokens):
    """(status, text or None) of one valid request."""
    kind, stream, prompt = req
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        status, raw = post(url, "/v1/chat/completions", body)
    else:
        body["prompt"] = prompt
        status, raw = post(url, "/v1/completions", body)
    return status, (text_of(kind, stream, raw) if status == 200 else None)


def hang_up(url, i, max_tokens):
    port = int(url.rsplit(":", 1)[1])
    body = {"prompt": f"bye {i}", "max_tokens": max_tokens, "stream": i % 2 == 0}
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(data)
            + data
        )
        if i % 3:
            sock.recv(64 * (i % 3))


def scrape(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def healthy(url) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def settled(url, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m["mlxq_batch_size"] == 0 and m['mlxq_kv_bytes{where="active"}'] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def start_server(root, args, stock=False):
    model = os.path.join(root, "model")
    if not os.path.isdir(model):
        save_random_model(model, "llama", seed=11, dtype=mx.float32)
    port = free_port()
    log = open(os.path.join(root, "stock.log" if stock else "server.log"), "w")
    module = "mlx_lm.server" if stock else "mlxq.server"
    cmd = [sys.executable, "-m", module, "--model", model, "--port", str(port)]
    cmd += ([] if stock else ["--kv-bits", "4"]) + ["--max-tokens", str(args.max_tokens)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start: see {log.name}")
        time.sleep(0.25)
    return proc, url


def run_round(url, valid, alone, args):
    jobs = [("valid", r) for r in valid for _ in range(2)]
    jobs += [("hang-up", i) for i in range(args.hang_ups)]
    jobs += [("malformed", body) for body in MALFORMED]

    def run(job):
        kind, what = job
        t0 = time.perf_counter()
        if kind == "valid":
            status, text = request(url, what, args.max_tokens)
            return kind, status == 200 and text == alone[what], time.perf_counter() - t0
        if kind == "hang-up":
            hang_up(url, what, args.max_tokens)
            return kind, True, None
        status, _ = post(url, "/v1/completions", what)
        return kind, 400 <= status < 500, None

    before = scrape(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    wall = time.perf_counter() - t0
    after = settled(url)
    latencies = sorted(s for k, _, s in results if k == "valid")
    tokens = after["mlxq_generated_tokens_total"] - before["mlxq_generated_tokens_total"]
    return {
        "clients": len(jobs),
        "served": sum(ok for k, ok, _ in results if k == "valid"),
        "valid": sum(k == "valid" for k, _, _ in results),
        "wrong_answers": sum(not ok for k, ok, _ in results if k == "valid"),
        "malformed_not_4xx": sum(not ok for k, ok, _ in results if k == "malformed"),
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "tokens_per_s": tokens / wall,
        "failures": after["mlxq_generation_failures_total"],
        "healthy": healthy(url),
        "idle_after": after["mlxq_batch_size"] == 0
        and after['mlxq_kv_bytes{where="active"}'] == 0
        and after["mlxq_queue_length"] == 0,
        "wall_s": wall,
    }


def throughput(url, valid, max_tokens):
    """(generated tokens per second, connections reset) of the valid
    requests sent all at once, non-streaming (each answer's usage counts its
    tokens). A reset connection is sent again: stock mlx_lm.server listens
    with the standard library's backlog of 5, which resets connections when
    dozens of clients connect at once."""
    resets = []

    def run(req):
        kind, _, prompt = req
        body = {"max_tokens": max_tokens, "temperature": 0.0}
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        for _ in range(100):
            try:
                status, raw = post(url, path, body)
                break
            except (ConnectionResetError, urllib.error.URLError):
                resets.append(1)
                time.sleep(0.05)
        assert status == 200, raw[:200]
        return json.loads(raw)["usage"]["completion_tokens"]

    jobs = [r for r in valid for _ in range(2)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        tokens = sum(pool.map(run, jobs))
    return tokens / (time.perf_counter() - t0), len(resets)


def against_stock(root, args, valid) -> dict:
    servers = {name: start_server(root, args, stock=name == "stock") for name in ("mlxq", "stock")}
    rates = {name: [] for name in servers}
    resets = {name: 0 for name in servers}
    try:
        for _ in range(args.against_stock):
            for name, (_, url) in servers.items():
                rate, n = throughput(url, valid, args.max_tokens)
                rates[name].append(rate)
                resets[name] += n
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    out = {name: statistics.median(r) for name, r in rates.items()}
    out["ratio"] = out["mlxq"] / out["stock"]
    out["rounds"] = args.against_stock
    out["connections_reset"] = resets
    print(
        f"throughput, {2 * len(valid)} concurrent requests: mlxq-server --kv-bits 4 "
        f"{out['mlxq']:.0f} tok/s, stock mlx_lm.server {out['stock']:.0f} tok/s "
        f"({out['ratio']:.2f}x; median of {args.against_stock} alternating rounds); "
        f"connections reset: mlxq {resets['mlxq']}, stock {resets['stock']}"
    )
    return out


COLUMNS = [
    ("round", "round", "{}"),
    ("clients", "clients", "{}"),
    ("served", "served", "{}"),
    ("wrong", "wrong_answers", "{}"),
    ("malformed not 4xx", "malformed_not_4xx", "{}"),
    ("p50 s", "latency_p50_s", "{:.2f}"),
    ("p99 s", "latency_p99_s", "{:.2f}"),
    ("tok/s", "tokens_per_s", "{:.0f}"),
    ("loop failures", "failures", "{:.0f}"),
    ("healthy", "healthy", "{}"),
    ("idle after", "idle_after", "{}"),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="stop after this long")
    p.add_argument("--rounds", type=int, default=30, help="stop after this many rounds")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hang-ups", type=int, default=8, help="clients that hang up, per round")
    p.add_argument(
        "--against-stock",
        type=int,
        default=0,
        metavar="R",
        help="then R alternating throughput rounds against stock mlx_lm.server",
    )
    common.add_output_args(p)
    args = p.parse_args()
    out = common.output_path(args, "soak_cpu")
    info = common.machine_info()
    common.print_machine(info)
    kinds = [("completion", False), ("completion", True), ("chat", False), ("chat", True)]
    valid = [(k, s, f"soak {i}: " + "xyz " * (i % 5)) for i, (k, s) in enumerate(kinds * 4)]
    with tempfile.TemporaryDirectory() as root:
        proc, url = start_server(root, args)
        try:
            alone = {}
            for r in valid:
                status, alone[r] = request(url, r, args.max_tokens)
                assert status == 200, f"a valid request failed alone: {r}"
            table = common.MarkdownTable(COLUMNS)
            table.header()
            rows, deadline = [], time.monotonic() + 60 * args.minutes
            for i in range(args.rounds):
                if time.monotonic() > deadline:
                    break
                row = dict(run_round(url, valid, alone, args), round=i + 1)
                rows.append(row)
                table.row(row)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        stock = against_stock(root, args, valid) if args.against_stock else None
    total = {
        "rounds": len(rows),
        "requests": sum(r["clients"] for r in rows),
        "valid_served": sum(r["served"] for r in rows),
        "valid": sum(r["valid"] for r in rows),
        "wrong_answers": sum(r["wrong_answers"] for r in rows),
        "malformed_not_4xx": sum(r["malformed_not_4xx"] for r in rows),
        "loop_failures": max((r["failures"] for r in rows), default=0),
        "always_healthy_and_idle_after": all(r["healthy"] and r["idle_after"] for r in rows),
    }
    print(json.dumps(total))
    payload = {"benchmark": "soak", "machine": info, "rows": rows, "total": total}
    if stock is not None:
        payload["against_stock"] = stock
    common.save_json(out, payload)


if __name__ == "__main__":
    main()
