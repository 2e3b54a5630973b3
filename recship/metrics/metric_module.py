"""RecMetricModule: a training loop's one object for metrics. ``update(model_out)`` after each forward parses the
tasks' labels, predictions and weights out of the model output dict and feeds every RecMetric (and the throughput
counter); ``compute()`` every ``compute_interval_steps`` batches (``should_compute()``) returns all values keyed
``"{namespace}-{task}|{prefix}{name}"``, reduced across ranks.

Example::

    metrics = generate_metric_module(RecMetricModule, DefaultMetricsConfig, batch_size=512, world_size=1, my_rank=0,
                                     state_metrics_mapping={}, device=torch.device("cpu"))
    metrics.update({"prediction": p, "label": y, "weight": w})  # each [512] (or [512, 1])
    metrics.compute()  # {"ne-DefaultTask|lifetime_ne": tensor([..]), "ne-DefaultTask|window_ne": ..,
                       #  "throughput-throughput|total_examples": .., ...}
"""

import abc
import logging
import time
from collections import OrderedDict, defaultdict
from typing import Any, Dict, List, Optional, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from recship.metrics.accuracy import AccuracyMetric
from recship.metrics.auc import AUCMetric
from recship.metrics.auprc import AUPRCMetric
from recship.metrics.average import AverageMetric
from recship.metrics.cali_free_ne import CaliFreeNEMetric
from recship.metrics.calibration import CalibrationMetric
from recship.metrics.calibration_with_recalibration import RecalibratedCalibrationMetric
from recship.metrics.ctr import CTRMetric
from recship.metrics.deferrable_metrics import DeferrableMetrics
from recship.metrics.hindsight_target_pr import HindsightTargetPRMetric
from recship.metrics.mae import MAEMetric
from recship.metrics.metrics_config import (
    BatchSizeStage,
    MetricsConfig,
    RecMetricEnum,
    RecMetricEnumBase,
    RecTaskInfo,
    StateMetricEnum,
    validate_batch_size_stages,
)
from recship.metrics.metrics_namespace import MetricNamespace, compose_customized_metric_key, compose_metric_namespace
from recship.metrics.model_utils import parse_task_model_outputs
from recship.metrics.mse import MSEMetric
from recship.metrics.multi_label_precision import MultiLabelPrecisionMetric
from recship.metrics.multiclass_recall import MulticlassRecallMetric
from recship.metrics.ndcg import NDCGMetric
from recship.metrics.ne import NEMetric
from recship.metrics.ne_positive import NEPositiveMetric
from recship.metrics.ne_with_recalibration import RecalibratedNEMetric
from recship.metrics.nmse import NMSEMetric
from recship.metrics.num_missing_labels import NumMissingLabelsMetric
from recship.metrics.num_positive_samples import NumPositiveSamplesMetric
from recship.metrics.output import OutputMetric
from recship.metrics.precision import PrecisionMetric
from recship.metrics.precision_session import PrecisionSessionMetric
from recship.metrics.rauc import RAUCMetric
from recship.metrics.rec_metric import RecMetric, RecMetricException, RecMetricList
from recship.metrics.recall import RecallMetric
from recship.metrics.recall_session import RecallSessionMetric
from recship.metrics.scalar import ScalarMetric
from recship.metrics.segmented_ne import SegmentedNEMetric
from recship.metrics.serving_calibration import ServingCalibrationMetric
from recship.metrics.serving_ne import ServingNEMetric
from recship.metrics.sum_weights import SumWeightsMetric
from recship.metrics.synced_states import gather_all_tensors
from recship.metrics.tensor_weighted_avg import TensorWeightedAvgMetric
from recship.metrics.throughput import ThroughputMetric
from recship.metrics.tower_qps import TowerQPSMetric
from recship.metrics.unweighted_ne import UnweightedNEMetric
from recship.metrics.weighted_avg import WeightedAvgMetric
from recship.metrics.weighted_sum_predictions import WeightedSumPredictionsMetric
from recship.metrics.xauc import XAUCMetric

logger: logging.Logger = logging.getLogger(__name__)

# the metrics recship implements; generate_metric_module refuses the other RecMetricEnum members by name
REC_METRICS_MAPPING: Dict[RecMetricEnumBase, Type[RecMetric]] = {
    RecMetricEnum.NE: NEMetric,
    RecMetricEnum.NE_POSITIVE: NEPositiveMetric,
    RecMetricEnum.SEGMENTED_NE: SegmentedNEMetric,
    RecMetricEnum.RECALIBRATED_NE: RecalibratedNEMetric,
    RecMetricEnum.RECALIBRATED_CALIBRATION: RecalibratedCalibrationMetric,
    RecMetricEnum.CTR: CTRMetric,
    RecMetricEnum.CALIBRATION: CalibrationMetric,
    RecMetricEnum.AUC: AUCMetric,
    RecMetricEnum.AUPRC: AUPRCMetric,
    RecMetricEnum.RAUC: RAUCMetric,
    RecMetricEnum.MSE: MSEMetric,
    RecMetricEnum.MAE: MAEMetric,
    RecMetricEnum.MULTICLASS_RECALL: MulticlassRecallMetric,
    RecMetricEnum.WEIGHTED_AVG: WeightedAvgMetric,
    RecMetricEnum.TOWER_QPS: TowerQPSMetric,
    RecMetricEnum.RECALL_SESSION_LEVEL: RecallSessionMetric,
    RecMetricEnum.PRECISION_SESSION_LEVEL: PrecisionSessionMetric,
    RecMetricEnum.ACCURACY: AccuracyMetric,
    RecMetricEnum.NDCG: NDCGMetric,
    RecMetricEnum.XAUC: XAUCMetric,
    RecMetricEnum.SCALAR: ScalarMetric,
    RecMetricEnum.TENSOR_WEIGHTED_AVG: TensorWeightedAvgMetric,
    RecMetricEnum.CALI_FREE_NE: CaliFreeNEMetric,
    RecMetricEnum.HINDSIGHT_TARGET_PR: HindsightTargetPRMetric,
    RecMetricEnum.NMSE: NMSEMetric,
    RecMetricEnum.PRECISION: PrecisionMetric,
    RecMetricEnum.RECALL: RecallMetric,
    RecMetricEnum.SERVING_NE: ServingNEMetric,
    RecMetricEnum.SERVING_CALIBRATION: ServingCalibrationMetric,
    RecMetricEnum.OUTPUT: OutputMetric,
    RecMetricEnum.UNWEIGHTED_NE: UnweightedNEMetric,
    RecMetricEnum.AVERAGE: AverageMetric,
    RecMetricEnum.MULTI_LABEL_PRECISION: MultiLabelPrecisionMetric,
    RecMetricEnum.NUM_MISSING_LABELS: NumMissingLabelsMetric,
    RecMetricEnum.WEIGHTED_SUM_PREDICTIONS: WeightedSumPredictionsMetric,
    RecMetricEnum.NUM_POSITIVE_SAMPLES: NumPositiveSamplesMetric,
    RecMetricEnum.SUM_WEIGHTS: SumWeightsMetric,
}

MODEL_METRIC_LABEL: str = "model"

MetricValue = Union[torch.Tensor, float]
MetricsResult = Dict[str, MetricValue]


class StateMetric(abc.ABC):
    """A component (an optimizer, ...) that reports its own values: ``get_metrics() -> {name: value}``, keyed
    ``"{namespace}-{namespace}|{name}"`` in ``RecMetricModule.compute()``."""

    @abc.abstractmethod
    def get_metrics(self) -> MetricsResult:
        pass


class RecMetricModule(nn.Module):
    r"""RecMetrics computed from model outputs, a ThroughputMetric, and StateMetrics of components.

    Args:
        batch_size (int): the local batch size.
        world_size (int): the number of trainers.
        rec_tasks (Optional[List[RecTaskInfo]]): the tasks whose outputs ``update`` parses.
        rec_metrics (Optional[RecMetricList]): the metrics.
        throughput_metric (Optional[ThroughputMetric]): the throughput counter.
        state_metrics (Optional[Dict[str, StateMetric]]): namespace -> component.
        compute_interval_steps (int): ``should_compute()`` every this many batches.
        min_compute_interval, max_compute_interval (float): seconds; when either is set, the second ``compute()``
            re-derives ``compute_interval_steps`` from the time per step so computes fall in this range (the
            largest over the ranks when a process group is initialized).
    """

    rec_tasks: List[RecTaskInfo]
    rec_metrics: RecMetricList
    throughput_metric: Optional[ThroughputMetric]
    state_metrics: Dict[str, StateMetric]
    _compute_interval_steps: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        world_size: int,
        rec_tasks: Optional[List[RecTaskInfo]] = None,
        rec_metrics: Optional[RecMetricList] = None,
        throughput_metric: Optional[ThroughputMetric] = None,
        state_metrics: Optional[Dict[str, StateMetric]] = None,
        compute_interval_steps: int = 100,
        min_compute_interval: float = 0.0,
        max_compute_interval: float = float("inf"),
    ) -> None:
        super().__init__()
        if compute_interval_steps < 1:
            raise ValueError(f"compute_interval_steps must be at least 1, got {compute_interval_steps}")
        self.rec_tasks = rec_tasks if rec_tasks else []
        self.rec_metrics = rec_metrics if rec_metrics else RecMetricList([])
        self.throughput_metric = throughput_metric
        self.state_metrics = state_metrics if state_metrics else {}
        self.trained_batches: int = 0
        self.batch_size = batch_size
        self.world_size = world_size
        self.oom_count = 0
        self.compute_count = 0
        self.compute_interval_steps = compute_interval_steps
        self.min_compute_interval = min_compute_interval
        self.max_compute_interval = max_compute_interval
        if self.min_compute_interval == 0.0 and self.max_compute_interval == float("inf"):
            self.min_compute_interval = -1.0
            self.max_compute_interval = -1.0
        else:
            if self.max_compute_interval <= 0.0:
                raise ValueError(f"Max compute interval should not be smaller than 0.0, got {max_compute_interval}")
            if self.min_compute_interval < 0.0:
                raise ValueError(f"Min compute interval should not be smaller than 0.0, got {min_compute_interval}")
        self.register_buffer("_compute_interval_steps", torch.zeros(1, dtype=torch.int32), persistent=False)
        self.last_compute_time = -1.0
        self._register_load_state_dict_pre_hook(self.load_state_dict_hook)

    def load_state_dict_hook(
        self,
        state_dict: "OrderedDict[str, torch.Tensor]",
        prefix: str,
        local_metadata: Dict[str, Any],
        strict: bool,
        missing_keys: List[str],
        unexpected_keys: List[str],
        error_msgs: List[str],
    ) -> None:
        """Checkpoints of older TorchRec versions carry ``_trained_batches``; it is dropped."""
        state_dict.pop(f"{prefix}_trained_batches", None)

    def _update_rec_metrics(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self.rec_metrics and self.rec_tasks:
            labels, predictions, weights, required_inputs = parse_task_model_outputs(
                self.rec_tasks, model_out, self.get_required_inputs()
            )
            if required_inputs:
                kwargs["required_inputs"] = required_inputs
            self.rec_metrics.update(predictions=predictions, labels=labels, weights=weights, **kwargs)

    def update(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        """One batch: ``model_out`` maps each task's label/prediction/weight name to a [B] (or [B, 1]) tensor."""
        self._update_rec_metrics(model_out, **kwargs)
        if self.throughput_metric:
            self.throughput_metric.update()
        self.trained_batches += 1

    def _adjust_compute_interval(self) -> None:
        if self.last_compute_time > 0 and self.min_compute_interval >= 0:
            interval = time.time() - self.last_compute_time
            if not self.max_compute_interval >= interval >= self.min_compute_interval:
                per_step_time = interval / self.compute_interval_steps
                if self.max_compute_interval == float("inf"):
                    steps = (self.min_compute_interval + 1.0) / per_step_time
                elif self.min_compute_interval == 0.0:
                    offset = 0.0 if self.max_compute_interval <= 1.0 else 1.0
                    steps = (self.max_compute_interval - offset) / per_step_time
                else:
                    steps = (self.max_compute_interval + self.min_compute_interval) / 2 / per_step_time
                self._compute_interval_steps[0] = int(steps)
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(self._compute_interval_steps, op=dist.ReduceOp.MAX)
                # TorchRec also assigns the buffer (still 0) when the interval is already in range, which makes
                # should_compute() divide by zero; recship keeps the steps then, and never goes below 1
                self.compute_interval_steps = max(1, int(self._compute_interval_steps.item()))
            self.min_compute_interval = -1.0
            self.max_compute_interval = -1.0
        self.last_compute_time = time.time()

    def should_compute(self) -> bool:
        return self.trained_batches % self.compute_interval_steps == 0

    def compute(self) -> DeferrableMetrics:
        """Every value, reduced across ranks ({} for the RecMetrics on ranks other than 0 unless
        ``compute_on_all_ranks``)."""
        self.compute_count += 1
        out: MetricsResult = {}
        if self.rec_metrics:
            self._adjust_compute_interval()
            out.update(self.rec_metrics.compute())
        if self.throughput_metric:
            out.update(self.throughput_metric.compute())
        for namespace, component in self.state_metrics.items():
            out.update(
                {compose_customized_metric_key(namespace, name): value for name, value in component.get_metrics().items()}
            )
        return DeferrableMetrics(out)

    def local_compute(self) -> DeferrableMetrics:
        """This rank's RecMetric values (keys ``...|local_lifetime_ne`` ...)."""
        out: MetricsResult = {}
        if self.rec_metrics:
            out.update(self.rec_metrics.local_compute())
        return DeferrableMetrics(out)

    def sync(self) -> None:
        self.rec_metrics.sync()

    def unsync(self) -> None:
        self.rec_metrics.unsync()

    def reset(self) -> None:
        self.rec_metrics.reset()

    def get_required_inputs(self) -> Optional[List[str]]:
        return self.rec_metrics.get_required_inputs()

    def _get_metric_states(
        self, metric: RecMetric, process_group: Optional[dist.ProcessGroup]
    ) -> Dict[str, Dict[str, Union[torch.Tensor, List[torch.Tensor]]]]:
        out: Dict[str, Dict[str, Any]] = defaultdict(dict)
        distributed = dist.is_available() and dist.is_initialized()

        def gather(value: torch.Tensor) -> List[torch.Tensor]:  # one process without a process group: itself
            return gather_all_tensors(value, process_group) if distributed else [value]

        for task, computation in zip(metric._tasks, metric.computations):
            for name, reduce_fx in computation._reductions.items():
                value = getattr(computation, name)
                if isinstance(value, list):
                    if not value:
                        out[task.name][name] = []
                        continue
                    gathered: Any = gather(torch.cat(value, dim=-1))
                else:
                    gathered = torch.stack(gather(value))
                out[task.name][name] = reduce_fx(gathered) if reduce_fx is not None else gathered
        return out

    def get_pre_compute_states(
        self, pg: Optional[dist.ProcessGroup] = None
    ) -> Dict[str, Dict[str, Dict[str, Union[torch.Tensor, List[torch.Tensor]]]]]:
        """Every metric's states reduced across the ranks of ``pg`` (default: the world), on every rank:
        ``{namespace: {task: {state: value}}}`` (the throughput counters under ``throughput``); a collective
        (without a process group, the local states reduced as a world of one)."""
        states: Dict[str, Any] = {}
        for metric in self.rec_metrics.metrics:
            states[metric._namespace.value] = self._get_metric_states(metric, pg)
        if self.throughput_metric is not None:
            throughput = self.throughput_metric
            states.setdefault(throughput._namespace.value, {})[throughput._metric_name.value] = dict(
                throughput.named_buffers()
            )
        return states

    def load_pre_compute_states(
        self, source: Dict[str, Dict[str, Dict[str, Union[torch.Tensor, List[torch.Tensor]]]]]
    ) -> None:
        """Load what ``get_pre_compute_states`` returned (no collective)."""
        for metric in self.rec_metrics.metrics:
            per_task = source[metric._namespace.value]
            for task, computation in zip(metric._tasks, metric.computations):
                for name, value in per_task[task.name].items():
                    setattr(computation, name, value)
        if self.throughput_metric is not None:
            counters: Dict[str, Any] = source[self.throughput_metric._namespace.value][self.throughput_metric._metric_name.value]
            for name, buf in self.throughput_metric.named_buffers():
                buf.copy_(counters[name])

    def shutdown(self) -> None:
        logger.info("RecMetricModule: shutdown")

    def async_compute(self) -> DeferrableMetrics:
        raise RecMetricException("async_compute is not supported in RecMetricModule")


def _generate_rec_metrics(
    metrics_config: MetricsConfig,
    world_size: int,
    my_rank: int,
    batch_size: int,
    process_group: Optional[dist.ProcessGroup] = None,
    batch_size_stages: Optional[List[BatchSizeStage]] = None,
) -> RecMetricList:
    rec_metrics = []
    for metric_enum, metric_def in metrics_config.rec_metrics.items():
        if metric_enum not in REC_METRICS_MAPPING:
            raise ValueError(
                f"{metric_enum} is not implemented in recship.metrics; it has: "
                f"{', '.join(str(m) for m in REC_METRICS_MAPPING)}"
            )
        kwargs: Dict[str, Any] = dict(metric_def.arguments or {})
        kwargs["enable_pt2_compile"] = metrics_config.enable_pt2_compile
        kwargs["should_clone_update_inputs"] = metrics_config.should_clone_update_inputs
        kwargs["batch_size_stages"] = batch_size_stages
        if metric_def.rec_tasks and metric_def.rec_task_indices:
            raise ValueError(
                f"{metric_enum}: only one of RecMetricDef.rec_tasks and RecMetricDef.rec_task_indices should be specified"
            )
        if metric_def.rec_tasks:
            rec_tasks = metric_def.rec_tasks
        elif metric_def.rec_task_indices:
            rec_tasks = [metrics_config.rec_tasks[idx] for idx in metric_def.rec_task_indices]
        else:
            raise ValueError(
                f"{metric_enum}: one of RecMetricDef.rec_tasks and RecMetricDef.rec_task_indices should be a non-empty list"
            )
        rec_metrics.append(
            REC_METRICS_MAPPING[metric_enum](
                world_size=world_size,
                my_rank=my_rank,
                batch_size=batch_size,
                tasks=rec_tasks,
                compute_mode=metrics_config.rec_compute_mode,
                window_size=metric_def.window_size,
                fused_update_limit=metrics_config.fused_update_limit,
                compute_on_all_ranks=metrics_config.compute_on_all_ranks,
                should_validate_update=metrics_config.should_validate_update,
                process_group=process_group,
                **kwargs,
            )
        )
    return RecMetricList(rec_metrics)


STATE_METRICS_NAMESPACE_MAPPING: Dict[StateMetricEnum, MetricNamespace] = {
    StateMetricEnum.OPTIMIZERS: MetricNamespace.OPTIMIZERS,
    StateMetricEnum.MODEL_CONFIGURATOR: MetricNamespace.MODEL_CONFIGURATOR,
}


def _generate_state_metrics(
    metrics_config: MetricsConfig, state_metrics_mapping: Dict[StateMetricEnum, StateMetric]
) -> Dict[str, StateMetric]:
    state_metrics: Dict[str, StateMetric] = {}
    for metric_enum in metrics_config.state_metrics:
        namespace = STATE_METRICS_NAMESPACE_MAPPING.get(metric_enum)
        if namespace is None:
            raise ValueError(f"Unknown StateMetrics {metric_enum}")
        if metric_enum not in state_metrics_mapping:
            raise ValueError(f"state metric {metric_enum} is configured but state_metrics_mapping has no component for it")
        state_metrics[compose_metric_namespace(namespace, str(namespace))] = state_metrics_mapping[metric_enum]
    return state_metrics


def generate_metric_module(
    metric_class: Type[RecMetricModule],
    metrics_config: MetricsConfig,
    batch_size: int,
    world_size: int,
    my_rank: int,
    state_metrics_mapping: Dict[StateMetricEnum, StateMetric],
    device: torch.device,
    process_group: Optional[dist.ProcessGroup] = None,
    batch_size_stages: Optional[List[BatchSizeStage]] = None,
    module_kwargs: Optional[Dict[str, Any]] = None,
) -> RecMetricModule:
    """``metric_class`` (RecMetricModule or a subclass) built from ``metrics_config`` and moved to ``device``;
    ``module_kwargs`` go to its constructor (``CPUOffloadedRecMetricModule`` takes ``model_out_device`` there).
    ``metrics_config.use_cpu_offloaded_rec_metric_module`` is for the caller choosing ``metric_class``."""
    rec_metrics = _generate_rec_metrics(metrics_config, world_size, my_rank, batch_size, process_group, batch_size_stages)
    validate_batch_size_stages(batch_size_stages)
    throughput_metric = None
    if metrics_config.throughput_metric:
        throughput_metric = ThroughputMetric(
            batch_size=batch_size,
            world_size=world_size,
            window_seconds=metrics_config.throughput_metric.window_size,
            warmup_steps=metrics_config.throughput_metric.warmup_steps,
            batch_size_stages=batch_size_stages,
        )
    metrics = metric_class(
        batch_size=batch_size,
        world_size=world_size,
        rec_tasks=metrics_config.rec_tasks,
        rec_metrics=rec_metrics,
        throughput_metric=throughput_metric,
        state_metrics=_generate_state_metrics(metrics_config, state_metrics_mapping),
        compute_interval_steps=metrics_config.compute_interval_steps,
        min_compute_interval=metrics_config.min_compute_interval,
        max_compute_interval=metrics_config.max_compute_interval,
        **(module_kwargs or {}),
    )
    metrics.to(device)
    return metrics
