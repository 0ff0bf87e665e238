"""Prepacked oneDNN matrix products for the linear layers of a model decoding on a CPU.

A TreeSpark round verifies `N + 1` tokens in one target forward, so its cost hangs on how a
linear layer scales from one row to a few. On CPUs where the default BLAS handles a handful of
rows poorly, that scaling is nearly linear: measured on a 2-core AMD EPYC (AVX2, MKL, fp32), one
SmolLM2-135M forward over a 256-token cache took 90 ms for 1 token, 156 ms for 3 and 240 ms for 9.
oneDNN with its weights reordered once into its blocked layout ("prepacked") took 86, 104 and 130 ms:
the 1-token step is unchanged and the verify forward of a budget-8 tree falls from 2.7 to 1.5 steps.

`pack_linear_layers(model)` switches every `nn.Linear` of `model` to that kernel for inference.
The packed copy is rebuilt whenever the weight changes (in place, by `.to()`, by training), and a
call that needs gradients, or a tensor that is not a CPU float32/bfloat16 tensor, takes the
ordinary `F.linear`, so the model's behaviour is unchanged apart from floating-point rounding
(another summation order: the same kind of difference as between a 1-token and a 9-token forward
under the default BLAS). Use the same packed model for plain decoding when comparing speeds.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear kernels (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def weight_key(weight: torch.Tensor) -> tuple:
    """Changes whenever `weight` is replaced or modified in place."""
    return weight.data_ptr(), weight._version, weight.dtype, weight.shape


class PackedForward:
    """`forward` of a packed linear layer, holding the layer's weight in oneDNN's blocked layout.

    The packed weight is a cache, not state: it is an opaque tensor (it has no storage to copy), so a
    deep copy (`copy.deepcopy`) or a pickle (`torch.save` of the model) of the layer carries an empty
    cache, filled again at the copy's first call. It is never a parameter or buffer, so `state_dict`
    and `save_pretrained` do not see it.
    """

    def __init__(self, module: nn.Linear):
        self.module = module
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None  # `weight_key` of the weight `packed` was made from

    def __deepcopy__(self, memo: dict) -> PackedForward:
        return PackedForward(copy.deepcopy(self.module, memo))

    def __reduce__(self):
        return PackedForward, (self.module,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight = module.weight
        if (weight.device.type != "cpu" or x.device.type != "cpu" or x.dtype != weight.dtype
                or weight.dtype not in PACKABLE_DTYPES or x.numel() == 0
                or (module.bias is not None and module.bias.dtype != x.dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return F.linear(x, weight, module.bias)
        key = weight_key(weight)
        if self.key != key:  # first call, or the weight changed since packing
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.key = key
        bias = None if module.bias is None else module.bias.detach()
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


def pack_linear_layers(model: nn.Module) -> int:
    """Route every `nn.Linear` of `model` through prepacked oneDNN kernels; returns how many.

    Idempotent. Raises `RuntimeError` when this torch build has no oneDNN (see `packing_available`).
    """
    if not packing_available():
        raise RuntimeError("this torch build has no oneDNN packed linear kernels (torch.backends.mkldnn); "
                           "decode without packing")
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and not is_packed(module):
            module.forward = PackedForward(module)
            count += 1
    return count


def unpack_linear_layers(model: nn.Module) -> int:
    """Undo `pack_linear_layers`: the ordinary `nn.Linear.forward` again; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and is_packed(module):
            del module.forward
            count += 1
    return count


def is_packed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), PackedForward)


def should_pack(pack: bool | str, device: str | torch.device) -> bool:
    """`pack`: True, False or "auto" (pack on a CPU when oneDNN is there)."""
    if pack == "auto":
        return torch.device(device).type == "cpu" and packing_available()
    if not isinstance(pack, bool):
        raise ValueError(f"cpu_pack={pack!r} is invalid: use True, False or 'auto'")
    return pack


def model_is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of `model` uses the packed kernels."""
    return any(is_packed(m) for m in model.modules() if isinstance(m, nn.Linear))
