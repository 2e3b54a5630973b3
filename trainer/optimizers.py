"""TorchRec's embedding-table optimizers (``torchrec.optim.optimizers``, ``torchrec.optim.rowwise_adagrad``).

    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.02})   # fused once sharded
    opt = Adam(unsharded_ebc.parameters(), lr=0.01, weight_decay=1e-5)           # or stepped as a dense optimizer

``SGD``, ``Adagrad``, ``Adam``, ``PartialRowWiseAdam``, ``LAMB``, ``PartialRowWiseLAMB`` and ``LarsSGD`` name fbgemm's
fused update rules (EXACT_SGD, EXACT_ADAGRAD, ADAM, PARTIAL_ROWWISE_ADAM, LAMB, PARTIAL_ROWWISE_LAMB, LARS_SGD). Their
keyword arguments are fbgemm's: ``lr`` (or ``learning_rate``), ``eps``, ``beta1``, ``beta2``, ``weight_decay``,
``eta``, ``momentum``, each rule taking the ones its kernel reads, with fbgemm's defaults (lr 0.01, eps 1e-8, beta1
0.9, beta2 0.999, weight_decay 0, eta 0.001, momentum 0.9). Handed to ``apply_optimizer_in_backward`` before
sharding, DistributedModelParallel fuses that rule into the sharded tables' backward (on CPU fbgemm has kernels for
EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD only; the others are refused there, naming the rule).

What differs from TorchRec: TorchRec's classes are placeholders whose ``step()`` raises NotImplementedError, and
whose unknown keywords reach fbgemm's constructor. recship's ``step()`` performs the same rule densely, so a table
kept unsharded (data-parallel, or a test's reference) trains as the fused kernel would; a keyword the rule does not
read is a ValueError naming it. As fbgemm's kernels, the step updates only the rows a batch looked up: the rows of a
sparse gradient, or the rows of a dense gradient that are not all zero (an embedding row no id touched); the step
counter ``t`` of the bias corrections counts every step, as fbgemm's ``iter``. Rows are ``p.reshape(p.shape[0], -1)``
(a 1-D parameter is one row). Per row (w, g: [D]; m, v: state; norms over the row):

    SGD                 w -= lr * g
    Adagrad             m += g^2;  w -= lr * g / (sqrt(m) + eps)
    Adam                m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
                        w -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * w)
    PartialRowWiseAdam  as Adam with one v per row: v = (1-b2) mean(g^2) + b2 v
    LAMB                r = m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * w;  w -= lr * |w| / |r| * r
    PartialRowWiseLAMB  as LAMB with one v per row:  r = m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * w
    LarsSGD             a = lr * eta * |w| / (|g| + wd |w|);  m = momentum m + a (g + wd w);  w -= m

``RowWiseAdagrad`` is TorchRec's real dense optimizer (every row, one accumulator per row, lr_decay, L2 weight decay,
``maximize``), with TorchRec's state (``step``: a float scalar tensor, ``sum``: [rows, 1]) and numbers.
"""

import math
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from recship.names import EmbOptimType

# fbgemm's SplitTableBatchedEmbeddingBagsCodegen defaults (fbgemm_gpu 1.8.0), which TorchRec's placeholders inherit
_FBGEMM_DEFAULTS: Dict[str, float] = {
    "learning_rate": 0.01, "eps": 1.0e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eta": 0.001, "momentum": 0.9,
}


def _rows(t: Tensor) -> Tensor:
    """``t`` as [rows, D] (a view: the step writes through it)."""
    return t.view(t.shape[0], -1) if t.dim() >= 2 else t.view(1, -1)


def _looked_up(grad: Tensor, param: Tensor) -> Tuple[Tensor, Tensor]:
    """(row indices [n] int64, their summed gradients [n, D]): the rows a step updates."""
    rows = param.shape[0] if param.dim() >= 2 else 1
    if grad.is_sparse:
        if grad.sparse_dim() != 1:
            raise ValueError(f"a sparse gradient must be sparse over rows only (sparse_dim 1), got sparse_dim {grad.sparse_dim()}")
        grad = grad.coalesce()  # sums the gradients of a row looked up several times, as fbgemm's backward does
        return grad.indices()[0], grad.values().reshape(grad.values().shape[0], -1)
    g = grad.reshape(rows, -1)
    index = g.ne(0).any(dim=1).nonzero().squeeze(1)
    return index, g.index_select(0, index)


class TableOptimizer(torch.optim.Optimizer):
    """An fbgemm embedding update rule as a dense torch optimizer (see the module docstring).

    Subclasses set ``optim_type`` (recship's fused kernel for it; None when recship fuses none), ``fbgemm_name``,
    ``hyper_parameters`` (the fbgemm keywords the rule reads, ``learning_rate`` first) and ``_update``.
    """

    optim_type: ClassVar[Optional[EmbOptimType]] = None
    fbgemm_name: ClassVar[str] = ""
    hyper_parameters: ClassVar[Tuple[str, ...]] = ("learning_rate",)

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        super().__init__(params, self.settings(kwargs))

    @classmethod
    def settings(cls, kwargs: Dict[str, Any]) -> Dict[str, float]:
        """The param-group settings of ``kwargs`` (fbgemm's names; ``lr`` and ``learning_rate`` are one setting,
        kept as "lr" so LR schedulers and WarmupOptimizer drive it), defaults filled in; ValueError for a keyword
        the rule does not read or a value out of range."""
        given = dict(kwargs)
        if "lr" in given:
            if "learning_rate" in given:
                raise ValueError(f"{cls.__name__}: give lr or learning_rate, not both ({given['lr']}, {given['learning_rate']})")
            given["learning_rate"] = given.pop("lr")
        unknown = sorted(set(given) - set(cls.hyper_parameters))
        if unknown:
            takes = ["lr"] + [h for h in cls.hyper_parameters if h != "learning_rate"]
            raise ValueError(f"{cls.__name__} (fbgemm's {cls.fbgemm_name}) takes {takes}; it does not read {unknown}")
        out = {name: float(given.get(name, _FBGEMM_DEFAULTS[name])) for name in cls.hyper_parameters}
        for name, value in out.items():
            bad = (value < 0 or (name == "eps" and value == 0) or (name in ("beta1", "beta2", "momentum") and value >= 1)
                   or not math.isfinite(value))
            if bad:
                raise ValueError(f"{cls.__name__}: {name}={value} is out of range")
        out["lr"] = out.pop("learning_rate")
        return out

    def _init_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        state["step"] = torch.tensor(0, dtype=torch.int64)

    def _update(self, group: Dict[str, Any], state: Dict[str, Any], rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        """The new values [n, D] of the rows ``rows`` (w, g: [n, D])."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                rows, g = _looked_up(p.grad, p)
                if rows.numel() == 0:
                    continue
                w = _rows(p)
                w.index_copy_(0, rows, self._update(group, state, rows, w.index_select(0, rows), g.to(w.dtype)))
        return loss


def _gather(state: Tensor, rows: Tensor) -> Tensor:
    return state.index_select(0, rows)


class SGD(TableOptimizer):
    """fbgemm's EXACT_SGD: ``w -= lr * g``. Keywords: lr."""

    optim_type = EmbOptimType.EXACT_SGD
    fbgemm_name = "EXACT_SGD"

    def _update(self, group: Dict[str, Any], state: Dict[str, Any], rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        return w - group["lr"] * g


class Adagrad(TableOptimizer):
    """fbgemm's EXACT_ADAGRAD: ``m += g^2; w -= lr * g / (sqrt(m) + eps)``. Keywords: lr, eps.
    State: ``momentum1`` [rows, D] (fbgemm's name for the running sum)."""

    optim_type = EmbOptimType.EXACT_ADAGRAD
    fbgemm_name = "EXACT_ADAGRAD"
    hyper_parameters = ("learning_rate", "eps")

    def _init_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        super()._init_state(param, state)
        state["momentum1"] = torch.zeros_like(_rows(param))

    def _update(self, group: Dict[str, Any], state: Dict[str, Any], rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        m = _gather(state["momentum1"], rows) + g * g
        state["momentum1"].index_copy_(0, rows, m)
        return w - group["lr"] * g / (m.sqrt() + group["eps"])


class _AdamFamily(TableOptimizer):
    """Adam, LAMB and their partial-rowwise forms: ``momentum1`` [rows, D], ``momentum2`` [rows, D] or [rows]."""

    hyper_parameters = ("learning_rate", "eps", "beta1", "beta2", "weight_decay")
    rowwise_second_moment: ClassVar[bool] = False
    trust_ratio: ClassVar[bool] = False  # LAMB: scale each row's step by |w| / |r|

    def _init_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        super()._init_state(param, state)
        rows = _rows(param)
        state["momentum1"] = torch.zeros_like(rows)
        state["momentum2"] = torch.zeros(rows.shape[0], dtype=rows.dtype) if self.rowwise_second_moment else torch.zeros_like(rows)

    def _update(self, group: Dict[str, Any], state: Dict[str, Any], rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        b1, b2, eps, wd = group["beta1"], group["beta2"], group["eps"], group["weight_decay"]
        t = int(state["step"])
        m = _gather(state["momentum1"], rows) * b1 + g * (1.0 - b1)
        state["momentum1"].index_copy_(0, rows, m)
        if self.rowwise_second_moment:
            v = g.pow(2).mean(dim=1) * (1.0 - b2) + _gather(state["momentum2"], rows) * b2
            state["momentum2"].index_copy_(0, rows, v)
            v = v.unsqueeze(1)
        else:
            v = _gather(state["momentum2"], rows) * b2 + g * g * (1.0 - b2)
            state["momentum2"].index_copy_(0, rows, v)
        r = m / (1.0 - b1**t) / ((v / (1.0 - b2**t)).sqrt() + eps) + wd * w
        if not self.trust_ratio:
            return w - group["lr"] * r
        ratio = w.norm(dim=1, keepdim=True) / r.norm(dim=1, keepdim=True)
        return w - group["lr"] * ratio * r


class Adam(_AdamFamily):
    """fbgemm's ADAM (weight decay inside the step, as AdamW). Keywords: lr, eps, beta1, beta2, weight_decay.
    State: ``momentum1``, ``momentum2`` [rows, D]."""

    optim_type = EmbOptimType.ADAM
    fbgemm_name = "ADAM"


class PartialRowWiseAdam(_AdamFamily):
    """fbgemm's PARTIAL_ROWWISE_ADAM: Adam with one second moment per row (``momentum2`` [rows], of mean(g^2))."""

    optim_type = EmbOptimType.PARTIAL_ROWWISE_ADAM
    fbgemm_name = "PARTIAL_ROWWISE_ADAM"
    rowwise_second_moment = True


class LAMB(_AdamFamily):
    """fbgemm's LAMB: Adam's direction r (weight decay included), each row's step scaled by |w| / |r|."""

    optim_type = EmbOptimType.LAMB
    fbgemm_name = "LAMB"
    trust_ratio = True


class PartialRowWiseLAMB(_AdamFamily):
    """fbgemm's PARTIAL_ROWWISE_LAMB: LAMB with one second moment per row (``momentum2`` [rows]). recship has no
    fused kernel for it (fbgemm's is CUDA-only and not wired into recship's sharded tables)."""

    fbgemm_name = "PARTIAL_ROWWISE_LAMB"
    rowwise_second_moment = True
    trust_ratio = True


class LarsSGD(TableOptimizer):
    """fbgemm's LARS_SGD: per row, a = lr * eta * |w| / (|g| + wd |w|); m = momentum m + a (g + wd w); w -= m.
    Keywords: lr, eta, momentum, weight_decay. State: ``momentum1`` [rows, D]. recship has no fused kernel for it."""

    fbgemm_name = "LARS_SGD"
    hyper_parameters = ("learning_rate", "eta", "momentum", "weight_decay")

    def _init_state(self, param: Tensor, state: Dict[str, Any]) -> None:
        super()._init_state(param, state)
        state["momentum1"] = torch.zeros_like(_rows(param))

    def _update(self, group: Dict[str, Any], state: Dict[str, Any], rows: Tensor, w: Tensor, g: Tensor) -> Tensor:
        wd = group["weight_decay"]
        w_norm = w.norm(dim=1, keepdim=True)
        rate = group["lr"] * group["eta"] * w_norm / (g.norm(dim=1, keepdim=True) + wd * w_norm)
        m = _gather(state["momentum1"], rows) * group["momentum"] + rate * (g + wd * w)
        state["momentum1"].index_copy_(0, rows, m)
        return w - m


# -- TorchRec's RowWiseAdagrad ------------------------------------------------------------------------------------


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (TorchRec's ``torchrec.optim.RowWiseAdagrad``), for [rows, D] parameters.

    Each step t (from 1), per row r, with g the gradient (-g if ``maximize``, + weight_decay * w if weight_decay):
    ``sum[r] += mean(g[r]^2)``; ``w[r] -= lr / (1 + (t - 1) * lr_decay) * g[r] / (sqrt(sum[r]) + eps)``.
    Unlike fbgemm's kernel it updates every row (a row without a gradient changes only by its weight decay).
    State: ``step`` (float scalar tensor), ``sum`` [rows, 1], starting at ``initial_accumulator_value``.
    Handed to ``apply_optimizer_in_backward`` before sharding, it is fused as fbgemm's EXACT_ROWWISE_ADAGRAD
    (weight decay as its L2 mode; lr_decay, initial_accumulator_value and maximize have no fused form: refused).
    ``unused``: TorchRec passes such keywords on to fbgemm; recship refuses them (ValueError naming them).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        **unused: Any,
    ) -> None:
        if unused:
            raise ValueError(f"RowWiseAdagrad does not read {sorted(unused)} (TorchRec passes them to fbgemm's fused kernel; "
                             "recship's fused kernel takes only lr, weight_decay and eps from here)")
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)):
            if not value >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {value}")
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, maximize=maximize)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"RowWiseAdagrad takes [rows, D] parameters, got shape {list(p.shape)}")
                self.state[p]["step"] = torch.tensor(0.0)
                self.state[p]["sum"] = torch.full_like(p, initial_accumulator_value).mean(dim=1).view(-1, 1)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
        for s in self.state.values():
            if not torch.is_tensor(s["step"]):
                s["step"] = torch.tensor(float(s["step"]))

    def share_memory(self) -> None:
        """Moves every accumulator to shared memory (for hogwild-style workers)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"].share_memory_()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            adagrad(with_grad, [p.grad for p in with_grad], [self.state[p]["sum"] for p in with_grad],
                    [self.state[p]["step"] for p in with_grad], lr=group["lr"], weight_decay=group["weight_decay"],
                    lr_decay=group["lr_decay"], eps=group["eps"], maximize=group["maximize"])
        return loss


def adagrad(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """One row-wise Adagrad step in place (TorchRec's functional ``torchrec.optim.rowwise_adagrad.adagrad``).

    Args:
        params: [rows, D] each, updated in place.
        grads: dense, the shapes of ``params``.
        state_sums: [rows, 1] each, the running mean of squared gradients, updated in place.
        state_steps: scalar tensors, incremented in place.
    """
    if not all(isinstance(t, Tensor) for t in state_steps):
        raise TypeError("state_steps must be scalar tensors (TorchRec's functional API)")
    for param, grad, state_sum, step_t in zip(params, grads, state_sums, state_steps):
        if grad.is_sparse:
            raise ValueError("row-wise Adagrad takes dense gradients")
        step_t += 1
        step = step_t.item()
        grad = -grad if maximize else grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        state_sum += grad.pow(2).mean(dim=1).view(-1, 1)
        std = state_sum.sqrt().add_(eps)
        param.addcdiv_(grad, std, value=-(lr / (1 + (step - 1) * lr_decay)))
