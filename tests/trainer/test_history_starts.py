"""history.jsonl's start records: where each run started and on how many ranks; old files without them read as before."""

import json

import pytest

from recship.trainer.history import HISTORY_FILE, History, read_history


def _run(out, keep_until, world_size, resumed, last_step):
    h = History(out, keep_until=keep_until, world_size=world_size, resumed=resumed)
    for s in range(keep_until + 1, last_step + 1):
        h.add_loss(s, 1.0 / s)
    h.close()
    return h


def test_each_start_is_recorded_and_cut_back_with_the_steps(tmp_path):
    _run(tmp_path, 0, 1, False, 8)
    _run(tmp_path, 8, 2, True, 12)
    assert History(tmp_path, keep_until=10**9).starts == [
        {"step": 0, "world_size": 1, "resumed": False}, {"step": 8, "world_size": 2, "resumed": True}]
    # back to step 4 twice: the start at 8 goes with steps 9-12, and the second start at 4 replaces the first
    _run(tmp_path, 4, 4, True, 6)
    _run(tmp_path, 4, 3, True, 5)
    final = History(tmp_path, keep_until=10**9)
    final.close()
    assert final.starts == [{"step": 0, "world_size": 1, "resumed": False}, {"step": 4, "world_size": 3, "resumed": True}]
    assert final.steps == [1, 2, 3, 4, 5]
    starts = [r for r in read_history(tmp_path / HISTORY_FILE) if "start" in r]
    assert starts == [{"step": 0, "start": {"world_size": 1, "resumed": False}}, {"step": 4, "start": {"world_size": 3, "resumed": True}}]
    # reading (no world_size) records no start and keeps the file as it is
    before = (tmp_path / HISTORY_FILE).read_text()
    History(tmp_path, keep_until=10**9).close()
    assert sorted((tmp_path / HISTORY_FILE).read_text().splitlines()) == sorted(before.splitlines())


def test_an_old_history_without_start_records_reads_and_resumes(tmp_path):
    lines = [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}, {"step": 2, "eval": {"log_loss": 0.65, "auc": 0.6}}]
    (tmp_path / HISTORY_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    old = History(tmp_path, keep_until=10**9)
    old.close()
    assert old.starts == [] and old.steps == [1, 2] and old.evals == [{"step": 2, "log_loss": 0.65, "auc": 0.6}]
    resumed = _run(tmp_path, 2, 2, True, 3)
    assert resumed.starts == [{"step": 2, "world_size": 2, "resumed": True}] and resumed.steps == [1, 2, 3]


def test_bad_start_records_are_skipped_and_bad_world_sizes_refused(tmp_path, caplog):
    bad = [{"step": 0, "start": {"world_size": 0, "resumed": False}}, {"step": 0, "start": {"world_size": 2}},
           {"step": 0, "start": {"world_size": True, "resumed": False}}, {"step": 0, "start": {"world_size": 2, "resumed": False}}]
    (tmp_path / HISTORY_FILE).write_text("".join(json.dumps(r) + "\n" for r in bad))
    assert read_history(tmp_path / HISTORY_FILE) == bad[3:]
    assert len([r for r in caplog.records if "is not a history record" in r.getMessage()]) == 3
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        History(tmp_path, keep_until=0, world_size=0)
