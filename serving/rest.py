"""KServe v2 over HTTP/REST (``recship serve --http-port N``): JSON tensors, Python's own HTTP server.

    GET  /v2/health/live                          200 {"live": true}
    GET  /v2/health/ready                         200 {"ready": true}, 503 when not ready
    GET  /v2                                      server metadata
    GET  /v2/models/M[/versions/V]                model metadata (the same inputs as gRPC KServe)
    GET  /v2/models/M[/versions/V]/ready          200 / 503
    POST /v2/models/M[/versions/V]/infer          {"inputs": [{"name", "shape", "datatype", "data"}], ...}

Requests go through the same validation, batcher and metrics as gRPC. Errors are
``{"error": message}`` with 400 (invalid), 404 (unknown model), 503 (queue full),
504 (deadline) or 500. JSON only: Triton's binary-data extension is not supported.
No dependency: ``http.server.ThreadingHTTPServer`` from the standard library.
"""

import asyncio
import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Tuple

import grpc
import numpy as np

from recship.serving import kserve
from recship.serving.requests import InvalidRequest

log = logging.getLogger("recship.serving")

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_MODEL = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer)?$")
_TIMEOUT_S = 30.0  # an HTTP request has no gRPC deadline: this bounds the wait for its batch


class RestFront:
    """An HTTP server on its own threads, answering from a running recship ``Server``."""

    def __init__(self, server, host: str, port: int) -> None:
        self.server = server
        front = self

        class Handler(_Handler):
            owner = front

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="rest-front", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()

    # -- the routes, each returning (HTTP status, JSON body) -----------------

    def get(self, path: str) -> Tuple[int, dict]:
        s = self.server
        if path == "/v2/health/live":
            return 200, {"live": True}
        if path == "/v2/health/ready":
            ready = s.accepting and bool(s.repo.models())
            return (200 if ready else 503), {"ready": ready}
        if path == "/v2":
            return 200, kserve.server_metadata()
        match = _MODEL.match(path)
        if match is None or match.group(3) == "/infer":
            return 404, {"error": f"no route for GET {path}"}
        name, version, tail = match.groups()
        served = s.repo.get(name, kserve.parse_version(version or ""))
        if tail == "/ready":
            return (200 if s.accepting else 503), {"name": name, "ready": s.accepting}
        return 200, kserve.model_metadata(served)

    def infer(self, path: str, body: bytes) -> Tuple[int, dict]:
        from recship.serving.server import Outcome, status_of

        match = _MODEL.match(path)
        if match is None or match.group(3) != "/infer":
            return 404, {"error": f"no route for POST {path}"}
        name, version, _ = match.groups()
        s = self.server
        outcome, started, error = Outcome(name), time.monotonic(), None
        try:
            request = _infer_request(name, version or "", body)
            work = kserve.infer(s.inference, request, _TIMEOUT_S, outcome)
            served, outputs = asyncio.run_coroutine_threadsafe(work, s._loop).result()
            return 200, {
                "model_name": served.name,
                "model_version": str(served.version),
                "id": request.id,
                "outputs": [
                    {"name": k, "datatype": "FP32", "shape": list(t.shape), "data": t.float().reshape(-1).tolist()}
                    for k, t in outputs.items()
                ],
            }
        except Exception as e:
            error = e
        finally:
            s.inference.record(outcome, error, started)
        code, message = status_of(error)
        return _HTTP.get(code, 500), {"error": message}


def _infer_request(name: str, version: str, body: bytes):
    """The JSON body -> a KServe ModelInferRequest (typed contents), so gRPC's reader checks it."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the body is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidRequest('the body must be a JSON object with an "inputs" list')
    request = kserve.message("ModelInferRequest")(model_name=name, model_version=version, id=str(doc.get("id", "")))
    for i, tensor in enumerate(doc["inputs"]):
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype", "data"} <= set(tensor):
            raise InvalidRequest(f"inputs[{i}] must have name, shape, datatype and data")
        datatype = str(tensor["datatype"])
        if datatype not in kserve.DTYPES:
            raise InvalidRequest(f"input {tensor['name']!r}: datatype {datatype} is not one recship takes ({', '.join(kserve.DTYPES)})")
        dtype, field = kserve.DTYPES[datatype]
        try:
            data = np.asarray(tensor["data"], dtype=dtype).reshape(-1)  # KServe allows nested or flat data
            shape = [int(d) for d in tensor["shape"]]
        except (TypeError, ValueError) as e:
            raise InvalidRequest(f"input {tensor['name']!r}: {e}") from None
        inp = request.inputs.add(name=str(tensor["name"]), datatype=datatype, shape=shape)
        getattr(inp.contents, field).extend(data.tolist())
    for out in doc.get("outputs") or []:
        request.outputs.add(name=str(out.get("name", "")) if isinstance(out, dict) else "")
    return request


class _Handler(BaseHTTPRequestHandler):
    owner: RestFront
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(lambda: self.owner.get(self.path))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        self._answer(lambda: self.owner.infer(self.path, body))

    def _answer(self, route) -> None:
        from recship.serving.server import ModelNotFound, status_of

        try:
            status, doc = route()
        except (ModelNotFound, InvalidRequest) as e:
            code, message = status_of(e)
            status, doc = _HTTP[code], {"error": message}
        except Exception as e:  # our bug: 500, logged with its trace
            log.exception("REST %s %s failed", self.command, self.path)
            status, doc = 500, {"error": f"{type(e).__name__}: {e}"}
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # errors are logged once, by Inference.record
        pass
