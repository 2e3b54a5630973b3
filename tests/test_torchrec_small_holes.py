"""TorchRec's KeyedJaggedTensor/JaggedTensor ``copy_``, the collections' ``device`` and EmbeddingCollection's
``need_indices``, as TorchRec users write them (tests/snippets/torchrec_small_holes.txt, through docs/torchrec.md's import
map), against plain PyTorch on random inputs with fixed seeds."""


import pytest
import torch

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer import materialize
from tutorials.notebook import run_snippet

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)


def _user_code() -> dict:
    torch.manual_seed(0)
    return run_snippet("torchrec_small_holes")


def _kjt(seed: int, keys, rows: int = 7, weighted: bool = False, batch: int = 4) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g, dtype=torch.int32)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)


def _refill(buffer: KeyedJaggedTensor, batch: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return buffer.copy_(batch, non_blocking=False)


def _same_total(seed: int, total: int, weighted: bool) -> KeyedJaggedTensor:
    """A KJT of keys a, b, batch 4 and ``total`` ids, its lengths drawn anew."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, total + 1, (7,), generator=g)).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])).to(torch.int32)
    values = torch.randint(0, 7, (total,), generator=g)
    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths,
                             weights=torch.rand(total, generator=g) if weighted else None)


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_copy_fills_the_kjts_own_tensors(weighted):
    refill = _user_code()["refill"]
    source = _same_total(4, 12, weighted)
    buffer = _same_total(1, 12, weighted)
    assert buffer.length_per_key() != source.length_per_key()
    buffer.split_by_key()  # caches the old per-key split, which copy_ must drop
    pointers = [buffer.values().data_ptr(), buffer.lengths().data_ptr(), buffer.offsets().data_ptr()]
    assert refill(buffer, source) is buffer
    assert pointers == [buffer.values().data_ptr(), buffer.lengths().data_ptr(), buffer.offsets().data_ptr()]
    assert torch.equal(buffer.values(), source.values()) and torch.equal(buffer.lengths(), source.lengths())
    assert torch.equal(buffer.offsets(), source.offsets()) and buffer.length_per_key() == source.length_per_key()
    if weighted:
        assert torch.equal(buffer.weights(), source.weights())
    for key in ["a", "b"]:
        assert torch.equal(buffer[key].values(), source[key].values()) and torch.equal(buffer[key].lengths(), source[key].lengths())
        assert torch.equal(buffer.to_dict()[key].values(), source.to_dict()[key].values())
    assert [torch.equal(v, w) for v, w in zip(buffer.split_by_key()[0], source.split_by_key()[0])] == [True, True]
    # the same from TorchScript
    scripted = torch.jit.script(_refill)
    again = _same_total(7, 12, weighted)
    refilled = scripted(_same_total(3, 12, weighted), again)
    assert torch.equal(refilled.values(), again.values()) and torch.equal(refilled["b"].values(), again["b"].values())


def test_copy_refuses_what_does_not_fit():
    buffer = _same_total(2, 12, False)
    with pytest.raises(ValueError, match=r"values has shape \[11\] to copy into \[12\]"):
        buffer.copy_(_same_total(1, 11, False))
    with pytest.raises(ValueError, match="keys"):
        buffer.copy_(_kjt(0, ["a", "c"]))
    with pytest.raises(ValueError, match="weights"):
        buffer.copy_(_same_total(1, 12, True))
    jt = JaggedTensor(values=torch.arange(5), lengths=torch.tensor([2, 3]))
    other = JaggedTensor(values=torch.arange(5, 10), lengths=torch.tensor([4, 1]), weights=torch.rand(5))
    with pytest.raises(ValueError, match="weights"):
        jt.copy_(other)
    assert jt.copy_(JaggedTensor(values=torch.arange(5, 10), lengths=torch.tensor([4, 1]))) is jt
    assert torch.equal(jt.values(), torch.arange(5, 10)) and torch.equal(jt.offsets(), torch.tensor([0, 4, 5]))


def test_need_indices_returns_the_ids_as_weights():
    ec = _user_code()["ec"]
    assert ec.need_indices() and ec.device == torch.device("cpu")
    kjt = _kjt(5, ["f0", "f1", "f2"])
    weight = {"f0": ec.embeddings["t0"].weight, "f1": ec.embeddings["t0"].weight, "f2": ec.embeddings["t1"].weight}
    for module in (ec, torch.jit.script(ec)):
        out = module(kjt)
        assert list(out) == ["f0", "f1", "f2"]
        for key, jt in out.items():
            ids = kjt[key].values()
            assert torch.equal(jt.values(), weight[key].detach()[ids])  # plain indexing: the rows of the ids
            assert torch.equal(jt.weights(), ids) and jt.weights().dtype == torch.int64
            assert torch.equal(jt.lengths(), kjt[key].lengths())
    plain = type(ec)(ec.embedding_configs())
    assert not plain.need_indices() and all(jt.weights_or_none() is None for jt in plain(kjt).values())
    with pytest.raises(TypeError, match="need_indices"):
        type(ec)(ec.embedding_configs(), None, "yes")


def test_device_is_where_the_tables_are():
    code = _user_code()
    ebc = code["ebc"]
    assert ebc.device == torch.device("meta")
    materialize(ebc, "cpu")
    assert ebc.device == torch.device("cpu") == ebc.embedding_bags["t0"].weight.device
    assert torch.jit.script(ebc).embedding_bags["t0"].weight.device == torch.device("cpu")
    ec = type(code["ec"])(code["ec"].embedding_configs(), device="meta")
    assert ec.device == torch.device("meta") and not ec.need_indices()
