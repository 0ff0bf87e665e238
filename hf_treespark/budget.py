"""Hardware-aware tree budget: `tree_budget="auto"`.

A round commits `tau(N)` tokens on average (acceptance length at budget `N`) and costs
`t_draft(N) + t_verify(N)` seconds, so the expected throughput is

    tokens/s(N) = tau(N) / (t_draft(N) + t_verify(N)).

`t_verify(N)` (one target forward over `N + 1` tree tokens on a cached context) and `t_draft(N)`
(one drafter pass and the tree build) are measured once per device, dtype and model shape by
`calibrate_latency` (`treespark calibrate`, or the first `treespark generate`), and cached in
`<cache dir>/round_latency.json`. Decoding never measures: without a cached entry, "auto" uses
`fallback_budget` (a small tree on CPUs, a large one on accelerators). `tau(N)` comes from the drafter's measured
`config.acceptance_profile` (`{N: tau}`, written by `calibrate_acceptance`) when it has one, and
otherwise from the drafter's own tree scores for the current prompt: with scores `s_i`, the
expected number of accepted nodes of the top-`N` tree is `sum_{i <= N} exp(s_i)`.
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
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from .cpu_gemm import model_is_packed
from .engine import draft_pool, feature_indices
from .storage import cache_dir
from .tree import TreePolicy, pack_tree
from .verify import cache_kwarg

CANDIDATE_BUDGETS = (2, 4, 8, 16, 32, 64)
LATENCY_FILE = "round_latency.json"
FALLBACK_BUDGET = {"cpu": 4, "accelerator": 32}  # "auto" before this device's latency was measured
FALLBACK_GATE = {"cpu": 0.35, "accelerator": 0.1}  # the drafter gate's threshold, likewise


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


def latency_key(target, drafter, policy: TreePolicy, context: int) -> str:
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
    ])


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_round_latency(target, drafter, policy: TreePolicy, budgets=CANDIDATE_BUDGETS, context: int = 256,
                          repeats: int = 3) -> dict:
    """Seconds per round part for each budget: `{"verify": {N: s}, "draft": {N: s}}`; `verify[0]` is a
    plain step (one token).

    Verify: one target forward of `N + 1` tokens with a 4D float mask over a `context`-token
    cache (the mask's content does not change the cost, so a causal one is used). Draft: one
    drafter pass over a few new context features plus `build_tree` at budget `N`, every depth
    expanded (no early stop: an upper bound of the tree's cost).
    """
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    vocab = drafter.config.target_vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    cache = DynamicCache(config=target.config)
    cache_kw = cache_kwarg(target)
    target(input_ids=prefix, use_cache=True, **{cache_kw: cache})
    hidden_ids = feature_indices(drafter.config.target_layer_ids)
    width = len(hidden_ids) * drafter.config.target_hidden_size

    verify = {}
    for n in (0, *budgets):
        tokens = torch.randint(0, vocab, (1, n + 1), generator=generator).to(device)
        positions = torch.arange(context, context + n + 1, device=device)[None]
        allowed = torch.ones(n + 1, context + n + 1, dtype=torch.bool, device=device).tril(context)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

        def verify_once(tokens=tokens, positions=positions, mask=mask):
            target(input_ids=tokens, position_ids=positions, attention_mask=mask[None, None],
                   use_cache=True, output_hidden_states=hidden_ids, **{cache_kw: cache})
            cache.crop(-tokens.shape[1])

        verify[n] = _timed(verify_once, device, repeats)

    drafter.bind_target(target)
    drafter_cache = drafter.new_context_cache()
    features = torch.randn(1, context, width, generator=generator).to(device=device, dtype=dtype)
    anchor = prefix[:, -1]
    draft_pool(drafter, policy.with_budget(1), anchor, context, features, drafter_cache)
    step = torch.randn(1, 2, width, generator=generator).to(device=device, dtype=dtype)
    draft = {}
    for n in budgets:
        pool_policy = policy.with_budget(n)

        def draft_once(pool_policy=pool_policy):
            pool = draft_pool(drafter, pool_policy, anchor, context, step, drafter_cache)
            drafter_cache.crop(context)
            pack_tree(pool, anchor, pool_policy.budget, pool_policy.depth)

        draft[n] = _timed(draft_once, device, repeats)
    return {"verify": verify, "draft": draft}


def round_latency(target, drafter, policy: TreePolicy, budgets=CANDIDATE_BUDGETS, context: int = 256,
                  refresh: bool = False, measure: bool = True) -> dict | None:
    """`measure_round_latency`, read from / written to the on-disk cache.

    `measure=False` only reads: None when this device, dtype and model shape were never measured.
    """
    path = cache_dir() / LATENCY_FILE  # beside the converted default target
    key = latency_key(target, drafter, policy, context)
    table = {}
    if path.is_file():
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            table = {}  # a damaged cache is re-measured, never trusted
    entry = table.get(key) if isinstance(table, dict) else None
    if not refresh and isinstance(entry, dict) and all(str(n) in entry.get("verify", {}) for n in (0, *budgets)):
        return {part: {int(n): s for n, s in entry[part].items()} for part in ("verify", "draft")}
    if not measure:
        return None
    measured = measure_round_latency(target, drafter, policy, budgets, context)
    table = table if isinstance(table, dict) else {}
    table[key] = {part: {str(n): s for n, s in measured[part].items()} for part in ("verify", "draft")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
    return measured


def calibrate_latency(target, drafter, policy: TreePolicy | None = None, refresh: bool = False) -> dict:
    """Measure (once; cached) what a round costs on this device for every candidate budget."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, _budgets_for(policy), refresh=refresh)


def ensure_latency(target, drafter, quiet: bool = False) -> None:
    """First use on a machine (the CLI, the benchmark, the demo): measure what a round costs here, once, so
    that `tree_budget="auto"` and the drafter gate decide from this device's numbers. Prints what it does
    unless `quiet`."""
    policy = TreePolicy.from_config(drafter.config)
    if not (policy.auto or policy.lookup) or has_latency(target, drafter, policy):
        return
    if not quiet:
        print("[treespark] first use on this machine: measuring what a round costs for each tree budget "
              f"(once; cached in {cache_dir() / LATENCY_FILE})...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    calibrate_latency(target, drafter, policy)
    if not quiet:
        print(f"[treespark] measured in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def has_latency(target, drafter, policy: TreePolicy | None = None) -> bool:
    """Whether this device's round latency is cached for this target, drafter and policy."""
    policy = policy or TreePolicy.from_config(drafter.config)
    return round_latency(target, drafter, policy, _budgets_for(policy), measure=False) is not None


def _budgets_for(policy: TreePolicy, budgets=CANDIDATE_BUDGETS) -> tuple[int, ...]:
    pool = policy.budget if policy.auto else policy.with_budget(max(budgets)).num_candidates
    return tuple(n for n in budgets if n <= pool) or (pool,)


def fallback_budget(target, policy: TreePolicy) -> int:
    """The budget "auto" uses before this device's latency is measured: small on CPUs (verify cost grows
    with `N` from the start), large on accelerators (nearly flat in `N`)."""
    device = next(target.parameters()).device
    return min(FALLBACK_BUDGET["cpu" if device.type == "cpu" else "accelerator"], policy.budget)


def gate_threshold(target, drafter, policy: TreePolicy) -> float:
    """The drafter gate's threshold for this device (`lookup.DrafterGate`): `(t_draft(N) + t_verify(N)) /
    t_verify(0) - 1`, the extra cost of a drafter round at the policy's budget (the smallest measured one
    while "auto" is undecided) over a plain step, in plain steps; 0 (the gate stays open) when the drafter's
    calibrated acceptance profile gets at least that many drafted tokens accepted at that budget. Never
    measures: without this device's latency it is `FALLBACK_GATE`."""
    budgets = _budgets_for(policy)
    latency = round_latency(target, drafter, policy, budgets, measure=False)
    if latency is None:
        device = next(target.parameters()).device
        return FALLBACK_GATE["cpu" if device.type == "cpu" else "accelerator"]
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
        return fallback_budget(target, policy)
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
