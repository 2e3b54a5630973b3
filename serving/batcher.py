"""Dynamic batching: concurrent requests for one model version run as one forward.

A worker thread takes the oldest request, then keeps collecting until the batch
holds ``max_batch_size`` examples or ``max_delay_s`` has passed since that first
request. Requests whose deadline passed or whose caller gave up (a cancelled
future) are answered, or dropped, without running. The batch's inputs are merged
along the batch, the model runs once, and every output is split back by each
request's batch size, in order, so each request gets exactly its own rows.

The forwards of every model on a device run on one thread (``DeviceThread``): the
device runs one forward at a time anyway, and a thread that runs forwards keeps what
they cost after they end, its own OpenMP team of intra-op threads and its own malloc
arena holding the freed activations of its largest batch (glibc); one per device, not
one per model (measured: 4.4 MiB per served model on 2 cores, more on a host with more
cores, where each team has a thread per core).

Admission is bounded (``max_queue`` requests waiting; more are refused at once), but
the queue itself is not, so that the stop marker can always be queued: stopping
never waits for room. A stopping server closes the window (``close_window``): from then on no request waits for
company, and the one waiting runs at once. No single request's fate can stop the worker: a future that
its caller already cancelled is skipped, a failing forward fails only its batch,
and should the worker die anyway it fails everything queued, refuses new requests
with ``WorkerDied`` and reports its death through ``on_death``.
"""

import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from recship.serving import rules
from recship.serving.requests import ParsedRequest

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The model's queue is full (ErrorKind.OVERLOADED)."""


class Unloaded(RuntimeError):
    """The batcher stopped taking requests: its model version is being replaced or unloaded (ErrorKind.UNAVAILABLE)."""


class DeadlineExpired(RuntimeError):
    """The request's deadline passed before it ran (ErrorKind.DEADLINE)."""


class WorkerDied(RuntimeError):
    """The model's worker thread ended unexpectedly (ErrorKind.UNAVAILABLE until it is restarted)."""


@dataclass
class _Item:
    request: ParsedRequest
    deadline: Optional[float]  # time.monotonic() seconds
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)

    def fail(self, error: BaseException) -> None:
        """Answers with ``error`` unless the caller has already gone (cancelled) or it was answered."""
        future = self.future
        try:
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(error)
        except (InvalidStateError, RuntimeError):  # already answered: that answer stands
            pass

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


class _Wake:
    """The marker ``close_window`` queues: it ends the worker's wait for company (and is no request)."""


_WAKE = _Wake()


class DeviceThread:
    """The one thread that runs the forwards of every batcher on a device, one at a time, in the order they come.

    ``run(forward, threads)`` runs ``forward()`` there with ``threads`` intra-op threads (None: as set) and returns
    its result or raises its exception (BaseException included) in the caller's thread. ``stop()`` ends the thread
    after the forwards already given to it; later ones are refused (Unloaded).
    """

    def __init__(self, name: str = "cpu") -> None:
        self._jobs: "queue.Queue[Optional[Tuple[Callable[[], Any], Optional[int], Future]]]" = queue.Queue()
        self._stopped = False
        self._gate = threading.Lock()  # nothing is queued behind the stop marker
        self._thread = threading.Thread(target=self._main, name=f"forwards-{name}", daemon=True)
        self._thread.start()

    def run(self, forward: Callable[[], Any], threads: Optional[int] = None) -> Any:
        done: Future = Future()
        with self._gate:
            if self._stopped:
                raise Unloaded("the server is stopping")
            self._jobs.put((forward, threads, done))
        return done.result()

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Ends the thread after the forwards given to it, waiting up to ``timeout`` seconds for them."""
        with self._gate:
            self._stopped = True
            self._jobs.put(None)
        self._thread.join(timeout)

    def _main(self) -> None:
        threads = None  # what this thread's intra-op threads were last set to
        while True:
            job = self._jobs.get()
            if job is None:
                return
            forward, want, done = job
            if want and want != threads:
                torch.set_num_threads(want)
                threads = want
            try:
                done.set_result(forward())
            except BaseException as e:  # the caller's to handle (a worker that dies of it reports its death)
                done.set_exception(e)


class Batcher:
    """Queues requests for ``model`` and runs them in merged batches on one worker thread.

    Args:
        model: TorchScript artifact module: (dense, lengths, values, weights) -> Dict[str, Tensor].
        max_batch_size: examples per forward (a single larger request runs alone).
        max_delay_s: how long the first request of a batch waits for company; 0: no waiting, but requests
            queued meanwhile (during the previous forward) still run together.
        batching: False runs every request alone (one request per forward, whatever is queued).
        max_queue: requests waiting at most; more are refused with QueueFull.
        observe: callback(batch_examples, queue_seconds_list, compute_seconds) for metrics.
        device: where the model's inputs go ("cpu", or "cuda:N" for a CUDA artifact).
        forwards: the device's thread (``DeviceThread``) that runs the forwards of every batcher sharing it, so the
            device runs one forward at a time however many models it serves; None: this batcher's own thread runs them.
        threads: intra-op threads of this batcher's forwards (set on the thread that runs them).
        on_death: called (from the dying worker thread) with the exception if the worker ever dies.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = rules.DEFAULT_MAX_BATCH_SIZE,
        max_delay_s: float = 0.0,
        max_queue: int = rules.DEFAULT_MAX_QUEUE,
        observe: Optional[Callable[[int, List[float], float], None]] = None,
        name: str = "model",
        device: str = "cpu",
        forwards: Optional[DeviceThread] = None,
        threads: Optional[int] = None,
        on_death: Optional[Callable[[BaseException], None]] = None,
        batching: bool = True,
    ) -> None:
        self.model = model
        self.name = name
        self._forwards = forwards
        self._threads = threads
        self.device = torch.device(device)
        # inputs arrive on the host; a CUDA model gets them through pinned memory on its own stream
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.batching = batching
        self.max_queue = max_queue
        # unbounded: admission is counted in submit(); None is the stop marker, _WAKE close_window's
        self._queue: "queue.Queue[Union[_Item, _Wake, None]]" = queue.Queue()
        self._window_closed = False
        self._observe = observe
        self._on_death = on_death
        self._stopping = False
        self.died: Optional[BaseException] = None  # set if the worker ended unexpectedly
        # submit(), stop() and a dying worker hold this, so nothing is queued behind the stop marker
        # or after the worker's last look at the queue
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.died is None and not self._stopping

    @property
    def pending(self) -> int:
        """Requests queued and not yet taken into a batch (the metrics' queue depth)."""
        return self._queue.qsize()

    def submit(self, request: ParsedRequest, deadline: Optional[float] = None) -> Future:
        item = _Item(request, deadline)
        with self._gate:
            if self.died is not None:
                raise WorkerDied(f"the worker of {self.name} died ({type(self.died).__name__}); it is being restarted")
            if self._stopping:
                raise Unloaded("the model version is being unloaded")
            if self._queue.qsize() >= self.max_queue:
                raise QueueFull(rules.QUEUE_FULL.say(max_queue=self.max_queue))
            self._queue.put_nowait(item)
        return item.future

    def stop(self, drain: bool = True, timeout: Optional[float] = 30.0) -> None:
        """Stops after the queued requests (drain) or refusing them; never waits for queue room.

        Waits up to ``timeout`` seconds for the forward in progress (None: as long as it takes).
        """
        with self._gate:
            self._stopping = True
            if not drain:
                self._fail_queued(Unloaded("the model was unloaded"))
            self._queue.put_nowait(None)  # after every accepted request
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the worker of %s is still in a forward after %.0f s; leaving it behind", self.name, timeout)

    def close_window(self) -> None:
        """No request waits for company from now on (max_delay_s counts as 0): the batch waiting runs at once, with
        what is queued. A stopping server calls it once it stops taking requests, so that its last calls do not
        wait out a window that no request will join."""
        with self._gate:
            self._window_closed = True
            self._queue.put_nowait(_WAKE)

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Item):
                item.fail(error)

    # -- worker ------------------------------------------------------------

    def _main(self) -> None:
        batch: List[_Item] = []
        try:
            if self._threads and self._forwards is None:
                torch.set_num_threads(self._threads)  # on the thread that runs the forwards
            carry: Optional[_Item] = None
            while True:
                batch, carry, stop = self._collect(carry)
                if batch:
                    self._run(batch)
                batch = []
                if stop:
                    if carry is not None:
                        self._run([carry])
                    return
        except BaseException as e:  # a bug in the worker itself: fail what it holds, refuse the rest, report
            log.critical("the worker of %s died", self.name, exc_info=e)
            with self._gate:
                self.died = e
                error = WorkerDied(f"the worker of {self.name} died: {type(e).__name__}")
                for item in batch:
                    item.fail(error)
                self._fail_queued(error)
            if self._on_death is not None:
                self._on_death(e)

    def _collect(self, carry: Optional[_Item]):
        """(the next batch, the request that starts the batch after it, whether the stop marker came)."""
        first = carry if carry is not None else self._queue.get()
        if first is None:
            return [], None, True
        if isinstance(first, _Wake):  # close_window's marker, with no batch waiting
            return [], None, False
        batch, examples = [first], first.request.batch_size
        if not self.batching:  # one request per forward, however many are queued
            return batch, None, False
        while examples < self.max_batch_size:
            wait = first.enqueued + (0.0 if self._window_closed else self.max_delay_s) - time.monotonic()
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, None, True
            if isinstance(item, _Wake):  # the window closed: take what is queued, wait no more
                continue
            if item.future.cancelled():  # its caller gave up: it takes no room in the batch
                continue
            if examples + item.request.batch_size > self.max_batch_size:
                return batch, item, False  # it starts the next batch
            batch.append(item)
            examples += item.request.batch_size
        return batch, None, False

    def _run(self, batch: List[_Item]) -> None:
        now = time.monotonic()
        live = []
        for item in batch:
            if item.expired(now):
                item.fail(DeadlineExpired(rules.DEADLINE.say()))
            elif item.future.set_running_or_notify_cancel():  # False: the caller cancelled it
                live.append(item)
        if not live:
            return
        started = time.monotonic()
        try:
            outputs = self._forward([item.request for item in live])
            compute = time.monotonic() - started
            parts = _split(outputs, [i.request.batch_size for i in live])
        except Exception as e:  # the model failed: every request of this batch gets the error
            log.exception("forward failed for a batch of %d requests", len(live))
            for item in live:
                item.future.set_exception(e)
            return
        for item, outs in zip(live, parts):
            item.future.set_result(outs)
        if self._observe is not None:
            try:
                self._observe(sum(i.request.batch_size for i in live), [started - i.enqueued for i in live], compute)
            except Exception:  # metrics must never cost a request or the worker
                log.exception("recording metrics of %s failed", self.name)

    def _forward(self, requests: List[ParsedRequest]) -> Dict[str, torch.Tensor]:
        r = requests[0] if len(requests) == 1 else merge(requests)
        inputs = (r.dense, r.lengths.view(-1), r.ids, r.weights)

        def forward() -> Dict[str, torch.Tensor]:
            with torch.inference_mode():
                return self.model(*inputs) if self._stream is None else self._forward_cuda(inputs)

        return forward() if self._forwards is None else self._forwards.run(forward, self._threads)

    def _forward_cuda(self, inputs) -> Dict[str, torch.Tensor]:
        """Pinned host staging, asynchronous copies on this batcher's stream, results synchronised.

        The inputs are copied into page-locked memory so the host-to-device copies can run
        asynchronously on the stream; the outputs come back into pinned memory and the
        stream is synchronised before any request sees them.
        """
        with torch.cuda.stream(self._stream):
            staged = [None if t is None else t.pin_memory().to(self.device, non_blocking=True) for t in inputs]
            outputs = self.model(*staged)
            host = {}
            for name, t in outputs.items():
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
        assert self._stream is not None  # a CUDA runner always has its stream
        self._stream.synchronize()
        return host


def merge(requests: List[ParsedRequest]) -> ParsedRequest:
    """Concatenates requests along the batch: request 0's examples first, then request 1's, ...

    lengths [F, B_i] join along dim 1; the ids of each request are feature-major, so the
    merged ids are ordered by feature with a stable sort (within a feature, by request).
    """
    lengths = torch.cat([r.lengths for r in requests], dim=1)
    counts = np.stack([np.asarray(r.id_counts) for r in requests])  # [R, F] ids per request and feature (set by __post_init__)
    # int16 feature numbers where they fit: numpy's stable sort of 16-bit keys is a radix sort, O(ids)
    key = np.int16 if lengths.shape[0] < 2**15 else np.int32
    feature_of_id = np.repeat(np.tile(np.arange(lengths.shape[0], dtype=key), len(requests)), counts.reshape(-1))
    order = torch.from_numpy(np.argsort(feature_of_id, kind="stable"))
    ids = torch.cat([r.ids for r in requests])[order]
    weights = None if requests[0].weights is None else torch.cat([r.weights for r in requests if r.weights is not None])[order]
    return ParsedRequest(int(lengths.shape[1]), torch.cat([r.dense for r in requests]), lengths, ids, weights, counts.sum(0))


def _split(outputs: Dict[str, torch.Tensor], sizes: List[int]) -> List[Dict[str, torch.Tensor]]:
    parts = {name: torch.split(t, sizes) for name, t in outputs.items()}
    return [{name: parts[name][i] for name in outputs} for i in range(len(sizes))]
