"""The request path every front shares (recship's Predictor, KServe v2 over gRPC and over HTTP).

``Inference.call`` runs one request's work and counts it once; ``Inference.infer`` routes a
request to its model version, validates it, queues it on the version's batcher and waits
for its rows. ``status_of`` is the one mapping from what can go wrong to a gRPC status
(the HTTP front maps those on to HTTP codes).

Bounds that protect the process whatever clients do: request bytes in flight across all
fronts (``max_inflight_bytes``; past it RESOURCE_EXHAUSTED), metric labels only for
served models and versions (everything else is counted under ``-``), and client strings
cut short wherever a message echoes them.
"""

import asyncio
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, Iterator, Optional, Tuple, TypeVar

import grpc
import torch
from google.protobuf.message import DecodeError

from recship.serving.batcher import DeadlineExpired, QueueFull, Unloaded, WorkerDied
from recship.serving.metrics import Metrics
from recship.serving.repository import ModelNotFound, ModelRepository, ServedVersion
from recship.serving.requests import IdOutOfRange, InvalidRequest, RequestArrays, validate

log = logging.getLogger("recship.serving")

UNROUTED = "-"  # the model/version label of requests that reached no served version
MAX_MESSAGE_CHARS = 1000  # a status message is cut here (gRPC sends it in a header)
T = TypeVar("T")


class Overloaded(RuntimeError):
    """Too many request bytes are in flight (gRPC RESOURCE_EXHAUSTED)."""


def status_of(e: BaseException) -> Tuple[grpc.StatusCode, str]:
    """The one place that maps an exception to a gRPC status: bad input -> INVALID_ARGUMENT, ..., our bugs -> INTERNAL."""
    if isinstance(e, InvalidRequest):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
    elif isinstance(e, ModelNotFound):
        code, message = grpc.StatusCode.NOT_FOUND, str(e)
    elif isinstance(e, (QueueFull, Overloaded)):
        code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    elif isinstance(e, (DeadlineExpired, asyncio.TimeoutError)):
        code, message = grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or "deadline exceeded"
    elif isinstance(e, (WorkerDied, Unloaded)):
        code, message = grpc.StatusCode.UNAVAILABLE, str(e)
    elif isinstance(e, asyncio.CancelledError):
        code, message = grpc.StatusCode.CANCELLED, "cancelled by the client"
    else:
        code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    return code, message


def decode(message_class, data: bytes):
    """Parses a request message; bytes that do not decode are INVALID_ARGUMENT, not gRPC's UNKNOWN."""
    try:
        return message_class.FromString(data)
    except (DecodeError, RecursionError) as e:
        raise InvalidRequest(f"the request is not a valid {message_class.DESCRIPTOR.full_name}: {e}") from None


@dataclass
class Outcome:
    """What a request is counted and logged under: its method, and the served model and version it reached."""

    method: str
    model: str = UNROUTED
    version: str = UNROUTED

    def routed(self, served: ServedVersion) -> None:
        self.model, self.version = served.name, str(served.version)


class Inference:
    """Route, validate, batch, count: what every front does with a request."""

    def __init__(self, repo: ModelRepository, metrics: Metrics, max_inflight_bytes: int) -> None:
        self.repo = repo
        self.metrics = metrics
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight = 0
        self._inflight_lock = threading.Lock()

    @contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        """Holds ``nbytes`` of the in-flight budget for the request's lifetime, or raises Overloaded."""
        with self._inflight_lock:
            if self._inflight + nbytes > self.max_inflight_bytes:
                raise Overloaded(
                    f"{self._inflight + nbytes} bytes of requests would be in flight, over the limit of "
                    f"{self.max_inflight_bytes} (--max-inflight-mb); retry later"
                )
            self._inflight += nbytes
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight -= nbytes

    def route(self, name: str, version: int, outcome: Outcome) -> ServedVersion:
        served = self.repo.get(name, version)
        outcome.routed(served)
        return served

    async def infer(
        self, request: RequestArrays, remaining: Optional[float], outcome: Outcome, served: Optional[ServedVersion] = None
    ) -> Tuple[ServedVersion, Dict[str, torch.Tensor]]:
        """(the version that answered, its outputs); raises the exceptions ``status_of`` maps.

        ``served``: the version a front has already routed this request to, if any.
        """
        started = time.monotonic()
        # A hot swap can retire the version between routing and submit(): then the
        # request goes to the version that replaced it (or NOT_FOUND if it asked for the old one).
        for attempt in range(3):
            if served is None or attempt:
                served = self.route(request.model_name, request.model_version, outcome)
            parsed = validate(request, served.spec)
            try:
                future = served.batcher.submit(parsed, started + remaining if remaining is not None else None)
                break
            except Unloaded:
                if attempt == 2:
                    raise
        outputs = await asyncio.wait_for(asyncio.wrap_future(future), timeout=remaining)
        self.metrics.ids.labels(served.name).inc(int(parsed.values.numel()))
        return served, outputs

    async def call(self, method: str, work: Callable[[Outcome], Awaitable[T]]) -> T:
        """Runs ``await work(outcome)``, counting and logging it once whatever happens; errors propagate."""
        outcome, started, error = Outcome(method), time.monotonic(), None
        try:
            return await work(outcome)
        except BaseException as e:  # CancelledError included: counted as CANCELLED, then re-raised
            error = e
            raise
        finally:
            self.record(outcome, error, started)

    async def answer(self, context, method: str, work: Callable[[Outcome], Awaitable[T]]) -> T:
        """``call`` for a gRPC front: the response, or an abort with the mapped status."""
        try:
            return await self.call(method, work)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e
        await context.abort(*status_of(error))

    def record(self, outcome: Outcome, e: Optional[BaseException], started: float) -> None:
        """Counts the request; logs one line for a failure (with the trace for INTERNAL)."""
        status = "OK"
        if e is not None:
            code, message = status_of(e)
            status = code.name
            if isinstance(e, IdOutOfRange) and outcome.model != UNROUTED:
                self.metrics.rejected_ids.labels(outcome.model).inc()
            internal = code == grpc.StatusCode.INTERNAL
            log.log(
                logging.ERROR if internal else logging.WARNING, "%s", message, exc_info=e if internal else None,
                extra={"method": outcome.method, "model": outcome.model, "version": outcome.version, "status": status},
            )
        self.metrics.requests.labels(outcome.method, outcome.model, outcome.version, status).inc()
        self.metrics.latency.labels(outcome.model).observe(time.monotonic() - started)
