"""The request path every front shares (recship's Predictor, KServe v2 over gRPC and over HTTP).

``Inference.call`` runs one request's work and counts it once; ``Inference.run`` routes a
request to its model version, validates it, queues it on the version's batcher and waits
for its rows. What can go wrong is an ``ErrorKind`` (``error_of``), in no protocol's
terms: each front maps the kinds to its own status codes in one place
(``serving/grpc_status.py`` for both gRPC fronts, ``serving/rest.py`` for HTTP).

Bounds that protect the process whatever clients do: a request's size (``max_message_bytes``,
checked in ``admit``, which every front calls with the request's bytes: TOO_LARGE), request
bytes in flight across all fronts (``max_inflight_bytes``; past it OVERLOADED), metric labels
only for served models and versions (everything else is counted under ``-``), client strings
cut short wherever a message echoes them, and log lines: every refusal is counted, but at
most one line per method, status and kind of message is logged each ``rules.LOG_INTERVAL_S`` (``SampledLog``).
"""

import asyncio
import logging
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, Awaitable, Callable, Dict, Iterator, Optional, Tuple, TypeVar

import torch

from recship.serving import rules
from recship.serving.batcher import DeadlineExpired, QueueFull, Unloaded, WorkerDied
from recship.serving.metrics import Metrics
from recship.serving.repository import ControlRefused, ModelNotFound, ModelRepository, ServedVersion
from recship.serving.requests import IdOutOfRange, InvalidRequest, RequestArrays, RequestTooLarge, validate

log = logging.getLogger("recship.serving")

UNROUTED = rules.UNROUTED  # the model/version label of requests that reached no served version
INFER_METHODS = frozenset({"Predict", "ModelInfer", "http.infer"})  # the requests a model's statistics count
MAX_MESSAGE_CHARS = 1000  # an error message is cut here (gRPC sends it in a header)
T = TypeVar("T")


@unique
class ErrorKind(Enum):
    """What went wrong with a request, whichever front it came through."""

    INVALID = "invalid"  # the request is malformed (InvalidRequest)
    TOO_LARGE = "too large"  # the request is over --max-message-mb (RequestTooLarge)
    NOT_FOUND = "not found"  # no such model or version is served (ModelNotFound)
    OVERLOADED = "overloaded"  # the model's queue is full, or too many bytes are in flight: retry later
    UNAVAILABLE = "unavailable"  # the version's worker died or the version is being unloaded
    DEADLINE = "deadline"  # the request's deadline passed before its answer
    CLIENT_TIMEOUT = "client timeout"  # the client did not send its request in time (ClientTimeout)
    CANCELLED = "cancelled"  # the client went away
    REFUSED = "refused"  # a repository request the model control does not allow, or a load that failed (ControlRefused)
    INTERNAL = "internal"  # anything else: a bug of ours, logged with its trace

    @property
    def label(self) -> str:
        """The request's ``status`` in the metrics and logs: its gRPC status name (the serving rules'), for every front."""
        return rules.STATUSES[self.name][0]

    @property
    def http_status(self) -> int:
        """The HTTP status of the REST front's answer (the serving rules')."""
        return rules.STATUSES[self.name][1]


if set(rules.STATUSES) != {k.name for k in ErrorKind}:
    raise TypeError(f"the serving rules' error kinds {sorted(rules.STATUSES)} are not ErrorKind's {[k.name for k in ErrorKind]}")


class Overloaded(RuntimeError):
    """Too many request bytes are in flight (ErrorKind.OVERLOADED)."""


class ClientTimeout(RuntimeError):
    """A front gave up waiting for the request itself, e.g. an HTTP body (ErrorKind.CLIENT_TIMEOUT)."""


_KINDS = (  # the first match counts: subclasses before their bases
    (RequestTooLarge, ErrorKind.TOO_LARGE),
    (InvalidRequest, ErrorKind.INVALID),
    (ModelNotFound, ErrorKind.NOT_FOUND),
    ((QueueFull, Overloaded), ErrorKind.OVERLOADED),
    ((WorkerDied, Unloaded), ErrorKind.UNAVAILABLE),
    ((DeadlineExpired, asyncio.TimeoutError), ErrorKind.DEADLINE),
    (ClientTimeout, ErrorKind.CLIENT_TIMEOUT),
    (asyncio.CancelledError, ErrorKind.CANCELLED),
    (ControlRefused, ErrorKind.REFUSED),
)


def error_of(e: BaseException) -> Tuple[ErrorKind, str]:
    """The one place that classifies an exception: (its kind, the message a client is shown)."""
    kind = next((k for types, k in _KINDS if isinstance(e, types)), ErrorKind.INTERNAL)
    if kind is ErrorKind.INTERNAL:
        message = rules.INTERNAL.say(type=type(e).__name__, error=e)
    elif kind is ErrorKind.CANCELLED:
        message = rules.CANCELLED.say()
    elif kind is ErrorKind.DEADLINE:
        message = str(e) or "deadline exceeded"  # asyncio's TimeoutError says nothing
    else:
        message = str(e)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    return kind, message


def too_large(nbytes: Optional[int], limit: int) -> RequestTooLarge:
    """The one refusal of a request over ``limit`` bytes (--max-message-mb), whichever front it came through;
    ``nbytes`` None: its size is not known, only that it is over (an HTTP body without Content-Length)."""
    return RequestTooLarge(rules.TOO_LARGE.say(size="" if nbytes is None else f" of {nbytes} bytes", limit=limit))


@dataclass
class _Source:
    next: float = -math.inf  # when its next line may be logged
    suppressed: int = 0  # lines left out since its last one
    last: Tuple[int, str, Dict[str, Any]] = (logging.INFO, "", {})  # the last line asked for: level, message, extra


def message_kind(message: str) -> str:
    """What kind of error a message tells, without its values: each run of digits becomes ``#`` and each quoted run
    (from ``'`` or ``"`` to the same quote, or the end) an empty pair of those quotes, so ``feature 'a': id 7 is out
    of range [0, 5)`` is ``feature '': id # is out of range [#, #)``. The C++ front's ``message_kind`` (log.cpp) is
    the same rule: digits and quotes are ASCII, which no byte of a multi-byte UTF-8 character is."""
    out, i, n = [], 0, len(message)
    while i < n:
        c = message[i]
        if "0" <= c <= "9":
            while i < n and "0" <= message[i] <= "9":
                i += 1
            out.append("#")
        elif c in "'\"":
            end = message.find(c, i + 1)
            i = n if end < 0 else end + 1
            out.append(c + c)
        else:
            out.append(c)
            i += 1
    return "".join(out)


class SampledLog:
    """Lines a client can cause once per request, logged at a bounded rate: from each source (a fixed name, never
    client data) and kind of message (``message_kind``: the message without its numbers and quoted names) the
    first line, then at most one per ``interval_s``, which says how many like it were left out since the one
    before; ``flush()`` says the rest. A source's kinds past its first ``MAX_KINDS`` share one count, so that
    clients cannot grow the table. The same words and counts as the C++ front's (cpp_loader/tools/front/log.cpp),
    so that one reading of the log covers both processes."""

    MAX_KINDS = rules.LOG_MAX_KINDS  # kinds of message counted apart per source

    def __init__(self, logger: logging.Logger, interval_s: float = rules.LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._interval, self._clock = logger, interval_s, clock
        self._sources: Dict[Tuple[str, str], _Source] = {}  # (source, kind) -> its count
        self._kinds: Dict[str, int] = {}  # source -> kinds counted apart
        self._lock = threading.Lock()

    def log(self, source: str, level: int, message: str, exc_info: Optional[BaseException] = None,
            extra: Optional[Dict[str, Any]] = None) -> None:
        kind = message_kind(message)
        with self._lock:
            s = self._sources.get((source, kind))
            if s is None:
                if self._kinds.get(source, 0) >= self.MAX_KINDS:
                    kind = "*"  # past MAX_KINDS: one count for the rest
                else:
                    self._kinds[source] = self._kinds.get(source, 0) + 1
                s = self._sources.setdefault((source, kind), _Source())
            now = self._clock()
            s.last = (level, message, dict(extra or {}))  # (not exc_info: it would keep the request's frames alive)
            if now < s.next:
                s.suppressed += 1
                return
            line = message + self._note(s.suppressed)
            s.next, s.suppressed = now + self._interval, 0
        self._log.log(level, "%s", line, exc_info=exc_info, extra=extra)

    def flush(self) -> None:
        """Logs, for each source with lines left out since its last one, the last of them and how many there were."""
        with self._lock:
            lines = []
            for s in self._sources.values():
                if s.suppressed:
                    level, message, extra = s.last
                    lines.append((level, f"{message}{self._note(s.suppressed - 1)} (the last of {s.suppressed} not logged)", extra))
                    s.suppressed = 0
        for level, line, extra in lines:
            self._log.log(level, "%s", line, extra=extra)

    def _note(self, suppressed: int) -> str:
        return f" [{suppressed} more like this in the last {self._interval:g} s not logged]" if suppressed else ""


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
        self.max_message_bytes: int = repo.config.max_message_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.accepting = True  # False once the server begins stopping: readiness answers say so
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.failures = SampledLog(log)  # each failed request's line, sampled

    @property
    def inflight_bytes(self) -> int:
        """Request bytes admitted and not yet answered."""
        return self._inflight

    def server_ready(self) -> bool:
        """Taking requests, with at least one model serving (KServe's ServerReady); under explicit model control
        taking requests is enough (models load on request, and a server that is not ready gets none)."""
        return self.accepting and (self.repo.explicit or bool(self.repo.models()))

    def model_ready(self, served: ServedVersion) -> bool:
        """Taking requests, and ``served``'s worker is alive (KServe's ModelReady)."""
        return self.accepting and served.batcher.alive

    @contextmanager
    def admit(self, nbytes: int, cost: Optional[int] = None) -> Iterator[None]:
        """Admits a request of ``nbytes`` bytes that will hold ``cost`` bytes of memory at its peak (None: its
        size; ``serving/footprint.py`` says what each kind of request costs): RequestTooLarge over --max-message-mb,
        else holds ``cost`` of the in-flight budget for the request's lifetime, or raises Overloaded. Every front
        calls it before decoding a request, so the size rule is the same everywhere (the C++ front forwards what
        is over it) and a request that would not fit is refused before it costs anything but its bytes."""
        if nbytes > self.max_message_bytes:
            raise too_large(nbytes, self.max_message_bytes)
        held = nbytes if cost is None else cost
        with self._inflight_lock:
            if self._inflight + held > self.max_inflight_bytes:
                raise Overloaded(rules.OVERLOADED.say(total=self._inflight + held, limit=self.max_inflight_bytes))
            self._inflight += held
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight -= held

    def route(self, name: str, version: int, outcome: Outcome) -> ServedVersion:
        served = self.repo.get(name, version)
        outcome.routed(served)
        return served

    async def run(
        self, request: RequestArrays, remaining: Optional[float], outcome: Outcome, served: Optional[ServedVersion] = None
    ) -> Tuple[ServedVersion, Dict[str, torch.Tensor]]:
        """(the version that answered, its outputs); raises the exceptions ``error_of`` classifies.

        ``remaining``: seconds until the request's deadline (None: no deadline).

        ``served``: the version a front has already routed this request to, if any.
        """
        started = time.monotonic()
        # A hot swap can retire the version between routing and submit(): then the
        # request goes to the version that replaced it (or not found if it asked for the old one).
        for attempt in range(3):
            if served is None or attempt:
                served = self.route(request.model_name, request.model_version, outcome)
            assert served is not None  # route() raises rather than return None
            parsed = validate(request, served.spec)
            try:
                future = served.batcher.submit(parsed, started + remaining if remaining is not None else None)
                break
            except Unloaded:
                if attempt == 2:
                    raise
        assert served is not None
        outputs = await asyncio.wait_for(asyncio.wrap_future(future), timeout=remaining)
        self.metrics.ids.labels(served.name).inc(int(parsed.ids.numel()))
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

    def record(self, outcome: Outcome, e: Optional[BaseException], started: float) -> None:
        """Counts the request; logs a failure, sampled (``failures``), with the trace for an internal error."""
        status = "OK"
        if e is not None:
            kind, message = error_of(e)
            status = kind.label
            if isinstance(e, IdOutOfRange) and outcome.model != UNROUTED:
                self.metrics.rejected_ids.labels(outcome.model).inc()
            internal = kind is ErrorKind.INTERNAL
            self.failures.log(
                f"{outcome.method} {status}", logging.ERROR if internal else logging.WARNING, message, exc_info=e if internal else None,
                extra={"method": outcome.method, "model": outcome.model, "version": outcome.version, "status": status},
            )
        seconds = time.monotonic() - started
        self.metrics.requests.labels(outcome.method, outcome.model, outcome.version, status).inc()
        self.metrics.latency.labels(outcome.model, outcome.version).observe(seconds)
        if outcome.method in INFER_METHODS and outcome.model != UNROUTED:
            self.metrics.observe_request(outcome.model, outcome.version, e is None, seconds)
