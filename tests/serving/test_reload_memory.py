"""A replaced or unloaded version is freed: RSS stays flat across hot reloads, in every format and front.

A real ``recship serve`` process (and its C++ front, with ``--front cpp``) serves a model of ~20 MB of
INT8 tables; versions 2..9 each replace the one before (two different exports, alternating, so no
version can share its tables with the one it replaces), the old folder removed. After the last
reload: no mapping of a removed version's tables.bin is left in either process (/proc/PID/maps
lists a removed file as "(deleted)"), and the processes' anonymous and shared-memory RSS grew by
less than 0.2x the table bytes over the 5 reloads after version 4 (the first reloads warm up imports
and allocator arenas: a few MB of noise that once failed this check when measured from version 2).

The two checks split what a leaked version can hold: its mapped tables.bin (the first) or heap copies
of its rows (the second). File-backed RSS is left out: it is the kernel's choice which mapped pages
(torch's libraries, the live version's rows) stay resident, and under another job's memory pressure
it moved by a whole table's worth between two samples in CI, with no leak.
The same for explicit unload + load (``RepositoryModelUnload`` / ``Load``).
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
import torch

from recship.export.artifact import Manifest
from model_requests import model_repo
from serving_helpers import front_binary, http_request, stop_process

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="AOTInductor needs a C++ compiler (g++)")
ROWS = 70_000  # 4 tables x 70,000 x 64 INT8: 4 * 70,000 * 68 bytes = 19 MB of tables


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``exports(format) -> [Path, Path]``: two exports of the same DLRM shape with different weights."""
    from recship.export import ExportConfig, export_model
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    made = {}

    def build(format: str) -> List[Path]:
        if format not in made:
            made[format] = []
            for seed in (1, 2):
                torch.manual_seed(seed)
                model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[ROWS] * 4, embedding_dim=64, dense_arch=[64], over_arch=[16]))
                out = tmp_path_factory.mktemp("reload") / f"{format}-{seed}"
                export_model(model, ExportConfig(out=str(out), dtype="int8", progress=False, validation_batches=1, format=format))
                made[format].append(out)
        return made[format]

    return build


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def _private_kib(pids: List[int]) -> int:
    """Anonymous + shared-memory RSS of ``pids``: what a heap copy of a version's rows would grow."""
    return sum(_kib(p, "RssAnon") + _kib(p, "RssShmem") for p in pids)


def _children(pid: int) -> List[int]:
    """Every child of ``pid``, whichever of its threads started it (the C++ front is not started by the main thread)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _deleted_tables(pid: int) -> List[str]:
    return sorted({line.split(None, 5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                   if "tables.bin" in line and "(deleted)" in line})


def _copy_version(src: Path, model_dir: Path, version: int) -> None:
    """``src`` as version ``version`` of the model (its manifest says so), appearing at once."""
    tmp = model_dir / f".tmp-{version}"
    shutil.copytree(src, tmp)
    manifest = Manifest.read(tmp)
    manifest.model.version = version
    manifest.write(tmp)
    os.rename(tmp, model_dir / str(version))


def _ready(port: int, version: int) -> bool:
    try:
        return http_request(port, "GET", f"/v2/models/dlrm/versions/{version}/ready", timeout=5)[0] == 200
    except OSError:
        return False


def _wait(what, timeout: float = 120.0, proc=None) -> None:
    end = time.monotonic() + timeout
    while not what():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.2)


@pytest.mark.parametrize("format, front, control", [
    ("torchscript", "python", "poll"),
    pytest.param("aoti", "python", "poll", marks=needs_compiler),
    pytest.param("aoti", "cpp", "poll", marks=needs_compiler),
    ("torchscript", "python", "explicit"),
])
def test_hot_reloads_free_the_replaced_version(exports, tmp_path, format, front, control):
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    arts = exports("both" if format == "aoti" else "torchscript")
    table_bytes = Manifest.read(arts[0]).tables.bytes
    repo, http = tmp_path / "repo", _free_port()
    (repo / "dlrm").mkdir(parents=True)
    _copy_version(arts[0], repo / "dlrm", 1)
    args = [sys.executable, "-m", "recship.cli", "serve", "--model-repo", str(repo), "--port", str(_free_port()),
            "--http-port", str(http), "--poll-interval", "0.2", "--model-format", format, "--front", front,
            "--max-delay-ms", "0"]
    if control == "explicit":
        args += ["--model-control", "explicit", "--load-model", "dlrm"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _ready(http, 1), proc=proc)
        pids = [proc.pid] + (_children(proc.pid) if front == "cpp" else [])
        assert len(pids) == (2 if front == "cpp" else 1), pids
        base = 0
        for version in range(2, 10):
            _copy_version(arts[(version - 1) % 2], repo / "dlrm", version)
            if control == "explicit":  # unload, then load: the newest version
                assert http_request(http, "POST", "/v2/repository/models/dlrm/unload", b"{}")[0] == 200
                assert http_request(http, "POST", "/v2/repository/models/dlrm/load", b"{}")[0] == 200
            _wait(lambda: _ready(http, version), proc=proc)
            shutil.rmtree(repo / "dlrm" / str(version - 1))
            _wait(lambda: not _ready(http, version - 1), proc=proc)
            if version == 4:  # the baseline: after three reloads (the first imports and starts what reloads use; the
                # allocators' arenas settle over the next ones: a noise of a few MB, not a leak, measured from here)
                base = _private_kib(pids)
        end = time.monotonic() + 60  # the retired version's batcher finishes and frees it in the background
        while any(_deleted_tables(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.2)
        leftovers = {p: _deleted_tables(p) for p in pids}
        assert not any(leftovers.values()), f"removed versions' tables are still mapped (60 s after): {leftovers}"
        grown = _private_kib(pids) - base
        # the bound: a fifth of the tables, plus one model's fixed cost (<= 20 MB, tests/serving/test_model_cost.py): the
        # heap a retired model.pt freed is not always returned to the system by now (seen once under pytest-xdist: 11 MB
        # after 5 reloads); a leak of each retired version is 5 of them (a TorchScript model ~13 MB, its rows' heap
        # copy 93 MB: both caught)
        assert grown * 1024 < 0.2 * table_bytes + 20e6, \
            f"anonymous RSS grew by {grown} KiB over 5 reloads ({table_bytes / 1024:.0f} KiB of tables)"
    finally:
        stop_process(proc)


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_a_stopped_server_frees_its_models(small_artifact, tmp_path, front):
    """Server.stop() unloads every version: its models are freed at once, although the stopped Server object
    lives on (its threads and handlers refer to it) until a later garbage collection."""
    import gc
    import weakref

    from recship.serving.server import Server, ServerConfig

    if front == "cpp":
        front_binary()
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, front=front))
    served = server.repo.versions("dlrm")
    assert len(served) == 1
    model = weakref.ref(served[0].model)
    del served
    gc.disable()  # only stop() may free it, not a collection of the cycles around the Server
    try:
        server.stop()
        assert model() is None, "the stopped server still holds its model"
    finally:
        gc.enable()
