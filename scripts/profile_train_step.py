"""One `treespark train` step against random Llama and Qwen3 targets of one shape: timed, FLOPs counted, profiled.

    python scripts/profile_train_step.py                                  # llama and qwen3, one shape, one vocabulary
    python scripts/profile_train_step.py --targets llama:32000 qwen3:151936 qwen3:32000 llama:32000:bfloat16

Each target is ARCH[:VOCAB[:DTYPE]]: every target shares hidden size, layers, heads, head_dim and MLP width (Qwen3
adds its per-head q/k RMSNorm); VOCAB defaults to --vocab, DTYPE (the target's weights, as a checkpoint stored in
it loads) to float32. Each gets a fresh drafter and `Trainer` in this process and `--warmup` untimed steps; then
`--steps` timed steps, the targets' steps interleaved (on a shared machine, load falls on all alike). The table gives
each target's fastest step (seconds, and CPU seconds of this process: with `--threads 1` they hold still on a
machine others load), its target forward, and the step's matrix-product FLOPs (`FlopCounterMode`: the same on any
machine); `--top` lists the operators that took most of one profiled step. docs/training.md has a run.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from script_args import at_least

ARCHS = ("llama", "qwen3")
DTYPES = ("float32", "bfloat16")


def target_spec(text: str) -> tuple[str, int | None, str]:
    """argparse type of a target: `ARCH[:VOCAB[:DTYPE]]`."""
    parts = text.split(":")
    if parts[0] not in ARCHS or len(parts) > 3 or (len(parts) > 1 and not parts[1].isdigit()) or (
            len(parts) > 2 and parts[2] not in DTYPES):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ARCH[:VOCAB[:DTYPE]], ARCH one of {', '.join(ARCHS)}, "
                                         f"DTYPE one of {', '.join(DTYPES)}")
    return parts[0], int(parts[1]) if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "float32"


def build_target(arch: str, vocab: int, dtype: str, args):
    import torch
    import transformers

    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    head_dim = {} if args.config_head_dim else {"head_dim": args.hidden // args.heads}  # Qwen3Config's own: 128
    config = config_cls(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.heads // 2, max_position_embeddings=4096, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, **head_dim)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(config).to(getattr(torch, dtype)).eval()


def build_trainer(target, args, output_dir: str):
    import torch

    from hf_treespark.drafter.configuration import TreeSparkConfig
    from hf_treespark.drafter.modeling import TreeSparkDrafter
    from hf_treespark.training.data import ReferenceSequence
    from hf_treespark.training.trainer import TrainConfig, Trainer

    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    count = args.batch_size * (args.warmup + args.steps + 2)
    refs = [ReferenceSequence(id=f"s{i}", prompt_len=16,
                              input_ids=torch.randint(4, vocab, (args.length,), generator=gen).tolist())
            for i in range(count)]
    torch.manual_seed(1)
    drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, mask_token_id=3, num_hidden_layers=1,
                                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                                          intermediate_size=2 * args.hidden, markov_rank=64))
    if args.draft_vocab_size:  # as `treespark train --draft-vocab-size N` (any N ids: the cost is the same)
        drafter.restrict_vocabulary(list(range(min(args.draft_vocab_size, vocab))))
    config = TrainConfig(output_dir=output_dir, max_steps=10**6, batch_size=args.batch_size,
                         anchors_per_sequence=args.anchors, save_every=10**6, log_every=10**6,
                         mixed_precision=args.mixed_precision)
    return Trainer(config, target, drafter, refs)


def step_times(trainer, loader) -> tuple[float, float, float]:
    """`(seconds, CPU seconds of this process)` of one train_step on the next batch, and the seconds of its target
    forward alone. CPU seconds hold still on a machine others load (they count this process's work only)."""
    import torch

    batch = next(loader)
    start = time.perf_counter()
    with torch.no_grad():
        trainer._features(batch)
    forward = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train_step(batch, 0)
    return time.perf_counter() - start, time.process_time() - cpu, forward


def measure(args) -> list[dict]:
    """Each target's fastest step and forward over `--steps` interleaved steps, its FLOPs and one profiled step."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, (arch, vocab, dtype) in enumerate(args.targets):
            trainer = build_trainer(build_target(arch, vocab or args.vocab, dtype, args), args, f"{tmp}/{i}")
            loader = iter(trainer._epoch_loader(0, 0))
            for _ in range(args.warmup):
                trainer.train_step(next(loader), 0)
            runs.append((f"{arch}:{vocab or args.vocab}:{dtype}", trainer, loader, []))
        for _ in range(args.steps):
            for _, trainer, loader, times in runs:
                times.append(step_times(trainer, loader))
        rows = []
        for name, trainer, loader, times in runs:
            counter = FlopCounterMode(display=False)
            with counter:
                trainer.train_step(next(loader), 0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.train_step(next(loader), 0)
            rows.append({"target": name, "step_s": min(t[0] for t in times), "cpu_s": min(t[1] for t in times),
                         "forward_s": min(t[2] for t in times),
                         "gflops": counter.get_total_flops() / 1e9, "precision": trainer.accelerator.mixed_precision,
                         "profile": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)})
        return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", type=target_spec, default=[target_spec(a) for a in ARCHS],
                   help="ARCH[:VOCAB[:DTYPE]] each")
    p.add_argument("--hidden", type=at_least(8), default=256)
    p.add_argument("--layers", type=at_least(1), default=8)
    p.add_argument("--heads", type=at_least(2), default=4)
    p.add_argument("--vocab", type=at_least(16), default=8192, help="a target's vocabulary when its spec has none")
    p.add_argument("--length", type=at_least(32), default=256, help="tokens per reference sequence")
    p.add_argument("--batch-size", type=at_least(1), default=2)
    p.add_argument("--anchors", type=at_least(1), default=16, help="anchors per sequence")
    p.add_argument("--warmup", type=at_least(0), default=1)
    p.add_argument("--steps", type=at_least(1), default=3)
    p.add_argument("--draft-vocab-size", type=at_least(1), help="train over N ids only (a draft vocabulary)")
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto")
    p.add_argument("--top", type=at_least(0), default=0, help="operators listed from a profiled step (0: none)")
    p.add_argument("--threads", type=at_least(1), help="torch threads (default: torch's)")
    p.add_argument("--config-head-dim", action="store_true",
                   help="leave head_dim to each config class (Qwen3Config's: 128; LlamaConfig's: hidden / heads)")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads{'' if args.config_head_dim else f', head_dim {args.hidden // args.heads}'}; batch "
          f"{args.batch_size} x {args.length} tokens, {args.anchors} anchors per sequence; draft vocabulary "
          f"{args.draft_vocab_size or 'none'}\n")
    print("| target (arch:vocabulary:weights) | step precision | step (s) | step (CPU s) | of which target forward (s) "
          "| step GFLOPs |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['target']} | {row['precision']} | {row['step_s']:.3f} | {row['cpu_s']:.3f} | "
              f"{row['forward_s']:.3f} | {row['gflops']:.1f} |")
    if args.top:
        for row in rows:
            print(f"\n{row['target']}: one profiled step, by self CPU time\n{row['profile']}")


if __name__ == "__main__":
    main()
