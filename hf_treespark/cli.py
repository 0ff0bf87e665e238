"""The `treespark` command."""

from __future__ import annotations

import argparse
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load_pair(args):
    from . import assets
    from .modeling import TreeSparkDrafter

    dtype = DTYPES[args.dtype]
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    else:
        target, tokenizer = assets.load_default_target(dtype=dtype)
    if args.drafter:
        drafter = TreeSparkDrafter.from_pretrained(args.drafter, dtype=dtype).eval()
    else:
        drafter = assets.load_default_drafter(dtype=dtype)
    return target, tokenizer, drafter


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from . import assets
    from .exactness import check_greedy_equivalence

    target, tokenizer, drafter = _load_pair(args)
    inputs = assets.chat_inputs(tokenizer, args.prompt)
    knobs = {"tree_chain": args.chain}
    if args.budget is not None:
        knobs["tree_budget"] = args.budget
    if args.topk is not None:
        knobs["tree_topk"] = args.topk
    sample = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, streamer=streamer,
                          return_dict_in_generate=True, **sample, **knobs)
    seconds = time.perf_counter() - start
    new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    print(f"\n[treespark] {new} tokens in {len(out.rounds)} rounds, mean acceptance length "
          f"{out.acceptance_length:.2f}, {new / seconds:.1f} tokens/s ({args.dtype})")
    if args.compare:
        start = time.perf_counter()
        plain = target.generate(**inputs, max_new_tokens=args.max_new_tokens, **sample)
        plain_seconds = time.perf_counter() - start
        plain_new = plain.shape[1] - inputs["input_ids"].shape[1]
        print(f"[plain]     {plain_new} tokens, {plain_new / plain_seconds:.1f} tokens/s; "
              f"speedup {(new / seconds) / (plain_new / plain_seconds):.2f}x")
        if not sample["do_sample"]:
            report = check_greedy_equivalence(target, plain, out.sequences)
            print(f"[check]     {report}")
            if not report.ok:
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treespark", description="TreeSpark tree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an answer with tree speculative decoding")
    gen.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--target", help="target model name or path (default: offline SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", help="drafter name or path (default: the shipped drafter)")
    gen.add_argument("--budget", type=int, help="tree budget N (non-root nodes verified per round)")
    gen.add_argument("--topk", type=int, help="children per frontier parent")
    gen.add_argument("--chain", action="store_true", help="chain mode (plain DSpark drafting)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    gen.add_argument("--compare", action="store_true", help="also run plain decoding: speedup and exactness check")
    gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error("--max-new-tokens must be at least 1")
    if getattr(args, "prompt", "x").strip() == "":
        parser.error("--prompt is empty")
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"treespark: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
