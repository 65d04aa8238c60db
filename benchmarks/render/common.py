"""Helpers every renderer shares: loading result files, the commands that reproduce them,
and the note that flags a result measured against other target weights than today's."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# The generated pages live in docs/results/; links from there to the repository root.
TO_ROOT = "../.."

PAPER_DFLASH, PAPER_EAGLE = "+16–18 %", "+27–31 %"


def load(path: pathlib.Path):
    """A JSON result file, or None when it does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


def ratio(a, b) -> str:
    return f"{a / b:.3f}" if a and b else "–"


def demote(line: str, levels: int = 1) -> str:
    """A result file's headings, ``levels`` down (its ``#`` title becomes ``##``)."""
    return "#" * levels + line if line.startswith("#") else line


def included(path: pathlib.Path, command: str, note=()) -> list[str]:
    """A generated Markdown result file as a section: its own title becomes the section's
    heading, then the command that wrote it and any ``note`` lines, then the file's body."""
    text = path.read_text().splitlines()
    title, body = (text[0], text[1:]) if text and text[0].startswith("# ") else (None, text)
    head = [demote(title), ""] if title else []
    while body and not body[0].strip():
        body = body[1:]
    return [*head, f"    {command}", "", *note] + [demote(line) for line in body] + [""]


def table_head(title: str, command: str, columns: list[str], intro=()) -> list[str]:
    """A section's heading, its command and the head of its table."""
    return [title, "", f"    {command}", "", *intro,
            "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]  # fmt: skip


def acceptance_command(args: dict, out_name: str) -> str:
    """The acceptance command that reproduces a results file (from its recorded args)."""
    return (
        "python -m dspark_jax.eval acceptance --target assets/target "
        + " ".join(f"--drafter {d}" for d in args["drafter"])
        + " "
        + " ".join(f"--prompts {p}" for p in args["prompts"])
        + f" --temperature {' '.join(str(t) for t in args['temperature'])} --gamma {args['gamma']}"
        + f" --max-new-tokens {args['max_new_tokens']} --limit {args['limit']}"
        + f" --slots {args['slots']} --out benchmarks/results/{out_name}"
    )


def acceptance_weights(acc: dict) -> str | None:
    return acc["config"].get("target", {}).get("weights")


def bundled_target_weights() -> str | None:
    """The bundled target's weights fingerprint, as its drafters record it."""
    cfg = load(ROOT / "assets" / "drafters" / "dspark" / "drafter_config.json")
    return None if cfg is None else cfg.get("target", {}).get("weights")


def stale_models_note(recorded: str | None, rerun: str = "rerun the command above") -> list[str]:
    """A line saying so when a result was measured against other target weights than the
    bundled target's (``recorded``: the fingerprint the result file holds, if any)."""
    today = bundled_target_weights()
    if today is None or recorded == today:
        return []
    if recorded is None:
        return [
            f"**Not matched to today's models**: the run recorded no target fingerprint "
            f"(today's `assets/target` is `{today}`); {rerun}.",
            "",
        ]
    return [
        f"**Measured on earlier bundled models** (target weights `{recorded}`; today's "
        f"`assets/target` is `{today}`): the figures below are not today's models'; {rerun}.",
        "",
    ]


def command_of(path: pathlib.Path) -> str:
    """The command a Markdown result file's JSON twin records."""
    return json.loads(path.with_suffix(".json").read_text())["command"]
