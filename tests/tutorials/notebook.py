"""The TorchRec tutorials in ../shared/seeds/ as notebooks: their code cells, rewritten for recship, run in order.

    python -m tests.tutorials.notebook 3 --show     # run 003_*.txt: each cell, its stdout, its error
    python -m tests.tutorials.notebook 3 --extract  # only the cells found and the output the tutorial shows

``extract`` finds the code cells of a seed (one reader per format, each documented below) and
the output the tutorial shows right after a cell. ``prepare`` makes the only edits, in order:

1. imports, by the import map of docs/torchrec.md (between ``<!-- torchrec-import-map -->`` markers): a
   ``torchrec`` module path is replaced by the recship module of its longest prefix in the map
   (whole dotted components; the entry covers its submodules, so
   ``torchrec.distributed.embeddingbag`` becomes ``recship.distributed``), and
   ``import torchrec`` becomes ``import recship as torchrec``; other imports are untouched;
2. device, as docs/torchrec.md ("The tutorials on a CPU") says: ``"cuda"``, ``"cuda:0"`` and
   ``f"cuda:{rank}"`` become ``"cpu"``, ``.cuda()`` becomes ``.cpu()``, and ``"nccl"`` becomes
   ``"gloo"`` unless it is an operand of a comparison (``if backend == "nccl":`` stays);
3. Colab-only cells are not run: shell commands and ``pip install`` are not Python and so are
   never cells, and a cell that resets ``sys.path`` (the sharding tutorial's) is skipped.

``run`` executes one tutorial's cells in a fresh interpreter, in order, in one namespace: a new
module named ``__main__`` (as in Jupyter, so dill pickles notebook functions by value for
``multiprocess``), with torch seeded with 42 before the first cell. A marker line is printed and
flushed on stdout and on stderr before each cell, so everything a cell prints, the ranks it
spawns included (they write to the inherited descriptors), is attributed to it. A failing cell
records its traceback and the next cells still run; the whole run has a timeout. The tutorials
hard-code MASTER_PORT 29500, so runs on one machine take a file lock in turn.
"""

import argparse
import ast
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT.parent / "shared" / "seeds"
TIMEOUT_S = 300


@dataclass
class Block:
    """A piece of a seed: a code cell, the output shown after one, or a block that is not run."""

    kind: str  # "code" | "output" | "skipped"
    text: str
    line: int  # 1-based line of the seed where it starts
    note: str = ""  # for "skipped": why


@dataclass
class Cell:
    number: int  # 1-based, in notebook order
    line: int
    source: str  # as extracted
    shown_output: str = ""  # what the tutorial shows right after the cell


@dataclass
class Tutorial:
    path: Path
    text: str
    format: str
    blocks: List[Block]

    @property
    def cells(self) -> List[Cell]:
        cells: List[Cell] = []
        previous: Optional[Block] = None
        for block in self.blocks:
            if block.kind == "code":
                cells.append(Cell(len(cells) + 1, block.line, block.text))
            elif block.kind == "output" and previous is not None and previous.kind == "code":
                cells[-1].shown_output = block.text
            previous = block
        return cells


def seed_path(name: str) -> Path:
    """A seed by path, or by its number ("3", "003")."""
    if name.isdigit():
        found = sorted(SEEDS.glob(f"{int(name):03d}_*.txt"))
        if len(found) != 1:
            raise ValueError(f"no single seed numbered {name} in {SEEDS}")
        return found[0]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"no seed file {name}")
    return path


# --- Python text ------------------------------------------------------------------------------

_COMPOUND = re.compile(r"(async\s+)?(def|class|for|while|if|elif|else|try|except|finally|with)\b")
_PYTHON_LANGS = {"py", "python", "python3", ""}


def _parse(source: str) -> Optional[ast.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prose tried as Python may hold invalid escapes
        try:
            return ast.parse(source)
        except (SyntaxError, ValueError):
            return None


class _Brackets:
    """Open brackets and an open triple-quoted string, fed one physical line at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""

    @property
    def open(self) -> bool:
        return self.depth > 0 or bool(self.quote)

    def feed(self, line: str) -> None:
        i = 0
        while i < len(line):
            if self.quote:
                end = line.find(self.quote, i)
                if end < 0:
                    return
                i, self.quote = end + 3, ""
                continue
            c = line[i]
            if c == "#":
                return
            if line.startswith(('"""', "'''"), i):
                self.quote, i = line[i : i + 3], i + 3
                continue
            if c in "'\"":
                j = i + 1
                while j < len(line) and line[j] != c:
                    j += 2 if line[j] == "\\" else 1
                i = j + 1
                continue
            self.depth += (c in "([{") - (c in ")]}")
            i += 1


def _logical_lines(lines: Sequence[str]) -> List[List[str]]:
    """Physical lines grouped into logical lines (a group ends where brackets and strings close)."""
    groups: List[List[str]] = []
    brackets = _Brackets()
    for line in lines:
        if groups and (brackets.open and brackets.depth >= 0):
            groups[-1].append(line)
        else:
            groups.append([line])
        brackets.feed(line)
    return groups


def _names(statement: str, opener: bool) -> Set[str]:
    """Every name a statement mentions (f-strings included)."""
    tree = _parse(statement.strip() + ("\n    pass" if opener else ""))
    if tree is None:
        return set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", statement))
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    return found


@dataclass
class _Open:
    keyword: str
    names: Set[str] = field(default_factory=set)  # `for`: its targets and the names bound in its body
    statements: int = 0


def _is_opener(text: str) -> bool:
    return bool(_COMPOUND.match(text)) and re.sub(r"#[^'\"]*$", "", text).rstrip().endswith(":")


def reindent(lines: Sequence[str]) -> List[str]:
    """Restore the indentation that the HTML-to-text dump of the English tutorial (003) lost.

    The rule works on logical lines (brackets and triple quotes joined) and keeps a stack of
    open blocks; a statement goes at the depth of that stack:
    - a logical line that starts with a compound keyword and ends with ':' opens a block: the
      next statement is indented into it;
    - ``return`` ends its function: the next statement leaves the function, and leaves an
      enclosing class too unless it is a ``def``/``class``/decorator (a class body holds
      only definitions);
    - a ``def``/``class``/decorator inside a function body that already has statements is
      a sibling of that function (the next method of a class), not a nested definition;
    - ``elif``/``else``/``except``/``finally`` close the body before them;
    - a ``for`` body continues while each statement mentions a loop variable or a name bound
      earlier in the loop body; the first statement that mentions none is after the loop;
    - other blocks run to the end of the cell (the tutorial has no other kind).
    Comment lines go at the current depth; continuation lines inside brackets are indented
    one step per open bracket (Python ignores it; it restores the usual layout); lines inside
    a triple-quoted string are left as they are, so the string is not changed.
    """
    out: List[str] = []
    stack: List[_Open] = []
    function_ended = False
    for group in _logical_lines([line.strip() for line in lines]):
        head = group[0]
        if not head or head.startswith("#"):
            out.extend(" " * 4 * len(stack) + line for line in group)
            continue
        keyword_match = _COMPOUND.match(head)
        keyword = "@" if head.startswith("@") else (keyword_match.group(2) if keyword_match else "")
        definition = keyword in ("def", "class", "@")
        statement = "\n".join(group)
        opener = _is_opener(statement)
        if function_ended:
            while stack and stack.pop().keyword != "def":
                pass
            while stack and stack[-1].keyword == "class" and not definition:
                stack.pop()
            function_ended = False
        functions = [k for k, block in enumerate(stack) if block.keyword == "def"]
        if definition and functions and stack[functions[-1]].statements > 0:
            del stack[functions[-1] :]
        if keyword in ("elif", "else", "except", "finally") and stack:
            stack.pop()
        used = _names(statement, opener)
        while stack and stack[-1].keyword == "for" and stack[-1].statements > 0 and not used & stack[-1].names:
            stack.pop()
        indent = len(stack)
        brackets = _Brackets()
        for k, line in enumerate(group):
            if k == 0:
                depth = 0
            elif brackets.quote:
                out.append(line)
                brackets.feed(line)
                continue
            else:
                depth = brackets.depth - bool(re.match(r"[)\]}]", line))
            out.append(" " * 4 * (indent + depth) + line)
            brackets.feed(line)
        if stack:
            stack[-1].statements += 1
        bound = _bound_names(_parse(statement + ("\n    pass" if opener else "")))
        for block in stack:
            if block.keyword == "for":
                block.names |= bound
        if opener:
            stack.append(_Open(keyword, _loop_targets(statement) if keyword == "for" else set()))
        function_ended = keyword == "" and re.match(r"return\b", head) is not None
    return out


def _loop_targets(header: str) -> Set[str]:
    tree = _parse(header.strip() + "\n    pass")
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.AsyncFor))] if tree is not None else []
    return {n.id for n in ast.walk(loops[0].target) if isinstance(n, ast.Name)} if loops else set()


def _bound_names(tree: Optional[ast.AST]) -> Set[str]:
    """Names a cell assigns (not imports): its notebook variables."""
    if tree is None:
        return set()
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names | {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


_NAME_ONLY = (ast.Name, ast.Attribute, ast.Tuple, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare)
_OPERATORS = (ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.expr_context)


def _is_prose(statement: ast.stmt, variables: Set[str]) -> bool:
    """A heading or API name the page put on a line of its own ('Shortcuts', 'torch.nn.Embedding',
    'PyTorchKorea @ GitHub', 'parameters,'): an expression of names, operators and commas, none
    of them a notebook variable. A variable an earlier cell assigned ('ebc',
    'sharded_ebc._lookups') makes a display cell."""
    if not isinstance(statement, ast.Expr):
        return False
    nodes = list(ast.walk(statement.value))
    if not all(isinstance(n, _NAME_ONLY + _OPERATORS) for n in nodes):
        return False
    return not any(isinstance(n, ast.Name) and n.id in variables for n in nodes)


def _printed_literals(tree: ast.Module) -> List[str]:
    """The fixed text at the start of each print(...) of a cell ('Weights:', 'Graph Module Created!')."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):
                head = []
                for part in arg.values:
                    if not isinstance(part, ast.Constant):
                        break
                    head.append(part.value)
                text = "".join(head)
            else:
                text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
            text = text.strip()
            if len(text) >= 2 and re.search(r"[\s:!]", text):
                found.append(text)
    return found


def _prints_source(tree: ast.Module) -> bool:
    """print(inspect.getsource(...)) or print(<graph module>.code)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Attribute) and arg.attr == "code":
                return True
            if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "getsource":
                return True
    return False


# --- the seed formats -------------------------------------------------------------------------


def _code_or_none(text: str) -> Optional[str]:
    text = textwrap.dedent(text).strip("\n")
    tree = _parse(text)
    return text if tree is not None and tree.body else None


def _extract_markdown(lines: List[str]) -> List[Block]:
    """Markdown (000, 002): ``` fences. A py/python fence that parses is a cell; one that does not
    is the output of the cell right before it when only blank lines separate them (the sharding
    tutorial's plans), else not Python (a conda snippet, an ASCII table). Other fences are shell."""
    blocks: List[Block] = []
    i, after_code = 0, False
    while i < len(lines):
        fence = re.match(r"```\s*([\w+-]*)\s*$", lines[i])
        if not fence:
            after_code = after_code and not lines[i].strip()
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if re.match(r"```\s*$", lines[j])), len(lines))
        text, lang = "\n".join(lines[i + 1 : end]), fence.group(1).lower()
        code = _code_or_none(text) if lang in _PYTHON_LANGS else None
        if code is not None:
            blocks.append(Block("code", code, i + 2))
        elif lang in _PYTHON_LANGS and after_code:
            blocks.append(Block("output", text.strip("\n"), i + 2))
        else:
            blocks.append(Block("skipped", text.strip("\n"), i + 2, "not Python" if lang in _PYTHON_LANGS else f"{lang} block"))
        after_code = code is not None
        i = end + 1
    return blocks


def _extract_rst(lines: List[str]) -> List[Block]:
    """reStructuredText (001): ``.. code:: python`` directives are cells; other directives
    (``.. code:: shell``) and ``::`` literal blocks (ASCII tables) are not run."""
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        directive = re.match(r"(\s*)\.\. (?:code|code-block|sourcecode)::\s*(\S*)\s*$", lines[i])
        literal = not directive and lines[i].rstrip().endswith("::") and not lines[i].lstrip().startswith("..")
        if not (directive or literal):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        text = textwrap.dedent("\n".join(lines[i + 1 : j])).strip("\n")
        lang = directive.group(2).lower() if directive else "literal"
        code = _code_or_none(text) if lang in ("python", "py", "python3") else None
        if code is not None:
            blocks.append(Block("code", code, i + 3))
        else:
            blocks.append(Block("skipped", text, i + 2, "not Python" if lang.startswith("py") else f"{lang} block"))
        i = j
    return blocks


def _extract_paragraphs(lines: List[str]) -> List[Block]:
    """Plain text with blank lines between paragraphs (004). A paragraph is code when it parses
    and is not prose by ``_is_prose``; leading lines that keep it from parsing (an ASCII table
    printed right above the code) are dropped. Consecutive code paragraphs are one cell, as
    they were one block on the page. Prose, tables and shell lines do not parse."""
    blocks: List[Block] = []
    variables: Set[str] = set()
    previous_code = False
    i = 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
        is_code = False
        for k in range(i, end):
            source = textwrap.dedent("\n".join(lines[k:end]))
            tree = _parse(source)
            if tree is None or not tree.body or _is_prose(tree.body[0], variables):
                continue
            if k > i:
                blocks.append(Block("skipped", "\n".join(lines[i:k]), i + 1, "not Python"))
            if previous_code and k == i:
                blocks[-1].text += "\n\n" + source.strip("\n")
            else:
                blocks.append(Block("code", source.strip("\n"), k + 1))
            variables |= _bound_names(tree)
            is_code = True
            break
        previous_code = is_code
        i = end
    return blocks


_WARNING = re.compile(r"\S+:\d+: \w*Warning:")  # a Python warning's first line; its message follows
_LOG_RECORD = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]*:")
_SENTENCE = re.compile(r"[A-Za-z][\w’']*[,;]? [A-Za-z][\w’']*[,;]? [A-Za-z][\w’']*[,;]? [A-Za-z]")


def _headings(lines: Sequence[str]) -> Set[int]:
    """Headings end with '¶'; one the dump split ends with a line that is only '¶'."""
    found = {i for i, line in enumerate(lines) if line.rstrip().endswith("¶")}
    return found | {i - 1 for i in found if lines[i].strip() == "¶" and i > 0}


def _run_end(lines: Sequence[str], start: int, stop: Set[int], code: bool) -> int:
    """End of the longest run of lines from ``start`` that re-indents into valid Python.

    For a code cell (``code``) the run also stops before a line that starts with the fixed
    text of one of the cell's print calls (its output begins), before a shell line ('!'), and,
    in a cell that prints source code, before a def/class/decorator line (the printed source)."""
    best, j = start, start
    brackets = _Brackets()
    printed: List[str] = []
    prints_source = False
    while j < len(lines) and j not in stop:
        line = lines[j].strip()
        if code and j > start and not brackets.open:
            if re.match(r"!\w", line) or any(line.startswith(p) for p in printed):
                break
            if prints_source and re.match(r"(async\s+)?(def|class)\b|@", line):
                break
        brackets.feed(line)
        j += 1
        if brackets.depth < 0:
            break
        if brackets.open:
            continue
        text = reindent(lines[start:j])
        statements = [g for g in _logical_lines([s.strip() for s in lines[start:j]]) if g[0] and not g[0].startswith("#")]
        if statements and (statements[-1][0].startswith("@") or _is_opener("\n".join(statements[-1]))):
            continue  # a block header waits for its body
        tree = _parse("\n".join(text))
        if tree is None:
            break
        best = j
        if code:
            printed, prints_source = _printed_literals(tree), _prints_source(tree)
    return best


def _extract_flat(lines: List[str]) -> List[Block]:
    """An HTML page dumped with no blank lines and no indentation (003): code, output and prose
    interleave line by line. Headings end with '¶'. A cell starts at a line from which a run of
    lines re-indents (``reindent``) into valid Python whose first statement is not prose
    (``_is_prose``), and is the longest such run (see ``_run_end`` for where it stops early).

    What follows a cell up to the next heading or prose line is its output: runs that parse as
    Python (printed source, reprs such as ``torch.Size([2, 128])``), a Python warning and its
    message line, logging records, and lines starting with the cell's printed text are output;
    otherwise a line with four words in a row is prose. Lines starting with '!' are Colab shell
    commands."""
    blocks: List[Block] = []
    stop = _headings(lines)
    variables: Set[str] = set()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if i in stop or not line:
            i += 1
            continue
        if re.match(r"!\w", line):
            j = i
            while j < len(lines) and re.match(r"!\w", lines[j]):
                j += 1
            blocks.append(Block("skipped", "\n".join(lines[i:j]), i + 1, "shell commands (Colab setup)"))
            i = j
            continue
        end = _run_end(lines, i, stop, code=True)
        tree = _parse("\n".join(reindent(lines[i:end]))) if end > i else None
        if tree is None or not tree.body or _is_prose(tree.body[0], variables):
            i += 1
            continue
        blocks.append(Block("code", "\n".join(reindent(lines[i:end])), i + 1))
        variables |= _bound_names(tree)
        printed = _printed_literals(tree)
        j = end
        while j < len(lines) and j not in stop:
            text = lines[j].strip()
            run = _run_end(lines, j, stop, code=False)
            if run > j:
                j = run
            elif _WARNING.match(text):
                j += 2
            elif _LOG_RECORD.match(text) or any(text.startswith(p) for p in printed) or not _SENTENCE.search(text):
                j += 1
            else:
                break
        if j > end:
            blocks.append(Block("output", "\n".join(lines[end:j]), end + 1))
        i = j
    return blocks


def extract(path: Path) -> Tutorial:
    """The blocks of a seed, by its format: Markdown fences, reStructuredText directives, plain
    text in paragraphs, or a flattened HTML page (no blank line at all)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if re.search(r"^```", text, re.M):
        fmt, blocks = "markdown", _extract_markdown(lines)
    elif re.search(r"^\s*\.\. (code|code-block|sourcecode)::", text, re.M):
        fmt, blocks = "rst", _extract_rst(lines)
    elif re.search(r"\n[ \t]*\n", text):
        fmt, blocks = "paragraphs", _extract_paragraphs(lines)
    else:
        fmt, blocks = "flat", _extract_flat(lines)
    return Tutorial(path, text, fmt, blocks)


# --- rewriting --------------------------------------------------------------------------------


def import_map(page: Path = ROOT / "docs" / "torchrec.md") -> Dict[str, str]:
    """The torchrec -> recship module table of docs/torchrec.md."""
    found = re.search(r"<!-- torchrec-import-map -->(.*?)<!-- /torchrec-import-map -->", page.read_text(encoding="utf-8"), re.S)
    rows = re.findall(r"^\|\s*`(torchrec[\w.]*)`\s*\|\s*`(recship[\w.]*)`\s*\|", found.group(1) if found else "", re.M)
    if not rows:
        raise ValueError(f"no torchrec import map between the markers in {page}")
    return dict(rows)


def map_module(path: str, table: Dict[str, str]) -> str:
    """The recship module for a torchrec module path: the entry of its longest prefix, with the rest of the path kept
    where recship has that submodule (``torchrec.metrics.ne`` -> ``recship.metrics.ne``)."""
    import importlib.util

    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in table:
            target, rest = table[".".join(parts[:k])], parts[k:]
            if rest:
                try:
                    if importlib.util.find_spec(".".join([target, *rest])) is not None:
                        return ".".join([target, *rest])
                except ImportError:  # the entry's module is not a package
                    pass
            return target
    raise ValueError(f"the import map (docs/torchrec.md) has no entry for {path!r}")


def _replace(source: str, edits: Iterable[tuple]) -> str:
    """Apply (node, new text) edits; ast positions count UTF-8 bytes within a line."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    spans = sorted(((offset(s[0], s[1]), offset(e[0], e[1]), text) for s, e, text in edits), reverse=True)
    for begin, end, text in spans:
        source = source[:begin] + text + source[end:]
    return source


def _span(node: ast.AST) -> tuple:
    return (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)


SNIPPETS = Path(__file__).resolve().parents[1] / "snippets"  # TorchRec user code of the tests (not .py: torchrec is no dependency)


def run_snippet(name: str, forbid_torchrec: bool = False, label: str = "user_code") -> Dict[str, object]:
    """Runs tests/snippets/<name>.txt with its imports rewritten by the import map (docs/torchrec.md); returns its globals.
    ``forbid_torchrec``: the rewritten code must not mention torchrec any more."""
    code = rewrite_imports((SNIPPETS / f"{name}.txt").read_text(), import_map())
    if forbid_torchrec:
        assert "torchrec" not in code
    scope: Dict[str, object] = {}
    exec(compile(code, label, "exec"), scope)
    return scope


def rewrite_imports(source: str, table: Dict[str, str]) -> str:
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "torchrec":
            segment = ast.get_source_segment(source, node)
            edits.append((*_span(node), re.sub(r"^from\s+[\w.\s]+?(?=\s+import\b)", f"from {map_module(node.module, table)}", segment)))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torchrec" for a in node.names):
            names = []
            for alias in node.names:
                if alias.name.split(".")[0] != "torchrec":
                    names.append(alias.name + (f" as {alias.asname}" if alias.asname else ""))
                elif alias.asname or alias.name == "torchrec":
                    names.append(f"{map_module(alias.name, table)} as {alias.asname or 'torchrec'}")
                else:
                    raise ValueError(f"cannot rewrite 'import {alias.name}' without an alias")
            edits.append((*_span(node), "import " + ", ".join(names)))
    return _replace(source, edits)


def rewrite_device(source: str) -> str:
    tree = ast.parse(source)
    compared = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Compare) for n in [node.left, *node.comparators]}
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            quote = ast.get_source_segment(source, node)[-1]
            if re.fullmatch(r"cuda(:\d+)?", node.value):
                edits.append((*_span(node), f"{quote}cpu{quote}"))
            elif node.value == "nccl" and id(node) not in compared:
                edits.append((*_span(node), f"{quote}gloo{quote}"))
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            if len(parts) == 2 and isinstance(parts[0], ast.Constant) and parts[0].value == "cuda:" and isinstance(parts[1], ast.FormattedValue):
                edits.append((*_span(node), '"cpu"'))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args and not node.keywords:
            end = (node.func.end_lineno, node.func.end_col_offset)
            edits.append(((end[0], end[1] - len("cuda")), end, "cpu"))
    return _replace(source, edits)


def _colab_only(source: str) -> str:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "path" and isinstance(t.value, ast.Name) and t.value.id == "sys" for t in node.targets
        ):
            return "Colab only: resets sys.path"
    return ""


@dataclass
class CellRun:
    cell: Cell
    source: str  # what runs
    skip: str = ""  # why it does not run
    probe: bool = False  # added by the caller after the tutorial's cells


def prepare(tutorial: Tutorial, extra: Sequence[str] = ()) -> List[CellRun]:
    """The tutorial's cells with the imports and device rewritten, then the caller's extra cells."""
    table = import_map()
    runs = [CellRun(cell, rewrite_device(rewrite_imports(cell.source, table)), _colab_only(cell.source)) for cell in tutorial.cells]
    for source in extra:
        runs.append(CellRun(Cell(len(runs) + 1, 0, source), source, probe=True))
    return runs


# --- running ----------------------------------------------------------------------------------


@dataclass
class CellResult:
    run: CellRun
    status: str  # "ok" | "error" | "skipped" | "not run"
    stdout: str = ""
    stderr: str = ""  # warnings and logs
    error: str = ""  # traceback, or why it did not run

    @property
    def error_line(self) -> str:
        lines = [line for line in self.error.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    @property
    def title(self) -> str:
        where = "probe added by the test" if self.run.probe else f"line {self.run.cell.line}"
        return f"cell {self.run.cell.number} ({where})"


def run(tutorial: Tutorial, extra: Sequence[str] = (), timeout: float = TIMEOUT_S) -> List[CellResult]:
    """Run the cells in a fresh interpreter; one result per cell, in order."""
    runs = prepare(tutorial, extra)
    marker = f"@@ recship-notebook {uuid.uuid4().hex}"
    todo = [r for r in runs if not r.skip]
    with tempfile.TemporaryDirectory() as tmp:
        payload = Path(tmp) / "cells.json"
        cells = [
            {"number": r.cell.number, "source": r.source, "filename": f"<cell {r.cell.number}: {tutorial.path.name}:{r.cell.line}>"}
            for r in todo
        ]
        payload.write_text(json.dumps({"marker": marker, "cells": cells}))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        command = [sys.executable, str(Path(__file__).resolve()), "--child", str(payload)]
        with open(Path(tempfile.gettempdir()) / "recship-tutorials-port-29500.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                out, err = proc.communicate(timeout=timeout)
                ended = f"the interpreter exited with code {proc.returncode}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and the ranks it spawned
                out, err = proc.communicate()
                ended = f"timed out after {timeout:.0f} s"
    stdout = _split(out, marker)
    stderr = _split(err, marker)
    finished = "end" in stdout
    started = [k for k in stdout if k.startswith("cell")]
    if not started and todo:
        started = [f"cell {todo[0].cell.number}"]  # the interpreter died before its first cell
    results = []
    for r in runs:
        key = f"cell {r.cell.number}"
        cell_out, cell_err = "\n".join(stdout.get(key, [])), "\n".join(stderr.get(key, []))
        if r.skip:
            results.append(CellResult(r, "skipped", error=r.skip))
        elif f"error {r.cell.number}" in stdout:
            results.append(CellResult(r, "error", cell_out, cell_err, "\n".join(stdout[f"error {r.cell.number}"])))
        elif not finished and key == started[-1]:
            tail = "\n".join((stderr.get(key) or stderr[""])[-20:])
            results.append(CellResult(r, "error", cell_out, cell_err, f"{tail}\n{ended}"))
        elif key not in stdout:
            results.append(CellResult(r, "not run", error="an earlier cell stopped the run"))
        else:
            results.append(CellResult(r, "ok", cell_out, cell_err))
    return results


def _split(stream: bytes, marker: str) -> Dict[str, List[str]]:
    """A stream's lines by the marker before them: 'cell 3', 'error 3' (its traceback), 'end'."""
    parts: Dict[str, List[str]] = {"": []}
    current = parts[""]
    for line in stream.decode("utf-8", "replace").splitlines():
        if line.startswith(marker):
            current = parts.setdefault(line[len(marker) :].strip(), [])
        else:
            current.append(line)
    return parts


def _child(payload: Path) -> None:
    """The run's interpreter: each cell in one fresh ``__main__`` namespace; the last expression
    of a cell is displayed with repr(), as a notebook does."""
    import linecache
    import traceback
    import types

    import torch

    spec = json.loads(payload.read_text())
    marker = spec["marker"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    torch.manual_seed(42)
    for cell in spec["cells"]:
        source, filename = cell["source"], cell["filename"]
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        print(f"{marker} cell {cell['number']}", flush=True)
        print(f"{marker} cell {cell['number']}", file=sys.stderr, flush=True)
        try:
            tree = ast.parse(source, filename)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, filename, "exec"), main.__dict__)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), filename, "eval"), main.__dict__)
                if value is not None:
                    print(repr(value))
        except Exception:
            sys.stdout.flush()
            sys.stderr.flush()
            print(f"{marker} error {cell['number']}", flush=True)
            traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        sys.stderr.flush()
    print(f"{marker} end", flush=True)


# --- command line -----------------------------------------------------------------------------


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ") if text else "    (nothing)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tutorials.notebook", description=__doc__.splitlines()[0])
    parser.add_argument("seed", help="a seed file, or its number (0-4)")
    parser.add_argument("--show", action="store_true", help="print each cell's source, stdout and traceback")
    parser.add_argument("--extract", action="store_true", help="only print the cells found and the output the tutorial shows")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds for the whole tutorial")
    args = parser.parse_args(argv)
    try:
        tutorial = extract(seed_path(args.seed))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cells = tutorial.cells
    print(f"{tutorial.path.name}: {tutorial.format}, {len(cells)} cells")
    if args.extract:
        for block in tutorial.blocks:
            if block.kind == "code":
                number = next(c.number for c in cells if c.line == block.line)
                print(f"\n=== cell {number} (line {block.line}) ===\n{block.text}")
            elif block.kind == "output":
                print(f"--- shown output (line {block.line}) ---\n{_indent(block.text)}")
            else:
                print(f"··· not run (line {block.line}): {block.note}: {block.text.splitlines()[0] if block.text else ''}")
        return 0
    results = run(tutorial, timeout=args.timeout)
    for result in results:
        if args.show:
            print(f"\n=== {result.title}: {result.status} ===\n{result.run.source}")
            print(f"--- stdout ---\n{_indent(result.stdout)}")
            if result.stderr:
                print(f"--- stderr ---\n{_indent(result.stderr)}")
            if result.error:
                print(f"--- {'error' if result.status == 'error' else 'note'} ---\n{_indent(result.error)}")
        else:
            print(f"{result.title}: {result.status}" + (f": {result.error_line}" if result.error else ""))
    failed = [r for r in results if r.status in ("error", "not run")]
    print(f"\n{len(results) - len(failed)} of {len(results)} cells ran or were skipped; {len(failed)} failed or did not run")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(Path(sys.argv[2]))
    else:
        sys.exit(main())
