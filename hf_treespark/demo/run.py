"""What one demo request computes, round by round: the run behind the Gradio page, without the page.

A `DemoRun` takes one prompt through TreeSpark decoding in a worker thread and follows it round by
round: each round's committed tokens become a `Band` (their texts, and whether the last is the
target's bonus token), so the page can redraw after every round. When decoding ends it holds the
`TreeSparkGenerateOutput` (every round's drafted tree) and can run the speed comparison: TreeSpark
and plain decoding again, back to back, timed around `generate` with nothing streamed, since the
live run's time includes the page redrawing.

It lives apart from the page (`demo.py`) so that what a run computes can be read, tested and reused
without gradio: nothing here imports it, and nothing here draws.
"""

import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..calibration.measure import ensure_latency
from ..core.exactness import check_greedy_equivalence
from ..decoding.generation_output import TreeSparkGenerateOutput
from ..hub import assets
from ..hub.loading import load_pair

# Range of each control; the page's sliders use it and `check_request` enforces it for API callers.
LIMITS = {"max_new_tokens": (1, 1024), "tree_budget": (1, 128), "tree_topk": (1, 8), "temperature": (0.0, 2.0),
          "tree_lookup": (0, 7)}


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
    def load(cls, target: str | None = None, drafter: str | None = None, dtype: str | torch.dtype = "auto",
             device: str | torch.device = "cpu") -> "ModelPair":
        """By name or path (None = the offline default target / the shipped drafter), on `device`."""
        target_model, tokenizer, drafter_model = load_pair(target, drafter, dtype, device=device)
        ensure_latency(target_model, drafter_model)  # first use on this machine: for tree_budget="auto"
        # The first calls of a process pay one-time costs (packed weights, lazy set-up): before the first request,
        # so that the page's speedup compares the two decoders and not their first calls.
        warm = assets.chat_inputs(tokenizer, "Say hello.", device=target_model.device)
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
        device = getattr(self.pair.target, "device", None)  # a model's (None: any target without one)
        self.inputs = assets.chat_inputs(self.pair.tokenizer, self.prompt, device=device)
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
