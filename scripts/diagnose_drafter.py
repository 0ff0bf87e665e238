"""Is the shipped drafter under- or over-fitting? Teacher-forced top-1 by depth on training positions (the first
25 records of the shared training file) and on the development set (held-out ShareGPT prompts 400-431, answered
by the target in float32 and cached in runs/dev_s13.jsonl), and a backoff n-gram table's depth-1 top-1 on the
same positions (the shipped datastore's index, and one built without the training file). About 5 minutes:

    .venv/bin/python scripts/diagnose_drafter.py [--data ../shared/data]
"""
import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from script_args import existing_dir

D = 4
TRAIN_FILE, HELDOUT_FILE = "sharegpt_smollm2_regen.jsonl", "sharegpt_smollm2_regen_part2.jsonl"
REPO_TURNS = Path(__file__).resolve().parents[1] / "training_data" / "sharegpt_turns_smollm2_regen.jsonl.gz"


def ngram_top1(index_store, ids, anchors):
    hits = 0
    for a in anchors.tolist():
        hist = ids[: a + 1].tolist()
        n, lo, hi = index_store.index.match(hist[-8:])
        if n == 0:
            continue
        follow = index_store.index.follow(lo, hi, 1)[:, 0]
        hits += Counter(follow.tolist()).most_common(1)[0][0] == int(ids[a + 1])
    return hits


def measure(target, drafter, store, heldout_store, refs):
    import torch

    from hf_treespark.decoding.engine import target_features
    from hf_treespark.training.data import collate_references

    hits, count, ng, ng_ho = torch.zeros(D), 0, 0, 0
    for ref in refs:
        t = collate_references([ref], pad_id=0)
        ids = t["input_ids"][0]
        feats, _ = target_features(target, drafter.config.target_layer_ids, t["input_ids"], t["attention_mask"])
        last = len(ids) - 1 - D
        if last < ref.prompt_len:
            continue
        anchors = torch.linspace(ref.prompt_len, last, min(32, last - ref.prompt_len + 1)).round().long().unique()
        out = drafter(anchor_ids=ids[anchors][None], anchor_positions=anchors[None], target_features=feats,
                      logit_slots=D)
        U = out.depth_logits.view(len(anchors), D, -1)
        parents = ids[anchors[:, None] + torch.arange(D)]
        truth = ids[anchors[:, None] + 1 + torch.arange(D)]
        pred = drafter.to_target_ids((U + drafter.markov_bias(parents)).argmax(-1))
        hits += (pred == truth).float().sum(0)
        count += len(anchors)
        ng += ngram_top1(store, ids, anchors)
        ng_ho += ngram_top1(heldout_store, ids, anchors)
    percent = lambda x: round(100 * float(x) / count, 1)  # noqa: E731
    return [percent(h) for h in hits], count, percent(ng), percent(ng_ho)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=existing_dir, default="../shared/data",
                        help=f"folder holding {TRAIN_FILE} and {HELDOUT_FILE}")
    args = parser.parse_args()
    data = Path(args.data)
    missing = [str(p) for p in (data / TRAIN_FILE, data / HELDOUT_FILE, REPO_TURNS) if not p.is_file()]
    if missing:
        parser.error(f"argument --data: {', '.join(missing)} missing: give the folder of the shared training data")

    import torch

    import hf_treespark
    from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR
    from hf_treespark.sources.datastore import Datastore, sequences_from_references
    from hf_treespark.training.data import load_references
    from hf_treespark.training.evaluate import DEV_PROMPTS, build_dev_set

    try:  # every input file is read before the target loads
        train = load_references(data / TRAIN_FILE, max_length=384, limit=DEV_PROMPTS.stop - DEV_PROMPTS.start)
        heldout_refs = load_references([data / HELDOUT_FILE, REPO_TURNS], max_length=1 << 30)
    except ValueError as err:
        parser.error(str(err))
    store = Datastore.load(DEFAULT_DRAFTER_DIR, 49152)
    heldout_store = Datastore.build(sequences_from_references(heldout_refs), 49152)
    torch.manual_seed(0)
    target, tok = hf_treespark.load_default_target(dtype=torch.float32)
    drafter = hf_treespark.load_default_drafter(dtype=torch.float32).bind_target(target)
    t0 = time.time()
    dev = build_dev_set(target, tok, "runs/dev_s13.jsonl", progress=False)
    print("dev set", len(dev), "in", round(time.time() - t0), "s", flush=True)
    train = train[: len(dev)]
    for name, refs in ((f"training ({TRAIN_FILE}, first {len(train)})", train),
                       ("development (held-out 400-431)", dev)):
        with torch.no_grad():
            acc, n, ng, ngho = measure(target, drafter, store, heldout_store, refs)
        print(f"{name}: {n} anchors; drafter teacher-forced top-1 d1..d{D} {acc}; n-gram (shipped store) d1 {ng}%; "
              f"n-gram (store without this file's first part) d1 {ngho}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
