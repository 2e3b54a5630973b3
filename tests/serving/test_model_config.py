"""Per-model config.yaml (batching limits, version policy, id-policy overrides) and serving several versions at once."""

import json
import shutil
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.serving import PredictClient
from recship.serving.kserve import repository_index
from recship.serving.settings import ModelSettings, VersionPolicy, read_model_config
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from recship.models.dlrm import BuiltinDLRM, DLRMConfig

from model_requests import dlrm_request, in_process
from serving_helpers import wait_until

ROWS = [20 + i for i in range(26)]


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Three versions of one small DLRM (different seeds, so different outputs): staged / "1", "2", "3"."""
    root = tmp_path_factory.mktemp("staged")
    for version in (1, 2, 3):
        torch.manual_seed(version)
        model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
        export_model(model, ExportConfig(out=str(root / str(version)), dtype="int8", progress=False, validation_batches=1,
                                         validation_batch_size=32))
    return root


def _put(staged, root, model, version):
    """Moves a finished version into place with a rename, as a deployment would."""
    hidden = root / model / f".incoming-{version}"
    shutil.copytree(staged / str(version), hidden)
    hidden.rename(root / model / str(version))


def _configure(root, model, text):
    """Writes the model's config.yaml with a rename, as a deployment would: a scan never reads it half written."""
    (root / model / ".config.yaml").write_text(text)
    (root / model / ".config.yaml").replace(root / model / "config.yaml")


def _served(server, model):
    return [s.version for s in server.repo.versions(model)]


def _predict(client, model, sparse, dense, version=0, weights=None):
    """(the version that answered, its outputs)."""
    r = client.stub.Predict(client.request(model, sparse, dense, weights, version), timeout=10)
    return r.model_version, {t.name: np.asarray(t.values, dtype=np.float32).reshape(list(t.shape)) for t in r.outputs}


def _server(root, **kw):
    return Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.2, **kw))


def test_latest_two_serves_two_versions_each_bitwise_and_follows_adds_and_removals(tmp_path, staged):
    root = tmp_path / "repo"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.yaml").write_text("version-policy: {latest: 2}\n")
    for v in (1, 2):
        shutil.copytree(staged / str(v), root / "m" / str(v))
    server = _server(root, http_port=0)
    try:
        assert _served(server, "m") == [2, 1]
        sparse, dense = dlrm_request(3, 1)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            for asked, answered in ((1, 1), (2, 2), (0, 2)):  # 0: the newest served
                version, got = _predict(client, "m", sparse, dense, asked)
                want = in_process(open_artifact(staged / str(answered))[0], sparse, dense)
                assert version == answered and set(got) == set(want)
                for k in want:
                    np.testing.assert_array_equal(got[k], want[k])
            assert not np.array_equal(_predict(client, "m", sparse, dense, 1)[1]["logit"], _predict(client, "m", sparse, dense, 2)[1]["logit"])
            listed = client.stub.ListModels(pb.ListModelsRequest(), timeout=5).models
            assert [(m.name, list(m.versions), m.serving_version) for m in listed] == [("m", [2, 1], 2)]
            with urllib.request.urlopen(f"http://127.0.0.1:{server.rest.port}/v2/models/m", timeout=5) as r:
                assert json.loads(r.read())["versions"] == ["2", "1"]
            assert [(e["version"], e["state"]) for e in repository_index(server.repo)] == [("1", "READY"), ("2", "READY")]

            _put(staged, root, "m", 3)  # latest: 2 -> {3, 2}: version 1 goes
            wait_until(lambda: _served(server, "m") == [3, 2], "versions 3 and 2")
            assert _predict(client, "m", sparse, dense, 3)[0] == 3
            with pytest.raises(grpc.RpcError) as err:
                _predict(client, "m", sparse, dense, 1)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert err.value.details() == "model 'm' version 1 is not served (serving versions [3, 2])"

            shutil.rmtree(root / "m" / "3")  # rollback: the policy picks the 2 newest of what remains, {2, 1}
            wait_until(lambda: _served(server, "m") == [2, 1], "the rollback to versions 2 and 1")
            version, got = _predict(client, "m", sparse, dense, 1)
            assert version == 1
            np.testing.assert_array_equal(got["prob"], in_process(open_artifact(staged / "1")[0], sparse, dense)["prob"])
            assert _predict(client, "m", sparse, dense)[0] == 2
    finally:
        server.stop()


def test_all_then_an_edited_config_specific_one_serves_only_that_version(tmp_path, staged):
    root = tmp_path / "repo"
    (root / "m").mkdir(parents=True)
    (root / "m" / "config.yaml").write_text("version-policy: all\n")
    for v in (1, 2, 3):
        shutil.copytree(staged / str(v), root / "m" / str(v))
    server = _server(root)
    try:
        assert _served(server, "m") == [3, 2, 1]
        _configure(root, "m", "version_policy:\n  specific: [1]\n")  # picked up on the next scan
        wait_until(lambda: _served(server, "m") == [1], "version 1 alone")
        sparse, dense = dlrm_request(2, 2)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            version, got = _predict(client, "m", sparse, dense)
            assert version == 1
            np.testing.assert_array_equal(got["logit"], in_process(open_artifact(staged / "1")[0], sparse, dense)["logit"])
            with pytest.raises(grpc.RpcError) as err:
                _predict(client, "m", sparse, dense, 3)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        (root / "m" / "config.yaml").unlink()  # no config.yaml: the server's default, the newest version
        wait_until(lambda: _served(server, "m") == [3], "version 3 alone")
    finally:
        server.stop()


def test_per_model_batch_limit_a_bad_config_refuses_only_its_model_and_edits_take_effect(tmp_path, staged):
    root = tmp_path / "repo"
    for model, config in (("small", "max-batch-size: 4\nmax-delay-ms: 0\n"), ("bad", "max-batch-size: 4\nbogus-key: 1\n"),
                          ("plain", None)):
        shutil.copytree(staged / "1", root / model / "1")
        if config is not None:
            (root / model / "config.yaml").write_text(config)
    server = _server(root, max_batch_size=64)
    try:
        assert [m.name for m in server.repo.models()] == ["plain", "small"]
        index = [e for e in repository_index(server.repo) if e["name"] == "bad"]
        assert [(e["version"], e["state"]) for e in index] == [("", "UNAVAILABLE")]
        assert str(root / "bad" / "config.yaml") in index[0]["reason"] and "unknown key 'bogus-key'" in index[0]["reason"]
        assert server.repo.get("small").batcher.max_batch_size == 4 and server.repo.get("plain").batcher.max_batch_size == 64
        sparse5, dense5 = dlrm_request(5, 3)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            with pytest.raises(grpc.RpcError) as err:
                _predict(client, "small", sparse5, dense5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "batch_size 5 exceeds the model's limit of 4"
            assert client.metadata("small").max_batch_size == 4
            assert _predict(client, "plain", sparse5, dense5)[0] == 1  # the server's limit, 64
            with pytest.raises(grpc.RpcError) as err:
                _predict(client, "bad", sparse5, dense5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

            _configure(root, "small", "max-batch-size: 8\n")
            _configure(root, "bad", "max-batch-size: 4\n")
            wait_until(lambda: server.repo.get("small").spec.max_batch_size == 8, "small's new limit")
            wait_until(lambda: [m.name for m in server.repo.models()] == ["bad", "plain", "small"], "the fixed model")
            assert [e for e in repository_index(server.repo) if e["state"] != "READY"] == []
            version, got = _predict(client, "small", sparse5, dense5)
            np.testing.assert_array_equal(got["logit"], in_process(open_artifact(staged / "1")[0], sparse5, dense5)["logit"])

            _configure(root, "small", "max-batch-size: 0\n")  # bad: small keeps serving, with its last good settings
            wait_until(lambda: any(e["name"] == "small" and e["version"] == "" for e in repository_index(server.repo)), "the refusal")
            reason = next(e["reason"] for e in repository_index(server.repo) if e["name"] == "small" and e["version"] == "")
            assert reason == f"{root / 'small' / 'config.yaml'}: max-batch-size: takes an integer >= 1, got 0"
            assert _predict(client, "small", sparse5, dense5)[0] == 1
    finally:
        server.stop()


def test_id_policy_overrides_change_validation(tmp_path, small_artifacts):
    root = tmp_path / "repo"
    shutil.copytree(small_artifacts("emb"), root / "emb" / "1")  # x, y: table a (40 rows, reject); z: table b (30 rows, modulo)
    (root / "emb" / "config.yaml").write_text("id-policy: {x: modulo, z: reject}\n")
    shutil.copytree(small_artifacts("emb"), root / "typo" / "1")
    (root / "typo" / "config.yaml").write_text("id-policy: {nope: modulo}\n")
    server = _server(root)
    try:
        assert [m.name for m in server.repo.models()] == ["emb"]
        refused = [e for e in repository_index(server.repo) if e["name"] == "typo"]
        assert [(e["version"], e["state"]) for e in refused] == [("1", "UNAVAILABLE")]
        assert "id-policy names ['nope'], which version 1 does not have" in refused[0]["reason"]
        model, _ = open_artifact(root / "emb" / "1")
        sparse = {"x": [[45, 1]], "y": [[2]], "z": [[3]]}
        weights = {"x": [[1.0, 0.5]], "y": [[1.0]], "z": [[2.0]]}
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            meta = client.metadata("emb")
            assert {f.name: f.id_policy for f in meta.sparse_features} == {"x": "modulo", "y": "reject", "z": "reject"}
            _, got = _predict(client, "emb", sparse, None, weights=weights)
            with torch.no_grad():  # x's 45 is folded into its 40-row table before the model
                want = model(torch.zeros(1, 0), torch.tensor([2, 1, 1], dtype=torch.int32), torch.tensor([5, 1, 2, 3]),
                             torch.tensor([1.0, 0.5, 1.0, 2.0]))
            assert set(got) == set(want)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k].numpy())
            with pytest.raises(grpc.RpcError) as err:  # z's modulo is overridden: 31 is outside its 30 rows
                _predict(client, "emb", {**sparse, "z": [[31]]}, None, weights=weights)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "id 31 is out of range [0, 30)" in err.value.details()
    finally:
        server.stop()


DEFAULTS = ModelSettings(512, 2.0, True, 1024, None)
BAD = [
    ("max_queue: -1\n", "max_queue: takes an integer >= 1, got -1"),
    ("batching: 1\n", "batching: takes true or false, got 1"),
    ("max-delay-ms: -2\n", "max-delay-ms: takes a number from 0 to 60000, got -2"),
    ("max-delay-ms: 60001\n", "max-delay-ms: takes a number from 0 to 60000, got 60001"),
    ("torch-threads: 1025\n", "torch-threads: takes an integer from 1 to 1024 (or null: the server's), got 1025"),
    ("torch-threads: 0\n", "torch-threads: takes an integer from 1 to 1024 (or null: the server's), got 0"),
    ("version-policy: newest\n", "version-policy: takes latest: N, all, or specific: [versions], got 'newest'"),
    ("version-policy: {latest: 0}\n", "version-policy: latest takes a number of versions >= 1, got 0"),
    ("version-policy: {specific: []}\n", "version-policy: specific takes a list of version numbers >= 1, got []"),
    ("id-policy: {x: hash}\n", "id-policy: 'x': takes reject or modulo, got 'hash'"),
    ("[1, 2]\n", "expected a mapping of settings to values, got list"),
    ("max-batch-size: 4\nmax_batch_size: 8\n", "max_batch_size: given twice (with - and _)"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m for _, m in BAD])
def test_bad_config_values_are_refused_naming_the_file_and_key(tmp_path, text, message):
    with pytest.raises(ValueError) as err:
        read_model_config(tmp_path / "config.yaml", text, DEFAULTS)
    assert str(err.value) == f"{tmp_path / 'config.yaml'}: {message}"


def test_config_values_and_triton_spellings():
    read = lambda text: read_model_config("config.yaml", text, DEFAULTS)  # noqa: E731
    assert read("") == DEFAULTS
    s = read("max-batch-size: 8\nmax_delay_ms: 0\nbatching: false\nmax-queue: 3\ntorch-threads: 1\n")
    assert (s.max_batch_size, s.max_delay_ms, s.batching, s.max_queue, s.torch_threads) == (8, 0.0, False, 3, 1)
    assert s.front_settings() == {"max_batch_size": 8, "max_delay_ms": 0.0, "batching": False, "max_queue": 3, "torch_threads": 1}
    assert read("version_policy: {latest: {num_versions: 3}}\n").version_policy == VersionPolicy("latest", 3)
    assert read("version_policy: {all: {}}\n").version_policy == VersionPolicy("all")
    assert read("version_policy: {specific: {versions: [1, 3]}}\n").version_policy == VersionPolicy("specific", versions=(3, 1))
