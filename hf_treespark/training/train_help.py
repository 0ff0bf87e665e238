"""What `treespark train --help` says after its options: every data source it reads and every loss it trains with.

Written by hand, one entry per source and per `--loss` key, each saying what it is; tests/test_train_help.py derives
the lists from the code (the fields of `objective.LossConfig`, `trainer.PRESETS`, the mixture names of `data.py`,
the record fields and file kinds `--data` reads) and fails when one is missing here.
"""

from __future__ import annotations

import textwrap

DESCRIPTION = ("Train a TreeSpark drafter for a target: the DSpark losses plus TreeSpark's replayed survival and "
               "coverage terms, on the target's own answers (or any text), with checkpoints a rerun resumes from.")

DATA_SOURCES = """\
data it reads (and what it never reads, below):
  --data FILE ...        any mix of
    .jsonl / .jsonl.gz   records with prompt_ids and response_ids: the target's own answers, as written by
                         --regenerate (OUTPUT_DIR/references.jsonl), by `treespark answers`
                         (answers-NNNNN.jsonl.gz shards) or committed in training_data/
                         (sharegpt_turns_smollm2_regen.jsonl.gz, tail_sharegpt_smollm2_regen.jsonl.gz,
                         answers_self_standalone/); or chat records, messages ({role, content}) or
                         conversations (ShareGPT {from, value}): one sequence per assistant turn, in the
                         target's chat template
    .txt                 plain UTF-8 text, cut into windows of --max-length tokens
  --regenerate MIXTURE   prompts the target answers first (greedy), SOURCE:WEIGHT items, comma-separated:
    sharegpt             ShareGPT V3 first human turns of the training records (file positions below 12,000)
    sharegpt_turns       their second and later human turns, each with the conversation before it
    sharegpt_tail        first turns of the records from position 14,000 on (beyond the held-out band)
    sharegpt_tail_turns  later turns of those records
    hf:NAME              a `datasets` dataset (Hub name, data directory or file, or save_to_disk folder)
    PATH.jsonl           prompts, one a line: messages, conversations or prompt (a string)
  --dev-data FILE        development references (prompt_ids, response_ids), evaluated on, never trained on;
                         default training_data/dev/dev_set.jsonl.gz (207 held-out prompts of five kinds)
  --init-from DIR        a drafter to start from (a run's final/ or best/, or any save_pretrained drafter)
  held out (read by no training source): ShareGPT records 12,000-13,999 (the bench's sharegpt and copy suites,
  calibration, the development set), MT-Bench (the mtbench and multiturn suites), HumanEval, CHAMP (the math
  suite's problems, the development set's math concepts); where ShareGPT repeats one of their texts at a training
  position, the ShareGPT sources skip that prompt (hf_treespark/training/held_out.py)"""

# `--loss` keys: the fields of `objective.LossConfig` (defaults there)
LOSSES = {
    "ce": "weight of L_ce, cross-entropy of the teacher-forced p_k(. | y_{k-1}) with the label (--labels)",
    "l1": "weight of L_l1, the L1 distance between the drafter's p_k and the target's q_k",
    "conf": "weight of L_conf, binary cross-entropy of the confidence head c_k with 1 - TV(p_k, q_k)",
    "surv": "weight of L_surv, replayed survival: the tree policy is run from each anchor and the kept nodes' "
            "log-probabilities are weighted by the target's path mass",
    "cov": "weight of L_cov, replayed coverage: a capped hinge lifting the target's top tokens above each "
           "expanded parent's admission threshold",
    "gamma": "depth decay of the per-depth weights w_k = exp(-(k - 1) / gamma) (L_ce, L_l1, L_conf, L_cov)",
    "coverage_top_j": "how many of the target's most likely tokens L_cov lifts per parent",
    "coverage_margin": "the margin of L_cov's hinge, in log-probability",
    "coverage_cap": "the cap of L_cov's hinge per token",
    "replay_anchors": "replay the tree from this many evenly spaced anchors per sequence (null: all)",
}

# `--preset`: what each switches (the loss weights it zeroes, the drafter shape of a fresh drafter)
PRESETS_HELP = {
    "treespark": "every loss, head_dim 192 (the default)",
    "treespark_hd128": "every loss, head_dim 128",
    "no_survival": "surv 0, head_dim 192",
    "no_coverage": "cov 0, head_dim 192",
    "dspark_tree": "surv 0 and cov 0 (DSpark's losses), head_dim 192",
    "dspark": "surv 0 and cov 0, head_dim 128, a chain: tree_topk 1, tree_frontier 1, tree_budget 7",
}


def _table(rows: dict[str, str]) -> str:
    """`rows` as lines `  NAME  description`, the descriptions wrapped under each other."""
    return "\n".join(textwrap.fill(text, 110, initial_indent=f"  {name:<16} ", subsequent_indent=" " * 19)
                     for name, text in rows.items())


def epilog() -> str:
    """The text after the options: the data sources, the `--loss` keys and the presets."""
    losses, presets = _table(LOSSES), _table(PRESETS_HELP)
    return (f"{DATA_SOURCES}\n\nlosses, --loss '{{\"KEY\": VALUE, ...}}' (L = sum of weight x term; the "
            f"--preset sets some weights first):\n{losses}\n\npresets:\n{presets}\n\nfrozen parts: --train-only; "
            "the best drafter on the development set: OUTPUT_DIR/best/ with --eval-every\n(docs/training.md)")
