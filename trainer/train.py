"""``recship train``: train a DLRM with sharded tables on one or more ranks, with checkpoints.

    recship train --out runs/demo                         # 1 rank, synthetic data, defaults
    recship train --out runs/demo --nproc-per-node 2      # spawns 2 local gloo ranks
    torchrun --nproc-per-node 2 -m recship.trainer --out runs/demo
    recship train --config train.yaml --resume            # YAML or JSON with the same fields

Rank 0 shows a progress bar (step, samples/s, loss), evaluates log loss and AUC
on held-out data every ``eval_every`` steps, and prints a summary at the end.
"""

import argparse
import itertools
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from recship.trainer.checkpoint import load_checkpoint, save_checkpoint
from recship.trainer.metrics import auc
from recship.trainer.checkpoint_reader import complete_checkpoints, latest_checkpoint
from recship.trainer.data import CriteoTSV, DataFunction, SyntheticConfig, SyntheticCriteo, is_entry_point, prefetch
from recship.trainer.dlrm import DLRM, DLRMConfig
from recship.trainer.embedding_modules import EmbeddingBagCollection
from recship.trainer.entry_point import build_model, describe_model
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

EVAL_STREAM = 1_000_000  # synthetic eval batches come from rank ids past this: never trained on


@dataclass
class TrainConfig:
    """Everything a training run needs; the CLI, YAML/JSON files and tests fill it."""

    out: str = "runs/recship"
    steps: int = 300
    batch_size: int = 256  # examples per rank per step
    num_embeddings_per_feature: List[int] = field(default_factory=lambda: [1000] * 26)
    embedding_dim: int = 16
    dense_arch: List[int] = field(default_factory=lambda: [64])
    over_arch: List[int] = field(default_factory=lambda: [64, 32])
    optimizer: str = "exact_rowwise_adagrad"
    embedding_lr: float = 0.05
    dense_lr: float = 0.05
    sharding: Optional[str] = None  # force one sharding type for every table; None: the planner decides
    data: str = "synthetic"  # or a Criteo TSV file, or a data function package.module:function (see trainer/data.py)
    eval_data: Optional[str] = None  # the same kinds, for evaluation (synthetic data has its own held-out stream)
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    resume: bool = False  # continue from the newest complete checkpoint in out/checkpoints
    overwrite: bool = False  # delete out/checkpoints and start over (refused without it or --resume)
    keep_last: int = 0  # keep only the newest N checkpoints (0: keep all)
    seed: int = 0
    # the model: an entry point package.module:factory and its keyword arguments (--model-args JSON);
    # None trains the built-in DLRM shaped by the fields above
    model: Optional[str] = None
    model_args: Dict[str, Any] = field(default_factory=dict)
    nproc_per_node: int = 1
    device: str = "auto"  # "cpu", "cuda" (rank r on cuda:r of its host) or "auto" (cuda when available)
    progress: bool = True

    def use_cuda(self) -> bool:
        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())

    def model_config(self) -> DLRMConfig:
        return DLRMConfig(
            num_embeddings_per_feature=list(self.num_embeddings_per_feature),
            embedding_dim=self.embedding_dim,
            dense_arch=list(self.dense_arch),
            over_arch=list(self.over_arch),
        )

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError("steps must be >= 0 and batch_size >= 1")
        if self.model is not None and any(d is not None and d != "synthetic" and not is_entry_point(d) for d in (self.data, self.eval_data)):
            raise ValueError("--model trains on synthetic data sized from the model's tables or on a data function "
                             "(--data package.module:function); Criteo TSV files feed the built-in DLRM only")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the checkpoints or delete them")
        if self.keep_last < 0:
            raise ValueError(f"--keep-last must be >= 0 (0 keeps every checkpoint), got {self.keep_last}")
        try:
            EmbOptimType(self.optimizer)
        except ValueError:
            valid = ", ".join(o.value for o in EmbOptimType)
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected one of {valid}") from None
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
        if self.sharding is not None:
            try:
                ShardingType(self.sharding)
            except ValueError:
                valid = ", ".join(s.value for s in ShardingType)
                raise ValueError(f"unknown sharding {self.sharding!r}; expected one of {valid}") from None


class _Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        torch.manual_seed(config.seed)
        if config.model is None:
            model_config = config.model_config()
            model: nn.Module = DLRM(model_config, device="meta")
            tables = model_config.tables()
            self.features = [f for t in tables for f in t.feature_names]
            self.rows = list(config.num_embeddings_per_feature)
            self.num_dense, self.weighted = model_config.num_dense, False
            self.saved_model = {"model": asdict(model_config)}
        else:
            model = build_model(config.model, config.model_args, device="meta")
            contract = describe_model(model)
            tables = [t for path, m in model.named_modules() if isinstance(m, EmbeddingBagCollection) for t in m.embedding_bag_configs()]
            self.features = [f[0] for f in contract["features"]]
            self.rows = [f[2].num_embeddings for f in contract["features"]]
            self.num_dense, self.weighted = contract["num_dense"], contract["weighted"]
            self.saved_model = {"entry_point": {"model": config.model, "args": config.model_args}}
        self.user_model = model  # its loss() and eval_output, if it defines them
        constraints = None
        if config.sharding is not None:
            st = ShardingType(config.sharding)
            constraints = {t.name: ParameterConstraints(sharding_types=[st]) for t in tables}
        optimizer = FusedOptimizerConfig(EmbOptimType(config.optimizer), learning_rate=config.embedding_lr)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if config.use_cuda():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank % local)))
        else:
            self.device = torch.device("cpu")
        topology = Topology(self.world_size, self.device.type, local_world_size=local if self.world_size % local == 0 else None)
        self.plan = EmbeddingShardingPlanner(topology, constraints, optimizer, config.batch_size).collective_plan(model)
        torch.manual_seed(config.seed)  # dense init identical on every rank and for every world size
        self.model = DistributedModelParallel(model, plan=self.plan, optimizer=optimizer, device=self.device)
        self.dense_optimizer = torch.optim.Adagrad(self.model.dense_parameters(), lr=config.dense_lr)
        self.step = 0
        self.next_batch = 0
        self.losses: List[float] = []
        self.load_seconds = 0.0

    # -- data --------------------------------------------------------------

    def _synthetic(self) -> SyntheticCriteo:
        c = self.config
        config = SyntheticConfig(self.rows, num_dense=self.num_dense, batch_size=c.batch_size, seed=c.seed, weighted=self.weighted)
        return SyntheticCriteo(config, self.features)

    def _reader(self, data: str):
        """A re-iterable source of this rank's batches: a Criteo TSV file, or a data function."""
        c = self.config
        if is_entry_point(data):
            return DataFunction(data, c.batch_size, self.rank, self.world_size, self.features, self.weighted)
        return CriteoTSV(data, c.num_embeddings_per_feature, c.batch_size, self.rank, self.world_size)

    def _train_batches(self, start: int):
        c = self.config
        if c.data == "synthetic":
            return prefetch(self._synthetic().batches(start=start, rank=self.rank))
        return prefetch(_skip(_repeat(self._reader(c.data)), start))

    def _eval_batches(self):
        c = self.config
        if c.eval_data is not None:
            return list(itertools.islice(iter(self._reader(c.eval_data)), c.eval_batches))
        if c.data != "synthetic":
            return []
        gen = self._synthetic()
        return [gen.batch(i, EVAL_STREAM + self.rank) for i in range(c.eval_batches)]

    # -- loop --------------------------------------------------------------

    def _loss(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        """The model's own ``loss(outputs, labels)``, else binary cross-entropy on its one output (logits)."""
        own = getattr(self.user_model, "loss", None)
        if callable(own):
            return own(outputs, labels)
        return nn.functional.binary_cross_entropy_with_logits(self._score(outputs), labels)

    def _score(self, outputs) -> torch.Tensor:
        """[B] logits to evaluate: the one output, or the one named by the model's ``eval_output``."""
        if isinstance(outputs, dict):
            name = getattr(self.user_model, "eval_output", None)
            if name is None and len(outputs) != 1:
                raise ValueError(f"{type(self.user_model).__name__} returns {sorted(outputs)}: define eval_output (and loss) "
                                 "to say which output is trained and evaluated")
            outputs = outputs[name] if name is not None else next(iter(outputs.values()))
        return outputs.reshape(-1)

    def evaluate(self) -> Dict[str, float]:
        scores, labels = [], []
        with torch.no_grad():
            for b in self._eval_batches():
                b = b.to(self.device)
                scores.append(self._score(self.model(b.dense, b.sparse)).cpu())
                labels.append(b.labels.cpu())
        if not scores:
            return {}
        s, l = torch.cat(scores), torch.cat(labels)
        # gather every rank's predictions so rank 0 reports the global metrics
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (s, l))
        s = torch.cat([g[0] for g in gathered])
        l = torch.cat([g[1] for g in gathered])
        log_loss = float(nn.functional.binary_cross_entropy_with_logits(s, l))
        return {"log_loss": log_loss, "auc": auc(s, l), "examples": l.numel()}

    def checkpoint(self) -> Path:
        root = Path(self.config.out) / "checkpoints"
        path = save_checkpoint(
            root,
            self.step,
            self.model,
            self.dense_optimizer,
            next_batch=self.next_batch,
            plan=self.plan,
            config={**self.saved_model, "train": asdict(self.config)},
        )
        if self.config.keep_last and self.rank == 0:  # the save is complete (renamed) on every rank by now
            for old in complete_checkpoints(root)[: -self.config.keep_last]:
                shutil.rmtree(old)
        return path

    def resume(self) -> Optional[Path]:
        path = latest_checkpoint(Path(self.config.out) / "checkpoints")
        if path is None:
            return None
        t = time.perf_counter()
        meta = load_checkpoint(path, self.model, self.dense_optimizer)
        self.load_seconds = time.perf_counter() - t
        self.step = meta["step"]
        self.next_batch = meta["next_batch"]
        if self.rank == 0:
            print(f"resumed from step {self.step} (world {meta.get('world_size', '?')} -> {self.world_size}): {path}", flush=True)
        return path

    def run(self) -> Dict[str, Any]:
        c = self.config
        resumed = self.resume() if c.resume else None
        first_step = self.step
        show = self.rank == 0 and c.progress
        bar = _progress(total=c.steps, initial=self.step, enabled=show)
        batches = self._train_batches(self.next_batch)
        evals: List[Dict[str, float]] = []
        last_checkpoint = None
        started, seen = time.perf_counter(), 0
        while self.step < c.steps:
            b = next(batches, None)
            if b is None:
                break
            b = b.to(self.device, non_blocking=True)
            loss = self._loss(self.model(b.dense, b.sparse), b.labels)
            loss.backward()  # the sharded tables are updated inside backward
            self.dense_optimizer.step()
            self.dense_optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.next_batch += 1
            self.losses.append(float(loss.detach()))
            seen += len(b) * self.world_size
            rate = seen / max(time.perf_counter() - started, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{self.losses[-1]:.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
            if c.eval_every and self.step % c.eval_every == 0:
                evals.append({"step": self.step, **self.evaluate()})
                if show:
                    bar.write(f"step {self.step}: eval {evals[-1]}")
            if c.checkpoint_every and self.step % c.checkpoint_every == 0:
                last_checkpoint = self.checkpoint()
        bar.close()
        train_seconds = time.perf_counter() - started
        save_started = time.perf_counter()
        if last_checkpoint is None or not last_checkpoint.name.endswith(f"{self.step:08d}"):
            last_checkpoint = self.checkpoint()
        save_seconds = time.perf_counter() - save_started
        final_eval = self.evaluate()
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "resumed_from": str(resumed) if resumed else None,
            "losses": self.losses,
            "evals": evals,
            "final_eval": final_eval,
            "checkpoint": str(last_checkpoint),
            "samples_per_s": seen / max(train_seconds, 1e-9),
            "final_save_seconds": save_seconds,
            "load_seconds": self.load_seconds,
        }


def _repeat(reader):
    while True:
        yielded = False
        for b in reader:
            yielded = True
            yield b
        if not yielded:
            raise ValueError(f"{reader.path} gives no batch")


def _skip(it, n: int):
    for i, b in enumerate(it):
        if i >= n:
            yield b


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix(self, refresh: bool = True, **kw: Any) -> None: ...
    def write(self, s: str) -> None: print(s)
    def close(self) -> None: ...


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------


def train(config: TrainConfig) -> Dict[str, Any]:
    """Trains on the already-initialised process group (one call per rank); returns this rank's summary."""
    if not dist.is_initialized():
        raise ValueError("train() needs torch.distributed initialised; use launch() to start ranks")
    return _Trainer(config).run()


def _rank_entry(rank: int, world_size: int, port: int, config: TrainConfig, out: str) -> None:
    """One local rank; spawned ranks are separate processes, a single rank runs in this one."""
    if world_size > 1:
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if config.use_cuda() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        summary = train(config)
        Path(out, f"summary_rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


def launch(config: TrainConfig) -> Dict[str, Any]:
    """Runs training: in this process's group (torchrun), or spawning ``nproc_per_node`` gloo ranks.

    Returns rank 0's summary.
    """
    if config.model is not None:  # a model that cannot be built fails here, in one line, not inside a spawned rank
        describe_model(build_model(config.model, config.model_args, device="meta"))
    Path(config.out).mkdir(parents=True, exist_ok=True)
    _check_run_folder(config, delete=os.environ.get("RANK", "0") == "0")  # under torchrun only rank 0 deletes
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if config.use_cuda() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            dist.init_process_group(backend)
        try:
            return train(config)
        finally:
            dist.destroy_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = config.nproc_per_node
    if n < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {n}")
    if n == 1:
        _rank_entry(0, 1, port, config, config.out)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank_entry, args=(n, port, config, config.out), nprocs=n)
    return json.loads(Path(config.out, "summary_rank0.json").read_text())


def _check_run_folder(config: TrainConfig, delete: bool) -> None:
    """Refuses to train over earlier checkpoints unless told what to do with them (users lost runs this way)."""
    root = Path(config.out) / "checkpoints"
    newest = latest_checkpoint(root)
    if newest is None or config.resume:
        return
    if not config.overwrite:
        raise ValueError(
            f"{config.out} already holds checkpoints (newest: {newest.name}); pass --resume to continue them "
            "or --overwrite to delete them and start over"
        )
    if delete:
        shutil.rmtree(root)
        print(f"--overwrite: deleted the checkpoints in {root}", flush=True)


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML or JSON file with TrainConfig fields (flags override it)")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f"(default {value})")
        elif isinstance(value, dict):
            parser.add_argument(flag, type=_json_object, default=None, help="a JSON object (default {})")
        elif isinstance(value, list):
            parser.add_argument(flag, type=int, nargs="+", default=None, help=f"(default {value[:4]}{'...' if len(value) > 4 else ''})")
        else:
            kind = float if isinstance(value, float) else int if isinstance(value, int) else str
            parser.add_argument(flag, type=kind, default=None, help=f"(default {value})")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: Dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
        unknown = sorted(set(values) - {f.name for f in fields(TrainConfig)})
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}")
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return TrainConfig(**values)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    summary = launch(config)
    if summary["rank"] != 0:
        return 0
    done = summary["steps_this_run"]
    if done == 0:
        print(f"nothing to train: the run is already at step {summary['steps']} (--steps {config.steps}); checkpoint {summary['checkpoint']}")
        return 0
    final = summary["final_eval"]
    first = sum(summary["losses"][:10]) / max(1, len(summary["losses"][:10]))
    last = sum(summary["losses"][-10:]) / max(1, len(summary["losses"][-10:]))
    print(
        f"trained {done} steps (steps {summary['steps'] - done + 1}-{summary['steps']}) on {summary['world_size']} rank(s): "
        f"loss {first:.4f} -> {last:.4f} (mean of first/last 10 steps), "
        + (f"eval log loss {final['log_loss']:.4f}, AUC {final['auc']:.4f}, " if final else "")
        + f"{summary['samples_per_s']:.0f} samples/s; checkpoint {summary['checkpoint']}"
    )
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="recship.trainer", description="Train a DLRM with sharded embedding tables.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except (ValueError, FileNotFoundError) as e:
        print(f"recship train: error: {e}", file=sys.stderr)
        return 2
