"""Ahead-of-time compilation with the real TPU compiler (XLA:TPU from libtpu) for a named
topology this CPU host does not have: a tiny drafter training step and a tiny serving
round compile for ``v5e:2x2`` and report XLA:TPU's memory plan. Skipped, with the reason,
where libtpu is not installed (``pip install -e '.[tpu]'``); CI installs it.
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax
import pytest

from dspark_jax import aot
from dspark_jax.config import load_config

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason="libtpu is not installed (pip install -e '.[tpu]')"
)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_DRAFTER = os.path.join(REPO, "configs", "tiny", "drafter_tiny.py") + ":dspark"


def test_missing_libtpu_is_named(monkeypatch):
    monkeypatch.setattr(aot.topology, "libtpu_version", lambda: None)
    with pytest.raises(ValueError, match=r"needs libtpu.*pip install -e '\.\[tpu\]'"):
        aot.topology_devices("v5e:2x2")


@needs_libtpu
def test_bad_topology_names_are_user_errors():
    with pytest.raises(ValueError, match="expected CHIP:SHAPE such as v5e:2x2"):
        aot.topology_devices("v5e")
    with pytest.raises(ValueError, match="not a TPU topology libtpu knows"):
        aot.topology_devices("v9x:2x2")


@pytest.fixture(scope="module")
def v5e_mesh():
    return aot.aot_mesh("1,4,1", topology="v5e:2x2")


@needs_libtpu
def test_tiny_training_step_compiles_with_xla_tpu(v5e_mesh):
    assert [d.platform for d in v5e_mesh.devices.flat] == ["tpu"] * 4
    cfg = load_config(TINY_DRAFTER)
    cfg.target.preset = "tiny"  # no target directory: the shape comes from the preset
    report, _ = aot.compile_train_step(cfg, v5e_mesh, device_memory_gb=16)
    assert report["compiler"] == "XLA:TPU" and report["libtpu"] == aot.libtpu_version()
    assert "v5" in report["device_kind"].lower()
    mem, pd = report["memory"], report["per_device"]
    # The donated state is aliased (updated in place). XLA:TPU lays small arrays out in
    # padded tiles, so its byte counts are at least the logical shard sizes, not equal.
    state = pd["params_bytes"] + pd["opt_state_bytes"]
    assert mem["alias_bytes"] >= state and mem["argument_bytes"] >= mem["alias_bytes"]
    assert mem["temp_bytes"] > 0
    assert report["fits"] is True


@needs_libtpu
def test_tiny_serving_round_compiles_with_xla_tpu(v5e_mesh):
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset

    tgt = get_preset("tiny")
    dc = DrafterConfig(kind="dspark", gamma=4, num_layers=1, markov_rank=16, mask_token_id=1)
    report, compiled = aot.compile_serve_round(tgt, dc.resolve(tgt), v5e_mesh, slots=4, max_len=64)
    assert report["compiler"] == "XLA:TPU" and report["kind"] == "serve_round"
    # The state is laid out by the decoder's own state_shardings (one layout, not a copy).
    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.models.drafters import make_drafter
    from dspark_jax.models.qwen3 import Qwen3

    dec = SpeculativeDecoder(
        Qwen3(tgt), None, make_drafter(dc.resolve(tgt), tgt), None,
        StepConfig(num_slots=4, max_len=64),
    )  # fmt: skip
    specs = jax.tree.map(lambda s: s.spec, dec.state_shardings(v5e_mesh))
    assert jax.tree.map(lambda s: s.spec, compiled.input_shardings[0][1]) == specs
    assert report["budget"] == 4 * 4 and report["memory"]["peak_bytes"] > 0
    text = aot.format_report(report)
    assert "by XLA:TPU" in text


@needs_libtpu
@pytest.mark.slow  # 22 s
def test_roofline_benchmark_writes_its_tables(tmp_path):
    """benchmarks/roofline.py on tiny models (two buckets): XLA:TPU flops near the hand
    count, bytes above the floor, a modelled SPS table in the --sps-cache format."""
    import json
    import sys

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import roofline

    from dspark_jax.sched.sps import SPSTable

    out = str(tmp_path / "rl")
    assert roofline.main(["--quick", "--budgets", "0,16", "--out", out]) == 0
    res = json.load(open(out + ".json"))
    assert res["compiler"]["compiler"] == "XLA:TPU" and [r["B"] for r in res["rows"]] == [4, 20]
    for r in res["rows"]:
        assert r["bytes_over_floor"] >= 1 and r["modelled_ms"] > 0
        assert 0.8 < r["flops_ratio"] < 2.0  # tiny shapes: elementwise work weighs more
        assert r["top_bytes"]["largest"] and r["bound"] in ("memory", "compute")
        # XLA:TPU's bytes re-derived by name scope: near its own total (at these tiny shapes
        # tile padding dominates; at the 8B shapes the two agree within 5 %), layers named.
        scopes = r["bytes_by_scope"]
        assert scopes["total"] == pytest.approx(r["xla_bytes"], rel=0.4)
        # HBM-only traffic: what XLA moves to and from HBM, kernel included, is counted.
        assert r["kernel_bytes_modelled"] < r["hbm_bytes"] and r["hbm_over_floor"] > 0
        assert any("Qwen3.decode" in s for s in scopes["by_scope"])
    (table,) = json.load(open(out + "_sps.json")).values()
    assert list(SPSTable.from_json(table).buckets) == [4, 20]
    text = open(out + ".md").read()
    assert "| B = R + K |" in text and "XLA's bytes by name scope" in text
    assert "| B = R + K | HBM bytes GB |" in text
    # The drafter's γ-step sampling loop is kept; its trip count (which XLA:TPU does not
    # record) is read from its counter, and its body counted that many times. The XLA
    # attention's loops over a slot's pages have a runtime bound: unknown, counted once.
    assert "loops (trips)" in text and "static trip count times" in text
    for r in res["rows"]:
        assert res["drafter"]["gamma"] in r["loop_trips"] and None in r["loop_trips"]
        assert r["hbm_loop_extra_bytes"] > 0
        # XLA's excess over the HBM count, split by why, sums to the two counts' gap.
        ex, once = r["xla_excess"], r["bytes_by_scope"]["total"]
        assert ex["total"] == sum(v for k, v in ex.items() if k != "total") > 0
        assert ex["total"] <= once
    assert "Why XLA's bytes exceed the HBM count" in text
    grown = res["rows"][1]["hbm_bytes"] - res["rows"][0]["hbm_bytes"]  # over 16 added rows
    assert f"{grown / 16 / 1e6:.2f} MB per added row" in text


@needs_libtpu
def test_mesh_whose_axes_split_a_torus_axis():
    # data 8 x fsdp 2 over v5e:4x4: 8 is no product of the physical axes (4, 4), so the
    # logical axis must span part of one (what the 8B "data8xfsdp8" row on v5p:4x4x4 needs).
    mesh = aot.aot_mesh("8,2,1", topology="v5e:4x4")
    assert dict(mesh.shape) == {"data": 8, "fsdp": 2, "tensor": 1}
    assert len({d.id for d in mesh.devices.flat}) == 16


# kind -> (drafter config, kernel calls of its draft over the paged context)
_KERNEL_DRAFTERS = {
    "dspark": (dict(kind="dspark", gamma=3, num_layers=1, markov_rank=16, mask_token_id=1), 1),
    # the first query reads the pages (the slot's last state), then chain steps 1 and 2
    "eagle3": (dict(kind="eagle3", gamma=3, num_layers=1), 3),
    "mtp1": (dict(kind="mtp1", gamma=1, num_layers=1), 1),
}


@needs_libtpu
@pytest.mark.parametrize("kind", list(_KERNEL_DRAFTERS))
def test_tpu_kernel_lowers_inside_the_serving_round(kind):
    """XLA:TPU compiles the decode round with the Pallas ragged-paged-attention kernel
    (in the layer scan, split over the tensor axis) for a model with head_dim 128, and the
    drafter's attention over its paged context on the same kernel: DSpark's block per draft
    layer, EAGLE-3's and MTP-1's one query per draft step (none re-runs its layer over the
    whole context)."""
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset

    mesh = aot.aot_mesh("1,1,4", topology="v5e:2x2")
    tgt = get_preset("tiny").replace(
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128
    )
    fields, draft_calls = _KERNEL_DRAFTERS[kind]
    dc = DrafterConfig(**fields)
    report, compiled = aot.compile_serve_round(tgt, dc.resolve(tgt), mesh, slots=4, max_len=64)
    assert report["attention"] == "pallas_tpu" and report["compiler"] == "XLA:TPU"
    hlo = compiled.as_text()
    assert 'custom_call_target="tpu_custom_call"' in hlo  # in the layer scan's body
    assert "ragged_paged_attention" in hlo
    from dspark_jax.perf.roofline import ragged_attention_calls

    # One call in the target's layer-scan body (verify), and the drafter's.
    assert ragged_attention_calls(hlo) == 1 + draft_calls


@needs_libtpu
def test_serving_round_reads_every_weight_in_its_stored_layout():
    """XLA:TPU multiplies every weight where it lies: no copy of a parameter into another
    layout in the round (the unrolled program the roofline measures), at a small and a
    large batch. q/k/v kernels stored [d, heads, head_dim] were re-laid out on every call
    (XLA computes them one matmul per head, wanting each head's block contiguous), and
    [heads, d, head_dim] at large batches (copied to contraction-minor); stored
    [heads, head_dim, d] (Projection.out_first) they are not."""
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf.hlo_bytes import parameter_relayouts

    mesh = aot.aot_mesh("1,1,4", topology="v5e:2x2")
    # d = 512: with the tiny preset's d = 64 the old layouts were not copied either.
    tgt = get_preset("tiny").replace(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, scan_layers=False,
    )  # fmt: skip
    for slots in (4, 64):
        _, compiled = aot.compile_serve_round(
            tgt, None, mesh, slots=slots, max_len=64, scheduler="none"
        )
        assert parameter_relayouts(compiled.as_text()) == {}, slots


@needs_libtpu
def test_splash_attention_lowers_in_the_training_step():
    """XLA:TPU compiles the target's loss and gradients with splash attention (auto on a
    TPU topology; batch over fsdp, heads over tensor) and no [T, T] array."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax import sharding as shd
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.ops.flash_attention import compile_platform

    mesh = aot.aot_mesh("1,2,2", topology="v5e:2x2")
    t = 384  # a multiple of 128, and no other dimension of the program (vocab 256)
    cfg = get_preset("tiny").replace(num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = Qwen3(cfg)
    with jax.set_mesh(mesh), shd.rules_context(mesh), compile_platform("tpu"):
        boxed = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        )
        params, _ = aot.abstract_tree(boxed, mesh)
        tokens = jax.ShapeDtypeStruct((4, t), jnp.int32, sharding=NamedSharding(
            mesh, PartitionSpec(("data", "fsdp"), None)))  # fmt: skip

        def loss(p, x):
            return jnp.mean(model.apply({"params": p}, x))

        hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    assert "splash" in hlo
    assert f"{t},{t}]" not in hlo


@needs_libtpu
def test_tensor_parallel_round_all_reduces_each_row_twice_per_layer():
    """Under a tensor split the compiled round all-reduces every row's full hidden state
    after o_proj and after down_proj, two per layer, plus one for the vocabulary-split
    embedding (what ``perf.hlo_bytes.hbm_all_reduces`` counts when they lie in HBM, as in
    the 8B round on v5p). At these small widths XLA:TPU keeps them in VMEM: none counted."""
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf import hlo_bytes as hb

    mesh = aot.aot_mesh("1,1,4", topology="v5e:2x2")
    layers, d = 2, 512
    tgt = get_preset("tiny").replace(
        hidden_size=d, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, scan_layers=False,
    )  # fmt: skip
    _, compiled = aot.compile_serve_round(tgt, None, mesh, slots=64, max_len=64, scheduler="none")
    text = compiled.as_text()
    rows = {int(m) for m in re.findall(rf"bf16\[(\d+),1,{d}\][^ ]* all-reduce\(", text)}
    assert len(rows) == 1  # one row count: the round's verify rows
    (n,) = rows
    assert len(re.findall(rf"bf16\[{n},1,{d}\][^ ]* all-reduce\(", text)) == 2 * layers + 1
    assert hb.hbm_all_reduces(text, n * d, "Qwen3.decode/") == 0
