"""Run by torchrun (2 processes) and plainly (1 process) in test_training.py.

Two optimizer steps; rank 0 saves the parameters.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from training_setup import tiny_trainer  # noqa: E402

out = Path(sys.argv[1])
batch_size = int(sys.argv[2])
# A large Adam epsilon makes the update linear in the gradient: Adam's first steps otherwise turn
# float-rounding-sized gradients into full +-lr updates, which would hide what this test compares.
trainer = tiny_trainer(out / "run", batch_size=batch_size, max_steps=2, save_every=100, adam_eps=1.0, lr=0.5)
trainer.train(resume=False, progress=False)
assert trainer.accelerator.num_processes == int(sys.argv[3]), trainer.accelerator.num_processes
if trainer.accelerator.is_main_process:
    drafter = trainer.unwrapped_drafter()
    torch.save({k: v.detach().cpu() for k, v in drafter.state_dict().items()}, out / "params.pt")
