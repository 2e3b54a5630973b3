"""open_artifact verifies a version as a unit before any of it runs: every file the manifest lists,
whichever model file loads; the sample's sizes, values and outputs (NaN and infinity fail it); the torch it was
built with; and, with an allow-list, the manifest's sha256 (which pins every file through its checksums)."""

import json
import shutil
import struct

import numpy as np
import pytest
import torch

from recship.export.artifact import ArtifactError, Manifest, file_sha256, open_artifact


def _copy(src, tmp_path, name="a"):
    art = tmp_path / name
    shutil.copytree(src, art)
    return art


def _edit_manifest(art, edit):
    raw = json.loads((art / "manifest.json").read_text())
    edit(raw)
    (art / "manifest.json").write_text(json.dumps(raw, indent=2))


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def both(small_artifacts):
    """The small DLRM with model.pt and model.pt2 (an AOTInductor compile: 15-40 s, once per session)."""
    return small_artifacts(format="both")


# -- the sample: sizes, values, NaN ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_recorded_output_fails_the_self_check(small_artifact, tmp_path, value):
    art = _copy(small_artifact, tmp_path)
    prob = art / "sample" / "outputs.prob.bin"
    prob.write_bytes(struct.pack("<f", value) + prob.read_bytes()[4:])
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}: sample file 'sample/outputs.prob.bin' holds NaN or infinity"
    open_artifact(art, check=False)  # only the self-check reads the sample


def test_a_non_finite_sample_input_is_refused_naming_its_file(small_artifact, tmp_path):
    """A NaN dense value made NaN outputs, which max(|got - want|) let through (NaN > 1e-5 is false)."""
    art = _copy(small_artifact, tmp_path)
    dense = art / "sample" / "inputs.dense.bin"
    dense.write_bytes(struct.pack("<f", float("nan")) + dense.read_bytes()[4:])
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == (f"{art}: sample file 'sample/inputs.dense.bin' is not a valid request: "
                            "dense values must be finite (no NaN or infinity)")


def test_sample_ids_outside_their_table_are_refused_naming_the_file(small_artifact, tmp_path):
    art = _copy(small_artifact, tmp_path)
    values = art / "sample" / "inputs.values.bin"
    ids = np.fromfile(values, dtype="<i8")
    ids[0] = 65
    ids.tofile(values)
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}: sample file 'sample/inputs.values.bin' is not a valid request: feature 'cat_0': id 65 is out of range [0, 20)"


def test_sample_lengths_that_do_not_sum_to_the_values_are_refused(small_artifact, tmp_path):
    art = _copy(small_artifact, tmp_path)
    lengths = art / "sample" / "inputs.lengths.bin"
    raw = np.fromfile(lengths, dtype="<i4")
    want = int(raw.sum())
    raw[3] += 1
    raw.tofile(lengths)
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == (f"{art}: sample file 'sample/inputs.lengths.bin' is not a valid request: its lengths sum to {want + 1}, "
                            f"but 'sample/inputs.values.bin' holds {want} ids")


@pytest.mark.parametrize("file, size", [("sample/inputs.values.bin", 8), ("sample/outputs.prob.bin", 0)])
def test_a_sample_file_of_another_size_is_refused(small_artifact, tmp_path, file, size):
    art = _copy(small_artifact, tmp_path)
    spec = next(s for s in [*Manifest.read(art).sample.inputs.values(), *Manifest.read(art).sample.outputs.values()] if s.file == file)
    (art / file).write_bytes((art / file).read_bytes()[:size])
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}: sample file {file!r} has {size} bytes, its shape {spec.shape} needs {4 * int(np.prod(spec.shape)) * (2 if 'values' in file else 1)}"


def test_every_output_has_a_recorded_sample(small_artifact, tmp_path):
    """Without sample outputs, the self-check compared nothing and the artifact loaded."""
    art = _copy(small_artifact, tmp_path)
    _edit_manifest(art, lambda m: m["sample"].update(outputs={}))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}/manifest.json: sample.outputs must hold every output, ['logit', 'prob'], got []"


def test_a_sample_shape_must_be_the_models(small_artifact, tmp_path):
    art = _copy(small_artifact, tmp_path)
    _edit_manifest(art, lambda m: m.update(num_dense=12))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == (f"{art}/manifest.json: sample.inputs.dense must be float32 [4, 12] (batch_size, num_dense), "
                            "got float32 [4, 13]")


def test_a_feature_must_have_the_rows_its_table_holds(small_artifact, tmp_path):
    """The rows requests are validated by follow the tables the model files pin, not a flipped digit."""
    art = _copy(small_artifact, tmp_path)
    _edit_manifest(art, lambda m: m["sparse_features"][3].update(rows=33))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}/manifest.json: sparse_features[3].rows is 33, but tables holds 23 rows of its table 'sparse_arch.embedding_bag_collection.t_cat_3'"


def test_an_artifact_of_another_torch_is_refused(small_artifact, tmp_path):
    art = _copy(small_artifact, tmp_path)
    _edit_manifest(art, lambda m: m["versions"].update(torch="9.9.9"))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert str(e.value) == f"{art}/manifest.json: artifact built with torch 9.9.9, this loader runs torch {torch.__version__.split('+')[0]}"


# -- a version is verified as a unit ------------------------------------------------------------------------------

@pytest.mark.parametrize("format", ["auto", "aoti", "torchscript"])
def test_a_flipped_model_pt_refuses_the_version_whichever_file_loads(both, tmp_path, format):
    """model.pt2 intact, model.pt flipped (manifest unchanged): "auto" served model.pt2 before."""
    art = _copy(both, tmp_path)
    _flip(art / "model.pt")
    with pytest.raises(ArtifactError) as e:
        open_artifact(art, format=format)
    digest = file_sha256(art / "model.pt")
    assert str(e.value) == f"{art}/model.pt: sha256 {digest} does not match the manifest's {Manifest.read(art).model_sha256}"


def test_a_half_copied_version_without_its_model_pt2_is_refused(both, tmp_path):
    """model.pt loads on its own; the manifest lists model.pt2, so the version is incomplete."""
    art = _copy(both, tmp_path)
    (art / "model.pt2").unlink()
    for format in ("torchscript", "auto"):
        with pytest.raises(ArtifactError) as e:
            open_artifact(art, format=format)
        assert str(e.value) == f"{art}: model.pt2 is missing"


def test_a_flipped_model_pt2_refuses_the_version_when_model_pt_loads(both, tmp_path):
    art = _copy(both, tmp_path)
    _flip(art / "model.pt2")
    with pytest.raises(ArtifactError, match=r"/model\.pt2: sha256 [0-9a-f]{64} does not match the manifest's"):
        open_artifact(art, format="torchscript")


def test_a_model_pt2_pinned_to_other_tables_refuses_the_version_when_model_pt_loads(both, small_artifact, tmp_path):
    """Each model file's copy of the tables spec is checked, the one that does not run too."""
    art = _copy(both, tmp_path)
    other = _copy(small_artifact, tmp_path, "other")
    (art / "model.pt").write_bytes((other / "model.pt").read_bytes())  # another export's model.pt, hash fixed up
    _edit_manifest(art, lambda m: m.update(model_sha256=file_sha256(art / "model.pt")))
    other_tables = json.loads((other / "manifest.json").read_text())["tables"]
    if other_tables == json.loads((art / "manifest.json").read_text())["tables"]:
        pytest.skip("the two exports pin the same tables")
    with pytest.raises(ArtifactError, match="model.pt was exported with other tables than manifest.json describes"):
        open_artifact(art, format="aoti")


# -- the allow-list pins manifests --------------------------------------------------------------------------------

def test_the_allow_list_pins_the_manifest_and_through_it_every_file(both, tmp_path):
    """Listing model.pt's sha256 (its documented meaning) refused the default export ('model.pt2 ... is not in the
    trusted list'); the list now names manifests, and says which digest to list when it names a model file."""
    art = _copy(both, tmp_path)
    manifest = file_sha256(art / "manifest.json")
    model, m = open_artifact(art, trusted={manifest})
    assert m.sha256 == manifest
    for listed in ("model.pt", "model.pt2"):
        with pytest.raises(ArtifactError) as e:
            open_artifact(art, trusted={file_sha256(art / listed)})
        assert str(e.value) == (f"{art}/manifest.json: sha256 {manifest} is not in the trusted list (the list names this "
                                f"version's {listed}; it pins manifest.json, whose checksums pin every file of the version: "
                                f"list {manifest}, e.g. sha256sum */*/manifest.json)")
    with pytest.raises(ArtifactError) as e:
        open_artifact(art, trusted={"0" * 64})
    assert str(e.value) == f"{art}/manifest.json: sha256 {manifest} is not in the trusted list"
    # a listed manifest pins the files: one of them altered is refused as before
    _flip(art / "tables.bin", 100)
    with pytest.raises(ArtifactError, match=r"tables\.bin: table 't_cat_0' \(bytes"):
        open_artifact(art, trusted={manifest})
