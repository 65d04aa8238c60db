"""The roofline cost model (dspark_jax/perf/roofline.py): unrolled layers give the same
logits and let XLA's cost analysis count every layer; its flops match a hand count; the
chip model, floor and byte breakdown do what they say."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.perf import roofline as rl

BENCHMARKS = str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks")


def _compiled_forward(cfg, tokens):
    model = Qwen3(cfg)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    fn = jax.jit(lambda p, t: model.apply({"params": p}, t))
    return fn, params, fn.lower(params, tokens).compile()


def test_unrolled_layers_same_logits_every_layer_counted_flops_match_hand_count():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    base = PRESETS["tiny"]
    fn, params, scanned = _compiled_forward(base, tokens)
    fn_u, _, unrolled = _compiled_forward(base.replace(scan_layers=False), tokens)
    np.testing.assert_allclose(fn(params, tokens), fn_u(params, tokens), rtol=1e-5, atol=1e-5)
    assert rl.while_loops(scanned.as_text()) >= 1 and rl.while_loops(unrolled.as_text()) == 0
    hand = rl.target_forward_flops(base, rows=2 * 16, context_len=16)
    flops = rl.cost_of(unrolled)["flops"]
    # Matmuls are all but a few percent of the flops (norms, RoPE, softmax are the rest).
    assert hand <= flops <= 1.1 * hand, (flops, hand)
    # The scanned program counts one layer's body: far fewer flops.
    assert rl.cost_of(scanned)["flops"] < 0.5 * flops


def test_chip_model_is_the_max_of_compute_and_memory_time():
    v5p = rl.CHIPS["v5p"]
    assert rl.chip_for_topology("v5p:2x2x1") is v5p
    assert v5p.seconds(459e12, 0) == pytest.approx(1.0)
    assert v5p.seconds(0, 2765e9) == pytest.approx(1.0)
    assert v5p.seconds(459e12, 2 * 2765e9) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no chip figures for 'v9x:2x2'"):
        rl.chip_for_topology("v9x:2x2")


def test_floor_counts_each_slot_to_its_length():
    per_device = dict(target_bytes=100, drafter_bytes=10, kv_cache_bytes=400, state_bytes=480)
    full = rl.round_floor_bytes(per_device)
    assert full["bytes"] == 100 + 10 + 400 + 80
    half = rl.round_floor_bytes(per_device, context_fraction=0.5)
    assert half["parts"] == {
        "target_weights": 100,
        "kv_cache": 200,
        "drafter_weights": 10,
        "drafter_context": 40,
    }


def test_bytes_by_op_reads_hlo_output_shapes():
    hlo = """
ENTRY %main (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %fusion.1 = bf16[16,128]{1,0} fusion(%p0), kind=kLoop, metadata={op_name="jit(f)/dot"}
  %copy.2 = f32[4,8]{1,0} copy(%p0)
  ROOT %add.3 = f32[4,8]{1,0} add(%copy.2, %copy.2), metadata={op_name="jit(f)/add"}
}
"""
    out = rl.bytes_by_op(hlo)
    assert out["by_opcode"] == {"fusion": 16 * 128 * 2, "copy": 128, "add": 128}
    assert out["largest"][0] == {"bytes": 4096, "opcode": "fusion", "op_name": "jit(f)/dot"}


def test_bytes_by_scope_matches_xla_and_counts_slices_not_buffers():
    """Per-instruction bytes summed by name scope equal XLA's own total for a step that
    reads 16 rows of a 16 MB buffer and writes them back in place (donated): the buffer
    itself is never counted whole, as XLA's cost analysis does not count it."""
    from dspark_jax.perf.hlo_bytes import bytes_by_scope

    def step(buf, w, x, i):
        with jax.named_scope("read"):
            rows = jax.lax.dynamic_slice_in_dim(buf, i, 16)
        with jax.named_scope("mm"):
            y = jnp.tanh(rows @ w + x)
        with jax.named_scope("write"):
            buf = jax.lax.dynamic_update_slice_in_dim(buf, y, i, 0)
        return buf, y.sum()

    args = (jnp.zeros((4096, 1024)), jnp.ones((1024, 1024)), jnp.ones((16, 1024)), 3)
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    got = bytes_by_scope(compiled.as_text(), depth=2)
    assert got["total"] == pytest.approx(rl.cost_of(compiled)["bytes"], rel=0.02)
    rows_bytes = 16 * 1024 * 4
    assert got["by_scope"]["jit(step)/read"] <= 2 * rows_bytes + 64
    assert got["by_scope"]["jit(step)/write"] <= 2 * rows_bytes + 64
    assert got["by_scope"]["jit(step)/mm"] >= 1024 * 1024 * 4  # the weight, read once


_PREFETCH_HLO = """HloModule m

%fused_mm (param_0: bf16[1024,1024], param_1: bf16[8,1024]) -> bf16[8,1024] {
  %param_1 = bf16[8,1024]{1,0} parameter(1)
  %param_0 = bf16[1024,1024]{1,0} parameter(0)
  ROOT %dot.1 = bf16[8,1024]{1,0} dot(%param_1, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/mm"}
}

%fused_head (param_0.1: bf16[1024,1024], param_1.1: bf16[8,1024]) -> bf16[8,1024] {
  %param_1.1 = bf16[8,1024]{1,0} parameter(1)
  %param_0.1 = bf16[1024,1024]{1,0} parameter(0)
  %bitcast_fusion.1 = bf16[1024,1024]{1,0} fusion(%param_0.1), kind=kLoop, calls=%bitcast_only
  ROOT %dot.2 = bf16[8,1024]{1,0} dot(%param_1.1, %bitcast_fusion.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%bitcast_only (param_0.2: bf16[1024,1024]) -> bf16[1024,1024] {
  %param_0.2 = bf16[1024,1024]{1,0} parameter(0)
  ROOT %bitcast.9 = bf16[1024,1024]{1,0} bitcast(%param_0.2)
}

ENTRY %main (w: bf16[1024,1024], x: bf16[8,1024], table: bf16[4096,1024], ids: s32[8,1], head: bf16[1024,1024]) -> (bf16[8,1024], bf16[8,1024], bf16[8,1024]) {
  %w = bf16[1024,1024]{1,0} parameter(0)
  %x = bf16[8,1024]{1,0} parameter(1)
  %table = bf16[4096,1024]{1,0} parameter(2)
  %ids = s32[8,1]{1,0} parameter(3)
  %head = bf16[1024,1024]{1,0} parameter(4)
  %copy-start = (bf16[1024,1024]{1,0:S(1)}, bf16[1024,1024]{1,0}, u32[]{:S(2)}) copy-start(%w)
  %copy-done = bf16[1024,1024]{1,0:S(1)} copy-done(%copy-start)
  %fusion = bf16[8,1024]{1,0} fusion(%copy-done, %x), kind=kOutput, calls=%fused_mm, metadata={op_name="jit(f)/mm"}
  %gather = bf16[8,1024]{1,0} gather(%table, %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,1024}, metadata={op_name="jit(f)/embed"}
  %fusion.2 = bf16[8,1024]{1,0} fusion(%head, %x), kind=kOutput, calls=%fused_head, metadata={op_name="jit(f)/head"}
  ROOT %tuple = (bf16[8,1024]{1,0}, bf16[8,1024]{1,0}, bf16[8,1024]{1,0}) tuple(%fusion, %gather, %fusion.2)
}
"""


def test_hbm_bytes_count_a_prefetched_weight_once_and_a_gather_by_its_rows():
    """HBM-only accounting (``hbm_only``): a weight that memory-space assignment prefetches
    into VMEM (``S(1)``) is read from HBM once, at the copy; its consumer reads VMEM. A
    gather reads the rows it gathers. A weight read through a nested fusion that only
    bitcasts it is read whole (in both accountings). Every byte here is counted by hand."""
    from dspark_jax.perf.hlo_bytes import bytes_by_scope

    w, act, ids = 1024 * 1024 * 2, 8 * 1024 * 2, 8 * 4
    hbm = bytes_by_scope(_PREFETCH_HLO, depth=2, hbm_only=True)
    assert hbm["by_scope"]["(unnamed)"] == w  # copy-start: the HBM read of the weight
    assert hbm["by_scope"]["jit(f)/mm"] == 2 * act  # x in, y out; the weight is in VMEM
    assert hbm["by_scope"]["jit(f)/embed"] == 2 * act + ids  # 8 rows, not the table
    assert hbm["by_scope"]["jit(f)/head"] == w + 2 * act
    every = bytes_by_scope(_PREFETCH_HLO, depth=2)
    # Every memory space, as XLA counts: the copy's source, both tuple buffers and the
    # flag; copy-done its tuple and its output; the consumer the VMEM copy; the whole table.
    assert every["by_scope"]["(unnamed)"] == (w + 2 * w + 4) + (2 * w + 4 + w)
    assert every["by_scope"]["jit(f)/mm"] == w + 2 * act
    assert every["by_scope"]["jit(f)/embed"] == 4096 * 1024 * 2 + ids + act
    assert every["by_scope"]["jit(f)/head"] == w + 2 * act


def test_xla_excess_over_the_hbm_count_is_split_by_why():
    """XLA's figure minus the HBM count of the prefetch program, by kind, counted by hand:
    the prefetch copy's VMEM side and bookkeeping, the weight read again from VMEM, the
    gather's whole table beyond its rows; the kinds sum to the difference."""
    from dspark_jax.perf.hlo_bytes import bytes_by_scope, xla_excess

    w, table, rows = 1024 * 1024 * 2, 4096 * 1024 * 2, 8 * 1024 * 2
    got = xla_excess(_PREFETCH_HLO)
    # copy-start: its tuple's VMEM buffer, its HBM source again and the 4-byte flag;
    # copy-done: the tuple and its VMEM output.
    assert got["prefetch_copies"] == (2 * w + 4) + (3 * w + 4)
    assert got["prefetched_in_vmem"] == w  # the matmul reads the VMEM copy
    assert got["whole_gathers"] == table - rows
    assert got["activations_in_vmem"] == 0 and got["other"] == 0
    every = bytes_by_scope(_PREFETCH_HLO)["total"]
    assert got["total"] == every - bytes_by_scope(_PREFETCH_HLO, hbm_only=True)["total"]


_ALLREDUCE_HLO = """HloModule m

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

ENTRY %main (x: bf16[8,1,64], y: bf16[8,1,64]) -> (bf16[8,1,64], bf16[8,1,64], bf16[8,1,64], bf16[8,1,64], bf16[4,64]) {
  %x = bf16[8,1,64]{2,0,1} parameter(0)
  %y = bf16[8,1,64]{2,0,1:S(1)} parameter(1)
  %hbm = bf16[8,1,64]{2,0,1} all-reduce(%x), to_apply=%add, metadata={op_name="jit(r)/Qwen3.decode/layer/mlp/down_proj/dot_general"}
  %vmem = bf16[8,1,64]{2,0,1:S(1)} all-reduce(%y), to_apply=%add, metadata={op_name="jit(r)/Qwen3.decode/layer/o_proj/dot_general"}
  %into_vmem = bf16[8,1,64]{2,0,1:S(1)} all-reduce(%x), to_apply=%add, metadata={op_name="jit(r)/Qwen3.decode/layer/o_proj/dot_general"}
  %drafter = bf16[8,1,64]{2,0,1} all-reduce(%x), to_apply=%add, metadata={op_name="jit(r)/DSpark.draft/o_proj/dot_general"}
  %small = bf16[4,64]{1,0} slice(%x), slice={[0:4], [0:1], [0:64]}
  %other = bf16[4,64]{1,0} all-reduce(%small), to_apply=%add, metadata={op_name="jit(r)/Qwen3.decode/layer/x"}
  ROOT %t = (bf16[8,1,64]{2,0,1}, bf16[8,1,64]{2,0,1:S(1)}, bf16[8,1,64]{2,0,1:S(1)}, bf16[8,1,64]{2,0,1}, bf16[4,64]{1,0}) tuple(%hbm, %vmem, %into_vmem, %drafter, %other)
}
"""


def test_xla_excess_counts_vmem_activations():
    """Activations in VMEM (not prefetched): an all-reduce reading and writing VMEM, and
    one writing VMEM from HBM, 1 KiB each array."""
    from dspark_jax.perf.hlo_bytes import xla_excess

    got = xla_excess(_ALLREDUCE_HLO)
    assert got["activations_in_vmem"] == 2 * 1024 + 1024
    assert got["total"] == 3 * 1024 and got["prefetched_in_vmem"] == 0


def test_hidden_all_reduces_count_only_the_targets_held_in_hbm():
    """``hbm_all_reduces`` counts an all-reduce of rows × d elements under the scope whose
    input and output both lie in HBM; not one kept in VMEM (input or output), not another
    scope's (the drafter's), not another size. Each such all-reduce costs 4 passes."""
    from dspark_jax.perf.hlo_bytes import hbm_all_reduces

    assert hbm_all_reduces(_ALLREDUCE_HLO, 8 * 64, "Qwen3.decode/") == 1
    assert hbm_all_reduces(_ALLREDUCE_HLO, 8 * 64, "DSpark.draft/") == 1
    assert hbm_all_reduces(_ALLREDUCE_HLO, 4 * 64, "Qwen3.decode/") == 1
    assert hbm_all_reduces(_ALLREDUCE_HLO, 16 * 64, "Qwen3.decode/") == 0
    # Matmul writes, all-reduce reads and writes, norm reads: 4 passes of [rows, d] bf16.
    assert rl.allreduce_activation_bytes(3, rows=8, width=64) == 3 * 4 * 8 * 64 * 2
    assert rl.allreduce_activation_bytes(0, rows=8, width=64) == 0


_LOOP_HLO = """HloModule m

%fused_read (param_0: bf16[256,4096], param_1: bf16[8,256]) -> bf16[8,4096] {
  %param_0 = bf16[256,4096]{1,0} parameter(0)
  %param_1 = bf16[8,256]{1,0} parameter(1)
  ROOT %dot = bf16[8,4096]{1,0} dot(%param_1, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/step/markov"}
}

%body (p: (s32[], bf16[256,4096], bf16[8,256], bf16[8,4096])) -> (s32[], bf16[256,4096], bf16[8,256], bf16[8,4096]) {
  %p = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[256,4096]{1,0} get-tuple-element(%p), index=1
  %h = bf16[8,256]{1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one), metadata={op_name="jit(f)/step/count"}
  %y = bf16[8,4096]{1,0} fusion(%w, %h), kind=kOutput, calls=%fused_read, metadata={op_name="jit(f)/step/markov"}
  ROOT %t = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) tuple(%next, %w, %h, %y)
}

%cond (q: (s32[], bf16[256,4096], bf16[8,256], bf16[8,4096])) -> pred[] {
  %q = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%j, %n), direction=LT, metadata={op_name="jit(f)/step/cond"}
}

ENTRY %main (w: bf16[256,4096], h: bf16[8,256], y: bf16[8,4096], start: s32[]) -> bf16[8,4096] {
  %w = bf16[256,4096]{1,0} parameter(0)
  %h = bf16[8,256]{1,0} parameter(1)
  %y = bf16[8,4096]{1,0} parameter(2)
  %start = s32[] parameter(3)
  %zero = s32[] constant(0)
  %zero.copy = s32[] copy(%zero)
  %init = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) tuple(%zero.copy, %w, %h, %y)
  %from = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) tuple(%start, %w, %h, %y)
  %recorded = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %inferred = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) while(%init), condition=%cond, body=%body
  %unknown = (s32[], bf16[256,4096]{1,0}, bf16[8,256]{1,0}, bf16[8,4096]{1,0}) while(%from), condition=%cond, body=%body
  ROOT %out = bf16[8,4096]{1,0} get-tuple-element(%recorded), index=3
}
"""


def test_a_loop_with_a_static_trip_count_is_counted_trips_times_its_body():
    """A while loop whose trip count XLA recorded (7, as the drafter's γ-step sampling
    loop) counts its body 7 times and its condition 8; so does the same loop without the
    record (XLA:TPU records none), its count read from a counter that starts from a
    constant, steps by 1 and is compared with a constant; started from a runtime value
    the count is unknown, and body and condition count once. Every byte is counted by
    hand."""
    from dspark_jax.perf.hlo_bytes import bytes_by_scope, loop_trips

    read = 256 * 4096 * 2 + 8 * 256 * 2 + 8 * 4096 * 2  # the factor, h in, y out
    count = 3 * 4  # i and 1 in, next out (s32)
    cond = 4 + 4 + 1  # j and 7 in, the predicate out
    got = bytes_by_scope(_LOOP_HLO, depth=3)["by_scope"]
    assert got["jit(f)/step/markov"] == (7 + 7 + 1) * read
    assert got["jit(f)/step/count"] == (7 + 7 + 1) * count
    assert got["jit(f)/step/cond"] == (8 + 8 + 1) * cond
    assert got == bytes_by_scope(_LOOP_HLO, depth=3, hbm_only=True)["by_scope"]
    assert sorted(loop_trips(_LOOP_HLO), key=str) == [
        ("inferred", 7),
        ("recorded", 7),
        ("unknown", None),
    ]


def test_a_scan_of_static_length_is_counted_trips_times_on_cpu():
    """On a compiled program: a 7-step ``fori_loop`` reading one row of a weight per step
    counts that read 7 times (XLA's own figure counts it once)."""
    from dspark_jax.perf.hlo_bytes import bytes_by_scope, loop_trips

    def f(w, x):
        def body(i, c):
            with jax.named_scope("step"):
                return jnp.tanh(c @ w + jax.lax.dynamic_index_in_dim(w, i, keepdims=False))

        return jax.lax.fori_loop(0, 7, body, x)

    compiled = jax.jit(f).lower(jnp.ones((256, 256)), jnp.ones((8, 256))).compile()
    hlo = compiled.as_text()
    assert [t for _, t in loop_trips(hlo)] == [7]
    steps = sum(v for k, v in bytes_by_scope(hlo, depth=6, top=50)["by_scope"].items()
                if "/step" in k)  # fmt: skip
    assert steps >= 7 * 256 * 256 * 4  # the weight, read every step
    assert bytes_by_scope(hlo)["total"] > 3 * rl.cost_of(compiled)["bytes"]


@pytest.mark.slow  # 26 s
def test_verify_cost_benchmark_runs_with_chosen_budgets(tmp_path):
    """benchmarks/verify_cost.py end to end on a tiny model with the options an
    accelerator run uses (chosen budgets, a dtype, the attention backend, no feature-draft
    comparison): its round times, anatomy and SPS table are written."""
    import json
    import sys

    sys.path.insert(0, BENCHMARKS)
    import verify_cost

    out = str(tmp_path / "vc.json")
    res = verify_cost.main([
        "--preset", "tiny", "--slots", "2", "--gamma", "3", "--max-len", "64",
        "--budgets", "0,3", "--dtype", "float32", "--attention", "xla",
        "--no-feature-draft", "--repeats", "1", "--out", out,
    ])  # fmt: skip
    assert set(res["round_seconds_by_B"]) == {"2", "5", "8"}  # B = R + K for K = 0, 3, R·γ
    assert res["attention"] == "xla" and res["draft_seconds"]["features_reprojected"] is None
    assert json.load(open(out))["sps_table"] and open(out[:-5] + ".md").read()


def test_verify_cost_times_rounds_at_each_context_beside_the_modelled_chip(tmp_path):
    """The accelerator run's options: rounds timed with every slot at each context length,
    the chip's floor-modelled round beside them, no anatomy (one decode state at a time)."""
    import json
    import sys

    sys.path.insert(0, BENCHMARKS)
    import verify_cost

    out = str(tmp_path / "vc.json")
    res = verify_cost.main([
        "--preset", "tiny", "--slots", "2", "--gamma", "3", "--max-len", "64",
        "--budgets", "0", "--dtype", "float32", "--attention", "xla", "--contexts", "60,1",
        "--modelled-chip", "H200", "--no-anatomy", "--no-feature-draft", "--repeats", "1",
        "--out", out,
    ])  # fmt: skip
    assert list(res["by_context"]) == ["60", "1"] and "anatomy_seconds" not in res
    long, short = res["by_context"]["60"], res["by_context"]["1"]
    for entry in (long, short):
        assert set(entry["modelled_seconds_by_B"]) == {"2", "8"}
        assert entry["measured_over_modelled_by_B"]["2"] > 0
    # The floor reads each slot's KV up to its length: a longer context costs more.
    assert long["modelled_seconds_by_B"]["2"] > short["modelled_seconds_by_B"]["2"]
    assert json.load(open(out))["by_context"] == res["by_context"]
    assert "H200 modelled" in open(out[:-5] + ".md").read()
    with pytest.raises(SystemExit, match="--modelled-chip"):
        verify_cost.main(["--preset", "tiny", "--modelled-chip", "A100", "--out", out])
    with pytest.raises(ValueError, match=r"context_len must be in \[1, max_len - γ - 1 = 60\]"):
        verify_cost.main([
            "--preset", "tiny", "--slots", "2", "--gamma", "3", "--max-len", "64",
            "--budgets", "0", "--contexts", "61", "--no-anatomy", "--out", out,
        ])  # fmt: skip


@pytest.mark.slow  # 14 s
def test_gpu_attention_check_passes_the_kernel_interpreted(tmp_path):
    """benchmarks/gpu_attention_check.py (the device run's gate before it picks pallas_gpu)
    on tiny shapes: both backends match the dense reference within tolerance."""
    import sys

    sys.path.insert(0, BENCHMARKS)
    import gpu_attention_check

    res = gpu_attention_check.main(["--quick", "--out", str(tmp_path / "g.json")])
    assert res["pallas_gpu_ok"] and res["reference"] == "ref_ragged_paged_attention"
    for dtype, errs in res["errors"].items():
        assert all(e <= res["tolerance"][dtype] for e in errs.values()), errs
    assert set(res["verify_ms"]["16"]) >= {"xla", "pallas_gpu"}
