"""The Gradio demo: watch tree speculative decoding commit an answer, round by round.

One round = one target forward over a packed draft tree. The target commits the longest drafted
path it agrees with plus one token of its own (the bonus). On screen each round's tokens share a
colour band and the bonus is bold and underlined, so the length of a band is the round's
acceptance length. For any finished round the app draws the drafted tree: every candidate the
drafter proposed, the `N` packed (verified) ones, and the accepted path.

The speedup is not taken from that live run: the page redraws after every round, and on a small CPU
machine the browser shares the cores with decoding. It comes from TreeSpark and plain decoding run
again back to back, same settings, each timed around its `generate` call with nothing streamed.

Everything but `build_app` is plain Python (a streamer, a stopping criterion, HTML and SVG
strings), so the package imports without gradio. `build_app` imports gradio, the optional
`demo` extra: `pip install 'hf_treespark[demo]'`.
"""

import html
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from . import assets
from .budget import ensure_latency
from .exactness import check_greedy_equivalence
from .generation import RoundRecord, TreeSparkGenerateOutput
from .loading import load_drafter, load_pair
from .tree import TreePolicy

BAND_COLOURS = ("#ffd6a5", "#b9fbc0", "#a3c4f3", "#fdffb6", "#ffc6ff", "#98f5e1", "#cfbaf0", "#ffadad")
PREFILL_COLOUR = "#e4e4e4"
LOOKUP_COLOUR = "#8e24aa"  # outline of tree nodes that a lookup branch proposed
DATASTORE_COLOUR = "#ef6c00"  # outline of tree nodes that only the datastore proposed
# Range of each control; the sliders use it and `check_request` enforces it for API callers.
LIMITS = {"max_new_tokens": (1, 1024), "tree_budget": (1, 128), "tree_topk": (1, 8), "temperature": (0.0, 2.0),
          "tree_lookup": (0, 7)}
EXAMPLE_PROMPT = "Explain what a binary search does."


# ----- one request -------------------------------------------------------------------------------
@dataclass
class DemoSettings:
    """What the controls set. `tree_budget`/`tree_topk` None: the drafter config's values."""

    max_new_tokens: int = 96
    tree_budget: int | None = None
    tree_topk: int | None = None
    chain: bool = False
    temperature: float = 0.0
    compare: bool = False
    tree_lookup: int | None = None

    def sampling_kwargs(self) -> dict:
        if self.temperature > 0:
            return {"do_sample": True, "temperature": self.temperature}
        return {"do_sample": False}

    def tree_kwargs(self) -> dict:
        knobs = {"tree_chain": self.chain}
        if self.tree_budget is not None:
            knobs["tree_budget"] = self.tree_budget
        if self.tree_topk is not None:
            knobs["tree_topk"] = self.tree_topk
        if self.tree_lookup is not None:
            knobs["tree_lookup"] = self.tree_lookup
        return knobs


def check_request(prompt: str | None, settings: DemoSettings) -> str | None:
    """A readable message for a request the demo refuses, or None.

    API callers reach this with raw values (the endpoint skips gradio's preprocessing, whose errors
    reach a client only as "verbose error reporting not enabled"): any type is checked here.
    """
    if prompt is not None and not isinstance(prompt, str):
        return f"The prompt must be text, got {prompt!r}."
    if prompt is None or not prompt.strip():
        return "The prompt is empty: type a question or an instruction first."
    for name in ("max_new_tokens", "tree_budget", "tree_topk", "temperature", "tree_lookup"):
        value = getattr(settings, name)
        low, high = LIMITS[name]
        label = name.replace("_", " ")
        if value is None and name in ("tree_budget", "tree_topk", "tree_lookup"):
            continue  # the drafter config's value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{label} must be a number between {low:g} and {high:g}, got {value!r}."
        if name != "temperature" and float(value) != int(value):
            return f"{label} must be a whole number, got {value!r}."
        if not low <= value <= high:
            return f"{label} must be between {low:g} and {high:g}, got {value:g}."
    for name in ("chain", "compare"):
        if not isinstance(getattr(settings, name), bool):
            return f"{name} must be true or false, got {getattr(settings, name)!r}."
    return None


# ----- generation plumbing -----------------------------------------------------------------------
class RoundStreamer(BaseStreamer):
    """Queues what `generate` commits: after the prompt, one list of token ids per `put` (the
    prefill token, then each round's committed tokens); `end()` queues None."""

    def __init__(self):
        self.queue: queue.Queue[list[int] | None] = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.queue.put(value.reshape(-1).tolist())

    def end(self) -> None:
        self.queue.put(None)


class StopOnEvent(StoppingCriteria):
    """Stops generation once `event` is set (the Stop button)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class TokenText:
    """The text each generated token adds, such that the pieces concatenate to `decode(all ids)`.

    A token that ends inside a multi-byte character decodes to U+FFFD; its text is held back and
    given to the token that completes the character.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, ids: list[int]) -> list[str]:
        pieces = []
        for token in ids:
            self.ids.append(token)
            full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if full.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(full[len(_common_prefix(self.text, full)):])
            self.text = full
        return pieces


def _common_prefix(a: str, b: str) -> str:
    if b.startswith(a):
        return a
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def token_label(tokenizer, token_id: int) -> str:
    """One token as a short visible label: spaces as '␣', newlines as '⏎'."""
    text = tokenizer.decode([token_id])
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅"


@dataclass
class ModelPair:
    """A target, its tokenizer, a TreeSpark drafter built for it, and how to name them on screen."""

    target: torch.nn.Module
    tokenizer: object
    drafter: torch.nn.Module
    description: str

    @classmethod
    def load(cls, target: str | None = None, drafter: str | None = None,
             dtype: str | torch.dtype = "auto") -> "ModelPair":
        """By name or path; None = the offline default target / the shipped drafter."""
        target_model, tokenizer, drafter_model = load_pair(target, drafter, dtype)
        ensure_latency(target_model, drafter_model)  # first use on this machine: for tree_budget="auto"
        # The first calls of a process pay one-time costs (packed weights, lazy set-up): before the first request,
        # so that the page's speedup compares the two decoders and not their first calls.
        warm = assets.chat_inputs(tokenizer, "Say hello.")
        target_model.generate(**warm, do_sample=False, max_new_tokens=4)
        target_model.generate(**warm, assistant_model=drafter_model, do_sample=False, max_new_tokens=4)
        return cls(target_model, tokenizer, drafter_model, describe_pair(target, drafter))


def describe_pair(target: str | None, drafter: str | None) -> str:
    return (f"target `{target or assets.DEFAULT_TARGET_NAME + ' (offline default)'}`, "
            f"drafter `{drafter or 'shipped default drafter'}`")


@dataclass
class Band:
    """Tokens committed together: by the prefill forward (`round_index` None) or by one round.

    pieces: the text of each token. bonus: the last token is the target's bonus token.
    """

    pieces: list[str]
    round_index: int | None
    bonus: bool = True


@dataclass
class PlainRun:
    """The plain-decoding comparison: plain decoding (`new_tokens` in `seconds`, `text`) and TreeSpark
    again (`treespark_tokens` in `treespark_seconds`), same settings, timed alike with nothing streamed.

    check: the greedy equivalence verdict (plain against the live run) in words, None when sampling or
    stopped. check_ok: it passed (equal, or in half precision a first divergence at a near-tie).
    identical: token for token.
    """

    new_tokens: int
    seconds: float
    text: str
    treespark_tokens: int
    treespark_seconds: float
    check: str | None = None
    check_ok: bool | None = None
    identical: bool | None = None


@dataclass
class DemoRun:
    """One prompt through TreeSpark decoding, streamed round by round, then optionally the speed comparison.

    `stream()` yields after every committed round; `bands`, `seconds` and `num_new_tokens` follow
    along. When it returns, `output` holds the `TreeSparkGenerateOutput` (rounds with trees) or
    `error` a message. `compare_plain()` then fills `plain`.
    """

    pair: ModelPair
    prompt: str
    settings: DemoSettings
    stop: threading.Event = field(default_factory=threading.Event)
    bands: list[Band] = field(default_factory=list)
    seconds: float = 0.0
    output: TreeSparkGenerateOutput | None = None
    plain: PlainRun | None = None
    error: str | None = None

    def __post_init__(self):
        self.inputs = assets.chat_inputs(self.pair.tokenizer, self.prompt)
        self.prompt_length = self.inputs["input_ids"].shape[1]
        self.text = TokenText(self.pair.tokenizer)

    @property
    def num_new_tokens(self) -> int:
        return len(self.text.ids)

    @property
    def stopped(self) -> bool:
        return self.stop.is_set()

    def _generate(self, **kwargs):
        stopping = StoppingCriteriaList([StopOnEvent(self.stop)])
        return self.pair.target.generate(**self.inputs, max_new_tokens=self.settings.max_new_tokens,
                                         stopping_criteria=stopping, **self.settings.sampling_kwargs(), **kwargs)

    def stream(self) -> Iterator[None]:
        """Run TreeSpark decoding in a thread; yield each time a round's tokens arrive."""
        streamer = RoundStreamer()
        result: dict = {}

        def work():
            try:
                begin = time.perf_counter()
                result["output"] = self._generate(assistant_model=self.pair.drafter, streamer=streamer,
                                                  return_dict_in_generate=True, tree_record=True,
                                                  **self.settings.tree_kwargs())
                result["seconds"] = time.perf_counter() - begin  # the decoding itself, not the page's drawing
            except Exception as err:  # shown in the UI; the app keeps running
                result["error"] = err
            finally:
                streamer.queue.put(None)

        start = time.perf_counter()
        thread = threading.Thread(target=work, name="treespark-generate", daemon=True)
        thread.start()
        finished = False
        try:
            while (ids := streamer.queue.get()) is not None:
                self.seconds = time.perf_counter() - start
                round_index = len(self.bands) - 1 if self.bands else None
                self.bands.append(Band(self.text.add(ids), round_index, bonus=round_index is not None))
                yield
            finished = True
        finally:
            if not finished:  # the consumer went away (page closed): end the generate thread too
                self.stop.set()
            thread.join()
        self.seconds = result.get("seconds", time.perf_counter() - start)
        if "error" in result:
            err = result["error"]
            self.error = f"Generation failed: {str(err) or type(err).__name__}"
            return
        self.output = result["output"]
        for band, record in zip(self.bands[1:], self.output.rounds, strict=False):
            band.bonus = len(record.committed) == record.num_accepted + 1  # False: cut short by EOS/length/stop

    def _timed_generate(self, **kwargs) -> tuple[torch.Tensor, float]:
        """`[1, prompt + new]` token ids and the seconds `generate` took, nothing streamed."""
        start = time.perf_counter()
        sequences = self._generate(**kwargs)
        return sequences, time.perf_counter() - start

    def compare_plain(self) -> None:
        """The speedup and, for greedy, the equivalence check.

        The live run's time includes the page redrawing after every round, so TreeSpark runs again
        here, then plain decoding: same settings, back to back, timed the same way. The check
        compares plain decoding with the live run's output, the answer on the page.
        """
        treespark, treespark_seconds = self._timed_generate(assistant_model=self.pair.drafter,
                                                            **self.settings.tree_kwargs())
        sequences, seconds = self._timed_generate()
        new = sequences[0, self.prompt_length:].tolist()
        self.plain = PlainRun(len(new), seconds, self.pair.tokenizer.decode(new, skip_special_tokens=True),
                              treespark.shape[1] - self.prompt_length, treespark_seconds)
        if not self.settings.sampling_kwargs()["do_sample"] and not self.stopped:
            report = check_greedy_equivalence(self.pair.target, sequences, self.output.sequences)
            self.plain.check, self.plain.check_ok = str(report), report.ok
            self.plain.identical = report.ok and report.position is None

    # ----- what the UI shows ------------------------------------------------------------------
    @property
    def answer(self) -> str:
        return self.text.tokenizer.decode(self.text.ids, skip_special_tokens=True)

    @property
    def committed_lengths(self) -> list[int]:
        return [len(band.pieces) for band in self.bands[1:]]

    @property
    def depth(self) -> int:
        return self.pair.drafter.config.block_size

    def tokens_per_second(self) -> float:
        return _rate(self.num_new_tokens, self.seconds)

    def stats(self) -> dict:
        """The live figures: rounds, tokens, acceptance length, tokens/s (of the live run, the page redrawn
        each round), and the comparison: `plain.tokens_per_s`, `plain.treespark_tokens_per_s` (the runs
        without streaming) and their ratio `plain.speedup`."""
        lengths = self.committed_lengths
        records = self.output.rounds if self.output is not None else []
        figures = {
            "num_rounds": len(lengths),
            "new_tokens": self.num_new_tokens,
            "lookup_tokens": sum(r.lookup_accepted for r in records),
            "datastore_tokens": sum(r.datastore_accepted for r in records),
            "acceptance_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "tokens_per_s": self.tokens_per_second(),
            "seconds": self.seconds,
        }
        if self.plain is not None:
            plain_rate = _rate(self.plain.new_tokens, self.plain.seconds)
            treespark_rate = _rate(self.plain.treespark_tokens, self.plain.treespark_seconds)
            figures["plain"] = {
                "tokens_per_s": plain_rate,
                "treespark_tokens_per_s": treespark_rate,
                "speedup": treespark_rate / plain_rate if plain_rate > 0 else None,
                "text": self.plain.text,
                "check": self.plain.check,
                "check_ok": self.plain.check_ok,
                "identical": self.plain.identical,
            }
        return figures

    def result(self) -> dict:
        """Everything as JSON: the answer, the figures, the greedy check and per-round data.

        Each round: `committed` (token texts), `committed_ids`, `num_accepted`, `tree_size`, `bonus`;
        the ids and counts are None until generation has finished.
        """
        records = self.output.rounds if self.output is not None else [None] * (len(self.bands) - 1)
        rounds = [{
            "round": i + 1,
            "committed": band.pieces,
            "committed_ids": None if record is None else record.committed,
            "num_accepted": None if record is None else record.num_accepted,
            "tree_size": None if record is None else record.tree_size,
            "lookup_accepted": None if record is None else record.lookup_accepted,
            "datastore_accepted": None if record is None else record.datastore_accepted,
            "bonus": band.bonus,
        } for i, (band, record) in enumerate(zip(self.bands[1:], records, strict=False))]
        stats = self.stats()
        return {
            "text": self.answer,
            "new_token_ids": list(self.text.ids),
            "prefill_token": self.bands[0].pieces[0] if self.bands else None,
            "rounds": rounds,
            **stats,
            "check": (stats.get("plain") or {}).get("check"),
            "stopped": self.stopped,
            "finished": self.output is not None,
            "error": self.error,
        }

    def tree_labels(self) -> dict[int, str]:
        """Label of every token that appears in a recorded tree (for `render_tree` without a tokenizer)."""
        tokenizer = self.text.tokenizer
        ids = set()
        for record in self.output.rounds if self.output is not None else []:
            ids.update(record.tree["candidates"]["tokens"])
            ids.update(record.tree["tokens"])
            ids.update(record.committed)
        return {i: token_label(tokenizer, i) for i in ids}


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


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


def render_tree(record: RoundRecord, labels: dict[int, str] | Callable[[int], str], round_index: int,
                num_rounds: int) -> str:
    """One round's drafted tree as HTML + SVG, depth left to right.

    Every candidate the drafter proposed is drawn: `g.ts-node.ts-accepted` (on the accepted path),
    `.ts-packed` (packed into the tree and verified, rejected) and `.ts-pruned` (proposed, not
    packed). Each node shows its token and its joint score `sum log p` along the path. A gold
    outline marks the candidate, if any, that carries the target's bonus token.
    """
    label = labels if callable(labels) else (lambda i: labels.get(i, str(i)))
    tree = record.tree
    cand = tree["candidates"]
    num_cand = len(cand["tokens"])
    accepted_nodes = set(record.accepted_path)  # packed-tree indices, root excluded
    status = ["accepted" if cand["node_index"][c] in accepted_nodes else "packed" if cand["packed"][c] else "pruned"
              for c in range(num_cand)]
    deepest = max((c for c in range(num_cand) if status[c] == "accepted"), key=lambda c: cand["depths"][c],
                  default=-1)  # -1: the root
    bonus_token = record.committed[-1] if len(record.committed) == record.num_accepted + 1 else None
    bonus_hit = next((c for c in range(num_cand)
                      if cand["parents"][c] == deepest and cand["tokens"][c] == bonus_token), None)

    # Layout: one column per depth; within a column, children follow their parent's row.
    depth = max(cand["depths"], default=0)
    columns: list[list[int]] = [[-1]] + [[] for _ in range(depth)]
    for c in range(num_cand):
        columns[cand["depths"][c]].append(c)
    row_of = {-1: 0}
    for d in range(1, depth + 1):
        columns[d].sort(key=lambda c: (row_of[cand["parents"][c]], c))
        row_of.update({c: i for i, c in enumerate(columns[d])})
    rows = max(len(col) for col in columns)
    height = rows * ROW_H + 2 * PAD
    width = (depth + 1) * (NODE_W + COL_GAP) + PAD
    pos = {}
    for d, col in enumerate(columns):
        spacing = rows * ROW_H / len(col)
        for i, c in enumerate(col):
            pos[c] = (PAD + d * (NODE_W + COL_GAP), PAD + (i + 0.5) * spacing - NODE_H / 2)

    edge_style = {"accepted": ("#2e7d32", 2.5), "packed": ("#64b5f6", 1.5), "pruned": ("#d5d5d5", 1)}
    edges, nodes = [], []
    for c in sorted(range(num_cand), key=lambda c: ("pruned", "packed", "accepted").index(status[c])):
        (px, py), (cx, cy) = pos[cand["parents"][c]], pos[c]
        x1, y1, x2, y2 = px + NODE_W, py + NODE_H / 2, cx, cy + NODE_H / 2
        colour, stroke = edge_style[status[c]]
        edges.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1 + COL_GAP / 2:.1f},{y1:.1f} {x2 - COL_GAP / 2:.1f},{y2:.1f} '
                     f'{x2:.1f},{y2:.1f}" fill="none" stroke="{colour}" stroke-width="{stroke}"/>')
    node_style = {"accepted": ("#c8e6c9", "#2e7d32", "#111"), "packed": ("#e3f2fd", "#64b5f6", "#111"),
                  "pruned": ("#ffffff", "#cfcfcf", "#9e9e9e")}
    from_lookup = cand.get("lookup") or [False] * num_cand
    from_store = cand.get("retrieved") or [False] * num_cand
    for c in [-1, *range(num_cand)]:
        x, y = pos[c]
        if c == -1:
            token, score, kind, fill, stroke, ink = tree["tokens"][0], None, "root", "#424242", "#424242", "#fff"
        else:
            token, score, kind = cand["tokens"][c], cand["scores"][c], status[c]
            fill, stroke, ink = node_style[kind]
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

    committed = "".join(html.escape(label(t)) + " " for t in record.committed[:record.num_accepted])
    bonus = "" if bonus_token is None else (
        f' + bonus <b style="text-decoration:underline">{html.escape(label(bonus_token))}</b>'
        + (" (drafted, but not packed)" if bonus_hit is not None and status[bonus_hit] == "pruned" else ""))
    caption = (f'<div class="ts-tree-caption" style="margin-bottom:4px">'
               f'<b>Round {round_index + 1} of {num_rounds}</b> · packed {record.tree_size} of {num_cand} candidates '
               f'· accepted {record.num_accepted}'
               + (f" ({record.lookup_accepted} from lookup)" if record.lookup_accepted else "")
               + (f" ({record.datastore_accepted} from the datastore)" if record.datastore_accepted else "")
               + f': <span style="background:{band_colour(round_index)};'
               f'padding:1px 4px;border-radius:3px">{committed or "–"}</span>{bonus}</div>')
    legend = ('<div class="ts-legend" style="font-size:12px;color:#444;margin-bottom:4px">'
              + swatch("#424242", "#424242", "root (last committed token)")
              + swatch("#c8e6c9", "#2e7d32", "accepted path")
              + swatch("#e3f2fd", "#64b5f6", "packed and verified, rejected")
              + swatch("#fff", "#cfcfcf", "proposed, pruned by packing")
              + swatch("#fff", "#f9a825", "carries the target's bonus token")
              + swatch("#fff", LOOKUP_COLOUR, "from a lookup branch (earlier text)")
              + swatch("#fff", DATASTORE_COLOUR, "from the datastore (the target's earlier answers)")
              + " · number = joint score Σ log p</div>")
    svg = (f'<svg class="ts-tree-svg" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}">{"".join(edges)}{"".join(nodes)}</svg>')
    return (f'<div class="ts-tree">{caption}{legend}'
            f'<div style="overflow:auto;max-height:560px;border:1px solid #eee;border-radius:6px">{svg}</div></div>')


def swatch(fill: str, stroke: str, text: str) -> str:
    """A legend entry: a small coloured square and its meaning."""
    return (f'<span style="display:inline-block;width:12px;height:12px;background:{fill};border:1.5px solid {stroke};'
            f'border-radius:3px;vertical-align:middle;margin:0 4px 0 12px"></span>{html.escape(text)}')


def render_tree_placeholder(text: str) -> str:
    return f'<div class="ts-tree-empty" style="color:#888">{html.escape(text)}</div>'


def default_round(lengths: list[int]) -> int:
    """The round shown first: the first one with the longest accepted run."""
    return max(range(len(lengths)), key=lambda i: (lengths[i], -i)) if lengths else 0


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
    from .budget import auto_budget, has_latency

    chosen = auto_budget(target, drafter, policy)
    if chosen is None:  # no acceptance profile: the first round would decide; start from the policy default
        return TreePolicy().budget, label
    how = "measured best for this machine" if has_latency(target, drafter, policy) else "default before measuring"
    return chosen, f"{label}; {chosen} = {how} (tree_budget='auto')"


class _AppState:
    """What the app's event handlers share: the loaded pair and each session's Stop flag."""

    def __init__(self, pair: ModelPair):
        self.pair = pair
        self.stops: dict[str, threading.Event] = {}


INTRO = """\
# TreeSpark: tree speculative decoding, live
A small drafter proposes a **tree** of possible continuations; the target checks the whole tree in
**one forward pass** and keeps the longest path it agrees with, plus one token of its own
(the **bonus**, bold and underlined). Each colour band below is one target forward: a long
band means many tokens for the price of one. Greedy output is identical to plain decoding.
"""


def build_app(target=None, tokenizer=None, drafter=None, *, target_name: str | None = None,
              drafter_name: str | None = None, dtype: str | torch.dtype = "auto"):
    """The Gradio app (`gr.Blocks`). Pass loaded models (tests), or names/paths to load (None = defaults).

    API endpoints: `/generate` (outputs: answer HTML, stats HTML, histogram, round slider, tree
    HTML, result JSON, message; the JSON has `text`, `check` and per-round `rounds`),
    `/load_models` and `/show_round`.
    """
    gr = import_gradio()
    if target is None:
        pair = ModelPair.load(target_name, drafter_name, dtype)
    else:
        if tokenizer is None:
            raise ValueError("build_app: pass the target's tokenizer with the target")
        if drafter is None:
            drafter = load_drafter(drafter_name, next(target.parameters()).dtype)
        drafter.check_target(target)
        pair = ModelPair(target, tokenizer, drafter, describe_pair(target_name or target.name_or_path, drafter_name))
    state = _AppState(pair)
    config = pair.drafter.config

    def outputs_for(run: DemoRun | None, message: str = "", status: str = "", final: bool = False):
        """Values for (answer, stats, histogram, round slider, tree, result, message, records)."""
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

    def generate(prompt, max_new_tokens, tree_budget, tree_topk, chain, temperature, compare,
                 tree_lookup: int | None = None, request: gr.Request = None):
        settings = DemoSettings(max_new_tokens=max_new_tokens, tree_budget=tree_budget, tree_topk=tree_topk,
                                chain=chain, temperature=temperature, compare=compare, tree_lookup=tree_lookup)
        problem = check_request(prompt, settings)
        if problem:
            gr.Warning(problem)
            yield outputs_for(None, problem)
            return
        settings.max_new_tokens, settings.tree_budget, settings.tree_topk = (
            int(v) if v is not None else None for v in (max_new_tokens, tree_budget, tree_topk))
        session = request.session_hash if request is not None else None
        stop = state.stops[session] = threading.Event()
        try:
            yield from run_steps(prompt, settings, stop)
        finally:
            state.stops.pop(session, None)

    def run_steps(prompt: str, settings: DemoSettings, stop: threading.Event):
        try:
            run = DemoRun(state.pair, prompt, settings, stop)
        except Exception as err:  # e.g. a tokenizer without a chat template
            gr.Warning(str(err))
            yield outputs_for(None, f"Could not prepare the prompt: {err}")
            return
        for _ in run.stream():
            yield outputs_for(run, status=f"drafting and verifying… round {len(run.bands) - 1}")
        if run.error:
            gr.Warning(run.error)
            yield outputs_for(run, run.error, final=True)
            return
        if settings.compare and not run.stopped:
            yield outputs_for(run, status="measuring speed: TreeSpark and plain decoding, no page updates…")
            try:
                run.compare_plain()
            except Exception as err:
                yield outputs_for(run, f"Plain decoding failed: {err}", final=True)
                return
        yield outputs_for(run, status="stopped" if run.stopped else "done", final=True)

    def stop(request: gr.Request):
        event = state.stops.get(request.session_hash if request is not None else None)
        if event is not None:
            event.set()

    def clear(request: gr.Request):
        stop(request)
        return ("", render_answer([]), "", None, gr.update(value=1, maximum=2, interactive=False),
                render_tree_placeholder(""), None, "", None)

    def show_round(index, records):
        if not records or not records.get("rounds"):
            return render_tree_placeholder("Generate an answer first.")
        rounds = records["rounds"]
        i = min(max(int(index) - 1, 0), len(rounds) - 1)
        return render_tree(rounds[i], records["labels"], i, len(rounds))

    def load_models(target_text, drafter_text):
        target_text, drafter_text = (target_text or "").strip() or None, (drafter_text or "").strip() or None
        try:
            state.pair = ModelPair.load(target_text, drafter_text, dtype)
        except Exception as err:  # a missing path, a drafter for another target, ...
            message = f"Could not load the models (still using {state.pair.description}): {err}"
            gr.Warning(message)
            return f"**⚠ {message}**"
        return f"Loaded {state.pair.description}."

    with gr.Blocks(title="TreeSpark demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=2, min_width=320):
                prompt = gr.Textbox(label="Prompt (the chat template is applied)", value=EXAMPLE_PROMPT, lines=3,
                                    elem_id="ts-prompt")
                with gr.Row():
                    generate_btn = gr.Button("Generate", variant="primary", elem_id="ts-generate")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="ts-stop")
                    clear_btn = gr.Button("Clear", elem_id="ts-clear")
                max_new_tokens = gr.Slider(*LIMITS["max_new_tokens"], value=96, step=1, precision=0,
                                           label="max new tokens", elem_id="ts-max-new-tokens")
                budget, budget_label = initial_budget(pair.target, pair.drafter)
                tree_budget = gr.Slider(*LIMITS["tree_budget"], value=budget, step=1, precision=0,
                                        label=budget_label, elem_id="ts-budget")
                tree_topk = gr.Slider(*LIMITS["tree_topk"], value=config.tree_topk, step=1, precision=0,
                                      label="children per parent (top-k)", elem_id="ts-topk")
                chain = gr.Checkbox(label="chain instead of tree (plain DSpark drafting: one path)", value=False,
                                    elem_id="ts-chain")
                tree_lookup = gr.Slider(*LIMITS["tree_lookup"], value=config.tree_lookup, step=1, precision=0,
                                        label="lookup tokens per branch (continuations of earlier text; 0 = off)",
                                        elem_id="ts-lookup")
                temperature = gr.Slider(*LIMITS["temperature"], value=0.0, step=0.05,
                                        label="temperature (0 = greedy)", elem_id="ts-temperature")
                compare = gr.Checkbox(label="also run plain decoding: speedup and exactness check", value=True,
                                      elem_id="ts-compare")
                with gr.Accordion("Models", open=False):
                    target_box = gr.Textbox(label="target (name or path; empty = offline SmolLM2-135M-Instruct)")
                    drafter_box = gr.Textbox(label="drafter (name or path; empty = the shipped drafter)")
                    load_btn = gr.Button("Load models")
                    models_md = gr.Markdown(f"Using {pair.description}.")
            with gr.Column(scale=3, min_width=420):
                message = gr.Markdown(elem_id="ts-message")
                answer = gr.HTML(render_answer([]), label="answer", elem_id="ts-answer-box")
                stats = gr.HTML(elem_id="ts-stats-box")
                histogram = gr.BarPlot(x="tokens per round", y="rounds", height=220,
                                       title="Tokens committed per round (accepted + bonus)", elem_id="ts-histogram")
        round_slider = gr.Slider(1, 2, value=1, step=1, precision=0, interactive=False, elem_id="ts-round",
                                 label="round to inspect (drafted tree of that round)")
        tree = gr.HTML(render_tree_placeholder("The drafted tree of every round appears here at the end."),
                       elem_id="ts-tree-box")
        with gr.Accordion("Per-round data (also the API result)", open=False):
            result = gr.JSON(elem_id="ts-result")
        records = gr.State(None)

        outputs = [answer, stats, histogram, round_slider, tree, result, message, records]
        controls = [prompt, max_new_tokens, tree_budget, tree_topk, chain, temperature, compare, tree_lookup]
        # preprocess=False: `generate` gets the raw values and `check_request` answers bad ones readably.
        # show_progress="hidden": the status line says what runs; gradio's animated progress overlay kept the
        # browser busy (most of a core on a 2-core CPU), slowing the decoding it was showing.
        run_options = {"concurrency_limit": 1, "preprocess": False, "show_progress": "hidden"}
        generate_btn.click(generate, controls, outputs, api_name="generate", **run_options)
        prompt.submit(generate, controls, outputs, api_name=False, **run_options)
        stop_btn.click(stop, None, None, api_name="stop", queue=False)
        clear_btn.click(clear, None, [prompt, *outputs], api_name=False, queue=False)
        round_slider.change(show_round, [round_slider, records], tree, api_name="show_round")
        load_btn.click(load_models, [target_box, drafter_box], models_md, api_name="load_models")
    return app


def launch(app, host: str = "127.0.0.1", port: int = 7860, share: bool = False, **kwargs):
    """Start the app's server (blocking unless `prevent_thread_lock=True`)."""
    return app.queue().launch(server_name=host, server_port=port, share=share, **kwargs)
