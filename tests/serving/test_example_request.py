"""`recship example-request`: a request printed from an artifact's own sample, in both formats, is answered by a server
exactly as the sample's outputs say (its first examples), for a DLRM and for a weighted collection without dense inputs.

Reference: the artifact's sample outputs (sample/), written at export from the model in-process.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from recship.cli import main
from recship.export.artifact import Manifest, read_sample
from recship.serving.client import PredictClient
from recship.serving.server import Server, ServerConfig

sys.path.insert(0, str(Path(__file__).parent))
from serving_helpers import http_request  # noqa: E402
from model_requests import model_repo  # noqa: E402


@pytest.fixture(scope="module")
def served(small_artifacts, tmp_path_factory):
    """(server over a repository of the dlrm and the weighted emb artifact, {name: artifact})."""
    arts = {"dlrm": small_artifacts("dlrm"), "emb": small_artifacts("emb")}
    server = Server(ServerConfig(model_repo=str(model_repo(tmp_path_factory.mktemp("example-repo"), arts)), port=0, http_port=0,
                                 max_delay_ms=1))
    yield server, arts
    server.stop()


def _printed(capsys, *argv: str) -> dict:
    assert main(["example-request", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", ["dlrm", "emb"])
@pytest.mark.parametrize("batch", [1, 3])
def test_each_format_is_answered_as_the_sample_says(served, capsys, name, batch):
    server, arts = served
    manifest = Manifest.read(arts[name])
    _, want = read_sample(arts[name], manifest)
    body = _printed(capsys, str(arts[name]), "--batch", str(batch))
    status, _, answer = http_request(server.rest.port, "POST", f"/v2/models/{name}/infer", json.dumps(body).encode())
    assert status == 200, answer
    got = {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"]) for o in json.loads(answer)["outputs"]}
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k][:batch].numpy()), k
    request = _printed(capsys, str(arts[name]), "--batch", str(batch), "--format", "predict")
    assert ("weights" in request) == any(f.weighted for f in manifest.sparse_features)
    with PredictClient(f"127.0.0.1:{server.port}") as client:
        outputs = client.predict(name, request["sparse"], request.get("dense"), request.get("weights"))
    for k in want:
        assert np.array_equal(outputs[k], want[k][:batch].numpy()), k


def test_a_model_folder_gives_its_newest_version_and_bad_arguments_are_refused(small_artifacts, tmp_path, capsys):
    repo = model_repo(tmp_path, {"dlrm": small_artifacts("dlrm")})
    assert _printed(capsys, str(repo / "dlrm")) == _printed(capsys, str(repo / "dlrm" / "1"))
    assert main(["example-request", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["example-request", str(tmp_path)]) == 2
    assert "neither an artifact" in capsys.readouterr().err
    assert main(["example-request", str(repo / "dlrm"), "--batch", "0"]) == 2
    assert "--batch 0: the artifact's sample has" in capsys.readouterr().err
