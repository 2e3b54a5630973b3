"""Optimizers fused into the embedding backward (fbgemm TBE): their names, settings and handles.

The update happens inside ``backward()``; no embedding gradient is materialised.
On CPU fbgemm implements only EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD;
the others need CUDA and are refused at construction on CPU.

Settings come in three ways, as in TorchRec: a ``FusedOptimizerConfig``, a sharder's
``fused_params`` dict (``fused_config``), or torch's ``_apply_optimizer_in_backward``
on the unsharded tables (``fused_config_from_torch``: torch's SGD, Adagrad and Adam,
TorchRec's ``RowWiseAdagrad`` and TorchRec's fbgemm-rule classes of ``recship.trainer.optimizers``
map to their fbgemm kernels; a setting fbgemm cannot honour, such as SGD momentum, is an
error, never ignored). After sharding, ``fused_optimizer`` is a
``CombinedOptimizer`` of one ``EmbeddingFusedOptimizer`` per sharded module; changing a
param group's ``lr`` and calling ``step()`` or ``zero_grad()`` (as TorchRec's) sets the rate
used from the next backward on.
"""

import abc
import inspect
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.optim import _apply_optimizer_in_backward

from recship.names import EmbOptimType
from recship.trainer.optimizers import RowWiseAdagrad, TableOptimizer


@dataclass
class FusedOptimizerConfig:
    """Settings of the fused embedding optimizer (shared by every table).

    Args:
        optimizer: which update rule.
        learning_rate: step size; change it between steps with
            ``fused_optimizer.set_learning_rate`` (or a param group's "lr" and ``step()``).
        eps: added to the denominator (adagrad, adam, lamb).
        weight_decay: L2 weight decay (CUDA only: fbgemm's CPU kernels ignore it, so
            it is refused on CPU).
        beta1, beta2: moment decay (adam, partial-rowwise adam, lamb).
    """

    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD
    learning_rate: float = 0.01
    eps: float = 1.0e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, EmbOptimType):
            raise TypeError(f"optimizer must be an EmbOptimType, got {self.optimizer!r}")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    def check_device(self, device_type: str) -> None:
        """Raises ValueError if this optimizer cannot run on ``device_type``."""
        if device_type == "cpu" and not self.optimizer.cpu_supported:
            supported = ", ".join(o.name for o in EmbOptimType if o.cpu_supported)
            raise ValueError(
                f"fused optimizer {self.optimizer.name} runs on CUDA only (fbgemm has no CPU "
                f"kernel for it); on CPU use one of {supported}"
            )
        if device_type == "cpu" and self.weight_decay != 0:
            # fbgemm-gpu-cpu 1.8.0 accepts weight_decay on CPU but its kernels ignore it
            # (checked for every CPU optimizer, L2 and decoupled): refuse, don't train silently without it.
            raise ValueError(
                f"weight_decay={self.weight_decay} is not applied by fbgemm's CPU kernels; "
                "use weight_decay=0 on CPU (it is honoured on CUDA)"
            )


# -- the three ways to give the settings ---------------------------------------


def fused_config(fused_params: Optional[Mapping[str, Any]]) -> FusedOptimizerConfig:
    """A sharder's ``fused_params`` (TorchRec's keys) as a FusedOptimizerConfig.

    ``optimizer`` may be recship's EmbOptimType, fbgemm's (matched by name) or a name;
    the other keys are FusedOptimizerConfig's fields. Unknown keys are an error.
    """
    params = dict(fused_params or {})
    known = {f.name for f in fields(FusedOptimizerConfig)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"fused_params {unknown} are not supported by recship; it takes {sorted(known)}")
    if "optimizer" in params:
        params["optimizer"] = _optim_type(params["optimizer"])
    return FusedOptimizerConfig(**params)


def _optim_type(value: Any) -> EmbOptimType:
    """recship's EmbOptimType for itself, fbgemm's enum member of the same name, or a name."""
    if isinstance(value, EmbOptimType):
        return value
    name = value.name if isinstance(value, Enum) else str(value).upper()
    try:
        return EmbOptimType[name]
    except KeyError:
        raise ValueError(f"fused optimizer {value!r} is not supported; recship has {[o.name for o in EmbOptimType]}") from None


_FROM_TORCH = {
    torch.optim.SGD: EmbOptimType.EXACT_SGD,
    torch.optim.Adagrad: EmbOptimType.EXACT_ADAGRAD,
    RowWiseAdagrad: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    torch.optim.Adam: EmbOptimType.ADAM,
}
# torch optimizer arguments that only choose an implementation, not the update
_IMPLEMENTATION_ONLY = {"foreach", "fused", "differentiable", "capturable"}


def fused_config_from_torch(optimizer_class: type, kwargs: Mapping[str, Any]) -> FusedOptimizerConfig:
    """The fused optimizer that performs ``optimizer_class(params, **kwargs)``'s update.

    As in TorchRec, only the arguments given are passed on: an unset one takes fbgemm's default (eps 1e-8, where
    torch.optim.Adagrad's own is 1e-10; lr 0.01, betas (0.9, 0.999) and weight_decay 0 are the same in both).
    An argument fbgemm's kernel has no equivalent for, set to anything but the torch class's default,
    raises ValueError naming it.
    """
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, TableOptimizer):
        return _fused_config_of_rule(optimizer_class, kwargs)
    if optimizer_class not in _FROM_TORCH:
        supported = ", ".join(c.__name__ for c in _FROM_TORCH)
        raise ValueError(f"no fused embedding optimizer for {optimizer_class.__name__}; recship fuses {supported} and "
                         "recship.distributed's SGD, Adagrad, Adam, PartialRowWiseAdam and LAMB")
    optim = _FROM_TORCH[optimizer_class]
    defaults = {
        name: p.default
        for name, p in inspect.signature(optimizer_class).parameters.items()
        if name != "params" and p.default is not inspect.Parameter.empty
    }
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise ValueError(f"{optimizer_class.__name__} has no arguments {unknown}")
    args = {**defaults, **kwargs}
    settings: Dict[str, Any] = {"optimizer": optim}
    if "lr" in kwargs:
        settings["learning_rate"] = float(kwargs["lr"])
    if "eps" in kwargs:
        settings["eps"] = float(kwargs["eps"])
    if "weight_decay" in kwargs:
        settings["weight_decay"] = float(kwargs["weight_decay"])
    if "betas" in kwargs:
        settings["beta1"], settings["beta2"] = (float(b) for b in kwargs["betas"])
    for name, value in args.items():
        if name in ("lr", "eps", "weight_decay", "betas") or name in _IMPLEMENTATION_ONLY:
            continue
        if value != defaults[name]:
            raise ValueError(
                f"{optimizer_class.__name__}({name}={value!r}) cannot be fused: fbgemm's {optim.name} "
                f"kernel has no {name!r} (only its default {defaults[name]!r} is supported)"
            )
    return FusedOptimizerConfig(**settings)


def _fused_config_of_rule(optimizer_class: type, kwargs: Mapping[str, Any]) -> FusedOptimizerConfig:
    """TorchRec's fbgemm-rule classes (recship.trainer.optimizers): their keywords are the kernel's, defaults fbgemm's."""
    settings = optimizer_class.settings(dict(kwargs))  # type: ignore[attr-defined]
    optim = optimizer_class.optim_type  # type: ignore[attr-defined]
    if optim is None:
        raise ValueError(f"{optimizer_class.__name__} (fbgemm's {optimizer_class.fbgemm_name}) cannot be fused by recship: "  # type: ignore[attr-defined]
                         f"its sharded tables run {', '.join(o.name for o in EmbOptimType)}; step it as a dense optimizer instead")
    defaults = FusedOptimizerConfig()
    return FusedOptimizerConfig(
        optimizer=optim, learning_rate=settings["lr"], eps=settings.get("eps", defaults.eps),
        weight_decay=settings.get("weight_decay", 0.0), beta1=settings.get("beta1", defaults.beta1),
        beta2=settings.get("beta2", defaults.beta2),
    )


# -- optimizer handles ---------------------------------------------------------


class KeyedOptimizer(torch.optim.Optimizer):
    """An optimizer whose parameters have names (TorchRec's KeyedOptimizer).

    Args:
        params: name -> parameter.
        state: parameter -> its state.
        param_groups: torch's param groups (dicts with "params" and hyper-parameters).
    """

    def __init__(
        self, params: Mapping[str, torch.Tensor], state: Mapping[Any, Any], param_groups: List[Dict[str, Any]]
    ) -> None:
        # torch.optim.Optimizer.__init__ would re-add the groups (and refuses an empty
        # list, which a rank without shards has): set what its methods use instead.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.defaults: Dict[str, Any] = {}
        self.params = dict(params)
        self.state = state  # type: ignore[assignment]
        self.param_groups = param_groups
        param_ids = {id(p) for p in self.params.values()}
        strays = [key for key in state if id(key) not in param_ids]
        if strays:  # TorchRec's words, so code matching them keeps working
            raise ValueError(f"All state keys must be params. The following keys are not: {strays}.")

    def __getstate__(self) -> Dict[str, Any]:
        # torch.optim.Optimizer pickles only defaults, state and param_groups; a keyed optimizer needs all of itself
        # (its params, a wrapper's wrapped optimizer), as TorchRec's
        return self.__dict__

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has a fixed set of parameters")

    def init_state(self, sparse_grad_parameter_names: Optional[Set[str]] = None) -> None:
        """Creates the (lazy) optimizer state by one step on zero gradients (sparse ones for the parameters named in
        ``sparse_grad_parameter_names``), as TorchRec's, so a checkpoint's state can be loaded into it in place."""
        for key, param in self.params.items():
            if param.requires_grad:
                zero = torch.zeros_like(param)
                param.grad = zero.to_sparse() if sparse_grad_parameter_names is not None and key in sparse_grad_parameter_names else zero
        self.step(closure=None)

    def post_load_state_dict(self) -> None:
        """Called at the end of ``load_state_dict`` (TorchRec's hook; nothing to do here)."""

    def save_param_groups(self, save: bool) -> None:
        """Whether ``state_dict()`` includes "param_groups" (TorchRec's default: not)."""
        self.defaults["_save_param_groups"] = save

    def state_dict(self) -> Dict[str, Any]:
        """TorchRec's keyed form: {"state": {parameter name: its state}} (plus "param_groups", their
        parameters by name, after ``save_param_groups(True)``). Sharded state stays ShardedTensors,
        so ``torch.distributed.checkpoint`` saves it and reshards it on load."""
        key_of = {id(p): k for k, p in self.params.items()}
        out: Dict[str, Any] = {"state": {key_of[id(p)]: _state_content(s) for p, s in self.state.items() if id(p) in key_of}}
        if self.defaults.get("_save_param_groups", False):
            out["param_groups"] = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": sorted(key_of[id(p)] for p in g["params"])}
                for g in self.param_groups
            ]
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Copies a ``state_dict()`` of the same parameters into this optimizer's state, in place (TorchRec's)."""
        new_state = state_dict["state"]
        for key, p in self.params.items():
            if p not in self.state or not self.state[p]:
                continue
            if key not in new_state:
                raise ValueError(f"optimizer state_dict has no state for parameter {key!r} (it has {sorted(new_state)})")
            _copy_state(self.state[p], new_state[key], key)
        if "param_groups" in state_dict:
            key_of = {id(p): k for k, p in self.params.items()}
            given = {"/".join(sorted(g["params"])): g for g in state_dict["param_groups"]}
            for group in self.param_groups:
                name = "/".join(sorted(key_of[id(p)] for p in group["params"]))
                if name not in given:
                    raise ValueError(f"optimizer state_dict has no param group of {name!r}")
                group.update({k: v for k, v in given[name].items() if k != "params"})
        self.post_load_state_dict()


def _state_content(state: Mapping[str, Any]) -> Dict[str, Any]:
    """A parameter's state for ``state_dict()``: nested dicts copied, and an object with a ``state_dict()`` method (an
    optimizer module kept in the state, say) replaced by its ``state_dict()``, as TorchRec's. ``load_state_dict`` gives
    such an object its part back through its ``load_state_dict``."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _state_content(value)
        elif callable(getattr(value, "state_dict", None)):
            out[key] = value.state_dict()
        else:
            out[key] = value
    return out


def _copy_state(dst: Dict[str, Any], src: Dict[str, Any], path: str) -> None:
    """Copies a fused optimizer's per-parameter state ``src`` into ``dst`` in place (tensors) or by value (the rest)."""
    for key, current in dst.items():
        if key not in src:
            raise ValueError(f"optimizer state {path}: {key!r} is missing from the state_dict (it has {sorted(src)})")
        new = src[key]
        if isinstance(current, dict):
            _copy_state(current, new, f"{path}.{key}")
        elif not isinstance(current, torch.Tensor) and callable(getattr(current, "load_state_dict", None)):
            current.load_state_dict(new)  # an object in the state that saves itself (its state_dict() was saved)
        elif isinstance(current, ShardedTensor):
            if not isinstance(new, ShardedTensor) or list(new.size()) != list(current.size()):
                got = list(new.size()) if isinstance(new, (torch.Tensor, ShardedTensor)) else type(new).__name__
                raise ValueError(f"optimizer state {path}.{key}: expected a ShardedTensor {list(current.size())}, got {got}")
            given = {tuple(s.metadata.shard_offsets): s.tensor for s in new.local_shards()}
            with torch.no_grad():
                for shard in current.local_shards():
                    src_t = given.get(tuple(shard.metadata.shard_offsets))
                    if src_t is None or src_t.shape != shard.tensor.shape:
                        raise ValueError(f"optimizer state {path}.{key}: no matching local shard at {shard.metadata.shard_offsets}")
                    if src_t.data_ptr() != shard.tensor.data_ptr():
                        shard.tensor.copy_(src_t)
        elif isinstance(current, torch.Tensor):
            with torch.no_grad():
                current.copy_(new)
        else:
            dst[key] = new


class FusedOptimizer(KeyedOptimizer, abc.ABC):
    """A keyed optimizer whose update happens in backward (TorchRec's): ``step`` and ``zero_grad`` have no gradients
    to act on; subclasses define what they do (recship's apply a changed learning rate)."""

    @abc.abstractmethod
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        ...

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = False) -> None:
        ...

    def __repr__(self) -> str:
        return torch.optim.Optimizer.__repr__(self)


class EmptyFusedOptimizer(FusedOptimizer):
    """A fused optimizer over no parameters (TorchRec's): a module with nothing fused returns it."""

    def __init__(self) -> None:
        super().__init__({}, {}, [])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass


class FusedOptimizerModule(abc.ABC):
    """A module that updates its own parameters in backward and exposes the handle as ``fused_optimizer``
    (TorchRec's). Any class defining ``fused_optimizer`` counts as one (``isinstance`` checks the attribute, as
    ``collections.abc`` does), so recship's sharded collections are FusedOptimizerModules without deriving from it."""

    @property
    @abc.abstractmethod
    def fused_optimizer(self) -> KeyedOptimizer:
        ...

    @classmethod
    def __subclasshook__(cls, subclass: type) -> Any:
        if cls is FusedOptimizerModule:
            return True if any("fused_optimizer" in vars(c) for c in subclass.__mro__) else NotImplemented
        return NotImplemented


class EmbeddingFusedOptimizer(FusedOptimizer):
    """The optimizer fused into one sharded module's TBE: one param group whose "lr" is the kernel's.

    ``params`` are the sharded tables (``embedding_bags.<table>.weight``, ShardedTensors of this
    rank's shards); ``state`` maps each to TorchRec's ``{"<table>.momentum1": ShardedTensor}``,
    views of the kernel's state. ``step()`` applies a changed "lr".
    """

    def __init__(self, module: Any, config: FusedOptimizerConfig) -> None:
        # a weak reference: the module holds this optimizer, and a cycle would keep both (and the process group they
        # hold) alive past destroy_process_group, until a gloo thread freed a collective's tensors at interpreter exit
        # and aborted the process ("terminate called without an active exception")
        self._module_ref = weakref.ref(module)
        params, state = module.fused_optimizer_state()
        super().__init__(params, state, [{"params": list(params.values()), "lr": config.learning_rate}])
        self._applied_lr = config.learning_rate

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """No update (it happened in backward); applies a changed learning rate."""
        lr = self.param_groups[0]["lr"]
        if lr != self._applied_lr:
            module = self._module_ref()
            if module is None:
                raise RuntimeError("the sharded module of this fused optimizer is gone")
            module.set_learning_rate(lr)
            self._applied_lr = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Fused tables keep no gradients; applies a changed "lr" (as TorchRec's does), so that a rate set before
        the loop's zero_grad (an LR scheduler's, a warmup's) is the one the next backward uses."""
        self.step()

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        """Sets the kernel's learning rate from ``params_dict["lr"]`` (or ``"learning_rate"``), as TorchRec's; recship's
        kernels take no other setting after construction (ValueError naming it)."""
        others = sorted(set(params_dict) - {"lr", "learning_rate"})
        if others:
            raise ValueError(f"a fused table optimizer changes only its learning rate after construction; got {others}")
        for key in ("lr", "learning_rate"):
            if key in params_dict:
                self.param_groups[0]["lr"] = float(params_dict[key])
        self.step()


class CombinedOptimizer(KeyedOptimizer):
    """Several keyed optimizers driven as one (TorchRec's CombinedOptimizer).

    Args:
        optims: [(key, optimizer)] or [optimizer]; parameter names get ``key.`` prefixed.
    """

    def __init__(self, optims: List[Any]) -> None:
        self._optims: List[Tuple[str, KeyedOptimizer]] = [o if isinstance(o, tuple) else ("", o) for o in optims]
        params: Dict[str, torch.Tensor] = {}
        state: Dict[Any, Any] = {}
        groups: List[Dict[str, Any]] = []
        for key, opt in self._optims:
            for name, p in getattr(opt, "params", {}).items():
                params[f"{key}.{name}" if key else name] = p
            state.update(opt.state)
            groups.extend(opt.param_groups)
        super().__init__(params, state, groups)

    @property
    def optimizers(self) -> List[Tuple[str, KeyedOptimizer]]:
        return list(self._optims)

    def state_dict(self) -> Dict[str, Any]:
        """Every optimizer's ``state_dict()``, parameter names prefixed with its key (TorchRec's)."""
        out: Dict[str, Any] = {"state": {}}
        for key, opt in self._optims:
            sd = opt.state_dict()
            out["state"].update({f"{key}.{n}" if key else n: s for n, s in sd["state"].items()})
            if "param_groups" in sd:
                groups = [{**g, "params": [f"{key}.{n}" if key else n for n in g["params"]]} for g in sd["param_groups"]]
                out.setdefault("param_groups", []).extend(groups)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        for key, opt in self._optims:
            prefix = f"{key}." if key else ""
            sub: Dict[str, Any] = {"state": {n[len(prefix):]: s for n, s in state_dict["state"].items() if n.startswith(prefix)}}
            if "param_groups" in state_dict:
                names = set(getattr(opt, "params", {}))
                sub["param_groups"] = [
                    {**g, "params": [n[len(prefix):] for n in g["params"]]}
                    for g in state_dict["param_groups"]
                    if g["params"] and all(n.startswith(prefix) and n[len(prefix):] in names for n in g["params"])
                ]
            opt.load_state_dict(sub)

    def save_param_groups(self, save: bool) -> None:
        super().save_param_groups(save)
        for _, opt in self._optims:
            opt.save_param_groups(save)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for _, opt in self._optims:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self._optims:
            opt.zero_grad(set_to_none=set_to_none)

    @staticmethod
    def prepend_opt_key(name: str, opt_key: str) -> str:
        """``opt_key.name`` (just one of them when the other is empty), TorchRec's naming of combined parameters."""
        if not name:
            return opt_key
        return f"{opt_key}.{name}" if opt_key else name

    def post_load_state_dict(self) -> None:
        for _, opt in self._optims:
            opt.post_load_state_dict()

    def set_optimizer_step(self, step: int) -> None:
        """Passes the step on to every optimizer that keeps one."""
        for _, opt in self._optims:
            if hasattr(opt, "set_optimizer_step"):
                opt.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        """Passes the settings on to every optimizer that takes them."""
        for _, opt in self._optims:
            if hasattr(opt, "update_hyper_parameters"):
                opt.update_hyper_parameters(params_dict)

    def set_learning_rate(self, lr: float) -> None:
        """Sets every group's learning rate, effective from the next backward on."""
        for group in self.param_groups:
            group["lr"] = lr
        self.step()

    def __repr__(self) -> str:
        return ",".join(f"{key}: {opt!r}" for key, opt in self._optims)


# -- TorchRec's torchrec.optim wrappers ----------------------------------------------------------


def apply_optimizer_in_backward(optimizer_class: Any, params: Any, optimizer_kwargs: Dict[str, Any]) -> None:
    """TorchRec's ``torchrec.optim.apply_optimizer_in_backward``: torch's ``_apply_optimizer_in_backward``, which
    DistributedModelParallel reads to fuse that optimizer into a sharded table's backward."""
    _apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)


class KeyedOptimizerWrapper(KeyedOptimizer):
    """A torch optimizer over named parameters (TorchRec's): ``optim_factory`` builds it from the parameters (a list,
    or the name -> parameter dict itself with ``pass_params_dict=True``), and this keyed optimizer steps it.
    Typically over ``in_backward_optimizer_filter(dmp.named_parameters())``."""

    def __init__(self, params: Mapping[str, torch.Tensor], optim_factory: Callable[[Any], torch.optim.Optimizer],
                 pass_params_dict: bool = False) -> None:
        params = dict(params)
        self._optimizer = optim_factory(params if pass_params_dict else list(params.values()))
        super().__init__(params, self._optimizer.state, self._optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def set_optimizer_step(self, step: int) -> None:
        if hasattr(self._optimizer, "set_optimizer_step"):
            self._optimizer.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        if hasattr(self._optimizer, "update_hyper_parameters"):
            self._optimizer.update_hyper_parameters(params_dict)


class OptimizerWrapper(KeyedOptimizer):
    """Wraps a keyed optimizer and passes everything to it (TorchRec's base class for optimizer wrappers): subclass
    it and override ``step`` to act around the wrapped step."""

    def __init__(self, optimizer: KeyedOptimizer) -> None:
        self._optimizer = optimizer
        super().__init__(getattr(optimizer, "params", {}), optimizer.state, optimizer.param_groups)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        self._optimizer.load_state_dict(state_dict)

    def post_load_state_dict(self) -> None:
        self._optimizer.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self._optimizer.save_param_groups(save)

    def set_optimizer_step(self, step: int) -> None:
        if hasattr(self._optimizer, "set_optimizer_step"):
            self._optimizer.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        if hasattr(self._optimizer, "update_hyper_parameters"):
            self._optimizer.update_hyper_parameters(params_dict)

    def __repr__(self) -> str:
        return repr(self._optimizer)
