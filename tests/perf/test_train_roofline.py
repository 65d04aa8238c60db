"""The training-step roofline (perf.train_roofline, benchmarks/train_roofline.py): the hand
count against XLA's flops, the collectives' byte model, and the roofline end to end on a
small TPU topology (skipped without libtpu, as in tests/aot/test_aot_tpu.py)."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from dspark_jax import aot
from dspark_jax.config import load_config
from dspark_jax.perf import train_roofline as tr
from dspark_jax.perf.roofline import cost_of
from dspark_jax.perf.train_cost import model_loops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_hand_count_matches_xla_flops_on_an_unrolled_step():
    """A DSpark step on the bundled target's shape (d = 256, V = 8192), T = 640: longer
    than one 512-key block, so the target's XLA attention pads its keys to two blocks and
    the draft layers' attention runs the blocked (checkpointed, 4-pass) path. XLA:CPU's
    flops of the unrolled step agree with the hand count within 10 % (1.5 % when written)."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny", "drafter_tiny.py:dspark"))
    cfg.target.preset = "pycode-small"
    cfg.data.seq_len, cfg.data.batch_size = 640, 2
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    report, compiled = tr.compile_unrolled(cfg, mesh)
    assert model_loops(compiled.as_text()) == []  # every layer and key chunk unrolled
    task = aot.aot_task(cfg)
    shape = tr.step_shape(cfg, task.drafter_config)
    hand = tr.train_flops_hand_count(
        task.frozen_config(), task.drafter_config, shape, target_attention="xla",
        drafter_attention_passes=4.0, trainable_params=report["trainable_params"],
    )  # fmt: skip
    assert cost_of(compiled)["flops"] == pytest.approx(hand["total"], rel=0.10)
    useful = tr.useful_flops(hand, shape, task.frozen_config(), task.drafter_config)
    assert 0.5 * hand["total"] < useful < hand["total"]  # no padded keys, no recompute


def test_causal_pairs():
    assert tr.causal_pairs(4096, "causal") == 4096 * 4097 / 2
    assert tr.causal_pairs(4096, "splash") == 36 * 512 * 512  # 8 blocks: 8·9/2 on/below
    assert tr.causal_pairs(640, "xla") == 640 * 1024  # keys padded to two 512-key blocks
    with pytest.raises(ValueError, match="attention must be"):
        tr.causal_pairs(8, "dense")


HLO = """
  %ag = bf16[64,128]{1,0} all-gather(%p0), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}, metadata={op_name="jit(train_step)/Qwen3.hidden_states/layers_0/mlp"}
  %rs = f32[16,128]{1,0} reduce-scatter(%p1), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
  %ar = f32[8]{0} all-reduce(%p2), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  %one = f32[8]{0} all-reduce(%p3), channel_id=4, replica_groups={{0}}, to_apply=%add
"""  # noqa: E501


def test_collective_bytes_follow_the_ring_model():
    got = tr.collective_bytes(HLO, num_devices=4)
    ag = 64 * 128 * 2 * 3 / 4  # gathered output, (n-1)/n of it received
    rs = 16 * 128 * 4 * 3  # output shard, (n-1) shards sent
    ar = 2 * 8 * 4 * 1 / 2  # group of 2
    assert got["by_kind"] == {"all-gather": ag, "reduce-scatter": rs, "all-reduce": ar}
    assert got["count"] == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}  # n = 1: 0
    assert got["total"] == ag + rs + ar
    assert got["by_scope"]["Qwen3.hidden_states/layers_0/mlp"] == ag


def test_unrolled_scans_leave_no_loop():
    import jax.numpy as jnp

    w = jnp.ones((8, 8))

    def compiled_text():  # a new function each call: no trace cache shared
        def f(x):
            return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0]

        return jax.jit(f).lower(jnp.ones((4, 8))).compile().as_text()

    with tr.unrolled_scans():
        assert model_loops(compiled_text()) == []
    assert len(model_loops(compiled_text())) == 1


def test_cost_table_from_a_case():
    """The chip-hour table scales a case to DeepSpec's recipe: more anchors cost more, the
    cache drops the target's forward, v5e is slower per chip than v5p."""
    from dspark_jax.perf import train_report as rep

    assert rep.cache_bytes_per_token(2560) == 30726
    assert rep.tokens_per_epoch() == pytest.approx(38e12 / 30726)
    case = {
        "chips": 64, "mesh": {"data": 1, "fsdp": 64, "tensor": 1}, "mfu": 0.6,
        "preset": "qwen3-8b", "frozen_params": 8.19e9,
        "shape": {"batch": 64, "seq_len": 4096, "anchors": 32, "gamma": 7, "pack": 1},
        "per_chip": {"flops": 80e12, "bytes": 100e9, "collective_bytes": 40e9,
                     "hand_flops": 78e12},
        "hand_count": {"target_layers": 60e12, "target_attention": 5e12, "total": 78e12},
        "collectives": {"gathers_as_all_reduce": 30e9},
    }  # fmt: skip
    table = rep.cost_table({"8b_v5p64": case})
    rows = {(r["size"], r["chip"]): r for r in table["costs"]}
    assert set(rows) == {(s, c) for s in ("4b", "8b", "14b") for c in ("v5p", "v5e")}
    r = rows[("8b", "v5p")]
    assert r["cache_compute_chip_hours"] < r["online_chip_hours"]
    assert rows[("8b", "v5e")]["online_chip_hours"] > r["online_chip_hours"]
    assert rows[("4b", "v5p")]["cache_tb"] == pytest.approx(38.0)
    assert "8B's efficiency" in rows[("4b", "v5p")]["note"]  # scaled from the 8B case: said so
    # The cache leaves out the target's weight gathers: 2 x (8.19e9 - 2 x 151936 x 4096)
    # parameters' bf16 bytes x 63/64 (gathers written as all-reduces: twice the ring bytes).
    assert rep.target_gather_bytes(case) == pytest.approx(
        2 * (8.19e9 - 2 * 151936 * 4096) * 2 * 63 / 64
    )


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_roofline_runs_end_to_end_on_a_small_tpu_topology(tmp_path):
    """benchmarks/train_roofline.py --case tiny_v5e4: XLA:TPU compiles the unrolled tiny
    step for v5e:2x2, and the roofline, its tables and the results page's section (the
    summarize renderer over the written Markdown) come out."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import train_roofline as bench

    out = tmp_path / "r"
    bench.main(["--case", "tiny_v5e4", "--out", str(out)])
    res = json.loads((tmp_path / "r.json").read_text())
    c = res["cases"]["tiny_v5e4"]
    assert c["chips"] == 4 and c["loops_left"] == 0 and c["libtpu"]
    assert c["per_chip"]["collective_bytes"] > 0  # fsdp: weights gathered, grads reduced
    assert 0.7 < c["flops_vs_hand"] < 1.5  # tiny shapes: elementwise and padding weigh
    assert 0 < c["mfu"] < 1 and c["seconds"]["step"] > 0
    assert c["largest_instructions"] and c["bytes_by_scope"]
    md = (tmp_path / "r.md").read_text()
    assert "| tiny_v5e4 | v5e:2x2 | 1,4,1 |" in md and "MFU" in md
    from render import training

    (tmp_path / "train_roofline.md").write_text(md)
    section = "\n".join(training.train_roofline(tmp_path))
    assert section.startswith("## ") and "| tiny_v5e4 | v5e:2x2 | 1,4,1 |" in section
