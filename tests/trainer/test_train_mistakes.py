"""A model author's mistakes at `recship train` cost one line and exit code 2, before any rank starts; a resumed run
takes its model from the checkpoint, as export does."""

import json
from pathlib import Path

import pytest
import torch

from recship.cli import main
from recship.trainer.train import TrainConfig, launch

BRANCH_LINE = next(n for n, line in enumerate(open(Path(__file__).with_name("bad_models.py")), 1) if "if score.sum() > 0" in line)
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


@pytest.mark.parametrize("kind,message", [
    ("Branchy", f"Branchy.forward reads a tensor's value in Python at bad_models.py:{BRANCH_LINE}: if score.sum() > 0:  # a Python "
                "branch on a tensor's value (bool()): export traces the forward"),
    ("Swapped", "Swapped.forward(features, dense): the model contract is forward(dense, features), dense first"),
    ("TupleOut", "TupleOut.forward returned tuple: the model contract is a Tensor or a Dict[str, Tensor], batch first"),
    ("WrongDense", "WrongDense.forward failed on a batch of 2 (dense [2, 6]"),
    ("TwoOutputs", "TwoOutputs returns ['buy', 'click']: define eval_output"),
    ("OddDim", "table 't_user' (features ['user']): embedding_dim 6 is not a multiple of 4"),
    ("ScalarOut", "ScalarOut.forward's output 'output' has shape [] for a batch of 2: outputs are batch-first"),
    ("WideOut", "WideOut trains with binary cross-entropy on one logit per example, but its output has shape [2, 8]"),
])
def test_a_model_breaking_the_contract_costs_one_line_before_any_rank_starts(tmp_path, capsys, kind, message):
    """Each table of these models has 100M rows: the check builds none of them (a rank would allocate 3 GB)."""
    out = tmp_path / "run"
    err = _one_line_error(capsys, ["train", "--model", "tests.trainer.bad_models:build", "--model-args", json.dumps({"kind": kind}),
                                   "--out", str(out), "--steps", "2", "--nproc-per-node", "2", *QUICK])
    assert message in err, err
    assert not out.exists()  # no rank started, nothing written


def test_the_line_of_the_forward_is_named_where_it_failed(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "--model", "tests.trainer.bad_models:build", "--model-args", '{"kind": "WrongDense"}',
                                   "--out", str(tmp_path / "r"), *QUICK])
    assert "(at bad_models.py:" in err and "is num_dense = 6 the width of dense?" in err, err
