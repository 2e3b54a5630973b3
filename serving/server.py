"""The gRPC prediction server: model repository with hot reload, dynamic batching, health, metrics.

    recship serve --model-repo DIR [--host 127.0.0.1] [--port 8500] [--metrics-port 9100]

The repository is ``DIR/<model>/<version>/`` artifacts (from ``recship export``). The
newest version of each model is loaded at start; a watcher thread loads newer versions
in the background, runs their sample self-check, and only then routes traffic to them
(requests already queued finish on the old version). A broken version is refused with
a logged reason while the old one keeps serving.

Threads: gRPC runs on asyncio (grpc.aio) in one event-loop thread, which reads,
validates and answers every request; each served model version has one batcher
thread that runs the forwards. Measured on 2 cores, this is 1.6x the requests/s of
the thread-pool server, whose 16 handler threads spent their time fighting over
the GIL.
"""

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import grpc
import torch

from recship.export.artifact import ArtifactError, load_artifact, read_manifest
from recship.serving.batcher import Batcher, DeadlineExpired, QueueFull, Unloaded
from recship.serving.metrics import Metrics
from recship.serving import wire
from recship.serving.requests import InvalidRequest, ModelSpec, RequestArrays, output_shapes, validate
from recship.serving.v1 import predictor_pb2 as pb
from recship.serving.v1 import predictor_pb2_grpc as pb_grpc

log = logging.getLogger("recship.serving")


@dataclass
class ServerConfig:
    model_repo: str
    host: str = "127.0.0.1"
    port: int = 8500
    metrics_port: Optional[int] = None
    max_batch_size: int = 512
    max_delay_ms: float = 2.0
    max_queue: int = 1024
    poll_interval_s: float = 2.0
    torch_threads: Optional[int] = None
    max_message_bytes: int = 64 * 1024 * 1024
    device: str = "cpu"
    http_port: Optional[int] = None  # KServe v2 REST front (serving/rest.py); None: off


class ModelNotFound(LookupError):
    """No such model or version (gRPC NOT_FOUND)."""


def default_torch_threads() -> int:
    """Intra-op threads for the forwards: every core but one (left to the request path), from 3 cores up.

    On 2 cores that split would halve the forward: a 512-example forward of the MLPerf-shaped
    bench model served at p50 46 ms with 1 thread against 35 ms with 2 (bench/serve_bench.py).
    """
    cores = os.cpu_count() or 1
    return cores - 1 if cores > 2 else cores


class _Served:
    def __init__(self, name: str, version: int, path: Path, config: ServerConfig, metrics: Metrics, device_lock: threading.Lock) -> None:
        self.name, self.version, self.path = name, version, path
        built_for = read_manifest(path).get("sharding", {}).get("device", "cpu")
        if built_for != config.device:
            raise ArtifactError(f"{path}: exported for {built_for}, but this server runs on {config.device} (--device)")
        self.model, self.manifest = load_artifact(path, check=True)  # checksum + sample self-check
        self.spec = ModelSpec.from_manifest(self.manifest, config.max_batch_size)
        self.batcher = Batcher(
            self.model, config.max_batch_size, config.max_delay_ms / 1000.0, config.max_queue,
            observe=lambda ex, n, q, c: metrics.observe_batch(name, version, ex, n, q, c), name=f"{name}-{version}",
            device="cuda:0" if config.device == "cuda" else "cpu",  # a CUDA artifact takes its inputs on its first device
            device_lock=device_lock, threads=config.torch_threads or default_torch_threads(),
        )


class ModelRepository:
    """Loads, serves and hot-swaps the versions under ``config.model_repo``."""

    def __init__(self, config: ServerConfig, metrics: Metrics, on_change=None) -> None:
        self.config = config
        self.root = Path(config.model_repo)
        if not self.root.is_dir():
            raise FileNotFoundError(f"model repository not found: {self.root}")
        self._metrics = metrics
        self._lock = threading.Lock()
        self._serving: Dict[str, _Served] = {}
        # refused versions and the state of their files then: retried when the files change
        self._refused: Dict[Tuple[str, int], Tuple] = {}
        self._on_change = on_change
        self._device_lock = threading.Lock()  # one forward at a time on the server's device, across models
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def scan(self) -> None:
        """Loads each model's newest version that is newer than the one serving."""
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            versions = sorted((int(v.name), v) for v in model_dir.iterdir() if v.is_dir() and v.name.isdigit())
            for version, path in reversed(versions):
                current = self._serving.get(model_dir.name)
                if current is not None and current.version >= version:
                    break
                signature = _signature(path)
                if self._refused.get((model_dir.name, version)) == signature:
                    continue  # refused before and unchanged since
                try:
                    served = _Served(model_dir.name, version, path, self.config, self._metrics, self._device_lock)
                except (ArtifactError, OSError, RuntimeError, KeyError, ValueError) as e:
                    self._refused[(model_dir.name, version)] = signature
                    log.error("refusing %s version %d: %s", model_dir.name, version, e)
                    continue
                with self._lock:
                    old = self._serving.get(model_dir.name)
                    self._serving[model_dir.name] = served
                log.info("serving %s version %d from %s", model_dir.name, version, path)
                if self._on_change:
                    self._on_change(model_dir.name, True)
                if old is not None:  # queued requests finish on the old version, then it goes
                    threading.Thread(target=old.batcher.stop, daemon=True).start()
                break

    def start_watching(self) -> None:
        def watch():
            while not self._stop.wait(self.config.poll_interval_s):
                try:
                    self.scan()
                except OSError as e:
                    log.error("scanning %s failed: %s", self.root, e)

        self._watcher = threading.Thread(target=watch, name="model-watcher", daemon=True)
        self._watcher.start()

    def get(self, name: str, version: int = 0) -> _Served:
        with self._lock:
            served = self._serving.get(name)
        if served is None:
            raise ModelNotFound(f"model {name!r} is not loaded; loaded: {sorted(self._serving)}")
        if version and version != served.version:
            raise ModelNotFound(f"model {name!r} version {version} is not served (serving version {served.version})")
        return served

    def models(self) -> List[_Served]:
        with self._lock:
            return list(self._serving.values())

    def stop(self) -> None:
        self._stop.set()
        for served in self.models():
            served.batcher.stop(drain=True)


def _signature(path: Path) -> Tuple:
    """(name, size, mtime) of every file of an artifact: tells a half-copied version from a finished one."""
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()))


def status_of(e: BaseException) -> Tuple[grpc.StatusCode, str]:
    """The one place that maps an exception to a gRPC status: bad input -> INVALID_ARGUMENT, ..., our bugs -> INTERNAL."""
    if isinstance(e, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, (DeadlineExpired, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or "deadline exceeded"
    if isinstance(e, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


@dataclass
class Outcome:
    """What a request is counted and logged under: its model, and the version it was routed to (0 before)."""

    model: str = ""
    version: int = 0


class Inference:
    """What every front (recship's Predictor, KServe v2 over gRPC and HTTP) does with a request:
    route, validate, batch, count."""

    def __init__(self, repo: "ModelRepository", metrics: Metrics) -> None:
        self.repo = repo
        self.metrics = metrics

    async def infer(
        self, request: RequestArrays, remaining: Optional[float], outcome: Outcome, served: Optional["_Served"] = None
    ) -> Tuple["_Served", Dict[str, torch.Tensor]]:
        """(the version that answered, its outputs); raises the exceptions ``status_of`` maps.

        ``served``: the version a front has already looked up for this request, if any.
        """
        started = time.monotonic()
        outcome.model, outcome.version = request.model_name, request.model_version  # until routed
        # A hot swap can retire the version between get() and submit(): then the
        # request goes to the version that replaced it (or NOT_FOUND if it asked for the old one).
        for attempt in range(3):
            if served is None or attempt:
                served = self.repo.get(request.model_name, request.model_version)
            outcome.version = served.version
            parsed = validate(request, served.spec)
            try:
                future = served.batcher.submit(parsed, started + remaining if remaining is not None else None)
                break
            except Unloaded:
                if attempt == 2:
                    raise QueueFull("the model is being replaced; retry") from None
        outputs = await asyncio.wait_for(asyncio.wrap_future(future), timeout=remaining)
        self.metrics.ids.labels(served.name).inc(int(parsed.values.numel()))
        return served, outputs

    async def answer(self, context, work):
        """Runs ``await work(outcome)`` for a gRPC call: its response, or an abort with the mapped status.

        Every call is counted once, under ``outcome``; a failure is logged once; a client
        that goes away is counted as CANCELLED and the cancellation goes on.
        """
        outcome, started, error = Outcome(), time.monotonic(), None
        try:
            return await work(outcome)
        except asyncio.CancelledError as e:
            error = e
            raise
        except Exception as e:
            error = e
        finally:
            self.record(outcome, error, started)
        await context.abort(*status_of(error))

    def record(self, outcome: Outcome, e: Optional[BaseException], started: float) -> None:
        """Counts the request; logs one line for a failure (with the trace for INTERNAL)."""
        model, version = outcome.model, outcome.version
        status = "OK"
        if e is not None:
            code, message = status_of(e)
            status = code.name
            if isinstance(e, InvalidRequest) and "out of range" in message:
                self.metrics.rejected_ids.labels(model).inc()
            log.log(
                logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING, "%s", message,
                exc_info=e if code == grpc.StatusCode.INTERNAL else None,
                extra={"model": model, "version": version, "status": status},
            )
        self.metrics.requests.labels(model, str(version), status).inc()
        self.metrics.latency.labels(model).observe(time.monotonic() - started)


class PredictorServicer(pb_grpc.PredictorServicer):
    def __init__(self, inference: Inference) -> None:
        self.inference = inference
        self.repo = inference.repo

    async def Predict(self, data: bytes, context):
        """Takes the serialized request (see ``add_to_server``): the wire reader turns it into arrays."""

        async def work(outcome: Outcome):
            limit = self.repo.config.max_message_bytes
            if len(data) > limit:
                raise InvalidRequest(f"request of {len(data)} bytes exceeds the limit of {limit} bytes")
            request = _decode(data)
            served, outputs = await self.inference.infer(request, context.time_remaining(), outcome)
            return pb.PredictResponse(
                model_name=served.name,
                model_version=served.version,
                request_id=request.request_id,
                outputs=[pb.Tensor(name=k, shape=list(v.shape), values=v.float().reshape(-1).tolist()) for k, v in outputs.items()],
            )

        return await self.inference.answer(context, work)

    async def GetModelMetadata(self, request, context):
        try:
            served = self.repo.get(request.model_name, request.model_version)
        except ModelNotFound as e:
            await context.abort(*status_of(e))
        m = served.manifest
        return pb.ModelMetadataResponse(
            model_name=served.name,
            model_version=served.version,
            sparse_features=[
                pb.FeatureSpec(name=f["name"], table=f["table"], pooling=f["pooling"], dim=f["dim"], rows=f["rows"],
                               weight_type=f["weight_type"], id_policy=f["id_policy"])
                for f in m["sparse_features"]
            ],
            num_dense=m["num_dense"],
            weighted=m["weighted"],
            outputs=[pb.OutputSpec(name=k, shape=shape) for k, shape in output_shapes(m).items()],
            max_batch_size=served.spec.max_batch_size,
            device=self.repo.config.device,
        )

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(
            models=[pb.ModelStatus(name=s.name, versions=[s.version], serving_version=s.version) for s in self.repo.models()]
        )


def _decode(data: bytes) -> RequestArrays:
    try:
        return wire.read_request(data)
    except wire.Malformed as e:
        raise InvalidRequest(f"the request is not a valid recship.serving.v1.PredictRequest: {e}") from None


def add_to_server(servicer: PredictorServicer, server) -> None:
    """Registers the Predictor service; Predict gets the request's bytes for the wire reader."""
    rpc = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Predict": rpc(servicer.Predict, request_deserializer=None, response_serializer=pb.PredictResponse.SerializeToString),
        "GetModelMetadata": rpc(servicer.GetModelMetadata, request_deserializer=pb.ModelMetadataRequest.FromString,
                                response_serializer=pb.ModelMetadataResponse.SerializeToString),
        "ListModels": rpc(servicer.ListModels, request_deserializer=pb.ListModelsRequest.FromString,
                          response_serializer=pb.ListModelsResponse.SerializeToString),
    }
    service = pb.DESCRIPTOR.services_by_name["Predictor"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class Server:
    """A running server (its asyncio loop on a thread of its own); ``stop()`` drains in-flight requests."""

    def __init__(self, config: ServerConfig) -> None:
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        self.config = config
        self.metrics = Metrics(config.metrics_port)
        self.accepting = True  # False once stop() begins (KServe's ServerReady / ModelReady say so)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:  # e.g. the port is taken: leave nothing running behind
            if hasattr(self, "repo"):
                self.repo.stop()
            self.metrics.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise
        self.rest = None
        if config.http_port is not None:
            from recship.serving.rest import RestFront

            self.rest = RestFront(self, config.host, config.http_port)
        log.info("listening on %s:%d with models %s", config.host, self.port, [m.name for m in self.repo.models()])

    def _call(self, coroutine):
        """Runs a coroutine on the server's loop from any other thread and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_health.v1.health import aio as health_aio
        from grpc_reflection.v1alpha import reflection

        from recship.serving import kserve

        config = self.config
        self.health = health_aio.HealthServicer()
        loop = self._loop

        def on_change(name: str, ready: bool) -> None:  # called from the watcher thread too
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            asyncio.run_coroutine_threadsafe(self.health.set(name, status), loop)

        self.repo = ModelRepository(config, self.metrics, on_change)
        # loading runs the self-checks: off the loop, so it never stalls a request
        await loop.run_in_executor(None, self.repo.scan)
        # the transport admits twice the limit so that an oversized request gets our
        # INVALID_ARGUMENT naming the size rather than gRPC's generic RESOURCE_EXHAUSTED
        options = [
            ("grpc.max_receive_message_length", 2 * config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ]
        self.grpc = grpc.aio.server(options=options)
        self.inference = Inference(self.repo, self.metrics)
        add_to_server(PredictorServicer(self.inference), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        names = [pb.DESCRIPTOR.services_by_name["Predictor"].full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        kserve.add_to_server(kserve.KServeServicer(self), self.grpc)  # (not in reflection: its messages live in a private pool)
        reflection.enable_server_reflection(names + [reflection.SERVICE_NAME], self.grpc)
        self.port = self.grpc.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {config.host}:{config.port}")
        await self.grpc.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.repo.start_watching()

    def stop(self, grace: float = 5.0) -> None:
        """Stops taking requests, lets those in flight finish (up to ``grace`` seconds), then unloads."""

        async def stop():
            self.accepting = False
            await self.health.enter_graceful_shutdown()
            await self.grpc.stop(grace)

        if self.rest is not None:
            self.rest.stop()
        self._call(stop())
        self.repo.stop()
        self.metrics.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repo", required=True, help="directory of <model>/<version>/ artifacts")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--http-port", type=int, help="also answer KServe v2 over HTTP/REST (JSON) on this port")
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="how long a batch waits for more requests (0: no batching)")
    parser.add_argument("--max-queue", type=int, default=1024)
    parser.add_argument("--poll-interval", type=float, default=2.0, help="seconds between repository scans")
    parser.add_argument("--torch-threads", type=int, help="intra-op threads per forward (default: cores - 1 from 3 cores up, else all)")
    parser.add_argument("--max-message-mb", type=float, default=64, help="largest request accepted (default 64 MB)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where models run; artifacts must be exported for it")
    parser.add_argument("--log-format", default="json", choices=["json", "text"], help="json: one JSON object per line")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    server = Server(
        ServerConfig(
            model_repo=args.model_repo, host=args.host, port=args.port, metrics_port=args.metrics_port, http_port=args.http_port,
            max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms, max_queue=args.max_queue,
            poll_interval_s=args.poll_interval, torch_threads=args.torch_threads,
            max_message_bytes=int(args.max_message_mb * 1024 * 1024),
            device=args.device,
        )
    )
    done = threading.Event()

    def shutdown(signum, frame):
        log.info("signal %d: draining and stopping", signum)
        threading.Thread(target=lambda: (server.stop(), done.set()), daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    rest = f", KServe REST on {args.host}:{server.rest.port}" if server.rest else ""
    print(f"recship serve: listening on {args.host}:{server.port}{rest}", flush=True)
    done.wait()
    return 0


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the model/version/status a request log carries."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("model", "version", "status"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["trace"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(fmt: str = "json") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # recship's own lines at INFO; other libraries (fbgemm_gpu logs every .so it loads) at WARNING
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("recship").setLevel(logging.INFO)
