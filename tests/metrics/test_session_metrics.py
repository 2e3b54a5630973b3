"""NDCG and the session-level recall and precision against per-session numpy references."""

import numpy as np
import pytest
import torch

from recship.metrics.metrics_config import RecComputeMode, RecTaskInfo, SessionMetricDef
from recship.metrics.ndcg import NDCGMetric
from recship.metrics.precision_session import PrecisionSessionMetric
from recship.metrics.recall_session import RecallSessionMetric, ranking_within_session
from recship.metrics.rec_metric import RecMetricException

LENGTHS = [4, 1, 5, 3, 5, 2]
B = sum(LENGTHS)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    session = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    return torch.rand(B, generator=g), torch.randint(0, 3, (B,), generator=g).float(), torch.rand(B, generator=g), session


def _ndcg_reference(p, y, w, s, exponential=False, k=None, negative=False):
    if negative:
        p, y = 1 - p, 1 - y
    losses = []
    for session in np.unique(s):
        ps, ys, ws = p[s == session], y[s == session], w[s == session]
        gain = (2.0 ** ys - 1) if exponential else ys
        cut = len(ps) if k is None else min(k, len(ps))
        disc = 1 / np.log2(np.arange(2, len(ps) + 2))
        disc[cut:] = 0
        dcg = np.sum(gain[np.argsort(-ps, kind="stable")] * disc)
        ideal = np.sum(np.sort(gain)[::-1] * disc) or 1e-6
        losses.append((1 - dcg / ideal) * ws.max())
    return np.mean(losses)


@pytest.mark.parametrize("options", [{}, {"exponential_gain": True, "k": 2}])
def test_ndcg_is_one_minus_the_weighted_session_ndcg(options):
    tasks = [RecTaskInfo(name="a"), RecTaskInfo(name="b", is_negative_task=True)]
    metric = NDCGMetric(world_size=1, my_rank=0, batch_size=B, tasks=tasks, window_size=1000, **options)
    assert metric.get_required_inputs() == {"session_id"}
    p, y, w, s = _inputs(51)
    y_b = (y > 0).float()  # the negative task's labels in [0, 1]
    predictions, labels = {"a": p, "b": p.clone()}, {"a": y, "b": y_b}
    metric.update(predictions=predictions, labels=labels, weights={"a": w, "b": w}, required_inputs={"session_id": s})
    assert torch.equal(labels["b"], y_b)  # the caller's tensors are left alone (TorchRec flips them in place)
    got = metric.compute()
    np_args = dict(exponential=options.get("exponential_gain", False), k=options.get("k"))
    for task, labels_np, negative in (("a", y.numpy(), False), ("b", y_b.numpy(), True)):
        want = _ndcg_reference(p.double().numpy(), labels_np.astype(np.float64), w.double().numpy(), s.numpy(),
                               negative=negative, **np_args)
        np.testing.assert_allclose(got[f"ndcg-{task}|lifetime_ndcg"].item(), want, rtol=1e-6)


def test_ranking_within_session_counts_the_better_predicted_samples_of_the_session():
    predictions = torch.tensor([[0.3, 0.9, 0.5, 0.9, 0.1]])
    session = torch.tensor([[0, 0, 0, 1, 1]])
    assert ranking_within_session(predictions, session).tolist() == [2, 0, 1, 0, 1]


@pytest.mark.parametrize("cls,name", [(RecallSessionMetric, "recall"), (PrecisionSessionMetric, "precision")])
def test_session_recall_and_precision_take_the_top_of_each_session_as_positive(cls, name):
    task = RecTaskInfo(name="t", session_metric_def=SessionMetricDef(session_var_name="sess", top_threshold=2))
    metric = cls(world_size=1, my_rank=0, batch_size=B, tasks=[task], window_size=1000)
    assert metric.get_required_inputs() == {"sess"}
    p, y, w, s = _inputs(52)
    y = (y > 0).float()
    metric.update(predictions={"t": p}, labels={"t": y}, weights={"t": w}, required_inputs={"sess": s})
    got = metric.compute()[f"{name}_session_level-t|lifetime_{name}_session_level"].item()
    top = np.zeros(B, dtype=bool)
    for session in np.unique(s.numpy()):
        index = np.nonzero(s.numpy() == session)[0]
        top[index[np.argsort(-p.numpy()[index], kind="stable")[:2]]] = True
    wd, yd = w.double().numpy(), y.numpy()
    tp = np.sum(wd * yd * top)
    want = tp / np.sum(wd * yd) if name == "recall" else tp / np.sum(wd * top)
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_session_metrics_refuse_fused_modes_and_tasks_without_a_threshold():
    task = RecTaskInfo(name="t", session_metric_def=SessionMetricDef(session_var_name="sess", top_threshold=2))
    with pytest.raises(RecMetricException, match="Fused computation"):
        RecallSessionMetric(world_size=1, my_rank=0, batch_size=4, tasks=[task], window_size=8,
                            compute_mode=RecComputeMode.FUSED_TASKS_COMPUTATION)
    with pytest.raises(RecMetricException, match="top threshold"):
        RecallSessionMetric(world_size=1, my_rank=0, batch_size=4, window_size=8,
                            tasks=[RecTaskInfo(session_metric_def=SessionMetricDef(session_var_name="sess"))])
