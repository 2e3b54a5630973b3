"""The CPU-offloaded module: updates and computes on worker threads give the values of a plain RecMetricModule
fed the same batches (merged updates included), and its failures reach the caller."""

import pytest
import torch

from recship.metrics.cpu_offloaded_metric_module import CPUOffloadedRecMetricModule, PercentileLogger
from recship.metrics.metric_module import RecMetricModule, _generate_rec_metrics, generate_metric_module
from recship.metrics.metrics_config import DefaultTaskInfo, MetricsConfig, RecMetricDef, RecMetricEnum
from recship.metrics.rec_metric import RecMetricException

CONFIG = MetricsConfig(rec_tasks=[DefaultTaskInfo], rec_metrics={
    RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0], window_size=1000, arguments={"include_logloss": True}),
    RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0], window_size=1000),
    RecMetricEnum.ACCURACY: RecMetricDef(rec_task_indices=[0], window_size=1000, arguments={"threshold": 0.7}),
})


def _offloaded(update_batch_size: int) -> CPUOffloadedRecMetricModule:
    return CPUOffloadedRecMetricModule(torch.device("cpu"), update_batch_size=update_batch_size, batch_size=4, world_size=1,
                                       rec_tasks=CONFIG.rec_tasks, rec_metrics=_generate_rec_metrics(CONFIG, 1, 0, 4))


def _batches(n: int):
    g = torch.Generator().manual_seed(61)
    return [{"prediction": torch.rand(4, generator=g), "label": (torch.rand(4, generator=g) < 0.5).float(),
             "weight": torch.rand(4, generator=g)} for _ in range(n)]


@pytest.mark.parametrize("update_batch_size", [1, 3])
def test_offloaded_values_equal_a_plain_module(update_batch_size):
    plain = generate_metric_module(RecMetricModule, CONFIG, 4, 1, 0, {}, torch.device("cpu"))
    module = _offloaded(update_batch_size)
    try:
        batches = _batches(7)
        for out in batches[:4]:
            module.update(out)
            plain.update(out)
        first = module.async_compute()
        for out in batches[4:]:
            module.update(out)
            plain.update(out)
        got, want = module.async_compute().resolve(), dict(plain.compute())
        assert "ne-DefaultTask|lifetime_logloss" in first.resolve()  # the copies keep the metrics' options
        assert got.keys() == want.keys()
        for key in want:  # merged updates change the batching (float32 batch sums), not the values
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0, msg=key)
        with pytest.raises(RecMetricException, match="async_compute"):
            module.compute()
    finally:
        module.shutdown()
    with pytest.raises(RecMetricException, match="shut down"):
        module.update(batches[0])


def test_a_failing_update_fails_the_pending_compute_and_the_next_call():
    module = _offloaded(1)
    module.update({"prediction": torch.rand(4), "label": torch.ones(4)})  # no weight: the worker's parse fails
    pending = module.async_compute()
    with pytest.raises(ValueError, match="Weight weight not found"):
        pending.resolve()
    with pytest.raises(ValueError, match="Weight weight not found"):
        module.update(_batches(1)[0])
    with pytest.raises(ValueError):
        module.shutdown()


def test_percentile_logger_keeps_a_window(caplog):
    logger = PercentileLogger("t", window_size=3, log_interval=0)
    for value in (100.0, 1.0, 2.0, 3.0):
        logger.add(value)
    assert list(logger._values) == [1.0, 2.0, 3.0]
