"""NoOpMetricModule: a RecMetricModule that does nothing, for runs with metrics switched off (``update`` ignores
its input, ``compute`` returns {}, ``should_compute`` is never true)."""

from concurrent.futures import Future
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from recship.metrics.deferrable_metrics import DeferrableMetrics
from recship.metrics.metric_module import RecMetricModule


class NoOpMetricModule(RecMetricModule):
    def __init__(self) -> None:
        torch.nn.Module.__init__(self)

    def _update_rec_metrics(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        pass

    def update(self, model_out: Dict[str, torch.Tensor], **kwargs: Any) -> None:
        pass

    def should_compute(self) -> bool:
        return False

    def compute(self) -> DeferrableMetrics:
        return DeferrableMetrics({})

    def local_compute(self) -> DeferrableMetrics:
        return DeferrableMetrics({})

    def sync(self) -> None:
        pass

    def unsync(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_required_inputs(self) -> Optional[List[str]]:
        return None

    def get_pre_compute_states(self, pg: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
        return {}

    def load_pre_compute_states(self, source: Dict[str, Any]) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def async_compute(self, future: "Future[Dict[str, Any]]") -> None:  # type: ignore[override]
        pass
