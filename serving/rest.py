"""KServe v2 over HTTP/REST (``recship serve --http-port N``): JSON tensors (or binary, Triton's extension), aiohttp on the server's event loop.

    GET  /v2/health/live                          200 {"live": true}
    GET  /v2/health/ready                         200 {"ready": true}, 503 when not ready
    GET  /v2                                      server metadata
    GET  /v2/models/M[/versions/V]                model metadata (the same inputs as gRPC KServe)
    GET  /v2/models/M[/versions/V]/ready          200 / 503
    POST /v2/models/M[/versions/V]/infer          {"inputs": [{"name", "shape", "datatype", "data"}], ...}
    POST /v2/repository/index                     every version, READY or UNAVAILABLE with its reason ({"ready": true}: READY only)
    POST /v2/repository/models/M/load             explicit model control: (re)load M; unload likewise
    GET  /v2/models/M[/versions/V]/config         Triton's model configuration (kserve.model_config)
    GET  /v2/models[/M[/versions/V]]/stats        Triton's statistics (kserve.model_statistics)

Requests go through the same request path (``serving/inference.py``: validation, batcher,
metrics) as gRPC. Errors are ``{"error": message}`` with the HTTP status of the core's
error kind (``HTTP_STATUS``): 400 (invalid), 404 (unknown model), 408 (body too slow),
413 (body over --max-message-mb), 429 (queue full, over the in-flight budget), 503 (unavailable),
504 (deadline) or 500; routes that do not exist get 404 or 405 before reaching the core.

Triton's binary tensor data extension (what ``tritonclient.http`` sends by default): with
the header ``Inference-Header-Content-Length: N`` the first N bytes of the body are the
JSON request and the rest is the inputs' raw data, each input with
``"parameters": {"binary_data_size": K}`` taking the next K bytes (little-endian,
row-major) in place of "data". An output asked for with ``"parameters": {"binary_data":
true}`` (or every output, with the request's ``"parameters": {"binary_data_output": true}``)
comes back as ``"parameters": {"binary_data_size": K}`` and K raw bytes after the JSON,
whose length the answer's ``Inference-Header-Content-Length`` gives (Content-Type
application/octet-stream). The framing is read strictly: a length that is not a number
or exceeds the body, sizes that do not add up to the bytes after the JSON, a size that
is not a whole number of values or does not fill the shape, or both data and a size,
are 400.

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
import sys
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
from aiohttp import web
from aiohttp import web_response as aiohttp_response
from aiohttp.http_exceptions import HttpProcessingError

from recship.serving import footprint, kserve
from recship.serving.inference import ClientTimeout, ErrorKind, Inference, Outcome, error_of, too_large
from recship.serving.requests import InvalidRequest, shown
from recship.serving.json_tensors import Body, Numbers
from recship.serving.values import number_error

log = logging.getLogger("recship.serving")

HTTP_STATUS = {kind: kind.http_status for kind in ErrorKind}  # the serving rules' (CANCELLED's 500 is never sent: the client is gone)
_MODEL = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/infer|/config|/stats)?$")
_CONTROL = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")
_TIMEOUT_S = 30.0  # an HTTP request has no gRPC deadline: this bounds the wait for its batch
_SHUTDOWN_GRACE_S = 5.0
_MAX_DIMS = 8
HEADER_LENGTH = "Inference-Header-Content-Length"  # Triton's binary tensor data extension
EXTENSIONS = ["binary_tensor_data"]  # the REST front's own, added to what kserve.server_metadata() lists


class BinaryAnswer(NamedTuple):
    """An answer with binary outputs: the JSON document, then each binary output's bytes in order."""

    doc: dict
    tensors: List[bytes]


class RouteError(Exception):
    """No such route or method (404, 405): answered before the request reaches the inference path."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientErrors(logging.LoggerAdapter):
    """aiohttp's protocol logger, whose errors are requests no handler saw: malformed HTTP is the client's error,
    recorded as an invalid request of method ``http.malformed`` (counted, its line sampled, no trace); anything
    else aiohttp reports is ours, recorded as an internal error of method ``http.error`` (with its trace)."""

    def __init__(self, logger: logging.Logger, inference: Inference) -> None:
        super().__init__(logger, {})
        self.inference = inference

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        what = msg % args if args else msg
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, HttpProcessingError):
            text = str(error.message or "").strip()
            why = text.splitlines()[0][:200] if text else type(error).__name__
            self.inference.record(Outcome("http.malformed"), InvalidRequest(f"{what}: {why}"), time.monotonic())
        else:
            self.inference.record(Outcome("http.error"), error or RuntimeError(what), time.monotonic())


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
                                    shutdown_timeout=_SHUTDOWN_GRACE_S, logger=_ClientErrors(logging.getLogger("recship.serving.http"), self.inference))
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
            elif method == "http.repository_index" or route in ("load", "unload"):
                status, doc = await self.inference.call(method, lambda o: self._repository(request, route, name))
            else:
                status, doc = await self.inference.call(method, lambda o: self._get(route, name, version, o))
        except RouteError as e:
            status, doc = e.status, {"error": str(e)}
        except Exception as e:
            kind, message = error_of(e)
            status, doc = HTTP_STATUS[kind], {"error": message}
        if isinstance(doc, BinaryAnswer):
            head = json.dumps(doc.doc).encode()
            return web.Response(status=status, body=b"".join([head, *doc.tensors]), content_type="application/octet-stream",
                                headers={HEADER_LENGTH: str(len(head))})
        return web.Response(status=status, body=json.dumps(doc).encode(), content_type="application/json")

    # -- the routes, each returning (HTTP status, JSON body) -----------------

    async def _get(self, route: str, name: str, version: str, outcome: Outcome) -> Tuple[int, Any]:
        if route == "live":
            return 200, {"live": True}
        if route == "ready":
            ready = self.inference.server_ready()
            return (200 if ready else 503), {"ready": ready}
        if route == "server_metadata":
            meta = kserve.server_metadata()
            return 200, {**meta, "extensions": meta["extensions"] + EXTENSIONS}
        if route == "stats":
            return 200, kserve.model_statistics(self.repo, self.inference.metrics, name, version)
        served = self.inference.route(name, kserve.parse_version(version), outcome)
        if route == "config":
            return 200, kserve.model_config(served)
        if route == "model_ready":
            ready = self.inference.model_ready(served)
            return (200 if ready else 503), {"name": served.name, "ready": ready}
        return 200, kserve.model_metadata(served, [s.version for s in self.repo.versions(served.name)])

    async def _repository(self, request: web.Request, route: str, name: str) -> Tuple[int, Any]:
        """The repository extension: the index, and explicit load / unload of model ``name``; the body is optional JSON
        ({"ready": bool} for the index, {"parameters": {...}} for load and unload)."""
        body = await self._read_body(request)
        doc: Any = {}
        if body.strip():
            try:
                doc = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise InvalidRequest(f"the body is not JSON: {e}") from None
            if not isinstance(doc, dict):
                raise InvalidRequest(f"the body must be a JSON object, got {type(doc).__name__}")
        if route == "repository_index":
            ready = doc.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidRequest(f"ready must be true or false, got {shown(ready)}")
            return 200, kserve.repository_index(self.repo, ready)
        kserve.control_parameters(_parameters(doc, "the request"), route)
        action = self.repo.load if route == "load" else self.repo.unload
        await asyncio.get_running_loop().run_in_executor(None, action, name)
        return 200, {}

    async def _http_infer(self, request: web.Request, name: str, version: str, outcome: Outcome) -> Tuple[int, Any]:
        declared = request.content_length  # admitted (or refused as too large) before its body is read
        with self.inference.admit(declared or 0):
            body = await self._read_body(request)
            with self.inference.admit(0 if declared is not None else len(body)):
                header, binary = split_body(request.headers.getall(HEADER_LENGTH, []), body)
                parsed = Body(header, _reject_constant)
                # what decoding will hold, past the body: admitted (or refused) before anything is decoded
                with self.inference.admit(0, footprint.rest_json(parsed, len(binary or b""))):
                    infer_request, binary_outputs = _infer_request(name, version, parsed, binary)
                    del parsed  # (its text and arrays: the request's arrays are all that is needed now)
                    served, outputs = await kserve.model_infer(self.inference, infer_request, _TIMEOUT_S, outcome)
        answer: List[dict] = []
        tensors: List[bytes] = []
        for k, t in outputs.items():
            out: Dict[str, Any] = {"name": k, "datatype": "FP32", "shape": list(t.shape)}
            if binary_outputs.get(k, binary_outputs[None]):
                raw = t.float().contiguous().numpy().astype("<f4", copy=False).tobytes()
                out["parameters"] = {"binary_data_size": len(raw)}
                tensors.append(raw)
            else:
                out["data"] = t.float().reshape(-1).tolist()
            answer.append(out)
        doc = {"model_name": served.name, "model_version": str(served.version), "id": infer_request.id, "outputs": answer}
        return 200, (BinaryAnswer(doc, tensors) if tensors else doc)

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await asyncio.wait_for(_read(request), timeout=self.idle_timeout)
        except web.HTTPRequestEntityTooLarge:  # a body without Content-Length, past the limit as it arrived
            raise too_large(None, self.max_body) from None
        except asyncio.TimeoutError:
            raise ClientTimeout(f"the request body did not arrive within {self.idle_timeout:g} s") from None


async def _read(request: web.Request) -> bytes:
    """The request's body. With a Content-Length (admitted before this), read into one buffer of that size:
    request.read() gathers the chunks and then joins them, twice the body at its peak."""
    n = request.content_length
    if n is None:
        return await request.read()  # (chunked: aiohttp stops it at client_max_size)
    body = bytearray(n)
    view, at = memoryview(body), 0
    while at < n:
        chunk = await request.content.read(min(n - at, 1 << 20))
        if not chunk:
            raise ConnectionResetError(f"the client closed its connection after {at} of its body's {n} bytes")
        view[at:at + len(chunk)] = chunk
        at += len(chunk)
    return body  # type: ignore[return-value]  # (a bytearray: read as bytes everywhere)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "recship"  # not aiohttp's "Python/3.x aiohttp/3.x"


def _route(method: str, path: str) -> Tuple[str, str, str, str]:
    """(metric method name, route, model, version) of a request, or RouteError (404 / 405)."""
    fixed = {"/v2/health/live": ("GET", "live"), "/v2/health/ready": ("GET", "ready"), "/v2": ("GET", "server_metadata"),
             "/v2/repository/index": ("POST", "repository_index"), "/v2/models/stats": ("GET", "stats")}
    match = _MODEL.match(path)
    control = _CONTROL.match(path)
    if path in fixed:
        allowed, route = fixed[path]
        name, version = "", ""
        if method != allowed:
            raise RouteError(405, f"{shown(method, 16)} is not allowed on {shown(path)}")
    elif control is not None:
        route, name, version = control.group(2), control.group(1), ""
        if method != "POST":
            raise RouteError(405, f"{shown(method, 16)} is not allowed on {shown(path)}")
    elif match is not None:
        name, version, tail = match.group(1), match.group(2) or "", match.group(3)
        route = {None: "model_metadata", "/ready": "model_ready", "/infer": "infer", "/config": "config", "/stats": "stats"}[tail]
        if method != ("POST" if route == "infer" else "GET"):
            raise RouteError(405, f"{shown(method, 16)} is not allowed on {shown(path)}")
    elif method not in ("GET", "POST"):
        raise RouteError(405, f"method {shown(method, 16)} is not allowed; use GET or POST")
    else:
        raise RouteError(404, f"no route for {method} {shown(path)}")
    return f"http.{route}", route, name, version


def _reject_constant(name: str) -> None:
    raise InvalidRequest(f"the body is not strict JSON: {name} is not a number JSON allows")


def split_body(lengths: List[str], body: bytes) -> Tuple[bytes, Optional[memoryview]]:
    """(the JSON request, the binary tensor data after it, None without the header) of a body, given
    the values of its Inference-Header-Content-Length headers."""
    if not lengths:
        return body, None
    if len(lengths) > 1:
        raise InvalidRequest(f"{HEADER_LENGTH} is given {len(lengths)} times")
    text = lengths[0]
    if not re.fullmatch(r"[0-9]+", text):
        raise InvalidRequest(f"{HEADER_LENGTH} must be the JSON request's length in bytes, got {shown(text, 32)}")
    digits = text.lstrip("0") or "0"  # no int() of thousands of digits
    if len(digits) > len(str(len(body))) or int(digits) > len(body):
        raise InvalidRequest(f"{HEADER_LENGTH} is {shown(text, 32)} but the body has only {len(body)} bytes")
    n = int(digits)
    return body[:n], memoryview(body)[n:]  # (the binary data in place: it is read as arrays where it is)


def _json_what(nbytes: int, binary: Optional[memoryview]) -> str:
    return "the body" if binary is None else f"the JSON request (the body's first {nbytes} bytes, {HEADER_LENGTH})"


def _infer_request(name: str, version: str, parsed: Body, binary: Optional[memoryview] = None):
    """The JSON request (and the binary tensor data after it, None without Inference-Header-Content-Length)
    -> (a kserve.InferRequest, {output name: answer it as binary, None: the default}), as gRPC's message decodes
    into (kserve.request_arrays reads either). Number arrays go straight into numpy (json_tensors), binary data
    is read in place.

    Strict: integer tensors take JSON integers only (no 1.7, no true), FP32 takes numbers
    (no booleans), shapes are lists of non-negative integers, nothing out of its type's range;
    binary inputs take exactly the bytes their shape needs, and the bytes after the JSON are
    exactly the inputs' binary data.
    """
    try:
        doc = parsed.loads()
    except (ValueError, RecursionError) as e:  # JSONDecodeError, nesting past Python's limit
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(f"{_json_what(parsed.nbytes, binary)} is not JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise InvalidRequest('the body must be a JSON object with an "inputs" list')
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest('"id" must be a string')
    parameters = _parameters(doc, '"parameters"')
    binary_outputs: Dict[Optional[str], bool] = {None: _flag(parameters, "binary_data_output", "the request")}
    tensors: List[Tuple[str, str, List[int], Any]] = []  # (name, datatype, shape, values or binary size)
    for i, tensor in enumerate(doc["inputs"]):
        if not isinstance(tensor, dict) or not {"name", "shape", "datatype"} <= set(tensor):
            raise InvalidRequest(f"inputs[{i}] must be an object with name, shape, datatype and data (or parameters.binary_data_size)")
        input_name, datatype = tensor["name"], tensor["datatype"]
        if not isinstance(input_name, str):
            raise InvalidRequest(f"inputs[{i}].name must be a string")
        input_parameters = _parameters(tensor, f"input {shown(input_name)}: parameters")
        is_binary = "binary_data_size" in input_parameters
        if "data" not in tensor and not is_binary:
            raise InvalidRequest(f"inputs[{i}] must be an object with name, shape, datatype and data (or parameters.binary_data_size)")
        if "data" in tensor and is_binary:
            raise InvalidRequest(f"input {shown(input_name)}: both data and binary_data_size given")
        kserve.check_datatype(input_name, datatype)
        shape = _shape(input_name, tensor["shape"])
        if is_binary:
            tensors.append((input_name, datatype, shape, _binary_size(input_name, datatype, shape, input_parameters["binary_data_size"], binary)))
        else:
            tensors.append((input_name, datatype, shape, _data(input_name, datatype, tensor["data"])))
        tensor.clear()  # its data as decoded: only the array is kept
    sizes = [t[3] for t in tensors if isinstance(t[3], int)]
    if binary is not None and sum(sizes) != len(binary):
        raise InvalidRequest(f"the inputs' binary_data_size add up to {sum(sizes)} bytes but {len(binary)} bytes follow the JSON request "
                             f"({HEADER_LENGTH} {parsed.nbytes})")
    inputs, offset = [], 0
    for input_name, datatype, shape, values in tensors:
        if isinstance(values, int):  # binary data: read in place
            assert binary is not None
            array, offset = np.frombuffer(binary[offset:offset + values], dtype=kserve.DTYPES[datatype][0]), offset + values
        else:
            array = values
        inputs.append(kserve.Tensor(input_name, datatype, shape, array))
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        raise InvalidRequest('"outputs" must be a list of objects with a string "name"')
    for out in outputs:
        what = f"output {shown(out['name'])}"
        binary_outputs[out["name"]] = _flag(_parameters(out, f"{what}: parameters"), "binary_data", what, binary_outputs[None])
    request = kserve.InferRequest(name, version, request_id, inputs, [o["name"] for o in outputs])
    return request, binary_outputs


def _parameters(node: dict, what: str) -> dict:
    """The "parameters" object of a request, input or output ({} when absent)."""
    parameters = node.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"{what} must be an object, got {shown(_dumps(parameters), 32)}")
    return parameters


def _flag(parameters: dict, key: str, what: str, default: bool = False) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{what}: {key} must be true or false, got {shown(_dumps(value), 32)}")
    return value


def _binary_size(name: str, datatype: str, shape: List[int], size: Any, binary: Optional[memoryview]) -> int:
    """An input's binary_data_size, checked against its datatype and shape (the bytes themselves come later)."""
    if binary is None:
        raise InvalidRequest(f"input {shown(name)}: binary_data_size needs the {HEADER_LENGTH} header")
    if type(size) is not int or size < 0:
        raise InvalidRequest(f"input {shown(name)}: binary_data_size must be a non-negative integer, got {shown(_dumps(size), 32)}")
    itemsize = np.dtype(kserve.DTYPES[datatype][0]).itemsize
    if size % itemsize:
        raise InvalidRequest(f"input {shown(name)}: binary_data_size {size} is not a whole number of {datatype} values ({itemsize} bytes each)")
    count = 1
    for d in shape:
        count *= d
    if size // itemsize != count:
        raise InvalidRequest(f"input {shown(name)}: binary_data_size {size} holds {size // itemsize} {datatype} values but shape {shape} needs {count}")
    return size


def _dumps(value: Any) -> str:
    """json.dumps of a value a client sent, for a message (a long number array is json_tensors.Numbers)."""
    return str(value) if isinstance(value, Numbers) else json.dumps(value, default=Numbers.to_list)


def _shape(name: str, shape: Any) -> List[int]:
    if isinstance(shape, Numbers) and len(shape) <= _MAX_DIMS:  # (a short list, long in characters)
        shape = shape.to_list()
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
        raise InvalidRequest(f"input {shown(name)}: shape must be a list of at most {_MAX_DIMS} non-negative integers, got {shown(shape)}")
    return shape


class _Run(NamedTuple):
    """A json_tensors.Numbers among a tensor's values: its numbers, in place."""

    numbers: Numbers


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, Numbers))


def _data(name: str, datatype: str, data: Any) -> np.ndarray:
    """The tensor's data, flattened (KServe allows nested or flat lists), every element of the right JSON type;
    long runs of numbers come decoded (json_tensors.Numbers) and stay arrays, judged by their sample."""
    flat = [_Run(data)] if isinstance(data, Numbers) else data
    while flat and isinstance(flat, list) and _is_list(flat[0]):  # row-major nesting: flatten level by level
        if not all(_is_list(row) for row in flat):
            raise InvalidRequest(f"input {shown(name)}: data mixes lists and numbers")
        flat = [x for row in flat for x in ((_Run(row),) if isinstance(row, Numbers) else row)]
    if not isinstance(flat, list):
        raise InvalidRequest(f"input {shown(name)}: data must be a list")
    runs = any(isinstance(x, _Run) for x in flat)
    sample = [v for x in flat for v in (x.numbers.sample if isinstance(x, _Run) else (x,))] if runs else flat
    error = number_error(name, datatype, sample)  # (the Python client's check too: the same words)
    if error is not None:
        raise InvalidRequest(error)
    dtype = kserve.DTYPES[datatype][0]
    if not runs:
        return np.asarray(flat, dtype=dtype)
    pieces: List[np.ndarray] = []
    scalars: List[Any] = []
    for x in flat:
        if isinstance(x, _Run):
            if scalars:
                pieces.append(np.asarray(scalars, dtype=dtype))
                scalars = []
            values = x.numbers.values
            # as np.asarray of Python numbers: an int to FP32 through a double
            pieces.append(values.astype(np.float64, copy=False).astype(dtype) if datatype == "FP32" else values.astype(dtype, copy=False))
        else:
            scalars.append(x)
    if scalars:
        pieces.append(np.asarray(scalars, dtype=dtype))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
