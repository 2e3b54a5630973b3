"""KeyedJaggedTensor behaviour TorchRec 1.8.0's own unit tests pin down, against plain-Python references.

Variable-batch ``permute`` / ``split``, the input-distribution protocol (``dist_labels`` / ``dist_splits`` /
``dist_tensors`` / ``dist_init``), a KJT built from traced keys under fx, empty lengths given as
``torch.tensor([])``, meta tensors, TorchRec's ``lengths_or_none`` / ``offsets_or_none`` and the pytree round trip.
The same operations were checked bit-equal to TorchRec 1.8.0 on 24 random cases each (outside the repo).
"""

import inspect
import random
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.utils._pytree as pytree

from recship.fx import symbolic_trace
from recship.sparse import JaggedTensor, KeyedJaggedTensor

Rows = List[List[int]]  # one key's examples: the ids of each


def _random_vb(rng: random.Random, weighted: bool) -> Tuple[List[str], List[List[int]], Dict[str, Rows], Dict[str, Rows]]:
    """keys, [F][R] batch sizes, {key: rows of ids}, {key: rows of weights (as ints / 8)}."""
    num_keys, ranks = rng.randint(1, 4), rng.randint(1, 3)
    keys = [f"f{i}" for i in range(num_keys)]
    spkpr = [[rng.randint(0, 3) for _ in range(ranks)] for _ in keys]
    rows = {k: [[rng.randint(0, 99) for _ in range(rng.randint(0, 3))] for _ in range(sum(spkpr[i]))] for i, k in enumerate(keys)}
    weights = {k: [[rng.randint(0, 8) for _ in row] for row in rows[k]] for k in keys} if weighted else {}
    return keys, spkpr, rows, weights


def _kjt(keys: List[str], rows: Dict[str, Rows], weights: Dict[str, Rows], **kwargs) -> KeyedJaggedTensor:
    flat = [row for k in keys for row in rows[k]]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor([v for row in flat for v in row], dtype=torch.int64),
        lengths=torch.tensor([len(row) for row in flat], dtype=torch.int32),
        weights=torch.tensor([w / 8 for k in keys for row in weights[k] for w in row]) if weights else None,
        **kwargs,
    )


def _read(kjt: KeyedJaggedTensor) -> List[Tuple[str, Rows, Optional[Rows]]]:
    """(key, rows of ids, rows of weights * 8) read from the flat tensors with the per-key batch sizes."""
    lengths, values = kjt.lengths().tolist(), kjt.values().tolist()
    w = kjt.weights_or_none()
    weights = None if w is None else [round(x * 8) for x in w.tolist()]
    out, pos, at = [], 0, 0
    for key, b in zip(kjt.keys(), kjt.stride_per_key()):
        ids, ws = [], []
        for n in lengths[at : at + b]:
            ids.append(values[pos : pos + n])
            ws.append(None if weights is None else weights[pos : pos + n])
            pos += n
        at += b
        out.append((key, ids, None if weights is None else ws))
    assert at == len(lengths) and pos == len(values)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_variable_batch_permute_moves_each_keys_rows_and_batch_sizes(seed):
    rng = random.Random(seed)
    keys, spkpr, rows, weights = _random_vb(rng, weighted=seed % 2 == 1)
    inverse = torch.zeros(len(keys), 5, dtype=torch.int64)
    kjt = _kjt(keys, rows, weights, stride_per_key_per_rank=spkpr, inverse_indices=(keys, inverse))
    indices = [rng.randrange(len(keys)) for _ in range(rng.randint(0, 2 * len(keys)))]  # repeats and drops
    out = kjt.permute(indices)
    assert _read(out) == [(keys[i], rows[keys[i]], weights[keys[i]] if weights else None) for i in indices]
    assert out.stride_per_key_per_rank() == [spkpr[i] for i in indices]
    assert out.stride() == kjt.stride() == 5  # the inverse indices' batch, kept
    assert out.inverse_indices_or_none() is None  # as TorchRec's permute
    assert out.length_per_key() == [sum(map(len, rows[keys[i]])) for i in indices]


@pytest.mark.parametrize("seed", range(12))
def test_variable_batch_split_keeps_each_groups_batch_sizes(seed):
    rng = random.Random(seed)
    keys, spkpr, rows, weights = _random_vb(rng, weighted=seed % 2 == 0)
    kjt = _kjt(keys, rows, weights, stride_per_key_per_rank=spkpr)
    segments, left = [], len(keys)
    while left > 0:
        segments.append(rng.randint(0, left))
        left -= segments[-1]
    segments.insert(rng.randint(0, len(segments)), 0)
    parts = kjt.split(segments)
    start = 0
    for n, part in zip(segments, parts):
        group = keys[start : start + n]
        if n == len(keys):
            assert part is kjt  # TorchRec returns the KJT itself for a group of all keys
        assert _read(part) == [(k, rows[k], weights[k] if weights else None) for k in group]
        assert part.stride_per_key_per_rank() == spkpr[start : start + n]
        assert part.variable_stride_per_key() and part.stride() == kjt.stride()
        start += n


def test_split_of_fixed_batch_and_zero_sized_groups():
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.arange(7), lengths=torch.tensor([1, 2, 0, 1, 2, 1]))
    empty, ab, c = kjt.split([0, 2, 1])
    assert empty.keys() == [] and empty.lengths().numel() == 0 and empty.stride() == 2
    assert ab.keys() == ["a", "b"] and ab.lengths().tolist() == [1, 2, 0, 1] and ab.values().tolist() == [0, 1, 2, 3]
    assert c.lengths().tolist() == [2, 1] and c.values().tolist() == [4, 5, 6]
    assert kjt.split([3])[0] is kjt


def _rank_batches(rng: random.Random, keys: List[str], batch_sizes: List[List[int]]) -> List[Dict[str, Rows]]:
    """Per rank: {key: rows} with batch_sizes[rank][key] rows."""
    return [{k: [[rng.randint(0, 50) for _ in range(rng.randint(0, 3))] for _ in range(sizes[i])] for i, k in enumerate(keys)}
            for sizes in batch_sizes]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("variable", [False, True])
def test_dist_init_puts_what_ranks_sent_key_major(seed, variable):
    """Each rank sends its dist_tensors(); what arrives, concatenated rank after rank and reordered by recat,
    is one KJT holding every rank's rows of a key, rank after rank."""
    rng = random.Random(seed)
    num_keys, ranks = rng.randint(1, 3), rng.randint(1, 3)
    keys = [f"f{i}" for i in range(num_keys)]
    weighted = seed % 2 == 1
    if variable:
        batch_sizes = [[rng.randint(0, 3) for _ in keys] for _ in range(ranks)]
    else:
        batch_sizes = [[b] * num_keys for b in ([2] * ranks if seed % 3 == 0 else [rng.randint(1, 3) for _ in range(ranks)])]
    sent = _rank_batches(rng, keys, batch_sizes)
    wsent = [{k: [[rng.randint(0, 8) for _ in row] for row in batch[k]] for k in keys} for batch in sent] if weighted else []
    kjts = [_kjt(keys, batch, wsent[r] if weighted else {},
                 **({"stride_per_key_per_rank": [[b] for b in batch_sizes[r]]} if variable else {})) for r, batch in enumerate(sent)]
    assert kjts[0].dist_labels() == ["lengths", "values"] + (["strides"] if variable else []) + (["weights"] if weighted else [])
    received = [torch.cat(parts) for parts in zip(*[k.dist_tensors() for k in kjts])]
    stride_per_rank = None if variable else [sizes[0] for sizes in batch_sizes]
    if variable or len(set(stride_per_rank)) == 1:  # runs of (rank, key) lengths
        recat = torch.tensor([r * num_keys + f for f in range(num_keys) for r in range(ranks)], dtype=torch.int32)
    else:  # ranks sent different batch sizes: recat orders single examples
        starts = [sum(num_keys * b for b in stride_per_rank[:r]) for r in range(ranks)]
        recat = torch.tensor([starts[r] + f * stride_per_rank[r] + e for f in range(num_keys) for r in range(ranks)
                              for e in range(stride_per_rank[r])], dtype=torch.int32)
    out = KeyedJaggedTensor.dist_init(keys=keys, tensors=received, variable_stride_per_key=variable, num_workers=ranks,
                                      recat=recat, stride_per_rank=stride_per_rank)
    expected = [(k, [row for batch in sent for row in batch[k]],
                 [row for w in wsent for row in w[k]] if weighted else None) for k in keys]
    assert _read(out) == expected
    if variable:
        assert out.stride_per_key_per_rank() == [[batch_sizes[r][f] for r in range(ranks)] for f in range(num_keys)]
    else:
        assert out.stride() == sum(stride_per_rank) and not out.variable_stride_per_key()


def test_dist_splits_and_the_protocol_script():
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.arange(9), weights=torch.rand(9),
                            lengths=torch.tensor([1, 2, 0, 1, 2, 3]))
    # two destinations: keys [a] and [b, c]; per destination (examples, ids, weights)
    assert kjt.dist_splits([1, 2]) == [[2, 4], [3, 6], [3, 6]]

    class Send(torch.nn.Module):
        def forward(self, kjt: KeyedJaggedTensor) -> Tuple[List[str], List[List[int]], List[torch.Tensor]]:
            return kjt.dist_labels(), kjt.dist_splits([1, 2]), kjt.dist_tensors()

    scripted = torch.jit.script(Send())
    labels, splits, tensors = scripted(kjt)
    assert labels == ["lengths", "values", "weights"] and splits == kjt.dist_splits([1, 2])
    assert all(torch.equal(a, b) for a, b in zip(tensors, kjt.dist_tensors()))
    with pytest.raises(ValueError, match="2 to 4"):
        KeyedJaggedTensor.dist_init(keys=["a"], tensors=[kjt.lengths()], variable_stride_per_key=False, num_workers=1,
                                    recat=None, stride_per_rank=[2])


def test_a_kjt_built_from_traced_keys_is_one_graph_call():
    class Build(torch.nn.Module):
        def forward(self, keys: List[str], values: torch.Tensor, lengths: torch.Tensor) -> Tuple[KeyedJaggedTensor, int]:
            out = KeyedJaggedTensor(keys, values, None, lengths)
            return out, out.stride()

    class Rebuild(torch.nn.Module):
        def forward(self, kjt: KeyedJaggedTensor) -> Tuple[KeyedJaggedTensor, int]:
            out = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights_or_none(), lengths=kjt.lengths())
            return out, out.stride()

    keys, values, lengths = ["a", "b"], torch.arange(6), torch.tensor([2, 0, 1, 3])
    built = symbolic_trace(Build())
    nodes = [n for n in built.graph.nodes if n.target is KeyedJaggedTensor]
    assert len(nodes) == 1 and "stride" in built.code
    for gm in (built, torch.jit.script(built)):
        kjt, stride = gm(keys, values, lengths)
        assert stride == 2 and kjt.keys() == keys and torch.equal(kjt.offsets(), torch.tensor([0, 2, 2, 3, 6]))
    rebuilt = symbolic_trace(Rebuild())
    source = KeyedJaggedTensor(keys, values, None, lengths)
    for gm in (rebuilt, torch.jit.script(rebuilt)):
        kjt, stride = gm(source)
        assert stride == 2 and torch.equal(kjt.lengths(), lengths)
    # the metaclass does not hide the constructor's signature
    assert list(inspect.signature(KeyedJaggedTensor).parameters)[:5] == ["keys", "values", "weights", "lengths", "offsets"]
    # the checks still run when the graph does
    with pytest.raises(Exception, match="sum\\(lengths\\) = 7"):
        built(keys, values, torch.tensor([2, 0, 2, 3]))


def test_empty_lengths_given_as_float_or_2d_are_int32():
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), lengths=torch.tensor([]))
    assert kjt.lengths().dtype == torch.int32 and kjt.stride() == 0 and kjt["a"].lengths().numel() == 0
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), offsets=torch.tensor([]))
    assert kjt.offsets().dtype == torch.int32 and kjt.lengths().numel() == 0
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([]), lengths=torch.tensor([[], []]), length_per_key=[0, 0])
    for jt in kjt.to_dict().values():  # batch size 0: empty offsets, as JaggedTensor.empty()'s
        assert jt.lengths().numel() == 0 and jt.offsets().numel() == 0 and jt.offsets().dtype == torch.int32
    assert KeyedJaggedTensor(keys=["a"], values=torch.tensor([]), lengths=torch.tensor([]), stride_per_key_per_rank=[[]]).stride() == 0
    assert JaggedTensor(values=torch.tensor([]), lengths=torch.tensor([])).offsets().tolist() == [0]
    # an empty tensor carries no data; a float tensor that does stays refused, with an error that is a ValueError
    # and TorchRec's AssertionError
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="lengths must be an integer tensor, got torch.float32"):
            KeyedJaggedTensor(keys=["a"], values=torch.arange(2), lengths=torch.tensor([2.0]))
        with pytest.raises(error, match="offsets must be an integer tensor, got torch.float64"):
            JaggedTensor(values=torch.arange(2), offsets=torch.tensor([0.0, 2.0], dtype=torch.float64))


def test_no_keys_needs_no_lengths_but_keys_do():
    assert str(KeyedJaggedTensor([], torch.Tensor())) == "KeyedJaggedTensor()\n"
    assert KeyedJaggedTensor([], torch.Tensor()).stride() == 0
    with pytest.raises(ValueError, match="sum\\(lengths\\) = 0 but values has 2"):
        KeyedJaggedTensor([], torch.arange(2))
    with pytest.raises(ValueError, match="give lengths or offsets"):
        KeyedJaggedTensor(["a"], torch.arange(2))


def test_meta_tensors_build_and_sync():
    meta = torch.device("meta")
    values = torch.empty(10, device=meta)
    lengths = torch.empty(8, dtype=torch.int64, device=meta)
    offsets = torch.empty(9, dtype=torch.int64, device=meta)
    for kjt in (KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c", "d"], values=values, lengths=lengths, weights=values),
                KeyedJaggedTensor.from_offsets_sync(keys=["a", "b", "c", "d"], values=values, offsets=offsets, weights=values)):
        assert kjt.length_per_key() == [4, 2, 2, 2] and kjt.stride() == 2  # an even split, as TorchRec on meta
        assert KeyedJaggedTensor.from_jt_dict(kjt.to_dict()).values().is_meta
    empty = KeyedJaggedTensor.from_lengths_sync(keys=[], values=torch.tensor([], device=meta), lengths=torch.tensor([], device=meta))
    assert empty.lengths().dtype == torch.int32 and empty.length_per_key() == []


def test_lengths_or_none_reports_what_was_given_or_asked_for():
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(3), offsets=torch.tensor([0, 1, 3]))
    assert kjt.lengths_or_none() is None and kjt.offsets_or_none() is not None
    assert kjt.to("cpu").lengths_or_none() is None
    assert torch.equal(kjt.lengths(), torch.tensor([1, 2])) and kjt.lengths_or_none() is kjt.lengths()
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 2]))
    assert kjt.offsets_or_none() is None and kjt.offsets().tolist() == [0, 1, 3] and kjt.offsets_or_none() is not None


def test_pytree_round_trip_keeps_batch_sizes_inverse_indices_and_what_was_given():
    inverse = torch.tensor([[0, 1, 0], [0, 0, 0]])
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(8.0), weights=torch.rand(8),
                            offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32),
                            stride_per_key_per_rank=[[2], [4]], inverse_indices=(["b", "a"], inverse))
    leaves, spec = pytree.tree_flatten(kjt)
    # TorchRec's six: values, weights, lengths (None: built from offsets), offsets, [F, R] batch sizes, inverse
    assert len(leaves) == 6 and leaves[0] is kjt.values() and leaves[2] is None
    assert leaves[4].tolist() == [[2], [4]] and leaves[5] is inverse
    back = pytree.tree_unflatten(leaves, spec)
    assert back.lengths_or_none() is None and torch.equal(back.offsets(), kjt.offsets())
    assert back.stride_per_key_per_rank() == [[2], [4]] and back.stride() == 3
    assert back.inverse_indices()[0] == ["b", "a"]  # the names, not the keys (TorchRec would say ["a", "b"])
    assert _read(back) == _read(kjt)
    mapped = pytree.tree_map(lambda t: t * 2 if t.is_floating_point() else t, kjt)
    assert torch.equal(mapped.values(), kjt.values() * 2)
    plain = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(4), lengths=torch.tensor([1, 0, 2, 1]))
    leaves, spec = pytree.tree_flatten(plain)
    short = pytree.TreeSpec(type=spec.type, context=spec.context, children_specs=spec.children_specs[:4])
    assert _read(pytree.tree_unflatten(leaves[:4], short)) == _read(plain)
    with pytest.raises(ValueError):
        pytree.tree_unflatten(leaves + leaves, spec)
