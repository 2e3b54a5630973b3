"""Models named by entry point: ``package.module:factory`` plus keyword arguments (JSON on the command line).

``recship train --model`` and ``recship export --model`` build a user's model this way, and
a checkpoint records the entry point and its arguments so that export needs nothing else.
The built-in DLRM is ``recship.models:dlrm``.
"""

import importlib
import inspect
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

def load_factory(entry: str) -> Callable[..., nn.Module]:
    """The callable named by ``package.module:factory``; ValueError naming what is wrong."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like package.module:factory, got {entry!r}")
    if os.getcwd() not in sys.path:  # as uvicorn does: modules in the current directory are importable
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"--model {entry}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--model {entry}: {module_name} has no {attr}")
    if not callable(factory):
        raise ValueError(f"--model {entry}: {attr} is a {type(factory).__name__}, not a callable")
    return factory


def build_model(entry: str, args: Optional[Dict[str, Any]] = None, device: Optional[str] = None) -> nn.Module:
    """Calls the factory with ``args`` (and ``device``, if it takes one); the result must be an nn.Module."""
    factory = load_factory(entry)
    kwargs = dict(args or {})
    if device is not None and _takes(factory, "device"):
        kwargs["device"] = device
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise ValueError(f"--model {entry}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {entry}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _takes(factory: Callable, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def describe_model(module: nn.Module, num_dense: Optional[int] = None) -> Dict[str, Any]:
    """The model contract's facts about ``module``; ValueError naming what breaks the contract.

    Returns {"features": [(feature, collection path, table config, pooling or "NONE", weighted)],
    "weighted": whether any feature is, "num_dense": int}: features in the order of their
    collections (first path in ``named_modules`` order) and tables.
    """
    from recship.trainer.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 2:
        names = ", ".join(p.name for p in params)
        raise ValueError(f"{type(module).__name__}.forward({names}): the model contract is forward(dense, features) "
                         "(dense: float [B, num_dense], features: KeyedJaggedTensor)")
    seen: Dict[int, Any] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection):
            seen.setdefault(id(m), (path, m))
    if not seen:
        raise ValueError(f"{type(module).__name__} holds no EmbeddingBagCollection or EmbeddingCollection")
    features: List[Tuple[str, str, Any, str, bool]] = []  # (feature, path, table config, pooling, weighted)
    owner: Dict[str, str] = {}
    for path, c in seen.values():
        is_bag = isinstance(c, EmbeddingBagCollection)
        weighted = is_bag and c.is_weighted()
        for t in (c.embedding_bag_configs() if is_bag else c.embedding_configs()):
            for f in t.feature_names:
                if f in owner:
                    raise ValueError(f"feature {f!r} is looked up by two collections ({owner[f]} and {path or 'the model'}): "
                                     "give each collection its own feature name")
                owner[f] = path or "the model"
                features.append((f, path, t, t.pooling.value if is_bag else "NONE", weighted))
    if num_dense is None:
        num_dense = getattr(module, "num_dense", None)
    if not isinstance(num_dense, int) or isinstance(num_dense, bool) or num_dense < 0:
        raise ValueError(f"the dense width is unknown: give num_dense (ExportConfig(num_dense=N)) or a num_dense attribute "
                         f"on {type(module).__name__} (0 for a model without dense inputs)")
    return {"features": features, "weighted": any(f[4] for f in features), "num_dense": num_dense}
