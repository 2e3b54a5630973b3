"""Sharded training with recship's API in one file: the README's "Sharded training" section, runnable.

    .venv/bin/torchrun --nproc-per-node 2 examples/sharded_training.py --out runs/sharded   # 2 gloo ranks
    .venv/bin/python examples/sharded_training.py --out runs/sharded                        # one process, world size 1

The model is built on "meta" (no table is allocated), its tables are planned by
EmbeddingShardingPlanner (one table row-wise, one column-wise, one table-wise, to show
the constraints), DistributedModelParallel allocates only this rank's shards and wraps
the dense layers in DDP, the tables train with fbgemm's fused row-wise adagrad inside
backward and the dense layers with torch's Adagrad. Every rank trains on its slice of
one global batch, so N ranks train like one process with the whole batch (README:
"Semantics"). Checkpoints go to ``<out>/checkpoints/step_<N>/`` through
``recship.trainer.checkpoint.save_checkpoint`` (step 0, the starting weights, too, so a
run can be replayed from its beginning). CPU and gloo only.

Rank 0 prints the plan, each step's loss (the mean over the global batch) and, last, a
JSON line: {"world_size", "losses", "eval_loss", "checkpoints"}.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recship import (
    DistributedModelParallel,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingShardingPlanner,
    EmbOptimType,
    KeyedJaggedTensor,
    ParameterConstraints,
    Topology,
)
from recship.distributed import EmbeddingBagCollectionSharder
from recship.trainer.checkpoint import save_checkpoint

FEATURES = ["user", "item", "category"]
ROWS = [1000, 500, 100]  # rows of each feature's table
NUM_DENSE = 4
MAX_IDS = 3  # ids per (feature, example): 0..MAX_IDS


class MyModel(nn.Module):
    """Three tables (one per feature) and an MLP over [pooled embeddings, dense]: ``logit`` [B]."""

    def __init__(self, dim: int = 16, device: Optional[str] = None) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection([
            EmbeddingBagConfig(name=f"{f}_table", num_embeddings=rows, embedding_dim=dim, feature_names=[f])
            for f, rows in zip(FEATURES, ROWS)
        ], device=device)
        self.over = nn.Sequential(nn.Linear(len(FEATURES) * dim + NUM_DENSE, 32, device=device), nn.ReLU(),
                                  nn.Linear(32, 1, device=device))

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """dense [B, NUM_DENSE] float32, features: a KJT of FEATURES -> logit [B]."""
        pooled = self.sparse(features).values()  # [B, 3 * dim]; sharded: the awaitable's values()
        return self.over(torch.cat([pooled, dense], dim=1)).squeeze(1)


def global_batch(step: int, batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor], torch.Tensor]:
    """Batch ``step`` of the synthetic data, whole: dense [B, NUM_DENSE], lengths [F, B], ids per feature, labels [B].

    A pure function of (seed, step); labels come from a fixed hidden scoring of the ids and dense values.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    dense = torch.rand(batch_size, NUM_DENSE, generator=g)
    lengths = torch.randint(0, MAX_IDS + 1, (len(FEATURES), batch_size), generator=g)
    ids = [torch.randint(0, rows, (int(lengths[f].sum()),), generator=g) for f, rows in enumerate(ROWS)]
    hidden = torch.Generator().manual_seed(seed)  # the same hidden model for every batch
    score = (dense - 0.5) @ torch.randn(NUM_DENSE, generator=hidden)
    for f, rows in enumerate(ROWS):
        per_id = torch.randn(rows, generator=hidden)
        example = torch.repeat_interleave(torch.arange(batch_size), lengths[f])
        score = score.index_add(0, example, per_id[ids[f]])
    return dense, lengths, ids, (score > 0).float()


def local_batch(step: int, batch_size: int, seed: int, rank: int, world_size: int) -> Tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """This rank's slice of batch ``step``: examples [rank * b, (rank + 1) * b) for b = batch_size // world_size."""
    dense, lengths, ids, labels = global_batch(step, batch_size, seed)
    b = batch_size // world_size
    lo, hi = rank * b, (rank + 1) * b
    values = []
    for f in range(len(FEATURES)):
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), lengths[f]]), 0)
        values.append(ids[f][offsets[lo] : offsets[hi]])
    kjt = KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths[:, lo:hi].reshape(-1))
    return dense[lo:hi], kjt, labels[lo:hi]


def _init_process_group() -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any launcher setting the env:// variables)
        dist.init_process_group("gloo")
    else:  # a plain `python examples/sharded_training.py`: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Plans, shards and trains on the initialised process group; returns the summary rank 0 prints."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.batch_size < world_size or args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} must be a positive multiple of the {world_size} ranks")
    torch.manual_seed(args.seed + rank)

    model = MyModel(device="meta")  # nothing allocated yet
    # the fused optimizer of the tables, as TorchRec's fused_params (or DMP's optimizer=FusedOptimizerConfig(...))
    sharders = [EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": args.lr})]
    planner = EmbeddingShardingPlanner(  # the plan makes room for the sharders' optimizer state
        Topology(world_size=world_size, compute_device="cpu"),
        constraints={
            "user_table": ParameterConstraints(sharding_types=["row_wise"], pooling_factor=MAX_IDS / 2),
            "item_table": ParameterConstraints(sharding_types=["column_wise"]),
            "category_table": ParameterConstraints(sharding_types=["table_wise"]),
        },
        batch_size=args.batch_size // world_size,
    )
    plan = planner.collective_plan(model, sharders)  # planned on rank 0, broadcast
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_opt = torch.optim.Adagrad(dmp.dense_parameters(), lr=args.lr)
    if rank == 0:
        print(dmp.plan, flush=True)

    checkpoints = Path(args.out) / "checkpoints"
    saved = [str(save_checkpoint(checkpoints, 0, dmp, dense_opt, next_batch=0, plan=plan))]
    losses = []
    for step in range(1, args.steps + 1):
        dense, kjt, labels = local_batch(step, args.batch_size, args.seed, rank, world_size)
        loss = nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt), labels)
        loss.backward()  # the sharded tables are updated here; DDP averages the dense gradients
        dense_opt.step()
        dense_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every rank has as many examples: the mean over the global batch
        losses.append(mean.item() / world_size)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.5f}", flush=True)
        if step == args.steps or (args.checkpoint_every and step % args.checkpoint_every == 0):
            saved.append(str(save_checkpoint(checkpoints, step, dmp, dense_opt, next_batch=step, plan=plan)))

    with torch.no_grad():  # held-out data: batch -1
        dense, kjt, labels = local_batch(-1, args.batch_size, args.seed, rank, world_size)
        eval_loss = nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt), labels)
        dist.all_reduce(eval_loss)
    return {"world_size": world_size, "losses": losses, "eval_loss": eval_loss.item() / world_size, "checkpoints": saved}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/sharded", help="checkpoints go to OUT/checkpoints/")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch: examples per step over all ranks")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of both optimizers")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: at step 0 and the end only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    _init_process_group()
    rank = dist.get_rank()
    try:
        # train() keeps the sharded model to itself, so the model is gone before its process group
        # (destroying the group while the model still lived hung rank 0 at exit about one run in four)
        summary = train(args)
        dist.barrier()  # neither rank tears the group down while the other still talks
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
