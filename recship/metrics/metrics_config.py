"""What a user writes to ask for metrics: the tasks (which model outputs hold the label, prediction and weight of
each), the metrics per task and their window, and how often the module computes. ``generate_metric_module`` (in
``recship.metrics.metric_module``) turns a ``MetricsConfig`` into a ``RecMetricModule``.

Example::

    config = MetricsConfig(
        rec_tasks=[RecTaskInfo(name="click", label_name="label", prediction_name="prob", weight_name="weight")],
        rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0], window_size=10_000)},
    )
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from recship.metrics.metrics_namespace import StrValueMixin


class RecMetricEnumBase(StrValueMixin, Enum):
    pass


class RecMetricEnum(RecMetricEnumBase):
    """The metrics a ``MetricsConfig`` can name (``REC_METRICS_MAPPING`` gives each one's class; the ones recship
    does not implement are listed there as absent and refused by ``generate_metric_module``)."""

    NE = "ne"
    NE_POSITIVE = "ne_positive"
    RECALIBRATED_NE = "recalibrated_ne"
    RECALIBRATED_CALIBRATION = "recalibrated_calibration"
    SEGMENTED_NE = "segmented_ne"
    LOG_LOSS = "log_loss"
    CTR = "ctr"
    AUC = "auc"
    AUPRC = "auprc"
    RAUC = "rauc"
    CALIBRATION = "calibration"
    MSE = "mse"
    MAE = "mae"
    MULTICLASS_RECALL = "multiclass_recall"
    RECALL_SESSION_LEVEL = "recall_session_level"
    PRECISION_SESSION_LEVEL = "precision_session_level"
    WEIGHTED_AVG = "weighted_avg"
    TOWER_QPS = "tower_qps"
    ACCURACY = "accuracy"
    NDCG = "ndcg"
    XAUC = "xauc"
    SCALAR = "scalar"
    PRECISION = "precision"
    RECALL = "recall"
    SERVING_NE = "serving_ne"
    SERVING_CALIBRATION = "serving_calibration"
    SERVING_AE_LOSS = "serving_ae_loss"
    OUTPUT = "output"
    TENSOR_WEIGHTED_AVG = "tensor_weighted_avg"
    CALI_FREE_NE = "cali_free_ne"
    UNWEIGHTED_NE = "unweighted_ne"
    HINDSIGHT_TARGET_PR = "hindsight_target_pr"
    NMSE = "nmse"
    AVERAGE = "average"
    MULTI_LABEL_PRECISION = "multi_label_precision"
    NUM_POSITIVE_SAMPLES = "num_positive_samples"
    SUM_WEIGHTS = "sum_weights"
    NUM_MISSING_LABELS = "num_missing_labels"
    WEIGHTED_SUM_PREDICTIONS = "weighted_sum_predictions"


@dataclass(unsafe_hash=True, eq=True)
class SessionMetricDef:
    """For session-level metrics: the model output holding each sample's session id."""

    session_var_name: str
    top_threshold: Optional[int] = None
    run_ranking_of_labels: bool = False


@dataclass(unsafe_hash=True, eq=True)
class RecTaskInfo:
    """One task of the model: the keys of its label, prediction and weight in the model output dict. ``name``
    is the task part of every metric key (``"ne-{name}|lifetime_ne"``)."""

    name: str = "DefaultTask"
    label_name: str = "label"
    prediction_name: str = "prediction"
    weight_name: str = "weight"
    session_metric_def: Optional[SessionMetricDef] = None
    is_negative_task: bool = False
    tensor_name: Optional[str] = None
    weighted: bool = True


class RecComputeMode(Enum):
    """How a metric lays out several tasks.

    UNFUSED_TASKS_COMPUTATION: one computation (states of shape [1]) per task.
    FUSED_TASKS_COMPUTATION: one computation for all tasks, states of shape [n_tasks]; the tasks' tensors are
        stacked to [n_tasks, B] at each update.
    FUSED_TASKS_AND_STATES_COMPUTATION: as FUSED_TASKS_COMPUTATION (TorchRec additionally fuses the state tensors
        of one metric inside torchmetrics; the values are the same).
    """

    FUSED_TASKS_COMPUTATION = 1
    UNFUSED_TASKS_COMPUTATION = 2
    FUSED_TASKS_AND_STATES_COMPUTATION = 3


_DEFAULT_WINDOW_SIZE = 10_000_000
_DEFAULT_THROUGHPUT_WINDOW_SECONDS = 100
_DEFAULT_THROUGHPUT_WARMUP_STEPS = 100


@dataclass
class RecMetricDef:
    """One metric of a ``MetricsConfig``.

    Args:
        rec_tasks (List[RecTaskInfo]): the tasks this metric covers; or
        rec_task_indices (List[int]): indices into ``MetricsConfig.rec_tasks`` (give exactly one of the two).
        window_size (int): the global window in samples; each rank keeps ``ceil(window_size / world_size)``, which
            must be at least the batch size.
        arguments (Optional[Dict[str, Any]]): the metric's own options (``{"include_logloss": True}`` for NE,
            ``{"threshold": 0.7}`` for accuracy, ...).
    """

    rec_tasks: List[RecTaskInfo] = field(default_factory=list)
    rec_task_indices: List[int] = field(default_factory=list)
    window_size: int = _DEFAULT_WINDOW_SIZE
    arguments: Optional[Dict[str, Any]] = None


class StateMetricEnum(StrValueMixin, Enum):
    OPTIMIZERS = "optimizers"
    MODEL_CONFIGURATOR = "model_configurator"


@dataclass
class ThroughputDef:
    """``window_size`` in seconds; no throughput is reported during the first ``warmup_steps`` batches."""

    window_size: int = _DEFAULT_THROUGHPUT_WINDOW_SECONDS
    warmup_steps: int = _DEFAULT_THROUGHPUT_WARMUP_STEPS


@dataclass
class MetricsConfig:
    """Everything ``generate_metric_module`` needs.

    Args:
        rec_tasks (List[RecTaskInfo]): the tasks the metrics may refer to by index.
        rec_metrics (Dict[RecMetricEnum, RecMetricDef]): the metrics.
        throughput_metric (Optional[ThroughputDef]): add a ThroughputMetric.
        rec_compute_mode (RecComputeMode): fused or per-task computations, for every metric.
        fused_update_limit (int): > 1 buffers that many ``update()`` calls and applies them as one (0 or 1: none);
            not with the fused compute modes.
        state_metrics (List[StateMetricEnum]): which state metrics to report.
        compute_interval_steps (int): ``RecMetricModule.should_compute()`` is true every this many batches.
        min_compute_interval, max_compute_interval (float): seconds; when either is set, the module adapts
            ``compute_interval_steps`` after its second ``compute()`` so that computes fall in this range.
        compute_on_all_ranks (bool): every rank gets the global values (else only rank 0; the others get {}).
        should_validate_update (bool): skip updates whose weights are all zero; a task that never had a valid
            update reports 0.
        enable_pt2_compile (bool): compile the state functions with ``torch.compile``.
        should_clone_update_inputs (bool): clone the inputs of ``update()`` first.
        use_cpu_offloaded_rec_metric_module (Optional[bool]): a flag for the trainer choosing the module class
            (``CPUOffloadedRecMetricModule``); ``generate_metric_module`` itself does not read it.
    """

    rec_tasks: List[RecTaskInfo] = field(default_factory=list)
    rec_metrics: Dict[RecMetricEnum, RecMetricDef] = field(default_factory=dict)
    throughput_metric: Optional[ThroughputDef] = None
    rec_compute_mode: RecComputeMode = RecComputeMode.UNFUSED_TASKS_COMPUTATION
    fused_update_limit: int = 0
    state_metrics: List[StateMetricEnum] = field(default_factory=list)
    compute_interval_steps: int = 100
    min_compute_interval: float = 0.0
    max_compute_interval: float = float("inf")
    compute_on_all_ranks: bool = False
    should_validate_update: bool = False
    enable_pt2_compile: bool = False
    should_clone_update_inputs: bool = False
    use_cpu_offloaded_rec_metric_module: Optional[bool] = None

    def __post_init__(self) -> None:
        for metric_enum, metric_def in self.rec_metrics.items():
            for idx in metric_def.rec_task_indices:
                if not 0 <= idx < len(self.rec_tasks):
                    raise ValueError(
                        f"rec_task_indices {idx} is out of range of {len(self.rec_tasks)} tasks for metric {metric_enum}"
                    )


DefaultTaskInfo = RecTaskInfo(name="DefaultTask", label_name="label", prediction_name="prediction", weight_name="weight")


def _create_default_metrics_config() -> MetricsConfig:
    return MetricsConfig(
        rec_tasks=[DefaultTaskInfo],
        rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[DefaultTaskInfo], window_size=_DEFAULT_WINDOW_SIZE)},
        throughput_metric=ThroughputDef(),
        state_metrics=[],
    )


def _create_empty_metrics_config() -> MetricsConfig:
    return MetricsConfig(rec_tasks=[], rec_metrics={}, throughput_metric=None, state_metrics=[])


DefaultMetricsConfig: MetricsConfig = _create_default_metrics_config()
EmptyMetricsConfig: MetricsConfig = _create_empty_metrics_config()


@dataclass
class BatchSizeStage:
    """A stage of a variable batch size: ``batch_size`` while the step count is at most ``max_iters`` (absolute,
    not relative to the stage); the last stage has ``max_iters=None``."""

    batch_size: int = 0
    max_iters: Optional[int] = 0


def validate_batch_size_stages(batch_size_stages: Optional[List[BatchSizeStage]]) -> None:
    """Raise ValueError unless the last stage is open-ended (``max_iters=None``); None or [] is valid."""
    if not batch_size_stages:
        return
    if batch_size_stages[-1].max_iters is not None:
        raise ValueError(
            f"Batch size stages last stage should have max_iters = None, but get {batch_size_stages[-1].max_iters}"
        )
