"""The manifest's rules that a JSON Schema cannot state (each relates two fields), run on a manifest the schema
accepted, in the order manifest.schema.json's description lists them; the C++ loader's check_rules
(cpp_loader/src/manifest.cpp) is the same list, with the same words.
"""

import json
from typing import Any, Dict, List, Optional

from recship.contract.schema import Where, Problem, field
from recship.contract.tables import ALIGN, DTYPE_SIZES, span, split_shard

INPUT_NAMES = ("dense", "lengths", "values", "weights")  # the model's inputs, in the order of its call


def derived_inputs(num_dense: Any, weighted: Any) -> Dict[str, Any]:
    """The manifest's ``inputs``: the model's signature, as num_dense and weighted make it."""
    return {
        "dense": {"dtype": "float32", "shape": ["B", num_dense]},
        "lengths": {"dtype": "int32", "shape": ["F*B"], "order": "feature-major, features in the order below"},
        "values": {"dtype": "int64", "shape": ["N"]},
        "weights": {"dtype": "float32", "shape": ["N"], "required": weighted},
    }


def compact(value: Any) -> str:
    """A JSON value as the C++ loader prints it (nlohmann's dump(): compact, keys sorted)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


class _Broken(Exception):
    def __init__(self, where: Where, rule: str, text: str) -> None:
        self.problem = Problem(where, rule, f"{field(where)} {text}" if field(where) else text)


def _fail(where: Where, rule: str, text: str) -> None:
    raise _Broken(where, rule, text)


def first_broken(m: Dict[str, Any]) -> Optional[Problem]:
    """The first rule the manifest ``m`` (which the schema accepts) breaks, or None."""
    try:
        if "tables" in m:
            _tables_layout(m["tables"])
        _features(m)
        _sample(m)
        if "tables" in m:
            _table_rows(m)
        if "aoti" in m:
            _aoti(m)
        _inputs(m)
    except _Broken as e:
        return e.problem
    return None


def _tables_layout(spec: Dict[str, Any]) -> None:
    end, names = 0, set()
    for i, t in enumerate(spec["tensors"]):
        where: Where = ("tables", "tensors", i)
        if t["name"] in names:
            _fail(where + ("name",), "tables-layout", f"{t['name']!r} names two tensors")
        names.add(t["name"])
        if len(t["shape"]) != len(t["stride"]):
            _fail(where + ("stride",), "tables-layout", "must have one entry per dimension of its shape")
        if t["bytes"] != DTYPE_SIZES[t["dtype"]] * span(t["shape"], t["stride"]):
            _fail(where + ("bytes",), "tables-layout", "must be the bytes its shape and stride span")
        if t["offset"] % ALIGN or t["offset"] < end or t["offset"] + t["bytes"] > spec["bytes"]:
            _fail(where + ("offset",), "tables-layout",
                  f"must be a multiple of {ALIGN}, after the tensor before it and inside the file")
        end = t["offset"] + t["bytes"]
        at = 0
        for j, s in enumerate(t["segments"]):
            if s["offset"] != at:
                _fail(where + ("segments", j, "offset"), "tables-layout", f"must be {at}, where the segment before it ends")
            at += s["bytes"]
        if at != t["bytes"]:
            _fail(where + ("segments",), "tables-layout", f"must cover its {t['bytes']} bytes exactly")


def _features(m: Dict[str, Any]) -> None:
    names = set()
    for i, f in enumerate(m["sparse_features"]):
        if f["name"] in names:
            _fail(("sparse_features", i, "name"), "unique-feature", f"{f['name']!r} appears twice")
        names.add(f["name"])
        if "id_bound" in f and f["id_bound"] < f["rows"]:
            _fail(("sparse_features", i, "id_bound"), "id-bound", f"must be >= rows ({f['rows']}), got {f['id_bound']}")
    weighted = m["weighted"]
    if m["sparse_features"] and weighted != any(f.get("weighted", weighted) for f in m["sparse_features"]):
        _fail(("weighted",), "weighted", "must say whether any sparse feature is weighted")


def _sample(m: Dict[str, Any]) -> None:
    """The sample is one request of this model and its outputs: each tensor's dtype and shape follow from the
    manifest (so its files' sizes do too)."""
    sample, b = m["sample"], m["sample"]["batch_size"]
    inputs, outputs = sample["inputs"], sample["outputs"]
    if m["weighted"] != ("weights" in inputs):
        _fail(("sample", "inputs", "weights"), "sample",
              "is missing (the model is weighted)" if m["weighted"] else "is given, but the model is unweighted")

    def need(group: str, name: str, dtype: str, shape: Optional[List[int]], what: str) -> None:
        spec = sample[group][name]  # shape None: any one dimension
        if spec["dtype"] != dtype or (spec["shape"] != shape if shape is not None else len(spec["shape"]) != 1):
            _fail(("sample", group, name), "sample", f"must be {dtype} {shape if shape is not None else '[N]'} ({what}), "
                  f"got {spec['dtype']} {spec['shape']}")

    need("inputs", "dense", "float32", [b, m["num_dense"]], "batch_size, num_dense")
    need("inputs", "lengths", "int32", [len(m["sparse_features"]) * b], "features x batch_size")
    need("inputs", "values", "int64", None, "one dimension")
    if "weights" in inputs:
        need("inputs", "weights", "float32", inputs["values"]["shape"], "one per value")
    if sorted(outputs) != sorted(m["outputs"]):
        _fail(("sample", "outputs"), "sample", f"must hold every output, {sorted(m['outputs'])}, got {sorted(outputs)}")
    for name in sorted(outputs):
        need("outputs", name, "float32", [b, *m["outputs"][name]["shape"][1:]], "batch_size, the output's shape")


def _table_rows(m: Dict[str, Any]) -> None:
    """Each sparse feature's rows (the bound requests are validated by) are the rows tables.bin holds of its table:
    segments named ``<table>`` or ``<table>@<shard>`` in a tensor of its module (``model.<path>.``, for a feature
    table ``<path>.<table>``; the model files pin that list): all of them (row-wise) or each of them (table- and
    column-wise). A table no segment names is not checked."""
    held = [(t["name"], split_shard(seg["name"])[0], seg["rows"]) for t in m["tables"]["tensors"] for seg in t["segments"]
            if seg.get("rows") is not None]  # (tensor, table, rows) of each table segment, in file order
    for i, f in enumerate(m["sparse_features"]):
        path, _, table = f["table"].rpartition(".")
        prefix = f"model.{path}." if path else ""
        rows = [r for tensor, name, r in held if name == table and tensor.startswith(prefix)]
        if rows and f["rows"] != sum(rows) and any(r != f["rows"] for r in rows):
            _fail(("sparse_features", i, "rows"), "table-rows",
                  f"is {f['rows']}, but tables holds {'+'.join(map(str, rows))} rows of its table {f['table']!r}")


def _aoti(m: Dict[str, Any]) -> None:
    aoti = m["aoti"]
    for key in sorted(aoti["dynamic"]):
        low, high = aoti["dynamic"][key]
        if low > high:
            _fail(("aoti", "dynamic", key), "aoti-dynamic", f"must be [min, max] sizes, got [{low}, {high}]")
    if sorted(aoti["output_order"]) != sorted(m["outputs"]):
        _fail(("aoti", "output_order"), "aoti-outputs", f"must name every output once, {sorted(m['outputs'])}")


def _inputs(m: Dict[str, Any]) -> None:
    want = derived_inputs(m["num_dense"], m["weighted"])
    if m["inputs"] != want:
        _fail(("inputs",), "inputs", f"must be {compact(want)} (from num_dense and weighted), got {compact(m['inputs'])[:200]}")
