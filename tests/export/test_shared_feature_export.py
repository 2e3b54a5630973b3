"""A model whose collections look one feature up in several tables (TorchRec's shared features) goes export -> serve.

SharedRanker's EmbeddingBagCollection feeds ``user`` to t_user_sum (SUM, 10 rows) and t_user_mean (MEAN, 6 rows);
its EmbeddingCollection feeds ``seq`` to s_long (12 rows) and s_short (7 rows), each sequence mean-pooled. The
manifest lists each request feature once, with the table of fewest rows (its ids must lie inside every table it
feeds); the artifact in process equals a plain-PyTorch reference of the float model (each table pooling the
feature on its own), refuses an id at the smaller table's bound, and both fronts and recship_predict answer as it
does, bitwise. Inference sharding over 2 devices answers as one; a shared feature with the id policy 'modulo'
(id % rows, which differs per table) is refused.
"""

import numpy as np
import pytest
import torch
from torch import nn

from model_requests import ModelInputs, assert_served_as_in_process, in_process, random_request
from recship.export import ExportConfig, ExportError, export_model
from recship.export.artifact import open_artifact
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType

BAGS = [EmbeddingBagConfig(name="t_user_sum", embedding_dim=4, num_embeddings=10, feature_names=["user", "item"]),
        EmbeddingBagConfig(name="t_user_mean", embedding_dim=8, num_embeddings=6, feature_names=["user"], pooling=PoolingType.MEAN)]
SEQS = [EmbeddingConfig(name="s_long", embedding_dim=4, num_embeddings=12, feature_names=["seq"]),
        EmbeddingConfig(name="s_short", embedding_dim=4, num_embeddings=7, feature_names=["seq"])]


def _mean_rows(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    example = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long())
    summed = torch.zeros(lengths.numel(), rows.shape[1]).index_add(0, example, rows)
    return summed / lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)


torch.fx.wrap("_mean_rows")  # one call in the traced graph: its sizes are data


class SharedRanker(nn.Module):
    """[B, 1] logits of dense [B, 2], the pooled user / item lookups and the mean of each sequence table's rows."""

    num_dense = 2

    def __init__(self) -> None:
        super().__init__()
        self.bags = EmbeddingBagCollection(BAGS)
        self.seqs = EmbeddingCollection(SEQS)
        self.over = nn.Linear(2 + 16 + 8, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.bags(features).values()
        rows = self.seqs(features)
        seqs = [_mean_rows(rows[name].values(), rows[name].lengths()) for name in ("seq@s_long", "seq@s_short")]
        return self.over(torch.cat([dense, pooled, *seqs], dim=1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = SharedRanker().eval()
    out = tmp_path_factory.mktemp("shared") / "artifact"
    export_model(model, ExportConfig(out=str(out), model_name="shared", dtype="fp32", progress=False, validation_batches=1,
                                     validation_batch_size=16, format="torchscript"))
    return out, model


def _reference(model: SharedRanker, sparse, dense) -> np.ndarray:
    """The float model in plain PyTorch: every table pools (or gathers) its features' ids on its own."""
    weights = {**{n: b.weight.detach() for n, b in model.bags.embedding_bags.items()},
               **{n: e.weight.detach() for n, e in model.seqs.embeddings.items()}}

    def pooled(table: str, bags, mean: bool = False) -> torch.Tensor:
        return torch.stack([weights[table][list(bag)].sum(0) / (max(len(bag), 1) if mean else 1) if bag
                            else torch.zeros(weights[table].shape[1]) for bag in bags])

    x = torch.cat([torch.as_tensor(np.asarray(dense, dtype=np.float32)),
                   pooled("t_user_sum", sparse["user"]), pooled("t_user_sum", sparse["item"]),
                   pooled("t_user_mean", sparse["user"], mean=True),
                   pooled("s_long", sparse["seq"], mean=True), pooled("s_short", sparse["seq"], mean=True)], dim=1)
    with torch.no_grad():
        return model.over(x).numpy()


def test_the_manifest_lists_a_shared_feature_once_with_its_smallest_table_and_the_artifact_is_the_float_model(exported):
    out, model = exported
    artifact, manifest = open_artifact(out, format="torchscript")
    assert [(f.name, f.table, f.rows, f.pooling) for f in manifest.sparse_features] == [
        ("user", "bags.t_user_mean", 6, "MEAN"), ("item", "bags.t_user_sum", 10, "SUM"), ("seq", "seqs.s_short", 7, "NONE")]
    sparse, dense, _ = random_request(ModelInputs.of(manifest), 24, 4, ids=(0, 6))
    got = in_process(artifact, sparse, dense)["output"]
    np.testing.assert_allclose(got, _reference(model, sparse, dense), rtol=1e-5, atol=1e-6)
    sparse["user"][0] = [6]  # inside t_user_sum, outside t_user_mean
    with pytest.raises(Exception, match=r"feature 'user': id 6 is out of range \[0, 6\)"):
        in_process(artifact, sparse, dense)


def test_both_fronts_and_recship_predict_answer_as_the_artifact_in_process(exported, binary, tmp_path):
    out, _ = exported
    model, manifest = open_artifact(out, format="torchscript")
    requests = [random_request(ModelInputs.of(manifest), batch, seed, ids=(0, 6)) for batch, seed in [(1, 1), (9, 2), (100, 3)]]
    assert_served_as_in_process(out, "shared", requests, [in_process(model, *r) for r in requests], binary, tmp_path)


def test_inference_sharding_answers_as_one_device_and_modulo_is_refused(exported, tmp_path):
    out, model = exported
    one, manifest = open_artifact(out, format="torchscript")
    export_model(model, ExportConfig(out=str(tmp_path / "two"), model_name="shared", dtype="fp32", progress=False, shards=2,
                                     sharding="row_wise", validation_batches=1, validation_batch_size=8, format="torchscript"))
    two, _ = open_artifact(tmp_path / "two", format="torchscript")
    sparse, dense, _ = random_request(ModelInputs.of(manifest), 12, 5, ids=(0, 6))
    np.testing.assert_allclose(in_process(two, sparse, dense)["output"], in_process(one, sparse, dense)["output"], rtol=0, atol=1e-6)
    with pytest.raises(ExportError, match=r"features \['user'\] feed several tables \(shared features\)"):
        export_model(model, ExportConfig(out=str(tmp_path / "modulo"), progress=False, id_policy={"user": "modulo"}))
