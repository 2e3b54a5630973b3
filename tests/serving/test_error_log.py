"""The request path's log: the sampled log counts each kind of error apart (Python and the C++ front, one rule), and
a request, valid or not, makes torch warn about nothing."""

import logging
import re
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest

from recship.serving.inference import Inference, Outcome, SampledLog, message_kind
from recship.serving.metrics import Metrics
from recship.serving.requests import ModelSpec, RequestArrays, validate
from recship.serving.client import PredictClient

ROWS = [20, 21, 22]
SPEC = ModelSpec(features=["cat_0", "cat_1", "cat_2"], rows={f"cat_{i}": r for i, r in enumerate(ROWS)},
                 modulo={f"cat_{i}": False for i in range(3)}, weighted={f"cat_{i}": False for i in range(3)}, num_dense=2,
                 max_batch_size=64)


def _reference_kind(message):
    """message_kind's rule as one left-to-right regex: digit runs -> #, a quoted run -> its two quotes."""
    return re.sub(r"[0-9]+|'[^']*(?:'|$)|\"[^\"]*(?:\"|$)", lambda m: "#" if m.group(0)[0].isdigit() else m.group(0)[0] * 2,
                  message)


def _messages(seed, n):
    """``n`` random messages of digits, quotes, ASCII and multi-byte characters."""
    g = np.random.default_rng(seed)
    alphabet = list("ab :,[]()-.#*") + ["0", "7", "42", "'", '"', "é", "ß", "€", "🙂", "{x}"]
    return ["".join(g.choice(alphabet, size=int(g.integers(0, 30)))) for _ in range(n)]


def test_message_kind_drops_numbers_and_quoted_names():
    assert message_kind("feature 'cat_1': id 27 is out of range [0, 21)") == "feature '': id # is out of range [#, #)"
    assert message_kind('unknown sparse feature "it\'s"; the model takes [\'a\']') == 'unknown sparse feature ""; the model takes [\'\']'
    assert message_kind("queue full (12 requests waiting)") == "queue full (# requests waiting)"
    assert message_kind("name 'open to the end 12") == "name ''"
    for message in _messages(0, 500):
        assert message_kind(message) == _reference_kind(message), message


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _refusal(sparse, dense=((0.5, 0.5),)):
    """The InvalidRequest that validate raises for a request of one example."""
    request = RequestArrays.from_message(PredictClient.request("m", sparse, [list(d) for d in dense]))
    with pytest.raises(ValueError) as refused:
        validate(request, SPEC)
    return refused.value


def test_interleaved_kinds_of_bad_requests_are_counted_apart():
    clock = [100.0]
    logger = logging.getLogger("recship.test_error_log")
    logger.propagate, logger.level = False, logging.INFO
    handler = _Lines()
    logger.handlers = [handler]
    inference = Inference(SimpleNamespace(config=SimpleNamespace(max_message_bytes=1000)), Metrics(), max_inflight_bytes=1000)
    inference.failures = SampledLog(logger, interval_s=10.0, clock=lambda: clock[0])
    good = {"cat_0": [[1]], "cat_1": [[2]], "cat_2": [[3]]}
    # two kinds of INVALID_ARGUMENT, each with its values changing from request to request
    out_of_range = [_refusal({**good, f"cat_{i % 3}": [[ROWS[i % 3] + i]]}) for i in range(7)]
    wrong_dense = [_refusal(good, dense=[[0.5] * (3 + i)]) for i in range(4)]
    assert len({str(e) for e in out_of_range}) == 7 and len({str(e) for e in wrong_dense}) == 4
    order = [out_of_range[0], wrong_dense[0], out_of_range[1], out_of_range[2], wrong_dense[1], out_of_range[3], wrong_dense[2],
             out_of_range[4], out_of_range[5], wrong_dense[3], out_of_range[6]]
    for e in order:
        clock[0] += 0.5  # all within one 10 s interval
        inference.record(Outcome("Predict"), e, time.monotonic())
    assert handler.lines == [str(out_of_range[0]), str(wrong_dense[0])]  # the first of each kind
    inference.failures.flush()
    assert handler.lines[2:] == [
        f"{out_of_range[6]} [5 more like this in the last 10 s not logged] (the last of 6 not logged)",
        f"{wrong_dense[3]} [2 more like this in the last 10 s not logged] (the last of 3 not logged)",
    ]
    # the next interval: each kind's first line again, without a count (flush said it)
    clock[0] += 10.0
    inference.record(Outcome("Predict"), wrong_dense[0], time.monotonic())
    inference.record(Outcome("Predict"), out_of_range[0], time.monotonic())
    assert handler.lines[4:] == [str(wrong_dense[0]), str(out_of_range[0])]


def test_a_source_past_max_kinds_shares_one_count(monkeypatch):
    clock = [0.0]
    logger = logging.getLogger("recship.test_error_log.kinds")
    logger.propagate, logger.level = False, logging.INFO
    handler = _Lines()
    logger.handlers = [handler]
    monkeypatch.setattr(SampledLog, "MAX_KINDS", 3)
    sampled = SampledLog(logger, interval_s=10.0, clock=lambda: clock[0])
    for i in range(6):  # six kinds: the first three apart, the last three as one
        sampled.log("s", logging.WARNING, "kind" + "x" * i)
    assert handler.lines == ["kind", "kindx", "kindxx", "kindxxx"]
    sampled.flush()
    assert handler.lines[4:] == ["kindxxxxx [1 more like this in the last 10 s not logged] (the last of 2 not logged)"]


# Run in a process of its own: torch warns about a read-only array once per process, so a warning an earlier test
# caused would hide this one. The last request proves the detector: from_numpy on read-only bytes does warn.
_NO_WARNINGS = textwrap.dedent("""
    import warnings

    import numpy as np
    import torch

    from recship.serving import kserve, wire
    from recship.serving.client import PredictClient
    from recship.serving.requests import InvalidRequest, ModelSpec, validate

    spec = ModelSpec(features=["a", "b"], rows={"a": 20, "b": 21}, modulo={"a": False, "b": True},
                     weighted={"a": False, "b": False}, num_dense=2, max_batch_size=64)
    good = {"a": [[1], [2, 3]], "b": [[4], []]}
    cases = [(good, [[0.5, 0.5], [1.0, 2.0]]), ({**good, "a": [[1], [20]]}, [[0.5, 0.5]] * 2),
             ({**good, "a": [[-1], [2]]}, [[0.5, 0.5]] * 2), ({**good, "b": [[2**40], [7]]}, [[0.5, 0.5]] * 2),
             (good, [[0.5], [1.0]]), ({"a": good["a"]}, [[0.5, 0.5]] * 2)]

    def kserve_raw(sparse, dense):
        request = kserve.message("ModelInferRequest")(model_name="m")
        tensors = [("dense", "FP32", [len(dense), len(dense[0])], np.asarray(dense, dtype="<f4"))]
        for f, rows in sparse.items():
            tensors.append((f + ".lengths", "INT32", [len(rows)], np.array([len(r) for r in rows], dtype="<i4")))
            tensors.append((f + ".values", "INT64", [sum(map(len, rows))], np.array([i for r in rows for i in r], dtype="<i8")))
        for name, datatype, shape, values in tensors:
            request.inputs.add(name=name, datatype=datatype, shape=shape)
            request.raw_input_contents.append(values.tobytes())
        return kserve.request_arrays(kserve.from_grpc(kserve.message("ModelInferRequest").FromString(request.SerializeToString())), 2)

    outcomes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sparse, dense in cases:
            for read in (lambda: wire.read_request(PredictClient.request("m", sparse, dense).SerializeToString()),
                         lambda: kserve_raw(sparse, dense)):
                arrays = read()
                outcomes.append("read-only" if not arrays.sparse.ids.flags.writeable else "writable")
                try:
                    validate(arrays, spec)
                    outcomes.append("ok")
                except InvalidRequest as e:
                    outcomes.append(type(e).__name__)
        print(outcomes)
        print("warnings:", [str(w.message)[:60] for w in caught])
        torch.from_numpy(np.frombuffer(b"12345678", dtype=np.int64))
        print("control:", [str(w.message)[:40] for w in caught])
""")


def test_valid_and_invalid_requests_make_torch_warn_about_nothing():
    done = subprocess.run([sys.executable, "-c", _NO_WARNINGS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcomes, warned, control = done.stdout.splitlines()
    # the Predict reader hands over views of the request's bytes (read-only); KServe's inputs are joined into new arrays
    read = [("read-only", "writable")] * 6
    refused = ["ok", "IdOutOfRange", "IdOutOfRange", "ok", "InvalidRequest", "InvalidRequest"]
    assert outcomes == str([x for (w, r), o in zip(read, refused) for x in (w, o, r, o)])
    assert warned == "warnings: []"
    assert control == "control: ['The given NumPy array is not writable, a']"
