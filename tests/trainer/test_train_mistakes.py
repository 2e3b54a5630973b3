"""A model author's mistakes at `recship train` cost one line and exit code 2, before any rank starts; a resumed run
takes its model from the checkpoint, as export does."""

import json

import pytest
import torch

from recship.cli import main
from recship.trainer.train import TrainConfig, launch

QUICK = ["--batch-size", "16", "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress", "--no-plot"]


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_resume_without_model_continues_the_recorded_model_exactly(tmp_path):
    def config(out, steps, **kw):
        return TrainConfig(out=str(out), steps=steps, batch_size=16, eval_every=0, eval_batches=1, checkpoint_every=0,
                           progress=False, plot=False, **kw)

    model = dict(model="tests.trainer.indexed_model:build", model_args={"wait_first": True})
    straight = launch(config(tmp_path / "a", 6, **model))
    first = launch(config(tmp_path / "b", 3, **model))
    resumed = launch(config(tmp_path / "b", 6, resume=True))  # no --model: the checkpoint records it
    assert resumed["resumed_from"].endswith("step_00000003")
    torch.testing.assert_close(torch.tensor(first["losses"] + resumed["losses"]), torch.tensor(straight["losses"]), atol=0, rtol=0)


def test_resume_of_the_builtin_dlrm_takes_its_shape_from_the_checkpoint(tmp_path, capsys):
    shape = ["--num-embeddings-per-feature", "30", "--embedding-dim", "8", "--dense-arch", "16", "--over-arch", "8"]
    out = str(tmp_path / "run")
    assert main(["train", "--out", out, "--steps", "2", *shape, *QUICK]) == 0
    assert main(["train", "--out", out, "--steps", "4", "--resume", *QUICK]) == 0  # the shape flags are not needed again
    summary = json.loads((tmp_path / "run" / "summary_rank0.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("step_00000002")


@pytest.mark.parametrize("flags,named", [
    (["--embedding-dim", "32"], "--embedding-dim shapes"),
    (["--num-embeddings-per-feature", "50", "--over-arch", "8", "4"], "--num-embeddings-per-feature, --over-arch shape"),
])
def test_dlrm_shape_flags_are_refused_with_model(tmp_path, capsys, flags, named):
    err = _one_line_error(capsys, ["train", "--model", "tests.trainer.indexed_model:build", "--out", str(tmp_path / "r"), *flags, *QUICK])
    assert named in err and "the built-in DLRM, not --model's" in err
    assert not (tmp_path / "r").exists()
