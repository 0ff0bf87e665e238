"""Hardware-aware tree budget: `tree_budget="auto"`.

A round commits `tau(N)` tokens on average (acceptance length at budget `N`) and costs
`t_draft(N) + t_verify(N)` seconds, so the expected throughput is

    tokens/s(N) = tau(N) / (t_draft(N) + t_verify(N)).

`t_verify(N)` (one target forward over `N + 1` tree tokens on a cached context) and `t_draft(N)`
(one drafter pass and the tree build) are measured once per device, dtype and model shape by
`calibrate_latency` (`treespark calibrate`, or the first `treespark generate`), and cached in
`<cache dir>/round_latency.json`. Decoding never measures: without a cached entry, "auto" uses
`fallback_budget` (for a calibrated drafter on a CPU, the budget its profile implies under
`DEFAULT_CPU_ROUND_COST`; else a small tree on CPUs, a large one on accelerators).

A measurement is trusted only when it is this machine's steady cost: every forward is timed
`LATENCY_REPEATS` times, the budgets interleaved and rotated so that a burst of load slows all of them alike,
and the minimum kept; the table must pass `latency_problem` (times of the right type and range, verify and
draft non-decreasing in `N` within noise, the drafter's pass roughly flat) and other processes must have kept
less than `BUSY_CORES` cores busy meanwhile (`/proc/stat`). Otherwise it is measured once more, and then, if
it still fails, not stored. Reading never raises: a damaged or implausible file or entry is ignored with one
warning naming it; an unwritable location keeps measurements for the process; writes merge under a lock.

`tau(N)` comes from the drafter's measured `config.acceptance_profile` (`{N: tau}`, written by
`calibrate_acceptance`) when it has one, and otherwise from the drafter's own tree scores for the current
prompt: with scores `s_i`, the expected number of accepted nodes of the top-`N` tree is `sum_{i <= N} exp(s_i)`.
On a GPU verify latency is nearly flat in `N` and the best budget is large; on a small CPU it
grows with `N` from the start and the best budget is small.

The same table gives the drafter gate's threshold (`gate_threshold`, `lookup.DrafterGate`): what a
drafter round at budget `N` costs beyond a plain step (a 1-token forward, `verify[0]`), in plain steps.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # not on Windows: writes there are still atomic, but not merged under a lock
    fcntl = None

import torch
from transformers import DynamicCache

from .cpu_gemm import model_is_packed
from .engine import draft_pool, feature_indices
from .storage import cache_dir, unwritable_reason
from .tree import TreePolicy, pack_tree
from .verify import cache_kwarg, grouped_attention

CANDIDATE_BUDGETS = (2, 4, 8, 16, 32, 64)
LATENCY_FILE = "round_latency.json"
FALLBACK_BUDGET = {"cpu": 4, "accelerator": 32}  # "auto" before this device's latency was measured
FALLBACK_GATE = {"cpu": 0.35, "accelerator": 0.1}  # the drafter gate's threshold, likewise
LATENCY_REPEATS = 5  # timed passes over every budget; each time is the minimum over them
SHAPE_TOLERANCE = 0.25  # a larger budget may time this much (relative) below a smaller one: noise
SHAPE_FLOOR_S = 0.0005  # ... or this much (absolute, seconds): tiny models' timings are all overhead
DRAFT_SPREAD = 4.0  # the drafter's pass may differ this much across budgets (its tree expands deeper)
BUSY_CORES = 0.3  # other processes' CPU use during a measurement, in cores, beyond which it is not stored
UNTRUSTED_RETRY_S = 3600  # after an untrusted measurement, later processes use the default this long
BATCH_SIZES = (2, 4, 8, 16)  # the batch sizes calibration measures (`BatchBudget`)
BATCH_VERIFY_TOKENS = 320  # a batch's candidate budgets keep its verify forward at most this many tokens
# A batch's tree must be predicted this much faster than plain steps (`BatchBudget`): the calibration prompts accept
# more than some suites (measured at 8 rows: 1.52 tokens per row and round on MT-Bench against the profile's 1.80,
# 0.91x plain where 1.05x was predicted).
BATCH_TREE_MARGIN = 1.1
# ... and what the batch's own rows accept corrects the profile as they decode (`BatchBudget.observe`): the profile
# counts as this many row-rounds of evidence against the rows' own (measured at 8 rows, session 18: MT-Bench rows
# accepted 1.53 tokens per round against the profile's 1.90, and the tree "auto" kept ran at 0.83x plain).
BATCH_PRIOR_ROWS = 16
# What a round (drafter pass, tree, verify forward) costs in plain decoding steps, by budget, measured with the
# shipped drafter on this project's two kinds of 2-core CPU: "auto"'s cost model until this machine's own
# latency is measured and trusted (`default_round_cost`). float32: AMD EPYC with AVX2 only, `treespark
# calibrate --latency-only --force`, session 13; bfloat16: AMD EPYC with avx512_bf16, `treespark bench
# --profile`, session 12 (README, "What a round costs").
DEFAULT_CPU_ROUND_COST = {
    "float32": {2: 1.34, 4: 1.59, 8: 1.76, 16: 2.04, 32: 2.54, 64: 3.68},
    "bfloat16": {4: 1.25, 8: 1.36, 16: 1.58},
}

# A round's verify forward and drafter pass for a batch of `B` rows, in plain steps of `B` rows (`BatchBudget`):
# the shipped drafter on the AVX2-only AMD EPYC, float32, grouped-query verify attention, 256 cached tokens,
# `budget.measure_round_latency(batch=B)`, session 14 (plain steps of 87 / 89 / 84 / 120 / 163 ms at B = 1 / 2 /
# 4 / 8 / 16: up to 4 rows a plain step costs what one row's does).
DEFAULT_CPU_BATCH_ROUND_COST = {
    "float32": {
        1: {"verify": {2: 1.07, 4: 1.21, 8: 1.32, 16: 1.56, 32: 1.98, 64: 2.94},
            "draft": {2: 0.21, 4: 0.27, 8: 0.38, 16: 0.34, 32: 0.36, 64: 0.36}},
        2: {"verify": {2: 1.13, 4: 1.32, 8: 1.53, 16: 2.01},
            "draft": {2: 0.25, 4: 0.3, 8: 0.41, 16: 0.43}},
        4: {"verify": {2: 1.33, 4: 1.62, 8: 1.98, 16: 3.02},
            "draft": {2: 0.28, 4: 0.39, 8: 0.49, 16: 0.47}},
        8: {"verify": {2: 1.39, 4: 1.72, 8: 2.44, 16: 3.53},
            "draft": {2: 0.33, 4: 0.42, 8: 0.57, 16: 0.6}},
        16: {"verify": {2: 1.63, 4: 2.07, 8: 3.13, 16: 5.12},
            "draft": {2: 0.4, 4: 0.52, 8: 0.7, 16: 0.74}},
    },
}


def is_auto(budget) -> bool:
    return isinstance(budget, str) and budget == "auto"


def device_signature(device: torch.device) -> str:
    """What the latency depends on besides the models: the chip and, on CPU, the threads."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model_name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{device.type}:{model_name}:{os.cpu_count()}cpus:{torch.get_num_threads()}threads"


def _shape_signature(config, fields: tuple[str, ...]) -> str:
    return ",".join(f"{name}={getattr(config, name, None)}" for name in fields)


def latency_key(target, drafter, policy: TreePolicy, context: int, batch: int = 1) -> str:
    tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    device = next(target.parameters()).device
    return "|".join([
        device_signature(device),
        str(next(target.parameters()).dtype),
        str(getattr(target.config, "_attn_implementation", None)),
        "packed" if model_is_packed(target) else "unpacked",  # cpu_gemm changes how verify cost scales
        "target:" + _shape_signature(tcfg, ("model_type", "hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "intermediate_size",
                                            "vocab_size")),
        "drafter:" + _shape_signature(drafter.config, ("num_hidden_layers", "num_attention_heads", "head_dim",
                                                       "intermediate_size", "markov_rank", "block_size",
                                                       "draft_vocab_size")),
        f"policy:k={policy.topk},F={policy.frontier},D={policy.depth}",
        f"context={context}",
    ] + ([f"batch={batch}"] if batch > 1 else []))


class LatencyCacheWarning(UserWarning):
    """The latency cache could not be read, written or trusted; decoding goes on with the defaults."""


_warned: set = set()


def _warn_once(message: str, about=None) -> None:
    """One warning per process for each thing it is `about` (by default, per message)."""
    about = message if about is None else about
    if about not in _warned:
        _warned.add(about)
        warnings.warn(message, LatencyCacheWarning, stacklevel=3)


class _OthersLoad:
    """CPU time other processes used while the block ran, in cores (Linux `/proc/stat`; None elsewhere).

    A latency table measured while something else computes is not this machine's: a busy core slows
    small forwards and big ones differently (thread synchronisation), so the table's shape changes.
    """

    def __enter__(self):
        self.start = (_busy_cpu_seconds(), time.process_time(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy, own, wall = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        if busy is None or self.start[0] is None or wall <= self.start[2]:
            self.cores = None
        else:
            others = (busy - self.start[0]) - (own - self.start[1])
            self.cores = max(0.0, others / (wall - self.start[2]))
        return False


def _busy_cpu_seconds() -> float | None:
    """Seconds all CPUs spent busy since boot (user, nice, system, irq, softirq and steal)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if fields[:1] != ["cpu"] or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks


@torch.no_grad()
def measure_round_latency(target, drafter, policy: TreePolicy, budgets=CANDIDATE_BUDGETS, context: int = 256,
                          repeats: int = LATENCY_REPEATS, batch: int = 1) -> dict:
    """Seconds per round part for each budget: `{"verify": {N: s}, "draft": {N: s}, "others_load": cores}`;
    `verify[0]` is a plain step (one token).

    Verify: one target forward of `N + 1` tokens with a 4D float mask over a `context`-token
    cache (the mask's content does not change the cost, so a causal one is used); for `batch` rows at once
    (`[batch, N + 1]`, the drafter's pass likewise) when `batch > 1`. Draft: one
    drafter pass over a few new context features plus `build_tree` at budget `N`, every depth
    expanded (no early stop: an upper bound of the tree's cost).
    Robust to bursts of load: after one warm-up pass, `repeats` passes each time every forward once, the
    budgets in a rotated order (a burst slows all of them alike), and each time is the minimum over passes.
    `others_load`: the CPU cores other processes kept busy meanwhile (None where it cannot be read).
    """
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    vocab = drafter.config.target_vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    cache_kw = cache_kwarg(target)
    target(input_ids=prefix, use_cache=True, **{cache_kw: cache})
    hidden_ids = feature_indices(drafter.config.target_layer_ids)
    width = len(hidden_ids) * drafter.config.target_hidden_size

    verify_inputs = {}
    for n in (0, *budgets):
        allowed = torch.ones(n + 1, context + n + 1, dtype=torch.bool, device=device).tril(context)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        positions = torch.arange(context, context + n + 1, device=device)[None].expand(batch, -1)
        verify_inputs[n] = {"input_ids": torch.randint(0, vocab, (batch, n + 1), generator=generator).to(device),
                            "position_ids": positions,
                            "attention_mask": mask[None, None].expand(batch, -1, -1, -1)}

    def verify_once(n: int) -> None:
        with grouped_attention(target):
            target(**verify_inputs[n], use_cache=True, output_hidden_states=hidden_ids, **{cache_kw: cache})
        cache.crop(-(n + 1))

    drafter.bind_target(target)
    drafter_cache = drafter.new_context_cache()
    features = torch.randn(batch, context, width, generator=generator).to(device=device, dtype=dtype)
    anchor = prefix[:, -1]
    draft_pool(drafter, policy.with_budget(1), anchor, context, features, drafter_cache)
    step = torch.randn(batch, 2, width, generator=generator).to(device=device, dtype=dtype)

    def draft_once(n: int) -> None:
        pool_policy = policy.with_budget(n)
        pool = draft_pool(drafter, pool_policy, anchor, context, step, drafter_cache)
        drafter_cache.crop(context)
        pack_tree(pool, anchor, pool_policy.budget, pool_policy.depth)

    jobs = [("verify", n, verify_once) for n in (0, *budgets)] + [("draft", n, draft_once) for n in budgets]
    best = {job[:2]: math.inf for job in jobs}
    with _OthersLoad() as load:
        for attempt in range(repeats + 1):  # pass 0 warms up and is not timed
            shift = attempt % len(jobs)
            for part, n, run in jobs[shift:] + jobs[:shift]:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                run(n)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if attempt:
                    best[part, n] = min(best[part, n], time.perf_counter() - start)
    return {"verify": {n: best["verify", n] for n in (0, *budgets)},
            "draft": {n: best["draft", n] for n in budgets},
            "others_load": load.cores}


def latency_problem(latency, budgets) -> str | None:
    """What makes a latency table unusable or implausible, or None when it can be trusted.

    Usable: `verify` has a plain step (`0`) and every budget, `draft` every budget, each a finite number of
    seconds in (0, 60). Plausible: a wider verify forward never costs less than a narrower one, and the
    drafter's pass never less at a larger budget (it expands at least as deep), beyond `SHAPE_TOLERANCE`
    (relative) or `SHAPE_FLOOR_S` (absolute) of noise; the drafter's pass differs across budgets by at most
    `DRAFT_SPREAD`x (it is one pass; only the tree's expansion grows).
    """
    if not isinstance(latency, dict):
        return f"an entry is a {type(latency).__name__}, not a table"
    parts = {}
    for part, needed in (("verify", (0, *budgets)), ("draft", tuple(budgets))):
        raw = latency.get(part)
        if not isinstance(raw, dict):
            return f"{part!r} is missing or not a table"
        values = {}
        for n, seconds in raw.items():
            try:
                n = int(n)
            except (TypeError, ValueError):
                return f"{part} has the budget {n!r}, not a number"
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < 60:
                return f"{part}[{n}] = {seconds!r} is not a time in seconds"
            values[n] = float(seconds)
        missing = [n for n in needed if n not in values]
        if missing:
            return f"{part} lacks the budgets {missing}"
        parts[part] = [values[n] for n in sorted(needed)]
    for part, times in parts.items():
        for n, (small, large) in zip(sorted(budgets), zip(times, times[1:], strict=False), strict=False):
            if large < small * (1 - SHAPE_TOLERANCE) - SHAPE_FLOOR_S:
                return (f"{part} time falls from {small * 1e3:.1f} ms to {large * 1e3:.1f} ms at a larger budget "
                        f"(around N={n}): not this machine's steady cost")
    draft = parts["draft"]
    if max(draft) > DRAFT_SPREAD * min(draft) + SHAPE_FLOOR_S:
        return (f"the drafter's pass takes {min(draft) * 1e3:.1f} to {max(draft) * 1e3:.1f} ms across budgets "
                f"(more than {DRAFT_SPREAD:g}x apart): not this machine's steady cost")
    return None


def _parse_entry(entry: dict, budgets) -> dict:
    return {part: {int(n): float(s) for n, s in entry[part].items() if int(n) in (0, *budgets)}
            for part in ("verify", "draft")}


def _read_cache(path: Path) -> dict:
    """The cache file's table of entries; `{}` (with one warning naming the file) when it is damaged."""
    try:
        if not path.exists():
            return {}
        if path.is_dir():
            _warn_once(_unkept(f"{path} is a directory"), about=("location", str(path)))
            return {}
        table = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        _warn_once(f"hf_treespark: ignoring the latency cache {path}: {_reason(err)}. tree_budget='auto' uses "
                   "its default until it is measured again (`treespark calibrate --force`; set "
                   "HF_TREESPARK_CACHE to keep the cache elsewhere).")
        return {}
    if not isinstance(table, dict):
        _warn_once(f"hf_treespark: ignoring the latency cache {path}: it holds a {type(table).__name__}, not "
                   "a table of measurements. `treespark calibrate --force` measures again.")
        return {}
    return table


def _unkept(problem: str) -> str:
    return (f"hf_treespark: cannot keep measured round latencies ({problem}); what is measured holds for this "
            "process only. Set HF_TREESPARK_CACHE to a writable directory to keep them.")


def _reason(err: Exception) -> str:
    if isinstance(err, UnicodeDecodeError):
        return "it is not UTF-8 text"
    if isinstance(err, json.JSONDecodeError):
        return f"it is not JSON ({err.msg}, line {err.lineno})"
    return getattr(err, "strerror", None) or str(err)


def _cache_location_problem(path: Path) -> str | None:
    """Why measurements cannot be stored at `path`, or None: checked before measuring anything."""
    if path.is_dir():
        return f"{path} is a directory"
    return unwritable_reason(path.parent)


def _store(path: Path, key: str, entry: dict) -> str | None:
    """Add one entry to the cache file: under a lock, merged with what other processes wrote meanwhile, and
    replaced atomically. Returns why it could not be stored, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            table = _read_cache(path)
            table[key] = entry
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
    except OSError as err:
        return f"{path}: {err.strerror or err}"
    return None


_in_memory: dict[tuple[str, str], dict] = {}  # measured in this process where the cache could not keep it
_untrusted: set[tuple[str, str]] = set()  # measured in this process twice, and not trusted either time


def round_latency(target, drafter, policy: TreePolicy, budgets=CANDIDATE_BUDGETS, context: int = 256,
                  refresh: bool = False, measure: bool = True, batch: int = 1) -> dict | None:
    """`measure_round_latency`, read from / written to the on-disk cache (`{"verify": .., "draft": ..}`).

    `measure=False` only reads: None when this device, dtype and model shape were never measured, or when the
    cached entry is unusable or implausible (`latency_problem`; one warning names the file and what is
    wrong). Never raises because of the cache. Measuring: a table that fails `latency_problem`, or that was
    measured while other processes kept more than `BUSY_CORES` cores busy, is measured once more; if that
    one fails too nothing is stored, a warning says why, and None is returned ("auto" uses its default).
    A cache location that cannot be written (read-only, a directory, ...) is found before measuring: the
    table is then kept for this process only, with one warning naming `HF_TREESPARK_CACHE`.
    """
    path = cache_dir() / LATENCY_FILE  # beside the converted default target
    key = latency_key(target, drafter, policy, context, batch)
    if not refresh:
        cached = _lookup(path, key, budgets)
        if cached is not None or not measure or (str(path), key) in _untrusted or _recently_untrusted(path, key):
            return cached
    if not measure:
        return None
    location_problem = _cache_location_problem(path)
    if location_problem is not None:
        _warn_once(_unkept(location_problem), about=("location", str(path)))
    problem = None
    for _ in range(2):
        measured = measure_round_latency(target, drafter, policy, budgets, context, batch=batch)
        load = measured.get("others_load")
        problem = (f"other processes kept {load:.1f} CPU cores busy while it was measured"
                   if load is not None and load > BUSY_CORES else latency_problem(measured, budgets))
        if problem is None:
            break
    if problem is not None:
        _untrusted.add((str(path), key))
        if location_problem is None:  # later processes wait `UNTRUSTED_RETRY_S` before measuring again
            _store(path, key, {"untrusted": problem, "at": time.time()})
        _warn_once(f"hf_treespark: the round latency measured on this machine is not stored ({problem}). "
                   f"tree_budget='auto' uses its default ({fallback_budget(target, policy, drafter)}) until "
                   "`treespark calibrate --force` measures it on a quiet machine.")
        return None
    _untrusted.discard((str(path), key))
    latency = {part: measured[part] for part in ("verify", "draft")}
    entry = {part: {str(n): s for n, s in latency[part].items()} for part in ("verify", "draft")}
    entry["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    entry["others_load"] = measured.get("others_load")
    _in_memory[str(path), key] = latency
    if location_problem is None:
        store_problem = _store(path, key, entry)
        if store_problem is not None:
            _warn_once(_unkept(store_problem), about=("location", str(path)))
    return latency


def _lookup(path: Path, key: str, budgets) -> dict | None:
    """The cached latency for `key`: this process's measurement, else the file's entry if it can be trusted."""
    if (str(path), key) in _in_memory:
        latency = _in_memory[str(path), key]
        if latency_problem(latency, budgets) is None:
            return _parse_entry(latency, budgets)
    entry = _read_cache(path).get(key)
    if entry is None or (isinstance(entry, dict) and "untrusted" in entry):
        return None
    problem = latency_problem(entry, budgets)
    if problem is not None:
        _warn_once(f"hf_treespark: ignoring an entry of the latency cache {path} ({problem}); tree_budget='auto' "
                   "uses its default until `treespark calibrate --force` measures it again.", about=(path, key))
        return None
    return _parse_entry(entry, budgets)


def _recently_untrusted(path: Path, key: str) -> tuple[str, float] | None:
    """`(why, seconds ago)` when the cache records an untrusted measurement of `key` younger than
    `UNTRUSTED_RETRY_S` (a machine busy then is likely busy still: measuring again would cost every process
    the same seconds for nothing), else None."""
    entry = _read_cache(path).get(key)
    if not isinstance(entry, dict) or "untrusted" not in entry:
        return None
    try:
        age = time.time() - float(entry.get("at"))
    except (TypeError, ValueError):
        return None
    return (str(entry["untrusted"]), age) if 0 <= age < UNTRUSTED_RETRY_S else None


def calibrate_latency(target, drafter, policy: TreePolicy | None = None, refresh: bool = False,
                      batch: int = 1) -> dict | None:
    """Measure (once; cached) what a round costs on this device for every candidate budget, for `batch` rows at
    once; None when the measurement could not be trusted (see `round_latency`)."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, batch_budgets(policy, batch), refresh=refresh, batch=batch)


def ensure_latency(target, drafter, quiet: bool = False) -> None:
    """First use on a machine (the CLI, the benchmark, the demo): measure what a round costs here, once, so
    that `tree_budget="auto"` and the drafter gate decide from this device's numbers. Prints what it does
    unless `quiet`. Measures at most once per process, whatever comes of it."""
    policy = TreePolicy.from_config(drafter.config)
    if not (policy.auto or policy.lookup) or has_latency(target, drafter, policy):
        return
    path, key = cache_dir() / LATENCY_FILE, latency_key(target, drafter, policy, 256)
    if (str(path), key) in _untrusted:
        return  # measured in this process already, and not trusted: "auto" keeps its default
    recent = _recently_untrusted(path, key)
    if recent is not None:
        if not quiet:
            print(f"[treespark] this machine's round latency, measured {recent[1] / 60:.0f} min ago, was not trusted "
                  f"({recent[0]}): tree_budget='auto' uses its default ({fallback_budget(target, policy, drafter)}) "
                  "for now; `treespark calibrate --force` measures again", file=sys.stderr, flush=True)
        return
    if not quiet:
        print("[treespark] first use on this machine: measuring what a round costs for each tree budget "
              f"(once; cached in {cache_dir() / LATENCY_FILE})...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    calibrate_latency(target, drafter, policy)
    if not quiet:
        print(f"[treespark] measured in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def ensure_batch_latency(target, drafter, sizes, quiet: bool = False) -> None:
    """`ensure_latency` for batches (`treespark bench --batch-size`): the round costs of each measured batch size
    that prices `sizes` rows (`measured_batch`), measured once where this machine has none, so that the batched
    "auto" and the batch's drafter gate decide from this device's numbers, not `DEFAULT_CPU_BATCH_ROUND_COST`
    (measured on another CPU, in float32). About ten seconds per size on a 2-core CPU. An untrusted measurement
    is handled as `round_latency` handles it (the default stays; not measured again for a while)."""
    policy = TreePolicy.from_config(drafter.config)
    if not (policy.auto or policy.lookup):
        return
    for size in sorted({measured_batch(b) for b in sizes if b > 1}):
        budgets = batch_budgets(policy, size)
        if round_latency(target, drafter, policy, budgets, measure=False, batch=size) is not None:
            continue
        path, key = cache_dir() / LATENCY_FILE, latency_key(target, drafter, policy, 256, size)
        if (str(path), key) in _untrusted or _recently_untrusted(path, key):
            continue
        if not quiet:
            print(f"[treespark] measuring what a round of {size} rows costs on this machine, for each tree budget "
                  f"(once; cached in {path})...", file=sys.stderr, flush=True)
        round_latency(target, drafter, policy, budgets, batch=size)

def has_latency(target, drafter, policy: TreePolicy | None = None) -> bool:
    """Whether this device's round latency is cached (and trusted) for this target, drafter and policy."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, _budgets_for(policy), measure=False) is not None


def describe_latency(latency: dict, acceptance: dict[int, float] | None = None) -> str:
    """The latency table as text: per budget the verify and draft milliseconds, the round in plain steps and,
    given the acceptance per budget, the expected tokens per second (the best one marked)."""
    step = latency["verify"][0]
    rate = choose_budget(acceptance, latency)[1] if acceptance else {}
    best = max(rate, key=lambda n: (rate[n], -n)) if rate else None
    lines = [f"plain step {step * 1e3:.1f} ms",
             "budget  verify ms  draft ms  round/plain step" + ("  acceptance  tokens/s" if rate else "")]
    for n in sorted(latency["draft"]):
        row = (f"{n:>6}  {latency['verify'][n] * 1e3:>9.1f}  {latency['draft'][n] * 1e3:>8.1f}  "
               f"{(latency['verify'][n] + latency['draft'][n]) / step:>16.2f}")
        if n in rate:
            row += f"  {acceptance[n]:>10.2f}  {rate[n]:>8.1f}" + ("  <- auto" if n == best else "")
        lines.append(row)
    return "\n".join(lines)


def _budgets_for(policy: TreePolicy, budgets=CANDIDATE_BUDGETS) -> tuple[int, ...]:
    pool = policy.budget if policy.auto else policy.with_budget(max(budgets)).num_candidates
    return tuple(n for n in budgets if n <= pool) or (pool,)


def batch_budgets(policy: TreePolicy, batch: int) -> tuple[int, ...]:
    """The candidate budgets for `batch` rows: those whose verify forward holds at most `BATCH_VERIFY_TOKENS`
    tokens (`batch x (N + 1)`), and the smallest always."""
    budgets = _budgets_for(policy)
    return tuple(n for n in budgets if batch * (n + 1) <= BATCH_VERIFY_TOKENS) or budgets[:1]


def measured_batch(batch: int) -> int:
    """The batch size whose latency prices `batch` rows: the next measured size up (`BATCH_SIZES`), at most the
    largest."""
    return 1 if batch <= 1 else min((b for b in BATCH_SIZES if b >= batch), default=BATCH_SIZES[-1])


def default_round_cost(target, budgets) -> dict[int, float] | None:
    """What a round costs in plain steps, by budget, on this kind of device before (or without) a trusted
    measurement of this machine: `DEFAULT_CPU_ROUND_COST` for a CPU in its dtype, for the budgets it has a
    figure for; None elsewhere."""
    param = next(target.parameters())
    table = DEFAULT_CPU_ROUND_COST.get(str(param.dtype).removeprefix("torch.")) if param.device.type == "cpu" else None
    costs = {n: table[n] for n in budgets if n in table} if table else {}
    return costs or None


def default_batch_cost(target, budgets, batch: int) -> dict[str, dict[int, float]] | None:
    """`{"verify": {N: r}, "draft": {N: r}}` for a round of `batch` rows (a measured size) in plain steps of that batch,
    on a CPU before (or without) a trusted measurement of this machine (`DEFAULT_CPU_BATCH_ROUND_COST`, float32's for
    another dtype); None elsewhere or without figures for these budgets."""
    param = next(target.parameters())
    if param.device.type != "cpu":
        return None
    tables = DEFAULT_CPU_BATCH_ROUND_COST.get(str(param.dtype).removeprefix("torch."),
                                              DEFAULT_CPU_BATCH_ROUND_COST["float32"])
    table = tables.get(batch)
    if not table:
        return None
    known = [n for n in budgets if n in table["verify"] and n in table["draft"]]
    return {part: {n: table[part][n] for n in known} for part in ("verify", "draft")} if known else None


class BatchBudget:
    """The budget and the drafter gate's threshold for a batch (`batch.py`), by the number of unfinished rows `B`.

    Budget (`tree_budget="auto"`; a fixed budget stays as given): the one with the most committed tokens per
    second, `tau(N) / cost_B(N)` (`cost_B(N)`: a round of `B` rows at budget `N`, drafter pass included, in plain
    steps of `B` rows), or 0 (plain decoding) when none beats a plain step by `BATCH_TREE_MARGIN`. A verify
    forward of `B x (N + 1)` tokens costs more the larger `B` (on a CPU a plain step of many rows is already
    compute-bound), so the budget shrinks as the batch grows and grows again as rows finish. `cost_B`: this
    device's latency measured for `B` rows (`calibrate_latency(batch=B)`, `treespark calibrate --batch-sizes`),
    rounded up to a measured size
    (`measured_batch`), else `default_batch_cost`. `tau(N)`: the drafter's `batch_acceptance_profile` (rounds of a
    batch, lookup and datastore branches within the `N` nodes; `calibrate_batch_acceptance`), else its
    `acceptance_profile`, else (`needs_scores`) the first drafter pool's scores, averaged over rows.

    Correction (`observe`): the profile was measured on calibration prompts, and a batch's own rows may accept
    less (or more). Each round's committed tokens per row correct it: `tau(N) = 1 + s (tau_profile(N) - 1)`, `s`
    the rows' drafted tokens per round (beyond the bonus) over the profile's at the budgets they ran, the profile
    counting as `BATCH_PRIOR_ROWS` row-rounds. A batch whose rows accept too little for its tree falls back to
    plain steps within a few rounds.

    Gate (`gate_threshold`): one drafter pass serves every row, and the rows' lookup and datastore branches are
    verified with or without it, so the pass has to earn its own cost: the batch's drafter gate (one
    `lookup.DrafterGate` shared by the rows) stays open while the drafted tokens accepted per row and drafter
    round reach `t_draft_B(N) / t_plain_B`, the pass in plain steps of the batch. Measured with the shipped drafter
    (4 rows, 8 MT-Bench and 8 HumanEval prompts, float32, 2-core CPU): the pass is 0.3 plain steps and adds
    0.07-0.15 accepted tokens per row to the lookup and datastore branches; rounds without it ran 1.03-1.14x faster.
    """

    def __init__(self, target, drafter, policy: TreePolicy):
        self.target, self.drafter, self.policy = target, drafter, policy
        profile = (getattr(drafter.config, "batch_acceptance_profile", None)
                   or getattr(drafter.config, "acceptance_profile", None))
        self.acceptance = profile_acceptance(profile, _budgets_for(policy)) if profile else None
        self.chosen: dict[int, int] = {}  # by batch size
        self._costs: dict[int, dict | None] = {}  # round_cost by batch size: read once per generate call
        # the rows' drafted tokens committed (beyond each round's bonus), the profile's prediction for the same
        # rounds, and their number (`observe`)
        self.accepted, self.predicted, self.row_rounds = 0.0, 0.0, 0

    @property
    def scale(self) -> float:
        """`s`: the rows' drafted tokens per round over the profile's, the profile counting as `BATCH_PRIOR_ROWS`
        row-rounds (1 before any round)."""
        if not self.row_rounds or self.predicted <= 0:
            return 1.0
        prior = BATCH_PRIOR_ROWS * self.predicted / self.row_rounds
        return (self.accepted + prior) / (self.predicted + prior)

    def observe(self, budget: int, tokens: list[int]) -> None:
        """One round of the batch at `budget`: `tokens`, each row's committed tokens (bonus included). Only "auto"
        with a profile at that budget learns from it (a fixed budget stays; plain steps tell nothing)."""
        if not self.policy.auto or self.acceptance is None or budget not in self.acceptance or not tokens:
            return
        self.accepted += sum(count - 1 for count in tokens)
        self.predicted += len(tokens) * (self.acceptance[budget] - 1)
        self.row_rounds += len(tokens)
        self.chosen.clear()

    @property
    def needs_scores(self) -> bool:
        return self.policy.auto and self.acceptance is None

    def from_scores(self, scores: torch.Tensor) -> None:
        """`tau(N)` from a drafter pool's scores (`[b, C]`), averaged over its rows (`score_acceptance`)."""
        rows = [score_acceptance(row, _budgets_for(self.policy)) for row in scores]
        self.acceptance = {n: sum(r[n] for r in rows) / len(rows) for n in rows[0]}
        self.chosen.clear()

    def round_cost(self, batch: int) -> dict[str, dict[int, float]] | None:
        """`{"verify": {N: r}, "draft": {N: r}}`: a round's parts for `batch` rows in plain steps of `batch` rows,
        measured, else the default; None without either. Read once per batch size (the latency cache is a file)."""
        if batch not in self._costs:
            self._costs[batch] = self._round_cost(batch)
        return self._costs[batch]

    def _round_cost(self, batch: int) -> dict[str, dict[int, float]] | None:
        size = measured_batch(batch)
        budgets = batch_budgets(self.policy, size)
        latency = round_latency(self.target, self.drafter, self.policy, budgets, measure=False, batch=size)
        if latency is not None:
            step = latency["verify"][0]
            return {part: {n: latency[part][n] / step for n in budgets} for part in ("verify", "draft")}
        return default_batch_cost(self.target, budgets, size)

    def __call__(self, batch: int) -> int:
        if not self.policy.auto:
            return self.policy.budget
        if batch not in self.chosen:
            self.chosen[batch] = self._choose(batch)
        return self.chosen[batch]

    def _choose(self, batch: int) -> int:
        costs = self.round_cost(batch)
        if not costs or self.acceptance is None:  # an accelerator without a measurement: the batch-1 default
            return fallback_budget(self.target, self.policy, self.drafter)
        tau = {n: 1 + self.scale * (self.acceptance[n] - 1) for n in costs["verify"] if n in self.acceptance}
        rate = {0: BATCH_TREE_MARGIN} | {n: tau[n] / (costs["verify"][n] + costs["draft"][n]) for n in tau}
        return max(rate, key=lambda n: (rate[n], -n))

    def gate_threshold(self, batch: int, budget: int) -> float:
        """The batch's drafter gate threshold at `budget`: the drafter pass in plain steps of `batch` rows
        (`FALLBACK_GATE` without a cost for it)."""
        costs = self.round_cost(batch)
        if not costs or not costs["draft"]:
            return FALLBACK_GATE["cpu" if next(self.target.parameters()).device.type == "cpu" else "accelerator"]
        n = min(costs["draft"], key=lambda b: (abs(b - budget), b))
        return costs["draft"][n]


def fallback_budget(target, policy: TreePolicy, drafter=None) -> int:
    """The budget "auto" uses without this device's (trusted) latency: for a drafter with a calibrated
    `acceptance_profile` on a CPU, the best under `default_round_cost`; else small on CPUs (verify cost grows
    with `N` from the start), large on accelerators (nearly flat in `N`)."""
    profile = getattr(getattr(drafter, "config", None), "acceptance_profile", None)
    costs = default_round_cost(target, _budgets_for(policy)) if profile else None
    if costs:
        acceptance = profile_acceptance(profile, sorted(costs))
        return max(costs, key=lambda n: (acceptance[n] / costs[n], -n))
    device = next(target.parameters()).device
    return min(FALLBACK_BUDGET["cpu" if device.type == "cpu" else "accelerator"], policy.budget)


def gate_threshold(target, drafter, policy: TreePolicy) -> float:
    """The drafter gate's threshold for this device (`lookup.DrafterGate`): `(t_draft(N) + t_verify(N)) /
    t_verify(0) - 1`, the extra cost of a drafter round at the policy's budget (the smallest measured one
    while "auto" is undecided) over a plain step, in plain steps; without this device's (trusted) latency,
    `FALLBACK_GATE`. Either way 0 (the gate stays open) when the drafter's calibrated acceptance profile gets
    at least that many drafted tokens accepted at that budget. Never measures."""
    budgets = _budgets_for(policy)
    latency = round_latency(target, drafter, policy, budgets, measure=False)
    if latency is None:
        device = next(target.parameters()).device
        n = fallback_budget(target, policy, drafter) if policy.auto else policy.budget
        costs = default_round_cost(target, [n])
        threshold = costs[n] - 1.0 if costs else FALLBACK_GATE["cpu" if device.type == "cpu" else "accelerator"]
    else:
        n = min(budgets) if policy.auto else min(budgets, key=lambda b: (abs(b - policy.budget), b))
        threshold = max(0.0, (latency["draft"][n] + latency["verify"][n]) / latency["verify"][0] - 1.0)
    profile = getattr(drafter.config, "acceptance_profile", None)
    if profile and profile_acceptance(profile, [n])[n] - 1.0 >= threshold:
        return 0.0  # its calibrated rounds pay for themselves: draft every round (see lookup.py, "The drafter gate")
    return threshold


def profile_acceptance(profile: dict, budgets) -> dict[int, float]:
    """Acceptance length at each budget, interpolated from a measured `{N: tau}` profile.

    Linear in `log(1 + N)` between measured budgets, through `tau(0) = 1` (the bonus token
    alone), and flat beyond the largest measured budget (no extrapolated gains).
    """
    points = sorted((int(n), float(t)) for n, t in profile.items())
    points = [(0, 1.0)] + [p for p in points if p[0] > 0]
    out = {}
    for n in budgets:
        if n >= points[-1][0]:
            out[n] = points[-1][1]
            continue
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if n0 <= n <= n1:
                w = (math.log1p(n) - math.log1p(n0)) / (math.log1p(n1) - math.log1p(n0))
                out[n] = t0 + w * (t1 - t0)
                break
    return out


def score_acceptance(scores: torch.Tensor, budgets) -> dict[int, float]:
    """Expected acceptance length from the drafter's own path log-probabilities (root excluded).

    The top-`N` packed tree is the `N` best-scoring candidates, and a node is accepted with the
    probability of its whole path, so `tau(N) = 1 + sum of the N largest exp(scores)`.
    """
    mass = scores.detach().float().exp().sort(descending=True).values.cumsum(0)
    return {n: 1.0 + float(mass[min(n, mass.numel()) - 1]) for n in budgets}


def choose_budget(acceptance: dict[int, float], latency: dict) -> tuple[int, dict[int, float]]:
    """The budget with the most expected committed tokens per second, and each budget's rate."""
    rate = {n: acceptance[n] / (latency["verify"][n] + latency["draft"][n]) for n in acceptance}
    best = max(rate, key=lambda n: (rate[n], -n))
    return best, rate


def auto_budget(target, drafter, policy: TreePolicy, first_tree_scores: torch.Tensor | None = None,
                budgets=CANDIDATE_BUDGETS) -> int | None:
    """Pick the budget for this device, target and drafter (see the module docstring); never measures.

    Uses the cached latency (`fallback_budget` when there is none) and the drafter's acceptance
    profile, or else the candidate pool's scores `first_tree_scores`; None when it needs those scores.
    """
    budgets = _budgets_for(policy, budgets)
    latency = round_latency(target, drafter, policy, budgets, measure=False)
    if latency is None:
        return fallback_budget(target, policy, drafter)
    profile = getattr(drafter.config, "acceptance_profile", None)
    if profile:
        acceptance = profile_acceptance(profile, budgets)
    elif first_tree_scores is not None:
        acceptance = score_acceptance(first_tree_scores, budgets)
    else:
        return None
    best, _ = choose_budget(acceptance, latency)
    return best


def calibrate_acceptance(target, drafter, prompts: list[dict], budgets=CANDIDATE_BUDGETS,
                         max_new_tokens: int = 64, progress: bool = True) -> dict[str, float]:
    """Measure the drafter's mean acceptance length at each budget (greedy) on `prompts`.

    `prompts`: tokenised inputs (`input_ids`, `attention_mask`). The result is what
    `config.acceptance_profile` holds: `{"N": tau}`. Lookup branches are off here (`tree_lookup=0`): `tau(N)`
    prices a drafter round of budget `N`, and with lookup on, lookup-only rounds and the drafter gate (whose
    threshold depends on `N`) would mix rounds of other costs into it (measured: not even monotone in `N`).
    """
    from tqdm.auto import tqdm

    profile = {}
    for n in tqdm(budgets, desc="calibrating acceptance", disable=not progress):
        committed = rounds = 0
        for inputs in prompts:
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens,
                                  do_sample=False, tree_budget=n, tree_lookup=0, return_dict_in_generate=True)
            committed += sum(r.acceptance_length for r in out.rounds)
            rounds += len(out.rounds)
        profile[str(n)] = committed / max(1, rounds)
    return profile


def calibrate_batch_acceptance(target, drafter, prompts: list[dict], budgets=(2, 4, 8), batch: int = 4,
                               max_new_tokens: int = 64, pad_token_id: int = 0,
                               progress: bool = True) -> dict[str, float]:
    """The drafter's mean acceptance length per row and round at each budget in batched decoding (greedy, `batch`
    rows, the package's defaults: lookup and datastore branches within the `N` nodes, the batch's drafter gate):
    what `config.batch_acceptance_profile` holds, `{"N": tau}`. `prompts`: tokenised inputs (`input_ids` `[1, T]`),
    left-padded here into batches of `batch`."""
    from tqdm.auto import tqdm

    from .batch import left_padded

    batches = [left_padded([p["input_ids"][0] for p in prompts[start:start + batch]], pad_token_id)
               for start in range(0, len(prompts), batch)]
    profile = {}
    for n in tqdm(budgets, desc="calibrating batched acceptance", disable=not progress):
        committed = rounds = 0
        for inputs in batches:
            out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                  tree_budget=n, pad_token_id=pad_token_id, return_dict_in_generate=True)
            per_row = out.rounds if inputs["input_ids"].shape[0] > 1 else [out.rounds]
            committed += sum(r.acceptance_length for row in per_row for r in row)
            rounds += sum(len(row) for row in per_row)
        profile[str(n)] = committed / max(1, rounds)
    return profile
