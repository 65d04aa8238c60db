"""Serving simulator (perf/serving_sim.py): the engine's loop on a modelled clock."""

import numpy as np
import pytest

from dspark_jax.perf.serving_sim import Arm, Trace, Workload, simulate, traces_from_records
from dspark_jax.sched.sps import SPSTable

# Algorithm 1's worked example (tests/sched/test_scheduler.py): R = 2, γ = 3.
PAPER_A = np.array([[0.9, 0.54, 0.108], [0.8, 0.4, 0.04]])
PAPER_SPS = {2: 1.0, 3: 0.95, 4: 0.9, 5: 0.85, 6: 0.6, 7: 0.5, 8: 0.4}


def _table(sps: dict) -> SPSTable:
    return SPSTable.from_seconds({b: 1.0 / v for b, v in sps.items()})


def _no_prefill(rows, tokens):
    return 0.0


def test_worked_example_round_admits_algorithm1_lengths():
    arm = Arm(
        "Algorithm 1",
        "prefix",
        gamma=3,
        sps=_table(PAPER_SPS),
        verify_buckets=tuple(range(7)),
        two_phase=True,
    )
    # Every draft accepted, one round per prompt: the emitted tokens show the lengths.
    traces = [Trace(np.array([3]), PAPER_A[i : i + 1]) for i in range(2)]
    res = simulate(
        arm,
        traces,
        Workload(concurrency=2, requests_per_client=1, max_tokens=100, prompt_tokens=(8,)),
        slots=2,
        prefill_seconds=_no_prefill,
    )
    # lengths [2, 1]: B = 5, one round of 1 / SPS(5) seconds; 1 + 3 and 1 + 2 tokens. As in
    # the engine, one more (empty) round is dispatched before the host learns both ended.
    assert res["rounds"] == 2 and res["budgets"] == [3, 0]
    assert res["wall_seconds"] == pytest.approx(1 / 0.85)
    assert res["aggregate_tokens_per_second"] == pytest.approx(7 * 0.85)
    assert res["mean_verify_budget_per_request"] == pytest.approx(1.5)
    assert res["mean_tau"] == pytest.approx(2.5)


def test_exact_small_case_pipelined_loop():
    # R = 1, fixed γ = 2, every round accepts both drafts; prefill 0.5 s, rounds 0.1 s.
    arm = Arm("fixed", "fixed", gamma=2, sps=_table({1: 10.0, 3: 10.0}), verify_buckets=(0, 2))
    trace = Trace(np.array([2, 2, 2]), np.ones((3, 2)))
    res = simulate(
        arm,
        [trace],
        Workload(concurrency=1, requests_per_client=2, max_tokens=7, prompt_tokens=(8,)),
        slots=1,
        prefill_seconds=lambda rows, tokens: 0.5,
    )
    # Request 1: prefill [0, 0.5] (1 token), rounds end at 0.6 (+3) and 0.7 (+3 = 7). The
    # host learns of round 2 only after dispatching round 3 (a no-op round for the ended
    # slot, [0.7, 0.8]); request 2 arrives at 0.7, its prefill waits for the device:
    # [0.8, 1.3], rounds end at 1.4 and 1.5 (and a no-op round 6).
    assert res["rounds"] == 6
    assert res["wall_seconds"] == pytest.approx(1.5)
    assert res["aggregate_tokens_per_second"] == pytest.approx(14 / 1.5)
    assert res["per_user_tokens_per_second"] == pytest.approx((7 / 0.7 + 7 / 0.8) / 2)
    assert res["mean_tau"] == pytest.approx(3.0)
    assert res["mean_verify_budget_per_request"] == pytest.approx(2.0)


def test_topk_budget_reads_two_rounds_back():
    # SPS falls steeply past B = R + 1: Θ prefers one draft when survivals are low and all
    # four when they are high. Round 1 (low survivals) picks round 3's budget.
    sps = _table({2: 1.0, 3: 0.99, 4: 0.8, 5: 0.79, 6: 0.78})
    arm = Arm("top-K", "topk", gamma=2, sps=sps, verify_buckets=(1, 2, 3, 4))
    low, high = np.full((1, 2), 0.05), np.full((1, 2), 0.99)
    surv = np.concatenate([low, high, high, high, high])
    trace = Trace(np.zeros(5, np.int64), surv)
    res = simulate(
        arm,
        [trace, trace],
        Workload(concurrency=2, requests_per_client=1, max_tokens=100, prompt_tokens=(8,)),
        slots=2,
        prefill_seconds=_no_prefill,
    )
    # Rounds 1-2: nothing processed yet -> the largest bucket; round 3 sees round 1 (low):
    # argmax Θ is one draft; round 4 sees round 2 (high): all four.
    assert res["budgets"][:4] == [4, 4, 1, 4]


def test_data_replicas_serve_twice_the_clients_of_one_replica_in_the_same_time():
    """Two replicas of R slots with one replica's SPS table, 2c clients: each replica
    serves c of them exactly as one engine of R slots does (least-loaded admission
    alternates), so the wall time is the same and the aggregate throughput doubles."""
    arm = Arm("fixed", "fixed", gamma=2, sps=_table({2: 10.0, 4: 8.0, 6: 6.0}),
              verify_buckets=(0, 2, 4))  # fmt: skip
    trace = Trace(np.array([2, 1, 0, 2]), np.ones((4, 2)))
    kw = dict(prefill_seconds=_no_prefill, prefill_batch=1)  # rounds only
    one = simulate(arm, [trace], Workload(2, 2, 6, (8,)), slots=2, **kw)
    two = simulate(arm, [trace], Workload(4, 2, 6, (8,)), slots=4, replicas=2, **kw)
    assert two["wall_seconds"] == pytest.approx(one["wall_seconds"])
    assert two["aggregate_tokens_per_second"] == pytest.approx(
        2 * one["aggregate_tokens_per_second"]
    )
    assert two["budgets"] == one["budgets"] and two["padding_rows"] == 0


def test_replicas_run_the_largest_budget_and_count_the_padding():
    """Three clients on two replicas of two slots: one replica holds two requests, the
    other one; the round runs the busier replica's bucket (γ per occupied slot) and the
    other pads the difference."""
    arm = Arm("fixed", "fixed", gamma=2, sps=_table({2: 10.0, 4: 8.0, 6: 6.0}),
              verify_buckets=(0, 2, 4))  # fmt: skip
    trace = Trace(np.array([0, 0, 0]), np.ones((3, 2)))
    res = simulate(
        arm, [trace], Workload(3, 1, 3, (8,)), slots=4, replicas=2,
        prefill_seconds=_no_prefill, prefill_batch=1,
    )  # fmt: skip
    assert res["budgets"][0] == 4 and res["padding_rows"] >= 2
    with pytest.raises(ValueError, match="replicas must be >= 1 and divide the slots"):
        simulate(arm, [trace], Workload(1, 1, 3, (8,)), slots=3, replicas=2,
                 prefill_seconds=_no_prefill)  # fmt: skip


def test_traces_from_records_split_and_calibrate():
    idx = np.array([0, 0, 1, 1, 1])
    acc = np.array([1, 2, 0, 3, 9])
    z = np.zeros((5, 3))
    tr = traces_from_records(idx, acc, 3, z, sts_temperatures=[1, 1, 1], sts_biases=[0, 0, 0])
    assert [len(t.accepted) for t in tr] == [2, 3]
    assert tr[1].accepted.tolist() == [0, 3, 3]  # capped at γ
    np.testing.assert_allclose(tr[0].survival[0], [0.5, 0.25, 0.125])
    mtp = traces_from_records(idx, np.minimum(acc, 1), 1)
    assert mtp[0].survival.shape == (2, 1) and np.all(mtp[0].survival == 1)
    with pytest.raises(ValueError, match="confidence_logits must be"):
        traces_from_records(idx, acc, 3, np.zeros((5, 2)))


def test_bad_inputs_are_named():
    arm = Arm("fixed", "fixed", gamma=2, sps=_table({1: 1.0}), verify_buckets=(0, 2))
    wl = Workload(1, 1, 4, (8,))
    with pytest.raises(ValueError, match="at least one trace"):
        simulate(arm, [], wl, slots=1, prefill_seconds=_no_prefill)
    with pytest.raises(ValueError, match="no SPS for B = 3"):
        simulate(arm, [Trace(np.array([2]), np.ones((1, 2)))], wl, slots=1,
                 prefill_seconds=_no_prefill)  # fmt: skip


def test_plain_rounds_in_the_simulator_follow_the_engines_rule():
    """R = 1, γ = 2, top-K. Drafting rounds take 1 s, a plain round 0.5 s (SPS_plain 2).
    Hopeless drafts (survival 0): after the first round (a probe) plain rounds of one token
    each, with probes after 4, 8, ... of them: the modelled throughput is close to plain
    decoding's 2 tok/s. Sure drafts (survival 1, all accepted: Θ_draft = 3 > 2):
    every round drafts, as without plain rounds."""
    table = SPSTable.from_seconds({1: 1.0, 2: 1.0, 3: 1.0}, plain_seconds=0.5)
    workload = Workload(concurrency=1, requests_per_client=1, max_tokens=200, prompt_tokens=(8,))

    def run(survival, accepted, plain):
        arm = Arm("topk", "topk", gamma=2, sps=table, verify_buckets=(1, 2),
                  plain_rounds=plain)  # fmt: skip
        trace = Trace(np.full(400, accepted), np.full((400, 2), survival, np.float32))
        return simulate(arm, [trace], workload, slots=1, prefill_seconds=_no_prefill)

    hopeless = run(0.0, 0, True)
    kinds = hopeless["round_kinds"]
    # Probes after 1 + 8, 16, 32, 64, 128 plain rounds: 4 within 200 tokens.
    assert kinds["draft"] == 1 and kinds["probe"] == 4 and kinds["plain"] > 180, kinds
    assert hopeless["aggregate_tokens_per_second"] > 0.9 * 2.0
    assert run(0.0, 0, False)["aggregate_tokens_per_second"] < 1.01
    sure = run(1.0, 2, True)  # round 1 waits, plain, for the first round's survivals
    assert sure["round_kinds"] == {"draft": sure["rounds"] - 1, "plain": 1}
    assert sure["aggregate_tokens_per_second"] == pytest.approx(
        run(1.0, 2, False)["aggregate_tokens_per_second"], rel=0.02
    )
    with pytest.raises(ValueError, match="plain_seconds"):
        Arm("topk", "topk", gamma=2, sps=_table({1: 1.0}), verify_buckets=(1,), plain_rounds=True)
