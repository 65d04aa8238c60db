"""The speculative decode step (DESIGN §5.2): draft -> schedule -> packed verify -> commit.

State per slot ``r`` (all fixed-shape arrays, passed in and returned):

* ``seq_len[r]``: number of committed tokens whose keys/values are in the target cache.
  The anchor (the last committed token, not yet run through the target) sits at position
  ``seq_len[r]``; the drafter's context is every position ``< seq_len[r]``.
* ``anchor[r]``: that token. ``ctx_feats[r, t]`` / ``ctx_tokens[r, t]``: the target's
  features (tap hidden states, or the final hidden state for MTP-1) and the token at each
  committed position ``t < seq_len[r]``.

A round for R slots with verify budget K (one compiled function per K):

1. Draft ``[R, G]`` tokens, their draft distributions and confidences.
2. Schedule: survival ``a = cumprod(c)`` -> per-slot prefix lengths ``l[r]`` (a mask, never
   a shape). Lengths are capped by the room left in the cache and by ``max_new`` so no
   write goes past ``max_len``.
3. Packed verify: the anchor and the ``l[r]`` admitted drafts of every slot are packed
   into a buffer of ``R + K`` rows (row = one token, with its slot and position). The
   target runs ``Qwen3.decode`` on ``[R + K, 1]``: projections, MLP and LM head cost
   ``O(R + K)``, not ``O(R·(G+1))``.

   Attention layout: each packed row gathers its slot's whole cache row
   (``[max_len, kv_heads, head_dim]`` per layer) and attends to positions ``<=`` its own.
   Attention FLOPs and the gathered bytes are ``O((R + K)·max_len)`` per layer, so they
   also scale with the packed size; the gather materialises ``(R + K)·max_len·kv·hd``
   elements per layer (a paged/flash kernel would read the cache in place).
4. Accept (greedy or rejection sampling), commit by lengths only (rejected cache entries
   stay and are overwritten later), append the features of committed positions to the
   drafter context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decode.sampling import process_logits, sample
from dspark_jax.decode.verify import verify_greedy, verify_sampling
from dspark_jax.models.qwen3 import KVCache, Qwen3, init_cache
from dspark_jax.sched import prefix as prefix_sched
from dspark_jax.sched import topk as topk_sched

Array = jax.Array

FINISH_NONE, FINISH_EOS, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_NONE: None, FINISH_EOS: "eos", FINISH_LENGTH: "length"}

SCHEDULER_MODES = ("none", "fixed", "threshold", "prefix", "topk")


class DecodeState(NamedTuple):
    cache: KVCache
    ctx_feats: Array  # [R, M, F]
    ctx_tokens: Array  # [R, M] int32
    seq_len: Array  # [R] int32
    anchor: Array  # [R] int32
    active: Array  # [R] bool
    remaining: Array  # [R] int32: tokens still allowed (max_new_tokens budget)
    temperature: Array  # [R] float32
    top_k: Array  # [R] int32
    top_p: Array  # [R] float32
    rng: Array


class RoundOutput(NamedTuple):
    tokens: Array  # [R, G+1] emitted tokens (first ``num_emitted`` valid)
    num_emitted: Array  # [R]
    accepted: Array  # [R] accepted draft tokens
    verified: Array  # [R] draft tokens sent to the target (l[r])
    finish: Array  # [R] FINISH_* code (0 = still running)
    survival: Array  # [R, G] a = cumprod(c) used by the scheduler (ones without confidences)
    confidence: Array  # [R, G] calibrated c_k (ones without confidences)
    draft_tokens: Array  # [R, G]


class PrefillOutput(NamedTuple):
    first_token: Array  # [B]
    finish: Array  # [B]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of a decoder (one compiled round per verify budget K)."""

    num_slots: int
    max_len: int
    scheduler: str = "fixed"
    sampling: bool = False  # False: greedy verification (all requests at temperature 0)
    threshold: float = 0.5  # static-threshold arm
    fixed_length: int | None = None  # fixed arm: verify this many drafts (default: all)
    eos_id: int = -1

    def __post_init__(self):
        if self.scheduler not in SCHEDULER_MODES:
            raise ValueError(
                f"Unknown scheduler {self.scheduler!r}; allowed: {list(SCHEDULER_MODES)}"
            )
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")


class SpeculativeDecoder:
    """Jitted prefill and decode rounds for a target + drafter pair.

    ``drafter`` may be ``None`` (plain decoding through the same machinery: every round
    verifies only the anchor). ``sts_temperatures`` (``[G]``) rescale confidence logits.
    """

    def __init__(
        self,
        target: Qwen3,
        target_params,
        drafter,
        drafter_params,
        config: StepConfig,
        sps_table: Array | None = None,
        sts_temperatures=None,
    ):
        self.target = target
        self.target_params = target_params
        self.drafter = drafter
        self.drafter_params = drafter_params
        self.config = config
        tcfg = target.config
        if config.max_len > tcfg.max_position_embeddings:
            raise ValueError(
                f"max_len {config.max_len} exceeds the target's max_position_embeddings "
                f"{tcfg.max_position_embeddings}"
            )
        if drafter is None:
            self.gamma, self.taps, self.kind, self.feat_dim = 1, None, "none", 1
            self.has_confidence = False
        else:
            dcfg = drafter.config
            if drafter.target.vocab_size != tcfg.vocab_size or (
                drafter.target.hidden_size != tcfg.hidden_size
            ):
                raise ValueError(
                    "drafter was built for a different target: vocab/hidden "
                    f"{drafter.target.vocab_size}/{drafter.target.hidden_size} vs target "
                    f"{tcfg.vocab_size}/{tcfg.hidden_size}"
                )
            self.kind = dcfg.kind
            self.gamma = 1 if dcfg.kind == "mtp1" else dcfg.gamma
            self.taps = None if dcfg.kind == "mtp1" else tuple(dcfg.taps)
            self.feat_dim = tcfg.hidden_size * (1 if self.taps is None else len(self.taps))
            self.has_confidence = dcfg.kind == "dspark" and bool(getattr(dcfg, "confidence", True))
        if config.scheduler in ("threshold", "prefix", "topk") and not self.has_confidence:
            raise ValueError(
                f"scheduler {config.scheduler!r} needs a drafter with a confidence head "
                f"(DSpark); this drafter is {self.kind!r}. Use 'fixed' or 'none'."
            )
        g = self.gamma
        if config.scheduler == "prefix" and sps_table is None:
            raise ValueError("scheduler 'prefix' needs an SPS table (profile_sps)")
        need = config.num_slots * (g + 1) + 1
        if sps_table is not None and len(sps_table) < need:
            raise ValueError(f"SPS table has {len(sps_table)} entries; need {need}")
        self.sps_table = None if sps_table is None else jnp.asarray(sps_table, jnp.float32)
        temps = jnp.ones((g,), jnp.float32) if sts_temperatures is None else sts_temperatures
        self.sts_temperatures = jnp.asarray(temps, jnp.float32)
        if self.sts_temperatures.shape != (g,):
            raise ValueError(f"STS temperatures must have shape [{g}], got {temps!r}")
        # Parameters are passed as arguments (not closed over) so they are not baked into
        # the executables as constants; the state is donated so caches update in place.
        self._round = jax.jit(self._round_impl, static_argnums=(2,), donate_argnums=(1,))
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self._params = (target_params, drafter_params)

    # -- state ------------------------------------------------------------------------
    def init_state(self, seed: int = 0) -> DecodeState:
        c, r = self.config, self.config.num_slots
        return DecodeState(
            cache=init_cache(self.target.config, r, c.max_len),
            ctx_feats=jnp.zeros((r, c.max_len, self.feat_dim), self.target.config.compute_dtype),
            ctx_tokens=jnp.zeros((r, c.max_len), jnp.int32),
            seq_len=jnp.zeros((r,), jnp.int32),
            anchor=jnp.zeros((r,), jnp.int32),
            active=jnp.zeros((r,), bool),
            remaining=jnp.zeros((r,), jnp.int32),
            temperature=jnp.zeros((r,), jnp.float32),
            top_k=jnp.zeros((r,), jnp.int32),
            top_p=jnp.ones((r,), jnp.float32),
            rng=jax.random.key(seed),
        )

    @property
    def full_budget(self) -> int:
        """The verify budget that holds every draft token: K = R·G."""
        return self.config.num_slots * self.gamma

    # -- the frozen target pieces the drafter shares --------------------------------------
    def _embed_fn(self, tp):
        return lambda tokens: self.target.apply({"params": tp}, tokens, method=Qwen3.embed)

    def _lm_head_fn(self, tp):
        return lambda h: self.target.apply({"params": tp}, h, method=Qwen3.logits_from_hidden)

    def _features(self, taps, hidden):
        """Drafter context features of target rows: concatenated taps or final hidden."""
        if self.taps is None:
            return hidden
        m = taps.shape[0]
        return jnp.moveaxis(taps, 0, -2).reshape(taps.shape[1:-1] + (m * taps.shape[-1],))

    # -- prefill ----------------------------------------------------------------------
    def prefill(self, state, slots, prompts, lengths, max_new, temperature, top_k, top_p):
        """Insert prompts ``[B, T]`` (right-padded) into ``slots [B]`` and sample token 1."""
        args = (slots, prompts, lengths, max_new, temperature, top_k, top_p)
        return self._prefill(self._params, state, *(jnp.asarray(a) for a in args))

    def _prefill_impl(
        self, params, state, slots, prompts, lengths, max_new, temperature, top_k, top_p
    ):
        c = self.config
        tp, _ = params
        b, t = prompts.shape
        hidden, cache, taps = self.target.apply(
            {"params": tp},
            prompts,
            lengths,
            slots,
            state.cache,
            taps=self.taps,
            return_hidden=True,
            method=Qwen3.prefill,
        )
        last_h = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = self._lm_head_fn(tp)(last_h)
        rng, key = jax.random.split(state.rng)
        if c.sampling:
            first = sample(key, process_logits(logits, temperature, top_k, top_p))
        else:
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)

        # Drafter context: features and tokens of prompt positions 0..len-1.
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        write = jnp.where(pos < lengths[:, None], pos, c.max_len)
        rows = jnp.broadcast_to(slots[:, None], (b, t))
        feats = self._features(taps, hidden).astype(state.ctx_feats.dtype)
        if self.drafter is None:
            feats = jnp.zeros((b, t, 1), state.ctx_feats.dtype)
        ctx_feats = state.ctx_feats.at[rows, write].set(feats, mode="drop")
        ctx_tokens = state.ctx_tokens.at[rows, write].set(prompts, mode="drop")

        finish = jnp.where(
            first == c.eos_id,
            FINISH_EOS,
            jnp.where((max_new <= 1) | (lengths + 1 >= c.max_len), FINISH_LENGTH, FINISH_NONE),
        ).astype(jnp.int32)
        state = state._replace(
            cache=cache,
            ctx_feats=ctx_feats,
            ctx_tokens=ctx_tokens,
            seq_len=state.seq_len.at[slots].set(lengths),
            anchor=state.anchor.at[slots].set(first),
            active=state.active.at[slots].set(finish == FINISH_NONE),
            remaining=state.remaining.at[slots].set(max_new - 1),
            temperature=state.temperature.at[slots].set(temperature),
            top_k=state.top_k.at[slots].set(top_k),
            top_p=state.top_p.at[slots].set(top_p),
            rng=rng,
        )
        return state, PrefillOutput(first, finish)

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Free a slot (cancellation): it stops drafting/verifying from the next round."""
        return state._replace(active=state.active.at[slot].set(False))

    # -- one round --------------------------------------------------------------------
    def round(self, state: DecodeState, budget: int | None = None):
        """Run one decode round with verify budget K = ``budget`` (default: R·G)."""
        k = self.full_budget if budget is None else int(budget)
        if not 0 <= k <= self.full_budget:
            raise ValueError(f"verify budget must be in [0, {self.full_budget}], got {k}")
        return self._round(self._params, state, k)

    def _draft(self, params, state, key):
        g, r = self.gamma, self.config.num_slots
        if self.drafter is None:
            zeros = jnp.zeros((r, g), jnp.int32)
            return zeros, None, jnp.ones((r, g), jnp.float32), None
        tp, dp = params
        out = self.drafter.apply(
            {"params": dp},
            state.ctx_feats,
            state.seq_len,
            state.anchor,
            key,
            state.temperature if self.config.sampling else 0.0,
            state.top_k,
            state.top_p,
            self._embed_fn(tp),
            self._lm_head_fn(tp),
            context_tokens=state.ctx_tokens,
            method="draft",
        )
        if out.confidence_logits is None:
            conf = jnp.ones((r, g), jnp.float32)
        else:
            conf = jax.nn.sigmoid(out.confidence_logits.astype(jnp.float32) / self.sts_temperatures)
        return out.tokens.astype(jnp.int32), out.probs, conf, out

    def _schedule(self, survival, active, budget):
        """Per-slot prefix lengths ``[R]`` for the configured arm (DESIGN §5.3)."""
        c, g = self.config, self.gamma
        if self.drafter is None or c.scheduler == "none":
            return jnp.zeros(survival.shape[:1], jnp.int32)
        if c.scheduler == "fixed":
            n = g if c.fixed_length is None else min(c.fixed_length, g)
            lengths = jnp.full(survival.shape[:1], n, jnp.int32)
        elif c.scheduler == "threshold":
            # a is non-increasing along j, so "a >= threshold" is already a prefix.
            lengths = jnp.sum(survival >= c.threshold, axis=1).astype(jnp.int32)
        elif c.scheduler == "prefix":
            lengths = prefix_sched.algorithm1(survival, self.sps_table, active).lengths
        else:  # topk
            lengths = topk_sched.admit_topk(survival, budget, active).lengths
        return jnp.where(active, lengths, 0)

    def _round_impl(self, params, state: DecodeState, budget: int):
        c, g, r = self.config, self.gamma, self.config.num_slots
        tp, _ = params
        n_rows = r + budget
        rng, draft_key, verify_key = jax.random.split(state.rng, 3)
        draft_tokens, draft_probs, conf, _ = self._draft(params, state, draft_key)
        survival = jnp.cumprod(conf, axis=1)
        active = state.active

        # --- schedule, then cap by budget, cache room and max_new ----------------------
        lengths = self._schedule(survival, active, budget)
        room = jnp.maximum(c.max_len - 2 - state.seq_len, 0)
        lengths = jnp.minimum(lengths, jnp.minimum(room, jnp.maximum(state.remaining - 1, 0)))
        lengths = _cap_total(lengths, budget)
        lengths = jnp.where(active, lengths, 0)

        # --- pack anchor + admitted drafts into R + K rows -----------------------------
        j = jnp.arange(g + 1, dtype=jnp.int32)
        counts = jnp.where(active, lengths + 1, 0)
        offsets = jnp.cumsum(counts) - counts
        included = active[:, None] & (j[None, :] <= lengths[:, None])  # [R, G+1]
        row_of = jnp.where(included, offsets[:, None] + j[None, :], n_rows)
        tokens_rj = jnp.concatenate([state.anchor[:, None], draft_tokens], axis=1)
        pos_rj = state.seq_len[:, None] + j[None, :]
        slot_rj = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, g + 1))

        def pack(values, fill):
            buf = jnp.full((n_rows,), fill, values.dtype)
            return buf.at[row_of].set(values, mode="drop")

        p_tokens = pack(tokens_rj, 0)
        p_pos = pack(pos_rj, 0)
        p_slot = pack(slot_rj, 0)
        p_valid = pack(included, False)

        hidden, cache, taps = self.target.apply(
            {"params": tp},
            p_tokens[:, None],
            p_pos[:, None],
            p_slot,
            state.cache,
            p_valid[:, None],
            taps=self.taps,
            return_hidden=True,
            method=Qwen3.decode,
        )
        logits = self._lm_head_fn(tp)(hidden[:, 0])  # [R+K, V]: the LM head runs on packed rows
        gather_rows = jnp.minimum(row_of, n_rows - 1)

        # --- verify --------------------------------------------------------------------
        if c.sampling:
            p_temp, p_k, p_p = (x[p_slot] for x in (state.temperature, state.top_k, state.top_p))
            target_probs = process_logits(logits, p_temp, p_k, p_p)[gather_rows]
            accepted, next_tok, out_tokens = verify_sampling(
                verify_key, draft_tokens, draft_probs, target_probs, lengths, active
            )
        else:
            target_argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)[gather_rows]
            accepted, next_tok, out_tokens = verify_greedy(
                draft_tokens, target_argmax, lengths, active
            )

        # --- commit by lengths -----------------------------------------------------------
        committed = included & (j[None, :] <= accepted[:, None])  # anchor + accepted drafts
        write = jnp.where(committed, pos_rj, c.max_len)
        feats = self._features(taps, hidden)[:, 0] if self.drafter is not None else None
        ctx_feats = state.ctx_feats
        if feats is not None:
            ctx_feats = ctx_feats.at[slot_rj, write].set(
                feats[gather_rows].astype(ctx_feats.dtype), mode="drop"
            )
        ctx_tokens = state.ctx_tokens.at[slot_rj, write].set(tokens_rj, mode="drop")

        emitted = jnp.where(active, accepted + 1, 0)
        emitted = jnp.minimum(emitted, state.remaining)
        is_eos = (out_tokens == c.eos_id) & (j[None, :] < emitted[:, None])
        first_eos = jnp.argmax(is_eos, axis=1)
        hit_eos = jnp.any(is_eos, axis=1)
        emitted = jnp.where(hit_eos, first_eos + 1, emitted)
        new_len = state.seq_len + jnp.where(active, accepted + 1, 0)
        remaining = state.remaining - emitted
        out_of_room = new_len + 1 >= c.max_len
        finish = jnp.where(
            ~active,
            FINISH_NONE,
            jnp.where(
                hit_eos,
                FINISH_EOS,
                jnp.where((remaining <= 0) | out_of_room, FINISH_LENGTH, FINISH_NONE),
            ),
        ).astype(jnp.int32)

        new_state = state._replace(
            cache=cache,
            ctx_feats=ctx_feats,
            ctx_tokens=ctx_tokens,
            seq_len=jnp.where(active, new_len, state.seq_len),
            anchor=jnp.where(active, next_tok, state.anchor),
            active=active & (finish == FINISH_NONE),
            remaining=remaining,
            rng=rng,
        )
        out = RoundOutput(
            tokens=out_tokens,
            num_emitted=emitted,
            accepted=accepted,
            verified=lengths,
            finish=finish,
            survival=survival,
            confidence=conf,
            draft_tokens=draft_tokens,
        )
        return new_state, out


def _cap_total(lengths: Array, budget: int) -> Array:
    """Trim per-slot prefixes so that their total fits the verify budget K.

    Trimming removes tokens from the end of the *last* slots first; only reached when a
    scheduler that does not know K (fixed, threshold, prefix) overshoots a smaller bucket.
    The choice depends only on lengths, never on the sampled draft tokens themselves.
    """
    before = jnp.cumsum(lengths) - lengths
    return jnp.clip(budget - before, 0, lengths).astype(jnp.int32)


def make_budget_chooser(decoder: SpeculativeDecoder, buckets: tuple[int, ...]) -> Callable:
    """Dynamic top-K's host-side budget choice from survival probabilities of an older round."""
    import numpy as np

    table = np.asarray(decoder.sps_table)

    def choose(old_survival, old_active) -> int:
        return topk_sched.choose_budget(
            np.asarray(old_survival), table, buckets, np.asarray(old_active)
        )

    return choose


__all__ = [
    "DecodeState",
    "RoundOutput",
    "PrefillOutput",
    "StepConfig",
    "SpeculativeDecoder",
    "FINISH_NAMES",
    "SCHEDULER_MODES",
    "make_budget_chooser",
]
