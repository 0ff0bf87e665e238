"""`tree_budget="auto"`: the throughput model, the latency cache, and exact decoding with it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark import TreeSparkConfig, TreeSparkDrafter, budget
from hf_treespark.tree import TreePolicy


@pytest.fixture
def latency_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))
    return tmp_path / budget.LATENCY_FILE


def test_profile_interpolation_hits_measured_points_and_never_extrapolates():
    profile = {"4": 1.5, "16": 2.1, "64": 2.4}
    got = budget.profile_acceptance(profile, (2, 4, 8, 16, 32, 64, 128))
    assert got[4] == 1.5 and got[16] == 2.1 and got[64] == 2.4
    assert got[128] == 2.4  # flat beyond the largest measured budget
    assert 1.0 < got[2] < 1.5 and 1.5 < got[8] < 2.1 and 2.1 < got[32] < 2.4
    w = (math.log1p(8) - math.log1p(4)) / (math.log1p(16) - math.log1p(4))
    assert got[8] == pytest.approx(1.5 + w * 0.6)


def test_score_acceptance_is_one_plus_the_top_n_path_mass():
    scores = torch.log(torch.tensor([0.1, 0.8, 0.4, 0.05, 0.3]))
    got = budget.score_acceptance(scores, (1, 2, 3, 8))
    assert got[1] == pytest.approx(1.8)
    assert got[2] == pytest.approx(2.2)
    assert got[3] == pytest.approx(2.5)
    assert got[8] == pytest.approx(1 + 1.65)  # more budget than candidates: all of them


def test_choice_follows_the_hardware():
    acceptance = budget.profile_acceptance({"2": 1.6, "8": 2.0, "32": 2.3, "64": 2.4}, budget.CANDIDATE_BUDGETS)
    flat = {"verify": {n: 0.010 for n in budget.CANDIDATE_BUDGETS},  # accelerator: latency flat in N
            "draft": {n: 0.002 for n in budget.CANDIDATE_BUDGETS}}
    steep = {"verify": {n: 0.030 + 0.004 * n for n in budget.CANDIDATE_BUDGETS},  # small CPU
             "draft": {n: 0.010 for n in budget.CANDIDATE_BUDGETS}}
    big, _ = budget.choose_budget(acceptance, flat)
    small, rates = budget.choose_budget(acceptance, steep)
    assert big == 64
    assert small < 16
    assert rates[small] == max(rates.values())


def test_latency_is_measured_once_and_cached(latency_cache, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target)
    policy = TreePolicy(budget=8)
    calls = []
    real = budget.measure_round_latency
    monkeypatch.setattr(budget, "measure_round_latency", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = budget.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    # verify[0] is a plain step (one token), the drafter gate's unit
    assert set(first["verify"]) == {0, 2, 8} and all(s > 0 for s in first["verify"].values())
    second = budget.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    assert len(calls) == 1 and second == first
    latency_cache.write_text("{ not json")  # a damaged cache is measured again, not trusted
    budget.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    assert len(calls) == 2 and json.loads(latency_cache.read_text())


def test_auto_budget_uses_the_profile_and_the_measured_latency(latency_cache, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, acceptance_profile={"2": 1.2, "64": 6.0})
    verify = {n: 0.01 * (1 + n / 64) for n in budget.CANDIDATE_BUDGETS}
    monkeypatch.setattr(budget, "round_latency",
                        lambda *a, **k: {"verify": verify, "draft": {n: 0.0 for n in verify}})
    policy = TreePolicy(topk=4, frontier=4, budget=64, depth=7)
    chosen = budget.auto_budget(target, drafter, policy)
    acceptance = budget.profile_acceptance(drafter.config.acceptance_profile, budget.CANDIDATE_BUDGETS)
    assert chosen == max(budget.CANDIDATE_BUDGETS, key=lambda n: acceptance[n] / verify[n])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_auto_budget_decoding_is_exact(latency_cache, attn):
    target = make_target("qwen3", attn)
    for profile in (None, {"4": 1.3, "16": 1.6}):
        drafter = make_drafter(target, tree_budget="auto", acceptance_profile=profile)
        ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(3))
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=20,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.tree_budget in budget.CANDIDATE_BUDGETS
        assert all(r.tree_size <= out.tree_budget for r in out.rounds)
    assert not latency_cache.exists()  # generate never measures; budget.calibrate_latency does


def test_config_accepts_auto_and_a_profile_and_refuses_nonsense(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto", acceptance_profile={8: 1.7})
    drafter.save_pretrained(tmp_path)
    again = TreeSparkDrafter.from_pretrained(tmp_path)
    assert again.config.tree_budget == "auto" and again.config.acceptance_profile == {"8": 1.7}
    with pytest.raises(ValueError, match="tree_budget"):
        TreeSparkConfig(tree_budget="big")
    with pytest.raises(ValueError, match="acceptance_profile"):
        TreeSparkConfig(acceptance_profile={"8": 0.5})


def test_the_gate_threshold_is_a_drafter_rounds_extra_cost_in_plain_steps(latency_cache, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target)
    # nothing measured yet: the device kind's fallback
    assert budget.gate_threshold(target, drafter, TreePolicy(budget=8)) == budget.FALLBACK_GATE["cpu"]
    verify = {0: 0.100, 2: 0.117, 4: 0.122, 8: 0.141}
    draft = {2: 0.020, 4: 0.021, 8: 0.022}
    monkeypatch.setattr(budget, "round_latency", lambda *a, **k: {"verify": verify, "draft": draft})
    assert math.isclose(budget.gate_threshold(target, drafter, TreePolicy(budget=2)), 0.37)
    assert math.isclose(budget.gate_threshold(target, drafter, TreePolicy(budget=8)), 0.63)
    assert math.isclose(budget.gate_threshold(target, drafter, TreePolicy(budget=6)), 0.43)  # nearest: 4
    # "auto" not yet decided: the smallest measured budget
    assert math.isclose(budget.gate_threshold(target, drafter, TreePolicy(budget=32, auto=True)), 0.37)
    # a drafter round cheaper than a plain step (a measurement artefact) never gives a negative threshold
    verify[2] = 0.05
    assert budget.gate_threshold(target, drafter, TreePolicy(budget=2)) == 0.0
    verify[2] = 0.117
    # a calibrated drafter whose rounds pay for themselves keeps the gate open; one whose rounds do not, does not
    paying = make_drafter(target, acceptance_profile={"2": 1.40, "8": 1.70})  # gains 0.40 >= 0.37, 0.70 >= 0.63
    assert budget.gate_threshold(target, paying, TreePolicy(budget=2)) == 0.0
    assert budget.gate_threshold(target, paying, TreePolicy(budget=8)) == 0.0
    assert budget.gate_threshold(target, paying, TreePolicy(budget=32, auto=True)) == 0.0
    weak = make_drafter(target, acceptance_profile={"2": 1.30, "8": 1.50})  # gains 0.30 < 0.37, 0.50 < 0.63
    assert math.isclose(budget.gate_threshold(target, weak, TreePolicy(budget=2)), 0.37)
    assert math.isclose(budget.gate_threshold(target, weak, TreePolicy(budget=8)), 0.63)


def test_calibrated_acceptance_prices_drafter_rounds_without_lookup(monkeypatch):
    """The profile is the drafter's own acceptance per budget: with the drafter's lookup on, calibration still
    verifies no lookup branch (lookup-only rounds and the gate would price rounds of another cost)."""
    target = make_target("llama")
    drafter = make_drafter(target, tree_lookup=7)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])  # lookup finds matches here
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with_lookup = target.generate(**inputs, assistant_model=drafter, max_new_tokens=24, do_sample=False,
                                  tree_budget=4, return_dict_in_generate=True)
    assert sum(r.lookup_accepted for r in with_lookup.rounds) > 0  # the drafter's default would use lookup

    seen = []
    original = type(target).generate

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(type(target), "generate", spy)
    profile = budget.calibrate_acceptance(target, drafter, [inputs], budgets=(4,), max_new_tokens=24, progress=False)
    (out,) = seen
    assert sum(r.lookup_accepted for r in out.rounds) == 0
    assert profile["4"] == pytest.approx(sum(len(r.committed) for r in out.rounds) / len(out.rounds))
