'''Prompt sets and their formatting for a **base code model** (DESIGN §7).

Prompt files are JSON lines; each record holds ``"turns": [str, ...]`` (only the first
turn is used) or, alternatively, a ``"prompt"`` string. The set's name is the file stem
(``humaneval.jsonl`` → ``humaneval``).

A base code model has no chat template, so each first turn is rendered as source code
(``format_prompt``, style ``auto``):

1. **code block** — the turn contains a fenced block (```` ```python … ``` ````, as in
   HumanEval): the prompt is the block's contents, ending in one newline, e.g.::

       from typing import List


       def has_close_elements(numbers: List[float], threshold: float) -> bool:
           """ Check if ... """

2. **docstring + stub** — code-instruction sets (``mbpp``) or any instruction that asks to
   "write a function / program": the instruction as a module docstring, then the start of
   a function definition for the model to complete::

       """Write a python function to find the volume of a triangular prism."""


       def

3. **comment + answer** — everything else (``gsm8k``, ``math500``, ``aime25``,
   ``mt-bench``): every line of the instruction as a ``# `` comment, then an answer line::

       # Janet's ducks lay 16 eggs per day. ...
       # Please reason step by step, and put your final answer within \\boxed{}.
       # Answer:

   (the prompt ends after ``# Answer:`` plus a newline).

Long lines are kept as they are (no re-wrapping), so the text the model sees is exactly the
instruction. Style ``raw`` passes the first turn through unchanged.

Plain text is left as it is under ``auto``: a record's ``"prompt"`` string (text to
continue, not a benchmark's instruction turn), and a turn that already reads as source
code (its first line starts a ``def``, ``class``, ``import``, decorator, comment or
docstring). Any other style asked for by name still applies to them.
'''

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

PROMPT_STYLES = ("auto", "raw", "code", "docstring", "comment")
# Sets whose instructions ask for a Python function (rendered as docstring + stub).
CODE_INSTRUCTION_SETS = frozenset({"mbpp"})
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.I)
_ASKS_FOR_CODE = re.compile(r"\bwrite a (?:python )?(?:function|program|class)\b", re.I)
# The first non-blank line of text that is already source code (left as it is by auto).
_READS_AS_CODE = re.compile(
    r"""^[ \t]*(?:(?:async[ \t]+)?def[ \t]|class[ \t]|import[ \t]|from[ \t]+\S+[ \t]+import\b|@\w|#|\"\"\"|\'\'\')"""
)


@dataclasses.dataclass(frozen=True)
class Prompt:
    set_name: str
    index: int  # line index in the file (records kept in file order)
    text: str  # the first turn as stored
    formatted: str  # what the model is given


def extract_code_block(text: str) -> str | None:
    """Contents of the first fenced code block (without the fences), or None."""
    m = _FENCE.search(text)
    if m is None:
        return None
    code = m.group(1).rstrip()
    return code + "\n" if code else None


def reads_as_code(text: str) -> bool:
    """Whether ``text``'s first non-blank line starts Python source (``def``, ``class``,
    ``import``, a decorator, a comment, a docstring)."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    return bool(_READS_AS_CODE.match(first))


def format_prompt(text: str, set_name: str = "", style: str = "auto") -> str:
    """Render one first turn for a base code model (module docstring for the formats)."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {style!r}; allowed: {list(PROMPT_STYLES)}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("prompt text must be a non-empty string")
    if style == "raw":
        return text
    if style == "auto" and reads_as_code(text):
        return text
    code = extract_code_block(text)
    if style == "code" or (style == "auto" and code is not None):
        if code is None:
            raise ValueError(f"style 'code' needs a fenced code block; got {text[:80]!r}")
        return code
    instruction = text.strip()
    if style == "docstring" or (
        style == "auto"
        and (set_name.lower() in CODE_INSTRUCTION_SETS or _ASKS_FOR_CODE.search(instruction))
    ):
        # Escape quotes/backslashes that would end the docstring early or form escapes.
        body = instruction.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
        return f'"""{body}"""\n\n\ndef'
    lines = "\n".join(("# " + ln).rstrip() for ln in instruction.splitlines())
    return f"{lines}\n# Answer:\n"


def _first_turn(record, path: Path, lineno: int) -> tuple[str, bool]:
    """``(text, plain)``: the first turn, or a ``"prompt"`` string (``plain``: text to
    continue as it is)."""
    if isinstance(record, dict):
        turns = record.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0], False
        if isinstance(record.get("prompt"), str):
            return record["prompt"], True
    raise ValueError(
        f"{path}:{lineno}: expected a JSON object with a non-empty 'turns' list of strings "
        f"(or a 'prompt' string), got {str(record)[:120]}"
    )


def load_prompts(path: str | Path, limit: int | None = None, style: str = "auto") -> list[Prompt]:
    """Formatted prompts of one JSONL file (first ``limit`` records, in file order)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file not found: {p}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    name = p.name.removesuffix(".jsonl").removesuffix(".json")
    out: list[Prompt] = []
    with p.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: invalid JSON: {e}") from None
            text, plain = _first_turn(record, p, lineno)
            if plain and not text.strip():
                raise ValueError(f"{p}:{lineno}: the prompt is empty")
            # A plain "prompt" string is rendered only when a style is asked for by name.
            formatted = text if plain and style == "auto" else format_prompt(text, name, style)
            out.append(Prompt(name, len(out), text, formatted))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"prompt file {p} holds no records")
    return out


def split_prompts(prompts: list[Prompt], fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """First ``fraction`` of the prompts (at least one) and the rest (may be empty)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"split fraction must be in (0, 1], got {fraction}")
    n = max(1, min(len(prompts), round(len(prompts) * fraction)))
    return prompts[:n], prompts[n:]


__all__ = [
    "CODE_INSTRUCTION_SETS",
    "PROMPT_STYLES",
    "Prompt",
    "extract_code_block",
    "format_prompt",
    "load_prompts",
    "reads_as_code",
    "split_prompts",
]
