"""The precision models load in: `dtype="auto"` picks half precision where the hardware computes it natively.

bfloat16 on CUDA devices that compute it natively (float16 on older ones) and on CPUs with native bf16
instructions (x86 `avx512_bf16` or `amx_bf16`, Arm `bf16`); float32 elsewhere. On this project's
2-core CPU, bf16 runs SmolLM2-135M about 1.7x faster than float32 end to end. Greedy output in half
precision may differ from float32 at floating-point near-ties of the target's logits
(`hf_treespark.core.exactness`); pass `dtype="fp32"` for bit-exact comparisons.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
_DTYPE_NAMES = {**DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (read from `/proc/cpuinfo`'s flags; False when unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return False


def cuda_has_native_bf16(device: str | torch.device = "cuda") -> bool:
    """Whether the CUDA device computes bf16 natively: compute capability 8.0 (Ampere) or later, or any ROCm device.
    Not `torch.cuda.is_bf16_supported()`: by default it also counts emulated bf16 (slower than float16 on a V100 or
    a T4), and it asks about the current device rather than `device`."""
    if not torch.cuda.is_available():
        return False
    return bool(torch.version.hip) or torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The precision `dtype="auto"` picks for `device` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if cuda_has_native_bf16(device) else torch.float16
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """`"auto"`/None, a short name (`fp32`, `bf16`, `fp16`), a torch name (`bfloat16`) or a `torch.dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return auto_dtype(device)
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    raise ValueError(f"dtype={dtype!r} is not a precision: use 'auto', 'fp32', 'bf16' or 'fp16'")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bf16`: how reports name a precision."""
    return next((name for name, value in DTYPES.items() if value == dtype), str(dtype).replace("torch.", ""))
