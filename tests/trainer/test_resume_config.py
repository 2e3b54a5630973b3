"""``recship train --resume`` continues the run its checkpoint records: every recorded input (model and arguments,
data, eval data, batch size, optimizer, learning rates, sharding, seed, eval/checkpoint cadence, keep-last) comes back
unless a flag gives it, and what cannot continue the checkpoint (another model, other shapes) is refused in one line.

Each field: a tiny run with a non-default value, a resume without the flag (the recorded value must show in what
the run did: the calls of the data functions, the checkpoint's optimizer and plan, the evaluations, the files), then
a resume with the flag (the flag's value must show instead)."""

import json
import sys
from pathlib import Path

import pytest

from recship.cli import main
from recship.trainer.checkpoint_reader import latest_checkpoint, read_metadata
from recship.trainer.entry_point import load_factory
from recship.trainer.train import TrainConfig, launch

M = "tests.trainer.resume_model"
load_factory(f"{M}:build")  # imported as the entry points import it (from the current directory)
resume_model = sys.modules[M]  # its CALLS
BASE = {"--model": f"{M}:build", "--data": f"{M}:data", "--eval-data": f"{M}:eval_data", "--batch-size": "4",
        "--eval-every": "0", "--eval-batches": "1", "--checkpoint-every": "0"}
QUIET = ["--no-progress", "--no-plot"]


def _train(out: Path, steps: int, flags, resume: bool = False):
    """recship train; (the exit code, stdout, rank 0's summary, the data functions' calls meanwhile)."""
    resume_model.CALLS.clear()
    argv = ["train", "--out", str(out), "--steps", str(steps), *QUIET, *(["--resume"] if resume else [])]
    for flag, value in flags.items():
        argv += [flag, value]
    code = main(argv)
    summary = json.loads((out / "summary_rank0.json").read_text()) if code == 0 else None
    return code, summary, list(resume_model.CALLS)


def _meta(out: Path):
    return read_metadata(latest_checkpoint(out / "checkpoints"))


def _train_calls(calls):
    return {c for c in calls if "eval" not in c[0]}


# field flag: (the first run's value, the override's value, what the run did with it)
CASES = {
    "--batch-size": ("6", "3", lambda out, s, calls: " ".join(sorted({str(b) for _, b in calls}))),
    "--data": (f"{M}:other_data", f"{M}:data", lambda out, s, calls: f"{M}:" + {n for n, _ in _train_calls(calls)}.pop()),
    "--eval-data": (f"{M}:other_eval_data", f"{M}:eval_data",
                    lambda out, s, calls: f"{M}:" + {n for n, _ in calls if "eval" in n}.pop()),
    "--optimizer": ("exact_sgd", "exact_adagrad", lambda out, s, calls: _meta(out)["tables"]["ebc/t_a"]["optimizer"]),
    "--dense-lr": ("0.2", "0.01", lambda out, s, calls: str(_meta(out)["dense_optimizer"]["param_groups"][0]["lr"])),
    "--sharding": ("row_wise", "table_wise", lambda out, s, calls: _meta(out)["tables"]["ebc/t_a"]["sharding_type"]),
    "--eval-every": ("1", "0", lambda out, s, calls: str(len(s["evals"]))),  # 2 steps a run: 2 evaluations, or none
    "--eval-batches": ("2", "1", lambda out, s, calls: str(s["final_eval"]["examples"] // 4)),
    "--checkpoint-every": ("1", "0", lambda out, s, calls: " ".join(p.name[-1] for p in sorted((out / "checkpoints").iterdir()))),
    "--keep-last": ("1", "0", lambda out, s, calls: str(len(list((out / "checkpoints").iterdir())))),
}
# what the observation reads where it is not the value itself: evaluations in 2 steps (--eval-every 1: 2), the
# checkpoints' steps (every step: 1-4; then 0, the end only: 6), the checkpoints kept (--keep-last 1: 1; 0: all)
EXPECTED = {
    ("--eval-every", "1"): "2", ("--eval-every", "0"): "0",
    ("--checkpoint-every", "1"): "1 2 3 4", ("--checkpoint-every", "0"): "1 2 3 4 6",
    ("--keep-last", "1"): "1", ("--keep-last", "0"): "2",
}


@pytest.mark.parametrize("flag", list(CASES))
def test_resume_takes_each_recorded_field_unless_a_flag_overrides_it(tmp_path, capsys, flag):
    recorded, override, observe = CASES[flag]
    out = tmp_path / "run"
    flags = {**BASE, flag: recorded}
    assert _train(out, 2, flags)[0] == 0
    capsys.readouterr()
    code, summary, calls = _train(out, 4, {}, resume=True)  # nothing but --steps: the checkpoint says the rest
    assert code == 0
    said = capsys.readouterr().out
    assert "--resume from step_00000002: " in said and "nothing overridden" in said
    assert f"of {summary['data']} at batch {summary['batch_size']}" in said  # the closing line names the data again
    want = EXPECTED.get((flag, recorded), recorded)
    assert observe(out, summary, calls) == want, f"{flag}: the resumed run did not use the recorded {recorded}"
    assert _meta(out)["config"]["train"][flag[2:].replace("-", "_")] == _typed(recorded)

    code, summary, calls = _train(out, 6, {flag: override}, resume=True)
    assert code == 0
    said = capsys.readouterr().out
    assert f"from flags, over the checkpoint's: {flag} {override} (was {recorded})" in said
    want = EXPECTED.get((flag, override), override)
    assert observe(out, summary, calls) == want, f"{flag}: the flag's {override} did not override the checkpoint's"


def _typed(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def test_resume_takes_the_embedding_learning_rate(tmp_path, monkeypatch):
    """The fused optimizer is built with the recorded rate, or the flag's."""
    import recship.trainer.train as train

    rates = []
    real = train.FusedOptimizerConfig
    monkeypatch.setattr(train, "FusedOptimizerConfig", lambda optim, learning_rate: rates.append(learning_rate) or real(optim, learning_rate=learning_rate))
    out = tmp_path / "run"
    assert _train(out, 2, {**BASE, "--embedding-lr": "0.3"})[0] == 0
    assert _train(out, 3, {}, resume=True)[0] == 0
    assert _train(out, 4, {"--embedding-lr": "0.02"}, resume=True)[0] == 0
    assert rates == [0.3, 0.3, 0.02]


def test_resume_takes_the_seed_of_synthetic_data(tmp_path):
    """--seed draws the synthetic data: the resumed steps train on the recorded seed's batches, exactly as a run
    that never stopped; --seed on the resume draws other batches."""
    flags = {"--model": f"{M}:build", "--batch-size": "8", "--eval-every": "0", "--eval-batches": "1", "--seed": "5"}
    straight = _train(tmp_path / "a", 4, flags)[1]
    assert _train(tmp_path / "b", 2, flags)[0] == 0
    resumed = _train(tmp_path / "b", 3, {}, resume=True)[1]
    assert resumed["losses"] == straight["losses"][2:3]
    other = _train(tmp_path / "b", 4, {"--seed": "0"}, resume=True)[1]
    assert other["losses"] != straight["losses"][3:4]


def test_resume_takes_the_model_arguments_and_refuses_shapes_it_cannot_continue(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, 2, {**BASE, "--model-args": '{"rows": 30}'})[0] == 0
    assert _train(out, 3, {}, resume=True)[0] == 0
    assert [t["config"]["num_embeddings"] for t in _meta(out)["tables"].values()] == [30, 30]
    capsys.readouterr()
    refusals = [
        ({"--model": "tests.trainer.indexed_model:build"}, f"trained {M}:build, not --model tests.trainer.indexed_model:build"),
        ({"--model-args": '{"rows": 40}'}, "table ebc/t_a is 30 x 4 there, 40 x 4 in"),
        ({"--model-args": '{"rows": 30, "hidden": 8}'}, "mlp.0.weight is [4, 10] there, [8, 10] in"),
    ]
    for flags, named in refusals:
        code, _, _ = _train(out, 4, flags, resume=True)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("recship train: error: --resume: "), err
        assert named in err, err
    assert latest_checkpoint(out / "checkpoints").name == "step_00000003"  # nothing trained
    # the same arguments, given again, are no conflict
    assert _train(out, 4, {"--model-args": '{"rows": 30}', "--model": f"{M}:build"}, resume=True)[0] == 0


def test_resume_of_the_builtin_dlrm_refuses_other_shape_flags(tmp_path, capsys):
    shape = {"--num-embeddings-per-feature": "30", "--embedding-dim": "8", "--dense-arch": "16", "--over-arch": "8",
             "--batch-size": "8", "--eval-every": "0", "--eval-batches": "1"}
    out = tmp_path / "run"
    assert _train(out, 2, shape)[0] == 0
    capsys.readouterr()
    for flags, named in [({"--embedding-dim": "12"}, "--embedding-dim build a model that cannot continue"),
                         ({"--over-arch": "16"}, "--over-arch build a model that cannot continue"),
                         ({"--model": f"{M}:build"}, "trained recship.models.dlrm:builtin, not --model")]:
        assert _train(out, 3, flags, resume=True)[0] == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err, err


def test_a_config_file_counts_as_given_and_python_callers_override_by_changed_fields(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, 2, {**BASE, "--batch-size": "6"})[0] == 0
    config = tmp_path / "resume.yaml"
    config.write_text("batch_size: 3\n")
    resume_model.CALLS.clear()
    assert main(["train", "--config", str(config), "--out", str(out), "--steps", "3", "--resume", *QUIET]) == 0
    assert {b for _, b in _train_calls(resume_model.CALLS)} == {3}
    # Python: the fields that differ from TrainConfig's defaults are the overrides; the rest is the checkpoint's
    resume_model.CALLS.clear()
    summary = launch(TrainConfig(out=str(out), steps=4, resume=True, progress=False, plot=False))
    assert {b for _, b in _train_calls(resume_model.CALLS)} == {3} and summary["data"] == f"{M}:data"
    # or an explicit set of given fields: batch_size=256 (the default) given on purpose
    resume_model.CALLS.clear()
    launch(TrainConfig(out=str(out), steps=5, resume=True, progress=False, plot=False), given={"steps", "batch_size"})
    assert {b for _, b in _train_calls(resume_model.CALLS)} == {256}


@pytest.mark.parametrize("recorded", ["eval_data", "data"])
def test_export_of_a_checkpoint_validates_on_the_runs_own_data(tmp_path, recorded):
    out = tmp_path / "run"
    flags = {**BASE, "--eval-every": "0"}
    if recorded == "data":
        del flags["--eval-data"]
    assert _train(out, 2, flags)[0] == 0
    resume_model.CALLS.clear()
    assert main(["export", str(latest_checkpoint(out / "checkpoints")), "--out", str(tmp_path / "art"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    function = f"{M}:{recorded}"
    assert manifest["validation"]["data"] == function
    assert [n for n, _ in resume_model.CALLS] == [recorded] and "auc" in manifest["validation"]
