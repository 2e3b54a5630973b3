"""Where a data-parallel table's weight sits in a recship checkpoint: TorchRec's name since the sharded state_dict is
TorchRec's, the old ``data_parallel.<table>`` name in checkpoints written before (both still read)."""

from recship.trainer.checkpoint_reader import data_parallel_key


def test_data_parallel_tables_are_read_under_torchrecs_name_or_the_old_one():
    new = {"dense_keys": ["sparse.embedding_bags.t2.weight", "over.0.weight"]}
    old = {"dense_keys": ["sparse.data_parallel.t2", "over.0.weight"]}
    assert data_parallel_key(new, "sparse", "t2") == "sparse.embedding_bags.t2.weight"
    assert data_parallel_key(old, "sparse", "t2") == "sparse.data_parallel.t2"
    assert data_parallel_key({"dense_keys": ["embedding_bags.t.weight"]}, "", "t") == "embedding_bags.t.weight"
