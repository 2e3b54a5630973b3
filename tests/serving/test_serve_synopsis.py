"""The ``recship serve`` synopses (docs/serving.md, serving/server.py) imply no default the flags do not have: a
value shown in ``[--flag VALUE]`` is the flag's default, ``[--flag a|b]`` lists its choices default first, and a
flag off by default shows a placeholder (``[--metrics-port PORT]``)."""

import argparse
import re
from pathlib import Path

import pytest

from recship.serving import server
from recship.serving.cli import add_arguments

ROOT = Path(__file__).resolve().parents[2]


def _docs_synopsis() -> str:
    text = (ROOT / "docs" / "serving.md").read_text()
    block = re.search(r"```\n(recship serve --model-repo.*?)```", text, re.S)
    assert block is not None, "docs/serving.md has no recship serve synopsis"
    return block.group(1).split("\nrecship predict")[0]


def _server_synopsis() -> str:
    return next(line for line in server.__doc__.splitlines() if line.strip().startswith("recship serve"))


@pytest.mark.parametrize("where", ["docs/serving.md", "serving/server.py"])
def test_a_value_in_the_synopsis_is_the_flags_default(where):
    synopsis = _docs_synopsis() if where == "docs/serving.md" else _server_synopsis()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    shown = re.findall(r"\[(--[a-z-]+) ([^\s\[\]]+)", synopsis)
    assert len(shown) >= 4, synopsis
    for flag, value in shown:
        action = actions[flag]
        if value.isupper() or flag == "--config":  # a placeholder (PORT, N, PEM), or an example file name
            continue
        if "|" in value:
            names = value.split("|")
            assert set(names) == set(action.choices), f"{where}: {flag} {value}: the choices are {action.choices}"
            assert names[0] == action.default, f"{where}: {flag} {value} shows {names[0]} first, the default is {action.default}"
        else:
            default = action.default
            assert default is not None, f"{where}: [{flag} {value}] reads as a default, but {flag} is off by default"
            same = float(value) == default if isinstance(default, (int, float)) else value == default
            assert same, f"{where}: [{flag} {value}] reads as a default; the default is {default}"
