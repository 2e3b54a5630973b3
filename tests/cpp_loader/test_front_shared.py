"""The C++ front's shared tables (cpp_loader/tools/front/tables.h): its histogram buckets, status names and the
codes and messages of the refusals it makes itself come from the Python definitions, sent at start
(serving/front.py front_tables()), never from a copy of its own.

Each check fails on a drift: the Python request path says exactly the tables' messages under their statuses and
codes, and its metrics use their buckets; the front holds what Python sent, and counts and refuses with whatever
tables it is given; and its sources hold no copy of a message, a status name or a bucket list.
"""

import asyncio
import json
import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client.utils import floatToGoString

from recship.serving import PredictClient, footprint
from recship.serving.batcher import Batcher, QueueFull
from recship.serving.front import CppFront, FrontError, build_front, front_tables
from recship.serving.grpc_status import CODES
from recship.serving.inference import Inference, Outcome, Overloaded, error_of
from recship.serving.metrics import Metrics
from recship.serving.requests import ParsedRequest
from recship.serving.server import ServerConfig

from model_requests import dlrm_request

ROOT = Path(__file__).resolve().parents[2]
FRONT_SOURCES = [ROOT / "cpp_loader" / "tools" / "recship_front.cpp", *sorted((ROOT / "cpp_loader" / "tools" / "front").iterdir())]
PREDICT = "/recship.serving.v1.Predictor/Predict"


@pytest.fixture(scope="module")
def front_bin() -> Path:
    try:
        return build_front()
    except FrontError as e:
        pytest.skip(f"the C++ front cannot be built here: {e}")


# -- 1. the tables are what the Python server says and counts ------------------------------------------------------

def _parsed() -> ParsedRequest:
    """A request of one example with two features of one id each, and 3 dense values."""
    return ParsedRequest(1, torch.zeros(1, 3), torch.ones(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), None)


def _python_refusals():
    """Each refusal the front makes, as the Python request path makes it: key -> (the exception, the template's fields)."""
    gate = threading.Event()

    def forward(dense, lengths, values, weights):
        gate.wait(30)
        return {"out": dense[:, :1]}

    batcher = Batcher(forward, max_batch_size=1, max_delay_s=0.0, max_queue=1)
    try:
        running = batcher.submit(_parsed())
        deadline = time.monotonic() + 10
        while batcher.pending:  # the worker takes it, then waits at the gate
            assert time.monotonic() < deadline, "the batcher's worker did not take the first request"
            time.sleep(0.01)
        expired = batcher.submit(_parsed(), deadline=time.monotonic())  # its deadline passes while it waits
        with pytest.raises(QueueFull) as full:
            batcher.submit(_parsed())
        gate.set()
        running.result(timeout=30)
        late = expired.exception(timeout=30)
    finally:
        gate.set()
        batcher.stop()
    inference = Inference(SimpleNamespace(config=SimpleNamespace(max_message_bytes=1000)), Metrics(), max_inflight_bytes=150)
    with inference.admit(100), pytest.raises(Overloaded) as over, inference.admit(80):
        pass
    return {
        "cancelled": (asyncio.CancelledError(), {}),
        "deadline": (late, {}),
        "queue_full": (full.value, {"max_queue": "1"}),
        "overloaded": (over.value, {"total": "180", "limit": "150"}),
        "internal": (RuntimeError("the forward failed"), {"type": "RuntimeError", "error": "the forward failed"}),
    }


def test_each_refusal_of_the_tables_is_the_python_request_paths_own():
    refusals = front_tables()["refusals"]
    python = _python_refusals()
    assert set(refusals) == set(python)
    for key, (error, fields) in python.items():
        kind, message = error_of(error)
        r = refusals[key]
        assert (r["code"], r["status"], r["message"].format(**fields)) == (CODES[kind].value[0], kind.label, message), key


def test_the_tables_buckets_and_answered_status_are_the_python_metrics_own():
    tables = front_tables()
    metrics = Metrics()
    inference = Inference(SimpleNamespace(config=SimpleNamespace(max_message_bytes=1000)), metrics, max_inflight_bytes=1000)
    inference.record(Outcome("Predict"), None, time.monotonic())  # an answered request
    assert [s.labels["status"] for s in next(iter(metrics.requests.collect())).samples if s.name.endswith("_total")] \
        == [tables["answered"]]
    for histogram, key in [(metrics.latency, "latency_buckets"), (metrics.queue, "latency_buckets"),
                           (metrics.compute, "latency_buckets"), (metrics.batch, "batch_buckets")]:
        histogram.labels("m", "1").observe(1)
        les = [s.labels["le"] for s in next(iter(histogram.collect())).samples
               if s.name.endswith("_bucket") and s.labels["model"] == "m"]
        assert les == [floatToGoString(b) for b in tables[key]] + ["+Inf"], key


# -- 2. the front uses the tables it is given, and no others -------------------------------------------------------

def test_the_front_holds_the_tables_python_sends(front_bin, tmp_path):
    front = CppFront(ServerConfig(model_repo=str(tmp_path), port=0, front="cpp"), f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)
    try:
        assert front.tables() == json.loads(json.dumps(front_tables()))
    finally:
        front.stop(0)


def test_the_front_counts_logs_and_refuses_with_the_tables_it_is_given(front_bin, small_artifact, tmp_path, monkeypatch, caplog):
    import recship.serving.front as front_module

    tables = front_tables()
    tables.update(latency_buckets=[0.25, 3.0], batch_buckets=[7, 70], log_interval_s=1234.5, answered="DONE")
    tables["refusals"]["overloaded"] = {"code": grpc.StatusCode.UNAVAILABLE.value[0], "status": "SHED",
                                        "message": "shed: {total} > {limit} {{bytes}}"}
    monkeypatch.setattr(front_module, "front_tables", lambda: tables)
    small = PredictClient.request("dlrm", *dlrm_request(1, 1)).SerializeToString()
    large = PredictClient.request("dlrm", *dlrm_request(64, 2)).SerializeToString()
    limit = footprint.predict(small) + 10  # (a Predict's cost: its bytes and 5 times its tensors)
    assert footprint.predict(large) > limit
    config = ServerConfig(model_repo=str(tmp_path), port=0, front="cpp", max_inflight_bytes=limit, torch_threads=1)
    with caplog.at_level(logging.INFO, logger="recship.front"):
        front = CppFront(config, f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)  # no backend: nothing is forwarded
        try:
            front.load("dlrm", 1, small_artifact, "torchscript")
            with grpc.insecure_channel(f"127.0.0.1:{front.port}") as channel:
                call = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
                call(small, timeout=30)
                for _ in range(3):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(large, timeout=30)
                    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                                                f"shed: {footprint.predict(large)} > {limit} {{bytes}}")
            stats = front.stats()
        finally:
            front.stop(0)
    # the refusals over the in-flight budget came before any version, as in Python: counted under "-"
    assert {(r["model"], r["status"], r["count"]) for r in stats["requests"]} == {("dlrm", "DONE", 1), ("-", "SHED", 3)}
    model, unrouted = sorted(stats["models"], key=lambda m: m["model"] == "-")
    for key, bounds in [("latency", [0.25, 3.0]), ("queue", [0.25, 3.0]), ("compute", [0.25, 3.0]), ("batch", [7, 70])]:
        assert model[key]["bounds"] == bounds, key
    assert model["batch"]["counts"] == [1, 0, 0]  # one forward of one example: le 7
    assert sum(model["latency"]["counts"]) == 1 and sum(unrouted["latency"]["counts"]) == 3
    records = [r for r in caplog.records if r.name == "recship.front" and r.getMessage().startswith("shed: ")]
    assert [r.getMessage() for r in records] == [f"shed: {footprint.predict(large)} > {limit} {{bytes}}",
                                                 f"shed: {footprint.predict(large)} > {limit} {{bytes}} [1 more like this in the last 1234.5 s not logged]"
                                                 " (the last of 2 not logged)"]
    for r in records:  # what the line is about: the Python server's extra fields, by the same names
        assert (r.method, r.model, r.version, r.status) == ("Predict", "-", "-", "SHED")


def test_the_front_refuses_a_models_settings_outside_the_rules_bounds(front_bin, small_artifact, tmp_path):
    """A load's settings are held to the serving rules' bounds (recship/serving_rules.h), as ServerConfig holds them."""
    from recship.serving.rules import LIMITS

    front = CppFront(ServerConfig(model_repo=str(tmp_path), port=0, front="cpp"), f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)
    try:
        delay, batch, queue = LIMITS["max_delay_ms"], LIMITS["max_batch_size"], LIMITS["max_queue"]
        for settings, message in [({"max_delay_ms": delay.hi + 1}, f"max_delay_ms must be from {delay.lo:g} to {delay.hi:g}, got {delay.hi + 1:g}"),
                                  ({"max_batch_size": batch.lo - 1}, f"max_batch_size must be >= {batch.lo}, got {batch.lo - 1}"),
                                  ({"max_queue": queue.lo - 1}, f"max_queue must be >= {queue.lo}, got {queue.lo - 1}")]:
            with pytest.raises(FrontError) as refused:
                front.load("dlrm", 1, small_artifact, "torchscript", settings=settings)
            assert str(refused.value) == f"settings: {message}"
        assert front.load("dlrm", 1, small_artifact, "torchscript", settings={"max_delay_ms": delay.hi}) == "torchscript"  # the bound itself loads
    finally:
        front.stop(0)


def test_the_front_refuses_to_start_on_tables_it_would_not_use(front_bin, tmp_path, monkeypatch):
    import recship.serving.front as front_module

    tables = front_tables()
    tables["refusals"]["queue_full"]["message"] = "queue full ({waiting} requests waiting)"
    monkeypatch.setattr(front_module, "front_tables", lambda: tables)
    with pytest.raises(FrontError, match=r"exited \(code 2\)"):
        CppFront(ServerConfig(model_repo=str(tmp_path), port=0, front="cpp"), f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)


def test_the_front_sources_hold_no_copy_of_the_tables():
    source = "\n".join(p.read_text() for p in FRONT_SOURCES)
    tables = front_tables()
    copies = []
    for key, r in tables["refusals"].items():
        copies += [f"{key}: {part!r}" for part in re.split(r"\{\w+\}", r["message"]) if len(part.strip()) >= 8 and part in source]
        copies += [f"{key}: status {r['status']!r}" for status in [r["status"]] if f'"{status}"' in source]
    if f'"{tables["answered"]}"' in source:
        copies.append(f"answered: status {tables['answered']!r}")
    for key in ("latency_buckets", "batch_buckets"):
        numbers = [re.escape(f"{b:g}") + (r"(\.0*)?" if float(b).is_integer() else "") for b in tables[key]]
        for a, b in zip(numbers, numbers[1:]):  # two neighbouring bounds written as a list
            if re.search(rf"(?<![\d.]){a}\s*,\s*{b}(?![\d.])", source):
                copies.append(f"{key}: {a}, {b}")
    assert copies == [], f"the C++ front has copies of the tables (it must use --tables): {copies}"


def test_the_front_tells_kinds_of_errors_apart_by_the_python_rule(front_bin, tmp_path):
    """The sampled log counts each kind of error apart (serving/inference.py message_kind, log.cpp message_kind):
    both fronts must see the same kinds, or one reading of the log would count them differently."""
    import numpy as np

    from recship.serving.inference import message_kind

    g = np.random.default_rng(0)
    alphabet = list("ab :,[]()-.#*{}") + ["0", "7", "42", "'", '"', "é", "ß", "€", "🙂", "\\"]
    messages = ["".join(g.choice(alphabet, size=int(g.integers(0, 40)))) for _ in range(300)]
    tables = front_tables()["refusals"]
    messages += [tables["queue_full"]["message"].format(max_queue=12), tables["overloaded"]["message"].format(total=5, limit=3),
                 "feature 'cat_1': id 27 is out of range [0, 21)", "model 'x' version 3 is not served", "open 'quote 12"]
    front = CppFront(ServerConfig(model_repo=str(tmp_path), port=0, front="cpp"), f"unix:{tmp_path / 'backend.sock'}", binary=front_bin)
    try:
        assert [front.message_kind(m) for m in messages] == [message_kind(m) for m in messages]
        assert front.tables()["log_max_kinds"] == front_tables()["log_max_kinds"]
    finally:
        front.stop(0)
