"""Measuring a round's cost on this machine (`latency`): the measurement, the latency cache file, its lock and
its trust rules.

Imports: `core`, `sources`, `drafter`, `decoding` (it times the decoding session).
"""
