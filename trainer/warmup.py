"""TorchRec's learning-rate warmup (``torchrec.optim.warmup``): a wrapper that sets the wrapped optimizer's rate
every step from a list of stages.

    optimizer = WarmupOptimizer(CombinedOptimizer([dmp.fused_optimizer, dense_optimizer]),
                                stages=[WarmupStage(WarmupPolicy.LINEAR, max_iters=100, value=0.1),
                                        WarmupStage(WarmupPolicy.POLY, max_iters=1000, value=2.0)],
                                lr=0.05)

The rate of step ``i`` (counted from 0, over all stages) is ``lr * multiplier(stage, i) * stage.lr_scale``, where
the stage is the first whose ``max_iters`` ``i`` has not passed (stage k covers iterations up to and including its
``max_iters``; after the last, the multiplier is 1). The multipliers, as TorchRec's:

    LINEAR    value + (1 - value) * i / max_iters            (from ``value`` up to 1 at max_iters)
    CONSTANT  value
    POLY      (1 - i / decay_iters) ** value                 (decay_iters defaults to max_iters)
    STEP      value ** (i // decay_iters)                     (decay_iters defaults to 1)
    INVSQRT   1 / sqrt(i)
    COSINE_ANNEALING_WARM_RESTARTS  value + (1 - value) * (1 + cos(pi * (i % sgdr_period) / sgdr_period)) / 2
    INTERPOLATE  value + (end_value - value) * (i - start_interpolating_iters) / (max_iters - start_interpolating_iters)
                 (a straight line through (start_interpolating_iters, value) and (max_iters, end_value); ``i`` is the
                 global iteration, as everywhere above)

The rate reaches every param group of the wrapped optimizer, and so the kernels of fused embedding optimizers: the
wrapper applies it to them right away (a fused optimizer takes a new rate on ``step()`` or ``zero_grad()``), so the
next backward's fused update uses it even in a loop that calls ``zero_grad`` after ``step``.

The warmup counter [iteration, stage] (a [2] int64 tensor) is the state of TorchRec's placeholder parameter
``params[param_name]``: ``state[placeholder]["warmup"]`` and ``state_dict()["state"][param_name]["warmup"]``, so it
is checkpointed with the optimizer, and ``load_state_dict`` resumes the schedule at the saved iteration (and sets
its rate). What differs from TorchRec: the wrapper's ``state`` is a view, the wrapped optimizer's state plus that
entry, and the counter is never written into the wrapped optimizer's own state dict (recship's keyed optimizers
share it with the torch optimizer they wrap, whose own ``state_dict()`` would not know the extra parameter).
"""

import math
from dataclasses import dataclass
from enum import Enum, unique
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from recship.trainer.fused_optim import CombinedOptimizer, EmbeddingFusedOptimizer, KeyedOptimizer, OptimizerWrapper

_LAST_ITER = 1 << 63  # the stage after the last one never ends


@unique
class WarmupPolicy(Enum):
    NONE = "none"
    LINEAR = "linear"
    CONSTANT = "constant"
    POLY = "poly"
    STEP = "step"
    INVSQRT = "inv_sqrt"
    COSINE_ANNEALING_WARM_RESTARTS = "cosine_annealing_warm_restarts"
    INTERPOLATE = "interpolate"


@dataclass
class WarmupStage:
    """One stage of the schedule (TorchRec's fields and defaults).

    Args:
        policy: how the multiplier moves with the iteration.
        max_iters: the last iteration (counted from 0 over all stages) this stage covers.
        value: the policy's parameter (start of LINEAR, the CONSTANT, POLY's power, STEP's factor, COSINE's floor).
        lr_scale: multiplies this stage's multiplier.
        decay_iters: POLY's horizon (<= 0: max_iters) and STEP's step length (<= 0: 1).
        sgdr_period: COSINE_ANNEALING_WARM_RESTARTS's period, in iterations.
        start_interpolating_iters: INTERPOLATE's start iteration (where the multiplier is ``value``); required by it.
        end_value: INTERPOLATE's multiplier at ``max_iters``; required by it.
    """

    policy: WarmupPolicy = WarmupPolicy.LINEAR
    max_iters: int = 1
    value: float = 1.0
    lr_scale: float = 1.0
    decay_iters: int = -1
    sgdr_period: int = 1
    start_interpolating_iters: Optional[int] = None
    end_value: Optional[float] = None


def _checked_stages(stages: List[WarmupStage]) -> List[WarmupStage]:
    """The stages with their defaults filled in (as TorchRec, in place), then the endless stage of multiplier 1."""
    start = 0
    for k, stage in enumerate(stages):
        if not isinstance(stage, WarmupStage) or not isinstance(stage.policy, WarmupPolicy):
            raise TypeError(f"stage {k} must be a WarmupStage with a WarmupPolicy, got {stage!r}")
        if stage.max_iters <= start:
            raise ValueError(f"stage {k} ({stage}) must end after iteration {start}, where the stage before it ends: "
                             f"max_iters must grow from stage to stage")
        if stage.policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS and stage.sgdr_period < 1:
            raise ValueError(f"stage {k}: sgdr_period must be >= 1, got {stage.sgdr_period}")
        if stage.policy == WarmupPolicy.INTERPOLATE:
            if stage.start_interpolating_iters is None or stage.end_value is None:
                raise ValueError(f"stage {k} ({stage}): INTERPOLATE needs start_interpolating_iters and end_value")
            if stage.max_iters <= stage.start_interpolating_iters:
                raise ValueError(f"stage {k}: INTERPOLATE's max_iters ({stage.max_iters}) must be greater than its "
                                 f"start_interpolating_iters ({stage.start_interpolating_iters})")
        start = stage.max_iters
        if stage.decay_iters <= 0:
            stage.decay_iters = 1 if stage.policy == WarmupPolicy.STEP else stage.max_iters
    if stages and stages[0].policy == WarmupPolicy.INVSQRT:
        raise ValueError("the first stage cannot be INVSQRT: its multiplier 1/sqrt(iteration) is infinite at iteration 0 "
                         "(start with a LINEAR or CONSTANT stage)")
    return list(stages) + [WarmupStage(policy=WarmupPolicy.NONE, max_iters=_LAST_ITER, value=1.0)]


def _multiplier(stage: WarmupStage, i: int) -> float:
    """The factor on the base rate at iteration ``i`` (see the module docstring)."""
    policy = stage.policy
    if policy == WarmupPolicy.LINEAR:
        m = stage.value + (1.0 - stage.value) * i / stage.max_iters
    elif policy == WarmupPolicy.CONSTANT:
        m = stage.value
    elif policy == WarmupPolicy.POLY:
        m = math.pow(1.0 - i / stage.decay_iters, stage.value)
    elif policy == WarmupPolicy.STEP:
        m = math.pow(stage.value, i // stage.decay_iters)
    elif policy == WarmupPolicy.INVSQRT:
        m = 1.0 / math.sqrt(i)
    elif policy == WarmupPolicy.COSINE_ANNEALING_WARM_RESTARTS:
        # SGDR (arXiv 1608.03983) without the period multiplier: the phase is i modulo the period
        phase = (i % stage.sgdr_period) / stage.sgdr_period
        m = stage.value + (1.0 - stage.value) * 0.5 * (1.0 + math.cos(math.pi * phase))
    elif policy == WarmupPolicy.INTERPOLATE:
        start, end = stage.start_interpolating_iters, stage.end_value
        assert start is not None and end is not None  # _checked_stages saw to it
        m = stage.value + (end - stage.value) * (i - start) / (stage.max_iters - start)
    else:
        m = 1.0
    return m * stage.lr_scale


def _fused_optimizers(optimizer: Any) -> Iterator[EmbeddingFusedOptimizer]:
    """The fused embedding optimizers inside a tree of keyed optimizers."""
    if isinstance(optimizer, EmbeddingFusedOptimizer):
        yield optimizer
    elif isinstance(optimizer, CombinedOptimizer):
        for _, sub in optimizer.optimizers:
            yield from _fused_optimizers(sub)
    elif isinstance(optimizer, OptimizerWrapper):
        yield from _fused_optimizers(optimizer._optimizer)


class WarmupOptimizer(OptimizerWrapper):
    """Sets the wrapped optimizer's learning rate every step from ``stages`` (TorchRec's ``WarmupOptimizer``).

    Args:
        optimizer: the keyed optimizer to drive (a CombinedOptimizer, DMP's ``fused_optimizer``, a
            KeyedOptimizerWrapper, ...).
        stages: the schedule; ``max_iters`` must grow from stage to stage. Filled in place with their default
            ``decay_iters``, as TorchRec does.
        lr: the base rate the multipliers scale.
        lr_param: the param-group entry to set.
        param_name: the name of the warmup counter in ``params`` and ``state_dict()``.
    """

    def __init__(self, optimizer: KeyedOptimizer, stages: List[WarmupStage], lr: float = 0.1, lr_param: str = "lr",
                 param_name: str = "__warmup") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"WarmupOptimizer wraps a (keyed) optimizer, got {type(optimizer).__name__}")
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        self._optimizer = optimizer
        self._warmup_param = torch.nn.Parameter()  # TorchRec's placeholder: it names the warmup counter among the params
        self._iter, self._stage_id = 0, 0
        super().__init__(optimizer)
        self._stages = _checked_stages(list(stages))
        self._lr = lr
        self._lr_param = lr_param
        self._param_name = param_name
        self.params[param_name] = self._warmup_param
        self._set_lr()

    @property  # type: ignore[override]
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        """The wrapped optimizer's state and, under the placeholder parameter, {"warmup": tensor([iteration, stage])}
        (TorchRec's layout: the counter after the wrapped parameters' states)."""
        out = dict(self._optimizer.state)
        out[self._warmup_param] = {"warmup": torch.tensor([self._iter, self._stage_id], dtype=torch.long)}
        return out

    @state.setter
    def state(self, value: Any) -> None:
        # KeyedOptimizer.__init__ assigns the wrapped optimizer's state, which the view above reads already
        if value is not self._optimizer.state:
            raise AttributeError("WarmupOptimizer.state is a view of the wrapped optimizer's state; set that instead")

    @property
    def warmup_state(self) -> Tuple[int, int]:
        """(iteration, stage index): where the schedule is."""
        return self._iter, self._stage_id

    @property
    def learning_rate(self) -> float:
        """The rate the next step uses."""
        return self._lr * _multiplier(self._stages[self._stage_id], self._iter)

    def _set_lr(self) -> None:
        lr = self.learning_rate
        for group in self.param_groups:
            group[self._lr_param] = lr
        if self._lr_param == "lr":
            for fused in _fused_optimizers(self._optimizer):
                fused.step()  # no update: it applies the new rate to the kernel before the next backward

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Steps the wrapped optimizer at the current rate, then moves the schedule on by one iteration."""
        out = super().step(closure)
        self._iter += 1
        if self._iter > self._stages[self._stage_id].max_iters and self._stage_id + 1 < len(self._stages):
            self._stage_id += 1
        self._set_lr()
        return out

    def post_load_state_dict(self) -> None:
        """Sets the rate of the restored iteration (TorchRec's hook, called by ``load_state_dict``)."""
        self._set_lr()

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with the counter under ``state[param_name]["warmup"]``."""
        out = dict(self._optimizer.state_dict())
        out["state"] = {**out.get("state", {}), self._param_name: self.state[self._warmup_param]}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restores the wrapped optimizer and the schedule (a state_dict without the counter restarts it at 0)."""
        state = dict(state_dict.get("state", {}))
        counter = state.pop(self._param_name, None)
        self._optimizer.load_state_dict({**state_dict, "state": state})
        if counter is None:
            self._iter, self._stage_id = 0, 0
        else:
            warmup = counter["warmup"] if isinstance(counter, Mapping) else counter
            values = torch.as_tensor(warmup).tolist()
            if len(values) != 2 or not 0 <= values[1] < len(self._stages):
                raise ValueError(f"state_dict's {self._param_name!r} must be [iteration, stage < {len(self._stages)}], got {values}")
            self._iter, self._stage_id = int(values[0]), int(values[1])
        self.post_load_state_dict()

