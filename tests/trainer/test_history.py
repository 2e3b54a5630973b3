"""A run's history.jsonl: appended per step and eval, cut back to the step a run resumes from."""

import json
import logging

from recship.trainer.history import HISTORY_FILE, History, read_history


def _write(history, steps, evals=()):
    for s in steps:
        history.add_loss(s, 1.0 / s)
        if s in evals:
            history.add_eval(s, {"log_loss": 0.5 / s, "auc": 0.5 + s / 100})


def test_history_survives_reopening_and_is_cut_back_to_the_resumed_step(tmp_path):
    h = History(tmp_path, keep_until=0)
    _write(h, range(1, 9), evals=(4, 8))
    h.close()
    assert len(read_history(tmp_path / HISTORY_FILE)) == 10
    again = History(tmp_path, keep_until=8)
    assert again.steps == list(range(1, 9)) and [e["step"] for e in again.evals] == [4, 8]
    again.close()
    # resumed from the checkpoint of step 4: steps 5-8 and the eval of step 8 are gone, from the file too
    resumed = History(tmp_path, keep_until=4)
    assert resumed.steps == [1, 2, 3, 4]
    assert resumed.evals == [{"step": 4, "log_loss": 0.125, "auc": 0.54}]
    _write(resumed, range(5, 7), evals=(6,))
    resumed.close()
    final = History(tmp_path, keep_until=10**9)
    assert final.steps == [1, 2, 3, 4, 5, 6]
    assert final.loss_values == [1.0 / s for s in range(1, 7)]
    assert [e["step"] for e in final.evals] == [4, 6]
    final.close()
    # a fresh run (no checkpoint: step 0) starts empty
    fresh = History(tmp_path, keep_until=0)
    fresh.close()
    assert fresh.steps == [] and fresh.evals == [] and (tmp_path / HISTORY_FILE).read_text() == ""


def test_the_same_eval_is_not_recorded_twice(tmp_path):
    h = History(tmp_path, keep_until=0)
    h.add_eval(4, {"log_loss": 0.6, "auc": 0.7})
    h.add_eval(4, {"log_loss": 0.6, "auc": 0.7})  # a resumed run that trains no step evaluates step 4 again
    h.add_eval(5, {})  # no eval data: nothing to record
    h.close()
    assert [r["step"] for r in read_history(tmp_path / HISTORY_FILE)] == [4]


def test_a_line_cut_by_a_kill_is_dropped_and_garbage_is_reported(tmp_path, caplog):
    path = tmp_path / HISTORY_FILE
    good = [json.dumps({"step": 1, "loss": 0.7}), "not json", json.dumps({"step": "2", "loss": 0.6}), json.dumps({"step": 3, "loss": 0.5})]
    path.write_text("\n".join(good) + '\n{"step": 4, "lo')
    with caplog.at_level(logging.WARNING, logger="recship.trainer.history"):
        records = read_history(path)
    assert records == [{"step": 1, "loss": 0.7}, {"step": 3, "loss": 0.5}]
    assert [r.getMessage().split(" is not")[0] for r in caplog.records] == [f"{path}:2", f"{path}:3"]
    assert read_history(tmp_path / "missing.jsonl") == []
