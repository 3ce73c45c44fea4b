"""Where many-row attention over quantized K/V runs on a GPU.

On a GPU, a prefill-sized :func:`mlxq.quantized_sdpa` dequantizes the
layer's K and V (a transient ``O(N * D)`` copy in this stream's workspace,
:mod:`mlxq.workspace`) and composes MLX's fused attention wherever MLX has a
fused kernel for the problem; everything else runs mlxq's kernels. The op
decides in C++ (csrc/prefill_route.h says why and when); this module holds
the switches and the test hooks.
"""

import functools
from typing import Dict, Optional

from . import _ext

# Fewer query rows than this (per KV head) stay on mlxq's kernels
# (csrc/prefill_route.h: kMinRoutedQueryRows).
MIN_ROUTED_QUERY_ROWS = 16

_SWITCHES = {"prefill": "MLXQ_DEQUANTIZED_PREFILL", "workspace": "MLXQ_PREFILL_WORKSPACE"}


def _switch(name: str, enabled: bool) -> bool:
    variable = _SWITCHES[name]
    old = _ext._environment()[variable] == "1"
    _ext._set_environment(variable, "1" if enabled else "0")
    return old


def set_dequantized_prefill(enabled: bool) -> bool:
    """Turn the dequantize-then-``mx.fast`` route on or off; returns the old setting.

    Off, every quantized attention runs on mlxq's kernels (benchmarks and the
    kernel tests use this). Also settable with ``MLXQ_DEQUANTIZED_PREFILL=0``.
    """
    return _switch("prefill", enabled)


def prefill_workspace() -> bool:
    """Whether routed layers dequantize into the stream's workspace (see
    :func:`set_prefill_workspace`)."""
    return _ext._environment()[_SWITCHES["workspace"]] == "1"


def set_prefill_workspace(enabled: bool) -> bool:
    """Dequantize routed layers into one reused buffer per stream (default) or
    with ``mx.dequantize`` per layer; returns the old setting. Also settable
    with ``MLXQ_PREFILL_WORKSPACE=0``."""
    return _switch("workspace", enabled)


def take_route_counts() -> Dict[str, int]:
    """Test hook: quantized attention calls routed to ``mx.fast`` since the last call."""
    return _ext._take_route_counts()


@functools.lru_cache(maxsize=None)
def gpu_backend() -> Optional[str]:
    """``"cuda"``, ``"metal"`` or None: the GPU backend this build of mlxq
    runs (fixed for the build; asked once, as prefill steps ask it)."""
    return _ext._gpu_backend()


def route_through_mx_fast(
    backend: Optional[str],
    *,
    L: int,
    N: int,
    Hq: int,
    Hkv: int,
    Dk: int,
    Dv: int,
    dtype,
    scales_dtype,
    mask_kind: str,
    sinks_dtype=None,
) -> bool:
    """The op's decision for a problem on ``backend`` (``"cuda"``, ``"metal"``
    or None: the CPU), whatever machine this is: dequantize and use MLX's
    fused attention, or keep mlxq's kernel. ``mask_kind`` is ``"none"``,
    ``"causal"`` or ``"array"``."""
    return _ext._route_to_mx_fast(
        backend,
        L=L,
        N=N,
        Hq=Hq,
        Hkv=Hkv,
        Dk=Dk,
        Dv=Dv,
        dtype=dtype,
        scales_dtype=scales_dtype,
        mask_kind=mask_kind,
        sinks_dtype=sinks_dtype,
    )
