"""TreeSparkConfig: every knob of the drafter and of its tree policy."""

from __future__ import annotations

import operator

from transformers import PretrainedConfig


class TreeSparkConfig(PretrainedConfig):
    r"""Configuration of a [`TreeSparkDrafter`].

    The drafter is a small transformer that drafts `block_size` future tokens in one forward
    pass, conditioned on hidden states of its target model (docs/method.md).

    Args:
        target_hidden_size: hidden size `d_target` of the target model; the drafter shares the
            target's token embeddings and LM head, so its residual width equals this.
        target_vocab_size: vocabulary size `V` of the target.
        target_num_hidden_layers: number of decoder layers of the target.
        target_layer_ids: target layers whose outputs feed the drafter (0-based layer index `l`,
            read from HF's `hidden_states[l + 1]`). Never the last layer. Defaults to an even
            spread over the target's depth.
        target_name_or_path: the target the drafter was trained for (informative, written to the
            model card).
        block_size: `B`, number of draft depths per block.
        mask_token_id: id used for the `B - 1` mask slots. `None` gives the drafter a learned
            mask embedding of its own (for targets without a spare token id).
        num_hidden_layers: draft transformer layers.
        num_attention_heads / num_key_value_heads / head_dim: draft attention shape. `head_dim`
            is the TreeSpark capacity knob (192; DSpark uses 128).
        intermediate_size: SwiGLU width of the draft MLP.
        markov_rank: rank `r` of the Markov (parent-token) correction head.
        use_confidence_head: whether the confidence head `c_k(y)` exists.
        tree_topk: children proposed per frontier parent (`k`).
        tree_frontier: frontier width kept per depth.
        tree_budget: number of non-root tree nodes packed for verification (`N`), or `"auto"`:
            chosen per device from measured verify latency and `acceptance_profile`
            (`hf_treespark.decoding.budget`).
        acceptance_profile: measured mean acceptance length per budget, `{"N": tau}`
            (`hf_treespark.calibration.measure.calibrate_acceptance`), or None.
        batch_acceptance_profile: the same for batched decoding, whose rows verify at most `N` nodes with the
            lookup and datastore branches competing for them
            (`hf_treespark.calibration.measure.calibrate_batch_acceptance`),
            or None (`acceptance_profile` then prices batches too).
        tree_lookup: tokens per lookup branch grafted into each round's tree (continuations of the
            text's suffix found earlier in the prompt or output; `hf_treespark.sources.lookup`); 0 = off.
        tree_datastore: graft the drafter's datastore branches (continuations of the text's suffix in the
            target's earlier outputs, `hf_treespark.sources.datastore`) into each round's tree, where the drafter
            carries a datastore (`datastore.safetensors` beside its weights).
        tree_shortlist: at inference, each depth's children are chosen among its `tree_shortlist` most likely
            draft-vocabulary entries before the parent's Markov correction, which is then computed for those rows
            of `W2` only (`hf_treespark.core.tree.expand_tree`); 0 = among all. Exactness does not depend on it.
        datastore_grow_tokens: how many tokens of this process's own outputs `generate` adds to the
            drafter's datastore (the most recent ones; 0 = none, the store stays as shipped).
        draft_vocab_size: size `|S|` of the draft vocabulary, the target-vocabulary subset the drafter
            proposes from (frequency-ranked ids, stored in the checkpoint as the buffer
            `draft_vocab_ids`); None: the whole target vocabulary. Verification always uses the full
            vocabulary, so decoding stays lossless.
        anchor_features: also feed the projected target features of the position before the anchor
            (`ctx[a - 1]`, the newest committed position) into every block slot's input through a
            zero-initialised `anchor_proj`, besides the KV injection; False keeps the method's
            KV-only conditioning (and every checkpoint saved without the field).
        depth1_head: width of the depth-1 head's MLP, 0 = none. The head is a context-free pathway into the
            first depth (the block's anchor slot): `h_1 <- h_1 + out(x + mlp(x))`,
            `x = [norm(fc_1(f_{a-1})) ; e(x_a) ; h_1]`, from the raw target features of the position before the
            anchor, the anchor's embedding and the slot's own state; `out` starts at zero, so a drafter grown
            with it starts as it was. It is trained cheaply apart from the block (every position an anchor,
            no block, `hf_treespark.training.depth1`).
        depth2_head: width of the depth-2 head's MLP, 0 = none. The head gives the second depth its parent:
            `h_2(y) = h_2 + out(x + mlp(x))`, `x = [norm(fc_2(f_{a-1})) ; e(x_a) ; e(y) ; h_2]`, with `y` the token
            the tree put at depth 1; the tree scores each depth-2 parent's children with `lm_head(h_2(y))[S] +
            W2(W1[y])` instead of `U_2 + W2(W1[y])`. `out` starts at zero. Trained apart from the block, like the
            depth-1 head.
        normalize_features: standardise each target feature dimension before `fc`,
            `(f - feature_mean) * feature_scale`, with per-dimension statistics of the training data
            saved as buffers (`TreeSparkDrafter.set_feature_statistics`). A small target's hidden
            states carry a few dimensions hundreds of times larger than the rest, which otherwise
            dominate `fc`'s output and its updates; standardising is a reparametrisation of `fc`.
    """

    model_type = "treespark"

    def __init__(
        self,
        target_hidden_size: int = 576,
        target_vocab_size: int = 49152,
        target_num_hidden_layers: int = 30,
        target_layer_ids: list[int] | None = None,
        target_name_or_path: str | None = None,
        block_size: int = 7,
        mask_token_id: int | None = None,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
        head_dim: int = 192,
        intermediate_size: int = 1536,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 100000.0,
        max_position_embeddings: int = 32768,
        attention_bias: bool = False,
        markov_rank: int = 256,
        use_confidence_head: bool = True,
        tree_topk: int = 4,
        tree_frontier: int = 4,
        tree_budget: int | str = 32,
        acceptance_profile: dict[str, float] | None = None,
        batch_acceptance_profile: dict[str, float] | None = None,
        tree_lookup: int = 0,
        tree_datastore: bool = True,
        tree_shortlist: int = 0,
        datastore_grow_tokens: int = 0,
        draft_vocab_size: int | None = None,
        anchor_features: bool = False,
        depth1_head: int = 0,
        depth2_head: int = 0,
        normalize_features: bool = False,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(target_num_hidden_layers)
        self.target_hidden_size = target_hidden_size
        self.target_vocab_size = target_vocab_size
        self.target_num_hidden_layers = target_num_hidden_layers
        self.target_layer_ids = _layer_ids(target_layer_ids)
        self.target_name_or_path = target_name_or_path
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.hidden_size = target_hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.attention_bias = attention_bias
        self.markov_rank = markov_rank
        self.use_confidence_head = use_confidence_head
        self.tree_topk = tree_topk
        self.tree_frontier = tree_frontier
        self.tree_budget = tree_budget
        self.acceptance_profile = _acceptance_profile(acceptance_profile)
        self.batch_acceptance_profile = _acceptance_profile(batch_acceptance_profile, "batch_acceptance_profile")
        self.tree_lookup = tree_lookup
        self.tree_datastore = tree_datastore
        self.tree_shortlist = tree_shortlist
        self.datastore_grow_tokens = datastore_grow_tokens
        self.draft_vocab_size = draft_vocab_size
        self.anchor_features = bool(anchor_features)
        self.depth1_head = depth1_head
        self.depth2_head = depth2_head
        self.normalize_features = bool(normalize_features)
        self.initializer_range = initializer_range
        kwargs.pop("hidden_size", None)  # always equal to target_hidden_size
        kwargs.pop("vocab_size", None)  # always equal to target_vocab_size (a property)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_fields()

    def validate_fields(self) -> None:
        """Raise `ValueError` naming the first field whose value cannot work."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"TreeSparkConfig.{field}={getattr(self, field)!r} is invalid: {why}")

        for name in ("target_hidden_size", "target_vocab_size", "target_num_hidden_layers", "block_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "markov_rank", "tree_topk", "tree_frontier", "tree_budget"):
            value = getattr(self, name)
            if name == "tree_budget" and value == "auto":
                continue
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                 "must be a positive integer" + (' or "auto"' if name == "tree_budget" else ""))
        for name in ("acceptance_profile", "batch_acceptance_profile"):
            profile = getattr(self, name)
            need(profile is None or all(int(n) > 0 and t >= 1.0 for n, t in profile.items()), name,
                 'must map budgets N > 0 to acceptance lengths >= 1, e.g. {"8": 1.9}')
        need(len(self.target_layer_ids) > 0, "target_layer_ids", "needs at least one target layer")
        need(all(0 <= i < self.target_num_hidden_layers - 1 for i in self.target_layer_ids), "target_layer_ids",
             f"layer ids must lie in [0, {self.target_num_hidden_layers - 2}] (the last target layer is post-norm "
             "in HF outputs and is never used)")
        need(len(set(self.target_layer_ids)) == len(self.target_layer_ids), "target_layer_ids", "has duplicates")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             "must divide num_attention_heads")
        need(self.head_dim % 2 == 0, "head_dim", "must be even for rotary embeddings")
        need(self.mask_token_id is None or 0 <= self.mask_token_id < self.target_vocab_size, "mask_token_id",
             f"must be None (learned mask embedding) or an id in [0, {self.target_vocab_size})")
        need(isinstance(self.tree_lookup, int) and not isinstance(self.tree_lookup, bool) and self.tree_lookup >= 0,
             "tree_lookup", "must be an integer >= 0 (tokens per lookup branch; 0 = off)")
        need(isinstance(self.tree_datastore, bool), "tree_datastore", "must be true or false")
        need(isinstance(self.tree_shortlist, int) and not isinstance(self.tree_shortlist, bool)
             and self.tree_shortlist >= 0, "tree_shortlist",
             "must be an integer >= 0 (draft-vocabulary entries each depth chooses from; 0 = all)")
        need(isinstance(self.depth1_head, int) and not isinstance(self.depth1_head, bool) and self.depth1_head >= 0,
             "depth1_head", "must be an integer >= 0 (the width of the depth-1 head's MLP; 0 = none)")
        need(isinstance(self.depth2_head, int) and not isinstance(self.depth2_head, bool) and self.depth2_head >= 0,
             "depth2_head", "must be an integer >= 0 (the width of the depth-2 head's MLP; 0 = none)")
        need(isinstance(self.datastore_grow_tokens, int) and not isinstance(self.datastore_grow_tokens, bool)
             and 0 <= self.datastore_grow_tokens <= 1 << 26, "datastore_grow_tokens",
             "must be an integer in [0, 67108864] (tokens of this process's outputs kept; 0 = none)")
        need(self.draft_vocab_size is None or (isinstance(self.draft_vocab_size, int)
                                               and 0 < self.draft_vocab_size <= self.target_vocab_size),
             "draft_vocab_size", f"must be None (the whole vocabulary) or an integer in [1, {self.target_vocab_size}]")
        need(self.tree_topk <= (self.draft_vocab_size or self.target_vocab_size), "tree_topk",
             "cannot exceed the (draft) vocabulary size")

    @classmethod
    def for_target(cls, target, **overrides) -> TreeSparkConfig:
        """A config sized for `target` (a model or its config): hidden size, vocabulary, layers, name."""
        tcfg = getattr(target, "config", target)
        tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
        fields = {
            "target_hidden_size": tcfg.hidden_size,
            "target_vocab_size": tcfg.vocab_size,
            "target_num_hidden_layers": tcfg.num_hidden_layers,
            "target_name_or_path": getattr(tcfg, "_name_or_path", None) or None,
            "rms_norm_eps": getattr(tcfg, "rms_norm_eps", 1e-6),
        }
        fields.update(overrides)
        return cls(**fields)

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: the drafter drafts the target's own token ids."""
        return self.target_vocab_size

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def proposal_vocab_size(self) -> int:
        """How many tokens the drafter can propose: `draft_vocab_size`, or the target's vocabulary."""
        return self.draft_vocab_size or self.target_vocab_size


def _integer(value) -> int:
    """`value` as an int if it is integer-like (numpy and 0-d torch ints are; bools, floats and strings are not)."""
    if isinstance(value, bool):
        raise TypeError
    return operator.index(value)


def _layer_ids(value) -> list[int]:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return [_integer(i) for i in value]
    except TypeError:
        raise ValueError(f"TreeSparkConfig.target_layer_ids={value!r} is invalid: expected a list of integer "
                         "target layer ids, e.g. [1, 8, 14]") from None


def _acceptance_profile(value, name: str = "acceptance_profile") -> dict[str, float] | None:
    if not value:
        return None
    try:
        if not isinstance(value, dict):
            raise TypeError
        profile = {}
        for n, tau in value.items():
            if isinstance(tau, (bool, str)):
                raise TypeError
            budget = int(n) if isinstance(n, str) and n.isdigit() else _integer(n)  # JSON keys are strings
            profile[str(budget)] = float(tau)
        return profile
    except (TypeError, ValueError):
        raise ValueError(f"TreeSparkConfig.{name}={value!r} is invalid: expected a mapping from integer "
                         'tree budgets to measured acceptance lengths, e.g. {"8": 1.9, "16": 2.1}') from None


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Evenly spread layer ids in `[1, num_target_layers - 2]`, e.g. 36 layers -> [1, 9, 17, 25, 33]."""
    last = num_target_layers - 2
    if last < 1:
        return [0]
    num_features = min(num_features, last)
    if num_features == 1:
        return [last // 2]
    step = (last - 1) / (num_features - 1)
    return sorted({round(1 + i * step) for i in range(num_features)})
