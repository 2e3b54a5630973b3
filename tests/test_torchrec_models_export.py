"""TorchRec's DLRM and DLRM_DCN (recship.models.dlrm) follow recship's model contract: exported (fp32 tables) they
answer as the model does in process, and ``recship train --model`` / ``recship export`` take a factory returning
one."""

import json

import numpy as np
import pytest
import torch

from model_requests import in_process
from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.models.dlrm import DLRM, DLRM_DCN
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

FEATURES = ["cat_0", "cat_1", "cat_2"]


def _tables(device=None):
    return EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=30 + i, embedding_dim=8, feature_names=[f])
                                   for i, f in enumerate(FEATURES)], device=device)


def dcn(device=None):
    """The factory `recship train --model test_torchrec_models_export:dcn` calls."""
    return DLRM_DCN(_tables(device), dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1],
                    dcn_num_layers=2, dcn_low_rank_dim=4)


def _request(seed, batch=7):
    g = np.random.default_rng(seed)
    sparse = {f: [g.integers(0, 30, size=g.integers(0, 4)).tolist() for _ in range(batch)] for f in FEATURES}
    return sparse, g.random((batch, 4), dtype=np.float32)


@pytest.mark.parametrize("kind", ["DLRM", "DLRM_DCN"])
def test_exported_answers_as_in_process(tmp_path, kind):
    torch.manual_seed(1)
    model = dcn() if kind == "DLRM_DCN" else DLRM(_tables(), 4, [16, 8], [8, 1])
    export_model(model, ExportConfig(out=str(tmp_path / "a"), dtype="fp32", progress=False, validation_batches=1,
                                     validation_batch_size=16, format="torchscript"))
    artifact, _ = open_artifact(tmp_path / "a")
    for seed in range(3):
        sparse, dense = _request(seed)
        got = in_process(artifact, sparse, dense, names=FEATURES)["output"]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.tensor([i for f in FEATURES for r in sparse[f] for i in r], dtype=torch.int64),
            lengths=torch.tensor([len(r) for f in FEATURES for r in sparse[f]]))
        with torch.no_grad():
            expected = model(torch.from_numpy(dense), kjt).numpy()
        assert got.shape == (7, 1)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_recship_train_and_export_a_torchrec_dlrm_dcn(tmp_path, monkeypatch):
    from recship.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "test_torchrec_models_export:dcn", "--out", "run", "--steps", "20", "--batch-size", "32",
                 "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress"]) == 0
    checkpoint = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    assert main(["export", str(checkpoint), "--out", "art", "--dtype", "fp32", "--validation-batch-size", "16",
                 "--format", "torchscript", "--no-plot"]) == 0
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["model"]["class"] == "recship.models.dlrm.DLRM_DCN" and manifest["num_dense"] == 4
    assert [(f["name"], f["table"]) for f in manifest["sparse_features"]] == [
        (f, f"sparse_arch.embedding_bag_collection.t{i}") for i, f in enumerate(FEATURES)]
    assert manifest["validation"]["relative_diff_vs_float"] == 0.0
