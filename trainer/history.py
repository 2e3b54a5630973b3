"""A training run's loss and eval history, kept across resumes: ``<out>/history.jsonl``.

One JSON object a line, appended by rank 0 as the run goes: ``{"step": 5, "loss": 0.69}`` after
each step, ``{"step": 100, "eval": {"log_loss": ..., "auc": ..., "examples": ...}}`` after each
evaluation, and ``{"step": 100, "start": {"world_size": 2, "resumed": true}}`` where a run (a
fresh one at step 0, or a resume from the checkpoint of step 100) starts, with its number of
ranks. A run that resumes from the checkpoint of step N first cuts the file back to step N, so
the points a later (abandoned) part of the run wrote do not stay in it (nor the start of an
earlier resume from the same step); a fresh run starts it empty. Files written before start
records existed read the same, without them. ``recship train`` draws ``curves.png`` from it
(recship/plots.py), marking each resume and each change of world size.
"""

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO, Tuple, Union

log = logging.getLogger(__name__)

HISTORY_FILE = "history.jsonl"


class History:
    """The history file of a run folder, opened for appending.

    ``keep_until``: the step the run starts from (0 for a fresh run, the checkpoint's step on
    resume): records past it are dropped before anything is appended. ``world_size``: the run's
    number of ranks, recorded with ``resumed`` as a start at ``keep_until`` (None: record no start,
    e.g. to read a finished run's history).
    """

    def __init__(self, out: Union[str, Path], keep_until: int, world_size: Optional[int] = None,
                 resumed: bool = False) -> None:
        if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.path = Path(out) / HISTORY_FILE
        self.losses: List[Tuple[int, float]] = []  # (step, train loss), in step order
        self.evals: List[Dict[str, Any]] = []  # {"step": n, "log_loss": ..., "auc": ..., ...}, in step order
        self.starts: List[Dict[str, Any]] = []  # {"step": n, "world_size": w, "resumed": bool}, in step order
        for record in read_history(self.path):
            if record["step"] > keep_until:
                continue
            if "loss" in record:
                self.losses.append((record["step"], record["loss"]))
            elif "eval" in record:
                self.evals.append({"step": record["step"], **record["eval"]})
            elif world_size is None or record["step"] < keep_until:  # a start at keep_until is replaced by this one's
                self.starts.append({"step": record["step"], **record["start"]})
        self.losses.sort(key=lambda r: r[0])
        self.evals.sort(key=lambda r: r["step"])
        self.starts.sort(key=lambda r: r["step"])
        self._rewrite()
        self._file: Optional[TextIO] = open(self.path, "a", encoding="utf-8")
        if world_size is not None:
            start = {"world_size": world_size, "resumed": bool(resumed)}
            self.starts.append({"step": keep_until, **start})
            self._append({"step": keep_until, "start": start})

    def _rewrite(self) -> None:
        """Writes the kept records (temporary sibling + rename: a kill mid-write keeps the old file)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for step, loss in self.losses:
                f.write(_json({"step": step, "loss": loss}) + "\n")
            for e in self.evals:
                f.write(_json({"step": e["step"], "eval": {k: v for k, v in e.items() if k != "step"}}) + "\n")
            for r in self.starts:
                f.write(_json({"step": r["step"], "start": {k: v for k, v in r.items() if k != "step"}}) + "\n")
        os.replace(tmp, self.path)

    def _append(self, record: Dict[str, Any]) -> None:
        assert self._file is not None, "History is closed"
        self._file.write(_json(record) + "\n")
        self._file.flush()

    def add_loss(self, step: int, loss: float) -> None:
        """Records the train loss after ``step``."""
        self.losses.append((step, loss))
        self._append({"step": step, "loss": loss})

    def add_eval(self, step: int, metrics: Dict[str, Any]) -> None:
        """Records an evaluation at ``step`` (log_loss, auc, ...); one already there for the step (a
        resumed run that trains no step evaluates the same model again) is not repeated."""
        if not metrics or any(e["step"] == step for e in self.evals[-1:]):
            return
        self.evals.append({"step": step, **metrics})
        self._append({"step": step, "eval": metrics})

    @property
    def steps(self) -> List[int]:
        return [s for s, _ in self.losses]

    @property
    def loss_values(self) -> List[float]:
        return [v for _, v in self.losses]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_history(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """The records of a history file (none if it does not exist). A last line without its newline
    (the writer was killed mid-line) is dropped; any other unreadable line is dropped with a warning."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # cut mid-line by a kill
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and isinstance(record.get("step"), int) and (
                isinstance(record.get("loss"), (int, float)) or isinstance(record.get("eval"), dict) or _is_start(record.get("start")))
        except ValueError:
            ok = False
        if not ok:
            log.warning("%s:%d is not a history record, skipped: %.80s", path, number, line)
            continue
        records.append(record)
    return records


def _is_start(start: Any) -> bool:
    """Whether ``start`` is a start record's value: ``{"world_size": positive int, "resumed": bool}``."""
    return (isinstance(start, dict) and isinstance(start.get("world_size"), int) and not isinstance(start["world_size"], bool)
            and start["world_size"] >= 1 and isinstance(start.get("resumed"), bool))


def _json(record: Dict[str, Any]) -> str:
    """``record`` as strict JSON: a NaN or infinite metric (e.g. AUC of one class) is written as null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(record), allow_nan=False)
