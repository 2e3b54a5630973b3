"""On 2 gloo ranks, compute() reduces the metric states across the ranks (sums added, AUC's sample buffers
concatenated, of different lengths on each rank) and equals one process computing on all the data; the local
states survive the reduction."""

from typing import Dict, List

import pytest
import torch

from gloo_ranks import run_ranks
from recship.metrics.metric_module import RecMetricModule, generate_metric_module
from recship.metrics.metrics_config import MetricsConfig, RecMetricDef, RecMetricEnum, RecTaskInfo

TASKS = [RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
         RecTaskInfo(name="like", label_name="l2", prediction_name="p2", weight_name="w2")]
METRICS = [RecMetricEnum.NE, RecMetricEnum.AUC, RecMetricEnum.CALIBRATION, RecMetricEnum.MSE, RecMetricEnum.CTR,
           RecMetricEnum.ACCURACY]
BATCH = {0: 8, 1: 5}  # rank 1 holds fewer samples: the AUC buffers differ in length across ranks
STEPS = 4


def _batches(rank: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    b = BATCH[rank]
    return [{"p1": torch.rand(b, 1, generator=g), "l1": (torch.rand(b, 1, generator=g) < 0.4).float(),
             "w1": torch.rand(b, generator=g), "p2": torch.rand(b, generator=g),
             "l2": (torch.rand(b, generator=g) < 0.5).float(), "w2": torch.rand(b, generator=g)} for _ in range(STEPS)]


def _module(world_size: int, rank: int) -> RecMetricModule:
    config = MetricsConfig(
        rec_tasks=TASKS,
        rec_metrics={m: RecMetricDef(rec_task_indices=[0, 1], window_size=1000) for m in METRICS},
        compute_on_all_ranks=True,
    )
    return generate_metric_module(RecMetricModule, config, batch_size=8, world_size=world_size, my_rank=rank,
                                  state_metrics_mapping={}, device=torch.device("cpu"))


def _worker(rank: int, world_size: int) -> Dict[str, Dict[str, torch.Tensor]]:
    module = _module(world_size, rank)
    batches = _batches(rank)
    for out in batches[:2]:
        module.update(out)
    first = dict(module.compute())
    for out in batches[2:]:
        module.update(out)
    return {"first": first, "global": dict(module.compute()), "local": dict(module.local_compute()),
            "pre_compute": module.get_pre_compute_states()}


def _single(batches: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    module = _module(1, 0)
    for out in batches:
        module.update(out)
    return dict(module.compute())


def _concat(parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("world_size", [2])  # the parameter marks the test distributed (tests/conftest.py)
def test_two_ranks_compute_the_metric_of_all_their_data(world_size):
    results = run_ranks(_worker, world_size)
    per_rank = [_batches(0), _batches(1)]
    # one process, each step's batch the two ranks' batches together (rank 0 first)
    whole = _single([_concat([per_rank[0][s], per_rank[1][s]]) for s in range(STEPS)])
    whole_first = _single([_concat([per_rank[0][s], per_rank[1][s]]) for s in range(2)])
    assert len(whole) == 2 * (2 + 2 + 4 + 2 + 2 + 1)  # per task: NE, calibration, MSE+RMSE, CTR, accuracy (lifetime, window); AUC
    for rank in (0, 1):
        got = results[rank]
        assert got["global"].keys() == whole.keys()
        for key, value in whole.items():
            torch.testing.assert_close(got["global"][key], value, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {key}")
            torch.testing.assert_close(got["first"][key], whole_first[key], rtol=1e-6, atol=1e-7, msg=key)
        # the local values are this rank's alone: the reduction did not overwrite the states
        local = _single(per_rank[rank])
        for key, value in local.items():
            prefix, name = key.split("|")
            torch.testing.assert_close(got["local"][f"{prefix}|local_{name}"], value, rtol=1e-6, atol=1e-7, msg=key)
    # the gathered AUC buffers hold all 2 x 4 x (8 + 5) samples ... of each task, on both ranks
    for rank in (0, 1):
        predictions = results[rank]["pre_compute"]["auc"]["like"]["predictions"]
        assert predictions[0].shape == (1, STEPS * (BATCH[0] + BATCH[1]))
        ne = results[rank]["pre_compute"]["ne"]["click"]["weighted_num_samples"]
        expected = sum(float(b["w1"].double().sum()) for r in (0, 1) for b in per_rank[r])
        torch.testing.assert_close(ne, torch.tensor([expected], dtype=torch.float64), rtol=1e-6, atol=0)
    assert results[0]["global"]["auc-like|window_auc"].item() != results[0]["local"]["auc-like|local_window_auc"].item()
