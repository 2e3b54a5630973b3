"""Prometheus metrics of the server (one registry per server, so tests can run several).

Label values are bounded by what the server serves: ``model`` and ``version`` are served
models and versions, or ``-`` for requests that reached none (an unknown model name never
becomes a label), and ``method`` is one of the fronts' method names.
"""

import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

log = logging.getLogger("recship.serving")

# samples another process counted (the C++ front), by family name: (sample name, labels, value)
ExtraSamples = Dict[str, List[Tuple[str, Dict[str, str], float]]]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


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


class Metrics:
    def __init__(self) -> None:
        own = CollectorRegistry()
        r = own
        self.extra: Optional[Callable[[], ExtraSamples]] = None  # set by a server with the C++ front
        self.registry = CollectorRegistry()  # what /metrics shows: own families, the front's samples merged in
        self.registry.register(_Merged(own, self))
        self.requests = Counter("recship_requests_total", "requests by method, model, version and status",
                                ["method", "model", "version", "status"], registry=r)
        self.latency = Histogram("recship_request_seconds", "end-to-end latency of a request", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("recship_queue_seconds", "time from enqueue to forward", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("recship_compute_seconds", "forward time per batch", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("recship_batch_examples", "examples per forward", ["model"], buckets=_BATCH_BUCKETS, registry=r)
        self.ids = Counter("recship_ids_total", "ids looked up", ["model"], registry=r)
        self.rejected_ids = Counter("recship_rejected_id_requests_total", "requests refused for out-of-range ids", ["model"], registry=r)
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

    def observe_batch(self, model: str, examples: int, queue_s: List[float], compute_s: float) -> None:
        """One forward of ``model``: its examples, each request's wait in the queue, the forward's time."""
        self.batch.labels(model).observe(examples)
        self.compute.labels(model).observe(compute_s)
        for q in queue_s:
            self.queue.labels(model).observe(q)
