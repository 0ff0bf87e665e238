"""Own-answer generation throughput: useful answer tokens per second of the continuous-batching generator
(`hf_treespark.training.answers`) against the batched `target.generate` regeneration (`regenerate_responses`), on
the same prompts, in one process, one after the other.

Useful tokens are the answers' tokens up to and including their first EOS (what training reads); the time is the
whole run, prefill included. Prompts: ShareGPT training first turns (file positions below the held-out band), the
shortest-first order `regenerate_responses` uses, so both methods answer the same set. Greedy answers of the two
methods are compared token for token (in bf16 they may differ after a near-tie of the target's logits).

    python scripts/answer_throughput.py --num-prompts 96 --slots 32,48 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_args import at_least, whole_numbers  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=at_least(1), default=96)
    parser.add_argument("--skip-prompts", type=at_least(0), default=0,
                        help="start this far into the prompt list (another sample of prompts)")
    parser.add_argument("--slots", type=whole_numbers, default=[32], help="rows of the continuous generator")
    parser.add_argument("--batch-size", type=at_least(1), default=32, help="rows of the regeneration baseline")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=256)
    parser.add_argument("--max-prompt-tokens", type=at_least(1), default=384)
    parser.add_argument("--spare", type=at_least(1), default=128,
                        help="cache slots beyond the longest row span (decoding steps between rolls)")
    parser.add_argument("--chunk-rows", type=at_least(0), default=8, help="rows sharing an attention window")
    parser.add_argument("--sort-every", type=at_least(1), default=32,
                        help="decoding steps between two sorts of the rows")
    parser.add_argument("--no-pack", action="store_true", help="leave the target's linear layers unpacked (the "
                        "generator's run; the baseline always runs unpacked, as `treespark train --regenerate` does)")
    parser.add_argument("--no-baseline", action="store_true", help="time the continuous generator only")
    parser.add_argument("--output", help="write the table's rows as JSON here")
    args = parser.parse_args(argv)

    import torch

    from hf_treespark import load_default_target
    from hf_treespark.training.answers import AnswerConfig, AnswerGenerator
    from hf_treespark.training.data import _eos_ids, regenerate_responses, sharegpt_chat_prompts

    target, tokenizer = load_default_target()
    eos = _eos_ids(target, tokenizer)
    prompts = []
    for prompt in sharegpt_chat_prompts("train", limit=args.skip_prompts + 4 * args.num_prompts):
        ids = list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        if len(ids) <= args.max_prompt_tokens:
            prompts.append((prompt, ids))
    prompts = prompts[args.skip_prompts: args.skip_prompts + args.num_prompts]
    prompts.sort(key=lambda item: len(item[1]))
    print(f"{len(prompts)} prompts, {sum(len(i) for _, i in prompts):,} prompt tokens; dtype {target.dtype}; "
          f"{torch.get_num_threads()} threads", flush=True)
    rows, answers = [], {}

    if not args.no_baseline:
        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            out = regenerate_responses(target, tokenizer, [p for p, _ in prompts], Path(tmp) / "r.jsonl",
                                       batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                       max_prompt_tokens=args.max_prompt_tokens, progress=False)
            seconds = time.perf_counter() - began
            baseline = {r["id"]: r["response_ids"] for r in map(json.loads, out.read_text().splitlines())}
        tokens = sum(len(r) for r in baseline.values())
        rows.append({"method": f"target.generate, batches of {args.batch_size}", "answers": len(baseline),
                     "tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)})
        answers["baseline"] = baseline
        print(rows[-1], flush=True)

    if not args.no_pack:
        from hf_treespark import pack_linear_layers

        pack_linear_layers(target)  # as `treespark answers --cpu-pack auto` does on a CPU
    for slots in args.slots:
        config = AnswerConfig(slots=slots, max_new_tokens=args.max_new_tokens,
                              max_prompt_tokens=args.max_prompt_tokens, spare=args.spare,
                              chunk_rows=args.chunk_rows, sort_every=args.sort_every)
        generator = AnswerGenerator(target, eos, config)
        began = time.perf_counter()
        got = {a.key: a.response_ids for a in generator.run((p.id, ids) for p, ids in prompts)}
        seconds = time.perf_counter() - began
        tokens = sum(len(r) for r in got.values())
        label = f"continuous, {slots} rows" + (", unpacked" if args.no_pack else "")
        row = {"method": label, "answers": len(got), "tokens": tokens,
               "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
               "steps": generator.steps, "prefills": generator.prefills, "rolls": generator.rolls}
        if "baseline" in answers:
            same = sum(got[k] == answers["baseline"].get(k) for k in got)
            row["same_as_baseline"] = f"{same}/{len(got)}"
        rows.append(row)
        print(row, flush=True)

    base = rows[0]["tokens_per_s"] if not args.no_baseline else None
    print("\n| method | answers | answer tokens | seconds | tokens/s | x baseline | same answers |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = f"{row['tokens_per_s'] / base:.2f}" if base else "-"
        print(f"| {row['method']} | {row['answers']} | {row['tokens']:,} | {row['seconds']} | {row['tokens_per_s']} "
              f"| {ratio} | {row.get('same_as_baseline', '-')} |")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
