"""No valid request can take a server down: in a memory cgroup limited to its baseline plus 3 times --max-inflight-mb,
the server (with --front cpp, the Python process and the C++ front together) stays alive under large REST JSON,
KServe gRPC and Predict requests, alone, concurrent inside the budget and over it, and refuses exactly those whose
cost (serving/footprint.py) is over the budget, before decoding them: HTTP 429 / RESOURCE_EXHAUSTED."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import grpc
import numpy as np
import pytest

from recship.export.artifact import open_artifact
from recship.serving import PredictClient, footprint
from recship.serving.json_tensors import Body
from recship.serving.kserve import message

from model_requests import dlrm_request, in_process, model_repo
from serving_helpers import front_binary, http_request, kserve_tensors

MB = 1 << 20
BUDGET = 32 * MB  # --max-inflight-mb 32
PREDICT = "/recship.serving.v1.Predictor/Predict"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
OVERLOADED = re.compile(r"(\d+) bytes of requests would be in flight, over the limit of (\d+) \(--max-inflight-mb\); retry later")


class MemoryCgroup:
    """A child of this process's memory cgroup (v1 memory controller, or v2), made for one test and removed after."""

    def __init__(self, name: str) -> None:
        self.path, self.v2 = _child_cgroup(name)

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v2 if self.v2 else v1)

    def usage(self) -> int:
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def peak(self) -> int:
        peak = self._file("memory.max_usage_in_bytes", "memory.peak")
        return int(peak.read_text()) if peak.exists() else self.usage()

    def reset_peak(self) -> None:
        peak = self._file("memory.max_usage_in_bytes", "memory.peak")
        if peak.exists():
            try:
                peak.write_text("0")
            except OSError:  # v2's memory.peak is reset by newer kernels only
                pass

    def limit(self, nbytes: int) -> None:
        self._file("memory.limit_in_bytes", "memory.max").write_text(str(nbytes))

    def oom_kills(self) -> int:
        text = self._file("memory.oom_control", "memory.events").read_text()
        m = re.search(r"oom_kill (\d+)", text)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _child_cgroup(name: str) -> Tuple[Path, bool]:
    """(a new child of this process's memory cgroup, whether it is v2); skips, saying why, where none can be made."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    why = []
    v1 = next((line.split(":", 2)[2] for line in lines if line.split(":", 2)[1].split(",").count("memory")), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        path = Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / name
        try:
            path.mkdir()
            return path, False
        except OSError as e:
            why.append(f"cgroup v1 {path}: {e.strerror}")
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if v2 is not None and (root / "cgroup.controllers").exists():
            parent = root / v2.lstrip("/")
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                why.append(f"cgroup v2 {parent}: the memory controller is not enabled for its children")
                continue
            try:
                (parent / name).mkdir()
                return parent / name, True
            except OSError as e:
                why.append(f"cgroup v2 {parent / name}: {e.strerror}")
    pytest.skip("no memory cgroup can be made here: " + ("; ".join(why) or "neither cgroup v1's memory controller nor v2 is mounted"))


# -- requests of a given cost ----------------------------------------------------------------------------------

def _request(batch: int, per: int, seed: int):
    return dlrm_request(batch, seed, ids=(per, per))


def _predict(sparse, dense) -> bytes:
    return PredictClient.request("dlrm", sparse, dense).SerializeToString()


def _kserve(sparse, dense) -> bytes:
    r = message("ModelInferRequest")(model_name="dlrm")
    fields = {"INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents"}
    for name, datatype, values in kserve_tensors(sparse, dense):
        inp = r.inputs.add(name=name, datatype=datatype, shape=list(values.shape))
        getattr(inp.contents, fields[datatype]).extend(values.reshape(-1).tolist())
    return r.SerializeToString()


def _rest(sparse, dense) -> bytes:
    inputs = [{"name": n, "datatype": d, "shape": list(v.shape), "data": v.reshape(-1).tolist()} for n, d, v in kserve_tensors(sparse, dense)]
    return json.dumps({"inputs": inputs}).encode()


def _rest_cost(body: bytes) -> int:
    return len(body) + footprint.rest_json(Body(body, float), 0)


KINDS: Dict[str, Tuple[Callable, Callable[[bytes], int]]] = {
    "predict": (_predict, footprint.predict), "kserve": (_kserve, footprint.kserve_infer), "rest": (_rest, _rest_cost)}


def _sized(kind: str, cost: float, seed: int):
    """(request bytes, its cost, sparse, dense) of ``kind`` whose cost (what the server charges it) is about ``cost``:
    256 examples of the small DLRM, as many ids per example and feature as that takes."""
    make, charge = KINDS[kind]
    per = 8
    for _ in range(3):  # the cost is nearly linear in the ids: a few corrections hit it
        sparse, dense = _request(256, per, seed)
        data = make(sparse, dense)
        if abs(charge(data) - cost) < 0.03 * cost:
            break
        per = max(1, round(per * cost / charge(data)))
    return data, charge(data), sparse, dense


# -- the server in the cgroup ------------------------------------------------------------------------------------

class Served:
    def __init__(self, repo: Path, front: str, cgroup: MemoryCgroup, log: Path) -> None:
        script = (f"echo $$ > {cgroup.path / 'cgroup.procs'} && exec {sys.executable} -m recship serve --model-repo {repo} "
                  f"--port 0 --http-port 0 --max-inflight-mb {BUDGET // MB} --max-message-mb 32 --front {front} --drain-delay 0")
        self.log = log
        with open(log, "w") as stderr:  # (a pipe nobody reads would stop the server once full)
            self.proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True)
        line = self.proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, log.read_text()
        self.port = int(line.split("listening on 127.0.0.1:")[1].split(",")[0])
        self.http_port = int(line.rsplit(":", 1)[1])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=[("grpc.max_send_message_length", 64 * MB),
                                                                              ("grpc.max_receive_message_length", 64 * MB)])

    def send(self, kind: str, data: bytes) -> Tuple[str, object]:
        """(status: "OK" or the refusal's status name, outputs {name: array} or the refusal's message)."""
        if kind == "rest":
            status, _, body = http_request(self.http_port, "POST", "/v2/models/dlrm/infer", data, timeout=60)
            doc = json.loads(body)
            if status != 200:
                return {429: "RESOURCE_EXHAUSTED"}.get(status, str(status)), doc.get("error")
            return "OK", {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in doc["outputs"]}
        method, parse = (PREDICT, _predict_outputs) if kind == "predict" else (MODEL_INFER, _kserve_outputs)
        call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return "OK", parse(call(data, timeout=60))
        except grpc.RpcError as e:
            return e.code().name, e.details()

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _predict_outputs(raw: bytes) -> Dict[str, np.ndarray]:
    from recship.serving.v1 import predictor_pb2 as pb

    r = pb.PredictResponse.FromString(raw)
    return {t.name: np.asarray(t.values, np.float32).reshape(list(t.shape)) for t in r.outputs}


def _kserve_outputs(raw: bytes) -> Dict[str, np.ndarray]:
    r = message("ModelInferResponse").FromString(raw)
    return {o.name: np.asarray(o.contents.fp32_contents, np.float32).reshape(list(o.shape)) for o in r.outputs}


def _assert_answer(got: Tuple[str, object], want: Dict[str, np.ndarray], what: str) -> None:
    status, outputs = got
    assert status == "OK", (what, status, outputs)
    assert isinstance(outputs, dict)
    for k, v in want.items():
        np.testing.assert_allclose(outputs[k], v, rtol=0, atol=1e-6, err_msg=what)


def _assert_refused(got: Tuple[str, object], cost: int, what: str, alone: bool = True) -> None:
    """Refused for the budget; ``alone`` (nothing else in flight): the total it names is its whole cost (a REST request
    among others can be refused at its body's bytes, before its decoding is charged)."""
    status, detail = got
    assert status == "RESOURCE_EXHAUSTED", (what, status, str(detail)[:200])
    m = OVERLOADED.fullmatch(str(detail))
    assert m and int(m.group(2)) == BUDGET and int(m.group(1)) > BUDGET, (what, detail)
    assert not alone or int(m.group(1)) == cost, (what, detail, cost)


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_the_server_stays_alive_and_within_its_memory_under_any_mix_of_valid_requests(small_artifact, tmp_path, front):
    if front == "cpp":
        front_binary()  # skips where gRPC C++ is missing
    cgroup = MemoryCgroup(f"recship-memory-{os.getpid()}-{front}")
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    model = open_artifact(repo / "dlrm" / "1", format="torchscript")[0]
    served = None
    started = time.monotonic()
    try:
        served = Served(repo, front, cgroup, tmp_path / "server.log")
        for kind in KINDS:  # warm: every path has run once
            data, _, sparse, dense = _sized(kind, 0.02 * BUDGET, 1)
            _assert_answer(served.send(kind, data), in_process(model, sparse, dense), f"warm {kind}")
        time.sleep(0.5)
        baseline = cgroup.usage()
        cgroup.limit(baseline + 3 * BUDGET)  # past it the kernel kills the server: it must never get there
        cgroup.reset_peak()

        # one at a time, each at 60% of the budget: answered, as the model answers in process
        for seed, kind in enumerate(KINDS, 10):
            data, cost, sparse, dense = _sized(kind, 0.6 * BUDGET, seed)
            assert 0.5 * BUDGET < cost <= BUDGET
            _assert_answer(served.send(kind, data), in_process(model, sparse, dense), f"{kind} of {len(data)} bytes, cost {cost}")

        # together, inside the budget: all answered
        trio = [(kind,) + _sized(kind, 0.3 * BUDGET, seed) for seed, kind in enumerate(KINDS, 20)]
        assert sum(t[2] for t in trio) <= BUDGET
        results: List[Optional[Tuple[str, object]]] = [None] * len(trio)
        threads = [threading.Thread(target=lambda i=i, t=t: results.__setitem__(i, served.send(t[0], t[1]))) for i, t in enumerate(trio)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (kind, data, cost, sparse, dense), got in zip(trio, results):
            _assert_answer(got, in_process(model, sparse, dense), f"concurrent {kind}")

        # over the budget alone: refused before decoding, with the exact status; the 24.9 MiB REST body of 13M ids too
        for seed, kind in enumerate(KINDS, 30):
            data, cost, _, _ = _sized(kind, 1.3 * BUDGET, seed)
            _assert_refused(served.send(kind, data), cost, f"{kind} over the budget")
        ids = np.random.default_rng(0).integers(0, 10, 13_000_000)
        big = json.dumps({"inputs": [{"name": "cat_0.values", "datatype": "INT64", "shape": [ids.size], "data": ids.tolist()}]},
                         separators=(",", ":")).encode()
        assert 24 * MB < len(big) < 25 * MB
        del ids
        _assert_refused(served.send("rest", big), _rest_cost(big), "the 24.9 MiB REST body")
        del big

        # a mix, 6 clients at once, sizes drawn from 5% to 130% of the budget: each answered or refused, never anything else;
        # those over the budget alone always refused
        rng = np.random.default_rng(5)
        plan = [(str(rng.choice(list(KINDS))), float(rng.uniform(0.05, 1.3)), 100 + i) for i in range(18)]
        made = [(kind,) + _sized(kind, f * BUDGET, seed) for kind, f, seed in plan]
        outcomes: List[Optional[Tuple[str, object]]] = [None] * len(made)
        lock = threading.Lock()
        queue = list(range(len(made)))

        def client():
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                outcomes[i] = served.send(made[i][0], made[i][1])

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        answered = 0
        for (kind, data, cost, sparse, dense), got in zip(made, outcomes):
            assert got is not None
            if cost > BUDGET or got[0] != "OK":
                _assert_refused(got, cost, f"mixed {kind} of cost {cost}", alone=False)
            else:
                _assert_answer(got, in_process(model, sparse, dense), f"mixed {kind}")
                answered += 1
        assert answered > 0

        peak = cgroup.peak()
        assert served.proc.poll() is None and cgroup.oom_kills() == 0, served.log.read_text()[-3000:]
        assert peak - baseline <= 3 * BUDGET, (peak - baseline) / MB
        _assert_answer(served.send("predict", _sized("predict", 0.02 * BUDGET, 1)[0]), in_process(model, *_sized("predict", 0.02 * BUDGET, 1)[2:]),
                       "after")
        print(f"{front}: baseline {baseline / MB:.0f} MiB, peak above it {(peak - baseline) / MB:.1f} MiB (budget {BUDGET // MB} MiB)")
        assert time.monotonic() - started < 90
    finally:
        if served is not None:
            served.close()
        cgroup.remove()
