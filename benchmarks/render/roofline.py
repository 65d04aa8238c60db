"""Roofline page: XLA:TPU's cost analysis of the serving round at every verify bucket, one
section per (model, drafter, topology), each headed by what it models."""

from __future__ import annotations

import pathlib

from . import common


def roofline(results: pathlib.Path) -> list[str]:
    """Every roofline table but the --quick smoke run; each names its own command and keeps
    its own title (which names the drafter and topology), so no two headings are alike."""
    out = []
    for path in sorted(results.glob("roofline_*.md")):
        if path.stem.startswith("roofline_quick"):
            continue
        out += common.included(path, common.command_of(path))
    return out
