import random
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.fx

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
def test_concat_batch_matches_reference(weighted):
    inputs = [random_kjt(KEYS, batch_size=b, seed=10 + b, weighted=weighted) for b in (1, 3, 2)]
    out = KeyedJaggedTensor.concat_batch([k for k, _, _ in inputs])
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
    assert str(kjt) == 'KeyedJaggedTensor({\n    "product": [[1, 2, 1], [5]],\n    "user": [[2, 3], [4, 1]]\n})\n'


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
        (dict(keys=["a"], values=torch.arange(2), lengths=torch.tensor([1.0, 1.0])), "integer"),
        (dict(keys=["a"], values=torch.arange(2)), "give lengths or offsets"),
        (dict(keys=["a"], values=torch.arange(2), offsets=torch.tensor([1, 2])), "start at 0"),
    ],
)
def test_inconsistent_input_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyedJaggedTensor(**kwargs)


def test_concat_batch_rejects_mismatched_keys_and_weights():
    a, _, _ = random_kjt(["x", "y"], 2, seed=0)
    b, _, _ = random_kjt(["y", "x"], 2, seed=1)
    c, _, _ = random_kjt(["x", "y"], 2, seed=2, weighted=True)
    with pytest.raises(ValueError, match="keys differ"):
        KeyedJaggedTensor.concat_batch([a, b])
    with pytest.raises(ValueError, match="weights"):
        KeyedJaggedTensor.concat_batch([a, c])
    with pytest.raises(ValueError, match="no KeyedJaggedTensors"):
        KeyedJaggedTensor.concat_batch([])


def test_concat_rejects_mismatched_batch_and_weights():
    a, _, _ = random_kjt(["x", "y"], 2, seed=0)
    b, _, _ = random_kjt(["z"], 3, seed=1)
    c, _, _ = random_kjt(["z"], 2, seed=2, weighted=True)
    with pytest.raises(ValueError, match="batch sizes differ \\(2 vs 3\\)"):
        KeyedJaggedTensor.concat([a, b])
    with pytest.raises(ValueError, match="weights"):
        KeyedJaggedTensor.concat([a, c])
    with pytest.raises(ValueError, match="no KeyedJaggedTensors"):
        KeyedJaggedTensor.concat([])


def test_permute_split_and_lookup_errors():
    kjt, _, _ = random_kjt(["x", "y"], 2, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([2])
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([0, -1])
    with pytest.raises(ValueError, match="sum to 1"):
        kjt.split([1])
    with pytest.raises(ValueError, match="no key 'z'"):
        kjt["z"]
    # JaggedTensors of different batch sizes make a variable-batch KJT (tests/sparse/test_torchrec_behaviour.py)


@torch.jit.script
def _scripted_ops(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths, weights=weights)
    d = kjt.to_dict()
    p = kjt.permute([2, 0])
    s = kjt.split([1, 2])
    c = KeyedJaggedTensor.concat_batch([kjt, kjt])
    dup = kjt.permute([1, 1, 0])
    joined = KeyedJaggedTensor.concat([s[1], s[0]]).sync()
    lengths_or_none = joined.flatten_lengths().unsync().lengths_or_none()
    assert lengths_or_none is not None
    return {
        "b_values": d["b"].values(),
        "b_weights": d["b"].weights(),
        "perm_values": p.values(),
        "perm_lengths": p.lengths(),
        "split1_values": s[1].values(),
        "concat_lengths": c.lengths(),
        "concat_values": c.values(),
        "dup_values": dup.values(),
        "dup_weights": dup.weights(),
        "dup_lengths": dup.lengths(),
        "joined_values": joined.values(),
        "joined_lengths": lengths_or_none,
        "joined_a_index": torch.tensor(joined.index_per_key()["a"]),
        "joined_stride_per_key": torch.tensor(joined.stride_per_key()),
        "size_in_bytes": torch.tensor(kjt.size_in_bytes()),
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
    cat = KeyedJaggedTensor.concat_batch([kjt, kjt])
    assert torch.equal(out["concat_lengths"], cat.lengths())
    assert torch.equal(out["concat_values"], cat.values())
    assert kjt_as_lists(cat) == {k: ref[k] + ref[k] for k in ["a", "b", "c"]}
    dup = kjt.permute([1, 1, 0])
    assert torch.equal(out["dup_values"], dup.values())
    assert torch.equal(out["dup_weights"], dup.weights())
    assert torch.equal(out["dup_lengths"], dup.lengths())
    # concat([keys b, c], [key a]) holds the same ids as permute([1, 2, 0]).
    assert out["joined_values"].tolist() == sum(ref["b"] + ref["c"] + ref["a"], [])
    assert out["joined_lengths"].tolist() == [len(r) for k in "bca" for r in ref[k]]
    assert out["joined_a_index"].item() == 2
    assert out["joined_stride_per_key"].tolist() == [4, 4, 4]
    assert out["size_in_bytes"].item() == kjt.size_in_bytes()


def test_torchscript_raises_on_inconsistent_input():
    with pytest.raises(torch.jit.Error, match="sum\\(lengths\\)"):
        _scripted_ops(torch.arange(3), torch.tensor([1, 1, 0]), torch.ones(3))


class _UsesKJT(torch.nn.Module):
    def forward(self, kjt: KeyedJaggedTensor):
        d = kjt.to_dict()
        p = kjt.permute([1, 0, 1])
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
    assert got[1].keys() == ["b", "a", "b"]
    assert got[1].lengths().tolist() == [len(r) for k in "bab" for r in ref[k]]
    assert got[1].values().tolist() == sum(ref["b"] + ref["a"] + ref["b"], [])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


# ---------------------------------------------------------------------------
# Repeated keys, concat (keys) / concat_batch, and the TorchRec accessors,
# against a plain-Python reference that keeps repeated keys apart:
# [(key, rows of ids, rows of weights or None), ...] in key order.
# ---------------------------------------------------------------------------

Feature = Tuple[str, List[List[int]], Optional[List[List[float]]]]


def _random_features(keys: List[str], batch: int, rng: random.Random, weighted: bool) -> List[Feature]:
    """Random rows per key; about one key in four has no ids at all."""
    feats: List[Feature] = []
    for k in keys:
        max_len = 0 if rng.random() < 0.25 else 3
        rows = [[rng.randrange(1000) for _ in range(rng.randint(0, max_len))] for _ in range(batch)]
        # Weights go through float32 so that the KJT holds them exactly.
        wrows = [torch.tensor([rng.random() for _ in r], dtype=torch.float32).tolist() for r in rows]
        feats.append((k, rows, wrows if weighted else None))
    return feats


def _build(feats: List[Feature], batch: int, weighted: bool, rng: random.Random) -> KeyedJaggedTensor:
    """A KJT holding feats, with random integer dtypes and stride given explicitly."""
    values_dtype = rng.choice([torch.int32, torch.int64])
    lengths_dtype = rng.choice([torch.int32, torch.int64])
    return KeyedJaggedTensor(
        keys=[k for k, _, _ in feats],
        values=torch.tensor([v for _, rows, _ in feats for r in rows for v in r], dtype=values_dtype),
        lengths=torch.tensor([len(r) for _, rows, _ in feats for r in rows], dtype=lengths_dtype),
        weights=torch.tensor([x for _, _, w in feats for r in w for x in r]) if weighted else None,
        stride=batch,
    )


def _read(kjt: KeyedJaggedTensor) -> List[Feature]:
    """Reads a KJT back into reference form using only lengths, values and weights."""
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    w = kjt.weights_or_none()
    weights = w.tolist() if w is not None else None
    b = kjt.stride()
    out: List[Feature] = []
    pos = 0
    for i, k in enumerate(kjt.keys()):
        rows, wrows = [], []
        for n in lengths[i * b : (i + 1) * b]:
            rows.append(values[pos : pos + n])
            wrows.append(weights[pos : pos + n] if weights is not None else None)
            pos += n
        out.append((k, rows, wrows if weights is not None else None))
    assert pos == len(values)
    return out


def _check(kjt: KeyedJaggedTensor, feats: List[Feature], batch: int) -> None:
    """Every accessor of kjt against the reference."""
    keys = [k for k, _, _ in feats]
    per_key = [sum(len(r) for r in rows) for _, rows, _ in feats]
    assert kjt.keys() == keys
    assert kjt.stride() == batch
    assert kjt.stride_per_key() == [batch] * len(keys)
    assert _read(kjt) == feats
    assert kjt.length_per_key() == per_key
    assert kjt.offset_per_key() == [sum(per_key[:i]) for i in range(len(keys) + 1)]
    flat_lengths = [len(r) for _, rows, _ in feats for r in rows]
    flat_offsets = [sum(flat_lengths[:i]) for i in range(len(flat_lengths) + 1)]
    # TorchRec's *_or_none: what was given or asked for already, else None; once asked, always the tensor
    for given, ask in ((kjt.lengths_or_none(), kjt.lengths), (kjt.offsets_or_none(), kjt.offsets)):
        asked = ask()
        assert given is None or given is asked
    assert kjt.lengths_or_none().tolist() == flat_lengths
    assert kjt.offsets_or_none().tolist() == flat_offsets
    # A repeated key is found at its last position, as TorchRec's dict-based lookups do.
    last = {k: i for i, k in enumerate(keys)}
    assert kjt.index_per_key() == last
    assert list(kjt.to_dict()) == list(last)
    for k, i in last.items():
        _, rows, wrows = feats[i]
        assert [r.tolist() for r in kjt[k].to_dense()] == rows
        assert [r.tolist() for r in kjt.to_dict()[k].to_dense()] == rows
        if wrows is not None:
            assert [r.tolist() for r in kjt[k].to_dense_weights()] == wrows
    n = sum(per_key)
    expect_bytes = (
        n * kjt.values().element_size()
        + (n * 4 if feats and feats[0][2] is not None else 0)
        + len(flat_lengths) * kjt.lengths().element_size()
        + (len(flat_lengths) + 1) * kjt.offsets().element_size()
    )
    assert kjt.size_in_bytes() == expect_bytes


@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_permute_with_repeats_matches_reference(batch, weighted, seed):
    rng = random.Random(seed)
    feats = _random_features(KEYS, batch, rng, weighted)
    kjt = _build(feats, batch, weighted, rng)
    indices = [rng.randrange(len(KEYS)) for _ in range(6)]
    out = kjt.permute(indices)
    _check(out, [feats[i] for i in indices], batch)
    with_tensor = kjt.permute(indices, torch.tensor(indices, dtype=torch.int32))
    assert _read(with_tensor) == _read(out)


@pytest.mark.parametrize("batch", [0, 2, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_concat_joins_keys_like_reference(batch, weighted):
    rng = random.Random(batch)
    parts = [_random_features(keys, batch, rng, weighted) for keys in (["a", "b"], [], ["c"], ["a", "d", "e"])]
    kjts = [_build(f, batch, weighted, rng) for f in parts]
    if batch % 4 == 0:  # sometimes every input has length_per_key cached, sometimes not
        for kjt in kjts:
            kjt.sync()
    out = KeyedJaggedTensor.concat(kjts)
    _check(out, sum(parts, []), batch)


def _random_step(kjt: KeyedJaggedTensor, feats: List[Feature], batch: int, weighted: bool, rng: random.Random):
    """One random operation applied to the KJT and, independently, to its reference."""
    num_keys = len(feats)
    op = rng.choice(["permute", "concat", "concat_batch", "split", "flatten", "sync"])
    if op == "permute" or num_keys > 8:
        indices = [rng.randrange(num_keys) for _ in range(rng.randint(0, min(num_keys + 2, 6)))] if num_keys else []
        return kjt.permute(indices), [feats[i] for i in indices], batch
    if op == "concat":
        other_feats = _random_features([rng.choice("abcdefg") for _ in range(rng.randint(0, 3))], batch, rng, weighted)
        other = _build(other_feats, batch, weighted, rng)
        if rng.random() < 0.5:
            return KeyedJaggedTensor.concat([other, kjt]), other_feats + feats, batch
        return KeyedJaggedTensor.concat([kjt, other]), feats + other_feats, batch
    if op == "concat_batch":
        more = rng.randint(0, 3)
        other_feats = _random_features([k for k, _, _ in feats], more, rng, weighted)
        other = _build(other_feats, more, weighted, rng)
        joined = [
            (k, rows + orows, None if w is None else w + ow)
            for (k, rows, w), (_, orows, ow) in zip(feats, other_feats)
        ]
        return KeyedJaggedTensor.concat_batch([kjt, other]), joined, batch + more
    if op == "split":
        cut = rng.randint(0, num_keys)
        left, right = kjt.split([cut, num_keys - cut])
        if rng.random() < 0.5:  # concat undoes split
            return KeyedJaggedTensor.concat([left, right]), feats, batch
        return right, feats[cut:], batch
    if op == "flatten":
        return kjt.flatten_lengths(), feats, batch
    return (kjt.sync() if rng.random() < 0.5 else kjt.unsync()), feats, batch


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_reference(seed):
    rng = random.Random(seed)
    weighted = seed % 2 == 1
    batch = rng.choice([0, 1, 2, 3])
    feats = _random_features(KEYS[: rng.randint(0, 4)], batch, rng, weighted)
    kjt = _build(feats, batch, weighted, rng)
    for _ in range(10):
        kjt, feats, batch = _random_step(kjt, feats, batch, weighted, rng)
        _check(kjt, feats, batch)


def _tutorial_kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([2, 0, 1, 2]),
        weights=torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
    )


def test_torchrec_cases():
    """Results read off TorchRec 1.8.0 for the same inputs."""
    p = _tutorial_kjt().permute([0, 0, 1])
    assert p.keys() == ["a", "a", "b"]
    assert p.values().tolist() == [1, 2, 1, 2, 3, 4, 5]
    assert p.lengths().tolist() == [2, 0, 2, 0, 1, 2]
    assert p.weights().tolist() == pytest.approx([0.1, 0.2, 0.1, 0.2, 0.3, 0.4, 0.5])
    assert p.length_per_key() == [2, 2, 3]
    assert p.index_per_key() == {"a": 1, "b": 2}

    c = KeyedJaggedTensor.concat(
        [_tutorial_kjt(), KeyedJaggedTensor(keys=["c"], values=torch.tensor([9]), lengths=torch.tensor([0, 1]), weights=torch.tensor([0.9]))]
    )
    assert c.keys() == ["a", "b", "c"]
    assert c.values().tolist() == [1, 2, 3, 4, 5, 9]
    assert c.lengths().tolist() == [2, 0, 1, 2, 0, 1]
    assert c.stride() == 2 and c.length_per_key() == [2, 3, 1]
    assert KeyedJaggedTensor.concat([_tutorial_kjt(), _tutorial_kjt()]).keys() == ["a", "b", "a", "b"]

    dup = KeyedJaggedTensor(keys=["a", "a"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
    assert dup["a"].values().tolist() == [2, 3]
    assert {k: jt.values().tolist() for k, jt in dup.to_dict().items()} == {"a": [2, 3]}

    # TorchRec reports 92 bytes (values 40, weights 20, lengths 32) because it has not
    # built offsets yet; recship always holds them: 5 more int64 offsets.
    assert _tutorial_kjt().size_in_bytes() == 92 + 5 * 8

    zero = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([], dtype=torch.int64), lengths=torch.tensor([], dtype=torch.int32))
    zp = zero.permute([1, 0, 1])
    assert (zp.keys(), zp.lengths().tolist(), zp.stride(), zp.length_per_key()) == (["b", "a", "b"], [], 0, [0, 0, 0])
    assert zero.stride_per_key() == [0, 0]


def test_sync_and_unsync_manage_the_per_key_cache():
    kjt = _tutorial_kjt()
    assert kjt.sync() is kjt
    assert (kjt._length_per_key, kjt._offset_per_key) == ([2, 3], [0, 2, 5])
    assert kjt.unsync() is kjt
    assert (kjt._length_per_key, kjt._offset_per_key) == (None, None)
    assert kjt.offset_per_key() == [0, 2, 5]  # recomputed on demand


def test_flatten_lengths_keeps_the_tensors():
    kjt = _tutorial_kjt().sync()
    flat = kjt.flatten_lengths()
    assert flat is not kjt
    assert flat.values() is kjt.values() and flat.weights() is kjt.weights()
    assert flat.lengths().tolist() == [2, 0, 1, 2] and flat.length_per_key() == [2, 3]


@pytest.mark.parametrize("weighted", [False, True])
def test_empty_takes_torchrec_arguments(weighted):
    kjt = KeyedJaggedTensor.empty(weighted, None, torch.int32, torch.float16, torch.int64)
    assert (kjt.keys(), kjt.stride(), kjt.values().dtype, kjt.lengths().dtype) == ([], 0, torch.int32, torch.int64)
    assert kjt.offsets().tolist() == [0]
    if weighted:
        assert kjt.weights().dtype == torch.float16
    else:
        assert kjt.weights_or_none() is None
    assert KeyedJaggedTensor.empty().values().dtype == torch.get_default_dtype()  # as TorchRec's
