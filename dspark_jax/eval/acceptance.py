"""Offline acceptance evaluation: τ, position-wise acceptance, calibration (DESIGN §7).

Every run uses the **fixed** scheduler (verify all γ drafts, i.e. confidence threshold 0)
so that acceptance labels are never censored by a scheduler, with STS off while decoding
(temperatures do not change a fixed-block run; the raw logits are recovered from the
recorded survival and any ``sts.json`` is applied offline, giving raw *and* calibrated
metrics from one run). Prompts are batched over ``slots`` request slots of one jitted
decode round (continuous batching via :class:`dspark_jax.engine.offline.Runner`).

Programmatic use::

    target = load_target("models/pycode-small")  # dspark_jax.convert.loading
    drafter = load_drafter_dir("models/pycode-small-dspark", target)
    prompts = {"humaneval": load_prompts("humaneval.jsonl", limit=50)}
    results, rounds = evaluate(target, [drafter], prompts, temperatures=(0.0,), gamma=7)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspark_jax.convert.loading import LoadedDrafter, LoadedTarget
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
from dspark_jax.engine.offline import Request, Runner
from dspark_jax.eval import calibration as cal
from dspark_jax.eval import metrics
from dspark_jax.eval.prompts import Prompt
from dspark_jax.tokenizer import Tokenizer

# Verification rules at T > 0: rejection sampling, and position-keyed Gumbel-max
# (decode.verify.verify_coupled, load-invariant for a seed; measured side by side).
VERIFICATION = ("standard", "coupled")

# -- one decode run ---------------------------------------------------------------------


@dataclasses.dataclass
class RoundRecords:
    """Flattened per-round records of one fixed-block run over a list of prompts."""

    prompt_index: np.ndarray  # [N] index into the prompt list
    accepted: np.ndarray  # [N]
    verified: np.ndarray  # [N]
    logits: np.ndarray | None  # [N, γ] raw survival logits z_k of the decoder's estimator
    gamma: int
    num_prompts: int
    generated_tokens: np.ndarray  # [num_prompts]
    wall_seconds: float
    loops: np.ndarray | None = None  # [num_prompts] bool: continuation ends in a loop

    def subset(self, prompt_ids) -> RoundRecords:
        ids = np.asarray(sorted(prompt_ids), np.int64)
        m = np.isin(self.prompt_index, ids)
        remap = np.full(self.num_prompts, -1, np.int64)
        remap[ids] = np.arange(ids.size)
        return RoundRecords(
            remap[self.prompt_index[m]],
            self.accepted[m],
            self.verified[m],
            None if self.logits is None else self.logits[m],
            self.gamma,
            int(ids.size),
            self.generated_tokens[ids],
            self.wall_seconds,
            None if self.loops is None else self.loops[ids],
        )


def encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[Prompt], max_prompt_tokens: int
) -> list[list[int]]:
    """Token ids of the formatted prompts; longer prompts keep their last tokens (the ones
    next to where generation starts)."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    ids = tokenizer.encode_batch([p.formatted for p in prompts])
    out = []
    for p, toks in zip(prompts, ids):
        if not toks:
            raise ValueError(f"{p.set_name}[{p.index}]: prompt encodes to no tokens")
        out.append(list(toks[-max_prompt_tokens:]))
    return out


def effective_gamma(drafter: LoadedDrafter, gamma: int | None) -> int:
    """Drafts verified per round: ``gamma`` capped at the drafter's draft length."""
    if gamma is None:
        return drafter.draft_len
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    return min(gamma, drafter.draft_len)


def make_decoder(
    target: LoadedTarget,
    drafter: LoadedDrafter,
    *,
    gamma: int,
    temperature: float,
    slots: int,
    max_len: int,
) -> SpeculativeDecoder:
    """A fixed-block decoder for ``drafter``: every draft verified, survivals recorded from
    ``drafter.survival_estimator`` with STS off."""
    cfg = StepConfig(
        num_slots=slots,
        max_len=max_len,
        scheduler="fixed",  # confidence threshold 0: every draft verified, labels uncensored
        sampling=temperature > 0,
        fixed_length=gamma,
        eos_id=target.tokenizer.eos_id,
    )
    # STS off while decoding: the fixed arm ignores confidences, and raw logits are needed.
    return SpeculativeDecoder(
        target.module,
        target.params,
        drafter.module,
        drafter.params,
        cfg,
        mesh=target.mesh,
        survival_estimator=drafter.survival_estimator,
    )


def collect_rounds(
    decoder: SpeculativeDecoder,
    prompt_ids: Sequence[Sequence[int]],
    *,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    verification: str = "standard",
    progress: str | None = None,
) -> RoundRecords:
    """Decode every prompt with the fixed-block decoder; flatten the per-round records,
    with the raw survival logits of the decoder's estimate (every drafter has one).

    ``verification``: ``standard`` (rejection sampling) or ``coupled`` (position-keyed
    Gumbel-max, ``decode.verify.verify_coupled``); the same at temperature 0.
    ``progress``: a tqdm bar with this description counts finished prompts (None: no
    bar)."""
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if verification not in VERIFICATION:
        raise ValueError(f"verification must be one of {list(VERIFICATION)}, got {verification!r}")
    coupled = verification == "coupled"
    reqs = [
        Request(list(p), max_new_tokens, float(temperature), prompt_index=i, coupled=coupled)
        for i, p in enumerate(prompt_ids)
    ]
    runner = Runner(decoder, record_details=True, seed=seed)
    from tqdm.auto import tqdm

    with tqdm(
        total=len(reqs), desc=progress, unit="prompt", disable=progress is None, leave=False
    ) as bar:
        samples, stats = runner.generate(reqs, on_finish=lambda _: bar.update())
    samples = sorted(samples, key=lambda s: s.prompt_index)
    pidx, acc, ver, surv = [], [], [], []
    for s in samples:
        pidx += [s.prompt_index] * s.rounds
        acc += s.accepted_per_round
        ver += s.verified_per_round
        surv += [row[:gamma] for row in s.survival_per_round]
    logits = cal.logits_from_survival(np.asarray(surv, np.float64).reshape(len(acc), gamma))
    return RoundRecords(
        np.asarray(pidx, np.int64),
        np.asarray(acc, np.int64),
        np.asarray(ver, np.int64),
        logits,
        gamma,
        len(prompt_ids),
        np.asarray([len(s.tokens) for s in samples], np.int64),
        stats.wall_seconds,
        np.asarray([metrics.ends_in_loop(s.tokens) for s in samples], bool),
    )


# -- summaries ----------------------------------------------------------------------------


def calibration_summary(
    logits: np.ndarray,
    accepted,
    verified,
    sts: cal.STS | None = None,
    n_bins: int = metrics.DEFAULT_BINS,
) -> dict[str, Any]:
    """Per-position ECE/AUROC/Brier, pooled ECE and reliability bins for one calibration
    (``sts`` None: raw confidences)."""
    temps, biases = (None, None) if sts is None else (sts.temperatures, sts.biases)
    a = cal.survival_from_sts(logits, sts)
    conf, labels = metrics.pooled_scores(a, accepted, verified)
    return {
        "temperatures": None if temps is None else np.asarray(temps).tolist(),
        "biases": None if biases is None else np.asarray(biases).tolist(),
        "per_position": metrics.position_calibration(a, accepted, verified, n_bins),
        "pooled_ece": metrics.ece(conf, labels, n_bins),
        "pooled_auroc": metrics.auroc(conf, labels),
        "reliability": metrics.reliability_bins(conf, labels, n_bins),
        "reliability_per_position": [
            metrics.reliability_bins(a[m, k], labels_k, n_bins)
            for k, (m, labels_k) in enumerate(_position_masks(accepted, verified, a.shape[1]))
        ],
        "threshold_sweep": metrics.threshold_sweep(a, accepted, verified),
    }


def _position_masks(accepted, verified, gamma):
    labels, observed = metrics.prefix_labels(accepted, gamma, verified)
    return [(observed[:, k], labels[observed[:, k], k]) for k in range(gamma)]


def summarize(records: RoundRecords, sts: cal.STS | None = None) -> dict[str, Any]:
    """τ, rounds, conditional acceptance and (with confidences) calibration of one run."""
    r = records
    tau_rounds = metrics.tau_per_round(r.accepted)
    per_prompt_tau, per_prompt_rounds = [], []
    for i in range(r.num_prompts):
        m = r.prompt_index == i
        per_prompt_rounds.append(int(m.sum()))
        per_prompt_tau.append(float(tau_rounds[m].mean()) if m.any() else None)
    seen = [t for t in per_prompt_tau if t is not None]
    out: dict[str, Any] = {
        "gamma": r.gamma,
        "tau": metrics.mean_tau(r.accepted),
        # Round-pooled τ weighs long-running prompts more; the per-prompt mean weighs each
        # prompt once (a prompt stuck in a loop of τ = 1 rounds counts once).
        "tau_prompt_mean": float(np.mean(seen)) if seen else None,
        "loop_share": None if r.loops is None else float(np.mean(r.loops)),
        "tau_per_prompt": per_prompt_tau,
        "rounds": int(r.accepted.size),
        "rounds_per_prompt": per_prompt_rounds,
        "generated_tokens": int(r.generated_tokens.sum()),
        "accepted_histogram": np.bincount(r.accepted, minlength=r.gamma + 1).tolist(),
        "conditional_acceptance": metrics.conditional_acceptance(
            r.accepted, r.gamma, r.verified
        ).tolist(),
        "wall_seconds": r.wall_seconds,
        "calibration": None,
    }
    if r.logits is not None and r.accepted.size:
        calib = {"raw": calibration_summary(r.logits, r.accepted, r.verified)}
        if sts is not None:
            calib["sts"] = calibration_summary(r.logits, r.accepted, r.verified, sts.first(r.gamma))
        out["calibration"] = calib
    return out


def evaluate(
    target: LoadedTarget,
    drafters: Sequence[LoadedDrafter],
    prompt_sets: dict[str, Sequence[Prompt]],
    *,
    temperatures: Sequence[float] = (0.0,),
    gamma: int | None = None,
    max_new_tokens: int = 128,
    slots: int = 8,
    seed: int = 0,
    max_prompt_tokens: int = 512,
    verifications: Sequence[str] = ("standard",),
    progress=print,
    progress_bars: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """τ and calibration for every (drafter, prompt set, temperature, verification rule;
    ``coupled`` only at T > 0, where it differs from ``standard``). ``progress`` prints
    one line per finished arm; ``progress_bars``: a tqdm bar per arm while it decodes.

    Returns the result entries (JSON-ready) and the raw per-round arrays keyed
    ``"<entry>/<name>"`` (for ``np.savez``). One decoder (one compiled round) per drafter
    and sampling mode; the cache length fits the longest prompt of all sets.
    """
    if not drafters:
        raise ValueError("evaluate needs at least one drafter")
    if not prompt_sets:
        raise ValueError("evaluate needs at least one prompt set")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    labels = [d.label for d in drafters]
    if len(set(labels)) != len(labels):
        raise ValueError(f"drafter labels must be unique, got {labels}")
    tc = target.config
    max_g = max(effective_gamma(d, gamma) for d in drafters)
    room = tc.max_position_embeddings - max_new_tokens - max_g - 2
    if room < 1:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} + gamma {max_g} leaves no room for a prompt in "
            f"the target's {tc.max_position_embeddings} positions"
        )
    limit = min(max_prompt_tokens, room)
    encoded = {n: encode_prompts(target.tokenizer, ps, limit) for n, ps in prompt_sets.items()}
    longest = max(len(p) for ids in encoded.values() for p in ids)
    max_len = min(tc.max_position_embeddings, longest + max_new_tokens + max_g + 2)

    entries, arrays = [], {}
    for d in drafters:
        g = effective_gamma(d, gamma)
        for temp in temperatures:
            dec = make_decoder(target, d, gamma=g, temperature=temp, slots=slots, max_len=max_len)
            rules = [v for v in verifications if temp > 0 or v == "standard"] or ["standard"]
            for (name, ids), rule in itertools.product(encoded.items(), rules):
                rec = collect_rounds(
                    dec,
                    ids,
                    gamma=g,
                    temperature=temp,
                    max_new_tokens=max_new_tokens,
                    seed=seed,
                    verification=rule,
                    progress=f"{d.label} {name} T={temp:g} {rule}" if progress_bars else None,
                )
                entry = {
                    "drafter": d.label,
                    "drafter_path": d.path,
                    "kind": d.config.kind,
                    "survival_estimator": d.survival_estimator,
                    "prompt_set": name,
                    "num_prompts": len(ids),
                    "temperature": float(temp),
                    "verification": rule,
                    "sts_applied_offline": d.sts is not None,
                    **summarize(rec, d.sts),
                }
                key = f"{len(entries)}"
                arrays[f"{key}/prompt_index"] = rec.prompt_index
                arrays[f"{key}/accepted"] = rec.accepted
                arrays[f"{key}/verified"] = rec.verified
                if rec.logits is not None:
                    arrays[f"{key}/confidence_logits"] = rec.logits.astype(np.float32)
                entries.append(entry)
                if progress:
                    progress(
                        f"{d.label:>20s}  {name:>12s}  T={temp:g}  {rule:>8s}  "
                        f"tau={entry['tau']:.3f}  "
                        f"rounds={entry['rounds']}  ({rec.wall_seconds:.1f}s)"
                    )
    _add_ratios(entries)
    return entries, arrays


def _add_ratios(entries: list[dict[str, Any]]) -> None:
    """τ of each entry relative to every drafter on the same prompt set, temperature and
    verification rule."""

    def group_of(e):
        return e["prompt_set"], e["temperature"], e.get("verification", "standard")

    by_key: dict[tuple, dict[str, float]] = {}
    for e in entries:
        by_key.setdefault(group_of(e), {})[e["drafter"]] = e["tau"]
    for e in entries:
        group = by_key[group_of(e)]
        e["tau_ratio_to"] = {
            other: (e["tau"] / t if t and math.isfinite(t) else None)
            for other, t in group.items()
            if other != e["drafter"]
        }


def run_metadata(target: LoadedTarget, drafters: Sequence[LoadedDrafter], args: dict) -> dict:
    """The run's configuration: arguments, model paths/configs, versions, device."""
    dev = jax.devices()[0]
    return {
        "args": args,
        "target": {
            "path": target.path,
            "config": dataclasses.asdict(target.config),
            "weights": target.fingerprint,  # summarize.py flags results on other models
        },
        "drafters": [
            {
                "label": d.label,
                "path": d.path,
                "config": d.config.to_dict(),
                "survival_estimator": d.survival_estimator,
                "sts_temperatures": None if d.sts is None else d.sts.temperatures.tolist(),
                "sts_biases": None if d.sts is None else d.sts.biases.tolist(),
                # isotonic fits: [γ, 2, J] step maps (edges, logits; null rows: none)
                "sts_knots": None if d.sts is None or d.sts.knots is None else d.sts.knots.tolist(),
            }
            for d in drafters
        ],
        "scheduler": "fixed",
        "jax_version": jax.__version__,
        "device": {
            "platform": dev.platform,
            "kind": getattr(dev, "device_kind", str(dev)),
            "count": jax.device_count(),
        },
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_results(
    out: str | os.PathLike, entries: list[dict], arrays: dict[str, np.ndarray], meta: dict
) -> tuple[Path, Path]:
    """``results.json`` (config + entries; NaN written as null) and ``<stem>.rounds.npz``
    (per-round ``prompt_index``/``accepted``/``verified``/``confidence_logits`` per entry,
    keyed ``"<entry index>/<name>"``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rounds_file = out.with_suffix(".rounds.npz")
    np.savez_compressed(rounds_file, **arrays)
    meta = dict(meta, rounds_file=rounds_file.name)
    payload = cal.to_jsonable({"config": meta, "results": entries})
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out, rounds_file


__all__ = [
    "RoundRecords",
    "calibration_summary",
    "collect_rounds",
    "effective_gamma",
    "encode_prompts",
    "evaluate",
    "make_decoder",
    "run_metadata",
    "summarize",
    "write_results",
]
