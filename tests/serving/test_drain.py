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
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recship.serving import PredictClient

from model_requests import dlrm_request, model_repo
from serving_helpers import front_binary

DRAIN_S = 2.0


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
        assert status == 503, status  # answered, not refused: the listener is still open
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not_ready - signalled < 1.0
        # a load balancer takes the pod out within the drain; until then requests keep coming, and are answered
        time.sleep(DRAIN_S / 2)
        during = sum(1 for t, _ in answered if t > not_ready)
        stop.set()
        for t in threads:
            t.join()
        assert errors == [], errors[:3]
        assert during > 0 and all(shape == (3, 1) for _, shape in answered)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert time.monotonic() - signalled >= DRAIN_S  # the listeners stayed for the whole drain
        logged = proc.stderr.read()
        assert "draining: not ready; listeners close in 2 s" in logged, logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
