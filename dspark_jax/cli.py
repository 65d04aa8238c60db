"""One error convention for every command-line entry point.

A user error (a bad flag value, a missing or wrong directory, a prompt that does not fit,
a config key that does not exist) prints one line, ``error: <what is wrong>``, on stderr
and exits with status 2, the status ``argparse`` uses for bad usage. There is no traceback
for these: the message names the problem. Anything else is a bug and keeps its traceback.
``DSPARK_JAX_TRACEBACK=1`` shows the traceback of a user error too (when reporting one).

    from dspark_jax.cli import run_main

    def main(argv=None) -> int:
        args = parse_args(argv)
        return run_main(run, args)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

# ConfigError is a ValueError; OSError subclasses cover a missing file or directory, an
# output that would replace an existing file, a file where a directory was expected, and
# permissions.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)
EXIT_USAGE = 2
TRACEBACK_ENV = "DSPARK_JAX_TRACEBACK"


def report_error(err: BaseException) -> int:
    """Print ``error: <message>`` on stderr; returns the exit status (2)."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run_main(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Call ``fn``; a user error becomes ``error: ...`` and status 2. ``fn`` returning
    ``None`` (or a non-int, e.g. a summary dict) means success, status 0."""
    try:
        rc = fn(*args, **kwargs)
    except USER_ERRORS as err:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        return report_error(err)
    # A multi-process run (dspark_jax.distributed): every process leaves together.
    from dspark_jax.distributed import finalize_if_started

    finalize_if_started()
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0


__all__ = ["EXIT_USAGE", "TRACEBACK_ENV", "USER_ERRORS", "report_error", "run_main"]


SURVIVAL_ESTIMATOR_CHOICES = ("auto", "confidence-head", "draft-probability")


def add_survival_estimator_argument(parser, help_extra: str = "") -> None:
    """``--survival-estimator``: where the schedulers' survivals come from
    (``models.drafter_io.SURVIVAL_ESTIMATORS``), the same flag on every entry point."""
    parser.add_argument(
        "--survival-estimator",
        default="auto",
        choices=SURVIVAL_ESTIMATOR_CHOICES,
        help="where the threshold/prefix/top-K schedulers' draft survivals come from: the "
        "drafter's confidence head (DSpark), or the largest probability of its draft "
        "distribution at each position (any drafter; calibrated by "
        "<drafter>/sts_draft_probability.json when present). auto: the head where the "
        "drafter has one, else the draft probability" + help_extra,
    )
