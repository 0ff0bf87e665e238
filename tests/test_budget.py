"""`tree_budget="auto"`: the throughput model, the latency cache, and exact decoding with it."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import make_drafter, make_target

from hf_treespark import TreeSparkConfig, TreeSparkDrafter
from hf_treespark.calibration import latency
from hf_treespark.calibration import measure as measuring
from hf_treespark.core.tree import TreePolicy
from hf_treespark.decoding import budget, call_guard


@pytest.fixture
def latency_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(latency, "_warned", set())  # each test sees its own first warnings
    return tmp_path / latency.LATENCY_FILE


def steady_table(budgets, load=0.0) -> dict:
    """A plausible measurement: verify grows with N, the drafter's pass is flat."""
    return {"verify": {n: 0.040 * (1 + n / 16) for n in (0, *budgets)}, "draft": {n: 0.010 for n in budgets},
            "others_load": load}


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
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: calls.append(1) or steady_table((2, 8)))
    first = latency.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    # verify[0] is a plain step (one token), the drafter gate's unit
    assert set(first["verify"]) == {0, 2, 8} and all(s > 0 for s in first["verify"].values())
    second = latency.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    assert len(calls) == 1 and second == first
    latency_cache.write_text("{ not json")  # a damaged cache is measured again, not trusted
    monkeypatch.setattr(latency, "_in_memory", {})  # as in a new process, which reads the file
    with pytest.warns(latency.LatencyCacheWarning, match="not JSON"):
        latency.round_latency(target, drafter, policy, budgets=(2, 8), context=16)
    assert len(calls) == 2 and json.loads(latency_cache.read_text())


def test_auto_budget_uses_the_profile_and_the_measured_latency(latency_cache, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, acceptance_profile={"2": 1.2, "64": 6.0})
    verify = {n: 0.01 * (1 + n / 64) for n in budget.CANDIDATE_BUDGETS}
    monkeypatch.setattr(budget, "measured_latency",
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
    assert not latency_cache.exists()  # generate never measures; measuring.calibrate_latency does


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
    # nothing measured yet: the default round cost of this kind of CPU, or the device kind's fallback
    default = budget.DEFAULT_CPU_ROUND_COST["float32"]
    assert math.isclose(budget.gate_threshold(target, drafter, TreePolicy(budget=8)), default[8] - 1)
    assert budget.gate_threshold(target, drafter, TreePolicy(budget=6)) == budget.FALLBACK_GATE["cpu"]
    verify = {0: 0.100, 2: 0.117, 4: 0.122, 8: 0.141}
    draft = {2: 0.020, 4: 0.021, 8: 0.022}
    monkeypatch.setattr(budget, "measured_latency", lambda *a, **k: {"verify": verify, "draft": draft})
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
    verifies no lookup branch (lookup-only rounds and the gate would price rounds of another cost), and no probe of
    the per-call guard, which would also hand slow budgets to plain decoding."""
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
    profile = measuring.calibrate_acceptance(target, drafter, [inputs], budgets=(4,), max_new_tokens=24, progress=False)
    (out,) = seen
    assert sum(r.lookup_accepted for r in out.rounds) == 0
    # nor the per-call guard: no probe among the rounds (with it, one comes after its first window of rounds)
    assert len(out.rounds) > 1 + call_guard.GUARD_WINDOW and {r.kind for r in out.rounds} == {"drafter"}
    assert profile["4"] == pytest.approx(sum(len(r.committed) for r in out.rounds) / len(out.rounds))


def test_a_real_measurement_times_every_budget_and_says_how_busy_the_machine_was(latency_cache):
    target = make_target("llama")
    drafter = make_drafter(target)
    measured = latency.measure_round_latency(target, drafter, TreePolicy(budget=8), budgets=(2, 8), context=16,
                                            repeats=2)
    assert set(measured["verify"]) == {0, 2, 8} and set(measured["draft"]) == {2, 8}
    assert all(0 < s < 60 for part in ("verify", "draft") for s in measured[part].values())
    assert measured["others_load"] is None or measured["others_load"] >= 0.0


@pytest.mark.parametrize(("table", "problem"), [
    ({"verify": {0: 0.04, 2: 0.0, 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, r"verify\[2\] = 0.0 is not a time"),
    ({"verify": {0: 0.04, 2: "fast", 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, "'fast' is not a time"),
    ({"verify": {0: 0.04, 2: True, 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, "True is not a time"),
    ({"verify": {0: 0.04, 2: math.inf, 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, "inf is not a time"),
    ({"verify": {0: 0.04, 2: 0.045}, "draft": {2: 0.01, 8: 0.01}}, r"verify lacks the budgets \[8\]"),
    ({"verify": {0: 0.04, 2: 0.045, 8: 0.05}}, "'draft' is missing"),
    ({"verify": {0: 0.04, "two": 0.045, 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, "'two', not a number"),
    ([1, 2], "a list, not a table"),
    # the busy machine of the report: 339 ms to draft at budget 2, 9 ms at 8
    ({"verify": {0: 0.04, 2: 0.045, 8: 0.05}, "draft": {2: 0.339, 8: 0.009}}, "draft time falls"),
    ({"verify": {0: 0.04, 2: 0.090, 8: 0.05}, "draft": {2: 0.01, 8: 0.01}}, "verify time falls"),
    ({"verify": {0: 0.04, 2: 0.045, 8: 0.05}, "draft": {2: 0.01, 8: 0.09}}, "more than 4x apart"),
])
def test_unusable_and_implausible_tables_are_named(table, problem):
    assert re.search(problem, latency.latency_problem(table, (2, 8)))


def test_a_steady_table_passes_and_noise_within_tolerance_is_allowed():
    assert latency.latency_problem(steady_table((2, 8)), (2, 8)) is None
    noisy = steady_table((2, 4, 8))
    noisy["verify"][4] = noisy["verify"][2] * 0.9  # 10% below a smaller budget: measurement noise
    assert latency.latency_problem(noisy, (2, 4, 8)) is None


def _cache_entry(target, drafter, table) -> dict:
    key = latency.latency_key(target, drafter, TreePolicy.from_config(drafter.config), 256)
    return {key: {part: {str(n): s for n, s in table[part].items()} for part in ("verify", "draft")}}


DAMAGED = {
    "not utf-8": (lambda t, d: b"\xff\xfe\x00 not text", "not UTF-8"),
    "not json": (lambda t, d: b"{ not json", "not JSON"),
    "a list": (lambda t, d: b"[1, 2, 3]", "holds a list"),
    "zeros": (lambda t, d: json.dumps(_cache_entry(t, d, {"verify": {n: 0 for n in (0, 2, 4, 8)},
                                                           "draft": {n: 0 for n in (2, 4, 8)}})).encode(),
              "is not a time"),
    "strings": (lambda t, d: json.dumps(_cache_entry(t, d, {"verify": {n: "1" for n in (0, 2, 4, 8)},
                                                             "draft": {n: "1" for n in (2, 4, 8)}})).encode(),
                "is not a time"),
    "missing keys": (lambda t, d: json.dumps({k: {"verify": {"0": 0.01}}
                                               for k in _cache_entry(t, d, steady_table((2,)))}).encode(),
                     "verify lacks the budgets"),
    "not monotone": (lambda t, d: json.dumps(_cache_entry(t, d, {  # a burst of load in the middle of measuring
        "verify": {n: 0.3 if n == 2 else 0.04 * (1 + n / 16) for n in (0, *budget.CANDIDATE_BUDGETS)},
        "draft": {n: 0.339 if n == 2 else 0.009 for n in budget.CANDIDATE_BUDGETS}})).encode(),
                     "falls from"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_cache_gives_one_warning_naming_the_file_and_decoding_goes_on(latency_cache, case):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto", tree_topk=2, tree_frontier=2, tree_depth=4)
    make, problem = DAMAGED[case]
    latency_cache.write_bytes(make(target, drafter))
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    with pytest.warns(latency.LatencyCacheWarning) as caught:
        for _ in range(2):  # said once, not on every call
            out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                                  return_dict_in_generate=True, tree_lookup=3)
            assert torch.equal(out.sequences, ref)
            assert out.tree_budget == budget.FALLBACK_BUDGET["cpu"]
    messages = [str(w.message) for w in caught if issubclass(w.category, latency.LatencyCacheWarning)]
    assert len(messages) == 1 and str(latency_cache) in messages[0] and re.search(problem, messages[0])


def test_a_directory_as_the_cache_path_is_found_before_measuring(latency_cache, monkeypatch):
    latency_cache.mkdir()
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    events = []
    monkeypatch.setattr(latency, "measure_round_latency",
                        lambda *a, **k: events.append("measure") or steady_table(a[3]))
    monkeypatch.setattr(latency, "warnings", SimpleNamespace(warn=lambda message, *a, **k: events.append(message)))
    table = measuring.calibrate_latency(target, drafter)
    assert events[1:] == ["measure"]  # one warning, before measuring
    assert "is a directory" in events[0] and "HF_TREESPARK_CACHE" in events[0]
    assert table is not None and latency.has_latency(target, drafter)  # kept for this process
    assert latency_cache.is_dir()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs a location nobody can create (Linux /proc)")
def test_an_unwritable_cache_location_means_no_caching_and_a_correct_answer(monkeypatch):
    monkeypatch.setenv("HF_TREESPARK_CACHE", "/proc/hf_treespark_cannot_exist")
    monkeypatch.setattr(latency, "_warned", set())
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: steady_table(a[3]))
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    with pytest.warns(latency.LatencyCacheWarning, match="HF_TREESPARK_CACHE"):
        measuring.ensure_latency(target, drafter, quiet=True)
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=12)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=12))


def _store_many(path: str, prefix: str, start, count: int) -> None:
    start.wait()
    for i in range(count):
        latency._store(Path(path), f"{prefix}{i}", {"verify": {"0": 0.01}, "draft": {}})


def test_two_processes_writing_at_once_lose_nothing(latency_cache):
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    writers = [context.Process(target=_store_many, args=(str(latency_cache), prefix, start, 25))
               for prefix in ("fp32-", "bf16-")]
    for writer in writers:
        writer.start()
    start.set()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    table = json.loads(latency_cache.read_text())
    assert set(table) == {f"{p}{i}" for p in ("fp32-", "bf16-") for i in range(25)}


def test_a_writer_waits_for_the_lock_beside_the_cache_even_without_fcntl(latency_cache, monkeypatch):
    """The lock file beside the cache (`filelock`) holds on every platform: a second writer waits for it, then
    merges what the first one wrote."""
    from filelock import FileLock

    monkeypatch.setattr(latency, "fcntl", None, raising=False)  # as on Windows, which has no fcntl
    entry = {"verify": {"0": 0.01}, "draft": {}}
    with FileLock(f"{latency_cache}.lock"):
        writer = threading.Thread(target=latency._store, args=(latency_cache, "second", entry))
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and not latency_cache.exists()  # waiting for the lock, nothing written
        latency_cache.write_text(json.dumps({"first": entry}))  # what the lock's holder writes
    writer.join(30)
    assert not writer.is_alive()
    assert set(json.loads(latency_cache.read_text())) == {"first", "second"}


def test_a_held_latency_lock_is_waited_for_a_bounded_time_named_and_auto_goes_on(latency_cache, monkeypatch,
                                                                                  capsys):
    """Another process holding the lock beside the cache for good: a writer says, on stderr, which lock file it
    waits for and why, gives up after `LOCK_WAIT_S`, and returns why nothing was stored, naming the lock file; the
    first use keeps its measurement for the process and goes on with it."""
    from filelock import FileLock

    monkeypatch.setattr(latency, "LOCK_WAIT_S", 0.5, raising=False)
    monkeypatch.setattr(latency, "LOCK_NOTICE_S", 0.1, raising=False)
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: steady_table(a[3]))
    lock = Path(f"{latency_cache}.lock")
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    results = {}

    def store():
        results["store"] = latency._store(latency_cache, "k", {"verify": {"0": 0.01}, "draft": {}})

    def first_use():
        with pytest.warns(latency.LatencyCacheWarning) as caught:
            results["table"] = measuring.calibrate_latency(target, drafter)
        results["warnings"] = [str(w.message) for w in caught]

    with FileLock(str(lock)):  # held for the whole of both calls: the holder never lets go
        for job in (store, first_use):
            worker = threading.Thread(target=job, daemon=True)
            worker.start()
            worker.join(60)  # a generous sanity limit: the point is that it comes back at all
            returned = not worker.is_alive()
            if not returned:
                break
    worker.join(60)  # the lock is free now: a writer that was still waiting finishes
    assert returned, f"{job.__name__} was still waiting for {lock} after 60 s"
    assert results["store"] is not None and results["store"].startswith(f"{lock}: ")
    assert "another process" in results["store"]
    assert not latency_cache.exists()
    said = [line for line in capsys.readouterr().err.splitlines() if str(lock) in line]
    assert said and all("waiting" in line and "another process" in line for line in said), said
    assert results["table"] is not None and latency.has_latency(target, drafter)  # kept for this process
    assert len(results["warnings"]) == 1 and f"{lock}: " in results["warnings"][0]


def test_a_lock_file_that_cannot_be_created_is_named_not_the_cache(latency_cache, monkeypatch):
    """Where the lock file cannot be created (here a directory has its name: root ignores permission bits), the
    reason names the lock file, the file that failed, not the cache file beside it."""
    lock = Path(f"{latency_cache}.lock")
    lock.mkdir(parents=True)
    problem = latency._store(latency_cache, "k", {"verify": {"0": 0.01}, "draft": {}})
    assert problem is not None and problem.startswith(f"{lock}: "), problem
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: steady_table(a[3]))
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    with pytest.warns(latency.LatencyCacheWarning) as caught:
        assert measuring.calibrate_latency(target, drafter) is not None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and f"({lock}: " in messages[0], messages


@pytest.mark.parametrize(("load", "shape_ok"), [(1.2, True), (0.0, False)])
def test_a_measurement_that_fails_its_check_twice_is_not_stored(latency_cache, monkeypatch, load, shape_ok):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        table = steady_table(args[3], load)
        if not shape_ok:
            table["draft"][2] = 0.339
        return table

    monkeypatch.setattr(latency, "measure_round_latency", measure)
    with pytest.warns(latency.LatencyCacheWarning, match="not stored.*uses its default"):
        assert measuring.calibrate_latency(target, drafter) is None
    assert len(calls) == 2 and not latency.has_latency(target, drafter)
    (entry,) = json.loads(latency_cache.read_text()).values()
    assert set(entry) == {"untrusted", "at"}  # no table: a note of the untrusted attempt
    measuring.ensure_latency(target, drafter, quiet=True)
    assert len(calls) == 2  # one attempt per process: later calls do not measure again


def test_after_an_untrusted_measurement_new_processes_wait_before_measuring_again(latency_cache, monkeypatch,
                                                                                     capsys):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto", acceptance_profile={"2": 1.5, "4": 1.6})
    calls = []
    loads = [1.5, 1.5, 0.0]  # busy twice (not stored), then quiet
    monkeypatch.setattr(latency, "measure_round_latency",
                        lambda *a, **k: calls.append(1) or steady_table(a[3], loads.pop(0)))
    with pytest.warns(latency.LatencyCacheWarning, match="not stored"):
        measuring.ensure_latency(target, drafter, quiet=True)
    monkeypatch.setattr(latency, "_untrusted", set())  # a new process
    measuring.ensure_latency(target, drafter)
    assert len(calls) == 2 and "was not trusted" in capsys.readouterr().err  # said, not measured again
    assert budget.auto_budget(target, drafter, TreePolicy.from_config(drafter.config)) == \
        budget.fallback_budget(target, TreePolicy.from_config(drafter.config), drafter)
    later = time.time() + latency.UNTRUSTED_RETRY_S + 1
    monkeypatch.setattr(measuring.time, "time", lambda: later)
    measuring.ensure_latency(target, drafter, quiet=True)  # an hour later: measured again, and trusted this time
    assert len(calls) == 3 and latency.has_latency(target, drafter)


def test_a_measurement_that_passes_on_the_second_try_is_stored(latency_cache, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    loads = [1.5, 0.05]
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: steady_table(a[3], loads.pop(0)))
    assert measuring.calibrate_latency(target, drafter) is not None
    assert not loads and latency.has_latency(target, drafter) and latency_cache.is_file()


def test_calibration_beside_a_cpu_bound_process_stores_nothing(latency_cache):
    """A CPU-bound process on one core during the real measurement: the table is not kept."""
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        with pytest.warns(latency.LatencyCacheWarning, match="CPU cores busy"):
            assert measuring.calibrate_latency(target, drafter) is None
    finally:
        busy.kill()
        busy.wait()
    assert not latency.has_latency(target, drafter)  # no table stored (a note of the attempt at most)
    assert budget.auto_budget(target, drafter, TreePolicy.from_config(drafter.config)) == \
        budget.FALLBACK_BUDGET["cpu"]


@pytest.mark.parametrize("variant", ["fp16", "fixed budget", "restricted vocabulary"])
def test_the_gate_stays_open_for_a_paying_drafter_without_a_cached_latency(latency_cache, variant):
    dtype = torch.float16 if variant == "fp16" else torch.float32
    target = make_target("llama", dtype=dtype)
    paying = {"2": 1.6, "4": 1.9, "8": 2.0}  # 0.6-1.0 drafted tokens per round: more than the fallback's 0.35
    drafter = make_drafter(target, tree_budget=4 if variant == "fixed budget" else "auto", tree_lookup=4,
                           acceptance_profile=paying)
    if variant == "restricted vocabulary":
        drafter.restrict_vocabulary(list(range(4, 100)))
    policy = TreePolicy.from_config(drafter.config, vocab_size=drafter.draft_vocab_size)
    assert not latency.has_latency(target, drafter, policy)
    assert budget.gate_threshold(target, drafter, policy) == 0.0
    weak = make_drafter(target, tree_budget="auto", tree_lookup=4, acceptance_profile={"2": 1.1, "4": 1.2})
    n = budget.fallback_budget(target, policy, weak) if policy.auto else policy.budget
    costs = budget.default_round_cost(target, [n])
    expected = costs[n] - 1 if costs else budget.FALLBACK_GATE["cpu"]
    assert math.isclose(budget.gate_threshold(target, weak, policy), expected) and expected > 0.2
    # decoding with the open gate drafts in every round that is not lookup-only (this random drafter never gets a
    # token accepted, so a running gate would have closed after its first round)
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(5))
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                          return_dict_in_generate=True, tree_budget=4)
    assert all(r.tree_size >= 4 for r in out.rounds if r.lookup_accepted == 0 and r.num_accepted == 0)


# `treespark calibrate`: bad input and unwritable directories are refused before anything is measured


@pytest.fixture
def no_loading(monkeypatch):
    from hf_treespark.cli import commands as cli

    monkeypatch.setattr(cli, "_load_pair", lambda args: pytest.fail("models were loaded before the check"))
    return cli


@pytest.fixture
def drafter_dir(tmp_path):
    target = make_target("llama")
    make_drafter(target, tree_budget="auto", acceptance_profile={"2": 1.5}).save_pretrained(tmp_path / "drafter")
    return tmp_path / "drafter"


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-prompts", "0"], "--num-prompts: must be a whole number >= 1, got '0'"),
    (["--num-prompts", "-1"], "--num-prompts: must be a whole number >= 1, got '-1'"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_calibrate_refuses_counts_below_one(no_loading, drafter_dir, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        no_loading.main(["calibrate", "--drafter", str(drafter_dir), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_calibrate_refuses_a_budget_no_tree_can_use(no_loading, drafter_dir, capsys):
    assert no_loading.main(["calibrate", "--drafter", str(drafter_dir), "--budgets", "2,100000"]) == 2
    err = capsys.readouterr().err
    assert "budget 100000 is never used" in err and "at most" in err


def test_calibrate_refuses_a_directory_it_cannot_write_before_measuring(no_loading, drafter_dir, monkeypatch, capsys):
    from hf_treespark import storage

    before = (drafter_dir / "config.json").read_text()
    monkeypatch.setattr(storage, "unwritable_reason",
                        lambda folder: "Read-only file system" if Path(folder) == drafter_dir else None)
    assert no_loading.main(["calibrate", "--drafter", str(drafter_dir)]) == 2
    err = capsys.readouterr().err
    assert "cannot write the acceptance profile" in err and str(drafter_dir) in err
    assert (drafter_dir / "config.json").read_text() == before


def test_calibrate_names_a_damaged_config(no_loading, drafter_dir, capsys):
    (drafter_dir / "config.json").write_bytes(b"\xff{ broken")
    assert no_loading.main(["calibrate", "--drafter", str(drafter_dir)]) == 2
    assert str(drafter_dir / "config.json") in capsys.readouterr().err


def test_calibrate_never_writes_a_profile_that_would_not_load(drafter_dir, monkeypatch, capsys, latency_cache):
    from hf_treespark.cli import commands as cli

    target = make_target("llama")
    monkeypatch.setattr(cli, "_load_pair", lambda args: (target, None, TreeSparkDrafter.from_pretrained(drafter_dir)))
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: steady_table(a[3]))
    monkeypatch.setattr(measuring, "calibrate_acceptance", lambda *a, **k: {"2": 0.0})  # as 0 prompts once gave
    monkeypatch.setattr(cli, "_calibration_prompts", lambda args, tokenizer: [{"input_ids": torch.ones(1, 3)}])
    before = (drafter_dir / "config.json").read_text()
    assert cli.main(["calibrate", "--drafter", str(drafter_dir), "--budgets", "2"]) == 2
    assert "acceptance_profile" in capsys.readouterr().err
    assert (drafter_dir / "config.json").read_text() == before
    TreeSparkDrafter.from_pretrained(drafter_dir)  # still loads


def test_calibrate_shows_the_latency_table_and_the_budget_it_implies(drafter_dir, monkeypatch, capsys, latency_cache):
    from hf_treespark.cli import commands as cli

    target = make_target("llama")
    monkeypatch.setattr(cli, "_load_pair", lambda args: (target, None, TreeSparkDrafter.from_pretrained(drafter_dir)))
    calls = []
    monkeypatch.setattr(latency, "measure_round_latency", lambda *a, **k: calls.append(1) or steady_table(a[3]))
    assert cli.main(["calibrate", "--drafter", str(drafter_dir), "--latency-only"]) == 0
    assert cli.main(["calibrate", "--drafter", str(drafter_dir), "--latency-only"]) == 0
    assert len(calls) == 1  # cached
    assert cli.main(["calibrate", "--drafter", str(drafter_dir), "--latency-only", "--force"]) == 0
    assert len(calls) == 2  # --force measures again
    out = capsys.readouterr().out
    assert "plain step" in out and "verify ms" in out and "<- auto" in out


def test_without_a_trusted_latency_auto_prices_a_calibrated_drafter_with_the_default_round_cost(latency_cache):
    target = make_target("llama")
    profile = {"2": 1.50, "4": 1.65, "8": 1.77, "16": 1.96, "32": 2.00, "64": 1.97}  # the shipped drafter's
    drafter = make_drafter(target, tree_budget="auto", acceptance_profile=profile)
    policy = TreePolicy.from_config(drafter.config)
    cost = budget.DEFAULT_CPU_ROUND_COST["float32"]
    budgets = [n for n in latency.candidate_budgets(policy) if n in cost]
    best = max(budgets, key=lambda n: budget.profile_acceptance(profile, [n])[n] / cost[n])
    assert budget.auto_budget(target, drafter, policy) == best == budget.fallback_budget(target, policy, drafter)
    # the same choice on a machine whose measurement could not be trusted, and without a profile the constant
    uncalibrated = make_drafter(target, tree_budget="auto")
    assert budget.auto_budget(target, uncalibrated, policy) == budget.FALLBACK_BUDGET["cpu"]
    assert budget.default_round_cost(make_target("llama", dtype=torch.float16), budgets) is None


def test_the_batch_bench_measures_each_batch_size_it_prices_once(latency_cache, monkeypatch, capsys):
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto", acceptance_profile={"2": 1.5, "4": 1.6})
    measured = []
    monkeypatch.setattr(latency, "measure_round_latency",
                        lambda *a, **k: measured.append(k["batch"]) or steady_table(a[3]))
    measuring.ensure_batch_latency(target, drafter, [1, 2, 3, 4])
    assert measured == [2, 4]  # 3 rows are priced by the 4-row measurement; one row is ensure_latency's
    assert "a round of 4 rows" in capsys.readouterr().err
    policy = TreePolicy.from_config(drafter.config)
    size_budgets = budget.batch_budgets(policy, 4)
    expected = steady_table(size_budgets)
    assert budget.BatchBudget(target, drafter, policy).round_cost(3) == {
        part: {n: expected[part][n] / expected["verify"][0] for n in size_budgets} for part in ("verify", "draft")}
    measuring.ensure_batch_latency(target, drafter, [2, 4, 8], quiet=True)
    assert measured == [2, 4, 8]  # cached sizes are not measured again
