"""Dynamic batching: concurrent requests for one model version run as one forward.

A worker thread takes the oldest request, then keeps collecting until the batch
holds ``max_batch_size`` examples or ``max_delay_s`` has passed since that first
request; expired requests are answered DEADLINE_EXCEEDED without running. The
requests' KJTs are concatenated along the batch, the model runs once, and every
output is split back by each request's batch size, in order, so each request gets
exactly its own rows. The queue is bounded: a full queue refuses at once.
"""

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from recship.serving.requests import ParsedRequest

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The model's queue is full (gRPC RESOURCE_EXHAUSTED)."""


class Unloaded(RuntimeError):
    """The batcher stopped taking requests (its model version is being replaced)."""


class DeadlineExpired(RuntimeError):
    """The request's deadline passed before it ran (gRPC DEADLINE_EXCEEDED)."""


@dataclass
class _Item:
    request: ParsedRequest
    deadline: Optional[float]  # time.monotonic() seconds
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    """Queues requests for ``model`` and runs them in merged batches on one worker thread.

    Args:
        model: TorchScript artifact module: (dense, lengths, values, weights) -> Dict[str, Tensor].
        max_batch_size: examples per forward (a single larger request runs alone).
        max_delay_s: how long the first request of a batch waits for company; 0 disables batching.
        max_queue: requests waiting at most; more are refused with QueueFull.
        observe: callback(batch_examples, n_requests, queue_seconds_list, compute_seconds) for metrics.
        device: where the model's inputs go ("cpu", or "cuda:N" for a CUDA artifact).
        device_lock: held around each forward; batchers of one device share it, so the
            device runs one forward at a time (a worker per device) however many models it serves.
        threads: intra-op threads of this batcher's forwards (set on its own thread).
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 512,
        max_delay_s: float = 0.002,
        max_queue: int = 1024,
        observe: Optional[Callable[[int, int, List[float], float], None]] = None,
        name: str = "model",
        device: str = "cpu",
        device_lock: Optional[threading.Lock] = None,
        threads: Optional[int] = None,
    ) -> None:
        self.model = model
        self._device_lock = device_lock if device_lock is not None else threading.Lock()
        self._threads = threads
        self.device = torch.device(device)
        # inputs arrive on the host; a CUDA model gets them through pinned memory on its own stream
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self._queue: "queue.Queue[Optional[_Item]]" = queue.Queue(maxsize=max_queue)
        self._observe = observe
        self._stopping = False
        # submit() and stop() hold this so that no request can be queued behind the stop marker
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    def submit(self, request: ParsedRequest, deadline: Optional[float] = None) -> Future:
        item = _Item(request, deadline)
        with self._gate:
            if self._stopping:
                raise Unloaded("the model version is being unloaded")
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                raise QueueFull(f"queue full ({self._queue.maxsize} requests waiting)") from None
        return item.future

    def stop(self, drain: bool = True) -> None:
        """Stops after the queued requests (drain) or refusing them."""
        with self._gate:
            self._stopping = True
        if not drain:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item.future.set_exception(QueueFull("the model was unloaded"))
        with self._gate:  # after every accepted request
            self._queue.put(None)
        self._thread.join()

    # -- worker ------------------------------------------------------------

    def _loop(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)  # on the thread that runs the forwards
        carry: Optional[_Item] = None
        while True:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                return
            batch = [first]
            examples = first.request.batch_size
            until = first.enqueued + self.max_delay_s
            stop = False
            while examples < self.max_batch_size:
                wait = until - time.monotonic()
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                if examples + item.request.batch_size > self.max_batch_size:
                    carry = item  # starts the next batch
                    break
                batch.append(item)
                examples += item.request.batch_size
            self._run(batch)
            if stop:
                if carry is not None:
                    self._run([carry])
                return

    def _run(self, batch: List[_Item]) -> None:
        now = time.monotonic()
        live = []
        for item in batch:
            if item.deadline is not None and now > item.deadline:
                item.future.set_exception(DeadlineExpired("deadline passed while queued"))
            elif item.future.set_running_or_notify_cancel():
                live.append(item)
        if not live:
            return
        started = time.monotonic()
        try:
            outputs = self._forward([item.request for item in live])
        except Exception as e:  # the model failed: every request of this batch gets the error
            log.exception("forward failed for a batch of %d requests", len(live))
            for item in live:
                item.future.set_exception(e)
            return
        compute = time.monotonic() - started
        start = 0
        for item, outs in zip(live, _split(outputs, [i.request.batch_size for i in live])):
            item.future.set_result(outs)
            start += item.request.batch_size
        if self._observe is not None:
            self._observe(sum(i.request.batch_size for i in live), len(live), [started - i.enqueued for i in live], compute)

    def _forward(self, requests: List[ParsedRequest]) -> Dict[str, torch.Tensor]:
        r = requests[0] if len(requests) == 1 else merge(requests)
        inputs = (r.dense, r.lengths.view(-1), r.values, r.weights)
        with torch.inference_mode(), self._device_lock:
            if self._stream is None:
                return self.model(*inputs)
            return self._forward_cuda(inputs)

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
        self._stream.synchronize()
        return host


def merge(requests: List[ParsedRequest]) -> ParsedRequest:
    """Concatenates requests along the batch: request 0's examples first, then request 1's, ...

    lengths [F, B_i] join along dim 1; the ids of each request are feature-major, so the
    merged ids are ordered by feature with a stable sort (within a feature, by request).
    """
    lengths = torch.cat([r.lengths for r in requests], dim=1)
    counts = np.stack([r.id_counts for r in requests])  # [R, F] ids per request and feature
    # int16 feature numbers where they fit: numpy's stable sort of 16-bit keys is a radix sort, O(ids)
    key = np.int16 if lengths.shape[0] < 2**15 else np.int32
    feature_of_id = np.repeat(np.tile(np.arange(lengths.shape[0], dtype=key), len(requests)), counts.reshape(-1))
    order = torch.from_numpy(np.argsort(feature_of_id, kind="stable"))
    values = torch.cat([r.values for r in requests])[order]
    weights = None if requests[0].weights is None else torch.cat([r.weights for r in requests])[order]
    return ParsedRequest(int(lengths.shape[1]), torch.cat([r.dense for r in requests]), lengths, values, weights, counts.sum(0))


def _split(outputs: Dict[str, torch.Tensor], sizes: List[int]) -> List[Dict[str, torch.Tensor]]:
    parts = {name: torch.split(t, sizes) for name, t in outputs.items()}
    return [{name: parts[name][i] for name in outputs} for i in range(len(sizes))]
