"""Imports sit at the top of their module. One inside a function says why it cannot, with a ``# lazy: <reason>``
comment on its own line or in the comment lines just above its group (consecutive imports in one block).

Two reasons hold: the import keeps a torch-free path free of torch (``recship --help``, a subcommand's ``--help``,
argument errors: tests/test_cli.py's test_answers_do_not_import_torch runs each of them and checks), or it imports an
optional dependency that may be absent (matplotlib, tritonclient). An import cycle or an upward import is not one:
tests/test_layers.py counts imports inside functions too. Imports under ``if TYPE_CHECKING:`` do not run and are left out.
"""

import ast
import re
import textwrap
from typing import Iterator, List, Tuple

from test_layers import ROOT, _modules, _type_checking_nodes

_REASON = re.compile(r"#\s*lazy:\s*\S")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_IMPORTS = (ast.Import, ast.ImportFrom)


def _blocks(node: ast.AST) -> Iterator[List[ast.stmt]]:
    """The statement lists directly under ``node``: bodies, else and finally branches, except handlers, match cases."""
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block
    for inner in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
        yield inner.body


def _function_imports(tree: ast.Module) -> List[Tuple[ast.stmt, ast.stmt]]:
    """(import, first import of its group) for each import inside a function, TYPE_CHECKING blocks left out."""
    skipped = _type_checking_nodes(tree)
    found: List[Tuple[ast.stmt, ast.stmt]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for block in _blocks(node):
            first = None
            for stmt in block:
                if isinstance(stmt, _IMPORTS):
                    first = first or stmt
                    if in_function and id(stmt) not in skipped:
                        found.append((stmt, first))
                else:
                    first = None
                visit(stmt, in_function or isinstance(stmt, _FUNCTIONS))

    visit(tree, False)
    return found


def _says_why(lines: List[str], stmt: ast.stmt, first: ast.stmt) -> bool:
    """A reason on the import's own lines, or on a comment line above it: between it and its group's first import
    (the earlier imports' own comments aside), or just above the group."""
    if any(_REASON.search(line) for line in lines[stmt.lineno - 1:stmt.end_lineno]):
        return True
    for above in range(stmt.lineno - 2, -1, -1):
        text = lines[above].strip()
        if text.startswith("#"):
            if _REASON.search(text):
                return True
        elif above < first.lineno - 1:  # above the group: only comment lines count
            return False
    return False


def unexplained(source: str) -> List[int]:
    """Line numbers of the imports inside functions of ``source`` that carry no ``# lazy: <reason>``."""
    lines = source.splitlines()
    return [stmt.lineno for stmt, first in _function_imports(ast.parse(source)) if not _says_why(lines, stmt, first)]


def test_the_check_finds_an_unexplained_import_and_accepts_the_explained_ones():
    source = textwrap.dedent('''
        import json
        from typing import TYPE_CHECKING


        def plain():
            import os
            return os


        def explained(flag):
            import torch  # lazy: keeps --help torch-free
            # lazy: optional, absent from a plain install
            # (a second comment line)
            import matplotlib
            from matplotlib import figure
            if flag:
                # lazy: keeps --help torch-free
                from recship.trainer import train
            try:
                import tritonclient  # lazy: a dev dependency
            except ImportError:
                import shutil
            return torch, figure, train

        def group_ends(x):
            # lazy: keeps --help torch-free
            import torch

            from recship.export import artifact
            x += 1
            import numpy
            import sys  # lazy: not the reason for the next one
            import time
            if TYPE_CHECKING:
                import numpy.typing

        class Holder:
            def method(self):
                def inner():
                    from recship import cli  # lazy:
                    return cli
                return inner
    ''')
    lines = source.splitlines()
    assert [lines[n - 1].strip() for n in unexplained(source)] == [
        "import os", "import shutil", "import numpy", "import time", "from recship import cli  # lazy:"]


def test_every_import_inside_a_function_says_why():
    offenders = []
    for name, path in _modules().items():
        for line in unexplained(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, ("imports inside functions without a `# lazy: <reason>` comment (move them to the top of "
                           "their module, or say which torch-free path or optional dependency needs them there):\n"
                           + "\n".join(offenders))
