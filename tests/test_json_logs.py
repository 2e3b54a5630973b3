"""``--log-format json``: every stderr line of train, export and serve is one JSON object (recship/logs.py).

The commands run as subprocesses with ``PYTHONWARNINGS=default``, so that warnings Python hides by
default (torch's DeprecationWarnings for TorchScript among them) are shown and must come out as JSON
or not at all. stdout keeps the commands' result lines (summary, "listening on ...") as text.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

TRAIN = ["--steps", "2", "--batch-size", "16", "--num-embeddings-per-feature", "30", "--embedding-dim", "8",
         "--dense-arch", "8", "--over-arch", "8", "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
         "--no-plot"]


def _env():
    return {**os.environ, "PYTHONWARNINGS": "default", "PYTHONUNBUFFERED": "1"}


def _recship(*args, timeout=180):
    done = subprocess.run([sys.executable, "-m", "recship.cli", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)
    assert done.returncode == 0, f"recship {args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _json_lines(stderr):
    """The parsed non-empty lines of ``stderr``; fails naming the first line that is not a JSON object."""
    records = []
    for number, line in enumerate(stderr.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        assert isinstance(record, dict), f"stderr line {number} is not a JSON object: {line!r}\n--- all of stderr:\n{stderr}"
        assert {"time", "level", "logger", "message"} <= set(record), record
        records.append(record)
    return records


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("json_logs") / "run"
    done = _recship("train", "--out", str(out), *TRAIN, "--log-format", "json")
    return out, done


def test_train_writes_only_json_on_stderr(trained):
    out, done = trained
    _json_lines(done.stderr)
    assert "Failed to import" not in done.stderr  # fbgemm_gpu-cpu's SSD notices: silenced
    assert done.stdout.startswith("trained 2 steps")  # the summary: a result, on stdout, as text


def test_export_writes_only_json_on_stderr(trained, tmp_path):
    out, _ = trained
    done = _recship("export", str(out / "checkpoints" / "step_00000002"), "--out", str(tmp_path / "art"),
                    "--format", "torchscript", "--no-progress", "--log-format", "json")
    _json_lines(done.stderr)
    assert (tmp_path / "art" / "model.pt").is_file()
    text = _recship("export", str(out / "checkpoints" / "step_00000002"), "--out", str(tmp_path / "art2"),
                    "--format", "torchscript", "--no-progress", "--log-format", "text")
    assert "is deprecated" not in text.stderr  # torch's TorchScript notices are silenced in both formats
    # progress on (the default), stderr not a terminal: no bar, the summary on stdout
    shown = _recship("export", str(out / "checkpoints" / "step_00000002"), "--out", str(tmp_path / "art3"),
                     "--format", "torchscript", "--log-format", "json")
    _json_lines(shown.stderr)
    assert f"artifact: {tmp_path / 'art3'}" in shown.stdout.splitlines()


def test_serve_writes_only_json_on_stderr(trained, tmp_path):
    out, _ = trained
    repo = tmp_path / "repo"
    _recship("export", str(out / "checkpoints" / "step_00000002"), "--model-repo", str(repo), "--model-name", "m",
             "--format", "torchscript", "--no-progress", "--log-format", "json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recship.cli", "serve", "--model-repo", str(repo), "--port", "0", "--http-port", "0",
         "--metrics-port", "0", "--drain-delay", "0", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )
    try:
        line = proc.stdout.readline()
        while not line.startswith("recship serve: listening on"):
            assert line, "the server exited before listening"
            line = proc.stdout.readline()
        http_port = int(line.rsplit(":", 1)[-1])
        with pytest.raises(urllib.error.HTTPError) as missing:  # a failed request: a log line with its status
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/nope/infer", data=b"{}", timeout=30)
        assert missing.value.code in (400, 404)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    records = _json_lines(stderr)
    messages = [r["message"] for r in records]
    assert any(m.startswith("serving m version 1") for m in messages), messages
    assert any("draining" in m for m in messages), messages


def test_warnings_and_torch_loggers_come_out_as_json():
    script = textwrap.dedent("""
        import logging, warnings
        from recship.logs import configure_logging
        configure_logging("json")
        import torch
        warnings.warn("a user warning", UserWarning)
        warnings.warn("`torch.jit.save` is deprecated. Please switch to `torch.export`.", DeprecationWarning)
        logging.getLogger("torch.distributed.run").warning("\\n***\\nSetting OMP_NUM_THREADS environment variable\\n***")
        logging.getLogger("torch.export.x").info("below torch's level: not shown")
        logging.getLogger("other.library").info("below WARNING: not shown")
        logging.getLogger("recship.test").info("recship at INFO")
        print("a result line", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "a result line\n"
    records = _json_lines(done.stderr)
    assert [(r["level"], r["logger"], r["message"]) for r in records] == [
        ("WARNING", "py.warnings", "UserWarning: a user warning"),
        ("WARNING", "torch.distributed.run", "\n***\nSetting OMP_NUM_THREADS environment variable\n***"),
        ("INFO", "recship.test", "recship at INFO"),
    ]
    assert records[0]["source"] == "<string>:6"


def test_error_line_follows_the_format():
    from recship.logs import error_line

    assert error_line("train", "bad --steps") == error_line("train", "bad --steps", "text") == "recship train: error: bad --steps"
    record = json.loads(error_line("train", ValueError("bad --steps"), "json"))
    assert (record["level"], record["logger"], record["message"]) == ("ERROR", "recship", "recship train: error: bad --steps")


def test_a_commands_one_line_error_is_a_json_record_with_log_format_json(tmp_path, capsys):
    from recship.cli import main

    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "a"), "--log-format", "json"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["message"] == f"recship export: error: checkpoint not found: {tmp_path / 'missing'}"
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "a")]) == 2  # text, the default of every command
    assert capsys.readouterr().err.strip() == f"recship export: error: checkpoint not found: {tmp_path / 'missing'}"
