"""A served version whose files change on disk is loaded again as a unit: an export --overwrite, or an
rsync over the version folder, used to change nothing until a restart (and a restart silently changed what the
version answered). The loaded version serves until the new files verify; files that do not load leave it serving,
with the reason logged once; with --front cpp the C++ front is told too."""

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from recship.export.artifact import open_artifact
from recship.serving.client import PredictClient
from recship.serving.server import Server, ServerConfig
from model_requests import in_process, sample_request
from serving_helpers import front_binary, wait_until


def _swap_in(source: Path, version: Path, staging: Path) -> None:
    """Writes ``source``'s files over ``version``'s as rsync does: each file copied beside it, then renamed over the
    old one (a served tables.bin keeps its own inode, mapped; never truncated under it)."""
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    for file in sorted(p for p in staging.rglob("*") if p.is_file()):
        target = version / file.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(file, target)
    shutil.rmtree(staging)


def _same(got, want) -> bool:
    return all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_a_served_version_whose_files_change_is_loaded_again_as_a_unit(small_artifacts, tmp_path, caplog, front):
    if front == "cpp":
        front_binary()
    first, second = small_artifacts(dtype="int8"), small_artifacts(dtype="int4")  # the same model, other weights
    broken = tmp_path / "broken"
    shutil.copytree(second, broken)
    data = bytearray((broken / "tables.bin").read_bytes())
    data[100] ^= 0x40
    (broken / "tables.bin").write_bytes(bytes(data))
    root = tmp_path / "repo"
    version = root / "dlrm" / "1"
    shutil.copytree(first, version)
    sparse, dense = sample_request(first)
    want_first = in_process(open_artifact(first, format="torchscript")[0], sparse, dense)
    want_second = in_process(open_artifact(second, format="torchscript")[0], sparse, dense)
    assert not _same(want_second, want_first)
    staging = root / "dlrm" / ".incoming"  # hidden: the repository skips it

    with caplog.at_level(logging.INFO, logger="recship"):
        server = Server(ServerConfig(model_repo=str(root), port=0, poll_interval_s=0.1, max_delay_ms=1, front=front))
        try:
            with PredictClient(f"127.0.0.1:{server.port}") as client:
                ask = lambda: client.predict("dlrm", sparse, dense)  # noqa: E731
                assert _same(ask(), want_first)
                served = server.repo.get("dlrm", 1)

                # another export's files over version 1: loaded again, verified, swapped in, logged
                _swap_in(second, version, staging)
                wait_until(lambda: _same(ask(), want_second), what="version 1 to answer with its new files")
                assert server.repo.get("dlrm", 1) is not served
                assert any("dlrm version 1: its files changed on disk; loading them again" in m for m in caplog.messages)
                assert any(m.startswith("serving dlrm version 1 from ") and "(loaded again: its files changed on disk)" in m
                           for m in caplog.messages)
                if front == "cpp":  # the front was told, and answers with the new files itself
                    wait_until(lambda: sum("C++ front serves dlrm version 1" in m for m in caplog.messages) >= 2,
                          what="the front to load version 1 again")
                    before = sum(r["count"] for r in server.front.stats()["requests"] if r["status"] == "OK")
                    assert _same(ask(), want_second)
                    assert sum(r["count"] for r in server.front.stats()["requests"] if r["status"] == "OK") == before + 1

                # files that do not verify: the loaded version keeps serving, the reason logged once (once per state
                # of its files: the swap is made while no scan runs, so that no scan sees it half done)
                served = server.repo.get("dlrm", 1)
                caplog.clear()
                with server.repo._scanning:
                    _swap_in(broken, version, staging)
                wait_until(lambda: any("keeps serving what it loaded before" in m and "tables.bin: table" in m for m in caplog.messages),
                      what="the refusal of the broken files")
                for _ in range(3):  # several scans of the same files
                    server.repo.scan()
                assert sum("keeps serving what it loaded before" in m and "tables.bin: table" in m for m in caplog.messages) == 1
                assert server.repo.get("dlrm", 1) is served and _same(ask(), want_second)

                # fixed: loaded again
                _swap_in(first, version, staging)
                wait_until(lambda: _same(ask(), want_first), what="version 1 to answer with the fixed files")
        finally:
            server.stop()


def test_the_cpp_front_loads_only_the_manifest_the_server_verified(small_artifact, tmp_path):
    """The repository hands the front the sha256 of the manifest it verified (LoadOptions::trusted): files that
    change between the two loads are refused there, and the version the front serves is untouched."""
    front_binary()
    from recship.export.artifact import file_sha256
    from recship.serving.front import FrontError

    root = tmp_path / "repo"
    shutil.copytree(small_artifact, root / "dlrm" / "1")
    sparse, dense = sample_request(small_artifact)
    want = in_process(open_artifact(small_artifact, format="torchscript")[0], sparse, dense)
    server = Server(ServerConfig(model_repo=str(root), port=0, max_delay_ms=1, front="cpp"))
    try:
        path = root / "dlrm" / "1"
        assert server.repo.get("dlrm").manifest.sha256 == file_sha256(path / "manifest.json")
        with pytest.raises(FrontError) as e:
            server.front.load("dlrm", 1, path, "torchscript", manifest_sha256="0" * 64)
        assert str(e.value) == f"{path}/manifest.json: sha256 {file_sha256(path / 'manifest.json')} is not in the trusted list"
        before = sum(r["count"] for r in server.front.stats()["requests"] if r["status"] == "OK")
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            assert _same(client.predict("dlrm", sparse, dense), want)
        assert sum(r["count"] for r in server.front.stats()["requests"] if r["status"] == "OK") == before + 1
    finally:
        server.stop()
