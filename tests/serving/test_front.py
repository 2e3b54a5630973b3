"""The C++ gRPC front (``--front cpp``, cpp_loader/tools/recship_front.cpp) end to end on loopback.

References are independent of the server: the artifact run in-process (``open_artifact``), plain numpy,
and, for everything the front forwards, a ``--front python`` server on the same repository (the front
must answer exactly what it answers). "Answered natively" is told apart from "forwarded" by the Python
server's own request counter (``server.metrics.requests``): the front's counts only reach the merged
``/metrics`` text.
"""

import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from recship.export.artifact import open_artifact
from recship.serving import PredictClient, footprint
from recship.serving.client import outputs_of
from recship.serving.kserve import message
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from model_requests import dlrm_request, in_process, model_repo, runnable_aoti
from serving_helpers import NUM_DENSE, ROWS, front_binary, metric_samples, wait_until

PREDICT = "/recship.serving.v1.Predictor/Predict"
LIMIT = 64 * 1024  # max_message_bytes of the shared servers (the transport admits twice that)


# -- helpers ----------------------------------------------------------------------------------------

def _concat(requests):
    """Several requests as one batch, in order (what a merged forward runs)."""
    sparse = {f: [row for s, _ in requests for row in s[f]] for f in requests[0][0]}
    return sparse, np.concatenate([d for _, d in requests])


def _assert_bitwise(got, want):
    assert sorted(got) == sorted(want) == ["logit", "prob"]
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _python_count(server, status="OK", version="1", model="dlrm", method="Predict") -> float:
    """What the Python server itself counted (the front's own counts are not in here)."""
    return server.metrics.requests.labels(method, model, version, status)._value.get()


def _python_refused(server) -> float:
    """Predicts the Python server itself refused, whatever their labels."""
    return sum(s.value for f in server.metrics.requests.collect() for s in f.samples
               if s.name == "recship_requests_total" and s.labels["method"] == "Predict" and s.labels["status"] != "OK")


def _sample(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _ok(samples, version="1"):
    return _sample(samples, "recship_requests_total", method="Predict", model="dlrm", status="OK", version=version)


def _raw(port: int, method: str, data: bytes, timeout: float = 10):
    """(code, details, response bytes) of one unary call with raw bytes."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return grpc.StatusCode.OK, "", channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def _health(port: int, service: str):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as e:
            return e.code(), e.details()


def _front_children():
    """pids of this process's recship_front children (zombies included)."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and comm == "recship_front":
            out.add(int(entry))
    return out


# -- the servers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    front_binary()  # skips the module where the front cannot be built
    return model_repo(tmp_path_factory.mktemp("front") / "repo", {"dlrm": small_artifact})


@pytest.fixture(scope="module")
def model(repo):
    return open_artifact(repo / "dlrm" / "1", format="torchscript")[0]


@pytest.fixture(scope="module")
def cpp(repo):
    s = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_delay_ms=5, max_message_bytes=LIMIT, front="cpp"))
    assert s.front is not None
    yield s
    s.stop()


@pytest.fixture(scope="module")
def py(repo):
    s = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_delay_ms=5, max_message_bytes=LIMIT, front="python"))
    yield s
    s.stop()


# -- 1. exact outputs, batching, the merged metrics --------------------------------------------------

def test_predict_is_answered_by_the_front_and_equals_the_artifact_in_process_bitwise(cpp, py, model):
    before, python_before = _ok(metric_samples(cpp)), _python_count(cpp)
    with PredictClient(f"127.0.0.1:{cpp.port}") as client, PredictClient(f"127.0.0.1:{py.port}") as reference:
        for seed, batch in [(1, 1), (2, 5), (3, 64)]:
            sparse, dense = dlrm_request(batch, seed)
            request = PredictClient.request("dlrm", sparse, dense, request_id=f"req-{seed}")
            response = client.stub.Predict(request, timeout=10)
            assert (response.model_name, response.model_version, response.request_id) == ("dlrm", 1, f"req-{seed}")
            assert [(t.name, list(t.shape)) for t in response.outputs] == [("logit", [batch, 1]), ("prob", [batch, 1])]
            _assert_bitwise(outputs_of(response), in_process(model, sparse, dense))
            assert response == reference.stub.Predict(request, timeout=10)  # the Python front's answer, field for field
    assert _python_count(cpp) == python_before  # none of them reached the Python server
    assert _ok(metric_samples(cpp)) - before == 3


def test_a_merged_forward_equals_the_concatenated_batch_in_process_bitwise(repo, model):
    """Requests that arrive within one batch window run as one forward: each gets exactly its rows of it. (The
    window is long and the batch closes when it is full, at its 16th example: on a busy machine too.)"""
    server = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_batch_size=16, max_delay_ms=30_000, front="cpp"))
    try:
        requests = [dlrm_request(b, 50 + i) for i, b in enumerate([1, 3, 2, 5, 1, 4])]
        before = metric_samples(server)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            futures = []
            for r in requests:  # one after another, so they queue in this order
                futures.append(stub.future(PredictClient.request("dlrm", *r).SerializeToString(), timeout=30))
                time.sleep(0.03)
            answers = [outputs_of(f.result()) for f in futures]
        after = metric_samples(server)
        assert _sample(after, "recship_batch_examples_count", model="dlrm", version="1") - _sample(before, "recship_batch_examples_count", model="dlrm", version="1") == 1
        assert _sample(after, "recship_batch_examples_sum", model="dlrm", version="1") - _sample(before, "recship_batch_examples_sum", model="dlrm", version="1") == 16
        whole = in_process(model, *_concat(requests))
        row = 0
        for r, got in zip(requests, answers):
            n = len(r[1])
            _assert_bitwise(got, {k: v[row:row + n] for k, v in whole.items()})
            row += n
    finally:
        server.stop()


# -- 2. AOTInductor ---------------------------------------------------------------------------------

def test_the_front_runs_model_pt2_and_equals_torchscript_in_process_bitwise(small_artifacts, tmp_path, caplog):
    front_binary()
    artifact = runnable_aoti(lambda: small_artifacts(format="both"))
    root = tmp_path / "repo"
    shutil.copytree(artifact, root / "dlrm" / "1")
    scripted, _ = open_artifact(root / "dlrm" / "1", format="torchscript")
    with caplog.at_level(logging.INFO, logger="recship"):
        server = Server(ServerConfig(model_repo=str(root), port=0, max_delay_ms=1, front="cpp"))
    try:
        assert "C++ front serves dlrm version 1 (aoti)" in caplog.messages
        python_before = _python_count(server)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            for seed, batch in [(11, 1), (12, 5), (13, 64)]:
                sparse, dense = dlrm_request(batch, seed)
                _assert_bitwise(client.predict("dlrm", sparse, dense), in_process(scripted, sparse, dense))
        assert _python_count(server) == python_before  # the front ran them, not the Python server
        assert sum(r["count"] for r in server.front.stats()["requests"] if r["status"] == "OK") == 3
    finally:
        server.stop()


# -- 3. refusals: the Python server's exact status and message ---------------------------------------

def _body(seed=7, batch=2, **changes):
    sparse, dense = dlrm_request(batch, seed)
    request = PredictClient.request("dlrm", sparse, dense)
    for key, value in changes.items():
        value(request) if callable(value) else setattr(request, key, value)
    return request.SerializeToString()


def _out_of_range(r):
    r.sparse[5].lengths[0] += 1
    r.sparse[5].ids.insert(0, ROWS[5] + 1)


REFUSALS = {
    "out-of-range id": _body(mutate=_out_of_range),
    "unknown model": _body(model_name="nope"),
    "wrong version": _body(model_version=7),
    "malformed body": b"\xff\xff\xff\xff",
    "truncated body": _body()[:-3],
    "feature named twice": _body(mutate=lambda r: r.sparse.add().CopyFrom(r.sparse[0])),
    "missing feature": _body(mutate=lambda r: r.sparse.pop()),
    "nan dense": _body(mutate=lambda r: r.dense.values.__setitem__(0, float("nan"))),
    "weights on an unweighted model": _body(mutate=lambda r: r.sparse[0].weights.extend([1.0] * len(r.sparse[0].ids))),
    "batch over the limit": _body(batch_size=10_000),
    "empty request": b"",
    "over the size limit": _body(request_id="x" * (LIMIT + 1000)),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refused_predict_gets_the_python_servers_status_and_message(cpp, py, name):
    data = REFUSALS[name]
    refused_before = _python_refused(cpp)
    got = _raw(cpp.port, PREDICT, data)[:2]
    want = _raw(py.port, PREDICT, data)[:2]
    assert want[0] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) and want[1]
    if name == "over the size limit":
        assert want[1] == f"request of {len(data)} bytes exceeds the limit of {LIMIT} bytes"
    assert got == want
    # it was the Python server behind the front that refused it (and counted it)
    assert _python_refused(cpp) == refused_before + 1


def test_a_request_past_what_the_transport_admits_is_resource_exhausted_as_behind_the_python_front(cpp, py):
    """Over twice max_message_bytes gRPC itself refuses it, in each process: same status and numbers. (The words
    differ by a prefix: grpcio's core says "SERVER: Received message larger than max", the C++ library without
    "SERVER: ", so only the part after it is compared.)"""
    data = _body(request_id="x" * (2 * LIMIT + 1000))
    (got_code, got), (want_code, want) = _raw(cpp.port, PREDICT, data)[:2], _raw(py.port, PREDICT, data)[:2]
    assert got_code == want_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    tail = f"Received message larger than max ({len(data)} vs. {2 * LIMIT})"
    assert got.endswith(tail) and want.endswith(tail), (got, want)


def test_an_out_of_range_id_is_counted_in_the_merged_metrics(cpp):
    before = _sample(metric_samples(cpp), "recship_rejected_id_requests_total", model="dlrm")
    code, details, _ = _raw(cpp.port, PREDICT, REFUSALS["out-of-range id"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"id {ROWS[5] + 1} is out of range [0, {ROWS[5]})" in details
    assert _sample(metric_samples(cpp), "recship_rejected_id_requests_total", model="dlrm") == before + 1


# -- 4. the other services, through the front -------------------------------------------------------

def test_health_check_and_watch_through_the_front(cpp, py):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for service in ("", "dlrm"):
        assert _health(cpp.port, service) == "SERVING"
    assert _health(cpp.port, "nope") == _health(py.port, "nope")  # NOT_FOUND, in the Python servicer's words
    assert _health(cpp.port, "nope")[0] == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(f"127.0.0.1:{cpp.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "dlrm"):
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
            first = next(stream)  # a server-streaming call: its first message comes through the proxy
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            stream.cancel()
            with pytest.raises(grpc.RpcError) as e:
                next(stream)
            assert e.value.code() == grpc.StatusCode.CANCELLED
    assert cpp.front._proc.poll() is None


def test_server_reflection_through_the_front_is_a_bidi_stream(cpp, py):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def ask(port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol="recship.serving.v1.Predictor"),
                        reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")]
            return list(stub.ServerReflectionInfo(iter(requests), timeout=10))

    got, want = ask(cpp.port), ask(py.port)
    assert len(got) == 3
    services = {s.name for s in got[0].list_services_response.service}
    assert services == {"recship.serving.v1.Predictor", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    assert got[1].file_descriptor_response.file_descriptor_proto  # the descriptor of predictor.proto
    assert got[2].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert [g.SerializeToString() for g in got] == [w.SerializeToString() for w in want]


def test_kserve_and_predictor_metadata_through_the_front(cpp, py):
    calls = [
        ("/inference.GRPCInferenceService/ServerLive", message("ServerLiveRequest")(), message("ServerLiveResponse")),
        ("/inference.GRPCInferenceService/ServerReady", message("ServerReadyRequest")(), message("ServerReadyResponse")),
        ("/inference.GRPCInferenceService/ModelReady", message("ModelReadyRequest")(name="dlrm"), message("ModelReadyResponse")),
        ("/inference.GRPCInferenceService/ModelMetadata", message("ModelMetadataRequest")(name="dlrm"), message("ModelMetadataResponse")),
        ("/inference.GRPCInferenceService/ModelMetadata", message("ModelMetadataRequest")(name="nope"), message("ModelMetadataResponse")),
        ("/recship.serving.v1.Predictor/GetModelMetadata", pb.ModelMetadataRequest(model_name="dlrm"), pb.ModelMetadataResponse),
        ("/recship.serving.v1.Predictor/GetModelMetadata", pb.ModelMetadataRequest(model_name="dlrm", model_version=3), pb.ModelMetadataResponse),
        ("/recship.serving.v1.Predictor/ListModels", pb.ListModelsRequest(), pb.ListModelsResponse),
    ]
    answers = {}
    for method, request, response in calls:
        got, want = _raw(cpp.port, method, request.SerializeToString()), _raw(py.port, method, request.SerializeToString())
        assert got[:2] == want[:2], method
        if got[0] == grpc.StatusCode.OK:
            assert response.FromString(got[2]) == response.FromString(want[2]), method
            answers[(method, str(request))] = response.FromString(got[2])
        else:
            assert got[0] == grpc.StatusCode.NOT_FOUND, (method, got)
    assert answers[(calls[1][0], str(calls[1][1]))].ready
    assert answers[(calls[2][0], str(calls[2][1]))].ready
    kserve_meta = answers[(calls[3][0], str(calls[3][1]))]
    assert kserve_meta.name == "dlrm" and list(kserve_meta.versions) == ["1"]
    meta = answers[(calls[5][0], str(calls[5][1]))]
    assert [f.name for f in meta.sparse_features] == [f"cat_{i}" for i in range(26)] and [f.rows for f in meta.sparse_features] == ROWS
    assert [f.id_bound for f in meta.sparse_features] == ROWS  # no managed collisions: ids stay under the rows
    assert meta.num_dense == NUM_DENSE and [o.name for o in meta.outputs] == ["logit", "prob"]
    listing = answers[(calls[7][0], str(calls[7][1]))]
    assert [(m.name, m.serving_version) for m in listing.models] == [("dlrm", 1)]


# -- 5. hot reload ----------------------------------------------------------------------------------

def test_a_new_version_is_served_by_the_front_and_a_removed_model_is_not_found(repo, small_artifacts, tmp_path):
    new_artifact = small_artifacts(dtype="fp16")  # another artifact: its outputs differ from version 1's
    root = tmp_path / "repo"
    shutil.copytree(repo / "dlrm" / "1", root / "dlrm" / "1")
    old_model, _ = open_artifact(root / "dlrm" / "1", format="torchscript")
    new_model, _ = open_artifact(new_artifact, format="torchscript")
    sparse, dense = dlrm_request(4, 21)
    old, new = in_process(old_model, sparse, dense), in_process(new_model, sparse, dense)
    assert not np.array_equal(old["prob"], new["prob"])
    server = Server(ServerConfig(model_repo=str(root), port=0, max_delay_ms=1, poll_interval_s=0.1, front="cpp"))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            response = client.stub.Predict(client.request("dlrm", sparse, dense), timeout=10)
            assert response.model_version == 1
            _assert_bitwise(outputs_of(response), old)
            seen, errors, stop = [], [], threading.Event()

            def load():  # requests all through the swap: none may fail, and each is exactly one version's answer
                request = client.request("dlrm", sparse, dense)
                while not stop.is_set():
                    try:
                        r = client.stub.Predict(request, timeout=10)
                        seen.append((r.model_version, outputs_of(r)))
                    except grpc.RpcError as e:
                        errors.append((e.code(), e.details()))

            threads = [threading.Thread(target=load) for _ in range(3)]
            for t in threads:
                t.start()
            try:
                wait_until(lambda: seen or errors, what="a first answer (version 1)")
                shutil.copytree(new_artifact, root / "dlrm" / ".incoming")
                (root / "dlrm" / ".incoming").rename(root / "dlrm" / "2")  # a version appears complete
                wait_until(lambda: [(m.name, m.serving_version) for m in client.stub.ListModels(pb.ListModelsRequest(), timeout=5).models]
                      == [("dlrm", 2)], what="ListModels to show version 2")
                listed = len(seen)
                wait_until(lambda: errors or sum(v == 2 for v, _ in seen[listed:]) >= 6, what="answers of version 2")
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert errors == []
            assert {v for v, _ in seen} == {1, 2} and seen[-1][0] == 2
            for version, got in seen:  # identical requests, possibly merged: each row to 1e-6 of its own version
                for k in ("logit", "prob"):
                    np.testing.assert_allclose(got[k], (old if version == 1 else new)[k], rtol=0, atol=1e-6)
            python_before = _python_count(server, version="2")
            front_ok = lambda: sum(r["count"] for r in server.front.stats()["requests"] if (r["version"], r["status"]) == ("2", "OK"))  # noqa: E731
            front_before = front_ok()
            for version in (0, 2):
                response = client.stub.Predict(client.request("dlrm", sparse, dense, version=version), timeout=10)
                assert (response.model_name, response.model_version) == ("dlrm", 2)
                _assert_bitwise(outputs_of(response), new)
            assert _python_count(server, version="2") == python_before  # answered by the front's new version
            assert front_ok() == front_before + 2
            with pytest.raises(grpc.RpcError) as e:
                client.predict("dlrm", sparse, dense, version=1)
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "model 'dlrm' version 1 is not served (serving version 2)")
            shutil.rmtree(root / "dlrm")
            wait_until(lambda: _health(server.port, "dlrm") == "NOT_SERVING", what="dlrm to stop serving")
            assert client.stub.ListModels(pb.ListModelsRequest(), timeout=5).models == []
            for version in (0, 2):
                with pytest.raises(grpc.RpcError) as e:
                    client.predict("dlrm", sparse, dense, version=version)
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "model 'dlrm' is not served; served: []")
    finally:
        server.stop()


# -- 6. deadlines and overload ----------------------------------------------------------------------

def test_tiny_deadlines_interleaved_with_normal_requests(cpp, model):
    sparse0, dense0 = dlrm_request(3, 300)
    tiny = PredictClient.request("dlrm", sparse0, dense0).SerializeToString()
    normal = [dlrm_request(1 + i % 4, 400 + i) for i in range(40)]
    pid = cpp.front._proc.pid
    codes, stop = [], threading.Event()

    def storm():
        with grpc.insecure_channel(f"127.0.0.1:{cpp.port}") as channel:
            stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
            while not stop.is_set():
                futures = [stub.future(tiny, timeout=0.001) for _ in range(8)]
                codes.extend(f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures)

    threads = [threading.Thread(target=storm) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with PredictClient(f"127.0.0.1:{cpp.port}") as client:
            answers = [client.predict("dlrm", s, d, timeout=30) for s, d in normal]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK}
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) > 0
    for (s, d), got in zip(normal, answers):  # may have shared a forward with a live short-deadline one
        want = in_process(model, s, d)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6)
    with PredictClient(f"127.0.0.1:{cpp.port}") as client:  # alone again: bitwise
        for s, d in normal[:5]:
            _assert_bitwise(client.predict("dlrm", s, d), in_process(model, s, d))
    assert cpp.front._proc.pid == pid and cpp.front._proc.poll() is None


def test_a_full_queue_is_resource_exhausted_in_the_servers_words_and_the_front_goes_on(repo, model):
    server = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, batching=False, max_queue=1, front="cpp"))
    try:
        requests = [dlrm_request(64, 600 + i) for i in range(8)]
        want = [in_process(model, *r) for r in requests]
        data = [PredictClient.request("dlrm", *r).SerializeToString() for r in requests]
        before = metric_samples(server)
        results = []
        start = threading.Barrier(16)

        def client(k):
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
                start.wait()
                for j in range(12):
                    i = (k + j) % len(requests)
                    try:
                        results.append((i, stub(data[i], timeout=30), None))
                    except grpc.RpcError as e:
                        results.append((i, None, (e.code(), e.details())))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [err for _, _, err in results if err is not None]
        assert refused, "16 clients never filled a queue of 1"
        assert set(refused) == {(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (1 requests waiting)")}
        answered = [(i, r) for i, r, err in results if err is None]
        assert answered
        for i, response in answered:  # batching off: one request per forward, so bitwise
            assert response.model_version == 1
            _assert_bitwise(outputs_of(response), want[i])
        after = metric_samples(server)
        counted = {status: _sample(after, "recship_requests_total", method="Predict", model="dlrm", status=status, version="1")
                   - _sample(before, "recship_requests_total", method="Predict", model="dlrm", status=status, version="1")
                   for status in ("OK", "RESOURCE_EXHAUSTED")}
        assert counted == {"OK": len(answered), "RESOURCE_EXHAUSTED": len(refused)}
        with PredictClient(f"127.0.0.1:{server.port}") as c:  # and it keeps answering, exactly
            for i in range(3):
                _assert_bitwise(c.predict("dlrm", *requests[i], timeout=10), want[i])
        assert server.front._proc.poll() is None
    finally:
        server.stop()


def test_request_bytes_in_flight_are_bounded_and_released(repo, model):
    sparse, dense = dlrm_request(20, 650)
    data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
    cost = footprint.predict(data)  # what either front charges a Predict: its bytes and 5 times its tensors
    limit = 4 * cost + 100  # 4 requests at a time
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=200, max_inflight_bytes=limit, front="cpp"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            futures = [stub.future(data, timeout=30) for _ in range(24)]
            outcomes = [(f.exception().code(), f.exception().details()) if f.exception() else f.result() for f in futures]
            refused = [o for o in outcomes if isinstance(o, tuple)]
            answered = [o for o in outcomes if not isinstance(o, tuple)]
            assert refused and answered
            for code, details in refused:
                m = re.fullmatch(r"(\d+) bytes of requests would be in flight, over the limit of (\d+) \(--max-inflight-mb\); retry later", details)
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and m, details
                assert int(m.group(2)) == limit and limit < int(m.group(1)) <= limit + cost
            want = in_process(model, sparse, dense)
            for response in answered:  # identical requests: a merged forward gives each the same rows
                for k in want:
                    np.testing.assert_allclose(outputs_of(response)[k], want[k], rtol=0, atol=1e-6)
            # every byte admitted was given back: one at a time, all are answered, bitwise
            for _ in range(6):
                _assert_bitwise(outputs_of(stub(data, timeout=10)), want)
    finally:
        server.stop()


# -- 7. stop ------------------------------------------------------------------------------------------

def test_stop_drains_requests_in_flight_and_the_front_exits(repo, model):
    children_before = _front_children()
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=2000, front="cpp"))
    port, proc = server.port, server.front._proc
    backend_dir = Path(server._backend_dir)
    assert proc.pid in _front_children()
    requests = [dlrm_request(2, 700 + i) for i in range(4)]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
        futures = []
        for r in requests:
            futures.append(stub.future(PredictClient.request("dlrm", *r).SerializeToString(), timeout=30))
            time.sleep(0.02)
        forwarded = stub.future(REFUSALS["unknown model"], timeout=30)
        # answered through the Python server: the front has read the calls sent before it (queued in its 2 s window)
        assert forwarded.exception(timeout=30).code() == grpc.StatusCode.NOT_FOUND
        started = time.monotonic()
        server.stop(grace=5)
        assert time.monotonic() - started < 15
        answers = [outputs_of(f.result(timeout=5)) for f in futures]  # drained, not dropped
    whole = in_process(model, *_concat(requests))
    for n, got in enumerate(answers):
        _assert_bitwise(got, {k: v[2 * n:2 * n + 2] for k, v in whole.items()})
    assert proc.poll() == 0
    assert _front_children() == children_before - {proc.pid}  # nothing left behind, not even a zombie
    assert not backend_dir.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- 8. TLS ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("client_ca", [False, True], ids=["tls", "mtls"])
def test_tls_front_answers_predict_and_refuses_plaintext(repo, model, tmp_path, client_ca):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("client")
    files = {"cert": b"".join(p.bytes() for p in cert.cert_chain_pems), "key": cert.private_key_pem.bytes(), "ca": ca.cert_pem.bytes()}
    for name, blob in files.items():
        (tmp_path / f"{name}.pem").write_bytes(blob)
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=1, front="cpp", tls_cert=str(tmp_path / "cert.pem"),
                                 tls_key=str(tmp_path / "key.pem"), tls_client_ca=str(tmp_path / "ca.pem") if client_ca else None))
    try:
        sparse, dense = dlrm_request(3, 800)
        data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
        good = (grpc.ssl_channel_credentials(ca.cert_pem.bytes(), client_cert.private_key_pem.bytes(), client_cert.cert_chain_pems[0].bytes())
                if client_ca else grpc.ssl_channel_credentials(ca.cert_pem.bytes()))
        python_before = _python_count(server)
        with grpc.secure_channel(f"127.0.0.1:{server.port}", good) as channel:
            predict = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
            _assert_bitwise(outputs_of(predict(data, timeout=10)), in_process(model, sparse, dense))
            listing = channel.unary_unary("/recship.serving.v1.Predictor/ListModels", request_serializer=None,
                                          response_deserializer=pb.ListModelsResponse.FromString)(b"", timeout=10)
            assert [m.name for m in listing.models] == ["dlrm"]  # forwarded over the TLS connection too
        assert _python_count(server) == python_before  # the Predict was the front's
        refused = [grpc.insecure_channel(f"127.0.0.1:{server.port}")]
        if client_ca:  # TLS without a client certificate
            refused.append(grpc.secure_channel(f"127.0.0.1:{server.port}", grpc.ssl_channel_credentials(ca.cert_pem.bytes())))
        for channel in refused:
            with channel, pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(PREDICT, request_serializer=None)(data, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


# -- forwarded calls under concurrency ----------------------------------------------------------------

def test_many_concurrent_forwarded_calls_do_not_crash_the_front(repo):
    """Forwarded calls answered OK (metadata) and refused (Predicts the Python server turns down: its status can
    arrive before the front has read the client's half-close), 16 threads at once."""
    server = Server(ServerConfig(model_repo=str(repo), port=0, front="cpp"))
    try:
        proc = server.front._proc
        request = pb.ModelMetadataRequest(model_name="dlrm").SerializeToString()
        refused = pb.PredictRequest(model_name="dlrm", batch_size=1).SerializeToString()  # no features
        errors, calls = [], [0]
        until = time.monotonic() + 4  # each of two proxy races crashed the front within 3 s before its hold

        def work(k):
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = channel.unary_unary("/recship.serving.v1.Predictor/GetModelMetadata", request_serializer=None,
                                           response_deserializer=pb.ModelMetadataResponse.FromString)
                predict = channel.unary_unary(PREDICT, request_serializer=None)
                while time.monotonic() < until and not errors:
                    try:
                        if k % 2:
                            assert call(request, timeout=10).model_name == "dlrm"
                        else:
                            with pytest.raises(grpc.RpcError) as e:
                                predict(refused, timeout=10)
                            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                        calls[0] += 1
                    except grpc.RpcError as e:
                        errors.append((e.code(), e.details()))
                    except AssertionError as e:
                        errors.append(str(e))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and calls[0] > 0
        assert proc.poll() is None and server.front._proc is proc  # neither crashed nor restarted
    finally:
        server.stop()


def test_the_fronts_gauges_are_added_to_the_servers(cpp, monkeypatch):
    """The front reports its own queue depth per served version and its request bytes in flight; a scrape adds them
    to the Python process's gauges of the same names (at rest both are 0; a stand-in count shows the sum)."""
    samples = cpp.front.samples()
    assert [(n, l, v) for n, l, v in samples["recship_queue_depth"]] == [("recship_queue_depth", {"model": "dlrm", "version": "1"}, 0.0)]
    assert samples["recship_inflight_bytes"] == [("recship_inflight_bytes", {}, 0.0)]
    assert _sample(metric_samples(cpp), "recship_queue_depth", model="dlrm", version="1") == 0.0

    def busier():
        out = cpp.front.samples()
        out["recship_queue_depth"] = [(n, l, 3.0) for n, l, _ in out["recship_queue_depth"]]
        out["recship_inflight_bytes"] = [("recship_inflight_bytes", {}, 4096.0)]
        return out

    monkeypatch.setattr(cpp.metrics, "extra", busier)
    scraped = metric_samples(cpp)
    assert _sample(scraped, "recship_queue_depth", model="dlrm", version="1") == 3.0
    assert _sample(scraped, "recship_inflight_bytes") == 4096.0


def test_a_replaced_version_is_freed_once_its_calls_are_answered(repo, small_artifacts, tmp_path, caplog):
    """The front holds a version only through its batcher and the calls it answers: once replaced (and again once
    removed) the version's Model is destroyed, which the front logs, and its tables.bin is no longer mapped."""
    root = tmp_path / "repo"
    shutil.copytree(repo / "dlrm" / "1", root / "dlrm" / "1")
    sparse, dense = dlrm_request(3, 31)

    def mapping(version: int) -> bool:  # whether a recship_front child of this process maps that version's tables
        path = str(root / "dlrm" / str(version) / "tables.bin")
        return any(path in Path(f"/proc/{pid}/maps").read_text() for pid in _front_children())

    with caplog.at_level(logging.INFO, logger="recship.front"):
        server = Server(ServerConfig(model_repo=str(root), port=0, max_delay_ms=1, poll_interval_s=0.1, front="cpp"))
        try:
            with PredictClient(f"127.0.0.1:{server.port}") as client:
                assert client.stub.Predict(client.request("dlrm", sparse, dense), timeout=10).model_version == 1
                assert mapping(1)
                shutil.copytree(small_artifacts(dtype="fp16"), root / "dlrm" / ".incoming")
                (root / "dlrm" / ".incoming").rename(root / "dlrm" / "2")
                wait_until(lambda: "freed dlrm version 1" in caplog.messages, what="the front to free version 1")
                assert not mapping(1) and mapping(2)
                assert client.stub.Predict(client.request("dlrm", sparse, dense), timeout=10).model_version == 2
                assert "freed dlrm version 2" not in caplog.messages
                shutil.rmtree(root / "dlrm")
                wait_until(lambda: "freed dlrm version 2" in caplog.messages, what="the front to free version 2")
                assert not mapping(2)
        finally:
            server.stop()
