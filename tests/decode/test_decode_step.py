"""The speculative decode step and host loop (DESIGN §5): exactness, greedy parity,
compile-once, limits and errors, on a tiny random target (vocabulary 24)."""

import collections

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decode.autoregressive import generate as ar_generate
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig, request_key_data
from dspark_jax.engine.offline import Request, Runner
from dspark_jax.models.draft_api import DraftContext, SamplingSettings
from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.ops.sampling import process_logits, split_keys
from dspark_jax.sched import prefix as prefix_sched

V = 24  # distinct from every other dimension, so HLO shapes can be matched by size
MASK = V - 1
CFG = PRESETS["tiny"].replace(vocab_size=V, num_hidden_layers=2, max_position_embeddings=64)
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def target():
    model = Qwen3(CFG)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    # A peaked target (random init gives near-uniform logits): its conditionals differ
    # clearly from the drafter's, so biased verification shows in the outputs.
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 15.0
    return model, params


def _drafter(kind, gamma=4, seed=1):
    dcfg = DrafterConfig(
        kind=kind,
        gamma=1 if kind == "mtp1" else gamma,
        num_layers=1,
        markov_rank=4,
        rnn_rank=4,
        mask_token_id=MASK,
    )
    module = make_drafter(dcfg, CFG)
    return module, nn.unbox(init_drafter_params(module, jax.random.key(seed)))


def _sensitive_drafter():
    """γ = 2 DSpark drafter whose confidence depends only, and strongly, on the previous
    token: c_k = σ(±3) = 0.95 / 0.05 for x_{k-1} in S = even ids / odd ids. Then c_2 is a
    function of the sampled x_1, which is what Appendix A's failure needs."""
    module, params = _drafter("dspark", gamma=2, seed=2)
    w1 = np.array(params["markov_head"]["markov_w1"])
    w1[:, 0] = np.where(np.arange(V) % 2 == 0, 3.0, -3.0)
    kernel = np.zeros_like(np.asarray(params["confidence_head"]["kernel"]))
    kernel[CFG.hidden_size] = 1.0  # reads W1[x_{k-1}][0] only
    params["markov_head"]["markov_w1"] = jnp.asarray(w1)
    params["confidence_head"]["kernel"] = jnp.asarray(kernel)
    params["confidence_head"]["bias"] = jnp.zeros((1,), jnp.float32)
    return module, params


# Paper Appendix A's per-slot step rates SPS(B) for B = 1, 2, 3 (R = 1, γ = 2).
SPS_A = jnp.asarray([0.0, 1.0, 0.5, 0.45])


class NoEarlyStopDecoder(SpeculativeDecoder):
    """WRONG (test only): per slot, verify the prefix length that maximises Θ globally
    (Appendix A's table), i.e. Algorithm 1 without the early stop."""

    def _schedule(self, survival, active, budget, sps_table):
        a = prefix_sched.running_min(survival)
        tau = 1.0 + jnp.concatenate([jnp.zeros_like(a[:, :1]), jnp.cumsum(a, axis=1)], axis=1)
        theta = tau * SPS_A[1 : a.shape[1] + 2][None, :]
        return jnp.where(active, jnp.argmax(theta, axis=1), 0).astype(jnp.int32)


class EarlyStopDecoder(SpeculativeDecoder):
    """The same per-slot rule with Algorithm 1's first-drop stop (exact)."""

    def _schedule(self, survival, active, budget, sps_table):
        lengths = jax.vmap(lambda a: prefix_sched.algorithm1(a[None], SPS_A).lengths[0])(survival)
        return jnp.where(active, lengths, 0)


# --------------------------------------------------------------------------------------
# Exactness at T = 1


def _exact_first3(model, params, temperature, top_k, top_p):
    """P(t1, t2, t3 | PROMPT) by enumerating the target's conditionals (full forward)."""

    @jax.jit
    def probs(tokens):
        logits = model.apply({"params": params}, tokens)[:, -1]
        return process_logits(logits, temperature, top_k, top_p)

    def cond(prefixes):
        return np.asarray(probs(jnp.asarray(prefixes, jnp.int32)), np.float64)

    p1 = cond([PROMPT])[0]
    p2 = cond([PROMPT + [a] for a in range(V)])  # [V, V]
    p3 = cond([PROMPT + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _sample_first3(
    dec, waves, temperature, top_k, top_p, budget=None, buckets=None, coupled=False,
    plain_when=None,
):  # fmt: skip
    """Counts of the first 3 generated tokens over ``waves`` × R slots, all on PROMPT, and
    the verify lengths admitted by each wave's first round.

    Each request may generate γ + 2 = 4 tokens, so the first round (after the prefill's
    token) may admit every length 0..γ: multi-draft rejection sampling is what the first
    three tokens' distribution is checked through. ``coupled``: position-keyed requests,
    each with its own seed (a coupled slot's key never advances by itself).
    ``plain_when(tokens)``: run a plain round instead when it returns True for the tokens
    the wave has emitted so far (a rule on earlier rounds only)."""
    r = dec.config.num_slots
    state = dec.init_state(seed=11)
    counts, lengths = collections.Counter(), collections.Counter()
    prompts = np.zeros((r, 16), np.int32)
    prompts[:, : len(PROMPT)] = PROMPT

    def full(x, dtype):
        return np.full((r,), x, dtype)

    for w in range(waves):
        state, pre = dec.prefill(
            state,
            np.arange(r, dtype=np.int32),
            prompts,
            full(len(PROMPT), np.int32),
            full(dec.gamma + 2, np.int32),
            full(temperature, np.float32),
            full(top_k, np.int32),
            full(top_p, np.float32),
            *(
                (np.stack([request_key_data(7, w, s) for s in range(r)]), full(1, bool))
                if coupled
                else ()
            ),
        )
        seqs = [[int(t)] for t in np.asarray(pre.first_token)]
        first_round = True
        while bool(np.any(np.asarray(state.active))):
            active = np.asarray(state.active)
            plain = plain_when is not None and plain_when([t for s in seqs for t in s])
            if plain:
                state, out = dec.plain_round(state)
            elif buckets is not None:  # synchronous two-phase path
                state, plan = dec.plan(state)
                need = int(np.asarray(plan.lengths).sum())
                state, out = dec.commit(state, plan, next(k for k in buckets if k >= need))
            else:
                state, out = dec.round(state, budget)
            out = jax.device_get(out)
            if first_round and not plain:  # the first drafting round
                lengths.update(int(v) for v, a in zip(out.verified, active) if a)
                first_round = False
            for s in range(r):
                seqs[s].extend(int(x) for x in out.tokens[s, : out.num_emitted[s]])
        assert all(len(s) == dec.gamma + 2 for s in seqs)
        counts.update(tuple(s[:3]) for s in seqs)
    return counts, lengths


def _chi2_pvalue(counts, probs):
    """Pearson chi-square of the counts against ``probs [V, V, V]``; cells with an expected
    count below 5 are pooled into one."""
    n = sum(counts.values())
    obs = np.zeros(probs.shape)
    for key, c in counts.items():
        obs[key] += c
    exp = probs * n
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    assert o[~keep].sum() == 0, "a sequence of target probability 0 was generated"
    chi2 = float(np.sum((o[keep] - e[keep]) ** 2 / e[keep]))
    return float(stats.chi2.sf(chi2, keep.sum() - 1)), chi2


def _shifted(probs, amount=0.02):
    """Move ``amount`` of probability from the most likely sequence to the second one."""
    flat = probs.reshape(-1).copy()
    first, second = np.argsort(flat)[::-1][:2]
    moved = min(amount, flat[first])
    flat[first] -= moved
    flat[second] += moved
    return flat.reshape(probs.shape)


SAMPLING = [(1.0, 0, 1.0), (1.0, 5, 0.9)]
R_EXACT, WAVES = 256, 64  # 16384 samples per setting


@pytest.fixture(scope="module")
def exact_dists(target):
    model, params = target
    return {s: _exact_first3(model, params, *s) for s in SAMPLING}


@pytest.mark.parametrize(
    "mode",
    ["prefix", "topk"]
    + [pytest.param(m, marks=pytest.mark.slow) for m in ("none", "fixed", "threshold")],
)
def test_sampling_is_exact_for_every_scheduler(target, exact_dists, mode):
    model, params = target
    drafter, dparams = _sensitive_drafter()
    r, g = R_EXACT, 2
    # A decreasing table so Algorithm 1 admits a mix of lengths across the slots.
    table = 1.0 / (1.0 + jnp.arange(r * (g + 1) + 1) / (1.5 * r))
    dec = SpeculativeDecoder(
        model,
        params,
        drafter,
        dparams,
        StepConfig(num_slots=r, max_len=24, scheduler=mode, sampling=True, threshold=0.5),
        sps_table=table if mode in ("prefix", "topk") else None,
    )
    kwargs = {"budget": r} if mode == "topk" else {}  # top-K of the current a, K fixed
    if mode == "prefix":
        kwargs = {"buckets": (r // 2, r, r * g)}  # the two-phase (bucketed) path
    for setting in SAMPLING:
        counts, lengths = _sample_first3(dec, WAVES, *setting, **kwargs)
        p, chi2 = _chi2_pvalue(counts, exact_dists[setting])
        # Every admitted length the scheduler can choose occurred (fixed: always γ).
        assert set(lengths) == ({g} if mode == "fixed" else {0} if mode == "none" else
                                set(range(g + 1))), (mode, lengths)  # fmt: skip
        assert p > 1e-3, (mode, setting, chi2, p)
        # The same data and test reject a target moved by 3 %: the test has the power (a 2 %
        # move sits at the edge of 16384 samples' power: p 0.003 for one sample stream).
        p_shift, _ = _chi2_pvalue(counts, _shifted(exact_dists[setting], 0.03))
        assert p_shift < 1e-3, (mode, setting, p_shift)
    assert dec._round._cache_size() + dec._commit._cache_size() <= 3


def test_coupled_sampling_is_exact_through_the_step(target, exact_dists):
    """Position-keyed (coupled) verification through the real step, Algorithm 1's bucketed
    path admitting every length 0..γ: the first three tokens follow the target exactly
    (under top-k/top-p), and the test keeps its power (a 3 % move is rejected)."""
    model, params = target
    drafter, dparams = _sensitive_drafter()
    r, g = R_EXACT, 2
    table = 1.0 / (1.0 + jnp.arange(r * (g + 1) + 1) / (1.5 * r))
    cfg = StepConfig(num_slots=r, max_len=24, scheduler="prefix", sampling=True)
    dec = SpeculativeDecoder(model, params, drafter, dparams, cfg, sps_table=table)
    # One setting, with top-k/top-p (tests/decode/test_verify.py checks the unfiltered rule too).
    for setting in SAMPLING[1:]:
        counts, lengths = _sample_first3(
            dec, WAVES, *setting, buckets=(r // 2, r, r * g), coupled=True
        )
        assert set(lengths) == set(range(g + 1)), lengths
        p, chi2 = _chi2_pvalue(counts, exact_dists[setting])
        assert p > 1e-3, (setting, chi2, p)
        assert _chi2_pvalue(counts, _shifted(exact_dists[setting], 0.03))[0] < 1e-3


@pytest.mark.parametrize(
    "mode", ["prefix"] + [pytest.param(m, marks=pytest.mark.slow) for m in ("fixed", "topk")]
)
def test_coupled_output_is_the_same_whatever_the_scheduler_and_load(target, mode):
    """A coupled request's tokens depend on its seed and prompt alone: the same under every
    scheduler, alone or among other sampled requests, in any slot, and without a drafter
    (plain decoding draws the same position-keyed tokens). Standard draws do not have this
    property under Algorithm 1 (their verify lengths depend on the other slots)."""
    model, params = target
    drafter, dparams = _drafter("dspark", gamma=4)
    coupled = [
        Request([3, 7, 1], 14, 1.0, seed=11, coupled=True),
        Request([5, 6, 7, 8], 12, 0.8, top_k=6, top_p=0.9, seed=2**40 + 3, coupled=True),
        Request([9], 10, 1.2, seed=5, coupled=True),
    ]
    others = [Request(PROMPTS[i] + [i], 5 + 2 * i, 1.0) for i in range(5)]
    loaded = others[:2] + coupled[:1] + others[2:4] + coupled[1:] + others[4:]

    def run(drafter_, mode, requests, slots):
        table = 1.0 / (1.0 + jnp.arange(slots * 5 + 1) / (3 * slots))
        dec = SpeculativeDecoder(
            model, params, drafter_, dparams if drafter_ else None,
            StepConfig(num_slots=slots, max_len=40, scheduler=mode, sampling=True, threshold=0.3),
            sps_table=table if mode in ("prefix", "topk") else None,
        )  # fmt: skip
        buckets = (2, slots * 2, slots * 4) if mode in ("prefix", "topk") else None
        res, _ = Runner(dec, buckets=buckets, seed=len(mode)).generate(requests)
        return {tuple(q.prompt): r.tokens for q, r in zip(requests, res) if q.coupled}

    want = run(None, "none", coupled, 1)  # alone, one slot, no drafter
    assert all(len(t) == q.max_new_tokens for q, t in zip(coupled, want.values()))
    assert run(drafter, mode, loaded, 3) == want, mode


def test_no_early_stop_variant_is_rejected(target, exact_dists):
    """Appendix A's broken rule (global Θ argmax per slot) fails the same chi-square test,
    while the same rule with Algorithm 1's early stop passes."""
    model, params = target
    drafter, dparams = _sensitive_drafter()
    cfg = StepConfig(num_slots=R_EXACT, max_len=24, scheduler="fixed", sampling=True)
    setting = SAMPLING[0]
    broken = NoEarlyStopDecoder(model, params, drafter, dparams, cfg)
    counts, _ = _sample_first3(broken, WAVES, *setting)
    p_broken, chi2 = _chi2_pvalue(counts, exact_dists[setting])
    assert p_broken < 1e-6, (chi2, p_broken)


@pytest.mark.slow
def test_same_rule_with_early_stop_passes(target, exact_dists):
    model, params = target
    drafter, dparams = _sensitive_drafter()
    cfg = StepConfig(num_slots=R_EXACT, max_len=24, scheduler="fixed", sampling=True)
    exact = EarlyStopDecoder(model, params, drafter, dparams, cfg)
    for setting in SAMPLING:
        p_ok, _ = _chi2_pvalue(_sample_first3(exact, WAVES, *setting)[0], exact_dists[setting])
        assert p_ok > 1e-3


# --------------------------------------------------------------------------------------
# Greedy parity, compile-once, limits


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [9, 9, 9, 9], [2, 20, 2], [17] * 12, [8, 1]]


def _greedy_case(
    target, kind, mode, n_prompts, max_new, buckets=None, slots=3, max_len=48, pages=None,
    attention="auto",
):  # fmt: skip
    model, params = target
    drafter, dparams = (None, None) if kind is None else _drafter(kind)
    g = 1 if drafter is None else drafter.config.draft_len
    # A slowly decreasing table: Algorithm 1 admits a few drafts per round.
    table = 1.0 / (1.0 + jnp.arange(slots * (g + 1) + 1) / (3 * slots))
    dec = SpeculativeDecoder(
        model,
        params,
        drafter,
        dparams,
        StepConfig(
            num_slots=slots, max_len=max_len, scheduler=mode, threshold=0.3,
            attention=attention,
            **({} if pages is None else {"page_size": 4, "num_pages": pages}),
        ),
        sps_table=table if mode in ("prefix", "topk") else None,
    )  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % V] for i in range(n_prompts)]
    news = [max_new - (i % 3) for i in range(n_prompts)]
    runner = Runner(dec, buckets=buckets)
    res, st = runner.generate([Request(p, m) for p, m in zip(prompts, news)])
    for p, m, r in zip(prompts, news, res):
        ref = ar_generate(model, params, [p], m, max_len=max_len)
        assert r.tokens == ref.tokens[0], (kind, mode, p)
        assert r.finish_reason == "length" and len(r.tokens) == m
    return dec, runner, st


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind,mode",
    [
        ("dspark", "threshold"),
        ("eagle3", "fixed"),
        pytest.param("dspark", "fixed", marks=_SLOW),
        pytest.param("dspark", "none", marks=_SLOW),
        pytest.param("dflash", "fixed", marks=_SLOW),
        pytest.param("mtp1", "fixed", marks=_SLOW),
        pytest.param(None, "none", marks=_SLOW),
    ],
)
def test_greedy_matches_autoregressive(target, kind, mode):
    dec, runner, st = _greedy_case(target, kind, mode, n_prompts=7, max_new=10)
    assert dec._prefill._cache_size() == 1
    if mode == "none":
        assert runner.buckets == (0,) and dec._round._cache_size() == 1
    else:
        # The server's rule (decode/policy.py): the smallest bucket holding γ drafts per
        # occupied slot, so the last rounds, with slots free, verify in smaller shapes.
        assert 1 < dec._round._cache_size() <= 3  # at most one per occupancy level
        assert st.mean_budget < dec.full_budget


def test_greedy_with_a_page_pool_smaller_than_the_slots(target):
    """8 pages of 4 positions for 3 slots of 48: about two requests fit at a time, the
    rest wait for pages, which are then reused in another order; greedy output is still
    autoregressive decoding token for token."""
    dec, runner, st = _greedy_case(target, "dspark", "topk", 8, 10, pages=9)
    assert dec.num_pages == 9 < dec.full_pool
    with pytest.raises(ValueError, match="pass page_rows from a PagePool"):
        dec.prefill(dec.init_state(), [0], [[1, 2]], [2], [4], [0.0], [0], [1.0])
    # 30 + 6 positions, and the γ = 4 a draft block writes past them: 10 pages of 4.
    with pytest.raises(ValueError, match=r"request 0: the request needs 10 KV pages .*4 draft"):
        runner.generate([Request([1] * 30, 6)])


def test_greedy_matches_autoregressive_with_the_gpu_kernel(target):
    """The Pallas GPU kernel (here in interpret mode) in both places it runs: the verify
    rows and the drafted block over the paged drafter context, pages reused in another
    order by a pool smaller than the slots."""
    dec, _, _ = _greedy_case(target, "dspark", "topk", 5, 8, pages=9, attention="pallas_gpu")
    assert dec.attention == "pallas_gpu"


@pytest.mark.parametrize("mode", ["topk", "prefix"])
def test_greedy_bucketed_modes_compile_once_per_bucket(target, mode):
    """100+ rounds with refills and varying budgets: each bucket's round traces once."""
    buckets = (2, 4, 12)
    dec, runner, st = _greedy_case(target, "dspark", mode, 30, 14, buckets=buckets)
    assert st.rounds >= 100
    if mode == "topk":
        assert 1 < dec._round._cache_size() <= len(buckets)
    else:  # two-phase: one plan, one verify+commit per bucket used
        assert runner.two_phase and dec._plan._cache_size() == 1
        assert 1 < dec._commit._cache_size() <= len(buckets) and dec._round._cache_size() == 0
    assert dec._prefill._cache_size() == 1


def test_limits_eos_max_new_and_cache_end(target):
    model, params = target
    drafter, dparams = _drafter("dspark")
    m = 24
    ref = ar_generate(model, params, [PROMPTS[1]], 12, max_len=m).tokens[0]
    eos = ref[5]
    first_eos = ref.index(eos)
    dec = SpeculativeDecoder(
        model, params, drafter, dparams, StepConfig(num_slots=2, max_len=m, eos_id=eos)
    )
    near_end = [5] * (m - 4)  # 4 positions left: 4 tokens, then "length"
    reqs = [
        Request(PROMPTS[1], 12),
        Request(near_end, 50),
        Request(PROMPTS[0], 1),
        Request(PROMPTS[2], 3),
    ]
    res, _ = Runner(dec).generate(reqs)
    assert res[0].tokens == ref[: first_eos + 1] and res[0].finish_reason == "eos"
    ref_end = ar_generate(model, params, [near_end], 50, max_len=m, eos_id=eos)
    assert res[1].tokens == ref_end.tokens[0] and res[1].finish_reason == ref_end.finish_reasons[0]
    if res[1].finish_reason == "length":
        assert len(res[1].tokens) == m - len(near_end)
    assert len(res[2].tokens) == 1 and res[2].rounds == 0
    assert len(res[3].tokens) <= 3


def test_slot_at_cache_end_never_writes_past_it(target):
    model, params = target
    drafter, dparams = _drafter("dspark")
    m = 20
    dec = SpeculativeDecoder(model, params, drafter, dparams, StepConfig(num_slots=2, max_len=m))
    state = dec.init_state()
    prompt = np.full((1, 32), 3, np.int32)
    state, pre = dec.prefill(
        state,
        np.array([0]),
        prompt[:, :m],
        np.array([m - 3]),
        np.array([100]),
        np.zeros(1, np.float32),
        np.zeros(1, np.int32),
        np.ones(1, np.float32),
    )
    n = 1
    while bool(np.asarray(state.active)[0]):
        state, out = dec.round(state)
        assert int(out.verified[0]) <= m - 2 - (m - 3 + n - 1)  # room left for drafts
        n += int(out.num_emitted[0])
        assert int(state.seq_len[0]) <= m - 1
    assert int(out.finish[0]) == 2 and n == 3  # FINISH_LENGTH after M - P tokens


def test_inactive_slots_untouched_and_packed_rows(target):
    model, params = target
    drafter, dparams = _drafter("dspark")
    r, g = 3, 4
    dec = SpeculativeDecoder(model, params, drafter, dparams, StepConfig(num_slots=r, max_len=32))
    state = dec.init_state()
    state, _ = dec.prefill(
        state,
        np.array([1]),
        np.array([[4, 5, 6] + [0] * 13]),
        np.array([3]),
        np.array([20]),
        np.zeros(1, np.float32),
        np.zeros(1, np.int32),
        np.ones(1, np.float32),
    )
    before = jax.tree.map(np.array, state)
    state, out = dec.round(state)
    after = jax.tree.map(np.array, state)
    assert not np.array_equal(before.slot_keys[1], after.slot_keys[1])  # the active stream
    names = ("seq_len", "anchor", "remaining", "active", "ctx_query")

    def slot_view(st, s):
        """Everything of slot ``s`` in ``st`` (idle slots' random streams included)."""
        pages = before.page_table[s]  # the slot's own pages (static rows: the full pool)
        view = {name: getattr(st, name)[s] for name in names + ("slot_keys",)}
        # Paged: the slot's own pages of the drafter's context.
        view["ctx_feats"] = st.ctx_feats[:, pages] if dec.kv_cache else st.ctx_feats[s]
        view["kv"] = st.cache.kv[:, pages]
        return view

    for s in (0, 2):
        assert (before.page_table[s] > 0).all()
        chex.assert_trees_all_equal(slot_view(after, s), slot_view(before, s), strict=True)
        assert int(out.num_emitted[s]) == 0 and int(out.verified[s]) == 0
    assert int(after.seq_len[1]) == 3 + int(out.accepted[1]) + 1
    # Pages are given at prefill only: a round never changes the page table.
    chex.assert_trees_all_equal(after.page_table, before.page_table, strict=True)

    # The verify pass runs on R + K packed rows: the LM head's logits are [R + K, V] and
    # nothing of the unpruned size R·(G+1) x V is materialised when K is small.
    for k in (2, r * g):
        hlo = dec._round.lower(dec._params, state, k).as_text()
        assert f"tensor<{r + k}x{V}xf32>" in hlo
        if k < r * g:
            assert f"tensor<{r * (g + 1)}x{V}xf32>" not in hlo


def test_errors_name_the_problem(target):
    model, params = target
    dflash, dfp = _drafter("dflash")
    for mode in ("threshold", "prefix", "topk"):
        # Without a drafter there is nothing to schedule; without a head, the
        # confidence-head estimate is refused (the draft probability is the default).
        with pytest.raises(ValueError, match=f"scheduler '{mode}' needs a drafter"):
            SpeculativeDecoder(model, params, None, None, StepConfig(1, 16, scheduler=mode))
        with pytest.raises(ValueError, match="has no confidence head"):
            SpeculativeDecoder(
                model, params, dflash, dfp, StepConfig(1, 16, scheduler=mode),
                survival_estimator="confidence_head",
            )  # fmt: skip
    with pytest.raises(ValueError, match="Unknown scheduler 'greedy'"):
        StepConfig(1, 16, scheduler="greedy")
    dspark, dsp = _drafter("dspark")
    dec = SpeculativeDecoder(model, params, dspark, dsp, StepConfig(2, 16, scheduler="prefix"))
    with pytest.raises(ValueError, match="needs an SPS table"):
        dec.round(dec.init_state())
    with pytest.raises(ValueError, match="SPS table has shape"):
        dec.set_sps_table(jnp.ones(3))
    dec = SpeculativeDecoder(model, params, dspark, dsp, StepConfig(2, 16))
    with pytest.raises(ValueError, match="verify budget"):
        dec.round(dec.init_state(), 99)
    with pytest.raises(ValueError, match="prompt has 20 tokens but the cache holds 16"):
        Runner(dec).generate([Request([1] * 20, 4)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SpeculativeDecoder(model, params, dspark, dsp, StepConfig(2, 1000))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp1"])
@pytest.mark.parametrize("mode", ["none"])
def test_greedy_other_kinds_without_speculation(target, kind, mode):
    _greedy_case(target, kind, mode, n_prompts=5, max_new=8)


def _two_prompts_prefilled(dec, seed):
    """A 2-slot state after prefilling two short prompts (lengths 3 and 5) at T = 1."""
    state = dec.init_state(seed=seed)
    prompts = np.array([PROMPT + [0] * 5, [5, 2, 8, 9, 4, 0, 0, 0]])
    ones = np.ones(2, np.float32)
    state, _ = dec.prefill(
        state, np.arange(2), prompts, np.array([3, 5]), np.array([20, 20]), ones,
        np.zeros(2, np.int32), ones,
    )  # fmt: skip
    return state


def test_sts_calibration_applied_to_confidences(target):
    """``sts_temperatures``/``sts_biases`` turn the head's logits into σ(z / T + b), and the
    survival the scheduler sees is their running product."""
    model, params = target
    drafter, dparams = _drafter("dspark")
    g = drafter.config.gamma
    temps = np.array([0.5, 2.0, 1.0, 3.0], np.float32)[:g]
    biases = np.array([0.3, -0.7, 1.2, 0.0], np.float32)[:g]
    cfg = StepConfig(num_slots=2, max_len=32)
    raw = SpeculativeDecoder(model, params, drafter, dparams, cfg)
    cal = SpeculativeDecoder(
        model, params, drafter, dparams, cfg, sts_temperatures=temps, sts_biases=biases
    )
    state = _two_prompts_prefilled(raw, seed=0)
    state, plan = raw.plan(state)  # the state is donated and returned (as by a round)
    c_raw = np.asarray(plan.confidence, np.float64)
    _, plan = cal.plan(state)
    z = np.log(c_raw) - np.log1p(-c_raw)
    want = 1 / (1 + np.exp(-(z / temps + biases)))
    chex.assert_shape([plan.confidence, plan.survival], want.shape)
    chex.assert_trees_all_close(
        (plan.confidence, plan.survival), (want, np.cumprod(want, axis=1)), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="STS biases must have shape"):
        SpeculativeDecoder(model, params, drafter, dparams, cfg, sts_biases=np.zeros(g + 1))


def test_isotonic_steps_applied_to_confidences(target):
    """An isotonic fit's step maps (``STS.knots``) replace σ(z / T + b) where a position
    has one, in the jitted round exactly as ``eval.calibration`` applies them offline."""
    from dspark_jax.eval import calibration as offline
    from dspark_jax.models.drafter_io import STS, check_knots

    model, params = target
    drafter, dparams = _drafter("dspark")
    g = drafter.config.gamma
    cfg = StepConfig(num_slots=2, max_len=32)
    raw = SpeculativeDecoder(model, params, drafter, dparams, cfg)
    state = _two_prompts_prefilled(raw, seed=0)
    state, plan = raw.plan(state)
    c_raw = np.asarray(plan.confidence, np.float64)
    z = np.log(c_raw) - np.log1p(-c_raw)
    # Three steps per position, edges among the observed logits; the last position none.
    knots = [
        {"edges": np.quantile(z[:, k], [0.0, 0.4, 0.8]).tolist() if k else [-50.0, 0.0, 50.0],
         "logits": [-2.0, 0.5, 3.0]}
        for k in range(g - 1)
    ] + [None]  # fmt: skip
    sts = STS(np.ones(g, np.float32), np.zeros(g, np.float32), "confidence_head",
              check_knots(knots, g))  # fmt: skip
    stepped = SpeculativeDecoder(model, params, drafter, dparams, cfg, sts=sts)
    _, plan = stepped.plan(state)
    want = offline.apply_sts(z, np.ones(g), None, sts.knots)
    chex.assert_trees_all_close(
        (plan.confidence, plan.survival), (want, np.cumprod(want, axis=1)), atol=1e-5, rtol=0
    )
    assert not np.allclose(want, c_raw, atol=1e-3)  # the steps did change something


@pytest.mark.parametrize(
    "kind", ["dspark", "eagle3"] + [pytest.param(k, marks=_SLOW) for k in ("dflash", "mtp1")]
)
def test_kv_cached_context_matches_feature_draft(target, kind):
    """Every drafter keeps per-slot K/V rows in pages (computed once per committed
    position; EAGLE-3/MTP-1 once the next token is committed, plus the last state). After
    prefill and two rounds, the round's draft distributions equal the feature-based
    ``draft`` run from scratch on the target's features and tokens of the committed
    sequence (rebuilt from the prompts and the emitted tokens)."""
    model, params = target
    drafter, dparams = _drafter(kind)
    m = 32
    dec = SpeculativeDecoder(
        model, params, drafter, dparams, StepConfig(num_slots=2, max_len=m, sampling=True)
    )
    layers, two, kvh, hd = dec.ctx_shape[0], 2, CFG.num_key_value_heads, CFG.head_dim
    assert dec.ctx_shape == (layers, dec.num_pages, dec.config.page_size, two * kvh, hd)
    state = dec.init_state(seed=3)
    prompts = [PROMPT, [5, 2, 8, 9, 4]]
    ones = np.ones(2, np.float32)
    state, first = dec.prefill(
        state, np.arange(2), np.array([p + [0] * (8 - len(p)) for p in prompts]),
        np.array([3, 5]), np.array([20, 20]), ones, np.zeros(2, np.int32), ones,
    )  # fmt: skip
    seqs = [list(p) + [int(first.first_token[r])] for r, p in enumerate(prompts)]
    for _ in range(2):
        state, out = dec.round(state)
        for r in range(2):
            seqs[r] += [int(x) for x in out.tokens[r, : int(out.num_emitted[r])]]
    state, plan = dec.plan(state)

    seq_len = np.asarray(state.seq_len)
    toks = np.zeros((2, m), np.int32)
    feats = np.zeros((2, m, drafter.config.feature_width(CFG)), np.float32)
    for r in range(2):
        assert len(seqs[r]) == seq_len[r] + 1 and seqs[r][-1] == int(state.anchor[r])
        toks[r, : seq_len[r]] = seqs[r][: seq_len[r]]
        hidden, taps = model.apply(
            {"params": params}, jnp.asarray(toks[r : r + 1, : seq_len[r]]), None, None,
            dec.taps, method="hidden_states",
        )  # fmt: skip
        feats[r, : seq_len[r]] = np.asarray(dec._features(taps, hidden)[0])
    _, draft_key, _ = split_keys(jax.random.wrap_key_data(state.slot_keys), 3)
    ref = drafter.apply(
        {"params": dparams}, DraftContext(jnp.asarray(feats), state.seq_len, jnp.asarray(toks)),
        state.anchor, draft_key, SamplingSettings(1.0, 0, 1.0), dec._embed_fn(params),
        dec._lm_head_fn(params), method="draft",
    )  # fmt: skip
    chex.assert_trees_all_close(plan.draft_probs, ref.probs, atol=2e-5, rtol=0)
    chex.assert_trees_all_equal(plan.draft_tokens, ref.tokens)


def test_batched_prefill_with_padding_rows_equals_one_at_a_time(target):
    """The engine prefills several requests per call and pads the batch with rows aimed at
    slot R (out of range): those rows must write nothing, and the real rows must leave the
    state exactly as one-at-a-time prefills do."""
    model, params = target
    drafter, dparams = _drafter("dspark")
    dec = SpeculativeDecoder(model, params, drafter, dparams, StepConfig(num_slots=3, max_len=32))
    prompts = np.array([[4, 5, 6, 0, 0, 0], [9, 1, 2, 3, 8, 0], [0] * 6, [0] * 6], np.int32)
    lengths = np.array([3, 5, 1, 1], np.int32)
    zeros, ones = np.zeros(4, np.float32), np.ones(4, np.float32)
    batched, out = dec.prefill(
        dec.init_state(), np.array([2, 0, 3, 3]), prompts, lengths, np.array([9, 9, 1, 1]),
        zeros, np.zeros(4, np.int32), ones,
    )  # fmt: skip
    single = dec.init_state()
    firsts = []
    for i, slot in enumerate((2, 0)):
        single, o = dec.prefill(
            single, np.array([slot]), prompts[i : i + 1], lengths[i : i + 1], np.array([9]),
            zeros[:1], np.zeros(1, np.int32), ones[:1],
        )  # fmt: skip
        firsts.append(int(o.first_token[0]))
    assert [int(x) for x in out.first_token[:2]] == firsts

    # Padding rows write only into the null page 0, which no slot reads (the drafter's
    # paged context K/V share the target's page table).
    def written(st):
        view = {n: getattr(st, n) for n in ("seq_len", "anchor", "remaining", "active",
                                            "ctx_query", "page_table")}  # fmt: skip
        view["kv"] = st.cache.kv[:, 1:]
        view["ctx_feats"] = st.ctx_feats[:, 1:] if dec.kv_cache else st.ctx_feats
        return view

    chex.assert_trees_all_equal(written(batched), written(single), strict=True)
    assert not bool(batched.active[1]) and int(batched.seq_len[1]) == 0  # slot 1 untouched


# --------------------------------------------------------------------------------------
# Plain rounds (draft-aware policy, decode.policy): the target alone, the drafter idle


def _greedy_rounds(dec, prompt, kinds):
    """Prefill ``prompt`` into slot 0 (greedy, room for 40 tokens) and run a round of each
    kind (``"plain"`` or ``"draft"``); returns the state and the generated tokens."""
    state = dec.init_state()
    padded = np.array([prompt + [0] * (16 - len(prompt))])
    state, pre = dec.prefill(
        state, np.array([0]), padded, np.array([len(prompt)]), np.array([40]),
        np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
    )  # fmt: skip
    tokens = [int(pre.first_token[0])]
    for kind in kinds:
        state, out = dec.plain_round(state) if kind == "plain" else dec.round(state)
        out = jax.device_get(out)
        tokens += [int(x) for x in out.tokens[0, : out.num_emitted[0]]]
        if kind == "plain":  # the anchor alone: one token, nothing drafted or verified
            assert out.num_emitted[0] == 1 and out.verified[0] == 0
            assert not out.survival.any()
    return state, tokens


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_plain_rounds_keep_the_drafter_context_current(target, kind):
    """Plain rounds interleaved with drafting ones: greedy output is still autoregressive
    decoding, and the drafter's context after them is what a prefill of the same committed
    sequence builds: the next draft (tokens, confidences, EAGLE-3's query state) is the
    same as if every committed token had come from a prefill. The plain round compiles
    once and the drafter is not in it."""
    model, params = target
    drafter, dparams = _drafter(kind)
    cfg = StepConfig(num_slots=2, max_len=48)
    dec = SpeculativeDecoder(model, params, drafter, dparams, cfg)
    prompt = PROMPTS[1]
    kinds = ["plain", "draft", "plain", "plain", "draft", "plain"]
    state, tokens = _greedy_rounds(dec, prompt, kinds)
    ref = ar_generate(model, params, [prompt], len(tokens), max_len=48).tokens[0]
    assert tokens == ref, kind
    assert dec._plain._cache_size() == 1
    # The drafter's forward is not in it: fewer matmuls than the K = 0 drafting round.
    plain = str(jax.make_jaxpr(dec._plain_impl)(dec._params, state)).count("dot_general")
    k0 = str(jax.make_jaxpr(dec._round_impl, static_argnums=2)(dec._params, state, 0))
    assert plain < k0.count("dot_general"), (plain, k0.count("dot_general"))

    # The same committed sequence, prefilled: prompt + every token but the anchor.
    seq_len = int(state.seq_len[0])
    committed = (prompt + tokens)[:seq_len]
    fresh = SpeculativeDecoder(model, params, drafter, dparams, cfg)
    other = fresh.init_state()
    padded = np.array([committed + [0] * (48 - len(committed))])
    other, pre = fresh.prefill(
        other, np.array([0]), padded, np.array([seq_len]), np.array([40]),
        np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
    )  # fmt: skip
    assert int(pre.first_token[0]) == int(state.anchor[0]) == tokens[-1]
    if dec.next_token_states:
        chex.assert_trees_all_close(state.ctx_query[0], other.ctx_query[0], atol=1e-5)
    _, plan = dec.plan(state)  # (donates the states)
    _, want = fresh.plan(other)
    np.testing.assert_array_equal(plan.draft_tokens[0], want.draft_tokens[0])
    chex.assert_trees_all_close(plan.confidence[0], want.confidence[0], atol=1e-5)
