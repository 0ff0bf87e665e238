"""Before/after of two versions of the package's code (two checkouts), the defaults as a user calls them
(`target.generate(..., assistant_model=drafter)`, each checkout's own default target and drafter), on the same
prompts. Two versions of one package cannot share a process, so each (suite, checkout) runs in a process of its own,
with plain greedy beside it (the two alternate which goes first, prompt by prompt); compare the defaults' speedup
over the plain decoding measured in the same process.

    python scripts/compare_checkouts.py dump PROMPTS.json [--num-prompts 20]       # this checkout's bench prompts
    PYTHONPATH=<old checkout> HF_TREESPARK_CACHE=<its own cache> \\
        python scripts/compare_checkouts.py run PROMPTS.json SUITE old RESULTS.jsonl  # one line per prompt
    python scripts/compare_checkouts.py run PROMPTS.json SUITE new RESULTS.jsonl      # this checkout
    python scripts/compare_checkouts.py check PROMPTS.json RESULTS.jsonl  # every output against plain greedy's
    python scripts/compare_checkouts.py report RESULTS.jsonl              # tables: each label, then the last / first

`PYTHONPATH` puts the other checkout's `hf_treespark` ahead of the installed one; `HF_TREESPARK_CACHE` keeps each
version's cache (converted target, latency table) apart. Alternate the order of the two versions from suite to suite
(old, new; new, old; ...) so that a drift of the machine's speed falls on both. The multiturn suite's prompts hold the
target's earlier answers, but the datastore is the drafter's own as loaded (the bench's grown copy is newer code).
`check` uses this checkout's near-tie rule (strict in float32). Measured runs: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict

from script_args import at_least, existing_file

SUITES = ("mtbench", "humaneval", "sharegpt", "copy", "multiturn", "math")
FIELDS = ("label", "suite", "prompt", "plain_s", "plain_n", "spec_s", "spec_n", "plain", "spec")


def read_rows(path: str) -> list[dict]:
    """The rows `run` wrote; a line that is not one of them stops the script with its file and line named."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            missing = [k for k in FIELDS if k not in row] if isinstance(row, dict) else None
            if missing is None or missing:
                raise SystemExit(f"{path}:{number}: not a row of `compare_checkouts.py run` "
                                 f"({'missing ' + ', '.join(missing) if missing else 'not a JSON object'}); "
                                 "give the results file that `run` appended to")
            rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows; run `compare_checkouts.py run` first")
    return rows


def dump(out: str, count: int) -> None:
    import hf_treespark
    from hf_treespark.bench.suites import suite_prompts

    target, tokenizer = hf_treespark.load_default_target()
    prompts = {}
    for suite in SUITES:
        prompts[suite] = [p.inputs["input_ids"][0].tolist()
                          for p in suite_prompts(tokenizer, suite, count, target=target, progress=True)]
        print(f"{suite}: {len(prompts[suite])} prompts", flush=True)
    with open(out, "w") as f:
        json.dump(prompts, f)


def run(prompts_path: str, suite: str, label: str, out: str, max_new_tokens: int, batch_size: int = 1) -> None:
    import torch

    import hf_treespark

    with open(prompts_path) as f:
        prompts = json.load(f)[suite]
    target, tokenizer = hf_treespark.load_default_target()
    drafter = hf_treespark.load_default_drafter()
    print(f"{label}: {hf_treespark.__file__}", flush=True)
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    ends = set(eos if isinstance(eos, list) else [eos]) | {pad}

    def trimmed(row: list[int]) -> list[int]:  # a batch row's tokens up to its end (the rest is padding)
        return next((row[:j + 1] for j, token in enumerate(row) if token in ends), row)

    def generate(rows, speculative: bool, new_tokens: int = max_new_tokens):
        """`(each row's new tokens, seconds)` for prompt rows (token-id lists) as one left-padded batch."""
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        kwargs = {"assistant_model": drafter} if speculative else {}
        start = time.perf_counter()
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              pad_token_id=pad, **kwargs)
        seconds = time.perf_counter() - start
        out = getattr(out, "sequences", out)[:, width:].tolist()
        return [trimmed(row) if len(rows) > 1 else row for row in out], seconds

    warm = [prompts[0][:64]] * batch_size
    for speculative in (False, True, False, True):  # first-call costs stay out of the timings
        generate(warm, speculative, 8)
    with open(out, "a") as f:
        for first in range(0, len(prompts) - batch_size + 1, batch_size):
            rows = prompts[first:first + batch_size]
            done = {}
            for speculative in ((False, True) if (first // batch_size) % 2 == 0 else (True, False)):
                done[speculative] = generate(rows, speculative)
            (plain, plain_s), (spec, spec_s) = done[False], done[True]
            plain_total, spec_total = sum(map(len, plain)), sum(map(len, spec))
            for i in range(len(rows)):  # a batch's seconds shared by its rows in proportion to their tokens
                f.write(json.dumps({"label": label, "suite": suite, "prompt": first + i,
                                    "plain_s": plain_s * len(plain[i]) / max(plain_total, 1),
                                    "plain_n": len(plain[i]), "spec_s": spec_s * len(spec[i]) / max(spec_total, 1),
                                    "spec_n": len(spec[i]), "plain": plain[i], "spec": spec[i],
                                    "batch_size": batch_size}) + "\n")
            f.flush()


def check(prompts_path: str, results: str) -> int:
    import torch

    import hf_treespark
    from hf_treespark.core.exactness import check_greedy_equivalence

    with open(prompts_path) as f:
        prompts = json.load(f)
    target, _ = hf_treespark.load_default_target()
    counts, failed = defaultdict(lambda: [0, 0]), 0
    for row in read_rows(results):
        prompt = prompts[row["suite"]][row["prompt"]]
        report = check_greedy_equivalence(target, torch.tensor([prompt + row["plain"]]),
                                          torch.tensor([prompt + row["spec"]]))
        counts[(row["suite"], row["label"])][0] += int(report.ok)
        counts[(row["suite"], row["label"])][1] += 1
        if not report.ok:
            failed += 1
            print(f"{row['suite']} {row['label']} prompt {row['prompt']}: {report}")
    for (suite, label), (ok, n) in counts.items():
        print(f"{suite} {label}: {ok}/{n} pass")
    return 1 if failed else 0


def report(results: str) -> None:
    rows = defaultdict(list)
    for row in read_rows(results):
        rows[(row["suite"], row["label"])].append(row)
    labels = list(dict.fromkeys(label for _, label in rows))
    suites = list(dict.fromkeys(suite for suite, _ in rows))
    speed = {}
    print("| suite | code | prompts | plain tok/s | defaults tok/s | defaults x plain |\n|---|---|---|---|---|---|")
    for suite in suites:
        for label in labels:
            part = rows.get((suite, label))
            if part:
                plain = sum(r["plain_n"] for r in part) / sum(r["plain_s"] for r in part)
                spec = sum(r["spec_n"] for r in part) / sum(r["spec_s"] for r in part)
                speed[(suite, label)] = (plain, spec, {r["prompt"]: r for r in part})
                print(f"| {suite} | {label} | {len(part)} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x |")
    if len(labels) < 2:
        return
    first, last = labels[0], labels[-1]
    print(f"\n| suite | {last} / {first}, defaults x plain | per prompt, geometric mean (SE of its log) |\n"
          "|---|---|---|")
    for suite in suites:
        if (suite, first) in speed and (suite, last) in speed:
            (p0, s0, r0), (p1, s1, r1) = speed[(suite, first)], speed[(suite, last)]
            logs = [math.log(r1[i]["spec_n"] / r1[i]["spec_s"] * r1[i]["plain_s"] / r1[i]["plain_n"])
                    - math.log(r0[i]["spec_n"] / r0[i]["spec_s"] * r0[i]["plain_s"] / r0[i]["plain_n"])
                    for i in sorted(set(r0) & set(r1))]
            mean = sum(logs) / len(logs)
            se = (sum((x - mean) ** 2 for x in logs) / (len(logs) - 1) / len(logs)) ** 0.5 if len(logs) > 1 else 0
            print(f"| {suite} | {(s1 / p1) / (s0 / p0):.3f} | {math.exp(mean):.3f} ({se:.3f}) |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("prompts")
    d.add_argument("--num-prompts", type=at_least(1), default=20)
    r = sub.add_parser("run")
    r.add_argument("prompts", type=existing_file)
    r.add_argument("suite", choices=SUITES)
    r.add_argument("label", help="the checkout's name in the results, e.g. old or new")
    r.add_argument("results", help="JSONL file the rows are appended to")
    r.add_argument("--max-new-tokens", type=at_least(1), default=128)
    r.add_argument("--batch-size", type=at_least(1), default=1,
                   help="prompts per generate call (left-padded; its rows share the call's seconds by tokens, so a "
                        "row's speedup is its batch's)")
    c = sub.add_parser("check")
    c.add_argument("prompts", type=existing_file)
    c.add_argument("results", type=existing_file)
    t = sub.add_parser("report")
    t.add_argument("results", type=existing_file)
    args = p.parse_args()
    if args.command == "dump":
        dump(args.prompts, args.num_prompts)
    elif args.command == "run":
        run(args.prompts, args.suite, args.label, args.results, args.max_new_tokens, args.batch_size)
    elif args.command == "check":
        return check(args.prompts, args.results)
    else:
        report(args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
