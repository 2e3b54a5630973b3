"""The float reference that export validates against is the model's own forward, whatever the forward does to the
features before its collections: export never holds the float model whole (tables stream one at a time), so
it replays each collection call on the features that call really got.

Reference: the float model itself, run whole in the test. An FP32 export stores the tables exactly, so the
exported model must match that forward up to float summation order; a reference built from the request's raw
features instead (what export did before) is off by whole embedding rows.
"""

import torch
from torch import nn

from recship import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recship.export import ExportConfig, export_model, open_artifact
from recship.export.any_model import synthetic_batch, tables_by_reference
from recship.models import TwoTower


def _remapped(features: KeyedJaggedTensor, scale: int, shift: int) -> KeyedJaggedTensor:
    """The same features with every id hashed to (id * scale + shift) % 5 (one fx node: torch.fx.wrap below)."""
    return KeyedJaggedTensor(keys=features.keys(), values=(features.values() * scale + shift) % 5, lengths=features.lengths())


torch.fx.wrap("_remapped")


class HashingTowers(nn.Module):
    """Hashes ids into its tables in forward, and calls one collection twice (user and item towers share it)."""

    num_dense = 2

    def __init__(self) -> None:
        super().__init__()
        configs = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=13, feature_names=["a"]),
                   EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=7, feature_names=["b"])]
        self.shared = EmbeddingBagCollection(configs)
        self.head = nn.Linear(2 * 12 + 2, 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        first = self.shared(_remapped(features, 7, 3)).values()
        second = self.shared(_remapped(features, 2, 4)).values()
        return self.head(torch.cat([first, second, dense], dim=1))


def test_fp32_export_of_a_model_that_transforms_its_features_matches_its_own_forward(tmp_path):
    torch.manual_seed(0)
    model = HashingTowers().eval()
    manifest = export_model(model, ExportConfig(out=str(tmp_path / "a"), dtype="fp32", progress=False, validation_batches=2,
                                                validation_batch_size=16, format="torchscript"))
    assert manifest["validation"]["max_abs_diff_vs_float"]["output"] < 1e-5
    exported, _ = open_artifact(tmp_path / "a")
    spec = {"features": [("a", "shared", model.shared.embedding_bag_configs()[0], "SUM", False),
                         ("b", "shared", model.shared.embedding_bag_configs()[1], "SUM", False)],
            "weighted": False, "num_dense": 2}
    dense, kjt = synthetic_batch(spec, 9, seed=5)
    with torch.no_grad():
        want = model(dense, kjt)
        got = exported(dense, kjt.lengths().to(torch.int32), kjt.values(), None)["output"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_tables_by_reference_copies_no_table_and_reads_the_models_own():
    model = HashingTowers()
    copied, load_table = tables_by_reference(model)
    assert copied.shared.embedding_bags["t"].weight.device.type == "meta"
    assert load_table("shared", "t").data_ptr() == model.shared.embedding_bags["t"].weight.data_ptr()
    assert copied.head.weight.data_ptr() != model.head.weight.data_ptr()  # the dense part is the copy's own
    torch.testing.assert_close(copied.head.weight, model.head.weight, rtol=0, atol=0)


def test_tables_by_reference_shares_embedding_collection_tables_and_leaves_the_model_as_it_was(tmp_path):
    model = TwoTower(num_users=50, num_items=40)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied, _ = tables_by_reference(model)
    assert copied.history is not model.history  # a module of the copy's own ...
    assert copied.history.embeddings["history_items"].weight is model.history.embeddings["history_items"].weight  # ... on the same table
    assert copied.user_tables.embedding_bags["user_ids"].weight.device.type == "meta"
    export_model(model, ExportConfig(out=str(tmp_path / "art"), dtype="int4", progress=False, format="torchscript"))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert type(model.history).__name__ == "EmbeddingCollection"  # not swapped for a quantized one
