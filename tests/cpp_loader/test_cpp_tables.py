"""The C++ loader on format recship.artifact/2 (tables.bin): refusals with Python's exact messages, outputs bitwise.

References: Python's ``open_artifact`` / ``Manifest.read`` on the very same folders (their ArtifactError is the
message recship_predict must print), Python's own model of each format on the same requests, and the same
artifact rewritten in format 1 (model.pt with its tables inside, no tables.bin).
"""

import gc
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from recship.export.artifact import FORMAT_V1, ArtifactError, Manifest, file_sha256, open_artifact
from recship.contract.tables import PINNED_NAME, TABLES_FILE

from binaries import run_binary
from model_requests import ModelInputs, in_process, random_request, request_file, runnable_aoti

AOTI_CASES = [("dlrm", 1), ("emb", 2)]  # as tests/cpp_loader/test_cpp_aoti.py compiles them (shared in the session)


@pytest.fixture(scope="module")
def other(small_artifact, tmp_path_factory):
    """The small DLRM of tests/conftest.py exported from other weights (seed 1): same layout, other tables."""
    from recship.export import ExportConfig, export_model
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    rows = [f.rows for f in Manifest.read(small_artifact).sparse_features]
    torch.manual_seed(1)
    module = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=rows, embedding_dim=8, dense_arch=[16], over_arch=[16]))
    out = tmp_path_factory.mktemp("other") / "dlrm_seed1"
    export_model(module, ExportConfig(out=str(out), dtype="int8", device="cpu", progress=False, validation_batches=1,
                                      validation_batch_size=32, format="torchscript", plot=False))
    return out


def _aoti_artifact(small_artifacts, name="dlrm", shards=1):
    return runnable_aoti(lambda: small_artifacts(name, "int8", "cpu", "both", shards))


def _python_error(art, **kwargs) -> str:
    """Python's refusal of the artifact (no model of it is left alive: an equal live tensor would be shared unread)."""
    gc.collect()
    with pytest.raises(ArtifactError) as e:
        open_artifact(art, **kwargs)
    return str(e.value)


def _assert_same_refusal(binary, art, fmt="torchscript", check=True):
    result = run_binary(binary, art, "--format", fmt)
    want = _python_error(art, format=fmt, check=check)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == f"recship_predict: error: {want}"
    return want


def _table_segments(manifest):
    return [(t, s) for t in manifest.tables.tensors for s in t.segments if s.rows is not None]


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


# -- 1. a corrupt, short, missing or foreign tables.bin: refused naming the table, in Python's words -----------------

def test_a_flipped_byte_in_a_table_is_refused_naming_it(binary, small_artifact, tmp_path):
    art = tmp_path / "flipped"
    shutil.copytree(small_artifact, art)
    tensor, segment = _table_segments(Manifest.read(art))[3]
    _flip(art / TABLES_FILE, tensor.offset + segment.offset + segment.bytes // 2)
    message = _assert_same_refusal(binary, art)
    start, end = tensor.offset + segment.offset, tensor.offset + segment.offset + segment.bytes
    assert f"table '{segment.name}' (bytes {start}..{end} of {tensor.name}) has sha256 " in message
    assert message.endswith(f", the manifest says {segment.sha256}: the file is corrupt or from another artifact")


def test_a_truncated_or_missing_tables_file_is_refused_naming_the_table(binary, small_artifact, tmp_path):
    art = tmp_path / "short"
    shutil.copytree(small_artifact, art)
    manifest = Manifest.read(art)
    tensor, segment = _table_segments(manifest)[2]
    os.truncate(art / TABLES_FILE, tensor.offset + segment.offset + 10)
    message = _assert_same_refusal(binary, art)
    assert f"the manifest says {manifest.tables.bytes} (truncated: table '{segment.name}' of {tensor.name} needs bytes up to" in message
    (art / TABLES_FILE).unlink()
    message = _assert_same_refusal(binary, art)
    assert message == f"{art}: {TABLES_FILE} cannot be read (No such file or directory): the artifact is incomplete"


def test_another_exports_tables_file_is_refused_naming_the_table(binary, small_artifact, other, tmp_path):
    art = tmp_path / "foreign"
    shutil.copytree(small_artifact, art)
    shutil.copy(other / TABLES_FILE, art / TABLES_FILE)
    assert (art / TABLES_FILE).stat().st_size == Manifest.read(art).tables.bytes  # same layout: only the bytes differ
    first = _table_segments(Manifest.read(art))[0][1]
    message = _assert_same_refusal(binary, art)
    assert f"table '{first.name}' " in message and "the file is corrupt or from another artifact (and " in message


def test_a_flipped_byte_in_a_dense_constant_of_model_pt2_is_refused_naming_it(binary, small_artifacts, tmp_path):
    art = tmp_path / "constant"
    shutil.copytree(_aoti_artifact(small_artifacts), art)
    constants = [(t, s) for t in Manifest.read(art).tables.tensors for s in t.segments if s.rows is None and s.bytes]
    assert constants  # model.pt2's dense weights live in tables.bin too
    tensor, segment = constants[-1]
    _flip(art / TABLES_FILE, tensor.offset + segment.offset)
    for fmt in ("aoti", "torchscript"):  # the tables are verified before either model file is read
        assert f"constant '{segment.name}' " in _assert_same_refusal(binary, art, fmt)


def _maps(pid: int, path: Path) -> bool:
    """Whether process ``pid`` maps the file at ``path``."""
    return str(path) in Path(f"/proc/{pid}/maps").read_text()


def test_a_corrupt_copy_of_live_tables_is_refused_by_the_process_serving_them(binary, small_artifact, tmp_path):
    """One C++ process loads version 1, then a copy whose tables.bin has a flipped byte in a table: every tensor of
    the copy equals one version 1 uses (same layout and checksums), yet the copy's own file is verified before any
    is shared, so it is refused naming the table, in the words of Python (which, with version 1 alive too, refuses
    it as well), and version 1 goes on serving. An intact copy loads and shares version 1's pages: its own mapping
    is dropped. The process is the C++ front (cpp_loader/tools/recship_front.cpp), driven through its command pipe
    as serving/front.py does (the server asks it to load only what Python loaded, so it is told directly here)."""
    from recship.serving import PredictClient
    from recship.serving.client import outputs_of
    from recship.serving.front import CppFront, FrontError
    from recship.serving.server import ServerConfig

    front_bin = binary.parent / "recship_front"
    if not front_bin.is_file():
        pytest.skip("recship_front was not built here (gRPC C++ is missing)")
    first = tmp_path / "1"
    shutil.copytree(small_artifact, first)
    corrupt, intact = tmp_path / "2", tmp_path / "3"
    shutil.copytree(first, corrupt)
    shutil.copytree(first, intact)
    manifest = Manifest.read(first)
    tensor, segment = _table_segments(manifest)[5]
    _flip(corrupt / TABLES_FILE, tensor.offset + segment.offset + segment.bytes // 3)

    model, _ = open_artifact(first, format="torchscript")  # version 1 alive in Python too: its tables are live
    with pytest.raises(ArtifactError) as e:
        open_artifact(corrupt, format="torchscript")
    want = str(e.value)
    start, end = tensor.offset + segment.offset, tensor.offset + segment.offset + segment.bytes
    assert want.startswith(f"{corrupt / TABLES_FILE}: table '{segment.name}' (bytes {start}..{end} of {tensor.name}) has sha256 ")
    assert want.endswith(f", the manifest says {segment.sha256}: the file is corrupt or from another artifact")

    # the front runs with this process's thread count: on some hosts a GEMM's rounding follows it
    config = ServerConfig(model_repo=str(tmp_path), port=0, front="cpp", torch_threads=torch.get_num_threads())
    front = CppFront(config, f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)  # no backend: nothing is forwarded
    try:
        pid = front._proc.pid
        assert front.load("dlrm", 1, first, "torchscript") == "torchscript"
        assert _maps(pid, first / TABLES_FILE)
        with pytest.raises(FrontError) as refused:
            front.load("dlrm", 2, corrupt, "torchscript")
        assert str(refused.value) == want
        assert not _maps(pid, corrupt / TABLES_FILE)  # the refused copy's mapping is gone
        assert front.load("copy", 3, intact, "torchscript") == "torchscript"
        assert _maps(pid, first / TABLES_FILE) and not _maps(pid, intact / TABLES_FILE)  # verified, then shared
        with PredictClient(f"127.0.0.1:{front.port}") as client:  # version 1 still serves, its own answers
            for name in ("dlrm", "copy"):
                for sparse, dense, weights in _requests(manifest, seed=11):
                    response = client.stub.Predict(client.request(name, sparse, dense, weights), timeout=30)
                    assert response.model_version == (1 if name == "dlrm" else 3)
                    got, expected = outputs_of(response), in_process(model, sparse, dense, weights, names=manifest.feature_names)
                    assert sorted(got) == sorted(expected)
                    for k in expected:
                        np.testing.assert_array_equal(got[k], expected[k], err_msg=f"{name} {k}")
    finally:
        front.stop(0)
    assert front._proc.returncode == 0


# -- 2. the model file pins its tables: a manifest that describes others is refused -------------------------------

def test_a_manifest_rewritten_for_other_tables_is_refused_by_model_pt(binary, small_artifact, other, tmp_path):
    art = tmp_path / "rewritten"
    shutil.copytree(small_artifact, art)
    shutil.copy(other / TABLES_FILE, art / TABLES_FILE)
    raw = json.loads((art / "manifest.json").read_text())
    raw["tables"] = json.loads((other / "manifest.json").read_text())["tables"]
    (art / "manifest.json").write_text(json.dumps(raw))
    message = _assert_same_refusal(binary, art, check=False)
    assert message == (f"{art}/model.pt was exported with other tables than manifest.json describes: "
                       "the manifest or tables.bin belongs to another artifact")


@pytest.mark.parametrize("fmt", ["torchscript", "aoti"])
def test_a_renamed_table_in_the_manifest_is_refused_by_the_model_file(binary, small_artifacts, tmp_path, fmt):
    """The bytes still verify (only a name changed), but the model file's recship/tables.json says otherwise."""
    art = tmp_path / "renamed"
    shutil.copytree(_aoti_artifact(small_artifacts) if fmt == "aoti" else small_artifacts(), art)
    raw = json.loads((art / "manifest.json").read_text())
    raw["tables"]["tensors"][0]["segments"][0]["name"] = "renamed"
    (art / "manifest.json").write_text(json.dumps(raw))
    # each model file's copy is checked, whichever runs (the version is verified as a unit): model.pt's first
    assert _assert_same_refusal(binary, art, fmt).startswith(f"{art}/model.pt was exported with other tables than manifest.json")


@pytest.mark.parametrize("fmt", ["torchscript", "aoti"])
def test_a_model_file_without_its_pinned_tables_is_refused(binary, small_artifacts, tmp_path, fmt):
    art = tmp_path / "unpinned"
    shutil.copytree(_aoti_artifact(small_artifacts) if fmt == "aoti" else small_artifacts(), art)
    raw = json.loads((art / "manifest.json").read_text())
    if fmt == "aoti":  # the archive again, every entry but the pinned copy
        with zipfile.ZipFile(art / "model.pt2") as src, zipfile.ZipFile(art / "new.pt2", "w") as dst:
            for info in src.infolist():
                if not info.filename.endswith("/extra/" + PINNED_NAME):
                    dst.writestr(info, src.read(info))
        os.replace(art / "new.pt2", art / "model.pt2")
        raw["aoti"]["sha256"] = file_sha256(art / "model.pt2")
    else:  # saved again without its extra file (the placeholders stay empty)
        import fbgemm_gpu  # noqa: F401  (registers the TBE ops model.pt calls)

        torch.jit.save(torch.jit.load(str(art / "model.pt")), str(art / "model.pt"))
        raw["model_sha256"] = file_sha256(art / "model.pt")
    (art / "manifest.json").write_text(json.dumps(raw))
    file = "model.pt2" if fmt == "aoti" else "model.pt"
    message = _assert_same_refusal(binary, art, fmt)
    assert message == f"{art}/{file} does not say which tables it was exported with ({PINNED_NAME} is missing)"


# -- 3. the manifest's tables: their fields and layout are the contract's (tests/contract's shared vectors hold both
# loaders to them, word for word) -------------------------------------------------------------------------------------

# -- 4. outputs: bitwise Python's, in each format; format 1 still loads ---------------------------------------------

def _requests(manifest, seed):
    """(sparse, dense, weights): batch 1, 7, 64 with 0-4 ids per example and feature, then batch 2 with no ids at all."""
    g = np.random.default_rng(seed)
    for batch, most in ((1, 4), (7, 4), (64, 4), (2, 0)):
        yield random_request(ModelInputs.of(manifest), batch, g, ids=(0, most))


def _assert_cpp_equals(binary, art, fmt, model, manifest, tmp_path, seed):
    for i, (sparse, dense, weights) in enumerate(_requests(manifest, seed)):
        want = in_process(model, sparse, dense, weights, names=manifest.feature_names)
        result = run_binary(binary, art, "--request", request_file(tmp_path / f"r{i}.json", sparse, dense, weights), "--format", fmt)
        assert result.returncode == 0, result.stderr
        got = json.loads(result.stdout)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32).reshape(want[k].shape), want[k], err_msg=f"{fmt} {k}")


@pytest.mark.parametrize("name", ["dlrm", "emb"])
def test_model_pt_outputs_equal_pythons_bitwise(binary, small_artifacts, tmp_path, name):
    art = small_artifacts(name)
    model, manifest = open_artifact(art, format="torchscript")
    assert manifest.tables is not None and (art / TABLES_FILE).is_file()
    _assert_cpp_equals(binary, art, "torchscript", model, manifest, tmp_path, seed=7)


@pytest.mark.parametrize("name, shards", AOTI_CASES)
def test_model_pt2_outputs_equal_pythons_bitwise(binary, small_artifacts, tmp_path, name, shards):
    art = _aoti_artifact(small_artifacts, name, shards)
    model, manifest = open_artifact(art, format="aoti")
    assert any(t.aoti is not None and t.torchscript is None for t in manifest.tables.tensors)  # constants of model.pt2 only
    _assert_cpp_equals(binary, art, "aoti", model, manifest, tmp_path, seed=8)
    del model
    scripted, _ = open_artifact(art, format="torchscript")  # the same artifact's model.pt, with the same tables.bin
    _assert_cpp_equals(binary, art, "torchscript", scripted, manifest, tmp_path, seed=9)


def test_a_format_1_artifact_still_loads_and_gives_the_same_outputs(binary, small_artifacts, tmp_path):
    """The artifact as format 1 wrote it (tables inside model.pt, no tables.bin): loaded as before, same answers."""
    src = small_artifacts("emb")
    model, manifest = open_artifact(src, format="torchscript")
    old = tmp_path / "v1"
    old.mkdir()
    torch.jit.save(model, str(old / "model.pt"))
    shutil.copytree(src / "sample", old / "sample")
    raw = manifest.to_dict()
    raw.update(format=FORMAT_V1, model_sha256=file_sha256(old / "model.pt"))
    del raw["tables"]
    (old / "manifest.json").write_text(json.dumps(raw))
    assert run_binary(binary, old, "--threads", 2).returncode == 0
    _assert_cpp_equals(binary, old, "torchscript", model, manifest, tmp_path, seed=10)
