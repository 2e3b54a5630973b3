"""Writes torchrec_1.8.0.json: TorchRec's public API (names, parameters, defaults, dataclass fields, enum members)
for the modules TorchRec users import. Run once, with TorchRec 1.8.0 installed in a throwaway venv (never a
dependency of recship or of its tests; ../shared/STACK.md says how):

    /tmp/trec/bin/python tests/api_parity/generate.py

tests/test_torchrec_parity.py reads the JSON, and describes recship's side with this file's ``default_json`` (which
needs no TorchRec).
"""

import dataclasses
import enum
import importlib
import importlib.util
import inspect
import json
import pkgutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

OUT = Path(__file__).resolve().parent / "torchrec_1.8.0.json"
# modules users import (issue 38); packages are walked
MODULES = ["torchrec", "torchrec.fx", "torchrec.distributed", "torchrec.distributed.model_parallel",
           "torchrec.distributed.planner", "torchrec.distributed.planner.types", "torchrec.distributed.planner.enumerators",
           "torchrec.distributed.planner.partitioners", "torchrec.distributed.planner.proposers",
           "torchrec.distributed.planner.shard_estimators", "torchrec.distributed.planner.storage_reservations",
           "torchrec.distributed.planner.planners", "torchrec.distributed.sharding_plan", "torchrec.distributed.types",
           "torchrec.distributed.embeddingbag", "torchrec.distributed.embedding", "torchrec.distributed.train_pipeline",
           "torchrec.distributed.comm", "torchrec.distributed.test_utils.test_model"]
PACKAGES = ["torchrec.sparse", "torchrec.modules", "torchrec.optim", "torchrec.quant", "torchrec.inference", "torchrec.models",
            "torchrec.datasets", "torchrec.metrics"]


def default_json(value: Any) -> Any:
    """A default as JSON: plain values as they are, an enum member as "Enum.NAME", anything else as {"repr": ...}."""
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return {"required": True}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return {"repr": type(value).__name__}


def _params(fn: Any, skip_self: bool) -> Optional[List[Dict[str, Any]]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    out = []
    for i, p in enumerate(sig.parameters.values()):
        if skip_self and i == 0 and p.name in ("self", "cls"):
            continue
        out.append({"name": p.name, "kind": p.kind.name, "default": default_json(p.default)})
    return out


def describe(obj: Any) -> Optional[Dict[str, Any]]:
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return {"kind": "enum", "members": [m.name for m in obj]}
    if inspect.isclass(obj):
        entry: Dict[str, Any] = {"kind": "class"}
        if dataclasses.is_dataclass(obj):
            entry["kind"] = "dataclass"
            entry["fields"] = [{"name": f.name, "default": default_json(f.default) if f.default_factory is dataclasses.MISSING
                                else {"factory": True}} for f in dataclasses.fields(obj) if f.init]
        elif "__init__" in vars(obj) or any("__init__" in vars(b) for b in obj.__mro__[1:] if b.__module__.startswith("torchrec")):
            entry["init"] = _params(obj.__init__, skip_self=True)
        entry["methods"] = sorted(n for n, v in vars(obj).items() if not n.startswith("_") and callable(v))
        return entry
    if inspect.isfunction(obj):
        return {"kind": "function", "params": _params(obj, skip_self=False)}
    return None


def main() -> None:
    if importlib.util.find_spec("torchrec") is None:
        sys.exit("generate.py reads TorchRec's API: run it with a Python that has torchrec 1.8.0 installed (see its docstring)")
    names = list(MODULES)
    for root in PACKAGES:
        package = importlib.import_module(root)
        names.append(root)
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            if any(part.startswith("test") or part.startswith("_") for part in info.name.split(".")):
                continue
            names.append(info.name)
    api: Dict[str, Dict[str, Any]] = {}
    skipped = {}
    for name in dict.fromkeys(names):
        try:
            module = importlib.import_module(name)
        except Exception as e:  # a module TorchRec itself cannot import here (grpc client, internal packagers)
            skipped[name] = f"{type(e).__name__}: {e}"
            continue
        entries = {}
        exported = getattr(module, "__all__", None)
        for attr in sorted(exported if exported is not None else dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            owner = getattr(obj, "__module__", "") or ""
            if not owner.startswith("torchrec"):
                if exported is None and attr.isupper() and isinstance(obj, (int, float, str, list, tuple)):
                    entries[attr] = {"kind": "constant", "value": default_json(obj)}
                continue
            entry = describe(obj)
            if entry is not None:
                entry["defined_in"] = owner
                entries[attr] = entry
        api[name] = entries
    OUT.write_text(json.dumps({"torchrec": "1.8.0", "python": sys.version.split()[0], "modules": api,
                               "not_importable": skipped}, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{OUT}: {len(api)} modules, {sum(len(v) for v in api.values())} names; {len(skipped)} modules not importable")


if __name__ == "__main__":
    main()
