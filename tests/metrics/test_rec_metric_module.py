"""RecMetricModule and RecMetric: the keys, the compute modes, fused updates, validation, state_dict, throughput,
the compute interval, model output parsing and the errors."""

import dataclasses
import re

import pytest
import torch

from recship.metrics import metric_module as metric_module_file
from recship.metrics.metric_module import RecMetricModule, StateMetric, generate_metric_module
from recship.metrics.metrics_config import (
    DefaultMetricsConfig,
    DefaultTaskInfo,
    MetricsConfig,
    RecComputeMode,
    RecMetricDef,
    RecMetricEnum,
    RecTaskInfo,
    StateMetricEnum,
    ThroughputDef,
)
from recship.metrics.metrics_namespace import (
    MetricName,
    MetricNamespace,
    MetricPrefix,
    compose_metric_key,
    task_wildcard_metrics_pattern,
)
from recship.metrics.model_utils import parse_task_model_outputs, session_ids_to_tensor
from recship.metrics.ne import NEMetric

TASKS = [
    RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
    RecTaskInfo(name="like", label_name="l2", prediction_name="p2", weight_name="w2"),
]
B = 8


def _outputs(steps: int, seed: int = 0, zero_like_weights_at=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        w2 = torch.zeros(B) if step in zero_like_weights_at else torch.rand(B, generator=g)
        out.append({
            "p1": torch.rand(B, 1, generator=g), "l1": (torch.rand(B, 1, generator=g) < 0.4).float(),
            "w1": torch.rand(B, generator=g), "p2": torch.rand(B, generator=g),
            "l2": (torch.rand(B, generator=g) < 0.6).float(), "w2": w2,
        })
    return out


def _module(**config_fields) -> RecMetricModule:
    config = MetricsConfig(
        rec_tasks=TASKS,
        rec_metrics={
            RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0, 1], window_size=24, arguments={"include_logloss": True}),
            RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0, 1], window_size=20),
            RecMetricEnum.CALIBRATION: RecMetricDef(rec_task_indices=[1], window_size=16),
        },
        **config_fields,
    )
    return generate_metric_module(RecMetricModule, config, batch_size=B, world_size=1, my_rank=0,
                                  state_metrics_mapping={}, device=torch.device("cpu"))


def _run(module: RecMetricModule, outputs) -> dict:
    for out in outputs:
        module.update(out)
    return dict(module.compute())


def test_the_keys_are_torchrecs():
    got = _run(_module(), _outputs(3))
    assert sorted(got) == sorted([
        "auc-click|window_auc", "auc-like|window_auc", "calibration-like|lifetime_calibration",
        "calibration-like|window_calibration", "ne-click|lifetime_logloss", "ne-click|lifetime_ne",
        "ne-click|window_logloss", "ne-click|window_ne", "ne-like|lifetime_logloss", "ne-like|lifetime_ne",
        "ne-like|window_logloss", "ne-like|window_ne",
    ])
    assert compose_metric_key(MetricNamespace.NE, "click", MetricName.NE, MetricPrefix.LIFETIME) == "ne-click|lifetime_ne"
    assert re.fullmatch(task_wildcard_metrics_pattern(MetricNamespace.NE, MetricName.NE, MetricPrefix.WINDOW),
                        "ne-like|window_ne")


def test_default_config_reports_ne_and_throughput():
    module = generate_metric_module(RecMetricModule, DefaultMetricsConfig, batch_size=4, world_size=2, my_rank=0,
                                    state_metrics_mapping={}, device=torch.device("cpu"))
    for _ in range(3):
        module.update({"prediction": torch.rand(4), "label": torch.ones(4), "weight": torch.ones(4)})
    got = module.compute()
    assert set(got) == {"ne-DefaultTask|lifetime_ne", "ne-DefaultTask|window_ne",
                        "throughput-throughput|total_examples", "throughput-throughput|attempt_examples"}
    assert got["throughput-throughput|total_examples"].item() == 3 * 4 * 2  # batch x world size per step


def test_fused_modes_and_fused_updates_give_the_unfused_values():
    """The fused modes hold the tasks in one computation (values [] per task, not [1]); a fused update applies
    2 updates as one batch."""
    outputs = _outputs(5, seed=1)
    unfused = _run(_module(), outputs)
    for fields in ({"rec_compute_mode": RecComputeMode.FUSED_TASKS_COMPUTATION},
                   {"rec_compute_mode": RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION},
                   {"fused_update_limit": 2}):
        got = _run(_module(**fields), outputs)
        assert got.keys() == unfused.keys()
        for key, value in unfused.items():
            if "fused_update_limit" in fields and "|window_" in key and not key.startswith("auc"):
                continue  # a fused update enters the window as one batch (AUC's window is exact in samples)
            torch.testing.assert_close(got[key].reshape(1), value, rtol=1e-6, atol=0, msg=f"{fields} {key}")
    fused = _run(_module(rec_compute_mode=RecComputeMode.FUSED_TASKS_COMPUTATION), outputs)
    assert fused["ne-click|lifetime_ne"].shape == () and unfused["ne-click|lifetime_ne"].shape == (1,)


def test_window_holds_the_last_batches_and_lifetime_all():
    outputs = _outputs(6, seed=2)
    everything = _run(_module(), outputs)
    last_three = _run(_module(), outputs[-3:])  # NE window 24 = 3 batches of 8
    torch.testing.assert_close(everything["ne-click|window_ne"], last_three["ne-click|lifetime_ne"], rtol=1e-6, atol=0)
    assert not torch.allclose(everything["ne-click|lifetime_ne"], last_three["ne-click|lifetime_ne"])


def test_should_validate_update_skips_zero_weight_batches_and_zeroes_a_task_never_valid():
    outputs = _outputs(4, seed=3, zero_like_weights_at={0, 2})
    got = _run(_module(should_validate_update=True), outputs)
    kept = _run(_module(), [outputs[1], outputs[3]])
    torch.testing.assert_close(got["ne-like|lifetime_ne"], kept["ne-like|lifetime_ne"], rtol=1e-6, atol=0)
    never = _run(_module(should_validate_update=True), _outputs(2, seed=3, zero_like_weights_at={0, 1}))
    assert never["ne-like|lifetime_ne"].item() == 0.0 and never["calibration-like|window_calibration"].item() == 0.0


def test_state_dict_round_trip_resumes_the_lifetime_values():
    outputs = _outputs(4, seed=4)
    first = _module()
    _run(first, outputs[:2])
    state = first.state_dict()
    assert "rec_metrics.rec_metrics.0._metrics_computations.1.cross_entropy_sum" in state
    assert not any("window_" in key for key in state)  # windows are not checkpointed, as in TorchRec
    resumed = _module()
    resumed.load_state_dict(state)
    straight = _module()
    a, b = _run(resumed, outputs[2:]), _run(straight, outputs)
    torch.testing.assert_close(a["ne-like|lifetime_ne"], b["ne-like|lifetime_ne"], rtol=1e-12, atol=0)


def test_compute_interval_steps_and_its_adjustment(monkeypatch):
    module = _module(compute_interval_steps=3)
    flags = []
    for out in _outputs(6):
        module.update(out)
        flags.append(module.should_compute())
    assert flags == [False, False, True, False, False, True]
    now = [100.0]
    monkeypatch.setattr(metric_module_file.time, "time", lambda: now[0])
    module = _module(compute_interval_steps=10, max_compute_interval=5.0)
    module.update(_outputs(1)[0])
    module.compute()
    now[0] = 120.0
    module.compute()  # 20 s for 10 steps: 2 s a step; (5 - 1) s / 2 s = 2 steps
    assert module.compute_interval_steps == 2
    now[0] = 180.0
    module.compute()  # adjusted once only
    assert module.compute_interval_steps == 2
    module = _module(compute_interval_steps=10, max_compute_interval=50.0)
    module.compute()
    now[0] = 181.0
    module.compute()  # 1 s: in range, kept
    assert module.compute_interval_steps == 10


def test_throughput_after_warmup_and_state_metrics():
    class Optimizer(StateMetric):
        def get_metrics(self):
            return {"lr": torch.tensor(0.1)}

    config = dataclasses.replace(DefaultMetricsConfig, throughput_metric=ThroughputDef(window_size=10, warmup_steps=2),
                                 state_metrics=[StateMetricEnum.OPTIMIZERS])
    module = generate_metric_module(RecMetricModule, config, batch_size=4, world_size=1, my_rank=0,
                                    state_metrics_mapping={StateMetricEnum.OPTIMIZERS: Optimizer()},
                                    device=torch.device("cpu"))
    for _ in range(4):
        module.update({"prediction": torch.rand(4), "label": torch.ones(4), "weight": torch.ones(4)})
    got = module.compute()
    assert {"throughput-throughput|lifetime_throughput", "throughput-throughput|window_throughput",
            "throughput-throughput|attempt_throughput", "optimizers-optimizers|lr"} <= set(got)
    assert got["throughput-throughput|lifetime_throughput"].item() > 0


def test_local_compute_keys_and_reset():
    module = _module()
    _run(module, _outputs(2))
    local = module.local_compute()
    assert "ne-click|local_lifetime_ne" in local and "auc-like|local_window_auc" in local
    module.reset()
    assert module.rec_metrics.rec_metrics[0]._metrics_computations[0].cross_entropy_sum.item() == 0.0
    assert module.compute()["auc-click|window_auc"].item() == 0.5


def test_parse_task_model_outputs_squeezes_and_skips_empty_tasks():
    out = _outputs(1)[0]
    out["p2"], out["l2"], out["w2"] = torch.empty(0), torch.empty(0), torch.empty(0)
    labels, predictions, weights, required = parse_task_model_outputs(TASKS, out)
    assert set(labels) == {"click"} and predictions["click"].shape == (B,) and required == {}
    with pytest.raises(ValueError, match="Label name nope"):
        parse_task_model_outputs([RecTaskInfo(label_name="nope")], out)
    with pytest.raises(ValueError, match="same number of elements"):
        parse_task_model_outputs([TASKS[0]], {**out, "w1": torch.ones(B + 1)})
    assert session_ids_to_tensor(["a", "a", "b", "c", "c"]).tolist() == [1, 1, 2, 3, 3]


def test_bad_configurations_are_refused_by_name():
    with pytest.raises(ValueError, match="window size"):
        NEMetric(world_size=4, my_rank=0, batch_size=16, tasks=[DefaultTaskInfo], window_size=32)
    with pytest.raises(ValueError, match="fused"):
        NEMetric(world_size=1, my_rank=0, batch_size=4, tasks=[DefaultTaskInfo],
                 compute_mode=RecComputeMode.FUSED_TASKS_COMPUTATION, fused_update_limit=2)
    with pytest.raises(TypeError, match="thresold"):
        NEMetric(world_size=1, my_rank=0, batch_size=4, tasks=[DefaultTaskInfo], thresold=0.3)
    with pytest.raises(ValueError, match="out of range"):
        MetricsConfig(rec_tasks=TASKS, rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_task_indices=[2])})
    config = MetricsConfig(rec_tasks=TASKS, rec_metrics={RecMetricEnum.LOG_LOSS: RecMetricDef(rec_task_indices=[0])})
    with pytest.raises(ValueError, match="log_loss is not implemented"):
        generate_metric_module(RecMetricModule, config, 8, 1, 0, {}, torch.device("cpu"))
