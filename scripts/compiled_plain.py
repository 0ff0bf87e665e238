"""The compiled plain-decoding anchor: plain greedy `generate` of the offline default target, eager against
transformers' static cache + `torch.compile`, on this CPU, per precision; prints a Markdown table.

    python scripts/compiled_plain.py --dtypes bf16,fp32 --num-prompts 3 --max-new-tokens 64

Three ways per precision, one prompt at a time in turn (a burst of load elsewhere slows all three alike):

* eager, packed: the benchmark's plain anchor (`load_target(cpu_pack=True)`: oneDNN prepacked linear layers);
* eager, unpacked: the same with the ordinary linear kernels (`cpu_pack=False`);
* compiled: the unpacked model, `generate(cache_implementation="static", compile_config=CompileConfig(...))`. The
  packed layers cannot be compiled (their forward packs the weight on first use, a graph break), hence unpacked.
  transformers compiles the decoding step only on CUDA/XPU/TPU/Neuron unless the `CompileConfig` has
  `_compile_all_devices` set (`GenerationMixin._valid_auto_compile_criteria`), as here; the prefill stays eager.
  `max_cache_len` sizes the static cache for the longest prompt, so one graph serves every call.

Each way is warmed up once on the first prompt (for the compiled way that call compiles: "compile time" is that
call's time minus the timed call of the same prompt), then every prompt is timed once; ms/token is the summed time
over the summed new tokens (prefill included, as a user sees it). Speedups are eager time over compiled time (above
1: compiled is faster). "outputs identical": the compiled tokens equal both eager ways' on every prompt.
"""

from __future__ import annotations

import argparse
import time

from script_args import at_least, names_from

DTYPE_NAMES = ("fp32", "bf16", "fp16")
MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def compile_config(mode: str):
    """A `CompileConfig` that transformers honours on a CPU too (`_compile_all_devices`; see the docstring)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode=mode)
    config._compile_all_devices = True
    return config


def timed_generate(model, inputs: dict, max_new_tokens: int, **kwargs) -> tuple[float, list[int]]:
    """Seconds of one plain greedy `generate` call, and its new tokens."""
    start = time.perf_counter()
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
    seconds = time.perf_counter() - start
    return seconds, out[0, inputs["input_ids"].shape[1]:].tolist()


def measure(dtype_name: str, prompts: list[dict], args) -> dict:
    """One precision's row: the three ways over `prompts` (see the module docstring)."""
    from hf_treespark.core.cpu_gemm import model_is_packed
    from hf_treespark.hub.loading import load_target
    from hf_treespark.precision import DTYPES

    dtype = DTYPES[dtype_name]
    packed, _ = load_target(None, dtype, cpu_pack=True)
    unpacked, _ = load_target(None, dtype, cpu_pack=False)
    cache_len = max(p["input_ids"].shape[1] for p in prompts) + args.max_new_tokens + 1
    ways = {
        "packed": (packed, {}),
        "unpacked": (unpacked, {}),
        "compiled": (unpacked, {"cache_implementation": "static", "max_cache_len": cache_len,
                                "compile_config": compile_config(args.compile_mode)}),
    }
    first = {}
    for name, (model, kwargs) in ways.items():  # warm-up; the compiled way compiles here
        first[name] = timed_generate(model, prompts[0], args.max_new_tokens, **kwargs)[0]
    if not hasattr(unpacked, "_compiled_call"):  # `GenerationMixin.get_compiled_call` keeps what it compiled there
        raise SystemExit("compiled_plain.py: transformers did not compile the decoding step (see its warning above)")
    seconds = dict.fromkeys(ways, 0.0)
    tokens = dict.fromkeys(ways, 0)
    same = {"packed": 0, "unpacked": 0}
    compiled_first_prompt = None
    for index, inputs in enumerate(prompts):
        outputs = {}
        for name, (model, kwargs) in ways.items():
            s, new = timed_generate(model, inputs, args.max_new_tokens, **kwargs)
            seconds[name] += s
            tokens[name] += len(new)
            outputs[name] = new
            if index == 0 and name == "compiled":
                compiled_first_prompt = s
        for eager in same:
            same[eager] += int(outputs[eager] == outputs["compiled"])
    ms = {name: 1e3 * seconds[name] / max(1, tokens[name]) for name in ways}
    return {"dtype": dtype_name, "ms": ms, "packed": model_is_packed(packed),
            "compile_s": first["compiled"] - compiled_first_prompt, "same": same, "prompts": len(prompts)}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| dtype | eager ms/token (packed) | eager ms/token (unpacked) | compiled ms/token | compile time s | "
             "compiled speedup vs packed | compiled speedup vs unpacked | outputs identical |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ms, same, n = row["ms"], row["same"], row["prompts"]
        identical = ("yes" if same["packed"] == same["unpacked"] == n else
                     f"no: compiled = packed on {same['packed']}/{n}, = unpacked on {same['unpacked']}/{n}")
        packed = f"{ms['packed']:.1f}" if row["packed"] else "n/a (no oneDNN)"
        lines.append(f"| {row['dtype']} | {packed} | {ms['unpacked']:.1f} | {ms['compiled']:.1f} | "
                     f"{row['compile_s']:.1f} | {ms['packed'] / ms['compiled']:.2f}x | "
                     f"{ms['unpacked'] / ms['compiled']:.2f}x | {identical} |")
    return "\n".join(lines)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`--help` with each option's default and the docstring as written (parsing imports no torch)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--dtypes", type=names_from(DTYPE_NAMES), default="bf16,fp32", help=f"from {', '.join(DTYPE_NAMES)}")
    p.add_argument("--num-prompts", type=at_least(1), default=3, help="MT-Bench prompts (bench_suites)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64)
    p.add_argument("--compile-mode", choices=MODES, default="default",
                   help="torch.compile's mode (reduce-overhead's CUDA graphs do nothing on a CPU)")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from hf_treespark.bench.suites import suite_inputs
    from hf_treespark.hub import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.default_target_path())
    prompts = suite_inputs(tokenizer, "mtbench", args.num_prompts)
    rows = [measure(name, prompts, args) for name in args.dtypes]
    print(f"Plain greedy decoding, offline default target, {len(prompts)} MT-Bench prompts, {args.max_new_tokens} new "
          f"tokens, {torch.get_num_threads()} torch threads, torch.compile mode {args.compile_mode!r}; torch "
          f"{torch.__version__}, transformers {__import__('transformers').__version__}.\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
