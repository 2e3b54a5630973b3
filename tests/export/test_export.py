"""Export: artifact contents, loading without recship, sharding, dynamic batch, validation, CLI errors."""

import subprocess
import sys
import textwrap

import pytest
import torch

from recship.export import ExportConfig, ExportError, export_model
from recship.export.artifact import ArtifactError, Manifest, open_artifact
from recship.quantize import dequantize_rows, quantize_rows
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.data import SyntheticConfig, SyntheticCriteo
from recship.models.dlrm import BuiltinDLRM, DLRMConfig
from recship.trainer.train import TrainConfig, launch

ROWS = [30 + 3 * i for i in range(26)]  # uneven table sizes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    summary = launch(TrainConfig(out=str(out), steps=20, batch_size=64, num_embeddings_per_feature=ROWS, embedding_dim=8,
                                 dense_arch=[16], over_arch=[16], eval_every=0, eval_batches=1, checkpoint_every=0, progress=False))
    return summary["checkpoint"]


def _config(tmp_path, name, **kw):
    base = dict(out=str(tmp_path / name), progress=False, validation_batch_size=64, validation_batches=2)
    base.update(kw)
    return ExportConfig(**base)


def _dlrm(seed=0):
    torch.manual_seed(seed)
    model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=ROWS, embedding_dim=8, dense_arch=[16], over_arch=[16]))
    with torch.no_grad():
        for t in model.sparse_arch.embedding_bag_collection.embedding_bag_configs():
            model.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight.normal_(0, 0.1)
    return model


def _reference(model, dtype):
    """The same DLRM with every table replaced by its quantize-then-dequantize values (plain torch)."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for t in ref.sparse_arch.embedding_bag_collection.embedding_bag_configs():
            w = ref.sparse_arch.embedding_bag_collection.embedding_bags[t.name].weight
            w.copy_(dequantize_rows(quantize_rows(w, dtype, True), dtype, w.shape[1]))
    return ref


def _run(model, batch):
    return model(batch.dense, batch.sparse.lengths().to(torch.int32), batch.sparse.values(), None)


@pytest.mark.parametrize("shards, sharding", [(1, None), (2, "table_wise"), (3, "row_wise"), (2, "row_wise")])
def test_sharded_artifact_equals_the_dequantized_model_at_any_batch_size(tmp_path, shards, sharding):
    model = _dlrm()
    export_model(model, _config(tmp_path, "a", dtype="int8", shards=shards, sharding=sharding))
    scripted, manifest = open_artifact(tmp_path / "a")
    assert manifest.sharding.num_devices == shards
    ref = _reference(model, DataType.INT8)
    gen = SyntheticCriteo(SyntheticConfig(ROWS, batch_size=1, seed=5))
    for batch_size in (1, 7, 512):
        gen.config.batch_size = batch_size
        b = gen.batch(0)
        got = _run(scripted, b)
        want = ref(b.dense, b.sparse).unsqueeze(1)
        assert got["logit"].shape == (batch_size, 1)
        torch.testing.assert_close(got["logit"], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["prob"], torch.sigmoid(want), atol=1e-6, rtol=1e-5)


def test_column_wise_artifact_stays_within_quantization_error(tmp_path):
    model = _dlrm()
    export_model(model, _config(tmp_path, "cw", dtype="int8", shards=2, sharding="column_wise"))
    scripted, manifest = open_artifact(tmp_path / "cw")
    # the unsharded reference quantizes the same column blocks, so they agree to rounding
    assert manifest.validation["max_relative_diff_vs_unsharded_quantized"] < 1e-5
    assert {s.cols for s in manifest.sharding.shards} == {4}
    b = SyntheticCriteo(SyntheticConfig(ROWS, batch_size=64, seed=5)).batch(0)
    got = _run(scripted, b)["prob"][:, 0]
    assert float((got - torch.sigmoid(model(b.dense, b.sparse))).abs().max()) < 0.02


def test_artifact_from_checkpoint_loads_without_recship(tmp_path, checkpoint):
    export_model(checkpoint, _config(tmp_path, "art", dtype="int4", table_dtypes={"t_cat_0": "fp16"}))
    art = tmp_path / "art"
    assert sorted(p.name for p in art.iterdir()) == ["manifest.json", "model.pt", "sample", "tables.bin"]
    manifest = Manifest.read(art)
    assert manifest.feature_names == [f"cat_{i}" for i in range(26)]
    assert [f.weight_type for f in manifest.sparse_features][:2] == ["FP16", "INT4"]
    assert manifest.num_dense == 13 and set(manifest.outputs) == {"logit", "prob"}
    assert manifest.validation["auc"] == pytest.approx(manifest.validation["float_auc"], abs=0.05)
    assert manifest.validation["max_relative_diff_vs_unsharded_quantized"] < 1e-5
    assert not any(p.name.startswith(".art.tmp") for p in tmp_path.iterdir())
    code = textwrap.dedent(
        f"""
        import json, sys, numpy as np, torch, fbgemm_gpu
        art = {str(art)!r}
        m = torch.jit.load(art + "/model.pt")
        man = json.load(open(art + "/manifest.json"))
        try:  # without its tables, model.pt refuses to run (it must not crash)
            m(torch.zeros(1, 13), torch.zeros(26, dtype=torch.int32), torch.zeros(0, dtype=torch.int64), None)
            raise SystemExit("ran without tables")
        except torch.jit.Error as e:
            assert "tables.bin" in str(e), e
        # docs/export.md's recipe: map tables.bin, fill each empty buffer the manifest names
        t = man["tables"]
        data = torch.from_file(art + "/" + t["file"], shared=False, size=t["bytes"], dtype=torch.uint8)
        for spec in t["tensors"]:
            if spec["torchscript"]:
                *path, leaf = spec["torchscript"].split(".")
                owner = m
                for p in path:
                    owner = getattr(owner, p)
                raw = data[spec["offset"]: spec["offset"] + spec["bytes"]].view(getattr(torch, spec["dtype"]))
                setattr(owner, leaf, raw.as_strided(spec["shape"], spec["stride"]))
        def read(spec):
            return torch.from_numpy(np.fromfile(art + "/" + spec["file"], dtype="<" + {{"float32": "f4", "int32": "i4", "int64": "i8"}}[spec["dtype"]]).reshape(spec["shape"]))
        ins = {{k: read(v) for k, v in man["sample"]["inputs"].items()}}
        outs = m(ins["dense"], ins["lengths"], ins["values"], ins.get("weights"))
        for k, v in man["sample"]["outputs"].items():
            assert torch.equal(outs[k], read(v)), k
        assert not any(name.startswith("recship") for name in sys.modules)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_embedding_only_weighted_mean_model(tmp_path):
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=50, embedding_dim=16, feature_names=["x", "y"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="b", num_embeddings=20, embedding_dim=8, feature_names=["z"]),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    export_model(ebc, _config(tmp_path, "emb", dtype="fp16", shards=2, sharding="row_wise", id_policy={"z": "modulo"}))
    scripted, manifest = open_artifact(tmp_path / "emb")
    assert set(manifest.outputs) == {"x", "y", "z"} and manifest.weighted
    assert [f.id_policy for f in manifest.sparse_features] == ["reject", "reject", "modulo"]
    kjt = KeyedJaggedTensor(keys=["x", "y", "z"], values=torch.tensor([1, 49, 7, 0, 3, 25]), lengths=torch.tensor([2, 0, 1, 1, 1, 1]), weights=torch.rand(6))
    got = scripted(torch.zeros(2, 0), kjt.lengths().to(torch.int32), kjt.values(), kjt.weights())
    hashed = KeyedJaggedTensor(keys=["x", "y", "z"], values=torch.tensor([1, 49, 7, 0, 3, 5]), lengths=kjt.lengths(), weights=kjt.weights())
    ref = EmbeddingBagCollection(tables, is_weighted=True)
    ref.load_state_dict({k: v.half().float() for k, v in ebc.state_dict().items()})
    want = ref(hashed).to_dict()
    for k in ("x", "y", "z"):
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
    bad = KeyedJaggedTensor(keys=["x", "y", "z"], values=torch.tensor([50]), lengths=torch.tensor([1, 0, 0, 0, 0, 0]))
    with pytest.raises(torch.jit.Error, match="feature 'x': id 50 is out of range \\[0, 50\\)"):
        scripted(torch.zeros(2, 0), bad.lengths().to(torch.int32), bad.values(), torch.ones(1))


def test_error_budget_fails_the_export_and_leaves_nothing(tmp_path):
    with pytest.raises(ExportError, match="over the error budget"):
        export_model(_dlrm(), _config(tmp_path, "tight", dtype="int2", error_budget=1e-6))
    assert list(tmp_path.iterdir()) == []


def test_tampered_or_missing_artifact_is_reported(tmp_path):
    export_model(_dlrm(), _config(tmp_path, "t", dtype="int8"))
    model = tmp_path / "t" / "model.pt"
    model.write_bytes(model.read_bytes() + b"x")
    with pytest.raises(ArtifactError, match="sha256 .* does not match"):
        open_artifact(tmp_path / "t")
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        Manifest.read(tmp_path / "nothing")


def test_cli_export_inspect_and_bad_inputs(tmp_path, checkpoint, capsys):
    from recship.cli import main

    out = str(tmp_path / "cli")
    assert main(["export", checkpoint, "--out", out, "--dtype", "int8", "--shards", "2"]) == 0
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "sample self-check: ok" in text and "checksum: ok" in text and "cat_25" in text
    cases = [
        (["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")], "checkpoint not found"),
        (["export", checkpoint, "--out", str(tmp_path / "x"), "--table-dtype", "nope=int4"], "names tables the model does not have: ['nope']"),
        (["export", checkpoint, "--out", str(tmp_path / "x"), "--dtype", "int3"], "unknown data type 'int3'"),
        (["export", checkpoint, "--out", out], "already exists"),
        (["inspect", str(tmp_path / "x")], "manifest.json is missing"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"recship {argv[0]}: error:") and message in err


def test_synthetic_validation_follows_the_training_runs_seed(tmp_path):
    """A model trained with --seed 5 is validated on seed 5's data, not seed 0's (AUC near the training eval's)."""
    summary = launch(TrainConfig(out=str(tmp_path / "run"), steps=60, batch_size=128, num_embeddings_per_feature=ROWS, embedding_dim=8,
                                 dense_arch=[16], over_arch=[16], eval_every=0, eval_batches=4, checkpoint_every=0, progress=False, seed=5))
    export_model(summary["checkpoint"], _config(tmp_path, "a", validation_batch_size=256, validation_batches=4))
    v = Manifest.read(tmp_path / "a").validation
    assert v["data"] == "synthetic, as the training run's (seed 5)"
    # seed 0's labels would give an AUC near 0.5 (what the manifest said before); the two eval streams differ, so 0.1
    assert abs(v["float_auc"] - summary["final_eval"]["auc"]) < 0.1 and v["float_auc"] > 0.65, (v, summary["final_eval"])


def test_eval_data_from_a_criteo_file(checkpoint, tmp_path):
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(300):
        dense = [str(int(torch.randint(0, 1000, (1,), generator=g))) for _ in range(13)]
        cats = ["%08x" % int(torch.randint(0, 2**31, (1,), generator=g)) for _ in range(26)]
        lines.append("\t".join([str(int(torch.randint(0, 2, (1,), generator=g)))] + dense + cats))
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    export_model(checkpoint, _config(tmp_path, "a", eval_data=str(data), validation_batch_size=100, validation_batches=5))
    v = Manifest.read(tmp_path / "a").validation
    assert v["data"] == str(data) and v["batches"] == 3  # 300 lines in batches of 100
    assert 0 <= v["auc"] <= 1 and abs(v["auc"] - v["float_auc"]) < 0.05
    with pytest.raises(ExportError, match="no such file"):
        export_model(checkpoint, _config(tmp_path, "b", eval_data=str(tmp_path / "missing.tsv")))
