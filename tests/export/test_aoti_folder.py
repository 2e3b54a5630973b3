"""Where model.pt2 packages are extracted and what loading one says.

``recship.export.aoti.process_folder``: one folder per process, removed at normal exit, and the folders of
processes that are gone removed by the next one (``remove_abandoned``), never a live one's. Loading a
model.pt2 says nothing when the package runs here (torch's "Device information mismatch for
AOTI_CPU_ISA" is noise: recship chose the ISA and checked it) and one line of recship's own, once,
when this CPU cannot run it.
"""

import fcntl
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from recship.export import aoti
from recship.export.artifact import AotiModel, ArtifactError, open_artifact
from recship.export.blocks import unwrapped
from model_requests import runnable_aoti


@pytest.fixture
def temp(tmp_path, monkeypatch) -> Path:
    """The system temp folder, as this process and the subprocesses it starts see it."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _in_subprocess(temp: Path, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(temp)})


HOLD = "from recship.export.aoti import process_folder; f = process_folder(); (f / 'x').write_text('1'); print(f, flush=True); import time; time.sleep(120)"


def test_a_killed_process_folder_is_removed_by_the_next_one_a_live_one_is_not(temp):
    live, killed = _in_subprocess(temp, HOLD), _in_subprocess(temp, HOLD)
    try:
        live_folder, killed_folder = Path(live.stdout.readline().strip()), Path(killed.stdout.readline().strip())
        assert live_folder.parent == killed_folder.parent == temp
        assert live_folder.name.startswith(f"recship-{live.pid}-") and killed_folder.name.startswith(f"recship-{killed.pid}-")
        assert aoti.remove_abandoned() == []
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (killed_folder / "x").is_file()  # nothing ran at its exit
        assert aoti.remove_abandoned() == [killed_folder]
        assert not killed_folder.exists() and (live_folder / "x").is_file()
    finally:
        for p in (live, killed):
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def test_a_normal_exit_removes_the_process_folder(temp):
    proc = _in_subprocess(temp, "from recship.export.aoti import process_folder; print(process_folder())")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert Path(out.strip()).parent == temp and not Path(out.strip()).exists()
    assert [p.name for p in temp.iterdir() if p.name.startswith("recship-")] == []


def test_only_folders_of_dead_pids_nobody_locks_are_removed(temp):
    dead = _dead_pid()
    gone = temp / f"recship-{dead}-abc"
    (gone / "sub").mkdir(parents=True)
    locked = temp / f"recship-{dead}-locked"  # its owner lives in a pid namespace where the pid means another process
    locked.mkdir()
    mine = temp / f"recship-{os.getpid()}-mine"
    mine.mkdir()
    others = [temp / "recship-front-abc", temp / "recship-aoti-abc", temp / f"recship{dead}-x", temp / "aotinductor_abc"]
    for p in others:
        p.mkdir()
    target = temp / "target"
    target.mkdir()
    (target / "keep").write_text("1")
    (temp / f"recship-{dead}-link").symlink_to(target)
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert aoti.remove_abandoned() == [gone]
    finally:
        os.close(fd)
    assert locked.is_dir() and mine.is_dir() and all(p.is_dir() for p in others) and (target / "keep").is_file()
    assert aoti.remove_abandoned() == [locked]  # its lock is gone now


@pytest.fixture(scope="module")
def aoti_artifact(small_artifacts) -> Path:
    return runnable_aoti(lambda: small_artifacts(format="both"))


def test_loading_model_pt2_twice_says_nothing_of_the_isa_and_leaves_nothing(aoti_artifact, temp):
    """torch's warning went to stderr through its own handler (and would C++ prints): a subprocess's stderr.
    (It showed where the host's best ISA is above the package's x86-64-v3, e.g. AVX-512 hosts.)"""
    code = (
        "import sys; from recship.logs import configure_logging; configure_logging('text')\n"
        "from recship.export.artifact import open_artifact\n"
        f"a, _ = open_artifact({str(aoti_artifact)!r}, format='aoti'); b, _ = open_artifact({str(aoti_artifact)!r}, format='aoti')\n"
        "print(a.format, b.format)\n"
    )
    proc = _in_subprocess(temp, code)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.split() == ["aoti", "aoti"]
    assert "AOTI_CPU_ISA" not in err and "mismatch" not in err.lower(), err
    assert [p.name for p in temp.rglob("*") if p.name.startswith(("aotinductor_", "recship-"))] == []


def test_a_package_this_cpu_cannot_run_is_said_once_in_recship_words(aoti_artifact, monkeypatch, caplog):
    flags = aoti.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo: every ISA is taken on trust")
    monkeypatch.setattr(aoti, "cpu_flags", lambda: flags - {"avx2", "fma"})
    monkeypatch.setattr(aoti, "_said_unsupported", set())
    with caplog.at_level(logging.WARNING, logger="recship"):
        for _ in range(2):  # auto: model.pt instead
            assert not isinstance(unwrapped(open_artifact(aoti_artifact)[0]), AotiModel)
        with pytest.raises(ArtifactError, match="x86-64-v3; this CPU lacks avx2 fma"):
            open_artifact(aoti_artifact, format="aoti")
    said = [r.getMessage() for r in caplog.records if r.name.startswith("recship") and "x86-64-v3" in r.getMessage()]
    assert said == ["this CPU lacks avx2 fma, which model.pt2 compiled for x86-64-v3 needs: such artifacts run from model.pt "
                    "(TorchScript) where the model format is auto, and are refused where it is aoti"]
    assert not [r for r in caplog.records if "AOTI_CPU_ISA" in r.getMessage()]
