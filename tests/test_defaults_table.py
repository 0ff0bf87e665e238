"""The round controller's defaults are data with a provenance: each tunable number of the controller's modules is a
row of docs/design-notes.md's table "Defaults and where they came from" (value, what for, where it came from), and
the value the table gives is the one the code holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_treespark.decoding import budget, call_guard
from hf_treespark.sources import lookup

NOTES = Path(__file__).resolve().parents[1] / "docs" / "design-notes.md"
DEFAULTS = {
    budget: ("FALLBACK_BUDGET", "FALLBACK_GATE", "CANDIDATE_BUDGETS", "BATCH_SIZES", "BATCH_VERIFY_TOKENS",
             "BATCH_TREE_MARGIN", "BATCH_PRIOR_ROWS", "DEFAULT_CPU_ROUND_COST", "DEFAULT_CPU_BATCH_ROUND_COST"),
    call_guard: ("GUARD_SKIP", "GUARD_WINDOW", "GUARD_PROBES", "GUARD_MARGIN", "GUARD_CHECKS", "GUARD_RECHECK",
                 "GUARD_VERIFY_BOUND"),
    lookup: ("LOOKUP_TOKEN_PROB", "LOOKUP_ROUND_NGRAM", "LOOKUP_ROUND_BRANCHES", "LOOKUP_LONG_TOKENS",
             "LOOKUP_WEAK_TOKENS", "DRAFTER_GATE_ROUNDS", "DRAFTER_GATE_SMOOTHING"),
}
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def table_rows() -> dict[str, list[str]]:
    """`{name: [value, what for, where it came from]}` of the defaults table (a name like `X["float32"]` under X)."""
    text = NOTES.read_text()
    section = text[text.index("## Defaults and where they came from"):]
    section = section[:section.index("\n## ", 4)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            name = cells[0].strip("`").split("[")[0]
            rows.setdefault(name, []).append(cells[1:])
    return rows


def leaves(value) -> set[float]:
    """Every number a constant holds (keys and values of dicts, items of tuples)."""
    if isinstance(value, dict):
        return set().union(*(leaves(k) | leaves(v) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return set().union(*(leaves(v) for v in value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return set()
    return {float(value)}


@pytest.mark.parametrize("module, name", [(m, n) for m, names in DEFAULTS.items() for n in names])
def test_every_default_is_a_row_with_the_value_the_code_holds(module, name):
    rows = table_rows()
    assert name in rows, f"{module.__name__}.{name} has no row in docs/design-notes.md's defaults table"
    value = getattr(module, name)
    for shown, what_for, source in rows[name]:
        assert what_for and source, f"{name}: say what it is for and where it came from"
        numbers = {float(n) for n in NUMBER.findall(shown)}
        assert numbers, f"{name}: the table gives no value"
        assert numbers <= leaves(value), f"{name}: the table shows {sorted(numbers - leaves(value))}, not in the code"
        if isinstance(value, (int, float)):
            assert numbers == {float(value)}, f"{name} is {value} in the code, {shown} in the table"


def test_the_check_catches_a_stale_value(monkeypatch):
    monkeypatch.setattr(call_guard, "GUARD_WINDOW", 9)
    with pytest.raises(AssertionError, match=r"GUARD_WINDOW: the table shows \[8.0\]"):
        test_every_default_is_a_row_with_the_value_the_code_holds(call_guard, "GUARD_WINDOW")
    monkeypatch.setattr(lookup, "LOOKUP_TOKEN_PROB", {1: 0.3, 2: 0.5, 3: 0.7})
    with pytest.raises(AssertionError, match=r"shows \[0.6\]"):
        test_every_default_is_a_row_with_the_value_the_code_holds(lookup, "LOOKUP_TOKEN_PROB")
