"""A routine rollout logs at INFO: a new version loaded, the old one unloaded, a rollback by removing a folder, a
version's files replaced in place. WARNING and ERROR are kept for what needs a person (a refused version); an
``unloaded ... version 1`` at WARNING on every rollout paged people for nothing."""

import logging
import shutil

from recship.serving.metrics import Metrics
from recship.serving.repository import ModelRepository
from recship.serving.server import ServerConfig


def _records(caplog, text):
    return [r for r in caplog.records if text in r.getMessage()]


def test_a_rollout_a_rollback_and_a_replace_log_at_info_and_a_refusal_at_error(small_artifacts, tmp_path, caplog):
    root = tmp_path / "repo"
    shutil.copytree(small_artifacts(dtype="int8"), root / "dlrm" / "1")
    repo = ModelRepository(ServerConfig(model_repo=str(root), poll_interval_s=3600), Metrics())
    try:
        with caplog.at_level(logging.DEBUG, logger="recship"):
            repo.scan()
            assert repo.get("dlrm").version == 1
            shutil.copytree(small_artifacts(dtype="int4"), root / "dlrm" / "2")  # the rollout: 1 -> 2
            repo.scan()
            assert repo.get("dlrm").version == 2
            shutil.rmtree(root / "dlrm" / "2")  # the rollback: 2 -> 1
            repo.scan()
            assert repo.get("dlrm").version == 1
            served = repo.get("dlrm", 1)
            staging = root / "dlrm" / ".incoming"  # another export's files over version 1, each renamed over the old one
            shutil.copytree(small_artifacts(dtype="int4"), staging)
            for file in sorted(p for p in staging.rglob("*") if p.is_file()):
                file.replace(root / "dlrm" / "1" / file.relative_to(staging))
            repo.scan()
            assert repo.get("dlrm", 1) is not served

            routine = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert routine == [], [f"{r.levelname} {r.getMessage()}" for r in routine]
            for text in ("serving dlrm version 2 from ", "unloaded dlrm version 1", "unloaded dlrm version 2",
                         "dlrm version 2 was removed from the repository", "dlrm version 1: its files changed on disk"):
                assert [r.levelname for r in _records(caplog, text)] == ["INFO"], text

            # what needs a person stays an error: a version that does not load
            (root / "dlrm" / "3").mkdir()
            (root / "dlrm" / "3" / "manifest.json").write_text("{")
            repo.scan()
            assert repo.get("dlrm").version == 1
            assert [r.levelname for r in _records(caplog, "3/manifest.json is corrupt")] == ["ERROR"]
    finally:
        repo.stop()
