#!/usr/bin/env bash
# The device check: on any machine with a CUDA GPU, before publishing numbers from it or after changing the round
# code, one command (under 8 minutes) that checks TreeSpark there: the core exactness tests on the GPU (float32
# strictly, bfloat16/float16 by the near-tie rule), a 5-prompt bench per suite and its round profile on the GPU
# (--device cuda), and a training smoke run. Each step's log goes to OUTPUT_DIR/<step>.log; a summary table (step,
# seconds, result) is printed at the end and written to OUTPUT_DIR/summary.md; exit status 0 when every step passed.
# What each step checks and when to run it: docs/devices.md.
#
#   bash scripts/device_check.sh                      # the checks (needs CUDA); output in device_check/
#   bash scripts/device_check.sh --dry-run            # print the commands, check every file, command and option
#                                                     # they name; runs nothing, needs no GPU, writes nothing
#   bash scripts/device_check.sh --output-dir DIR --venv DIR
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  echo
  echo "options: --dry-run  --output-dir DIR (default: device_check)  --venv DIR (default: .venv)  -h, --help"
}

refuse() {  # one line on stderr, then exit with $2 (default 2)
  echo "device_check: $1" >&2
  exit "${2:-2}"
}

DRY_RUN=0
OUT=device_check
VENV=.venv
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --output-dir|--venv)
      [ $# -ge 2 ] && [ -n "$2" ] || refuse "$1 needs a directory"
      if [ "$1" = --venv ]; then VENV=$2; else OUT=$2; fi
      shift ;;
    --output-dir=*) OUT=${1#*=}; [ -n "$OUT" ] || refuse "--output-dir needs a directory" ;;
    --venv=*) VENV=${1#*=}; [ -n "$VENV" ] || refuse "--venv needs a directory" ;;
    -h|--help) usage; exit 0 ;;
    *) refuse "unknown option '$1' (see --help)" ;;
  esac
  shift
done

PY=$VENV/bin/python
TREESPARK=$VENV/bin/treespark
TESTS=tests/test_device_exactness.py
TRAIN_SCRIPT=examples/train_drafter.py
TRAIN_DATA=training_data/sharegpt_turns_smollm2_regen.jsonl.gz

# --- what it runs: name, time limit (seconds), command ---------------------------------------------------------------
FP32_TESTS=(-m pytest -q -p no:cacheprovider "$TESTS" -k fp32)
HALF_TESTS=(-m pytest -q -p no:cacheprovider "$TESTS" -k "bf16 or fp16")
BENCH=(bench --device cuda --num-prompts 5 --methods plain,prompt_lookup,treespark,treespark_datastore
       --output-dir "$OUT/bench")
PROFILE=(bench --device cuda --profile --num-prompts 5 --max-new-tokens 64 --output-dir "$OUT/profile")
TRAIN=("$TRAIN_SCRIPT" --target default --data "$TRAIN_DATA" --max-sequences 8 --max-length 256 --batch-size 2
       --anchors 16 --max-steps 3 --save-every 2 --no-feature-cache --output-dir "$OUT/train_smoke")
STEPS=(exactness-fp32 exactness-half bench bench-profile train-smoke)
# at most 8 minutes in all (the bench: 15 prompts x 4 methods x 128 tokens; the profile: 4 budgets, 64 tokens)
declare -A LIMIT=([exactness-fp32]=75 [exactness-half]=45 [bench]=180 [bench-profile]=90 [train-smoke]=90)

# --- every file and command it names ------------------------------------------------------------------------------
[ -e "$OUT" ] && [ ! -d "$OUT" ] && refuse "--output-dir $OUT is a file: give a directory (created if missing)"
for file in "$PY" "$TREESPARK"; do
  [ -x "$file" ] || refuse "$file: no such program (bash scripts/setup.sh makes the .venv; or give --venv DIR)" 1
done
for file in "$TESTS" tests/conftest.py "$TRAIN_SCRIPT" "$TRAIN_DATA"; do
  [ -f "$file" ] || refuse "$file: no such file (run from a complete checkout)" 1
done
for cmd in timeout awk date; do
  command -v "$cmd" >/dev/null || refuse "the command '$cmd' is missing" 1
done

# --- the options parse and the tests exist (one Python process: the package, the parsers, pytest's collection) -----
PREFLIGHT=$("$PY" - "${BENCH[@]}" :: "${PROFILE[@]}" :: "${TRAIN[@]:1}" :: "${FP32_TESTS[@]:2}" :: \
  "${HALF_TESTS[@]:2}" <<'EOF'
import argparse, contextlib, io, sys

import pytest
import torch

from hf_treespark.bench import methods as bench_methods
from hf_treespark.bench import run as bench
from hf_treespark.training import cli as train_cli

groups, current = [], []
for arg in sys.argv[1:] + ["::"]:
    if arg == "::":
        groups.append(current)
        current = []
    else:
        current.append(arg)
bench_args, profile_args, train_args, fp32_args, half_args = groups


def parser(prog, add):
    p = argparse.ArgumentParser(prog=prog)
    add(p)
    return p


bench_parser = parser("treespark bench", bench.add_arguments)
for argv in (bench_args, profile_args):
    args = bench_parser.parse_args(argv[1:])
    unknown = [m for m in (args.methods or "").split(",") if m and m not in bench_methods.METHODS]
    if unknown:
        sys.exit(f"treespark bench: unknown method(s) {unknown}")
try:
    train_cli.check_arguments(parser("train_drafter.py", train_cli.add_arguments).parse_args(train_args))
except (ValueError, OSError) as err:
    sys.exit(f"train_drafter.py: {err}")


class Count:
    items = 0

    def pytest_collection_finish(self, session):
        Count.items = len(session.items)


counts = []
for argv in (fp32_args, half_args):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = pytest.main(["--collect-only", *argv], plugins=[Count()])
    if code != 0 or Count.items == 0:
        sys.exit(f"pytest {' '.join(argv)} selects no test (exit {code}):\n{out.getvalue()[-2000:]}")
    counts.append(Count.items)
cuda = torch.cuda.is_available()
print(f"cuda={int(cuda)}")
print(f"gpu={torch.cuda.get_device_name(0) if cuda else 'none'}")
print(f"torch=torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA build"))
print(f"tests={counts[0]} fp32, {counts[1]} half precision")
EOF
) || refuse "a command it would run does not parse or finds no test (see above)" 1
value() { printf '%s\n' "$PREFLIGHT" | sed -n "s/^$1=//p"; }

words() {  # a command line a shell reads back as these words (quoted only where needed)
  local word line=""
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=,+-]+$ ]]; then line+=" $word"; else line+=" $(printf '%q' "$word")"; fi
  done
  echo "${line# }"
}

command_of() {  # the command line of a step, as it runs
  case "$1" in
    exactness-fp32) words TREESPARK_TEST_DEVICE=cuda "$PY" "${FP32_TESTS[@]}" ;;
    exactness-half) words TREESPARK_TEST_DEVICE=cuda "$PY" "${HALF_TESTS[@]}" ;;
    bench) words "$TREESPARK" "${BENCH[@]}" ;;
    bench-profile) words "$TREESPARK" "${PROFILE[@]}" ;;
    train-smoke) words "$PY" "${TRAIN[@]}" ;;
  esac
}

echo "device_check: $(value torch); GPU: $(value gpu); $(value tests) exactness tests; output in $OUT/"
for step in "${STEPS[@]}"; do
  printf '  %-15s (limit %3s s) %s\n' "$step" "${LIMIT[$step]}" "$(command_of "$step")"
done

if [ "$DRY_RUN" = 1 ]; then
  echo "device_check: dry run: every file, command and option above checked; nothing run"
  exit 0
fi
if [ "$(value cuda)" != 1 ]; then
  refuse "no CUDA device here (torch.cuda.is_available() is False: $(value torch)); run it on a machine with \
a GPU, or pass --dry-run to check the commands only" 1
fi

# --- the run -----------------------------------------------------------------------------------------------------------
mkdir -p "$OUT" || refuse "cannot create $OUT" 1
rm -rf "$OUT/train_smoke"  # a run left there would resume and train nothing
declare -A SECONDS_OF RESULT_OF
failed=0
for step in "${STEPS[@]}"; do
  echo "== $step: $(command_of "$step")"
  start=$(date +%s.%N)
  case "$step" in
    exactness-fp32) TREESPARK_TEST_DEVICE=cuda timeout -k 10 "${LIMIT[$step]}" "$PY" "${FP32_TESTS[@]}" ;;
    exactness-half) TREESPARK_TEST_DEVICE=cuda timeout -k 10 "${LIMIT[$step]}" "$PY" "${HALF_TESTS[@]}" ;;
    bench) timeout -k 10 "${LIMIT[$step]}" "$TREESPARK" "${BENCH[@]}" ;;
    bench-profile) timeout -k 10 "${LIMIT[$step]}" "$TREESPARK" "${PROFILE[@]}" ;;
    train-smoke) timeout -k 10 "${LIMIT[$step]}" "$PY" "${TRAIN[@]}" ;;
  esac >"$OUT/$step.log" 2>&1
  rc=$?
  SECONDS_OF[$step]=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')
  case $rc in
    0) RESULT_OF[$step]=pass ;;
    124|137) RESULT_OF[$step]="FAIL (over its ${LIMIT[$step]} s)"; failed=1 ;;
    *) RESULT_OF[$step]="FAIL (exit $rc)"; failed=1 ;;
  esac
  if [ "$rc" != 0 ]; then tail -n 5 "$OUT/$step.log" | sed 's/^/   | /'; fi
done

{
  echo "Device check, $(date -u +%Y-%m-%dT%H:%MZ), GPU $(value gpu), $(value torch); logs in $OUT/"
  echo
  echo "| step | seconds | result |"
  echo "|---|---|---|"
  for step in "${STEPS[@]}"; do echo "| $step | ${SECONDS_OF[$step]} | ${RESULT_OF[$step]} |"; done
} | tee "$OUT/summary.md"
exit "$failed"
