"""The bench's comparison of lookup-only rounds with prompt lookup's rounds at the same accepted length: the rounds
read off prompt lookup's target forwards add up to what it generated, and the report's table weighs the cost ratios
by prompt lookup's rounds."""

import torch
from conftest import make_target

from hf_treespark.bench.methods import MethodResult, committed_bin
from hf_treespark.bench.report import CHAIN_TITLE, markdown_table
from hf_treespark.bench.run import ForwardCounter


def test_prompt_lookups_rounds_add_up_to_what_it_generated():
    target = make_target("llama")
    torch.manual_seed(0)
    phrase = torch.randint(5, 200, (1, 6))
    ids = torch.cat([phrase] * 5, dim=1)  # a repeated phrase: prompt lookup finds candidates
    counter = ForwardCounter(target, log=True)
    try:
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, prompt_lookup_num_tokens=5)
    finally:
        counter.close()
    end = counter.log[-1][0] + 1.0
    rounds = counter.chain_rounds(end, out.shape[1])
    assert len(rounds) == counter.count - 1  # every forward after the prefill is a round
    # the prefill commits one token; the rounds commit the rest, each at least its bonus
    assert 1 + sum(committed for committed, _, _ in rounds) == out.shape[1] - ids.shape[1]
    assert all(committed >= 1 and seconds > 0 for committed, _, seconds in rounds)
    assert all(committed <= nodes + 1 for committed, nodes, _ in rounds)  # accepted candidates + the bonus
    assert any(nodes > 0 for _, nodes, _ in rounds)  # the repeat gave prompt lookup candidates


def test_committed_bins():
    assert [committed_bin(n) for n in (1, 2, 3, 4, 6, 7, 10, 11, 40)] == [
        "1", "2-3", "2-3", "4-6", "4-6", "7-10", "7-10", "11+", "11+"]


def _row(suite, method, label, chain):
    row = MethodResult(suite, method, label)
    for committed, nodes, seconds in chain:
        row.add_chain_round(committed, nodes, seconds)
    from dataclasses import asdict
    return {**asdict(row), "acceptance_length": None, "tokens_per_second": None, "speedup": None}


def test_the_report_compares_costs_at_the_same_accepted_length():
    ours = _row("copy", "treespark_datastore", "defaults", [(1, 7, 0.050), (5, 7, 0.052), (5, 7, 0.054)])
    theirs = _row("copy", "prompt_lookup", "prompt lookup",
                  [(1, 10, 0.040), (1, 10, 0.040), (1, 10, 0.040), (4, 10, 0.053)])
    report = {"config": {"dtype": "float32", "device": "cpu", "machine": "x", "target": "t", "num_prompts": 1,
                         "max_new_tokens": 8, "tree_budget": 4, "requested_budget": 4, "skipped": [],
                         "torch": "2", "transformers": "5", "cpu_pack": False, "methods": []},
              "results": [ours, theirs], "violations": []}
    table = markdown_table(report)
    assert CHAIN_TITLE in table
    lines = [line for line in table.splitlines() if line.startswith("| Copy") and "defaults" in line
             and line.count("|") == 11]
    cells = {line.split(" | ")[2]: line.split(" | ") for line in lines}
    assert set(cells) == {"1", "4-6", "all"}
    assert cells["1"][3] == "1" and cells["1"][5] == "50.0" and cells["1"][6] == "3" and cells["1"][8] == "40.0"
    assert cells["1"][9] == "1.25 |"
    assert cells["4-6"][3] == "2" and cells["4-6"][5] == "53.0" and cells["4-6"][9] == "1.00 |"
    # "all": each group's ratio weighed by prompt lookup's rounds in it: (3 x 1.25 + 1 x 1.00) / 4
    assert cells["all"][6] == "4" and cells["all"][9] == "1.19 |"
