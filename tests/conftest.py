# tests/ is put on sys.path by this file's presence, so tests import `reference` and `model_requests`.
"""Fixtures shared across test folders (the small artifacts, each exported once per session; the C++ loader's binary)
and the one place tests get their markers (slow, cpp, distributed, gpu)."""

import fcntl
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import pytest
import torch

from gloo_ranks import one_rank_group
from model_requests import SMALL_ROWS

ROOT = Path(__file__).resolve().parents[1]
# exports in tests write model.pt only unless a test asks for model.pt2 (format="both"): an AOTInductor
# compile takes 15-40 s here; tests/export/test_aoti.py covers it (subprocesses inherit this too)
os.environ["RECSHIP_AOTI"] = "0"


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Each test leaves logging as it found it: a command run in-process (``main(["export", ...])``) configures the
    root logger with a handler on the stderr of that moment (the test's captured stream, closed after it), which a
    later test's log lines would meet ("--- Logging error ---" in its stderr)."""
    root, ours = logging.getLogger(), logging.getLogger("recship")
    saved = (root.handlers[:], root.level, ours.level, warnings.showwarning)
    yield
    root.handlers[:], (root.level, ours.level) = saved[0], saved[1:3]
    warnings.showwarning = saved[3]


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory) -> Path:
    """model.pt2's compile cache of this session (export/compile_cache.py; subprocesses inherit it), not the user's
    ~/.cache: a test compiles a model the session compiled before from it, as a re-export does. Under pytest-xdist
    the workers share one (the cache is safe for concurrent exports: entries are renamed into place whole)."""
    shared = _xdist_run_folder(tmp_path_factory)
    folder = shared / "compile-cache" if shared is not None else tmp_path_factory.mktemp("compile-cache")
    folder.mkdir(exist_ok=True)
    os.environ["RECSHIP_CACHE_DIR"] = str(folder)
    return folder


def _xdist_run_folder(tmp_path_factory) -> Optional[Path]:
    """The temp folder that this run's pytest-xdist workers share (the parent of each one's basetemp); None when the
    session is not an xdist worker."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(scope="session")
def small_artifacts(tmp_path_factory):
    """``small_artifacts(model="dlrm", dtype="int8", device="cpu", format="torchscript", shards=1) -> Path``: each
    artifact is exported once per session (format "both" adds the AOTInductor model.pt2; shards > 1: row-wise).

    dlrm: a DLRM of 26 features cat_i (SMALL_ROWS[i] rows, dim 8), dense 13, outputs logit and prob [B, 1].
    emb: a weighted EmbeddingBagCollection, table a (40 x 16, MEAN) for x and y, table b (30 x 8) for z,
    whose ids take the modulo policy. Both are built after ``torch.manual_seed(0)``. Treat the folders as
    read-only (copy one to change it): every test of the session shares them, and under pytest-xdist every worker.
    """
    from recship.export import ExportConfig, export_model
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    built: Dict[Tuple[str, str, str, str, int], Path] = {}

    def build(model: str = "dlrm", dtype: str = "int8", device: str = "cpu", format: str = "torchscript", shards: int = 1) -> Path:
        key = (model, dtype, device, format, shards)
        if key in built:
            return built[key]
        if device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        torch.manual_seed(0)
        extra: Dict[str, Any] = {}
        if model == "dlrm":
            module = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=SMALL_ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
        elif model == "emb":
            module = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=16, feature_names=["x", "y"], pooling=PoolingType.MEAN),
                    EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["z"]),
                ],
                is_weighted=True,
            )
            extra["id_policy"] = {"z": "modulo"}
        else:
            raise ValueError(f"small_artifacts: model must be 'dlrm' or 'emb', got {model!r}")
        if shards > 1:
            extra.update(shards=shards, sharding="row_wise")

        def export(out: Path) -> None:
            export_model(module, ExportConfig(out=str(out), dtype=dtype, device=device, progress=False, validation_batches=1,
                                              validation_batch_size=32, format=format, **extra))

        name = f"{model}_{dtype}_{device}_{format}_{shards}"
        shared = _xdist_run_folder(tmp_path_factory)
        if shared is None:
            out = tmp_path_factory.mktemp("artifact") / name
            export(out)
        else:  # under pytest-xdist: the first worker to ask exports it, the others wait for it and share it
            out = shared / "small-artifacts" / name
            out.parent.mkdir(exist_ok=True)
            with open(out.parent / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not out.exists():
                    partial = out.parent / f"{name}.partial"
                    shutil.rmtree(partial, ignore_errors=True)
                    export(partial)
                    partial.rename(out)
        built[key] = out
        return out

    return build


@pytest.fixture(scope="session")
def small_artifact(small_artifacts):
    """Path of the INT8 CPU artifact of the small DLRM (see ``small_artifacts``)."""
    return small_artifacts()


@pytest.fixture(scope="session")
def binary() -> Path:
    """Path of recship_predict, the C++ loader's CLI: the one installed with recship (a wheel built with
    RECSHIP_BUILD_CPP), else built from this checkout (cpp_loader/build.py: cmake, incremental; recship.native.find)."""
    from recship.native import find

    return find("recship_predict")


# -- markers -------------------------------------------------------------------------------------------------------
# Registered in pyproject.toml, assigned here only; `make test-fast` runs the tests that have none of them. An entry
# names a folder or a module under tests/, or module::name for one test of it or for the tests that use one of its
# fixtures.

TESTS = Path(__file__).resolve().parent
SLOW = {  # what takes long on 2 cores (pytest --durations): trainings, AOTInductor compiles (~20 s each), mypy
    "export/test_any_model.py",  # trains four models
    "export/test_ec_train_export.py::exported",  # trains the two-tower (its history sharded row-wise) on 2 gloo ranks
    "export/test_aoti.py::test_aoti_artifact_equals_torchscript_bitwise",
    "export/test_aoti.py::test_aoti_model_checks_what_the_compiled_code_would_not",
    "export/test_aoti.py::test_open_artifact_format_choice_and_a_tampered_package",
    "export/test_aoti.py::test_the_server_runs_model_pt2_unless_told_otherwise",
    "export/test_aoti.py::test_two_tower_with_an_embedding_collection_compiles",
    "export/test_aoti_folder.py::aoti_artifact",
    "export/test_compile_cache.py::test_a_hit_equals_a_fresh_compile_bitwise_and_a_corrupt_entry_is_rebuilt",  # 3 compiles
    "export/test_compile_cache.py::test_two_exports_into_one_cache_at_once_both_succeed_and_one_compiles",
    "export/test_artifact_integrity.py::both",  # the small DLRM with model.pt2
    "export/test_export.py::test_sharded_artifact_equals_the_dequantized_model_at_any_batch_size",
    "export/test_staged_tables.py::test_rows_quantized_into_the_file_equal_the_written_ones",
    "serving/test_leftovers.py",
    "serving/test_memory_bounds.py",  # large requests in a memory cgroup, both fronts
    "serving/test_reload_memory.py",
    "test_examples.py",
    "test_docs.py::test_readme_quick_start_runs_from_an_installed_package",  # trains, exports, serves (~25 s)
    "test_oserrors.py::run",  # trains and exports the run whose exports fill small disks
    "test_oserrors.py::test_export_into_a_disk_that_fills_at_model_pt2_says_so",  # an AOTInductor compile
    "test_oserrors.py::test_train_whose_checkpoint_does_not_fit_leaves_no_partial_checkpoint",
    "test_package.py::test_cli_version_and_demo",
    "test_typing.py",
    "trainer/test_lazy_awaitable.py::test_a_model_indexing_its_sharded_collection_trains_on_every_sharding_type",
    "tutorials",
    "test_torchrec_examples.py",  # TorchRec's three examples on 2 gloo ranks
    "export/test_mc_export.py::exported",  # recship train on 2 ranks, then export
    "trainer/distributed/test_ec_sharding.py",
    "trainer/distributed/test_ec_checkpoint.py",
    # the quick loop (make test-fast) under 2 minutes: each test that took >= 3.5 s (or whose module's fixture did) in a
    # --durations run of test-fast on a busy 2-core machine (2026-11-28); make test runs them all
    "contract/test_contract.py::test_exported_manifests_keep_the_contract",
    "contract/test_contract.py::test_python_answers_every_vector",
    "export/test_aoti_folder.py::test_a_killed_process_folder_is_removed_by_the_next_one_a_live_one_is_not",
    "export/test_aoti_folder.py::test_a_normal_exit_removes_the_process_folder",
    "export/test_batch_invariance.py",
    "export/test_compile_cache.py::test_the_key_is_the_same_in_another_process",
    "export/test_compile_cache.py::test_two_processes_storing_one_key_never_read_a_torn_entry",
    "export/test_export.py::test_artifact_from_checkpoint_loads_without_recship",
    "export/test_export.py::test_cli_export_inspect_and_bad_inputs",
    "export/test_export.py::test_column_wise_artifact_stays_within_quantization_error",
    "export/test_export.py::test_error_budget_fails_the_export_and_leaves_nothing",
    "export/test_export.py::test_eval_data_from_a_criteo_file",
    "export/test_export.py::test_synthetic_validation_follows_the_training_runs_seed",
    "export/test_export.py::test_tampered_or_missing_artifact_is_reported",
    "export/test_export_repo.py::test_a_running_server_picks_up_each_new_version",
    "export/test_fp_ebc_export.py",
    "export/test_non_finite.py::test_a_corrupt_checkpoint_is_refused_by_the_cli",
    "export/test_pt2_only.py",
    "export/test_tables.py::test_outputs_equal_the_format_1_artifact_bitwise",
    "export/test_torchrec_checkpoint.py::test_a_torchrec_checkpoint_loads_into_a_recship_dmp_and_exports",
    "serving/test_drain.py::test_sigterm_exits_within_the_drain_idle_and_under_load_through_the_close_with_no_accepted_call_failed",
    "serving/test_drain.py::test_sigterm_under_load_drains_with_readiness_503_first_and_no_failed_request",
    "serving/test_error_log.py::test_valid_and_invalid_requests_make_torch_warn_about_nothing",
    "serving/test_faults.py::test_sigterm_after_expired_requests_in_a_small_queue_drains_and_exits",
    "serving/test_model_config.py::test_latest_two_serves_two_versions_each_bitwise_and_follows_adds_and_removals",
    "serving/test_repository_api.py::test_platform_names_the_format_each_version_runs",
    "serving/test_repository_api.py::test_rest_repository_routes_mutated",
    "serving/test_server.py::test_recship_serve_answers_and_drains_on_sigterm",
    "serving/test_serving_imports.py::test_a_server_answers_without_importing_the_training_side",
    "test_deploy.py::test_dockerfile_runs_serve_as_non_root_with_matching_ports",
    "test_docs.py::test_python_block_runs_as_shown",
    "test_json_logs.py",
    "test_oserrors.py",
    "test_plots.py",
    "test_torchrec_models_dmp.py::test_dlrm_train_under_dmp_trains_like_one_process",
    "trainer/distributed/test_comm.py::test_intra_and_cross_groups_on_two_ranks",
    "trainer/distributed/test_ec_training.py::test_an_embedding_collection_trains_data_parallel_like_one_process",
    "trainer/distributed/test_fp_ebc_training.py::test_fp_ebc_trains_on_two_ranks_like_one_process",
    "trainer/distributed/test_fused_ebc_sharder.py::test_fused_ebc_trains_on_two_ranks_like_one_process",
    "trainer/distributed/test_mc_sharded_module.py::test_base_sharded_module_answers_as_dmp_in_place",
    "trainer/distributed/test_sharded_ebc.py::test_a_sharded_collection_is_freed_when_unreferenced",
    "trainer/distributed/test_sharded_state_dict.py",
    "trainer/distributed/test_torchrec_sharded_checkpoint.py::test_sharded_state_dict_and_dcp_checkpoint_as_torchrec_users_write_them",
    "trainer/distributed/test_torchrec_sharding_api.py::test_dmp_and_shard_modules_take_torchrecs_arguments",
    "trainer/test_ec_resume.py::test_a_checkpoint_with_a_replicated_history_table_resumes_with_it_replicated",
    "trainer/test_gradient_accumulation.py::test_dmp_accumulates_dense_and_steps_fused_tables_every_micro_batch",
    "trainer/test_hybrid_eval.py::test_share_embedding_memory_maps_rank0_tables_and_refuses_different_ones",
    "trainer/test_optim_wrappers.py::test_global_clipping_over_two_ranks_is_one_process_clipping",
    "trainer/test_resume_config.py",
    "trainer/test_shared_features.py::test_sharded_embedding_collection_looks_a_shared_feature_up_in_each_table_on_two_ranks",
    "trainer/test_train.py::test_cli_config_file_yaml_and_json_with_flag_override",
    "trainer/test_train.py::test_killed_save_leaves_previous_checkpoint",
    "trainer/test_train.py::test_resume_is_exact",
    "trainer/test_train.py::test_run_safety_refuse_overwrite_resume_keep_last",
    "trainer/test_train_mistakes.py::test_resume_of_the_builtin_dlrm_takes_its_shape_from_the_checkpoint",
    "trainer/test_train_mistakes.py::test_resume_without_model_continues_the_recorded_model_exactly",
}
CPP = {  # besides: a test that takes the `binary` fixture (recship_predict), or a parameter "cpp" (a front)
    "cpp_loader",
    "serving/test_front.py",
    "serving/test_leftovers.py::test_a_restarted_cpp_front_does_not_accumulate_folders_nor_does_a_killed_cpp_server",
    "serving/test_repository_reload.py::test_the_cpp_front_loads_only_the_manifest_the_server_verified",
    "test_wheel.py",  # builds the sdist and the manylinux wheel (C++ parts and all) and installs both (~5 min)
}
DISTRIBUTED = {  # besides: a parameter nproc or world_size above 1 (gloo ranks, torchrun)
    "trainer/distributed/test_gpu.py",
    "trainer/distributed/test_model_parallel.py",
    "trainer/distributed/test_sharding_plan.py::test_a_dmp_from_a_plan_by_hand_trains_like_one_process",
    "trainer/distributed/test_sharded_ebc.py::test_table_row_wise_on_two_hosts_of_two",
    "trainer/test_train.py::test_checkpoint_reshards_on_load",
    "trainer/test_train.py::test_reader_maps_tables_equal_to_dcp_load",
    "tutorials/test_tutorials.py::test_sharding_tutorial_prints_the_tutorials_plans_on_two_ranks",
    "export/test_any_model.py::exported",  # trains the two-tower on 2 gloo ranks
    "export/test_ec_train_export.py::exported",
    "trainer/test_lazy_awaitable.py::test_a_model_indexing_its_sharded_collection_trains_on_every_sharding_type",
    "trainer/test_multi_task.py::test_two_ranks_gather_each_task_and_resume_on_the_recorded_data",
    "test_torchrec_examples.py",
    "export/test_mc_export.py::exported",
    "trainer/distributed/test_mc_training.py",
    "trainer/distributed/test_mc_ec_dmp.py",
    "trainer/distributed/test_ec_sharding.py",
    "trainer/distributed/test_ec_checkpoint.py",
    "export/test_ec_sharded_export.py",
    "test_inference_package.py",
    "test_test_utils.py",
}


def _places(item: pytest.Item) -> Set[str]:
    """The names an entry of SLOW, CPP or DISTRIBUTED may give ``item``: its folders, its module, module::test and
    module::fixture for each fixture it uses."""
    module = item.path.relative_to(TESTS)
    folders = {parent.as_posix() for parent in module.parents if parent != Path(".")}
    names = [getattr(item, "originalname", item.name), *item.fixturenames]
    return folders | {module.as_posix()} | {f"{module.as_posix()}::{name}" for name in names}


def _markers(item: pytest.Item) -> Iterator[str]:
    places = _places(item)
    params = item.callspec.params if isinstance(item, pytest.Function) and hasattr(item, "callspec") else {}
    if places & SLOW:
        yield "slow"
    if places & CPP or "binary" in item.fixturenames or any(isinstance(v, str) and v == "cpp" for v in params.values()):
        yield "cpp"
    if places & DISTRIBUTED or params.get("nproc", 1) > 1 or params.get("world_size", 1) > 1:
        yield "distributed"
    if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):  # skipped without CUDA
        yield "gpu"


def _stale(entries: Set[str]) -> List[str]:
    """Entries of SLOW, CPP or DISTRIBUTED that name no folder, module, test or fixture here (renamed or removed)."""
    stale = []
    for entry in sorted(entries):
        path, _, name = entry.partition("::")
        where = TESTS / path
        if not where.exists() or (name and not re.search(rf"^\s*def {re.escape(name)}\(", where.read_text(), re.M)):
            stale.append(entry)
    return stale


def pytest_configure(config: pytest.Config) -> None:
    stale = _stale(SLOW | CPP | DISTRIBUTED)
    if stale:  # a stale entry would silently leave its tests unmarked (and in make test-fast)
        raise pytest.UsageError(f"tests/conftest.py's marker lists name what does not exist: {stale}")


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    for item in items:
        for name in _markers(item):
            item.add_marker(name)


@pytest.fixture
def pg(tmp_path):
    """A gloo process group of this process alone (``gloo_ranks.one_rank_group``), for in-process tests of code that
    needs one."""
    with one_rank_group(tmp_path) as group:
        yield group
