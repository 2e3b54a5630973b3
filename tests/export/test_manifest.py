"""The typed Manifest against real exported manifests and the contract's JSON Schema (recship/contract/manifest.schema.json;
every way it refuses a manifest is tests/contract's)."""

import json
import shutil

import pytest

from recship.export.artifact import ArtifactError, Manifest, ModelFields, open_artifact, read_sample, write_sample
from recship.contract.schema import problems, resolve, schema
from recship.contract.tables import TablesSpec
from recship.export.pipeline import current_versions

KINDS = [("dlrm", "int8", "cpu", "torchscript", 1), ("emb", "int4", "cpu", "torchscript", 2)]  # unweighted with dense inputs,
# unsharded; weighted, no dense, a modulo feature, row-wise on 2 shards


@pytest.fixture(params=KINDS, ids=["_".join(map(str, k[:2])) for k in KINDS])
def artifact(request, small_artifacts):
    return small_artifacts(*request.param)


def _raw(path):
    return json.loads((path / "manifest.json").read_text())


def test_exported_manifests_satisfy_the_schema(artifact):
    assert problems(_raw(artifact)) == []


def test_manifest_reads_and_writes_todays_json_exactly(artifact, tmp_path):
    text = (artifact / "manifest.json").read_text()
    manifest = Manifest.read(artifact)
    assert json.dumps(manifest.to_dict(), indent=2) == text
    manifest.write(tmp_path)
    assert (tmp_path / "manifest.json").read_text() == text
    raw = json.loads(text)
    assert manifest.feature_names == [f["name"] for f in raw["sparse_features"]]
    assert [(f.rows, f.dim, f.id_policy, f.weighted) for f in manifest.sparse_features] == [
        (f["rows"], f["dim"], f["id_policy"], f["weighted"]) for f in raw["sparse_features"]]
    assert {k: o.dims for k, o in manifest.outputs.items()} == {k: v["shape"][1:] for k, v in raw["outputs"].items()}
    assert (manifest.num_dense, manifest.weighted, manifest.sharding.device) == (raw["num_dense"], raw["weighted"], raw["sharding"]["device"])
    assert manifest.sample.inputs["lengths"].shape == raw["sample"]["inputs"]["lengths"]["shape"]


def test_manifest_writes_exactly_the_fields_the_schema_lists(artifact):
    """Where the schema closes an object (properties without additionalProperties), the keys written are
    those it lists (the optional ones may be absent)."""
    written = Manifest.read(artifact).to_dict()
    checked = []

    def walk(node, value, where):
        node = resolve(node)
        if isinstance(value, dict):
            props = node.get("properties")
            if props is not None and "additionalProperties" not in node:
                # every key written is listed; every listed key is written unless optional (aoti: only with model.pt2)
                assert set(node.get("required", props)) <= set(value) <= set(props), where
                checked.append(where)
            for key, sub in (props or {}).items():
                walk(sub, value.get(key), f"{where}.{key}")
            if isinstance(node.get("additionalProperties"), dict):
                for key, v in value.items():
                    if key not in (props or {}):
                        walk(node["additionalProperties"], v, f"{where}[{key!r}]")
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for i, v in enumerate(value):
                walk(node["items"], v, f"{where}[{i}]")

    walk(schema(), written, "manifest")
    assert {"manifest", "manifest.inputs", "manifest.sharding", "manifest.versions", "manifest.sample",
            "manifest.sparse_features[0]", "manifest.sample.inputs.dense"} <= set(checked)
    assert ("manifest.sharding.shards[0]" in checked) == (written["sharding"]["shards"] != [])


def test_an_optional_field_missing_is_accepted(artifact):
    """A feature without ``weighted`` (not required) takes the manifest's."""
    raw = _raw(artifact)
    for f in raw["sparse_features"]:
        del f["weighted"]
    assert problems(raw) == []
    assert [f.weighted for f in Manifest.from_dict(raw).sparse_features] == [raw["weighted"]] * len(raw["sparse_features"])


def test_validate_and_write_name_the_bad_field(small_artifact, tmp_path):
    manifest = Manifest.read(small_artifact)
    manifest.sparse_features[3].rows = 0
    with pytest.raises(ArtifactError, match=r"sparse_features\[3\]\.rows must be >= 1"):
        manifest.validate()
    with pytest.raises(ArtifactError, match=r"sparse_features\[3\]"):
        manifest.write(tmp_path)
    assert not (tmp_path / "manifest.json").exists()


def test_inputs_must_agree_with_num_dense_and_weighted(small_artifact):
    raw = _raw(small_artifact)
    raw["inputs"]["dense"]["shape"] = ["B", 12]
    with pytest.raises(ArtifactError, match="inputs must be"):
        Manifest.from_dict(raw)


def test_open_artifact_gives_the_typed_manifest_and_self_checks(small_artifact, tmp_path):
    model, manifest = open_artifact(small_artifact)
    assert isinstance(manifest, Manifest) and manifest.model.kind == "module" and manifest.model.details["config"]["embedding_dim"] == 8
    assert manifest.model.details["class"] == "recship.models.dlrm.BuiltinDLRM"
    art = tmp_path / "a"
    shutil.copytree(small_artifact, art)
    prob = art / manifest.sample.outputs["prob"].file
    prob.write_bytes(bytes(len(prob.read_bytes())))  # recorded outputs all 0
    with pytest.raises(ArtifactError, match="sample self-check failed"):
        open_artifact(art)
    open_artifact(art, check=False)


def test_from_fields_and_write_sample_rebuild_the_exported_manifest_and_sample(artifact, tmp_path):
    """What the exporter writes, rebuilt through the contract's writers: the same JSON text and sample bytes."""
    raw = _raw(artifact)
    inputs, outputs = read_sample(artifact, Manifest.read(artifact))
    sample = write_sample(tmp_path, raw["sample"]["batch_size"], inputs, outputs)
    for spec in [*raw["sample"]["inputs"].values(), *raw["sample"]["outputs"].values()]:
        assert (tmp_path / spec["file"]).read_bytes() == (artifact / spec["file"]).read_bytes()
    m = Manifest.read(artifact)
    fields = ModelFields(m.model, m.num_dense, m.weighted, m.sparse_features, m.sharding, m.quantization, m.validation)
    built = Manifest.from_fields(fields, {k: list(v.shape[1:]) for k, v in outputs.items()}, sample, raw["model_sha256"],
                                 current_versions(), tables=TablesSpec.from_dict(raw["tables"]), row_block=raw["row_block"])
    assert json.dumps(built.to_dict(), indent=2) == (artifact / "manifest.json").read_text()
