# Type stubs for mlxq's compiled extension (the Python layer wraps it).
from typing import Optional, Union

import mlx.core as mx

mlx_version: str

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
    stream: Union[None, mx.Stream, mx.Device] = None,
) -> mx.array: ...
def _set_poison_outputs(enabled: bool) -> None: ...
