"""Export pipeline: checkpoint -> quantize -> reshard -> fx-trace -> TorchScript artifact.

Names load on first use (PEP 562), so a command that only needs part of the package (``recship
inspect --help``) does not import torch.
"""

import importlib
from typing import Any

_NAMES = {
    "ExportConfig": "recship.export.pipeline",
    "ExportError": "recship.export.pipeline",
    "export_model": "recship.export.pipeline",
    "shard_quant_model": "recship.export.sharded",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'recship.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
