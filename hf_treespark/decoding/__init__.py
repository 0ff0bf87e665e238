"""Decoding with a drafter: the session (prefill, round, commit; `engine`, `batch`), the budget and the per-call
guard, and the `generate` integration (`generation`, `generation_batch`, `integration`).

Imports: `core`, `sources`, `drafter`; never `bench`, `cli`, `training` (tests/test_structure.py says so).
"""
