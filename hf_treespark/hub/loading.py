"""Loading targets and drafters by name or path, on a device (`device`: "cpu", "cuda", "cuda:1", a `torch.device`;
the command line's `--device` resolved by `help_format.resolve_device`), in the precision chosen for it
(`precision.py`).

`cpu_pack="auto"` (the default) routes a CPU model's linear layers through prepacked oneDNN kernels
(`cpu_gemm.py`), which make a multi-token verify forward far cheaper on CPUs whose BLAS handles a few
rows poorly; `cpu_pack=False` keeps the ordinary kernels.
"""

from __future__ import annotations

import os

import torch

from ..core.cpu_gemm import pack_linear_layers, should_pack
from ..precision import resolve_dtype
from . import assets


def _check_local_path(name: str, what: str) -> None:
    if name.startswith((os.sep, ".", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise OSError(f"No {what} directory at {name!r}: check the path (a Hub repo id looks like 'org/name').")


def _check_pack(cpu_pack: bool | str, device: str | torch.device) -> None:
    if cpu_pack is True and torch.device(device).type != "cpu":
        raise ValueError(f"cpu_pack=True (--cpu-pack on) packs the linear layers of a model on the CPU, and this one "
                         f"is on {device}: leave it 'auto' (--cpu-pack auto) or turn it off")


def _packed(model, cpu_pack: bool | str, device: str | torch.device):
    if should_pack(cpu_pack, device):
        pack_linear_layers(model)
    return model


def load_target(name: str | None = None, dtype: str | torch.dtype | None = "auto",
                device: str | torch.device = "cpu", cpu_pack: bool | str = "auto"):
    """`(model, tokenizer)`: a causal LM by name or path (sdpa attention), or the offline default when empty, on
    `device`."""
    _check_pack(cpu_pack, device)
    dtype = resolve_dtype(dtype, device)
    if not name:
        target, tokenizer = assets.load_default_target(dtype=dtype, device=device)
        return _packed(target, cpu_pack, device), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_local_path(name, "target model")
    target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return _packed(target, cpu_pack, device), AutoTokenizer.from_pretrained(name)


def load_drafter(name: str | None = None, dtype: str | torch.dtype | None = "auto",
                 device: str | torch.device = "cpu", cpu_pack: bool | str = "auto"):
    """A TreeSpark drafter by name or path, or the drafter shipped in the package when empty, on `device`."""
    from ..drafter.modeling import TreeSparkDrafter

    _check_pack(cpu_pack, device)
    dtype = resolve_dtype(dtype, device)
    if not name:
        return _packed(assets.load_default_drafter(dtype=dtype, device=device), cpu_pack, device)
    return _packed(TreeSparkDrafter.from_pretrained(name, dtype=dtype).to(device).eval(), cpu_pack, device)


def load_pair(target: str | None = None, drafter: str | None = None, dtype: str | torch.dtype | None = "auto",
              device: str | torch.device = "cpu", cpu_pack: bool | str = "auto"):
    """`(target, tokenizer, drafter)` in one precision on one device; the drafter is checked against the target."""
    dtype = resolve_dtype(dtype, device)
    target_model, tokenizer = load_target(target, dtype, device, cpu_pack)
    drafter_model = load_drafter(drafter, dtype, device, cpu_pack)
    drafter_model.check_target(target_model)
    return target_model, tokenizer, drafter_model
