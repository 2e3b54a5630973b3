"""SIGTERM as Kubernetes sends it: readiness answers 503 (gRPC health NOT_SERVING) at once, while every listener keeps
serving for --drain-delay; requests in flight finish; the process exits 0. Under load from clients on open channels
and on new connections, no request fails, through the Python front and the C++ front alike."""

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recship.export.artifact import open_artifact
from recship.serving import PredictClient
from recship.serving.server import Server, ServerConfig

from model_requests import dlrm_request, in_process, model_repo
from serving_helpers import front_binary

DRAIN_S = 2.0
CLOSE_DRAIN_S = 0.5
# Server.stop's grace, what a stop waits at most for the calls in flight: a stop that exits later than the drain +
# its longest call + this waited for a call the drain should have finished. On a loaded machine the exit's own work
# (the fronts' and the models' teardown) can take seconds: the tighter bound, EXIT_S, holds for the best of several stops.
GRACE_S = 5.0
EXIT_S = 2.0
NOT_ACCEPTED = "failed to connect"  # (UNAVAILABLE) a call after the listener closed: never reached the server


def _ready(http_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_sigterm_under_load_drains_with_readiness_503_first_and_no_failed_request(small_artifact, tmp_path, front):
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    proc = subprocess.Popen([sys.executable, "-m", "recship", "serve", "--model-repo", str(repo), "--port", "0", "--http-port", "0",
                             "--drain-delay", str(DRAIN_S), "--front", front], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, proc.stderr.read()
        port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        http_port = int(line.rsplit(":", 1)[1])
        assert _ready(http_port) == 200
        sparse, dense = dlrm_request(3, 1)
        stop, answered, errors = threading.Event(), [], []

        def load(fresh_channels: bool):
            client = None
            while not stop.is_set():
                try:
                    if client is None or fresh_channels:
                        if client is not None:
                            client.close()
                        client = PredictClient(f"127.0.0.1:{port}")
                    got = client.predict("dlrm", sparse, dense)
                    answered.append((time.monotonic(), got["prob"].shape))
                except Exception as e:  # noqa: BLE001 -- every failure is the finding
                    errors.append(f"{type(e).__name__}: {e}")
            if client is not None:
                client.close()

        threads = [threading.Thread(target=load, args=(fresh,)) for fresh in (False, False, True)]
        for t in threads:
            t.start()
        while len(answered) < 30 and not errors:
            time.sleep(0.01)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = _ready(http_port)
        while status == 200 and time.monotonic() < signalled + 5:
            time.sleep(0.01)
            status = _ready(http_port)
        not_ready = time.monotonic()
        assert status == 503, status  # answered, not refused: readiness turned while the listeners are open
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # a load balancer takes the pod out within the drain; until then requests keep coming, and are answered
        while sum(1 for t, _ in answered if t > not_ready) < 10 and not errors:
            time.sleep(0.01)
        during = sum(1 for t, _ in answered if t > not_ready)
        stop.set()
        for t in threads:
            t.join()
        assert errors == [], errors[:3]
        assert during > 0 and all(shape == (3, 1) for _, shape in answered)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        exited = time.monotonic() - signalled
        assert DRAIN_S <= exited < DRAIN_S + GRACE_S, exited  # the listeners stayed for the whole drain (no longer: below)
        logged = proc.stderr.read()
        assert "draining: not ready; listeners close in 2 s" in logged, logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve(repo, front: str, drain: float) -> "tuple[subprocess.Popen, int]":
    proc = subprocess.Popen([sys.executable, "-m", "recship", "serve", "--model-repo", str(repo), "--port", "0", "--http-port", "0",
                             "--drain-delay", str(drain), "--front", front], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on 127.0.0.1:" in line, proc.stderr.read()
    return proc, int(line.split("listening on 127.0.0.1:")[1].split(",")[0])


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_sigterm_exits_within_the_drain_idle_and_under_load_through_the_close_with_no_accepted_call_failed(small_artifact, tmp_path, front):
    """Clients that keep calling past the drain (a load balancer slower than --drain-delay): every call the server
    took is answered (gRPC core cancels the calls that reach a server after its shutdown began and before the
    client read its GOAWAY: PredictClient sends those again), the rest fail to connect. Each stop exits after the
    drain and before the drain + the longest call + the grace (no call waited out); the best of the four (one
    idle, three under load) within the drain + its longest call + 2 s: the machine's load may slow one exit's own
    work, not every one. Three times under load: the race is rare."""
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    sparse, dense = dlrm_request(3, 1)
    proc, _ = _serve(repo, front, CLOSE_DRAIN_S)
    past_drain = []  # of each stop: its exit after the signal - the drain - its longest call
    try:  # idle
        time.sleep(0.5)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        exited = time.monotonic() - signalled
        assert CLOSE_DRAIN_S <= exited < CLOSE_DRAIN_S + GRACE_S, exited
        past_drain.append(exited - CLOSE_DRAIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for attempt in range(3):  # under load, through the close
        proc, port = _serve(repo, front, CLOSE_DRAIN_S)
        try:
            stop, answered, failed, longest = threading.Event(), [0], [], [0.0]

            def load(fresh_channels: bool):
                client = None
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        if client is None or fresh_channels:
                            if client is not None:
                                client.close()
                            client = PredictClient(f"127.0.0.1:{port}")
                        assert client.predict("dlrm", sparse, dense)["prob"].shape == (3, 1)
                        answered[0] += 1
                        longest[0] = max(longest[0], time.monotonic() - started)
                    except grpc.RpcError as e:
                        if not (e.code() == grpc.StatusCode.UNAVAILABLE and NOT_ACCEPTED in (e.details() or "")):
                            failed.append(f"{e.code().name}: {e.details()}")
                        if proc.poll() is not None:
                            time.sleep(0.01)
                if client is not None:
                    client.close()

            threads = [threading.Thread(target=load, args=(i % 4 == 3,)) for i in range(8)]
            for t in threads:
                t.start()
            while answered[0] < 200 and not failed:
                time.sleep(0.01)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            exited = time.monotonic() - signalled
            time.sleep(0.2)  # calls on after the exit: they fail to connect
            stop.set()
            for t in threads:
                t.join()
            assert code == 0, proc.stderr.read()
            assert failed == [], (attempt, failed[:3])
            assert CLOSE_DRAIN_S <= exited < CLOSE_DRAIN_S + longest[0] + GRACE_S, (attempt, exited, longest[0])
            past_drain.append(exited - CLOSE_DRAIN_S - longest[0])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert min(past_drain) <= EXIT_S, past_drain  # no longer than the drain: nothing else waited for in every stop


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_sigterm_exits_within_the_drain_with_idle_clients_and_a_health_watch_open(small_artifact, tmp_path, front):
    """An idle server with clients connected: one that was answered and keeps its channel, one watching gRPC health
    (gRPC clients' own health checking holds such a stream on each connection; it never ends by itself). The watch
    sees NOT_SERVING at the signal and ends UNAVAILABLE "the server is stopping" when the listeners close; the
    process exits after the drain and before the drain + the grace (before: the stop waited the whole grace for the
    watch, either front), the best of two stops within the drain + EXIT_S."""
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    sparse, dense = dlrm_request(3, 1)
    past_drain = []
    for _ in range(2):
        proc, port = _serve(repo, front, CLOSE_DRAIN_S)
        try:
            with PredictClient(f"127.0.0.1:{port}") as client, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert client.predict("dlrm", sparse, dense)["prob"].shape == (3, 1)
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
                seen, ended = [], []

                def read():
                    try:
                        seen.extend(answer.status for answer in watch)
                    except grpc.RpcError as e:
                        ended.append((e.code(), e.details()))

                reader = threading.Thread(target=read)
                reader.start()
                while not seen and not ended:
                    time.sleep(0.01)
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 0, proc.stderr.read()
                exited = time.monotonic() - signalled
                reader.join(timeout=10)
            assert CLOSE_DRAIN_S <= exited < CLOSE_DRAIN_S + GRACE_S, exited
            past_drain.append(exited - CLOSE_DRAIN_S)
            assert seen == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING], seen
            assert ended == [(grpc.StatusCode.UNAVAILABLE, "the server is stopping")], ended
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if past_drain[-1] <= EXIT_S:
            break
    assert min(past_drain) <= EXIT_S, past_drain


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_a_stop_runs_the_batch_waiting_for_company_at_once(small_artifact, tmp_path, front):
    """One Predict waits in its batch window (max_delay_ms 20 s; the Python batcher's, or the C++ front's) when the
    server stops: once the drain ends no call comes any more, so it runs then (Batcher.close_window,
    Front::close_windows) and is answered as in process; the stop ends within the drain + EXIT_S (before: it waited
    the window out, inside the grace)."""
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    window_s = 20.0
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, front=front, max_delay_ms=window_s * 1000))
    sparse, dense = dlrm_request(3, 5)
    answers, stopped = [], None
    try:
        with PredictClient(f"127.0.0.1:{server.port}", timeout=60) as client:
            caller = threading.Thread(target=lambda: answers.append(client.predict("dlrm", sparse, dense)))
            caller.start()
            deadline = time.monotonic() + 30
            while not _held(server):
                assert time.monotonic() < deadline and caller.is_alive(), answers
                time.sleep(0.01)
            if front == "python":
                time.sleep(0.2)  # (held: submitted to the batcher right after)
                (served,) = server.repo.versions("dlrm")
                assert served.batcher.pending == 0  # taken into the window, waiting for company
            assert not answers
            stopping = time.monotonic()
            try:
                server.stop(grace=2 * window_s, drain_delay=CLOSE_DRAIN_S)
            finally:
                stopped = time.monotonic() - stopping
            caller.join()
    finally:
        if stopped is None:  # (not stopped twice: a stopped server's loop is gone)
            server.stop(drain_delay=0)
    assert CLOSE_DRAIN_S <= stopped < CLOSE_DRAIN_S + EXIT_S, stopped
    want = in_process(open_artifact(small_artifact, format="torchscript")[0], sparse, dense)
    assert len(answers) == 1 and sorted(answers[0]) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(answers[0][name], want[name], err_msg=name)


def _held(server: Server) -> bool:
    """Whether a request is held by the front that took it (its bytes in flight): the C++ front's, else Python's."""
    if server.front is not None:
        return server.front.stats()["gauges"]["inflight_bytes"] > 0
    return server.inference.inflight_bytes > 0
