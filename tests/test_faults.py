"""Bad input at `generate(assistant_model=drafter)`: a clear error naming the knob, or plain greedy's output.

Regression tests for the cases users met (tree knobs of the wrong type or range, empty or
out-of-vocabulary prompts, a list prompt), then a hypothesis walk over every tree knob.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, make_drafter, make_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_treespark

NEW = 8


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, make_drafter(target)


@pytest.fixture(scope="module")
def ids_and_plain(pair):
    target, _ = pair
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    return ids, target.generate(ids, do_sample=False, max_new_tokens=NEW)


def tree_generate(pair, ids, **knobs):
    target, drafter = pair
    return target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=NEW,
                           return_dict_in_generate=True, **knobs)


def test_topk_beyond_the_vocabulary_names_the_knob(pair, ids_and_plain):
    ids, _ = ids_and_plain
    with pytest.raises(ValueError, match=rf"tree_topk={VOCAB + 1} exceeds the drafter's vocabulary of {VOCAB}"):
        tree_generate(pair, ids, tree_topk=VOCAB + 1)


def test_chain_mode_honours_a_budget_and_refuses_a_non_bool(pair, ids_and_plain):
    ids, plain = ids_and_plain
    out = tree_generate(pair, ids, tree_chain=True, tree_budget=3)
    assert torch.equal(out.sequences, plain)
    assert out.tree_budget == 3 and all(r.tree_size == 3 for r in out.rounds)
    with pytest.raises(ValueError, match="tree_chain='no' is invalid: it must be True or False"):
        tree_generate(pair, ids, tree_chain="no")


def test_a_budget_above_the_candidates_reports_what_was_packed(pair, ids_and_plain):
    ids, plain = ids_and_plain
    out = tree_generate(pair, ids, tree_budget=10**6)
    assert torch.equal(out.sequences, plain)
    sizes = {r.tree_size for r in out.rounds}
    assert sizes == {out.tree_budget} and out.tree_budget == 100  # 4 + 6 * 16 candidates with the defaults


@pytest.mark.parametrize("budget", [np.int64(4), torch.tensor(4), np.int32(4)])
def test_integer_like_budgets_are_accepted(pair, ids_and_plain, budget):
    ids, plain = ids_and_plain
    out = tree_generate(pair, ids, tree_budget=budget)
    assert torch.equal(out.sequences, plain) and out.tree_budget == 4


def test_empty_and_out_of_vocabulary_prompts_are_refused_clearly(pair):
    with pytest.raises(ValueError, match=r"input_ids is empty"):
        tree_generate(pair, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 5}, outside the target's vocabulary \[0, {VOCAB}\)"):
        tree_generate(pair, torch.tensor([[5, 6, VOCAB + 5]]))


def test_the_plain_function_takes_a_list_of_token_ids(pair, ids_and_plain):
    target, drafter = pair
    ids, plain = ids_and_plain
    out = hf_treespark.generate(target, drafter, ids[0].tolist(), do_sample=False, max_new_tokens=NEW)
    assert torch.equal(out, plain)


KNOBS = ("tree_budget", "tree_topk", "tree_frontier", "tree_depth", "tree_chain")
VALUES = st.one_of(
    st.integers(-3, 10**6), st.sampled_from([0, 1, 2, 7, 8, 99, VOCAB, VOCAB + 1]), st.none(), st.booleans(),
    st.just("auto"), st.text(max_size=4), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(1, 40).map(np.int64), st.integers(-1, 40).map(torch.tensor),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(knob=st.sampled_from(KNOBS), value=VALUES)
def test_any_tree_knob_value_gives_plain_greedy_or_an_error_naming_it(pair, ids_and_plain, knob, value):
    ids, plain = ids_and_plain
    try:
        out = tree_generate(pair, ids, **{knob: value})
    except ValueError as err:
        assert knob in str(err), f"{knob}={value!r}: the error does not name the knob: {err}"
    else:
        assert torch.equal(out.sequences, plain), f"{knob}={value!r} changed the output"
