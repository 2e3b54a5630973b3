"""``recship export --model-repo DIR --model-name M``: the next version folder, written atomically, picked up by a running server."""

import os
import time

import pytest
import torch

from recship.export import ExportConfig, ExportError, export_model
from recship.contract import repository
from recship.export import pipeline
from recship.export.artifact import Manifest
from recship.serving import PredictClient
from recship.serving.server import Server, ServerConfig
from recship.models.dlrm import BuiltinDLRM, DLRMConfig

from model_requests import dlrm_request

ROWS = [20 + i for i in range(26)]


def _dlrm(seed):
    torch.manual_seed(seed)
    return BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))


def _config(repo, name="dlrm", **kw):
    base = dict(repo=str(repo), model_name=name, dtype="int8", progress=False, validation_batches=1, validation_batch_size=32,
                format="torchscript")
    base.update(kw)
    return ExportConfig(**base)


def test_next_version_counts_only_number_folders(tmp_path):
    assert repository.next_version(tmp_path / "absent") == 1
    assert repository.next_version(tmp_path) == 1
    for name in ["1", "7", "latest", ".version.tmp-0a1b2c3d", ".99", "²", "12a"]:
        (tmp_path / name).mkdir()
    assert repository.next_version(tmp_path) == 8


def _finished(tmp_path):
    """A stand-in for a finished artifact folder (publish_version only renames it)."""
    tmp = tmp_path / "m" / ".version.tmp-test"
    tmp.mkdir(parents=True)
    (tmp / "manifest.json").write_text("{}")
    return tmp


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "check-then-rename"])
def test_a_number_taken_after_it_was_chosen_is_not_overwritten(tmp_path, monkeypatch, renameat2):
    if not renameat2:
        monkeypatch.setattr(repository, "_renameat2", lambda: None)
    elif repository._renameat2() is None:
        pytest.skip("no renameat2 here")
    tmp = _finished(tmp_path)
    model_dir = tmp.parent
    (model_dir / "1").mkdir()
    real, raced = repository.next_version, []

    def racing(path):  # once: another export creates the chosen folder (empty, even) before this one renames
        version = real(path)
        if not raced:
            raced.append(version)
            (path / str(version)).mkdir()
        return version

    monkeypatch.setattr(repository, "next_version", racing)
    stamped = []
    assert repository.publish_version(tmp, model_dir, stamped.append) == 3
    assert stamped == [2, 3]  # the manifest is rewritten for the number it finally gets
    assert list((model_dir / "2").iterdir()) == []  # the other export's folder is untouched
    assert (model_dir / "3" / "manifest.json").is_file() and not tmp.exists()


def test_a_folder_appearing_between_the_check_and_the_rename(tmp_path, monkeypatch):
    monkeypatch.setattr(repository, "_renameat2", lambda: None)  # the fallback: the rename itself must fail
    tmp = _finished(tmp_path)
    model_dir = tmp.parent
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(os.path.basename(dst))
        if len(calls) == 1:  # the racing export wins: its complete version lands first
            os.mkdir(dst)
            open(os.path.join(dst, "manifest.json"), "w").close()
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    assert repository.publish_version(tmp, model_dir) == 2
    assert calls == ["1", "2"] and (model_dir / "1" / "manifest.json").stat().st_size == 0


def test_a_failing_export_leaves_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pipeline, "write_sample", fail)  # fails inside the temporary folder, after model.pt
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(_dlrm(0), _config(tmp_path / "repo"))
    assert not (tmp_path / "repo" / "dlrm").exists()  # the model folder it created is gone too


def test_config_and_cli_refusals(tmp_path, capsys):
    from recship.cli import main

    with pytest.raises(ExportError, match="model name 'a/b'"):
        _config(tmp_path, name="a/b")
    with pytest.raises(ExportError, match="not both"):
        _config(tmp_path, out=str(tmp_path / "x"))
    with pytest.raises(ExportError, match="overwrite does not apply"):
        _config(tmp_path, overwrite=True)
    checkpoint = str(tmp_path / "ckpt")  # never read: every case is refused first
    repo = str(tmp_path / "repo")
    cases = [
        (["--model-repo", repo], "--model-repo needs --model-name"),
        (["--model-repo", repo, "--model-name", "../up"], "--model-name '../up' cannot name a model folder"),
        (["--model-repo", repo, "--model-name", ".hidden"], "--model-name '.hidden'"),
        (["--model-repo", repo, "--model-name", "m", "--model-version", "3"], "--model-version does not apply with --model-repo"),
        (["--model-repo", repo, "--model-name", "m", "--overwrite"], "--overwrite does not apply with --model-repo"),
    ]
    for argv, message in cases:
        assert main(["export", checkpoint, *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("recship export: error:") and message in err, (argv, err)
    for argv, message in [(["--out", str(tmp_path / "x"), "--model-repo", repo, "--model-name", "m"], "argument --model-repo: not allowed with argument --out"),
                          ([], "one of the arguments --out --model-repo is required")]:
        with pytest.raises(SystemExit) as e:
            main(["export", checkpoint, *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    assert not os.path.exists(repo)


def test_a_running_server_picks_up_each_new_version(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "dlrm").mkdir(parents=True)
    (repo / "dlrm" / "notes").mkdir()  # neither counts as a version when choosing the number
    (repo / "dlrm" / ".version.tmp-deadbeef").mkdir()  # left by a killed export: skipped by the server too
    export_model(_dlrm(0), _config(repo))
    assert sorted(p.name for p in (repo / "dlrm").iterdir()) == [".version.tmp-deadbeef", "1", "notes"]
    server = Server(ServerConfig(model_repo=str(repo), port=0, poll_interval_s=0.2))
    try:
        sparse, dense = dlrm_request(3, 5)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            assert client.stub.Predict(client.request("dlrm", sparse, dense), timeout=10).model_version == 1
            manifest = export_model(_dlrm(1), _config(repo, dtype="fp16", progress=True))
            assert f"wrote {repo / 'dlrm' / '2'} (version 2)" in capsys.readouterr().out
            deadline, version = time.time() + 60, 1  # (a bound on a busy machine's load: the watcher polls every 0.2 s)
            while version != 2 and time.time() < deadline:
                version = client.stub.Predict(client.request("dlrm", sparse, dense), timeout=10).model_version
                time.sleep(0.05)
            assert version == 2
        # the hidden folder is never refused; "notes" (not a number) is, as before
        assert [(u.model, u.version) for u in server.repo.unavailable()] == [("dlrm", "notes")]
    finally:
        server.stop()
    assert manifest["model"] == {**manifest["model"], "name": "dlrm", "version": 2}
    for version in (1, 2):
        m = Manifest.read(repo / "dlrm" / str(version))
        assert (m.model.name, m.model.version) == ("dlrm", version)
    assert sorted(p.name for p in (repo / "dlrm").iterdir()) == [".version.tmp-deadbeef", "1", "2", "notes"]


def test_cli_repo_mode_reaches_the_config(tmp_path, monkeypatch):
    from recship.cli import main
    from recship.export import cli

    seen = []
    monkeypatch.setattr(cli, "export_model", lambda source, config: seen.append((source, config)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()  # the CLI refuses a missing checkpoint before it loads torch
    assert main(["export", str(ckpt), "--model-repo", str(tmp_path), "--model-name", "dlrm", "--dtype", "int4"]) == 0
    assert main(["export", str(ckpt), "--out", str(tmp_path / "a")]) == 0
    (_, repo_mode), (_, out_mode) = seen
    assert (repo_mode.repo, repo_mode.out, repo_mode.model_name, repo_mode.dtype) == (str(tmp_path), None, "dlrm", "int4")
    assert (out_mode.repo, out_mode.model_name, out_mode.model_version) == (None, "model", 1)


def test_an_export_removes_what_a_killed_export_left(tmp_path):
    """A staging folder names its exporter's pid; one whose process is gone goes, a live one's stays."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    model_dir = tmp_path / "m"
    (model_dir / f".version.tmp-{dead.pid}-0a1b2c3d").mkdir(parents=True)
    (model_dir / f".version.tmp-{os.getpid()}-live").mkdir()  # this process: alive
    (model_dir / ".version.tmp-deadbeef").mkdir()  # not a pid: not ours to judge
    pipeline._remove_abandoned(model_dir / ".version.tmp-")
    assert sorted(p.name for p in model_dir.iterdir()) == [f".version.tmp-{os.getpid()}-live", ".version.tmp-deadbeef"]


@pytest.mark.parametrize("atomic", [True, False], ids=["renameat2", "fallback"])
def test_exchange_swaps_two_folders(tmp_path, monkeypatch, atomic):
    if not atomic:
        monkeypatch.setattr(repository, "_renameat2", lambda: None)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(name)
    repository.exchange(tmp_path / "a", tmp_path / "b")
    assert [(tmp_path / n / "which").read_text() for n in ("a", "b")] == ["b", "a"]
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_overwrite_swaps_the_artifact_in_without_a_moment_missing(tmp_path, monkeypatch):
    """--overwrite of a served folder: before, the old folder was removed and then the new one renamed in, so a
    server's scan could find the version gone and unload it (rolling back) in between."""
    out = tmp_path / "repo" / "dlrm" / "1"
    config = dict(model_name="dlrm", out=str(out), overwrite=True, dtype="int8", progress=False, validation_batches=1,
                  validation_batch_size=32, format="torchscript")
    first = export_model(_dlrm(0), ExportConfig(**config))
    missing = []  # whether the served folder was missing after any removal the export made
    rmtree = pipeline.shutil.rmtree

    def watched_rmtree(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        missing.append(not (out / "manifest.json").exists())

    monkeypatch.setattr(pipeline.shutil, "rmtree", watched_rmtree)
    second = export_model(_dlrm(1), ExportConfig(**config))
    assert missing and not any(missing)
    assert Manifest.read(out).to_dict() == second and second != first
    assert sorted(os.listdir(out.parent)) == ["1"]  # the old artifact removed, nothing left beside it
