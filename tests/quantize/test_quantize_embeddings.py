"""quantize_embeddings on whole models: nested, several, shared and unpooled collections vs a dequantized float copy."""

import copy

import pytest
import torch
from torch import nn

from recship.quantize import QuantEmbeddingBagCollection, QuantEmbeddingCollection, dequantize_rows, quantize_embeddings
from recship.quantize.rowwise import QuantizedRows
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType

from reference import random_kjt


def _tables(prefix, rows, dims, features, pooling=PoolingType.SUM):
    return [EmbeddingBagConfig(name=f"{prefix}{i}", num_embeddings=r, embedding_dim=d, feature_names=f, pooling=pooling)
            for i, (r, d, f) in enumerate(zip(rows, dims, features))]


class TwoTowers(nn.Module):
    """A user tower (EBC + an EmbeddingCollection over a history, mean-pooled in the model), an item tower in a
    ModuleList/ModuleDict with a weighted EBC, and a 'shared' EBC reached by two paths."""

    def __init__(self):
        super().__init__()
        self.user = nn.Module()
        self.user.ebc = EmbeddingBagCollection(_tables("t", (50, 40), (8, 16), (["user"], ["country"])))
        self.user.history = EmbeddingCollection([EmbeddingConfig(name="t0", num_embeddings=30, embedding_dim=8, feature_names=["history"])])
        self.items = nn.ModuleList([nn.ModuleDict({"ebc": EmbeddingBagCollection(
            _tables("item", (60,), (8,), (["item", "category"],), PoolingType.MEAN), is_weighted=True)})])
        self.shared = EmbeddingBagCollection(_tables("s", (20,), (4,), (["tag"],)))
        self.user.tags = self.shared  # the same module under two paths
        self.head = nn.Linear(8 + 16 + 8 + 8 + 8 + 4 + 4, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.1)

    def forward(self, user: KeyedJaggedTensor, item: KeyedJaggedTensor, tags: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.user.ebc(user).values()
        history = self.user.history(user)["history"]
        example = torch.repeat_interleave(torch.arange(history.lengths().numel()), history.lengths())
        seq = torch.zeros_like(pooled[:, :8]).index_add_(0, example, history.values())  # mean of the history's rows
        seq = seq / history.lengths().clamp(min=1).unsqueeze(1)
        parts = [pooled, seq, self.items[0]["ebc"](item).values(), self.user.tags(tags).values(), self.shared(tags).values()]
        return self.head(torch.cat(parts, dim=1))


def _inputs(batch, seed):
    return (random_kjt(["user", "country", "history"], batch, seed, max_len=3, max_id=[50, 40, 30])[0],
            random_kjt(["item", "category"], batch, seed + 1, max_len=3, max_id=60, weighted=True)[0],
            random_kjt(["tag"], batch, seed + 2, max_len=3, max_id=20)[0])


def _dequantized(float_model, quantized):
    """The float model holding exactly the values each quantized table stores."""
    ref = copy.deepcopy(float_model)
    for path, q in quantized.named_modules():
        if isinstance(q, (QuantEmbeddingBagCollection, QuantEmbeddingCollection)):
            target = ref.get_submodule(path)
            tables = target.embedding_bags if isinstance(q, QuantEmbeddingBagCollection) else target.embeddings
            for name, (data, scale_bias) in q.table_weights().items():
                dim = tables[name].weight.shape[1]
                with torch.no_grad():
                    tables[name].weight.copy_(dequantize_rows(QuantizedRows(data, scale_bias), q.weight_types()[name], dim))
    return ref


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
def test_every_collection_is_swapped_and_computes_on_its_stored_values(dtype):
    torch.manual_seed(0)
    model = TwoTowers()
    before = copy.deepcopy(model.state_dict())
    q, report = quantize_embeddings(model, dtype=dtype, table_dtypes={"item0": "fp16", "user.ebc.t0": "int2"})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # not inplace: the float model is untouched
    assert isinstance(q.user.ebc, QuantEmbeddingBagCollection) and isinstance(q.user.history, QuantEmbeddingCollection)
    assert isinstance(q.items[0]["ebc"], QuantEmbeddingBagCollection) and q.items[0]["ebc"].is_weighted()
    assert q.user.tags is q.shared  # shared stays shared
    types = {t.table: t.data_type for t in report.tables}
    assert types == {"user.ebc.t0": "INT2", "user.ebc.t1": dtype.upper(), "user.history.t0": dtype.upper(),
                     "items.0.ebc.item0": "FP16", "user.tags.s0": dtype.upper()}  # a shared one: its first path
    for batch, seed in [(1, 1), (7, 2), (33, 3)]:
        inputs = _inputs(batch, seed)
        with torch.no_grad():
            torch.testing.assert_close(q(*inputs), _dequantized(model, q)(*inputs), atol=1e-5, rtol=1e-5)


def test_inplace_and_a_bare_collection():
    ebc = EmbeddingBagCollection(_tables("t", (30,), (8,), (["f"],)))
    q, report = quantize_embeddings(ebc, dtype="int8")
    assert isinstance(q, QuantEmbeddingBagCollection) and [t.table for t in report.tables] == ["t0"]
    torch.manual_seed(1)
    model = TwoTowers()
    same, _ = quantize_embeddings(model, inplace=True)
    assert same is model and isinstance(model.user.ebc, QuantEmbeddingBagCollection)


def test_bad_arguments_name_the_problem():
    torch.manual_seed(2)
    with pytest.raises(ValueError, match="holds no EmbeddingBagCollection"):
        quantize_embeddings(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'t0' is in several collections; name one of \['user.ebc.t0', 'user.history.t0'\]"):
        quantize_embeddings(TwoTowers(), table_dtypes={"t0": "int4"})
    with pytest.raises(ValueError, match="table_dtypes names 'nope'"):
        quantize_embeddings(TwoTowers(), table_dtypes={"nope": "int4"})
    with pytest.raises(ValueError, match="id_policy names 'nope'"):
        quantize_embeddings(TwoTowers(), id_policy={"nope": "modulo"})


def test_id_policy_reaches_the_collection_of_its_feature():
    torch.manual_seed(3)
    q, _ = quantize_embeddings(TwoTowers(), id_policy={"tag": "modulo", "history": "modulo"})
    assert q.shared.id_policy == {"tag": "modulo"} and q.user.history.id_policy == {"history": "modulo"}
    assert q.user.ebc.id_policy == {"user": "reject", "country": "reject"}


def test_the_quantized_model_traces_with_recship_fx_and_scripts():
    from recship.fx import Tracer

    torch.manual_seed(4)
    q, _ = quantize_embeddings(TwoTowers(), dtype="int4")
    graph = Tracer(leaf_modules=["Linear"]).trace(q)
    assert any(n.op == "call_module" and n.target == "head" for n in graph.nodes)  # a named leaf stays a call
    scripted = torch.jit.script(torch.fx.GraphModule(q, graph))
    for batch, seed in [(1, 5), (7, 6), (64, 7)]:
        inputs = _inputs(batch, seed)
        with torch.no_grad():
            assert torch.equal(scripted(*inputs), q(*inputs))
