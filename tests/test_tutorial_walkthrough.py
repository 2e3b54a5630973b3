"""The TorchRec tutorial walk-throughs, with their numbers, on recship."""

import torch

from recship import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from recship import JaggedTensor, KeyedJaggedTensor, PoolingType
from recship.demo import tutorial_ebc


def test_product_user_ebc_on_three_examples():
    torch.manual_seed(0)
    ebc = tutorial_ebc()
    assert str(ebc.embedding_bags) == (
        "ModuleDict(\n"
        "  (product_table): EmbeddingBag(4096, 64, mode='sum')\n"
        "  (user_table): EmbeddingBag(4096, 64, mode='sum')\n"
        ")"
    )
    mb = KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.tensor([101, 202, 303, 404, 505, 606]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int64),
    )
    out = ebc(mb)
    assert out.keys() == ["product", "user"]
    assert tuple(out.values().shape) == (3, 128)
    p = ebc.embedding_bags["product_table"].weight.detach()
    u = ebc.embedding_bags["user_table"].weight.detach()
    want = torch.stack(
        [
            torch.cat([p[101] + p[202], u[404]]),
            torch.cat([torch.zeros(64), u[505]]),
            torch.cat([p[303], u[606]]),
        ]
    )
    torch.testing.assert_close(out.values(), want, atol=1e-6, rtol=0)


def test_nn_embedding_bag_offsets_example():
    torch.manual_seed(0)
    product_eb = torch.nn.EmbeddingBag(4096, 64)  # default mode: mean
    out = product_eb(input=torch.tensor([101, 202, 303]), offsets=torch.tensor([0, 2, 2]))
    w = product_eb.weight.detach()
    assert tuple(out.shape) == (3, 64)
    torch.testing.assert_close(out[0], (w[101] + w[202]) / 2)
    assert torch.equal(out[1], torch.zeros(64))
    torch.testing.assert_close(out[2], w[303])
    # The same batch through a one-table MEAN EmbeddingBagCollection with those weights.
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="product_table", embedding_dim=64, num_embeddings=4096, feature_names=["product"], pooling=PoolingType.MEAN)]
    )
    ebc.load_state_dict({"embedding_bags.product_table.weight": w})
    kjt = KeyedJaggedTensor(keys=["product"], values=torch.tensor([101, 202, 303]), lengths=torch.tensor([2, 0, 1]))
    torch.testing.assert_close(ebc(kjt).values(), out.detach())


def test_from_jt_dict_walkthrough_gives_two_by_128():
    torch.manual_seed(0)
    # the KJT itself is checked in tests/sparse/test_keyed_jagged_tensor.py::test_tutorial_from_jt_dict
    product = JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1]))
    kjt = KeyedJaggedTensor.from_jt_dict({"product": product, "user": JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2]))})
    ebc = tutorial_ebc()
    result = ebc(kjt)
    assert result.keys() == ["product", "user"]
    assert tuple(result.values().shape) == (2, 128)
    shapes = {k: tuple(v.shape) for k, v in result.to_dict().items()}
    assert shapes == {"product": (2, 64), "user": (2, 64)}
    p = ebc.embedding_bags["product_table"].weight.detach()
    torch.testing.assert_close(result["product"], torch.stack([2 * p[1] + p[2], p[5]]))


def test_mean_pooling_equals_mean_of_looked_up_rows():
    # the tutorial's nn.Embedding vs nn.EmbeddingBag comparison, on the collections
    torch.manual_seed(0)
    weights = torch.rand(10, 4)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, pooling=PoolingType.MEAN)])
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10)])
    ebc.load_state_dict({"embedding_bags.t.weight": weights})
    ec.load_state_dict({"embeddings.t.weight": weights})
    ids = KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 3, 0, 9, 9, 4]), lengths=torch.tensor([2, 1, 3]))
    looked_up = ec(ids)["t"].to_dense()
    torch.testing.assert_close(ebc(ids).values(), torch.stack([r.mean(0) for r in looked_up]))
    torch.testing.assert_close(ebc(ids).values()[0], torch.mean(weights[[1, 3]], dim=0))
