"""How much memory a training run will need, known before anything is built, and how much the machine has.

`treespark train` compares the two before loading a model (`training.cli.check_memory`), so that an absurd
size option (`--draft-layers 100000`, `--batch-size 10000000`) is refused in one line instead of growing
until the kernel kills the process without a word. Every estimate here is a lower bound of what the run
allocates, so a run that fits is never refused.
"""

from __future__ import annotations

import copy
import os

import torch

# float32 weights, their gradients and AdamW's two moments: what each trained parameter costs at least.
TRAINED_PARAMETER_BYTES = 16
# A regeneration prompt in memory (measured ~170 bytes: the `Prompt`, its id, its place in the list).
PROMPT_BYTES = 150


def drafter_parameter_count(config) -> int:
    """Parameters of a `TreeSparkDrafter(config)`, counted on the meta device: nothing is allocated, and two
    drafters of 1 and 2 layers give the per-layer count, so 100,000 layers cost no more to count than 2."""
    from ..drafter.modeling import TreeSparkDrafter

    def count(num_layers: int) -> int:
        small = copy.deepcopy(config)
        small.num_hidden_layers = num_layers
        with torch.device("meta"):
            return sum(p.numel() for p in TreeSparkDrafter(small).parameters())

    one, two = count(1), count(2)
    return one + (config.num_hidden_layers - 1) * (two - one)


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """`(bytes, where)`: the memory this process may still use on `device` (for a CPU run its share of the
    machine's available memory among the processes torchrun started on it), or None where it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)}"
    available = _available_host_memory()
    if available is None:
        return None
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    share = f" for each of the {processes} processes on this machine" if processes > 1 else ""
    return available // processes, f"available{share}"


def _available_host_memory() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def format_bytes(size: float) -> str:
    """`1.5 GB`, `320.0 MB`, `6.4 TB` (powers of 1000)."""
    units = ("B", "KB", "MB", "GB", "TB")
    index = 0
    while size >= 1000 and index < len(units) - 1:
        size /= 1000
        index += 1
    return f"{size:.0f} B" if index == 0 else f"{size:.1f} {units[index]}"
