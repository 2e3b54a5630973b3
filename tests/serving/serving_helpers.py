"""Shared by the serving tests: the small artifact's shape, its requests in KServe's form, a raw HTTP/1.1 client,
the C++ front's binary. (Requests and the in-process reference of every folder: tests/model_requests.py.)"""

import socket
import subprocess
import time
from typing import Dict, Optional, Tuple

import numpy as np
import pytest

from model_requests import NUM_DENSE, SMALL_ROWS, dlrm_request  # NUM_DENSE: the serving tests import it from here too

ROWS = SMALL_ROWS  # table sizes of the 26 features cat_0..cat_25
FEATURES = [f"cat_{i}" for i in range(len(ROWS))]


def random_request(seed: int):
    """(sparse {feature: [ids per example]}, dense [B, 13]) of a valid request for the small DLRM: 1-5 examples
    (drawn first), 0-2 ids per example and feature."""
    g = np.random.default_rng(seed)
    return dlrm_request(int(g.integers(1, 6)), g, ids=(0, 2))


def kserve_tensors(sparse, dense, weights=None):
    """[(input name, KServe datatype, numpy array)] of a request, in the order the requests send them."""
    out = []
    for name, rows in sparse.items():
        out.append((f"{name}.lengths", "INT32", np.array([len(r) for r in rows], dtype=np.int32)))
        out.append((f"{name}.values", "INT64", np.array([i for r in rows for i in r], dtype=np.int64)))
        if weights and name in weights:
            out.append((f"{name}.weights", "FP32", np.array([w for r in weights[name] for w in r], dtype=np.float32)))
    out.append(("dense", "FP32", np.asarray(dense, dtype=np.float32)))
    return out


def http_request(port: int, method: str, path: str, body: Optional[bytes] = None, headers: Optional[Dict[str, str]] = None,
                 host: str = "127.0.0.1", timeout: float = 20.0) -> Tuple[int, Dict[str, str], bytes]:
    """One request on a fresh connection: (status, lower-cased headers, body). Raw sockets, so nothing is normalised."""
    head = {"Host": "test", "Connection": "close", **(headers or {})}
    if body is not None and "Content-Length" not in head and "Transfer-Encoding" not in head:
        head["Content-Length"] = str(len(body))
    data = f"{method} {path} HTTP/1.1\r\n".encode() + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + (body or b"")
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        return read_response(s)


def read_response(s: socket.socket) -> Tuple[int, Dict[str, str], bytes]:
    """Reads one HTTP response (Content-Length framed) from a connected socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {buf[:200]!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def front_binary():
    """Path of the built C++ front (serving/front.py builds it once, incrementally); skips where gRPC C++ is missing."""
    from recship.serving.front import FrontError, build_front

    try:
        return build_front()
    except FrontError as e:
        pytest.skip(f"the C++ front cannot be built here: {e}")


def metric_samples(server) -> Dict[Tuple[str, frozenset], float]:
    """A running server's /metrics (the C++ front's counts merged in), scraped over HTTP: {(sample name,
    frozenset of its labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def wait_until(condition, what: str = "condition", seconds: float = 60.0) -> None:
    """Polls ``condition()`` every 50 ms until it is true; AssertionError naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen, seconds: float = 30.0) -> None:
    """SIGTERM ``proc`` (a server a test started), SIGKILL if it has not exited within ``seconds``."""
    proc.terminate()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
