"""Decoding on a tensor-parallel mesh of fake CPU devices (decode/mesh.py): the same greedy
tokens as autoregressive decoding on one device for every drafter kind and scheduler,
exact sampling through the real step, load-invariant coupled seeds, one compilation per
bucket, and errors that name the problem."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode_step import (
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
from test_decode_step import target as target  # noqa: F401 (the module fixture)

from dspark_jax.decode import mesh as mesh_lib
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
from dspark_jax.engine.offline import Request, Runner
from dspark_jax.testing import xla_compilations

MAX_LEN = 48


def _decoder(target, kind, mode, mesh, slots=3, sampling=False):
    model, params = target
    drafter, dparams = (None, None) if kind is None else _drafter(kind)
    g = 1 if drafter is None else drafter.config.draft_len
    table = 1.0 / (1.0 + jnp.arange(slots * (g + 1) + 1) / (3 * slots))
    cfg = StepConfig(
        num_slots=slots, max_len=MAX_LEN, scheduler=mode, threshold=0.3, sampling=sampling
    )
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
    [("dspark", "topk", 4), ("eagle3", "fixed", 2), ("dspark", "prefix", 2)]
    + [
        pytest.param(k, m, t, marks=_SLOW)
        for t in (2, 4)
        for k, m in CASES
        if (k, m, t) not in {("dspark", "topk", 4), ("eagle3", "fixed", 2), ("dspark", "prefix", 2)}
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
    with pytest.raises(ValueError, match=r"--data 2: data-parallel decoding .* not built yet"):
        mesh_lib.decode_mesh(data=2)
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
    dec = SpeculativeDecoder(model, params, None, None, cfg, mesh=mesh_lib.decode_mesh(tensor=2))
    weights = mesh_lib.per_device_bytes(dec.target_params)
    with pytest.raises(ValueError, match=r"the models do not fit: .* Try --tensor 4"):
        mesh_lib.check_fits(dec, device_bytes=weights)
    mesh_lib.check_fits(dec, device_bytes=100 * weights)  # fits: no error
    # Split weights: each device holds about half of the target.
    one = mesh_lib.per_device_bytes(params)
    assert weights < 0.75 * one, (weights, one)
