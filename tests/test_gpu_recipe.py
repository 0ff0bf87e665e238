"""The GPU recipe (`scripts/gpu_recipe.py`) rehearsed on the CPU with a tiny random-weight target: its answers,
its distilled head and its paired development comparison, each written to metrics.json; the dry run; the refusals
(CUDA missing, a bad option) before anything runs; a phase past its limit is interrupted and keeps what it wrote."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_drafter

from hf_treespark import TreeSparkDrafter
from hf_treespark.hub import assets
from hf_treespark.training.depth1 import grow_depth1_head

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe():
    """scripts/gpu_recipe.py as a module (the scripts import `script_args` from their own folder)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("gpu_recipe", REPO / "scripts" / "gpu_recipe.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_recipe"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return module


def _gzip_jsonl(path: Path, records: list[dict]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _answers(target, count: int, seed: int, new_tokens: int = 12) -> list[dict]:
    """The tiny target's greedy answers to random prompts (prompt_ids, response_ids)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(10, 2000, (6,), generator=gen)
        full = target.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long), do_sample=False,
                               max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        out.append({"id": f"r{seed}-{i}", "prompt_ids": prompt.tolist(), "response_ids": full[0, 6:].tolist()})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with the default target's tokenizer (its chat template) and a drafter for it, saved; the
    prompts, a folder of two earlier answers to go on from, more answers to distil and a development file."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("recipe")
    tokenizer = AutoTokenizer.from_pretrained(assets.default_target_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits, so greedy continuations are not all near-ties
        target.lm_head.weight.mul_(8.0)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    make_drafter(target).save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: "
                                                                        "why is the sky blue?"}]}) + "\n"
                               for i in range(6)))
    earlier = root / "earlier"
    earlier.mkdir()
    (earlier / "answers.json").write_text(json.dumps({"target": str(root / "target"), "prompts": str(prompts),
                                                      "max_new_tokens": 12, "sample": None, "seed": 0,
                                                      "question_temperature": 1.0}))
    _gzip_jsonl(earlier / "answers-00000.jsonl.gz",
                [{**a, "id": f"p{i}", "source": str(prompts), "prompt": "earlier"}
                 for i, a in enumerate(_answers(target, 2, seed=1))])
    _gzip_jsonl(root / "data.jsonl.gz", _answers(target, 3, seed=2))
    dev = root / "dev.jsonl"
    dev.write_text("".join(json.dumps({**a, "id": f"d{i}", "kind": ("chat", "code")[i % 2]}) + "\n"
                           for i, a in enumerate(_answers(target, 4, seed=3, new_tokens=16))))
    return root


def _tiny_argv(root: Path, out: Path) -> list[str]:
    return ["--device", "cpu", "--minutes", "10", "--target", str(root / "target"), "--drafter", str(root / "drafter"),
            "--prompts", str(root / "prompts.jsonl"), "--answers-from", str(root / "earlier"),
            "--data", str(root / "data.jsonl.gz"), "--dev-data", str(root / "dev.jsonl"), "--max-new-tokens", "12",
            "--slots", "4", "--width", "32", "--max-length", "64", "--batch-size", "2", "--train-batch-size", "16",
            "--buffer-positions", "256", "--distil-rate", "1000", "--output-dir", str(out)]


def test_the_recipe_rehearsed_on_a_cpu_answers_distils_and_measures_the_trained_head(recipe, tiny, tmp_path):
    out = tmp_path / "run"
    assert recipe.main(_tiny_argv(tiny, out)) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["machine"]["device"] == "cpu" and metrics["minutes"] == 10
    assert metrics["budget_s"] == {"answers": 300.0, "distil": 210.0, "evaluate": 90.0}
    for phase in recipe.PHASES:
        assert (out / f"{phase}.log").is_file() and metrics[phase]["seconds"] > 0, phase

    answers = metrics["answers"]
    records = list(recipe._answer_records(out / "answers"))
    earlier = list(recipe._answer_records(tiny / "earlier"))
    assert sorted(r["id"] for r in records) == [f"p{i}" for i in range(6)]  # the two earlier ones not asked again
    assert [r for r in records if r["id"] in ("p0", "p1")] == earlier
    new = [r for r in records if r["id"] not in ("p0", "p1")]
    assert answers["status"] == "done" and answers["answers"] == 4 and answers["carried_answers"] == 2
    assert answers["answer_tokens"] == sum(len(r["response_ids"]) for r in new) > 0
    assert "--device cpu" in answers["command"] and "--num-prompts 20002" in answers["command"]

    distil = metrics["distil"]
    shards = sorted(str(p) for p in (out / "answers").glob("answers-*.jsonl.gz"))
    assert distil["status"] == "done" and distil["sources"] == [str(tiny / "data.jsonl.gz"), *shards]
    held = sum(len(r["response_ids"]) for r in records) + 3 * 12
    assert distil["positions_available"] == held and distil["max_positions"] == held
    assert 0 < distil["positions"] <= held and distil["steps"] > 0 and distil["positions_per_s"] > 0
    trained = TreeSparkDrafter.from_pretrained(distil["drafter"])
    assert trained.config.depth1_head == 32 and Path(distil["drafter"]) == out / "distil" / "final"
    fresh = grow_depth1_head(TreeSparkDrafter.from_pretrained(tiny / "drafter"), 32, fresh=True)
    assert not fresh.depth1_head.out.weight.any() and trained.depth1_head.out.weight.any()  # zero until trained

    evaluate = metrics["evaluate"]
    assert evaluate["status"] == "done" and evaluate["references"] == 4
    assert evaluate["anchors"] == 4 * 15  # every response token but the last, of four 16-token answers
    assert [k["kind"] for k in evaluate["kinds"]] == ["chat", "code"]
    assert sum(k["anchors"] for k in evaluate["kinds"]) == evaluate["anchors"]
    for scores in (evaluate, *evaluate["kinds"]):
        assert 0 <= scores["start_top1"] <= 100 and 0 <= scores["trained_top1"] <= 100
        assert scores["difference_points"] == pytest.approx(scores["trained_top1"] - scores["start_top1"], abs=0.02)
    summary = (out / "summary.md").read_text()
    for phase in recipe.PHASES:
        assert f"| {phase} | {metrics[phase]['seconds']:.0f} ({metrics[phase]['limit_s']:.0f}) | done |" in summary
    assert f"trained {evaluate['trained_top1']:.2f}" in summary and "| 4 answers, " in summary

    # a stopped run's drafter is its last checkpoint's head on the drafter it started from: here the same as final/
    kept = recipe.head_from_checkpoint(out / "distil", str(tiny / "drafter"), 32, fresh=True)
    for name, value in trained.state_dict().items():
        assert torch.equal(TreeSparkDrafter.from_pretrained(kept).state_dict()[name], value), name


def test_a_dry_run_prints_the_budgets_and_the_commands_and_writes_nothing(recipe, tmp_path, capsys):
    out = tmp_path / "never"
    assert recipe.main(["--dry-run", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    committed = len(recipe._answer_ids(recipe.COMMITTED_ANSWERS))
    assert f"going on from {recipe.COMMITTED_ANSWERS} ({committed:,} answers" in printed
    lines = {line.split()[0]: line for line in printed.splitlines() if line.startswith("  ")}
    assert "360 s" in lines["answers"] and "252 s" in lines["distil"] and "108 s" in lines["evaluate"]
    assert "--device cuda" in lines["answers"] and f"--num-prompts {committed + 20_000}" in lines["answers"]
    assert "--slots 256" in lines["answers"]
    for path in recipe.COMMITTED_DATA:
        assert str(path) in lines["distil"]
    assert str(recipe.DEV_SET) not in lines["distil"] and "--fresh-head" in lines["distil"]
    assert "--batch-size 64 --train-batch-size 1024" in lines["distil"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_is_refused_in_one_line_before_anything_loads_or_is_written(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_recipe.py", "--output-dir", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "--device cuda: this machine has no CUDA GPU" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--data", "training_data/dev/dev_set.jsonl.gz"], "is the development set"),
    (["--answers-from", "training_data/answers_self_standalone", "--max-new-tokens", "64"],
     "holds answers made with other max_new_tokens (max_new_tokens=256)"),
    (["--answers-from", "training_data/dev"], "has no answers.json"),
    (["--device", "tpu"], "'tpu' is not cpu, cuda or cuda:N"),
])
def test_bad_options_are_refused_in_one_line_before_anything_runs(recipe, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as refused:
        recipe.main([*argv, "--output-dir", str(tmp_path / "out")])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_used_output_dir_is_refused(recipe, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit):
        recipe.main(["--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert "is not empty" in capsys.readouterr().err


def test_a_phase_past_its_limit_is_interrupted_and_writes_what_it_holds(recipe, tmp_path):
    """SIGINT at the limit: the command writes what it holds (as `treespark answers` writes its last shard) and ends;
    one that ends by itself is done, or failed with its exit status."""
    endless = ("import sys, time\nprint('ready', flush=True)\ntry:\n    while True:\n        time.sleep(0.05)\n"
               "except KeyboardInterrupt:\n    print('flushed', flush=True)\n    sys.exit(130)\n")
    ran = recipe.run_phase([sys.executable, "-c", endless], tmp_path / "endless.log", limit_s=2.0)
    log = (tmp_path / "endless.log").read_text()
    assert ran.status == "stopped at its time limit" and ran.returncode == 130
    assert log.startswith(f"$ {sys.executable} -c ") and log.rstrip().endswith("ready\nflushed")
    assert recipe.run_phase([sys.executable, "-c", "pass"], tmp_path / "a.log", limit_s=60).status == "done"
    failed = recipe.run_phase([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "b.log", limit_s=60)
    assert failed.status == "failed (exit 3)" and failed.returncode == 3


def test_distil_positions_are_what_the_sources_hold_or_what_the_time_affords(recipe, tmp_path):
    path = _gzip_jsonl(tmp_path / "a.jsonl.gz", [{"prompt_ids": [1], "response_ids": [5] * n} for n in (3, 4)])
    assert recipe.positions_in([path]) == 7
    assert recipe.max_positions(7, seconds=100, rate=1000) == 7
    assert recipe.max_positions(10**6, seconds=100, rate=1000) == int(1000 * 100 * recipe.POSITIONS_TIME)
    assert recipe.max_positions(10**6, seconds=0, rate=1000) == 1
    (tmp_path / "bad.jsonl").write_text('{"response_ids": [1]}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: not a JSON object with a list 'response_ids'"):
        recipe.positions_in([tmp_path / "bad.jsonl"])
