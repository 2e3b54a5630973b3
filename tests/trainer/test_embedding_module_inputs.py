"""What the embedding collections take, as TorchRec's: a KeyedJaggedTensor holds values of any dtype, so the
collections (where ids are looked up) refuse non-integer ids with a clear error; a collection of no tables; meta
KJTs through a collection built on meta (shape propagation)."""

import pytest
import torch

from recship.models.deepfm import SimpleDeepFMNN
from recship.models.dlrm import DLRM
from recship.quantize import QuantConfig, quantize_embedding_bag_collection
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig


def _bag_tables():
    return [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])]


def _kjt(values, weights=None):
    return KeyedJaggedTensor(keys=["f1", "f3", "f2"], values=values, lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
                             weights=weights)


def test_collections_refuse_float_ids():
    """2.7 must never become row 2: the KJT takes float values, each lookup refuses them."""
    floats = _kjt(torch.tensor([1.0, 2.7, 3.0, 4.0, 5.0, 6.0]))
    ebc = EmbeddingBagCollection(_bag_tables())
    with pytest.raises(ValueError, match="integer tensor"):
        ebc(floats)
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10,
                                              feature_names=["f1", "f2", "f3"])])
    with pytest.raises(ValueError, match="integer tensor"):
        ec(floats)
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    with pytest.raises(ValueError, match="integer tensor"):
        qebc(floats)
    # the same ids as integers are looked up: each row equals its table's row
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    out = ebc(_kjt(ids)).to_dict()
    t1, t2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    torch.testing.assert_close(out["f1"], t1[[1, 2]], rtol=0, atol=0)
    torch.testing.assert_close(out["f3"], t1[[3, 4]], rtol=0, atol=0)
    torch.testing.assert_close(out["f2"], t2[[5, 6]], rtol=0, atol=0)


def test_collection_on_meta_propagates_shapes():
    ebc = EmbeddingBagCollection(_bag_tables(), is_weighted=True, device=torch.device("meta"))
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f3", "f2"], values=torch.empty(12, dtype=torch.int64, device="meta"),
        offsets=torch.empty(7, dtype=torch.int64, device="meta"), weights=torch.empty(12, device="meta"))
    pooled = ebc(kjt)
    assert pooled.values().shape == (2, 10) and pooled.values().device.type == "meta"
    assert pooled.keys() == ["f1", "f3", "f2"] and pooled.offset_per_key() == [0, 3, 6, 10]


def test_collection_of_no_tables_pools_to_nothing_and_models_refuse_it():
    """An EmbeddingBagCollection of no tables is legal (TorchRec's): [B, 0]. DLRM and DeepFM need tables and say so
    (TorchRec asserts)."""
    ebc = EmbeddingBagCollection(tables=[])
    assert ebc.embedding_bag_configs() == [] and list(ebc.parameters()) == []
    kjt = KeyedJaggedTensor(keys=["x"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2]))
    out = ebc(kjt)
    assert out.keys() == [] and out.values().shape == (3, 0)
    with pytest.raises(ValueError, match="DLRM needs at least one embedding bag"):
        DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[2], over_arch_layer_sizes=[3, 1])
    with pytest.raises(ValueError, match="SimpleDeepFMNN: the EmbeddingBagCollection has no tables"):
        SimpleDeepFMNN(num_dense_features=4, embedding_bag_collection=ebc, hidden_layer_size=4, deep_fm_dimension=2)
