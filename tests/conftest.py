# tests/ is put on sys.path by this file's presence, so tests import `reference`.
"""Fixtures shared across test folders: the small artifacts (each exported once per session) and the manifest schema."""

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# exports in tests write model.pt only unless a test asks for model.pt2 (format="both"): an AOTInductor
# compile takes 15-40 s here; tests/export/test_aoti.py covers it (subprocesses inherit this too)
os.environ["RECSHIP_AOTI"] = "0"
SMALL_ROWS = [20 + i for i in range(26)]  # table sizes of the small DLRM's features cat_0..cat_25


@pytest.fixture(scope="session")
def small_artifacts(tmp_path_factory):
    """``small_artifacts(model="dlrm", dtype="int8", device="cpu", format="torchscript", shards=1) -> Path``: each
    artifact is exported once per session (format "both" adds the AOTInductor model.pt2; shards > 1: row-wise).

    dlrm: a DLRM of 26 features cat_i (SMALL_ROWS[i] rows, dim 8), dense 13, outputs logit and prob [B, 1].
    emb: a weighted EmbeddingBagCollection, table a (40 x 16, MEAN) for x and y, table b (30 x 8) for z,
    whose ids take the modulo policy. Both are built after ``torch.manual_seed(0)``. Treat the folders as
    read-only (copy one to change it): every test of the session shares them.
    """
    from recship.export import ExportConfig, export_model
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from recship.trainer.dlrm import DLRM, DLRMConfig

    built: Dict[Tuple[str, str, str, str, int], Path] = {}

    def build(model: str = "dlrm", dtype: str = "int8", device: str = "cpu", format: str = "torchscript", shards: int = 1) -> Path:
        key = (model, dtype, device, format, shards)
        if key in built:
            return built[key]
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        torch.manual_seed(0)
        extra: Dict[str, Any] = {}
        if model == "dlrm":
            module = DLRM(DLRMConfig(num_embeddings_per_feature=SMALL_ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
        elif model == "emb":
            module = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=16, feature_names=["x", "y"], pooling=PoolingType.MEAN),
                    EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["z"]),
                ],
                is_weighted=True,
            )
            extra["id_policy"] = {"z": "modulo"}
        else:
            raise ValueError(f"small_artifacts: model must be 'dlrm' or 'emb', got {model!r}")
        if shards > 1:
            extra.update(shards=shards, sharding="row_wise")
        out = tmp_path_factory.mktemp("artifact") / f"{model}_{dtype}_{device}_{format}_{shards}"
        export_model(module, ExportConfig(out=str(out), dtype=dtype, device=device, progress=False, validation_batches=1,
                                          validation_batch_size=32, format=format, **extra))
        built[key] = out
        return out

    return build


@pytest.fixture(scope="session")
def small_artifact(small_artifacts):
    """Path of the INT8 CPU artifact of the small DLRM (see ``small_artifacts``)."""
    return small_artifacts()


class ManifestSchema:
    """protos/recship/artifact/v1/manifest.schema.json, with the subset of JSON Schema it uses checked
    (type, const, enum, pattern, minimum, minItems, required, properties, additionalProperties,
    items, prefixItems, local $ref) and its required fields listed against a real manifest."""

    PATH = ROOT / "protos" / "recship" / "artifact" / "v1" / "manifest.schema.json"
    _TYPES = {
        "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list), "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool), "boolean": lambda v: isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "null": lambda v: v is None,
    }

    def __init__(self) -> None:
        self.schema = json.loads(self.PATH.read_text())

    def resolve(self, node: Dict[str, Any]) -> Dict[str, Any]:
        while "$ref" in node:
            assert node["$ref"].startswith("#/"), node["$ref"]
            target: Any = self.schema
            for part in node["$ref"][2:].split("/"):
                target = target[part]
            node = target
        return node

    def errors(self, value: Any, node: Dict[str, Any] = None, where: str = "") -> List[str]:
        """Every way ``value`` breaks the schema, each naming its field (empty: it conforms)."""
        node = self.resolve(self.schema if node is None else node)
        at = where or "manifest"
        kinds = node.get("type")
        if kinds is not None and not any(self._TYPES[k](value) for k in ([kinds] if isinstance(kinds, str) else kinds)):
            return [f"{at}: must be {kinds}, got {type(value).__name__}"]
        out = []
        if "const" in node and value != node["const"]:
            out.append(f"{at}: must be {node['const']!r}")
        if "enum" in node and value not in node["enum"]:
            out.append(f"{at}: must be one of {node['enum']}")
        if "pattern" in node and isinstance(value, str) and not re.search(node["pattern"], value):
            out.append(f"{at}: does not match {node['pattern']}")
        if "minimum" in node and isinstance(value, (int, float)) and value < node["minimum"]:
            out.append(f"{at}: must be >= {node['minimum']}")
        if isinstance(value, dict):
            out += [f"{at}: {key} is missing" for key in node.get("required", []) if key not in value]
            props, extra = node.get("properties", {}), node.get("additionalProperties", True)
            for key, v in value.items():
                if key in props:
                    out += self.errors(v, props[key], f"{where}.{key}" if where else key)
                elif isinstance(extra, dict):
                    out += self.errors(v, extra, f"{where}[{key!r}]")
                elif extra is False:
                    out.append(f"{at}: unexpected field {key!r}")
        if isinstance(value, list):
            if len(value) < node.get("minItems", 0):
                out.append(f"{at}: needs at least {node['minItems']} items")
            prefix = node.get("prefixItems", [])
            for i, v in enumerate(value):
                sub = prefix[i] if i < len(prefix) else node.get("items")
                if sub is not None:
                    out += self.errors(v, sub, f"{where}[{i}]")
        return out

    def required_fields(self, manifest: Dict[str, Any]) -> List[Tuple[str, Tuple]]:
        """(name as error messages print it, key path) of every field a "required" list names, as present in
        ``manifest``; arrays and maps of specs are followed through their first element only."""
        out: List[Tuple[str, Tuple]] = []

        def walk(node, value, where: str, keys: Tuple) -> None:
            node = self.resolve(node)
            props = node.get("properties", {})

            def name(key):
                return (f"{where}.{key}" if where else key) if key in props else f"{where}[{key!r}]"

            if isinstance(value, dict):
                out.extend((name(k), keys + (k,)) for k in node.get("required", []) if k in value)
                for key, sub in props.items():
                    if key in value:
                        walk(sub, value[key], name(key), keys + (key,))
                extra = node.get("additionalProperties")
                others = [k for k in value if k not in props]
                if isinstance(extra, dict) and others:
                    walk(extra, value[others[0]], name(others[0]), keys + (others[0],))
            elif isinstance(value, list) and value and isinstance(node.get("items"), dict) and not node.get("prefixItems"):
                walk(node["items"], value[0], f"{where}[0]", keys + (0,))

        walk(self.schema, manifest, "", ())
        return out

    @staticmethod
    def without(manifest: Dict[str, Any], keys: Tuple) -> Dict[str, Any]:
        """A deep copy of ``manifest`` lacking the field at ``keys``."""
        out = copy.deepcopy(manifest)
        parent = out
        for k in keys[:-1]:
            parent = parent[k]
        del parent[keys[-1]]
        return out


@pytest.fixture(scope="session")
def manifest_schema() -> ManifestSchema:
    return ManifestSchema()
