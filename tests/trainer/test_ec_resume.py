"""`recship train` shards EmbeddingCollection tables as the planner says; a run whose checkpoint holds them replicated
(dense parameters, as `recship train` trained them before it sharded EmbeddingCollections) resumes with them still
replicated: its dense optimizer's state holds them."""

from dataclasses import asdict

from recship.trainer import train as train_module
from recship.trainer.checkpoint_reader import CheckpointReader
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder
from recship.trainer.train import TrainConfig, launch

ARGS = {"num_users": 20, "num_items": 40, "num_countries": 4, "num_categories": 6, "dim": 8, "num_dense": 4}
HISTORY = "history.embeddings.history_items.weight"


def _config(out, steps: int, resume: bool = False) -> TrainConfig:
    return TrainConfig(out=str(out), steps=steps, batch_size=16, model="recship.models:TwoTower", model_args=ARGS, eval_every=0,
                       eval_batches=1, checkpoint_every=0, progress=False, plot=False, resume=resume)


def _newest(out) -> CheckpointReader:
    return CheckpointReader(sorted((out / "checkpoints").iterdir())[-1])


def test_the_history_table_is_planned_and_sharded(tmp_path):
    launch(_config(tmp_path, 2))
    reader = _newest(tmp_path)
    assert reader.meta["tables"]["history/history_items"]["sharding_type"] == "table_wise"  # one rank: the planner's choice
    assert HISTORY not in reader.meta["dense_keys"]
    assert HISTORY in reader.dense_state_dict()  # gathered whole for export


def test_a_checkpoint_with_a_replicated_history_table_resumes_with_it_replicated(tmp_path, monkeypatch):
    with monkeypatch.context() as m:  # the CLI before it sharded EmbeddingCollections: an EBC sharder only
        m.setattr(train_module, "_sharders", lambda optimizer: [EmbeddingBagCollectionSharder(asdict(optimizer))])
        launch(_config(tmp_path, 2))
    before = _newest(tmp_path)
    assert HISTORY in before.meta["dense_keys"] and "history/history_items" not in before.meta["tables"]
    summary = launch(_config(tmp_path, 4, resume=True))
    assert summary["steps"] == 4
    after = _newest(tmp_path)
    assert after.step == 4 and HISTORY in after.meta["dense_keys"]
    assert after.plan.get_plan_for_module("history")["history_items"].sharding_type == "data_parallel"
    assert not (after.dense_state_dict()[HISTORY] == before.dense_state_dict()[HISTORY]).all()  # it went on training
