"""The per-call guard (`call_guard.py`): a batch-1 call whose rounds are slower than plain steps goes on in
transformers' loop, and its output is still plain decoding's, token for token."""

import pytest
import torch
from conftest import make_drafter, make_target
from test_generation import RecordingStreamer, prompt

from hf_treespark.decoding.call_guard import GUARD_PROBES, GUARD_SKIP, GUARD_WINDOW, CallGuard, resolve_guard


def test_the_guard_hands_off_only_after_two_slower_judgements_in_a_row():
    guard = CallGuard(window=3, probes=2, margin=0.05, checks=2, skip=1)
    guard.observe(5.0, 1, probe=False)  # the first round is never judged (however slow)
    for _ in range(3):
        assert not guard.probing and not guard.should_hand_off
        guard.observe(0.30, 2, probe=False)  # 0.15 s per token
    assert guard.probing
    guard.observe(0.10, 1, probe=True)
    assert guard.probing and not guard.should_hand_off  # one probe of two
    guard.observe(0.12, 1, probe=True)  # plain pace 0.11 s per token
    assert guard.judgements == [pytest.approx((0.15, 0.11))]
    assert not guard.should_hand_off and not guard.probing  # slower once: judged again on a fresh stretch
    for _ in range(3):
        guard.observe(0.30, 2, probe=False)
    assert guard.probing
    guard.observe(0.11, 1, probe=True)
    guard.observe(0.11, 1, probe=True)
    assert guard.should_hand_off and not guard.probing  # slower twice in a row
    assert len(guard.rounds) == 7 and len(guard.probe_rounds) == 4


def test_a_slow_moment_does_not_end_a_fast_call():
    """A stretch slowed by the machine, judged against probes of a quiet moment, counts once; the next stretch, judged
    against its own probes, clears it, and the one after is further away."""
    guard = CallGuard(window=2, probes=1, margin=0.05, checks=2, skip=0, recheck=4)
    guard.observe(0.40, 2, probe=False)  # a noisy moment: 0.2 s per token
    guard.observe(0.40, 2, probe=False)
    guard.observe(0.10, 1, probe=True)  # quiet again: 0.1 s per token
    assert not guard.should_hand_off
    guard.observe(0.10, 2, probe=False)
    guard.observe(0.10, 2, probe=False)
    guard.observe(0.10, 1, probe=True)  # 0.05 against 0.10: faster
    assert not guard.should_hand_off
    for _ in range(7):  # the next check comes 2 x 4 rounds later
        guard.observe(0.40, 1, probe=False)
        assert not guard.probing
    guard.observe(0.40, 1, probe=False)
    assert guard.probing
    guard.observe(0.10, 1, probe=True)  # slower, once: no hand-off yet
    assert not guard.should_hand_off and [slower > plain for slower, plain in guard.judgements] == [True, False, True]

    within_noise = CallGuard(window=1, probes=1, margin=0.05, checks=1, skip=0)
    within_noise.observe(0.104, 1, probe=False)
    within_noise.observe(0.100, 1, probe=True)
    assert not within_noise.should_hand_off  # 4% slower: within the margin


def test_tree_guard_values():
    assert isinstance(resolve_guard(True, guardable=True), CallGuard)
    assert resolve_guard(True, guardable=False) is None  # scores, logits or padding: no hand-off
    assert resolve_guard(False, guardable=True) is None
    mine = CallGuard()
    assert resolve_guard(mine, guardable=True) is mine
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="tree_guard"):
            resolve_guard(bad, guardable=True)


def always_slower() -> CallGuard:
    """A guard that hands off right after its first probe: any TreeSpark pace counts as slower (and no stretch is
    faster beyond doubt, however its verify forwards compare)."""
    return CallGuard(window=2, probes=1, margin=-1.0, checks=1, skip=0, verify_bound=float("inf"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_handed_off_call_returns_what_plain_generate_returns(arch, attn):
    target = make_target(arch, attn)
    drafter = make_drafter(target)
    ids = prompt(3, 7)
    ref = target.generate(ids, do_sample=False, max_new_tokens=40)
    streamer = RecordingStreamer()
    guard = always_slower()
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, tree_guard=guard,
                          streamer=streamer, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert len(guard.rounds) == 2 and len(guard.probe_rounds) == 1  # two rounds, one probe, then transformers
    probe = out.rounds[2]
    assert probe.tree_size == 0 and len(probe.committed) == 1 and probe.kind == "probe"
    handed = out.rounds[3:]
    assert handed and all(r.tree_size == 0 and len(r.committed) == 1 for r in handed)
    assert [r.kind for r in out.rounds] == ["drafter"] * 2 + ["probe"] + ["plain"] * len(handed)
    assert all(r.seconds > 0 for r in out.rounds[:3]) and all(r.seconds is None for r in handed)
    assert sum(len(r.committed) for r in out.rounds) == ref.shape[1] - ids.shape[1] - 1  # + the prefill's token
    assert streamer.ended  # once, by transformers' loop
    assert sum(len(p) for p in streamer.puts[1:]) == ref.shape[1] - ids.shape[1]  # every new token streamed once
    assert out.cache.get_seq_length() == ref.shape[1] - 1  # every token but the last, as plain decoding leaves it


def test_a_handed_off_call_stops_where_plain_generate_stops():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(5, 6)
    ref = target.generate(ids, do_sample=False, max_new_tokens=30)
    stop_at = int(ref[0, ids.shape[1] + 12])  # a token plain decoding emits after the hand-off: an end token
    ref_eos = target.generate(ids, do_sample=False, max_new_tokens=30, eos_token_id=stop_at)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=30, eos_token_id=stop_at,
                          tree_guard=always_slower())
    assert torch.equal(out, ref_eos)


def test_a_guard_that_never_finds_rounds_slower_keeps_drafting():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(4, 7)
    ref = target.generate(ids, do_sample=False, max_new_tokens=40)
    guard = CallGuard(window=2, probes=1, margin=float("inf"), skip=0, recheck=100)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, tree_guard=guard,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert len(guard.probe_rounds) == 1 and len(guard.rounds) == len(out.rounds) - 1
    assert sum(r.tree_size == 0 for r in out.rounds) == 1  # the probe alone verified the root only


def test_no_guard_where_scores_are_returned():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(6, 7)
    guard = always_slower()
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=30, tree_guard=guard,
                          return_dict_in_generate=True, output_scores=True)
    assert not guard.rounds and all(r.tree_size > 0 for r in out.rounds)
    assert len(out.scores) == out.sequences.shape[1] - ids.shape[1]


def test_the_guard_is_on_by_default_and_off_when_asked():
    target = make_target("llama")
    drafter = make_drafter(target)
    ids = prompt(7, 7)
    off = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, tree_guard=False,
                          return_dict_in_generate=True)
    assert len(off.rounds) > GUARD_SKIP + GUARD_WINDOW + GUARD_PROBES and all(r.tree_size > 0 for r in off.rounds)
    on = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=40,
                         return_dict_in_generate=True)
    assert torch.equal(on.sequences, off.sequences)
    first_probe = GUARD_SKIP + GUARD_WINDOW
    assert all(r.tree_size > 0 for r in on.rounds[:first_probe])
    assert all(r.tree_size == 0 for r in on.rounds[first_probe:first_probe + GUARD_PROBES])  # the first probes


class FakeClock:
    """A clock that stands still until `advance(seconds)` moves it: what the decoding loop and the session read
    instead of `time.perf_counter` (both read it at call time), so that a round's seconds are exactly the time the
    test made its parts take, however loaded the machine is."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_probe_is_timed_by_its_target_forward_alone(monkeypatch):
    """The plain pace a probe measures leaves out this loop's own work around the forward (the drafter pass, the
    walk, the commit), which a plain step in transformers' loop does not do; the judged rounds keep all of theirs.

    Each part of a round takes a known time on an injected clock (the drafter pass 1 s, the target forward 2 s, the
    commit 8 s; whole numbers, so every sum is exact): a probe counts 2 s, a judged round 11 s."""
    import time

    from hf_treespark.decoding.session import DecodingSession

    target = make_target("llama")
    drafter = make_drafter(target)
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    def taking(seconds: float, original):
        def timed(self, *args):
            clock.advance(seconds)
            return original(self, *args)

        return timed

    for method, seconds in (("draft", 1.0), ("verify", 2.0), ("commit", 8.0)):
        monkeypatch.setattr(DecodingSession, method, taking(seconds, getattr(DecodingSession, method)))
    guard = CallGuard(window=2, probes=2, margin=float("inf"), skip=0, recheck=100)
    out = target.generate(prompt(4, 7), assistant_model=drafter, do_sample=False, max_new_tokens=12, tree_guard=guard,
                          return_dict_in_generate=True)
    assert [r.kind for r in out.rounds[:4]] == ["drafter", "drafter", "probe", "probe"]
    assert [seconds for seconds, _ in guard.probe_rounds] == [2.0, 2.0]  # the forward, not the drafter or the commit
    assert guard.rounds and all(seconds == 11.0 for seconds, _ in guard.rounds)  # the whole round
    assert all(r.seconds == 11.0 for r in out.rounds)  # every round's record, the probes' included
    first_stretch = guard.rounds[:2]  # judged against the two probes after it: seconds per committed token
    assert guard.judgements == [(22.0 / sum(n for _, n in first_stretch), 2.0)]


def test_a_stretch_faster_beyond_doubt_skips_its_probes_and_any_other_is_probed():
    """A stretch whose pace beats its median verify forward over `verify_bound` (a one-token forward costs at least
    that) is judged faster without probes; a stretch short of it, or one whose verify forwards were not timed (CUDA),
    is probed."""
    guard = CallGuard(window=3, probes=2, margin=0.05, checks=2, skip=0, recheck=2, verify_bound=2.0)
    for _ in range(3):  # 0.05 s per token; verify forwards of 0.12 s: a plain step costs at least 0.06 s
        guard.observe(0.20, 4, probe=False, verify_seconds=0.12)
    assert not guard.probing and guard.judgements == [pytest.approx((0.05, None))] and not guard.probe_rounds
    for _ in range(6):  # the next stretch is twice as long; 0.06 s per token is not beyond doubt against 0.06
        guard.observe(0.18, 3, probe=False, verify_seconds=0.12)
    assert guard.probing and len(guard.judgements) == 1
    guard.observe(0.05, 1, probe=True)
    guard.observe(0.05, 1, probe=True)  # probed: 0.06 against 0.05 s per token, slower
    assert guard.judgements[-1] == pytest.approx((0.06, 0.05)) and not guard.should_hand_off
    for _ in range(3):  # fast again, but untimed verify forwards (a CUDA call): probed
        guard.observe(0.20, 4, probe=False, verify_seconds=None)
    assert guard.probing


def test_a_slower_stretch_is_never_judged_without_probes():
    """However its verify forwards were timed, a stretch slower than plain steps meets its probes, and two such
    judgements hand the call off."""
    guard = CallGuard(window=2, probes=1, margin=0.05, checks=2, skip=0, verify_bound=2.0)
    for _ in range(2):
        for _ in range(2):
            guard.observe(0.30, 1, probe=False, verify_seconds=0.25)
        assert guard.probing
        guard.observe(0.10, 1, probe=True)
    assert guard.should_hand_off and [plain for _, plain in guard.judgements] == [0.10, 0.10]
