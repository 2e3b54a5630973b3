"""TorchRec's training pipelines (``torchrec.distributed.train_pipeline``): one call of ``progress`` is one step.

    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    it = iter(dataloader)                  # of Batch (recship.datasets), or anything with .to(device, non_blocking)
    while True:
        try:
            output = pipeline.progress(it)  # next batch: to device, model(batch) -> (loss, output), backward, step
        except StopIteration:
            break

Each step does what the plain loop does, in TorchRec's order: ``optimizer.zero_grad()``, ``losses, output =
model(batch)``, ``torch.sum(losses, dim=0).backward()``, ``optimizer.step()`` (backward and step only while
``model.training``), and returns ``output``. The pipelines read ahead: TrainPipelineBase one batch, TrainPipelineSparseDist
two, and ``StopIteration`` comes once the batches read ahead are spent too (or, with ``execute_all_batches=False``, as
soon as the dataloader runs dry, leaving the batches read ahead untrained, as TorchRec's does).

What differs from TorchRec: TorchRec overlaps the next batches' host-to-device copy and the sharded modules'
input distribution with the current batch's forward and backward, on CUDA side streams, by rewriting the model's
sharded modules. recship's sharded modules distribute their input inside their own forward, so there is nothing to
start early: batches move to the device on the current stream when they are read, the model is never rewritten, and
the results are those of the plain loop, bit for bit. The overlap-only arguments (``pipeline_postproc``,
``dmp_collection_sync_interval_batches``) change nothing here; ``apply_jit=True`` (TorchScript the unsharded
modules) is refused, since recship does not compile the training model.

``EvalPipelineSparseDist`` runs forwards only, its batches read and moved by a ``DataLoadingThread`` in the
background (TorchRec's; on CPU the thread overlaps reading the next batch with the current forward).
"""

import abc
import functools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Generic, Iterator, List, Optional, Tuple, Type, TypeVar

import torch
from torch import nn

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class TrainPipelineContext:
    """The per-batch record a pipeline keeps (TorchRec's fields, order and defaults): ``index`` counts the batches
    read, from 0. TorchRec keeps the batch's in-flight input-distribution requests, module contexts, CUDA events and
    post-processing results in the other fields; recship's sharded modules distribute their input inside their
    forward, so those stay empty."""

    input_dist_splits_requests: Dict[str, Any] = field(default_factory=dict)
    input_dist_tensors_requests: Dict[str, Any] = field(default_factory=dict)
    module_contexts: Dict[str, Any] = field(default_factory=dict)
    module_contexts_next_batch: Dict[str, Any] = field(default_factory=dict)
    fused_splits_awaitables: List[Any] = field(default_factory=list)
    events: List[Any] = field(default_factory=list)
    postproc_fwd_results: Dict[str, Any] = field(default_factory=dict)
    index: Optional[int] = None
    version: int = 0


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """``batch.to(device, non_blocking=...)``: a tensor or a Pipelineable (Batch, KeyedJaggedTensor, ...)."""
    move = getattr(batch, "to", None)
    if not callable(move):
        raise TypeError(f"a pipeline moves each batch with batch.to(device, non_blocking=...); {type(batch).__name__} has no .to")
    return move(device, non_blocking=non_blocking)


def _device(device: Any) -> torch.device:
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device, got {device!r}")
    return torch.device(device)


class TrainPipeline(abc.ABC, Generic[In, Out]):
    """A training loop one step at a time: ``progress(dataloader_iter)`` trains on one batch and returns the model's
    output for it; ``StopIteration`` when there is nothing left to train on."""

    @abc.abstractmethod
    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        ...

    def reset(self) -> None:
        """Forget the batches read ahead (the next ``progress`` starts on a fresh iterator)."""


class _Stepper:
    """The step both pipelines share: zero_grad, forward, backward of the summed losses, optimizer step."""

    _model: nn.Module
    _optimizer: torch.optim.Optimizer
    _custom_fwd: Optional[Callable[[Any], Tuple[torch.Tensor, Any]]]

    def _step(self, batch: Any, after_forward: Optional[Callable[[], Any]] = None) -> Any:
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        result = (self._custom_fwd if self._custom_fwd is not None else self._model)(batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"a pipelined model returns (losses, output), as TorchRec's DLRMTrain does; {type(self._model).__name__} "
                            f"returned {type(result).__name__}")
        if after_forward is not None:
            after_forward()
        losses, output = result
        if training:
            # TorchRec sums the losses over dim 0: a scalar loss is itself, per-example losses [B] add up
            torch.sum(losses, dim=0).backward()
            self._optimizer.step()
        return output


class TrainPipelineBase(_Stepper, TrainPipeline[In, Out]):
    """TorchRec's base pipeline: reads one batch ahead and trains on the one before it.

    Args:
        model: ``model(batch) -> (losses, output)``; losses: a scalar, or [B] (summed before backward).
        optimizer: stepped after every backward (every optimizer the model needs, e.g. a CombinedOptimizer of the
            dense one and DMP's ``fused_optimizer``).
        device: where each batch is moved (``batch.to(device, non_blocking=True)``).
        custom_model_fwd: called instead of ``model(batch)`` when given.
        enable_inplace_copy_batch: TorchRec allocates the device copy of a batch on its copy stream (a CUDA memory
            saving); the batch is the same either way, so it changes nothing here.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 custom_model_fwd: Optional[Callable[[Any], Tuple[torch.Tensor, Any]]] = None,
                 enable_inplace_copy_batch: bool = False) -> None:
        self._enable_inplace_copy_batch = enable_inplace_copy_batch
        self._model = model
        self._optimizer = optimizer
        self._device = _device(device)
        self._custom_fwd = custom_model_fwd
        self._cur_batch: Optional[Any] = None
        self._connected = False
        self._data_iter_stopped = False

    def _next_batch(self, dataloader_iter: Iterator[In]) -> Optional[In]:
        try:
            return next(dataloader_iter)
        except StopIteration:
            self._data_iter_stopped = True
            return None

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Trains on the batch read last time (the first call reads it now) after reading the next one."""
        if not self._connected:
            first = next(dataloader_iter)  # an empty iterator stops the first call here, as TorchRec's does
            self._cur_batch = None if first is None else _to_device(first, self._device, non_blocking=True)
            self._connected = True
        if self._data_iter_stopped:
            raise StopIteration
        next_batch = self._next_batch(dataloader_iter)
        output = self._step(self._cur_batch)
        self._cur_batch = None if next_batch is None else _to_device(next_batch, self._device, non_blocking=True)
        return output

    def reset(self) -> None:
        self._connected = False
        self._data_iter_stopped = False
        self._cur_batch = None


class TrainPipelineSparseDist(_Stepper, TrainPipeline[In, Out]):
    """TorchRec's sparse-data-distribution pipeline: up to three batches in flight (the one trained on, the next
    two read ahead), each step trains on the oldest.

    Args:
        model: ``model(batch) -> (losses, output)``, usually DistributedModelParallel around a DLRMTrain-like model.
        optimizer: stepped after every backward.
        device: where each batch is moved.
        execute_all_batches: True: train on the batches read ahead after the dataloader runs dry, then stop;
            False: stop as soon as it runs dry (the last batches read ahead are not trained on).
        apply_jit: must be False (recship does not TorchScript the training model).
        context_type: the class of the per-batch records in ``contexts`` (TrainPipelineContext or a subclass).
        pipeline_postproc, dmp_collection_sync_interval_batches: overlap and 2D-sharding settings of TorchRec's; no
            effect in recship (nothing is overlapped, there is no DMPCollection).
        custom_model_fwd: called instead of ``model(batch)`` when given.
        enqueue_batch_after_forward: read batch i+2 after batch i's forward instead of before it.
        enable_inplace_copy_batch, free_features_storage_early, clear_data_dist_inputs: TorchRec's CUDA memory savings
            around its early input distribution (copy on the copy stream, free the host KJT once distributed, drop
            the distribution's inputs once done); there is no early distribution here, so they change nothing.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, execute_all_batches: bool = True,
                 apply_jit: bool = False, context_type: Type[TrainPipelineContext] = TrainPipelineContext,
                 pipeline_postproc: bool = False, custom_model_fwd: Optional[Callable[[Any], Tuple[torch.Tensor, Any]]] = None,
                 dmp_collection_sync_interval_batches: Optional[int] = 1, enqueue_batch_after_forward: bool = False,
                 enable_inplace_copy_batch: bool = False, free_features_storage_early: bool = False,
                 clear_data_dist_inputs: bool = False) -> None:
        self._enable_inplace_copy_batch = enable_inplace_copy_batch
        self._free_features_storage_early = free_features_storage_early
        self._clear_data_dist_inputs = clear_data_dist_inputs
        if apply_jit:
            raise ValueError("TrainPipelineSparseDist(apply_jit=True): recship does not TorchScript the training model "
                             "(its sharded modules run eagerly); pass apply_jit=False")
        if not (isinstance(context_type, type) and issubclass(context_type, TrainPipelineContext)):
            raise TypeError(f"context_type must be TrainPipelineContext or a subclass, got {context_type!r}")
        self._model = model
        self._optimizer = optimizer
        self._device = _device(device)
        self._execute_all_batches = execute_all_batches
        self._context_type = context_type
        self._enqueue_batch_after_forward = enqueue_batch_after_forward
        self._custom_fwd = custom_model_fwd
        self.batches: Deque[Any] = deque()
        self.contexts: Deque[TrainPipelineContext] = deque()
        self._next_index = 0
        self._dataloader_iter: Optional[Iterator[In]] = None
        self._dataloader_exhausted = False
        self._model_attached = True

    # -- reading batches --------------------------------------------------------------------------------------------

    def _next_batch(self, dataloader_iter: Iterator[In]) -> Optional[In]:
        """The next batch, or None once the iterator is spent (never calling next() on it again: a spent
        distributed dataloader may hang)."""
        if dataloader_iter is not self._dataloader_iter:
            self._dataloader_iter, self._dataloader_exhausted = dataloader_iter, False
        if self._dataloader_exhausted:
            return None
        batch = next(dataloader_iter, None)
        self._dataloader_exhausted = batch is None
        return batch

    def copy_batch_to_gpu(self, dataloader_iter: Iterator[In]) -> Tuple[Optional[In], Optional[TrainPipelineContext]]:
        """Reads the next batch and moves it to the device (any device, despite TorchRec's name), with its context.
        A spent iterator gives (None, context), or raises StopIteration when ``execute_all_batches`` is False."""
        context = self._context_type(index=self._next_index)
        self._next_index += 1
        batch = self._next_batch(dataloader_iter)
        if batch is None:
            if not self._execute_all_batches:
                raise StopIteration
            return None, context
        return _to_device(batch, self._device, non_blocking=True), context

    def inplace_copy_batch_to_gpu(self, dataloader_iter: Iterator[In]) -> Tuple[Optional[In], Optional[TrainPipelineContext]]:
        """``copy_batch_to_gpu`` (TorchRec's variant allocates on its copy stream; the batch is the same)."""
        return self.copy_batch_to_gpu(dataloader_iter)

    def enqueue_batch(self, dataloader_iter: Iterator[In]) -> bool:
        """Reads one batch into the pipeline; False when there was none."""
        batch, context = self.copy_batch_to_gpu(dataloader_iter)
        if batch is None:
            return False
        self.batches.append(batch)
        self.contexts.append(context)  # type: ignore[arg-type]
        return True

    def dequeue_batch(self) -> None:
        self.batches.popleft()
        self.contexts.popleft()

    def fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        """At the start (no batch in flight), reads batches i and i+1; otherwise nothing, except that with
        ``execute_all_batches=False`` a pipeline down to its last batch tries to read more (and so stops)."""
        if len(self.batches) >= 2 or (self.batches and self._execute_all_batches):
            return
        if self.enqueue_batch(dataloader_iter):
            self.enqueue_batch(dataloader_iter)

    # -- the step ---------------------------------------------------------------------------------------------------

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Trains on the oldest batch in flight after reading one more; StopIteration when none is left."""
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        read_next = functools.partial(self.enqueue_batch, dataloader_iter)  # batch i+2
        if not self._enqueue_batch_after_forward:
            read_next()
        output = self._step(self.batches[0], after_forward=read_next if self._enqueue_batch_after_forward else None)
        self.dequeue_batch()
        return output

    def detach(self) -> nn.Module:
        """The model, for use outside the pipeline (TorchRec restores the forwards it rewrote; recship rewrote none).
        The batches in flight are kept: ``attach`` (or the next ``progress``) resumes."""
        self._model_attached = False
        return self._model

    def attach(self, model: Optional[nn.Module] = None, sparse_dist: bool = True) -> None:
        """Trains ``model`` (or the detached one) from the next ``progress`` on."""
        if model is not None:
            self._model = model
        self._model_attached = True

    def reset(self) -> None:
        self.batches.clear()
        self.contexts.clear()
        self._next_index = 0
        self._dataloader_iter, self._dataloader_exhausted = None, False


def _retriable(exc: Exception) -> bool:
    """TorchRec's test: the exception (or its cause) says ``is_retryable``."""
    for e in (exc, exc.__cause__):
        if e is not None and hasattr(e, "is_retryable"):
            return bool(e.is_retryable)
    return False


class DataLoadingThread(threading.Thread, Generic[In]):
    """Reads the next batch and moves it to ``device`` in a background thread, one batch ahead (TorchRec's).

    ``get_next_batch()`` waits for the buffered batch, hands it over and lets the thread read the next; None (or
    StopIteration with ``none_throws``) once the iterator is spent. An exception from the iterator is re-raised by
    the next ``get_next_batch`` (one whose ``is_retryable`` is true skips that batch, as TorchRec's). A daemon
    thread: ``stop()`` ends it.

    Args:
        device: where each batch goes (``batch.to(device, non_blocking=to_device_non_blocking)``).
        dataloader_iter: the batches.
        to_device_non_blocking: passed to ``batch.to``.
        memcpy_stream_priority, memcpy_stream: TorchRec's CUDA copy stream (its priority, or one to use); on CUDA the
            copy runs on it, elsewhere there is none.
    """

    def __init__(self, device: torch.device, dataloader_iter: Iterator[In], to_device_non_blocking: bool,
                 memcpy_stream_priority: int = 0, memcpy_stream: Optional[torch.Stream] = None) -> None:
        super().__init__(name="DataLoadingThread", daemon=True)
        self._device = _device(device)
        self._dataloader_iter = dataloader_iter
        self._to_device_non_blocking = to_device_non_blocking
        if memcpy_stream is None and self._device.type == "cuda":
            memcpy_stream = torch.cuda.Stream(device=self._device, priority=memcpy_stream_priority)
        self._memcpy_stream = memcpy_stream
        self._stopping = False
        self._buffered: Optional[In] = None
        self._exception: Optional[Exception] = None
        self._buffer_empty = threading.Event()
        self._buffer_filled = threading.Event()
        self._buffer_empty.set()

    def run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while not self._stopping:
            self._buffer_empty.wait()
            if self._stopping:
                break
            try:
                batch = next(self._dataloader_iter)
            except StopIteration:
                break
            except Exception as e:  # handed to the reading thread by get_next_batch
                if _retriable(e):
                    continue
                self._exception = e
                break
            if self._memcpy_stream is not None:
                with torch.cuda.stream(self._memcpy_stream):  # type: ignore[arg-type]
                    self._buffered = _to_device(batch, self._device, self._to_device_non_blocking)
            else:
                self._buffered = _to_device(batch, self._device, self._to_device_non_blocking)
            self._buffer_empty.clear()
            self._buffer_filled.set()
        self._stopping = True
        self._buffer_filled.set()

    def stop(self) -> None:
        """Ends the thread after the batch it is reading, if any."""
        self._stopping = True
        self._buffer_filled.set()
        self._buffer_empty.set()

    def get_next_batch(self, none_throws: bool = False) -> Optional[In]:
        """The next batch on the device; None at the end (StopIteration if ``none_throws``). Main thread only."""
        self._buffer_filled.wait()
        if self._exception is not None:
            exc, self._exception = self._exception, None
            raise exc
        batch = self._buffered
        if batch is None:
            if none_throws:
                raise StopIteration
            return None
        self._buffered = None
        self._buffer_filled.clear()
        self._buffer_empty.set()
        return batch


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out]):
    """TorchRec's evaluation pipeline: ``progress`` runs the forward of the next batch and returns its output; no
    backward, no optimizer step (``optimizer`` is taken for TorchRec's signature and never stepped), and the model's
    train/eval mode is left as the caller set it, as TorchRec's. Batches are read and moved to the device by a
    DataLoadingThread, one ahead; StopIteration when they are spent.

    Args:
        model: ``model(batch) -> (losses, output)``.
        optimizer: unused.
        device: where each batch goes.
        apply_jit: must be False.
        pipeline_postproc, enable_inplace_copy_batch, free_features_storage_early, clear_data_dist_inputs: as
            TrainPipelineSparseDist's (no effect here).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, apply_jit: bool = False,
                 pipeline_postproc: bool = False, enable_inplace_copy_batch: bool = False,
                 free_features_storage_early: bool = False, clear_data_dist_inputs: bool = False) -> None:
        super().__init__(model, optimizer, device, execute_all_batches=True, apply_jit=apply_jit,
                         pipeline_postproc=pipeline_postproc, enable_inplace_copy_batch=enable_inplace_copy_batch,
                         free_features_storage_early=free_features_storage_early, clear_data_dist_inputs=clear_data_dist_inputs)
        self._batch_loader: Optional[DataLoadingThread[In]] = None

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """The model's output for the next batch (its forward only)."""
        if self._batch_loader is None:
            self._batch_loader = DataLoadingThread(self._device, dataloader_iter, to_device_non_blocking=True)
            self._batch_loader.start()
        batch = self._batch_loader.get_next_batch()
        if batch is None:
            raise StopIteration
        self._next_index += 1
        result = (self._custom_fwd if self._custom_fwd is not None else self._model)(batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"a pipelined model returns (losses, output), as TorchRec's DLRMTrain does; {type(self._model).__name__} "
                            f"returned {type(result).__name__}")
        return result[1]

    def reset(self) -> None:
        super().reset()
        if self._batch_loader is not None:
            self._batch_loader.stop()
        self._batch_loader = None

    def __del__(self) -> None:
        if getattr(self, "_batch_loader", None) is not None:
            self._batch_loader.stop()  # type: ignore[union-attr]
