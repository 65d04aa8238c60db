"""Drafter hyper-parameters (DESIGN §3.2–3.5), JSON (de)serialisation and validation.

One dataclass covers the four drafter kinds:

* ``dspark``: parallel block backbone + sequential head (Markov/RNN/gated) + confidence head.
* ``dflash``: the same backbone with no sequential head and no confidence head (this is how
  DeepSpec builds its DFlash baseline: ``markov_rank=0``, ``confidence_head_alpha=0``).
* ``eagle3``: one fused-input decoder layer, autoregressive over its own hidden state.
* ``mtp1``: DeepSeek-V3-style single MTP block, one draft token per round.

Fields left as ``None`` get per-kind defaults; ``resolve(target_config)`` fills the ones
that depend on the target (taps) and checks everything against it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """What every consumer of a drafter (decode step, training, AOT, conversion) needs to
    know about its kind; code outside the per-drafter modules asks this, never the name.

    context: what the drafter reads of the target per committed position:
      ``taps`` (the concatenated tap hidden states: DSpark, DFlash, EAGLE-3) or
      ``final_hidden`` (MTP-1: the target's last normed hidden state).
    next_token_states: context state ``t`` pairs position t's feature with the *next*
      token ``x_{t+1}`` (EAGLE-3, MTP-1), so its K/V row is known once ``x_{t+1}`` is
      committed, and the draft's first query is the last context state itself; otherwise
      (DSpark, DFlash) a position's K/V depend on its own features only.
    mask_token: block positions 1..γ-1 are MASK placeholders (parallel block drafting).
    single_token: one draft token per round (γ fixed at 1).
    sequential_head / confidence: whether a Markov/RNN head and a confidence head exist.
    default_layers: draft layers in DeepSpec's released configs.
    loss_weights: default (α_CE, α_TV, α_conf) of the block loss (DESIGN §4): DSpark 0.1 CE
      + 0.9 L1 + 1.0 confidence BCE; DFlash CE only (DeepSpec's DFlash baseline); EAGLE-3
      and MTP-1 train with the sequence loss instead.
    """

    name: str
    context: str
    next_token_states: bool
    mask_token: bool
    single_token: bool
    sequential_head: bool
    confidence: bool
    default_layers: int
    loss_weights: tuple[float, float, float] = (0.0, 0.0, 0.0)


DRAFTER_KINDS = {
    "dspark": DrafterKind("dspark", "taps", False, True, False, True, True, 5, (0.1, 0.9, 1.0)),
    "dflash": DrafterKind("dflash", "taps", False, True, False, False, False, 5, (1.0, 0.0, 0.0)),
    "eagle3": DrafterKind("eagle3", "taps", True, False, False, False, False, 1),
    "mtp1": DrafterKind("mtp1", "final_hidden", True, False, True, False, False, 1),
}
KINDS = tuple(DRAFTER_KINDS)


def drafter_kind(name: str) -> DrafterKind:
    """The spec of drafter kind ``name``; unknown names list the known ones."""
    if name not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(KINDS)}")
    return DRAFTER_KINDS[name]


HEADS = ("markov", "gated", "rnn", "none")
# Initialisation of the sequential head's factors (see heads.SequentialHead).
HEAD_INITS = ("deepspec", "zero_bias")


def default_taps(num_target_layers: int, m: int = 5) -> list[int]:
    """``m`` tap layers spread uniformly from layer 1 to layer ``L-3`` (DESIGN §3.2).

    Qwen3-4B/8B (L = 36): ``[1, 9, 17, 25, 33]``. Shallow targets get fewer, distinct taps
    (duplicates collapse); a target with fewer than 4 layers taps every layer but the last.
    """
    n = int(num_target_layers)
    if n < 2:
        raise ValueError(
            f"A target with {n} layer(s) has no tappable layer (the last layer may not be "
            "tapped); drafters need num_hidden_layers >= 2"
        )
    if m < 1:
        raise ValueError(f"default_taps needs m >= 1, got {m}")
    lo, hi = 1, n - 3
    if hi < lo:
        return list(range(0, n - 1))[:m]
    m = min(m, hi - lo + 1)
    if m == 1:
        return [lo]
    return sorted({int(math.floor(lo + i * (hi - lo) / (m - 1) + 0.5)) for i in range(m)})


def eagle3_default_taps(num_target_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high taps ``(2, L/2, L-3)`` (DESIGN §3.5), clipped to valid layers."""
    n = int(num_target_layers)
    if n < 2:
        raise ValueError(f"A target with {n} layer(s) has no tappable layer")
    wanted = (2, n // 2, n - 3)
    return sorted({min(max(t, 0), n - 2) for t in wanted})


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Drafter hyper-parameters. See the module docstring for the kinds.

    Attributes:
      kind: ``dspark`` | ``dflash`` | ``eagle3`` | ``mtp1``.
      gamma: block size / draft length γ (DSpark/DFlash block, EAGLE-3 unroll); MTP-1 is 1.
      num_layers: drafter decoder layers (default 5 for dspark/dflash, 1 otherwise).
      taps: target tap layer ids (``None`` = per-kind default, see ``default_taps``);
        unused by MTP-1, which reads the target's final (normed) hidden state.
      head: sequential head for DSpark: ``markov`` (default), ``gated``, ``rnn``, ``none``.
      markov_rank: rank r of ``W1: V×r``, ``W2: r×V`` for the markov/gated heads
        (default 256; 0 disables the head).
      rnn_rank: state size and W1 rank of the RNN head (default 256).
      head_init: how the head's W1/W2 start: ``deepspec`` (both N(0, 0.02), what DeepSpec's
        Hugging Face ``_init_weights`` gives) or ``zero_bias`` (W1 ~ N(0, 1) like a fresh
        embedding table, W2 = 0: the bias starts at exactly 0 and W2's gradient is O(1)
        from step one, which short training budgets need; see heads.SequentialHead).
      confidence: confidence head on/off (default on for dspark, off otherwise).
      confidence_with_prev: feed ``W1[x_{k-1}]`` to the confidence head with ``h_k``
        (DeepSpec ``confidence_head_with_markov``; only when a head with W1 exists).
      mask_token_id: id of the MASK token filling block positions 1..γ-1 (dspark/dflash).
    """

    kind: str = "dspark"
    gamma: int = 7
    num_layers: int | None = None
    taps: tuple[int, ...] | None = None
    head: str | None = None
    markov_rank: int = 256
    rnn_rank: int = 256
    head_init: str = "deepspec"
    confidence: bool | None = None
    confidence_with_prev: bool = True
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.taps is not None and not isinstance(self.taps, tuple):
            object.__setattr__(self, "taps", tuple(self.taps))
        problems = []
        if self.kind not in KINDS:
            problems.append(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in ("gamma",):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if self.num_layers is not None and (not _is_int(self.num_layers) or self.num_layers < 1):
            problems.append(f"num_layers must be a positive integer, got {self.num_layers!r}")
        for name in ("markov_rank", "rnn_rank"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                problems.append(f"{name} must be an integer >= 0, got {v!r}")
        if self.head is not None and self.head not in HEADS:
            problems.append(f"head must be one of {list(HEADS)}, got {self.head!r}")
        if self.head_init not in HEAD_INITS:
            problems.append(f"head_init must be one of {list(HEAD_INITS)}, got {self.head_init!r}")
        if self.taps is not None:
            if not self.taps or not all(_is_int(t) for t in self.taps):
                problems.append(f"taps must be a non-empty list of integers, got {self.taps!r}")
            elif list(self.taps) != sorted(set(self.taps)):
                problems.append(f"taps must be strictly increasing, got {list(self.taps)}")
        if self.mask_token_id is not None and (
            not _is_int(self.mask_token_id) or self.mask_token_id < 0
        ):
            problems.append(f"mask_token_id must be an integer >= 0, got {self.mask_token_id!r}")
        if not problems:
            problems += self._kind_problems()
        if problems:
            raise ValueError("Invalid DrafterConfig: " + "; ".join(problems))

    @property
    def spec(self) -> DrafterKind:
        return DRAFTER_KINDS[self.kind]

    @property
    def next_token_states(self) -> bool:
        """Context states pair a position with the next token (EAGLE-3, MTP-1; see
        ``DrafterKind``): the decode state also keeps each slot's last state."""
        return self.spec.next_token_states

    @property
    def uses_taps(self) -> bool:
        """Reads target tap layers (all kinds but MTP-1, which reads the final hidden)."""
        return self.spec.context != "final_hidden"

    @property
    def needs_mask_token(self) -> bool:
        """Block positions 1..γ-1 are MASK placeholders: the tokenizer needs a MASK id."""
        return self.spec.mask_token

    @property
    def parallel_block(self) -> bool:
        """Drafts a whole block in one forward (DSpark/DFlash); trained on the blocks of
        sampled anchors rather than on every position."""
        return self.spec.mask_token

    @property
    def single_token(self) -> bool:
        """Drafts one token per round (MTP-1): outputs carry no block axis."""
        return self.spec.single_token

    def context_kv_shape(self, target_config) -> tuple[int, int, int, int]:
        """Per-position shape of the decode state's drafter context: every draft layer's
        K/V, ``(draft layers, 2, kv_heads, head_dim)`` (``2``: keys, values)."""
        t = target_config
        return (self.resolved_num_layers, 2, t.num_key_value_heads, t.head_dim)

    def feature_width(self, target_config) -> int:
        """Per-position width of what the drafter reads of the target: the tap features
        (``taps · hidden``) or the final hidden state (``hidden``)."""
        t = target_config
        if self.uses_taps:
            return t.hidden_size * len(self.taps or ())
        return t.hidden_size

    def query_width(self, target_config) -> int:
        """Width of the per-slot last context state the decode state keeps for the draft's
        first query (``hidden``; 0 for kinds whose block queries are new tokens)."""
        return target_config.hidden_size if self.next_token_states else 0

    def _kind_problems(self) -> list[str]:
        out = []
        if not self.spec.sequential_head and self.head not in (None, "none"):
            out.append(f"kind {self.kind!r} has no sequential head; got head={self.head!r}")
        if not self.spec.confidence and self.confidence:
            out.append(f"kind {self.kind!r} has no confidence head; got confidence=True")
        if self.spec.single_token and self.gamma != 1:
            out.append(f"kind {self.kind!r} drafts one token; gamma must be 1, got {self.gamma}")
        if self.head == "rnn" and self.rnn_rank == 0:
            out.append("head 'rnn' needs rnn_rank >= 1")
        if self.head == "gated" and self.markov_rank == 0:
            out.append("head 'gated' needs markov_rank >= 1")
        return out

    # -- resolved views -------------------------------------------------------------------
    @property
    def resolved_head(self) -> str:
        """The head actually built: ``none`` for non-DSpark kinds or Markov rank 0."""
        if not self.spec.sequential_head:
            return "none"
        head = self.head or "markov"
        if head == "markov" and self.markov_rank == 0:
            return "none"  # rank 0: DSpark reduces to the parallel backbone (DFlash logits)
        return head

    @property
    def head_rank(self) -> int:
        """Rank of W1 (0 when there is no head)."""
        head = self.resolved_head
        if head == "none":
            return 0
        return self.rnn_rank if head == "rnn" else self.markov_rank

    @property
    def has_confidence(self) -> bool:
        if self.confidence is None:
            return self.spec.confidence
        return bool(self.confidence)

    @property
    def resolved_num_layers(self) -> int:
        return self.num_layers if self.num_layers is not None else self.spec.default_layers

    @property
    def draft_len(self) -> int:
        """Tokens proposed per round (1 for MTP-1)."""
        return 1 if self.spec.single_token else self.gamma

    def resolve(self, target_config) -> DrafterConfig:
        """Fill target-dependent defaults and validate against ``target_config`` (Qwen3Config)."""
        n = target_config.num_hidden_layers
        vocab = target_config.vocab_size
        taps = self.taps
        if not self.uses_taps:
            taps = None
        elif taps is None:
            taps = tuple(eagle3_default_taps(n) if self.kind == "eagle3" else default_taps(n))
        problems = []
        if taps is not None and not all(0 <= t <= n - 2 for t in taps):
            problems.append(
                f"taps {list(taps)} out of range: must be in [0, {n - 2}] for a {n}-layer "
                "target (the last layer may not be tapped)"
            )
        if self.needs_mask_token:
            if self.mask_token_id is None:
                problems.append(
                    f"kind {self.kind!r} needs mask_token_id (a MASK token in the vocabulary)"
                )
            elif self.mask_token_id >= vocab:
                problems.append(
                    f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                    f"(vocab_size {vocab})"
                )
        if problems:
            raise ValueError("Invalid DrafterConfig for this target: " + "; ".join(problems))
        return dataclasses.replace(
            self,
            taps=taps,
            num_layers=self.resolved_num_layers,
            head=self.resolved_head,
            confidence=self.has_confidence,
        )

    @classmethod
    def from_section(cls, section, mask_token_id: int | None = None) -> DrafterConfig:
        """From a training config's ``drafter`` section (``ml_collections`` or a mapping
        with this class's field names; other keys, e.g. loss weights, are ignored). The
        MASK id is kept only for kinds that draft from MASK placeholders."""
        get = section.get if hasattr(section, "get") else lambda k, d=None: getattr(section, k, d)
        kw = {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)}
        kw.pop("mask_token_id")
        if kw["taps"] is not None:
            kw["taps"] = tuple(int(t) for t in kw["taps"])
        mask = mask_token_id if drafter_kind(kw["kind"]).mask_token else None
        return cls(**kw, mask_token_id=mask)

    # -- serialisation --------------------------------------------------------------------
    def replace(self, **kwargs) -> DrafterConfig:
        return dataclasses.replace(self, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["taps"] = None if self.taps is None else list(self.taps)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DrafterConfig:
        if not isinstance(values, dict):
            raise ValueError(f"DrafterConfig.from_dict needs a dict, got {type(values).__name__}")
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"Unknown DrafterConfig key(s) {unknown}; allowed keys: {cls.field_names()}"
            )
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"DrafterConfig JSON is malformed: {e}") from None
        return cls.from_dict(values)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> DrafterConfig:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Drafter config file not found: {path}")
        with open(path) as f:
            return cls.from_json(f.read())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
