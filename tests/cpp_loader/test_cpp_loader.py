"""The C++ loader against Python's torch.jit.load: same outputs, same validation, documented errors, threads."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from recship.export.artifact import ArtifactError, Manifest, open_artifact
from recship.serving.requests import InvalidRequest, ModelSpec, RequestArrays, validate
from recship.serving import PredictClient

from bad_requests import bad_requests
from binaries import run_binary
from model_requests import ModelInputs, hash_ids, in_process, random_request, request_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifacts(small_artifacts):
    """(model, dtype) -> artifact path: the session's small DLRM and weighted EmbeddingBagCollection (tests/conftest.py)."""
    return {(name, dtype): small_artifacts(name, dtype) for dtype in ("int8", "int4") for name in ("dlrm", "emb")}


@pytest.mark.parametrize("name", ["dlrm", "emb"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cpp_outputs_equal_python_bitwise(binary, artifacts, tmp_path, name, dtype):
    art = artifacts[(name, dtype)]
    manifest = Manifest.read(art)
    inputs = ModelInputs.of(manifest)
    sparse, dense, weights = random_request(inputs, 6, 3, ids=(0, 4), past_modulo=3)
    result = run_binary(binary, art, "--request", request_file(tmp_path / "r.json", sparse, dense, weights))
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    want = in_process(open_artifact(art)[0], hash_ids(sparse, inputs), dense, weights, names=manifest.feature_names)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32), want[k])
    sample = run_binary(binary, art, "--threads", 8)  # the sample, plus 8 threads each checking its own answer
    assert sample.returncode == 0 and "threads ok: 8" in sample.stderr, sample.stderr


def test_invalid_requests_get_the_servers_messages(binary, artifacts, tmp_path):
    art = artifacts[("dlrm", "int8")]
    manifest = Manifest.read(art)
    spec = ModelSpec.from_manifest(manifest, 512)
    rows = [f.rows for f in manifest.sparse_features]
    for _, sparse, d, weights in bad_requests(rows, manifest.num_dense):
        with pytest.raises(InvalidRequest) as server_error:
            validate(RequestArrays.from_message(PredictClient.request("m", sparse, d, weights)), spec)
        result = run_binary(binary, art, "--request", request_file(tmp_path / "bad.json", sparse, d, weights))
        assert result.returncode == 2
        assert result.stderr.strip() == f"recship_predict: invalid request: {server_error.value}"


def test_help_describes_every_flag_and_bad_arguments_exit_2(binary):
    for flag in ("--help", "-h"):
        result = run_binary(binary, flag)
        assert result.returncode == 0 and result.stdout.startswith("usage: recship_predict ARTIFACT_DIR")
        usage = result.stdout.splitlines()[0]
        flags = [word.strip("[") for word in usage.split() if word.startswith("[--")]
        described = [line.split()[0] for line in result.stdout.splitlines()[1:] if line.startswith("  -")]
        assert flags and set(flags) <= set(described), (flags, described)
    assert run_binary(binary).returncode == 2
    assert run_binary(binary, "some_dir", "--nope").returncode == 2


def test_tampered_model_and_missing_op_library(binary, artifacts, tmp_path):
    art = tmp_path / "tampered"
    shutil.copytree(artifacts[("dlrm", "int8")], art)
    (art / "model.pt").write_bytes((art / "model.pt").read_bytes() + b"x")
    result = run_binary(binary, art)
    assert result.returncode == 1 and "model.pt: sha256" in result.stderr and "does not match the manifest" in result.stderr
    result = run_binary(binary, artifacts[("dlrm", "int8")], "--fbgemm-dir", tmp_path / "no_fbgemm")
    assert result.returncode == 1 and "cannot load fbgemm op library" in result.stderr
    result = run_binary(binary, tmp_path / "nothing")
    assert result.returncode == 1 and "manifest.json is missing" in result.stderr


def test_example_program_links_the_library_with_add_subdirectory(binary, artifacts, tmp_path):
    import fbgemm_gpu
    import nlohmann_json
    import os

    build = ROOT / "build" / "cpp_example"
    if not (build / "CMakeCache.txt").exists():
        subprocess.run(
            ["cmake", "-S", str(ROOT / "cpp_loader" / "example"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DNLOHMANN_JSON_INCLUDE_DIR={nlohmann_json.get_include()}",
             f"-DRECSHIP_FBGEMM_DIR={os.path.dirname(fbgemm_gpu.__file__)}"],
            check=True, capture_output=True, text=True,
        )
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, capture_output=True, text=True)
    art = artifacts[("dlrm", "int8")]
    result = subprocess.run([str(build / "recship_example"), str(art)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    want = np.fromfile(art / Manifest.read(art).sample.outputs["prob"].file, dtype="<f4")[0]
    assert f"prob[0] = {want:.6g}" in result.stdout


def test_version_mismatch_is_refused(binary, artifacts, tmp_path):
    art = tmp_path / "other_torch"
    shutil.copytree(artifacts[("dlrm", "int8")], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["versions"]["torch"] = "9.9.9"
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run_binary(binary, art)
    assert result.returncode == 1 and f"{art}/manifest.json: artifact built with torch 9.9.9, this loader runs torch" in result.stderr


def test_max_batch_size_is_an_option(binary, artifacts, tmp_path):
    art = artifacts[("emb", "int8")]
    sparse = {n: [[1]] * 600 for n in ("x", "y", "z")}
    weights = {n: [[0.5]] * 600 for n in sparse}
    request = request_file(tmp_path / "big.json", sparse, None, weights)
    refused = run_binary(binary, art, "--request", request)
    assert refused.returncode != 0 and "batch_size 600 exceeds the model's limit of 512" in refused.stderr
    allowed = run_binary(binary, art, "--request", request, "--max-batch-size", "1024")
    assert allowed.returncode == 0, allowed.stderr
    model, manifest = open_artifact(art)
    want = in_process(model, sparse, None, weights, names=manifest.feature_names)
    got = json.loads(allowed.stdout)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32).reshape(want[k].shape), want[k])


def test_the_loader_refuses_a_manifest_the_contract_refuses_in_its_words(binary, artifacts, tmp_path):
    """Model::load checks the manifest with the contract (tests/contract holds that check to the shared vectors, word
    for word with Python's): a required field removed is refused as open_artifact refuses it, and an optional one
    removed still loads."""
    for name in ("dlrm", "emb"):
        art = tmp_path / name
        shutil.copytree(artifacts[(name, "int8")], art)
        raw = json.loads((art / "manifest.json").read_text())
        broken = json.loads(json.dumps(raw))
        del broken["sparse_features"][1]["id_policy"]
        (art / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(ArtifactError) as refused:
            open_artifact(art)
        assert str(refused.value) == f"{art}/manifest.json: sparse_features[1].id_policy is missing"
        result = run_binary(binary, art)
        assert result.returncode == 1 and str(refused.value) in result.stderr, result.stderr
        optional = json.loads(json.dumps(raw))
        for f in optional["sparse_features"]:
            del f["weighted"]  # not required: the manifest's weighted applies
        (art / "manifest.json").write_text(json.dumps(optional))
        result = run_binary(binary, art)
        assert result.returncode == 0, result.stderr
