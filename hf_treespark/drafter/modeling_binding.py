"""The drafter's binding to its target, and its draft vocabulary.

The drafter shares its target's token embeddings and LM head: they are frozen, the target's, and never stored in
the drafter's checkpoint. `bind_target(target)` checks that the target is the one the drafter was built for
(vocabulary, hidden size, depth) and keeps a reference to both, unregistered, so that no save, copy or pickle
carries them.

The draft vocabulary `S` is the set of target ids the drafter may propose: the frequency-ranked ids of the buffer
`draft_vocab_ids` (`config.draft_vocab_size`), or the whole target vocabulary. Drafted tokens are indices into `S`
until `to_target_ids` maps them back. Restricting it keeps the matching rows of the Markov head's `W2` and of the
target's LM head (the "draft head", built once per binding, packed for the CPU when the target's head is), so it
needs no retraining; `full_vocabulary` widens it again for training. `draft_vocab_problem` is the one check of a
vocabulary, wherever one comes from (a checkpoint, a state dict, a user's list).

This file imports only torch and `.cpu_gemm`: it ships beside `modeling.py` as remote code.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from ..core.cpu_gemm import is_packed, pack_linear_layers, weight_key

Drafter = TypeVar("Drafter", bound="DrafterBinding")


class DrafterBinding:
    """The binding and vocabulary methods of `TreeSparkDrafter` (mixed into it): needs `config`,
    `markov_head` and the `draft_vocab_ids` buffer."""

    def bind_target(self: Drafter, target: nn.Module) -> Drafter:
        """Share `target`'s frozen token embeddings and LM head. Refuses a target that does not fit."""
        self.check_target(target)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        bound = self.__dict__.get("_target_modules")
        if (bound is not None and bound[0] is embed and bound[1] is head
                and (bound[2] is head or bound[2].__dict__.get("source_key") == _head_source(head))):
            return self  # already bound to this target, unchanged: keep the draft head (and its packed copy)
        self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))  # not registered: never saved
        return self

    def check_target(self, target: nn.Module) -> None:
        """Raise `ValueError` naming each mismatch between `target` and this drafter's config."""
        cfg = self.config
        tcfg = getattr(target, "config", None)
        tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError("the target has no input embeddings or no LM head; TreeSpark needs a causal LM target")
        problems = []
        if embed.weight.shape[0] != cfg.target_vocab_size or head.weight.shape[0] != cfg.target_vocab_size:
            problems.append(f"vocabulary size {head.weight.shape[0]} != drafter's target_vocab_size "
                            f"{cfg.target_vocab_size}")
        if embed.weight.shape[1] != cfg.target_hidden_size:
            problems.append(f"hidden size {embed.weight.shape[1]} != drafter's target_hidden_size "
                            f"{cfg.target_hidden_size}")
        num_layers = getattr(tcfg, "num_hidden_layers", None)
        if num_layers is not None and num_layers != cfg.target_num_hidden_layers:
            problems.append(f"{num_layers} layers != drafter's target_num_hidden_layers "
                            f"{cfg.target_num_hidden_layers}")
        if problems:
            name = cfg.target_name_or_path or "its training target"
            raise ValueError(f"This TreeSpark drafter was built for {name} and does not fit this target: "
                             + "; ".join(problems) + ". Load the drafter trained for this target.")

    def __getstate__(self) -> dict:
        # A copy (`copy.deepcopy`) or a pickle (`torch.save`) leaves the target's embeddings and LM head out:
        # they are the target's, and `generate()` (or `bind_target`) binds the copy again.
        state = super().__getstate__().copy()
        state["_target_modules"] = None
        return state

    @property
    def draft_vocab_size(self) -> int:
        """How many tokens the drafter can propose (the width of `U_k` and of the Markov correction)."""
        return self.config.proposal_vocab_size

    @torch.no_grad()
    def full_vocabulary(self: Drafter) -> Drafter:
        """Propose from the whole target vocabulary again (the inverse of `restrict_vocabulary`, for training).

        The Markov head's `W2` rows of the ids outside the draft vocabulary start at zero (no parent
        correction), as a fresh drafter's do; the kept rows are unchanged.
        """
        if self.draft_vocab_ids is None:
            return self
        w2 = self.markov_head.markov_w2
        full = nn.Linear(w2.in_features, self.config.target_vocab_size, bias=False).to(w2.weight.device,
                                                                                      w2.weight.dtype)
        full.weight.zero_()
        full.weight[self.draft_vocab_ids] = w2.weight
        full.zero_init = True
        self.markov_head.markov_w2 = full
        self.register_buffer("draft_vocab_ids", None)
        self.config.draft_vocab_size = None
        if self.is_bound:
            embed, head, _ = self.__dict__["_target_modules"]
            self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))
        return self

    @torch.no_grad()
    def restrict_vocabulary(self: Drafter, token_ids) -> Drafter:
        """Propose only `token_ids` (target ids, most useful first) from now on; no retraining needed.

        Keeps the rows of the Markov head's `W2` (and, through `draft_vocab_ids`, of the target's LM
        head) for those ids. A drafter that is already restricted can only be narrowed to a subset.
        """
        ids = _token_id_tensor(token_ids)
        problem = draft_vocab_problem(ids, self.config.target_vocab_size)
        if problem is not None:
            raise ValueError(f"restrict_vocabulary: token_ids are not a draft vocabulary ({problem}); give distinct "
                             f"target ids in [0, {self.config.target_vocab_size})")
        current = (torch.arange(self.config.target_vocab_size) if self.draft_vocab_ids is None
                   else self.draft_vocab_ids.cpu())
        position = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long)
        position[current] = torch.arange(len(current))
        if bool((position[ids] < 0).any()):
            raise ValueError(f"restrict_vocabulary: every id must lie in the drafter's current vocabulary "
                             f"(target ids in [0, {self.config.target_vocab_size}))")
        rows = position[ids].to(self.markov_head.markov_w2.weight.device)
        w2 = self.markov_head.markov_w2
        new_w2 = nn.Linear(w2.in_features, ids.numel(), bias=False).to(device=w2.weight.device, dtype=w2.weight.dtype)
        new_w2.weight.copy_(w2.weight[rows])
        new_w2.zero_init = True
        self.markov_head.markov_w2 = new_w2
        self.register_buffer("draft_vocab_ids", ids.to(w2.weight.device), persistent=True)
        self.config.draft_vocab_size = ids.numel()
        self.config.tree_topk = min(self.config.tree_topk, ids.numel())
        if self.is_bound:
            embed, head, _ = self.__dict__["_target_modules"]
            self.__dict__["_target_modules"] = (embed, head, self._draft_head(head))
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """`nn.Module` loading (`load_state_dict`, a training checkpoint): refuse a damaged `draft_vocab_ids`
        before any weight is copied."""
        ids = state_dict.get(prefix + "draft_vocab_ids")
        problem = None if ids is None else draft_vocab_problem(ids, self.config.target_vocab_size)
        if problem is not None:
            raise ValueError(f"the state dict's {prefix}draft_vocab_ids is damaged ({problem}); nothing was loaded")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def to_target_ids(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids (the identity without one)."""
        return draft_tokens if self.draft_vocab_ids is None else self.draft_vocab_ids[draft_tokens]

    @property
    def is_bound(self) -> bool:
        return self.__dict__.get("_target_modules") is not None

    def _target(self) -> tuple[nn.Module, nn.Module, torch.Tensor]:
        """`(embed_tokens, lm_head, LM-head rows of the draft vocabulary [|S|, H])` of the bound target."""
        if not self.is_bound:
            raise RuntimeError("The drafter is not bound to a target: call drafter.bind_target(target) first "
                               "(generate() does this for you).")
        return self.__dict__["_target_modules"]

    def _draft_head(self, head: nn.Module) -> nn.Module:
        """The target's LM head over `S`: `head` itself, or a frozen `nn.Linear` of its rows for `S`
        (packed for the CPU, `hf_treespark.core.cpu_gemm`, when `head` is)."""
        if self.draft_vocab_ids is None:
            return head
        rows = head.weight.detach()[self.draft_vocab_ids]
        # Built on the meta device and given the rows: no random initialisation, so binding (the first
        # generate() of a process) draws nothing from the global random generator that sampling uses.
        draft = nn.Linear(rows.shape[1], rows.shape[0], bias=head.bias is not None, device="meta")
        draft.weight = nn.Parameter(rows, requires_grad=False)
        if head.bias is not None:
            draft.bias = nn.Parameter(head.bias.detach()[self.draft_vocab_ids], requires_grad=False)
        draft.source_key = _head_source(head)  # rebuilt when the head changes
        if is_packed(head):
            pack_linear_layers(draft)
        return draft


def _token_id_tensor(token_ids) -> torch.Tensor:
    """`token_ids` (a sequence, numpy array or tensor of integer ids) as a flat CPU long tensor; `TypeError` for
    anything else (strings, floats, bools)."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"restrict_vocabulary: token_ids must be a list of integer token ids, got "
                        f"{type(token_ids).__name__} {token_ids!r:.40}")
    try:
        ids = torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is not None and ids.numel() == 0:
        return ids.to(torch.long).flatten().cpu()  # `[]` is float32 to torch
    if ids is None or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"restrict_vocabulary: token_ids must be integer token ids, got {token_ids!r:.60}")
    return ids.to(torch.long).flatten().cpu()


def draft_vocab_problem(ids: torch.Tensor, vocab_size: int) -> str | None:
    """What makes `ids` unfit as a draft vocabulary of a target with `vocab_size` ids (integer dtype, at least
    one id, every id in `[0, vocab_size)`, no id twice), or None when it is fit."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        return f"dtype {ids.dtype}, not integer ids"
    ids = ids.flatten()
    if ids.numel() == 0:
        return "no ids"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        return f"id {low if low < 0 else high} outside the target's vocabulary [0, {vocab_size})"
    unique = torch.unique(ids)
    if unique.numel() != ids.numel():
        counts = torch.bincount(ids.cpu())
        return f"id {int(counts.argmax())} appears {int(counts.max())} times"
    return None


def _head_source(head: nn.Module) -> tuple:
    """What a draft head copied from `head` depends on: its weight (as it is now) and whether it is packed."""
    return weight_key(head.weight), is_packed(head)

