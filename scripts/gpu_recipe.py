"""The GPU recipe: one command that, within a wall-clock budget (default 12 minutes), has the target answer prompts
itself, trains the drafter's depth-1 head on those answers and the committed ones, and measures the trained drafter
against the one it started from on the development set. Three phases, each given a share of the budget:

    answers    `treespark answers` (greedy, bf16 on CUDA), going on from the committed answers folder
               (training_data/answers_self_standalone: its prompts are skipped, its questions not asked again);
               stopped by SIGINT when its share is spent (the verb writes its last shard and exits)
    distil     `treespark distil` on those answers plus the committed regenerated answers (never the development
               set), one learning-rate schedule over min(the positions the sources hold, what --distil-rate affords
               in the time left); interrupted past its share plus a grace, its last checkpoint's head is kept
    evaluate   development depth-1 top-1 of the starting drafter and of the trained one, and their paired
               difference with its standard error clustered by prompt (`training.dev_compare`, as
               scripts/compare_drafters_dev.py)

Writes OUTPUT_DIR/metrics.json (per phase: seconds, what it produced, its rate; the development scores), a table in
OUTPUT_DIR/summary.md, and each phase's log (OUTPUT_DIR/<phase>.log). Exit status 0 when every phase produced its
output. docs/devices.md says what each phase does and what it writes.

    .venv/bin/python scripts/gpu_recipe.py --output-dir runs/gpu_recipe             # on a CUDA machine
    .venv/bin/python scripts/gpu_recipe.py --dry-run                                # the commands and the budgets
    .venv/bin/python scripts/gpu_recipe.py --device cpu --target DIR --drafter DIR --prompts P.jsonl ...  # rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from script_args import at_least, drafter_dir, existing_dir, existing_file, output_dir, positive_number

REPO = Path(__file__).resolve().parents[1]
PHASES = ("answers", "distil", "evaluate")
SHARES = {"answers": 0.50, "distil": 0.35, "evaluate": 0.15}  # of --minutes; what a phase leaves goes to the next
GRACE = 0.05  # of --minutes: how far past its share distil may run before it is interrupted
POSITIONS_TIME = 0.7  # of distil's time: the positions' share; the rest loads the models and the development set
STOP_WAIT_S = 30  # after SIGINT, how long a verb has to write its last shard or checkpoint before it is killed
DEFAULT_PROMPTS = "self,sharegpt_standalone"
COMMITTED_ANSWERS = REPO / "training_data" / "answers_self_standalone"  # `treespark answers`' folder, its options
COMMITTED_DATA = (REPO / "training_data" / "sharegpt_turns_smollm2_regen.jsonl.gz",
                  REPO / "training_data" / "tail_sharegpt_smollm2_regen.jsonl.gz")
DEV_SET = REPO / "training_data" / "dev" / "dev_set.jsonl.gz"

# Per device kind, and where each number came from. cpu: the verbs' own defaults (measured on 2-core CPUs,
# docs/answers.md and docs/training.md). cuda: distil's options of the 8M-position run on an H200 (docs/training.md,
# "8M positions on a GPU": 27,000 positions/s end to end at one pass, two runs sharing the GPU); the planning rate
# allows for --passes 2 and own answers' unlabelled prompts; 256 answer rows is a guess, not yet measured on a GPU.
DEVICE_DEFAULTS = {
    "cuda": {"slots": 256, "distil_rate": 15_000, "batch_size": 64, "train_batch_size": 1024,
             "buffer_positions": 262_144, "eval_every": 250},
    "cpu": {"slots": 96, "distil_rate": 300, "batch_size": 8, "train_batch_size": 256, "buffer_positions": 65_536,
            "eval_every": 500},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a rehearsal)")
    p.add_argument("--minutes", type=positive_number, default=12.0, help="the wall-clock budget of all three phases")
    p.add_argument("--output-dir", type=output_dir, default="runs/gpu_recipe",
                   help="where everything goes (a new or empty directory)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the phases' budgets and commands, check that the commands parse; run nothing")
    p.add_argument("--target", default="default", help="'default' (offline SmolLM2-135M-Instruct) or a path")
    p.add_argument("--drafter", type=drafter_dir, help="the drafter to start from (default: the shipped drafter)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="`treespark answers --prompts`")
    p.add_argument("--num-prompts", type=at_least(1), default=20_000,
                   help="new answers at most (the answers' share of the budget usually ends the phase first)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=256, help="an answer stops here")
    p.add_argument("--slots", type=at_least(1), help="answer rows decoding at once (default: 256 on cuda, 96 on cpu)")
    p.add_argument("--answers-from",
                   help="a `treespark answers` folder to go on from, copied first (its prompts are skipped and its "
                        "answers distilled too); 'none': start empty (default: training_data/answers_self_standalone "
                        "with the default target, prompts and --max-new-tokens; else none)")
    p.add_argument("--data", nargs="+", type=existing_file,
                   help="more of the target's answers to distil (prompt_ids, response_ids; .jsonl[.gz]); never the "
                        "development set (default: training_data's two regenerated files with the default target, "
                        "else none)")
    p.add_argument("--dev-data", type=existing_file,
                   help="development references (default: the committed set with the default target; with another "
                        "target, distil answers the same prompts first into OUTPUT_DIR/distil/dev_set.jsonl.gz)")
    p.add_argument("--head", choices=("fresh", "continue"), default="fresh",
                   help="train a fresh depth-1 head of --width, or continue the drafter's own")
    p.add_argument("--width", type=at_least(1), default=2048, help="a fresh head's MLP width")
    p.add_argument("--passes", type=positive_number, default=2.0, help="optimizer samples per distilled position")
    p.add_argument("--lr", type=positive_number, default=1e-3, help="peak learning rate")
    p.add_argument("--max-length", type=at_least(2), default=512, help="distil's tokens per window")
    p.add_argument("--batch-size", type=at_least(1), help="windows per target forward (default: 64 cuda, 8 cpu)")
    p.add_argument("--train-batch-size", type=at_least(1), help="positions per step (default: 1024 cuda, 256 cpu)")
    p.add_argument("--buffer-positions", type=at_least(1), help="the shuffle buffer (default: 262144 cuda, 65536 cpu)")
    p.add_argument("--distil-rate", type=positive_number,
                   help="planned positions/s of distil, to fit its positions to its time (default: 15000 cuda, 300 "
                        "cpu)")
    return p


# ----- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What the run does: the options resolved, the phases' budgets and the paths."""

    args: argparse.Namespace
    out: Path
    budget: dict[str, float]  # seconds per phase
    answers_from: Path | None
    data: list[Path]

    @property
    def kind(self) -> str:
        return "cuda" if self.args.device.startswith("cuda") else "cpu"

    def option(self, name: str):
        value = getattr(self.args, name, None)  # eval_every is no option: the table's
        return DEVICE_DEFAULTS[self.kind][name] if value is None else value

    def answers_command(self, carried: int) -> list[str]:
        a = self.args
        return [*treespark("answers"), "--target", a.target, "--prompts", a.prompts,
                "--num-prompts", str(carried + a.num_prompts), "--slots", str(self.option("slots")),
                "--max-new-tokens", str(a.max_new_tokens), "--shard-answers", "64", "--device", a.device,
                "--output-dir", str(self.out / "answers")]

    def distil_command(self, sources: list[str], max_positions: int | str) -> list[str]:
        a = self.args
        every, batch = str(self.option("eval_every")), str(self.option("batch_size"))
        return [*treespark("distil"), "--target", a.target, *(["--drafter", a.drafter] if a.drafter else []),
                "--sources", *sources, "--max-length", str(a.max_length), "--batch-size", batch,
                "--train-batch-size", str(self.option("train_batch_size")),
                "--buffer-positions", str(self.option("buffer_positions")), "--passes", str(a.passes),
                "--max-positions", str(max_positions), "--lr", str(a.lr), "--width", str(a.width),
                *(["--fresh-head"] if a.head == "fresh" else []), *(["--dev-data", a.dev_data] if a.dev_data else []),
                "--eval-every", every, "--save-every", every, "--device", a.device,
                "--output-dir", str(self.out / "distil")]

    def dev_path(self) -> Path:
        if self.args.dev_data:
            return Path(self.args.dev_data)
        return DEV_SET if self.args.target == "default" else self.out / "distil" / "dev_set.jsonl.gz"


def treespark(verb: str) -> list[str]:
    return [sys.executable, "-m", "hf_treespark.cli", verb]


def make_plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    """The options checked and resolved (`p.error` on a bad one: one line, status 2); nothing is loaded."""
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        p.error(f"argument --device: {args.device!r} is not cpu, cuda or cuda:N")
    default = args.target == "default"
    settings = {"target": args.target, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                "sample": None, "seed": 0, "question_temperature": 1.0}  # `treespark answers`' answers.json
    if args.answers_from is None:
        fits = default and args.prompts == DEFAULT_PROMPTS and _answers_settings(COMMITTED_ANSWERS) == settings
        answers_from = COMMITTED_ANSWERS if fits else None
    elif args.answers_from == "none":
        answers_from = None
    else:
        try:
            answers_from = Path(existing_dir(args.answers_from))
        except argparse.ArgumentTypeError as err:
            p.error(f"argument --answers-from: {err}")
        saved = _answers_settings(answers_from)
        if saved is None:
            p.error(f"argument --answers-from: {answers_from} has no answers.json: give a `treespark answers` folder")
        changed = sorted(k for k in settings if saved.get(k) != settings[k])
        if changed:
            p.error(f"argument --answers-from: {answers_from} holds answers made with other {', '.join(changed)} "
                    f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): give the same options, or "
                    "--answers-from none")
    data = [Path(d) for d in args.data] if args.data else list(COMMITTED_DATA) if default else []
    dev = Path(args.dev_data).resolve() if args.dev_data else DEV_SET.resolve()
    for path in data:
        if path.resolve() in (dev, DEV_SET.resolve()):
            p.error(f"argument --data: {path} is the development set: the trained head is measured on it, never "
                    "trained on it")
    if len(set(map(Path.resolve, data))) != len(data):
        p.error("argument --data: a file is listed twice")
    out = Path(args.output_dir)
    if not args.dry_run and out.is_dir() and any(out.iterdir()):
        p.error(f"argument --output-dir: {out} is not empty (a recipe run starts from nothing): give a new directory")
    seconds = args.minutes * 60
    return Plan(args, out, {name: share * seconds for name, share in SHARES.items()}, answers_from, data)


def _answers_settings(folder: Path) -> dict | None:
    try:
        value = json.loads((folder / "answers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def positions_in(paths: list[Path]) -> int:
    """The positions `treespark distil` labels in answers (`prompt_ids`, `response_ids`), at most: one per response
    token (a window's first token is not one, nor under `--anchors agreeing` a token that is not the target's
    argmax; the target's own greedy answers are, but for near-ties)."""
    total = 0
    for path in paths:
        with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
            for number, line in enumerate(f, 1):
                try:
                    record = json.loads(line) if line.strip() else {}
                    total += len(record.get("response_ids", []))
                except (ValueError, AttributeError, TypeError):
                    raise ValueError(f"{path}, line {number}: not a JSON object with a list 'response_ids' (the "
                                     "target's answers, as `treespark answers` writes them)") from None
    return total


def max_positions(available: int, seconds: float, rate: float) -> int:
    """One schedule's positions: what the sources hold, or what `rate` positions/s afford in the positions' share
    of `seconds` (`POSITIONS_TIME`), whichever is fewer; at least 1."""
    return max(1, min(available, int(rate * seconds * POSITIONS_TIME)))


def words(command: list[str]) -> str:
    return shlex.join(command)


def dry_run(plan: Plan) -> int:
    """Print the budgets and the commands, and parse each command with its verb's own parser; write nothing."""
    from hf_treespark.training import answers_cli, distill

    carried = len(_answer_ids(plan.answers_from)) if plan.answers_from else 0
    sources = [*map(str, plan.data), str(plan.out / "answers" / "answers-*.jsonl.gz")]
    commands = {"answers": plan.answers_command(carried), "distil": plan.distil_command(sources, "N")}
    for verb, add in (("answers", answers_cli.add_arguments), ("distil", distill.add_arguments)):
        check = argparse.ArgumentParser(prog=f"treespark {verb}")
        add(check)
        check.parse_args([w if w != "N" else "1" for w in commands[verb][4:]])
    print(f"gpu_recipe: {plan.args.minutes:g} minutes on {plan.args.device}; output in {plan.out}/")
    if plan.answers_from:
        print(f"  going on from {plan.answers_from} ({carried:,} answers, copied to {plan.out / 'answers'})")
    for name in PHASES:
        print(f"  {name:9s} {plan.budget[name]:5.0f} s  "
              + (words(commands[name]) if name in commands else
                 f"depth-1 top-1 of {plan.args.drafter or 'the shipped drafter'} and {plan.out / 'distil' / 'final'} "
                 f"on {plan.dev_path()}, paired"))
    print(f"  distil's N: min(the positions in its sources, {plan.option('distil_rate'):g} positions/s x "
          f"{POSITIONS_TIME:g} of its time left); it is interrupted {GRACE * plan.args.minutes * 60:.0f} s past its "
          "share")
    print("gpu_recipe: dry run: the commands parse; nothing run")
    return 0


# ----- running a phase ----------------------------------------------------------------------------------------------


@dataclass
class PhaseRun:
    status: str  # "done", "stopped at its time limit", "failed (exit N)"
    seconds: float
    returncode: int


def run_phase(command: list[str], log: Path, limit_s: float, stop_wait_s: float = STOP_WAIT_S) -> PhaseRun:
    """Run `command`, its output into `log`; past `limit_s` seconds send it SIGINT (the
    verbs write what they hold and exit 130), and kill it when it has not ended `stop_wait_s` later."""
    began = time.monotonic()
    stopped = False
    with open(log, "w", encoding="utf-8") as f:
        f.write(f"$ {words(command)}\n")
        f.flush()
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT)  # paths as the caller gave them
        try:
            returncode = process.wait(timeout=max(limit_s, 0.0))
        except subprocess.TimeoutExpired:
            stopped = True
            process.send_signal(signal.SIGINT)
            try:
                returncode = process.wait(timeout=stop_wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                returncode = process.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the verb too: let it write its shard or checkpoint
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=stop_wait_s)
            process.kill()
            raise
    status = "stopped at its time limit" if stopped else "done" if returncode == 0 else f"failed (exit {returncode})"
    return PhaseRun(status, time.monotonic() - began, returncode)


def _answer_ids(folder: Path) -> set[str]:
    return {record["id"] for record in _answer_records(folder)}


def _answer_records(folder: Path):
    for path in sorted(folder.glob("answers-*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield from (json.loads(line) for line in f if line.strip())


def answers_phase(plan: Plan, limit_s: float) -> dict:
    """Phase 1: the target's own answers into OUTPUT_DIR/answers (after a copy of `plan.answers_from`)."""
    folder = plan.out / "answers"
    folder.mkdir(parents=True)
    carried = set()
    if plan.answers_from:
        for path in [plan.answers_from / "answers.json", *sorted(plan.answers_from.glob("answers-*.jsonl.gz"))]:
            shutil.copy2(path, folder / path.name)
        carried = _answer_ids(folder)
    command = plan.answers_command(len(carried))
    ran = run_phase(command, plan.out / "answers.log", limit_s)
    new = [r for r in _answer_records(folder) if r["id"] not in carried]
    tokens = sum(len(r["response_ids"]) for r in new)
    return {**_phase_fields(ran, limit_s, command, "answers.log"), "answers": len(new), "answer_tokens": tokens,
            "tokens_per_s": round(tokens / max(ran.seconds, 1e-9), 1), "carried_answers": len(carried),
            "output": str(folder)}


def _phase_fields(ran: PhaseRun, limit_s: float, command: list[str], log: str) -> dict:
    return {"status": ran.status, "seconds": round(ran.seconds, 1), "limit_s": round(limit_s, 1),
            "command": words(command), "log": log}


def distil_phase(plan: Plan, seconds: float) -> dict:
    """Phase 2: `treespark distil` on the committed data and every answer in OUTPUT_DIR/answers; `seconds` is its
    time (its share and what the answers left), past which (plus `GRACE`) it is interrupted."""
    shards = sorted((plan.out / "answers").glob("answers-*.jsonl.gz"))
    sources = [*plan.data, *shards]
    available = positions_in(sources)
    if not available:
        return {"status": "not run: no answer to distil", "seconds": 0.0, "limit_s": round(seconds, 1),
                "positions_available": 0}
    count = max_positions(available, seconds, plan.option("distil_rate"))
    command = plan.distil_command([str(s) for s in sources], count)
    ran = run_phase(command, plan.out / "distil.log", seconds + GRACE * plan.args.minutes * 60)
    fields = {**_phase_fields(ran, seconds, command, "distil.log"), "sources": [str(s) for s in sources],
              "positions_available": available, "max_positions": count}
    rows = _metrics_rows(plan.out / "distil" / "metrics.jsonl")
    if rows:
        fields.update(positions=rows[-1]["positions_seen"], positions_per_s=rows[-1]["positions_per_s"],
                      steps=rows[-1]["step"], dev_top1_start=rows[0].get("dev_top1"),
                      dev_top1_end=rows[-1].get("dev_top1"))
    final = plan.out / "distil" / "final"
    if not (final / "config.json").is_file() and ran.status.startswith("stopped"):
        kept = head_from_checkpoint(plan.out / "distil", plan.args.drafter, plan.args.width, plan.args.head == "fresh")
        final = kept or final
    fields["drafter"] = str(final) if (final / "config.json").is_file() else None
    return fields


def _metrics_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def head_from_checkpoint(distil_dir: Path, drafter: str | None, width: int, fresh: bool) -> Path | None:
    """The drafter of a stopped distil run: `drafter` (None: the shipped one) grown by a head of `width` (`fresh`: a
    new one, as `distil --fresh-head`), holding the head of `distil_dir/checkpoint.pt`, saved as
    `distil_dir/checkpoint_drafter`; None when there is no checkpoint."""
    import torch

    from hf_treespark.drafter.modeling import TreeSparkDrafter
    from hf_treespark.hub.assets import DEFAULT_DRAFTER_DIR
    from hf_treespark.training.depth1 import grow_depth1_head

    path = distil_dir / "checkpoint.pt"
    if not path.is_file():
        return None
    state = torch.load(path, weights_only=True, map_location="cpu")
    base = TreeSparkDrafter.from_pretrained(drafter or DEFAULT_DRAFTER_DIR, dtype=torch.float32)
    stored = base.config.dtype if isinstance(getattr(base.config, "dtype", None), str) else "bfloat16"
    grown = grow_depth1_head(base, width, fresh=fresh)
    grown.depth1_head.load_state_dict(state["head"])
    grown.save_pretrained(distil_dir / "checkpoint_drafter", dtype=getattr(torch, stored))
    return distil_dir / "checkpoint_drafter"


def evaluate_phase(plan: Plan, trained: str, limit_s: float) -> dict:
    """Phase 3: the starting and the trained drafter's development depth-1 top-1 (%), paired, with standard errors
    clustered by prompt; the log in OUTPUT_DIR/evaluate.log. Its share is reported, not enforced."""
    began = time.monotonic()
    with open(plan.out / "evaluate.log", "w", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        rows, references = paired_depth1(plan.args.target, plan.args.drafter, trained, plan.dev_path(),
                                         plan.args.device)
        from hf_treespark.training.dev_compare import markdown_table

        print(markdown_table(rows, "start", "trained"))
    seconds = time.monotonic() - began
    status = "done" if seconds <= limit_s else "done, past its share"
    return {"status": status, "seconds": round(seconds, 1), "limit_s": round(limit_s, 1), "log": "evaluate.log",
            "dev_data": str(plan.dev_path()), "references": references,
            "references_per_s": round(references / max(seconds, 1e-9), 2),
            **_scores(rows[-1]), "kinds": [{"kind": r.kind, **_scores(r)} for r in rows[:-1]]}


def paired_depth1(target_name: str, base: str | None, trained: str, dev_path: Path, device: str):
    """`(rows, references)`: `dev_compare.compare_depth1`'s rows (per kind, then "all") of drafter `base` (None: the
    shipped one) as A and `trained` as B, both bound to the target in its "auto" precision on `device`."""
    import torch

    from hf_treespark.hub.loading import load_drafter, load_target
    from hf_treespark.training.dev_compare import compare_depth1, depth1_hits
    from hf_treespark.training.dev_set import dev_kinds, load_dev_set

    target, _ = load_target(None if target_name == "default" else target_name, "auto", device, cpu_pack=False)
    references = load_dev_set(dev_path, vocab_size=target.config.vocab_size)
    a = load_drafter(base, target.dtype, device, cpu_pack=False).bind_target(target).eval()
    b = load_drafter(trained, target.dtype, device, cpu_pack=False).bind_target(target).eval()
    torch.manual_seed(0)
    hits_a, hits_b = depth1_hits(target, [a, b], references, progress=True)
    per_a = {ref.id: h for ref, h in zip(references, hits_a, strict=True)}
    per_b = {ref.id: h for ref, h in zip(references, hits_b, strict=True)}
    return compare_depth1(per_a, per_b, dev_kinds(dev_path)), len(references)


def _scores(row) -> dict:
    z = row.diff.value / row.diff.se if row.diff.se > 0 else None
    return {"prompts": row.prompts, "anchors": row.anchors,
            "start_top1": round(100 * row.a.value, 2), "start_se": round(100 * row.a.se, 2),
            "trained_top1": round(100 * row.b.value, 2), "trained_se": round(100 * row.b.se, 2),
            "difference_points": round(100 * row.diff.value, 2), "difference_se": round(100 * row.diff.se, 2),
            "z": None if z is None else round(z, 2)}


# ----- the run ------------------------------------------------------------------------------------------------------


def machine(device: str) -> dict:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {"device": device, "gpu": gpu, "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def write_results(plan: Plan, metrics: dict) -> None:
    """OUTPUT_DIR/metrics.json and OUTPUT_DIR/summary.md, as far as the run has got."""
    (plan.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    produced = {"answers": lambda m: f"{m.get('answers', 0):,} answers, {m.get('answer_tokens', 0):,} tokens",
                "distil": lambda m: f"{m.get('positions', 0):,} positions, {m.get('steps', 0):,} steps",
                "evaluate": lambda m: f"{m.get('references', 0):,} references"}
    rate = {"answers": ("tokens_per_s", "tokens/s"), "distil": ("positions_per_s", "positions/s"),
            "evaluate": ("references_per_s", "references/s")}
    lines = [f"GPU recipe, {metrics['started_utc']}, {metrics['machine']['gpu'] or metrics['machine']['cpu']} "
             f"({metrics['machine']['device']}), {plan.args.minutes:g} minutes; logs in {plan.out}/", "",
             "| phase | seconds (limit) | status | produced | rate |", "|---|---|---|---|---|"]
    for name in PHASES:
        m = metrics.get(name)
        if m is not None:
            key, unit = rate[name]
            lines.append(f"| {name} | {m['seconds']:.0f} ({m['limit_s']:.0f}) | {m['status']} | "
                         f"{produced[name](m)} | {m.get(key, 0):,.1f} {unit} |")
    e = metrics.get("evaluate", {})
    if "trained_top1" in e:
        lines += ["", f"Development depth-1 top-1 ({e['references']} references, {e['anchors']:,} anchors): start "
                      f"{e['start_top1']:.2f} ± {e['start_se']:.2f}, trained {e['trained_top1']:.2f} ± "
                      f"{e['trained_se']:.2f}; trained − start {e['difference_points']:+.2f} ± "
                      f"{e['difference_se']:.2f} points (z {'–' if e['z'] is None else e['z']})."]
    (plan.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def run(plan: Plan) -> int:
    """The three phases, each within its share of the budget (what one leaves goes to the next)."""
    start = time.monotonic()
    plan.out.mkdir(parents=True, exist_ok=True)
    metrics = {"started_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "machine": machine(plan.args.device),
               "minutes": plan.args.minutes, "budget_s": {k: round(v, 1) for k, v in plan.budget.items()},
               "target": plan.args.target, "drafter": plan.args.drafter or "the shipped drafter",
               "answers_from": str(plan.answers_from) if plan.answers_from else None,
               "data": [str(d) for d in plan.data]}

    def left(through: str) -> float:  # seconds until the end of phase `through`'s share
        end = sum(plan.budget[name] for name in PHASES[: PHASES.index(through) + 1])
        return end - (time.monotonic() - start)

    print(f"gpu_recipe: answers ({left('answers'):.0f} s) ...", flush=True)
    metrics["answers"] = answers_phase(plan, left("answers"))
    write_results(plan, metrics)
    print(f"gpu_recipe: answers {metrics['answers']['status']}; distil ({left('distil'):.0f} s) ...", flush=True)
    metrics["distil"] = distil_phase(plan, left("distil"))
    write_results(plan, metrics)
    trained = metrics["distil"].get("drafter")
    print(f"gpu_recipe: distil {metrics['distil']['status']}; evaluate ({left('evaluate'):.0f} s) ...", flush=True)
    if trained:
        try:
            metrics["evaluate"] = evaluate_phase(plan, trained, left("evaluate"))
        except Exception as err:  # noqa: BLE001  (recorded: what the phases before it made is kept)
            metrics["evaluate"] = {"status": f"failed ({type(err).__name__}: {err}; see evaluate.log)",
                                   "seconds": 0.0, "limit_s": round(left("evaluate"), 1)}
    else:
        metrics["evaluate"] = {"status": "not run: no trained drafter", "seconds": 0.0,
                               "limit_s": round(left("evaluate"), 1)}
    metrics["total_seconds"] = round(time.monotonic() - start, 1)
    write_results(plan, metrics)
    print((plan.out / "summary.md").read_text(encoding="utf-8"), end="")
    produced = metrics["answers"]["answers"] > 0 and trained and "trained_top1" in metrics["evaluate"]
    return 0 if produced else 1


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    plan = make_plan(p, args)
    if args.dry_run:
        return dry_run(plan)
    from hf_treespark.help_format import resolve_device

    try:
        resolve_device(args.device, kinds=("cpu", "cuda"))
    except ValueError as err:  # before anything loads or is written: one line
        print(f"{p.prog}: error: {err} (or --dry-run to see the commands)", file=sys.stderr)
        return 2
    try:
        return run(plan)
    except (OSError, ValueError) as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{p.prog}: interrupted; what the phases wrote is in {plan.out}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
