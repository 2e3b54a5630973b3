"""KServe v2 over HTTP/REST (``recship serve --http-port N``): JSON tensors, aiohttp on the server's event loop.

    GET  /v2/health/live                          200 {"live": true}
    GET  /v2/health/ready                         200 {"ready": true}, 503 when not ready
    GET  /v2                                      server metadata
    GET  /v2/models/M[/versions/V]                model metadata (the same inputs as gRPC KServe)
    GET  /v2/models/M[/versions/V]/ready          200 / 503
    POST /v2/models/M[/versions/V]/infer          {"inputs": [{"name", "shape", "datatype", "data"}], ...}
    POST /v2/repository/index                     every version, READY or UNAVAILABLE with its reason

Requests go through the same request path (``serving/inference.py``: validation, batcher,
metrics) as gRPC. Errors are ``{"error": message}`` with the HTTP status of the core's
error kind (``HTTP_STATUS``): 400 (invalid), 404 (unknown model), 408 (body too slow),
413 (body over --max-message-mb), 503 (queue full, overloaded, unavailable), 504
(deadline) or 500; routes that do not exist get 404 or 405 before reaching the core.
JSON only: Triton's binary-data extension is not supported.

Why aiohttp: on this project's 2-core machine a minimal JSON handler answered 8,100
POSTs/s on aiohttp, 3,600 on uvicorn + starlette and 510 on the standard library's
ThreadingHTTPServer (``bench/http_front_bench.py``, wrk, 32 connections); it runs on the
asyncio loop the gRPC server already has, with HTTP parsing in C (llhttp), body limits,
chunked bodies and keep-alive timeouts, and no thread per connection.
"""

import asyncio
import json
import logging
import re
import ssl
from typing import Any, List, Optional, Tuple

import numpy as np
from aiohttp import web
from aiohttp import web_response as aiohttp_response

from recship.serving import kserve
from recship.serving.inference import ClientTimeout, ErrorKind, Inference, Outcome, error_of
from recship.serving.requests import InvalidRequest, RequestTooLarge, shown

log = logging.getLogger("recship.serving")

HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.DEADLINE: 504,
    ErrorKind.CLIENT_TIMEOUT: 408,
    ErrorKind.CANCELLED: 500,  # never sent: the client is gone
    ErrorKind.INTERNAL: 500,
}
_MODEL = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer)?$")
_TIMEOUT_S = 30.0  # an HTTP request has no gRPC deadline: this bounds the wait for its batch
_SHUTDOWN_GRACE_S = 5.0
_MAX_DIMS = 8
_INT_RANGE = {"INT32": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1)}


class RouteError(Exception):
    """No such route or method (404, 405): answered before the request reaches the inference path."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientErrors(logging.LoggerAdapter):
    """aiohttp's protocol logger: a malformed request is the client's error, one warning line, no trace."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        text = str(getattr(error, "message", error) or "").strip()
        self.warning("%s: %s", msg % args if args else msg, text.splitlines()[0][:200] if text else type(error).__name__, **kwargs)


class RestFront:
    """The HTTP listener: aiohttp on the server's event loop, answering from its inference path."""

    def __init__(self, inference: Inference) -> None:
        self.inference = inference
        self.repo = inference.repo
        config = self.repo.config
        self.max_body = config.max_message_bytes
        self.idle_timeout = config.http_idle_timeout_s
        self.app = web.Application(client_max_size=self.max_body)
        self.app.router.add_route("*", "/{path:.*}", self._handle)
        self.app.on_response_prepare.append(_server_header)
        # aiohttp's own answers to malformed HTTP (before any handler) name its software in
        # Server: this process serves no other aiohttp site, so the default is set here
        aiohttp_response.SERVER_SOFTWARE = "recship"
        self.runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None

    async def start(self, host: str, port: int, ssl_context: Optional[ssl.SSLContext]) -> None:
        # keepalive_timeout closes idle connections, including ones that never send a request
        self.runner = web.AppRunner(self.app, handle_signals=False, access_log=None, keepalive_timeout=self.idle_timeout,
                                    shutdown_timeout=_SHUTDOWN_GRACE_S, logger=_ClientErrors(logging.getLogger("recship.serving.http"), {}))
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context, backlog=1024)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        """Stops listening; requests in flight get up to 5 s to finish."""
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            method, route, name, version = _route(request.method, request.path)
            if route == "infer":
                status, doc = await self.inference.call(method, lambda o: self._http_infer(request, name, version, o))
            else:
                status, doc = await self.inference.call(method, lambda o: self._get(route, name, version, o))
        except RouteError as e:
            status, doc = e.status, {"error": str(e)}
        except Exception as e:
            kind, message = error_of(e)
            status, doc = HTTP_STATUS[kind], {"error": message}
        return web.Response(status=status, body=json.dumps(doc).encode(), content_type="application/json")

    # -- the routes, each returning (HTTP status, JSON body) -----------------

    async def _get(self, route: str, name: str, version: str, outcome: Outcome) -> Tuple[int, Any]:
        if route == "live":
            return 200, {"live": True}
        if route == "ready":
            ready = self.inference.server_ready()
            return (200 if ready else 503), {"ready": ready}
        if route == "server_metadata":
            return 200, kserve.server_metadata()
        if route == "repository_index":
            return 200, kserve.repository_index(self.repo)
        served = self.inference.route(name, kserve.parse_version(version), outcome)
        if route == "model_ready":
            ready = self.inference.model_ready(served)
            return (200 if ready else 503), {"name": served.name, "ready": ready}
        return 200, kserve.model_metadata(served)

    async def _http_infer(self, request: web.Request, name: str, version: str, outcome: Outcome) -> Tuple[int, dict]:
        declared = request.content_length
        if declared is not None and declared > self.max_body:
            raise RequestTooLarge(f"request body of {declared} bytes exceeds the limit of {self.max_body} bytes (--max-message-mb)")
        with self.inference.admit(declared or 0):
            body = await self._read_body(request)
            with self.inference.admit(0 if declared is not None else len(body)):
                infer_request = _infer_request(name, version, body)
                served, outputs = await kserve.model_infer(self.inference, infer_request, _TIMEOUT_S, outcome)
        return 200, {
            "model_name": served.name,
            "model_version": str(served.version),
            "id": infer_request.id,
            "outputs": [
                {"name": k, "datatype": "FP32", "shape": list(t.shape), "data": t.float().reshape(-1).tolist()}
                for k, t in outputs.items()
            ],
        }

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await asyncio.wait_for(request.read(), timeout=self.idle_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise RequestTooLarge(f"request body exceeds the limit of {self.max_body} bytes (--max-message-mb)") from None
        except asyncio.TimeoutError:
            raise ClientTimeout(f"the request body did not arrive within {self.idle_timeout:g} s") from None


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "recship"  # not aiohttp's "Python/3.x aiohttp/3.x"


def _route(method: str, path: str) -> Tuple[str, str, str, str]:
    """(metric method name, route, model, version) of a request, or RouteError (404 / 405)."""
    fixed = {("GET", "/v2/health/live"): "live", ("GET", "/v2/health/ready"): "ready", ("GET", "/v2"): "server_metadata",
             ("POST", "/v2/repository/index"): "repository_index"}
    match = _MODEL.match(path)
    if (method, path) in fixed:
        route, name, version = fixed[(method, path)], "", ""
    elif match is not None:
        name, version, tail = match.group(1), match.group(2) or "", match.group(3)
        route = {None: "model_metadata", "/ready": "model_ready", "/infer": "infer"}[tail]
        if method != ("POST" if route == "infer" else "GET"):
            raise RouteError(405, f"{shown(method, 16)} is not allowed on {shown(path)}")
    elif method not in ("GET", "POST"):
        raise RouteError(405, f"method {shown(method, 16)} is not allowed; use GET or POST")
    else:
        raise RouteError(404, f"no route for {method} {shown(path)}")
    return f"http.{route}", route, name, version


def _reject_constant(name: str) -> None:
    raise InvalidRequest(f"the body is not strict JSON: {name} is not a number JSON allows")


def _infer_request(name: str, version: str, body: bytes):
    """The JSON body -> a KServe ModelInferRequest (typed contents), so gRPC's reader checks the rest.

    Strict: integer tensors take JSON integers only (no 1.7, no true), FP32 takes numbers
    (no booleans), shapes are lists of non-negative integers, nothing out of its type's range.
    """
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, nesting past Python's limit
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(f"the body is not JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidRequest('the body must be a JSON object with an "inputs" list')
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest('"id" must be a string')
    request = kserve.message("ModelInferRequest")(model_name=name, model_version=version, id=request_id)
    for i, tensor in enumerate(doc["inputs"]):
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype", "data"} <= set(tensor):
            raise InvalidRequest(f"inputs[{i}] must be an object with name, shape, datatype and data")
        input_name, datatype = tensor["name"], tensor["datatype"]
        if not isinstance(input_name, str):
            raise InvalidRequest(f"inputs[{i}].name must be a string")
        if datatype not in kserve.DTYPES:
            raise InvalidRequest(f"input {shown(input_name)}: datatype {shown(datatype, 16)} is not one recship takes ({', '.join(kserve.DTYPES)})")
        shape = _shape(input_name, tensor["shape"])
        data = _data(input_name, datatype, tensor["data"])
        inp = request.inputs.add(name=input_name, datatype=datatype, shape=shape)
        getattr(inp.contents, kserve.DTYPES[datatype][1]).extend(data.tolist())
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        raise InvalidRequest('"outputs" must be a list of objects with a string "name"')
    for out in outputs:
        request.outputs.add(name=out["name"])
    return request


def _shape(name: str, shape: Any) -> List[int]:
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        raise InvalidRequest(f"input {shown(name)}: shape must be a list of at most {_MAX_DIMS} non-negative integers, got {shown(shape)}")
    return shape


def _data(name: str, datatype: str, data: Any) -> np.ndarray:
    """The tensor's data, flattened (KServe allows nested or flat lists), every element of the right JSON type."""
    flat = data
    while flat and isinstance(flat, list) and isinstance(flat[0], list):  # row-major nesting: flatten level by level
        if not all(isinstance(row, list) for row in flat):
            raise InvalidRequest(f"input {shown(name)}: data mixes lists and numbers")
        flat = [x for row in flat for x in row]
    if not isinstance(flat, list):
        raise InvalidRequest(f"input {shown(name)}: data must be a list")
    kinds = set(map(type, flat))
    allowed = {int} if datatype in _INT_RANGE else {int, float}
    if not kinds <= allowed:
        wrong = sorted(k.__name__ for k in kinds - allowed)
        raise InvalidRequest(f"input {shown(name)}: {datatype} data must be {' or '.join(sorted(a.__name__ for a in allowed))}s, found {', '.join(wrong)}")
    if datatype in _INT_RANGE:
        lo, hi = _INT_RANGE[datatype]
        if flat and (min(flat) < lo or max(flat) > hi):
            raise InvalidRequest(f"input {shown(name)}: a value is outside {datatype}'s range")
    return np.asarray(flat, dtype=kserve.DTYPES[datatype][0])
