"""Writing a benchmark's result file (``benchmarks/results/*.json``): the directory made,
JSON with a final newline, the same JSON echoed on stdout for the log."""

from __future__ import annotations

import json
import os

__all__ = ["write_result"]


def write_result(path: str | os.PathLike, result: dict, indent: int = 2) -> dict:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
        f.write("\n")
    print(json.dumps(result, indent=indent))
    return result
