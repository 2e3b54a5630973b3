"""The fenced code blocks of the README and of docs/*.md, each with the marker on the line before its fence:

- ``<!-- illustrative: why -->``: shown, not run (why says what stands in for it);
- ``<!-- tested-by: tests/x.py::test_y -->``: that test runs it, either by reading the block (``doc_block`` /
  ``doc_blocks``, so the test runs the very text the page shows) or by running the same command (its program or
  subcommand and its flags appear in the test's module).

tests/test_docs.py holds every block to one of the two; the tests named in markers import this module.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^\s*<!--\s*(illustrative|tested-by):\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # the page's path from the repository root: README.md, docs/serving.md
    line: int  # 1-based line of the opening fence
    lang: str  # the fence's info string: python, yaml, cpp, "" (a shell session)
    text: str  # the lines between the fences, their indentation (a block inside a list item) removed
    kind: Optional[str]  # "illustrative", "tested-by", or None where the line before the fence holds no marker
    value: str  # the marker's reason or test id

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> List[Path]:
    """README.md and every page of docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> List[Block]:
    """The fenced blocks of one page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, lang = opened.group(1), opened.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page.relative_to(ROOT)}:{i + 1}: a code fence that is never closed")
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        out.append(Block(page.relative_to(ROOT).as_posix(), i + 1, lang, body + "\n",
                         marker.group(1) if marker else None, marker.group(2) if marker else ""))
        i = end + 1
    return out


def all_blocks() -> List[Block]:
    return [b for page in pages() for b in blocks(page)]


def doc_blocks(test: str) -> List[Block]:
    """Every block whose marker is ``tested-by: <test>`` (test: ``tests/x.py::test_y``), in page order."""
    return [b for b in all_blocks() if b.kind == "tested-by" and b.value == test]


def doc_block(test: str) -> str:
    """The text of the one block marked ``tested-by: <test>``; ValueError unless exactly one page block has it."""
    found = doc_blocks(test)
    if len(found) != 1:
        raise ValueError(f"{len(found)} blocks are marked 'tested-by: {test}' ({[b.where() for b in found]}); want one")
    return found[0].text
