"""The Gradio page of the demo: watch tree speculative decoding commit an answer, round by round.

One round = one target forward over a packed draft tree. The target commits the longest drafted
path it agrees with plus one token of its own (the bonus). On screen each round's tokens share a
colour band and the bonus is bold and underlined, so the length of a band is the round's
acceptance length. For any finished round the page draws the drafted tree: every candidate the
drafter proposed, the `N` packed (verified) ones, and the accepted path.

What a request computes (`DemoRun`, the timed comparison, the per-round JSON) lives in
`demo_run.py`; this module only draws it and wires the controls to it, so that the page can change
without touching the run. Its names stay importable from here.

Everything but `build_app` is plain Python (HTML and SVG strings), so the package imports without
gradio. `build_app` imports gradio, the optional `demo` extra: `pip install 'hf_treespark[demo]'`.
"""

import html
import threading
from collections.abc import Callable

import torch

from ..core.tree import TreePolicy
from ..decoding.generation_output import RoundRecord
from ..hub.loading import load_drafter
from .run import (
    LIMITS,
    Band,
    DemoRun,
    DemoSettings,
    ModelPair,
    PlainRun,
    RoundStreamer,
    StopOnEvent,
    TokenText,
    check_request,
    describe_pair,
    token_label,
)

__all__ = [
    "BAND_COLOURS", "DATASTORE_COLOUR", "EXAMPLE_PROMPT", "INTRO", "LIMITS", "LOOKUP_COLOUR", "PREFILL_COLOUR",
    "Band", "DemoHandlers", "DemoRun", "DemoSettings", "ModelPair", "PlainRun", "RoundStreamer", "StopOnEvent",
    "TokenText", "acceptance_histogram", "band_colour", "build_app", "check_request", "default_round",
    "describe_pair", "import_gradio", "initial_budget", "launch", "render_answer", "render_stats", "render_tree",
    "render_tree_placeholder", "show_round", "swatch", "token_label",
]

BAND_COLOURS = ("#ffd6a5", "#b9fbc0", "#a3c4f3", "#fdffb6", "#ffc6ff", "#98f5e1", "#cfbaf0", "#ffadad")
PREFILL_COLOUR = "#e4e4e4"
LOOKUP_COLOUR = "#8e24aa"  # outline of tree nodes that a lookup branch proposed
DATASTORE_COLOUR = "#ef6c00"  # outline of tree nodes that only the datastore proposed
EXAMPLE_PROMPT = "Explain what a binary search does."


# ----- rendering -----------------------------------------------------------------------------------
def band_colour(round_index: int | None) -> str:
    return PREFILL_COLOUR if round_index is None else BAND_COLOURS[round_index % len(BAND_COLOURS)]


def render_answer(bands: list[Band]) -> str:
    """The answer as HTML: one coloured `span.ts-band` per round, the bonus token in `b.ts-bonus`.

    The `.ts-answer` element's text content is exactly the decoded answer (no separators).
    """
    if not bands:
        return '<div class="ts-empty" style="color:#888">The answer appears here, one colour band per round.</div>'
    spans = []
    for band in bands:
        text = [html.escape(piece) for piece in band.pieces]
        if band.bonus and text:
            text[-1] = f'<b class="ts-bonus" style="text-decoration:underline;text-decoration-thickness:2px">' \
                       f'{text[-1]}</b>'
        if band.round_index is None:
            kind, title = "ts-prefill", "prefill: the target's first token"
        else:
            accepted = len(band.pieces) - (1 if band.bonus else 0)
            kind = "ts-round"
            title = f"round {band.round_index + 1}: {accepted} drafted token(s) accepted" + \
                    (" + bonus" if band.bonus else "")
        spans.append(f'<span class="ts-band {kind}" title="{html.escape(title)}" '
                     f'style="background:{band_colour(band.round_index)};border-radius:3px;padding:2px 0">'
                     f'{"".join(text)}</span>')
    key = ('<div style="font-size:12px;color:#666;margin-bottom:4px">one colour band = one target forward · '
           '<b style="text-decoration:underline">bold underlined</b> = the target\'s bonus token · grey = the '
           'prefill token · hover a band for its round</div>')
    return (key + '<div class="ts-answer" style="white-space:pre-wrap;line-height:1.9;font-size:15px;color:#111">'
            + "".join(spans) + "</div>")


def render_stats(stats: dict, status: str = "") -> str:
    """The live figures as a row of tiles."""
    tiles = [
        ("acceptance length", f"{stats['acceptance_length']:.2f}" if stats["num_rounds"] else "–",
         "tokens per target forward"),
        ("rounds", f"{stats['num_rounds']}", "target forwards after prefill"),
        ("new tokens", f"{stats['new_tokens']}", f"in {stats['seconds']:.1f} s"),
        ("tokens/s", f"{stats['tokens_per_s']:.1f}", "TreeSpark, page redrawn each round"),
    ]
    if stats.get("lookup_tokens"):
        tiles.append(("from lookup", f"{stats['lookup_tokens']}", "accepted tokens only a lookup branch drafted"))
    if stats.get("datastore_tokens"):
        tiles.append(("from datastore", f"{stats['datastore_tokens']}",
                      "accepted tokens only the datastore (the target's earlier answers) proposed"))
    plain = stats.get("plain")
    if plain is not None:
        speedup = "–" if plain["speedup"] is None else f"{plain['speedup']:.2f}×"
        tiles.append(("speedup", speedup, f"TreeSpark {plain['treespark_tokens_per_s']:.1f} vs plain "
                                          f"{plain['tokens_per_s']:.1f} tokens/s, rerun back to back, no page updates"))
    cells = "".join(
        f'<div class="ts-stat" style="border:1px solid #ddd;border-radius:6px;padding:6px 10px;min-width:88px">'
        f'<div style="font-size:12px;color:#666">{html.escape(name)}</div>'
        f'<div style="font-size:22px;font-weight:600;color:#111">{html.escape(value)}</div>'
        f'<div style="font-size:11px;color:#888">{html.escape(note)}</div></div>'
        for name, value, note in tiles
    )
    lines = []
    if plain is not None and plain["check"] is not None:
        ok = plain["check_ok"]
        colour = "#1b5e20" if ok else "#b71c1c"
        lines.append(f'<div class="ts-check" style="color:{colour};font-weight:600">'
                     f'{"✓" if ok else "✗"} greedy check: {html.escape(plain["check"])}</div>')
    elif plain is not None:
        lines.append('<div class="ts-check" style="color:#555">sampling: the two outputs differ by design '
                     '(same distribution); no token-by-token check</div>')
    if status:
        lines.append(f'<div class="ts-status" style="color:#555">{html.escape(status)}</div>')
    return (f'<div class="ts-stats"><div style="display:flex;gap:8px;flex-wrap:wrap">{cells}</div>'
            + "".join(lines) + "</div>")


def acceptance_histogram(lengths: list[int], depth: int):
    """`pandas.DataFrame` of how many rounds committed 1, 2, ..., `depth + 1` tokens (more where a long
    lookup-only round committed more)."""
    import pandas as pd

    top = max([depth + 1, *lengths])
    counts = [sum(n == k for n in lengths) for k in range(1, top + 1)]
    return pd.DataFrame({"tokens per round": [str(k) for k in range(1, top + 1)], "rounds": counts})


NODE_W, NODE_H, COL_GAP, ROW_H, PAD = 112, 20, 30, 24, 8
EDGE_STYLE = {"accepted": ("#2e7d32", 2.5), "packed": ("#64b5f6", 1.5), "pruned": ("#d5d5d5", 1)}
NODE_STYLE = {"accepted": ("#c8e6c9", "#2e7d32", "#111"), "packed": ("#e3f2fd", "#64b5f6", "#111"),
              "pruned": ("#ffffff", "#cfcfcf", "#9e9e9e")}


def render_tree(record: RoundRecord, labels: dict[int, str] | Callable[[int], str], round_index: int,
                num_rounds: int) -> str:
    """One round's drafted tree as HTML + SVG, depth left to right.

    Every candidate the drafter proposed is drawn: `g.ts-node.ts-accepted` (on the accepted path),
    `.ts-packed` (packed into the tree and verified, rejected) and `.ts-pruned` (proposed, not
    packed). Each node shows its token and its joint score `sum log p` along the path. A gold
    outline marks the candidate, if any, that carries the target's bonus token.
    """
    label = labels if callable(labels) else (lambda i: labels.get(i, str(i)))
    cand = record.tree["candidates"]
    accepted_nodes = set(record.accepted_path)  # packed-tree indices, root excluded
    status = ["accepted" if cand["node_index"][c] in accepted_nodes else "packed" if cand["packed"][c] else "pruned"
              for c in range(len(cand["tokens"]))]
    bonus_token = record.committed[-1] if len(record.committed) == record.num_accepted + 1 else None
    bonus_hit = _bonus_candidate(cand, status, bonus_token)
    pos, width, height = _tree_layout(cand)
    edges = _tree_edges(cand, status, pos)
    nodes = _tree_nodes(record.tree, status, pos, label, bonus_hit)
    caption = _tree_caption(record, label, len(status), bonus_token,
                            bonus_hit is not None and status[bonus_hit] == "pruned", round_index, num_rounds)
    svg = (f'<svg class="ts-tree-svg" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}">{"".join(edges)}{"".join(nodes)}</svg>')
    return (f'<div class="ts-tree">{caption}{_tree_legend()}'
            f'<div style="overflow:auto;max-height:560px;border:1px solid #eee;border-radius:6px">{svg}</div></div>')


def _bonus_candidate(cand: dict, status: list[str], bonus_token: int | None) -> int | None:
    """The candidate, if any, that drafted the target's bonus token: a child of the deepest accepted one."""
    deepest = max((c for c in range(len(status)) if status[c] == "accepted"), key=lambda c: cand["depths"][c],
                  default=-1)  # -1: the root
    return next((c for c in range(len(status))
                 if cand["parents"][c] == deepest and cand["tokens"][c] == bonus_token), None)


def _tree_layout(cand: dict) -> tuple[dict[int, tuple[float, float]], float, float]:
    """`(top-left corner of each node, width, height)`: one column per depth; within a column, children follow
    their parent's row. Node -1 is the root."""
    depth = max(cand["depths"], default=0)
    columns: list[list[int]] = [[-1]] + [[] for _ in range(depth)]
    for c in range(len(cand["tokens"])):
        columns[cand["depths"][c]].append(c)
    row_of = {-1: 0}
    for d in range(1, depth + 1):
        columns[d].sort(key=lambda c: (row_of[cand["parents"][c]], c))
        row_of.update({c: i for i, c in enumerate(columns[d])})
    rows = max(len(col) for col in columns)
    pos = {}
    for d, col in enumerate(columns):
        spacing = rows * ROW_H / len(col)
        for i, c in enumerate(col):
            pos[c] = (PAD + d * (NODE_W + COL_GAP), PAD + (i + 0.5) * spacing - NODE_H / 2)
    return pos, (depth + 1) * (NODE_W + COL_GAP) + PAD, rows * ROW_H + 2 * PAD


def _tree_edges(cand: dict, status: list[str], pos: dict) -> list[str]:
    """One SVG curve per candidate, from its parent; the accepted path drawn last (on top)."""
    edges = []
    for c in sorted(range(len(status)), key=lambda c: ("pruned", "packed", "accepted").index(status[c])):
        (px, py), (cx, cy) = pos[cand["parents"][c]], pos[c]
        x1, y1, x2, y2 = px + NODE_W, py + NODE_H / 2, cx, cy + NODE_H / 2
        colour, stroke = EDGE_STYLE[status[c]]
        edges.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1 + COL_GAP / 2:.1f},{y1:.1f} {x2 - COL_GAP / 2:.1f},{y2:.1f} '
                     f'{x2:.1f},{y2:.1f}" fill="none" stroke="{colour}" stroke-width="{stroke}"/>')
    return edges


def _tree_nodes(tree: dict, status: list[str], pos: dict, label: Callable[[int], str],
                bonus_hit: int | None) -> list[str]:
    """One SVG group per node, the root first: its box, its token, its score, and a tooltip."""
    cand = tree["candidates"]
    from_lookup = cand.get("lookup") or [False] * len(status)
    from_store = cand.get("retrieved") or [False] * len(status)
    nodes = []
    for c in [-1, *range(len(status))]:
        x, y = pos[c]
        if c == -1:
            token, score, kind, fill, stroke, ink = tree["tokens"][0], None, "root", "#424242", "#424242", "#fff"
        else:
            token, score, kind = cand["tokens"][c], cand["scores"][c], status[c]
            fill, stroke, ink = NODE_STYLE[kind]
            if from_lookup[c]:
                stroke = LOOKUP_COLOUR
            elif from_store[c]:
                stroke = DATASTORE_COLOUR
        outline = ' stroke-dasharray="3,2"' if kind == "pruned" else ""
        if c == bonus_hit and c != -1:
            stroke, outline = "#f9a825", ' stroke-width="2.5"'
        text = label(token)
        short = text if len(text) <= 9 else text[:8] + "…"
        state = "root (x0)" if c == -1 else f"depth {cand['depths'][c]}, {kind}" + (
            ", from a lookup branch" if from_lookup[c] else ", from the datastore" if from_store[c] else "")
        title = f"{text!r} · {state}" + ("" if score is None else f" · score {score:.3f}")
        score_text = "" if score is None else (
            f'<text x="{x + NODE_W - 4:.1f}" y="{y + 14:.1f}" text-anchor="end" font-size="10" '
            f'fill="{ink}" opacity="0.75">{score:.2f}</text>')
        nodes.append(
            f'<g class="ts-node ts-{kind}{" ts-lookup" if c >= 0 and from_lookup[c] else ""}'
            f'{" ts-datastore" if c >= 0 and from_store[c] else ""}" '
            f'data-candidate="{c}"><title>{html.escape(title)}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{NODE_W}" height="{NODE_H}" rx="4" fill="{fill}" '
            f'stroke="{stroke}"{outline}/>'
            f'<text x="{x + 5:.1f}" y="{y + 14:.1f}" font-size="12" font-family="ui-monospace,monospace" '
            f'fill="{ink}">{html.escape(short)}</text>{score_text}</g>')
    return nodes


def _tree_caption(record: RoundRecord, label: Callable[[int], str], num_cand: int, bonus_token: int | None,
                  bonus_pruned: bool, round_index: int, num_rounds: int) -> str:
    """The line above a tree: the round, how much was packed and accepted, and the committed tokens."""
    committed = "".join(html.escape(label(t)) + " " for t in record.committed[:record.num_accepted])
    bonus = "" if bonus_token is None else (
        f' + bonus <b style="text-decoration:underline">{html.escape(label(bonus_token))}</b>'
        + (" (drafted, but not packed)" if bonus_pruned else ""))
    return (f'<div class="ts-tree-caption" style="margin-bottom:4px">'
            f'<b>Round {round_index + 1} of {num_rounds}</b> · packed {record.tree_size} of {num_cand} candidates '
            f'· accepted {record.num_accepted}'
            + (f" ({record.lookup_accepted} from lookup)" if record.lookup_accepted else "")
            + (f" ({record.datastore_accepted} from the datastore)" if record.datastore_accepted else "")
            + f': <span style="background:{band_colour(round_index)};'
            f'padding:1px 4px;border-radius:3px">{committed or "–"}</span>{bonus}</div>')


def _tree_legend() -> str:
    return ('<div class="ts-legend" style="font-size:12px;color:#444;margin-bottom:4px">'
            + swatch("#424242", "#424242", "root (last committed token)")
            + swatch("#c8e6c9", "#2e7d32", "accepted path")
            + swatch("#e3f2fd", "#64b5f6", "packed and verified, rejected")
            + swatch("#fff", "#cfcfcf", "proposed, pruned by packing")
            + swatch("#fff", "#f9a825", "carries the target's bonus token")
            + swatch("#fff", LOOKUP_COLOUR, "from a lookup branch (earlier text)")
            + swatch("#fff", DATASTORE_COLOUR, "from the datastore (the target's earlier answers)")
            + " · number = joint score Σ log p</div>")


def swatch(fill: str, stroke: str, text: str) -> str:
    """A legend entry: a small coloured square and its meaning."""
    return (f'<span style="display:inline-block;width:12px;height:12px;background:{fill};border:1.5px solid {stroke};'
            f'border-radius:3px;vertical-align:middle;margin:0 4px 0 12px"></span>{html.escape(text)}')


def render_tree_placeholder(text: str) -> str:
    return f'<div class="ts-tree-empty" style="color:#888">{html.escape(text)}</div>'


def default_round(lengths: list[int]) -> int:
    """The round shown first: the first one with the longest accepted run."""
    return max(range(len(lengths)), key=lambda i: (lengths[i], -i)) if lengths else 0


def show_round(index, records) -> str:
    """The tree of round `index` (1-based, clamped) from the records the last run left in the page's state."""
    if not records or not records.get("rounds"):
        return render_tree_placeholder("Generate an answer first.")
    rounds = records["rounds"]
    i = min(max(int(index) - 1, 0), len(rounds) - 1)
    return render_tree(rounds[i], records["labels"], i, len(rounds))


# ----- the app -------------------------------------------------------------------------------------
def import_gradio():
    """gradio, or a RuntimeError saying how to install it."""
    try:
        import gradio
    except ImportError as err:
        raise RuntimeError("The demo needs gradio: pip install 'hf_treespark[demo]'") from err
    return gradio


def initial_budget(target, drafter) -> tuple[int, str]:
    """The budget slider's start: the config's budget, or for `"auto"` the one chosen for this machine."""
    label = "tree budget N (nodes verified per round)"
    policy = TreePolicy.from_config(drafter.config)
    if not policy.auto:
        return policy.budget, label
    from ..calibration.latency import has_latency
    from ..decoding.budget import auto_budget

    chosen = auto_budget(target, drafter, policy)
    if chosen is None:  # no acceptance profile: the first round would decide; start from the policy default
        return TreePolicy().budget, label
    how = "measured best for this machine" if has_latency(target, drafter, policy) else "default before measuring"
    return chosen, f"{label}; {chosen} = {how} (tree_budget='auto')"


INTRO = """\
# TreeSpark: tree speculative decoding, live
A small drafter proposes a **tree** of possible continuations; the target checks the whole tree in
**one forward pass** and keeps the longest path it agrees with, plus one token of its own
(the **bonus**, bold and underlined). Each colour band below is one target forward: a long
band means many tokens for the price of one. Greedy output is plain decoding's, token for token in float32; in
half precision (bf16, fp16) it may part from it at a floating-point near-tie of the target's logits, which the
greedy check under the answer names (with "also run plain decoding"; its token position counts the prompt too).
"""


class DemoHandlers:
    """What the page's events do, and what they share: the loaded pair and each browser session's Stop flag.

    Each handler returns (or for `generate`, yields) the values of the components it updates. `session`
    is gradio's session hash, None for a caller without one.
    """

    def __init__(self, gr, pair: ModelPair, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"):
        self.gr, self.pair, self.dtype, self.device = gr, pair, dtype, device
        self.stops: dict[str | None, threading.Event] = {}

    def outputs(self, run: DemoRun | None, message: str = "", status: str = "", final: bool = False) -> tuple:
        """Values for (answer, stats, histogram, round slider, tree, result, message, records)."""
        gr = self.gr
        warning = f"**⚠ {message}**" if message else ""
        if run is None:
            return ("", "", None, gr.update(), render_tree_placeholder(""), {"error": message or None}, warning, None)
        answer, stats = render_answer(run.bands), render_stats(run.stats(), status)
        histogram = acceptance_histogram(run.committed_lengths, run.depth)
        rounds = run.output.rounds if final and run.output is not None else []
        if not rounds:
            note = "No drafting round ran." if final else "The drafted tree of every round appears here at the end."
            return answer, stats, histogram, gr.update(), render_tree_placeholder(note), run.result(), warning, None
        records = {"rounds": rounds, "labels": run.tree_labels()}
        shown = default_round(run.committed_lengths)
        tree = render_tree(rounds[shown], records["labels"], shown, len(rounds))
        # A gradio slider needs minimum < maximum: with one round it stays put, not interactive.
        slider = gr.update(minimum=1, maximum=max(len(rounds), 2), value=shown + 1, interactive=len(rounds) > 1)
        return answer, stats, histogram, slider, tree, run.result(), warning, records

    def generate(self, prompt, max_new_tokens, tree_budget, tree_topk, chain, temperature, compare,
                 tree_lookup: int | None, session: str | None):
        """Check the raw request, then stream the run: one set of outputs per round, then the final one."""
        settings = DemoSettings(max_new_tokens=max_new_tokens, tree_budget=tree_budget, tree_topk=tree_topk,
                                chain=chain, temperature=temperature, compare=compare, tree_lookup=tree_lookup)
        problem = check_request(prompt, settings)
        if problem:
            self.gr.Warning(problem)
            yield self.outputs(None, problem)
            return
        settings.max_new_tokens, settings.tree_budget, settings.tree_topk = (
            int(v) if v is not None else None for v in (max_new_tokens, tree_budget, tree_topk))
        stop = self.stops[session] = threading.Event()
        try:
            yield from self._run_steps(prompt, settings, stop)
        finally:
            self.stops.pop(session, None)

    def _run_steps(self, prompt: str, settings: DemoSettings, stop: threading.Event):
        gr = self.gr
        try:
            run = DemoRun(self.pair, prompt, settings, stop)
        except Exception as err:  # e.g. a tokenizer without a chat template
            gr.Warning(str(err))
            yield self.outputs(None, f"Could not prepare the prompt: {err}")
            return
        for _ in run.stream():
            yield self.outputs(run, status=f"drafting and verifying… round {len(run.bands) - 1}")
        if run.error:
            gr.Warning(run.error)
            yield self.outputs(run, run.error, final=True)
            return
        if settings.compare and not run.stopped:
            yield self.outputs(run, status="measuring speed: TreeSpark and plain decoding, no page updates…")
            try:
                run.compare_plain()
            except Exception as err:
                yield self.outputs(run, f"Plain decoding failed: {err}", final=True)
                return
        yield self.outputs(run, status="stopped" if run.stopped else "done", final=True)

    def stop(self, session: str | None) -> None:
        event = self.stops.get(session)
        if event is not None:
            event.set()

    def clear(self, session: str | None) -> tuple:
        """Stop the session's run; values for (prompt, *the outputs of `generate`) as on a fresh page."""
        self.stop(session)
        return ("", render_answer([]), "", None, self.gr.update(value=1, maximum=2, interactive=False),
                render_tree_placeholder(""), None, "", None)

    def load_models(self, target_text: str | None, drafter_text: str | None) -> str:
        """Swap the pair for the next requests; on failure keep the one loaded and say why."""
        target_text, drafter_text = (target_text or "").strip() or None, (drafter_text or "").strip() or None
        try:
            self.pair = ModelPair.load(target_text, drafter_text, self.dtype, self.device)
        except Exception as err:  # a missing path, a drafter for another target, ...
            message = f"Could not load the models (still using {self.pair.description}): {err}"
            self.gr.Warning(message)
            return f"**⚠ {message}**"
        return f"Loaded {self.pair.description}."


def build_app(target=None, tokenizer=None, drafter=None, *, target_name: str | None = None,
              drafter_name: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"):
    """The Gradio app (`gr.Blocks`). Pass loaded models (tests), or names/paths to load (None = defaults) in `dtype` on
    `device` (models loaded later from the *Models* panel too; with a given target: its device).

    API endpoints: `/generate` (outputs: answer HTML, stats HTML, histogram, round slider, tree
    HTML, result JSON, message; the JSON has `text`, `check` and per-round `rounds`),
    `/load_models` and `/show_round`.
    """
    gr = import_gradio()
    pair = _model_pair(target, tokenizer, drafter, target_name, drafter_name, dtype, device)
    handlers = DemoHandlers(gr, pair, dtype, pair.target.device)
    with gr.Blocks(title="TreeSpark demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                ui = _request_panel(gr, pair) | _models_panel(gr, pair)
            with gr.Column(scale=3, min_width=420):
                ui |= _answer_panel(gr)
        ui |= _tree_panel(gr)
        _wire_events(gr, ui, handlers)
    return app


def _model_pair(target, tokenizer, drafter, target_name: str | None, drafter_name: str | None,
                dtype: str | torch.dtype, device: str | torch.device) -> ModelPair:
    """The pair `build_app` was given, completed (the drafter loaded when missing, on the target's device), or loaded
    by name on `device`."""
    if target is None:
        return ModelPair.load(target_name, drafter_name, dtype, device)
    if tokenizer is None:
        raise ValueError("build_app: pass the target's tokenizer with the target")
    if drafter is None:
        drafter = load_drafter(drafter_name, next(target.parameters()).dtype, device=target.device)
    drafter.check_target(target)
    return ModelPair(target, tokenizer, drafter, describe_pair(target_name or target.name_or_path, drafter_name))


def _request_panel(gr, pair: ModelPair) -> dict:
    """The prompt, its buttons and every setting of a request."""
    config = pair.drafter.config
    ui = {"prompt": gr.Textbox(label="Prompt (the chat template is applied)", value=EXAMPLE_PROMPT, lines=3,
                               elem_id="ts-prompt")}
    with gr.Row():
        ui["generate_btn"] = gr.Button("Generate", variant="primary", elem_id="ts-generate")
        ui["stop_btn"] = gr.Button("Stop", variant="stop", elem_id="ts-stop")
        ui["clear_btn"] = gr.Button("Clear", elem_id="ts-clear")
    ui["max_new_tokens"] = gr.Slider(*LIMITS["max_new_tokens"], value=96, step=1, precision=0,
                                     label="max new tokens", elem_id="ts-max-new-tokens")
    budget, budget_label = initial_budget(pair.target, pair.drafter)
    ui["tree_budget"] = gr.Slider(*LIMITS["tree_budget"], value=budget, step=1, precision=0,
                                  label=budget_label, elem_id="ts-budget")
    ui["tree_topk"] = gr.Slider(*LIMITS["tree_topk"], value=config.tree_topk, step=1, precision=0,
                                label="children per parent (top-k)", elem_id="ts-topk")
    ui["chain"] = gr.Checkbox(label="chain instead of tree (plain DSpark drafting: one path)", value=False,
                              elem_id="ts-chain")
    ui["tree_lookup"] = gr.Slider(*LIMITS["tree_lookup"], value=config.tree_lookup, step=1, precision=0,
                                  label="lookup tokens per branch (continuations of earlier text; 0 = off)",
                                  elem_id="ts-lookup")
    ui["temperature"] = gr.Slider(*LIMITS["temperature"], value=0.0, step=0.05,
                                  label="temperature (0 = greedy)", elem_id="ts-temperature")
    ui["compare"] = gr.Checkbox(label="also run plain decoding: speedup and exactness check", value=True,
                                elem_id="ts-compare")
    return ui


def _models_panel(gr, pair: ModelPair) -> dict:
    """The folded panel that swaps the target and drafter."""
    with gr.Accordion("Models", open=False):
        return {"target_box": gr.Textbox(label="target (name or path; empty = offline SmolLM2-135M-Instruct)"),
                "drafter_box": gr.Textbox(label="drafter (name or path; empty = the shipped drafter)"),
                "load_btn": gr.Button("Load models"),
                "models_md": gr.Markdown(f"Using {pair.description}.")}


def _answer_panel(gr) -> dict:
    """The message line, the answer in round bands, the figures and the histogram of round lengths."""
    return {"message": gr.Markdown(elem_id="ts-message"),
            "answer": gr.HTML(render_answer([]), label="answer", elem_id="ts-answer-box"),
            "stats": gr.HTML(elem_id="ts-stats-box"),
            "histogram": gr.BarPlot(x="tokens per round", y="rounds", height=220,
                                    title="Tokens committed per round (accepted + bonus)", elem_id="ts-histogram")}


def _tree_panel(gr) -> dict:
    """The round picker, that round's drafted tree, the per-round JSON and the records behind them."""
    ui = {"round_slider": gr.Slider(1, 2, value=1, step=1, precision=0, interactive=False, elem_id="ts-round",
                                    label="round to inspect (drafted tree of that round)"),
          "tree": gr.HTML(render_tree_placeholder("The drafted tree of every round appears here at the end."),
                          elem_id="ts-tree-box")}
    with gr.Accordion("Per-round data (also the API result)", open=False):
        ui["result"] = gr.JSON(elem_id="ts-result")
    ui["records"] = gr.State(None)
    return ui


def _session(request) -> str | None:
    return request.session_hash if request is not None else None


def _wire_events(gr, ui: dict, handlers: DemoHandlers) -> None:
    """Connect buttons and sliders to the handlers; gradio passes the `gr.Request` by its annotation."""

    def generate(prompt, max_new_tokens, tree_budget, tree_topk, chain, temperature, compare,
                 tree_lookup: int | None = None, request: gr.Request = None):
        yield from handlers.generate(prompt, max_new_tokens, tree_budget, tree_topk, chain, temperature, compare,
                                     tree_lookup, _session(request))

    def stop(request: gr.Request):
        handlers.stop(_session(request))

    def clear(request: gr.Request):
        return handlers.clear(_session(request))

    outputs = [ui[name] for name in ("answer", "stats", "histogram", "round_slider", "tree", "result", "message",
                                     "records")]
    controls = [ui[name] for name in ("prompt", "max_new_tokens", "tree_budget", "tree_topk", "chain", "temperature",
                                      "compare", "tree_lookup")]
    # preprocess=False: `generate` gets the raw values and `check_request` answers bad ones readably.
    # show_progress="hidden": the status line says what runs; gradio's animated progress overlay kept the
    # browser busy (most of a core on a 2-core CPU), slowing the decoding it was showing.
    run_options = {"concurrency_limit": 1, "preprocess": False, "show_progress": "hidden"}
    ui["generate_btn"].click(generate, controls, outputs, api_name="generate", **run_options)
    ui["prompt"].submit(generate, controls, outputs, api_name=False, **run_options)
    ui["stop_btn"].click(stop, None, None, api_name="stop", queue=False)
    ui["clear_btn"].click(clear, None, [ui["prompt"], *outputs], api_name=False, queue=False)
    ui["round_slider"].change(show_round, [ui["round_slider"], ui["records"]], ui["tree"], api_name="show_round")
    ui["load_btn"].click(handlers.load_models, [ui["target_box"], ui["drafter_box"]], ui["models_md"],
                         api_name="load_models")


def launch(app, host: str = "127.0.0.1", port: int = 7860, share: bool = False, **kwargs):
    """Start the app's server (blocking unless `prevent_thread_lock=True`)."""
    return app.queue().launch(server_name=host, server_port=port, share=share, **kwargs)
