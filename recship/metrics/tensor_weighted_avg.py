"""The weighted average of a model output other than the prediction: each task names it in
``RecTaskInfo.tensor_name`` (fed through ``required_inputs``); ``RecTaskInfo.weighted=False`` averages it
unweighted. Keys ``weighted_avg-{task}|lifetime_weighted_avg{description}`` and ``|window_weighted_avg...``.
As in TorchRec's WeightedAvg, the window counts each update as ``labels.shape[0]`` samples."""

from typing import Any, Dict, List, Optional, Set, Type, Union

import torch

from recship.metrics.metrics_config import RecTaskInfo
from recship.metrics.metrics_namespace import MetricName, MetricNamespace
from recship.metrics.rec_metric import MetricComputationReport, RecMetric, RecMetricComputation, RecMetricException
from recship.metrics.sums import SumsComputation


def get_mean(value_sum: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
    return value_sum / num_samples


class TensorWeightedAvgMetricComputation(SumsComputation):
    """Args: tasks (List[RecTaskInfo]): the computation's tasks, each with a ``tensor_name``; description
    (Optional[str]): appended to the keys."""

    _SUMS = ("weighted_sum", "weighted_num_samples")

    def __init__(self, *args: Any, tasks: List[RecTaskInfo], description: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks = tasks
        for task in tasks:
            if task.tensor_name is None:
                raise RecMetricException(
                    f"TensorWeightedAvgMetricComputation expects all tasks to have tensor_name, but task {task.name!r} has None"
                )
        self._description = description
        self.weighted_mask = torch.tensor([task.weighted for task in tasks]).unsqueeze(dim=-1)

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        required = kwargs.get("required_inputs")
        if required is None:
            raise RecMetricException("TensorWeightedAvgMetricComputation expects 'required_inputs' to exist.")
        if len(self.tasks) > 1:
            target = required["target_tensor"]
        else:
            name = self.tasks[0].tensor_name
            if name not in required:
                raise RecMetricException(
                    f"TensorWeightedAvgMetricComputation expects required_inputs to contain target tensor {name}"
                )
            target = required[name]
        assert weights is not None
        self.weighted_mask = self.weighted_mask.to(target.device)
        values = torch.where(self.weighted_mask, target * weights, target)
        counts = torch.where(self.weighted_mask, weights, torch.ones_like(weights))
        self._add_sums({"weighted_sum": values.sum(dim=-1), "weighted_num_samples": counts.sum(dim=-1)}, labels.shape[0])

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(MetricName.WEIGHTED_AVG, get_mean, *self._SUMS, description=self._description)


class TensorWeightedAvgMetric(RecMetric):
    _namespace: MetricNamespace = MetricNamespace.WEIGHTED_AVG
    _computation_class: Type[RecMetricComputation] = TensorWeightedAvgMetricComputation

    def _get_task_kwargs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Dict[str, Any]:
        return {"tasks": [task_config] if isinstance(task_config, RecTaskInfo) else task_config}

    def _get_task_required_inputs(self, task_config: Union[RecTaskInfo, List[RecTaskInfo]]) -> Set[str]:
        """The tasks' tensor names; one tensor may not be both weighted and unweighted."""
        weighted: Dict[str, bool] = {}
        for task in [task_config] if isinstance(task_config, RecTaskInfo) else task_config:
            if task.tensor_name is None:
                continue
            if weighted.get(task.tensor_name, task.weighted) is not task.weighted:
                raise RecMetricException(
                    f"This target tensor {task.tensor_name!r} was already registered as "
                    f"weighted={weighted[task.tensor_name]}. It cannot be re-registered with weighted={task.weighted}"
                )
            weighted[task.tensor_name] = task.weighted
        return set(weighted)
