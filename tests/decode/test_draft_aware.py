"""Draft-aware rounds (decode/policy.py): a plain round (the target alone) when drafting
would not pay on the newest survivals read, probes that keep speculation from starving,
and the rules that keep it lossless: the decision reads nothing of the round it decides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode.autoregressive import generate as ar_generate
from dspark_jax.decode.policy import RoundPolicy
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
from dspark_jax.engine.offline import Request, Runner
from dspark_jax.sched import sps as sps_lib
from tests.decode.test_decode_step import (
    PROMPTS,
    SAMPLING,
    WAVES,
    V,
    _chi2_pvalue,
    _drafter,
    _sample_first3,
    _sensitive_drafter,
    _shifted,
    exact_dists,  # noqa: F401 (module fixture)
)
from tests.decode.test_decode_step import target as target  # noqa: F401 (module fixture)

R, G = 2, 4  # slots; γ of the tiny DSpark drafter
BUCKETS = (2, 4, 8)


def _table(draft_seconds: float, plain_seconds: float | None) -> sps_lib.SPSTable:
    """Every drafting bucket (B = R + K) takes ``draft_seconds``, a plain round
    ``plain_seconds``."""
    return sps_lib.SPSTable.from_seconds(
        {R + k: draft_seconds for k in BUCKETS}, plain_seconds=plain_seconds
    )


def _decoder(target, scheduler="topk", table=None, slots=R, max_len=40):  # noqa: F811
    model, params = target
    drafter, dparams = _drafter("dspark", gamma=G)
    cfg = StepConfig(num_slots=slots, max_len=max_len, scheduler=scheduler)
    return SpeculativeDecoder(model, params, drafter, dparams, cfg, sps_table=table)


SURE = np.ones((R, G), np.float32)  # every draft survives: Θ_draft = (2 + 8)·1 = 10
HOPELESS = np.zeros((R, G), np.float32)  # none does: Θ_draft = 2·1 < Θ_plain = 2·2
BOTH = np.ones(R, bool)


def _kinds(policy, dec, survival_of, n):
    """Dispatch ``n`` rounds, feeding each drafting round's survivals ``survival_of(i)``
    to the policy once two rounds later (a pipelined host's view); their kinds."""
    state, kinds, pending = dec.init_state(), [], []
    for _ in range(n):
        state, _, _, index = policy.dispatch(state, BOTH)
        kinds.append(policy.last_kind)
        pending.append(index)
        if len(pending) == 2:  # round i - 1 is read after round i is dispatched
            j = pending.pop(0)
            policy.observe(j, survival_of(j), BOTH)
    return kinds


def test_the_decision_reads_only_rounds_two_back(target):  # noqa: F811
    """Non-anticipation on the host: the kind of round n is a function of the survivals
    read from rounds <= n − 2 (and the profile) alone. Changing round n − 1's survivals
    (read, offline, before round n is dispatched) never changes it; changing round
    n − 2's does."""
    dec = _decoder(target, table=_table(1.0, 0.5))

    def decide(older, newer):
        policy = RoundPolicy(dec, BUCKETS)
        state = dec.init_state()
        for survival in (older, newer):  # rounds 0 and 1, read at once (offline)
            state, _, _, index = policy.dispatch(state, BOTH)
            policy.observe(index, survival, BOTH)
        policy.dispatch(state, BOTH)  # round 2
        return policy.last_kind

    assert decide(SURE, HOPELESS) == decide(SURE, SURE) == "draft"
    assert decide(HOPELESS, SURE) == decide(HOPELESS, HOPELESS) == "plain"


def test_probes_back_off_and_never_stop(target):  # noqa: F811
    """Where drafting never pays, probes come after 4, 8, 16, 32 and then every 64 plain
    rounds (``probe_gap=(4, 64)``), never further apart, and scaled by what a probe costs beyond a plain round
    when that is more than one plain round; once a probe shows that drafting pays, every
    round drafts again. Without a plain round's profile, or with plain rounds off, every
    round drafts."""
    dec = _decoder(target, table=_table(1.0, 0.5))  # a probe costs one plain round more
    kinds = _kinds(RoundPolicy(dec, BUCKETS, probe_gap=(4, 64)), dec, lambda i: HOPELESS, 300)
    drafting = [i for i, k in enumerate(kinds) if k != "plain"]
    # The first round drafts; the next waits for its survivals, read two rounds later.
    assert kinds[:2] == ["draft", "plain"]
    assert all(kinds[i] == "probe" for i in drafting[1:])
    gaps = np.diff(drafting) - 1  # plain rounds between drafting ones
    assert list(gaps[:6]) == [1 + 4, 8, 16, 32, 64, 64], gaps
    assert max(gaps) == 64 and len(drafting) <= 1 + 300 // 65 + 4
    switch = drafting[4]  # from this probe on, drafts survive
    policy = RoundPolicy(dec, BUCKETS, probe_gap=(4, 64))
    kinds = _kinds(policy, dec, lambda i: SURE if i >= switch else HOPELESS, switch + 20)
    assert kinds[switch] == "probe" and kinds[switch + 1] == "plain"
    assert set(kinds[switch + 2 :]) == {"draft"}  # decided on the probe's survivals

    # A probe that costs 3 plain rounds more (SPS 1 against 4): gaps 3 times as long.
    dec = _decoder(target, table=_table(1.0, 0.25))
    kinds = _kinds(RoundPolicy(dec, BUCKETS, probe_gap=(4, 64)), dec, lambda i: HOPELESS, 400)
    gaps = np.diff([i for i, k in enumerate(kinds) if k != "plain"]) - 1
    assert list(gaps) == [1 + 12, 24, 48, 96, 192], gaps

    policy = RoundPolicy(dec, BUCKETS, plain_rounds=False)
    assert set(_kinds(policy, dec, lambda i: HOPELESS, 10)) == {"draft"}
    no_plain = _decoder(target, table=_table(1.0, None))
    assert set(_kinds(RoundPolicy(no_plain, BUCKETS), no_plain, lambda i: HOPELESS, 10)) == {
        "draft"
    }
    with pytest.raises(ValueError, match="plain rounds are decided from survivals"):
        RoundPolicy(_decoder(target, scheduler="fixed"), BUCKETS, plain_rounds=True)
    with pytest.raises(ValueError, match="probe_gap"):
        RoundPolicy(dec, BUCKETS, probe_gap=(8, 4))


@pytest.mark.parametrize("mode", ["topk", "prefix"])
@pytest.mark.parametrize("plain_seconds", [0.5, 2.0])
def test_greedy_with_draft_aware_rounds_is_autoregressive(target, mode, plain_seconds):  # noqa: F811
    """Through the offline runner: with a plain round twice as fast as any drafting one
    most rounds are plain, with one twice as slow only the round waiting for the first
    survivals is; the output is autoregressive decoding token for token either way, and
    warm-up compiles every round the runs use (the plain round is one executable)."""
    dec = _decoder(target, scheduler=mode, table=_table(1.0, plain_seconds), slots=3)
    runner = Runner(dec, buckets=BUCKETS)
    runner.warmup()  # every verify bucket and the plain round (prefill compiles in use)

    def rounds_compiled():
        return dec.compiled_executables() - dec._prefill._cache_size()

    compiled = rounds_compiled()
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % V] for i in range(6)]
    res, stats = runner.generate([Request(p, 12) for p in prompts])
    for p, r in zip(prompts, res):
        assert r.tokens == ar_generate(*target, [p], 12, max_len=40).tokens[0]
    kinds = stats.round_kinds
    assert sum(kinds.values()) == stats.rounds
    if plain_seconds < 1:
        assert kinds["plain"] > stats.rounds / 2 and kinds.get("probe", 0) >= 1, kinds
    else:  # only round 1, waiting for round 0's survivals, is plain
        assert kinds.get("plain") == 1 and "probe" not in kinds, kinds
    assert rounds_compiled() == compiled


def test_sampling_is_exact_with_plain_rounds_mixed_in(target, exact_dists):  # noqa: F811
    """χ² through the real step (top-K, every verify length 0..γ admitted) with plain
    rounds mixed in by a rule that reads only earlier rounds' tokens (a plain round
    whenever the tokens emitted so far sum to an odd number): the first three tokens
    still follow the target exactly, and the test keeps its power."""
    model, params = target
    drafter, dparams = _sensitive_drafter()
    r, g = 256, 2
    table = 1.0 / (1.0 + jnp.arange(r * (g + 1) + 1) / (1.5 * r))
    cfg = StepConfig(num_slots=r, max_len=24, scheduler="topk", sampling=True)
    dec = SpeculativeDecoder(model, params, drafter, dparams, cfg, sps_table=table)
    setting = SAMPLING[0]
    counts, lengths = _sample_first3(
        dec, WAVES, *setting, budget=r, plain_when=lambda emitted: sum(emitted) % 2 == 1
    )
    assert set(lengths) == set(range(g + 1)), lengths
    p, chi2 = _chi2_pvalue(counts, exact_dists[setting])
    assert p > 1e-3, (chi2, p)
    assert _chi2_pvalue(counts, _shifted(exact_dists[setting], 0.03))[0] < 1e-3
    assert dec._plain._cache_size() == 1


class PeekingSkipDecoder(SpeculativeDecoder):
    """WRONG (test only): skip verifying a slot (as a plain round would) when its current
    draft looks unlikely to survive, i.e. decide on the round's own draft. With the
    sensitive drafter a_2 reveals whether x_1 is even, so x_1's admission depends on x_1
    itself: Appendix A's failure."""

    def _schedule(self, survival, active, budget, sps_table):
        keep = survival[:, 1] >= 0.5
        return jnp.where(active & keep, survival.shape[1], 0).astype(jnp.int32)


def test_a_skip_decided_on_the_current_draft_is_detected(target, exact_dists):  # noqa: F811
    model, params = target
    drafter, dparams = _sensitive_drafter()
    cfg = StepConfig(num_slots=256, max_len=24, scheduler="fixed", sampling=True)
    peeking = PeekingSkipDecoder(model, params, drafter, dparams, cfg)
    counts, lengths = _sample_first3(peeking, WAVES, *SAMPLING[0])
    assert set(lengths) == {0, 2}, lengths  # both skipped and verified slots occurred
    p, chi2 = _chi2_pvalue(counts, exact_dists[SAMPLING[0]])
    assert p < 1e-6, (chi2, p)


def test_the_sps_table_keeps_the_plain_round(tmp_path):
    """The plain round's time travels with the table (JSON, the cache); a cached table
    without it is profiled again when the plain round is wanted."""
    table = _table(1.0, 0.25)
    assert table.plain_sps == 4.0
    assert sps_lib.SPSTable.from_json(table.to_json()) == table
    path = str(tmp_path / "sps.json")
    sps_lib.store_table(path, "k", _table(1.0, None))
    fns = {R + k: (lambda: jnp.zeros(())) for k in BUCKETS}
    assert sps_lib.cached_table(path, "k", fns) is not None
    assert sps_lib.cached_table(path, "k", fns, plain=True) is None
    fresh = sps_lib.load_or_profile(path, "k", fns, repeats=1, plain_fn=lambda: jnp.zeros(()))
    assert fresh.plain_seconds is not None
    assert sps_lib.cached_table(path, "k", fns, plain=True) == fresh
    with pytest.raises(ValueError, match="plain_seconds must be finite"):
        sps_lib.SPSTable.from_seconds({4: 1.0}, plain_seconds=0.0)


def test_without_a_drafter_the_plain_round_is_the_k0_round(target):  # noqa: F811
    """Without a drafter a plain round is the K = 0 round itself."""
    model, params = target
    dec = SpeculativeDecoder(model, params, None, None, StepConfig(num_slots=1, max_len=16))
    state = dec.init_state()
    state, out = dec.plain_round(state)
    jax.block_until_ready(out.tokens)
    assert dec._round._cache_size() == 1 and dec._plain._cache_size() == 0


def test_the_rule_refuses_a_round_it_may_not_read():
    """``PlainRoundRule.decide`` for round n accepts survivals of rounds <= n − 2 only."""
    from dspark_jax.sched.plain_rounds import PlainRoundRule

    dense = np.asarray(_table(1.0, 0.5).as_array(R * (G + 1) + 1))
    rule = PlainRoundRule()
    assert rule.decide(5, (3, HOPELESS, BOTH), dense, 2.0, BUCKETS, R) == "plain"
    assert rule.decide(5, (3, SURE, BOTH), dense, 2.0, BUCKETS, R) == "draft"
    with pytest.raises(ValueError, match="round 5 may only be decided on rounds <= 3"):
        rule.decide(5, (4, SURE, BOTH), dense, 2.0, BUCKETS, R)
