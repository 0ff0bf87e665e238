"""`treespark answers`: the target's own answers to an endless prompt supply, continuously batched, resumable.

    treespark answers --prompts self,sharegpt_standalone --num-prompts 20000 --output-dir runs/answers

Writes `OUTPUT_DIR/answers-NNNNN.jsonl.gz` (`answers.AnswerShards`; `id`, `source`, `prompt`, `prompt_ids`,
`response_ids`: `treespark train --data` reads them) and `OUTPUT_DIR/answers.json`, what the run answers with
(a rerun of other options is refused). Rerun the same command to resume: answered prompts are skipped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

from ..help_format import CPU_PACK_CHOICES, CPU_PACK_HELP, add_device_option, cpu_pack_option, resolve_device
from .prompt_supply import SELF_SOURCE, SOURCES

HELP = "the target's own answers to an endless prompt supply, continuously batched (resumable; see --help)"


def add_arguments(p) -> None:
    """The options of `treespark answers`."""
    if p.description is None:
        p.description = ("Answer prompts with the target, many rows at once in one preallocated KV cache (a finished "
                         "row takes the next prompt at once), and write the answers as gzip JSONL shards that "
                         "`treespark train --data` reads. Rerun with the same options to resume.")
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--prompts", default=f"{SELF_SOURCE},sharegpt_standalone",
                   help="comma-separated prompt sources, taken in turn: 'self' (questions the target writes itself, "
                        "sampled after its chat template's user-turn prefix, deduplicated), 'sharegpt_standalone' "
                        "(ShareGPT's later human turns asked alone), 'sharegpt', 'sharegpt_turns', 'sharegpt_tail', "
                        "'sharegpt_tail_turns', or .jsonl files of chats; never a held-out or benchmark record")
    p.add_argument("--num-prompts", type=int, default=1000, help="answers to have in OUTPUT_DIR in all")
    p.add_argument("--slots", type=int, default=96, help="rows decoding at once (96 was fastest on a 2-core CPU)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="an answer stops here if it has not ended")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    p.add_argument("--sample", action="store_true", help="sample answers at --temperature (default: greedy, the "
                                                         "deployed mode)")
    p.add_argument("--temperature", type=float, default=0.8, help="with --sample")
    p.add_argument("--question-temperature", type=float, default=1.0,
                   help="the temperature 'self' writes its questions at")
    p.add_argument("--shard-answers", type=int, default=256, help="answers per shard (a crash loses at most these)")
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p, help="where the target runs: cpu, cuda or cuda:N; auto: cuda when this machine has a CUDA "
                              "GPU, else cpu")
    p.add_argument("--cpu-pack", choices=CPU_PACK_CHOICES, default="auto", help=CPU_PACK_HELP)
    p.add_argument("--output-dir", required=True, help="where the shards go; rerun to resume")


def check_arguments(args) -> list[str]:
    """Every option checked before anything loads (`args.device` resolved here: "auto" becomes cpu or cuda); returns
    the prompt sources."""
    for flag, value in {"--num-prompts": args.num_prompts, "--slots": args.slots,
                        "--max-new-tokens": args.max_new_tokens, "--max-prompt-tokens": args.max_prompt_tokens,
                        "--shard-answers": args.shard_answers}.items():
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    for flag, value in {"--temperature": args.temperature, "--question-temperature": args.question_temperature}.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")
    sources = [s.strip() for s in args.prompts.split(",")]
    for source in sources:
        if source in SOURCES:
            continue
        if not source.endswith(".jsonl") or not Path(source).is_file():
            raise ValueError(f"--prompts: {source!r} is neither a source ({', '.join(SOURCES)}) nor a .jsonl file")
    if len(set(sources)) != len(sources):
        raise ValueError(f"--prompts {args.prompts}: a source is listed twice")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise ValueError(f"--output-dir {args.output_dir} is a file: give a directory")
    args.device = str(resolve_device(args.device, kinds=("cpu", "cuda")))
    return sources


def _claim(out: Path, settings: dict) -> None:
    path = out / "answers.json"
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} cannot be read ({err}): delete it to resume with these options, or give "
                             "another --output-dir") from None
        changed = [k for k, v in settings.items() if not isinstance(saved, dict) or saved.get(k) != v]
        if changed:
            raise ValueError(f"{out} holds answers made with other {', '.join(changed)}: give the same options to "
                             "resume, or another --output-dir")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1))


def _interleaved(streams: list[Iterator]) -> Iterator:
    """One item of each stream in turn, dropping the streams that run out."""
    while streams:
        for stream in list(streams):
            item = next(stream, None)
            if item is None:
                streams.remove(stream)
            else:
                yield item


def run(args) -> int:
    """`treespark answers`."""
    sources = check_arguments(args)
    from tqdm.auto import tqdm

    from ..core.cpu_gemm import pack_linear_layers, should_pack
    from .answers import AnswerConfig, AnswerGenerator, AnswerShards
    from .cli import load_target
    from .data import _eos_ids
    from .prompt_supply import QuestionFilter, prompt_source

    out = Path(args.output_dir)
    settings = {"target": args.target, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                "sample": args.temperature if args.sample else None, "seed": args.seed,
                "question_temperature": args.question_temperature}
    _claim(out, settings)
    shards = AnswerShards(out, args.shard_answers)
    done = shards.done()
    if len(done) >= args.num_prompts:
        print(f"[answers] {out} already holds {len(done):,} answers (--num-prompts {args.num_prompts:,})")
        return 0
    target, tokenizer = load_target(args.target, with_tokenizer=True, device=args.device)
    if should_pack(cpu_pack_option(args.cpu_pack), args.device):
        pack_linear_layers(target)  # about 6% more answer tokens/s on a 2-core bf16 CPU (docs/answers.md)
    eos = _eos_ids(target, tokenizer)
    written = QuestionFilter()
    self_start = 0
    for record in shards.records():
        if record["source"] == SELF_SOURCE:
            written.keep(record["prompt"])
            self_start = max(self_start, int(record["id"].rsplit(":", 1)[1]) + 1)
    streams = [prompt_source(s, target=target, tokenizer=tokenizer, eos_ids=eos, seed=args.seed,
                             slots=args.slots, temperature=args.question_temperature, question_filter=written,
                             start=self_start) if s == SELF_SOURCE else prompt_source(s) for s in sources]
    skipped = {"answered": 0, "too long": 0}
    prompts = {}

    def pending() -> Iterator[tuple[str, list[int]]]:
        for prompt in _interleaved(streams):
            if prompt.id in done:
                skipped["answered"] += 1
                continue
            ids = list(tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
            if len(ids) > args.max_prompt_tokens:
                skipped["too long"] += 1
                continue
            prompts[prompt.id] = prompt
            yield prompt.id, ids

    config = AnswerConfig(slots=args.slots, max_new_tokens=args.max_new_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, do_sample=args.sample,
                          temperature=args.temperature, seed=args.seed + len(done))
    generator = AnswerGenerator(target, eos, config)
    bar = tqdm(total=args.num_prompts, initial=len(done), unit="answer", desc="answering")
    began, tokens, count = time.perf_counter(), 0, len(done)
    try:
        for answer in generator.run(pending()):
            prompt = prompts.pop(answer.key)
            shards.add({"id": prompt.id, "source": prompt.source, "prompt": prompt.text,
                        "prompt_ids": answer.prompt_ids, "response_ids": answer.response_ids})
            tokens += len(answer.response_ids)
            count += 1
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - began):.0f}")
            if count >= args.num_prompts:
                break
    finally:
        shards.flush()
        bar.close()
    seconds = time.perf_counter() - began
    print(f"[answers] {count - len(done):,} answers, {tokens:,} answer tokens in {seconds:.0f} s "
          f"({tokens / max(seconds, 1e-9):.0f} tokens/s); {count:,} in {out}; skipped: "
          f"{skipped['answered']:,} answered before, {skipped['too long']:,} longer than --max-prompt-tokens"
          + (f"; questions refused: {written.refused}" if SELF_SOURCE in sources else ""))
    return 0
