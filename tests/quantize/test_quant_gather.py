"""QuantEmbeddingBagCollection's gathering path (input keys not exactly one group's features).

The gathered ids/lengths/weights are per-key views of the KJT; whatever the key order, extra
or repeated keys, the output must equal the one for a KJT holding exactly the features in
table order (repeated keys resolve to their last occurrence, as KeyedJaggedTensor.to_dict does).
"""

import pytest
import torch

from recship.quantize import QuantConfig, quantize_embedding_bag_collection
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

from reference import random_kjt


def _module(weighted: bool):
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=40, feature_names=["x", "y"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=30, feature_names=["z"]),
        EmbeddingBagConfig(name="c", embedding_dim=12, num_embeddings=20, feature_names=["w"]),
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8", error_minimizing=False))
    return qebc


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("keys", [["w", "z", "y", "x"], ["q", "x", "y", "z", "w"], ["x", "y", "z", "w", "x", "z"]])
def test_gathered_output_equals_canonical_order(weighted, ids_dtype, keys):
    qebc = _module(weighted)
    kjt, _, _ = random_kjt(keys, 5, seed=len(keys), max_len=3, max_id=20, weighted=weighted, values_dtype=ids_dtype)
    per_key = kjt.to_dict()  # the last occurrence of a repeated key, as the module must read it
    canonical = KeyedJaggedTensor.from_jt_dict({f: per_key[f] for f in ["x", "y", "z", "w"]})
    assert canonical.keys() == ["x", "y", "z", "w"]
    assert torch.equal(qebc(kjt).values(), qebc(canonical).values())


def test_missing_feature_is_named():
    qebc = _module(weighted=False)
    with pytest.raises(ValueError, match=r"lacks feature 'y'"):
        qebc(random_kjt(["x", "z", "w"], 5, seed=0, max_len=3, max_id=20)[0])


def test_out_of_range_id_on_the_gathering_path_names_the_feature():
    qebc = _module(weighted=False)
    kjt = KeyedJaggedTensor(keys=["w", "x", "y", "z"], values=torch.tensor([1, 2, 3, 30]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"^feature 'z': id 30 is out of range \[0, 30\)$"):
        qebc(kjt)
