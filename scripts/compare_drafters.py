"""Before/after of two drafters, each at its own "auto" budget (the bench's baseline role shares one budget):
plain greedy, the baseline drafter and the new one with the package's defaults, interleaved prompt by prompt in one
process, 128 new tokens; every output checked against plain greedy. Prints time ratios per suite.

    .venv/bin/python scripts/compare_drafters.py --baseline <previous drafter dir> --drafter <new drafter dir>
"""
import argparse
import time

from script_args import at_least, drafter_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=drafter_dir, required=True)
    p.add_argument("--drafter", type=drafter_dir, help="default: the shipped drafter")
    p.add_argument("--suites", default="mtbench,humaneval")
    p.add_argument("--num-prompts", type=at_least(1), default=8)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    args = p.parse_args()

    import torch

    from hf_treespark.bench.suites import SUITES, select_prompts
    from hf_treespark.hub import assets
    from hf_treespark.hub.loading import load_drafter, load_target

    unknown = [s for s in args.suites.split(",") if s not in SUITES]
    if unknown:
        p.error(f"argument --suites: unknown suite(s) {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(SUITES)}")
    target, tok = load_target(None, torch.float32, cpu_pack=True)
    drafters = {"baseline": load_drafter(args.baseline, torch.float32, cpu_pack=True),
                "new": load_drafter(args.drafter, torch.float32, cpu_pack=True)}
    warm = assets.chat_inputs(tok, "Say hello.")
    for name, d in drafters.items():
        out = target.generate(**warm, assistant_model=d, do_sample=False, max_new_tokens=16,
                              return_dict_in_generate=True)
        print(f"{name}: auto budget {out.tree_budget}", flush=True)
    target.generate(**warm, do_sample=False, max_new_tokens=8)
    for suite in args.suites.split(","):
        seconds = {"plain": 0.0, **{name: 0.0 for name in drafters}}
        for prompt in select_prompts(suite, args.num_prompts):
            inputs = assets.chat_inputs(tok, prompt)
            start = time.perf_counter()
            ref = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
            seconds["plain"] += time.perf_counter() - start
            for name, d in drafters.items():
                start = time.perf_counter()
                out = target.generate(**inputs, assistant_model=d, do_sample=False, max_new_tokens=args.max_new_tokens)
                seconds[name] += time.perf_counter() - start
                assert torch.equal(out, ref), (suite, name, "differs from plain greedy")
        print(f"{suite}: baseline {seconds['plain'] / seconds['baseline']:.2f}x plain, new "
              f"{seconds['plain'] / seconds['new']:.2f}x plain, new / baseline "
              f"{seconds['baseline'] / seconds['new']:.2f}x (all outputs exact)", flush=True)


if __name__ == "__main__":
    main()
