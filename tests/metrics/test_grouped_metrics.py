"""Segmented NE, GAUC, multiclass recall, the recalibrated and serving metrics against numpy references."""

import numpy as np
import pytest
import torch

from recship.metrics.calibration_with_recalibration import RecalibratedCalibrationMetric
from recship.metrics.gauc import GAUCMetricComputation
from recship.metrics.metrics_config import DefaultTaskInfo, RecComputeMode, RecTaskInfo
from recship.metrics.multiclass_recall import MulticlassRecallMetric
from recship.metrics.ne import NEMetric
from recship.metrics.ne_with_recalibration import RecalibratedNEMetric
from recship.metrics.segmented_ne import SegmentedNEMetric
from recship.metrics.serving_ne import ServingNEMetric

B = 24
EPS = 1e-12


def _batch(g: torch.Generator, n: int = B):
    return torch.rand(n, generator=g), (torch.rand(n, generator=g) < 0.4).float(), torch.rand(n, generator=g)


def _ne(p, y, w):
    p, y, w = (np.asarray(a, dtype=np.float64) for a in (p, y, w))
    q = np.clip(p, EPS, 1 - EPS)
    ce = np.sum(-w * y * np.log2(q) - w * (1 - y) * np.log2(1 - q))
    pos, neg = np.sum(w * y), np.sum(w * (1 - y))
    base = np.clip(pos / np.sum(w), EPS, 1 - EPS)
    return ce / (-pos * np.log2(base) - neg * np.log2(1 - base))


@pytest.mark.parametrize("mode", [RecComputeMode.UNFUSED_TASKS_COMPUTATION, RecComputeMode.FUSED_TASKS_COMPUTATION])
def test_segmented_ne_is_the_ne_of_each_group(mode):
    tasks = [RecTaskInfo(name="a"), RecTaskInfo(name="b")]
    metric = SegmentedNEMetric(world_size=1, my_rank=0, batch_size=B, tasks=tasks, window_size=1000, compute_mode=mode,
                               num_groups=3, include_logloss=True)
    assert metric.get_required_inputs() == {"grouping_keys"}
    g = torch.Generator().manual_seed(31)
    seen = {"a": [], "b": []}
    for _ in range(3):
        keys = torch.randint(0, 3, (B,), generator=g)
        batches = {t: _batch(g) for t in ("a", "b")}
        metric.update(predictions={t: b[0] for t, b in batches.items()}, labels={t: b[1] for t, b in batches.items()},
                      weights={t: b[2] for t, b in batches.items()}, required_inputs={"grouping_keys": keys})
        for t, b in batches.items():
            seen[t].append((*b, keys))
    got = metric.compute()
    for task, batches in seen.items():
        p, y, w, k = (torch.cat(parts).numpy() for parts in zip(*batches))
        for group in range(3):
            sel = k == group
            np.testing.assert_allclose(float(got[f"segmented_ne-{task}|lifetime_segmented_ne_{group}"]),
                                       _ne(p[sel], y[sel], w[sel]), rtol=1e-5)  # float32 values, as TorchRec's
            q = np.clip(p[sel].astype(np.float64), EPS, 1 - EPS)  # logloss: the cross entropy per unit weight
            logloss = np.sum(-w[sel] * y[sel] * np.log2(q) - w[sel] * (1 - y[sel]) * np.log2(1 - q)) / np.sum(w[sel])
            np.testing.assert_allclose(float(got[f"segmented_ne-{task}|lifetime_logloss_{group}"]), logloss, rtol=1e-5)


def test_segmented_ne_refuses_a_key_out_of_range():
    metric = SegmentedNEMetric(world_size=1, my_rank=0, batch_size=4, tasks=[DefaultTaskInfo], window_size=8, num_groups=2)
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        metric.update(predictions={"DefaultTask": torch.rand(4)}, labels={"DefaultTask": torch.ones(4)},
                      weights={"DefaultTask": torch.ones(4)}, required_inputs={"grouping_keys": torch.tensor([0, 1, 2, 0])})


def _session_auc(p, y, w):
    pos, neg = y > 0.5, y <= 0.5
    return ((p[pos][:, None] > p[neg][None, :]) * w[pos][:, None] * w[neg][None, :]).sum() / (w[pos].sum() * w[neg].sum())


def test_gauc_averages_the_auc_of_sessions_with_both_classes():
    computation = GAUCMetricComputation(my_rank=0, batch_size=B, n_tasks=1, window_size=1000)
    g = torch.Generator().manual_seed(32)
    lengths = torch.tensor([6, 1, 5, 8, 4])  # the one-sample session never has both classes
    p, y, w = (t.view(1, -1) for t in _batch(g))
    y[0, 7:12] = 1.0  # the third session: positives only, not counted
    computation.update(predictions=p, labels=y, weights=w, num_candidates=lengths)
    reports = {f"{r.metric_prefix}{r.name}": r.value for r in computation.compute()}
    aucs, start = [], 0
    for n in lengths.tolist():
        ps, ys, ws = (t[0, start:start + n].double().numpy() for t in (p, y, w))
        start += n
        if 0 < ys.sum() < n:
            aucs.append(_session_auc(ps, ys, ws))
    assert reports["lifetime_gauc_num_samples"].item() == len(aucs) == 3
    np.testing.assert_allclose(reports["lifetime_gauc"].item(), np.mean(aucs), rtol=1e-6)
    with pytest.raises(ValueError, match="num_candidates sum to 23"):
        computation.update(predictions=p, labels=y, weights=w, num_candidates=torch.tensor([23]))


def test_multiclass_recall_at_k_is_the_share_of_labels_among_the_top_k_plus_one():
    metric = MulticlassRecallMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=1000,
                                    number_of_classes=4)
    g = torch.Generator().manual_seed(33)
    scores, labels, weights = torch.rand(B, 4, generator=g), torch.randint(0, 4, (B,), generator=g), torch.rand(B, generator=g)
    metric.update(predictions={"DefaultTask": scores}, labels={"DefaultTask": labels.float()},
                  weights={"DefaultTask": weights})
    got = metric.compute()["multiclass_recall-DefaultTask|lifetime_multiclass_recall"]
    rank_of_label = (scores > scores.gather(1, labels[:, None])).sum(1).numpy()  # classes scored above the label
    want = [np.sum(weights.numpy() * (rank_of_label <= k)) / weights.sum().item() for k in range(4)]
    np.testing.assert_allclose(got.numpy().reshape(-1), want, rtol=1e-6)
    assert got.reshape(-1)[-1].item() == pytest.approx(1.0)


def test_recalibrated_metrics_are_the_plain_ones_on_recalibrated_predictions():
    g = torch.Generator().manual_seed(34)
    p, y, w = _batch(g)
    c = 0.25
    q = p / (p + (1 - p) / c)
    kw = dict(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=1000)
    recal = RecalibratedNEMetric(recalibration_coefficient=c, include_logloss=True, **kw)
    plain = NEMetric(include_logloss=True, **kw)
    calib = RecalibratedCalibrationMetric(recalibration_coefficient=c, **kw)
    for metric, preds in ((recal, p), (plain, q), (calib, p)):
        metric.update(predictions={"DefaultTask": preds}, labels={"DefaultTask": y}, weights={"DefaultTask": w})
    a, b = recal.compute(), plain.compute()
    assert a["recalibrated_ne-DefaultTask|lifetime_ne"].item() == b["ne-DefaultTask|lifetime_ne"].item()
    assert "recalibrated_ne-DefaultTask|lifetime_logloss" in a  # TorchRec 1.8.0 loses include_logloss here
    np.testing.assert_allclose(calib.compute()["recalibrated_calibration-DefaultTask|lifetime_calibration"].item(),
                               float((q.double() * w).sum() / (y.double() * w).sum()), rtol=1e-6)


def test_serving_ne_counts_the_examples_of_nonzero_weight():
    metric = ServingNEMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=1000)
    g = torch.Generator().manual_seed(35)
    p, y, w = _batch(g)
    w[::3] = 0
    metric.update(predictions={"DefaultTask": p}, labels={"DefaultTask": y}, weights={"DefaultTask": w})
    got = metric.compute()
    assert got["serving_ne-DefaultTask|total_examples"].tolist() == [B - B // 3]
    np.testing.assert_allclose(got["serving_ne-DefaultTask|lifetime_ne"].item(), _ne(p, y, w), rtol=1e-6)
