"""Export of models other than the built-in DLRM: the example two-tower model and multi-task ranker,
exported, self-checked, served over gRPC (Predict and KServe) and run from C++, all answering alike."""

import json
import re
import subprocess

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from recship.export import ExportConfig, ExportError, export_model
from recship.export.artifact import Manifest, open_artifact
from recship.models import TwoTower
from recship.serving import PredictClient
from recship.serving.kserve import message
from recship.serving.server import Server, ServerConfig

from model_requests import ModelInputs, in_process, random_request, request_file


EXAMPLES = {
    "two_tower": ("recship.models:TwoTower", {"num_users": 300, "num_items": 500, "num_countries": 20, "num_categories": 30,
                                              "dim": 16, "num_dense": 4}, ["--dtype", "int8"]),
    "ranker": ("recship.models:MultiTaskRanker", {"num_items": 400, "num_tags": 60, "dim": 8, "num_dense": 5, "hidden": 16},
               ["--dtype", "int4", "--shards", "2", "--sharding", "row_wise", "--table-dtype", "tag_table=int8"]),
    "dlrm": ("recship.models.dlrm:builtin", {"num_embeddings_per_feature": [40 + i for i in range(26)], "embedding_dim": 8,
                                     "dense_arch": [16], "over_arch": [16]}, ["--dtype", "int4"]),
    "mixed": ("recship.models:MixedRanker", {"num_items": 400, "num_tags": 60, "dim": 8, "num_dense": 5, "hidden": 16, "num_countries": 30},
              ["--dtype", "int8"]),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each example (the built-in DLRM through its entry point too) trained by recship train --model for 200 steps
    (the two-tower on 2 gloo ranks), then exported from its checkpoint."""
    from recship.cli import main

    root = tmp_path_factory.mktemp("any-model")
    manifests = {}
    for name, (entry, args, export_flags) in EXAMPLES.items():
        run = root / "runs" / name
        code = main(["train", "--model", entry, "--model-args", json.dumps(args), "--out", str(run), "--steps", "200",
                     "--batch-size", "64", "--eval-every", "0", "--eval-batches", "2", "--checkpoint-every", "0", "--no-progress",
                     "--nproc-per-node", "2" if name == "two_tower" else "1"])
        assert code == 0
        checkpoint = sorted((run / "checkpoints").iterdir())[-1]
        out = root / "repo" / name / "1"
        assert main(["export", str(checkpoint), "--out", str(out), "--model-name", name, "--validation-batch-size", "64", *export_flags]) == 0
        manifests[name] = json.loads((out / "manifest.json").read_text())
    return root, manifests


def test_the_manifests_describe_the_models(exported):
    _, manifests = exported
    tt = manifests["two_tower"]
    assert [(f["name"], f["pooling"], f["table"]) for f in tt["sparse_features"]] == [
        ("user", "SUM", "user_tables.user_ids"), ("country", "SUM", "user_tables.country_ids"), ("history", "NONE", "history.history_items"),
        ("item", "SUM", "item_tables.item_ids"), ("category", "MEAN", "item_tables.category_ids")]
    assert tt["num_dense"] == 4 and not tt["weighted"] and tt["model"]["kind"] == "module"
    assert tt["model"]["entry_point"] == {"model": "recship.models:TwoTower", "args": EXAMPLES["two_tower"][1]}
    assert {k: v["shape"] for k, v in tt["outputs"].items()} == {"score": ["B", 1], "user_embedding": ["B", 16], "item_embedding": ["B", 16]}
    mixed = manifests["mixed"]
    assert mixed["weighted"] and {f["name"]: f["weighted"] for f in mixed["sparse_features"]} == {
        "clicked_items": True, "candidate": True, "followed_tags": True, "country": False, "device_type": False}
    ranker = manifests["ranker"]
    assert ranker["weighted"] and {k: v["shape"] for k, v in ranker["outputs"].items()} == {"click": ["B", 1], "purchase": ["B", 1]}
    assert {f["table"]: f["weight_type"] for f in ranker["sparse_features"]} == {"sparse.item_table": "INT4", "sparse.tag_table": "INT8"}
    assert {s["device"] for s in ranker["sharding"]["shards"]} == {0, 1}
    for m in manifests.values():  # quantization error is small against the float model
        assert m["validation"]["relative_diff_vs_float"] < (0.03 if m is tt else 0.2)
        assert m["validation"]["max_relative_diff_vs_unsharded_quantized"] < 1e-5


def test_served_and_cpp_answers_equal_the_artifact(exported, binary, tmp_path):
    root, manifests = exported
    server = Server(ServerConfig(model_repo=str(root / "repo"), port=0, max_batch_size=1024))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
            kserve = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                         response_deserializer=message("ModelInferResponse").FromString)
            for name, manifest in manifests.items():
                model, _ = open_artifact(root / "repo" / name / "1")
                for batch, seed in [(1, 1), (7, 2), (513, 3)]:
                    sparse, dense, weights = random_request(ModelInputs.of(Manifest.from_dict(manifest)), batch, seed)
                    want = in_process(model, sparse, dense, weights)
                    got = client.predict(name, sparse, dense, weights)
                    assert set(got) == set(want)
                    for k in want:
                        np.testing.assert_array_equal(got[k], want[k])
                    # KServe v2 over gRPC: the same rows
                    request = message("ModelInferRequest")(model_name=name)
                    dense_in = request.inputs.add(name="dense", datatype="FP32", shape=list(dense.shape))
                    dense_in.contents.fp32_contents.extend(dense.reshape(-1).tolist())
                    for f in manifest["sparse_features"]:
                        rows = sparse[f["name"]]
                        request.inputs.add(name=f"{f['name']}.lengths", datatype="INT32", shape=[batch]).contents.int_contents.extend(
                            [len(r) for r in rows])
                        ids = [i for r in rows for i in r]
                        request.inputs.add(name=f"{f['name']}.values", datatype="INT64", shape=[len(ids)]).contents.int64_contents.extend(ids)
                        if weights and f["name"] in weights:
                            w = [x for r in weights[f["name"]] for x in r]
                            request.inputs.add(name=f"{f['name']}.weights", datatype="FP32", shape=[len(w)]).contents.fp32_contents.extend(w)
                    answer = kserve(request.SerializeToString(), timeout=30)
                    for out in answer.outputs:
                        np.testing.assert_array_equal(np.array(out.contents.fp32_contents, dtype=np.float32).reshape(list(out.shape)), want[out.name])
                    # C++: the same request through recship_predict (its limit raised like the server's)
                    path = request_file(tmp_path / f"{name}.json", sparse, dense, weights)
                    result = subprocess.run([str(binary), str(root / "repo" / name / "1"), "--request", str(path),
                                             "--max-batch-size", "1024"], capture_output=True, text=True)
                    assert result.returncode == 0, result.stderr
                    cpp = json.loads(result.stdout)
                    for k in want:
                        np.testing.assert_array_equal(np.asarray(cpp[k], dtype=np.float32).reshape(got[k].shape), got[k])
            # mixed weighting: weights only for weighted features, the same message from the server and from C++
            manifest = manifests["mixed"]
            sparse, dense, weights = random_request(ModelInputs.of(Manifest.from_dict(manifest)), 2, 9)
            for bad, expected in (({**weights, "country": [[0.5] * len(r) for r in sparse["country"]]},
                                  "sparse feature 'country': weights given, but this feature is unweighted"),
                                 ({k: v for k, v in weights.items() if k != "candidate"}, "sparse feature 'candidate': 0 weights for")):
                with pytest.raises(grpc.RpcError) as e:
                    client.predict("mixed", sparse, dense, bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in e.value.details()
                path = request_file(tmp_path / "bad.json", sparse, dense, bad)
                result = subprocess.run([str(binary), str(root / "repo" / "mixed" / "1"), "--request", str(path)], capture_output=True, text=True)
                assert result.returncode != 0 and expected in result.stderr, result.stderr
            channel.close()
    finally:
        server.stop()


class _NoTables(nn.Module):
    num_dense = 2

    def forward(self, dense, features):
        return dense


class _WrongSignature(TwoTower):
    def forward(self, features):
        return super().forward(torch.zeros(1, 4), features)


class _Branchy(TwoTower):
    def forward(self, dense, features):
        out = super().forward(dense, features)
        if out["score"].sum() > 0:  # a Python branch on a tensor value: fx cannot trace it
            return out
        return out


@pytest.mark.parametrize("model,message", [
    (_NoTables(), "holds no EmbeddingBagCollection or EmbeddingCollection"),
    (_WrongSignature(num_users=20, num_items=20, num_countries=5, num_categories=5, dim=8), r"forward\(features\): the model contract is forward\(dense, features\)"),
    (_Branchy(num_users=20, num_items=20, num_countries=5, num_categories=5, dim=8), "_Branchy: fx trace failed: .* \\(at test_any_model.py:[0-9]+: if out\\[\"score\"\\].sum\\(\\) > 0:"),
])
def test_models_outside_the_contract_are_refused_by_name(model, message, tmp_path):
    with pytest.raises(ExportError, match=message):
        export_model(model, ExportConfig(out=str(tmp_path / "a"), progress=False, validation_batches=1, validation_batch_size=8))
    assert not (tmp_path / "a").exists()


def test_the_dense_width_must_be_known(tmp_path):
    model = TwoTower(num_users=20, num_items=20, num_countries=5, num_categories=5, dim=8)
    del model.num_dense
    with pytest.raises(ExportError, match="the dense width is unknown"):
        export_model(model, ExportConfig(out=str(tmp_path / "a"), progress=False))
    manifest = export_model(model, ExportConfig(out=str(tmp_path / "a"), progress=False, num_dense=4, validation_batches=1, validation_batch_size=8))
    assert manifest["num_dense"] == 4


@pytest.mark.parametrize("argv,message", [
    (["--model", "no_such_package.models:Model"], "cannot import no_such_package.models: ModuleNotFoundError"),
    (["--model", "recship.models:Nope"], "recship.models has no Nope"),
    (["--model", "recship.models:TwoTower", "--model-args", '{"nope": 1}'], "the factory raised TypeError"),
    (["--model", "torch.nn:Linear", "--model-args", '{"in_features": 2, "out_features": 2}'], r"forward\(input\): the model contract"),
    (["--model", "recship.models"], "must look like package.module:factory"),
])
def test_train_refuses_a_model_it_cannot_build_in_one_line(tmp_path, capsys, argv, message):
    from recship.cli import main

    assert main(["train", "--out", str(tmp_path / "x"), "--steps", "1", "--no-progress", *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(message, lines[0]), lines
    assert not (tmp_path / "x").exists()


def test_model_args_must_be_a_json_object(tmp_path, capsys):
    from recship.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path / "x"), "--model", "recship.models:TwoTower", "--model-args", "[1]"])
    assert e.value.code == 2 and "a JSON object is needed" in capsys.readouterr().err


def test_validation_is_drawn_like_the_training_data_or_from_eval_data(exported, tmp_path):
    from recship.cli import main

    root, manifests = exported
    for name, manifest in manifests.items():  # no --eval-data: synthetic batches with the training run's labelling model
        v = manifest["validation"]
        assert v["data"] == "synthetic, as the training run's (seed 0)"
        assert v["output"] == {"two_tower": "score", "dlrm": "logit"}.get(name, "click")
        assert abs(v["auc"] - v["float_auc"]) < 0.02 and v["float_auc"] > 0.6, v
    checkpoint = sorted((root / "runs" / "two_tower" / "checkpoints").iterdir())[-1]
    out = tmp_path / "a"
    assert main(["export", str(checkpoint), "--out", str(out), "--validation-batch-size", "32", "--eval-data", "eval_data_helper:two_tower_batches"]) == 0
    v = json.loads((out / "manifest.json").read_text())["validation"]
    assert v["data"] == "eval_data_helper:two_tower_batches" and v["batches"] == 3 and 0 <= v["auc"] <= 1
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "b"), "--eval-data", "no_such_file.tsv"]) == 2
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "b"), "--eval-data", str(out / "manifest.json")]) == 2  # not Criteo-shaped


def test_train_a_model_on_a_data_function(tmp_path, capsys):
    from recship.cli import main

    entry, args, _ = EXAMPLES["two_tower"]
    common = ["train", "--model", entry, "--model-args", json.dumps(args), "--steps", "6", "--batch-size", "16",
              "--eval-every", "0", "--eval-batches", "2", "--checkpoint-every", "0", "--no-progress"]
    assert main(common + ["--out", str(tmp_path / "a"), "--data", "eval_data_helper:two_tower_batches",
                          "--eval-data", "eval_data_helper:two_tower_batches"]) == 0
    out = capsys.readouterr().out
    assert "trained 6 steps (steps 1-6)" in out and "AUC" in out  # 3 batches a pass: the function is called again
    # a data function whose batches do not fit the model is one line, exit 2
    assert main(common + ["--out", str(tmp_path / "b"), "--data", "eval_data_helper:wrong_features"]) == 2
    assert "batches must have the model's features" in capsys.readouterr().err
    # a TSV file feeds the built-in DLRM only
    (tmp_path / "d.tsv").write_text("1\t" * 39 + "1\n")
    assert main(common + ["--out", str(tmp_path / "c"), "--data", str(tmp_path / "d.tsv")]) == 2
    assert "Criteo TSV files feed the built-in DLRM only" in capsys.readouterr().err


def test_streamed_export_equals_the_in_memory_one(exported, tmp_path):
    """From a checkpoint the float tables stream one at a time and the float outputs are replayed from recorded
    lookups; the same model loaded whole and exported from memory must give the same figures and artifact."""
    from recship.trainer.checkpoint_reader import CheckpointReader

    root, _ = exported
    entry, args, _ = EXAMPLES["two_tower"]
    checkpoint = sorted((root / "runs" / "two_tower" / "checkpoints").iterdir())[-1]
    reader = CheckpointReader(checkpoint)
    whole = TwoTower(**args)
    with torch.no_grad():
        for mpath, cfg, weight in reader.tables():
            whole.get_submodule(mpath).embedding_bags[cfg.name].weight.copy_(weight)
    whole.load_state_dict(reader.dense_state_dict(), strict=False)
    config = dict(progress=False, validation_batch_size=32, eval_data="eval_data_helper:two_tower_batches")
    streamed = export_model(checkpoint, ExportConfig(out=str(tmp_path / "streamed"), **config))
    in_memory = export_model(whole, ExportConfig(out=str(tmp_path / "memory"), **config))
    a, b = streamed["validation"], in_memory["validation"]
    for k in a["max_abs_diff_vs_float"]:
        assert a["max_abs_diff_vs_float"][k] == pytest.approx(b["max_abs_diff_vs_float"][k], rel=1e-5, abs=1e-7)
    assert a["float_auc"] == b["float_auc"] and a["auc"] == b["auc"]
    m1, _ = open_artifact(tmp_path / "streamed")
    m2, _ = open_artifact(tmp_path / "memory")
    sparse, dense, _ = random_request(ModelInputs.of(Manifest.from_dict(streamed)), 9, 4)
    want = in_process(m2, sparse, dense)
    for k, v in in_process(m1, sparse, dense).items():
        np.testing.assert_array_equal(v, want[k])
