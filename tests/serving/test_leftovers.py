"""What a `recship serve` leaves in the temp folder: a SIGKILLed server, or a C++ front
that dies and is restarted, must not leave extracted model.pt2 packages (``aotinductor_*``) or socket
folders behind for good; the next server removes what a dead one left, and a clean stop leaves nothing.

Every server here runs as a subprocess with TMPDIR set to a folder of the test's own, so what it sees
there is only what these servers made (other processes on the machine use /tmp too).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

import pytest

from recship.serving import PredictClient
from model_requests import model_repo, runnable_aoti
from serving_helpers import front_binary, random_request, wait_until


def _leftovers(tmp: Path) -> List[str]:
    """What the servers put in the temp folder, relative paths, at any depth: extracted packages
    (aotinductor_*) and recship's own folders. torch's compile cache (torchinductor_<user>) is a cache
    shared across processes by design, not a leftover."""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                  if p.is_dir() and (p.name.startswith("aotinductor_") or p.name.startswith("recship-")))


def _count(tmp: Path, prefix: str) -> int:
    return sum(1 for p in tmp.rglob(prefix + "*") if p.is_dir())


@pytest.fixture(scope="module")
def aoti_repo(small_artifacts, tmp_path_factory) -> Path:
    """A model repository serving the small DLRM with a model.pt2 this machine runs (dlrm/1)."""
    artifact = runnable_aoti(lambda: small_artifacts(format="both"))
    return model_repo(tmp_path_factory.mktemp("leftovers") / "repo", {"dlrm": artifact})


class _Serve:
    """`recship serve --port 0` in a subprocess whose temp folder is ``tmp``; its log lines go to a file."""

    def __init__(self, repo: Path, tmp: Path, log: Path, *flags: str) -> None:
        self.log = log
        env = {**os.environ, "TMPDIR": str(tmp)}
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "recship", "serve", "--model-repo", str(repo), "--port", "0", *flags],
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on 127.0.0.1:" not in line:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {line!r} {log.read_text()[-3000:]}")
        self.port = int(line.strip().rsplit(":", 1)[1])

    def predict(self) -> Tuple[int, int]:
        sparse, dense = random_request(3)
        with PredictClient(f"127.0.0.1:{self.port}") as client:
            return client.predict("dlrm", sparse, dense)["prob"].shape

    def front_pid(self) -> int:
        """The pid of its C++ front child (the one running now)."""
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                if name.startswith("recship_front") and int(rest[1]) == self.proc.pid and rest[0] != "Z":
                    return int(entry.name)
        raise AssertionError("the server has no C++ front child")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.log.read_text()[-3000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def tmp():
    """The servers' temp folder (TMPDIR): short, as the front's Unix socket path inside it must stay under 108 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="lo-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_the_next_server_removes_what_a_killed_one_left_and_a_clean_stop_leaves_nothing(aoti_repo, tmp, tmp_path):
    killed = _Serve(aoti_repo, tmp, tmp_path / "killed.log")
    try:
        assert killed.predict() == (len(random_request(3)[1]), 1)
        killed.kill()
    finally:
        killed.close()
    left = _leftovers(tmp)
    assert left, "a SIGKILLed server that served model.pt2 left nothing: this test checks nothing"
    server = _Serve(aoti_repo, tmp, tmp_path / "next.log")
    try:
        assert server.predict()[1] == 1
        assert not set(left) & set(_leftovers(tmp)), (left, _leftovers(tmp))
        assert _count(tmp, "aotinductor_") == 0  # a package is extracted only while it loads
        server.stop()
    finally:
        server.close()
    assert _leftovers(tmp) == []


def test_a_restarted_cpp_front_does_not_accumulate_folders_nor_does_a_killed_cpp_server(aoti_repo, tmp, tmp_path):
    front_binary()  # built once here (skips where gRPC C++ is missing); the servers find it up to date
    server = _Serve(aoti_repo, tmp, tmp_path / "cpp.log", "--front", "cpp")
    try:
        assert "C++ front serves dlrm version 1 (aoti)" in server.log.read_text()
        before = _leftovers(tmp)
        # all inside the server's own folder; the front's extracted model.pt2 inside the front's folder there
        assert before and all(p.startswith("recship-") for p in before), before
        assert [Path(p).parent.name[:6] for p in before if Path(p).name.startswith("aotinductor_")] == ["front-"], before
        for crash in range(2):
            first = server.front_pid()
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: server.log.read_text().count("the C++ front is back on port") == crash + 1, "the front's restart")
            assert server.front_pid() != first
            assert server.predict()[1] == 1
            assert _count(tmp, "aotinductor_") == sum(1 for p in before if Path(p).name.startswith("aotinductor_"))
            assert len(_leftovers(tmp)) == len(before), (before, _leftovers(tmp))
        server.stop()
    finally:
        server.close()
    assert _leftovers(tmp) == []

    killed = _Serve(aoti_repo, tmp, tmp_path / "killed.log", "--front", "cpp")
    try:
        front = killed.front_pid()
        killed.kill()
        wait_until(lambda: _gone(front), "the orphaned front's exit (its stdin closed)")
    finally:
        killed.close()
    left = _leftovers(tmp)
    assert left, "a SIGKILLed --front cpp server left nothing: this test checks nothing"
    server = _Serve(aoti_repo, tmp, tmp_path / "next.log", "--model-format", "torchscript")
    try:
        assert not set(left) & set(_leftovers(tmp)), (left, _leftovers(tmp))
        server.stop()
    finally:
        server.close()
    assert _leftovers(tmp) == []
