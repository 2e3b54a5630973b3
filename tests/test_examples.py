"""The docs' example files run as documented and answer correctly: examples/my_model.py (docs/models.md),
examples/sharded_training.py (docs/training.md, "Sharded training"), examples/request.json and predict_request.json
(docs/serving.md)."""

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recship.export.artifact import open_artifact

from model_requests import in_process, model_repo

ROOT = Path(__file__).resolve().parents[1]


def test_the_example_trains_exports_and_serves_from_the_repository_root(tmp_path):
    result = subprocess.run([sys.executable, "examples/my_model.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    model, m = open_artifact(tmp_path / "repo" / "my_model" / "1")
    manifest = m.to_dict()
    assert [f["name"] for f in manifest["sparse_features"]] == ["video", "channel"]
    assert manifest["model"]["entry_point"] == {"model": "examples.my_model:build", "args": {"videos": 500, "channels": 50}}
    with torch.no_grad():  # the request the example sends: video [3, 17], channel [5], dense [2, 0, 7]
        want = model(torch.tensor([[2.0, 0.0, 7.0]]), torch.tensor([2, 1], dtype=torch.int32), torch.tensor([3, 17, 5]), None)
    np.testing.assert_array_equal(np.array(answer["output"], dtype=np.float32), want["output"].numpy())


# -- examples/sharded_training.py: docs/training.md's "Sharded training" section ----------------------------------


def _sharded_training_module():
    spec = importlib.util.spec_from_file_location("sharded_training", ROOT / "examples" / "sharded_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_forward(tables, over, dense, lengths, ids):
    """Plain torch: per feature a sum-pooled torch embedding_bag over the whole table, then the MLP; logit [B]."""
    pooled = []
    for f, weight in enumerate(tables):
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths[f], 0)[:-1]])
        pooled.append(torch.nn.functional.embedding_bag(ids[f], weight, offsets, mode="sum"))
    return over(torch.cat(pooled + [dense], dim=1)).squeeze(1)


def _run_group(command, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` that leaves nothing behind on timeout: SIGTERM first (torchrun then stops its ranks, each
    in a session of its own), then SIGKILL to the whole process group. A rank hung at exit would otherwise stay
    behind, spinning gloo threads."""
    p = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, command))} did not finish in {timeout:g} s; its stderr ends:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, p.returncode, out, err)


@pytest.mark.parametrize("nproc", [2, 1])
def test_sharded_training_example_trains_like_plain_torch_on_the_whole_batch(tmp_path, nproc):
    """The script on `nproc` gloo ranks (torchrun) against a single-process plain-torch replay of the same run: from
    its step-0 checkpoint, the global batches, row-wise adagrad per column block for the tables, torch Adagrad for
    the MLP. The per-step losses, the held-out loss and the final checkpoint's weights must all agree."""
    from recship.trainer.checkpoint_reader import CheckpointReader

    steps, batch, lr, seed = 6, 32, 0.05, 3
    args = ["examples/sharded_training.py", "--out", str(tmp_path), "--steps", str(steps), "--batch-size", str(batch),
            "--lr", str(lr), "--seed", str(seed)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
    result = _run_group(launch + args, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == nproc and len(summary["losses"]) == steps
    assert [Path(p).name for p in summary["checkpoints"]] == ["step_00000000", f"step_{steps:08d}"]
    if nproc == 2:  # the plan put every table on more than one rank or on one rank alone, as the constraints say
        plan = CheckpointReader(summary["checkpoints"][-1]).plan.get_plan_for_module("sparse")
        assert [(t, p.sharding_type.value, p.ranks) for t, p in plan.items()] == [
            ("user_table", "row_wise", [0, 1]), ("item_table", "column_wise", [0, 1]), ("category_table", "table_wise", [0])]

    example = _sharded_training_module()
    start, end = CheckpointReader(summary["checkpoints"][0]), CheckpointReader(summary["checkpoints"][-1])
    names = [f"{f}_table" for f in example.FEATURES]
    tables = [start.table("sparse", t).clone().requires_grad_() for t in names]
    blocks = [end.meta["tables"][f"sparse/{t}"]["column_blocks"] + [tables[i].shape[1]] for i, t in enumerate(names)]
    state = [torch.zeros(w.shape[0], len(b) - 1) for w, b in zip(tables, blocks)]  # row-wise adagrad: one per row and column block
    dim = tables[0].shape[1]
    over = torch.nn.Sequential(torch.nn.Linear(3 * dim + example.NUM_DENSE, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    over.load_state_dict({k[len("over."):]: v for k, v in start.dense_state_dict().items() if k.startswith("over.")})
    dense_opt = torch.optim.Adagrad(over.parameters(), lr=lr)
    losses = []
    for step in range(1, steps + 1):
        dense, lengths, ids, labels = example.global_batch(step, batch, seed)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(_reference_forward(tables, over, dense, lengths, ids), labels)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        with torch.no_grad():
            for w, s, b in zip(tables, state, blocks):
                for j, (c0, c1) in enumerate(zip(b[:-1], b[1:])):
                    g = w.grad[:, c0:c1]
                    s[:, j] += (g * g).mean(dim=1)
                    w[:, c0:c1] -= lr * g / (s[:, j : j + 1].sqrt() + 1e-8)
                w.grad = None
        losses.append(loss.item())
    np.testing.assert_allclose(summary["losses"], losses, rtol=0, atol=2e-5)
    for i, t in enumerate(names):
        torch.testing.assert_close(end.table("sparse", t), tables[i].detach(), rtol=0, atol=2e-5)
    trained = end.dense_state_dict()
    for k, v in over.state_dict().items():
        torch.testing.assert_close(trained[f"over.{k}"], v, rtol=0, atol=2e-5)
    with torch.no_grad():
        dense, lengths, ids, labels = example.global_batch(-1, batch, seed)
        eval_loss = torch.nn.functional.binary_cross_entropy_with_logits(_reference_forward(tables, over, dense, lengths, ids), labels)
    assert summary["eval_loss"] == pytest.approx(eval_loss.item(), abs=2e-5)
    assert sum(losses[-2:]) / 2 < losses[0] - 0.01  # it learns


# -- examples/request.json (KServe v2 REST) and examples/predict_request.json (recship predict) -----------------------


def test_example_requests_fit_the_demo_model_and_both_fronts_answer_them_as_the_model_does(tmp_path, small_artifact, capsys):
    """The two request files hold the same 2 examples for the model `make demo` serves (the default DLRM: cat_0..cat_25,
    13 dense). The small test DLRM has the same inputs with 20+ rows per table, so it serves them here: the REST
    answer to the file as curl sends it, and `recship predict --request`'s, equal the artifact run in-process."""
    import urllib.request

    from recship.cli import main as recship
    from recship.export.artifact import open_artifact
    from recship.serving.server import Server, ServerConfig
    from recship.trainer.train import TrainConfig

    rest_text = (ROOT / "examples" / "request.json").read_text()
    rest, predict = json.loads(rest_text), json.loads((ROOT / "examples" / "predict_request.json").read_text())
    from recship.models.dlrm import DLRMConfig

    demo = DLRMConfig(**TrainConfig().entry_point()[1])  # recship demo trains TrainConfig's default DLRM and serves it as "dlrm"
    inputs = {t["name"]: t for t in rest["inputs"]}
    batch = len(predict["dense"])
    assert list(predict["sparse"]) == demo.sparse_feature_names
    assert sorted(inputs) == sorted([f"{f}.{part}" for f in demo.sparse_feature_names for part in ("lengths", "values")] + ["dense"])
    assert inputs["dense"]["datatype"] == "FP32" and inputs["dense"]["shape"] == [batch, demo.num_dense]
    assert inputs["dense"]["data"] == predict["dense"]
    for f, rows, table in zip(demo.sparse_feature_names, (predict["sparse"][f] for f in demo.sparse_feature_names), demo.num_embeddings_per_feature):
        lengths, values = inputs[f"{f}.lengths"], inputs[f"{f}.values"]
        assert (lengths["datatype"], lengths["shape"], lengths["data"]) == ("INT32", [batch], [len(r) for r in rows]), f
        assert (values["datatype"], values["shape"], values["data"]) == ("INT64", [sum(map(len, rows))], [i for r in rows for i in r]), f
        assert all(0 <= i < min(table, 20) for r in rows for i in r), f  # inside the demo's tables and the small DLRM's

    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    model, manifest = open_artifact(repo / "dlrm" / "1")
    assert manifest.feature_names == demo.sparse_feature_names and manifest.num_dense == demo.num_dense
    want = in_process(model, predict["sparse"], predict["dense"], names=manifest.feature_names)
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0))
    try:
        post = urllib.request.Request(f"http://127.0.0.1:{server.rest.port}/v2/models/dlrm/infer", data=rest_text.encode(),
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=30) as r:
            answer = json.loads(r.read())
        capsys.readouterr()
        assert recship(["predict", "--target", f"127.0.0.1:{server.port}", "--model-name", "dlrm",
                        "--request", str(ROOT / "examples" / "predict_request.json")]) == 0
        predicted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        server.stop()
    assert answer["id"] == rest["id"] and sorted(o["name"] for o in answer["outputs"]) == sorted(want) == ["logit", "prob"]
    for out in answer["outputs"]:
        np.testing.assert_array_equal(np.asarray(out["data"], dtype=np.float32).reshape(out["shape"]), want[out["name"]])
        np.testing.assert_array_equal(np.asarray(predicted[out["name"]], dtype=np.float32), want[out["name"]])


# -- examples/esmm.py: docs/models.md's multi-task example (labels [B, 2]) -----------------------------------------


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a positive outscores a negative (ties count half), pair by pair."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg)))


def test_the_esmm_example_trains_both_tasks_resumes_exports_on_its_data_and_serves(tmp_path, monkeypatch):
    """examples/esmm.py as docs/models.md runs it: trained on labels [B, 2] with each task's AUC reported (equal to a plain
    replay of the checkpoint on the eval data), resumed without its data flags (the checkpoint's data and batch size
    are used), exported (validated on the run's own eval data function) and served; the Python front answers as the
    artifact does in process, bitwise, for the example's request and a batch of 5."""
    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig
    from recship.trainer.checkpoint_reader import CheckpointReader

    result = subprocess.run([sys.executable, "examples/esmm.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    resumed_line = next(line for line in lines if line.startswith("--resume from step_00000060: "))
    assert "data examples.esmm:data, eval data examples.esmm:eval_data, batch size 64" in resumed_line
    assert any(line.startswith("trained 20 steps (steps 61-80) on 1 rank(s) of examples.esmm:data at batch 64: ") for line in lines)
    summary = json.loads((tmp_path / "run" / "summary_rank0.json").read_text())
    assert summary["steps"] == 80 and summary["data"] == "examples.esmm:data" and summary["batch_size"] == 64
    tasks = summary["final_eval"]["tasks"]
    assert sorted(tasks) == ["ctcvr", "ctr"] and summary["final_eval"]["auc"] == tasks["ctr"]["auc"]

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    from examples import esmm

    reader = CheckpointReader(summary["checkpoint"])
    state = reader.dense_state_dict()
    for mpath, cfg, weight in reader.tables():
        state[f"{mpath}.embedding_bags.{cfg.name}.weight"] = weight.clone()
    model = esmm.build()
    model.load_state_dict(state)
    model.eval()
    batches = list(esmm.eval_data(64))[:8]  # --eval-batches 8 (the default) of the recorded batch size
    with torch.no_grad():
        outputs = [model(d, k) for d, k, _ in batches]
    labels = torch.cat([l for _, _, l in batches]).numpy()
    for task, column in esmm.ESMM.eval_outputs.items():
        scores = torch.cat([o[task].reshape(-1) for o in outputs]).numpy()
        assert tasks[task]["auc"] == pytest.approx(_auc(scores, labels[:, column]), abs=1e-6), task
        assert tasks[task]["auc"] > 0.6, task  # both tasks learn the hidden model's signal

    artifact = tmp_path / "repo" / "esmm" / "1"
    artifact_model, manifest = open_artifact(artifact)
    validation = manifest.to_dict()["validation"]
    assert validation["data"] == "examples.esmm:eval_data" and validation["output"] == "ctr"  # the run's own eval data
    assert abs(validation["auc"] - validation["float_auc"]) < 0.01
    answer = json.loads(lines[-1])
    request = {"user": [[7]], "item": [[42]], "category": [[3]], "history": [[42, 17, 260]]}
    want = in_process(artifact_model, request, [[0.5, 0.25]], names=manifest.feature_names)
    for name in ("ctr", "cvr", "ctcvr"):
        np.testing.assert_array_equal(np.asarray(answer[name], dtype=np.float32), want[name])
    g = torch.Generator().manual_seed(3)
    batch = {"user": [[int(torch.randint(0, 200, (1,), generator=g))] for _ in range(5)],
             "item": [[int(torch.randint(0, 500, (1,), generator=g))] for _ in range(5)],
             "category": [[int(torch.randint(0, 20, (1,), generator=g))] for _ in range(5)],
             "history": [torch.randint(0, 500, (n,), generator=g).tolist() for n in (0, 1, 3, 5, 2)]}
    dense = torch.rand(5, 2, generator=g).numpy()
    want = in_process(artifact_model, batch, dense, names=manifest.feature_names)
    server = Server(ServerConfig(model_repo=str(tmp_path / "repo"), port=0))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            got = client.predict("esmm", batch, dense=dense.tolist())
    finally:
        server.stop()
    assert sorted(got) == ["ctcvr", "ctr", "cvr"]
    for name, value in got.items():
        np.testing.assert_array_equal(np.asarray(value, dtype=np.float32), want[name])
