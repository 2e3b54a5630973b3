"""TorchRec parity, measured: every public name of the TorchRec modules users import (tests/api_parity/
torchrec_1.8.0.json, written by tests/api_parity/generate.py from TorchRec 1.8.0 itself), mapped through the
import map (docs/torchrec.md), is in recship with TorchRec's parameters (names, kinds, defaults), dataclass fields and enum
members, or listed in tests/api_parity/missing.txt.

missing.txt is a ratchet while parity is being built: a name that is missing or differs and is not listed fails
(a regression, or a new gap), and so does a listed name that now matches (take it off the list). The figure
(present / missing) is printed; docs/torchrec.md ("Parity, measured") states it.
"""

import fnmatch
import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

from api_parity.generate import default_json

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "tests" / "api_parity" / "torchrec_1.8.0.json"
MISSING = ROOT / "tests" / "api_parity" / "missing.txt"
PAGE = ROOT / "docs" / "torchrec.md"  # the import map, the absent-on-purpose table and the parity figure


def import_map() -> Dict[str, str]:
    """The import map of docs/torchrec.md: TorchRec module prefix -> recship module."""
    text = PAGE.read_text()
    block = text.split("<!-- torchrec-import-map -->")[1].split("<!-- /torchrec-import-map -->")[0]
    return dict(re.findall(r"\| `([\w.]+)` \| `([\w.]+)` \|", block))


def mapped(module: str, table: Dict[str, str]) -> Optional[str]:
    """``module`` rewritten by its longest prefix in the map (whole dotted components), or None: the rest of the path
    is kept where recship has that submodule (``torchrec.metrics.ne`` -> ``recship.metrics.ne``), else the entry's
    module holds it."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in table:
            return _keep_rest(table[prefix], parts[i:])
    return None


def _keep_rest(target: str, rest: List[str]) -> str:
    import importlib.util

    if rest:
        try:
            if importlib.util.find_spec(".".join([target, *rest])) is not None:
                return ".".join([target, *rest])
        except ImportError:  # ``target`` is a module, not a package
            pass
    return target


def _params(fn: Any) -> Optional[List[Tuple[str, str, Any]]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind.name, default_json(p.default)) for p in sig.parameters.values() if p.name not in ("self", "cls")]


def _want(entry: List[Dict[str, Any]]) -> List[Tuple[str, str, Any]]:
    return [(p["name"], p["kind"], p["default"]) for p in entry if p["name"] not in ("self", "cls")]


def _same_defaults(want: Any, got: Any) -> bool:
    if isinstance(want, dict) and "repr" in want:  # an object default (a module, a factory): its presence is what counts
        return not (isinstance(got, dict) and got.get("required"))
    return want == got


def difference(entry: Dict[str, Any], obj: Any) -> Optional[str]:
    """Why recship's ``obj`` differs from TorchRec's ``entry`` (None: it matches)."""
    import dataclasses
    import enum

    kind = entry["kind"]
    if kind == "enum":
        if not (inspect.isclass(obj) and issubclass(obj, enum.Enum)):
            return "not an enum"
        absent = [m for m in entry["members"] if m not in obj.__members__]
        return f"members {absent} absent" if absent else None
    if kind == "dataclass":
        if not dataclasses.is_dataclass(obj):
            return "not a dataclass"
        have = {f.name: f for f in dataclasses.fields(obj) if f.init}
        absent = [f["name"] for f in entry["fields"] if f["name"] not in have]
        return f"fields {absent} absent" if absent else None
    if kind == "constant":
        return None if default_json(obj) == entry["value"] or isinstance(entry["value"], dict) else f"value {default_json(obj)!r}"
    want = entry.get("params") if kind == "function" else entry.get("init")
    if want is None:
        return None
    got = _params(obj if kind == "function" else obj.__init__)
    if got is None:
        return None
    want_t, got_by_name = _want(want), {p[0]: p for p in got}
    varkw = any(p[1] == "VAR_KEYWORD" for p in got)
    for name, pkind, default in want_t:
        if pkind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            continue
        if name not in got_by_name:
            if varkw:
                continue
            return f"parameter {name!r} absent"
        if not _same_defaults(default, got_by_name[name][2]):
            return f"parameter {name!r} defaults to {got_by_name[name][2]!r}, TorchRec's to {default!r}"
    return None


def counted(api: Dict[str, Dict[str, Any]]) -> List[Tuple[str, str, Dict[str, Any]]]:
    """(module, name, entry) once per TorchRec object, at the path users import it from: a module's own names, and a
    package's re-exports (``torchrec.distributed.DistributedModelParallel``). A name a plain module merely imports is
    an implementation detail of that module (PEP 8) and is counted where it is defined; one defined in a module outside
    the survey is counted once, under the surveyed module nearest to where it is defined (the longest shared dotted prefix;
    ties: the first in sorted order)."""
    packages = {m for m in api if any(other.startswith(m + ".") for other in api)}
    out, importers = [], {}
    for module in sorted(api):
        for name, entry in sorted(api[module].items()):
            home = entry.get("defined_in", module)
            if module in packages or home == module:
                out.append((module, name, entry))
            elif not (home in api and name in api[home]):
                importers.setdefault((home, name), []).append((module, entry))
    for (home, name), found in sorted(importers.items()):
        module, entry = min(found, key=lambda f: (-_shared_prefix(f[0], home), f[0]))
        out.append((module, name, entry))
    return out


def _shared_prefix(a: str, b: str) -> int:
    """How many leading dotted components ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def survey() -> Tuple[int, Dict[str, str]]:
    """(names present and matching, {"module:name": why not} for the others)."""
    api = json.loads(API.read_text())["modules"]
    table = import_map()
    present, gaps = 0, {}
    modules: Dict[str, Any] = {}
    for module, name, entry in counted(api):
        key = f"{module}:{name}"
        target = mapped(module, table)
        if target is None:
            gaps[key] = "module not mapped"
            continue
        if target not in modules:
            try:
                modules[target] = importlib.import_module(target)
            except ImportError:
                modules[target] = None
        if modules[target] is None:
            gaps[key] = f"{target} not importable"
        elif not hasattr(modules[target], name):
            gaps[key] = f"absent from {target}"
        else:
            why = difference(entry, getattr(modules[target], name))
            if why:
                gaps[key] = why
            else:
                present += 1
    return present, gaps


def absent_on_purpose() -> Dict[str, str]:
    """docs/torchrec.md's table of TorchRec names recship leaves out on purpose: ``module:name`` pattern (fnmatch) -> why
    (a row's first cell may hold several patterns, each in backticks)."""
    text = PAGE.read_text()
    block = text.split("<!-- torchrec-absent -->")[1].split("<!-- /torchrec-absent -->")[0]
    out = {}
    for cell, why in re.findall(r"^\| (`[^|]+`) \| (.+?) \|$", block, re.M):
        for pattern in re.findall(r"`([^`]+)`", cell):
            out[pattern] = why
    return out


def classify() -> Tuple[int, Dict[str, str], Dict[str, str]]:
    """(present, {key: pattern} absent on purpose, {key: why} missing)."""
    present, gaps = survey()
    patterns = absent_on_purpose()
    on_purpose, missing = {}, {}
    for key, why in gaps.items():
        hit = next((p for p in patterns if fnmatch.fnmatchcase(key, p)), None)
        if hit is None:
            missing[key] = why
        else:
            on_purpose[key] = hit
    return present, on_purpose, missing


def listed() -> Dict[str, str]:
    out = {}
    for line in MISSING.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, why = line.partition("\t")
            out[key] = why
    return out


def figure(present: int, on_purpose: int, missing: int) -> str:
    return (f"**{present} of {present + on_purpose + missing} public names** are in recship with TorchRec's parameters, "
            f"**{on_purpose} absent on purpose**, **{missing} missing**")


def test_every_torchrec_name_is_in_recship_absent_on_purpose_or_on_the_missing_list():
    present, on_purpose, missing = classify()
    known = listed()
    print(f"\nTorchRec parity: {present} present, {len(on_purpose)} absent on purpose, {len(missing)} missing or different")
    new = sorted(set(missing) - set(known))
    assert not new, f"{len(new)} TorchRec names missing or different and not in {MISSING.name}: " + "; ".join(
        f"{k} ({missing[k]})" for k in new[:20])
    done = sorted(set(known) - set(missing))
    assert not done, f"{len(done)} names on {MISSING.name} now match TorchRec or are absent on purpose: take them off " \
        f"(python tests/test_torchrec_parity.py --write-missing): {done[:20]}"


def test_each_absent_on_purpose_row_names_absent_names_only():
    """A row of docs/torchrec.md's absent-on-purpose table matches at least one gap and no name recship has."""
    present, gaps = survey()
    api = json.loads(API.read_text())["modules"]
    keys = [f"{m}:{n}" for m, n, _ in counted(api)]
    for pattern, why in absent_on_purpose().items():
        hits = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        assert hits, f"absent-on-purpose row {pattern!r} matches no TorchRec name"
        there = [k for k in hits if k not in gaps]
        assert not there, f"absent-on-purpose row {pattern!r} matches names recship has: {there[:5]}"
        assert len(why.strip()) > 10, f"row {pattern!r} gives no reason"


def test_the_docs_state_the_parity_figure():
    present, on_purpose, missing = classify()
    assert figure(present, len(on_purpose), len(missing)) in PAGE.read_text()


def test_the_survey_can_tell_a_difference():
    """The comparison is not vacuous: a function with another default, a missing parameter and a missing enum
    member are each told apart."""
    import enum

    def f(a, b=2):  # noqa: ANN001 - a stand-in
        return a

    entry = {"kind": "function", "params": [{"name": "a", "kind": "POSITIONAL_OR_KEYWORD", "default": {"required": True}},
                                            {"name": "b", "kind": "POSITIONAL_OR_KEYWORD", "default": 3}]}
    assert "defaults to 2" in difference(entry, f)
    entry["params"].append({"name": "c", "kind": "KEYWORD_ONLY", "default": None})
    entry["params"][1]["default"] = 2
    assert "'c' absent" in difference(entry, f)

    class E(enum.Enum):
        X = 1

    assert difference({"kind": "enum", "members": ["X", "Y"]}, E) == "members ['Y'] absent"
    assert difference({"kind": "enum", "members": ["X"]}, E) is None


@pytest.mark.parametrize("module,target", [("torchrec.distributed.embeddingbag", "recship.distributed"),
                                           ("torchrec.sparse.jagged_tensor", "recship.sparse"), ("torchrec.nope", "recship")])
def test_modules_map_by_their_longest_prefix(module, target):
    assert mapped(module, import_map()) == target


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-missing"]:
        sys.exit("usage: python tests/test_torchrec_parity.py --write-missing  (rewrites missing.txt from the survey)")
    present, on_purpose, missing = classify()
    header = [line for line in MISSING.read_text().splitlines() if line.startswith("#")]
    MISSING.write_text("\n".join(header + [f"{k}\t{v}" for k, v in sorted(missing.items())]) + "\n")
    print(f"{MISSING}: {len(missing)} missing; {present} present, {len(on_purpose)} absent on purpose")
    print("docs/torchrec.md figure: " + figure(present, len(on_purpose), len(missing)))
