"""The prediction server: process wiring of the model repository, the request path and its fronts.

    recship serve --model-repo DIR [--host 127.0.0.1] [--port 8500] [--metrics-port PORT] [--http-port PORT]

(the command's flags and its process: ``serving/cli.py``)
One gRPC port answers recship's Predictor (``serving/predictor.py``), KServe v2 (``serving/kserve_grpc.py``, its codec ``serving/kserve.py``),
``grpc.health.v1`` and, unless ``--no-reflection``, server reflection; ``--http-port``
adds KServe v2 over HTTP (``serving/rest.py``, aiohttp on the same event loop) and
``--metrics-port`` Prometheus metrics. ``--tls-cert/--tls-key`` put every listener on TLS,
``--tls-client-ca`` requires client certificates (mTLS).

Every front is handed the request path (``serving/inference.py``), which holds the model
repository (``serving/repository.py``); this module only wires them into a process.

Threads: gRPC and HTTP run on asyncio in one event-loop thread, which reads, validates
and answers every request; each served model version has one batcher thread that runs
the forwards; the repository's watcher thread loads versions.
"""

import asyncio
import dataclasses
import errno
import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from recship.export.aoti import process_folder, remove_abandoned
from recship.oserrors import doing
from recship.serving import kserve_grpc, predictor
from recship.serving.front import CppFront, FrontMirror
from recship.serving.inference import Inference
from recship.serving.metrics import Metrics
from recship.serving.repository import ModelRepository
from recship.serving.rest import RestFront
from recship.serving.settings import ServerConfig


log = logging.getLogger("recship.serving")


class Health(health_aio.HealthServicer):
    """grpc.health.v1 whose Watch streams end when the server stops taking calls (``close``): a Watch (gRPC
    clients' own health checking holds one open on each connection) never ends by itself, so a stop waited out
    its whole grace for it (the C++ front's stop too: it forwards the stream to this server)."""

    def __init__(self) -> None:
        super().__init__()
        self._closed = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait({watch, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            closed.cancel()
        if watch.done() and not watch.cancelled():
            return watch.result()  # (raises what the stream raised, e.g. its client is gone)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

    def close(self) -> None:
        """Ends every Watch stream, open or to come, with UNAVAILABLE "the server is stopping"."""
        self._closed.set()


class Server:
    """A running server (its asyncio loop on a thread of its own); ``stop()`` drains in-flight requests."""

    def __init__(self, config: ServerConfig) -> None:
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        self.config = config
        self.rest = None
        self.front: Optional[CppFront] = None  # the C++ front (config.front == "cpp")
        self._backend_dir: Optional[str] = None
        self._backend = ""  # the address this process listens on behind the front
        self._stopping = threading.Event()
        remove_abandoned()  # what SIGKILLed servers left in the temp folder (extracted model.pt2, the front's files)
        self._front_started, self._front_pause = time.monotonic(), 1.0
        self.metrics = Metrics()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="serving-loop", daemon=True)
        self._thread.start()
        try:
            self._call(self._start())
            metrics_host = config.metrics_host or config.host
            try:
                self.metrics.serve(config.metrics_port, metrics_host, config.tls_cert, config.tls_key, config.tls_client_ca)
            except OSError as e:
                assert config.metrics_port is not None  # serve() listens on nothing without a port
                raise _cannot_listen(metrics_host, config.metrics_port, e) from None
        except BaseException:  # e.g. a port is taken: leave nothing running behind
            self._shutdown()
            self._loop.close()  # (else the failed server's loop is a ResourceWarning line after the one-line error)
            raise
        log.info("listening on %s:%d with models %s", config.host, self.port, [m.name for m in self.repo.models()])

    def _call(self, coroutine):
        """Runs a coroutine on the server's loop from any other thread and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start(self) -> None:
        config = self.config
        self.health = Health()
        loop = self._loop

        def on_change(name: str, ready: bool) -> None:  # called from the watcher and batcher threads too
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            asyncio.run_coroutine_threadsafe(self.health.set(name, status), loop)

        # a taken port fails the start before any model loads (the C++ front checks its own port)
        listeners = [(config.host, config.http_port), (config.metrics_host or config.host, config.metrics_port)]
        for host, port in listeners + ([(config.host, config.port)] if config.front == "python" else []):
            if port and _bind_error(host, port):
                raise _cannot_listen(host, port)
        with doing("reading the model repository", config.model_repo):  # an unreadable folder: recship.cli says it
            self.repo = ModelRepository(config, self.metrics, on_change)
            # loading runs the self-checks: off the loop, so it never stalls a request
            if config.model_control == "explicit":
                await loop.run_in_executor(None, self.repo.start_explicit, config.load_models)
            else:
                await loop.run_in_executor(None, self.repo.scan)
        # the transport admits twice the limit so that an oversized request gets our
        # INVALID_ARGUMENT naming the size rather than gRPC's generic RESOURCE_EXHAUSTED;
        # no SO_REUSEPORT (gRPC's default): a second server on the port must fail, not take half its connections
        options = [
            ("grpc.max_receive_message_length", 2 * config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc = grpc.aio.server(options=options)
        self.inference = Inference(self.repo, self.metrics, config.max_inflight_bytes)
        self.metrics.inflight_bytes = lambda: self.inference.inflight_bytes
        predictor.add_to_server(predictor.PredictorServicer(self.inference), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        kserve_grpc.add_to_server(kserve_grpc.KServeServicer(self.inference), self.grpc)
        if config.reflection:  # (KServe is not listed: its messages live in a private pool)
            names = [predictor.SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
            reflection.enable_server_reflection(names + [reflection.SERVICE_NAME], self.grpc)
        address = f"{config.host}:{config.port}"
        if config.front == "cpp":  # the front takes the public port; this server listens behind it, privately

            self._backend_dir = tempfile.mkdtemp(prefix="sock-", dir=process_folder())
            address = f"unix:{self._backend_dir}/backend.sock"
            self.grpc.add_insecure_port(address)
            await self.grpc.start()

            self._backend = address
            front = await loop.run_in_executor(None, functools.partial(CppFront, config, address, on_exit=self._front_exited))
            self.front, self.port, self.metrics.extra, self.metrics.extra_stats = front, front.port, front.samples, front.model_stats
            await loop.run_in_executor(None, self.repo.attach_front, FrontMirror(front, config.model_format))
        elif config.tls_cert is not None:
            assert config.tls_key is not None  # ServerConfig checks that cert and key come together
            ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                root_certificates=ca, require_client_auth=ca is not None,
            )
            self.port = _add_port(lambda: self.grpc.add_secure_port(address, credentials), config.host, config.port)
        else:
            self.port = _add_port(lambda: self.grpc.add_insecure_port(address), config.host, config.port)
        if self.front is None:
            await self.grpc.start()
        if config.http_port is not None:

            self.rest = RestFront(self.inference)
            try:
                await self.rest.start(config.host, config.http_port, config.ssl_context())
            except OSError as e:
                raise _cannot_listen(config.host, config.http_port, e) from None
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.repo.start_watching()

    def _front_exited(self, code: int) -> None:
        """The C++ front died (a crash: it never exits unasked): start a new one on the same port, after a pause
        that grows while it keeps dying young (1 s, 2 s, ... 30 s), so a front that cannot run does not spin."""
        assert self.front is not None  # only a started front calls this
        self._front_binary = self.front.binary
        now = time.monotonic()
        self._front_pause = min(30.0, 2 * self._front_pause) if now - self._front_started < 10 else 1.0
        log.critical("the C++ front exited unexpectedly (code %d); restarting it on port %d in %.0f s", code, self.port,
                     self._front_pause)

        def restart() -> None:
            if self._stopping.wait(self._front_pause):
                return
            try:
                self._front_started = time.monotonic()
                front = CppFront(dataclasses.replace(self.config, port=self.port), self._backend, binary=self._front_binary,
                                 on_exit=self._front_exited)
            except Exception as e:
                log.critical("restarting the C++ front failed: %s; retrying", e)
                self._front_exited(-1)
                return
            if self._stopping.is_set():  # stop() began meanwhile
                front.stop(0)
                return
            self.front = front
            self.metrics.extra, self.metrics.extra_stats = front.samples, front.model_stats
            self.repo.attach_front(FrontMirror(front, self.config.model_format))
            log.warning("the C++ front is back on port %d", self.port)

        threading.Thread(target=restart, name="front-restart", daemon=True).start()

    def stop(self, grace: float = 5.0, drain_delay: float = 0.0) -> None:
        """Readiness answers 503 (gRPC health NOT_SERVING) at once; the listeners keep serving for ``drain_delay``
        seconds (SIGTERM: --drain-delay, while load balancers take the server out), then stop taking requests and
        let those in flight and queued finish (up to ``grace`` seconds); then unloads."""
        self._stopping.set()

        async def stop():
            self.inference.accepting = False
            await self.health.enter_graceful_shutdown()
            if drain_delay > 0:
                log.info("draining: not ready; listeners close in %g s", drain_delay)
                await asyncio.sleep(drain_delay)
            self.health.close()  # (a Watch is no call in flight: the grace below is not for it)
            self.repo.close_windows()  # the calls in flight wait for no company that will not come
            if self.front is not None:  # it drains its own calls, and the ones it forwards here, first
                await self._loop.run_in_executor(None, self.front.stop, grace)
            fronts = [self.grpc.stop(grace)] + ([self.rest.stop()] if self.rest is not None else [])
            await asyncio.gather(*fronts)

        self._call(stop())
        self._shutdown()

    def _shutdown(self) -> None:
        self._stopping.set()
        if self.front is not None:
            self.front.stop(0)  # (already stopped after stop(): this returns at once)
            self.metrics.extra = self.metrics.extra_stats = None
        if hasattr(self, "inference"):
            self.inference.failures.flush()  # how many failed requests' lines were left out since the last one
        if hasattr(self, "repo"):
            self.repo.stop()
        if self._backend_dir is not None:
            shutil.rmtree(self._backend_dir, ignore_errors=True)
        self.metrics.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _bind_error(host: str, port: int) -> str:
    """Why a TCP listener cannot bind ``host:port``: the error of binding a plain socket to each address it resolves
    to (with SO_REUSEADDR, as gRPC and asyncio bind; never SO_REUSEPORT), e.g. "address already in use"; "" when
    every address binds. (gRPC's own error says only "Failed to bind".) The C++ front words it the same."""
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return ""  # an unknown host: the listener's own error says it
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    why = os.strerror(e.errno) if e.errno else str(e)
                    return why[:1].lower() + why[1:]
    return ""


def _cannot_listen(host: str, port: int, error: Optional[OSError] = None) -> OSError:
    """The one-line error of a listener that cannot start: "cannot listen on HOST:PORT: address already in use"."""
    why = _bind_error(host, port) if port else ""
    if not why and error is not None:
        why = os.strerror(error.errno) if error.errno else str(error)
        why = why[:1].lower() + why[1:]
    return OSError(f"cannot listen on {host}:{port}" + (f": {why}" if why else ""))


def _add_port(add: Callable[[], int], host: str, port: int) -> int:
    """The port gRPC listens on after ``add()`` (add_insecure_port or add_secure_port), or _cannot_listen's error."""
    try:
        bound = add()
    except RuntimeError:  # grpcio: "Failed to bind to address ..."; older releases return 0
        bound = 0
    if bound == 0:
        raise _cannot_listen(host, port)
    return bound
