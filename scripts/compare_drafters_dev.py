"""Two drafters' development depth-1 accuracy (teacher-forced top-1 at depth 1 on every anchor of the development
set's references) and the paired difference B - A with its standard error clustered by prompt, per kind and
overall, as a markdown table (`hf_treespark.training.dev_compare`). One target forward per reference serves both
drafters (one drafter pass when A and B are the same directory, the depth-1 head not turned off). Run it alone:
on a busy 2-core CPU the committed set takes an hour or more (bf16).

    .venv/bin/python scripts/compare_drafters_dev.py --a runs/old/final --b runs/new/final
    .venv/bin/python scripts/compare_drafters_dev.py --b-without-depth1-head    # the shipped drafter, head off in B

A and B default to the shipped drafter; a difference is "seen" when it is about twice its standard error.
"""
import argparse
import json
import sys
import time

from script_args import at_least, drafter_dir, existing_file, output_file_and_folders


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=drafter_dir, help="drafter A, the baseline (default: the shipped drafter)")
    p.add_argument("--b", type=drafter_dir, help="drafter B (default: the shipped drafter)")
    p.add_argument("--b-without-depth1-head", action="store_true",
                   help="measure B with its depth-1 head turned off (the drafter before the head was grown)")
    p.add_argument("--dev-data", type=existing_file,
                   help="development references (default: the committed set, training_data/dev/dev_set.jsonl.gz)")
    p.add_argument("--dtype", choices=("auto", "fp32"), default="auto",
                   help="the target's and drafters' precision (auto: bf16 where the CPU computes it natively)")
    p.add_argument("--limit", type=at_least(1), help="only the first LIMIT references (a quick look)")
    p.add_argument("--per-prompt", type=output_file_and_folders,
                   help="also write each prompt's id, kind, anchors and hits of A and B here (JSONL)")
    args = p.parse_args()

    from pathlib import Path

    import torch

    from hf_treespark.hub.loading import load_drafter, load_target
    from hf_treespark.training.dev_compare import compare_depth1, depth1_hits, markdown_table
    from hf_treespark.training.dev_set import DEV_SET_PATH, dev_kinds, load_dev_set

    path = Path(args.dev_data or DEV_SET_PATH)
    dtype = torch.float32 if args.dtype == "fp32" else "auto"
    target, _ = load_target(None, dtype, cpu_pack=False)
    references = load_dev_set(path, vocab_size=target.config.vocab_size)[: args.limit]
    kinds = dev_kinds(path)
    a = load_drafter(args.a, target.dtype, cpu_pack=False).bind_target(target).eval()
    same = args.a == args.b or (args.a and args.b and Path(args.a).resolve() == Path(args.b).resolve())
    b = a if same else load_drafter(args.b, target.dtype, cpu_pack=False).bind_target(target).eval()
    if args.b_without_depth1_head and b.depth1_head is None:
        p.error("argument --b-without-depth1-head: drafter B has no depth-1 head")
    start = time.perf_counter()
    torch.manual_seed(0)
    hits_a, hits_b = depth1_hits(target, [a, b], references, heads_off=[False, args.b_without_depth1_head],
                                 progress=True)
    per_a = {ref.id: h for ref, h in zip(references, hits_a, strict=True)}
    per_b = {ref.id: h for ref, h in zip(references, hits_b, strict=True)}
    rows = compare_depth1(per_a, per_b, kinds)
    b_name = "B (depth-1 head off)" if args.b_without_depth1_head else "B"
    print(f"A: {args.a or 'the shipped drafter'}; {b_name}: {args.b or 'the shipped drafter'}; {path}, "
          f"{len(references)} references; target {target.dtype}; {time.perf_counter() - start:.0f} s\n")
    print(markdown_table(rows, "A", b_name))
    if args.per_prompt:
        Path(args.per_prompt).parent.mkdir(parents=True, exist_ok=True)
        with open(args.per_prompt, "w", encoding="utf-8") as f:
            for ref in references:
                f.write(json.dumps({"id": ref.id, "kind": kinds.get(ref.id), "anchors": per_a[ref.id][1],
                                    "hits_a": per_a[ref.id][0], "hits_b": per_b[ref.id][0]}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
