"""The round engine (`engine.py`) and the package's structure: one session drives every decoding path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import make_drafter, make_target

import hf_treespark
from hf_treespark.calibration import latency
from hf_treespark.calibration import measure as measuring
from hf_treespark.core.tree import TreePolicy
from hf_treespark.decoding import budget
from hf_treespark.decoding.engine import feature_indices
from hf_treespark.decoding.session import DecodingSession
from hf_treespark.sources.lookup import LOOKUP_LONG_TOKENS

PACKAGE = Path(hf_treespark.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every import between hf_treespark modules, including those inside functions.

    `from . import x` is an edge to the module `x`; a name that is not a module is an edge to the
    module it is imported from.
    """
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                source = ".".join(part for part in (base, node.module) if part)
                targets = {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
            elif isinstance(node, ast.Import):
                targets = {alias.name for alias in node.names}
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_package_import_graph_has_no_cycles():
    graph = import_graph()
    assert "hf_treespark.hub.loading" in graph["hf_treespark.cli.commands"], "the graph should see its imports"
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the checker finds a cycle when there is one
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(find_cycle(graph) or [])


def test_decoding_modules_import_nothing_but_torch_transformers_and_each_other():
    """What `generate` runs can ship as remote code: no assets, CLI, benchmark or demo behind it."""
    graph = import_graph()
    allowed = {f"hf_treespark.{name}" for name in ("core.tree", "core.verify", "decoding.engine", "sources.lookup",
                                                   "sources.datastore", "sources.base", "drafter.configuration",
                                                   "drafter.modeling")}
    for module in (f"hf_treespark.{name}" for name in ("core.tree", "core.verify", "decoding.engine", "sources.lookup",
                                                       "sources.datastore")):
        assert graph[module] <= allowed, (module, graph[module] - allowed)


def test_feature_indices_skip_the_embedding_output():
    assert feature_indices([0, 7, 13]) == [1, 8, 14]


def test_a_hand_driven_session_reproduces_generate(llama_pair):
    target, drafter = llama_pair
    ids = torch.randint(4, 100, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    session = DecodingSession(target, drafter, TreePolicy.from_config(drafter.config))
    seq = torch.cat([ids, session.prefill(ids).argmax(-1, keepdim=True)], dim=1)
    while seq.shape[1] < ref.shape[1]:
        rnd = session.step([seq[0]], [seq])[0]
        assert rnd.tree.num_nodes == drafter.config.tree_budget
        seq = torch.cat([seq, rnd.tokens], dim=1)
        assert int(session.lengths[0]) == seq.shape[1] - 1  # everything but the new bonus is in the target cache
    assert torch.equal(seq[:, : ref.shape[1]], ref)


def test_lookup_only_rounds_skip_the_drafter_and_its_next_pass_sees_every_committed_position(llama_pair):
    target, drafter = llama_pair
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])  # 3-token matches recur
    ref = target.generate(ids, do_sample=False, max_new_tokens=24)
    passes = []  # (context positions cached before the pass, new feature rows, anchor position)
    forward = drafter.forward

    def recording_forward(*args, **kwargs):
        new = kwargs["target_features"]
        passes.append((kwargs["context_cache"].get_seq_length(), 0 if new is None else new.shape[1],
                       int(kwargs["anchor_positions"][0, 0])))
        return forward(*args, **kwargs)

    drafter.forward = recording_forward
    try:
        session = DecodingSession(target, drafter, TreePolicy.from_config(drafter.config, lookup=4))
        seq = torch.cat([ids, session.prefill(ids).argmax(-1, keepdim=True)], dim=1)
        kinds, long, sizes = [], False, []
        while seq.shape[1] < ref.shape[1]:
            before = len(passes)
            rnd = session.step([seq[0]], [seq])[0]
            kinds.append("drafter" if len(passes) > before else "lookup")
            if kinds[-1] == "lookup":
                # L = 4 nodes, or up to LOOKUP_LONG_TOKENS after a lookup-only round accepted its whole branch
                assert bool(rnd.tree.lookup[0, 1:].all()) and rnd.tree.num_nodes <= (LOOKUP_LONG_TOKENS if long else 4)
                long = rnd.num_accepted == rnd.tree.num_nodes >= 4
                sizes.append(rnd.tree.num_nodes)
            seq = torch.cat([seq, rnd.tokens], dim=1)
    finally:
        del drafter.forward
    assert torch.equal(seq[:, : ref.shape[1]], ref)
    assert "lookup" in kinds and "drafter" in kinds, kinds
    # each pass conditions on every committed position, those of lookup-only rounds included
    for cached, new, position in passes:
        assert cached + new == position
    # and its context equals one built from the committed text's target features at once
    from hf_treespark.decoding.engine import target_features

    length = session.context.get_seq_length()
    features, _ = target_features(target, drafter.config.target_layer_ids, seq[:, :length],
                                  torch.ones(1, length, dtype=torch.long))
    fresh = drafter.new_context_cache()
    with torch.no_grad():
        drafter(anchor_ids=seq[:, length: length + 1], anchor_positions=torch.tensor([[length]]),
                target_features=features, context_cache=fresh, return_logits=False)
    for mine, theirs in zip(session.context.keys, fresh.keys, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_policy_from_config_reads_the_drafter_and_per_call_knobs(llama_pair):
    _, drafter = llama_pair
    cfg = drafter.config
    policy = TreePolicy.from_config(cfg)
    assert (policy.topk, policy.frontier, policy.budget, policy.depth, policy.auto) == (
        cfg.tree_topk, cfg.tree_frontier, cfg.tree_budget, cfg.block_size, False)
    assert TreePolicy.from_config(cfg, budget="auto").auto
    assert TreePolicy.from_config(cfg, chain=True) == TreePolicy.chain(cfg.block_size)
    assert TreePolicy.from_config(cfg, chain=True, budget=3).budget == 3


@pytest.mark.slow
def test_training_init_from_the_shipped_auto_budget_drafter_runs(tmp_path):
    """The shipped drafter's tree_budget is "auto": training replay must resolve it, then train."""
    from hf_treespark.training.data import ReferenceSequence
    from hf_treespark.training.trainer import TrainConfig, Trainer

    target, tokenizer = hf_treespark.load_default_target(dtype=torch.float32)
    drafter = hf_treespark.load_default_drafter(dtype=torch.float32)
    assert drafter.config.tree_budget == "auto"
    text = tokenizer("A binary search halves the interval each step until it finds the value.")["input_ids"]
    refs = [ReferenceSequence(id=f"r{i}", input_ids=[1, *text[i:], 2], prompt_len=3) for i in range(2)]
    config = TrainConfig(output_dir=str(tmp_path), max_steps=2, batch_size=2, anchors_per_sequence=4, save_every=2,
                         log_every=1)
    trainer = Trainer(config, target, drafter, refs)
    assert trainer.policy.budget == TreePolicy().budget and not trainer.policy.auto
    ids = drafter.draft_vocab_ids.clone()  # trained in its own draft vocabulary
    before = drafter.fc.weight.detach().clone()
    w2_before = drafter.markov_head.markov_w2.weight.detach().clone()
    trainer.train(progress=False)
    assert trainer.step == 2 and not torch.equal(before, drafter.fc.weight)
    assert torch.equal(drafter.draft_vocab_ids, ids) and drafter.markov_head.markov_w2.weight.shape == w2_before.shape
    assert not torch.equal(w2_before, drafter.markov_head.markov_w2.weight)


def test_auto_budget_never_measures_inside_generate(tmp_path, monkeypatch):
    """No cached latency: "auto" takes the fallback budget; one target forward per round, nothing written."""
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))
    monkeypatch.setattr("hf_treespark.calibration.latency.measure_round_latency",
                        lambda *a, **k: pytest.fail("generate measured latency"))
    target = make_target("llama")
    drafter = make_drafter(target, tree_budget="auto")
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)
    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                              return_dict_in_generate=True)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, ref)
    assert out.tree_budget == budget.FALLBACK_BUDGET["cpu"]
    assert len(calls) == 1 + len(out.rounds)
    assert not (tmp_path / latency.LATENCY_FILE).exists()


@pytest.mark.parametrize("profile", [None, {"4": 1.3, "16": 1.6}])
def test_auto_budget_after_calibration_packs_the_first_pool_once(tmp_path, monkeypatch, profile):
    monkeypatch.setenv("HF_TREESPARK_CACHE", str(tmp_path))
    target = make_target("qwen3")
    drafter = make_drafter(target, tree_budget="auto", acceptance_profile=profile)
    steady = {"verify": {n: 0.002 * (1 + n / 16) for n in (0, *budget.CANDIDATE_BUDGETS)},
              "draft": {n: 0.001 for n in budget.CANDIDATE_BUDGETS}, "others_load": 0.0}
    # this machine's load aside
    monkeypatch.setattr("hf_treespark.calibration.latency.measure_round_latency", lambda *a, **k: steady)
    measuring.calibrate_latency(target, drafter)
    assert latency.has_latency(target, drafter)
    from hf_treespark.decoding import engine

    expansions = []
    real = engine.expand_tree
    monkeypatch.setattr(engine, "expand_tree", lambda *a, **k: expansions.append(1) or real(*a, **k))
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids, do_sample=False, max_new_tokens=16)
    out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                          return_dict_in_generate=True, tree_guard=False)  # every round drafted, no probe
    assert torch.equal(out.sequences, ref)
    assert out.tree_budget in budget.CANDIDATE_BUDGETS
    assert all(r.tree_size == out.tree_budget for r in out.rounds)
    assert len(expansions) == len(out.rounds)  # the first round's tree is not built twice


def test_a_closed_drafter_gate_skips_the_drafter_and_stays_exact(llama_pair):
    """An untrained drafter gets (almost) nothing accepted: with a gate the session stops drafting and
    verifies short lookup branches or the root alone, and its later passes still see every committed
    position. Gate 0 drafts in every round that is not lookup-only."""
    target, drafter = llama_pair
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids, do_sample=False, max_new_tokens=40)
    forward = drafter.forward
    offsets = []

    def recording_forward(*args, **kwargs):
        new = kwargs["target_features"]
        offsets.append(kwargs["context_cache"].get_seq_length() + (0 if new is None else new.shape[1])
                       - int(kwargs["anchor_positions"][0, 0]))
        return forward(*args, **kwargs)

    drafter.forward = recording_forward
    kinds = {}
    try:
        for gate in (0.0, 0.5):
            session = DecodingSession(target, drafter, TreePolicy.from_config(drafter.config, lookup=6), gate=gate)
            seq = torch.cat([ids, session.prefill(ids).argmax(-1, keepdim=True)], dim=1)
            kinds[gate] = []
            while seq.shape[1] < ref.shape[1]:
                passes, idle = len(offsets), session.gate.idle
                rnd = session.step([seq[0]], [seq])[0]
                if len(offsets) > passes:
                    kinds[gate].append("drafter")
                    assert session.gate.idle == 0
                elif session.gate.idle == idle + 1:  # the gate skipped the drafter
                    kinds[gate].append("gated")
                    assert rnd.tree.num_nodes <= 6  # one branch of at most L tokens
                    assert rnd.tree.num_nodes == 0 or bool(rnd.tree.lookup[0, 1:].all())
                else:  # a lookup-only round (a 3-token match) leaves the gate's count alone
                    kinds[gate].append("lookup")
                    assert session.gate.idle == idle
                seq = torch.cat([seq, rnd.tokens], dim=1)
            assert torch.equal(seq[:, : ref.shape[1]], ref), gate
    finally:
        del drafter.forward
    assert all(offset == 0 for offset in offsets)  # cached + new features == the anchor's position
    assert "gated" not in kinds[0.0] and "drafter" in kinds[0.0]
    assert "gated" in kinds[0.5] and kinds[0.5].count("drafter") < kinds[0.0].count("drafter"), kinds


def test_a_lookup_only_round_accepted_whole_lengthens_the_next_one():
    """A looping text (here a target whose logits are all equal, so greedy repeats token 0): the branch of
    the most recent match continues the repeat, is accepted whole, and the next lookup-only round's branch
    runs to LOOKUP_LONG_TOKENS, deeper than the drafter's tree; decoding stays exact."""
    target = make_target("llama")
    with torch.no_grad():
        target.model.norm.weight.zero_()
    drafter = make_drafter(target)
    ids = torch.tensor([[0, 0, 0, 0]])  # 0 is also the pad id: the mask says these are text
    mask = torch.ones_like(ids)
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=50)
    assert bool((ref[0] == 0).all())
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=50,
                          tree_lookup=4,
                          return_dict_in_generate=True, tree_record=True)
    assert torch.equal(out.sequences, ref)
    sizes = [len(r.tree["tokens"]) - 1 for r in out.rounds]
    assert sizes[0] == 4 and max(sizes) == LOOKUP_LONG_TOKENS > drafter.config.block_size, sizes
    assert all(r.num_accepted == size for r, size in zip(out.rounds[:-1], sizes, strict=False))


def test_commit_cache_keeps_the_accepted_entries_whether_they_move_or_are_already_in_place():
    from transformers import DynamicCache

    from hf_treespark.core.verify import commit_cache

    target = make_target("llama")
    for keep in ([0], [0, 1, 2], [0, 2, 5], [0, 1, 4]):
        cache = DynamicCache(config=target.config)
        past, chunk = 4, 7
        values = torch.arange(past + chunk, dtype=torch.float32)[None, None, :, None].expand(1, 2, -1, 3)
        for layer in range(target.config.num_hidden_layers):
            cache.update(values.clone() + layer, values.clone() - layer, layer)
        commit_cache(cache, past, torch.tensor([keep]))
        expected = torch.tensor(list(range(past)) + [past + k for k in keep], dtype=torch.float32)
        for layer_index, layer in enumerate(cache.layers):
            assert torch.equal(layer.keys[0, 1, :, 0], expected + layer_index)
            assert torch.equal(layer.values[0, 0, :, 2], expected - layer_index)
        assert cache.get_seq_length() == past + len(keep)
