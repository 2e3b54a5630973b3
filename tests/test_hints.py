"""A user's wrong paths cost one line that says what to give instead: a run folder given to export, a checkpoint cut
short, a version or model folder given to serve as the repository."""

import shutil
from pathlib import Path

import pytest

from recship.cli import main

QUICK = ["--steps", "2", "--batch-size", "16", "--num-embeddings-per-feature", "30", "--embedding-dim", "8", "--dense-arch", "8",
         "--over-arch", "8", "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "1", "--no-progress", "--no-plot"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hints") / "run"
    assert main(["train", "--out", str(out), *QUICK]) == 0
    return out


def _one_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    return err


def test_export_of_a_run_folder_names_its_newest_complete_checkpoint(run, tmp_path, capsys):
    newest = sorted((run / "checkpoints").iterdir())[-1]
    assert newest.name == "step_00000002"
    for given in (run, run / "checkpoints"):
        err = _one_line(capsys, ["export", str(given), "--out", str(tmp_path / "a"), "--no-progress"])
        assert err.endswith(f"{given} is a training run's folder, not a checkpoint: export one of its checkpoints, e.g. the newest "
                            f"complete one: recship export {newest}"), err
    assert not (tmp_path / "a").exists()


def test_a_truncated_checkpoint_is_one_line_naming_the_file(run, tmp_path, capsys):
    cut = tmp_path / "cut"
    shutil.copytree(sorted((run / "checkpoints").iterdir())[-1], cut)
    biggest = max((p for p in cut.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    err = _one_line(capsys, ["export", str(cut), "--out", str(tmp_path / "a"), "--no-progress"])
    assert "Traceback" not in err and biggest.name in err, err


def test_serve_given_a_version_or_a_model_folder_says_which_folder_to_give(small_artifact, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(small_artifact, repo / "dlrm" / "1")
    err = _one_line(capsys, ["serve", "--model-repo", str(repo / "dlrm" / "1"), "--port", "0"])
    assert f"--model-repo {repo / 'dlrm' / '1'} is an artifact (a version folder: it holds manifest.json)" in err
    assert f"--model-repo {repo} if 'dlrm' is the model" in err
    err = _one_line(capsys, ["serve", "--model-repo", str(repo / "dlrm"), "--port", "0"])
    assert err.endswith(f"--model-repo {repo / 'dlrm'} is one model's folder (its versions [1] hold the artifacts); give the "
                        f"repository that holds it: --model-repo {repo}"), err
