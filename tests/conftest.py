# tests/ is put on sys.path by this file's presence, so tests import `reference` and `model_requests`.
"""Fixtures shared across test folders (the small artifacts, each exported once per session; the C++ loader's binary)
and the one place tests get their markers (slow, cpp, distributed, gpu)."""

import fcntl
import os
import re
import shutil
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


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory) -> Path:
    """model.pt2's compile cache of this session (export/compile_cache.py; subprocesses inherit it), not the user's
    ~/.cache: a test compiles a model the session compiled before from it, as a re-export does."""
    folder = tmp_path_factory.mktemp("compile-cache")
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
    "export/test_compile_cache.py::test_two_exports_into_one_cache_at_once_both_succeed",
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
}
CPP = {  # besides: a test that takes the `binary` fixture (recship_predict), or a parameter "cpp" (a front)
    "cpp_loader",
    "serving/test_front.py",
    "serving/test_leftovers.py::test_a_restarted_cpp_front_does_not_accumulate_folders_nor_does_a_killed_cpp_server",
    "serving/test_repository_reload.py::test_the_cpp_front_loads_only_the_manifest_the_server_verified",
    "test_wheel.py",  # builds the wheel with its C++ parts
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
