"""TorchRec's module helpers (``torchrec.modules.utils``, in recship.models.layers): construct_jagged_tensors and its
inference form against per-feature slicing, deterministic_dedup against a Python loop, jagged_index_select_with_empty
against list indexing, and the module-list builders; seeded inputs."""

import pytest
import torch
from torch import nn

from recship.models import layers as U
from recship.sparse import KeyedJaggedTensor, KTRegroupAsDict, Multistreamable, Pipelineable


def _kjt(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (9,), generator=g)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], values, lengths), torch.randn(int(lengths.sum()), 4, generator=g)


def _by_hand(kjt, rows):
    """{key: (lengths, rows, ids)} cut with Python offsets."""
    out, start = {}, 0
    for key in kjt.keys():
        n = int(kjt[key].lengths().sum())
        out[key] = (kjt[key].lengths(), rows[start:start + n], kjt.values()[start:start + n])
        start += n
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_construct_jagged_tensors_cuts_each_features_rows(seed):
    kjt, rows = _kjt(seed)
    got = U.construct_jagged_tensors(rows, kjt, ["a", "b", "c"], need_indices=True)
    for key, (lengths, expected, ids) in _by_hand(kjt, rows).items():
        assert torch.equal(got[key].lengths(), lengths) and torch.equal(got[key].values(), expected)
        assert torch.equal(got[key].weights(), ids)
    assert U.construct_jagged_tensors(rows, kjt, ["a", "b", "c"])["a"].weights_or_none() is None


def test_reverse_indices_expand_deduplicated_rows_by_index_select_or_gather():
    kjt, _ = _kjt(2)
    unique, inverse = torch.unique(kjt.values(), return_inverse=True)
    table = torch.randn(len(unique), 4, generator=torch.Generator().manual_seed(3))
    full = table[inverse]
    for gather in (False, True):
        got = U.construct_jagged_tensors(table, kjt, ["a", "b", "c"], reverse_indices=inverse, use_gather_select=gather)
        for key, (_, expected, _) in _by_hand(kjt, full).items():
            assert torch.equal(got[key].values(), expected)


def test_a_repeated_name_joins_its_features_rows_side_by_side_in_the_permuted_order():
    lengths = torch.tensor([1, 2, 0, 3, 1, 2, 1, 2, 0])  # a and c: the same lengths (two column shards)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], torch.arange(12), lengths)
    rows = torch.randn(12, 4, generator=torch.Generator().manual_seed(4))
    got = U.construct_jagged_tensors(rows, kjt, ["x", "y", "x"], features_to_permute_indices={"x": [1, 0]})
    assert list(got) == ["x", "y"]
    assert torch.equal(got["x"].values(), torch.cat([rows[9:12], rows[0:3]], 1))
    assert torch.equal(got["y"].values(), rows[3:9])


def test_inference_form_takes_plain_tensors_and_drops_padding():
    kjt, rows = _kjt(5)
    padded = torch.cat([rows, torch.full((3, 4), 7.0)])
    got = U.construct_jagged_tensors_inference(padded, kjt.lengths().view(3, -1), kjt.values(), ["a", "b", "c"],
                                               need_indices=True, remove_padding=True)
    for key, (lengths, expected, ids) in _by_hand(kjt, rows).items():
        assert torch.equal(got[key].lengths(), lengths) and torch.equal(got[key].values(), expected)
        assert torch.equal(got[key].weights(), ids)


def test_sequence_vbe_context_reorders_segments():
    rows = torch.randn(6, 2, generator=torch.Generator().manual_seed(6))
    ctx = U.SequenceVBEContext(recat=torch.tensor([1, 0], dtype=torch.int32), unpadded_lengths=torch.tensor([2, 4]),
                               reindexed_lengths=torch.tensor([[1, 3], [2, 0]]), reindexed_length_per_key=[4, 2])
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(6), torch.tensor([1, 1, 1, 3]))
    got = U.construct_jagged_tensors(rows, kjt, ["a", "b"], seq_vbe_ctx=ctx)
    assert torch.equal(got["a"].values(), rows[2:6]) and torch.equal(got["b"].values(), rows[0:2])
    assert got["a"].lengths().tolist() == [1, 3]
    assert isinstance(ctx, Multistreamable)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deterministic_dedup_keeps_each_ids_last_position(seed):
    ids = torch.randint(0, 8, (30,), generator=torch.Generator().manual_seed(seed))
    unique, last = U.deterministic_dedup(ids)
    expected = {}
    for i, x in enumerate(ids.tolist()):
        expected[x] = i
    assert unique.tolist() == sorted(expected) and last.tolist() == [expected[x] for x in sorted(expected)]


def test_jagged_index_select_with_empty():
    values = torch.randn(7, generator=torch.Generator().manual_seed(7))
    offsets = torch.tensor([2, 3, 7])  # rows of 2, 1 and 4: inclusive cumulative lengths, as output_offsets
    got = U.jagged_index_select_with_empty(values, torch.tensor([2, 0]), offsets, torch.tensor([4, 6]))
    assert torch.equal(got.flatten(), torch.cat([values[3:7], values[0:2]]))
    assert U.jagged_index_select_with_empty(values, torch.tensor([], dtype=torch.int64), offsets, torch.tensor([])).numel() == 0


def test_module_list_builders_and_output_dimension():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    nested = U.construct_modulelist_from_single_module(base, (2, 3))
    assert len(nested) == 2 and all(len(row) == 3 for row in nested)
    linears = [m[0] for row in nested for m in row]
    assert all(torch.equal(m.bias, torch.zeros(2)) for m in linears)
    assert not torch.equal(linears[0].weight, linears[1].weight)  # each copy re-initialised
    bound = (6 / (3 + 2)) ** 0.5  # xavier-uniform's
    assert all(m.weight.abs().max() <= bound for m in linears)
    assert U.check_module_output_dimension(nested[0], 3, 2) and not U.check_module_output_dimension(base, 3, 3)
    assert U.get_module_output_dimension(nn.Linear(3, 7), 3) == 7
    as_lists = U.convert_list_of_modules_to_modulelist([[nn.ReLU(), nn.ReLU()]], (1, 2))
    assert isinstance(as_lists[0], nn.ModuleList) and len(as_lists[0]) == 2
    with pytest.raises(ValueError, match=r"counts of modules \(1\) do not match"):
        U.convert_list_of_modules_to_modulelist([nn.ReLU()], (2,))
    assert isinstance(U.extract_module_or_tensor_callable(nn.ReLU), nn.ReLU)
    assert U.extract_module_or_tensor_callable(torch.relu) is torch.relu
    with pytest.raises(ValueError, match="must return a torch.nn.Module"):
        U.extract_module_or_tensor_callable(lambda: 3)


def test_state_helpers():
    regroup = KTRegroupAsDict([["a"]], ["x"])
    regroup._is_inited = True
    U.reset_module_states_post_sharding(nn.Sequential(regroup))
    assert not regroup._is_inited
    holder = nn.Module()
    holder.register_buffer("_hash_zch_bucket", torch.zeros(1))
    assert U.make_hash_zch_buckets_non_persistent(nn.Sequential(holder)) == 1
    assert "_hash_zch_bucket" not in holder.state_dict()
    assert isinstance(KeyedJaggedTensor.empty(), Pipelineable)
