"""Gradient accumulation around a training pipeline (TorchRec's ``torchrec.distributed.train_pipeline``
``GradientAccumulationConfig`` and ``GradientAccumulationWrapper``).

    config = GradientAccumulationConfig(num_steps=4)        # is_enabled follows from num_steps > 1
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    wrapped = GradientAccumulationWrapper(pipeline, optimizer, dmp, config)
    while True:
        try:
            wrapped.progress(it)     # one micro-batch: forward, backward; step every 4th call
        except StopIteration:        # the gradients of a last, incomplete cycle are stepped first
            break

Each ``progress`` is one micro-batch. The wrapper puts its own optimizer into the pipeline: its ``zero_grad`` only
clears gradients at the start of a cycle and its ``step`` only steps on a cycle's last micro-batch, so the dense
parameters see the sum of ``num_steps`` micro-batches' gradients: with a loss summed over examples, that is one step
on the micro-batches concatenated. Between a cycle's micro-batches the data-parallel wrappers (DDP, the outer one
and any inside the model) skip their all-reduce (``no_sync``), except during the first ``num_warmup_steps`` calls
(DDP with ``static_graph=True``, DMP's default, must all-reduce its first backward).

As in TorchRec, the sharded tables are not accumulated: their optimizer is fused into backward, so every
micro-batch updates them (``DistributedModelParallel.fused_optimizer.step()`` does nothing); a model whose tables
should accumulate too must keep them out of the fused optimizer (data-parallel tables are dense parameters here).
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Generic, Iterator, List, Optional, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass
class GradientAccumulationConfig:
    """Gradient accumulation settings (TorchRec's fields and defaults).

    Args:
        is_enabled: accumulate; set to True by itself when ``num_steps > 1``.
        num_steps: micro-batches per optimizer step (>= 1).
        num_warmup_steps: the first calls of ``progress`` that all-reduce every micro-batch (>= 1: DDP with
            ``static_graph=True`` must all-reduce its first backward).
    """

    is_enabled: bool = False
    num_steps: int = 1
    num_warmup_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("num_steps", "num_warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GradientAccumulationConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_steps > 1:
            self.is_enabled = True


class _GAOptimizerWrapper:
    """The optimizer the pipeline sees while accumulating: ``zero_grad`` clears only at the start of a cycle,
    ``step`` steps only on its last micro-batch; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: GradientAccumulationConfig) -> None:
        self._optimizer = optimizer
        self._config = config
        self._current_step = 0
        self._needs_zero_grad = True

    def _should_step(self) -> bool:
        return (self._current_step + 1) % self._config.num_steps == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._needs_zero_grad:
            self._optimizer.zero_grad(set_to_none=set_to_none)
            self._needs_zero_grad = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._should_step():
            self._optimizer.step(*args, **kwargs)
            self._needs_zero_grad = True

    def advance_step(self) -> None:
        self._current_step += 1

    def reset(self) -> None:
        self._current_step = 0
        self._needs_zero_grad = True

    def set_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"set_step: step must be an int >= 0, got {step!r}")
        self._current_step = step

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)


class GradientAccumulationWrapper(Generic[In, Out]):
    """Adds gradient accumulation to a pipeline (TorchRec's constructor; see the module docstring).

    Args:
        pipeline: the TrainPipeline (TrainPipelineBase, TrainPipelineSparseDist, ...); when accumulation is enabled
            its ``_optimizer`` is replaced by the wrapper's.
        optimizer: the optimizer the pipeline steps (the dense one, or a CombinedOptimizer with DMP's
            ``fused_optimizer``).
        model: the pipeline's model (DistributedModelParallel, DDP or a plain module): where ``no_sync`` is found.
        config: a GradientAccumulationConfig; disabled, ``progress`` is the pipeline's.
    """

    def __init__(self, pipeline: Any, optimizer: torch.optim.Optimizer, model: nn.Module,
                 config: GradientAccumulationConfig) -> None:
        if not callable(getattr(pipeline, "progress", None)):
            raise TypeError(f"GradientAccumulationWrapper wraps a TrainPipeline (with progress()), got {type(pipeline).__name__}")
        if not isinstance(config, GradientAccumulationConfig):
            raise TypeError(f"config must be a GradientAccumulationConfig, got {type(config).__name__}")
        self._pipeline = pipeline
        self._model = model
        self._config = config
        self._optimizer_wrapper = _GAOptimizerWrapper(optimizer, config)
        self._cached_ddp_modules: Optional[List[Any]] = None
        if config.is_enabled and hasattr(pipeline, "_optimizer"):
            pipeline._optimizer = self._optimizer_wrapper

    # -- when to all-reduce -----------------------------------------------------------------------------------------

    def _should_sync_grad(self, is_last_batch: bool = False) -> bool:
        """All-reduce on a cycle's last micro-batch, on a batch marked last, and during the warmup calls."""
        step = self.current_step
        if is_last_batch or step == 0 or step < self._config.num_warmup_steps:
            return True
        return (step + 1) % self._config.num_steps == 0

    def _get_ddp_modules(self) -> List[Any]:
        """What ``no_sync`` is entered on (found once): the outer data-parallel wrapper (anything with ``no_sync``,
        under DistributedModelParallel's ``_dmp_wrapped_module``) and every DistributedDataParallel inside it."""
        if self._cached_ddp_modules is not None:
            return self._cached_ddp_modules
        found: List[Any] = []
        root: Any = self._model
        wrapped = getattr(self._model, "_dmp_wrapped_module", None)
        if isinstance(wrapped, nn.Module):
            root = wrapped
        elif wrapped is not None and hasattr(wrapped, "no_sync"):
            found.append(wrapped)
        if hasattr(root, "no_sync"):
            found.append(root)
        if isinstance(root, nn.Module):
            found += [m for m in root.modules() if m is not root and isinstance(m, DistributedDataParallel)]
        self._cached_ddp_modules = found
        return found

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for ddp in self._get_ddp_modules():
                stack.enter_context(ddp.no_sync())
            yield

    def _flush_accumulated_gradients(self, steps_accumulated: int) -> bool:
        """Steps (and clears) the gradients of an incomplete cycle; True when there was one."""
        if steps_accumulated % self._config.num_steps == 0:
            return False
        self._optimizer_wrapper._optimizer.step()
        self._optimizer_wrapper._optimizer.zero_grad(set_to_none=True)
        self._optimizer_wrapper._needs_zero_grad = False
        return True

    # -- the step ---------------------------------------------------------------------------------------------------

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: Optional[bool] = None) -> Out:
        """One micro-batch through the pipeline; the optimizer steps on a cycle's last one.

        Args:
            dataloader_iter: the batches.
            is_last_batch: True: all-reduce this micro-batch and step what has accumulated, cycle complete or not.

        Raises:
            StopIteration: the pipeline has nothing left; an incomplete cycle's gradients are stepped first.
        """
        if not self._config.is_enabled:
            return self._pipeline.progress(dataloader_iter)
        sync = self._should_sync_grad(bool(is_last_batch))
        try:
            with contextlib.nullcontext() if sync else self._no_sync():
                result = self._pipeline.progress(dataloader_iter)
        except StopIteration:
            self._flush_accumulated_gradients(self.current_step)
            raise
        self._optimizer_wrapper.advance_step()
        if is_last_batch:
            self._flush_accumulated_gradients(self.current_step)
        return result

    def reset(self) -> None:
        """Starts a new cycle at step 0 and resets the pipeline."""
        self._optimizer_wrapper.reset()
        if hasattr(self._pipeline, "reset"):
            self._pipeline.reset()

    @property
    def optimizer_wrapper(self) -> _GAOptimizerWrapper:
        return self._optimizer_wrapper

    @property
    def current_step(self) -> int:
        """Micro-batches trained on since the start (or ``reset`` / ``set_step``)."""
        return self._optimizer_wrapper._current_step

    def set_step(self, step: int) -> None:
        """Sets the micro-batch counter (e.g. when resuming from a checkpoint)."""
        self._optimizer_wrapper.set_step(step)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_pipeline":
            raise AttributeError(name)
        return getattr(self._pipeline, name)


__all__ = ["GradientAccumulationConfig", "GradientAccumulationWrapper"]
