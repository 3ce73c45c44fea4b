"""A compiled decode step over a cache's buffers, the position passed as an array.

The step writes the token's K/V with the ring primitives and attends over the
whole buffer with a mask built from the position, so nothing in it depends on
the position's value: it must trace once and then replay for every token,
giving what the eager cache gives.
"""

import mlx.core as mx
import numpy as np
import pytest
from cache_helpers import kv

import mlxq

SCALE = 128**-0.5


def compiled_step(quantized, traces):
    def step(kbuf, vbuf, k, v, q, pos):
        traces.append(1)  # runs only while tracing
        if quantized:
            kbuf = mlxq.quantized_ring_update(kbuf, k, pos, group_size=64, bits=8)
            vbuf = mlxq.quantized_ring_update(vbuf, v, pos, group_size=64, bits=8)
        else:
            kbuf, vbuf = mlxq.ring_update(kbuf, k, pos), mlxq.ring_update(vbuf, v, pos)
        length = (kbuf[0] if quantized else kbuf).shape[2]
        visible = mx.arange(length) <= pos  # slots written so far
        out = mlxq.sdpa(q, kbuf, vbuf, scale=SCALE, mask=visible)
        return kbuf, vbuf, out

    return mx.compile(step)


@pytest.mark.parametrize("quantized", [False, True])
def test_compiled_decode_step_does_not_retrace(rng, quantized):
    eager = mlxq.QuantizedKVCache(64, 8) if quantized else mlxq.KVCache()
    eager.update_and_fetch(*kv(rng, 5))
    # The compiled path works on copies of the eager cache's buffers.
    copy = (lambda t: tuple(map(mx.array, t))) if quantized else mx.array
    kbuf, vbuf = copy(eager.keys), copy(eager.values)
    traces = []
    step = compiled_step(quantized, traces)
    for _ in range(12):
        k, v = kv(rng, 1)
        q = mx.array(rng.standard_normal((1, 4, 1, 128), dtype=np.float32))
        pos = mx.array(eager.offset, dtype=mx.int32)
        kbuf, vbuf, out = step(kbuf, vbuf, k, v, q, pos)
        want = mlxq.sdpa(q, *eager.update_and_fetch(k, v), scale=SCALE)
        assert mx.allclose(out, want, rtol=1e-5, atol=1e-6).item()
    assert len(traces) == 1, f"traced {len(traces)} times for 12 tokens"
    # The compiled writes put the same bytes where the cache put them.
    for got, want in zip(kbuf if quantized else [kbuf], eager.keys if quantized else [eager.keys]):
        assert mx.array_equal(got[..., :17, :], want[..., :17, :]).item()
