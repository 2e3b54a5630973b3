"""One regression test per failure class found by fault-testing the server: deadlines and cancellations,
bad neighbours in the repository, undecodable bytes, echoed names, metric labels, HTTP abuse,
memory bounds, TLS, the trusted list, rollback and worker death."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from recship.export.artifact import file_sha256
from recship.serving import PredictClient, footprint
from recship.serving.kserve import message
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from model_requests import dlrm_request, model_repo
from serving_helpers import http_request, read_response, wait_until

PREDICT = "/recship.serving.v1.Predictor/Predict"


def _health(port: int, name: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _index(port: int):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/RepositoryIndex", request_serializer=None,
                                   response_deserializer=message("RepositoryIndexResponse").FromString)
        return {(m.name, m.version): (m.state, m.reason) for m in call(b"", timeout=5).models}


# -- 1. deadlines, cancellations and a full queue -----------------------------------------------

def test_an_expired_deadline_or_a_cancel_in_the_queue_does_not_stop_the_model(small_artifact, tmp_path):
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=100, max_queue=4))
    try:
        sparse, dense = dlrm_request(2, 1, ids=(1, 2))
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            with pytest.raises(grpc.RpcError) as e:  # waits 100 ms for company: its 50 ms deadline passes in the queue
                client.predict("dlrm", sparse, dense, timeout=0.05)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            want = client.predict("dlrm", sparse, dense, timeout=10)  # the next request is answered
            # five requests with deadlines far shorter than the batch delay, into a queue of 4
            stub = client.channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
            futures = [stub.future(data, timeout=0.0005) for _ in range(5)]
            codes = {f.exception().code() for f in futures if f.exception() is not None}
            assert codes <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
            # cancelled by the client while queued
            queued = stub.future(data, timeout=10)
            time.sleep(0.02)
            queued.cancel()
            for _ in range(3):
                got = client.predict("dlrm", sparse, dense, timeout=10)
                np.testing.assert_array_equal(got["prob"], want["prob"])
        assert _health(server.port, "dlrm") == "SERVING"
    finally:
        server.stop()


def test_sigterm_after_expired_requests_in_a_small_queue_drains_and_exits(small_artifact, tmp_path):
    """The reported sequence: --max-queue 4, five requests with 0.5 ms deadlines, then normal ones, then SIGTERM.
    (The batcher's own tests fill its queue and stop it; here the whole process must answer and exit.)"""
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    proc = subprocess.Popen(
        [sys.executable, "-m", "recship.cli", "serve", "--model-repo", str(repo), "--port", "0", "--max-queue", "4",
         "--max-delay-ms", "500", "--log-format", "text"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        while not line.startswith("recship serve: listening on"):
            assert line, "the server exited before listening"
            line = proc.stdout.readline()
        port = int(line.split(":")[-1].split(",")[0])
        sparse, dense = dlrm_request(2, 2, ids=(1, 2))
        data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            expired = [stub.future(data, timeout=0.0005) for _ in range(5)]
            assert all(f.exception() is not None for f in expired)
            assert len(stub(data, timeout=10).outputs) == 2  # later requests are answered
            in_flight = [stub.future(data, timeout=30) for _ in range(3)]  # waiting 500 ms for company
            time.sleep(0.1)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
            assert time.monotonic() - started < 15
            assert all(len(f.result().outputs) == 2 for f in in_flight)  # drained, not dropped
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_a_dead_worker_turns_health_not_serving_and_is_restarted(small_artifact, tmp_path):
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, poll_interval_s=0.5))
    try:
        served = server.repo.get("dlrm")
        batcher = served.batcher

        def broken(carry):
            raise SystemExit("a bug in the worker loop")

        batcher._collect = broken  # the worker is waiting inside the real _collect: the next pass dies
        sparse, dense = dlrm_request(2, 3, ids=(1, 2))
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            client.predict("dlrm", sparse, dense)
            wait_until(lambda: batcher.died is not None, what="the worker to die")
            assert _health(server.port, "dlrm") == "NOT_SERVING"
            assert http_request(server.rest.port, "GET", "/v2/models/dlrm/ready")[0] == 503
            wait_until(lambda: server.repo.get("dlrm").batcher is not batcher, what="the restart")
            wait_until(lambda: _health(server.port, "dlrm") == "SERVING", what="SERVING")
            assert client.predict("dlrm", sparse, dense)["prob"].shape == (2, 1)
    finally:
        server.stop()


# -- 2 and 13. the repository: bad neighbours, rollback -------------------------------------------

def _bad_neighbours(root: Path, artifact: Path) -> None:
    def variant(model, edit):
        target = root / model / "1"
        shutil.copytree(artifact, target)
        manifest = json.loads((target / "manifest.json").read_text())
        (target / "manifest.json").write_text(json.dumps(edit(manifest)))

    variant("as_list", lambda m: [m])
    variant("sharding_list", lambda m: {**m, "sharding": []})
    variant("features_int", lambda m: {**m, "sparse_features": 5})
    variant("escaping_sample", lambda m: {**m, "sample": {**m["sample"], "inputs": {"dense": {"file": "../../x", "dtype": "float32", "shape": [1]}}}})
    shutil.copytree(artifact, root / "unicode_version" / "²")
    (root / "no_model_pt" / "1").mkdir(parents=True)
    shutil.copy(artifact / "manifest.json", root / "no_model_pt" / "1")
    (root / "bad name!" / "1").mkdir(parents=True)
    (root / "junk" / "1").mkdir(parents=True)
    (root / "junk" / "1" / "manifest.json").write_bytes(b"\xff\xfe not json")
    (root / "README.txt").write_text("a file beside the models is ignored")


def test_bad_neighbours_are_refused_listed_and_do_not_stop_other_models(small_artifact, tmp_path):
    root = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    _bad_neighbours(root, small_artifact)
    server = Server(ServerConfig(model_repo=str(root), port=0, http_port=0, poll_interval_s=0.2))
    try:
        assert [m.name for m in server.repo.models()] == ["dlrm"]
        index = _index(server.port)
        assert index[("dlrm", "1")] == ("READY", "")
        expected = {("as_list", "1"): "manifest.json: must be dict, got list", ("sharding_list", "1"): "sharding must be dict",
                    ("features_int", "1"): "sparse_features must be list", ("escaping_sample", "1"): "relative path inside",
                    ("unicode_version", "²"): "named by a number", ("no_model_pt", "1"): "model.pt is missing",
                    ("bad name!", ""): "model folder names", ("junk", "1"): "corrupt"}
        for key, reason in expected.items():
            state, why = index[key]
            assert state == "UNAVAILABLE" and reason in why, (key, why)
        status, _, body = http_request(server.rest.port, "POST", "/v2/repository/index", b"")
        assert status == 200 and {(m["name"], m["version"]) for m in json.loads(body)} == set(index)
        # a new version of the good model still loads while every neighbour stays broken
        shutil.copytree(small_artifact, root / "dlrm" / "2")
        wait_until(lambda: server.repo.get("dlrm").version == 2, what="version 2")
        # a new, good model too
        shutil.copytree(small_artifact, root / "other" / "7")
        wait_until(lambda: [m.name for m in server.repo.models()] == ["dlrm", "other"], what="the new model")
        assert server.repo._watcher.is_alive()
    finally:
        server.stop()


def test_removing_the_serving_version_rolls_back_then_unloads(small_artifact, tmp_path):
    root = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    shutil.copytree(small_artifact, root / "dlrm" / "2")
    server = Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.2))
    try:
        assert server.repo.get("dlrm").version == 2
        sparse, dense = dlrm_request(2, 4, ids=(1, 2))
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            shutil.rmtree(root / "dlrm" / "2")
            wait_until(lambda: server.repo.get("dlrm").version == 1, what="the rollback to version 1")
            assert client.predict("dlrm", sparse, dense)["prob"].shape == (2, 1)
            shutil.rmtree(root / "dlrm")
            wait_until(lambda: not server.repo.models(), what="the unload")
            with pytest.raises(grpc.RpcError) as e:
                client.predict("dlrm", sparse, dense)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert _health(server.port, "dlrm") == "NOT_SERVING"
    finally:
        server.stop()


def test_a_bad_repository_entry_at_start_does_not_stop_the_server_starting(small_artifact, tmp_path):
    root = tmp_path / "repo"
    _bad_neighbours(root, small_artifact)
    server = Server(ServerConfig(model_repo=str(root), port=0))
    try:
        assert server.repo.models() == [] and len(server.repo.unavailable()) == 8
    finally:
        server.stop()


# -- 3, 4, 5, 7, 8: statuses and bounds over gRPC ------------------------------------------------

@pytest.fixture(scope="module")
def server(small_artifact, tmp_path_factory):
    root = model_repo(tmp_path_factory.mktemp("faults") / "repo", {"dlrm": small_artifact})
    s = Server(ServerConfig(model_repo=str(root), port=0, http_port=0, metrics_port=0, max_delay_ms=1, http_idle_timeout_s=1.0,
                            max_message_bytes=1 << 20))
    yield s
    s.stop()


def _raw(server, method: str, data: bytes):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        try:
            channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=10)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


@pytest.mark.parametrize("method", [
    "/recship.serving.v1.Predictor/Predict", "/recship.serving.v1.Predictor/GetModelMetadata", "/recship.serving.v1.Predictor/ListModels",
    "/inference.GRPCInferenceService/ModelInfer", "/inference.GRPCInferenceService/ModelMetadata",
    "/inference.GRPCInferenceService/ModelReady", "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/RepositoryIndex",
])
def test_bytes_that_do_not_decode_are_invalid_argument_and_counted(server, method):
    code, details = _raw(server, method, b"\xff\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details
    name = method.rsplit("/", 1)[1]
    counted = server.metrics.requests.labels(name, "-", "-", "INVALID_ARGUMENT")._value.get()
    assert counted >= 1


def test_a_unicode_digit_version_is_invalid_argument(server):
    for method, request in [("ModelInfer", message("ModelInferRequest")(model_name="dlrm", model_version="²")),
                            ("ModelMetadata", message("ModelMetadataRequest")(name="dlrm", version="²")),
                            ("ModelReady", message("ModelReadyRequest")(name="dlrm", version="²"))]:
        code, details = _raw(server, f"/inference.GRPCInferenceService/{method}", request.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "version number" in details, method
    assert http_request(server.rest.port, "GET", "/v2/models/dlrm/versions/%C2%B2/ready")[0] == 400


def _kserve_body(sparse, dense, extra=()):
    inputs = [{"name": "dense", "shape": list(dense.shape), "datatype": "FP32", "data": dense.reshape(-1).tolist()}]
    for f, rows in sparse.items():
        inputs.append({"name": f"{f}.lengths", "shape": [len(rows)], "datatype": "INT32", "data": [len(r) for r in rows]})
        ids = [i for r in rows for i in r]
        inputs.append({"name": f"{f}.values", "shape": [len(ids)], "datatype": "INT64", "data": ids})
    return {"inputs": inputs + list(extra)}


def test_an_input_sent_twice_is_refused_over_grpc_and_rest(server):
    sparse, dense = dlrm_request(2, 5, ids=(1, 2))
    body = _kserve_body(sparse, dense, extra=[{"name": "dense", "shape": list(dense.shape), "datatype": "FP32",
                                               "data": np.zeros_like(dense).reshape(-1).tolist()}])
    status, _, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", json.dumps(body).encode())
    assert status == 400 and "'dense' appears twice" in json.loads(answer)["error"]
    request = message("ModelInferRequest")(model_name="dlrm")
    for t in body["inputs"]:
        inp = request.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        field = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}[t["datatype"]]
        getattr(inp.contents, field).extend(t["data"])
    code, details = _raw(server, "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'dense' appears twice" in details


def test_huge_names_are_cut_short_in_the_answer(server):
    sparse, dense = dlrm_request(2, 6, ids=(1, 2))
    long = "m" * 16384
    for request in (PredictClient.request(long, sparse, dense), PredictClient.request("dlrm", {**sparse, long: [[1], [1]]}, dense)):
        code, details = _raw(server, PREDICT, request.SerializeToString())
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
        assert "(16384 characters)" in details and len(details) < 600
    status, _, answer = http_request(server.rest.port, "GET", "/v2/models/" + "m" * 4000)
    assert status == 404 and "(4000 characters)" in json.loads(answer)["error"] and len(answer) < 600
    status, _, answer = http_request(server.rest.port, "GET", "/v2/models/" + long)  # past the HTTP line limit
    assert status in (400, 414) and len(answer) < 600


def test_metric_labels_only_name_served_models(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        predict = channel.unary_unary(PREDICT, request_serializer=pb.PredictRequest.SerializeToString,
                                      response_deserializer=pb.PredictResponse.FromString)
        names = [f"model-{i}" for i in range(300)] + ["\x00\n\"}{evil", "x" * (1 << 20)]
        for i, name in enumerate(names):
            with pytest.raises(grpc.RpcError):
                predict(pb.PredictRequest(model_name=name, model_version=i), timeout=10)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert len(text) < 200_000, len(text)
    models = {line.split('model="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'model="' in line}
    assert models <= {"dlrm", "-"}


# -- 6, 9: HTTP -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    b"[" * 50000 + b"]" * 50000,
    json.dumps({"inputs": [{"name": "dense", "shape": [1e30, 13], "datatype": "FP32", "data": []}]}).encode(),
    json.dumps({"inputs": [{"name": "cat_0.values", "shape": [1], "datatype": "INT64", "data": [2**70]}]}).encode(),
    json.dumps({"inputs": [{"name": "cat_0.lengths", "shape": [1], "datatype": "INT32", "data": [2**40]}]}).encode(),
    json.dumps({"inputs": [], "outputs": 5}).encode(),
    json.dumps({"inputs": [{"name": "dense", "shape": [2.5], "datatype": "FP32", "data": [1.0, 2.0]}]}).encode(),
    json.dumps({"inputs": [{"name": "cat_0.lengths", "shape": [2], "datatype": "INT32", "data": [1.7, 0.2]}]}).encode(),
    json.dumps({"inputs": [{"name": "dense", "shape": [1, 2], "datatype": "FP32", "data": [True, False]}]}).encode(),
    b'{"inputs": [{"name": "dense", "shape": [1], "datatype": "FP32", "data": [NaN]}]}',
    json.dumps({"inputs": [{"name": 5, "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode(),
])
def test_bad_json_is_400_never_500(server, body):
    status, headers, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", body)
    assert status == 400, answer
    assert "error" in json.loads(answer)


def test_http_bodies_are_bounded_and_framed(server):
    port = server.rest.port
    sparse, dense = dlrm_request(2, 7, ids=(1, 2))
    good = json.dumps(_kserve_body(sparse, dense)).encode()
    want = json.loads(http_request(port, "POST", "/v2/models/dlrm/infer", good)[2])
    # a body over --max-message-mb (1 MiB here): 413 from its Content-Length, nothing read
    started = time.monotonic()
    status, _, answer = http_request(port, "POST", "/v2/models/dlrm/infer", None, headers={"Content-Length": str(45 << 20)})
    assert status == 413 and time.monotonic() - started < 5
    big = good[:-1] + b', "pad": "' + b"x" * (1 << 20) + b'"}'
    assert http_request(port, "POST", "/v2/models/dlrm/infer", big)[0] == 413
    for length in ("abc", "-1", str(10**12), str(2**63)):
        status, _, _ = http_request(port, "POST", "/v2/models/dlrm/infer", b"{}", headers={"Content-Length": length})
        assert status in (400, 413), length
    # a chunked body is read as one body, and the next request on the connection is separate
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(good[i:i + 1000]), good[i:i + 1000]) for i in range(0, len(good), 1000)) + b"0\r\n\r\n"
        s.sendall(b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        status, headers, answer = read_response(s)
        assert status == 200 and json.loads(answer)["outputs"] == want["outputs"]
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s)[0] == 200
    assert headers["server"] == "recship"


def test_idle_and_slow_http_connections_are_closed(server):
    port = server.rest.port  # http_idle_timeout_s=1 in this fixture
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    slow = socket.create_connection(("127.0.0.1", port), timeout=10)
    slow.sendall(b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")  # and nothing more
    for s in idle:
        assert s.recv(100) == b""  # closed by the server (recv waits for it, up to the socket's 10 s)
        s.close()
    status, _, _ = read_response(slow)
    assert status == 408
    slow.close()
    started = time.monotonic()
    for _ in range(200):
        assert http_request(port, "GET", "/v2/health/live")[0] == 200
    assert time.monotonic() - started < 10


# -- 10: in-flight bytes ---------------------------------------------------------------------------

def test_request_bytes_in_flight_are_bounded(small_artifact, tmp_path):
    sparse, dense = dlrm_request(20, 8, ids=(1, 2))
    data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=200,
                                 max_inflight_bytes=4 * footprint.predict(data) + 100))  # 4 requests at a time
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            futures = [stub.future(data, timeout=30) for _ in range(24)]
            codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures]
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert server.inference.inflight_bytes == 0
        refused = [f.exception().details() for f in futures if f.exception()]
        assert "--max-inflight-mb" in refused[0]
    finally:
        server.stop()


# -- 11, 12: listeners, TLS, reflection, the trusted list ------------------------------------------

def test_every_listener_binds_to_host_and_tls_with_client_certificates(small_artifact, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.2")
    client = ca.issue_cert("client")
    files = {}
    for name, blob in [("cert", cert.cert_chain_pems[0].bytes() + b"".join(p.bytes() for p in cert.cert_chain_pems[1:])),
                       ("key", cert.private_key_pem.bytes()), ("ca", ca.cert_pem.bytes())]:
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(blob)
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), host="127.0.0.2", port=0, http_port=0, metrics_port=0,
                                 tls_cert=str(files["cert"]), tls_key=str(files["key"]), tls_client_ca=str(files["ca"]), reflection=False))
    try:
        with pytest.raises(OSError):  # metrics listen on --host, not 127.0.0.1
            socket.create_connection(("127.0.0.1", server.metrics.port), timeout=2).close()
        sparse, dense = dlrm_request(2, 9, ids=(1, 2))
        data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
        good = grpc.ssl_channel_credentials(ca.cert_pem.bytes(), client.private_key_pem.bytes(), client.cert_chain_pems[0].bytes())
        anonymous = grpc.ssl_channel_credentials(ca.cert_pem.bytes())
        for credentials, ok in ((good, True), (anonymous, False)):
            with grpc.secure_channel(f"127.0.0.2:{server.port}", credentials) as channel:
                call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
                if ok:
                    assert len(call(data, timeout=10).outputs) == 2
                else:
                    with pytest.raises(grpc.RpcError):
                        call(data, timeout=10)
        with grpc.insecure_channel(f"127.0.0.2:{server.port}") as channel:
            with pytest.raises(grpc.RpcError):
                channel.unary_unary(PREDICT, request_serializer=None)(data, timeout=5)
        import ssl

        context = ssl.create_default_context(cafile=str(files["ca"]))
        client.configure_cert(context)
        for port, path in ((server.rest.port, "/v2/health/ready"), (server.metrics.port, "/metrics")):
            with urllib.request.urlopen(f"https://127.0.0.2:{port}{path}", context=context, timeout=10) as r:
                assert r.status == 200
        with pytest.raises(Exception):  # no client certificate
            urllib.request.urlopen(f"https://127.0.0.2:{server.rest.port}/v2/health/ready",
                                   context=ssl.create_default_context(cafile=str(files["ca"])), timeout=10)
        with grpc.secure_channel(f"127.0.0.2:{server.port}", good) as channel:  # reflection off
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_only_trusted_manifests_load(small_artifact, tmp_path):
    root = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    trusted = tmp_path / "trusted.txt"
    trusted.write_text("# sha256 of manifest.json files allowed to load\n" + "0" * 64 + "  someone/else/manifest.json\n")
    server = Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.2, trusted_sha256=str(trusted)))
    try:
        assert server.repo.models() == []
        state, reason = _index(server.port)[("dlrm", "1")]
        assert state == "UNAVAILABLE" and "manifest.json: sha256" in reason and "not in the trusted list" in reason
        digest = file_sha256(root / "dlrm" / "1" / "manifest.json")
        trusted.write_text(trusted.read_text() + f"{digest}  dlrm/1/manifest.json\n")  # as sha256sum writes it
        wait_until(lambda: [m.name for m in server.repo.models()] == ["dlrm"], what="the trusted version")
    finally:
        server.stop()
    bad = tmp_path / "bad.txt"
    bad.write_text("not-a-digest\n")
    with pytest.raises(ValueError, match="not a sha256"):
        Server(ServerConfig(model_repo=str(root), port=0, trusted_sha256=str(bad)))


def test_http_routes_and_methods(server):
    port = server.rest.port
    assert http_request(port, "DELETE", "/v2/models/dlrm")[0] == 405
    assert http_request(port, "GET", "/v2/models/dlrm/infer")[0] == 405
    assert http_request(port, "POST", "/v2/models/dlrm/ready", b"")[0] == 405
    assert http_request(port, "GET", "/v3/anything")[0] == 404
    assert http_request(port, "GET", "/v2/models/nope")[0] == 404
    status, headers, body = http_request(port, "GET", "/v2/models/dlrm/versions/1")
    assert status == 200 and json.loads(body)["versions"] == ["1"] and headers["server"] == "recship"
    assert http_request(port, "GET", "/v2/models/dlrm/versions/2")[0] == 404
