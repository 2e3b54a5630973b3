"""The C++ loader verifies a version as a unit, as open_artifact does, and refuses the same versions with the same
messages: sample files of another size (it read past its vectors), empty or non-finite recorded outputs
(it compared nothing, or NaN), a model file that does not run but is damaged or missing, and the allow-list of
manifest sha256s (recship_predict --trusted-sha256, the C++ front's load)."""

import json
import shutil
import struct

import numpy as np
import pytest

from recship.export.artifact import ArtifactError, file_sha256, open_artifact

from binaries import run_binary


def _refusal(binary, art, *args):
    """recship_predict's one-line refusal (exit 1), without its prefix."""
    result = run_binary(binary, art, *args)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    return result.stderr.strip().splitlines()[-1].removeprefix("recship_predict: error: ")


def _python(art, **kwargs):
    with pytest.raises(ArtifactError) as e:
        open_artifact(art, **kwargs)
    return str(e.value)


def _cut(file, size):
    return lambda art: (art / file).write_bytes((art / file).read_bytes()[:size])


def _first_float(file, value):
    return lambda art: (art / file).write_bytes(struct.pack("<f", value) + (art / file).read_bytes()[4:])


def _lengths_plus_one(art):
    lengths = np.fromfile(art / "sample" / "inputs.lengths.bin", dtype="<i4")
    lengths[5] += 1
    lengths.tofile(art / "sample" / "inputs.lengths.bin")


def _negative_length(art):
    lengths = np.fromfile(art / "sample" / "inputs.lengths.bin", dtype="<i4")
    lengths[30] = -3
    lengths.tofile(art / "sample" / "inputs.lengths.bin")


def _id_outside(art):
    ids = np.fromfile(art / "sample" / "inputs.values.bin", dtype="<i8")
    ids[0] = 65
    ids.tofile(art / "sample" / "inputs.values.bin")


def _manifest(edit):
    def apply(art):
        raw = json.loads((art / "manifest.json").read_text())
        edit(raw)
        (art / "manifest.json").write_text(json.dumps(raw))
    return apply


def _flip(file, at=None):
    def apply(art):
        data = bytearray((art / file).read_bytes())
        data[len(data) // 2 if at is None else at] ^= 0x10
        (art / file).write_bytes(bytes(data))
    return apply


SAMPLE_FAULTS = {
    "values truncated to 8 bytes": _cut("sample/inputs.values.bin", 8),  # read past its vector: "id 65 is out of range"
    "outputs emptied": lambda art: [_cut(f"sample/outputs.{o}.bin", 0)(art) for o in ("logit", "prob")],  # compared nothing
    "prob NaN": _first_float("sample/outputs.prob.bin", float("nan")),
    "logit infinite": _first_float("sample/outputs.logit.bin", float("inf")),
    "dense NaN": _first_float("sample/inputs.dense.bin", float("nan")),
    "dense extended": lambda art: (art / "sample/inputs.dense.bin").write_bytes((art / "sample/inputs.dense.bin").read_bytes() + b"\0"),
    "lengths sum past the values": _lengths_plus_one,
    "negative length": _negative_length,
    "id outside its table": _id_outside,
    "values file missing": lambda art: (art / "sample/inputs.values.bin").unlink(),
    "no recorded outputs": _manifest(lambda m: m["sample"].update(outputs={})),
    "sample shape": _manifest(lambda m: m["sample"]["inputs"]["values"].update(shape=[10])),
    "rows past the table": _manifest(lambda m: m["sparse_features"][2].update(rows=30)),
    "a field removed": _manifest(lambda m: m["sharding"].pop("num_devices")),
    "a field of another type": _manifest(lambda m: m.update(num_dense="13")),
    "an op library fbgemm does not ship": _manifest(lambda m: m["op_libraries"].__setitem__(1, "fbgemm_gpu_tbe^cache.so")),
    "another torch": _manifest(lambda m: m["versions"].update(torch="9.9.9")),
    "a NUL after the JSON": lambda art: (art / "manifest.json").write_bytes((art / "manifest.json").read_bytes() + b"\0}"),
    "recorded output off by 0.01": lambda art: (art / "sample/outputs.prob.bin").write_bytes(
        (np.fromfile(art / "sample/outputs.prob.bin", dtype="<f4") + np.float32(0.01)).astype("<f4").tobytes()),
}


@pytest.mark.parametrize("fault", sorted(SAMPLE_FAULTS))
def test_the_loaders_refuse_a_bad_artifact_in_the_same_words(binary, small_artifact, tmp_path, fault):
    art = tmp_path / "a"
    shutil.copytree(small_artifact, art)
    SAMPLE_FAULTS[fault](art)
    python = _python(art)
    said = _refusal(binary, art)
    if " is corrupt: " in python:  # each JSON parser words where it stopped
        assert said.startswith(python.split(" is corrupt: ")[0] + " is corrupt: "), (python, said)
    else:
        assert said == python


@pytest.fixture(scope="module")
def both(small_artifacts):
    """The small DLRM with model.pt and model.pt2 (an AOTInductor compile: 15-40 s, once per session)."""
    return small_artifacts(format="both")


UNIT_FAULTS = {  # (fault, the formats it is refused under: every one)
    "model.pt flipped": _flip("model.pt"),  # --format auto ran the intact model.pt2
    "model.pt2 flipped": _flip("model.pt2"),
    "model.pt2 missing": lambda art: (art / "model.pt2").unlink(),  # --format torchscript did not need it
    "model.pt missing": lambda art: (art / "model.pt").unlink(),
    "tables.bin flipped": _flip("tables.bin", 100),
}


@pytest.mark.parametrize("fault", sorted(UNIT_FAULTS))
@pytest.mark.parametrize("format", ["auto", "torchscript", "aoti"])
def test_a_version_is_refused_as_a_unit_whichever_model_file_runs(binary, both, tmp_path, fault, format):
    art = tmp_path / "a"
    shutil.copytree(both, art)
    UNIT_FAULTS[fault](art)
    assert _refusal(binary, art, "--format", format) == _python(art, format=format)


def test_the_allow_list_names_manifests_in_cpp_as_in_python(binary, both, tmp_path):
    """recship_predict --trusted-sha256 reads serve's allow-list: a listed manifest loads (with model.pt2 beside
    model.pt, the default export); a list naming the version's model.pt is refused with the digest to list."""
    art = tmp_path / "a"
    shutil.copytree(both, art)
    manifest = file_sha256(art / "manifest.json")
    listed = tmp_path / "trusted.txt"
    listed.write_text(f"# allowed manifests\n{manifest.upper()}  dlrm/1/manifest.json\n")
    result = run_binary(binary, art, "--trusted-sha256", listed)
    assert result.returncode == 0, result.stderr
    for name in ("model.pt", "model.pt2"):
        listed.write_text(f"{file_sha256(art / name)}  dlrm/1/{name}\n")
        said = _refusal(binary, art, "--trusted-sha256", listed)
        assert said == _python(art, trusted={file_sha256(art / name)})
        assert f"list {manifest}" in said
    listed.write_text("not-a-digest\n")
    result = run_binary(binary, art, "--trusted-sha256", listed)
    assert result.returncode == 2 and f"{listed}:1: not a sha256: 'not-a-digest'" in result.stderr
