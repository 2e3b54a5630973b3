"""Training: any model (an entry point; the built-in DLRM by default) with sharded tables on one or more ranks, with checkpoints.

    launch(TrainConfig(out="runs/demo", steps=300))       # what ``recship train`` (recship.trainer.cli) runs

Rank 0 shows a progress bar (step, samples/s, loss, epoch of a data file), evaluates log loss
and AUC on held-out data every ``eval_every`` steps, and prints a summary at the end; warnings
and epoch changes go through the ``recship.trainer.*`` loggers (recship.logs formats them).
"""

import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import math
import os
import shutil
import socket
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Generator, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from recship.cpus import usable_cpus
from recship.logs import configure_logging
from recship.names import DLRM_ENTRY
from recship.oserrors import carried, carry
from recship.plots import plot_if_available, plot_training_curves
from recship.trainer.checkpoint import _sharded_modules, load_checkpoint, save_checkpoint
from recship.trainer.checkpoint_reader import CheckpointReader, _dcp_shapes, complete_checkpoints, latest_checkpoint, read_metadata
from recship.trainer.config import DLRM_SHAPE, RECORDED, TrainConfig, changed_fields
from recship.trainer.data import Batch, CriteoTSV, DataFunction, SyntheticConfig, SyntheticCriteo, is_entry_point, prefetch
from recship.trainer.distributed.sharders import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.entry_point import build_model, check_contract, describe_model
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from recship.trainer.history import History
from recship.trainer.metrics import auc
from recship.trainer.model_parallel import DistributedModelParallel
from recship.trainer.planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingType, Topology

log = logging.getLogger(__name__)


class TrainingDiverged(ValueError):
    """The loss or the weights became NaN or infinite: training stops before saving them."""

EVAL_STREAM = 1_000_000  # synthetic eval batches come from rank ids past this: never trained on


class _Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        torch.manual_seed(config.seed)
        entry, args = config.entry_point()  # the built-in DLRM is the entry point recship.models.dlrm:builtin
        model = build_model(entry, args, device="meta")
        contract = describe_model(model)
        tables = [t for path, m in model.named_modules() if isinstance(m, EmbeddingBagCollection) for t in m.embedding_bag_configs()]
        sequence_tables = [t for path, m in model.named_modules() if type(m) is EmbeddingCollection for t in m.embedding_configs()]
        self.features = [f[0] for f in contract["features"]]
        self.rows = [f[2].num_embeddings for f in contract["features"]]
        self.num_dense, self.weighted = contract["num_dense"], contract["weighted"]
        self.saved_model = {"entry_point": {"model": entry, "args": args}}
        self.user_model = model  # its loss() and eval_output, if it defines them
        constraints = None
        if config.sharding is not None:
            st = ShardingType(config.sharding)
            constraints = {t.name: ParameterConstraints(sharding_types=[st]) for t in tables}
            if st != ShardingType.TABLE_ROW_WISE:  # EmbeddingCollections have no table-row-wise (TorchRec's): the planner picks theirs
                constraints.update({t.name: ParameterConstraints(sharding_types=[st]) for t in sequence_tables})
        if config.resume:
            replicated = _replicated_sequence_tables(Path(config.out) / "checkpoints", model)
            constraints = {**(constraints or {}), **{n: ParameterConstraints(sharding_types=[ShardingType.DATA_PARALLEL]) for n in replicated}}
        optimizer = FusedOptimizerConfig(EmbOptimType(config.optimizer), learning_rate=config.embedding_lr)
        sharders = _sharders(optimizer)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if config.use_cuda():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank % local)))
        else:
            self.device = torch.device("cpu")
        topology = Topology(self.world_size, self.device.type, local_world_size=local if self.world_size % local == 0 else None)
        planner = EmbeddingShardingPlanner(topology, batch_size=config.batch_size, constraints=constraints, optimizer=optimizer)
        self.plan = planner.collective_plan(model, sharders)
        torch.manual_seed(config.seed)  # dense init identical on every rank and for every world size
        self.model = DistributedModelParallel(model, plan=self.plan, sharders=sharders, device=self.device)
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

    def _train_batches(self, start: int) -> Generator[Tuple[Optional[int], Batch], None, None]:
        """(epoch, batch) from batch ``start`` on: a data file or function is repeated, epoch 1, 2, ...;
        synthetic data is one endless stream (epoch None)."""
        c = self.config
        if c.data == "synthetic":
            return prefetch((None, b) for b in self._synthetic().batches(start=start, rank=self.rank))
        return prefetch(itertools.islice(_repeat(self._reader(c.data)), start, None))

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

    def evaluate(self) -> Dict[str, Any]:
        """log_loss, auc and examples over every rank's eval batches: of the one trained output (or ``eval_output``);
        for a model with ``eval_outputs`` ({output: label column}) also ``tasks``, {output: {log_loss, auc, examples}},
        the top-level keys being ``eval_output``'s task (else the first)."""
        tasks: Dict[str, int] = dict(getattr(self.user_model, "eval_outputs", None) or {})
        scores: Dict[str, List[torch.Tensor]] = {}
        labels: Dict[str, List[torch.Tensor]] = {}
        with torch.no_grad():
            for b in self._eval_batches():
                b = b.to(self.device)
                outputs = self.model(b.dense, b.sparse)
                if not tasks:
                    scores.setdefault("", []).append(self._score(outputs).cpu())
                    labels.setdefault("", []).append(b.labels.cpu())
                for name, column in tasks.items():
                    scores.setdefault(name, []).append(outputs[name].reshape(-1).cpu())
                    labels.setdefault(name, []).append((b.labels[:, column] if b.labels.dim() == 2 else b.labels).cpu())
        if not scores:
            return {}
        local = {name: (torch.cat(scores[name]), torch.cat(labels[name])) for name in scores}
        # gather every rank's predictions so rank 0 reports the global metrics
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        metrics = {}
        for name in local:
            s = torch.cat([g[name][0] for g in gathered])
            l = torch.cat([g[name][1] for g in gathered])
            metrics[name] = {"log_loss": float(nn.functional.binary_cross_entropy_with_logits(s, l)), "auc": auc(s, l),
                             "examples": l.numel()}
        if not tasks:
            return metrics[""]
        named = getattr(self.user_model, "eval_output", None)
        return {**metrics[named if named in tasks else next(iter(tasks))], "tasks": metrics}

    def _agreed(self, bad: bool) -> bool:
        """Whether ``bad`` holds on any rank (every rank calls this at the same point)."""
        if self.world_size == 1:
            return bad
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _non_finite_weights(self) -> Optional[str]:
        """What of this rank's weights holds a NaN or an inf (its table shards, then the dense parameters), or None."""
        for path, module in _sharded_modules(self.model):
            for (table, _), weight in module.local_shards().items():
                if not bool(torch.isfinite(weight).all()):
                    return f"table {path + '/' if path else ''}{table}"
        for group in self.dense_optimizer.param_groups:
            for p in group["params"]:
                if not bool(torch.isfinite(p).all()):
                    name = next((n for n, q in self.model.named_parameters() if q is p), "a dense parameter")
                    return f"dense parameter {name}"
        return None

    def _diverged(self, what: str, last: Optional[Path]) -> TrainingDiverged:
        kept = f"the last checkpoint, {last}, is the last good state" if last is not None else "no checkpoint was saved"
        return TrainingDiverged(f"training diverged at step {self.step}: {what}; stopped without saving it ({kept}); "
                                "lower --dense-lr / --embedding-lr, or check the data")

    def checkpoint(self) -> Path:
        root = Path(self.config.out) / "checkpoints"
        bad = self._non_finite_weights()
        if self._agreed(bad is not None):  # a checkpoint is never saved with NaN or inf weights
            raise self._diverged(f"{bad or 'another rank'} holds NaN or inf values", latest_checkpoint(root))
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
        for group in self.dense_optimizer.param_groups:  # the loaded state carries the saved rate: --dense-lr may override it
            group["lr"] = self.config.dense_lr
        self.step = meta["step"]
        self.next_batch = meta["next_batch"]
        if self.rank == 0:
            print(f"resumed from step {self.step} (world {meta.get('world_size', '?')} -> {self.world_size}): {path}", flush=True)
        return path

    def _curves(self, history: History) -> Optional[Path]:
        """Draws OUT/curves.png from the run's whole history (rank 0); None with --no-plot or without matplotlib."""
        if not self.config.plot:
            return None

        out = Path(self.config.out)
        return plot_if_available(plot_training_curves, out / "curves.png", history.steps, history.loss_values, history.evals,
                            title=f"{out.name}: {self.step} steps on {self.world_size} rank(s)", starts=history.starts)

    def run(self) -> Dict[str, Any]:
        resumed = self.resume() if self.config.resume else None
        # rank 0 keeps the loss/eval history, cut back to the step the run starts from (0, or the checkpoint's)
        history = (History(self.config.out, keep_until=self.step, world_size=self.world_size, resumed=resumed is not None)
                   if self.rank == 0 else None)
        try:
            return self._run(resumed, history)
        finally:
            if history is not None:
                history.close()

    def _run(self, resumed: Optional[Path], history: Optional[History]) -> Dict[str, Any]:
        c = self.config
        first_step = self.step
        show = self.rank == 0 and c.progress
        bar = _progress(total=c.steps, initial=self.step, enabled=show)
        batches = self._train_batches(self.next_batch)
        evals: List[Dict[str, Any]] = []
        last_checkpoint = None
        epoch: Optional[int] = None
        started, seen = time.perf_counter(), 0
        # log lines (malformed data, epochs) are written above the bar, not into it
        with _logging_above(bar), contextlib.closing(batches):  # (closing stops the prefetching thread)
            while self.step < c.steps:
                item = next(batches, None)
                if item is None:
                    break
                if item[0] != epoch:
                    if epoch is not None and self.rank == 0:
                        log.info("epoch %d of %s begins at step %d", item[0], c.data, self.step + 1)
                    epoch = item[0]
                b = item[1].to(self.device, non_blocking=True)
                loss = self._loss(self.model(b.dense, b.sparse), b.labels)
                value = float(loss.detach())
                if self._agreed(not math.isfinite(value)):  # before backward: the step does not update the model
                    self.step += 1
                    what = f"the loss is {value}" if not math.isfinite(value) else "another rank's loss is not finite"
                    raise self._diverged(what, latest_checkpoint(Path(c.out) / "checkpoints"))
                loss.backward()  # the sharded tables are updated inside backward
                self.dense_optimizer.step()
                self.dense_optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.next_batch += 1
                self.losses.append(value)
                if history is not None:
                    history.add_loss(self.step, self.losses[-1])
                seen += len(b) * self.world_size
                rate = seen / max(time.perf_counter() - started, 1e-9)
                bar.update(1)
                postfix = {"loss": f"{self.losses[-1]:.4f}", "samples_per_s": f"{rate:.0f}"}
                bar.set_postfix(refresh=False, **(postfix if epoch is None else {**postfix, "epoch": epoch}))
                if c.eval_every and self.step % c.eval_every == 0:
                    metrics = self.evaluate()
                    evals.append({"step": self.step, **metrics})
                    if show:
                        bar.write(f"step {self.step}: eval {evals[-1]}")
                    if history is not None:
                        history.add_eval(self.step, metrics)
                        if self.step < c.steps:  # the end draws it anyway
                            self._curves(history)  # refreshed at each evaluation: a long run can be watched
                if c.checkpoint_every and self.step % c.checkpoint_every == 0:
                    last_checkpoint = self.checkpoint()
            bar.close()
        train_seconds = time.perf_counter() - started
        save_started = time.perf_counter()
        if last_checkpoint is None or not last_checkpoint.name.endswith(f"{self.step:08d}"):
            last_checkpoint = self.checkpoint()
        save_seconds = time.perf_counter() - save_started
        final_eval = self.evaluate()
        curves = None
        if history is not None:
            history.add_eval(self.step, final_eval)
            curves = self._curves(history)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "resumed_from": str(resumed) if resumed else None,
            "data": c.data,  # what the run trained and evaluated on (on --resume: the checkpoint's, unless overridden)
            "eval_data": c.eval_data,
            "batch_size": c.batch_size,
            "losses": self.losses,
            "evals": evals,
            "final_eval": final_eval,
            "checkpoint": str(last_checkpoint),
            "epochs": epoch,  # the data file's pass the run ended in (None: synthetic data)
            "samples_per_s": seen / max(train_seconds, 1e-9),
            "final_save_seconds": save_seconds,
            "load_seconds": self.load_seconds,
            "history": str(history.path) if history is not None else None,  # rank 0's
            "curves": str(curves) if curves is not None else None,  # rank 0's, with --plot and matplotlib
        }


def _repeat(reader) -> Iterator[Tuple[int, Batch]]:
    """(epoch, batch) over ``reader`` read again and again: epoch 1, 2, ..."""
    for epoch in itertools.count(1):
        yielded = False
        for b in reader:
            yielded = True
            yield epoch, b
        if not yielded:
            raise ValueError(f"{reader.path} gives no batch")


class _NoBar:
    def update(self, n: int) -> None: ...
    def set_postfix(self, refresh: bool = True, **kw: Any) -> None: ...
    def write(self, s: str) -> None: print(s)
    def close(self) -> None: ...


def _progress(total: int, initial: int, enabled: bool):
    if not enabled or not sys.stderr.isatty():  # a bar on a terminal only: in a log file it is noise
        return _NoBar()

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)


def _logging_above(bar: Any) -> Any:
    """While a tqdm bar shows, the console log handlers write through tqdm.write (above the bar)."""
    if isinstance(bar, _NoBar):
        return nullcontext()

    return logging_redirect_tqdm()


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------


def train(config: TrainConfig) -> Dict[str, Any]:
    """Trains on the already-initialised process group (one call per rank); returns this rank's summary."""
    if not dist.is_initialized():
        raise ValueError("train() needs torch.distributed initialised; use launch() to start ranks")
    try:
        return _Trainer(config).run()
    except BaseException as e:
        # the failed run's trainer (its model holds the process group) lives on in the traceback's frames;
        # freed now, before the caller destroys the group: else gloo's threads abort the process at exit
        traceback.clear_frames(e.__traceback__)
        raise


def _rank_entry(rank: int, world_size: int, port: int, config: TrainConfig, out: str) -> None:
    """One local rank; spawned ranks are separate processes, a single rank runs in this one."""
    if world_size > 1:  # a spawned process: its log lines look like the parent's

        configure_logging(config.log_format)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        torch.set_num_threads(max(1, usable_cpus() // world_size))
    backend = "nccl" if config.use_cuda() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        summary = train(config)
        Path(out, f"summary_rank{rank}.json").write_text(json.dumps(summary))
        dist.barrier()  # neither rank tears the group down while the other still talks
    except OSError as e:
        if world_size == 1:
            raise
        raise RuntimeError(carry(e)) from None  # the parent sees a spawned rank's traceback text only: launch reads it
    finally:
        _close_process_group()


def launch(config: TrainConfig, given: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Runs training: in this process's group (torchrun), or spawning ``nproc_per_node`` gloo ranks.

    With ``config.resume``, what the newest checkpoint records of its run (``resumed_config``) replaces every
    recorded field not in ``given``: the names of the fields the caller set (``recship train`` passes its flags and
    ``--config`` keys); None counts the fields that differ from TrainConfig's defaults as given. Returns rank 0's
    summary.
    """
    if config.resume:
        config, line = resumed_config(config, given)
        if line is not None and os.environ.get("RANK", "0") == "0":
            print(line, flush=True)
    # a model that cannot be built, or breaks the contract, fails here in one line, not inside a spawned rank
    entry, args = config.entry_point()
    model = build_model(entry, args, device="meta")
    contract = describe_model(model)
    check_contract(model, contract, labels=_label_shapes(config, contract))
    Path(config.out).mkdir(parents=True, exist_ok=True)
    _check_run_folder(config, delete=os.environ.get("RANK", "0") == "0")  # under torchrun only rank 0 deletes
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        backend = "nccl" if config.use_cuda() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            dist.init_process_group(backend)
        try:
            summary = train(config)
            dist.barrier()  # neither rank tears the group down while the other still talks
            return summary
        finally:
            _close_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = config.nproc_per_node
    if n < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {n}")
    if n == 1:
        _rank_entry(0, 1, port, config, config.out)
    else:
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)  # not "Terminating process N" on a rank's error: the error says why
        try:
            mp.spawn(_rank_entry, args=(n, port, config, config.out), nprocs=n)
        except mp.ProcessRaisedException as e:  # a rank's own error, as one line: the ranks stop together
            for tmp in Path(config.out, "checkpoints").glob("step_*.tmp-*"):  # a save whose rank 0 was stopped mid-way
                shutil.rmtree(tmp, ignore_errors=True)
            marker = f"{TrainingDiverged.__module__}.{TrainingDiverged.__name__}: "
            if marker in str(e):
                raise TrainingDiverged(str(e).rsplit(marker, 1)[1].strip()) from None
            os_error = carried(str(e))  # a full disk, a read-only folder: said in one line by the CLI
            if os_error is not None:
                raise os_error from None
            raise
        finally:
            spawn_log.setLevel(level)
    return json.loads(Path(config.out, "summary_rank0.json").read_text())


def _label_shapes(config: TrainConfig, contract: Dict[str, Any]) -> Dict[str, List[int]]:
    """{data: the shape of its first batch's labels} of the run's data functions (one batch each, pulled here, before
    any rank starts, so that a label shape the model's loss cannot take is one line); synthetic data and Criteo
    files have labels [B]."""
    shapes = {}
    for data in dict.fromkeys(d for d in (config.data, config.eval_data) if d is not None and is_entry_point(d)):
        world = int(os.environ.get("WORLD_SIZE", config.nproc_per_node))
        function = DataFunction(data, config.batch_size, 0, world, [f[0] for f in contract["features"]], contract["weighted"])
        try:
            first = next(iter(function), None)
        except ValueError:  # recship's own checks of the batch (features, labels), already naming the data
            raise
        except Exception as e:
            raise ValueError(f"--data {data} raised {type(e).__name__}: {e}") from None
        if first is not None:
            shapes[data] = list(first.labels.shape)
    return shapes


def _close_process_group() -> None:
    """Destroys the process group once nothing holds it: whatever a reference cycle still keeps (the training
    objects, a user's model) is collected first, so gloo's threads are joined now and not left running into
    interpreter exit, where one freeing a collective's tensors aborts the rank (SIGABRT, "terminate called
    without an active exception")."""
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def resumed_config(config: TrainConfig, given: Optional[Iterable[str]] = None) -> Tuple[TrainConfig, Optional[str]]:
    """(``config`` with what its run's newest checkpoint records, the line saying so) for ``--resume``; (``config``,
    None) without a checkpoint.

    Every field of ``RECORDED`` (the model's entry point and arguments or the built-in DLRM's shape, data and eval
    data, batch size, optimizer, learning rates, sharding, seed, eval/checkpoint cadence, keep-last) takes the
    checkpoint's value unless it is in ``given``: the fields the caller set (the CLI: flags and ``--config`` keys;
    None: those differing from TrainConfig's defaults, ``changed_fields``). A given value that cannot continue the
    checkpoint (another entry point, a model whose table or dense shapes differ from the saved ones) is a
    ValueError, one line. A checkpoint written before the run's config was recorded gives back its model only.
    """
    newest = latest_checkpoint(Path(config.out) / "checkpoints")
    if newest is None:
        return config, None
    saved = read_metadata(newest).get("config") or {}
    given = set(changed_fields(config) if given is None else given)
    recorded: Dict[str, Any] = {k: v for k, v in (saved.get("train") or {}).items() if k in RECORDED and k not in ("model", "model_args", *DLRM_SHAPE)}
    entry_point = saved.get("entry_point")
    if entry_point:
        entry, args = entry_point["model"], dict(entry_point.get("args") or {})
        if entry == DLRM_ENTRY:
            recorded.update({"model": None, "model_args": {}, **{k: args[k] for k in DLRM_SHAPE if k in args}})
        else:
            recorded.update({"model": entry, "model_args": args})
        wanted = config.entry_point()[0] if "model" in given else entry
        if wanted != entry:
            raise ValueError(f"--resume: {newest} trained {entry}, not --model {wanted}: a checkpoint continues its own model "
                             f"(leave --model out, or train {wanted} in another --out)")
    taken = {k: v for k, v in recorded.items() if k not in given}
    resumed = dataclasses.replace(config, **taken)
    if entry_point and resumed.entry_point() != (entry, args):
        _check_shapes(resumed, newest, given)
    overridden = [k for k in RECORDED if k in given and k in recorded and recorded[k] != getattr(resumed, k)]
    shown = {"model": resumed.entry_point()[0], "model args": json.dumps(resumed.entry_point()[1]), "data": resumed.data,
             "eval data": resumed.eval_data or ("its held-out stream" if resumed.data == "synthetic" else "none"),
             "batch size": resumed.batch_size, "optimizer": resumed.optimizer, "embedding lr": resumed.embedding_lr,
             "dense lr": resumed.dense_lr, "sharding": resumed.sharding or "the planner's", "seed": resumed.seed,
             "eval every": resumed.eval_every, "checkpoint every": resumed.checkpoint_every}
    line = (f"--resume from {newest.name}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
            + ("; from flags, over the checkpoint's: " + ", ".join(
                f"--{k.replace('_', '-')} {_flag_text(getattr(resumed, k))} (was {_flag_text(recorded[k])})" for k in overridden)
               if overridden else "; nothing overridden")
            + ("" if saved.get("train") else " (the checkpoint records its model only: the rest is as given or default)"))
    return resumed, line


def _sharders(optimizer: FusedOptimizerConfig) -> List[Any]:
    """TorchRec's default sharders with the run's fused optimizer: EmbeddingBagCollections and EmbeddingCollections
    are planned and sharded alike."""
    return [EmbeddingBagCollectionSharder(asdict(optimizer)), EmbeddingCollectionSharder(asdict(optimizer))]


def _replicated_sequence_tables(root: Path, model: nn.Module) -> List[str]:
    """The EmbeddingCollection tables that the newest checkpoint under ``root`` holds as dense parameters (replicated,
    as `recship train` trained every EmbeddingCollection before it sharded them): a resumed run keeps them so, since
    its dense optimizer state holds them."""
    path = latest_checkpoint(root)
    if path is None:
        return []
    dense = set(read_metadata(path)["dense_keys"])
    return [t.name for p, m in model.named_modules() if type(m) is EmbeddingCollection for t in m.embedding_configs()
            if (f"{p}.embeddings.{t.name}.weight" if p else f"embeddings.{t.name}.weight") in dense]


def _flag_text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value[:1] if len(set(value)) == 1 else value))
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _check_shapes(config: TrainConfig, checkpoint: Path, given: Iterable[str]) -> None:
    """ValueError, one line, if the model ``config`` builds (on meta) has other tables or dense shapes than
    ``checkpoint`` saved: flags that change the model's shape cannot continue it."""
    flags = ", ".join("--" + k.replace("_", "-") for k in ("model", "model_args", *DLRM_SHAPE) if k in given) or "the flags"
    entry, args = config.entry_point()
    model = build_model(entry, args, device="meta")
    reader = CheckpointReader(checkpoint)
    # every table the checkpoint holds sharded or replicated: EmbeddingBagCollections' and EmbeddingCollections'
    saved = {key: (t["config"]["num_embeddings"], t["config"]["embedding_dim"]) for key, t in reader.meta["tables"].items()}
    built: Dict[str, Tuple[int, int]] = {}
    for path, m in model.named_modules():
        if type(m) is EmbeddingBagCollection:
            built.update({f"{path}/{t.name}": (t.num_embeddings, t.embedding_dim) for t in m.embedding_bag_configs()})
        elif type(m) is EmbeddingCollection:
            built.update({f"{path}/{t.name}": (t.num_embeddings, t.embedding_dim) for t in m.embedding_configs()})
    for key, shape in saved.items():
        if built.get(key) != shape:
            what = f"{built[key][0]} x {built[key][1]}" if key in built else "no such table"
            raise ValueError(f"--resume: {flags} build a model that cannot continue {checkpoint}: table {key} is {shape[0]} x "
                             f"{shape[1]} there, {what} in {entry} {json.dumps(args)}")
    shapes = _dcp_shapes(checkpoint)
    prefix = reader.meta.get("dense_prefix", "dense/")
    for name, tensor in model.state_dict().items():  # sharded tables are no dense keys; data-parallel ones and ECs are
        if name not in reader.meta["dense_keys"]:
            continue
        have = tuple(shapes[prefix + name][0]) if prefix + name in shapes else None
        if have is not None and have != tuple(tensor.shape):
            raise ValueError(f"--resume: {flags} build a model that cannot continue {checkpoint}: {name} is {list(have)} there, "
                             f"{list(tensor.shape)} in {entry} {json.dumps(args)}")
    missing = sorted(set(reader.meta["dense_keys"]) - set(model.state_dict()))
    if missing:
        raise ValueError(f"--resume: {flags} build a model that cannot continue {checkpoint}: it has no {missing[0]}, which "
                         "the checkpoint holds")


def _check_run_folder(config: TrainConfig, delete: bool) -> None:
    """Refuses to train over earlier checkpoints unless told what to do with them (users lost runs this way)."""
    root = Path(config.out) / "checkpoints"
    newest = latest_checkpoint(root)
    if newest is None or config.resume:
        return
    if not config.overwrite:
        raise ValueError(
            f"{config.out} already holds checkpoints (newest: {newest.name}); pass --resume to continue them "
            "or --overwrite to delete them and start over (resume=True or overwrite=True in TrainConfig)"
        )
    if delete:
        shutil.rmtree(root)
        print(f"--overwrite: deleted the checkpoints in {root}", flush=True)
