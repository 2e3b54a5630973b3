"""Variable batch per feature (TorchRec's VBE KeyedJaggedTensor: ``stride_per_key_per_rank`` and ``inverse_indices``),
as TorchRec users write it (tests/snippets/torchrec_variable_batch.txt, through docs/torchrec.md's import map): the KJT's
accessors, and the unsharded EmbeddingBagCollection's output expanded by the inverse indices, against the same
collection on the expanded (full) batch and against plain PyTorch; where recship does not take variable batch it says so."""


import pytest
import torch

from gloo_ranks import run_ranks
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingCollection, EmbeddingConfig
from tutorials.notebook import run_snippet

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)
KEYS = ["f0", "f1", "f2"]
ROWS = {"f0": 20, "f1": 20, "f2": 15}
B = 6  # the full batch: 2 ranks of 3 examples
SPKPR = [[2, 3], [1, 1], [3, 2]]  # deduplicated examples of each key from each rank


def _user_code() -> dict:
    scope = run_snippet("torchrec_variable_batch")
    return scope


def _bags(seed: int):
    """Per key: its deduplicated bags (ids, weights), and which bag each of the B examples takes."""
    g = torch.Generator().manual_seed(seed)
    bags, inverse = {}, {}
    for k, key in enumerate(KEYS):
        n = sum(SPKPR[k])
        bags[key] = []
        for _ in range(n):
            length = int(torch.randint(0, 4, (1,), generator=g))
            bags[key].append((torch.randint(0, ROWS[key], (length,), generator=g), torch.rand(length, generator=g)))
        inverse[key] = torch.cat([torch.arange(n), torch.randint(0, n, (B - n,), generator=g)])[torch.randperm(B, generator=g)]
    return bags, inverse


def _vbe(code, bags, inverse, weighted=False):
    values = torch.cat([ids for key in KEYS for ids, _ in bags[key]])
    weights = torch.cat([w for key in KEYS for _, w in bags[key]]) if weighted else None
    lengths = torch.tensor([len(ids) for key in KEYS for ids, _ in bags[key]])
    return code["variable_batch_kjt"](KEYS, values, lengths, SPKPR, torch.stack([inverse[k] for k in KEYS]), weights)


def _full(bags, inverse, weighted=False):
    """The same examples without deduplication: example b of key k is bag inverse[k][b]."""
    chosen = [bags[key][int(i)] for key in KEYS for i in inverse[key]]
    return KeyedJaggedTensor(keys=KEYS, values=torch.cat([ids for ids, _ in chosen]), lengths=torch.tensor([len(ids) for ids, _ in chosen]),
                             weights=torch.cat([w for _, w in chosen]) if weighted else None)


def test_the_kjt_answers_as_torchrecs():
    code = _user_code()
    bags, inverse = _bags(0)
    kjt = _vbe(code, bags, inverse)
    assert kjt.variable_stride_per_key() and kjt.stride_per_key_per_rank() == SPKPR
    assert kjt.stride_per_key() == [5, 2, 5] and kjt.stride() == B  # the inverse indices' batch
    assert kjt.lengths_offset_per_key() == [0, 5, 7, 12]
    assert kjt.inverse_indices()[0] == KEYS and torch.equal(kjt.inverse_indices()[1], torch.stack([inverse[k] for k in KEYS]))
    assert kjt.length_per_key() == [sum(len(ids) for ids, _ in bags[k]) for k in KEYS]
    for key, jt in kjt.to_dict().items():
        assert torch.equal(jt.lengths(), torch.tensor([len(ids) for ids, _ in bags[key]]))
        assert torch.equal(jt.values(), torch.cat([ids for ids, _ in bags[key]]))
        assert torch.equal(kjt[key].offsets(), jt.offsets())
    # an [F, R] tensor of batch sizes as TorchRec also takes; without inverse indices the stride is the largest key's
    plain = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(), stride_per_key_per_rank=torch.tensor(SPKPR))
    assert plain.stride_per_key_per_rank() == SPKPR and plain.stride() == 5 and plain.inverse_indices_or_none() is None
    assert not KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths()[:12]).variable_stride_per_key()
    with pytest.raises(ValueError, match="adds up to 11 examples"):
        KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(), stride_per_key_per_rank=[[2, 3], [1, 1], [3, 1]])
    with pytest.raises(ValueError, match="not supported for a variable-batch KJT"):
        KeyedJaggedTensor.concat([kjt, kjt])  # permute / split take it (tests/sparse/test_kjt_torchrec_semantics.py)
    with pytest.raises(ValueError, match="has no inverse_indices"):
        plain.inverse_indices()


@pytest.mark.parametrize("weighted", [False, True])
def test_the_collection_expands_its_output_by_the_inverse_indices(weighted):
    code = _user_code()
    torch.manual_seed(0)
    ebc = code["collection"](is_weighted=weighted)
    bags, inverse = _bags(1)
    vbe, full = _vbe(code, bags, inverse, weighted), _full(bags, inverse, weighted)
    out = ebc(vbe)
    want = ebc(full)
    assert out.keys() == KEYS and out.values().shape == (B, 12)
    assert torch.equal(out.values(), want.values())  # each bag pooled alone either way
    assert torch.equal(torch.jit.script(ebc)(vbe).values(), out.values())
    # plain PyTorch: example b of feature k pools the rows of bag inverse[k][b] (sum; MEAN for f2)
    tables = {"f0": ebc.embedding_bags["t0"].weight, "f1": ebc.embedding_bags["t0"].weight, "f2": ebc.embedding_bags["t1"].weight}
    for key in KEYS:
        rows = []
        for b in range(B):
            ids, w = bags[key][int(inverse[key][b])]
            r = (tables[key].detach()[ids] * (w.unsqueeze(1) if weighted else 1)).sum(0)
            rows.append(r / max(len(ids), 1) if key == "f2" else r)
        torch.testing.assert_close(out[key], torch.stack(rows), atol=1e-6, rtol=0)
    # gradients reach the tables as from the full batch
    out.values().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in ebc.named_parameters()}
    ebc.zero_grad()
    want.values().square().sum().backward()
    for n, p in ebc.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0)


def test_where_variable_batch_is_refused():
    code = _user_code()
    bags, inverse = _bags(2)
    vbe = _vbe(code, bags, inverse)
    ebc = code["collection"]()
    no_inverse = KeyedJaggedTensor(keys=KEYS, values=vbe.values(), lengths=vbe.lengths(), stride_per_key_per_rank=SPKPR)
    with pytest.raises(ValueError, match="without inverse_indices: feature 'f1' has 2 examples"):
        ebc(no_inverse)
    bad = KeyedJaggedTensor(keys=KEYS, values=vbe.values(), lengths=vbe.lengths(), stride_per_key_per_rank=SPKPR,
                            inverse_indices=(KEYS, torch.stack([inverse[k] for k in KEYS]) + 3))
    with pytest.raises(ValueError, match="inverse_indices of feature 'f0' pick rows 3..7 of its 5 examples"):
        ebc(bad)
    traced = torch.fx.symbolic_trace(ebc)
    with pytest.raises(ValueError, match="traced EmbeddingBagCollection"):
        traced(vbe)
    assert torch.equal(traced(_full(bags, inverse)).values(), ebc(_full(bags, inverse)).values())
    ec = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=20, feature_names=KEYS)])
    with pytest.raises(ValueError, match="unsharded EmbeddingBagCollection only"):
        ec(vbe)


def _sharded_worker(rank, world_size):
    from recship.distributed import DistributedModelParallel

    code = _user_code()
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("ebc", code["collection"]())
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    bags, inverse = _bags(3)
    try:
        dmp(_vbe(code, bags, inverse))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world_size", [2])
def test_a_sharded_collection_refuses_variable_batch_by_name(world_size):
    for message in run_ranks(_sharded_worker, world_size):
        assert message is not None and "variable-batch" in message and "sharded collections" in message
