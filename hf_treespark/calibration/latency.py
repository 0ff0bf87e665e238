"""What a round costs on this machine: measured once, cached beside the converted models, trusted only when steady.

A round at tree budget `N` costs `t_draft(N) + t_verify(N)` seconds: `t_verify(N)` is one target forward over
`N + 1` tree tokens on a cached context, `t_draft(N)` one drafter pass and the tree build (`budget.py` weighs that
cost against what the round commits). It depends on the chip, the threads, the dtype, the attention kernel and the
models' shapes (`latency_key`), not on the text, so `measure_round_latency` times it once per device, dtype and
model shape (`treespark calibrate`, or the first `treespark generate`) and `round_latency` caches the table in
`<cache dir>/round_latency.json`. Decoding never measures. On a GPU verify latency is nearly flat in `N`; on a small
CPU it grows with `N` from the start, and a verify forward of many rows costs more than one row's (on this project's
2-core CPU a plain step of 1 / 4 / 16 rows took 87 / 84 / 163 ms, `budget.DEFAULT_CPU_BATCH_ROUND_COST`), so
batches of 2 to 16 rows (`BATCH_SIZES`) are measured apart, each at the budgets whose verify forward stays within
`BATCH_VERIFY_TOKENS` tokens.

Why the trust rules: a table measured while something else computes is not this machine's. A busy core slows small
forwards and big ones differently (thread synchronisation), so the table's shape changes, and a budget chosen from it
is wrong for every later process (a busy machine once timed the drafter's pass at 339 ms at budget 2 and 9 ms at 8).
So every forward is timed `LATENCY_REPEATS` times, the budgets interleaved and rotated so that a burst of load slows
all of them alike, and the minimum kept; the table must pass `latency_problem` (times of the right type and range,
verify and draft non-decreasing in `N` within noise, the drafter's pass roughly flat) and other processes must have
kept at most `busy_cores_limit` cores busy meanwhile (`/proc/stat`; on a CPU `BUSY_CORES`, on a GPU's host all but
`ACCELERATOR_FREE_CORES`). Otherwise it is measured once more, and then, if it still fails, not stored: a note of
the attempt keeps later processes from measuring again for `UNTRUSTED_RETRY_S` (a machine busy then is likely busy
still).

Reading never raises: a damaged or implausible file or entry is ignored with one warning naming it, and an
unwritable location keeps measurements for the process. Writes merge under a lock: the lock file beside the cache
(`round_latency.json.lock`, through `filelock`: `flock` on Linux and macOS, `msvcrt` on Windows) is waited for
while another process holds it (a write takes milliseconds), at most `LOCK_WAIT_S` seconds, with one line on stderr
naming it after `LOCK_NOTICE_S`; under it the file is read again, the entry added, and the file replaced atomically,
so that two processes calibrating at once lose nothing. A lock held longer (its holder hangs) is given up on: the
measurement is kept for this process, as where the location is unwritable, and later writes of this process try
that lock once without waiting.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
import warnings
from pathlib import Path

import torch
from filelock import Timeout
from transformers import DynamicCache

from ..core.cpu_gemm import model_is_packed
from ..core.tree import TreePolicy, pack_tree
from ..core.verify import cache_kwarg, grouped_attention, tree_attention_mask, tree_position_ids
from ..decoding.budget import CANDIDATE_BUDGETS, candidate_budgets
from ..decoding.engine import draft_pool, feature_indices
from ..storage import acquire_lock, cache_dir, unwritable_reason

LATENCY_FILE = "round_latency.json"
LATENCY_REPEATS = 5  # timed passes over every budget; each time is the minimum over them
SHAPE_TOLERANCE = 0.25  # a larger budget may time this much (relative) below a smaller one: noise
SHAPE_FLOOR_S = 0.0005  # ... or this much (absolute, seconds): tiny models' timings are all overhead
DRAFT_SPREAD = 4.0  # the drafter's pass may differ this much across budgets (its tree expands deeper)
BUSY_CORES = 0.3  # other processes' CPU use during a CPU measurement, in cores, beyond which it is not stored
ACCELERATOR_FREE_CORES = 2  # on an accelerator's host, cores other processes must leave free (`busy_cores_limit`)
UNTRUSTED_RETRY_S = 3600  # after an untrusted measurement, later processes use the default this long
LOCK_WAIT_S = 30.0  # the longest wait for another process's lock on the cache before keeping a measurement in memory
LOCK_NOTICE_S = 2.0  # a wait this long for that lock is said on stderr (a write takes milliseconds)


def latency_path() -> Path:
    """The latency cache file: `<cache dir>/round_latency.json`, beside the converted default target."""
    return cache_dir() / LATENCY_FILE


def device_signature(device: torch.device) -> str:
    """What the latency depends on besides the models: the chip (on CUDA its name and multiprocessor count, which
    tells a MIG slice from the whole GPU of the same name) and, on CPU, the threads."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda:{props.name}:{props.multi_processor_count}SMs"
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


def busy_cores_limit(device: torch.device, cpu_count: int | None = None) -> float:
    """Other processes' CPU use during a measurement on `device`, in cores, beyond which it is not stored.

    On a CPU the forwards use every thread torch has, so any other load distorts them: `BUSY_CORES`. On an
    accelerator the host only launches kernels, from one thread, so other processes may keep all but
    `ACCELERATOR_FREE_CORES` of the machine's `cpu_count` cores busy (not `BUSY_CORES`: a GPU host with a few busy
    cores would never store a measurement, and "auto" would keep its default)."""
    if device.type == "cpu":
        return BUSY_CORES
    return max(BUSY_CORES, float((cpu_count or os.cpu_count() or 1) - ACCELERATOR_FREE_CORES))


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
        chain = torch.ones(batch, n + 1, n + 1, dtype=torch.bool, device=device).tril()  # [batch, n + 1, n + 1]
        depths = torch.arange(n + 1, device=device)[None].expand(batch, -1)
        verify_inputs[n] = {"input_ids": torch.randint(0, vocab, (batch, n + 1), generator=generator).to(device),
                            "position_ids": tree_position_ids(depths, context),
                            "attention_mask": tree_attention_mask(chain, context, dtype)}

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
    """Add one entry to the cache file `path`: under its lock (`<path>.lock`), merged with what other processes
    wrote meanwhile, and replaced atomically.

    Takes the cache file, the entry's key and the entry. Returns None once stored, else why not, naming the file
    that failed (the cache, its lock file or the temporary file beside it). Waits for another process's lock at
    most `LOCK_WAIT_S` seconds, saying so on stderr after `LOCK_NOTICE_S`; once that wait has timed out in this
    process, later calls try that lock once without waiting. Never raises for the file system."""
    lock = path.with_name(path.name + ".lock")
    waited = 0.0 if str(lock) in _locks_given_up else LOCK_WAIT_S
    notice = (f"hf_treespark: waiting for the lock {lock}: another process is writing measured round latencies "
              f"to {path} (a write takes milliseconds; giving up after {waited:g} s)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = acquire_lock(lock, waited, LOCK_NOTICE_S, notice)
        try:
            _locks_given_up.discard(str(lock))
            table = _read_cache(path)
            table[key] = entry
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            try:
                tmp.write_text(json.dumps(table, indent=1))
                tmp.replace(path)
            finally:
                tmp.unlink(missing_ok=True)
        finally:
            held.release()
    except Timeout:
        _locks_given_up.add(str(lock))
        holding = (f"held this lock for {waited:g} s" if waited
                   else f"still holds this lock (waited for in vain {LOCK_WAIT_S:g} s earlier)")
        return (f"{lock}: another process {holding} while writing measured round latencies; if that process hangs, "
                f"stop it (`fuser -v {lock}` names it), then `treespark calibrate` stores them")
    except OSError as err:
        return f"{err.filename or path}: {err.strerror or err}"
    return None


_locks_given_up: set[str] = set()  # lock files this process waited `LOCK_WAIT_S` for in vain: not waited for again
_in_memory: dict[tuple[str, str], dict] = {}  # measured in this process where the cache could not keep it
_untrusted: set[tuple[str, str]] = set()  # measured in this process twice, and not trusted either time


def round_latency(target, drafter, policy: TreePolicy, budgets=CANDIDATE_BUDGETS, context: int = 256,
                  refresh: bool = False, measure: bool = True, batch: int = 1,
                  fallback: int | None = None) -> dict | None:
    """`measure_round_latency`, read from / written to the on-disk cache (`{"verify": .., "draft": ..}`).

    `measure=False` only reads: None when this device, dtype and model shape were never measured, or when the
    cached entry is unusable or implausible (`latency_problem`; one warning names the file and what is
    wrong). Never raises because of the cache. Measuring: a table that fails `latency_problem`, or that was
    measured while other processes kept more than `busy_cores_limit` cores busy, is measured once more; if that
    one fails too nothing is stored, a warning says why, and None is returned ("auto" uses its default).
    A cache location that cannot be written (read-only, a directory, ...) is found before measuring: the
    table is then kept for this process only, with one warning naming `HF_TREESPARK_CACHE`; so is a table whose
    write waited `LOCK_WAIT_S` in vain for another process's lock (the warning names the lock file). `fallback`: the
    budget "auto" uses without a measurement, named in the warning when there is none.
    """
    path = latency_path()
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
    busy_limit = busy_cores_limit(next(target.parameters()).device)
    for _ in range(2):
        measured = measure_round_latency(target, drafter, policy, budgets, context, batch=batch)
        load = measured.get("others_load")
        problem = (f"other processes kept {load:.1f} CPU cores busy while it was measured"
                   if load is not None and load > busy_limit else latency_problem(measured, budgets))
        if problem is None:
            break
    if problem is not None:
        _untrusted.add((str(path), key))
        if location_problem is None:  # later processes wait `UNTRUSTED_RETRY_S` before measuring again
            _store(path, key, {"untrusted": problem, "at": time.time()})
        default = "its default" if fallback is None else f"its default ({fallback})"
        _warn_once(f"hf_treespark: the round latency measured on this machine is not stored ({problem}). "
                   f"tree_budget='auto' uses {default} until `treespark calibrate --force` measures it on a quiet "
                   "machine.")
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




def untrusted_in_process(target, drafter, policy: TreePolicy, batch: int = 1) -> bool:
    """Whether this process measured the round latency for `batch` rows twice and trusted it neither time (it is
    not measured again in this process)."""
    return (str(latency_path()), latency_key(target, drafter, policy, 256, batch)) in _untrusted


def untrusted_recently(target, drafter, policy: TreePolicy, batch: int = 1) -> tuple[str, float] | None:
    """`(why, seconds ago)` when the cache notes an untrusted measurement for `batch` rows younger than
    `UNTRUSTED_RETRY_S`, else None."""
    return _recently_untrusted(latency_path(), latency_key(target, drafter, policy, 256, batch))


def has_latency(target, drafter, policy: TreePolicy | None = None) -> bool:
    """Whether this device's round latency is cached (and trusted) for this target, drafter and policy."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, candidate_budgets(policy), measure=False) is not None


def cached_latency(target, drafter, policy: TreePolicy, budgets, batch: int = 1) -> dict | None:
    """The cost table the round controller reads (`budget.use_cost_table`, wired by `import hf_treespark`): this
    machine's cached and trusted latency for `budgets` at `batch` rows, or None. Never measures."""
    return round_latency(target, drafter, policy, budgets, measure=False, batch=batch)
