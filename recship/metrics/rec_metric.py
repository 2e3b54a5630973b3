"""RecMetric: one metric over one or more tasks, and RecMetricComputation, the states and math behind it.

A RecMetric parses nothing itself: ``update(predictions=, labels=, weights=)`` takes the per-task tensors that
``recship.metrics.model_utils.parse_task_model_outputs`` pulls out of a model's output dict, and ``compute()``
returns ``{"{namespace}-{task}|{prefix}{name}": value}``. Per task the values are of shape [1] (one computation
per task, UNFUSED_TASKS_COMPUTATION) or [] (one computation for all tasks, the fused modes).

Two spans per metric: the lifetime states add every batch; the window states hold the last ``window_size`` samples
(the global window divided by the world size, per rank), kept by a ``WindowBuffer`` of per-batch contributions:
a batch is dropped whole once the samples after it fill the window.
"""

import abc
import functools
import itertools
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo
from recship.metrics.metrics_namespace import MetricNameBase, MetricNamespaceBase, MetricPrefix, compose_metric_key
from recship.metrics.synced_states import MAX_BUFFER_COUNT, SyncedStates, WindowBuffer

RecModelOutput = Union[torch.Tensor, Dict[str, torch.Tensor]]
ComputeIterType = Iterator[Tuple[RecTaskInfo, MetricNameBase, torch.Tensor, str, Optional[str]]]

_FUSED_MODES = (RecComputeMode.FUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION)


@dataclass(frozen=True)
class MetricComputationReport:
    """One value a computation reports: ``value`` is [n_tasks]."""

    name: MetricNameBase
    metric_prefix: MetricPrefix
    value: torch.Tensor
    description: Optional[str] = None


class RecMetricException(Exception):
    pass


def pt2_compile_callable(f: Callable) -> Callable:
    """Decorates a metric method: when the object's ``enable_pt2_compile`` is true the method runs through
    ``torch.compile`` (compiled once per object), else as it is."""

    @functools.wraps(f)
    def maybe_compiled(ref: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(ref, "enable_pt2_compile", False):
            name = f"_{f.__name__}_pt2_compiled"
            if not hasattr(ref, name):
                setattr(ref, name, torch.compile(f))
            return getattr(ref, name)(ref, *args, **kwargs)
        return f(ref, *args, **kwargs)

    return maybe_compiled


class RecMetricComputation(SyncedStates, abc.ABC):
    r"""The math of one metric over ``n_tasks`` tasks: ``update()`` adds a batch to the states (tensors of
    [n_tasks, B]), ``_compute()`` turns the states into ``MetricComputationReport``\ s.

    ``compute()`` reduces the states across the ranks of ``process_group`` first (when a process group is
    initialized), computes on rank 0 (every rank with ``compute_on_all_ranks``; the others get []), and keeps the
    local states; it caches its result until the next ``update``. ``local_compute()`` uses this rank's states.

    Args:
        my_rank (int): this trainer's rank.
        batch_size (int): the local batch size.
        n_tasks (int): the tasks this computation holds (the leading dim of every state).
        window_size (int): this rank's window in samples (0: no window states).
        compute_on_all_ranks (bool): every rank gets the global values.
        should_validate_update (bool): keep a ``has_valid_update`` state per task.
        compute_mode (RecComputeMode): kept for metrics whose math depends on it.
        process_group (Optional[ProcessGroup]): the ranks to reduce over (default: the world).
        fused_update_limit (int): kept for metrics that refuse fused updates.
        allow_missing_label_with_zero_weight (bool): kept for metrics that accept it.
    """

    _batch_window_buffers: Optional[Dict[str, WindowBuffer]]

    def __init__(
        self,
        my_rank: int,
        batch_size: int,
        n_tasks: int,
        window_size: int,
        compute_on_all_ranks: bool = False,
        should_validate_update: bool = False,
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        process_group: Optional[dist.ProcessGroup] = None,
        fused_update_limit: int = 0,
        allow_missing_label_with_zero_weight: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._enable_pt2_compile: bool = bool(kwargs.pop("enable_pt2_compile", False))
        if args or kwargs:
            raise TypeError(
                f"{type(self).__name__} got arguments it does not take: {list(args) + sorted(kwargs)} (a metric's "
                "own options go in RecMetricDef.arguments under the names its computation accepts)"
            )
        super().__init__(process_group=process_group)
        self._my_rank = my_rank
        self._n_tasks = n_tasks
        self._batch_size = batch_size
        self._window_size = window_size
        self._compute_on_all_ranks = compute_on_all_ranks
        self._should_validate_update = should_validate_update
        self._compute_mode = compute_mode
        self._batch_window_buffers = {} if window_size > 0 else None
        if should_validate_update:
            self._add_state(
                "has_valid_update",
                torch.zeros(n_tasks, dtype=torch.uint8),
                add_window_state=False,
                dist_reduce_fx=lambda x: torch.any(x, dim=0).byte(),
                persistent=True,
            )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        update = cls.__dict__.get("update")
        if update is not None and not getattr(update, "_counts_updates", False):
            cls.update = _counting_updates(update)  # type: ignore[method-assign]

    @staticmethod
    def get_window_state_name(state_name: str) -> str:
        return f"window_{state_name}"

    def get_window_state(self, state_name: str) -> torch.Tensor:
        return getattr(self, self.get_window_state_name(state_name))

    def _add_state(self, name: str, default: Any, add_window_state: bool, **kwargs: Any) -> None:
        """``add_state(name, default, **kwargs)``, and with ``add_window_state`` a non-persistent
        ``window_{name}`` kept by a WindowBuffer of this computation's window size."""
        self.add_state(name, default, **kwargs)
        if add_window_state:
            if self._batch_window_buffers is None:
                raise RuntimeError(f"{type(self).__name__}: a window state {name!r} with window_size 0")
            kwargs["persistent"] = False
            window_name = self.get_window_state_name(name)
            self.add_state(window_name, default.detach().clone(), **kwargs)
            self._batch_window_buffers[window_name] = WindowBuffer(self._window_size, MAX_BUFFER_COUNT)

    def _aggregate_window_state(self, state_name: str, state: torch.Tensor, num_samples: int) -> None:
        if self._batch_window_buffers is None:
            raise RuntimeError(f"{type(self).__name__}: no window states (window_size 0)")
        window_name = self.get_window_state_name(state_name)
        self._batch_window_buffers[window_name].aggregate_state(getattr(self, window_name), state, num_samples)

    def _given(
        self, predictions: Optional[torch.Tensor], weights: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(predictions, weights) of an update that needs both; RecMetricException (TorchRec's text) for a None."""
        if predictions is None or weights is None:
            raise RecMetricException(
                f"Inputs 'predictions' and 'weights' should not be None for {type(self).__name__} update"
            )
        return predictions, weights

    def _maybe_compile(self, fn: Callable) -> Callable:
        return torch.compile(fn) if self._enable_pt2_compile else fn

    def _add_sums(self, states: Dict[str, torch.Tensor], num_samples: int) -> None:
        """Add each [n_tasks] batch sum to its lifetime state and to its window."""
        for name, value in states.items():
            state = getattr(self, name)
            state += value
            self._aggregate_window_state(name, value, num_samples)

    @abc.abstractmethod
    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:  # pragma: no cover
        pass

    @abc.abstractmethod
    def _compute(self) -> List[MetricComputationReport]:  # pragma: no cover
        pass

    def pre_compute(self) -> None:
        """Work on the local states before ``compute()`` reduces them across ranks (none by default)."""

    def compute(self) -> List[MetricComputationReport]:
        if self._computed is not None:
            return self._computed
        synced_here = self._to_sync and not self._is_synced and self._distributed()
        if synced_here:
            self.sync()
        try:
            reports = self._compute() if self._my_rank == 0 or self._compute_on_all_ranks else []
        finally:
            if synced_here:
                self.unsync()
        self._computed = reports
        return reports

    def local_compute(self) -> List[MetricComputationReport]:
        return self._compute()

    def reset(self) -> None:
        super().reset()
        if self._batch_window_buffers is not None:
            self._batch_window_buffers = {
                name: WindowBuffer(self._window_size, MAX_BUFFER_COUNT) for name in self._batch_window_buffers
            }


def _counting_updates(update: Callable) -> Callable:
    def counted(self: RecMetricComputation, *args: Any, **kwargs: Any) -> None:
        self._computed = None
        self._update_count += 1
        with torch.no_grad():
            update(self, *args, **kwargs)

    counted._counts_updates = True  # type: ignore[attr-defined]
    counted.__doc__, counted.__name__, counted.__qualname__ = update.__doc__, update.__name__, update.__qualname__
    return counted


class RecMetric(nn.Module, abc.ABC):
    r"""A metric over the tasks of a model: subclasses set ``_namespace`` and ``_computation_class``.

    Args:
        world_size (int): the number of trainers.
        my_rank (int): this trainer's rank.
        batch_size (int): the local batch size.
        tasks (List[RecTaskInfo]): the tasks.
        compute_mode (RecComputeMode): one computation per task or one for all.
        window_size (int): the global window in samples; ``ceil(window_size / world_size)`` per rank, at least
            ``batch_size``.
        fused_update_limit (int): > 0 buffers that many updates and applies them as one batch.
        compute_on_all_ranks (bool): every rank gets the global values.
        should_validate_update (bool): skip a task's update when its weights are all zero; a task with no valid
            update reports zeros.
        process_group (Optional[ProcessGroup]): the ranks ``compute()`` reduces over.
        **kwargs: the metric's own options (``include_logloss``, ``threshold``, ...), passed to its computation.

    Example::

        ne = NEMetric(world_size=1, my_rank=0, batch_size=4, tasks=[DefaultTaskInfo], window_size=8)
        ne.update(predictions={"DefaultTask": p}, labels={"DefaultTask": l}, weights=None)  # p, l: [4]
        ne.compute()  # {"ne-DefaultTask|lifetime_ne": tensor([..]), "ne-DefaultTask|window_ne": tensor([..])}
    """

    _computation_class: Type[RecMetricComputation]
    _namespace: MetricNamespaceBase
    _metrics_computations: nn.ModuleList

    PREDICTIONS: str = "predictions"
    LABELS: str = "labels"
    WEIGHTS: str = "weights"
    # The option (e.g. "grouped_auc") that, when true, makes the metric read the "grouping_keys" model output.
    _grouping_option: Optional[str] = None

    def __init__(
        self,
        world_size: int,
        my_rank: int,
        batch_size: int,
        tasks: List[RecTaskInfo],
        compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size: int = 100,
        fused_update_limit: int = 0,
        compute_on_all_ranks: bool = False,
        should_validate_update: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        **kwargs: Any,
    ) -> None:
        if compute_mode in _FUSED_MODES and fused_update_limit > 0:
            raise ValueError("The fused tasks computation and the fused update cannot be set at the same time")
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        super().__init__()
        self._world_size = world_size
        self._my_rank = my_rank
        self._window_size = math.ceil(window_size / world_size)
        self._batch_size = batch_size
        self._metrics_computations = nn.ModuleList()
        self._tasks = tasks
        self._compute_mode = compute_mode
        self._fused_update_limit = fused_update_limit
        self._should_validate_update = should_validate_update
        self._default_weights: Dict[Tuple[int, ...], torch.Tensor] = {}
        self._required_inputs: Set[str] = set()
        self._update_buffers: Dict[str, List[RecModelOutput]] = {self.PREDICTIONS: [], self.LABELS: [], self.WEIGHTS: []}
        self.enable_pt2_compile = bool(kwargs.pop("enable_pt2_compile", False))
        self._should_clone_update_inputs = bool(kwargs.pop("should_clone_update_inputs", False))
        kwargs.pop("batch_size_stages", None)
        if self._window_size < self._batch_size:
            raise ValueError(
                "Local window size must be larger than batch size. Got local window size "
                f"{self._window_size} and batch size {self._batch_size}."
            )
        fused = compute_mode in _FUSED_MODES
        self._tasks_iter: Callable[[str], ComputeIterType] = self._fused_tasks_iter if fused else self._unfused_tasks_iter
        for task_config in [tasks] if fused else tasks:
            self._metrics_computations.append(
                self._computation_class(
                    my_rank=my_rank,
                    batch_size=batch_size,
                    n_tasks=len(tasks) if fused else 1,
                    window_size=self._window_size,
                    compute_on_all_ranks=compute_on_all_ranks,
                    should_validate_update=should_validate_update,
                    compute_mode=compute_mode,
                    process_group=process_group,
                    **{
                        **kwargs,
                        "fused_update_limit": fused_update_limit,
                        **self._get_task_kwargs(task_config),
                        "enable_pt2_compile": self.enable_pt2_compile,
                    },
                )
            )
            self._required_inputs.update(self._get_task_required_inputs(task_config))
        self._required_inputs.update(self._get_option_required_inputs(kwargs))

    def _get_task_kwargs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Dict[str, Any]:
        return {}

    @property
    def computations(self) -> List[RecMetricComputation]:
        """The computations: one per task, or one for all tasks in the fused modes."""
        return list(self._metrics_computations)  # type: ignore[arg-type]

    def _get_task_required_inputs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Set[str]:
        return set()

    def _get_option_required_inputs(self, options: Dict[str, Any]) -> Set[str]:
        """The model outputs the metric's own options (``**kwargs``) make it read."""
        return {"grouping_keys"} if self._grouping_option and options.get(self._grouping_option) else set()

    # -- compute --------------------------------------------------------------------------------------------------

    def _fused_tasks_iter(self, compute_scope: str) -> ComputeIterType:
        computation = self.computations[0]
        computation.pre_compute()
        valid = computation.has_valid_update if self._should_validate_update else itertools.repeat(1)
        for report in getattr(computation, compute_scope + "compute")():
            for task, value, has_valid in zip(self._tasks, report.value, valid):
                value = value if has_valid > 0 else torch.zeros_like(value)
                yield task, report.name, value, compute_scope + report.metric_prefix.value, report.description

    def _unfused_tasks_iter(self, compute_scope: str) -> ComputeIterType:
        for task, computation in zip(self._tasks, self.computations):
            computation.pre_compute()
            for report in getattr(computation, compute_scope + "compute")():
                value = report.value
                if self._should_validate_update and not computation.has_valid_update[0] > 0:
                    value = torch.zeros_like(value)
                yield task, report.name, value, compute_scope + report.metric_prefix.value, report.description

    def _keyed(self, compute_scope: str) -> Dict[str, torch.Tensor]:
        self._check_fused_update(force=True)
        return {
            compose_metric_key(self._namespace, task.name, name, prefix, description): value  # type: ignore[arg-type]
            for task, name, value, prefix, description in self._tasks_iter(compute_scope)
        }

    @pt2_compile_callable
    def compute(self) -> Dict[str, torch.Tensor]:
        """The global values (reduced across ranks), keyed ``"{namespace}-{task}|{prefix}{name}"``; {} on ranks
        other than 0 unless ``compute_on_all_ranks``."""
        return self._keyed("")

    def local_compute(self) -> Dict[str, torch.Tensor]:
        """This rank's values, keyed ``"{namespace}-{task}|local_{prefix}{name}"``."""
        return self._keyed("local_")

    # -- update ---------------------------------------------------------------------------------------------------

    def _fuse_update_buffers(self) -> Dict[str, RecModelOutput]:
        def fuse(outputs: List[RecModelOutput]) -> RecModelOutput:
            if isinstance(outputs[0], torch.Tensor):
                return torch.cat(outputs)  # type: ignore[arg-type]
            per_task: Dict[str, List[torch.Tensor]] = defaultdict(list)
            for output in outputs:
                for task_name, tensor in output.items():  # type: ignore[union-attr]
                    per_task[task_name].append(tensor)
            return {name: torch.cat(tensors) for name, tensors in per_task.items()}

        fused: Dict[str, RecModelOutput] = {}
        for key, outputs in self._update_buffers.items():
            if outputs:
                fused[key] = fuse(outputs)
            outputs.clear()
        return fused

    def _check_fused_update(self, force: bool) -> None:
        if self._fused_update_limit <= 0 or not self._update_buffers[self.PREDICTIONS]:
            return
        if not force and len(self._update_buffers[self.PREDICTIONS]) < self._fused_update_limit:
            return
        fused = self._fuse_update_buffers()
        self._update(predictions=fused[self.PREDICTIONS], labels=fused[self.LABELS], weights=fused.get(self.WEIGHTS))

    def _create_default_weights(self, predictions: torch.Tensor) -> torch.Tensor:
        weights = self._default_weights.get(predictions.size())
        if weights is None:
            weights = self._default_weights[predictions.size()] = torch.ones_like(predictions)
        return weights

    def _check_nonempty_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return torch.gt(torch.count_nonzero(weights, dim=-1), 0)

    def clone_update_inputs(
        self,
        predictions: RecModelOutput,
        labels: RecModelOutput,
        weights: Optional[RecModelOutput],
        **kwargs: Any,
    ) -> Tuple[RecModelOutput, RecModelOutput, Optional[RecModelOutput], Dict[str, Any]]:
        def clone(output: RecModelOutput) -> RecModelOutput:
            return output.clone() if isinstance(output, torch.Tensor) else {k: v.clone() for k, v in output.items()}

        if "required_inputs" in kwargs:
            kwargs["required_inputs"] = {k: v.clone() for k, v in kwargs["required_inputs"].items()}
        return clone(predictions), clone(labels), None if weights is None else clone(weights), kwargs

    def _update_fused(
        self, predictions: RecModelOutput, labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        names = [task.name for task in self._tasks]
        n = len(self._tasks)
        if not isinstance(predictions, torch.Tensor):
            predictions = torch.stack([predictions[name] for name in names])
        if not isinstance(labels, torch.Tensor):
            labels = torch.stack([labels[name] for name in names])
        if weights is not None and not isinstance(weights, torch.Tensor):
            weights = torch.stack([weights[name] for name in names])
        if "required_inputs" in kwargs:
            targets = [
                kwargs["required_inputs"][task.tensor_name]
                for task in self._tasks
                if task.tensor_name and task.tensor_name in kwargs["required_inputs"]
            ]
            if targets:
                kwargs["required_inputs"]["target_tensor"] = torch.stack(targets).view(n, -1)
        if predictions.dim() == labels.dim():
            predictions = predictions.view(n, -1)
        else:  # multiclass: [n_tasks, B, n_classes]
            predictions = predictions.view(n, -1, predictions.size()[-1])
        labels = labels.view(n, -1)
        weights = self._create_default_weights(predictions) if weights is None else weights.view(n, -1)
        computation = self.computations[0]
        if self._should_validate_update:
            has_valid_weights = self._check_nonempty_weights(weights)
            if not torch.any(has_valid_weights):
                return
            computation.update(predictions=predictions, labels=labels, weights=weights, **kwargs)
            computation.has_valid_update.logical_or_(has_valid_weights)
        else:
            computation.update(predictions=predictions, labels=labels, weights=weights, **kwargs)

    def _update_unfused(
        self, predictions: RecModelOutput, labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        if isinstance(predictions, torch.Tensor) or isinstance(labels, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: with UNFUSED_TASKS_COMPUTATION predictions and labels are dicts task name -> "
                "tensor"
            )
        required_inputs = kwargs.get("required_inputs")
        for task, computation in zip(self._tasks, self.computations):
            if task.name not in predictions:
                continue
            if torch.numel(predictions[task.name]) == 0:
                continue
            task_predictions = predictions[task.name]
            if task_predictions.dim() == labels[task.name].dim():
                task_predictions = task_predictions.view(1, -1)
            else:  # multiclass: [1, B, n_classes]
                task_predictions = task_predictions.view(1, -1, task_predictions.size()[-1])
            task_labels = labels[task.name].view(1, -1)
            if weights is None:
                task_weights = self._create_default_weights(task_predictions)
            else:
                task_weights = weights[task.name].view(1, -1)  # type: ignore[index]
            if self._should_validate_update:
                has_valid_weights = self._check_nonempty_weights(task_weights)
                if not has_valid_weights[0]:
                    continue
                computation.has_valid_update.logical_or_(has_valid_weights)
            if required_inputs is not None:
                kwargs["required_inputs"] = {
                    k: v.view(task_labels.size()) if v.numel() > 1 else v.expand(task_labels.size())
                    for k, v in required_inputs.items()
                }
            computation.update(predictions=task_predictions, labels=task_labels, weights=task_weights, **kwargs)

    def _update(
        self, *, predictions: RecModelOutput, labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        with torch.no_grad():
            if self._should_clone_update_inputs:
                predictions, labels, weights, kwargs = self.clone_update_inputs(predictions, labels, weights, **kwargs)
            if self._compute_mode in _FUSED_MODES:
                self._update_fused(predictions, labels, weights, **kwargs)
            else:
                self._update_unfused(predictions, labels, weights, **kwargs)

    @pt2_compile_callable
    def update(
        self, *, predictions: RecModelOutput, labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        """Add a batch. predictions, labels, weights: {task name: [B]} (or [n_tasks, B] tensors in the fused
        modes); weights None: all ones."""
        kwargs.pop("_log_tensors", None)
        if self._fused_update_limit > 0:
            self._update_buffers[self.PREDICTIONS].append(predictions)
            self._update_buffers[self.LABELS].append(labels)
            if weights is not None:
                self._update_buffers[self.WEIGHTS].append(weights)
            self._check_fused_update(force=False)
        else:
            self._update(predictions=predictions, labels=labels, weights=weights, **kwargs)

    # -- state ----------------------------------------------------------------------------------------------------

    def sync(self) -> None:
        for computation in self.computations:
            computation.sync()

    def unsync(self) -> None:
        for computation in self.computations:
            if computation._is_synced:
                computation.unsync()

    def reset(self) -> None:
        for computation in self.computations:
            computation.reset()

    def get_memory_usage(self) -> Dict[torch.Tensor, int]:
        """Every tensor this metric holds (states, window buffers, default weights) -> its size in bytes."""
        sizes: Dict[torch.Tensor, int] = {}
        pending: Deque[Any] = deque(self.__dict__.values())
        while pending:
            item = pending.popleft()
            if isinstance(item, torch.Tensor):
                sizes[item] = item.numel() * item.element_size()
            elif isinstance(item, WindowBuffer):
                pending.extend(item.buffers)
            elif isinstance(item, Mapping):
                pending.extend(item.values())
            elif isinstance(item, Sequence) and not isinstance(item, str):
                pending.extend(item)
            elif hasattr(item, "__dict__") and not isinstance(item, Enum):
                pending.extend(item.__dict__.values())
        return sizes

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:  # type: ignore[override]
        """The persistent states, as ``_metrics_computations.{i}.{state}`` (pending fused updates applied)."""
        self._check_fused_update(force=True)
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def get_required_inputs(self) -> Set[str]:
        return self._required_inputs


class RecMetricList(nn.Module):
    """Several RecMetrics behind RecMetric's interface (``update`` feeds them all, ``compute`` merges their keys)."""

    rec_metrics: nn.ModuleList
    required_inputs: Optional[List[str]]

    def __init__(self, rec_metrics: List[RecMetric]) -> None:
        super().__init__()
        self.rec_metrics = nn.ModuleList(rec_metrics)
        self.required_inputs = list(set().union(*[m.get_required_inputs() for m in rec_metrics])) or None

    def __len__(self) -> int:
        return len(self.rec_metrics)

    @property
    def metrics(self) -> List[RecMetric]:
        return list(self.rec_metrics)  # type: ignore[arg-type]

    def __getitem__(self, idx: int) -> nn.Module:
        return self.rec_metrics[idx]

    def get_required_inputs(self) -> Optional[List[str]]:
        return self.required_inputs

    def update(
        self, *, predictions: RecModelOutput, labels: RecModelOutput, weights: Optional[RecModelOutput], **kwargs: Any
    ) -> None:
        for metric in self.metrics:
            metric.update(predictions=predictions, labels=labels, weights=weights, **kwargs)

    def compute(self) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        for metric in self.metrics:
            out.update(metric.compute())
        return out

    def local_compute(self) -> Dict[str, torch.Tensor]:
        out: Dict[str, torch.Tensor] = {}
        for metric in self.metrics:
            out.update(metric.local_compute())
        return out

    def sync(self) -> None:
        for metric in self.metrics:
            metric.sync()

    def unsync(self) -> None:
        for metric in self.metrics:
            metric.unsync()

    def reset(self) -> None:
        for metric in self.metrics:
            metric.reset()
