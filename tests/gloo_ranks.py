"""Run a function on N gloo ranks in spawned processes and collect what each returns."""

import contextlib
import gc
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable, local_world_size: int, backend: str, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:  # reference cycles collected first, so gloo's threads are joined before the interpreter exits
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


@contextlib.contextmanager
def one_rank_group(folder: Path) -> Iterator[dist.ProcessGroup]:
    """A gloo process group of this process alone (its FileStore in ``folder``), for in-process tests of code that
    needs one; destroyed on leaving. The ``pg`` fixture (tests/conftest.py) wraps it."""
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder) / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.GroupMember.WORLD
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable, world_size: int, *args: Any, local_world_size: Optional[int] = None, backend: str = "gloo"
) -> List[Any]:
    """fn(rank, world_size, *args) on every rank (gloo, or nccl with rank r on cuda:r); results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _worker,
            args=(world_size, _free_port(), out_dir, fn, local_world_size or world_size, backend, args),
            nprocs=world_size,
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def gather_whole(value: Any) -> Any:
    """A ShardedTensor gathered whole on rank 0 (None elsewhere); a plain tensor as it is (detached, cloned)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    full = torch.empty(value.size()) if dist.get_rank() == 0 else None
    value.gather(dst=0, out=full)
    return full
