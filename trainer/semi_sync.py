"""TorchRec's semi-synchronous optimizer (``torchrec.optim.semi_sync``): local steps, and every ``num_local_steps``
a global step (DiLoCo-style outer optimization across workers).

    opt = SemisyncOptimizer(model.parameters(), local_keyed_optimizer, global_keyed_optimizer, num_local_steps=16)

Every ``step()`` steps the local optimizer; when the local step count reaches a multiple of ``num_local_steps`` the
global optimizer's gradients are cleared and its torch optimizer's ``global_step(local_step_counter, closure)`` runs
(the global optimizer is a KeyedOptimizerWrapper around an optimizer with that method, as TorchRec expects: it
owns the synchronisation, e.g. an all-reduce of pseudo-gradients over its process group). recship ships no global
optimizer (TorchRec ships none either); any object with ``global_step`` works.

``state_dict()`` is TorchRec's combined form: each parameter's local state under ``semi_sync_local_<key>``, its
global state under ``semi_sync_global_<key>``, and on every global parameter the two step counters
(``__semisync_global_step_counter__``, ``__semisync_local_step_counter__``, int64 scalar tensors); ``load_state_dict``
splits it back and restores the counters.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist

from recship.trainer.fused_optim import KeyedOptimizer

SEMI_SYNC_GLOBAL_OPTIM_KEY = "semi_sync_global_optim"
SEMI_SYNC_LOCAL_OPTIM_KEY = "semi_sync_local_optim"
SEMI_SYNC_GLOBAL_STATE_KEY = "semi_sync_global_"
SEMI_SYNC_LOCAL_STATE_KEY = "semi_sync_local_"
SEMISYNC_GLOBAL_STEP_COUNTER_KEY = "__semisync_global_step_counter__"
SEMISYNC_LOCAL_STEP_COUNTER_KEY = "__semisync_local_step_counter__"


class EmptyGlobalParamsError(ValueError, IndexError):
    """``SemisyncOptimizer(global_params=[])``: a bad argument (ValueError) that is also the IndexError TorchRec
    raises there (it reads ``global_params[0]``), so code written against TorchRec catches it too; the same
    double lineage as ``io.UnsupportedOperation(OSError, ValueError)``."""


def _global_step_owner(global_optimizer: Any) -> Any:
    """The object whose ``global_step`` runs: the wrapped torch optimizer (TorchRec's way), else the optimizer itself."""
    for candidate in (getattr(global_optimizer, "_optimizer", None), global_optimizer):
        if candidate is not None and callable(getattr(candidate, "global_step", None)):
            return candidate
    raise TypeError(f"global_optimizer ({type(global_optimizer).__name__}) must wrap an optimizer with "
                    "global_step(local_step_counter, closure), e.g. KeyedOptimizerWrapper(params, make_diloco)")


class SemisyncOptimizer(KeyedOptimizer):
    """Local steps every call, a global step every ``num_local_steps`` (TorchRec's; see the module docstring).

    Args:
        global_params: the parameters the global optimizer synchronises (tensors or param-group dicts).
        optimizer: the local keyed optimizer.
        global_optimizer: the global keyed optimizer (its torch optimizer has ``global_step``).
        num_local_steps: local steps between global steps, >= 1.
        semi_sync_worker_shard_group: TorchRec logs metrics over it; kept for the global optimizer's use.
        offload_global_model, non_blocking: TorchRec's (unused there too in 1.8.0: the global optimizer decides
            where its copy of the model lives).
    """

    def __init__(self, global_params: Any, optimizer: KeyedOptimizer, global_optimizer: KeyedOptimizer, num_local_steps: int = 16,
                 semi_sync_worker_shard_group: Optional[dist.ProcessGroup] = None, offload_global_model: bool = False,
                 non_blocking: bool = False) -> None:
        if global_params is None:
            raise ValueError("SemisyncOptimizer needs global_params")
        if not isinstance(num_local_steps, int) or num_local_steps < 1:
            raise ValueError(f"num_local_steps must be an int >= 1, got {num_local_steps!r}")
        listed = list(global_params)
        if not listed:
            raise EmptyGlobalParamsError("SemisyncOptimizer needs at least one global parameter (global_params is empty)")
        if listed and isinstance(listed[0], dict):
            self._worker_model_params: List[torch.Tensor] = [p for group in listed for p in group["params"]]
        else:
            self._worker_model_params = [p for p in listed if isinstance(p, torch.Tensor)]
        self._optimizer = optimizer
        self._global_optimizer = global_optimizer
        self._global_step_owner = _global_step_owner(global_optimizer)
        self._num_local_steps = num_local_steps
        self._local_step_counter = torch.tensor(0, dtype=torch.int64)
        self._global_step_counter = torch.tensor(0, dtype=torch.int64)
        self._worker_shard_group = semi_sync_worker_shard_group
        self._offload_global_model = offload_global_model
        self._non_blocking = non_blocking
        # KeyedOptimizer.__init__ would assign params/state/param_groups, which are views of the two optimizers here
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.defaults: Dict[str, Any] = {"_save_param_groups": False}

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return [*self._optimizer.param_groups, *self._global_optimizer.param_groups]

    @property
    def params(self) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        """Both optimizers' parameters by name (a name in both must be the same tensor), and the two counters."""
        out = dict(self._optimizer.params)
        for key, p in self._global_optimizer.params.items():
            if key in out and out[key] is not p:
                raise ValueError(f"parameter {key!r} names different tensors in the local and the global optimizer")
            out[key] = p
        out[SEMISYNC_GLOBAL_STEP_COUNTER_KEY] = self._global_step_counter
        out[SEMISYNC_LOCAL_STEP_COUNTER_KEY] = self._local_step_counter
        return out

    @property
    def state(self) -> Dict[Any, Dict[str, Any]]:  # type: ignore[override]
        """parameter -> its local state (prefixed ``semi_sync_local_``), global state (``semi_sync_global_``) and,
        on global parameters, the step counters."""
        out: Dict[Any, Dict[str, Any]] = {
            p: {SEMI_SYNC_LOCAL_STATE_KEY + k: v for k, v in s.items()} for p, s in self._optimizer.state.items()
        }
        for p, s in self._global_optimizer.state.items():
            entry = out.setdefault(p, {})
            entry.update({SEMI_SYNC_GLOBAL_STATE_KEY + k: v for k, v in s.items()})
            entry[SEMISYNC_GLOBAL_STEP_COUNTER_KEY] = self._global_step_counter
            entry[SEMISYNC_LOCAL_STEP_COUNTER_KEY] = self._local_step_counter
        return out

    @property
    def num_local_steps(self) -> int:
        return self._num_local_steps

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """A local step; after every ``num_local_steps``-th, the global step."""
        self._local_step_counter.add_(1)
        self._optimizer.step(closure)
        if int(self._local_step_counter) % self._num_local_steps == 0:
            self._global_step_counter.add_(1)
            self._global_optimizer.zero_grad()
            self._global_step_owner.global_step(self._local_step_counter, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._global_optimizer.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Splits a combined ``state_dict()`` back into the two optimizers (each loads its part in place) and restores
        the step counters (RuntimeError, as TorchRec's, when a checkpoint lacks them while there are global states)."""
        new_state = state_dict["state"]
        counters: Dict[str, Any] = {}
        for entry in new_state.values():
            for key in (SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY):
                if key in entry:
                    counters.setdefault(key, entry[key])
        for opt, prefix in ((self._optimizer, SEMI_SYNC_LOCAL_STATE_KEY), (self._global_optimizer, SEMI_SYNC_GLOBAL_STATE_KEY)):
            part: Dict[str, Any] = {"state": {name: self._extract_prefixed_state(new_state[name], prefix)
                                              for name in opt.params if name in new_state}}
            if "param_groups" in state_dict:
                names = set(opt.params)
                part["param_groups"] = [g for g in state_dict["param_groups"] if set(g["params"]) <= names]
            opt.load_state_dict(part)
        if self._global_optimizer.state:
            missing = [k for k in (SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY) if k not in counters]
            if missing:
                raise RuntimeError(f"the checkpoint lacks the step counters {missing}")
        if SEMISYNC_GLOBAL_STEP_COUNTER_KEY in counters:
            self._global_step_counter.copy_(torch.as_tensor(counters[SEMISYNC_GLOBAL_STEP_COUNTER_KEY]))
        if SEMISYNC_LOCAL_STEP_COUNTER_KEY in counters:
            self._local_step_counter.copy_(torch.as_tensor(counters[SEMISYNC_LOCAL_STEP_COUNTER_KEY]))
        self.post_load_state_dict()

    @staticmethod
    def _extract_prefixed_state(param_state: Mapping[str, Any], prefix: str) -> Dict[str, Any]:
        """The entries of one parameter's combined state whose key starts with ``prefix``, the prefix removed
        (TorchRec's helper: ``semi_sync_local_`` gives the local optimizer's state, ``semi_sync_global_`` the global's)."""
        return {key[len(prefix):]: value for key, value in param_state.items() if key.startswith(prefix)}

    def post_load_state_dict(self) -> None:
        for opt in (self._optimizer, self._global_optimizer):
            opt.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        self.defaults["_save_param_groups"] = save
        self._optimizer.save_param_groups(save)
        self._global_optimizer.save_param_groups(save)

    def set_optimizer_step(self, step: int) -> None:
        for opt in (self._optimizer, self._global_optimizer):
            if hasattr(opt, "set_optimizer_step"):
                opt.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        for opt in (self._optimizer, self._global_optimizer):
            if hasattr(opt, "update_hyper_parameters"):
                opt.update_hyper_parameters(params_dict)

    def __repr__(self) -> str:
        return f"{SEMI_SYNC_LOCAL_OPTIM_KEY}: {self._optimizer!r}, {SEMI_SYNC_GLOBAL_OPTIM_KEY}: {self._global_optimizer!r}"
