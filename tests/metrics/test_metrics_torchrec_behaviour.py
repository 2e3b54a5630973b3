"""Metric behaviour TorchRec 1.8.0's own unit tests check: the session metrics' error texts, ThroughputMetric's
step count (kept, and checkpointed as ``num_batch``, only with batch size stages), and TowerQPSMetric's fused
update refusing per-task dicts that miss a task (RecMetricException, TorchRec's text)."""

import pytest
import torch

from recship.metrics.metrics_config import BatchSizeStage, RecComputeMode, RecTaskInfo, SessionMetricDef
from recship.metrics.precision_session import PrecisionSessionMetric
from recship.metrics.rec_metric import RecMetricException
from recship.metrics.recall_session import RecallSessionMetric
from recship.metrics.throughput import ThroughputMetric
from recship.metrics.tower_qps import TowerQPSMetric

SESSION_KW = dict(world_size=1, my_rank=0, batch_size=4, window_size=8)


@pytest.mark.parametrize("cls, label", [(RecallSessionMetric, "recall"), (PrecisionSessionMetric, "precision")])
def test_session_metrics_error_texts_are_torchrecs(cls, label):
    task = RecTaskInfo(name="t", session_metric_def=SessionMetricDef(session_var_name="sess", top_threshold=2))
    fused = f"^Fused computation is not supported for {label} session-level metrics$"
    with pytest.raises(RecMetricException, match=fused):
        cls(tasks=[task], compute_mode=RecComputeMode.FUSED_TASKS_COMPUTATION, **SESSION_KW)
    with pytest.raises(RecMetricException, match=f"^Fused update is not supported for {label} session-level metrics$"):
        cls(tasks=[task], fused_update_limit=2, **SESSION_KW)
    with pytest.raises(RecMetricException, match=r"^Please, specify the session metric definition \(task 'bare'\)$"):
        cls(tasks=[task, RecTaskInfo(name="bare")], **SESSION_KW)
    no_threshold = RecTaskInfo(name="u", session_metric_def=SessionMetricDef(session_var_name="sess"))
    with pytest.raises(RecMetricException, match=r"^Please, specify the top threshold \(task 'u'\)$"):
        cls(tasks=[no_threshold], **SESSION_KW)
    cls(tasks=[task], **SESSION_KW)  # a complete task builds


def test_throughput_keeps_a_step_count_only_with_batch_size_stages():
    plain = ThroughputMetric(batch_size=32, world_size=4, window_seconds=100)
    for _ in range(3):
        plain.update()
    state = plain.state_dict()
    assert "num_batch" not in state and not hasattr(plain, "_num_batch")
    assert plain.total_examples.item() == 3 * 32 * 4

    staged = ThroughputMetric(batch_size=32, world_size=4, window_seconds=100,
                              batch_size_stages=[BatchSizeStage(256, 1), BatchSizeStage(512, None)])
    for _ in range(3):
        staged.update()
    staged_state = staged.state_dict()
    assert staged_state["num_batch"].item() == 3
    assert staged.total_examples.item() == (256 + 512 + 512) * 4  # stage 1 covers step 1 only

    # a staged checkpoint loads into a job without stages: the count is dropped, not adopted
    resumed = ThroughputMetric(batch_size=32, world_size=4, window_seconds=100)
    resumed.load_state_dict(staged_state)
    assert not hasattr(resumed, "_num_batch")
    assert resumed.total_examples.item() == staged.total_examples.item()
    # and into a staged job: it resumes in the second stage
    again = ThroughputMetric(batch_size=32, world_size=4, window_seconds=100,
                             batch_size_stages=[BatchSizeStage(256, 1), BatchSizeStage(512, None)])
    again.load_state_dict(staged_state)
    again.update()
    assert again.total_examples.item() == staged.total_examples.item() + 512 * 4


def _fused_qps(batch_size: int) -> TowerQPSMetric:
    tasks = [RecTaskInfo(name="t1"), RecTaskInfo(name="t2")]
    return TowerQPSMetric(world_size=1, my_rank=0, batch_size=batch_size, tasks=tasks, warmup_steps=1,
                          window_size=64, compute_mode=RecComputeMode.FUSED_TASKS_COMPUTATION,
                          should_validate_update=True)


def test_tower_qps_fused_update_names_the_missing_tasks():
    torch.manual_seed(0)
    b = 8
    qps = _fused_qps(b)
    with pytest.raises(RecMetricException,
                       match=r"^Failed to convert labels to tensor for fused computation: no labels for tasks "
                             r"\['t1', 't2'\] \(the dict has keys \['key_0', 'key_1'\]\)$"):
        qps.update(predictions=torch.ones(b), labels={"key_0": torch.rand(b), "key_1": torch.rand(b)},
                   weights=torch.rand(b))
    with pytest.raises(RecMetricException, match="^Failed to convert weights to tensor for fused computation: "
                                                 r"no weights for tasks \['t2'\]"):
        qps.update(predictions=torch.ones(b), labels=torch.rand(2, b), weights={"t1": torch.rand(b)})
    with pytest.raises(RecMetricException, match="^Failed to convert labels to tensor for fused computation: stack"):
        qps.update(predictions=torch.ones(b), labels={"t1": torch.rand(b), "t2": torch.rand(b + 1)}, weights=None)


def test_tower_qps_fused_update_from_a_dict_equals_the_stacked_tensor():
    torch.manual_seed(0)
    b = 8
    by_dict, by_tensor = _fused_qps(b), _fused_qps(b)
    for _ in range(3):
        labels = {"t1": torch.rand(b), "t2": torch.rand(b)}
        weights = {"t1": torch.rand(b), "t2": torch.zeros(b)}  # t2 never has a valid update
        by_dict.update(predictions=None, labels=labels, weights=weights)
        by_tensor.update(predictions=None, labels=torch.stack([labels["t1"], labels["t2"]]),
                         weights=torch.stack([weights["t1"], weights["t2"]]))
    comp_dict, comp_tensor = by_dict.computations[0], by_tensor.computations[0]
    assert comp_dict.has_valid_update.tolist() == [True, False]
    assert torch.equal(comp_dict.has_valid_update, comp_tensor.has_valid_update)
    # the examples count for both towers (the weights only decide has_valid_update); warmup_steps=1
    for name, want in (("num_examples", 3 * b), ("warmup_examples", b)):
        assert torch.equal(getattr(comp_dict, name), getattr(comp_tensor, name))
        assert getattr(comp_dict, name).tolist() == [want, want]
