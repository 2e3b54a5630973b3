"""The float EmbeddingBagCollection against torch's embedding_bag called table by table.

Covers what the forward's shared preparation (one split of the values, one cumsum of the
lengths for every feature) must get right: key order, repeated and extra keys, int32 ids
and lengths, weights, MEAN, FP16/BF16 tables, empty bags; and that every out-of-range id
(nn.EmbeddingBag's kernels check them; the module names the feature) is a ValueError.
"""

import itertools
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

from reference import Ref, random_kjt


def _tables(pooling: PoolingType, data_type: DataType = DataType.FP32) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=50, feature_names=["f0", "f1"], pooling=pooling, data_type=data_type),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=30, feature_names=["f2"], pooling=pooling),
        EmbeddingBagConfig(name="t2", embedding_dim=12, num_embeddings=40, feature_names=["f3"], pooling=PoolingType.SUM),
    ]


def _reference(ebc: EmbeddingBagCollection, ref: Ref, wref: Optional[Dict[str, List[List[float]]]]) -> torch.Tensor:
    """F.embedding_bag per feature on that feature's own ids and weights (random_kjt's lists; ``wref`` None:
    unweighted), concatenated in table order."""
    outs = []
    for t in ebc.embedding_bag_configs():
        weight = ebc.embedding_bags[t.name].weight.detach()
        for f in t.feature_names:
            ids = torch.tensor([i for row in ref[f] for i in row], dtype=torch.int64)
            lengths = torch.tensor([len(row) for row in ref[f]], dtype=torch.int64)
            w = None if wref is None else torch.tensor([x for row in wref[f] for x in row], dtype=torch.float32)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
            mean = t.pooling == PoolingType.MEAN
            # F.embedding_bag takes per-sample weights in "sum" mode only: a weighted MEAN divides after
            mode = "mean" if mean and w is None else "sum"
            out = F.embedding_bag(ids, weight, offsets, mode=mode, include_last_offset=True,
                                  per_sample_weights=None if w is None else w.to(weight.dtype))
            if mean and w is not None:
                out = out / lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
            outs.append(out.float())
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ids_dtype,lengths_dtype", [(torch.int64, torch.int64), (torch.int32, torch.int32), (torch.int64, torch.int32)])
@pytest.mark.parametrize("keys", [["f0", "f1", "f2", "f3"], ["f3", "f0", "x", "f2", "f1"]])
def test_ebc_equals_embedding_bag_per_table(pooling, weighted, ids_dtype, lengths_dtype, keys):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(pooling), is_weighted=weighted)
    kjt, ref, wref = random_kjt(keys, 7, seed=1, max_id=30, weighted=weighted, values_dtype=ids_dtype, lengths_dtype=lengths_dtype)
    got = ebc(kjt)
    assert got.keys() == ["f0", "f1", "f2", "f3"]
    want = _reference(ebc, ref, wref)
    if pooling == PoolingType.SUM:
        assert torch.equal(got.values(), want)
    else:
        torch.testing.assert_close(got.values(), want, rtol=1e-6, atol=1e-7)


def test_repeated_key_reads_its_last_occurrence():
    """As KeyedJaggedTensor.to_dict: a key that appears twice resolves to its last block."""
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(PoolingType.SUM))
    kjt, _, _ = random_kjt(["f0", "f1", "f2", "f3", "f0"], 5, seed=2, max_id=30)
    expected = ebc(KeyedJaggedTensor.from_jt_dict(kjt.to_dict()))
    assert torch.equal(ebc(kjt).values(), expected.values())


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16])
def test_half_tables_equal_embedding_bag(data_type):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(PoolingType.SUM, data_type), is_weighted=True)
    kjt, ref, wref = random_kjt(["f0", "f1", "f2", "f3"], 6, seed=3, max_id=30, weighted=True)
    assert torch.equal(ebc(kjt).values(), _reference(ebc, ref, wref))


def test_scripted_and_traced_take_the_same_path():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(PoolingType.MEAN), is_weighted=True)
    kjt, _, _ = random_kjt(["f3", "f2", "f1", "f0"], 4, seed=4, max_id=30, weighted=True, values_dtype=torch.int32, lengths_dtype=torch.int32)
    eager = ebc(kjt).values()
    assert torch.equal(torch.jit.script(ebc)(kjt).values(), eager)
    assert torch.equal(torch.fx.symbolic_trace(ebc)(kjt).values(), eager)


@pytest.mark.parametrize(
    "data_type,pooling,weighted,ids_dtype",
    [c for c in itertools.product([DataType.FP32, DataType.FP16, DataType.BF16], [PoolingType.SUM, PoolingType.MEAN], [False, True], [torch.int64, torch.int32])],
)
def test_every_out_of_range_id_is_a_value_error(data_type, pooling, weighted, ids_dtype):
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["x"], pooling=pooling, data_type=data_type),
            EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=5, feature_names=["y"], pooling=pooling, data_type=data_type),
        ],
        is_weighted=weighted,
    )
    low = torch.iinfo(ids_dtype).min
    for feature, bad, rows in [("x", 10, 10), ("x", -1, 10), ("y", 5, 5), ("y", -1, 5), ("y", low, 5), ("y", 7, 5)]:
        values = torch.tensor([1, 2, 3, 4], dtype=ids_dtype)
        values[1 if feature == "x" else 3] = bad
        kjt = KeyedJaggedTensor(
            keys=["x", "y"], values=values, lengths=torch.tensor([1, 1, 1, 1]),
            weights=torch.rand(4) if weighted else None,
        )
        message = f"feature '{feature}': id {bad} is out of range [0, {rows})"
        with pytest.raises(ValueError) as raised:
            ebc(kjt)
        assert str(raised.value) == message


def test_the_first_bad_feature_in_key_order_is_named():
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["x"]),
            EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=5, feature_names=["y"]),
        ]
    )
    kjt = KeyedJaggedTensor(keys=["y", "x"], values=torch.tensor([9, 1, 11, 2]), lengths=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"^feature 'y': id 9 is out of range \[0, 5\)$"):
        ebc(kjt)


def test_other_kernel_errors_pass_through():
    """A RuntimeError that is not about ids (here: weights of the wrong length) is not rewritten."""
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["x"])], is_weighted=True)
    kjt = KeyedJaggedTensor(keys=["x"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.rand(2))
    kjt._weights = torch.rand(3)  # bypasses the KJT's own check, so that the kernel is the one to object
    with pytest.raises(RuntimeError):
        ebc(kjt)
