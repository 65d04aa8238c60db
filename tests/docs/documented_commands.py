"""The commands the README and ``docs/guides/`` show, read out of their ```bash blocks as
a shell reads them: continuation lines joined, here-documents and comments dropped, lists
(``&&``, ``;``, ``|``, ``&``) split into simple commands, ``VAR=value`` prefixes kept apart.

Used by tests/docs/test_documented_commands.py (every command parses with the entry point's
own parser) and tests/docs/test_guides_run.py (the guides that run on the bundled models,
run as written).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", "guides", f)
    for f in os.listdir(os.path.join(REPO, "docs", "guides"))
    if f.endswith(".md")
)
# A fence at the start of a line opens a block; its language follows the backticks.
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")
SEPARATORS = {"&&", "||", ";", "|", "&", ";;"}
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


@dataclasses.dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command's first line in the doc
    env: tuple[tuple[str, str], ...]  # VAR=value prefixes
    argv: tuple[str, ...]  # the words after the prefixes, quotes removed

    @property
    def text(self) -> str:
        """The command's words, one space apart (no prefixes, quotes or comments)."""
        return " ".join(self.argv)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def is_python_entry_point(self) -> bool:
        """``python X.py ...`` or ``python -m package.module ...`` (not venv, pytest, -c)."""
        if not self.argv or self.argv[0] not in ("python", "python3"):
            return False
        rest = self.argv[1:]
        if rest[:1] == ("-c",) or rest[:2] in (("-m", "venv"), ("-m", "pytest")):
            return False
        return bool(rest) and (rest[0] == "-m" or rest[0].endswith(".py"))


def blocks(doc: str, language: str = "bash") -> list[tuple[int, str]]:
    """(first line number of the block's body, body) of each block in ``language``."""
    text = open(os.path.join(REPO, doc)).read()
    return [
        (text[: m.start(2)].count("\n") + 1, m.group(2))
        for m in BLOCK.finditer(text)
        if m.group(1) == language
    ]


def _words(logical: str) -> list[str] | None:
    lex = shlex.shlex(logical, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # an unclosed quote: the command goes on on the next line
        return None


def commands_in(doc: str, first_line: int, body: str) -> list[Command]:
    lines = body.split("\n")
    out: list[Command] = []
    i = 0
    while i < len(lines):
        start, logical = i, lines[i]
        i += 1
        while True:
            if logical.endswith("\\") and i < len(lines):
                logical = logical[:-1] + " " + lines[i].lstrip()
                i += 1
                continue
            words = _words(logical)
            if words is None and i < len(lines):
                logical += "\n" + lines[i]
                i += 1
                continue
            break
        if words is None:
            raise ValueError(f"{doc}:{first_line + start}: unclosed quote in {logical!r}")
        here = HEREDOC.search(logical)
        if here:  # skip the document's body up to its terminator line
            while i < len(lines) and lines[i].strip() != here.group(1):
                i += 1
            i += 1
            words = _words(logical[: here.start()])
        simple: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                simple.append(word)
                continue
            env = []
            while simple and ASSIGNMENT.match(simple[0]):
                name, _, value = simple.pop(0).partition("=")
                env.append((name, value))
            if simple or env:
                out.append(Command(doc, first_line + start, tuple(env), tuple(simple)))
            simple = []
    return out


def documented_commands(skip: tuple[str, ...] = ()) -> list[Command]:
    """Every command of every ```bash block of the README and the guides, except blocks
    whose body contains one of ``skip`` (e.g. a block shown from a tested script)."""
    found = []
    for doc in DOCS:
        for first_line, body in blocks(doc):
            if not any(s in body for s in skip):
                found += commands_in(doc, first_line, body)
    return found
