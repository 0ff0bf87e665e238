"""Which nodes of a round's tree are worth verifying? Record trees on development prompts, then replay policies.

    record   greedy `generate` with the package's defaults but a generous budget (`--budget`, default 16) and
             `tree_record=True`, on development prompts the benchmark never selects (held-out ShareGPT records
             200-229, HumanEval prompts 8i+3, MT-Bench questions 4i+2); every round's packed tree (tokens, parents,
             scores, lookup/datastore flags) and its accepted path go to a jsonl file
    analyse  from the file alone (no torch): how often each kind of node is accepted given its parent was, by
             source, depth and its step probability; and the tokens per second that node-selection policies would
             reach on the same rounds

Replay is exact per round: a node's verdict depends only on its own path (the tree mask), so the accepted path of any
prefix-closed subset of a recorded tree is the recorded path cut at the first node left out. What it cannot replay is
a different trajectory (later rounds see the text this run committed) or nodes the budget did not pack.

Cost model, ms per round: the drafter pass when the round ran it, plus the tree and loop overhead, plus one verify
forward of `1 + nodes` tokens, interpolated from this machine's latency cache (`treespark calibrate`) scaled to the
measured plain step (`--plain-ms`); a plain step costs `--plain-ms + --overhead-ms`.

Policies: `current b` packs the top `b + extra` nodes by score, `extra` the lookup and datastore nodes of the round
(what the engine does at budget `b`); `threshold t` keeps every node whose calibrated path probability is at least
`t` (the product, along its path, of the conditional acceptance rates fitted on the other half of the prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

DEPTH_CAP = 4  # conditional rates are fitted per depth 1..DEPTH_CAP (deeper nodes share the last)


def development_prompts() -> list[tuple[str, str]]:
    from hf_treespark import assets

    sharegpt = assets.sharegpt_prompts("heldout", limit=400)[200:230]
    humaneval = assets.humaneval_prompts()
    mtbench = assets.mtbench_prompts()
    return ([("sharegpt", p) for p in sharegpt]
            + [("humaneval", f"Complete this Python function.\n\n```python\n{humaneval[8 * i + 3]}```")
               for i in range(15)]
            + [("mtbench", mtbench[4 * i + 2]) for i in range(15)])


def record(args) -> int:
    from tqdm.auto import tqdm

    from hf_treespark import assets, load_default_drafter, load_default_target

    target, tokenizer = load_default_target()
    drafter = load_default_drafter()
    with open(args.output, "w") as f:
        for suite, prompt in tqdm(development_prompts(), desc="recording trees"):
            inputs = assets.chat_inputs(tokenizer, prompt)
            if inputs["input_ids"].shape[1] > 512:
                continue
            out = target.generate(**inputs, assistant_model=drafter, do_sample=False,
                                  max_new_tokens=args.max_new_tokens, tree_budget=args.budget, tree_record=True,
                                  return_dict_in_generate=True)
            rounds = [{"tree": {k: v for k, v in r.tree.items() if k != "candidates"}, "path": r.accepted_path}
                      for r in out.rounds]
            f.write(json.dumps({"suite": suite, "rounds": rounds}) + "\n")
    print(f"wrote {args.output}")
    return 0


def node_kind(tree: dict, i: int, lookup_only: bool) -> tuple[str, int, int]:
    """`(source, depth, step bin)`: source drafted / lookup / retrieved (prefixed `LO-` in a lookup-only round), depth
    capped at `DEPTH_CAP`, and the node's own step probability `exp(score - parent's score)` in fifths."""
    source = "lookup" if tree["lookup"][i] else "retrieved" if tree["retrieved"][i] else "drafted"
    parent = tree["parents"][i]
    step = math.exp(tree["scores"][i] - (tree["scores"][parent] if parent > 0 else 0.0))
    return ("LO-" if lookup_only else "") + source, min(tree["depths"][i], DEPTH_CAP), min(int(step * 5), 4)


def load_rounds(path: str) -> list[dict]:
    rounds = []
    for prompt, line in enumerate(Path(path).read_text().splitlines()):
        rec = json.loads(line)
        for rnd in rec["rounds"]:
            tree = rnd["tree"]
            n = len(tree["tokens"]) - 1
            drafted = any(not tree["lookup"][i] and not tree["retrieved"][i] for i in range(1, n + 1))
            rounds.append({"suite": rec["suite"], "prompt": prompt, "tree": tree, "n": n, "path": rnd["path"],
                           "accepted": set(rnd["path"]) | {0}, "drafted": drafted,
                           "kinds": [None] + [node_kind(tree, i, not drafted) for i in range(1, n + 1)]})
    return rounds


def conditional_rates(rounds: list[dict]) -> dict[tuple, list[int]]:
    """`{kind: [nodes whose parent was accepted, of them accepted]}`."""
    rates = defaultdict(lambda: [0, 0])
    for r in rounds:
        for i in range(1, r["n"] + 1):
            if r["tree"]["parents"][i] in r["accepted"]:
                rates[r["kinds"][i]][0] += 1
                rates[r["kinds"][i]][1] += i in r["accepted"]
    return rates


class CostModel:
    def __init__(self, latency: dict, plain_ms: float, draft_ms: float, overhead_ms: float):
        verify = latency["verify"]
        scale = plain_ms / (1000 * verify["0"])
        self.nodes = sorted(int(n) for n in verify)
        self.verify_ms = [1000 * verify[str(n)] * scale for n in self.nodes]
        self.draft_ms, self.overhead_ms = draft_ms, overhead_ms

    def round_ms(self, nodes: int, drafted: bool) -> float:
        return (self.draft_ms if drafted else 0.0) + self.overhead_ms + float(np.interp(nodes, self.nodes,
                                                                                          self.verify_ms))


def replay(rounds: list[dict], keep, cost: CostModel) -> dict:
    """Tokens per round, ms per round, tokens per second and nodes per round of the policy `keep(round) -> set`."""
    tokens = ms = nodes = 0.0
    for r in rounds:
        kept = keep(r)
        accepted = 0
        for node in r["path"]:
            if node not in kept:
                break
            accepted += 1
        tokens += accepted + 1
        nodes += len(kept)
        ms += cost.round_ms(len(kept), r["drafted"])
    n = max(len(rounds), 1)
    return {"tokens": tokens / n, "ms": ms / n, "tok_s": 1000 * tokens / ms if ms else 0.0, "nodes": nodes / n}


def current_policy(budget: int):
    def keep(r: dict) -> set[int]:
        if not r["drafted"]:
            return set(range(1, r["n"] + 1))
        extra = sum(1 for kind in r["kinds"][1:] if kind[0] != "drafted")
        order = sorted(range(1, r["n"] + 1), key=lambda i: -r["tree"]["scores"][i])
        return set(order[: budget + extra])
    return keep


def threshold_policy(rates: dict, tau: float):
    def keep(r: dict) -> set[int]:
        tree, path_p, kept = r["tree"], [1.0] * (r["n"] + 1), set()
        for i in range(1, r["n"] + 1):  # packed trees list parents before children
            seen, hits = rates.get(r["kinds"][i], (0, 0))
            path_p[i] = path_p[tree["parents"][i]] * (hits + 0.5) / (seen + 1)
            if path_p[i] >= tau and (tree["parents"][i] == 0 or tree["parents"][i] in kept):
                kept.add(i)
        return kept
    return keep


def analyse(args) -> int:
    from hf_treespark.storage import cache_dir

    rounds = load_rounds(args.trees)
    entries = json.loads((Path(cache_dir()) / "round_latency.json").read_text())
    key = args.latency_key or next(k for k in entries if "|batch=" not in k)
    cost = CostModel(entries[key], args.plain_ms, args.draft_ms, args.overhead_ms)
    print(f"{len(rounds)} rounds, {sum(r['drafted'] for r in rounds)} with a drafter pass; plain step "
          f"{args.plain_ms + args.overhead_ms:.1f} ms\n")
    print("| node kind | depth | step probability | nodes whose parent was accepted | accepted |")
    print("|---|---|---|---|---|")
    for kind, (seen, hits) in sorted(conditional_rates(rounds).items()):
        if seen >= args.min_count:
            print(f"| {kind[0]} | {kind[1]}{'+' if kind[1] == DEPTH_CAP else ''} | {kind[2] / 5:.1f}-"
                  f"{(kind[2] + 1) / 5:.1f} | {seen} | {hits / seen:.1%} |")
    halves = [[r for r in rounds if r["prompt"] % 2 == h] for h in (0, 1)]
    print("\n| policy | tested on | tokens per round | nodes per round | ms per round | tokens/s |")
    print("|---|---|---|---|---|---|")
    for h, test in enumerate(halves):
        rates = conditional_rates(halves[1 - h])
        policies = [(f"current, budget {b}", current_policy(b)) for b in (2, 4)]
        policies += [(f"threshold {t:.2f}", threshold_policy(rates, t)) for t in args.thresholds]
        for name, keep in policies:
            res = replay(test, keep, cost)
            print(f"| {name} | half {h} | {res['tokens']:.3f} | {res['nodes']:.1f} | {res['ms']:.1f} | "
                  f"{res['tok_s']:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record every round's tree on the development prompts")
    rec.add_argument("--budget", type=int, default=16)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--output", required=True)
    ana = sub.add_parser("analyse", help="acceptance by node kind and node-selection policies, replayed")
    ana.add_argument("trees")
    ana.add_argument("--plain-ms", type=float, default=65.0, help="a plain target forward at the prompts' context")
    ana.add_argument("--draft-ms", type=float, default=15.5, help="the drafter pass (`treespark bench --profile`)")
    ana.add_argument("--overhead-ms", type=float, default=8.7, help="tree building and the loop, per round")
    ana.add_argument("--latency-key", default=None, help="entry of the latency cache (default: the first batch-1)")
    ana.add_argument("--thresholds", type=float, nargs="+", default=[0.03, 0.05, 0.07, 0.1])
    ana.add_argument("--min-count", type=int, default=30)
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else analyse(args)


if __name__ == "__main__":
    sys.exit(main())
