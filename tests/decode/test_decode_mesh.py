"""Decoding on a mesh of fake CPU devices (decode/mesh.py, decode/replicas.py): tensor
parallel, data replicas and both: the same greedy tokens as autoregressive decoding on one
device for every drafter kind and scheduler, exact sampling through the real step,
load-invariant coupled seeds, one compilation per bucket, replicas that own their slots
and page pools (admission to the least-loaded, page exhaustion in one replica queues and
loses nothing, padding counted), and errors that name the problem."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode import mesh as mesh_lib
from dspark_jax.decode.replicas import replica_count
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig, request_key_data
from dspark_jax.engine.offline import Request, Runner
from dspark_jax.testing import xla_compilations
from tests.decode.test_decode_step import (
    PROMPTS,
    R_EXACT,
    SAMPLING,
    WAVES,
    V,
    _chi2_pvalue,
    _drafter,
    _exact_first3,
    _sample_first3,
    _sensitive_drafter,
    _shifted,
)
from tests.decode.test_decode_step import target as target  # noqa: F401 (the module fixture)

MAX_LEN = 48


def _decoder(target, kind, mode, mesh, slots=3, sampling=False, num_pages=None):
    model, params = target
    drafter, dparams = (None, None) if kind is None else _drafter(kind)
    g = 1 if drafter is None else drafter.config.draft_len
    per = slots // replica_count(mesh)  # the SPS table is one replica's
    table = 1.0 / (1.0 + jnp.arange(per * (g + 1) + 1) / (3 * per))
    cfg = StepConfig(
        num_slots=slots, max_len=MAX_LEN, scheduler=mode, threshold=0.3, sampling=sampling,
        num_pages=num_pages,
    )  # fmt: skip
    return SpeculativeDecoder(
        model, params, drafter, dparams, cfg,
        sps_table=table if mode in ("prefix", "topk") else None, mesh=mesh,
    )  # fmt: skip


def _target_logits(target, tokens):
    model, params = target
    return np.asarray(model.apply({"params": params}, jnp.asarray([tokens], jnp.int32))[0, -1])


def _assert_same_greedy(target, prompt, want, got, tie_gap=1e-4):
    """Token-for-token equality, except at a near-tie of the target's logits (a sharded
    matmul sums in another order): a divergence there is reported as a warning and the
    rest of the sequence is not compared; any other divergence fails."""
    if want == got:
        return
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    logits = _target_logits(target, list(prompt) + want[:i])
    top2 = np.sort(logits)[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < tie_gap, (
        f"greedy output diverged at token {i} ({want[i]} vs {got[i]}) where the target's "
        f"top two logits are {gap:.3g} apart (no tie)"
    )
    warnings.warn(
        f"near-tie at token {i} (top-2 logit gap {gap:.2g}): compared up to it", stacklevel=2
    )


CASES = [
    ("dspark", "topk"),
    ("dspark", "prefix"),
    ("dspark", "threshold"),
    ("dflash", "fixed"),
    ("eagle3", "fixed"),
    ("mtp1", "fixed"),
    (None, "none"),
]


@pytest.fixture(scope="module")
def reference(target):  # noqa: F811
    """Greedy tokens on one device without a mesh (the oracle every mesh run must equal)."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % V] for i in range(6)]
    requests = [Request(p, 10 - (i % 3)) for i, p in enumerate(prompts)]
    res, _ = Runner(_decoder(target, None, "none", None)).generate(requests)
    return requests, [r.tokens for r in res]


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind,mode,tensor",
    [("dspark", "topk", 4), ("eagle3", "fixed", 2)]
    + [
        pytest.param(k, m, t, marks=_SLOW)
        for t in (2, 4)
        for k, m in CASES
        if (k, m, t) not in {("dspark", "topk", 4), ("eagle3", "fixed", 2)}
    ],
)
def test_greedy_on_a_tensor_mesh_equals_one_device(target, reference, kind, mode, tensor):  # noqa: F811
    requests, want = reference
    mesh = mesh_lib.decode_mesh(tensor=tensor)
    dec = _decoder(target, kind, mode, mesh)
    buckets = (2, 6, dec.full_budget) if mode in ("topk", "prefix") else None
    with xla_compilations() as compiled:
        res, _ = Runner(dec, buckets=buckets).generate(requests)
    for req, w, r in zip(requests, want, res):
        _assert_same_greedy(target, req.prompt, w, r.tokens)
    # The weights and the KV pool are split over the tensor axis (tiny: 4 query heads,
    # 2 KV heads: the pool is split only when the tensor axis divides the KV heads).
    q = dec.target_params["layers"]["layer"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec[1] == "tensor", q.sharding
    pool_spec = dec.init_state().cache.kv.sharding.spec
    assert (len(pool_spec) > 3 and pool_spec[3] == "tensor") == (tensor == 2), pool_spec
    # One compilation per bucket used, one prefill (nothing compiled per round).
    names = {"round", "plan", "commit"}
    assert compiled["prefill"] == 1, compiled
    assert sum(compiled[n] for n in names) <= (1 + len(buckets) if buckets else 3), compiled


@_SLOW  # data 2 × tensor 4 below covers the tensor split too (default run)
def test_sampling_on_a_tensor_mesh_is_exact(target):  # noqa: F811
    """T = 1 through the real step on tensor 4, Algorithm 1's bucketed path admitting every
    verify length 0..γ: the first three tokens follow the target (and a 3 % move of the
    target is rejected, so the test has the power to see a bias)."""
    model, params = target
    drafter, dparams = _sensitive_drafter()
    r, g = R_EXACT, 2
    table = 1.0 / (1.0 + jnp.arange(r * (g + 1) + 1) / (1.5 * r))
    cfg = StepConfig(num_slots=r, max_len=24, scheduler="prefix", sampling=True)
    dec = SpeculativeDecoder(
        model, params, drafter, dparams, cfg, sps_table=table,
        mesh=mesh_lib.decode_mesh(tensor=4),
    )  # fmt: skip
    setting = SAMPLING[1]
    exact = _exact_first3(model, params, *setting)
    counts, lengths = _sample_first3(dec, WAVES, *setting, buckets=(r // 2, r, r * g))
    assert set(lengths) == set(range(g + 1)), lengths
    p, chi2 = _chi2_pvalue(counts, exact)
    assert p > 1e-3, (chi2, p)
    assert _chi2_pvalue(counts, _shifted(exact, 0.03))[0] < 1e-3


@_SLOW  # data 2 × tensor 4 below covers the tensor split too (default run)
def test_coupled_seeds_give_the_same_tokens_on_the_mesh_under_load(target):  # noqa: F811
    model, params = target
    drafter, dparams = _drafter("dspark", gamma=4)
    coupled = [
        Request([3, 7, 1], 12, 1.0, seed=11, coupled=True),
        Request([5, 6, 7, 8], 10, 0.8, top_k=6, top_p=0.9, seed=2**40 + 3, coupled=True),
    ]
    others = [Request(PROMPTS[i] + [i], 5 + 2 * i, 1.0) for i in range(4)]
    loaded = others[:2] + coupled[:1] + others[2:] + coupled[1:]

    def run(mesh, requests, slots):
        table = 1.0 / (1.0 + jnp.arange(slots * 5 + 1) / (3 * slots))
        dec = SpeculativeDecoder(
            model, params, drafter, dparams,
            StepConfig(num_slots=slots, max_len=40, scheduler="topk", sampling=True),
            sps_table=table, mesh=mesh,
        )  # fmt: skip
        res, _ = Runner(dec, buckets=(2, slots * 2, slots * 4), seed=3).generate(requests)
        return {tuple(q.prompt): r.tokens for q, r in zip(requests, res) if q.coupled}

    alone = run(None, coupled, 1)
    assert run(mesh_lib.decode_mesh(tensor=4), loaded, 3) == alone


def test_state_layout_is_kept_by_every_step(target):  # noqa: F811
    """Prefill, rounds, plan/commit and release return the state in the layout
    ``state_shardings`` gives (so no step meets a new input layout)."""
    mesh = mesh_lib.decode_mesh(tensor=2)
    dec = _decoder(target, "dspark", "fixed", mesh)
    want = dec.state_shardings(mesh)
    state = dec.init_state()
    state, _ = dec.prefill(state, [0], [[1, 2, 3]], [3], [8], [0.0], [0], [1.0])
    state, _ = dec.round(state, 4)
    state, plan = dec.plan(state)
    state, _ = dec.commit(state, plan, 4)
    state = dec.release(state, 0)
    for got, w in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        assert got.sharding.is_equivalent_to(w, got.ndim), (got.sharding, w)
    chex.assert_trees_all_equal_shapes(state, jax.eval_shape(dec.init_state))


def test_mesh_errors_name_the_problem(target):  # noqa: F811
    with pytest.raises(ValueError, match=r"--data 4 --tensor 4 needs 16 devices but 8 cpu"):
        mesh_lib.decode_mesh(data=4, tensor=4)
    with pytest.raises(ValueError, match=r"--tensor 16 needs 16 devices but 8 cpu"):
        mesh_lib.decode_mesh(tensor=16)
    with pytest.raises(ValueError, match=r"--tensor must be a positive integer"):
        mesh_lib.decode_mesh(tensor=0)
    assert mesh_lib.decode_mesh(tensor=1) is None  # one device: no mesh at all
    model, params = target
    bad = jax.tree.map(lambda x: x, params)
    bad["embed_tokens"]["embedding"] = bad["embed_tokens"]["embedding"][:, :8]
    cfg = StepConfig(num_slots=2, max_len=16, scheduler="none")
    with pytest.raises(ValueError, match=r"target parameter .*embed_tokens.* has shape"):
        SpeculativeDecoder(model, bad, None, None, cfg, mesh=mesh_lib.decode_mesh(tensor=2))
    with pytest.raises(ValueError, match=r"--data 4 needs a slot count it divides .* got 2 slots"):
        SpeculativeDecoder(model, params, None, None, cfg, mesh=mesh_lib.decode_mesh(data=4))
    dec = SpeculativeDecoder(model, params, None, None, cfg, mesh=mesh_lib.decode_mesh(tensor=2))
    weights = mesh_lib.per_device_bytes(dec.target_params)
    with pytest.raises(ValueError, match=r"the models do not fit: .* Try --tensor 4"):
        mesh_lib.check_fits(dec, device_bytes=weights)
    mesh_lib.check_fits(dec, device_bytes=100 * weights)  # fits: no error
    # Split weights: each device holds about half of the target.
    one = mesh_lib.per_device_bytes(params)
    assert weights < 0.75 * one, (weights, one)


# -- data replicas (decode/replicas.py) ---------------------------------------------------
DATA_CASES = [("dspark", "topk", 2, 4)]


@pytest.mark.parametrize(
    "kind,mode,data,tensor",
    DATA_CASES
    + [
        pytest.param(k, m, d, t, marks=_SLOW)
        for d, t in ((2, 4), (8, 1), (2, 1))
        for k, m in CASES
        if (k, m, d, t) not in set(DATA_CASES)
    ],
)
def test_greedy_on_data_replicas_equals_one_device(target, reference, kind, mode, data, tensor):  # noqa: F811
    requests, want = reference
    mesh = mesh_lib.decode_mesh(data=data, tensor=tensor)
    dec = _decoder(target, kind, mode, mesh, slots=8)
    buckets = (2, 6, dec.full_budget) if mode in ("topk", "prefix") else None
    with xla_compilations() as compiled:
        res, _ = Runner(dec, buckets=buckets).generate(requests)
    for req, w, r in zip(requests, want, res):
        _assert_same_greedy(target, req.prompt, w, r.tokens)
    # Each replica holds its own slots and its own page pool (pages split over data).
    state = dec.init_state()
    assert state.cache.kv.sharding.spec[1] == "data", state.cache.kv.sharding
    assert state.seq_len.sharding.spec[0] == "data", state.seq_len.sharding
    chex.assert_shape(state.cache.kv, (None, data * dec.replica_pages, None, None, None))
    assert compiled["prefill"] == 1, compiled
    names = {"round", "plan", "commit"}
    assert sum(compiled[n] for n in names) <= (1 + len(buckets) if buckets else 3), compiled


@pytest.mark.slow  # 66 s; exactness on one device in test_decode_step, replica parity by the greedy cases
def test_sampling_on_data_replicas_is_exact(target):  # noqa: F811
    """T = 1 through the real step on data 2 × tensor 4 (each replica its own Algorithm 1
    budget, verify lengths 0..γ): the first three tokens follow the target, and a 3 % move
    of the target is rejected."""
    model, params = target
    drafter, dparams = _sensitive_drafter()
    r, g = R_EXACT, 2
    per = r // 2
    table = 1.0 / (1.0 + jnp.arange(per * (g + 1) + 1) / (1.5 * per))
    cfg = StepConfig(num_slots=r, max_len=24, scheduler="prefix", sampling=True)
    dec = SpeculativeDecoder(
        model, params, drafter, dparams, cfg, sps_table=table,
        mesh=mesh_lib.decode_mesh(data=2, tensor=4),
    )  # fmt: skip
    setting = SAMPLING[1]
    exact = _exact_first3(model, params, *setting)
    counts, lengths = _sample_first3(dec, WAVES, *setting, buckets=(per // 2, per, per * g))
    assert set(lengths) == set(range(g + 1)), lengths
    p, chi2 = _chi2_pvalue(counts, exact)
    assert p > 1e-3, (chi2, p)
    assert _chi2_pvalue(counts, _shifted(exact, 0.03))[0] < 1e-3


@pytest.mark.slow  # 55 s
def test_coupled_seeds_give_the_same_tokens_on_data_replicas_under_load(target):  # noqa: F811
    model, params = target
    drafter, dparams = _drafter("dspark", gamma=4)
    coupled = [
        Request([3, 7, 1], 12, 1.0, seed=11, coupled=True),
        Request([5, 6, 7, 8], 10, 0.8, top_k=6, top_p=0.9, seed=2**40 + 3, coupled=True),
    ]
    others = [Request(PROMPTS[i] + [i], 5 + 2 * i, 1.0) for i in range(6)]
    loaded = others[:3] + coupled[:1] + others[3:] + coupled[1:]

    def run(mesh, requests, slots):
        per = slots // replica_count(mesh)
        table = 1.0 / (1.0 + jnp.arange(per * 5 + 1) / (3 * per))
        dec = SpeculativeDecoder(
            model, params, drafter, dparams,
            StepConfig(num_slots=slots, max_len=40, scheduler="topk", sampling=True),
            sps_table=table, mesh=mesh,
        )  # fmt: skip
        res, _ = Runner(dec, buckets=(2, per * 2, per * 4), seed=3).generate(requests)
        return {tuple(q.prompt): r.tokens for q, r in zip(requests, res) if q.coupled}

    alone = run(None, coupled, 1)
    assert run(mesh_lib.decode_mesh(data=2, tensor=4), loaded, 4) == alone


def test_replicas_admit_to_the_least_loaded_and_queue_on_their_own_pages(target, reference):  # noqa: F811
    """Four slots over two replicas, each pool holding only two short requests at once:
    requests alternate between the replicas (least loaded first), a replica whose pages
    are spent takes nothing until one of its requests ends (the others wait in the queue,
    none dropped), and every output equals the one-device tokens."""
    from dspark_jax.engine.core import CoreRequest, EngineCore, RoundDone

    requests, want = reference
    mesh = mesh_lib.decode_mesh(data=2, tensor=2)
    # Per replica: the null page + 2 pages of 16 positions, one request's worth (prompt +
    # max_new + γ <= 32), for its two slots.
    dec = _decoder(target, "dspark", "fixed", mesh, slots=4, num_pages=2 * 3)
    assert dec.replica_pages == 3
    core = EngineCore(dec)
    core.reset()
    assert len(core.pages) == 2 and core.pages.capacity == 4
    reqs = [
        CoreRequest(q.prompt, q.max_new_tokens, 0.0, 0, 1.0, request_key_data(0, i), tag=i)
        for i, q in enumerate(requests)
    ]
    for r in reqs:
        core.add(r)
    placed, tokens, padding = {}, {i: [] for i in range(len(reqs))}, 0
    while core.has_work:
        for ev in core.step():
            if isinstance(ev, RoundDone):
                padding += ev.padding
                continue
            tokens[ev.request.tag].extend(ev.tokens)
        for s, r in enumerate(core.slots):
            if r is not None and r.tag not in placed:
                placed[r.tag] = s // dec.replica_slots
    assert [tokens[i] for i in range(len(reqs))] == want
    # First two go to different replicas (each empty, the least loaded first).
    assert placed[0] != placed[1], placed
    assert sorted(set(placed.values())) == [0, 1], placed
    assert core.times.page_waits > 0  # pages, not slots, held requests back
    assert core.pages.free == core.pages.capacity  # every page came back
    assert padding >= 0


def test_padding_counts_rows_run_for_the_other_replica(target):  # noqa: F811
    """Fixed γ per occupied slot: with three requests in one replica and one in the other,
    the round runs the busier replica's bucket and the quieter one pads the difference."""
    from dspark_jax.decode.policy import RoundPolicy

    mesh = mesh_lib.decode_mesh(data=2)
    dec = _decoder(target, "dspark", "fixed", mesh, slots=8)
    policy = RoundPolicy(dec, buckets=(2, 4, 6, 8))
    g = dec.gamma
    occupied = np.array([1, 1, 1, 0, 1, 0, 0, 0], bool)
    own = policy.replica_budgets(occupied)
    assert own == [min(b for b in policy.buckets if b >= 3 * g),
                   min(b for b in policy.buckets if b >= g)]  # fmt: skip
    state = dec.init_state()
    state, _, budget, _ = policy.dispatch(state, occupied)
    assert budget == max(own) and policy.last_padding == max(own) - min(own) > 0


def test_plain_rounds_on_data_replicas_equal_one_device(target, reference):  # noqa: F811
    """Draft-aware top-K on data 2 × tensor 4 with a plain round profiled twice as fast as
    any drafting one: most rounds run plain (per replica, in one executable), probes
    draft now and then, and the greedy tokens are those of one device."""
    from dspark_jax.sched.sps import SPSTable

    requests, want = reference
    mesh = mesh_lib.decode_mesh(data=2, tensor=4)
    dec = _decoder(target, "dspark", "topk", mesh, slots=8)
    buckets = (2, 6, dec.full_budget)
    per = dec.replica_slots
    dec.set_sps_table(SPSTable.from_seconds({per + k: 1.0 for k in buckets}, plain_seconds=0.5))
    res, stats = Runner(dec, buckets=buckets).generate(requests)
    for req, w, r in zip(requests, want, res):
        _assert_same_greedy(target, req.prompt, w, r.tokens)
    assert stats.round_kinds["plain"] > stats.rounds / 2, stats.round_kinds
    assert dec._plain._cache_size() == 1
