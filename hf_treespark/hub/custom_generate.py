"""TreeSpark decoding as a transformers `custom_generate` recipe, for users without the package.

`save_pretrained` copies this file into a drafter directory as `custom_generate/generate.py`,
next to copies of the modules of the decoding loop (`card.custom_generate_modules`), so that

    drafter = AutoModel.from_pretrained(repo, trust_remote_code=True)
    out = target.generate(**inputs, assistant_model=drafter, custom_generate=repo, trust_remote_code=True)

runs the same tree decoding as `import hf_treespark` does. transformers calls `generate(model=target,
**every generate argument)`.

A repository holding `custom_generate/` that is loaded with `trust_remote_code=True` gets this
function as its `generate` when the loaded model can generate. The drafter cannot (it is not a
causal LM), so loading it is unaffected; the check on `model` below turns any other use into a
clear error.
"""

from __future__ import annotations

from ..calibration.latency import cached_latency
from ..decoding.budget import use_cost_table
from ..decoding.integration import is_treespark_drafter, treespark_generate

use_cost_table(cached_latency)  # as `import hf_treespark` does: "auto" reads this machine's round costs


def generate(model, assistant_model=None, inputs=None, streamer=None, **kwargs):
    """`model.generate(..., assistant_model=drafter)` with TreeSpark tree decoding (see the module docstring)."""
    if is_treespark_drafter(model):
        raise RuntimeError("This is the TreeSpark decoding recipe of a drafter repository: call it from the target, "
                           "target.generate(..., assistant_model=drafter, custom_generate=<drafter repo>, "
                           "trust_remote_code=True), not from the drafter itself.")
    if not is_treespark_drafter(assistant_model):
        raise ValueError("custom_generate=<TreeSpark drafter repo> needs the drafter too: pass "
                         "assistant_model=AutoModel.from_pretrained(<drafter repo>, trust_remote_code=True)")
    return treespark_generate(model, assistant_model, inputs, streamer=streamer, **kwargs)
