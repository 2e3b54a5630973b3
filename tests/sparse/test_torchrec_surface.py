"""The smaller pieces of TorchRec's sparse and module API that user code reaches for (written as TorchRec users write
it, through the import map): each checked against plain PyTorch on random inputs with fixed seeds."""

import pytest
import torch

from recship.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, jt_is_equal, kjt_is_equal
from recship.trainer import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig


def _kjt(seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g, dtype=torch.int32)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths, weights=weights)


def test_from_dense_lengths_keeps_each_rows_first_lengths_entries():
    g = torch.Generator().manual_seed(0)
    dense, weights = torch.rand(4, 6, generator=g), torch.rand(4, 6, generator=g)
    lengths = torch.tensor([0, 6, 2, 3])
    jt = JaggedTensor.from_dense_lengths(dense, lengths, weights)
    assert torch.equal(jt.values(), torch.cat([dense[b, : int(n)] for b, n in enumerate(lengths)]))
    assert torch.equal(jt.weights(), torch.cat([weights[b, : int(n)] for b, n in enumerate(lengths)]))
    assert torch.equal(jt.lengths(), lengths) and torch.equal(jt.offsets(), torch.tensor([0, 0, 6, 8, 11]))
    assert JaggedTensor.from_dense_lengths(dense, lengths).weights_or_none() is None


def test_empty_like_and_lengths_offset_per_key():
    kjt = _kjt(1, weighted=True).to(torch.device("cpu"))
    empty = KeyedJaggedTensor.empty_like(kjt)
    assert empty.keys() == [] and empty.stride() == kjt.stride() == 5 and empty.values().numel() == 0
    assert (empty.values().dtype, empty.weights().dtype, empty.lengths().dtype) == (kjt.values().dtype, kjt.weights().dtype,
                                                                                  kjt.lengths().dtype)
    assert KeyedJaggedTensor.empty_like(_kjt(1)).weights_or_none() is None
    # where each key's lengths start: the cumulative sum of the per-key batch sizes
    assert kjt.lengths_offset_per_key() == [0, 5, 10, 15] == torch.cumsum(torch.tensor([0] + kjt.stride_per_key()), 0).tolist()


def test_is_equal_compares_every_part():
    a, same = _kjt(2, weighted=True), _kjt(2, weighted=True)
    assert kjt_is_equal(a, same) and not kjt_is_equal(a, _kjt(3, weighted=True)) and not kjt_is_equal(a, _kjt(2))
    assert not kjt_is_equal(a, a["a"]) and not kjt_is_equal(a, None)
    other_weights = KeyedJaggedTensor(keys=a.keys(), values=a.values(), lengths=a.lengths(), weights=a.weights() + 1)
    assert not kjt_is_equal(a, other_weights)
    renamed = KeyedJaggedTensor(keys=["a", "b", "d"], values=a.values(), lengths=a.lengths(), weights=a.weights())
    assert not kjt_is_equal(a, renamed)
    assert jt_is_equal(a["b"], same["b"]) and not jt_is_equal(a["b"], a["c"]) and not jt_is_equal(a["b"], a)
    as_int64 = JaggedTensor(values=a["b"].values(), lengths=a["b"].lengths().long(), weights=a["b"].weights())
    assert not jt_is_equal(a["b"], as_int64)  # the same numbers in another dtype are not equal


def test_from_tensor_list_joins_along_cat_dim():
    g = torch.Generator().manual_seed(4)
    tensors = [torch.rand(3, 2, generator=g), torch.rand(3, 5, generator=g)]
    kt = KeyedTensor.from_tensor_list(["x", "y"], tensors)
    assert torch.equal(kt.values(), torch.cat(tensors, dim=1)) and kt.length_per_key() == [2, 5]
    stacked = [torch.rand(2, 4, generator=g), torch.rand(3, 4, generator=g)]  # keys along dim 0, joined along dim 0
    kt0 = KeyedTensor.from_tensor_list(["p", "q"], stacked, key_dim=0, cat_dim=0)
    assert torch.equal(kt0.values(), torch.cat(stacked, dim=0)) and torch.equal(kt0["q"], stacked[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="record_stream needs a CUDA device")
def test_record_stream_marks_every_tensor():
    kjt = _kjt(5, weighted=True).to(torch.device("cuda"))
    stream = torch.cuda.Stream()
    kjt.record_stream(stream)
    kjt["a"].record_stream(stream)


def test_configs_and_collections_answer_torchrecs_questions():
    t = EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8, feature_names=["f", "g"], weight_init_max=0.5)
    assert t.num_features() == 2 and t.get_weight_init_max() == 0.5 and t.get_weight_init_min() == pytest.approx(-0.1)
    ec = EmbeddingCollection([EmbeddingConfig(name="u", num_embeddings=10, embedding_dim=4, feature_names=["x", "y"]),
                              EmbeddingConfig(name="v", num_embeddings=10, embedding_dim=4, feature_names=["z"])])
    assert ec.embedding_dim() == 4 and ec.embedding_names_by_table() == [["x", "y"], ["z"]]
    mixed = EmbeddingCollection([EmbeddingConfig(name="u", num_embeddings=10, embedding_dim=4),
                                 EmbeddingConfig(name="v", num_embeddings=10, embedding_dim=8)])
    with pytest.raises(ValueError, match="widths differ"):
        mixed.embedding_dim()
