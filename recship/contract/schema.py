"""The manifest's JSON Schema (manifest.schema.json beside this file, package data), validated with jsonschema: each way
a manifest breaks it as a ``Problem`` (where, which rule, the message users read), in the order and words the C++
loader's interpreter of the same file uses (cpp_loader/src/schema.cpp).

The schema's readings both loaders share (its description says them): "integer" is a JSON integer literal (1.0 is not
one), a pattern applies to a string within its node's maxLength; and a problem's ``where`` is the field it names (for
``required``, the missing field itself, not its parent).
"""

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Dict, Iterator, List, Sequence, Tuple, Union

import jsonschema

SCHEMA_FILE = "manifest.schema.json"
Where = Tuple[Union[str, int], ...]  # an instance path: object keys and array indices
# Python's names of JSON's types, as the messages say them ("num_dense must be int, got str")
TYPE_NAMES = {"object": "dict", "array": "list", "string": "str", "integer": "int", "boolean": "bool", "number": "a number",
              "null": "None"}
# the keywords manifest.schema.json may use: those the C++ interpreter knows (cpp_loader/src/schema.cpp) and
# _problems has words for; tests/contract holds the file to them
KEYWORDS = frozenset({
    "$schema", "$id", "$defs", "$ref", "title", "description",  # no rule
    "type", "enum", "const", "pattern", "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength",
    "required", "properties", "additionalProperties", "items", "prefixItems", "allOf", "if", "then", "else",
})


@dataclass(frozen=True)
class Problem:
    """One way a manifest breaks the contract: ``where`` (the field's path), ``rule`` (a schema keyword such as
    "required" or "minimum", or a named rule of rules.py) and ``message`` (its words, naming the field)."""

    where: Where
    rule: str
    message: str

    @property
    def pointer(self) -> str:
        """``where`` as a JSON Pointer (RFC 6901): "/sparse_features/0/rows"."""
        return "".join("/" + str(t).replace("~", "~0").replace("/", "~1") for t in self.where)

    def sort_key(self) -> Tuple[Any, ...]:
        """Field by field (indices as numbers), then rule, then message: the order both loaders report in."""
        return tuple((0, t, "") if isinstance(t, int) else (1, 0, t) for t in self.where), self.rule, self.message


@functools.lru_cache(maxsize=None)
def schema() -> Dict[str, Any]:
    """manifest.schema.json, parsed (from the installed package: a wheel, an editable install or a checkout)."""
    return json.loads(resources.files("recship.contract").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def _pattern(validator: Any, pattern: str, instance: Any, node: Dict[str, Any]) -> Iterator[jsonschema.ValidationError]:
    """The pattern keyword, on a string within its node's maxLength only (the schema's third reading)."""
    if isinstance(instance, str) and len(instance) <= node["maxLength"] and not re.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance[:80]!r} does not match {pattern!r}")


@functools.lru_cache(maxsize=None)
def _validator() -> jsonschema.protocols.Validator:
    """jsonschema's validator of the file's draft, with the schema's readings: "integer" is a JSON integer literal;
    a pattern applies within maxLength."""
    base = jsonschema.validators.validator_for(schema())
    base.check_schema(schema())
    strict = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(base, {"pattern": _pattern}, type_checker=strict)(schema())


def resolve(node: Any) -> Any:
    """``node``, its local $ref followed (to the node it names)."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref  # the file refers only within itself
        node = schema()
        for part in ref[2:].split("/"):
            node = node[part]
    return node


def _node(schema_path: Sequence[Any]) -> Any:
    """The schema node at a jsonschema ``absolute_schema_path`` (which steps through a "$ref" without naming it)."""
    node: Any = schema()
    for key in schema_path:
        if isinstance(node, dict) and key not in node:
            node = resolve(node)
        node = node[key]
    return node


def _holder(schema_path: Sequence[Any]) -> Dict[str, Any]:
    """The node whose keyword ``schema_path`` ends with (a "$ref" it reaches through followed)."""
    node = _node(schema_path[:-1])
    return node if schema_path[-1] in node else resolve(node)


def field(where: Where) -> str:
    """A field's name as messages print it: properties dotted, map entries and indices in brackets
    ("sparse_features[0].rows", "outputs['logit'].shape"); "" for the manifest itself."""
    out, node = "", schema()
    for token in where:
        node = resolve(node) if isinstance(node, dict) else {}
        if isinstance(token, int):
            prefix = node.get("prefixItems", [])
            out, node = out + f"[{token}]", prefix[token] if token < len(prefix) else node.get("items", {})
        elif token in node.get("properties", {}):
            out, node = f"{out}.{token}" if out else token, node["properties"][token]
        else:
            extra = node.get("additionalProperties", {})
            out, node = out + f"[{py_repr(token)}]", extra if isinstance(extra, dict) else {}
    return out


def py_repr(value: Any) -> str:
    """A schema value as messages print it: a string as Python's repr, anything else as compact JSON."""
    return repr(value) if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _type_name(value: Any) -> str:
    return "NoneType" if value is None else type(value).__name__


def _said(where: Where, text: str) -> str:
    name = field(where)
    return f"{name} {text}" if name else text


def _problems(error: jsonschema.ValidationError) -> Iterator[Problem]:
    where: Where = tuple(error.absolute_path)
    rule, value, instance = error.validator, error.validator_value, error.instance
    spath = list(error.absolute_schema_path)
    # a rule inside an if's then / else says why it applies (that branch's description)
    branch = max((i for i, k in enumerate(spath[:-1]) if k in ("then", "else")), default=None)
    why = _node(spath[:branch + 1]).get("description") if branch is not None else None
    tail = f" ({why})" if why else ""
    if rule == "required":
        for key in value:
            if key not in instance:
                yield Problem(where + (key,), rule, _said(where + (key,), "is missing") + tail)
        return
    if rule == "type":
        kinds = [value] if isinstance(value, str) else value
        text = f"must be {' or '.join(TYPE_NAMES[k] for k in kinds)}, got {_type_name(instance)}"
    elif rule == "enum":
        text = f"must be one of [{', '.join(map(py_repr, value))}]"
    elif rule == "const":
        text = f"must be {py_repr(value)}"
    elif rule == "pattern":
        text = f"must be {_holder(spath)['description']}"
    elif rule in ("minimum", "maximum"):
        text = f"must be {'>=' if rule == 'minimum' else '<='} {value}"
    elif rule in ("minItems", "maxItems"):
        text = f"must have {'at least' if rule == 'minItems' else 'at most'} {value} items"
    elif rule in ("minLength", "maxLength"):
        text = f"must have {'at least' if rule == 'minLength' else 'at most'} {value} characters"
    elif rule == "additionalProperties":
        known = _holder(spath).get("properties", {})
        text = f"has unknown fields [{', '.join(repr(k) for k in sorted(k for k in instance if k not in known))}]"
    else:  # a keyword this module has no words for: tests/contract fails on the schema before a user meets it
        raise AssertionError(f"{SCHEMA_FILE}: no message for keyword {rule!r}")
    yield Problem(where, rule, _said(where, text) + tail)


def problems(manifest: Any) -> List[Problem]:
    """Every way ``manifest`` (parsed JSON) breaks the schema, in order (``Problem.sort_key``); empty: it conforms."""
    found = {p for error in _validator().iter_errors(manifest) for p in _problems(error)}
    return sorted(found, key=Problem.sort_key)
