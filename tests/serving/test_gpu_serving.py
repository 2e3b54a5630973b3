"""Serving on a GPU: pinned staging, async copies, synchronised results (skipped without CUDA)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.serving import PredictClient
from recship.serving.server import Server, ServerConfig
from recship.models.dlrm import BuiltinDLRM, DLRMConfig

from model_requests import dlrm_request, in_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU serving)")

ROWS = [50 + i for i in range(26)]


@pytest.fixture(scope="module")
def cuda_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    torch.manual_seed(0)
    dlrm = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=16, dense_arch=[32], over_arch=[32]))
    export_model(dlrm, ExportConfig(out=str(root / "dlrm" / "1"), dtype="int8", device="cuda", progress=False, validation_batches=1))
    return root


def test_gpu_server_equals_the_cuda_artifact_in_process_and_keeps_rows_apart(cuda_repo):
    model, _ = open_artifact(cuda_repo / "dlrm" / "1")
    server = Server(ServerConfig(model_repo=str(cuda_repo), port=0, device="cuda", max_delay_ms=5))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            for seed, batch in [(1, 1), (2, 7), (3, 256)]:
                sparse, dense = dlrm_request(batch, seed, rows=ROWS)
                got = client.predict("dlrm", sparse, dense)
                want = in_process(model, sparse, dense)
                for k in want:
                    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
            requests = [dlrm_request(1 + i % 6, 100 + i, rows=ROWS) for i in range(48)]
            start = threading.Barrier(len(requests))

            def call(req):
                start.wait()
                return client.predict("dlrm", *req)

            with ThreadPoolExecutor(len(requests)) as pool:
                results = list(pool.map(call, requests))
            for (sparse, dense), got in zip(requests, results):
                np.testing.assert_allclose(got["prob"], in_process(model, sparse, dense)["prob"], rtol=1e-5, atol=1e-6)
    finally:
        server.stop()

