"""The contract's shared test vectors: tests/contract/vectors/cases.json, made from the valid manifests beside it (two
exported artifacts' manifest.json: the small DLRM, and the weighted EmbeddingBagCollection sharded row-wise on 2).
``python tests/contract/make_vectors.py`` writes it again; test_vectors.py fails while it is stale.

A case: {"name", "base" (a valid manifest's file stem), "patch" (RFC 6902 operations applied to it), "expect": null
(accepted) or {"pointer", "rule"} (refused: that field, by that schema keyword or named rule)}. They are made
systematically from manifest.schema.json: every required field removed, every field given a value of a wrong JSON
type, every enum and const a value outside it, every bound broken by one, every pattern values that break it, an
unknown field where an object is closed; then each if/then of the schema and each rule between fields
(recship/contract/rules.py) broken, and variants that must be accepted.
"""

import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from recship.contract.schema import resolve, schema

VECTORS = Path(__file__).resolve().parent / "vectors"
CASES = VECTORS / "cases.json"
BASES = ("dlrm", "emb_sharded")
Where = Tuple[Any, ...]

# one value of a wrong JSON type per typed field (the first one its type does not take), and the readings both loaders
# must share: an integer field takes neither true nor 1.0, a boolean field not 1
WRONG = [("string", "x"), ("integer", 7), ("object", {}), ("array", [])]
EXTRA_WRONG = {"integer": [True, 1.0, 2.5], "boolean": [1], "number": [True, "1"]}
# values that break each pattern (by the pattern's description)
BAD_PATTERN = {
    "64 lowercase hex digits": ["A" * 64, "g" * 64, "0" * 63 + "\n"],
    "a relative path inside the artifact": ["/etc/passwd", "../x", "sample/../../x", "a\\b", "", ".", "./", "sample/.."],
    "a file name (no folder): loaders dlopen it from fbgemm_gpu's folder": ["", ".", "..", "lib/x.so", "x\\y.so"],
}
AOTI = {"file": "model.pt2", "sha256": "0" * 64, "target_isa": "x86-64-v3", "torch": "2.13.0+cpu", "dynamic": {"dense.0": [1, 512]},
        "output_order": [], "compile_seconds": 12.5}


def pointer(where: Where) -> str:
    return "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in where)


def apply(manifest: Dict[str, Any], patch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``manifest`` with the RFC 6902 operations add, remove and replace applied (a deep copy)."""
    out = copy.deepcopy(manifest)
    for op in patch:
        if op["path"] == "":  # the whole manifest
            out = copy.deepcopy(op["value"])
            continue
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last: Any = int(parts[-1]) if isinstance(parent, list) else parts[-1]
        if op["op"] == "remove":
            del parent[last]
        elif isinstance(parent, list) and op["op"] == "add":
            parent.insert(last, copy.deepcopy(op["value"]))
        else:
            parent[last] = copy.deepcopy(op["value"])
    return out


def base(name: str) -> Dict[str, Any]:
    return json.loads((VECTORS / f"{name}.json").read_text())


def _case(name: str, patch: List[Dict[str, Any]], where: Optional[Where], rule: str = "") -> Dict[str, Any]:
    return {"name": name, "patch": patch, "expect": None if where is None else {"pointer": pointer(where), "rule": rule}}


def _set(where: Where, value: Any) -> Dict[str, Any]:
    return {"op": "replace", "path": pointer(where), "value": value}


def _types(node: Dict[str, Any]) -> List[str]:
    kinds = node.get("type", [])
    return [kinds] if isinstance(kinds, str) else kinds


def _takes(kinds: List[str], value: Any) -> bool:
    checks = {"string": lambda v: isinstance(v, str), "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "array": lambda v: isinstance(v, list), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None}
    return any(checks[k](value) for k in kinds)


def _leaf(node: Dict[str, Any], value: Any, where: Where) -> Iterator[Dict[str, Any]]:
    """The cases that break ``node``'s own keywords at ``where`` (where the manifest holds ``value``)."""
    at = pointer(where) or "the manifest"
    kinds = _types(node)
    if kinds:
        wrong = [next(v for _, v in WRONG if not _takes(kinds, v))] + [v for k in kinds for v in EXTRA_WRONG.get(k, [])]
        for v in wrong:
            if not _takes(kinds, v):
                yield _case(f"{at} given {json.dumps(v)}", [_set(where, v)], where, "type")
    if "enum" in node:
        yield _case(f"{at} outside its enum", [_set(where, "bogus")], where, "enum")
    if isinstance(node.get("const"), str):
        yield _case(f"{at} not its const", [_set(where, node["const"] + "x")], where, "const")
    if "minimum" in node and _takes(["integer"], value):
        yield _case(f"{at} below its minimum", [_set(where, node["minimum"] - 1)], where, "minimum")
    if "maximum" in node and _takes(["integer"], value):
        yield _case(f"{at} above its maximum", [_set(where, node["maximum"] + 1)], where, "maximum")
    if isinstance(value, list) and node.get("minItems", 0) > 0:
        yield _case(f"{at} too short", [_set(where, value[: node["minItems"] - 1])], where, "minItems")
    if isinstance(value, list) and "maxItems" in node:
        yield _case(f"{at} too long", [_set(where, value + value[-1:] * (node["maxItems"] + 1 - len(value)))], where, "maxItems")
    if isinstance(value, str) and "minLength" in node:
        yield _case(f"{at} too short", [_set(where, value[: node["minLength"] - 1])], where, "minLength")
    if isinstance(value, str) and "maxLength" in node:
        yield _case(f"{at} too long", [_set(where, value + "0" * (node["maxLength"] + 1 - len(value)))], where, "maxLength")
    for bad in BAD_PATTERN.get(node.get("description", ""), []) if "pattern" in node else []:
        yield _case(f"{at} = {json.dumps(bad)}", [_set(where, bad)], where, "pattern")
    if node.get("additionalProperties") is False:
        yield _case(f"{at} with an unknown field", [{"op": "add", "path": pointer(where + ("unknown",)), "value": 1}], where,
                    "additionalProperties")


def _walk(node: Any, value: Any, where: Where) -> Iterator[Dict[str, Any]]:
    """Every keyword case at and below ``where``: the first item of an array, the first entry of a map."""
    node = resolve(node)
    yield from _leaf(node, value, where)
    if isinstance(value, dict):
        for key in node.get("required", []):
            if key in value:
                yield _case(f"{pointer(where + (key,))} removed", [{"op": "remove", "path": pointer(where + (key,))}], where + (key,),
                            "required")
        props, extra = node.get("properties", {}), node.get("additionalProperties")
        for key in props:
            if key in value:
                yield from _walk(props[key], value[key], where + (key,))
        others = sorted(k for k in value if k not in props)
        if isinstance(extra, dict) and others:
            yield from _walk(extra, value[others[0]], where + (others[0],))
    elif isinstance(value, list) and value:
        prefix = node.get("prefixItems", [])
        for i, sub in enumerate(prefix[: len(value)]):
            yield from _walk(sub, value[i], where + (i,))
        if "items" in node and len(value) > len(prefix):
            yield from _walk(node["items"], value[len(prefix)], where + (len(prefix),))


def _aoti(m: Dict[str, Any]) -> Dict[str, Any]:
    """A model.pt2 description that fits the manifest ``m``."""
    return {**AOTI, "input_order": ["dense", "lengths", "values"] + (["weights"] if m["weighted"] else []),
            "output_order": sorted(m["outputs"])}


def _rules(name: str, m: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """The schema's if/then rules and the rules between fields broken, and variants accepted, for the base ``m``."""
    features, tensors = m["sparse_features"], m["tables"]["tensors"]
    reject = next(i for i, f in enumerate(features) if f["id_policy"] == "reject")
    add_aoti = {"op": "add", "path": "/aoti", "value": _aoti(m)}
    yield _case("the base", [], None)
    yield _case("features without weighted take the manifest's", [{"op": "remove", "path": f"/sparse_features/{i}/weighted"}
                                                                   for i in range(len(features))], None)
    yield _case("format 1 without tables", [_set(("format",), "recship.artifact/1"), {"op": "remove", "path": "/tables"}], None)
    yield _case("with model.pt2", [add_aoti], None)
    yield _case("model.pt2 alone", [add_aoti, {"op": "remove", "path": "/model_sha256"}], None)
    yield _case("an id_bound of rows", [{"op": "add", "path": f"/sparse_features/{reject}/id_bound", "value": features[reject]["rows"]}], None)
    yield _case("segment rows null (dense constants')", [_set(("tables", "tensors", i, "segments", j, "rows"), None)
                                                         for i, t in enumerate(tensors) for j in range(len(t["segments"]))], None)
    yield _case("a sample file named with a final newline after ..", [_set(("sample", "inputs", "dense", "file"), "sample/..\n")], None)
    yield _case("an op library named ..<newline>", [_set(("op_libraries", 0), "..\n")], None)
    yield _case("a sample file name past its maxLength, outside the artifact: refused by its length alone",
                [_set(("sample", "inputs", "dense", "file"), "/" + "a" * 4096)], ("sample", "inputs", "dense", "file"), "maxLength")
    # the schema's if/then
    yield _case("format 1 with tables", [_set(("format",), "recship.artifact/1")], ("format",), "const")
    yield _case("format 2 without tables", [{"op": "remove", "path": "/tables"}], ("tables",), "required")
    yield _case("neither model.pt nor model.pt2", [{"op": "remove", "path": "/model_sha256"}], ("model_sha256",), "required")
    yield _case("model.pt2's input_order not the model's", [add_aoti, _set(("aoti", "input_order"), ["dense", "values", "lengths"])],
                ("aoti", "input_order"), "const")
    modulo = [i for i, f in enumerate(features) if f["id_policy"] == "modulo"]
    if modulo:
        yield _case("an id_bound on a modulo feature",
                    [{"op": "add", "path": f"/sparse_features/{modulo[0]}/id_bound", "value": features[modulo[0]]["rows"]}],
                    ("sparse_features", modulo[0], "id_policy"), "const")
    # the rules between fields, in rules.py's order
    yield _case("a tensor's bytes not its span", [_set(("tables", "tensors", 0, "bytes"), tensors[0]["bytes"] + 1)],
                ("tables", "tensors", 0, "bytes"), "tables-layout")
    yield _case("a tensor's offset not aligned", [_set(("tables", "tensors", 0, "offset"), tensors[0]["offset"] + 1)],
                ("tables", "tensors", 0, "offset"), "tables-layout")
    yield _case("a tensor past the file's end", [_set(("tables", "bytes"), tensors[-1]["offset"])],
                ("tables", "tensors", len(tensors) - 1, "offset"), "tables-layout")
    yield _case("a stride of another rank", [_set(("tables", "tensors", 0, "stride"), tensors[0]["stride"] + [1])],
                ("tables", "tensors", 0, "stride"), "tables-layout")
    if len(tensors) > 1:
        yield _case("two tensors of one name", [_set(("tables", "tensors", 1, "name"), tensors[0]["name"])],
                    ("tables", "tensors", 1, "name"), "tables-layout")
    segments = tensors[0]["segments"]
    yield _case("a segment not where the one before it ends", [_set(("tables", "tensors", 0, "segments", 0, "offset"), 1)],
                ("tables", "tensors", 0, "segments", 0, "offset"), "tables-layout")
    yield _case("segments short of their tensor", [_set(("tables", "tensors", 0, "segments", len(segments) - 1, "bytes"),
                                                        segments[-1]["bytes"] - 1)], ("tables", "tensors", 0, "segments"), "tables-layout")
    yield _case("two features of one name", [_set(("sparse_features", 1, "name"), features[0]["name"])],
                ("sparse_features", 1, "name"), "unique-feature")
    if features[reject]["rows"] > 1:
        yield _case("an id_bound below rows", [{"op": "add", "path": f"/sparse_features/{reject}/id_bound", "value": features[reject]["rows"] - 1}],
                    ("sparse_features", reject, "id_bound"), "id-bound")
    flip = [_set(("sparse_features", i, "weighted"), False) for i in range(len(features))] if m["weighted"] else \
        [_set(("sparse_features", 0, "weighted"), True)]
    yield _case("weighted not saying whether any feature is", flip, ("weighted",), "weighted")
    b = m["sample"]["batch_size"]
    yield _case("the sample's dense of another width", [_set(("sample", "inputs", "dense", "shape"), [b, m["num_dense"] + 1])],
                ("sample", "inputs", "dense"), "sample")
    yield _case("the sample's lengths int64", [_set(("sample", "inputs", "lengths", "dtype"), "int64")], ("sample", "inputs", "lengths"), "sample")
    if m["weighted"]:
        yield _case("a weighted model's sample without weights", [{"op": "remove", "path": "/sample/inputs/weights"}],
                    ("sample", "inputs", "weights"), "sample")
    else:
        yield _case("an unweighted model's sample with weights",
                    [{"op": "add", "path": "/sample/inputs/weights", "value": m["sample"]["inputs"]["values"]}], ("sample", "inputs", "weights"), "sample")
    first = sorted(m["outputs"])[0]
    yield _case("an output the sample lacks", [{"op": "remove", "path": pointer(("sample", "outputs", first))}], ("sample", "outputs"), "sample")
    yield _case("a feature's rows not its table's", [_set(("sparse_features", 0, "rows"), features[0]["rows"] + 1)],
                ("sparse_features", 0, "rows"), "table-rows")
    yield _case("model.pt2's dynamic span reversed", [add_aoti, _set(("aoti", "dynamic", "dense.0"), [512, 1])],
                ("aoti", "dynamic", "dense.0"), "aoti-dynamic")
    yield _case("model.pt2's outputs not the model's", [add_aoti, _set(("aoti", "output_order"), ["nope"])], ("aoti", "output_order"), "aoti-outputs")
    yield _case("inputs not those of num_dense", [_set(("inputs", "dense", "shape"), ["B", m["num_dense"] + 1])], ("inputs",), "inputs")


def cases() -> List[Dict[str, Any]]:
    """Every case of every base, named uniquely, in a stable order."""
    out = []
    for name in BASES:
        m = base(name)
        made = list(_rules(name, m)) + list(_walk(schema(), m, ()))
        # model.pt2's fields, on the base with model.pt2 added
        aoti = _aoti(m)
        for case in _walk(schema()["properties"]["aoti"], aoti, ("aoti",)):
            made.append({**case, "name": "with model.pt2: " + case["name"], "patch": [{"op": "add", "path": "/aoti", "value": aoti}] + case["patch"]})
        for case in made:
            out.append({**case, "name": f"{name}: {case['name']}", "base": name})
    names = [c["name"] for c in out]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1][:5]
    return out


def main() -> int:
    CASES.write_text(json.dumps(cases(), indent=1, ensure_ascii=False) + "\n")
    print(f"{CASES}: {len(cases())} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
