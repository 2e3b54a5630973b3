"""CPUOffloadedRecMetricModule: a RecMetricModule whose updates and computes run on two worker threads, so the
training loop only enqueues.

``update(model_out)`` queues the model outputs; the update thread moves them to the CPU, merges up to
``update_batch_size`` queued updates into one (concatenated along the batch) and updates the metrics.
``async_compute()`` queues a marker and returns a pending ``DeferrableMetrics``: when the update thread reaches the
marker (all earlier updates applied, on every rank alike) it snapshots the states; the compute thread loads the
snapshot into a ``CPUCommsRecMetricModule``, all-gathers over a gloo group, computes and resolves the result.
``compute()`` is refused (use ``async_compute()``); ``state_dict()`` is the gathered states of the last compute.
"""

import atexit
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Deque, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist

from recship.metrics.cpu_comms_metric_module import CPUCommsRecMetricModule
from recship.metrics.deferrable_metrics import DeferrableMetrics, device_supports_async, transfer_tensors_to_cpu
from recship.metrics.metric_job_types import MetricComputeJob, MetricUpdateJob, SynchronizationMarker
from recship.metrics.metric_module import MetricsResult, RecMetricModule
from recship.metrics.metric_state_snapshot import MetricStateSnapshot
from recship.metrics.model_utils import parse_task_model_outputs
from recship.metrics.rec_metric import RecMetricException

logger: logging.Logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.5


class PercentileLogger:
    """Keeps the last ``window_size`` values of a measurement and logs their p50/p90/p99 every ``log_interval``
    additions."""

    def __init__(self, metric_name: str, window_size: int = 1000, log_interval: int = 100) -> None:
        self.metric_name = metric_name
        self._values: Deque[float] = collections.deque(maxlen=window_size)
        self._log_interval = log_interval
        self._count = 0

    def add(self, value: float) -> None:
        self._values.append(float(value))
        self._count += 1
        if self._log_interval > 0 and self._count % self._log_interval == 0:
            self.log_percentiles()

    def log_percentiles(self) -> None:
        if not self._values:
            return
        values = torch.tensor(list(self._values), dtype=torch.double)
        p50, p90, p99 = torch.quantile(values, torch.tensor([0.5, 0.9, 0.99], dtype=torch.double)).tolist()
        logger.info("%s: p50 %.3f p90 %.3f p99 %.3f (n=%d)", self.metric_name, p50, p90, p99, len(values))


def _merge_tensors(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors) if tensors[0].dim() == 0 else torch.cat(tensors, dim=0)


def _merge_update_jobs(jobs: List[MetricUpdateJob]) -> MetricUpdateJob:
    """One job of the jobs' model outputs (and required inputs) concatenated along the batch; the other kwargs
    are the first job's."""
    if len(jobs) == 1:
        return jobs[0]
    first = jobs[0]
    model_out = {key: _merge_tensors([j.model_out[key] for j in jobs]) for key in first.model_out}
    kwargs = dict(first.kwargs)
    required = first.kwargs.get("required_inputs")
    if isinstance(required, dict) and required:
        kwargs["required_inputs"] = {key: _merge_tensors([j.kwargs["required_inputs"][key] for j in jobs]) for key in required}
    return MetricUpdateJob(model_out, kwargs, merged_count=sum(j.merged_count for j in jobs))


def _clone_tensors(mapping: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else _clone_tensors(v) if isinstance(v, dict) else v
            for k, v in mapping.items()}


class CPUOffloadedRecMetricModule(RecMetricModule):
    """Args:
        model_out_device (torch.device): where the model outputs live (CUDA: copied to pinned host memory
            without blocking).
        update_queue_size, compute_queue_size (int): queue bounds; a full queue raises RecMetricException.
        update_batch_size (int): updates merged into one by the update thread (1: none).
        clone_model_out (bool): clone the model outputs when queueing (the caller may then reuse its tensors).
        *args, **kwargs: RecMetricModule's.
    """

    def __init__(
        self,
        model_out_device: torch.device,
        update_queue_size: int = 100,
        compute_queue_size: int = 100,
        update_batch_size: int = 10,
        clone_model_out: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._model_out_device = model_out_device
        self._update_batch_size = max(1, update_batch_size)
        self._clone_model_out = clone_model_out
        self._shutdown_event = threading.Event()
        self._shutdown_complete = False
        self._captured_exception: Optional[BaseException] = None
        self.update_queue: "queue.Queue[Union[MetricUpdateJob, SynchronizationMarker]]" = queue.Queue(update_queue_size)
        self.compute_queue: "queue.Queue[MetricComputeJob]" = queue.Queue(compute_queue_size)
        distributed = dist.is_available() and dist.is_initialized()
        self.cpu_process_group: Optional[dist.ProcessGroup] = dist.new_group(backend="gloo") if distributed else None
        self.comms_module = CPUCommsRecMetricModule(*args, **kwargs)
        self.update_job_time_logger = PercentileLogger("update_job_time_ms", log_interval=1000)
        self.compute_job_time_logger = PercentileLogger("compute_job_time_ms", log_interval=10)
        self.update_thread = threading.Thread(target=self._update_loop, name="metric_update", daemon=True)
        self.compute_thread = threading.Thread(target=self._compute_loop, name="metric_compute", daemon=True)
        self.update_thread.start()
        self.compute_thread.start()
        atexit.register(self.shutdown)

    # -- the training thread ----------------------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._shutdown_event.is_set():
            raise RecMetricException("metric processor thread is shut down.")
        if self._captured_exception is not None:
            raise self._captured_exception

    def update(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._update_rec_metrics(model_out, **kwargs)
        self.trained_batches += 1

    def _update_rec_metrics(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._raise_if_failed()
        job = MetricUpdateJob(
            _clone_tensors(model_out) if self._clone_model_out else dict(model_out),
            _clone_tensors(kwargs) if self._clone_model_out else dict(kwargs),
        )
        try:
            self.update_queue.put_nowait(job)
        except queue.Full:
            raise RecMetricException(f"update metric queue is full ({self.update_queue.maxsize} jobs)") from None

    def compute(self) -> DeferrableMetrics:
        raise RecMetricException("CPUOffloadedRecMetricModule does not support compute(). Use async_compute() instead.")

    def async_compute(self) -> DeferrableMetrics:  # type: ignore[override]
        """The values after every update queued so far, when the worker threads get there."""
        future: "concurrent.futures.Future[MetricsResult]" = concurrent.futures.Future()
        if self._shutdown_event.is_set():
            future.set_exception(RecMetricException("metric processor thread is shut down."))
            return DeferrableMetrics(future)
        self._raise_if_failed()
        try:
            self.update_queue.put_nowait(SynchronizationMarker(future))
        except queue.Full:
            raise RecMetricException("update queue is full when enqueueing compute marker.") from None
        return DeferrableMetrics(future)

    def wait_until_queue_is_empty(self, metric_job_queue: "queue.Queue[Any]") -> None:
        metric_job_queue.join()

    def sync(self) -> None:
        """Gather the states across ranks (through a compute; needed before checkpointing)."""
        self.async_compute().resolve()

    def unsync(self) -> None:
        pass  # the local states are never replaced

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:  # type: ignore[override]
        """The gathered states of the last compute (``sync()`` first for the current ones)."""
        return self.comms_module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Into the local metrics (the comms module is rebuilt from them at each compute)."""
        comms = self._modules.pop("comms_module", None)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            if comms is not None:
                self._modules["comms_module"] = comms

    def shutdown(self) -> None:
        """Finish the queued work, stop both threads; raise what a worker raised."""
        if self._shutdown_complete:
            return
        self._shutdown_complete = True
        self._shutdown_event.set()
        self.update_thread.join()
        self.compute_thread.join()
        if self._captured_exception is not None:
            raise self._captured_exception

    # -- the worker threads -----------------------------------------------------------------------------------------

    def _process_metric_update_job(self, job: MetricUpdateJob) -> None:
        start = time.time()
        model_out, event = (
            transfer_tensors_to_cpu(job.model_out) if device_supports_async(self._model_out_device) else (job.model_out, None)
        )
        if event is not None:
            event.synchronize()
        labels, predictions, weights, required = parse_task_model_outputs(self.rec_tasks, model_out, self.get_required_inputs())
        if required:
            job.kwargs["required_inputs"] = required
        self.rec_metrics.update(predictions=predictions, labels=labels, weights=weights, **job.kwargs)
        if self.throughput_metric:
            for _ in range(job.merged_count):
                self.throughput_metric.update()
        self.update_job_time_logger.add((time.time() - start) * 1000)

    def _process_synchronization_marker(self, marker: SynchronizationMarker) -> None:
        if not self.rec_metrics:
            raise RecMetricException("No metrics to compute.")
        snapshot = MetricStateSnapshot.from_metrics(self.rec_metrics, self.throughput_metric)
        self.compute_queue.put(MetricComputeJob(marker.future, snapshot))

    def _process_metric_compute_job(self, job: MetricComputeJob) -> MetricsResult:
        start = time.time()
        self.comms_module.load_local_metric_state_snapshot(job.metric_state_snapshot)
        self.comms_module.load_pre_compute_states(self.comms_module.get_pre_compute_states(self.cpu_process_group))
        result = self.comms_module.compute().resolve()
        self.compute_count += 1
        self._adjust_compute_interval()
        self.compute_job_time_logger.add((time.time() - start) * 1000)
        return result

    def _next_update_batch(self) -> Optional[tuple]:
        """(jobs, marker) drained from the update queue: up to update_batch_size jobs, stopping at a marker."""
        try:
            first = self.update_queue.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            return None
        jobs: List[MetricUpdateJob] = []
        marker: Optional[SynchronizationMarker] = first if isinstance(first, SynchronizationMarker) else None
        if isinstance(first, MetricUpdateJob):
            jobs.append(first)
            while len(jobs) < self._update_batch_size:
                try:
                    item = self.update_queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    if self._shutdown_event.is_set():
                        break
                    continue
                if isinstance(item, SynchronizationMarker):
                    marker = item
                    break
                jobs.append(item)
        return jobs, marker

    def _update_loop(self) -> None:
        while True:
            drained = self._next_update_batch()
            if drained is None:
                if self._shutdown_event.is_set():
                    return
                continue
            jobs, marker = drained
            try:
                if jobs:
                    self._process_metric_update_job(_merge_update_jobs(jobs))
                if marker is not None:
                    self._process_synchronization_marker(marker)
            except Exception as error:  # kept, raised to the training thread at its next call; pending computes fail
                self._captured_exception = error
                if marker is not None and not marker.future.done():
                    marker.future.set_exception(error)
                self._drain_failed(error)
                return
            finally:
                for _ in range(len(jobs) + (marker is not None)):
                    self.update_queue.task_done()

    def _compute_loop(self) -> None:
        while True:
            try:
                job = self.compute_queue.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if self._shutdown_event.is_set() and not self.update_thread.is_alive():
                    return
                continue
            try:
                job.future.set_result(self._process_metric_compute_job(job))
            except Exception as error:  # the Future carries it; the module refuses further work
                self._captured_exception = error
                if not job.future.done():
                    job.future.set_exception(error)
                self._drain_failed(error)
                return
            finally:
                self.compute_queue.task_done()

    def _drain_failed(self, error: BaseException) -> None:
        for pending in (self.update_queue, self.compute_queue):
            while True:
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    break
                future = getattr(item, "future", None)
                if future is not None and not future.done():
                    future.set_exception(error)
                pending.task_done()
