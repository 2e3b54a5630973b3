"""Lazy modules' helpers (TorchRec's torchrec.modules.lazy_extension): ``lazy_apply`` and ``LazyModuleExtensionMixin``.

A lazy module (``nn.LazyLinear``, or a module mixing in ``LazyModuleMixin``) learns its parameters' shapes from its
first input, so ``module.apply(init_fn)`` before that first forward sees uninitialised parameters. ``lazy_apply``
attaches ``init_fn`` to run once, on the module and every submodule, right after the first forward;
``LazyModuleExtensionMixin`` is the mixin whose ``apply`` refuses to run before then, naming ``lazy_apply``.

TorchRec's mixin also re-implemented ``nn.Module.__call__`` so that a lazy module's ``initialize_parameters`` got the
forward's keyword arguments; torch's ``LazyModuleMixin`` does that itself now (its hook is registered
``with_kwargs=True``), so this mixin only adds the ``apply`` check.
"""

from typing import Any, Callable, List

import torch
from torch.nn.modules.lazy import LazyModuleMixin


def _apply_after_first_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    functions: List[Callable[[torch.nn.Module], None]] = module.__dict__.pop("_functions_to_lazy_apply", [])
    handle = module.__dict__.pop("_lazy_apply_hook")
    handle.remove()
    for fn in functions:
        module.apply(fn)


def lazy_apply(module: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """Attaches ``fn`` to ``module``: right after its first forward (every lazy submodule then initialised),
    ``module.apply(fn)`` runs once (``fn`` on every submodule, then on ``module``). Several calls queue their
    functions, applied in order. Returns ``module``.

    Example::

        seq = nn.Sequential(nn.LazyLinear(2), nn.LazyLinear(2))
        lazy_apply(seq, init_weights)  # nothing runs yet
        seq(torch.randn(4, 10))        # shapes inferred, then init_weights applied
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"lazy_apply takes an nn.Module, got {type(module).__name__}")
    if not callable(fn):
        raise TypeError(f"lazy_apply takes a callable fn(module), got {fn!r}")
    if "_lazy_apply_hook" not in module.__dict__:
        module.__dict__["_functions_to_lazy_apply"] = []
        module.__dict__["_lazy_apply_hook"] = module.register_forward_hook(_apply_after_first_forward)
    module.__dict__["_functions_to_lazy_apply"].append(fn)
    return module


class LazyModuleExtensionMixin(LazyModuleMixin):
    """torch's ``LazyModuleMixin`` whose ``apply`` refuses an uninitialised module (RuntimeError naming
    ``lazy_apply``) instead of handing ``fn`` parameters without shapes. Keyword arguments of ``forward`` reach
    ``initialize_parameters``, as in TorchRec's."""

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> torch.nn.Module:  # type: ignore[override]
        """``fn`` on every submodule, then on this module, once the first forward has initialised it."""
        if hasattr(self, "_initialize_hook"):
            raise RuntimeError(
                f"Module {self} has not been initialized. Please run a dummy forward pass on the model to initialize "
                "all modules, or use lazy_apply (recship.trainer.lazy_extension) to attach a function to this module "
                "which would be applied after this module is initialized."
            )
        return super().apply(fn)  # type: ignore[misc]


__all__ = ["LazyModuleExtensionMixin", "lazy_apply"]
