"""Each metric's lifetime and window values against a plain numpy formula on the same seeded stream of batches."""

import zlib

import numpy as np
import pytest
import torch

from recship.metrics.accuracy import AccuracyMetric
from recship.metrics.auc import AUCMetric, compute_auc
from recship.metrics.auprc import AUPRCMetric
from recship.metrics.average import AverageMetric
from recship.metrics.cali_free_ne import CaliFreeNEMetric
from recship.metrics.calibration import CalibrationMetric
from recship.metrics.ctr import CTRMetric
from recship.metrics.mae import MAEMetric
from recship.metrics.metrics_config import DefaultTaskInfo, RecTaskInfo
from recship.metrics.mse import MSEMetric
from recship.metrics.ne import NEMetric
from recship.metrics.ne_positive import NEPositiveMetric
from recship.metrics.nmse import NMSEMetric
from recship.metrics.num_missing_labels import NumMissingLabelsMetric
from recship.metrics.num_positive_samples import NumPositiveSamplesMetric
from recship.metrics.precision import PrecisionMetric
from recship.metrics.rauc import RAUCMetric
from recship.metrics.recall import RecallMetric
from recship.metrics.sum_weights import SumWeightsMetric
from recship.metrics.tensor_weighted_avg import TensorWeightedAvgMetric
from recship.metrics.unweighted_ne import UnweightedNEMetric
from recship.metrics.weighted_avg import WeightedAvgMetric
from recship.metrics.weighted_sum_predictions import WeightedSumPredictionsMetric
from recship.metrics.xauc import XAUCMetric

B, STEPS, WINDOW = 16, 7, 40  # the window keeps the last 2 batches (3 would be 48 > 40)
EPS = 1e-12


def _stream(seed: int = 0, soft: bool = False):
    g = np.random.default_rng(seed)
    for _ in range(STEPS):
        p = g.random(B).astype(np.float32)
        y = g.random(B).astype(np.float32) if soft else (g.random(B) < 0.3).astype(np.float32)
        w = (g.random(B) * 2).astype(np.float32)
        yield p, y, w


def _ne(p, y, w):
    p, y, w = (a.astype(np.float64) for a in (p, y, w))
    q = np.clip(p, EPS, 1 - EPS)
    ce = np.sum(-w * y * np.log2(q) - w * (1 - y) * np.log2(1 - q))
    pos, neg = np.sum(w * y), np.sum(w * (1 - y))
    base = np.clip(pos / max(np.sum(w), EPS), EPS, 1 - EPS)
    return ce / (-pos * np.log2(base) - neg * np.log2(1 - base))


def _ne_positive(p, y, w):
    p, y, w = (a.astype(np.float64) for a in (p, y, w))
    ce = np.sum(-w * y * np.log2(np.clip(p, EPS, 1 - EPS)))
    pos, neg = np.sum(w * y), np.sum(w * (1 - y))
    base = np.clip(pos / np.sum(w), EPS, 1 - EPS)
    return ce / (-pos * np.log2(base) - neg * np.log2(1 - base))


def _auc(p, y, w):
    """Weighted Mann-Whitney: the weight share of (positive, negative) pairs ranked correctly (no ties here)."""
    p, y, w = (a.astype(np.float64) for a in (p, y, w))
    pos, neg = y > 0.5, y <= 0.5
    right = (p[pos][:, None] > p[neg][None, :]) * w[pos][:, None] * w[neg][None, :]
    return right.sum() / (w[pos].sum() * w[neg].sum())


def _d(a):
    return a.astype(np.float64)


def _cali_free_ne(p, y, w):
    m = np.sum(_d(w) * p) / np.sum(_d(w))
    pos = np.sum(_d(w) * y)
    return _ne(p, y, w) / (-pos * np.log2(m) - (np.sum(_d(w)) - pos) * np.log2(1 - m))


def _mse_vs(p, y, w):
    return np.sum(_d(w) * (_d(y) - p) ** 2) / np.sum(_d(w))


REFERENCES = {
    "ne": (NEMetric, {}, False, {"ne": _ne}),
    "ne_positive": (NEPositiveMetric, {}, False, {"ne_positive": _ne_positive}),
    "unweighted_ne": (UnweightedNEMetric, {}, False, {"unweighted_ne": lambda p, y, w: _ne(p, y, np.ones_like(w))}),
    "ctr": (CTRMetric, {}, False, {"ctr": lambda p, y, w: np.sum(_d(w) * y) / np.sum(_d(w))}),
    "calibration": (CalibrationMetric, {}, False, {"calibration": lambda p, y, w: np.sum(_d(w) * p) / np.sum(_d(w) * y)}),
    "mse": (MSEMetric, {"include_r_squared": True}, True, {
        "mse": lambda p, y, w: np.sum(_d(w) * (_d(y) - p) ** 2) / np.sum(_d(w)),
        "rmse": lambda p, y, w: np.sqrt(np.sum(_d(w) * (_d(y) - p) ** 2) / np.sum(_d(w))),
        "r_squared": lambda p, y, w: 1 - np.sum(_d(w) * (_d(y) - p) ** 2)
        / np.sum(_d(w) * (_d(y) - np.sum(_d(w) * y) / np.sum(_d(w))) ** 2),
    }),
    "mae": (MAEMetric, {}, True, {"mae": lambda p, y, w: np.sum(_d(w) * np.abs(_d(y) - p)) / np.sum(_d(w))}),
    "accuracy": (AccuracyMetric, {"threshold": 0.4}, False,
                 {"accuracy": lambda p, y, w: np.sum(_d(w) * ((p >= 0.4) == (y > 0.5))) / np.sum(_d(w))}),
    "precision": (PrecisionMetric, {}, False,
                  {"precision": lambda p, y, w: np.sum(_d(w) * (p >= 0.5) * y) / np.sum(_d(w) * (p >= 0.5))}),
    "recall": (RecallMetric, {}, False,
               {"recall": lambda p, y, w: np.sum(_d(w) * (p >= 0.5) * y) / np.sum(_d(w) * y)}),
    "average": (AverageMetric, {}, True, {
        "label_average": lambda p, y, w: np.sum(_d(w) * y) / np.sum(_d(w)),
        "prediction_average": lambda p, y, w: np.sum(_d(w) * p) / np.sum(_d(w)),
    }),
    "num_positive_samples": (NumPositiveSamplesMetric, {}, False, {"num_positive_samples": lambda p, y, w: np.sum(_d(w) * y)}),
    "sum_weights": (SumWeightsMetric, {}, False, {"sum_weights": lambda p, y, w: np.sum(_d(w))}),
    "cali_free_ne": (CaliFreeNEMetric, {}, False, {"cali_free_ne": _cali_free_ne}),
    "nmse": (NMSEMetric, {}, True, {
        "nmse": lambda p, y, w: _mse_vs(p, y, w) / _mse_vs(np.ones_like(p), y, w),
        "nrmse": lambda p, y, w: np.sqrt(_mse_vs(p, y, w)) / np.sqrt(_mse_vs(np.ones_like(p), y, w)),
    }),
    "weighted_sum_predictions": (WeightedSumPredictionsMetric, {}, False,
                                 {"weighted_sum_predictions": lambda p, y, w: np.sum(_d(w) * p)}),
}


@pytest.mark.parametrize("namespace", sorted(REFERENCES))
def test_lifetime_and_window_values_match_numpy(namespace):
    cls, arguments, soft, formulas = REFERENCES[namespace]
    metric = cls(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW, **arguments)
    batches = list(_stream(seed=zlib.crc32(namespace.encode()), soft=soft))
    for p, y, w in batches:
        metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                      weights={"DefaultTask": torch.from_numpy(w)})
    got = metric.compute()
    lifetime = [np.concatenate(a) for a in zip(*batches)]
    window = [np.concatenate(a) for a in zip(*batches[-2:])]
    for name, formula in formulas.items():
        for prefix, data in (("lifetime", lifetime), ("window", window)):
            value = got[f"{namespace}-DefaultTask|{prefix}_{name}"]
            assert value.shape == (1,) and value.dtype == torch.float64
            np.testing.assert_allclose(value.item(), formula(*data), rtol=1e-6, err_msg=f"{prefix}_{name}")  # batch sums of float32 inputs are float32


def test_weighted_avg_window_counts_each_update_as_one_sample():
    """TorchRec's window for weighted_avg counts labels.shape[0] (= 1 task) samples per update: window_size 3 keeps
    the last 3 updates."""
    metric = WeightedAvgMetric(world_size=1, my_rank=0, batch_size=2, tasks=[DefaultTaskInfo], window_size=3)
    batches = list(_stream(seed=3))
    for p, y, w in batches:
        metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                      weights={"DefaultTask": torch.from_numpy(w)})
    got = metric.compute()
    mean = lambda bs: np.sum([np.sum(_d(w) * p) for p, _, w in bs]) / np.sum([np.sum(_d(w)) for _, _, w in bs])
    np.testing.assert_allclose(got["weighted_avg-DefaultTask|lifetime_weighted_avg"].item(), mean(batches), rtol=1e-6)
    np.testing.assert_allclose(got["weighted_avg-DefaultTask|window_weighted_avg"].item(), mean(batches[-3:]), rtol=1e-6)


def test_auc_window_trims_to_the_last_window_size_samples():
    """AUC's window is exact in samples: window_size 40 over batches of 16 keeps the last 40 samples (a partial
    batch at its start), against a weighted Mann-Whitney count."""
    metric = AUCMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW)
    batches = list(_stream(seed=11))
    for p, y, w in batches:
        metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                      weights={"DefaultTask": torch.from_numpy(w)})
    p, y, w = (np.concatenate(a)[-WINDOW:] for a in zip(*batches))
    value = metric.compute()["auc-DefaultTask|window_auc"]
    assert value.shape == (1,)
    np.testing.assert_allclose(value.item(), _auc(p, y, w), rtol=1e-5)


def test_auc_is_one_half_without_both_classes_and_one_for_a_perfect_ranking():
    p = torch.tensor([[0.9, 0.8, 0.3, 0.1]])
    assert compute_auc(1, [p], [torch.tensor([[1.0, 1.0, 0.0, 0.0]])], [torch.ones(1, 4)]).item() == 1.0
    assert compute_auc(1, [p], [torch.ones(1, 4)], [torch.ones(1, 4)]).item() == 0.5


def test_num_missing_labels_counts_the_weight_of_nan_labels():
    metric = NumMissingLabelsMetric(world_size=1, my_rank=0, batch_size=4, tasks=[DefaultTaskInfo], window_size=4)
    labels = torch.tensor([1.0, float("nan"), 0.0, float("nan")])
    metric.update(predictions={"DefaultTask": torch.rand(4)}, labels={"DefaultTask": labels},
                  weights={"DefaultTask": torch.tensor([1.0, 2.0, 3.0, 0.5])})
    assert metric.compute()["num_missing_labels-DefaultTask|lifetime_num_missing_labels"].item() == 2.5


def test_ne_include_logloss_and_the_zero_weight_task():
    metric = NEMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW,
                      include_logloss=True, allow_missing_label_with_zero_weight=True)
    (p, y, w), = list(_stream(seed=5))[:1]
    metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                  weights={"DefaultTask": torch.from_numpy(w)})
    got = metric.compute()
    q = np.clip(_d(p), EPS, 1 - EPS)
    ce = np.sum(-_d(w) * y * np.log2(q) - _d(w) * (1 - y) * np.log2(1 - q))
    np.testing.assert_allclose(got["ne-DefaultTask|lifetime_logloss"].item(), ce / np.sum(_d(w)), rtol=1e-6)
    zero = NEMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW,
                    allow_missing_label_with_zero_weight=True)
    zero.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                weights={"DefaultTask": torch.zeros(B)})
    assert zero.compute()["ne-DefaultTask|lifetime_ne"].item() == 1e-12


def _feed(metric, batches, **kwargs):
    for p, y, w in batches:
        metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                      weights={"DefaultTask": torch.from_numpy(w)}, **kwargs)
    return metric.compute()


def _xauc_sums(p, y, w):
    p, y, w = _d(p), _d(y), _d(w)
    agree = total = 0.0
    for i in range(len(p)):
        for j in range(i + 1, len(p)):
            same = (p[i] > p[j] and y[i] > y[j]) or (p[i] < p[j] and y[i] < y[j]) or (p[i] == p[j] and y[i] == y[j])
            agree += w[i] * w[j] * same
            total += w[i] * w[j]
    return agree, total


def test_xauc_counts_the_pairs_ordered_alike_inside_each_batch():
    batches = [(np.round(p, 1), np.round(y, 1), w) for p, y, w in _stream(seed=21, soft=True)]  # ties in both
    got = _feed(XAUCMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW), batches)
    sums = [_xauc_sums(*b) for b in batches]
    for prefix, part in (("lifetime", sums), ("window", sums[-2:])):
        want = sum(a for a, _ in part) / sum(t for _, t in part)
        np.testing.assert_allclose(got[f"xauc-DefaultTask|{prefix}_xauc"].item(), want, rtol=1e-6)  # float32 w_i * w_j


def test_rauc_is_the_share_of_pairs_ordered_as_the_labels():
    batches = list(_stream(seed=22, soft=True))
    got = _feed(RAUCMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW), batches)
    p, y, _ = (np.concatenate(a)[-WINDOW:] for a in zip(*batches))
    discordant = sum((p[i] < p[j]) == (y[i] > y[j]) and y[i] != y[j] for i in range(len(p)) for j in range(len(p)) if i < j)
    pairs = len(p) * (len(p) - 1) / 2
    np.testing.assert_allclose(got["rauc-DefaultTask|window_rauc"].item(), 1 - discordant / pairs, rtol=1e-6)


def _average_precision(p, y, w):
    order = np.argsort(-_d(p), kind="stable")
    p, y, w = _d(p)[order], _d(y)[order], _d(w)[order]
    tp, fp = np.cumsum(w * y), np.cumsum(w * (1 - y))
    last = np.append(p[1:] != p[:-1], True)  # the last sample of each distinct prediction
    tp, fp = tp[last], fp[last]
    recall, precision = tp / tp[-1], tp / (tp + fp)
    return float(np.sum(np.diff(np.concatenate([[0.0], recall])) * precision))


def test_auprc_is_the_average_precision_of_the_window_and_lifetime_the_weighted_mean_of_computes():
    metric = AUPRCMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW)
    batches = list(_stream(seed=23))
    computed = []
    for k in (3, len(batches)):
        got = _feed(metric, batches[len(computed) and 3:k])
        p, y, w = (np.concatenate(a)[-WINDOW:] for a in zip(*batches[:k]))
        want = _average_precision(p, y, w)
        np.testing.assert_allclose(got["auprc-DefaultTask|window_auprc"].item(), want, rtol=1e-5)
        computed.append((want, float(np.sum(_d(w)))))
    mean = sum(a * w for a, w in computed) / sum(w for _, w in computed)
    np.testing.assert_allclose(got["auprc-DefaultTask|lifetime_auprc"].item(), mean, rtol=1e-5)


def test_grouped_auc_averages_the_groups_and_survives_a_full_window():
    """TorchRec's grouped AUC fails once its window is full (its group keys keep the empty window's placeholder);
    recship's keeps one key per sample."""
    metric = AUCMetric(world_size=1, my_rank=0, batch_size=B, tasks=[DefaultTaskInfo], window_size=WINDOW, grouped_auc=True)
    g = np.random.default_rng(24)
    batches = list(_stream(seed=24))
    keys = [g.integers(0, 3, B) for _ in batches]
    for (p, y, w), k in zip(batches, keys):
        metric.update(predictions={"DefaultTask": torch.from_numpy(p)}, labels={"DefaultTask": torch.from_numpy(y)},
                      weights={"DefaultTask": torch.from_numpy(w)}, required_inputs={"grouping_keys": torch.from_numpy(k)})
    got = metric.compute()
    p, y, w = (np.concatenate(a)[-WINDOW:] for a in zip(*batches))
    k = np.concatenate(keys)[-WINDOW:]
    want = np.mean([_auc(p[k == group], y[k == group], w[k == group]) for group in np.unique(k)])
    np.testing.assert_allclose(got["auc-DefaultTask|window_grouped_auc"].item(), want, rtol=1e-5)


def test_tensor_weighted_avg_averages_the_named_output_weighted_or_not():
    tasks = [RecTaskInfo(name="a", tensor_name="t", weighted=True), RecTaskInfo(name="b", tensor_name="u", weighted=False)]
    metric = TensorWeightedAvgMetric(world_size=1, my_rank=0, batch_size=B, tasks=tasks, window_size=WINDOW,
                                     description="_x")
    assert metric.get_required_inputs() == {"t", "u"}
    g = torch.Generator().manual_seed(25)
    t, u, w = torch.randn(B, generator=g), torch.randn(B, generator=g), torch.rand(B, generator=g)
    metric.update(predictions={"a": torch.rand(B), "b": torch.rand(B)}, labels={"a": torch.ones(B), "b": torch.ones(B)},
                  weights={"a": w, "b": w}, required_inputs={"t": t, "u": u})
    got = metric.compute()
    torch.testing.assert_close(got["weighted_avg-a|lifetime_weighted_avg_x"].item(), float((t * w).sum() / w.sum()))
    torch.testing.assert_close(got["weighted_avg-b|window_weighted_avg_x"].item(), float(u.mean()))
