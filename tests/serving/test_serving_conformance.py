"""One conformance suite for the serving rules (protos/recship/serving/v1/serving_rules.json, serving/rules.py), run
against both fronts: the Python server (``--front python``) and the C++ front (``--front cpp``,
cpp_loader/tools/front/). Each test asserts what a client and an operator observe: statuses and messages, rows,
counters, log lines, computed from the rules and from the artifact run in process, never from either front.

Where the C++ front enforces a rule itself (batching, queue and in-flight admission, its counts and its log), the
test also checks that the Python server did not answer in its place (its own request counter did not move). A
request over max_batch_size the C++ front forwards on purpose: the Python server refuses it in its words, as every
invalid Predict (serving/front.py).
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from recship.export.artifact import open_artifact
from recship.serving import PredictClient, footprint, rules
from recship.serving.grpc_status import CODES
from recship.serving.inference import ErrorKind
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from model_requests import dlrm_request, in_process, model_repo
from serving_helpers import front_binary, metric_samples, wait_until

PREDICT = "/recship.serving.v1.Predictor/Predict"
MAX_BATCH = 8  # "dlrm"'s config.yaml: batches of at most 8 examples, collected for up to 50 ms
INFLIGHT = 4 << 20  # the servers' --max-inflight-mb, in bytes
UNROUTED = rules.UNROUTED  # the model and version labels of a request refused before it reached a version


@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    """Two models of the small artifact: "dlrm" batching (max_batch_size 8, 50 ms), "queued" one request per forward
    with a queue of 1."""
    root = model_repo(tmp_path_factory.mktemp("conformance") / "repo", {"dlrm": small_artifact, "queued": small_artifact})
    (root / "dlrm" / "config.yaml").write_text(f"max-batch-size: {MAX_BATCH}\nmax-delay-ms: 50\n")
    (root / "queued" / "config.yaml").write_text("batching: false\nmax-queue: 1\n")
    return root


@pytest.fixture(scope="module")
def model(repo):
    return open_artifact(repo / "dlrm" / "1", format="torchscript")[0]


@pytest.fixture(scope="module", params=["python", "cpp"])
def server(request, repo):
    if request.param == "cpp":
        front_binary()  # skips where the C++ front cannot be built
    s = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_inflight_bytes=INFLIGHT, front=request.param))
    yield s
    s.stop()


def _call(server, data: bytes):
    """(status code, details, PredictResponse or None) of one Predict of raw bytes."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=pb.PredictResponse.FromString)
        try:
            return grpc.StatusCode.OK, "", call(data, timeout=30)
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def _status(refusal: rules.Refusal):
    return CODES[ErrorKind[refusal.kind]]


def _counted(server, model: str, version: str, status: str) -> float:
    return metric_samples(server).get(("recship_requests_total", frozenset(
        {"method": "Predict", "model": model, "version": version, "status": status}.items())), 0.0)


def _python_answered(server) -> float:
    """Predicts the Python server itself counted, whatever their labels (a C++ front's own are not in here)."""
    return sum(s.value for f in server.metrics.requests.collect() for s in f.samples
               if s.name == "recship_requests_total" and s.labels["method"] == "Predict")


def _native(server) -> bool:
    return server.front is not None


def _outputs(response):
    return {t.name: np.array(t.values, dtype=np.float32).reshape(list(t.shape)) for t in response.outputs}


def test_a_request_over_max_batch_size_is_refused_in_the_rules_words(server, model):
    refusal = rules.REFUSALS[rules.LIMITS["max_batch_size"].violation]
    before = _counted(server, "dlrm", "1", _status(refusal).name)
    over = PredictClient.request("dlrm", *dlrm_request(MAX_BATCH + 1, 5)).SerializeToString()
    assert _call(server, over)[:2] == (_status(refusal), refusal.say(batch_size=MAX_BATCH + 1, max_batch_size=MAX_BATCH))
    assert _counted(server, "dlrm", "1", _status(refusal).name) - before == 1
    at = dlrm_request(MAX_BATCH, 6)  # exactly the limit runs, and runs alone: bitwise the artifact in process
    code, _, response = _call(server, PredictClient.request("dlrm", *at).SerializeToString())
    assert code == grpc.StatusCode.OK
    want = in_process(model, *at)
    assert sorted(_outputs(response)) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(_outputs(response)[k], want[k], err_msg=k)


def test_requests_batched_together_each_get_their_own_rows_and_the_counters_move_as_the_rules_say(server, model):
    threads, per_thread, seed = 16, 4, 2000
    requests, want = [], []
    while len(requests) < threads * per_thread:  # answers 1e-5 apart: a row given to the wrong caller cannot pass
        seed += 1
        r = dlrm_request(1, seed)
        w = in_process(model, *r)
        if all(abs(w["logit"][0, 0] - o["logit"][0, 0]) > 1e-5 for o in want):
            requests.append(r)
            want.append(w)
    logits = np.array([w["logit"][0, 0] for w in want])
    before, stats_before, python_before = metric_samples(server), server.metrics.stats("dlrm", "1"), _python_answered(server)
    start = threading.Barrier(threads)
    with PredictClient(f"127.0.0.1:{server.port}") as client:

        def work(k):
            start.wait()
            return [(i, client.predict("dlrm", *requests[i], timeout=30)) for i in range(k, len(requests), threads)]

        with ThreadPoolExecutor(threads) as pool:
            answers = [a for part in pool.map(work, range(threads)) for a in part]
    assert sorted(i for i, _ in answers) == list(range(len(requests)))
    for i, got in answers:  # a merged forward differs from a lone one in the last bits of its GEMM: 1e-6, and nearest
        for k in want[i]:
            np.testing.assert_allclose(got[k], want[i][k], rtol=0, atol=1e-6, err_msg=f"request {i} {k}")
        assert int(np.argmin(np.abs(logits - got["logit"][0, 0]))) == i
    after, stats = metric_samples(server), server.metrics.stats("dlrm", "1")

    def moved(name, **labels):
        key = (name, frozenset({"model": "dlrm", "version": "1", **labels}.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    n = len(requests)
    assert moved("recship_requests_total", method="Predict", status="OK") == n
    forwards = moved("recship_batch_examples_count")
    assert moved("recship_batch_examples_sum") == n  # every example ran once
    assert moved("recship_batch_examples_bucket", le=f"{float(MAX_BATCH)}") == forwards  # none past max_batch_size
    assert moved("recship_batch_examples_bucket", le="1.0") < forwards < n  # some forwards held several requests
    assert moved("recship_queue_seconds_count") == n and moved("recship_compute_seconds_count") == forwards
    assert moved("recship_request_seconds_count") == n
    # Triton's statistics agree with the metrics
    assert stats.success[0] - stats_before.success[0] == n
    assert stats.inference_count - stats_before.inference_count == n
    assert stats.execution_count - stats_before.execution_count == forwards
    if _native(server):
        assert _python_answered(server) == python_before


def test_a_full_queue_is_refused_in_the_rules_words_and_the_others_are_answered_exactly(server, model):
    refusal = rules.REFUSALS[rules.LIMITS["max_queue"].violation]
    requests = [dlrm_request(32, 600 + i) for i in range(8)]
    data = [PredictClient.request("queued", *r).SerializeToString() for r in requests]
    assert 16 * max(footprint.predict(d) for d in data) < INFLIGHT  # the queue fills, never the in-flight budget
    want = [in_process(model, *r) for r in requests]
    before = {s: _counted(server, "queued", "1", s) for s in ("OK", _status(refusal).name)}
    python_before = _python_answered(server)
    start = threading.Barrier(16)

    def client(k):
        start.wait()
        return [(i, *_call(server, data[i])) for i in ((k + j) % len(data) for j in range(12))]

    with ThreadPoolExecutor(16) as pool:
        results = [r for part in pool.map(client, range(16)) for r in part]
    refused = {(code, details) for _, code, details, _ in results if code != grpc.StatusCode.OK}
    answered = [(i, response) for i, code, _, response in results if code == grpc.StatusCode.OK]
    assert refused == {(_status(refusal), refusal.say(max_queue=1))}, "16 clients never filled a queue of 1, or something else refused"
    for i, response in answered:  # one request per forward: bitwise
        for k in want[i]:
            np.testing.assert_array_equal(_outputs(response)[k], want[i][k], err_msg=k)
    n_refused = sum(1 for _, code, _, _ in results if code != grpc.StatusCode.OK)
    assert {s: _counted(server, "queued", "1", s) - before[s] for s in before} == {"OK": len(answered), _status(refusal).name: n_refused}
    if _native(server):
        assert _python_answered(server) == python_before


def test_requests_over_the_in_flight_budget_are_refused_counted_and_logged_as_sampled(server, caplog):
    refusal = rules.REFUSALS[rules.LIMITS["max_inflight_bytes"].violation]
    big = PredictClient.request("dlrm", *dlrm_request(MAX_BATCH, 7, ids=(400, 420))).SerializeToString()
    cost = footprint.predict(big)  # what both fronts charge a Predict
    assert cost > INFLIGHT
    message = refusal.say(total=cost, limit=INFLIGHT)
    status = _status(refusal).name
    before, python_before = _counted(server, UNROUTED, UNROUTED, status), _python_answered(server)
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            assert _call(server, big)[:2] == (_status(refusal), message)

        def lines():
            return [r for r in caplog.records if r.getMessage().startswith(message)]

        wait_until(lines, "the refusal's log line")  # (the C++ front's lines reach Python's log through a pipe)
        time.sleep(0.5)
    assert _counted(server, UNROUTED, UNROUTED, status) - before == 4  # refused before it reached a version
    # sampled: the first line of its kind, then none for LOG_INTERVAL_S; the record's fields say what it is about
    assert rules.LOG_INTERVAL_S >= 10
    assert [r.getMessage() for r in lines()] == [message]
    (r,) = lines()
    assert (r.method, r.model, r.version, r.status) == ("Predict", UNROUTED, UNROUTED, status)
    if _native(server):
        assert _python_answered(server) == python_before


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_at_stop_the_sampled_log_says_how_many_lines_it_left_out(front, repo, caplog):
    if front == "cpp":
        front_binary()
    refusal = rules.REFUSALS[rules.LIMITS["max_inflight_bytes"].violation]
    big = PredictClient.request("dlrm", *dlrm_request(MAX_BATCH, 8, ids=(400, 420))).SerializeToString()
    message = refusal.say(total=footprint.predict(big), limit=INFLIGHT)
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_inflight_bytes=INFLIGHT, front=front))
    with caplog.at_level(logging.WARNING):
        try:
            for _ in range(3):
                assert _call(server, big)[:2] == (_status(refusal), message)
        finally:
            server.stop()
    interval = f"{rules.LOG_INTERVAL_S:g}"
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(message)] == [
        message, f"{message} [1 more like this in the last {interval} s not logged] (the last of 2 not logged)"]
