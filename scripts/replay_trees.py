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
from script_args import at_least, existing_file, non_negative_number, output_file, positive_number, probability

DEPTH_CAP = 4  # conditional rates are fitted per depth 1..DEPTH_CAP (deeper nodes share the last)


def development_prompts() -> list[tuple[str, str]]:
    from hf_treespark.hub import assets

    sharegpt = assets.sharegpt_prompts("heldout", limit=400)[200:230]
    humaneval = assets.humaneval_prompts()
    mtbench = assets.mtbench_prompts()
    return ([("sharegpt", p) for p in sharegpt]
            + [("humaneval", f"Complete this Python function.\n\n```python\n{humaneval[8 * i + 3]}```")
               for i in range(15)]
            + [("mtbench", mtbench[4 * i + 2]) for i in range(15)])


def record(args) -> int:
    from tqdm.auto import tqdm

    from hf_treespark import load_default_drafter, load_default_target
    from hf_treespark.hub import assets

    target, tokenizer = load_default_target()
    drafter = load_default_drafter()
    partial = Path(f"{args.output}.partial")  # an earlier recording at --output stays until this one is complete
    with open(partial, "w") as f:
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
    partial.replace(args.output)
    print(f"wrote {args.output}")
    return 0


def node_kind(tree: dict, i: int, lookup_only: bool) -> tuple[str, int, int]:
    """`(source, depth, step bin)`: source drafted / lookup / retrieved (prefixed `LO-` in a lookup-only round), depth
    capped at `DEPTH_CAP`, and the node's own step probability `exp(score - parent's score)` in fifths."""
    source = "lookup" if tree["lookup"][i] else "retrieved" if tree["retrieved"][i] else "drafted"
    parent = tree["parents"][i]
    step = math.exp(tree["scores"][i] - (tree["scores"][parent] if parent > 0 else 0.0))
    return ("LO-" if lookup_only else "") + source, min(tree["depths"][i], DEPTH_CAP), min(int(step * 5), 4)


TREE_FIELDS = ("tokens", "parents", "depths", "scores", "lookup", "retrieved")


def _is_index(value, low: int, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < size


def round_problem(rnd) -> str | None:
    """What makes a recorded round unusable (a missing field, lists of unequal length, an index outside the
    tree), or None."""
    if not isinstance(rnd, dict) or not isinstance(rnd.get("tree"), dict) or not isinstance(rnd.get("path"), list):
        return "a round needs a 'tree' object and a 'path' list"
    tree = rnd["tree"]
    missing = [k for k in TREE_FIELDS if not isinstance(tree.get(k), list)]
    if missing:
        return f"the tree lacks the list(s) {', '.join(map(repr, missing))}"
    size = len(tree["tokens"])
    if size == 0 or any(len(tree[k]) != size for k in TREE_FIELDS):
        return f"the tree's lists {', '.join(TREE_FIELDS)} must be as long as each other, root first"
    if not (all(_is_index(p, 0, size) for p in tree["parents"][1:])
            and all(_is_index(d, 1, size) for d in tree["depths"][1:])):
        return f"a parent or depth lies outside the tree of {size - 1} nodes"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in tree["scores"]):
        return "a score is not a finite number"
    if not all(_is_index(node, 1, size) for node in rnd["path"]):
        return f"the accepted path {rnd['path']} names a node outside the tree of {size - 1} nodes"
    return None


def read_records(path: str) -> list[dict]:
    """The records of a `record` file; `ValueError` naming the file and line of one that is not JSON or lacks
    the fields `record` writes."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text: give the jsonl file that `record` wrote") from None
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_no}: not a JSON line ({err}); give the file that `record` wrote") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("rounds"), list):
            problem = "no 'rounds' list: give the file that `record` wrote"
        else:
            problem = next((f"round {k}: {p}" for k, p in enumerate(map(round_problem, rec["rounds"])) if p), None)
        if problem:
            raise ValueError(f"{path}:{line_no}: {problem}")
        records.append(rec)
    return records


def load_rounds(path: str) -> list[dict]:
    rounds = []
    for prompt, rec in enumerate(read_records(path)):
        for rnd in rec["rounds"]:
            tree = rnd["tree"]
            n = len(tree["tokens"]) - 1
            drafted = any(not tree["lookup"][i] and not tree["retrieved"][i] for i in range(1, n + 1))
            rounds.append({"suite": rec.get("suite"), "prompt": prompt, "tree": tree, "n": n, "path": rnd["path"],
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


def verify_problem(entry) -> str | None:
    """What makes a latency cache entry unusable for the cost model (no plain step `"0"`, a time that is not a
    positive number), or None."""
    verify = entry.get("verify") if isinstance(entry, dict) else None
    if not isinstance(verify, dict) or "0" not in verify:
        return "it has no 'verify' table with a plain step ('0')"
    try:
        if all(int(n) >= 0 and isinstance(t, (int, float)) and 0 < t < 60 for n, t in verify.items()):
            return None
    except ValueError:
        pass
    return "its 'verify' table maps something other than node counts to seconds"


def latency_entry(key: str | None) -> dict:
    """The cost model's entry of the latency cache: `key`, or the first usable batch-1 one; `ValueError` saying
    what to do when there is none."""
    from hf_treespark.storage import cache_dir

    path = Path(cache_dir()) / "round_latency.json"
    if not path.is_file():
        raise ValueError(f"no latency cache at {path}: run `treespark calibrate` on this machine first (or set "
                         "HF_TREESPARK_CACHE to the folder that holds one)")
    try:
        entries = json.loads(path.read_bytes())
    except ValueError as err:
        raise ValueError(f"the latency cache {path} is not JSON ({err}): run `treespark calibrate --force`") from None
    if not isinstance(entries, dict):
        raise ValueError(f"the latency cache {path} is not a table: run `treespark calibrate --force`")
    if key is None:
        key = next((k for k, e in entries.items() if "|batch=" not in k and verify_problem(e) is None), None)
        if key is None:
            raise ValueError(f"the latency cache {path} has no usable batch-1 entry: run `treespark calibrate`")
    elif key not in entries:
        raise ValueError(f"--latency-key {key!r} is not in the latency cache {path}; its entries: "
                         f"{', '.join(map(repr, entries)) or 'none'}")
    elif verify_problem(entries[key]):
        raise ValueError(f"--latency-key {key!r}: {verify_problem(entries[key])}; give another entry or run "
                         "`treespark calibrate --force`")
    return entries[key]


def analyse(args, rounds: list[dict], cost: CostModel) -> int:
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
        if not test:
            print(f"| (no rounds in half {h}: the file holds one prompt) | | | | | |")
            continue
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
    rec.add_argument("--budget", type=at_least(1), default=16)
    rec.add_argument("--max-new-tokens", type=at_least(1), default=128)
    rec.add_argument("--output", type=output_file, required=True)
    ana = sub.add_parser("analyse", help="acceptance by node kind and node-selection policies, replayed")
    ana.add_argument("trees", type=existing_file)
    ana.add_argument("--plain-ms", type=positive_number, default=65.0,
                     help="a plain target forward at the prompts' context")
    ana.add_argument("--draft-ms", type=non_negative_number, default=15.5,
                     help="the drafter pass (`treespark bench --profile`)")
    ana.add_argument("--overhead-ms", type=non_negative_number, default=8.7,
                     help="tree building and the loop, per round")
    ana.add_argument("--latency-key", default=None, help="entry of the latency cache (default: the first batch-1)")
    ana.add_argument("--thresholds", type=probability, nargs="+", default=[0.03, 0.05, 0.07, 0.1])
    ana.add_argument("--min-count", type=at_least(0), default=30)
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args)
    try:
        rounds = load_rounds(args.trees)
        if not rounds:
            raise ValueError(f"{args.trees} holds no rounds: record some with `python scripts/replay_trees.py "
                             f"record --output {args.trees}`")
        cost = CostModel(latency_entry(args.latency_key), args.plain_ms, args.draft_ms, args.overhead_ms)
    except ValueError as err:
        parser.error(str(err))
    return analyse(args, rounds, cost)


if __name__ == "__main__":
    sys.exit(main())
