"""Where does quantized KV lose accuracy? A fake-quantization grid on SmolLM2
(bf16): K/V rounded through mx.quantize / mx.dequantize (rotated or not),
except the first P tokens (attention sinks) and the last R (a recent window),
which stay exact; teacher-forced over two texts (the Apache license and
Python's pydoc topics). Each spec is bits:group:r|n:P:R:pbits[:prec] (pbits
< 16: the sinks at that width instead of exact; prec f32 / f32r: rotation and
quantization in f32). What it found led to mlxq's keep_recent caches (README,
"Real weights"). Fast on a GPU (the H200 ran the README's grid in ~2 min).

    python bench/fakequant_grid.py 2048 4:64:r:0:0:16 4:64:r:0:128:16 3:64:r:4:128:16
"""

import json
import os
import pydoc_data.topics as topics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq import gguf
from mlxq.evaluate import teacher_forced

PREC = "bf"


def fq(x, bits, gs, rot):
    # PREC bf: as mlxq does today (bf16 rotation, mx.quantize of the bf16 row,
    # bf16 scales); f32: rotation, quantization and scales in f32; f32r: f32
    # rotation, the rotated row rounded to bf16, then as bf.
    xin = x.astype(mx.float32) if PREC != "bf" else x
    y = mx.hadamard_transform(xin) if rot else xin
    if PREC == "f32r":
        y = y.astype(x.dtype)
    y = mx.dequantize(*mx.quantize(y, group_size=gs, bits=bits), group_size=gs, bits=bits)
    y = y.astype(mx.float32) if PREC != "bf" else y
    return (mx.hadamard_transform(y) if rot else y).astype(x.dtype)


class FQ:
    def __init__(self, bits, gs, rot, P, R, pbits):
        self.exact, self.fake, self.cfg = KVCache(), KVCache(), (bits, gs, rot, P, R, pbits)

    @property
    def offset(self):
        return self.exact.offset

    def make_mask(self, *a, **k):
        return self.exact.make_mask(*a, **k)

    def update_and_fetch(self, k, v):
        bits, gs, rot, P, R, pbits = self.cfg
        if pbits < 16:
            ke, ve = self.exact.update_and_fetch(fq(k, pbits, gs, rot), fq(v, pbits, gs, rot))
        else:
            ke, ve = self.exact.update_and_fetch(k, v)
        kf, vf = self.fake.update_and_fetch(fq(k, bits, gs, rot), fq(v, bits, gs, rot))
        n = ke.shape[2]
        lo = min(P, n)
        hi = max(lo, n - R)
        if pbits < 16 and R > 0:
            raise ValueError("pbits applies to sinks only")

        def mix(e, f):
            return mx.concatenate([e[..., :lo, :], f[..., lo:hi, :], e[..., hi:, :]], axis=2)

        return mix(ke, kf), mix(ve, vf)


model, tok = gguf.load_packaged("smollm2-135m", dtype=mx.bfloat16)

texts = {
    "apache": open(
        os.path.join(os.path.dirname(__file__), "..", "tests", "data", "apache-2.0.txt")
    ).read(),
    "pydoc": "\n".join(topics.topics[k] for k in sorted(topics.topics))[:200000],
}
ntok = int(sys.argv[1])
specs = sys.argv[2:]
out = {}
for name, text in texts.items():
    ids = tok.encode(text)[: ntok + 1]
    t = time.time()
    ref_ppl, ref_top = teacher_forced(model, ids, make_prompt_cache(model))
    print(f"[{name}] ref ppl {ref_ppl:.4f} ({time.time() - t:.1f}s)", flush=True)
    out[name] = {"ref": ref_ppl}
    for spec in specs:
        bits, gs, rot, P, R, pbits, prec = (spec + ":bf").split(":")[:7]
        PREC = prec
        caches = [
            FQ(int(bits), int(gs), rot == "r", int(P), int(R), int(pbits)) for _ in model.layers
        ]
        ppl, top = teacher_forced(model, ids, caches)
        ch = 100 * (ppl / ref_ppl - 1)
        ag = 100 * float(np.mean(top == ref_top))
        out[name][spec] = (ppl, ch, ag)
        print(f"[{name}] {spec:20s} {ch:+7.2f}% agree {ag:5.1f}%", flush=True)
path = os.path.join(os.environ.get("OUT", "/tmp"), "fakequant_grid.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print(f"saved {path}")
