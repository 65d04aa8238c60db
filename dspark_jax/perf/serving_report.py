"""Serving results as the paper's goals read them (Figs. 7–8): dynamic top-K against
every other arm per concurrency, against fixed γ at the highest concurrency, and per-user
tokens/s against MTP-1 at matched aggregate throughput. Used for the measured serving
benchmark (``benchmarks/summarize.py``) and the simulator (``benchmarks/serving_sim.py``).
Rows are the benchmark's per-level dicts (``concurrency``, ``aggregate_tokens_per_second``,
``per_user_tokens_per_second``)."""

from __future__ import annotations

__all__ = ["serving_goals", "serving_table"]


def serving_table(arms: dict, agg_digits: int = 1, round_budget: bool = False) -> list[str]:
    """Markdown rows, one per (arm, concurrency): aggregate and per-user tokens/s, τ, the
    drafts verified per request-round (and the mean round budget K when recorded)."""
    head = "| arm | concurrency | aggregate tok/s | per-user tok/s | τ | verify budget / round |"
    sep = "|---|---|---|---|---|---|"
    if round_budget:
        head, sep = head + " mean K |", sep + "---|"
    out = [head, sep]
    for arm, rows in arms.items():
        for r in rows:
            line = (
                f"| {arm} | {r['concurrency']} | {r['aggregate_tokens_per_second']:.{agg_digits}f}"
                f" | {r['per_user_tokens_per_second']:.1f} | {r['mean_tau']:.2f} | "
                f"{r['mean_verify_budget_per_request']:.2f} |"
            )
            if round_budget:
                line += f" {r['mean_round_budget']:.0f} |"
            out.append(line)
    return out


def _interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Linear interpolation of ``ys`` over increasing ``xs`` at ``x`` (None outside)."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def serving_goals(arms: dict) -> list[str]:
    """The issue's serving goals, computed from the table: top-K against every other arm
    per concurrency, top-K / fixed γ at the highest concurrency, and top-K's per-user
    tokens/s over MTP-1's at matched aggregate throughput (MTP-1's per-user rate
    interpolated along its aggregate-throughput frontier)."""
    topk, fixed, mtp = (arms.get(n) for n in ("dynamic top-K", "fixed γ", "MTP-1"))
    if not topk:
        return []
    agg = "aggregate_tokens_per_second"
    user = "per_user_tokens_per_second"
    out = ["", "Goals, from the table above:", ""]
    for r in topk:
        c = r["concurrency"]
        others = {
            n: x[agg] for n, rows in arms.items() if n != "dynamic top-K"
            for x in rows if x["concurrency"] == c
        }  # fmt: skip
        if others:
            best = max(others, key=others.get)
            out.append(
                f"- c = {c}: top-K / best other arm ({best}) = "
                f"{r[agg] / others[best]:.2f}× aggregate throughput"
            )
    if fixed:
        c_max = max(x["concurrency"] for x in topk)
        f = [x for x in fixed if x["concurrency"] == c_max]
        t = [x for x in topk if x["concurrency"] == c_max]
        if f and t:
            out.append(
                f"- c = {c_max}: top-K / fixed γ = {t[0][agg] / f[0][agg]:.2f}× (goal ≥ 1.3×)"
            )
    if mtp:
        pts = sorted((x[agg], x[user]) for x in mtp)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ratios = []
        for r in topk:
            ref = _interp(r[agg], xs, ys)
            if ref:
                ratios.append((r[agg], r[user] / ref))
        if ratios:
            desc = ", ".join(f"{a:.0f} tok/s: {q:.2f}×" for a, q in ratios)
            out.append(
                "- per-user tokens/s, top-K / MTP-1 at matched aggregate throughput "
                f"(goal ≥ 1.6×): {desc}"
            )
        else:
            out.append(
                "- per-user at matched aggregate: no top-K point falls inside MTP-1's "
                "aggregate-throughput range"
            )
    return out
