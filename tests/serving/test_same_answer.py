"""The same request, the same answer, through every path: one request of 7 examples, sent alone again and again
and sent among concurrent requests of other sizes (so the server batches it with them), gets one answer, bitwise
the artifact's in-process answer, on the Python and the C++ front, for model.pt2 and model.pt, at 1 and 2 intra-op
threads; and recship_predict gives the same bits.

The model is a DLRM with wide dense layers, whose answers do depend on the batch when it runs whole
(tests/export/test_batch_invariance.py shows it on this machine); the artifact runs in blocks of row_block rows.
"""

import json
import subprocess
import threading

import numpy as np
import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.serving.client import PredictClient
from recship.serving.server import Server, ServerConfig
from recship.models.dlrm import BuiltinDLRM, DLRMConfig
from model_requests import SMALL_ROWS, dlrm_request, in_process, model_repo, request_file, runnable_aoti
from serving_helpers import front_binary

SIZES = (1, 3, 9, 25, 57, 121)  # the other requests' batch sizes


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    torch.manual_seed(0)
    module = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=SMALL_ROWS, embedding_dim=16, dense_arch=[512, 16], over_arch=[512, 256]))
    path = tmp_path_factory.mktemp("same-answer") / "wide"
    export_model(module, ExportConfig(out=str(path), progress=False, validation_batches=1, validation_batch_size=16, format="both"))
    return path


def _answers(port: int, request, alone: int, among: int, seed: int):
    """The request's answers: ``alone`` calls one after another, then ``among`` calls while 3 other clients send
    requests of random sizes without pause."""
    target = f"127.0.0.1:{port}"
    got = []
    with PredictClient(target) as client:
        for _ in range(alone):
            got.append(client.predict("dlrm", *request))
    stop = threading.Event()
    failures = []

    def noise(k: int) -> None:
        g = np.random.default_rng(seed * 10 + k)
        with PredictClient(target) as other:
            while not stop.is_set():
                try:
                    other.predict("dlrm", *dlrm_request(int(g.choice(SIZES)), g))
                except Exception as e:  # noqa: BLE001 - reported below
                    failures.append(e)
                    return

    threads = [threading.Thread(target=noise, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        with PredictClient(target) as client:
            for _ in range(among):
                got.append(client.predict("dlrm", *request))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not failures, failures
    return got


@pytest.mark.parametrize("front", ["python", "cpp"])
@pytest.mark.parametrize("fmt", ["aoti", "torchscript"])
def test_one_request_gets_one_answer_alone_or_batched_on_every_front(wide, front, fmt, tmp_path):
    if front == "cpp":
        front_binary()
    art = runnable_aoti(lambda: wide) if fmt == "aoti" else wide
    repo = model_repo(tmp_path / "repo", {"dlrm": art})
    model, _ = open_artifact(repo / "dlrm" / "1", format=fmt)
    request = dlrm_request(7, 7)
    want = in_process(model, *request)
    for threads in (1, 2):
        server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_delay_ms=2, front=front, model_format=fmt,
                                     torch_threads=threads))
        try:
            answers = _answers(server.port, request, alone=10, among=30, seed=threads)
        finally:
            server.stop()
        for got in answers:
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{front} front, {fmt}, {threads} threads, output {k}")


@pytest.mark.parametrize("fmt", ["aoti", "torchscript"])
def test_recship_predict_gives_the_in_process_bits(wide, binary, fmt, tmp_path):
    art = runnable_aoti(lambda: wide) if fmt == "aoti" else wide
    model, _ = open_artifact(art, format=fmt)
    for batch in (7, 70):  # one block, and two
        request = dlrm_request(batch, batch)
        want = in_process(model, *request)
        done = subprocess.run([str(binary), str(art), "--request", str(request_file(tmp_path / f"r{batch}.json", *request)),
                               "--format", fmt], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32), want[k], err_msg=f"recship_predict {fmt} {k}")
