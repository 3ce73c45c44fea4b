"""Sharded generation over ``mx.distributed``: ``python -m mlxq.sharded``.

Two processes on 127.0.0.1 talk over MLX's ring backend (TCP sockets). They
are started as ``mlx.launch`` starts them: ``MLX_HOSTFILE`` names the ring's
hostfile (a JSON list holding each rank's ``"ip:port"``) and ``MLX_RANK``
the process's rank; one test goes through ``mlx.launch --hostfile`` itself,
with an mlx-lm model directory loaded by mlx-lm's ``sharded_load``, as a
run across machines would. The generation tests check that

* the greedy tokens (and their log-probabilities) equal those of the same
  model unsharded in this process, through the same ``generate_step`` with
  mlxq's ``kv_bits``;
* each rank's caches are mlxq's quantized caches holding its share of the
  KV: half of every layer's KV heads (tensor parallel: llama, and gpt_oss
  with its sliding-window caches and attention sinks), or all heads of only
  its own layers (pipeline, qwen2: rank 1 runs layers 0-1, rank 0 2-3).

The models are float32: tensor parallelism computes ``o_proj`` and
``down_proj`` as two partial matmuls joined by an ``all_sum``, which rounds
differently from one full matmul. In bf16 that moved log-probabilities by
0.03 (float32: 3e-6), enough to flip a near-tie of random weights.

Every process gets a timeout and runs in its own process group, killed
whole when the timeout passes, so a ring that never connects fails the
test instead of hanging it. The tests skip only where MLX has no ring
backend or two ranks cannot start one on 127.0.0.1 (a probe says why).
"""

import json
import os
import signal
import socket
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxq import sharded
from mlxq.random_models import model_args, random_model, save_random_model

PROMPT = "The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 16
# mlx.launch's output relay polls without pause (its select() watches the
# ranks' always-writable stdin), taking a core while it runs: fewer tokens.
LAUNCH_TOKENS = 8
KV_BITS = 4
SEED = 5
TIMEOUT_S = 120  # per two-rank run: a few seconds on two CPU cores

pytestmark = pytest.mark.skipif(
    not mx.distributed.is_available("ring"), reason="this MLX has no ring backend"
)


@pytest.fixture(autouse=True)
def cpu_only(device):
    # The ring backend's collectives run on the CPU (a GPU needs NCCL or
    # Metal's fast synch), so the ranks run there and so does the reference.
    if device != mx.cpu:
        pytest.skip("ring-backend ranks run on the CPU; the CPU case covers this")


# ----------------------------------------------------------------- launching
def free_ports(n: int, consecutive: bool = False):
    """``n`` ports free on 127.0.0.1 now (``consecutive``: p, p+1, ... as
    ``mlx.launch --starting-port p`` takes them)."""
    for _ in range(100):
        socks = []
        try:
            first = socket.socket()
            first.bind(("127.0.0.1", 0))
            socks.append(first)
            base = first.getsockname()[1]
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports on 127.0.0.1")


def wait_all(procs, logs, timeout: float) -> None:
    """Waits for every process; past ``timeout`` kills their process groups and fails."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {timeout} s (killed):\n{tails(logs)}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own group (start_new_session)
                p.wait()


def tails(logs) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)


def run_ranks(tmp_path, argv, ranks: int = 2, timeout: float = TIMEOUT_S):
    """Starts ``python -m mlxq.sharded argv`` as ranks 0..ranks-1 of a ring on
    127.0.0.1 (MLX_HOSTFILE, MLX_RANK) and returns each rank's JSON report."""
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    procs, outs, logs = [], [], []
    for rank in range(ranks):
        out, log = tmp_path / f"rank{rank}.out", tmp_path / f"rank{rank}.log"
        env = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank))
        with open(out, "w") as o, open(log, "w") as e:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "mlxq.sharded", *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=o,
                    stderr=e,
                    env=env,
                    start_new_session=True,
                )
            )
        outs.append(out)
        logs.append(log)
    wait_all(procs, logs, timeout)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{tails(logs)}"
    return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """Skips the module if two ranks cannot run an all_sum over the ring here."""
    tmp = tmp_path_factory.mktemp("ring_probe")
    hostfile = tmp / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    code = (
        "import mlx.core as mx; g = mx.distributed.init(strict=True, backend='ring'); "
        "print(mx.distributed.all_sum(mx.array([g.rank() + 1.0]), stream=mx.cpu).item())"
    )
    procs, logs = [], []
    for rank in range(2):
        log = tmp / f"rank{rank}.log"
        env = dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank))
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        logs.append(log)
    try:
        for p in procs:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode != 0 or log.read_text().strip() != "3.0" for p, log in zip(procs, logs)):
        pytest.skip(f"MLX's ring backend does not start on 127.0.0.1 here:\n{tails(logs)}")


# ----------------------------------------------------------------- checking
def unsharded(model, tokenizer, max_tokens: int = MAX_TOKENS):
    tokens, logprobs, cache = sharded.greedy_tokens(
        model, tokenizer.encode(PROMPT), max_tokens, KV_BITS
    )
    return tokens, logprobs, cache, len(tokenizer.encode(PROMPT))


def check_against(reports, reference, max_tokens: int = MAX_TOKENS):
    tokens, logprobs, cache, prompt_len = reference
    assert [r["rank"] for r in reports] == list(range(len(reports)))
    for r in reports:
        assert r["size"] == len(reports)
        assert r["tokens"] == tokens, f"rank {r['rank']}"
        assert r["logprobs"] == pytest.approx(logprobs, abs=1e-4)
        for c in r["caches"]:
            assert c["module"].startswith("mlxq.cache"), c
            assert c["class"] in ("QuantizedKVCache", "RotatingQuantizedKVCache"), c
            assert (c["bits"], c["v_bits"]) == (8, KV_BITS)  # the recipe's 8-bit keys
            # the prompt and every generated token (the last one was fed in too)
            assert c["offset"] == prompt_len + max_tokens
    assert all(type(c).__module__.startswith("mlxq.cache") for c in cache)


def check_tensor(reports, reference):
    """Every rank runs every layer on half of its KV heads."""
    full = [c.keys[0].shape[1] for c in reference[2]]
    for r in reports:
        assert r["layers"] == [0, len(full)]
        assert [c["layer"] for c in r["caches"]] == list(range(len(full)))
        assert [c["kv_heads"] for c in r["caches"]] == [h // len(reports) for h in full]


def check_pipeline(reports, reference):
    """Each rank runs (and caches) its own layers only, with all their KV heads;
    rank size-1 holds the first layers, as mlx-lm's PipelineMixin splits them."""
    full = [c.keys[0].shape[1] for c in reference[2]]
    spans = [r["layers"] for r in reports]
    assert sorted(spans) == [[0, 2], [2, 4]] and spans[-1] == [0, 2]
    for r in reports:
        start, end = r["layers"]
        assert [c["layer"] for c in r["caches"]] == list(range(start, end))
        assert [c["kv_heads"] for c in r["caches"]] == full[start:end]


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "arch, shard, check",
    [
        ("llama", "tensor", check_tensor),
        # sliding-window layers (RotatingQuantizedKVCache, wrapped by the
        # 60 tokens) and attention sinks, which shard() splits by head
        ("gpt_oss", "tensor", check_tensor),
        ("qwen2", "pipeline", check_pipeline),
    ],
)
def test_two_ranks_equal_unsharded(ring, tmp_path, arch, shard, check):
    argv = ["--random-arch", arch, "--seed", str(SEED), "--dtype", "float32"]
    argv += ["--shard", shard, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS)]
    argv += ["--kv-bits", str(KV_BITS), "--device", "cpu"]
    reports = run_ranks(tmp_path, argv)
    reference = unsharded(*random_model(arch, seed=SEED, dtype=mx.float32))
    check_against(reports, reference)
    check(reports, reference)


def test_model_directory_under_mlx_launch(ring, tmp_path):
    """``mlx.launch --hostfile`` (hosts named 127.0.0.1 run without ssh) and an
    mlx-lm model directory through mlx-lm's ``sharded_load``: the multi-machine
    path, short of ssh. Pipelined: sharded_load's own branch for it, which
    picks each rank's weight files from the index (one file here).
    mlx.launch exits 0 even when a rank fails, so the test counts the
    reports."""
    from mlx_lm import load

    path = save_random_model(str(tmp_path / "model"), "qwen2", seed=SEED, dtype=mx.float32)
    hosts = {"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    port = free_ports(2, consecutive=True)[0]
    launch = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
    cmd = [sys.executable, "-c", launch, "--hostfile", str(hostfile), "--starting-port", str(port)]
    cmd += ["--python", sys.executable, "--", "-m", "mlxq.sharded", "--model", path]
    cmd += ["--shard", "pipeline", "--prompt", PROMPT, "--max-tokens", str(LAUNCH_TOKENS)]
    cmd += ["--device", "cpu"]
    out, log = tmp_path / "launch.out", tmp_path / "launch.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(out, "w") as o, open(log, "w") as e:
        # stdin a pipe left open: mlx.launch relays stdin to the ranks, and an
        # at-EOF /dev/null would keep its select loop spinning.
        p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=o, stderr=e, env=env, start_new_session=True
        )
    try:
        wait_all([p], [out, log], TIMEOUT_S)
    finally:
        p.stdin.close()
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 2, tails([out, log])
    reports = sorted(lines, key=lambda r: r["rank"])
    model, tokenizer = load(path)
    reference = unsharded(model, tokenizer, LAUNCH_TOKENS)
    check_against(reports, reference, LAUNCH_TOKENS)
    check_pipeline(reports, reference)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--random-arch", "llama"], "--shard"),
        (["--random-arch", "llama", "--shard", "ring"], "invalid choice"),
        (["--shard", "tensor"], "--model --random-arch"),
        (["--random-arch", "llama", "--shard", "tensor", "--kv-bits", "7"], "--kv-bits"),
        (["--random-arch", "llama", "--shard", "tensor", "--kv-group-size", "48"], "group"),
        (["--model", "m", "--dtype", "float32", "--shard", "tensor"], "--dtype"),
        (["--random-arch", "llama", "--shard", "tensor", "--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_bad_options_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        sharded.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unshardable_models_are_refused(capsys):
    # llama has no pipeline in mlx-lm: refused before any communication (a
    # group of one here, without MLX_HOSTFILE).
    assert sharded.main(["--random-arch", "llama", "--shard", "pipeline"]) == 2
    assert "no pipeline sharding" in capsys.readouterr().err
    model, _ = random_model("llama")
    config = vars(model_args("llama")[1])
    with pytest.raises(ValueError, match="num_attention_heads=8 does not split over 3 ranks"):
        sharded.check_shardable(model, config, "tensor", 3, "llama")
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not split over 4 ranks"):
        sharded.check_shardable(model, config, "tensor", 4, "llama")
    with pytest.raises(ValueError, match="no tensor sharding"):
        sharded.check_shardable(random_model("gemma3")[0], {}, "tensor", 2, "gemma3")
    with pytest.raises(ValueError, match="4 layers for 5 pipeline ranks"):
        sharded.check_shardable(random_model("qwen2")[0], {}, "pipeline", 5, "qwen2")
