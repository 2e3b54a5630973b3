import pytest
import torch
import torch.fx
from typing import Dict

from recship.sparse import JaggedTensor, KeyedJaggedTensor
from reference import kjt_as_lists, random_kjt, requires_cuda

KEYS = ["f0", "f1", "f2", "f3"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("weighted", [False, True])
def test_accessors_match_reference(seed, weighted):
    kjt, ref, wref = random_kjt(KEYS, batch_size=5, seed=seed, weighted=weighted)
    assert kjt.keys() == KEYS
    assert kjt.stride() == 5
    assert kjt_as_lists(kjt) == ref
    assert kjt.length_per_key() == [sum(len(r) for r in ref[k]) for k in KEYS]
    lengths = [len(r) for k in KEYS for r in ref[k]]
    assert kjt.offsets().tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    opk = kjt.offset_per_key()
    assert opk[0] == 0 and opk[-1] == kjt.values().numel()
    for k, jt in kjt.to_dict().items():
        assert [r.tolist() for r in jt.to_dense()] == ref[k]
        assert [r.tolist() for r in kjt[k].to_dense()] == ref[k]
        if weighted:
            assert [pytest.approx(r.tolist()) for r in jt.to_dense_weights()] == wref[k]
        else:
            assert jt.weights_or_none() is None


def test_offsets_only_construction_derives_lengths():
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), offsets=torch.tensor([0, 2, 2, 3, 5]))
    assert kjt.lengths().tolist() == [2, 0, 1, 2]
    assert kjt_as_lists(kjt) == {"a": [[0, 1], []], "b": [[2], [3, 4]]}


@pytest.mark.parametrize("seed", range(4))
def test_permute_matches_reference(seed):
    kjt, ref, wref = random_kjt(KEYS, batch_size=3, seed=seed, weighted=True)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(seed)).tolist()[:3]
    out = kjt.permute(order)
    assert out.keys() == [KEYS[i] for i in order]
    assert kjt_as_lists(out) == {KEYS[i]: ref[KEYS[i]] for i in order}
    for i in order:
        assert [pytest.approx(r.tolist()) for r in out[KEYS[i]].to_dense_weights()] == wref[KEYS[i]]


@pytest.mark.parametrize("segments", [[4], [1, 3], [2, 0, 2], [1, 1, 1, 1]])
def test_split_matches_reference(segments):
    kjt, ref, _ = random_kjt(KEYS, batch_size=4, seed=7)
    parts = kjt.split(segments)
    start = 0
    for part, n in zip(parts, segments):
        assert part.keys() == KEYS[start : start + n]
        assert part.stride() == 4
        assert kjt_as_lists(part) == {k: ref[k] for k in KEYS[start : start + n]}
        start += n


@pytest.mark.parametrize("weighted", [False, True])
def test_concat_along_batch_matches_reference(weighted):
    inputs = [random_kjt(KEYS, batch_size=b, seed=10 + b, weighted=weighted) for b in (1, 3, 2)]
    out = KeyedJaggedTensor.concat([k for k, _, _ in inputs])
    assert out.stride() == 6
    assert kjt_as_lists(out) == {k: sum((r[k] for _, r, _ in inputs), []) for k in KEYS}
    assert out.length_per_key() == out.lengths().view(4, 6).sum(1).tolist()
    if weighted:
        for k in KEYS:
            expect = sum((w[k] for _, _, w in inputs), [])
            assert [pytest.approx(r.tolist()) for r in out[k].to_dense_weights()] == expect


def test_tutorial_from_jt_dict():
    kjt = KeyedJaggedTensor.from_jt_dict(
        {
            "product": JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1])),
            "user": JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2])),
        }
    )
    assert kjt.keys() == ["product", "user"]
    assert kjt.lengths().tolist() == [3, 1, 2, 2]
    assert kjt.values().tolist() == [1, 2, 1, 5, 2, 3, 4, 1]
    assert kjt.offsets().tolist() == [0, 3, 4, 6, 8]
    assert str(kjt) == 'KeyedJaggedTensor({\n    "product": [[1, 2, 1], [5]],\n    "user": [[2, 3], [4, 1]]\n})'


def test_tutorial_batch_size_is_lengths_over_keys():
    mb = KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.tensor([101, 202, 303, 404, 505, 606]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int64),
    )
    assert mb.stride() == 3
    assert kjt_as_lists(mb) == {"product": [[101, 202], [], [303]], "user": [[404], [505], [606]]}


def test_from_lengths_sync_and_int32():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a"], values=torch.tensor([3, 4, 5], dtype=torch.int32), lengths=torch.tensor([1, 2], dtype=torch.int32)
    )
    assert kjt.offsets().dtype == torch.int32
    assert kjt.length_per_key() == [3]


def test_to_keeps_data():
    kjt, ref, _ = random_kjt(KEYS, batch_size=3, seed=1, weighted=True)
    moved = kjt.to(torch.device("cpu"))
    assert kjt_as_lists(moved) == ref
    assert torch.equal(moved.weights(), kjt.weights())


@requires_cuda
def test_to_cuda_and_pin_memory_round_trip():
    kjt, ref, _ = random_kjt(KEYS, batch_size=3, seed=1, weighted=True)
    back = kjt.pin_memory().to(torch.device("cuda"), non_blocking=True).to(torch.device("cpu"))
    assert kjt_as_lists(back) == ref


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 1])), "sum\\(lengths\\) = 2"),
        (dict(keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1])), "not divisible"),
        (dict(keys=["a"], values=torch.arange(1), lengths=torch.tensor([2, -1])), "lengths must be >= 0"),
        (
            dict(keys=["a"], values=torch.arange(3), lengths=torch.tensor([3]), weights=torch.ones(2)),
            "weights has 2 entries",
        ),
        (dict(keys=["a", "a"], values=torch.arange(2), lengths=torch.tensor([1, 1])), "duplicate key"),
        (dict(keys=["a"], values=torch.arange(2), lengths=torch.tensor([1.0, 1.0])), "integer"),
        (dict(keys=["a"], values=torch.rand(2), lengths=torch.tensor([1, 1])), "integer"),
        (dict(keys=["a"], values=torch.arange(2)), "give lengths or offsets"),
        (dict(keys=["a"], values=torch.arange(2), offsets=torch.tensor([1, 2])), "start at 0"),
    ],
)
def test_inconsistent_input_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(**kwargs)


def test_concat_rejects_mismatched_keys_and_weights():
    a, _, _ = random_kjt(["x", "y"], 2, seed=0)
    b, _, _ = random_kjt(["y", "x"], 2, seed=1)
    c, _, _ = random_kjt(["x", "y"], 2, seed=2, weighted=True)
    with pytest.raises(ValueError, match="keys differ"):
        KeyedJaggedTensor.concat([a, b])
    with pytest.raises(ValueError, match="weights"):
        KeyedJaggedTensor.concat([a, c])


def test_permute_split_and_lookup_errors():
    kjt, _, _ = random_kjt(["x", "y"], 2, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([2])
    with pytest.raises(ValueError, match="repeats"):
        kjt.permute([0, 0])
    with pytest.raises(ValueError, match="sum to 1"):
        kjt.split([1])
    with pytest.raises(ValueError, match="no key 'z'"):
        kjt["z"]
    with pytest.raises(ValueError, match="batch size"):
        KeyedJaggedTensor.from_jt_dict(
            {
                "a": JaggedTensor(values=torch.arange(1), lengths=torch.tensor([1])),
                "b": JaggedTensor(values=torch.arange(2), lengths=torch.tensor([1, 1])),
            }
        )


@torch.jit.script
def _scripted_ops(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths, weights=weights)
    d = kjt.to_dict()
    p = kjt.permute([2, 0])
    s = kjt.split([1, 2])
    c = KeyedJaggedTensor.concat([kjt, kjt])
    return {
        "b_values": d["b"].values(),
        "b_weights": d["b"].weights(),
        "perm_values": p.values(),
        "perm_lengths": p.lengths(),
        "split1_values": s[1].values(),
        "concat_lengths": c.lengths(),
        "concat_values": c.values(),
    }


def test_torchscript_ops_match_eager():
    kjt, ref, _ = random_kjt(["a", "b", "c"], batch_size=4, seed=3, weighted=True)
    out = _scripted_ops(kjt.values(), kjt.lengths(), kjt.weights())
    eager_b = kjt.to_dict()["b"]
    assert torch.equal(out["b_values"], eager_b.values())
    assert torch.equal(out["b_weights"], eager_b.weights())
    perm = kjt.permute([2, 0])
    assert torch.equal(out["perm_values"], perm.values())
    assert torch.equal(out["perm_lengths"], perm.lengths())
    assert out["split1_values"].tolist() == sum(ref["b"], []) + sum(ref["c"], [])
    cat = KeyedJaggedTensor.concat([kjt, kjt])
    assert torch.equal(out["concat_lengths"], cat.lengths())
    assert torch.equal(out["concat_values"], cat.values())


def test_torchscript_raises_on_inconsistent_input():
    with pytest.raises(torch.jit.Error, match="sum\\(lengths\\)"):
        _scripted_ops(torch.arange(3), torch.tensor([1, 1, 0]), torch.ones(3))


class _UsesKJT(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor):
        d = kjt.to_dict()
        p = kjt.permute([1, 0])
        parts = kjt.split([1, 1])
        return d["b"].values() * 2, p, parts[0].lengths(), kjt["a"].offsets()


def test_fx_symbolic_trace_of_module_taking_kjt():
    gm = torch.fx.symbolic_trace(_UsesKJT())
    methods = {n.target for n in gm.graph.nodes if n.op == "call_method"}
    assert {"to_dict", "permute", "split"} <= methods
    kjt, ref, _ = random_kjt(["a", "b"], batch_size=3, seed=5)
    got = gm(kjt)
    want = _UsesKJT()(kjt)
    assert torch.equal(got[0], want[0])
    assert kjt_as_lists(got[1]) == {"b": ref["b"], "a": ref["a"]}
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
