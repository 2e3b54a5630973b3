"""Multi-task labels: a data function's labels [B, T] reach the model's ``loss`` as they are, evaluation reports each
task the model names in ``eval_outputs`` (checked against a plain-torch replay of the checkpoint), the history and
the curves carry them, and a label shape the model cannot take is one line before any rank starts."""

import json
import sys

import numpy as np
import pytest
import torch

from recship.cli import main
from recship.trainer.checkpoint_reader import CheckpointReader
from recship.trainer.entry_point import load_factory

M = "tests.trainer.multi_task_model"
load_factory(f"{M}:build")  # imported as the entry points import it (from the current directory)
multi_task_model = sys.modules[M]
QUIET = ["--no-progress", "--no-plot", "--checkpoint-every", "0"]


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a positive outscores a negative (ties count half), pair by pair."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def _model_of(checkpoint, kind="TwoHeads"):
    """The checkpoint's weights in an unsharded model built by the factory."""
    reader = CheckpointReader(checkpoint)
    state = reader.dense_state_dict()
    for mpath, cfg, weight in reader.tables():
        state[f"{mpath}.embedding_bags.{cfg.name}.weight"] = weight.clone()
    model = multi_task_model.build(kind)
    model.load_state_dict(state)
    return model.eval()


def test_labels_reach_the_loss_as_given_and_each_task_is_evaluated(tmp_path):
    out = tmp_path / "run"
    multi_task_model.LOSS_LABELS.clear()
    assert main(["train", "--out", str(out), "--model", f"{M}:build", "--data", f"{M}:data", "--eval-data", f"{M}:eval_data",
                 "--batch-size", "16", "--steps", "6", "--eval-every", "3", "--eval-batches", "3", *QUIET]) == 0
    assert multi_task_model.LOSS_LABELS == [[2, 2]] * 2 + [[16, 2]] * 6  # the contract check (data, eval data), each step
    summary = json.loads((out / "summary_rank0.json").read_text())
    final = summary["final_eval"]
    assert sorted(final["tasks"]) == ["a", "b"]
    assert {k: final[k] for k in ("log_loss", "auc", "examples")} == final["tasks"]["b"]  # eval_output = "b"
    model = _model_of(summary["checkpoint"])
    batches = list(multi_task_model.eval_data(16))[:3]
    with torch.no_grad():
        outputs = [model(d, k) for d, k, _ in batches]
    labels = torch.cat([l for _, _, l in batches])
    for task, column in {"a": 0, "b": 1}.items():
        s = torch.cat([o[task].reshape(-1) for o in outputs])
        want_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(s.double(), labels[:, column].double()))
        assert final["tasks"][task]["examples"] == 48
        assert final["tasks"][task]["log_loss"] == pytest.approx(want_loss, abs=1e-5)
        assert final["tasks"][task]["auc"] == pytest.approx(_auc(s.numpy(), labels[:, column].numpy()), abs=1e-6)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    evals = [r for r in history if "eval" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(sorted(r["eval"]["tasks"]) == ["a", "b"] for r in evals)
    pytest.importorskip("matplotlib")
    from recship.plots import training_curves_figure

    fig = training_curves_figure([1, 2], [0.7, 0.6], [{"step": r["step"], **r["eval"]} for r in evals])
    labels_drawn = {line.get_label() for ax in fig.axes for line in ax.lines}
    assert {"eval AUC: a", "eval AUC: b", "eval log loss: a", "eval log loss: b"} <= labels_drawn


@pytest.mark.parametrize("kind,data,message", [
    ("NoTasks", "data", "tests.trainer.multi_task_model:data's labels [16, 2] hold 2 tasks: define NoTasks.eval_outputs"),
    ("NoLoss", "data", "tests.trainer.multi_task_model:data's labels [16, 2] hold 2 tasks: define NoLoss.eval_outputs"),
    ("OneTaskLoss", "data", "OneTaskLoss.loss(outputs, labels [2, 2]) failed (tests.trainer.multi_task_model:data's labels "
                            "[16, 2], as the data gives them): "),
    ("TwoHeads", "one_column", "TwoHeads.eval_outputs: 'b' is label column 1, but tests.trainer.multi_task_model:one_column's "
                               "labels [16] have 1 column"),
])
def test_a_label_shape_the_model_cannot_take_is_one_line_before_any_rank(tmp_path, capsys, kind, data, message):
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--model", f"{M}:build", "--model-args", json.dumps({"kind": kind}),
                 "--data", f"{M}:{data}", "--batch-size", "16", "--steps", "2", *QUIET])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("recship train: error: ") and message in err, err
    assert not out.exists()


def test_two_ranks_gather_each_task_and_resume_on_the_recorded_data(tmp_path):
    """On 2 gloo ranks: a run stopped at step 2 and resumed (nothing but --steps and the ranks given again) trains on
    the recorded data at the recorded batch size exactly as a run that never stopped; each task's metrics are
    gathered from both ranks (their eval batches together, against the plain replay of the checkpoint)."""
    flags = ["--model", f"{M}:build", "--data", f"{M}:data", "--eval-data", f"{M}:eval_data", "--batch-size", "8",
             "--eval-every", "0", "--eval-batches", "2", "--nproc-per-node", "2", *QUIET]
    assert main(["train", "--out", str(tmp_path / "a"), "--steps", "4", *flags]) == 0
    straight = json.loads((tmp_path / "a" / "summary_rank0.json").read_text())
    assert main(["train", "--out", str(tmp_path / "b"), "--steps", "2", *flags]) == 0
    assert main(["train", "--out", str(tmp_path / "b"), "--steps", "4", "--resume", "--nproc-per-node", "2", *QUIET]) == 0
    resumed = json.loads((tmp_path / "b" / "summary_rank0.json").read_text())
    assert resumed["losses"] == straight["losses"][2:] and resumed["final_eval"] == straight["final_eval"]
    model = _model_of(resumed["checkpoint"])
    batches = list(multi_task_model.eval_data(8))[:4]  # rank 0 evaluates batches 0 and 2, rank 1 batches 1 and 3
    with torch.no_grad():
        outputs = [model(d, k) for d, k, _ in batches]
    labels = torch.cat([l for _, _, l in batches])
    for task, column in {"a": 0, "b": 1}.items():
        s = torch.cat([o[task].reshape(-1) for o in outputs])
        got = resumed["final_eval"]["tasks"][task]
        assert got["examples"] == 32
        assert got["auc"] == pytest.approx(_auc(s.numpy(), labels[:, column].numpy()), abs=1e-6)
        assert got["log_loss"] == pytest.approx(
            float(torch.nn.functional.binary_cross_entropy_with_logits(s.double(), labels[:, column].double())), abs=1e-5)
