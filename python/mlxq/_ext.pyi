# Type stubs for mlxq's compiled extension (the Python layer wraps it).
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import mlx.core as mx

mlx_version: str
SUPPORTED_BITS: Tuple[int, ...]
SUPPORTED_GROUP_SIZES: Tuple[int, ...]

def quantized_sdpa(
    q: mx.array,
    k_packed: mx.array,
    k_scales: mx.array,
    k_biases: mx.array,
    v_packed: mx.array,
    v_scales: mx.array,
    v_biases: mx.array,
    *,
    scale: float,
    mask_mode: str = "",
    mask: Optional[mx.array] = None,
    sinks: Optional[mx.array] = None,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    v_bits: Optional[int] = None,
    v_group_size: Optional[int] = None,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array: ...
def ring_update(
    buffer: mx.array,
    update: mx.array,
    pos: Union[int, mx.array],
    *,
    owned: bool = False,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array: ...
def quantized_ring_update(
    packed: mx.array,
    scales: mx.array,
    biases: mx.array,
    update: mx.array,
    pos: Union[int, mx.array],
    *,
    group_size: int,
    bits: int,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> Tuple[mx.array, mx.array, mx.array]: ...
def quantized_kv_update(
    k_packed: mx.array,
    k_scales: mx.array,
    k_biases: mx.array,
    v_packed: mx.array,
    v_scales: mx.array,
    v_biases: mx.array,
    k_update: mx.array,
    v_update: mx.array,
    pos: Union[int, mx.array],
    *,
    group_size: int,
    bits: int,
    fetch: int = -1,
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> Tuple[Tuple[mx.array, ...], ...]:
    """(K triple, V triple), then with fetch >= 0 also their rows [0, fetch) as views."""

def dequantize_into(
    workspace: mx.array,
    packed: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    after: Sequence[mx.array] = (),
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array:
    """[B, H, N, D] dequantized into the workspace's memory, after `after` is evaluated."""

def _take_workspace_misses() -> int: ...
def _take_ring_copies() -> int: ...
def _take_last_sdpa_kernel() -> str: ...
def _set_poison_outputs(enabled: bool) -> None: ...
def _device_memory() -> Tuple[int, int]:
    """(active, peak) bytes of mlxq's own CUDA pool; the peak restarts from active."""

def _install_crash_backtrace() -> None: ...

# Test hooks: the Metal host code's grid arithmetic, for the emulator tests.
def _metal_plan_sdpa(problem: Dict[str, Any]) -> Dict[str, Any]: ...
def _metal_plan_ring_update(problem: Dict[str, Any]) -> Dict[str, Any]: ...
def _metal_plan_quantized_ring_update(problem: Dict[str, Any]) -> Dict[str, Any]: ...
def _metal_plan_copy4d(problem: Dict[str, Any]) -> Dict[str, Any]: ...
def _metal_plan_dequantize_into(problem: Dict[str, Any]) -> Dict[str, Any]: ...
def _metal_plan_fill(problem: Dict[str, Any]) -> Dict[str, Any]: ...

# Test hook: CUDA's attention plan (csrc/cuda/sdpa/plan.h), on every platform.
def _cuda_plan_sdpa(
    problem: Dict[str, Any],
    layout: Dict[str, Any] = ...,
    limits: Dict[str, Any] = ...,
    decode: Dict[str, Any] = ...,
    tiled: Dict[str, Any] = ...,
    generic_smem: int = 0,
) -> Dict[str, Any]: ...
