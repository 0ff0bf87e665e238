"""Decoding with a drafter: the session (prefill, round, commit; `session`, `engine`), the budget's cost model and the
per-call guard (`budget`, `call_guard`) and the round controller over them (`controller`), and the `generate`
integration (`generation`, the one loop for every batch size; `handoff`, `integration`).

Imports: `core`, `sources`, `drafter`; never `calibration`, `bench`, `cli`, `training` (tests/test_structure.py says
so).
"""
