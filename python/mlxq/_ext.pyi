"""mlxq's C++ primitives (use the mlxq package, not this module)."""

from collections.abc import Sequence

import mlx.core


mlx_version: str = '0.32.4'

SUPPORTED_BITS: tuple = (2, 3, 4, 5, 6, 8)

SUPPORTED_GROUP_SIZES: tuple = (32, 64, 128)

def quantized_sdpa(q: mlx.core.array, k_packed: mlx.core.array, k_scales: mlx.core.array, k_biases: mlx.core.array, v_packed: mlx.core.array, v_scales: mlx.core.array, v_biases: mlx.core.array, *, scale: float, mask_mode: str = '', mask: mlx.core.array | None = None, sinks: mlx.core.array | None = None, group_size: int | None = None, bits: int | None = None, v_group_size: int | None = None, v_bits: int | None = None, return_lse: bool = False, recent_keys: mlx.core.array | None = None, recent_values: mlx.core.array | None = None, recent_causal: bool = False, rows: int | None = None, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> object:
    """
    Fused attention over MLX affine-quantized K/V (see mlxq.quantized_sdpa).
    """

def recent_attention(q: mlx.core.array, keys: mlx.core.array, values: mlx.core.array, out_q: mlx.core.array, lse_q: mlx.core.array, *, scale: float, causal: bool = False, mask: mlx.core.array | None = None, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> mlx.core.array:
    """
    Attention over an exact window (all of it, causally, or as a mask array says), merged with attention over other keys from its output and log-sum-exp (see mlxq.attention.recent_attention).
    """

def ring_update(buffer: mlx.core.array, update: mlx.core.array, pos: int | mlx.core.array, *, owned: bool = False, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> mlx.core.array:
    """Write update rows into a ring buffer at pos (see mlxq.ring_update)."""

def window_step(keys_ring: mlx.core.array, values_ring: mlx.core.array, keys: mlx.core.array, values: mlx.core.array, *, start: int, span: int, pos: int, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> tuple:
    """
    A recent window's many-row step: the exact rows (the rings' span, then keys / values) and the rings with the step's last rows written at pos (see mlxq.cache.recent).
    """

def quantized_ring_update(packed: mlx.core.array, scales: mlx.core.array, biases: mlx.core.array, update: mlx.core.array, pos: int | mlx.core.array, *, group_size: int, bits: int, owned: bool = False, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> tuple:
    """
    Quantize update rows into a quantized ring buffer (see mlxq.quantized_ring_update).
    """

def quantized_kv_update(k_packed: mlx.core.array, k_scales: mlx.core.array, k_biases: mlx.core.array, v_packed: mlx.core.array, v_scales: mlx.core.array, v_biases: mlx.core.array, k_update: mlx.core.array, v_update: mlx.core.array, pos: int | mlx.core.array, *, group_size: int, bits: int, fetch: int = -1, v_group_size: int | None = None, v_bits: int | None = None, recent_keys: mlx.core.array | None = None, recent_values: mlx.core.array | None = None, recent_key_rows: mlx.core.array | None = None, recent_value_rows: mlx.core.array | None = None, recent_owned: bool = False, recent_pos: int | mlx.core.array | None = None, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> tuple:
    """
    A KV cache's write of one step: quantize K and V rows into both triples in place (fetch >= 0: also return their rows [0, fetch) as views; recent_keys / recent_values: also write the rows (recent_key_rows / recent_value_rows, default the updates) into an exact window's two rings at the same position, or at recent_pos, and return them last).
    """

def dequantize_into(workspace: mlx.core.array, packed: mlx.core.array, scales: mlx.core.array, biases: mlx.core.array, *, group_size: int, bits: int, after: Sequence[mlx.core.array] = [], stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> mlx.core.array:
    """
    Dequantize a triple into the workspace's memory, after the arrays in `after` (see mlxq.workspace).
    """

def _take_workspace_misses() -> int:
    """
    Test hook: dequantize_into calls that could not use their workspace (then resets).
    """

def _take_ring_copies() -> int:
    """
    Test hook: ring/KV writes that copied their buffer since the last call (then resets).
    """

def _install_crash_backtrace() -> None:
    """Debug hook: print a native backtrace on SIGSEGV/SIGABRT."""

def _take_last_sdpa_kernel() -> str:
    """
    Test hook: the kernel family the last sdpa evaluation chose (CUDA: decode, tiled, ...; CPU: cpu_int16 or cpu_f32 products), then clears it.
    """

def _cpu_int_kernels() -> str | None:
    """
    Test hook: the CPU kernel's integer products in use now (avx512-vnni, avx512-bw, avx2; MLXQ_CPU_INT=0, avx2 or avx512-bw chooses), or None: f32 products.
    """

def _environment() -> dict:
    """
    The MLXQ_* variables mlxq reads (csrc/environment.cpp), as parsed: switches as '1' (on) or '0' (off).
    """

def _set_environment(name: str, value: str) -> None:
    """
    Test hook: parse `value` for one MLXQ_* variable as if it had been set at start (MLXQ_NUM_THREADS and MLXQ_CUDA_POOL take effect only before first use).
    """

def _set_tuning(name: str, value: int) -> None:
    """
    Test hook: override one of the plans' measured block shapes or thresholds (cuda_tiled_warps, cuda_tiled_keys, cuda_gemm_min_keys, cuda_gemm_block_elements, split_tasks_per_thread; 0 leaves the choice to the plan).
    """

def _scheduled(a: mlx.core.array) -> bool:
    """
    Whether an evaluation (eval or async_eval) has taken the array: its graph is then ordered before anything built after it on the same stream.
    """

def _device_memory() -> tuple:
    """
    (active, peak) bytes of mlxq's own GPU pool (CUDA outputs and scratch; MLX's get_peak_memory does not see them); the peak then restarts from active.
    """

def _set_poison_outputs(enabled: bool) -> None:
    """
    Test hook: fill every new mlxq output with NaN/0xFF before its kernel runs.
    """

def _gpu_backend() -> str | None:
    """The GPU backend this build of mlxq runs: "cuda", "metal" or None."""

def _route_to_mx_fast(backend: str | None, *, L: int, N: int, Hq: int, Hkv: int, Dk: int, Dv: int, dtype: mlx.core.Dtype, scales_dtype: mlx.core.Dtype, mask_kind: str, sinks_dtype: mlx.core.Dtype | None = None) -> bool:
    """
    Test hook: quantized_sdpa's decision to dequantize and compose MLX's fused attention on `backend` ("cuda", "metal" or None: the CPU).
    """

def _take_route_counts() -> dict[str, int]:
    """
    Test hook: quantized attention calls routed to mx.fast since the last call (then resets).
    """

def _workspace_dequantize_kv(k_packed: mlx.core.array, k_scales: mlx.core.array, k_biases: mlx.core.array, v_packed: mlx.core.array, v_scales: mlx.core.array, v_biases: mlx.core.array, *, group_size: int, bits: int, v_group_size: int, v_bits: int, dtype: mlx.core.Dtype, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> tuple[mlx.core.array, mlx.core.array]:
    """
    K and V dequantized into the stream's workspace buffers (see mlxq.workspace).
    """

def _dequantized_attention(q: mlx.core.array, k_packed: mlx.core.array, k_scales: mlx.core.array, k_biases: mlx.core.array, v_packed: mlx.core.array, v_scales: mlx.core.array, v_biases: mlx.core.array, *, scale: float, causal: bool, sinks: mlx.core.array | None = None, group_size: int, bits: int, v_group_size: int, v_bits: int, exact_keys: mlx.core.array | None = None, exact_values: mlx.core.array | None = None, rows: int | None = None, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> mlx.core.array | None:
    """
    Test hook: the routed prefill's attention on any stream (MLX's attention over the K/V rows [0, rows) dequantized, then exact_keys / exact_values), without the decision.
    """

def _workspace_note_reader(out: mlx.core.array, stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> None:
    """`out` read the stream's workspace: the next write waits for it."""

def _workspace_release(stream: mlx.core.Stream | mlx.core.ThreadLocalStream | mlx.core.Device | mlx.core.DeviceType | None = None) -> None:
    """Drop the stream's workspace buffers."""

def _workspace_release_all() -> None:
    """Drop every stream's workspace."""

def _workspace_held_bytes(stream: mlx.core.Stream | None = None) -> int:
    """Bytes of workspace held by one stream, or by all."""

def _metal_plan_sdpa(problem: dict) -> dict:
    """
    Test hook: the Metal dispatch of a QuantizedSDPA problem (dict in, dict out).
    """

def _metal_plan_ring_update(problem: dict) -> dict:
    """Test hook: the Metal dispatch of a RingUpdate."""

def _metal_plan_quantized_ring_update(problem: dict) -> dict:
    """Test hook: the Metal dispatch of a QuantizedRingUpdate."""

def _metal_plan_copy4d(problem: dict) -> dict:
    """Test hook: the Metal dispatch of a strided copy."""

def _metal_plan_dequantize_into(problem: dict) -> dict:
    """Test hook: the Metal dispatch of a DequantizeInto."""

def _metal_plan_fill(problem: dict) -> dict:
    """
    Test hook: the Metal dispatch of the poisoning fill (dtype's poison word unless a pattern is given).
    """

def _cuda_plan_sdpa(problem: dict, layout: dict = {}, limits: dict = {}, decode: dict = {}, tiled: dict = {}, generic_smem: int = 0) -> dict:
    """
    Test hook: CUDA's attention plan (kernel family, grid, splits, merge) for a problem.
    """
