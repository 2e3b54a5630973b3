"""The shape most metrics share: a few [n_tasks] float64 sums per batch, each with a lifetime and a window state,
reduced across ranks by summing, and a value computed from the sums. A metric names its sums, the per-batch
function and the value's; ``_reports`` makes its lifetime and window values. ``ThresholdSumsComputation``: the same for
the metrics that count predictions at or above a threshold (precision, recall, accuracy)."""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from recship.metrics.metrics_namespace import MetricNameBase, MetricPrefix
from recship.metrics.rec_metric import MetricComputationReport, RecMetricComputation, RecMetricException


def _as_is(total: torch.Tensor) -> torch.Tensor:
    return total


class SumsComputation(RecMetricComputation):
    """Subclasses set ``_SUMS`` (the state names, in the order TorchRec registers them), ``_states(labels,
    predictions, weights) -> {name: [n_tasks]}`` (a batch's sums) and ``_value(*sums)``, reported as ``_NAME``
    (default: the one sum as it is), or override ``_batch_sums`` and ``_compute``. ``_is_persistent`` says which
    sums go in the state_dict; ``_NEEDS`` says which of predictions/weights must be given."""

    _SUMS: Tuple[str, ...] = ()
    _NEEDS: Tuple[str, ...] = ("predictions", "weights")
    _NAME: MetricNameBase
    _states: Callable[..., Dict[str, torch.Tensor]]
    _value: Callable[..., torch.Tensor] = staticmethod(_as_is)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in self._SUMS:
            self._add_state(
                name,
                torch.zeros(self._n_tasks, dtype=torch.double),
                add_window_state=True,
                dist_reduce_fx="sum",
                persistent=self._is_persistent(name),
            )

    def _is_persistent(self, name: str) -> bool:
        return True

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return self._states(labels, predictions, weights)

    def _num_samples(self, labels: torch.Tensor, predictions: torch.Tensor) -> int:
        return predictions.shape[-1]

    def update(
        self,
        *,
        predictions: Optional[torch.Tensor],
        labels: torch.Tensor,
        weights: Optional[torch.Tensor],
        **kwargs: Dict[str, Any],
    ) -> None:
        given = {"predictions": predictions, "weights": weights}
        absent = [name for name in self._NEEDS if given[name] is None]
        if absent:
            raise RecMetricException(f"Inputs {absent} should not be None for {type(self).__name__} update")
        assert predictions is not None
        self._add_sums(self._batch_sums(labels, predictions, weights), self._num_samples(labels, predictions))

    def _compute(self) -> List[MetricComputationReport]:
        return self._reports(self._NAME, self._value, *self._SUMS)

    def _reports(
        self, name: MetricNameBase, fn: Callable[..., torch.Tensor], *sums: str, description: Optional[str] = None
    ) -> List[MetricComputationReport]:
        """[lifetime, window] reports of ``fn(*sums)``."""
        return [
            MetricComputationReport(name, MetricPrefix.LIFETIME, fn(*[getattr(self, s) for s in sums]), description),
            MetricComputationReport(name, MetricPrefix.WINDOW, fn(*[self.get_window_state(s) for s in sums]), description),
        ]


class ThresholdSumsComputation(SumsComputation):
    """Sums at a threshold (precision, recall, accuracy): ``_states(labels, predictions, weights, threshold)`` gives
    a batch's sums (weights None: all ones), ``_value(*sums)`` the value, reported as ``_NAME``.

    Args:
        threshold (float): a prediction at or above it counts as positive.
    """

    _NEEDS = ("predictions",)

    def __init__(self, *args: Any, threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threshold = threshold

    def _batch_sums(
        self, labels: torch.Tensor, predictions: torch.Tensor, weights: Any
    ) -> Dict[str, torch.Tensor]:
        return self._states(labels, predictions, weights, self._threshold)
