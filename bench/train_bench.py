"""Training throughput: sharded fused-optimizer EBC vs nn.EmbeddingBag + torch Adagrad (sparse).

    .venv/bin/python bench/train_bench.py [--tables 8 --rows 100000 --dim 64 --batch 2048 --pooling 20 --steps 20]
        [--dlrm | --two-tower] [--plot PNG]

Prints samples/s, peak RSS and optimizer-state bytes for:
  baseline   one process, nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad
  fused ws=1 DistributedModelParallel, EXACT_ROWWISE_ADAGRAD, 1 rank
  fused ws=2 the same on 2 gloo ranks (batch per rank), aggregate samples/s
and the ratios against the baseline measured in the same run.

--two-tower: recship.models.TwoTower with a 500k-row history EmbeddingCollection (sequence feature, --pooling ids per
example) on 2 gloo ranks, its history table sharded as the planner chooses vs data-parallel (replicated, DDP
all-reduces its dense gradient, torch Adagrad steps it); aggregate samples/s of both and their ratio.
"""

import argparse
import os
from pathlib import Path
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recship.plots import write_bench_chart
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import ParameterConstraints, ShardingType, Topology, EmbeddingShardingPlanner

PLOT = Path(__file__).resolve().parent / "out" / "train_bench.png"


def _batches(args, n, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(args.tables)]
    out = []
    for _ in range(n):
        lengths = torch.full((args.tables * args.batch,), args.pooling, dtype=torch.int64)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor(keys=keys, values=values, lengths=lengths))
    return out


def _tables(args):
    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=[f"f{i}"]) for i in range(args.tables)]


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the pre-exec parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def baseline(args):
    torch.manual_seed(0)
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in range(args.tables))
    opt = torch.optim.Adagrad(bags.parameters(), lr=0.01)
    batches = _batches(args, args.steps + 2, seed=1)

    def step(kjt):
        d = kjt.to_dict()
        out = torch.cat([bag(d[f"f{i}"].values(), d[f"f{i}"].offsets()[:-1]) for i, bag in enumerate(bags)], dim=1)
        out.sum().backward()
        opt.step()
        opt.zero_grad()

    for kjt in batches[:2]:
        step(kjt)
    t = time.perf_counter()
    for kjt in batches[2:]:
        step(kjt)
    secs = time.perf_counter() - t
    state = sum(s["sum"].numel() * 4 for s in opt.state.values())
    return args.batch * args.steps / secs, _peak_rss_mb(), state


def _fused_worker(rank, world_size, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ebc = EmbeddingBagCollection(_tables(args), device="meta")
    constraints = {f"t{i}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE]) for i in range(args.tables)}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(ebc)
    model = DistributedModelParallel(ebc, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.01))
    batches = _batches(args, args.steps + 2, seed=1 + rank)
    for kjt in batches[:2]:
        model(kjt).values().sum().backward()
    dist.barrier()
    t = time.perf_counter()
    for kjt in batches[2:]:
        model(kjt).values().sum().backward()
    dist.barrier()
    secs = time.perf_counter() - t
    state = sum(s.numel() * 4 for m in model.sharded_modules() for st in m.local_optimizer_states().values() for s in st)
    queue.put((rank, args.batch * args.steps / secs, _peak_rss_mb(), state))
    dist.destroy_process_group()


def fused(args, world_size):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fused_worker, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"rank exited with {p.exitcode}")
    return sum(r[1] for r in results), max(r[2] for r in results), sum(r[3] for r in results)


def _two_tower_batches(args, n, seed):
    """(dense [B, 4], KJT of user, country, history (--pooling ids), item, category, labels [B]) per step."""
    g = torch.Generator().manual_seed(seed)
    b, rows = args.batch, {"user": 100_000, "country": 50, "history": args.history_rows, "item": args.history_rows, "category": 100}
    out = []
    for _ in range(n):
        lengths = torch.cat([torch.full((b,), args.pooling if f == "history" else 1, dtype=torch.int64) for f in rows])
        values = torch.cat([torch.randint(0, r, (b * (args.pooling if f == "history" else 1),), generator=g) for f, r in rows.items()])
        kjt = KeyedJaggedTensor(keys=list(rows), values=values, lengths=lengths)
        out.append((torch.rand(b, 4, generator=g), kjt, torch.randint(0, 2, (b,), generator=g).float()))
    return out


def _two_tower_worker(rank, world_size, port, args, sharded, queue):
    from recship.models import TwoTower
    from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, args.threads // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = TwoTower(num_users=100_000, num_items=args.history_rows, dim=args.dim, device="meta")
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    sharders = [EmbeddingBagCollectionSharder(fused), EmbeddingCollectionSharder(fused)]
    constraints = None if sharded else {"history_items": ParameterConstraints(sharding_types=[ShardingType.DATA_PARALLEL])}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), batch_size=args.batch, constraints=constraints,
                                    debug=False).collective_plan(model, sharders)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    dense = torch.optim.Adagrad(dmp.dense_parameters(), lr=0.01)
    batches = _two_tower_batches(args, args.steps + 2, seed=1 + rank)

    def step(batch):
        d, kjt, labels = batch
        dmp.module.loss(dmp(d, kjt), labels).backward()
        dense.step()
        dense.zero_grad()

    for batch in batches[:2]:
        step(batch)
    dist.barrier()
    t = time.perf_counter()
    for batch in batches[2:]:
        step(batch)
    dist.barrier()
    secs = time.perf_counter() - t
    history = plan.get_plan_for_module("history")["history_items"]
    queue.put((rank, args.batch * args.steps / secs, _peak_rss_mb(), history.sharding_type.value))
    dist.destroy_process_group()


def two_tower(args):
    """Two-tower training on 2 gloo ranks: the history EmbeddingCollection sharded (the planner's choice) vs replicated."""
    print(f"TwoTower: history table {args.history_rows} x {args.dim} (EmbeddingCollection, {args.pooling} ids per example), "
          f"2 gloo ranks, batch {args.batch}/rank, {args.steps} steps, {args.threads} threads")
    print(f"{'history table':24s} {'samples/s':>10s} {'peak RSS MB/rank':>16s}")
    results = {}
    for sharded in (True, False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_two_tower_worker, args=(r, 2, port, args, sharded, queue)) for r in range(2)]
        for p in procs:
            p.start()
        got = [queue.get() for _ in procs]
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"rank exited with {p.exitcode}")
        name = got[0][3]
        results[sharded] = sum(r[1] for r in got)
        print(f"{name:24s} {results[sharded]:10.0f} {max(r[2] for r in got):16.0f}")
    print(f"sharded / data-parallel: {results[True] / results[False]:.2f}x")


def dlrm(args):
    """End-to-end DLRM (26 tables x rows x dim) at world sizes 1 and 2, then checkpoint save/load."""
    import shutil
    import tempfile

    from recship.trainer.train import TrainConfig, launch

    rows = [args.rows] * 26
    print(f"DLRM: 26 tables x {args.rows} rows x dim {args.dim}, batch {args.batch}/rank, {args.steps} steps, synthetic data")
    print(f"{'world':>5s} {'samples/s':>10s} {'save s':>7s} {'load s':>7s} {'checkpoint MB':>14s}")
    labels, speed, save, load = [], [], [], []
    for ws in (1, 2):
        out = tempfile.mkdtemp(prefix="recship-bench-")
        try:
            base = dict(out=out, num_embeddings_per_feature=rows, embedding_dim=args.dim, batch_size=args.batch,
                        eval_every=0, checkpoint_every=0, eval_batches=1, progress=False, nproc_per_node=ws)
            trained = launch(TrainConfig(steps=args.steps, **base))
            resumed = launch(TrainConfig(steps=args.steps, resume=True, **base))  # loads, trains 0 steps
            size = sum(f.stat().st_size for f in Path(trained["checkpoint"]).rglob("*") if f.is_file())
            print(f"{ws:5d} {trained['samples_per_s']:10.0f} {trained['final_save_seconds']:7.2f} "
                  f"{resumed['load_seconds']:7.2f} {size / 2**20:14.1f}")
            labels.append(f"DLRM, world size {ws}")
            speed.append(trained["samples_per_s"])
            save.append(trained["final_save_seconds"])
            load.append(resumed["load_seconds"])
        finally:
            shutil.rmtree(out, ignore_errors=True)
    write_bench_chart(args.plot, f"DLRM training: 26 tables x {args.rows} rows x dim {args.dim}, batch {args.batch}/rank", labels,
                      {"samples/s": {"samples/s": speed}, "seconds": {"checkpoint save": save, "checkpoint load": load}})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048, help="examples per rank per step")
    parser.add_argument("--pooling", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dlrm", action="store_true", help="instead: end-to-end DLRM samples/s and checkpoint save/load")
    parser.add_argument("--two-tower", action="store_true", help="instead: two-tower history EC sharded vs data-parallel")
    parser.add_argument("--history-rows", type=int, default=500_000, help="--two-tower: rows of the history (and item) table")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    if args.dlrm:
        return dlrm(args)
    if args.two_tower:
        return two_tower(args)
    torch.set_num_threads(args.threads)
    print(f"{args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}/rank, pooling {args.pooling}, {args.steps} steps, {args.threads} threads")
    base = baseline(args)
    rows = [("baseline nn.EmbeddingBag+Adagrad(sparse)", *base)]
    for ws in (1, 2):
        rows.append((f"fused rowwise adagrad, world size {ws}", *fused(args, ws)))
    print(f"{'run':42s} {'samples/s':>10s} {'ratio':>6s} {'peak RSS MB/rank':>16s} {'optim state MB':>15s}")
    for name, sps, rss, state in rows:
        print(f"{name:42s} {sps:10.0f} {sps / base[0]:6.2f} {rss:16.0f} {state / 2**20:15.2f}")
    write_bench_chart(args.plot, f"training: {args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}/rank",
                      [r[0] for r in rows], {"samples/s": {"samples/s": [r[1] for r in rows]},
                                             "MB": {"peak RSS per rank": [r[2] for r in rows],
                                                    "optimizer state": [r[3] / 2**20 for r in rows]}})


if __name__ == "__main__":
    main()
