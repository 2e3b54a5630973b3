"""Rules every front applies alike: one size rule in the core's admission, refusals counted but
logged at a bounded rate, ports and settings range-checked at start, client-given numbers read strictly.

References are independent of the server: the size rule and the ranges are re-stated here in plain Python,
answers that succeed are compared with the artifact run in-process (test_fault_properties' reference), and the
client's refusals with what the REST front's own check says for the same values (``rest._data``).
"""

import json
import logging
import math
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from recship.cli import build_parser, main, subcommand_parser
from recship.flags import apply_config_file
from recship.export.artifact import open_artifact
from recship.serving import inference, rest
from recship.serving.client import PredictClient
from recship.serving.kserve import message
from recship.serving.requests import InvalidRequest
from recship.serving.cli import config_from_args
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from model_requests import listening_socket, model_repo
from serving_helpers import front_binary, http_request
from test_fault_properties import expected_kserve, expected_predict, valid_kserve, valid_predict, valid_rest

LIMIT = 16 * 1024  # the servers' max_message_bytes; their transport admits twice it
PREDICT = "/recship.serving.v1.Predictor/Predict"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", params=["python", "cpp"])
def served(request, small_artifact, tmp_path_factory):
    """(server, the artifact in-process, a channel to it), once per front; max_message_bytes LIMIT."""
    if request.param == "cpp":
        front_binary()
    repo = model_repo(tmp_path_factory.mktemp("integrity-repo"), {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_delay_ms=1, max_message_bytes=LIMIT, front=request.param))
    model, _ = open_artifact(repo / "dlrm" / "1")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, model, channel
    channel.close()
    server.stop()


def _call(channel, method: str, data: bytes):
    """(status name, details, response bytes) of one raw unary call."""
    try:
        return "OK", "", channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=20)
    except grpc.RpcError as e:
        return e.code().name, e.details(), None


def _good_predict_still_exact(channel, model, seed: int) -> None:
    data = valid_predict(seed).SerializeToString()
    status, details, answer = _call(channel, PREDICT, data)
    assert status == "OK", details
    _, want = expected_predict(data, model)
    for t in pb.PredictResponse.FromString(answer).outputs:
        np.testing.assert_array_equal(np.array(t.values, dtype=np.float32).reshape(list(t.shape)), want[t.name])


def _counted(server, method: str, status: str) -> float:
    """Requests of ``method`` the Python server counted with ``status``, whatever model and version."""
    return sum(s.value for f in server.metrics.requests.collect() for s in f.samples
               if s.name == "recship_requests_total" and s.labels["method"] == method and s.labels["status"] == status)


# -- 1. one size rule, in the core's admission, for every front --------------------------------------

def _padded(data: bytes, k: int) -> bytes:
    """``data`` with an unknown length-delimited field 1000 of ``k`` bytes appended: every protobuf reader skips it,
    so the request means the same at any size."""
    n, length = k, b""
    while True:
        length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            break
    return data + b"\xc2\x3e" + length + b"x" * k


# method -> (its path, the request bytes of a seed)
GRPC_METHODS = {
    "Predict": (PREDICT, lambda seed: valid_predict(seed).SerializeToString()),
    "ModelInfer": (MODEL_INFER, lambda seed: valid_kserve(seed, raw=seed % 2 == 0).SerializeToString()),
    "GetModelMetadata": ("/recship.serving.v1.Predictor/GetModelMetadata", lambda seed: pb.ModelMetadataRequest(model_name="dlrm").SerializeToString()),
    "ModelMetadata": ("/inference.GRPCInferenceService/ModelMetadata", lambda seed: message("ModelMetadataRequest")(name="dlrm").SerializeToString()),
    "ServerLive": ("/inference.GRPCInferenceService/ServerLive", lambda seed: b""),
}


def _size_rule(n: int):
    """docs/serving.md's rule for a request of n bytes: (status, message), the message None where it is not ours."""
    if n > 2 * LIMIT:
        return "RESOURCE_EXHAUSTED", None  # refused by gRPC's transport before any front sees it
    if n > LIMIT:
        return "INVALID_ARGUMENT", f"request of {n} bytes exceeds the limit of {LIMIT} bytes"
    return "OK", None


# a request's size relative to LIMIT: within it, just over, over, past what the transport admits
sizes = st.one_of(st.integers(-LIMIT // 2, 0), st.integers(1, 64), st.integers(65, LIMIT), st.integers(LIMIT + 1, LIMIT + 2000)).map(lambda d: LIMIT + d)


@FAST
@given(seed=st.integers(0, 2**16), size=sizes)
def test_a_grpc_request_over_max_message_bytes_is_refused_alike_by_every_method(served, seed, size):
    server, model, channel = served
    for method, (path, build) in GRPC_METHODS.items():
        data = build(seed)
        data = _padded(data, max(0, size - len(data)))
        want_status, want_message = _size_rule(len(data))
        event(want_status)  # (pytest --hypothesis-show-statistics: each outcome is met)
        status, details, answer = _call(channel, path, data)
        assert status == want_status, (method, len(data), details)
        if want_message is not None:
            assert details == want_message
        if status == "OK" and method == "Predict":
            _, want = expected_predict(data, model)
            got = {t.name: np.array(t.values, dtype=np.float32).reshape(list(t.shape)) for t in pb.PredictResponse.FromString(answer).outputs}
            assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
        if status == "OK" and method == "ModelInfer":
            _, want = expected_kserve(data, model)
            response = message("ModelInferResponse").FromString(answer)
            for k, out in enumerate(response.outputs):
                values = (np.frombuffer(response.raw_output_contents[k], dtype="<f4") if response.raw_output_contents
                          else np.array(out.contents.fp32_contents, dtype=np.float32))
                np.testing.assert_array_equal(values.reshape(list(out.shape)), want[out.name])
    _good_predict_still_exact(channel, model, seed + 1)


@FAST
@given(seed=st.integers(0, 2**16), size=sizes)
def test_a_rest_request_over_max_message_bytes_gets_413_with_the_same_message(served, seed, size):
    server, model, channel = served
    doc = valid_rest(seed)
    doc["id"] = "x" * max(0, size - len(json.dumps(doc).encode()))
    body = json.dumps(doc).encode()
    status, _, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", body)
    event("413" if len(body) > LIMIT else "200")
    if len(body) > LIMIT:  # (HTTP has no transport limit apart: the same answer up to any size)
        assert (status, json.loads(answer)) == (413, {"error": f"request of {len(body)} bytes exceeds the limit of {LIMIT} bytes"})
    else:
        assert status == 200, answer
    _good_predict_still_exact(channel, model, seed + 1)


# -- 5. refusals: every one counted, a sample logged ---------------------------------------------------

def _lines_and_calls(records, method: str):
    """(the sampled lines of ``method``'s refusals, how many refusals they stand for): each line itself and the
    [N more] it reports; a flushed line "... (the last of N not logged)" stands for N."""
    lines = [r.getMessage() for r in records if getattr(r, "method", "") == method]
    calls = 0
    for line in lines:
        calls += 1 + (int(line.split(" [", 1)[1].split()[0]) if " more like this in the last 10 s not logged]" in line else 0)
    return lines, calls


def test_a_thousand_refused_requests_are_all_counted_and_logged_at_a_bounded_rate(served, caplog):
    server, model, channel = served
    methods = {"Predict": PREDICT, "ModelInfer": MODEL_INFER}
    before = {m: _counted(server, m, "INVALID_ARGUMENT") for m in methods}
    n = 1000
    with caplog.at_level(logging.INFO, logger="recship.serving"):
        server.inference.failures.flush()  # what earlier tests left unsaid is said before this one counts
        start = len(caplog.records)
        started = time.monotonic()
        for i in range(n):
            name = "Predict" if i % 2 else "ModelInfer"
            status, details, _ = _call(channel, methods[name], b"\xff\xff\xff\xff")
            assert status == "INVALID_ARGUMENT" and "is not a valid" in details
            if i % 100 == 0:
                _good_predict_still_exact(channel, model, i)
        elapsed = time.monotonic() - started
        server.inference.failures.flush()
    assert {m: _counted(server, m, "INVALID_ARGUMENT") - before[m] for m in methods} == {"Predict": n / 2, "ModelInfer": n / 2}
    for name in methods:  # at most one line per 10 s (and the flushed one), standing for every refusal
        lines, calls = _lines_and_calls([r for r in caplog.records[start:] if getattr(r, "status", "") == "INVALID_ARGUMENT"], name)
        assert len(lines) <= 2 + elapsed / 10 + 1 and calls == n / 2, lines
        assert all("is not a valid" in line for line in lines)


def test_malformed_http_is_counted_and_logged_at_a_bounded_rate(served, caplog):
    server, model, channel = served
    before = _counted(server, "http.malformed", "INVALID_ARGUMENT")
    n = 200
    with caplog.at_level(logging.INFO, logger="recship.serving"):
        server.inference.failures.flush()
        start = len(caplog.records)
        started = time.monotonic()
        for _ in range(n):
            with socket.create_connection(("127.0.0.1", server.rest.port), timeout=20) as s:
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
                assert s.recv(100).split(b" ", 2)[1] == b"400"
            assert http_request(server.rest.port, "GET", "/v2/health/live")[0] == 200  # a good one still answers
        elapsed = time.monotonic() - started
        server.inference.failures.flush()
    assert _counted(server, "http.malformed", "INVALID_ARGUMENT") == before + n
    assert not [r for r in caplog.records if r.name == "recship.serving.http"], "aiohttp's own line per request"
    lines, calls = _lines_and_calls(caplog.records[start:], "http.malformed")
    assert len(lines) <= 2 + elapsed / 10 + 1 and calls == n, lines
    assert all(line.startswith("Error handling request from 127.0.0.1: Invalid header token") for line in lines), lines


@given(gaps=st.lists(st.floats(0, 30), min_size=1, max_size=300), sources=st.lists(st.sampled_from("ab"), min_size=300, max_size=300))
@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])  # too_slow: a busy machine
def test_sampled_log_lines_are_bounded_and_account_for_every_call(gaps, sources):
    """Each source logs its first line, then at most one line per interval, which counts those left out since the
    one before; flush() says the rest: the lines and their counts add up to every call."""
    clock = [0.0]

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    logger = logging.getLogger("recship.test_sampled_log")
    logger.propagate, logger.level = False, logging.INFO
    handler = Lines()
    logger.handlers = [handler]
    sampled = inference.SampledLog(logger, interval_s=10.0, clock=lambda: clock[0])
    calls = {"a": [], "b": []}
    for i, gap in enumerate(gaps):
        clock[0] += gap
        calls[sources[i]].append(clock[0])
        sampled.log(sources[i], logging.WARNING, f"refused {i}", extra={"source": sources[i]})
    sampled.flush()
    for source, times in calls.items():
        mine = [r.getMessage() for r in handler.records if r.source == source]
        if not times:
            assert mine == []
            continue
        # each line stands for itself and the [N more] it reports; flush's line is the last one left out
        counted = sum(1 + (int(line.split(" [", 1)[1].split()[0]) if " more like this in the last 10 s not logged]" in line else 0)
                      for line in mine)
        assert counted == len(times), mine
        flushed = mine[-1].endswith(" not logged)")
        assert len(mine) <= 1 + math.floor((times[-1] - times[0]) / 10.0 + 1e-9) + flushed


# -- 9 and 12. ports and settings, checked at start ----------------------------------------------------

@pytest.mark.parametrize("reuseport", [True, False], ids=["held with SO_REUSEPORT", "held without"])
def test_a_taken_port_fails_the_start_in_the_same_words_for_grpc_http_and_metrics(tmp_path, reuseport):
    with listening_socket(reuseport) as held:
        port = held.getsockname()[1]
        for field in ("port", "http_port", "metrics_port"):
            with pytest.raises(OSError) as refused:
                Server(ServerConfig(model_repo=str(tmp_path), **{"port": 0, field: port}))
            assert str(refused.value) == f"cannot listen on 127.0.0.1:{port}: address already in use", field


def test_a_second_server_on_the_same_grpc_port_is_refused_and_the_first_keeps_every_request(served):
    server, model, channel = served
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}: address already in use"):
        Server(ServerConfig(model_repo=server.config.model_repo, port=server.port))
    for seed in range(20):  # over fresh connections: none can land on another listener
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as fresh:
            _good_predict_still_exact(fresh, model, seed)


# field -> (its flag, smallest, largest, integer?, None allowed?, smallest excluded?): the serve settings' ranges
RANGES = {
    "port": ("--port", 0, 65535, True, False, False),
    "http_port": ("--http-port", 0, 65535, True, True, False),
    "metrics_port": ("--metrics-port", 0, 65535, True, True, False),
    "max_batch_size": ("--max-batch-size", 1, math.inf, True, False, False),
    "max_delay_ms": ("--max-delay-ms", 0, 60_000, False, False, False),
    "max_queue": ("--max-queue", 1, math.inf, True, False, False),
    "poll_interval_s": ("--poll-interval", 0, 86_400, False, False, True),
    "torch_threads": ("--torch-threads", 1, 1024, True, True, False),
    "max_message_bytes": ("--max-message-mb", 1, 2**30 - 1, True, False, False),
    "max_inflight_bytes": ("--max-inflight-mb", 1, 2**63 - 1, True, False, False),
    "http_idle_timeout_s": ("http_idle_timeout_s", 0, 86_400, False, False, True),
}
odd_number = st.one_of(
    st.sampled_from([0, 1, -1, 2, 0.5, -0.5, 1.5, 65535, 65536, 99999, 60_000, 60_000.5, 1024, 1025, 2**30 - 1, 2**30, 2**31,
                     2**63 - 1, 2**63, 86_400, 86_401, 1e-9, True, False, None, "1", float("nan"), float("inf"), -float("inf")]),
    st.integers(-10, 10**6), st.floats(-10, 1e6),
)


def _in_range(field: str, value) -> bool:
    _, lo, hi, integer, optional, open_low = RANGES[field]
    if value is None:
        return optional
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return False
    return math.isfinite(value) and (lo < value if open_low else lo <= value) and value <= hi


@given(field=st.sampled_from(sorted(RANGES)), value=odd_number)
@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])  # too_slow: a busy machine
def test_every_numeric_setting_is_range_checked_with_a_one_line_error_naming_its_flag(field, value):
    try:
        config = ServerConfig(model_repo="repo", **{field: value})
    except ValueError as e:
        assert not _in_range(field, value), (field, value, e)
        text = str(e)
        assert text.startswith(RANGES[field][0] + " takes ") and "\n" not in text and text.removesuffix(" bytes").endswith(f"got {value!r}")
    else:
        assert _in_range(field, value), (field, value)
        assert getattr(config, field) == value


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port takes a port number from 0 to 65535 (0: any free port), got 99999"),
    (["--http-port", "-1"], "--http-port takes a port number from 0 to 65535 (0: any free port), got -1"),
    (["--metrics-port", "70000"], "--metrics-port takes a port number from 0 to 65535 (0: any free port), got 70000"),
    (["--max-batch-size", "0"], "--max-batch-size takes an integer >= 1, got 0"),
    (["--max-delay-ms", "-1"], "--max-delay-ms takes a number from 0 to 60000, got -1.0"),
    (["--max-delay-ms", "nan"], "--max-delay-ms takes a number from 0 to 60000, got nan"),
    (["--max-queue", "0"], "--max-queue takes an integer >= 1, got 0"),
    (["--poll-interval", "0"], "--poll-interval takes a number above 0, up to 86400, got 0.0"),
    (["--torch-threads", "0"], "--torch-threads takes an integer from 1 to 1024 (or none: the default), got 0"),
    (["--max-message-mb", "0"], "--max-message-mb takes a number of MB above 0 and below 1024, got 0.0"),
    (["--max-message-mb", "inf"], "--max-message-mb takes a number of MB above 0 and below 1024, got inf"),
    (["--max-message-mb", "1024"], "--max-message-mb takes a number of MB above 0 and below 1024, got 1024.0"),
    (["--max-inflight-mb", "-5"], "--max-inflight-mb takes a number of MB above 0, got -5.0"),
    (["--max-inflight-mb", "nan"], "--max-inflight-mb takes a number of MB above 0, got nan"),
])
def test_bad_serve_flags_are_refused_at_start(tmp_path, argv, message):
    args = build_parser("serve").parse_args(["serve", "--model-repo", str(tmp_path), *argv])
    with pytest.raises(ValueError) as refused:
        config_from_args(args)
    assert str(refused.value) == message


@pytest.mark.parametrize("text, message", [
    ("max-batch-size: 0\n", "--max-batch-size takes an integer >= 1, got 0"),
    ("max-batch-size: 1.5\n", "max-batch-size: --max-batch-size takes an integer, got 1.5"),
    ("max-queue: true\n", "max-queue: --max-queue takes an integer, got True"),
    ("max-delay-ms: -1\n", "--max-delay-ms takes a number from 0 to 60000, got -1.0"),
    ("port: 99999\n", "--port takes a port number from 0 to 65535 (0: any free port), got 99999"),
    ("host: true\n", "host: --host takes a string, got True"),
])
def test_bad_settings_in_a_config_file_are_refused_at_start(tmp_path, text, message):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model-repo: {tmp_path}\n" + text)
    with pytest.raises(ValueError) as refused:
        parser = build_parser("serve")
        apply_config_file(subcommand_parser(parser, "serve"), str(config))
        config_from_args(parser.parse_args(["serve"]))
    assert str(refused.value).endswith(message), str(refused.value)


def test_recship_serve_says_a_bad_port_in_one_line_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "recship.cli", "serve", "--model-repo", str(tmp_path), "--port", "99999"],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (
        2, "recship serve: error: --port takes a port number from 0 to 65535 (0: any free port), got 99999\n")


# -- 11. client-given numbers: refused by the client and `recship predict` as REST refuses them --------

def _rest_message(name: str, datatype: str, flat) -> str:
    try:
        rest._data(name, datatype, flat)
    except InvalidRequest as e:
        return str(e)
    return ""


json_scalar = st.one_of(st.integers(-(2**64), 2**64), st.floats(-1e3, 1e3),
                        st.sampled_from([0, 1, 5, 1.0, 1.5, -0.0, 1e30, True, False, None, "1", "x", 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]))


@FAST
@given(ids=st.lists(st.lists(json_scalar, max_size=3), min_size=1, max_size=3),
       weights=st.none() | st.lists(st.lists(json_scalar, max_size=3), min_size=1, max_size=3),
       dense=st.none() | st.lists(st.lists(json_scalar, min_size=2, max_size=2), min_size=1, max_size=3))
def test_the_client_refuses_exactly_what_rest_refuses_in_its_words(ids, weights, dense):
    """PredictClient.request takes ids, weights and dense values as REST's JSON reader does: nothing truncated,
    coerced or guessed (before: [[1.5]] was sent as id 1, "1" as 1, True as 1)."""
    flat_ids = [i for row in ids for i in row]
    want = (_rest_message("cat_0.values", "INT64", flat_ids)
            or (weights is not None and _rest_message("cat_0.weights", "FP32", [w for row in weights for w in row]))
            or (dense is not None and _rest_message("dense", "FP32", [x for row in dense for x in row])))
    try:
        request = PredictClient.request("dlrm", {"cat_0": ids}, dense, {"cat_0": weights} if weights is not None else None)
    except ValueError as e:
        assert str(e) == want
    else:
        assert not want
        assert list(request.sparse[0].ids) == flat_ids  # exactly the ids given
        assert list(request.sparse[0].lengths) == [len(row) for row in ids]


@pytest.mark.parametrize("value", [10**400, -(10**309)])
def test_an_int_past_a_doubles_range_in_fp32_data_is_a_400_not_a_500(served, value):
    """JSON allows integers of any size; as FP32 such a one has no float at all (numpy raised OverflowError: 500)."""
    server, model, channel = served
    doc = valid_rest(7)
    dense = next(t for t in doc["inputs"] if t["name"] == "dense")
    dense["data"] = [value] + np.asarray(dense["data"]).ravel().tolist()[1:]
    status, _, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", json.dumps(doc).encode())
    assert (status, json.loads(answer)) == (400, {"error": "input 'dense': a value is outside FP32's range"})
    with pytest.raises(ValueError, match="a value is outside FP32's range"):  # the client: the same words, nothing sent
        PredictClient.request("dlrm", {"cat_0": [[1]]}, [[value] + [0.0] * 12])
    _good_predict_still_exact(channel, model, 8)


def test_recship_predict_refuses_a_fractional_id_in_rests_words_without_sending_it(tmp_path, capsys):
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"sparse": {"cat_0": [[1.5], [2]]}, "dense": [[0.5] * 13, [0.5] * 13]}))
    # nothing listens on port 1: a request sent would fail UNAVAILABLE instead
    assert main(["predict", "--target", "127.0.0.1:1", "--model-name", "dlrm", "--request", str(path)]) == 2
    want = _rest_message("cat_0.values", "INT64", [1.5, 2])
    assert want == "input 'cat_0.values': INT64 data must be ints, found float"
    assert capsys.readouterr().err == f"recship predict: error: {want}\n"


def test_the_client_still_takes_numpy_ids_and_dense():
    request = PredictClient.request("dlrm", {"cat_0": [np.array([3, 4], dtype=np.int64), np.array([], dtype=np.int32)]},
                                    np.ones((2, 13), dtype=np.float64))
    assert list(request.sparse[0].ids) == [3, 4] and list(request.sparse[0].lengths) == [2, 0]
    assert list(request.dense.values) == [1.0] * 26
