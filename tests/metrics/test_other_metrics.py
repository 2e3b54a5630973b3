"""Tower QPS (on a fake clock), scalar, output, hindsight target precision, multi-label precision, the no-op
module and the state snapshot."""

import numpy as np
import pytest
import torch

from recship.metrics import tower_qps as tower_qps_file
from recship.metrics.hindsight_target_pr import THRESHOLD_GRANULARITY, HindsightTargetPRMetric
from recship.metrics.metric_module import RecMetricModule, generate_metric_module
from recship.metrics.metric_state_snapshot import MetricStateSnapshot
from recship.metrics.metrics_config import DefaultTaskInfo, MetricsConfig, RecMetricDef, RecMetricEnum
from recship.metrics.multi_label_precision import MultiLabelPrecisionMetric
from recship.metrics.noop_metric_module import NoOpMetricModule
from recship.metrics.output import OutputMetric
from recship.metrics.scalar import ScalarMetric
from recship.metrics.tower_qps import TowerQPSMetric

KW = dict(world_size=1, my_rank=0, tasks=[DefaultTaskInfo])


def _update(metric, p, y, w=None, **kwargs):
    metric.update(predictions={"DefaultTask": p}, labels={"DefaultTask": y},
                  weights=None if w is None else {"DefaultTask": w}, **kwargs)


def test_tower_qps_counts_examples_per_second_after_the_warmup(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tower_qps_file.time, "monotonic", lambda: now[0])
    metric = TowerQPSMetric(batch_size=8, window_size=16, warmup_steps=2, **KW)
    sizes, steps = [8, 8, 6, 8, 4], [0.0, 1.0, 2.0, 0.5, 1.5]  # seconds before each update
    for size, dt in zip(sizes, steps):
        now[0] += dt
        _update(metric, torch.rand(size), torch.ones(size))
    got = metric.compute()
    assert got["qps-DefaultTask|total_examples"].tolist() == [sum(sizes)]
    # after the warmup (2 updates): 6 + 8 + 4 examples in 2 + 0.5 + 1.5 s; the window (16 samples) keeps 8 + 4
    assert got["qps-DefaultTask|lifetime_qps"].item() == pytest.approx(18 / 4.0)
    assert got["qps-DefaultTask|window_qps"].item() == pytest.approx(12 / 2.0)


def test_scalar_reports_the_last_mean_and_the_window_mean_of_means():
    metric = ScalarMetric(batch_size=4, window_size=4, **KW)
    values = [torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0]), torch.tensor([0.0, 2.0])]
    for y in values:
        _update(metric, torch.zeros(2), y)
    got = metric.compute()
    assert got["scalar-DefaultTask|lifetime_scalar"].tolist() == [1.0]
    assert got["scalar-DefaultTask|window_scalar"].tolist() == [(2.0 + 6.0 + 1.0) / 3]


def test_output_reports_the_latest_means():
    metric = OutputMetric(batch_size=4, window_size=4, **KW)
    assert metric.get_required_inputs() == {"latest_imp", "total_latest_imp"}
    _update(metric, torch.zeros(4), torch.zeros(4), required_inputs={
        "latest_imp": torch.tensor([1.0, 2.0, 3.0, 4.0]), "total_latest_imp": torch.tensor([10.0, 10.0, 10.0, 30.0])})
    got = metric.compute()
    assert got["output-DefaultTask|output_latest_imp"].item() == 2.5
    assert got["output-DefaultTask|output_total_latest_imp"].item() == 15.0


def test_hindsight_target_pr_finds_the_first_threshold_reaching_the_precision():
    g = torch.Generator().manual_seed(41)
    p, y, w = torch.rand(64, generator=g), (torch.rand(64, generator=g) < 0.3).float(), torch.rand(64, generator=g)
    metric = HindsightTargetPRMetric(batch_size=64, window_size=64, target_precision=0.4, **KW)
    _update(metric, p, y, w)
    got = metric.compute()
    thresholds = np.linspace(0, 1, THRESHOLD_GRANULARITY, dtype=np.float32).astype(np.float64)
    pd, yd, wd = (t.double().numpy() for t in (p, y, w))
    tp = np.array([np.sum(wd * yd * (pd >= t)) for t in thresholds])
    fp = np.array([np.sum(wd * (1 - yd) * (pd >= t)) for t in thresholds])
    precision = np.where(tp + fp == 0, 0.0, tp / np.where(tp + fp == 0, 1, tp + fp))
    idx = int(np.argmax(precision >= 0.4))
    assert precision[idx] >= 0.4 and got["hindsight_target_pr-DefaultTask|lifetime_hindsight_target_pr"].tolist() == [idx]
    np.testing.assert_allclose(got["hindsight_target_pr-DefaultTask|lifetime_hindsight_target_precision"].item(),
                               precision[idx], rtol=1e-6)
    fn = np.sum(wd * yd * (pd <= thresholds[idx]))
    np.testing.assert_allclose(got["hindsight_target_pr-DefaultTask|lifetime_hindsight_target_recall"].item(),
                               tp[idx] / (tp[idx] + fn), rtol=1e-6)


def test_multi_label_precision_decodes_bit_sets():
    metric = MultiLabelPrecisionMetric(batch_size=4, window_size=4, num_labels=3, label_names=["cat", "dog", "horse"], **KW)
    predictions = torch.tensor([5.0, 3.0, 1.0, 6.0])  # {cat, horse}, {cat, dog}, {cat}, {dog, horse}
    labels = torch.tensor([1.0, 3.0, 4.0, 2.0])  # {cat}, {cat, dog}, {horse}, {dog}
    _update(metric, predictions, labels)
    got = metric.compute()
    assert got["multi_label_precision-DefaultTask|lifetime_multi_label_precisioncat"].item() == pytest.approx(2 / 3)
    assert got["multi_label_precision-DefaultTask|lifetime_multi_label_precisiondog"].item() == pytest.approx(1.0)
    assert got["multi_label_precision-DefaultTask|window_multi_label_precisionhorse"].item() == pytest.approx(0.0)


def test_noop_module_and_the_state_snapshot():
    noop = NoOpMetricModule()
    noop.update({"anything": torch.zeros(1)})
    assert dict(noop.compute()) == {} and not noop.should_compute()
    config = MetricsConfig(rec_tasks=[DefaultTaskInfo], rec_metrics={
        RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0], window_size=100),
        RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0], window_size=100)})
    module = generate_metric_module(RecMetricModule, config, 4, 1, 0, {}, torch.device("cpu"))
    for _ in range(3):
        module.update({"prediction": torch.rand(4), "label": torch.ones(4), "weight": torch.ones(4)})
    snapshot = MetricStateSnapshot.from_metrics(module.rec_metrics)
    predictions = snapshot.metric_states["DefaultTask_AUCMetricComputation_predictions"]
    assert len(predictions) == 1 and predictions[0].shape == (1, 12)  # the 3 updates in one tensor
    ne_sum = snapshot.metric_states["DefaultTask_NEMetricComputation_weighted_num_samples"]
    module.update({"prediction": torch.rand(4), "label": torch.ones(4), "weight": torch.ones(4)})
    assert ne_sum.tolist() == [12.0]  # a copy: later updates do not reach it
