"""Prometheus metrics and Triton-style model statistics of the server (one registry per server,
so tests can run several).

Label values are bounded by what the server serves: ``model`` and ``version`` are served
models and versions, or ``-`` for requests that reached none (an unknown model name never
becomes a label), and ``method`` is one of the fronts' method names.

The families (deploy/README.md documents them; deploy/grafana/recship.json charts them):

    recship_requests_total{method,model,version,status}     requests by outcome
    recship_request_seconds{model,version}                  end-to-end latency (histogram)
    recship_queue_seconds{model,version}                    enqueue to forward, per request (histogram)
    recship_compute_seconds{model,version}                  forward time per batch (histogram)
    recship_batch_examples{model,version}                   examples per forward (histogram)
    recship_ids_total{model}                                ids looked up
    recship_rejected_id_requests_total{model}               requests refused for out-of-range ids
    recship_queue_depth{model,version}                      requests waiting for a forward now (gauge)
    recship_inflight_bytes                                  request bytes being served now (gauge)
    recship_model_ready{model,version}                      1 serving, 0 refused or its worker is down (gauge)
    recship_model_load_failures_total{model}                versions (or config.yaml files) refused
"""

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from recship.serving import rules

log = logging.getLogger("recship.serving")

# samples another process counted (the C++ front), by family name: (sample name, labels, value)
ExtraSamples = Dict[str, List[Tuple[str, Dict[str, str], float]]]

# the histograms' buckets (seconds; examples per forward), the C++ front's too: serving/front.py sends them to it
LATENCY_BUCKETS, BATCH_BUCKETS = rules.LATENCY_BUCKETS, rules.BATCH_BUCKETS  # the serving rules' (the C++ front's too)


class _Merged:
    """The server's own families with another process's samples added: one family per name, counts summed."""

    def __init__(self, own: CollectorRegistry, metrics: "Metrics") -> None:
        self._own, self._metrics = own, metrics

    def collect(self) -> Iterator[Metric]:
        extra: ExtraSamples = {}
        if self._metrics.extra is not None:
            try:
                extra = self._metrics.extra()
            except Exception as e:  # a scrape never fails for it: the Python side's counts still show
                log.error("reading the C++ front's metrics failed: %s", e)
        for family in self._own.collect():
            added = extra.get(family.name)
            if added:
                index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(family.samples)}
                for name, labels, value in added:
                    i = index.get((name, tuple(sorted(labels.items()))))
                    if i is None:
                        family.samples.append(Sample(name, labels, value))
                    else:
                        old = family.samples[i]
                        family.samples[i] = old._replace(value=old.value + value)
            yield family


@dataclass
class ModelStats:
    """Triton's ModelStatistics of one served version: counts and total nanoseconds (``StatisticDuration``s)."""

    success: List[int] = field(default_factory=lambda: [0, 0])  # inference requests answered: [count, ns]
    fail: List[int] = field(default_factory=lambda: [0, 0])  # inference requests refused after reaching this version
    queue: List[int] = field(default_factory=lambda: [0, 0])  # per request: enqueue to forward
    compute: List[int] = field(default_factory=lambda: [0, 0])  # per request: its batch's forward
    inference_count: int = 0  # examples run
    execution_count: int = 0  # forwards run
    last_inference_ms: int = 0  # when the last forward ended, ms since the epoch
    batches: Dict[int, List[int]] = field(default_factory=dict)  # examples per forward -> [forwards, compute ns]

    def add(self, other: "ModelStats") -> "ModelStats":
        """The sum of two processes' statistics (the C++ front's and this one's)."""
        out = ModelStats([a + b for a, b in zip(self.success, other.success)], [a + b for a, b in zip(self.fail, other.fail)],
                         [a + b for a, b in zip(self.queue, other.queue)], [a + b for a, b in zip(self.compute, other.compute)],
                         self.inference_count + other.inference_count, self.execution_count + other.execution_count,
                         max(self.last_inference_ms, other.last_inference_ms), {k: list(v) for k, v in self.batches.items()})
        for size, (n, ns) in other.batches.items():
            mine = out.batches.setdefault(size, [0, 0])
            mine[0] += n
            mine[1] += ns
        return out


class Metrics:
    def __init__(self) -> None:
        own = CollectorRegistry()
        r = own
        self.extra: Optional[Callable[[], ExtraSamples]] = None  # set by a server with the C++ front
        self.extra_stats: Optional[Callable[[], Dict[Tuple[str, str], "ModelStats"]]] = None  # the front's statistics
        self.registry = CollectorRegistry()  # what /metrics shows: own families, the front's samples merged in
        self.registry.register(_Merged(own, self))
        self.requests = Counter("recship_requests_total", "requests by method, model, version and status",
                                ["method", "model", "version", "status"], registry=r)
        mv = ["model", "version"]
        self.latency = Histogram("recship_request_seconds", "end-to-end latency of a request", mv, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("recship_queue_seconds", "time from enqueue to forward", mv, buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("recship_compute_seconds", "forward time per batch", mv, buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("recship_batch_examples", "examples per forward", mv, buckets=BATCH_BUCKETS, registry=r)
        self.ids = Counter("recship_ids_total", "ids looked up", ["model"], registry=r)
        self.rejected_ids = Counter("recship_rejected_id_requests_total", "requests refused for out-of-range ids", ["model"], registry=r)
        self.load_failures = Counter("recship_model_load_failures_total", "versions or config.yaml files refused by the repository",
                                     ["model"], registry=r)
        # gauges read at scrape time: (model, version) -> requests waiting, and -> 1 ready / 0 not; bytes in flight
        self.queue_depth: Callable[[], Dict[Tuple[str, str], int]] = dict
        self.readiness: Callable[[], Dict[Tuple[str, str], int]] = dict
        self.inflight_bytes: Callable[[], int] = lambda: 0
        r.register(_Gauges(self))
        self._stats: Dict[Tuple[str, str], ModelStats] = {}
        self._stats_lock = threading.Lock()
        self.port: Optional[int] = None
        self._http: Optional[Any] = None  # prometheus_client's WSGI server

    def serve(self, port: Optional[int], host: str, certfile: Optional[str] = None, keyfile: Optional[str] = None,
              client_cafile: Optional[str] = None) -> None:
        """Starts the /metrics endpoint on ``host:port`` (None: no endpoint), on TLS when a certificate is given."""
        if port is None:
            return
        http, _ = start_http_server(port, addr=host, registry=self.registry, certfile=certfile, keyfile=keyfile,
                                    client_cafile=client_cafile, client_auth_required=client_cafile is not None)
        self._http = http
        self.port = http.server_port

    def close(self) -> None:
        """Stops the metrics endpoint."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def observe_batch(self, model: str, version: str, examples: int, queue_s: List[float], compute_s: float) -> None:
        """One forward of ``model`` ``version``: its examples, each request's wait in the queue, the forward's time."""
        self.batch.labels(model, version).observe(examples)
        self.compute.labels(model, version).observe(compute_s)
        for q in queue_s:
            self.queue.labels(model, version).observe(q)
        compute_ns = int(compute_s * 1e9)
        with self._stats_lock:
            s = self._stats.setdefault((model, version), ModelStats())
            s.queue[0] += len(queue_s)
            s.queue[1] += int(sum(queue_s) * 1e9)
            s.compute[0] += len(queue_s)
            s.compute[1] += compute_ns * len(queue_s)
            s.inference_count += examples
            s.execution_count += 1
            s.last_inference_ms = int(time.time() * 1000)
            b = s.batches.setdefault(examples, [0, 0])
            b[0] += 1
            b[1] += compute_ns

    def observe_request(self, model: str, version: str, ok: bool, seconds: float) -> None:
        """An inference request that reached ``model`` ``version``, answered (``ok``) or refused, and its latency."""
        with self._stats_lock:
            s = self._stats.setdefault((model, version), ModelStats())
            d = s.success if ok else s.fail
            d[0] += 1
            d[1] += int(seconds * 1e9)

    def stats(self, model: str, version: str) -> ModelStats:
        """``model`` ``version``'s statistics, the C++ front's added (zeros if it has seen no request)."""
        with self._stats_lock:
            own = ModelStats().add(self._stats.get((model, version), ModelStats()))
        if self.extra_stats is not None:
            try:
                front = self.extra_stats().get((model, version))
            except Exception as e:  # the Python side's counts still answer
                log.error("reading the C++ front's statistics failed: %s", e)
                front = None
            if front is not None:
                own = own.add(front)
        return own


class _Gauges:
    """The gauges read at scrape time from the repository and the request path."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        depth = GaugeMetricFamily("recship_queue_depth", "requests waiting for a forward", labels=["model", "version"])
        for (model, version), n in sorted(m.queue_depth().items()):
            depth.add_metric([model, version], n)
        ready = GaugeMetricFamily("recship_model_ready", "1: the version serves; 0: refused, or its worker is down",
                                  labels=["model", "version"])
        for (model, version), v in sorted(m.readiness().items()):
            ready.add_metric([model, version], v)
        yield depth
        yield ready
        yield GaugeMetricFamily("recship_inflight_bytes", "request bytes being served, all fronts of this process",
                                value=m.inflight_bytes())
