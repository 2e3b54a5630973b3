"""A model TorchScript cannot compile and torch.export can (tests/export/hidden_fm.py: ``torch.zeros(B, D)`` and
``ebc(features)["user"]``): trained on 2 gloo ranks, exported with the default format to model.pt2 alone with a
one-line note, served by both fronts and run by recship_predict, each answer bitwise the artifact's in process.
Model files that are absent are refused by name, in Python and C++ alike."""

import json
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
from torch import nn

from recship.export import ExportConfig, ExportError, export_model
from recship.export.artifact import ArtifactError, Manifest, aoti_runs_here, open_artifact
from recship.serving import PredictClient
from recship.serving.front import FrontError, build_front
from recship.serving.server import Server, ServerConfig

from model_requests import ModelInputs, in_process, model_repo, random_request, request_file
from tests.export.hidden_fm import HiddenFM

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="model.pt2 needs a C++ compiler (g++)")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(artifact folder, what `recship export` printed on stderr): HiddenFM trained by `recship train --model` on 2
    gloo ranks, exported from its checkpoint as a user would, with a C++ compiler present (RECSHIP_AOTI=1)."""
    from recship.cli import main

    root = tmp_path_factory.mktemp("pt2-only")
    assert main(["train", "--model", "tests.export.hidden_fm:build", "--out", str(root / "run"), "--steps", "30", "--batch-size", "32",
                 "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress", "--nproc-per-node", "2"]) == 0
    checkpoint = sorted((root / "run" / "checkpoints").iterdir())[-1]
    out = root / "artifact"
    done = subprocess.run([sys.executable, "-m", "recship", "export", str(checkpoint), "--out", str(out), "--model-name", "fm",
                           "--validation-batch-size", "64"], capture_output=True, text=True, env={**os.environ, "RECSHIP_AOTI": "1"})
    assert done.returncode == 0, done.stderr
    runs, why = aoti_runs_here(Manifest.read(out))
    if not runs:
        pytest.skip(f"model.pt2 does not run here: {why}")
    return out, done.stderr


def test_the_artifact_is_model_pt2_alone_with_a_one_line_note(exported):
    out, stderr = exported
    assert sorted(p.name for p in out.iterdir() if p.name != "tables.png") == ["manifest.json", "model.pt2", "sample", "tables.bin"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "model_sha256" not in manifest and manifest["aoti"]["file"] == "model.pt2"
    notes = [line for line in stderr.splitlines() if "no model.pt" in line]
    assert len(notes) == 1, stderr
    line = next(n for n, text in enumerate(open(sys.modules[HiddenFM.__module__].__file__), 1) if "torch.zeros(B, self.dim)" in text)
    assert ("fx trace failed: TypeError: zeros() takes 1 positional argument but 2 were given "
            f"(at hidden_fm.py:{line}: total = torch.zeros(B, self.dim))") in notes[0]
    assert "model.pt2 (torch.export + AOTInductor)" in notes[0]
    # trained, and quantized close to the float model
    assert manifest["validation"]["relative_diff_vs_float"] < 0.02


def test_both_fronts_and_recship_predict_answer_as_the_artifact_in_process(exported, binary, tmp_path):
    out, _ = exported
    model, manifest = open_artifact(out)
    assert model.format == "aoti"
    repo = model_repo(tmp_path / "repo", {"fm": out})
    fronts = ["python"]
    try:
        build_front()
        fronts.append("cpp")
    except FrontError:  # no gRPC C++ here: the Python front alone
        pass
    requests = [random_request(ModelInputs.of(manifest), batch, seed) for batch, seed in [(1, 1), (7, 2), (300, 3)]]
    wants = [in_process(model, *r) for r in requests]
    for front in fronts:
        server = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_delay_ms=2, front=front))
        try:
            with PredictClient(f"127.0.0.1:{server.port}") as client:
                for (sparse, dense, weights), want in zip(requests, wants):
                    got = client.predict("fm", sparse, dense, weights)
                    assert set(got) == set(want) == {"output"}
                    np.testing.assert_array_equal(got["output"], want["output"], err_msg=front)
                with pytest.raises(grpc.RpcError) as e:  # an id past the table is refused, not looked up as another row
                    client.predict("fm", {**requests[0][0], "user": [[120]]}, requests[0][1], None)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            server.stop()
    for n, ((sparse, dense, weights), want) in enumerate(zip(requests, wants)):
        path = request_file(tmp_path / f"r{n}.json", sparse, dense, weights)
        done = subprocess.run([str(binary), str(out), "--request", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        got = np.asarray(json.loads(done.stdout)["output"], dtype=np.float32).reshape(want["output"].shape)
        np.testing.assert_array_equal(got, want["output"])


def test_the_absent_model_pt_is_refused_by_name_in_python_and_cpp(exported, binary, capsys):
    from recship.cli import main

    out, _ = exported
    message = f"{out} has no model.pt: TorchScript could not compile this model at export, its program is model.pt2"
    with pytest.raises(ArtifactError, match="has no model.pt: TorchScript could not compile"):
        open_artifact(out, format="torchscript")
    done = subprocess.run([str(binary), str(out), "--format", "torchscript"], capture_output=True, text=True)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert main(["inspect", str(out)]) == 0
    said = capsys.readouterr().out
    assert "model.pt: none (TorchScript could not compile the model" in said and "sample self-check: ok (model.pt2" in said


def test_a_manifest_with_neither_program_is_refused_alike(exported, binary, tmp_path):
    out, _ = exported
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["aoti"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="manifest.json: model_sha256 is missing"):
        open_artifact(bad)
    done = subprocess.run([str(binary), str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "manifest.json: model_sha256 is missing" in done.stderr, done.stderr


def test_torchscript_format_demands_model_pt_and_names_the_stage_and_line(tmp_path):
    model = HiddenFM()
    with pytest.raises(ExportError, match=r"HiddenFM: fx trace failed: .* \(at hidden_fm.py:\d+: total = torch.zeros\(B, self.dim\)\)"):
        export_model(model, ExportConfig(out=str(tmp_path / "a"), format="torchscript", progress=False, validation_batches=1,
                                         validation_batch_size=8))
    assert not (tmp_path / "a").exists()


class _DataDependent(HiddenFM):
    """Neither fx nor torch.export can follow a Python branch on a tensor's value."""

    def forward(self, dense, features):
        out = super().forward(dense, features)
        if out.sum() > 0:
            return out
        return -out


def test_a_model_neither_path_takes_names_both_stages(tmp_path):
    with pytest.raises(ExportError) as e:
        export_model(_DataDependent(), ExportConfig(out=str(tmp_path / "a"), format="aoti", progress=False, validation_batches=1,
                                                    validation_batch_size=8))
    text = str(e.value)
    assert text.startswith("torch.export failed:") and "; and fx trace failed:" in text and "neither model.pt2 nor model.pt" in text, text
    exported_part = text.split("; and fx trace failed")[0]
    assert "(at test_pt2_only.py:" in exported_part and "if out.sum() > 0:" in exported_part, text  # the user's line, torch.export's too
    assert not (tmp_path / "a").exists()


def test_a_model_torchscript_compiles_keeps_model_pt_beside_model_pt2(tmp_path):
    """The usual case is unchanged: format aoti writes both files, and auto loads model.pt2 while model.pt stays."""
    class Plain(nn.Module):
        num_dense = 3

        def __init__(self):
            super().__init__()
            self.inner = HiddenFM()

        def forward(self, dense, features):
            pooled = self.inner.ebc(features).to_dict()
            return self.inner.out(pooled["user"] * pooled["item"] + self.inner.dense(dense))

    manifest = export_model(Plain(), ExportConfig(out=str(tmp_path / "a"), format="aoti", progress=False, validation_batches=1,
                                                  validation_batch_size=8))
    assert "model_sha256" in manifest and manifest["aoti"]["file"] == "model.pt2"
    assert (tmp_path / "a" / "model.pt").is_file() and (tmp_path / "a" / "model.pt2").is_file()
