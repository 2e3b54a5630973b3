"""ThroughputMetric: trained examples per second across all ranks (batch size x world size per step), over the
lifetime, this attempt (since the process started), and a sliding window of ``window_seconds``; nothing is timed
during the first ``warmup_steps`` steps.

Keys: ``throughput-throughput|total_examples``, ``|attempt_examples``, and after the warmup ``|lifetime_throughput``,
``|window_throughput``, ``|attempt_throughput``; with batch size stages also ``|batch_size``. The lifetime counters
(``total_examples``, ``warmup_examples``, ``time_lapse_after_warmup``) are persistent buffers, so a resumed job
keeps counting; the attempt ones are not.
"""

import copy
import logging
import math
import time
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, List, Optional

import torch
import torch.nn as nn

from recship.metrics.metrics_config import BatchSizeStage
from recship.metrics.metrics_namespace import MetricName, MetricNamespace, MetricPrefix, compose_metric_key

MAX_WINDOW_TS: int = 2 * 60 * 60  # window_seconds above two hours would report a stale window

logger: logging.Logger = logging.getLogger(__name__)


class StagedBatchSize:
    """For an nn.Module (ThroughputMetric, TowerQPSMetric) whose batch size follows ``batch_size_stages``:
    ``_get_batch_size()`` is the current stage's (``_batch_size`` without stages). The step count ``_num_batch``
    exists only with stages, as in TorchRec, and is checkpointed as ``num_batch``."""

    _batch_size: int
    _batch_size_stages: Optional[List[BatchSizeStage]]
    _num_batch: int

    def _init_batch_size_stages(self, batch_size_stages: Optional[List[BatchSizeStage]]) -> None:
        self._batch_size_stages = copy.deepcopy(batch_size_stages)
        if self._batch_size_stages is not None:
            self._num_batch = 0
        self._register_load_state_dict_pre_hook(self.load_state_dict_hook)  # type: ignore[attr-defined]
        self.register_state_dict_post_hook(self.state_dict_hook)  # type: ignore[attr-defined]

    def _get_batch_size(self) -> int:
        stages = self._batch_size_stages
        if not stages:
            return self._batch_size
        while stages[0].max_iters is not None and stages[0].max_iters < self._num_batch:
            stages.pop(0)
            if not stages:
                raise ValueError("batch_size_stages ran out: the last stage must have max_iters=None")
        return stages[0].batch_size

    @staticmethod
    def state_dict_hook(
        module: nn.Module, state_dict: "OrderedDict[str, torch.Tensor]", prefix: str, local_metadata: Dict[str, Any]
    ) -> None:
        """With batch size stages, the step count is saved as ``num_batch``."""
        if module._batch_size_stages is not None:  # type: ignore[union-attr]
            state_dict[f"{prefix}num_batch"] = torch.tensor(module._num_batch, dtype=torch.long)  # type: ignore[arg-type]

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
        num_batch = state_dict.pop(f"{prefix}num_batch", None)
        if num_batch is not None and self._batch_size_stages is not None:
            self._num_batch = int(num_batch.item())


class ThroughputMetric(StagedBatchSize, nn.Module):
    """Examples per second across ranks.

    Args:
        batch_size (int): the local batch size (the first stage's when ``batch_size_stages`` is given).
        world_size (int): the number of trainers.
        window_seconds (int): the sliding window, in seconds (1 .. MAX_WINDOW_TS; larger is capped).
        warmup_steps (int): steps before timing starts (at least 1).
        batch_size_stages (Optional[List[BatchSizeStage]]): a batch size that changes with the step count.
    """

    _namespace: MetricNamespace = MetricNamespace.THROUGHPUT
    _metric_name: MetricName = MetricName.THROUGHPUT
    total_examples: torch.Tensor
    warmup_examples: torch.Tensor
    time_lapse_after_warmup: torch.Tensor
    attempt_examples: torch.Tensor
    attempt_warmup_examples: torch.Tensor
    attempt_time_lapse_after_warmup: torch.Tensor

    def __init__(
        self,
        *,
        batch_size: int,
        world_size: int,
        window_seconds: int,
        warmup_steps: int = 100,
        batch_size_stages: Optional[List[BatchSizeStage]] = None,
    ) -> None:
        super().__init__()
        if window_seconds < 1:
            raise ValueError(f"window_seconds must be at least 1, got {window_seconds}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1, got {warmup_steps}")
        if window_seconds > MAX_WINDOW_TS:
            logger.warning("window_seconds %s is greater than %s; capped", window_seconds, MAX_WINDOW_TS)
            window_seconds = MAX_WINDOW_TS
        self._batch_size = batch_size
        self._world_size = world_size
        self._window_seconds = window_seconds
        self._warmup_steps = warmup_steps
        self._init_batch_size_stages(batch_size_stages)
        self.register_buffer("total_examples", torch.tensor(0, dtype=torch.long))
        self.register_buffer("warmup_examples", torch.tensor(0, dtype=torch.long))
        self.register_buffer("time_lapse_after_warmup", torch.tensor(0, dtype=torch.double))
        self.register_buffer("attempt_examples", torch.tensor(0, dtype=torch.long), persistent=False)
        self.register_buffer("attempt_warmup_examples", torch.tensor(0, dtype=torch.long), persistent=False)
        self.register_buffer("attempt_time_lapse_after_warmup", torch.tensor(0, dtype=torch.double), persistent=False)
        self._window_time_lapse_buffer: Deque[float] = deque(maxlen=MAX_WINDOW_TS)
        self._window_time_lapse = 0.0
        self._previous_ts = 0.0
        name, space = self._metric_name, self._namespace
        self._lifetime_throughput_key = compose_metric_key(space, str(space), name, MetricPrefix.LIFETIME)
        self._window_throughput_key = compose_metric_key(space, str(space), name, MetricPrefix.WINDOW)
        self._attempt_throughput_key = compose_metric_key(space, str(space), name, MetricPrefix.ATTEMPT)
        self._total_examples_key = compose_metric_key(space, str(space), MetricName.TOTAL_EXAMPLES)
        self._attempt_examples_key = compose_metric_key(space, str(space), MetricName.ATTEMPT_EXAMPLES)
        self._batch_size_key = compose_metric_key(space, str(space), MetricName.BATCH_SIZE)
        self._steps = 0

    def set_num_batch(self, num_batch: int) -> None:
        """Where a resumed job is in its batch size stages."""
        if self._batch_size_stages is not None:
            self._num_batch = num_batch

    def _batch_examples(self) -> int:
        return self._get_batch_size() * self._world_size

    def update(self) -> None:
        """One trained step."""
        ts = time.monotonic()
        self._steps += 1
        if self._batch_size_stages is not None:
            self._num_batch += 1
        batch_examples = self._batch_examples()
        self.total_examples += batch_examples
        self.attempt_examples += batch_examples
        if self._steps <= self._warmup_steps:
            self.warmup_examples += batch_examples
            self.attempt_warmup_examples += batch_examples
            if self._steps == self._warmup_steps:
                self._previous_ts = ts
            return
        time_lapse = ts - self._previous_ts
        self.time_lapse_after_warmup += time_lapse
        self.attempt_time_lapse_after_warmup += time_lapse
        self._window_time_lapse += time_lapse
        self._window_time_lapse_buffer.append(time_lapse)
        while self._window_time_lapse > self._window_seconds:
            self._window_time_lapse -= self._window_time_lapse_buffer.popleft()
        self._previous_ts = ts

    def compute(self) -> Dict[str, torch.Tensor]:
        out = {self._total_examples_key: self.total_examples, self._attempt_examples_key: self.attempt_examples}
        if self._steps > self._warmup_steps and not math.isclose(self.time_lapse_after_warmup.item(), 0):
            lifetime = (self.total_examples - self.warmup_examples) / self.time_lapse_after_warmup
            attempt = (self.attempt_examples - self.attempt_warmup_examples) / self.attempt_time_lapse_after_warmup
            window = 0.0
            if not math.isclose(self._window_time_lapse, 0):
                window = len(self._window_time_lapse_buffer) * self._batch_examples() / self._window_time_lapse
            if not math.isclose(lifetime.item(), 0):
                out[self._lifetime_throughput_key] = lifetime.clone().detach()
                out[self._window_throughput_key] = torch.tensor(window, dtype=torch.double)
            if not math.isclose(attempt.item(), 0):
                out[self._attempt_throughput_key] = attempt.clone().detach()
        if self._batch_size_stages is not None:
            out[self._batch_size_key] = torch.tensor(self._get_batch_size(), dtype=torch.int32)
        return out
