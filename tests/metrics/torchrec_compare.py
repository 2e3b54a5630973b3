"""Run recship.metrics and TorchRec's metrics on the same seeded streams and compare every value, bit for bit.

Not a test (it needs TorchRec 1.8.0, which recship does not depend on): run each side under its own interpreter,
then diff::

    /path/to/torchrec-venv/bin/python tests/metrics/torchrec_compare.py run torchrec /tmp/torchrec.pt
    .venv/bin/python tests/metrics/torchrec_compare.py run recship /tmp/recship.pt
    .venv/bin/python tests/metrics/torchrec_compare.py diff /tmp/torchrec.pt /tmp/recship.pt

The package is named by a string, so this file imports neither. Scenarios: every metric of REC_METRICS_MAPPING
through ``generate_metric_module`` in each compute mode, with fused updates and with update validation; grouped
AUC/AUPRC/RAUC; GAUC; tower QPS on a fake clock; the session metrics and NDCG; 2 gloo ranks (``compute`` and
``get_pre_compute_states``); the CPU-offloaded module on 2 gloo ranks. Timings (throughput) are left out.
Where TorchRec 1.8.0 has a bug recship does not copy, the stream steers clear of it (see the comments).
"""

import importlib
import os
import socket
import sys
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Results = Dict[str, Any]


def _modules(pkg: str) -> Any:
    class M:
        cfg = importlib.import_module(pkg + ".metrics.metrics_config")
        mm = importlib.import_module(pkg + ".metrics.metric_module")
    return M


def _save_module_values(results: Results, prefix: str, module: Any, local: bool = True) -> None:
    for key, value in dict(module.compute()).items():
        if "throughput" in key and "examples" not in key:
            continue  # wall-clock rates
        results[f"{prefix}/{key}"] = value.clone()
    if local:
        for key, value in dict(module.local_compute()).items():
            results[f"{prefix}/{key}"] = value.clone()


def scenario_modes(pkg: str, grouped: bool) -> Results:
    """Most metrics, 2 tasks (+2 for the tensor weighted average), each compute mode, fused updates, validation."""
    M = _modules(pkg)
    cfg, E = M.cfg, M.cfg.RecMetricEnum
    T = cfg.RecTaskInfo
    tasks = [T(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
             T(name="like", label_name="l2", prediction_name="p2", weight_name="w2"),
             T(name="tw1", label_name="l1", prediction_name="p1", weight_name="w1", tensor_name="t1"),
             T(name="tw2", label_name="l2", prediction_name="p2", weight_name="w2", tensor_name="t2", weighted=False)]
    metrics: Dict[Any, Any] = {
        E.NE: {"include_logloss": True}, E.NE_POSITIVE: None, E.CTR: None, E.CALIBRATION: None, E.AUC: None,
        E.MSE: {"include_r_squared": True}, E.MAE: None, E.WEIGHTED_AVG: None, E.ACCURACY: {"threshold": 0.4},
        E.PRECISION: None, E.RECALL: None, E.UNWEIGHTED_NE: None, E.AVERAGE: None, E.NUM_MISSING_LABELS: None,
        E.WEIGHTED_SUM_PREDICTIONS: None, E.NUM_POSITIVE_SAMPLES: None, E.SUM_WEIGHTS: None, E.AUPRC: None,
        E.RAUC: None, E.XAUC: None, E.CALI_FREE_NE: None, E.NMSE: None, E.TENSOR_WEIGHTED_AVG: {"description": "_t"},
    }
    if grouped:  # TorchRec's grouped AUC/RAUC fail once their window is full: a window the stream never fills
        metrics.update({E.AUC: {"grouped_auc": True}, E.AUPRC: {"grouped_auprc": True}, E.RAUC: {"grouped_rauc": True}})
    results: Results = {}
    modes = [("unfused", cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION, 0, False),
             ("fused", cfg.RecComputeMode.FUSED_TASKS_COMPUTATION, 0, False),
             ("fused_states", cfg.RecComputeMode.FUSED_TASKS_AND_STATES_COMPUTATION, 0, False),
             ("fused_update3", cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION, 3, False),
             ("validate", cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION, 0, True)]
    for name, mode, limit, validate in modes:
        defs = {}
        for enum, arguments in metrics.items():
            if limit and (enum == E.TENSOR_WEIGHTED_AVG or (grouped and enum in (E.AUC, E.AUPRC, E.RAUC))):
                continue  # fused updates drop required inputs (both)
            indices = [2, 3] if enum == E.TENSOR_WEIGHTED_AVG else [0, 1]
            defs[enum] = cfg.RecMetricDef(rec_task_indices=indices, window_size=1000 if grouped else 50,
                                          arguments=dict(arguments) if arguments else None)
        config = cfg.MetricsConfig(rec_tasks=tasks, rec_metrics=defs, rec_compute_mode=mode, fused_update_limit=limit,
                                   throughput_metric=cfg.ThroughputDef(window_size=10, warmup_steps=2),
                                   should_validate_update=validate, compute_interval_steps=4)
        module = M.mm.generate_metric_module(M.mm.RecMetricModule, config, batch_size=16, world_size=1, my_rank=0,
                                             state_metrics_mapping={}, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(7)
        for step in range(11):
            p1 = torch.rand(16, 1, generator=g)
            if step % 3 == 0:
                p1 = (p1 * 5).round() / 5  # ties
            out = {"p1": p1, "p2": torch.rand(16, generator=g), "l1": (torch.rand(16, 1, generator=g) < 0.3).float(),
                   "l2": torch.rand(16, generator=g), "w1": torch.rand(16, generator=g) * 2,
                   "w2": torch.ones(16) if step % 2 else torch.rand(16, generator=g)}
            if validate and step in (0, 5):
                out["w2"] = torch.zeros(16)
            out.update(grouping_keys=torch.randint(0, 3, (16,), generator=g), t1=torch.randn(16, generator=g),
                       t2=torch.randn(16, 1, generator=g))
            module.update(out)
            if module.should_compute() or step == 10:
                _save_module_values(results, f"{name}/{step}", module)
        for key, value in module.state_dict().items():
            if "time_lapse" not in key:
                results[f"{name}/state_dict/{key}"] = value.clone()
    return results


def scenario_more(pkg: str) -> Results:
    """Segmented NE, recalibrated and serving metrics, multiclass recall (per task and fused), GAUC."""
    M = _modules(pkg)
    cfg, E = M.cfg, M.cfg.RecMetricEnum
    T = cfg.RecTaskInfo
    tasks = [T(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
             T(name="like", label_name="l2", prediction_name="p2", weight_name="w2"),
             T(name="cls", label_name="lc", prediction_name="pc", weight_name="w1")]
    results: Results = {}
    for name, mode in (("unfused", cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION), ("fused", cfg.RecComputeMode.FUSED_TASKS_COMPUTATION)):
        d = cfg.RecMetricDef
        defs = {E.SEGMENTED_NE: d(rec_task_indices=[0, 1], window_size=40, arguments={"num_groups": 3, "include_logloss": True}),
                E.RECALIBRATED_NE: d(rec_task_indices=[0, 1], window_size=40, arguments={"recalibration_coefficient": 0.3}),
                E.RECALIBRATED_CALIBRATION: d(rec_task_indices=[0, 1], window_size=40, arguments={"recalibration_coefficient": 0.3}),
                E.SERVING_NE: d(rec_task_indices=[0, 1], window_size=40), E.SERVING_CALIBRATION: d(rec_task_indices=[0, 1], window_size=40)}
        if name == "unfused":
            defs[E.MULTICLASS_RECALL] = d(rec_task_indices=[2], window_size=40, arguments={"number_of_classes": 4})
        module = M.mm.generate_metric_module(M.mm.RecMetricModule, cfg.MetricsConfig(rec_tasks=tasks, rec_metrics=defs, rec_compute_mode=mode),
                                             batch_size=16, world_size=1, my_rank=0, state_metrics_mapping={}, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(9)
        for step in range(7):
            w1 = torch.rand(16, generator=g)
            w1[:3] = 0
            module.update({"p1": torch.rand(16, 1, generator=g), "l1": (torch.rand(16, 1, generator=g) < 0.3).float(), "w1": w1,
                           "p2": torch.rand(16, generator=g), "l2": (torch.rand(16, generator=g) < 0.5).float(),
                           "w2": torch.rand(16, generator=g), "pc": torch.rand(16, 4, generator=g),
                           "lc": torch.randint(0, 4, (16,), generator=g).float(), "grouping_keys": torch.randint(0, 3, (16,), generator=g)})
            if step % 3 == 2 or step == 6:
                _save_module_values(results, f"{name}/{step}", module, local=False)
    gauc = importlib.import_module(pkg + ".metrics.gauc")
    for n_tasks in (1, 2):
        computation = gauc.GAUCMetricComputation(my_rank=0, batch_size=20, n_tasks=n_tasks, window_size=40)
        g = torch.Generator().manual_seed(11)
        for step in range(4):
            p = (torch.rand(n_tasks, 20, generator=g) * 10).round() / 10
            if step == 1:
                p[:, 5:8] = 0.5  # a session of equal predictions
            computation.update(predictions=p, labels=(torch.rand(n_tasks, 20, generator=g) < 0.5).float(),
                               weights=torch.rand(n_tasks, 20, generator=g), num_candidates=torch.tensor([5, 3, 7, 1, 4]))
            for report in computation.compute():
                results[f"gauc{n_tasks}/{step}/{report.metric_prefix}{report.name}"] = report.value.clone()
    return results


def scenario_other(pkg: str) -> Results:
    """Tower QPS (fake clock), scalar, hindsight target PR, multi-label precision, output."""
    M = _modules(pkg)
    cfg, E = M.cfg, M.cfg.RecMetricEnum
    clock = [1000.0]
    importlib.import_module(pkg + ".metrics.tower_qps").time.monotonic = lambda: clock[0]
    tasks = [cfg.RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
             cfg.RecTaskInfo(name="ml", label_name="lm", prediction_name="pm", weight_name="w1")]
    d = cfg.RecMetricDef
    defs = {E.TOWER_QPS: d(rec_task_indices=[0], window_size=40, arguments={"warmup_steps": 2}),
            E.SCALAR: d(rec_task_indices=[0], window_size=40),
            E.HINDSIGHT_TARGET_PR: d(rec_task_indices=[0], window_size=40, arguments={"target_precision": 0.3}),
            E.MULTI_LABEL_PRECISION: d(rec_task_indices=[1], window_size=40, arguments={"num_labels": 3, "label_names": ["a", "b", "c"]}),
            E.OUTPUT: d(rec_task_indices=[0], window_size=40)}
    module = M.mm.generate_metric_module(M.mm.RecMetricModule, cfg.MetricsConfig(rec_tasks=tasks, rec_metrics=defs), batch_size=16,
                                         world_size=1, my_rank=0, state_metrics_mapping={}, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(13)
    results: Results = {}
    for step in range(7):
        clock[0] += 0.5 + step * 0.25
        module.update({"p1": torch.rand(16, 1, generator=g), "l1": (torch.rand(16, 1, generator=g) < 0.3).float(),
                       "w1": torch.rand(16, generator=g), "pm": torch.randint(0, 8, (16,), generator=g).float(),
                       "lm": torch.randint(0, 8, (16,), generator=g).float(), "latest_imp": torch.rand(16, generator=g),
                       "total_latest_imp": torch.rand(16, generator=g)})
        if step % 3 == 2 or step == 6:
            for key, value in dict(module.compute()).items():
                if key.endswith("_hindsight_target_pr") and value.numel() != 1:
                    value = torch.tensor([float(value.numel())], dtype=torch.double)  # TorchRec: torch.Tensor(idx)
                results[f"{step}/{key}"] = value.clone()
    return results


def scenario_sessions(pkg: str) -> Results:
    """NDCG (options, negative task, per task and fused) and the session-level recall and precision."""
    M = _modules(pkg)
    cfg, E = M.cfg, M.cfg.RecMetricEnum
    tasks = [cfg.RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1",
                             session_metric_def=cfg.SessionMetricDef(session_var_name="session", top_threshold=2)),
             cfg.RecTaskInfo(name="like", label_name="l2", prediction_name="p2", weight_name="w2", is_negative_task=True,
                             session_metric_def=cfg.SessionMetricDef(session_var_name="session", top_threshold=1,
                                                                     run_ranking_of_labels=True))]
    results: Results = {}
    options = [{}, {"exponential_gain": True, "k": 2}, {"remove_single_length_sessions": True, "report_ndcg_as_decreasing_curve": False},
               {"scale_by_weights_tensor": True}]
    for variant, arguments in enumerate(options):
        for mode in (cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION, cfg.RecComputeMode.FUSED_TASKS_COMPUTATION):
            unfused = mode == cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION
            defs = {}  # the session metrics before NDCG: TorchRec's NDCG flips the negative task's outputs in place
            if unfused:
                defs[E.RECALL_SESSION_LEVEL] = cfg.RecMetricDef(rec_task_indices=[0, 1], window_size=60)
                defs[E.PRECISION_SESSION_LEVEL] = cfg.RecMetricDef(rec_task_indices=[0, 1], window_size=60)
            defs[E.NDCG] = cfg.RecMetricDef(rec_task_indices=[0, 1], window_size=60, arguments=dict(arguments))
            module = M.mm.generate_metric_module(M.mm.RecMetricModule, cfg.MetricsConfig(rec_tasks=tasks, rec_metrics=defs, rec_compute_mode=mode),
                                                 batch_size=20, world_size=1, my_rank=0, state_metrics_mapping={}, device=torch.device("cpu"))
            g = torch.Generator().manual_seed(17 + variant)
            for step in range(5):
                session = torch.repeat_interleave(torch.arange(6), torch.tensor([4, 1, 5, 3, 5, 2])) + 10 * step
                module.update({"p1": (torch.rand(20, 1, generator=g) * 8).round() / 8, "l1": (torch.rand(20, 1, generator=g) < 0.4).float(),
                               "w1": torch.rand(20, generator=g), "p2": torch.rand(20, generator=g),
                               "l2": torch.randint(0, 3, (20,), generator=g).float(), "w2": torch.rand(20, generator=g),
                               "session": session, "session_id": session if unfused else session.expand(2, -1)})
                if step % 2:
                    _save_module_values(results, f"{variant}/{mode.name}/{step}", module, local=False)
    return results


def _rank_worker(rank: int, pkg: str, port: int, out: str, offloaded: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    M = _modules(pkg)
    cfg, E = M.cfg, M.cfg.RecMetricEnum
    results: Results = {}
    if offloaded:
        tasks = [cfg.RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1")]
        config = cfg.MetricsConfig(rec_tasks=tasks, compute_on_all_ranks=True, rec_metrics={
            m: cfg.RecMetricDef(rec_task_indices=[0], window_size=60) for m in (E.NE, E.AUC, E.CALIBRATION, E.CTR)})
        offload = importlib.import_module(pkg + ".metrics.cpu_offloaded_metric_module")
        module = offload.CPUOffloadedRecMetricModule(torch.device("cpu"), 100, 100, 3, False, batch_size=10, world_size=2,
                                                     rec_tasks=tasks, rec_metrics=M.mm._generate_rec_metrics(config, 2, rank, 10))
        g = torch.Generator().manual_seed(70 + rank)
        for step in range(8):
            module.update({"p1": torch.rand(10, generator=g), "l1": (torch.rand(10, generator=g) < 0.4).float(), "w1": torch.rand(10, generator=g)})
            if step % 4 == 3:
                for key, value in module.async_compute().resolve().items():
                    results[f"{step}/{key}"] = value.clone()
        module.shutdown()
    else:
        tasks = [cfg.RecTaskInfo(name="click", label_name="l1", prediction_name="p1", weight_name="w1"),
                 cfg.RecTaskInfo(name="like", label_name="l2", prediction_name="p2", weight_name="w2")]
        names = [E.NE, E.AUC, E.AUPRC, E.RAUC, E.CALIBRATION, E.MSE, E.CTR, E.XAUC, E.CALI_FREE_NE, E.ACCURACY]
        for mode in (cfg.RecComputeMode.UNFUSED_TASKS_COMPUTATION, cfg.RecComputeMode.FUSED_TASKS_COMPUTATION):
            config = cfg.MetricsConfig(rec_tasks=tasks, compute_on_all_ranks=True, rec_compute_mode=mode,
                                       rec_metrics={m: cfg.RecMetricDef(rec_task_indices=[0, 1], window_size=60) for m in names})
            module = M.mm.generate_metric_module(M.mm.RecMetricModule, config, batch_size=10, world_size=2, my_rank=rank,
                                                 state_metrics_mapping={}, device=torch.device("cpu"))
            g = torch.Generator().manual_seed(50 + rank)
            b = 10 if rank == 0 else 7  # the ranks hold different numbers of samples
            for step in range(6):
                module.update({"p1": torch.rand(b, 1, generator=g), "l1": (torch.rand(b, 1, generator=g) < 0.4).float(),
                               "w1": torch.rand(b, generator=g), "p2": torch.rand(b, generator=g), "l2": torch.rand(b, generator=g),
                               "w2": torch.rand(b, generator=g)})
                if step % 2:
                    _save_module_values(results, f"{mode.name}/{step}", module)
            for namespace, per_task in module.get_pre_compute_states().items():
                for task, states in per_task.items():
                    for state, value in states.items():
                        results[f"{mode.name}/pre/{namespace}/{task}/{state}"] = value
    torch.save(results, f"{out}.rank{rank}")
    dist.destroy_process_group()


def _two_ranks(pkg: str, offloaded: bool) -> Results:
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks")
        mp.spawn(_rank_worker, args=(pkg, port, out, offloaded), nprocs=2)
        return {f"rank{r}/{k}": v for r in (0, 1) for k, v in torch.load(f"{out}.rank{r}", weights_only=False).items()}


SCENARIOS: Dict[str, Callable[[str], Results]] = {
    "modes": lambda pkg: scenario_modes(pkg, grouped=False),
    "grouped": lambda pkg: scenario_modes(pkg, grouped=True),
    "more": scenario_more,
    "other": scenario_other,
    "sessions": scenario_sessions,
    "ranks": lambda pkg: _two_ranks(pkg, offloaded=False),
    "offloaded": lambda pkg: _two_ranks(pkg, offloaded=True),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


def diff(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    only = sorted(set(a) ^ set(b))
    unequal = sorted(k for k in set(a) & set(b) if not _same(a[k], b[k]))
    for key in (only + unequal)[:20]:
        print("DIFFERS" if key in unequal else "ONLY ONE SIDE", key, a.get(key), b.get(key))
    print(f"{len(set(a) & set(b))} values compared: {len(unequal)} not bit-equal, {len(only)} keys on one side only")
    return 1 if only or unequal else 0


def main(argv: List[str]) -> int:
    if len(argv) == 3 and argv[0] == "run":
        warnings.filterwarnings("ignore")
        results = {f"{name}/{k}": v for name, run in SCENARIOS.items() for k, v in run(argv[1]).items()}
        torch.save(results, argv[2])
        print(f"{len(results)} values from {argv[1]} in {argv[2]}")
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        return diff(argv[1], argv[2])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
