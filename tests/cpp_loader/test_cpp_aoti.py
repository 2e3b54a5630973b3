"""The C++ loader on model.pt2 (AOTInductor) against Python's TorchScript model.pt: same outputs, bitwise,
on random requests of batch 1, 7 and 513 and requests with 0 and 1 ids; the format choice (auto, torchscript,
aoti) and its refusals; requests validated before the compiled model, which checks nothing itself."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from recship.export.aoti import cpu_supports
from recship.export.artifact import Manifest, open_artifact
from recship.serving import PredictClient
from recship.serving.requests import InvalidRequest, ModelSpec, RequestArrays, validate

from bad_requests import bad_requests
from binaries import run_binary
from model_requests import ModelInputs, hash_ids, in_process, random_request, request_file

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="needs cmake and a C++ compiler (g++) to build the loader and compile model.pt2",
)
CASES = [("dlrm", 1), ("emb", 2)]  # the DLRM; the weighted EmbeddingBagCollection (MEAN, modulo ids), row-wise on 2 shards


@pytest.fixture(scope="module")
def compiled(small_artifacts):
    """model -> artifact with model.pt and model.pt2 (tests/conftest.py's small_artifacts, format "both")."""
    return {name: small_artifacts(name, "int8", "cpu", "both", shards) for name, shards in CASES}


def _requests(manifest, seed):
    """(sparse, dense, weights): batch 1, 7, 513, then batch 2 with 0 ids and with 1.
    Ids stay inside each table, except modulo features' (up to 3 times past it: the loader hashes them)."""
    g = np.random.default_rng(seed)
    inputs = ModelInputs.of(manifest)
    for batch in (1, 7, 513):
        yield random_request(inputs, batch, g, past_modulo=3)
    for n_ids in (0, 1):  # the sizes torch.export likes to specialise
        sparse, dense, weights = random_request(inputs, 2, g, ids=(0, 0))
        if n_ids:
            first = manifest.sparse_features[0]
            sparse[first.name][1] = [int(g.integers(0, first.rows))]
            if first.weighted:
                weights[first.name][1] = [float(g.random())]
        yield sparse, dense, weights


def _torchscript_outputs(model, manifest, sparse, dense, weights):
    """The reference: Python's torch.jit model.pt on the same request, modulo ids hashed as the loader does."""
    return in_process(model, hash_ids(sparse, ModelInputs.of(manifest)), dense, weights, names=manifest.feature_names)


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_cpp_aoti_equals_python_torchscript_bitwise(binary, compiled, tmp_path, name):
    art = compiled[name]
    manifest = Manifest.read(art)
    assert manifest.aoti is not None and (art / "model.pt2").is_file()
    scripted, _ = open_artifact(art, format="torchscript")
    for i, (sparse, dense, weights) in enumerate(_requests(manifest, 5)):
        request = request_file(tmp_path / f"r{i}.json", sparse, dense, weights)
        want = _torchscript_outputs(scripted, manifest, sparse, dense, weights)
        for fmt in ("aoti", "torchscript"):  # the C++ TorchScript path still runs model.pt of the same artifact
            result = run_binary(binary, art, "--request", request, "--format", fmt, "--max-batch-size", 1024)
            assert result.returncode == 0, (fmt, result.stderr)
            got = json.loads(result.stdout)
            assert set(got) == set(want)
            for k in want:
                np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32).reshape(want[k].shape), want[k], err_msg=f"{fmt} {k}")
    # auto runs model.pt2 here; the sample self-check ran on it, and 8 threads at once each get their own answer
    sample = run_binary(binary, art, "--threads", 8)
    assert sample.returncode == 0 and "threads ok: 8 threads got their own answers from aoti (model.pt2)" in sample.stderr, sample.stderr
    sample = run_binary(binary, art, "--threads", 2, "--format", "torchscript")
    assert sample.returncode == 0 and "from torchscript (model.pt)" in sample.stderr, sample.stderr


def test_invalid_requests_are_refused_before_the_compiled_model(binary, compiled, tmp_path):
    """AOTI checks no shapes: the loader's validation runs first, with the server's and the TorchScript path's words."""
    art = compiled["dlrm"]
    manifest = Manifest.read(art)
    spec = ModelSpec.from_manifest(manifest, 512)
    rows = [f.rows for f in manifest.sparse_features]
    cases = [(sparse, d, weights) for _, sparse, d, weights in bad_requests(rows, manifest.num_dense)]
    good = {f"cat_{i}": [[1], [2]] for i in range(len(rows))}
    # cat_0 with 1 example, the others 2: recship_predict takes the batch from the first feature, as PredictClient does
    cases.append(({**good, "cat_0": [[1]]}, [[0.5] * manifest.num_dense] * 2, None))
    for sparse, d, weights in cases:
        request = request_file(tmp_path / "bad.json", sparse, d, weights)
        aoti = run_binary(binary, art, "--request", request, "--format", "aoti")
        scripted = run_binary(binary, art, "--request", request, "--format", "torchscript")
        assert aoti.returncode == scripted.returncode == 2, aoti.stderr
        assert aoti.stderr == scripted.stderr and aoti.stderr.startswith("recship_predict: invalid request: ")
        with pytest.raises(InvalidRequest) as server_error:
            validate(RequestArrays.from_message(PredictClient.request("m", sparse, d, weights)), spec)
        assert aoti.stderr.strip() == f"recship_predict: invalid request: {server_error.value}"
    assert aoti.stderr.strip() == "recship_predict: invalid request: sparse feature 'cat_1': 2 lengths for batch_size 1"
    out_of_range = [c for c in cases if c[0]["cat_3"] == [[1], [rows[3]]]]
    assert out_of_range  # bad_requests still has the id one past its table
    result = run_binary(binary, art, "--request", request_file(tmp_path / "oor.json", *out_of_range[0]), "--format", "aoti")
    assert result.stderr.strip() == f"recship_predict: invalid request: feature 'cat_3': id {rows[3]} is out of range [0, {rows[3]})"


def test_format_aoti_is_refused_where_model_pt2_cannot_run(binary, compiled, small_artifact, tmp_path):
    result = run_binary(binary, small_artifact, "--format", "aoti")  # exported without model.pt2
    assert result.returncode == 1
    assert result.stderr.strip() == f"recship_predict: error: {small_artifact}: the artifact has no model.pt2 (exported with --format torchscript)"
    assert run_binary(binary, small_artifact).returncode == 0  # auto: model.pt, silently
    bad = run_binary(binary, compiled["dlrm"], "--format", "onnx")
    assert bad.returncode == 2 and "--format must be auto, torchscript or aoti" in bad.stderr

    art = tmp_path / "other_torch"
    shutil.copytree(compiled["dlrm"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["aoti"]["torch"] = torch.__version__.split("+")[0] + "+cu999"  # same release, another build
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run_binary(binary, art, "--format", "aoti")
    assert result.returncode == 1 and f"model.pt2 was compiled by torch {manifest['aoti']['torch']}, this binary runs torch {torch.__version__}" in result.stderr
    result = run_binary(binary, art, "--threads", 2)  # auto falls back to model.pt, and says why
    assert result.returncode == 0 and "from torchscript (model.pt)" in result.stderr
    assert "note: running model.pt: model.pt2 was compiled by torch" in result.stderr

    isa_missing = [isa for isa in ("x86-64-v4", "x86-64-v3") if not cpu_supports(isa)[0]]
    if isa_missing:  # a CPU without AVX-512 (most CI machines): a package for it is refused, not run into SIGILL
        manifest["aoti"]["torch"], manifest["aoti"]["target_isa"] = torch.__version__, isa_missing[0]
        (art / "manifest.json").write_text(json.dumps(manifest))
        result = run_binary(binary, art, "--format", "aoti")
        assert result.returncode == 1 and f"model.pt2 targets {isa_missing[0]}; this CPU lacks {cpu_supports(isa_missing[0])[1]}" in result.stderr


def test_tampered_model_pt2_refuses_the_version_whichever_file_runs(binary, compiled, tmp_path):
    """A version is verified as a unit: a damaged or missing model.pt2 refuses it under --format
    torchscript too, which used to load model.pt and never look at model.pt2."""
    art = tmp_path / "tampered"
    shutil.copytree(compiled["emb"], art)
    (art / "model.pt2").write_bytes((art / "model.pt2").read_bytes() + b"x")
    for fmt in ("auto", "aoti", "torchscript"):
        result = run_binary(binary, art, "--format", fmt)
        assert result.returncode == 1 and "model.pt2: sha256" in result.stderr and "does not match the manifest" in result.stderr
    (art / "model.pt2").unlink()
    for fmt in ("auto", "aoti", "torchscript"):
        result = run_binary(binary, art, "--format", fmt)
        assert result.returncode == 1 and f"{art}: model.pt2 is missing" in result.stderr


def test_the_loader_refuses_a_bad_aoti_section_and_loads_without_one(binary, compiled, tmp_path):
    art = tmp_path / "dlrm"
    shutil.copytree(compiled["dlrm"], art)
    raw = json.loads((art / "manifest.json").read_text())
    broken = json.loads(json.dumps(raw))
    broken["aoti"]["input_order"] = ["dense", "lengths", "values", "weights"]  # the DLRM is unweighted
    (art / "manifest.json").write_text(json.dumps(broken))
    result = run_binary(binary, art)
    assert result.returncode == 1 and "aoti.input_order must be" in result.stderr
    del broken["aoti"]
    (art / "manifest.json").write_text(json.dumps(broken))  # without "aoti", the artifact is a TorchScript one
    result = run_binary(binary, art, "--threads", 2)
    assert result.returncode == 0 and "from torchscript (model.pt)" in result.stderr and "note" not in result.stderr
