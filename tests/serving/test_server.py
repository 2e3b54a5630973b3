"""The gRPC server end to end on loopback: exact outputs, concurrent batching, validation, health, hot reload."""

import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.serving import PredictClient
from recship.serving.server import Server, ServerConfig
from recship.models.dlrm import BuiltinDLRM, DLRMConfig

from model_requests import dlrm_request, in_process
from serving_helpers import wait_until

ROWS = [20 + i for i in range(26)]


def _dlrm(seed):
    torch.manual_seed(seed)
    return BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    export_model(_dlrm(0), ExportConfig(out=str(root / "dlrm" / "1"), dtype="int8", progress=False, validation_batches=1, validation_batch_size=32))
    return root


@pytest.fixture(scope="module")
def server(repo):
    s = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_delay_ms=5, poll_interval_s=0.2))
    yield s
    s.stop()


def test_outputs_over_grpc_equal_the_artifact_in_process(server, repo):
    model, _ = open_artifact(repo / "dlrm" / "1")
    with PredictClient(f"127.0.0.1:{server.port}") as client:
        for seed, batch in [(1, 1), (2, 5), (3, 64)]:
            sparse, dense = dlrm_request(batch, seed)
            got = client.predict("dlrm", sparse, dense)
            want = in_process(model, sparse, dense)
            assert set(got) == {"logit", "prob"}
            for k in want:
                assert got[k].shape == (batch, 1)
                np.testing.assert_array_equal(got[k], want[k])  # bitwise: a lone request is its own batch


def test_concurrent_clients_get_exactly_their_own_rows(server, repo):
    model, _ = open_artifact(repo / "dlrm" / "1")
    requests = [dlrm_request(1 + i % 7, 100 + i) for i in range(64)]
    before = server.metrics.batch.labels("dlrm", "1")._sum.get()
    count_before = _histogram_count(server, "recship_batch_examples")
    with PredictClient(f"127.0.0.1:{server.port}") as client:
        start = threading.Barrier(64)

        def call(req):
            start.wait()
            return client.predict("dlrm", req[0], req[1])

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(call, requests))
    for (sparse, dense), got in zip(requests, results):
        want = in_process(model, sparse, dense)
        np.testing.assert_allclose(got["logit"], want["logit"], rtol=1e-5, atol=1e-6)
    forwards = _histogram_count(server, "recship_batch_examples") - count_before
    assert forwards < 64  # requests were merged into shared batches
    assert server.metrics.batch.labels("dlrm", "1")._sum.get() - before == sum(len(r[1]) for r in requests)


def _histogram_count(server, name):
    for metric in server.metrics.registry.collect():
        if metric.name == name:
            return sum(s.value for s in metric.samples if s.name.endswith("_count"))
    return 0


def _bad(**changes):
    sparse, dense = dlrm_request(2, 7)
    req = PredictClient.request("dlrm", sparse, dense)
    for key, fn in changes.items():
        fn(req)
    return req


INVALID = [
    (lambda r: r.sparse.add(name="nope", lengths=[0, 0]), "unknown sparse feature 'nope'"),
    (lambda r: r.sparse.pop(), "missing sparse features ['cat_25']"),
    (lambda r: r.sparse[0].ids.append(1), "sparse feature 'cat_0': sum(lengths)"),
    (lambda r: r.sparse[1].lengths.__setitem__(0, -1), "negative length -1"),
    (lambda r: (r.sparse[2].lengths.__setitem__(0, 1), r.sparse[2].ids.__setitem__(slice(None), [22] + list(r.sparse[2].ids)[1:]) if len(r.sparse[2].ids) else r.sparse[2].ids.append(22)), "id 22 is out of range [0, 22)"),
    (lambda r: r.sparse[3].weights.extend([1.0] * len(r.sparse[3].ids) or [1.0]), "weights given, but the model's features are unweighted"),
    (lambda r: setattr(r.dense, "cols", 12), "dense shape [2, 12] does not match"),
    (lambda r: r.dense.values.__setitem__(0, float("nan")), "dense values must be finite"),
    (lambda r: setattr(r, "batch_size", 0), "batch_size must be > 0"),
    (lambda r: setattr(r, "batch_size", 10_000), "exceeds the model's limit of 512"),
]


@pytest.mark.parametrize("mutate, message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_requests_are_refused_and_the_server_keeps_answering(server, mutate, message):
    sparse, dense = dlrm_request(2, 7)
    req = PredictClient.request("dlrm", sparse, dense)
    mutate(req)
    with PredictClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Predict(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
        assert client.predict("dlrm", sparse, dense)["prob"].shape == (2, 1)


def test_unknown_model_health_metadata_and_listing(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with PredictClient(f"127.0.0.1:{server.port}") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.predict("nope", {"a": [[1]]})
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        meta = client.metadata("dlrm")
        assert [f.name for f in meta.sparse_features] == [f"cat_{i}" for i in range(26)]
        assert meta.num_dense == 13 and [o.name for o in meta.outputs] == ["logit", "prob"]
        assert client.list_models() == ["dlrm"]
        health = health_pb2_grpc.HealthStub(client.channel)
        for service in ("", "dlrm"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING


def test_hot_reload_under_load_loses_no_request_and_refuses_a_broken_version(tmp_path):
    root = tmp_path / "repo"
    export_model(_dlrm(0), ExportConfig(out=str(root / "m" / "1"), dtype="int8", progress=False, validation_batches=1, validation_batch_size=32))
    staging = tmp_path / "staging"
    export_model(_dlrm(1), ExportConfig(out=str(staging / "2"), dtype="fp16", progress=False, validation_batches=1, validation_batch_size=32))
    shutil.copytree(staging / "2", staging / "3")
    (staging / "3" / "model.pt").write_bytes((staging / "3" / "model.pt").read_bytes() + b"tampered")
    server = Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.1))
    versions, errors = [], []
    stop = threading.Event()
    try:
        def load():
            with PredictClient(f"127.0.0.1:{server.port}") as client:
                sparse, dense = dlrm_request(3, 5)
                while not stop.is_set():
                    try:
                        r = client.stub.Predict(client.request("m", sparse, dense), timeout=10)
                        versions.append(r.model_version)
                    except grpc.RpcError as e:
                        errors.append(e)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: versions or errors, what="the first answer")
        shutil.copytree(staging / "2", root / "m" / ".incoming")
        (root / "m" / ".incoming").rename(root / "m" / "2")  # a version appears complete
        wait_until(lambda: errors or (versions and versions[-1] == 2), what="version 2 to answer")
        shutil.copytree(staging / "3", root / "m" / ".incoming3")
        (root / "m" / ".incoming3").rename(root / "m" / "3")
        wait_until(lambda: any((u.model, u.version) == ("m", "3") for u in server.repo.unavailable()), what="version 3's refusal")
        answered = len(versions)
        wait_until(lambda: errors or len(versions) >= answered + 20, what="answers after version 3's refusal")
        stop.set()
        for t in threads:
            t.join()
    finally:
        server.stop()
    assert errors == []
    assert versions[0] == 1 and versions[-1] == 2 and 3 not in versions
    assert set(versions) == {1, 2}


def test_recship_serve_answers_and_drains_on_sigterm(repo):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "recship", "serve", "--model-repo", str(repo), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, proc.stderr.read()
        port = int(line.strip().rsplit(":", 1)[1])
        sparse, dense = dlrm_request(2, 1)
        with PredictClient(f"127.0.0.1:{port}") as client:
            assert client.predict("dlrm", sparse, dense)["prob"].shape == (2, 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_refused_version_is_retried_once_its_files_change(tmp_path, repo):
    root = tmp_path / "repo"
    shutil.copytree(repo / "dlrm" / "1", root / "dlrm" / "1")
    (root / "dlrm" / "2").mkdir()
    shutil.copy(repo / "dlrm" / "1" / "manifest.json", root / "dlrm" / "2" / "manifest.json")  # half copied: no model.pt
    server = Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.1))
    try:
        assert server.repo.get("dlrm").version == 1
        for item in (repo / "dlrm" / "1").iterdir():
            if item.is_dir():
                shutil.copytree(item, root / "dlrm" / "2" / item.name)
            elif item.name != "manifest.json":
                shutil.copy(item, root / "dlrm" / "2" / item.name)
        wait_until(lambda: server.repo.get("dlrm").version == 2, what="version 2 to load once its files are complete")
    finally:
        server.stop()


def test_oversized_request_is_invalid_argument_naming_the_size(repo):
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_message_bytes=5000))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            small_sparse, small_dense = dlrm_request(1, 1)
            assert client.predict("dlrm", small_sparse, small_dense)["prob"].shape == (1, 1)
            sparse, dense = dlrm_request(16, 2)
            size = PredictClient.request("dlrm", sparse, dense).ByteSize()
            assert 5000 < size <= 10000  # over the limit, but within what the transport admits
            with pytest.raises(grpc.RpcError) as err:
                client.predict("dlrm", sparse, dense)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds the limit of 5000 bytes" in err.value.details()
    finally:
        server.stop()


def test_an_artifact_for_another_device_is_refused(tmp_path, repo, caplog):
    import json
    import logging

    root = tmp_path / "repo"
    shutil.copytree(repo / "dlrm" / "1", root / "dlrm" / "1")
    manifest = json.loads((root / "dlrm" / "1" / "manifest.json").read_text())
    manifest["sharding"]["device"] = "cuda"  # as if exported with --device cuda
    (root / "dlrm" / "1" / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.ERROR, logger="recship.serving"):
        server = Server(ServerConfig(model_repo=str(root), port=0))
    try:
        assert server.repo.models() == []
        assert "exported for cuda, but this server runs on cpu" in caplog.text
        with PredictClient(f"127.0.0.1:{server.port}") as client, pytest.raises(grpc.RpcError) as err:
            client.predict("dlrm", *dlrm_request(1, 1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()


def test_metrics_endpoint_and_a_json_log_line_of_an_error(server):
    import io
    import json
    import logging
    import urllib.request

    from recship.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("recship.serving")
    server.inference.failures.flush()  # earlier tests' refusals, sampled: said before this one listens
    logger.addHandler(handler)
    try:
        sparse, dense = dlrm_request(2, 3)
        bad = {**sparse, "cat_5": [[ROWS[5] + 1], []]}
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            client.predict("dlrm", sparse, dense)
            with pytest.raises(grpc.RpcError):
                client.predict("dlrm", bad, dense)
        server.inference.failures.flush()  # its line, if an earlier refusal's line came less than 10 s before
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    errors = [e for e in lines if e.get("status") == "INVALID_ARGUMENT"]
    assert len(errors) == 1 and errors[0]["model"] == "dlrm" and f"id {ROWS[5] + 1} is out of range" in errors[0]["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts = {status: float(m.group(1)) for status in ("OK", "INVALID_ARGUMENT")
              for m in [re.search(r'recship_requests_total\{method="Predict",model="dlrm",status="%s",version="1"\} (\S+)' % status, text)] if m}
    assert counts.get("OK", 0) >= 1 and counts.get("INVALID_ARGUMENT", 0) >= 1
    assert re.search(r'recship_rejected_id_requests_total\{model="dlrm"\} [1-9]', text)
