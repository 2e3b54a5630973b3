"""The README's CLI quick start, run as a user pastes it: tests/test_docs.py runs it with this checkout's install,
tests/test_wheel.py with the wheel's and the sdist's, each in a fresh venv."""

import json
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Mapping

from doc_blocks import doc_block

BLOCK = "tests/quick_start.py::run_quick_start"  # its marker in README.md (run by tests/test_docs.py and tests/test_wheel.py)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_quick_start(bin_dir: Path, cwd: Path, env: Mapping[str, str]) -> None:
    """Pastes the README's quick start into bash in ``cwd`` (an empty folder), ``bin_dir``'s commands first on PATH
    and its ports swapped for free ones, and checks what it printed: ready, the same two answers over KServe REST and
    gRPC, the exported version in the repository. AssertionError naming what went wrong."""
    script = doc_block(BLOCK)
    grpc, http = free_port(), free_port()
    script = script.replace("8500", str(grpc)).replace("8000", str(http))
    env = dict(env, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:  # the pipes close when the server the script started has drained and exited too
        out, err = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-3000:]
    assert '{"ready": true}' in out.splitlines()
    answer = json.loads(out.splitlines()[-1])  # recship predict's answer to the two examples
    assert [len(answer[name]) for name in ("logit", "prob")] == [2, 2] and all(len(row) == 1 for row in answer["prob"])
    rest = {o["name"]: o for o in json.loads(out.splitlines()[-2])["outputs"]}  # the KServe REST answer to the same two
    assert {name: (rest[name]["shape"], rest[name]["data"]) for name in ("logit", "prob")} == \
        {name: ([2, 1], [row[0] for row in answer[name]]) for name in ("logit", "prob")}
    assert (cwd / "models" / "dlrm" / "1" / "manifest.json").exists()
