"""TreeSpark vs plain greedy on the offline default target, a few MT-Bench prompts.

    python examples/generate.py                       # the shipped drafter
    python examples/generate.py --drafter DIR         # a drafter you trained
    python examples/generate.py --untrained           # a random-weight drafter (exactness only)

Prints, per prompt: tokens, rounds, mean acceptance length, tokens/s of both methods measured
side by side, and the exactness check against plain greedy.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_treespark
from hf_treespark import TreeSparkConfig, TreeSparkDrafter
from hf_treespark.core.exactness import check_greedy_equivalence
from hf_treespark.hub import assets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="drafter directory (default: the shipped one)")
    parser.add_argument("--untrained", action="store_true", help="use a random-weight drafter")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--budget", type=int, help="tree budget N")
    parser.add_argument("--chain", action="store_true")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--show", action="store_true", help="print the generated text")
    args = parser.parse_args()

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    target, tokenizer = assets.load_default_target(dtype=dtype)
    if args.untrained:
        torch.manual_seed(0)
        drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, mask_token_id=16)).to(dtype).eval()
    elif args.drafter:
        drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype=dtype).eval()
    else:
        drafter = assets.load_default_drafter(dtype=dtype)
    knobs = {"tree_chain": args.chain}
    if args.budget:
        knobs["tree_budget"] = args.budget

    rows, totals = [], {"plain_s": 0.0, "tree_s": 0.0, "tokens": 0, "rounds": 0, "committed": 0}
    for i, question in enumerate(assets.mtbench_prompts()[: args.prompts]):
        inputs = assets.chat_inputs(tokenizer, question)
        start = time.perf_counter()
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        out = hf_treespark.generate(target, drafter, **inputs, do_sample=False, max_new_tokens=args.max_new_tokens,
                                    return_dict_in_generate=True, **knobs)
        tree_s = time.perf_counter() - start
        new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
        report = check_greedy_equivalence(target, plain, out.sequences)
        rows.append((i, new, len(out.rounds), out.acceptance_length, new / plain_s, new / tree_s, report))
        totals["plain_s"] += plain_s
        totals["tree_s"] += tree_s
        totals["tokens"] += new
        totals["rounds"] += len(out.rounds)
        totals["committed"] += sum(len(r.committed) for r in out.rounds)
        if args.show:
            print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

    print("\n| prompt | tokens | rounds | acceptance length | plain tok/s | treespark tok/s | speedup | exactness |")
    print("|---|---|---|---|---|---|---|---|")
    for i, new, rounds, acc, plain_tps, tree_tps, report in rows:
        print(f"| {i} | {new} | {rounds} | {acc:.2f} | {plain_tps:.1f} | {tree_tps:.1f} | "
              f"{tree_tps / plain_tps:.2f}x | {report} |")
    mean_acc = totals["committed"] / max(totals["rounds"], 1)
    speedup = totals["plain_s"] / totals["tree_s"]
    print(f"| all | {totals['tokens']} | {totals['rounds']} | {mean_acc:.2f} | "
          f"{totals['tokens'] / totals['plain_s']:.1f} | {totals['tokens'] / totals['tree_s']:.1f} | "
          f"{speedup:.2f}x | {'all ok' if all(r[-1].ok for r in rows) else 'VIOLATION'} |")
    print(f"dtype {args.dtype}, policy {'chain' if args.chain else 'tree'}, "
          f"budget {args.budget or drafter.config.tree_budget}")


if __name__ == "__main__":
    main()
