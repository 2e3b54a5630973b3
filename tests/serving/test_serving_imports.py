"""Serving is free of the training side: a server process that loads an artifact and answers a request over gRPC
imports no module of ``recship.trainer`` (the planner, the fused optimizers, the float collections), of
``recship.quantize`` or of ``recship.models``: a server image needs the artifact, torch and fbgemm, not the trainer.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np

from model_requests import dlrm_request, in_process
from recship.export.artifact import open_artifact

SERVER = textwrap.dedent("""
    import json, sys
    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig
    sys.path.insert(0, sys.argv[2])
    from model_requests import dlrm_request
    server = Server(ServerConfig(model_repo=sys.argv[1], port=0, metrics_port=0, max_delay_ms=2))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            sparse, dense = dlrm_request(7, 3)
            answer = {k: v.tolist() for k, v in client.predict("dlrm", sparse, dense).items()}
    finally:
        server.stop()
    training_side = sorted(m for m in sys.modules if m.startswith(("recship.trainer", "recship.quantize", "recship.models")))
    print(json.dumps({"answer": answer, "training_side": training_side}))
""")


def test_a_server_answers_without_importing_the_training_side(small_artifacts, tmp_path):
    artifact = small_artifacts()
    shutil.copytree(artifact, tmp_path / "repo" / "dlrm" / "1")
    tests = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", SERVER, str(tmp_path / "repo"), tests], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["training_side"] == []
    model, _ = open_artifact(artifact)
    want = in_process(model, *dlrm_request(7, 3))
    for key, value in want.items():  # it answered, and as the artifact in process does
        np.testing.assert_array_equal(np.asarray(out["answer"][key], dtype=np.float32), value)
