"""TorchRec's examples as their users run them, through docs/torchrec.md's import map: golden_training (train_dlrm.py),
retrieval (two_tower_train.py) and BERT4Rec (bert4rec_main.py), written out in tests/snippets/torchrec_example_*.txt
with only the CPU changes TorchRec itself needs there (each snippet's header says what is shrunk or left out).

Each program initialises its own process group from the environment (LOCAL_RANK, MASTER_PORT, ...), as under
torchrun; one spawn of 2 processes runs the three on 2 gloo ranks. The test owns the data: a learnable synthetic
target (labels a function of the ids), each rank's batches a slice of one global batch. Checked:
- every loss is finite and the loss falls over the steps;
- each run equals a plain-PyTorch reference on one process, started from the run's initial weights (TorchRec draws a
  meta-device table shard by shard): the unsharded model, torch's optimizers for the dense part and fbgemm's update
  rule for the tables (row-wise Adagrad keeps a state per row of each column block the planner made), every step
  losses and at the end every parameter (sharded tables gathered) within float32 reduction-order noise. Golden and
  two-tower step on the global batch (their per-rank BCE means average to its mean); BERT4Rec steps on the mean of
  the ranks' losses (its CrossEntropyLoss(ignore_index=0) is a mean over each rank's masked items);
- two-tower's CPU model gathered on rank 0 (state_dict_to_device + state_dict_gather) and its item embeddings;
  BERT4Rec's test Recall/NDCG equal the reference model's; recalls_and_ndcgs_for_ks against a numpy count;
- what recship refuses on CPU where TorchRec's fbgemm fails (fused Adam) or ignores the setting (table weight decay).

Recorded with TorchRec 1.8.0 (CPU, 2 gloo ranks, the same torch and fbgemm, this data): its own train_dlrm.py and
two_tower_train.py plan these tables table-wise, and their losses and weights match these references (fed TorchRec's
blocks and eps) within 2e-7 and 5e-6; the BERT4Rec snippet run by TorchRec itself gives bit for bit the same plan,
step losses, weights and metrics as under recship.
"""

import gc
import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gloo_ranks import gather_whole
from recship.datasets import Batch
from recship.sparse import KeyedJaggedTensor
from tutorials.notebook import run_snippet

WORLD, LOCAL_B, STEPS = 2, 16, 16
TOL = dict(rtol=2e-5, atol=2e-6)  # float32 sums over ranks vs over one batch: only the reduction order differs
# tables of 1000 rows (TorchRec 1.8.0's planner shards them table-wise; it replicates tables of 20), ids in [0, 20)
# so that 16 steps of 32 examples see each id often enough to learn
GOLDEN = dict(num_embeddings=1000, embedding_dim=16, dense_arch_layer_sizes=[16, 16], over_arch_layer_sizes=[16, 1],
              num_iterations=STEPS)
TWO_TOWER = dict(num_embeddings=1000, embedding_dim=16, layer_sizes=[16], learning_rate=0.05, num_iterations=STEPS)
IDS = 20
# TorchRec's tests/test_bert4rec_main.py "random" settings, smaller; lr 0.01 (its 0.001) so 3 epochs show learning;
# weight_decay 0: on CPU recship refuses a fused table's weight decay (fbgemm's CPU kernels ignore it), see below
BERT4REC = ["--dataset_name", "random", "--random_user_count", "30", "--random_item_count", "40", "--random_size",
            "300", "--lr", "0.01", "--mask_prob", "0.2", "--weight_decay", "0", "--train_batch_size", "8",
            "--val_batch_size", "8", "--test_batch_size", "8", "--max_len", "12", "--emb_dim", "16", "--num_epochs", "3"]
SEED = 0


# -- launching: the programs call dist.init_process_group themselves -----------------------------------------------


def _free_ports(n: int) -> List[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _as_torchrun(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))


def _finish_group() -> None:
    gc.collect()  # reference cycles first, so gloo's threads are joined before the next group
    dist.destroy_process_group()


def _worker(rank: int, out_dir: str, ports: List[int]) -> None:
    torch.set_num_threads(1)
    results: Dict[str, Any] = {}
    for port, (name, run) in zip(ports, RUNS.items()):
        _as_torchrun(rank, WORLD, port)
        results[name] = run(rank)
        _finish_group()
    if rank == 0:
        _as_torchrun(0, 1, ports[-1])
        results["refused"] = _bert4rec_refusals()
        _finish_group()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ran() -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(out_dir, _free_ports(len(RUNS) + 1)), nprocs=WORLD)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- what the test puts into the programs ---------------------------------------------------------------------------


def _recording(dmp_class: Callable, seen: Dict[str, Any], dropout: bool = True) -> Callable:
    """DistributedModelParallel that records the model's initial state (tables gathered whole: TorchRec draws a
    meta-device table shard by shard) and its tables' column blocks; with dropout=False it first zeroes every Dropout
    (masks are drawn per rank; a reference could not draw the same)."""

    def build(*args, **kwargs):
        if not dropout:
            for m in kwargs["module"].modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
        model = dmp_class(*args, **kwargs)
        eps = {tbe.optimizer_args.eps for m in model.modules() for tbe in getattr(m, "_tbes", [])}  # fbgemm's TBEs
        seen.update(initial=_whole_state(model), blocks=_column_blocks(model.plan), plan=str(model.plan), eps=eps)
        return model

    return build


def _global_batch(step: int, features: int, num_dense: int):
    """Step ``step``'s global batch: ids [features, WORLD * LOCAL_B] (one per feature and example), dense features."""
    ids = torch.randint(0, IDS, (features, WORLD * LOCAL_B), generator=torch.Generator().manual_seed(100 + step))
    dense = torch.randn(WORLD * LOCAL_B, num_dense, generator=torch.Generator().manual_seed(200 + step))
    return ids, dense


def _batches(keys: List[str], num_dense: int, label: Callable[[torch.Tensor], torch.Tensor],
             pick: slice = slice(None)) -> List[Batch]:
    """Each step's global batch, examples ``pick`` of it (a rank's: [rank * LOCAL_B, (rank + 1) * LOCAL_B));
    labels = label(ids), a learnable function of the ids."""
    batches = []
    for step in range(STEPS):
        ids, dense = _global_batch(step, len(keys), num_dense)
        ids, dense, labels = ids[:, pick], dense[pick], label(ids)[pick].int()
        kjt = KeyedJaggedTensor(keys=keys, values=ids.reshape(-1), lengths=torch.ones(ids.numel(), dtype=torch.int32))
        batches.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return batches


def _rank_slice(rank: int) -> slice:
    return slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)


def _whole_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every state_dict entry, sharded tables gathered whole (on rank 0; a collective)."""
    return {k: gather_whole(v) for k, v in model.state_dict().items()}


def _column_blocks(plan) -> Dict[str, List[tuple]]:
    """Each table's column blocks (offset, width) in a ShardingPlan: a fused row-wise optimizer keeps one state per
    row of each block (fbgemm's, one per row of each TBE table), so a column-wise table trains per block."""
    blocks: Dict[str, List[tuple]] = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            assert ps.sharding_type.value != "data_parallel", table  # replicas train by torch's optimizer, not here
            shards = ps.sharding_spec.shards
            blocks[table] = sorted({(s.shard_offsets[1], s.shard_sizes[1]) for s in shards})
    return blocks


# -- the three programs ---------------------------------------------------------------------------------------------


def _golden(rank: int) -> Dict[str, Any]:
    code = run_snippet("torchrec_example_golden_training")
    keys = code["DEFAULT_CAT_NAMES"]
    # learnable: the label is whether the first categorical id is in the lower half of the ids drawn
    code["_get_random_dataset"] = lambda num_embeddings, batch_size=32: _batches(
        keys, len(code["DEFAULT_INT_NAMES"]), _golden_label, _rank_slice(rank))
    seen: Dict[str, Any] = {}
    code["DistributedModelParallel"] = _recording(code["DistributedModelParallel"], seen)
    torch.manual_seed(SEED)
    model, outputs = code["train"](**GOLDEN)
    return {"losses": torch.stack([o[0] for o in outputs]), **seen, "state": _whole_state(model),
            "fused": type(model.fused_optimizer).__name__}


def _golden_label(ids: torch.Tensor) -> torch.Tensor:
    return ids[0] < IDS // 2


def _two_tower(rank: int) -> Dict[str, Any]:
    code = run_snippet("torchrec_example_two_tower")
    keys = code["DEFAULT_RATINGS_COLUMN_NAMES"][:2]
    code["get_dataloader"] = lambda batch_size, num_embeddings, pin_memory=False, num_workers=0: _batches(
        keys, 0, _two_tower_label, _rank_slice(rank))
    seen: Dict[str, Any] = {}
    code["DistributedModelParallel"] = _recording(code["DistributedModelParallel"], seen)
    torch.manual_seed(SEED)
    cpu_model, item_embeddings, outputs = code["train"](**TWO_TOWER)
    return {"losses": torch.stack([o[0] for o in outputs]), "item_embeddings": item_embeddings, **seen,
            "cpu_state": None if cpu_model is None else {k: v.clone() for k, v in cpu_model.state_dict().items()}}


def _two_tower_label(ids: torch.Tensor) -> torch.Tensor:
    # 1 unless the user's and the movie's ids are both in the upper half: the towers end in a ReLU, so their dot
    # product (the logit) is >= 0 and a negative needs disjoint supports, which this label allows
    return ~((ids[0] >= IDS // 2) & (ids[1] >= IDS // 2))


def _seed_all() -> None:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


def _bert4rec(rank: int) -> Dict[str, Any]:
    code = run_snippet("torchrec_example_bert4rec")
    seen: Dict[str, Any] = {}
    code["DMP"] = _recording(code["DMP"], seen, dropout=False)
    _seed_all()  # every rank draws the same ratings and masks (the example leaves them unseeded)
    model, history = code["main"](BERT4REC)
    return {"history": history, **seen, "state": _whole_state(model)}


def _bert4rec_refusals() -> Dict[str, str]:
    """On one process: what recship refuses on CPU, as TorchRec's fbgemm does (or silently ignores)."""
    code = run_snippet("torchrec_example_bert4rec")
    dist.init_process_group(backend="gloo")  # as main() does
    refused = {}
    for name, fused_params in {"adam": {"optimizer": code["EmbOptimType"].ADAM, "learning_rate": 0.01},
                               "weight_decay": {"optimizer": code["EmbOptimType"].EXACT_ADAGRAD, "learning_rate": 0.01,
                                                "weight_decay": 1e-5}}.items():
        model = code["BERT4Rec"](vocab_size=10, max_len=4, emb_dim=4, nhead=2, num_layers=1)
        try:
            code["DMP"](module=model, device=torch.device("cpu"), sharders=[code["EmbeddingCollectionSharder"](fused_params)])
            refused[name] = ""
        except ValueError as e:
            refused[name] = str(e)
    return refused


RUNS = {"golden": _golden, "two_tower": _two_tower, "bert4rec": _bert4rec}


# -- plain-PyTorch references, on one process -----------------------------------------------------------------------


def _rowwise_adagrad_step(weight: torch.Tensor, state: torch.Tensor, blocks: List[tuple], lr: float, eps: float) -> None:
    """fbgemm's exact row-wise Adagrad on each column block: state += mean(g^2) over the block's row,
    w -= lr g / (sqrt(state) + eps)."""
    for k, (c0, width) in enumerate(blocks):
        g = weight.grad[:, c0 : c0 + width]
        state[:, k] += (g * g).mean(1)
        weight.data[:, c0 : c0 + width] -= lr * g / (state[:, k : k + 1].sqrt() + eps)


def _train_reference(model: nn.Module, tables: Dict[str, nn.Parameter], blocks: Dict[str, List[tuple]],
                     dense: torch.optim.Optimizer, batches: List[Batch], lr: float, eps: float) -> List[float]:
    """The global batches through the unsharded model, the tables by row-wise Adagrad, the rest by ``dense``. One loss
    over both ranks' examples is the same step as the ranks' (each rank's loss the mean over its half; DDP and
    TorchRec's sharded backward average the gradients over the ranks)."""
    states = {name: torch.zeros(w.shape[0], len(blocks[name])) for name, w in tables.items()}
    losses = []
    for batch in batches:
        dense.zero_grad()
        for w in tables.values():
            w.grad = None
        loss = model(batch)[0]
        loss.backward()
        dense.step()
        with torch.no_grad():
            for name, w in tables.items():
                _rowwise_adagrad_step(w, states[name], blocks[name], lr, eps)
        losses.append(loss.item())
    return losses


def _golden_reference(initial: Dict[str, torch.Tensor], blocks: Dict[str, List[tuple]], eps: float):
    code = run_snippet("torchrec_example_golden_training")
    configs = [code["EmbeddingBagConfig"](name=f"t_{f}", embedding_dim=GOLDEN["embedding_dim"],
                                          num_embeddings=GOLDEN["num_embeddings"], feature_names=[f])
               for f in code["DEFAULT_CAT_NAMES"]]
    model = code["DLRMTrain"](code["DLRM"](embedding_bag_collection=code["EmbeddingBagCollection"](tables=configs),
                                           dense_in_features=len(code["DEFAULT_INT_NAMES"]),
                                           dense_arch_layer_sizes=GOLDEN["dense_arch_layer_sizes"],
                                           over_arch_layer_sizes=GOLDEN["over_arch_layer_sizes"]))
    model.load_state_dict(initial)
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags."
    tables = {n[len(prefix) : -len(".weight")]: p for n, p in model.named_parameters() if n.startswith(prefix)}
    dense = torch.optim.Adagrad([p for n, p in model.named_parameters() if not n.startswith(prefix)], lr=0.1)
    batches = _batches(code["DEFAULT_CAT_NAMES"], len(code["DEFAULT_INT_NAMES"]), _golden_label)
    losses = _train_reference(model, tables, blocks, dense, batches, 0.1, eps)
    return torch.tensor(losses), {k: v.detach() for k, v in model.state_dict().items()}


def _two_tower_reference(initial: Dict[str, torch.Tensor], blocks: Dict[str, List[tuple]], eps: float):
    code = run_snippet("torchrec_example_two_tower")
    keys = code["DEFAULT_RATINGS_COLUMN_NAMES"][:2]
    configs = [code["EmbeddingBagConfig"](name=f"t_{f}", embedding_dim=TWO_TOWER["embedding_dim"],
                                          num_embeddings=TWO_TOWER["num_embeddings"], feature_names=[f]) for f in keys]
    model = code["TwoTowerTrainTask"](code["TwoTower"](code["EmbeddingBagCollection"](tables=configs),
                                                       layer_sizes=TWO_TOWER["layer_sizes"]))
    model.load_state_dict(initial)
    prefix = "two_tower.ebc.embedding_bags."
    tables = {n[len(prefix) : -len(".weight")]: p for n, p in model.named_parameters() if n.startswith(prefix)}
    lr = TWO_TOWER["learning_rate"]
    # the example's Adam holds every named parameter; the fused tables have no .grad, so Adam leaves them
    dense = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith(prefix)], lr=lr)
    batches = _batches(keys, 0, _two_tower_label)
    losses = _train_reference(model, tables, blocks, dense, batches, lr, eps)
    return torch.tensor(losses), {k: v.detach() for k, v in model.state_dict().items()}


def _bert4rec_reference(initial: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """BERT4Rec in plain PyTorch on one process: the same data and initial weights, no dropout; each step each rank's
    loss on its own batch (CrossEntropyLoss(ignore_index=0) means over that rank's masked items: unlike a global mean,
    so the global batch cannot stand in), the step on their mean; torch's Adam on the dense parameters and fbgemm's
    exact-Adagrad rule (state += g^2, w -= lr g / (sqrt(state) + 1e-8)) on the item table."""
    code = run_snippet("torchrec_example_bert4rec")
    args = code["parse_args"](BERT4REC)
    _seed_all()
    raw = code["get_raw_dataframe"](args.dataset_name, args.random_user_count, args.random_item_count,
                                    args.random_size, args.min_rating, args.dataset_path)
    df = code["Bert4RecPreprocsser"](raw, args.min_rating, args.min_user_count, args.min_item_count, args.dataset_name,
                                     args.max_len, args.mask_prob, args.dupe_factor).get_processed_dataframes()
    model = code["BERT4Rec"](len(df["smap"]) + 2, args.max_len, emb_dim=args.emb_dim, nhead=args.nhead,
                             num_layers=args.num_layers, dropout=0.0)
    model.load_state_dict(initial)
    table = model.history.ec.embeddings["item_embedding"].weight
    dense = torch.optim.Adam([p for p in model.parameters() if p is not table], lr=args.lr, weight_decay=args.weight_decay)
    state = torch.zeros_like(table)  # EXACT_ADAGRAD from fused_params without eps: fbgemm's 1e-8 in both
    loaders = [code["Bert4RecDataloader"](df, args.train_batch_size, args.val_batch_size,
                                          args.test_batch_size).get_pytorch_dataloaders(r, WORLD) for r in range(WORLD)]
    ce = nn.CrossEntropyLoss(ignore_index=0)
    cpu = torch.device("cpu")
    losses: List[List[List[float]]] = []
    for epoch in range(args.num_epochs):
        for train_loader, _, _ in loaders:
            train_loader.sampler.set_epoch(epoch)
        epoch_losses: List[List[float]] = [[] for _ in range(WORLD)]
        model.train()
        for batches in zip(*(iter(train) for train, _, _ in loaders)):
            dense.zero_grad()
            table.grad = None
            total = torch.zeros(())
            for r, (seqs, labels) in enumerate(batches):
                logits = model(code["_to_kjt"](seqs, cpu))
                loss = ce(logits.view(-1, logits.size(-1)), labels.view(-1))
                epoch_losses[r].append(loss.item())
                total = total + loss / WORLD
            total.backward()
            dense.step()
            with torch.no_grad():
                state += table.grad**2
                table -= args.lr * table.grad / (state.sqrt() + 1e-8)
        losses.append(epoch_losses)
    model.eval()
    with torch.no_grad():
        per_rank = []
        for _, _, test_loader in loaders:
            batch_metrics = [code["_calculate_metrics"](model, batch, [1, 5, 10], cpu) for batch in test_loader]
            per_rank.append({k: sum(m[k] for m in batch_metrics) / len(batch_metrics) for k in batch_metrics[0]})
    test = {k: float(np.mean([m[k] for m in per_rank])) for k in ["Recall@1", "Recall@5", "Recall@10", "NDCG@5", "NDCG@10"]}
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "test": test}


# -- the checks ------------------------------------------------------------------------------------------------------


def _assert_learns(losses: torch.Tensor) -> None:
    assert torch.isfinite(losses).all(), losses
    third = max(1, len(losses) // 3)
    assert losses[-third:].mean() < losses[:third].mean() - 0.02, losses


def _assert_same_state(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], skip=(), tol=TOL) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        if key not in skip:
            torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m: f"{key}: {m}")


def test_golden_training_on_two_ranks_trains_as_the_plain_torch_reference(ran):
    two = [r["golden"] for r in ran]
    assert two[0]["fused"] == "CombinedOptimizer"
    assert "data_parallel" not in two[0]["plan"]  # the tables are sharded (recship's planner: column-wise)
    (eps,) = two[0]["eps"]  # recship's: 1e-10, see test_in_backward_row_wise_adagrad_keeps_fbgemms_eps
    losses, state = _golden_reference(two[0]["initial"], two[0]["blocks"], eps)
    mean = (two[0]["losses"] + two[1]["losses"]) / 2  # each rank's BCE is the mean over its half of the batch
    torch.testing.assert_close(mean, losses.to(mean.dtype), **TOL)
    _assert_learns(mean)
    # torch's Adagrad divides each element's gradient by the root of its summed squares: an element whose gradient
    # stays at rounding level moves by rounding noise scaled up (seen: 1.1e-5 on 2 of the over arch's 5872 weights)
    _assert_same_state(two[0]["state"], state, tol=dict(rtol=2e-5, atol=5e-5))
    assert not torch.equal(two[0]["state"]["model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"],
                           two[0]["initial"]["model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"])


def test_two_tower_on_two_ranks_trains_as_the_plain_torch_reference_and_gathers_to_cpu(ran):
    two = [r["two_tower"] for r in ran]
    (eps,) = two[0]["eps"]
    losses, state = _two_tower_reference(two[0]["initial"], two[0]["blocks"], eps)
    mean = (two[0]["losses"] + two[1]["losses"]) / 2
    torch.testing.assert_close(mean, losses.to(mean.dtype), **TOL)
    _assert_learns(mean)
    assert two[1]["cpu_state"] is None and two[1]["item_embeddings"] is None  # rank 0 gathers
    gathered = two[0]["cpu_state"]
    _assert_same_state(gathered, state)
    # the item tower of the gathered model, by hand: relu(W e + b) for every movie's embedding row
    rows = gathered["two_tower.ebc.embedding_bags.t_movieId.weight"]
    w, b = gathered["two_tower.candidate_proj._mlp.0._linear.weight"], gathered["two_tower.candidate_proj._mlp.0._linear.bias"]
    assert two[0]["item_embeddings"].shape == (TWO_TOWER["num_embeddings"], TWO_TOWER["layer_sizes"][-1])
    torch.testing.assert_close(two[0]["item_embeddings"], torch.relu(rows @ w.T + b), rtol=1e-6, atol=1e-6)


# the key projection's bias shifts every score of a query equally: softmax ignores it, its gradient is rounding noise
# that Adam scales up to full steps, so it is no fixed value to compare
KEY_BIASES = {f"transformer_blocks.{i}.attention.linear_layers.1.bias" for i in range(2)}


def test_bert4rec_on_two_ranks_trains_as_the_plain_torch_reference(ran):
    two = [r["bert4rec"] for r in ran]
    assert "row_wise" in two[0]["plan"]  # TorchRec 1.8.0's planner also shards the item table row-wise on 2 CPU ranks
    reference = _bert4rec_reference(two[0]["initial"])
    for r in range(WORLD):
        got = two[r]["history"]["losses"]
        want = [epoch[r] for epoch in reference["losses"]]
        assert [len(e) for e in got] == [len(e) for e in want] and len(got) == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    epochs = torch.tensor(two[0]["history"]["epoch_loss"])
    assert torch.isfinite(epochs).all() and (epochs[1:] < epochs[:-1] - 0.05).all(), epochs  # every epoch learns
    _assert_same_state(two[0]["state"], reference["state"], skip=KEY_BIASES)  # DMP's keys are the unsharded model's
    assert {k: round(float(v), 5) for k, v in two[0]["history"]["test"].items()} == {
        k: round(v, 5) for k, v in reference["test"].items()}


def test_bert4rec_on_cpu_refuses_what_fbgemm_cannot_run(ran):
    """TorchRec 1.8.0 on CPU: the example's fused ADAM table fails in fbgemm ("Optimizer adam is not supported in CPU
    mode"), hence the snippet's EXACT_ADAGRAD there; a fused table's weight_decay is accepted and ignored (TorchRec
    leaves fbgemm's weight_decay_mode at NONE). recship refuses both, naming why."""
    refused = ran[0]["refused"]
    assert "ADAM runs on CUDA only" in refused["adam"]
    assert "weight_decay=1e-05 is not applied by fbgemm's CPU kernels" in refused["weight_decay"]


def test_in_backward_row_wise_adagrad_keeps_fbgemms_eps(ran):
    """TorchRec 1.8.0 (CPU, 1 rank, the golden example's call): its TBE's optimizer_args.eps is 1e-08 (fbgemm's
    default: TorchRec passes on only the arguments given, and so does recship)."""
    assert ran[0]["golden"]["eps"] == ran[0]["two_tower"]["eps"] == {1e-8}


def test_recalls_and_ndcgs_for_ks_count_hits_as_numpy():
    recalls = run_snippet("torchrec_example_bert4rec")["recalls_and_ndcgs_for_ks"]
    g = np.random.default_rng(0)
    scores = g.normal(size=(6, 11)).astype(np.float32)
    labels = np.zeros((6, 11), dtype=np.int64)
    labels[:, 0] = 1
    labels[2, 3] = 1  # two answers in one row
    got = recalls(torch.from_numpy(scores), torch.from_numpy(labels), [1, 5, 10])
    for k in (1, 5, 10):
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        hits = np.take_along_axis(labels, top, axis=1)
        recall = (hits.sum(1) / np.minimum(k, labels.sum(1))).mean()
        gains = 1 / np.log2(np.arange(2, 2 + k))
        ideal = np.array([gains[: min(n, k)].sum() for n in labels.sum(1)])
        assert got[f"Recall@{k}"] == pytest.approx(recall, rel=1e-6)
        assert got[f"NDCG@{k}"] == pytest.approx(((hits * gains).sum(1) / ideal).mean(), rel=1e-6)
