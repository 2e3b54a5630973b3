"""The C++ front (``recship serve --front cpp``, cpp_loader/tools/recship_front.cpp): a taken gRPC port fails
the start in one line, and a client cannot flood the log.

Before: gRPC's SO_REUSEPORT let a second server share a port another one (with SO_REUSEPORT, as every gRPC
server) listens on, each taking part of the connections; a port taken otherwise failed with "cannot listen
on ..." and no reason, after gRPC's own multi-line errors. And protobuf logged its "invalid UTF-8" parse error
once per such request.
"""

import logging
import subprocess
import sys

import grpc
import pytest

from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb

from model_requests import listening_socket, model_repo

PREDICT = "/recship.serving.v1.Predictor/Predict"


@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    from recship.serving.front import FrontError, build_front

    try:
        build_front()
    except FrontError as e:
        pytest.skip(f"the C++ front cannot be built here: {e}")
    return model_repo(tmp_path_factory.mktemp("front") / "repo", {"dlrm": small_artifact})


@pytest.mark.parametrize("reuseport", [True, False], ids=["held with SO_REUSEPORT", "held without"])
def test_a_taken_grpc_port_fails_recship_serve_front_cpp_at_start_in_one_line(repo, reuseport):
    with listening_socket(reuseport) as held:
        port = held.getsockname()[1]
        try:
            result = subprocess.run(
                [sys.executable, "-m", "recship.cli", "serve", "--model-repo", str(repo), "--host", "127.0.0.1", "--port", str(port),
                 "--front", "cpp"],
                capture_output=True, text=True, timeout=120,
            )
        except subprocess.TimeoutExpired:  # (run kills it) it started: it shares the port
            pytest.fail(f"recship serve --front cpp started on port {port}, which another socket listens on")
    assert result.returncode == 2, result
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"recship serve: error: the C++ front could not start: cannot listen on 127.0.0.1:{port}: address already in use"], \
        result.stderr


def test_a_free_port_still_starts_and_the_same_port_twice_is_refused(repo):
    first = Server(ServerConfig(model_repo=str(repo), port=0, front="cpp"))
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{first.port}: address already in use"):
            Server(ServerConfig(model_repo=str(repo), port=first.port, front="cpp"))
    finally:
        first.stop()


def _invalid_utf8_predict() -> bytes:
    """A Predict whose request_id (a proto3 string) is not UTF-8: protobuf's parser refuses it."""
    ok = pb.PredictRequest(model_name="dlrm", request_id="@@").SerializeToString()
    bad = ok.replace(b"@@", b"\xff\xfe")
    assert len(bad) == len(ok) and bad != ok
    return bad


def test_invalid_utf8_predicts_are_all_refused_and_counted_but_logged_at_a_bounded_rate(repo, caplog):
    n = 300
    with caplog.at_level(logging.INFO, logger="recship.front"):
        server = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, front="cpp"))
        try:
            before = _refused(server)
            data = _invalid_utf8_predict()
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
                codes = set()
                for _ in range(n):
                    try:
                        call(data, timeout=10)
                        codes.add(grpc.StatusCode.OK)
                    except grpc.RpcError as e:
                        codes.add((e.code(), "not a valid recship.serving.v1.PredictRequest" in e.details()))
            assert codes == {(grpc.StatusCode.INVALID_ARGUMENT, True)}
            assert _refused(server) == before + n  # every one counted (by the Python server the front forwards it to)
        finally:
            server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "recship.front" and "invalid UTF-8" in r.getMessage()]
    # one sample while they came (two if the run spanned the 10 s interval), one at stop for the rest
    assert 2 <= len(lines) <= 4, lines
    assert lines[0].startswith("protobuf: String field 'recship.serving.v1.PredictRequest.request_id' contains invalid UTF-8")
    assert lines[-1].endswith(" not logged)"), lines
    logged = len(lines) - 1
    suppressed = sum(int(line.rsplit("(the last of ", 1)[1].split()[0]) for line in lines[-1:])
    suppressed += sum(int(line.split(" [", 1)[1].split()[0]) for line in lines[1:-1] if " more like this in the last " in line)
    assert logged + suppressed == n, lines


def _refused(server) -> float:
    """Predicts the Python server refused, whatever their labels."""
    return sum(s.value for f in server.metrics.requests.collect() for s in f.samples
               if s.name == "recship_requests_total" and s.labels["method"] == "Predict" and s.labels["status"] != "OK")
