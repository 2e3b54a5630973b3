"""Training application: exact resume, resharding on load, atomic saves, corrupt checkpoints, AUC."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from recship.trainer.checkpoint import load_checkpoint
from recship.trainer.checkpoint_reader import CheckpointError, CheckpointReader, latest_checkpoint, read_metadata
from recship.trainer.metrics import auc
from recship.trainer.train import TrainConfig, launch


def small(out, **kw):
    base = dict(
        out=str(out), steps=8, batch_size=32, num_embeddings_per_feature=[40] * 26, embedding_dim=8,
        dense_arch=[16], over_arch=[16], eval_every=0, eval_batches=2, checkpoint_every=4, progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _tables(path):
    r = CheckpointReader(path)
    return {cfg.name: w for _, cfg, w in r.tables()}, r.dense_state_dict()


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_exact(tmp_path, nproc):
    straight = launch(small(tmp_path / "a", steps=8, nproc_per_node=nproc))
    first = launch(small(tmp_path / "b", steps=4, nproc_per_node=nproc))
    resumed = launch(small(tmp_path / "b", steps=8, nproc_per_node=nproc, resume=True))
    assert resumed["resumed_from"].endswith("step_00000004")
    losses = first["losses"] + resumed["losses"]
    assert len(losses) == 8
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(straight["losses"]), atol=1e-6, rtol=0)
    a_tables, a_dense = _tables(straight["checkpoint"])
    b_tables, b_dense = _tables(resumed["checkpoint"])
    for name in a_tables:
        torch.testing.assert_close(b_tables[name], a_tables[name], atol=1e-6, rtol=0)
    for name in a_dense:
        torch.testing.assert_close(b_dense[name], a_dense[name], atol=1e-6, rtol=0)


def _gathered_after_load(rank, world_size, checkpoint, sharding):
    """Builds a DMP under a new plan, loads the checkpoint, gathers tables and row-wise states."""
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig
    from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
    from recship.trainer.model_parallel import DistributedModelParallel
    from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

    config = DLRMConfig(**small("unused", sharding=sharding).entry_point()[1])
    model = BuiltinDLRM(config, device="meta")
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType(sharding)]) for t in config.tables()}
    optim = FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints, optimizer=optim).collective_plan(model)
    dmp = DistributedModelParallel(model, plan=plan, optimizer=optim)
    dense_opt = torch.optim.Adagrad(dmp.dense_parameters(), lr=0.05)
    load_checkpoint(checkpoint, dmp, dense_opt)
    sharded = dmp.sharded_modules()[0]
    tables = {t.name: sharded.gather_table(t.name) for t in config.tables()}
    # row-wise state per row: every shard of a row must carry the saved value
    states = {}
    for (table, idx), st in sharded.local_optimizer_states().items():
        r0 = sharded._plan[table].shards[idx].shard_offsets[0]
        states[f"{table}/{idx}"] = (r0, st[0].clone())
    return tables, states, {k: v.clone() for k, v in dmp.unwrapped.over_arch.state_dict().items()}


@pytest.fixture(scope="module")
def row_wise_run(tmp_path_factory):
    """(run folder, its checkpoint): 4 steps on 2 ranks, row-wise; trained once, each test resumes a copy."""
    out = tmp_path_factory.mktemp("row_wise_run")
    saved = launch(small(out, steps=4, nproc_per_node=2, sharding="row_wise"))
    return out, Path(saved["checkpoint"])


@pytest.mark.parametrize("world_size, sharding", [(1, "table_wise"), (3, "column_wise"), (2, "table_wise")])
def test_checkpoint_reshards_on_load(row_wise_run, tmp_path, world_size, sharding):
    from gloo_ranks import run_ranks

    run, checkpoint = row_wise_run
    shutil.copytree(run, tmp_path, dirs_exist_ok=True)
    saved = {"checkpoint": str(tmp_path / checkpoint.relative_to(run))}
    want_tables, want_dense = _tables(saved["checkpoint"])
    # the saved row-wise adagrad state, read back with DCP in one process
    import torch.distributed.checkpoint as dcp

    want_state = {}
    for name in want_tables:
        t = torch.zeros(40, 1)
        dcp.load({f"tables/sparse_arch.embedding_bag_collection/{name}/state0": t}, checkpoint_id=saved["checkpoint"], no_dist=True)
        want_state[name] = t[:, 0]
    assert any(float(s.abs().sum()) > 0 for s in want_state.values())
    results = run_ranks(_gathered_after_load, world_size, saved["checkpoint"], sharding)
    tables, _, dense = results[0]
    for name, w in want_tables.items():
        torch.testing.assert_close(tables[name], w, atol=0, rtol=0)
    for k, v in dense.items():
        torch.testing.assert_close(v, want_dense[f"over_arch.{k}"], atol=0, rtol=0)
    for _, states, _ in results:
        for key, (r0, st) in states.items():
            table = key.split("/")[0]
            torch.testing.assert_close(st, want_state[table][r0 : r0 + st.numel()], atol=1e-7, rtol=0)
    # and training continues under the new world size and plan
    more = launch(small(tmp_path, steps=6, nproc_per_node=world_size, sharding=sharding, resume=True))
    assert more["steps"] == 6 and len(more["losses"]) == 2
    assert all(l == l and l < 2 for l in more["losses"])


def test_killed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    launch(small(tmp_path, steps=4))
    import recship.trainer.checkpoint as ckpt

    real_save = ckpt.dcp.save

    left = []

    def dying_save(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)
        # what a SIGKILL here leaves behind (an interrupt is cleaned up: the save removes its own folder)
        copy = Path(checkpoint_id).parent / (Path(checkpoint_id).name + "-killed")
        shutil.copytree(checkpoint_id, copy)
        left.append(copy)
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(ckpt.dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        launch(small(tmp_path, steps=8, resume=True))
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert ".tmp-" in left[0].name and sorted(p.name for p in root.iterdir() if ".tmp-" in p.name) == [left[0].name]
    assert latest_checkpoint(root).name == "step_00000004"  # the half-written one is there, but never chosen
    resumed = launch(small(tmp_path, steps=8, resume=True))
    assert resumed["resumed_from"].endswith("step_00000004") and resumed["steps"] == 8


def test_corrupt_checkpoints_name_the_missing_piece(tmp_path):
    summary = launch(small(tmp_path, steps=4, checkpoint_every=0))
    good = Path(summary["checkpoint"])
    for remove, message in [(".metadata", "\\.metadata"), ("recship.json", "recship.json is missing")]:
        bad = tmp_path / f"bad_{remove}"
        shutil.copytree(good, bad)
        (bad / remove).unlink()
        with pytest.raises(CheckpointError, match=message):
            read_metadata(bad)
    bad = tmp_path / "bad_data"
    shutil.copytree(good, bad)
    next(bad.glob("*.distcp")).unlink()
    with pytest.raises(CheckpointError, match="__0_0.distcp is missing"):
        list(CheckpointReader(bad).tables())
    with pytest.raises(CheckpointError, match="not found"):
        read_metadata(tmp_path / "nope")


def test_the_checkpoint_reader_streams_tables_and_records_the_entry_point(tmp_path):
    summary = launch(small(tmp_path, steps=4))
    reader = CheckpointReader(summary["checkpoint"])
    entry = reader.config["entry_point"]  # the built-in DLRM is recorded as the entry point it is built from
    assert reader.step == 4 and entry["model"] == "recship.models.dlrm:builtin" and entry["args"]["embedding_dim"] == 8
    names = [cfg.name for _, cfg, _ in reader.tables()]
    assert names == [f"t_cat_{i}" for i in range(26)]
    dense = reader.dense_state_dict()
    assert "over_arch.model.1.weight" in dense and "dense_arch.model._mlp.0._linear.weight" in dense
    assert reader.plan is not None and set(reader.plan.get_plan_for_module("sparse_arch.embedding_bag_collection")) == set(names)

    # a checkpoint of the built-in DLRM before it became TorchRec's DLRM (other parameter names) is refused, named
    earlier = tmp_path / "earlier"
    shutil.copytree(summary["checkpoint"], earlier)
    meta_file = next(p for p in earlier.iterdir() if p.suffix == ".json" and "entry_point" in p.read_text())
    meta = json.loads(meta_file.read_text())
    meta["config"]["entry_point"]["model"] = "recship.models:dlrm"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"earlier recship \(recship.models:dlrm\).*train it again"):
        CheckpointReader(earlier)


def test_auc_matches_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=g).float()  # many ties
    labels = (torch.rand(200, generator=g) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert abs(auc(scores, labels) - float(pairwise)) < 1e-9


def test_training_learns_the_synthetic_task(tmp_path):
    summary = launch(small(tmp_path, steps=150, batch_size=128, num_embeddings_per_feature=[200] * 26, eval_batches=8, checkpoint_every=0))
    assert summary["final_eval"]["auc"] > 0.65
    first, last = summary["losses"][:10], summary["losses"][-10:]
    assert sum(last) / 10 < sum(first) / 10 - 0.03


def test_cli_config_file_yaml_and_json_with_flag_override(tmp_path, capsys):
    from recship.cli import main

    common = {"steps": 3, "batch_size": 16, "num_embeddings_per_feature": [20] * 26, "embedding_dim": 4,
              "dense_arch": [8], "over_arch": [8], "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0}
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("".join(f"{k}: {v}\n" for k, v in common.items()))
    assert main(["train", "--config", str(yaml_file), "--out", str(tmp_path / "y"), "--steps", "2", "--no-progress"]) == 0
    assert "trained 2 steps (steps 1-2) on 1 rank(s)" in capsys.readouterr().out  # the flag overrides the file
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({**common, "out": str(tmp_path / "j"), "progress": False}))
    assert main(["train", "--config", str(json_file)]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    json_file.write_text(json.dumps({"stepz": 3}))
    assert main(["train", "--config", str(json_file)]) == 2
    assert "unknown key 'stepz'" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "x"), "--optimizer", "adamw"]) == 2
    assert "unknown optimizer 'adamw'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_train_on_a_criteo_file(tmp_path):
    from test_data import ROWS, _line

    g = torch.Generator().manual_seed(0)
    lines = ["\t".join(_line(g, empty_every=(i % 4 == 0))) for i in range(100)]
    lines.insert(10, "garbage line")
    data = tmp_path / "train.tsv"
    data.write_text("\n".join(lines) + "\n")
    summary = launch(small(tmp_path / "run", steps=5, batch_size=16, num_embeddings_per_feature=ROWS,
                           data=str(data), eval_data=str(data), eval_every=5, checkpoint_every=0))
    assert summary["steps"] == 5 and len(summary["losses"]) == 5
    assert summary["final_eval"]["examples"] == 2 * 16


def test_run_safety_refuse_overwrite_resume_keep_last(tmp_path, capsys):
    from recship.cli import main

    args = ["train", "--out", str(tmp_path), "--steps", "4", "--batch-size", "16", "--num-embeddings-per-feature", "20",
            "--embedding-dim", "4", "--dense-arch", "8", "--over-arch", "8", "--eval-every", "0", "--eval-batches", "1",
            "--checkpoint-every", "1", "--keep-last", "2", "--no-progress"]
    assert main(args) == 0
    assert "trained 4 steps (steps 1-4)" in capsys.readouterr().out
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]  # --keep-last 2
    # a second run into the same folder is refused, with the flags that decide it named
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints (newest: step_00000004)" in err and "--resume" in err and "--overwrite" in err
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]  # nothing lost
    # --resume continues and says from where
    assert main(args[:4] + ["6"] + args[5:] + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from step 4 (world 1 -> 1)" in out and "trained 2 steps (steps 5-6)" in out
    assert main(args[:4] + ["6"] + args[5:] + ["--resume"]) == 0
    assert "nothing to train: the run is already at step 6" in capsys.readouterr().out
    # --overwrite starts over
    assert main(args + ["--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "deleted the checkpoints" in out and "trained 4 steps (steps 1-4)" in out
    assert main(args + ["--overwrite", "--resume"]) == 2
    assert "contradict" in capsys.readouterr().err


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_reader_maps_tables_equal_to_dcp_load(tmp_path, monkeypatch, sharding):
    """CheckpointReader maps each table's bytes from DCP's files (one chunk per shard, joined);
    reference: dcp.load of the same key into a fresh tensor. The mapped path must serve every
    table (dcp.load is made to fail while they are read)."""
    import recship.trainer.checkpoint_reader as checkpoint_reader

    summary = launch(small(tmp_path, steps=2, nproc_per_node=2, sharding=sharding, num_embeddings_per_feature=[37] * 26))
    reader = CheckpointReader(summary["checkpoint"])
    keys = {cfg.name: (mpath, key, t) for (mpath, cfg), (key, t) in zip(reader.table_configs(), reader.meta["tables"].items())}
    load = checkpoint_reader.load_tensors

    def refuse(*args, **kwargs):
        raise AssertionError("dcp.load was used for a table")

    monkeypatch.setattr(checkpoint_reader, "load_tensors", refuse)
    tables = {cfg.name: w for _, cfg, w in reader.tables()}
    monkeypatch.setattr(checkpoint_reader, "load_tensors", load)
    for name, (mpath, key, t) in keys.items():
        dcp_key = f"dense/{mpath}.embedding_bags.{name}.weight" if t["data_parallel"] else f"tables/{key}/weight"
        want = torch.full((37, 8), float("nan"))
        load({dcp_key: want}, reader.path, no_dist=True)
        assert tables[name].shape == (37, 8) and torch.equal(tables[name].view(torch.int32), want.view(torch.int32)), name
        tables[name][0, 0] += 1  # the mapping is copy-on-write: the checkpoint stays as it was
    again = CheckpointReader(summary["checkpoint"])
    first = next(iter(keys))
    assert not torch.equal(again.table(keys[first][0], first), tables[first])


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_diverging_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, nproc):
    """Learning rates of 1e8 blow the loss up to NaN within a few steps: training stops with TrainingDiverged
    naming the step, before that step updates the model, and no checkpoint with NaN or inf weights exists.
    Reference: every saved checkpoint's tables and dense parameters, read back and checked with torch.isfinite."""
    from recship.trainer.train import TrainingDiverged

    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d+: .*(the loss is nan|NaN or inf)") as e:
        launch(small(tmp_path, steps=40, checkpoint_every=1, dense_lr=1e8, embedding_lr=1e8, nproc_per_node=nproc))
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert "is the last good state" in str(e.value) or "no checkpoint was saved" in str(e.value)
    for path in saved:
        tables, dense = _tables(path)
        assert all(bool(torch.isfinite(w).all()) for w in [*tables.values(), *dense.values()]), path
    if saved:
        assert str(saved[-1]) in str(e.value)
