"""The drafter, a `PreTrainedModel`: its config (`configuration`), decoder block (`modeling_block`), heads
(`modeling_heads`), binding to a target (`modeling_binding`), draft vocabulary (`draft_vocab`), saving and
loading with their checks (`modeling_io`), and the model itself (`modeling`).

Imports: `core`, `sources` (a drafter carries its datastore) and the package's leaf modules.
"""
