"""Train a TreeSpark drafter.

    # offline default target, the shared regenerated ShareGPT responses, TreeSpark losses
    python examples/train_drafter.py --target default --data ../shared/data/sharegpt_smollm2_regen.jsonl \\
        --preset treespark --output-dir runs/treespark

    # regenerate reference responses with the target first (resumable), from a prompt mixture
    python examples/train_drafter.py --target default --regenerate "sharegpt:0.7,my_code.jsonl:0.3" \\
        --num-prompts 2000 --output-dir runs/treespark

    # several GPUs or machines
    accelerate launch examples/train_drafter.py --target Qwen/Qwen3-4B --data refs.jsonl --output-dir runs/q4b

Presets (one switch each): dspark, dspark_tree, treespark, no_survival, no_coverage, treespark_hd128.
An interrupted run resumes from its last checkpoint when started again with the same --output-dir.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import PartialState

from hf_treespark import TreeSparkConfig, TreeSparkDrafter, assets
from hf_treespark.hub import push_drafter_to_hub, save_drafter
from hf_treespark.training.data import load_references, mix_prompts, parse_mixture, regenerate_responses
from hf_treespark.training.objective import LossConfig
from hf_treespark.training.trainer import PRESETS, TrainConfig, Trainer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a name/path")
    p.add_argument("--data", nargs="*", default=[], help="reference JSONL files (prompt_ids, response_ids)")
    p.add_argument("--regenerate", help="prompt mixture to regenerate responses for, e.g. 'sharegpt:1.0'")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--regen-batch-size", type=int, default=32)
    p.add_argument("--regen-max-new-tokens", type=int, default=256)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="treespark")
    p.add_argument("--init-from", help="start from this drafter instead of a fresh one")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, help="override the preset's head dim")
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--mask-token-id", type=int, help="spare token id for mask slots (default: 16 for SmolLM2, "
                   "else a learned mask embedding)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--max-sequences", type=int)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--anchors", type=int, default=64, help="anchors per sequence")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--feature-cache", help="directory for cached target features (default: OUTPUT_DIR/feature_cache;"
                   " measured faster than a target forward per step on a 2-core CPU)")
    p.add_argument("--no-feature-cache", action="store_true", help="recompute target features every step")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss", type=json.loads, default={}, help='loss overrides, e.g. \'{"surv": 1.0}\'')
    p.add_argument("--push-to-hub", help="repository id to push the trained drafter to")
    return p.parse_args()


def load_target(name: str):
    if name == "default":
        return assets.load_default_target()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, attn_implementation="sdpa"), AutoTokenizer.from_pretrained(name)


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir)
    state = PartialState()
    target, tokenizer = load_target(args.target)
    data = list(args.data)
    if args.regenerate:
        regen = out / "references.jsonl"
        if state.is_main_process:
            prompts = mix_prompts(parse_mixture(args.regenerate), args.num_prompts, seed=args.seed)
            regenerate_responses(target.to(state.device), tokenizer, prompts, regen,
                                 batch_size=args.regen_batch_size, max_new_tokens=args.regen_max_new_tokens)
        state.wait_for_everyone()
        data.append(regen)
    if not data:
        raise SystemExit("give --data files or --regenerate a prompt mixture")
    references = load_references(data, max_length=args.max_length, limit=args.max_sequences)

    if args.init_from:
        drafter = TreeSparkDrafter.from_pretrained(args.init_from)
    else:
        mask = args.mask_token_id if args.mask_token_id is not None else (16 if args.target == "default" else None)
        fields = dict(num_hidden_layers=args.draft_layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate_size,
                      markov_rank=args.markov_rank, mask_token_id=mask)
        fields.update(PRESETS[args.preset][1])
        if args.head_dim:
            fields["head_dim"] = args.head_dim
        if args.target == "default":
            fields["target_name_or_path"] = assets.DEFAULT_TARGET_NAME
        torch.manual_seed(args.seed)
        drafter = TreeSparkDrafter(TreeSparkConfig.for_target(target, **fields))

    cache = None if args.no_feature_cache else (args.feature_cache or str(out / "feature_cache"))
    config = TrainConfig(output_dir=str(out), preset=args.preset, epochs=args.epochs, max_steps=args.max_steps,
                         batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
                         anchors_per_sequence=args.anchors, save_every=args.save_every, seed=args.seed,
                         feature_cache=cache,
                         tensorboard=args.tensorboard,
                         loss=LossConfig(**args.loss))
    trainer = Trainer(config, target, drafter, references)
    result = trainer.train()
    if state.is_main_process:
        drafter = trainer.unwrapped_drafter()
        save_drafter(drafter, out / "final")
        print(f"trained {result['steps']} steps in {result['seconds']:.0f} s; drafter saved to {out / 'final'}")
        if args.push_to_hub:
            push_drafter_to_hub(drafter, args.push_to_hub)


if __name__ == "__main__":
    main()
