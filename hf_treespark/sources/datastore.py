"""Datastore branches: continuations of the text's suffix in the target's own earlier outputs.

Lookup branches (`lookup.py`) find text the answer copies from its prompt or from itself; the datastore
finds the target's house style (openings, list formats, stock phrases, code idioms) in what it answered
to other prompts, which is where an answer starts and lookup has nothing yet. Both graft into the one
tree verified per round, so exactness does not depend on either.

The index. The token ids of the stored sequences (each the target's response, preceded by the last
`HEADER_TOKENS` tokens of its prompt, so that a match on the assistant header proposes the answer's
opening) are concatenated with a separator between sequences. Every position `e` that holds a token is
sorted by its *left* context, `tokens[e], tokens[e - 1], ..., tokens[e - MAX_MATCH + 1]` (a suffix array of
the reversed text, cut at `MAX_MATCH` tokens): the occurrences of any suffix `s` of length `n <=
MAX_MATCH` are one contiguous range, so the longest suffix of the current text that occurs in the store is
found by narrowing a range one token at a time (`2 n` binary searches). What followed the occurrences,
`tokens[e + 1: e + 1 + depth]`, is read for up to `SAMPLE` of them, evenly spread over the range (the range is
ordered by the context further left, which says little about what follows, so an even sample is a fair
one), and merged into a trie with counts (`Datastore.branches`). Size on disk: 2 bytes a token (4 for
vocabularies over 65,535 ids) and 4 for its sorted position; memory as on disk, plus nothing per lookup.

Scores. Packing compares drafted, looked-up and retrieved nodes on one scale, the log-probability of the
path. A retrieved node's step probability is an estimate that the target produces its token given that it
produced the parent's, from the node's evidence: `n`, the length of the context the counts condition on
(the match plus the node's depth - 1), `share = count / parent count`, and `support = parent count`:

    p = sigmoid(a + b * logit(share') + c * log(n) + d * log(support)),
    share' = (count + 0.5) / (parent count + 1)       (no share of 0 or 1 on little evidence)

The coefficients `DATASTORE_CALIBRATION` were fitted (logistic regression, `scripts/calibrate_datastore.py`)
on the target's float32 greedy answers to 300 held-out training prompts (`sharegpt_smollm2_regen_part2.jsonl`),
with a store built from the other shared responses and `training_data/`, at every other position of the
first 128 tokens of each answer: whether each trie node's token was the target's next one, given that its
parent's was: 131,710 nodes, 17.7% of them right; fitted `a, b, c, d = -2.74, 1.00, 0.98, 0.13`, and by
decile of the fitted probability the observed rate was 0.02 / 0.14 / 0.22 / 0.33 / 0.39 / 0.54 / 0.74 / 0.80 /
0.80 / 0.95. Nodes whose path probability falls under `MIN_PATH_PROB` are not proposed (a node costs a few
percent of a plain step to verify on a CPU: a node worth proposing is accepted about that often), and at most
`MAX_NODES` are (the most probable paths). On the same positions (the first 64 tokens of the answers; tokens
accepted per position by the retrieved tree alone, and its nodes): path probability >= 0.1 and 8 nodes 0.95
(2.9 nodes), >= 0.05 and 8 nodes 1.08 (4.1), >= 0.02 and 8 nodes 1.16 (5.5), >= 0.05 and 16 nodes 1.16 (5.1);
>= 0.05 with 8 nodes gains about 0.1 token per extra node over >= 0.1, and less beyond.

Growing with use. `Datastore.add(ids)` indexes a finished output too (`generate` does it when the drafter's
`datastore_grow_tokens` is above 0): what is added lives in a second, small index, rebuilt on each add,
holding the most recent `grow_tokens` tokens (older outputs are dropped first), so memory stays bounded.

Stored as `datastore.safetensors` (no pickle) in the drafter's directory: tensors `tokens` and `positions`,
metadata `format`, `version`, `vocab_size`, `max_match`, and where known `tokenizer` (the identity of the
tokenizer the text was tokenised with: `tokenizer_identity`, as JSON) and `sources` (a JSON list of the content
hashes of the files indexed, so that adding one again is noticed). Loading checks the format, the vocabulary, the
index's shape and (given one) the tokenizer, and refuses a damaged or foreign file naming it, before any
decoding. In memory a store pickles as
its arrays, so a drafter carrying one can be deep-copied, pickled and `torch.save`d.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .base import register_source

DATASTORE_FILE = "datastore.safetensors"
FORMAT = "hf_treespark.datastore"  # the file format's name (not the module's path)
VERSION = "1"
MAX_MATCH = 8  # the longest suffix looked up (tokens)
MIN_MATCH = 2  # shorter matches propose nothing (a single token says little about what follows)
HEADER_TOKENS = 4  # prompt tokens kept before each stored response (the assistant header)
SAMPLE = 64  # occurrences read per match
DEPTH = 8  # tokens read after each occurrence
MAX_NODES = 8  # retrieved nodes proposed per round at most
MIN_PATH_PROB = 0.05  # ... each with an estimated path probability at least this
DATASTORE_CALIBRATION = (-2.74, 1.00, 0.98, 0.13)  # a, b, c, d of the step probability (module docstring)
SEPARATOR = -1


class DatastoreError(ValueError):
    """A datastore file that is damaged, or built for another vocabulary."""


class _Index:
    """One sorted index: `tokens` (int32, separators between sequences and `MAX_MATCH` before the first, `DEPTH`
    after the last) and `positions` (int32: every token's position, ordered by its left context)."""

    def __init__(self, tokens: np.ndarray, positions: np.ndarray):
        self.tokens = tokens
        self.positions = positions
        self._tokens = memoryview(tokens)  # Python ints at list speed for the binary searches
        self._positions = memoryview(positions)

    def __getstate__(self) -> dict:
        """The arrays alone: a memoryview cannot be pickled (`copy.deepcopy`, `pickle`, `torch.save` of a drafter)."""
        return {"tokens": self.tokens, "positions": self.positions}

    def __setstate__(self, state: dict) -> None:
        self.__init__(np.ascontiguousarray(state["tokens"]), np.ascontiguousarray(state["positions"]))

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]]) -> _Index:
        pieces = [np.full(MAX_MATCH, SEPARATOR, np.int32)]
        for seq in sequences:
            if len(seq):
                pieces.append(np.asarray(seq, dtype=np.int32))
                pieces.append(np.full(1, SEPARATOR, np.int32))
        pieces.append(np.full(DEPTH, SEPARATOR, np.int32))
        tokens = np.ascontiguousarray(np.concatenate(pieces))
        ends = np.flatnonzero(tokens != SEPARATOR).astype(np.int32)
        # sort by tokens[e], then tokens[e - 1], ...: lexsort's last key is the primary one
        keys = [tokens[ends - k] for k in range(MAX_MATCH - 1, -1, -1)]
        return cls(tokens, np.ascontiguousarray(ends[np.lexsort(keys)]))

    def __len__(self) -> int:
        return len(self.positions)

    def match(self, suffix: Sequence[int]) -> tuple[int, int, int]:
        """`(n, lo, hi)`: the longest `n` such that the last `n` tokens of `suffix` occur, at `positions[lo:hi]`."""
        tokens, positions = self._tokens, self._positions
        lo, hi, n = 0, len(self.positions), 0
        for k in range(min(MAX_MATCH, len(suffix))):
            token = suffix[-1 - k]
            key = lambda i, k=k: tokens[positions[i] - k]  # noqa: E731
            new_lo = bisect_left(range(len(self.positions)), token, lo, hi, key=key)
            new_hi = bisect_right(range(len(self.positions)), token, new_lo, hi, key=key)
            if new_lo == new_hi:
                break
            lo, hi, n = new_lo, new_hi, k + 1
        return n, lo, hi

    def follow(self, lo: int, hi: int, depth: int) -> np.ndarray:
        """`[m, depth]`: what followed up to `SAMPLE` of the occurrences `positions[lo:hi]`, evenly spread."""
        count = hi - lo
        picks = lo + (np.arange(min(count, SAMPLE)) * count) // min(count, SAMPLE)
        ends = self.positions[picks]
        return self.tokens[ends[:, None] + 1 + np.arange(depth)]

    def sequences(self) -> list[np.ndarray]:
        """The indexed sequences (int32 arrays), in the order they were given."""
        cuts = np.flatnonzero(self.tokens == SEPARATOR)
        pieces = np.split(self.tokens, cuts)
        return [piece[1:] for piece in pieces if len(piece) > 1]


class Datastore:
    """The target's earlier outputs, indexed for longest-suffix lookup (see the module docstring).

    `Datastore.build(sequences, vocab_size)`, `Datastore.load(directory_or_file, vocab_size)`, `save(directory)`;
    `branches(history)` proposes a round's retrieved nodes; `add(ids)` indexes a new output.
    """

    def __init__(self, index: _Index, vocab_size: int, grow_tokens: int = 0, tokenizer: dict | None = None,
                 sources: Sequence[str] = ()):
        self.index = index
        self.vocab_size = int(vocab_size)
        self.grow_tokens = int(grow_tokens)
        self.tokenizer = tokenizer  # `tokenizer_identity` of what tokenised the text, None when not known
        self.sources = list(sources)  # content hashes of the files indexed (`treespark datastore`)
        self.grown: list[np.ndarray] = []
        self.grown_index: _Index | None = None

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, tokenizer: dict | None = None,
              sources: Sequence[str] = ()) -> Datastore:
        """Index `sequences` (each a list, array or tensor of integer token ids below `vocab_size`); `tokenizer` (a
        `tokenizer_identity`) and `sources` (content hashes of the files they came from) are recorded with them.
        Raises `DatastoreError` naming the sequence and position of an id that is outside the vocabulary or not an
        integer (a float is never truncated to one, a string never parsed as one)."""
        sequences = [_token_ids(seq, i) for i, seq in enumerate(sequences)]
        for i, seq in enumerate(sequences):
            if len(seq) and (seq.min() < 0 or seq.max() >= vocab_size):
                j = int(np.flatnonzero((seq < 0) | (seq >= vocab_size))[0])
                raise DatastoreError(f"sequence {i}, position {j} holds token id {seq[j]}, outside the vocabulary "
                                     f"[0, {vocab_size})")
        if not any(len(seq) for seq in sequences):
            raise DatastoreError("no tokens to index: the data holds no response")
        return cls(_Index.build(sequences), vocab_size, tokenizer=tokenizer, sources=sources)

    def sequences(self) -> list[np.ndarray]:
        """The sequences built into the index (not what `add` grew), as given to `build`: `Datastore.build(
        store.sequences() + more, vocab_size)` is the store with `more` appended."""
        return self.index.sequences()

    @property
    def num_tokens(self) -> int:
        return len(self.index) + (len(self.grown_index) if self.grown_index is not None else 0)

    def __repr__(self) -> str:
        grown = sum(len(g) for g in self.grown)
        return f"Datastore({len(self.index):,} tokens, vocab_size={self.vocab_size}, grown={grown:,})"

    # ----- lookup ---------------------------------------------------------------------------------------
    def lookup(self, history: Sequence[int], depth: int = DEPTH) -> tuple[int, np.ndarray]:
        """`(n, follow)`: the longest suffix of `history` found (`n` tokens, 0 if under `MIN_MATCH`) in the store
        or in what was added, and `[m, depth]` tokens that followed its occurrences (separator-padded)."""
        suffix = list(history[-MAX_MATCH:])
        found = [(index.match(suffix), index) for index in (self.index, self.grown_index) if index is not None]
        n = max(m for (m, _, _), _ in found)
        if n < MIN_MATCH:
            return 0, np.zeros((0, depth), np.int32)
        rows = [index.follow(lo, hi, depth) for (m, lo, hi), index in found if m == n]
        return n, np.concatenate(rows) if len(rows) > 1 else rows[0]

    def counts(self, history: Sequence[int], depth: int = DEPTH) -> tuple[int, dict[tuple[int, ...], int], int]:
        """`(n, counts, total)`: the match length, how often each continuation prefix followed the `total` read
        occurrences of the longest suffix of `history` (`{(t1, ..., td): count}`), and `total`."""
        n, follow = self.lookup(history, depth)
        counts: dict[tuple[int, ...], int] = {}
        for row in follow.tolist():
            for d in range(depth):
                if row[d] == SEPARATOR:
                    break
                prefix = tuple(row[: d + 1])
                counts[prefix] = counts.get(prefix, 0) + 1
        return n, counts, len(follow)

    def branches(self, history: Sequence[int], depth: int = DEPTH, max_nodes: int = MAX_NODES,
                 min_path_prob: float = MIN_PATH_PROB) -> list[tuple[int, int, float]]:
        """This round's retrieved nodes for the text `history` (its last token is the tree's root `x0`): a list of
        `(parent, token, log_step_prob)` in an order where parents come first; `parent` is -1 (the root) or an
        index into the list. At most `max_nodes`, the most probable paths with probability >= `min_path_prob`."""
        n, counts, total = self.counts(history, depth)
        if n == 0:
            return []
        floor = math.log(min_path_prob)
        paths = {(): 0.0}  # prefix -> log path probability
        for prefix in sorted(counts, key=len):  # parents before children
            parent = prefix[:-1]
            if parent in paths:
                step = step_log_prob(counts[prefix], counts.get(parent, total), n + len(prefix) - 1)
                if paths[parent] + step >= floor:
                    paths[prefix] = paths[parent] + step
        kept = sorted((p for p in paths if p), key=lambda p: (-paths[p], len(p)))[:max_nodes]
        kept.sort(key=len)  # the best paths are prefix-closed (a path never beats its parent): parents first
        where = {(): -1}
        nodes = []
        for prefix in kept:
            where[prefix] = len(nodes)
            nodes.append((where[prefix[:-1]], prefix[-1], paths[prefix] - paths[prefix[:-1]]))
        return nodes

    # ----- growing --------------------------------------------------------------------------------------
    def add(self, ids: Sequence[int]) -> None:
        """Index one more output (token ids), keeping the most recent `grow_tokens` added tokens (0: nothing)."""
        if self.grow_tokens <= 0 or len(ids) == 0:
            return
        self.grown.append(self._in_vocabulary(ids)[-self.grow_tokens:])
        while sum(len(g) for g in self.grown) > self.grow_tokens:
            self.grown.pop(0)
        self.grown_index = _Index.build(self.grown)

    def frozen_copy(self, outputs: Iterable[Sequence[int]] = ()) -> Datastore:
        """A copy that shares this store's index and also indexes `outputs` after what this store has grown, all of
        them kept, and grows no further (`grow_tokens` 0): a fixed store, as a process that grew this one with those
        outputs would hold it (the bench's `multiturn` suite)."""
        copy = Datastore(self.index, self.vocab_size, grow_tokens=0, tokenizer=self.tokenizer, sources=self.sources)
        copy.grown = list(self.grown) + [self._in_vocabulary(ids) for ids in outputs if len(ids)]
        copy.grown_index = _Index.build(copy.grown) if copy.grown else None
        return copy

    def _in_vocabulary(self, ids: Sequence[int]) -> np.ndarray:
        """`ids` as int32, the ids outside the store's vocabulary dropped."""
        seq = np.asarray(ids, dtype=np.int64)
        return seq[(seq >= 0) & (seq < self.vocab_size)].astype(np.int32)

    # ----- saving and loading ---------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write `datastore.safetensors` into `directory` (what was added by `add` is not saved), whole: a file
        already there is replaced only once the new one is written. Returns its path; raises `OSError`."""
        from safetensors.numpy import save_file

        path = Path(directory) / DATASTORE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        compact = np.uint16 if self.vocab_size < np.iinfo(np.uint16).max else np.int32
        tokens = self.index.tokens.astype(compact)  # the separator -1 becomes 65535 in uint16
        tmp = path.with_name(path.name + ".tmp")
        metadata = {"format": FORMAT, "version": VERSION, "vocab_size": str(self.vocab_size),
                    "max_match": str(MAX_MATCH)}
        if self.tokenizer is not None:
            metadata["tokenizer"] = json.dumps(self.tokenizer, sort_keys=True)
        if self.sources:
            metadata["sources"] = json.dumps(self.sources)
        try:
            save_file({"tokens": tokens, "positions": self.index.positions}, str(tmp), metadata=metadata)
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o666 & ~umask)  # as the weights beside it (the writer made it private to its owner)
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # no half-written file left beside the store
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int | None = None, grow_tokens: int = 0,
             tokenizer: dict | None = None) -> Datastore:
        """Read a datastore file (or the one in a directory). Raises `DatastoreError` naming the file when it is
        damaged, not a datastore, (given `vocab_size`) built for another vocabulary, or (given `tokenizer`, a
        `tokenizer_identity`) built with another tokenizer, as far as the file records one."""
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / DATASTORE_FILE
        if not path.is_file():
            # `treespark datastore` writes DATASTORE_FILE into --output: a file's directory, else the path itself
            directory = path.parent if path.suffix == ".safetensors" else path
            raise DatastoreError(f"no datastore at {path}: build one with `treespark datastore --data FILES "
                                 f"--output {directory}`")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                    raise DatastoreError(f"{path} is not an hf_treespark datastore (format {meta.get('format')!r}, "
                                         f"version {meta.get('version')!r})")
                tokens, positions = f.get_tensor("tokens"), f.get_tensor("positions")
        except DatastoreError:
            raise
        except Exception as err:  # safetensors raises its own error types for a cut or edited file
            raise DatastoreError(f"the datastore file {path} is damaged ({err}): rebuild it with `treespark "
                                 "datastore`") from None
        stored_vocab, max_match = (_metadata_int(meta, field, path) for field in ("vocab_size", "max_match"))
        if vocab_size is not None and stored_vocab != vocab_size:
            raise DatastoreError(f"the datastore {path} was built for a vocabulary of {stored_vocab} ids, not this "
                                 f"target's {vocab_size}: build one from this target's outputs")
        made_with, sources = _metadata_json(meta, "tokenizer", dict, path), _metadata_json(meta, "sources", list, path)
        mismatch = tokenizer_mismatch(made_with, tokenizer)
        if mismatch is not None:
            raise DatastoreError(f"the datastore {path} {mismatch}: build one with this target's tokenizer")
        problem = _index_problem(tokens, positions, stored_vocab, max_match)
        if problem is not None:
            raise DatastoreError(f"the datastore file {path} is damaged ({problem}): rebuild it with `treespark "
                                 "datastore`")
        words = tokens.astype(np.int32)
        if tokens.dtype == np.uint16:
            words[tokens == np.iinfo(np.uint16).max] = SEPARATOR
        tokens = words
        return cls(_Index(np.ascontiguousarray(tokens), np.ascontiguousarray(positions)), stored_vocab, grow_tokens,
                   tokenizer=made_with, sources=[str(h) for h in sources or ()])


def tokenizer_identity(tokenizer) -> dict:
    """What tells one tokenizer from another: `name_or_path` (as it was loaded; "" if unknown), `size` (its number
    of ids, added tokens included) and `fingerprint` (16 hex digits of a SHA-256 over its vocabulary, each token
    with its id; None for a tokenizer that does not list its vocabulary)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    fingerprint = None
    if vocab:
        text = json.dumps(sorted(vocab.items(), key=lambda item: (item[1], item[0])), ensure_ascii=False)
        fingerprint = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""), "size": size,
            "fingerprint": fingerprint}


def describe_tokenizer(identity: dict) -> str:
    """A `tokenizer_identity` in words: "the tokenizer of NAME (49152 ids, fingerprint 0123...)"."""
    facts = [f"{identity['size']} ids" if identity.get("size") is not None else None,
             f"fingerprint {identity['fingerprint']}" if identity.get("fingerprint") else None]
    facts = ", ".join(fact for fact in facts if fact)
    name = identity.get("name_or_path") or "an unnamed model"
    return f"the tokenizer of {name}" + (f" ({facts})" if facts else "")


def tokenizer_mismatch(recorded: dict | None, other: dict | None) -> str | None:
    """None when two `tokenizer_identity`s may be the same tokenizer (either unknown: nothing to compare), else
    "was built with X, not Y" naming both. The fingerprints decide when both have one, else the sizes."""
    if not recorded or not other:
        return None
    if recorded.get("fingerprint") and other.get("fingerprint"):
        same = recorded["fingerprint"] == other["fingerprint"]
    else:
        same = recorded.get("size") is None or other.get("size") is None or recorded["size"] == other["size"]
    return None if same else f"was built with {describe_tokenizer(recorded)}, not {describe_tokenizer(other)}"


def sequences_from_references(references) -> list[list[int]]:
    """What the datastore indexes of each reference sequence (`training.data.ReferenceSequence`: `input_ids`,
    `prompt_len`): the response, preceded by the last `HEADER_TOKENS` tokens of its prompt."""
    return [ref.input_ids[max(0, ref.prompt_len - HEADER_TOKENS):] for ref in references]


def step_log_prob(count: int, parent_count: int, context: int) -> float:
    """`log p` that the target produces a retrieved token seen `count` times after `parent_count` occurrences of
    its `context`-token left context (the calibration of the module docstring)."""
    a, b, c, d = DATASTORE_CALIBRATION
    share = (count + 0.5) / (parent_count + 1.0)
    z = a + b * math.log(share / (1.0 - share)) + c * math.log(context) + d * math.log(parent_count)
    return -math.log1p(math.exp(-z)) if z > -30 else z


def _token_ids(seq, i: int) -> np.ndarray:
    """Sequence `i` of `Datastore.build` as int64 ids; `DatastoreError` naming the first element that is not an
    integer id (floats, bools, strings: never converted)."""
    if isinstance(seq, (str, bytes)):
        raise DatastoreError(f"sequence {i} is a string ({seq!r:.40}), not a list of token ids: tokenise text with "
                             "the target's tokenizer first (`treespark datastore` reads .txt and chat JSONL files)")
    try:
        ids = np.asarray(seq)  # lists, tuples, numpy arrays, CPU tensors
    except (TypeError, ValueError, RuntimeError):
        ids = np.asarray(list(seq), dtype=object)  # ragged or mixed: found element by element below
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.ndim != 1:
        raise DatastoreError(f"sequence {i} has shape {ids.shape}: each sequence is a flat list of token ids")
    mixed = isinstance(seq, (list, tuple)) and any(isinstance(t, bool) for t in seq)  # np.asarray([1, True]): ints
    if ids.dtype.kind in "iu" and not mixed:
        return ids.astype(np.int64)
    values = []
    for j, token in enumerate(seq):
        scalar = hasattr(token, "item") and getattr(token, "ndim", 1) == 0  # numpy and torch scalars
        value = token.item() if scalar else token
        if isinstance(value, bool) or not isinstance(value, int):
            kind = {bool: "bool", float: "float", str: "string"}.get(type(value), type(value).__name__)
            raise DatastoreError(f"sequence {i}, position {j}: {value!r:.40} is a {kind}, not a token id (ids are "
                                 "integers: a float is not truncated, a string not parsed)")
        values.append(value)
    return np.array(values, dtype=object)  # integers, some beyond int64: the vocabulary check names them


def _metadata_int(meta: dict, field: str, path: Path) -> int:
    """A whole-number metadata field of the datastore file `path` (-1 when absent: `_index_problem` names it)."""
    text = meta.get(field, "-1")
    try:
        return int(text)
    except ValueError:
        raise DatastoreError(f"the datastore file {path} is damaged (its metadata field {field!r} is {text!r}, not "
                             "a whole number): rebuild it with `treespark datastore`") from None


def _metadata_json(meta: dict, field: str, kind: type, path: Path):
    """A JSON metadata field of the datastore file `path` (None when absent), which must hold a `kind`."""
    if field not in meta:
        return None
    try:
        value = json.loads(meta[field])
    except ValueError:
        value = None
    if not isinstance(value, kind):
        raise DatastoreError(f"the datastore file {path} is damaged (its metadata field {field!r} is "
                             f"{meta[field]!r:.60}, not a JSON {kind.__name__}): rebuild it with `treespark datastore`")
    return value


def _index_problem(tokens: np.ndarray, positions: np.ndarray, vocab_size: int, max_match: int) -> str | None:
    if max_match != MAX_MATCH:
        return f"max_match {max_match}, this version reads {MAX_MATCH}"
    if tokens.ndim != 1 or positions.ndim != 1 or tokens.dtype not in (np.uint16, np.int32) \
            or positions.dtype != np.int32:
        return "tensors of the wrong shape or type"
    if vocab_size < 1:
        return "no vocabulary size"
    separator = np.iinfo(np.uint16).max if tokens.dtype == np.uint16 else SEPARATOR
    words = tokens != separator
    if words.sum() != len(positions):
        return f"{int(words.sum())} tokens but {len(positions)} sorted positions"
    if len(tokens) < MAX_MATCH + DEPTH or words[:MAX_MATCH].any() or words[-DEPTH:].any():
        return "the separators around the tokens are missing"
    if int(tokens[words].max(initial=0)) >= vocab_size or int(tokens[words].min(initial=0)) < 0:
        return "a token id outside the vocabulary"
    if len(positions) and (positions.min() < MAX_MATCH or positions.max() >= len(tokens) - DEPTH
                           or not words[positions].all()):
        return "a sorted position that is not a token"
    first = tokens[positions].astype(np.int64)
    if (np.diff(first) < 0).any():
        return "the positions are not sorted"
    return None


class DatastoreSource:
    """A datastore as a branch source (`base.BranchSource`): each round, the continuations of the text's suffix in
    the target's earlier outputs (`Datastore.branches`), flagged "retrieved"."""

    name = "datastore"
    flag = "retrieved"

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def propose(self, history) -> list[tuple[int, int, float]]:
        return self.datastore.branches(history[-MAX_MATCH:].tolist())


register_source("datastore", lambda drafter, store: None if store is None else DatastoreSource(store))
