"""Tables of the training-step roofline (``benchmarks/train_roofline.py``): the per-case
roofline, and what DeepSpec's DSpark recipe costs in chip-hours, online or from a cache.

The recipe (``RECIPE``) is DeepSpec's ``config/dspark/dspark_qwen3_4b_online.py``
(deepseek-ai/DeepSpec): sequences up to 4096 tokens, 512 anchors, γ = 7 (``block_size``),
5 draft layers, taps [1, 9, 17, 25, 33], 512 sequences per step, 10 epochs. Its 8B and 14B
DSpark configs are taken to differ only in the target (as its ``config/dflash`` configs
for the three sizes do). Tokens per epoch come from its README's cache size: "roughly
38 TB" for Qwen3-4B, at the bytes per token its ``scripts/data/estimate_target_cache_size.py``
writes (int32 id, attention and loss mask bytes, 5 tap states and the last hidden state in
bf16: ``6 + 2·(5+1)·d``), i.e. 38e12 / 30,726 = 1.24e9 tokens; the same answers' length is
assumed for 8B and 14B (each target regenerates them). We model them as packed rows of
4096 tokens with 512 anchors per row (DeepSpec samples 512 anchors per sample; its samples
average under 4096 tokens, so it supervises at least as many blocks per token: this is a
lower bound on its drafter work).
"""

from __future__ import annotations

from typing import Any

from dspark_jax.perf.roofline import CHIPS
from dspark_jax.perf.train_roofline import ICI_GB_PER_S

RECIPE = {
    "source": "deepseek-ai/DeepSpec config/dspark/dspark_qwen3_4b_online.py, README.md, "
    "scripts/data/estimate_target_cache_size.py",
    "seq_len": 4096,
    "anchors": 512,
    "gamma": 7,
    "draft_layers": 5,
    "taps": 5,
    "global_batch": 512,
    "epochs": 10,
    "cache_tb_4b": 38.0,
}
HIDDEN = {"4b": 2560, "8b": 4096, "14b": 5120}
PRESET = {"4b": "qwen3-4b", "8b": "qwen3-8b", "14b": "qwen3-14b"}
CHIPS_PER_HOST = 4
CACHE_GB_PER_S_PER_HOST = 2.0  # a stated assumption: sustained reads per host


def cache_bytes_per_token(hidden: int, taps: int = 5) -> int:
    """DeepSpec's target-cache bytes per token (its sizing script's per-sample tensors)."""
    return 4 + 1 + 1 + 2 * (taps + 1) * hidden


def tokens_per_epoch() -> float:
    return RECIPE["cache_tb_4b"] * 1e12 / cache_bytes_per_token(HIDDEN["4b"])


def case_line(res: dict[str, Any]) -> str:
    pc, s = res["per_chip"], res["seconds"]
    return (
        f"{res['case']}: {pc['flops'] / 1e12:.2f} TFLOP/chip (x{res['flops_vs_hand']:.3f} hand), "
        f"{pc['bytes'] / 1e9:.1f} GB, coll {pc['collective_bytes'] / 1e9:.2f} GB; "
        f"step {s['step'] * 1e3:.1f} ms (flops {s['flops'] * 1e3:.1f}, bytes "
        f"{s['bytes'] * 1e3:.1f}, ici {s['collectives'] * 1e3:.1f}); MFU {res['mfu']:.3f}"
    )


def _rerated(case: dict[str, Any], chip_name: str, extra_flops: float = 0.0,
             drop: tuple[str, ...] = ()) -> dict[str, float]:  # fmt: skip
    """A compiled case's per-chip flops, bytes and collective bytes timed on ``chip_name``'s
    peak, HBM and ICI figures, plus ``extra_flops`` of work at the case's flops/bytes mix,
    less the hand-count parts ``drop`` (and the collectives of their scopes)."""
    chip = CHIPS[chip_name]
    pc = case["per_chip"]
    flops, bytes_ = pc["flops"], pc["bytes"]
    coll = pc["collective_bytes"]
    removed = sum(case["hand_count"].get(k, 0.0) for k in drop)
    if removed:
        share = removed / pc["hand_flops"]
        flops, bytes_ = flops * (1 - share), bytes_ * (1 - share)
        coll = max(0.0, coll - target_gather_bytes(case))
    scale = 1 + extra_flops / flops if flops else 1.0
    flops, bytes_ = flops * scale, bytes_ * scale
    t = max(flops / (chip.bf16_tflops * 1e12), bytes_ / (chip.hbm_gb_per_s * 1e9))
    return {"seconds": t + coll / (ICI_GB_PER_S[chip_name] * 1e9), "flops": flops}


def target_gather_bytes(case: dict[str, Any]) -> float:
    """ICI bytes per chip of gathering the frozen target's layer weights once (all but the
    vocabulary matrices: the LM head runs vocabulary-parallel, the embedding is a lookup),
    over the case's fsdp ways; twice that where XLA wrote its gathers as all-reduces."""
    from dspark_jax.models.presets import get_preset

    c = get_preset(case["preset"])
    vocab = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    n = int(case["mesh"].get("fsdp", 1))
    ring = 2.0 if case["collectives"].get("gathers_as_all_reduce", 0.0) > 0 else 1.0
    return (case["frozen_params"] - vocab) * 2.0 * ring * (n - 1) / max(n, 1)


def reference_case(cases: dict[str, Any], size: str) -> tuple[str | None, dict | None]:
    """The compiled 64-chip v5p case of ``size`` to scale: one at the recipe's anchors if
    there is one, else the one with the highest modelled MFU."""
    own = {k: c for k, c in cases.items() if k.startswith(f"{size}_v5p64")}
    if not own:
        return None, None
    at_recipe = {k: c for k, c in own.items() if c["shape"]["anchors"] == RECIPE["anchors"]}
    pool = at_recipe or own
    key = max(pool, key=lambda k: pool[k]["mfu"])
    return key, pool[key]


def cost_table(cases: dict[str, Any]) -> dict[str, Any]:
    """Chip-hours of the recipe per target size and chip, online and from a cache."""
    from dspark_jax.perf.train_roofline import StepShape, train_flops_hand_count

    tokens = tokens_per_epoch()
    rows_total = tokens * RECIPE["epochs"] / RECIPE["seq_len"]
    steps = rows_total / RECIPE["global_batch"]
    table = []
    for size in ("4b", "8b", "14b"):
        key, ref = reference_case(cases, size)
        note = f"from `{key}`"
        if ref is None:
            key, ref = reference_case(cases, "8b")
            note = f"8B's efficiency (`{key}`) at this size's hand count"
            if ref is None:
                continue
            ref = _scaled_case(ref, size)
        target, drafter = _configs(size)
        rows_chip = ref["shape"]["batch"] / ref["chips"]  # rows per chip per step
        # The recipe's 512 anchors instead of the case's: the extra hand-count flops.
        base = StepShape(1, RECIPE["seq_len"], ref["shape"]["anchors"], RECIPE["gamma"])
        recipe = StepShape(1, RECIPE["seq_len"], RECIPE["anchors"], RECIPE["gamma"])
        h0 = train_flops_hand_count(target, drafter, base, target_attention="splash")
        h1 = train_flops_hand_count(target, drafter, recipe, target_attention="splash")
        extra = (h1["total"] - h0["total"]) * rows_chip
        row_bytes = cache_bytes_per_token(HIDDEN[size]) * RECIPE["seq_len"]
        for chip in ("v5p", "v5e"):
            src, src_note, src_extra = ref, note, extra
            if chip != "v5p":
                own_key, own = _chip_case(cases, size, chip)
                if own is not None:  # compiled for this chip at the recipe's anchors
                    src, src_note, src_extra = own, f"from `{own_key}`", 0.0
                else:
                    src_note = note + " (re-rated)"
            rows_chip = src["shape"]["batch"] / src["chips"]
            online = _rerated(src, chip, src_extra)
            cached = _rerated(src, chip, src_extra, drop=("target_layers", "target_attention"))
            per_row_online = online["seconds"] / rows_chip  # chip-seconds per row
            compute_cached = cached["seconds"] / rows_chip
            io = row_bytes / (CACHE_GB_PER_S_PER_HOST * 1e9 / CHIPS_PER_HOST)
            per_row_cached = max(compute_cached, io)
            table.append({
                "size": size, "chip": chip, "note": src_note,
                "online_hours_on_64_chips": per_row_online * rows_total / 3600 / 64,
                "online_chip_hours": per_row_online * rows_total / 3600,
                "cache_chip_hours": per_row_cached * rows_total / 3600,
                "cache_compute_chip_hours": compute_cached * rows_total / 3600,
                "cache_io_bound": io > compute_cached,
                "cache_tb": tokens * cache_bytes_per_token(HIDDEN[size]) / 1e12,
                "break_even_gb_per_s_per_host": row_bytes / compute_cached * CHIPS_PER_HOST / 1e9,
                "step_ms_on_64_chips": per_row_online * RECIPE["global_batch"] / 64 * 1e3,
            })  # fmt: skip
    return {
        "recipe": dict(RECIPE, tokens_per_epoch=tokens, rows=rows_total, steps=steps,
                       chips_per_host=CHIPS_PER_HOST,
                       cache_gb_per_s_per_host=CACHE_GB_PER_S_PER_HOST),
        "costs": table,
    }  # fmt: skip


def _chip_case(cases: dict[str, Any], size: str, chip: str):
    """A compiled 64-chip case of ``size`` on ``chip`` at the recipe's anchors, if any."""
    own = {k: c for k, c in cases.items() if k.startswith(f"{size}_{chip}64")
           and c["shape"]["anchors"] == RECIPE["anchors"]}  # fmt: skip
    if not own:
        return None, None
    key = max(own, key=lambda k: own[k]["mfu"])
    return key, own[key]


def _scaled_case(ref: dict[str, Any], size: str) -> dict[str, Any]:
    """The 8B case's per-chip figures scaled by the hand counts' ratio (flops and bytes),
    its collectives by the frozen targets' parameter ratio: another size at the 8B step's
    efficiency, its target preset swapped in."""
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf.train_roofline import StepShape, train_flops_hand_count

    (t8, d8), (tn, dn) = _configs("8b"), _configs(size)
    sh = ref["shape"]
    shape = StepShape(sh["batch"], sh["seq_len"], sh["anchors"], sh["gamma"], sh["pack"])
    h8 = train_flops_hand_count(t8, d8, shape, target_attention="splash")
    hn = train_flops_hand_count(tn, dn, shape, target_attention="splash")
    r = hn["total"] / h8["total"]
    p8 = _params(get_preset("qwen3-8b"))
    pr = _params(get_preset(PRESET[size])) / p8
    pc = dict(ref["per_chip"])
    for k in ("flops", "bytes", "hand_flops"):
        pc[k] = pc[k] * r
    pc["collective_bytes"] = pc["collective_bytes"] * pr
    hand = {k: v * hn[k] / h8[k] if h8[k] else v for k, v in ref["hand_count"].items()}
    return dict(ref, per_chip=pc, hand_count=hand, preset=PRESET[size],
                frozen_params=ref["frozen_params"] * pr)  # fmt: skip


def _params(c) -> float:
    """Parameters of a Qwen3 config (layers and vocabulary matrices)."""
    d, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    layer = d * (2 * q + 2 * kv) + 3 * d * f
    return c.num_hidden_layers * layer + c.vocab_size * d * (1 if c.tie_word_embeddings else 2)


def _configs(size: str):
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset

    target = get_preset(PRESET[size])
    dc = DrafterConfig(kind="dspark", gamma=RECIPE["gamma"], num_layers=RECIPE["draft_layers"],
                       markov_rank=256, mask_token_id=0, taps=(1, 9, 17, 25, 33))  # fmt: skip
    return target, dc.resolve(target)


def _scaling_check(cases: dict[str, Any]) -> str:
    """The 8B v5p row from the 32-anchor case scaled by the hand count beside the one from
    the compiled 512-anchor case, when both are present."""
    small = {
        k: c
        for k, c in cases.items()
        if k.startswith("8b_v5p64") and c["shape"]["anchors"] != RECIPE["anchors"]
    }
    big = {k: c for k, c in cases.items()
           if k.startswith("8b_v5p64") and c["shape"]["anchors"] == RECIPE["anchors"]}  # fmt: skip
    if not small or not big:
        return ""

    def row(sub):
        return next(r for r in cost_table(sub)["costs"] if r["size"] == "8b" and r["chip"] == "v5p")

    ks = max(small, key=lambda k: small[k]["mfu"])
    kb = max(big, key=lambda k: big[k]["mfu"])
    a, b = row({ks: small[ks]}), row({kb: big[kb]})
    return (
        f"Check of the anchor scaling: `{ks}` ({small[ks]['shape']['anchors']} anchors) scaled "
        f"to 512 by the hand count gives {a['online_chip_hours']:,.0f} online chip-hours for "
        f"Qwen3-8B on v5p; the compiled 512-anchor `{kb}` gives {b['online_chip_hours']:,.0f}."
    )


def _goals(cases: dict[str, Any]) -> list[str]:
    c = cases.get("8b_v5p64")
    if c is None:
        return []
    hbm = c["per_chip"]["hbm_bytes_estimate"]
    big = c["largest_instructions"][0]
    coll = c["collectives"]
    top_coll = coll["largest"][0]["bytes"] if coll["largest"] else 0.0
    out = [
        "",
        "## Goals (issue 48)",
        "",
        f"- Modelled MFU of the 8B DSpark step, T = 4096, v5p-64 (4x4x4) at fsdp 64: "
        f"**{c['mfu'] * 100:.1f} %** (goal ≥ 50 %), collectives charged as compiled and not "
        f"overlapped; {c['mfu_gathers_as_all_gather'] * 100:.1f} % with the gathers charged as "
        "all-gathers.",
        f"- Largest single instruction: {big['bytes'] / 1e9:.2f} GB, "
        f"{big['bytes'] / hbm * 100:.2f} % of the step's {hbm / 1e9:.1f} GB of HBM traffic "
        f"(`{big['op_name'][:90]}`); largest single collective {top_coll / 1e9:.2f} GB, "
        f"{top_coll / coll['total'] * 100:.1f} % of the ICI bytes (goal: none over 15 %).",
    ]
    d2 = cases.get("8b_v5p64_d2")
    if d2 is not None:
        out += [
            "",
            "## The next-largest waste: 64-way weight gathers written as all-reduces",
            "",
            "After the matmuls (compute-bound: XLA's flops are "
            f"{c['flops_vs_hand']:.3f}× the hand count, so no layer is computed twice or past "
            "its use), the step's largest cost is ICI: at fsdp 64 XLA:TPU writes every weight "
            "all-gather as an all-reduce of zero-filled buffers, which doubles the ring bytes "
            f"({coll['gathers_as_all_reduce'] / 1e9:.1f} of {coll['total'] / 1e9:.1f} GB per "
            "chip) and adds the zero-filled broadcasts and all-reduce buffers to HBM "
            "traffic. Splitting the same 64 chips as data 2 × fsdp 32 (`--config.mesh.data=2 "
            "--config.mesh.fsdp=32`: each weight and optimizer shard is held on two chips; "
            f"XLA:TPU's peak per chip goes from {c['memory']['peak_bytes'] / 1e9:.2f} to "
            f"{d2['memory']['peak_bytes'] / 1e9:.2f} GB, the zero-filled gather buffers gone) "
            "keeps them all-gathers; the drafter's gradients are then all-reduced over the "
            "two data rows as well:",
            "",
            "| mesh | ICI GB / chip | of which gathers as all-reduce | HBM GB / chip (est.) | "
            "step ms | MFU | peak GB / chip |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in ("8b_v5p64", "8b_v5p64_d2"):
            x = cases[k]
            mesh = ",".join(str(x["mesh"].get(a, 1)) for a in ("data", "fsdp", "tensor"))
            out.append(
                f"| {mesh} | {x['per_chip']['collective_bytes'] / 1e9:.2f} | "
                f"{x['collectives']['gathers_as_all_reduce'] / 1e9:.2f} | "
                f"{x['per_chip']['hbm_bytes_estimate'] / 1e9:.1f} | "
                f"{x['seconds']['step'] * 1e3:.1f} | {x['mfu'] * 100:.1f} % | "
                f"{x['memory']['peak_bytes'] / 1e9:.2f} |"
            )
    e = next((x for k, x in cases.items() if k.startswith("8b_v5e64")), None)
    if e is not None:
        coll = e["collectives"]
        tgt = sum(v for n, v in coll["by_scope"].items() if "Qwen3.hidden_states)/layers" in n)
        once = target_gather_bytes(dict(e, collectives={}))
        out += [
            "",
            f"Not fixed here: on v5e ({e['topology']}, mesh "
            + ",".join(str(e["mesh"].get(a, 1)) for a in ("data", "fsdp", "tensor"))
            + f", {e['shape']['anchors']} anchors, draft layers rematerialised to fit 16 GB) "
            f"the step is {e['mfu'] * 100:.1f} % MFU: XLA:TPU gathers the frozen target's "
            f"weights {tgt / once:.2f}× over ({tgt / 1e9:.1f} GB against {once / 1e9:.1f} GB "
            f"once; {coll['count'].get('all-gather', 0)} all-gathers), so ICI takes "
            f"{e['seconds']['collectives'] * 1e3:.0f} of its "
            f"{e['seconds']['step'] * 1e3:.0f} ms; that is the next waste to chase there.",
        ]
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def to_markdown(res: dict[str, Any]) -> str:
    cases = res["cases"]
    out = [
        "# Training-step roofline on TPU slices, and what a drafter costs to train",
        "",
        "Produced by `python benchmarks/train_roofline.py` "
        + " ".join(f"`--case {k}`" for k in cases)
        + " (XLA:TPU from libtpu on a CPU host; nothing allocated). Per chip; the frozen "
        "target's layers and every scan unrolled so XLA counts every layer; the splash "
        "kernel's causal attention (a custom call XLA does not see into) modelled and added; "
        "modelled step = max(flops / peak, bytes / HBM BW) + collective bytes / ICI BW, the "
        "collectives (all-gather, reduce-scatter, all-reduce, all-to-all, "
        "collective-permute, at ring-algorithm bytes per chip) not overlapped with compute; "
        "MFU = hand-counted useful flops / (peak × modelled step) (`perf.train_roofline`).",
        "",
        "| case | topology | mesh | batch × T | anchors | TFLOP / chip | of which kernel | "
        "XLA / hand | GB / chip | ICI GB / chip | step ms (flops / bytes / ICI) | bound | MFU | "
        "MFU, gathers as all-gathers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, c in cases.items():
        pc, s, sh = c["per_chip"], c["seconds"], c["shape"]
        mesh = ",".join(str(c["mesh"].get(a, 1)) for a in ("data", "fsdp", "tensor"))
        out.append(
            f"| {k} | {c['topology']} | {mesh} | {sh['batch']} × {sh['seq_len']} | "
            f"{sh['anchors']} | {pc['flops'] / 1e12:.2f} | {pc['kernel_flops'] / 1e12:.2f} | "
            f"{c['flops_vs_hand']:.3f} | {_gb(pc['bytes'])} | {_gb(pc['collective_bytes'])} | "
            f"{s['step'] * 1e3:.1f} ({s['flops'] * 1e3:.1f} / {s['bytes'] * 1e3:.1f} / "
            f"{s['collectives'] * 1e3:.1f}) | {c['bound']} | {c['mfu'] * 100:.1f} % | "
            f"{c.get('mfu_gathers_as_all_gather', c['mfu']) * 100:.1f} % |"
        )
    out += [
        "",
        "*MFU, gathers as all-gathers*: the same step were every weight all-gather that "
        "XLA:TPU wrote as an all-reduce (each chip's shard placed in zeros, then summed: "
        "twice an all-gather's ring bytes) charged as an all-gather. XLA:TPU does this for "
        "the 64-way groups of fsdp 64 on a 4x4x4 v5p, not for 8-, 16- or 32-way ones "
        "(checked on the bundled target's shape); whether its all-reduce emitter on the full "
        "torus makes up for the doubled bytes is for a timing on the hardware to say.",
    ]
    for k, c in cases.items():
        if k.startswith("tiny"):
            continue
        pc = c["per_chip"]
        out += ["", f"## {k}: where the work goes", ""]
        out.append("Hand count per chip (TFLOP): " + ", ".join(
            f"{n} {v / 1e12:.3f}" for n, v in c["hand_count"].items() if n != "total"
        ) + f"; total {c['hand_count']['total'] / 1e12:.3f}, useful "
            f"{pc['useful_flops'] / 1e12:.3f}.")  # fmt: skip
        coll = c["collectives"]
        out += ["", "Collectives (ICI GB per chip, by kind): " + ", ".join(
            f"{n} {v / 1e9:.2f} ({coll['count'].get(n, 0)})" for n, v in coll["by_kind"].items()
        ) + "; by scope:", ""]  # fmt: skip
        out += [f"- {v / 1e9:.2f} GB `{n}`" for n, v in coll["by_scope"].items()]
        tgt = sum(v for n, v in coll["by_scope"].items() if "Qwen3.hidden_states)/layers" in n)
        if tgt and "preset" in c:
            once = target_gather_bytes(dict(c, collectives={}))
            out += ["", f"The frozen target's layer weights move {tgt / 1e9:.2f} GB over ICI in "
                    f"named all-gathers, {tgt / once:.2f}× one gather of each weight "
                    f"({once / 1e9:.2f} GB per chip at fsdp {c['mesh'].get('fsdp', 1)})."]  # fmt: skip
        ag = coll.get("gathers_as_all_reduce", 0.0)
        out += ["", f"Of the {coll['total'] / 1e9:.2f} GB, {ag / 1e9:.2f} GB are all-gathers "
                "written as all-reduces (unnamed: XLA's own instructions); by dtype: "
                + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in coll.get("by_dtype", {}).items())
                + ". HBM bytes of XLA's unnamed instructions by opcode (GB): "
                + ", ".join(f"{k} {v / 1e9:.2f}"
                            for k, v in c.get("unnamed_hbm_bytes_by_opcode", {}).items())
                + "."]  # fmt: skip
        hbm = pc["hbm_bytes_estimate"]
        out += ["", f"Largest single instructions by HBM bytes (`perf.hlo_bytes`, HBM only; "
                f"the step's estimate {hbm / 1e9:.1f} GB incl. the kernel):", ""]  # fmt: skip
        seen: dict[tuple, int] = {}
        for r in c["largest_instructions"]:
            key = (r["bytes"], r["opcode"], r["op_name"])
            seen[key] = seen.get(key, 0) + 1
        out += [
            f"- {b / 1e9:.2f} GB ({b / hbm * 100:.2f} %) `{op}` `{name[:150]}`"
            + (f" (× {n} in the top 10)" if n > 1 else "")
            for (b, op, name), n in seen.items()
        ]
        out += ["", "HBM bytes by name scope (GB):", ""]
        out += [f"- {v / 1e9:.2f} `{n}`" for n, v in c["bytes_by_scope"].items()]
    out += _goals(cases)
    rec = res.get("recipe")
    if rec and res.get("costs"):
        out += [
            "",
            "## What DeepSpec's DSpark recipe costs",
            "",
            f"Recipe ({rec['source']}): {rec['tokens_per_epoch'] / 1e9:.2f} B tokens per epoch "
            f"(its README's {rec['cache_tb_4b']:.0f} TB Qwen3-4B cache at its sizing script's "
            f"bytes per token), {rec['epochs']} epochs = {rec['rows'] / 1e6:.2f} M rows of "
            f"{rec['seq_len']} tokens, {rec['anchors']} anchors per row, γ = {rec['gamma']}, "
            f"{rec['global_batch']} rows per step ({rec['steps']:.0f} steps). Online: the "
            "frozen target runs in the step (this project). Cache: target features read from "
            f"storage at {rec['cache_gb_per_s_per_host']:.0f} GB/s per host of "
            f"{rec['chips_per_host']} chips, prefetched (step = max(compute, read)); the "
            "target's forward and its weight all-gathers are left out of the step.",
            "",
            "Each size's modelled step is the compiled 64-chip v5p case named in the note "
            "(per-chip flops, bytes and ICI bytes), plus, where that case has fewer anchors "
            "than the recipe, the hand count's extra work for 512 anchors at the case's "
            "flops/bytes mix, timed on the chip's peak, HBM and ICI figures. A v5e row marked "
            "*re-rated* is the v5p program timed on v5e's figures (same per-chip work; on v5e's "
            "16 GB, 512 anchors need `drafter.remat` = full, whose recomputation it leaves "
            "out); a v5e row naming a v5e case is that compiled program.",
            "",
            "| target | chip | online chip-hours | online hours on 64 chips | cache chip-hours "
            "| cache compute-only chip-hours | cache size TB | read GB/s per host to keep up | "
            "note |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        check = _scaling_check(res["cases"])
        if check:
            at = max(i for i, line in enumerate(out) if line.startswith("| target |"))
            out[at:at] = [check, ""]
        for r in res["costs"]:
            bound = " (read-bound)" if r["cache_io_bound"] else ""
            out.append(
                f"| Qwen3-{r['size'].upper()} | {r['chip']} | {r['online_chip_hours']:,.0f} | "
                f"{r['online_hours_on_64_chips']:.1f} | "
                f"{r['cache_chip_hours']:,.0f}{bound} | {r['cache_compute_chip_hours']:,.0f} | "
                f"{r['cache_tb']:.0f} | {r['break_even_gb_per_s_per_host']:.1f} | {r['note']} |"
            )
    return "\n".join(out) + "\n"
