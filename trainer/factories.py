"""Callables named by entry point (``package.module:attr``), imported without torch.

``recship train`` checks its ``--model`` with ``load_factory`` in the launching process before torch, fbgemm_gpu
or any rank starts, so that a wrong name costs its one line at once; ``recship.trainer.entry_point`` builds the
model from the same callable.
"""

import importlib
import os
import sys
from typing import Any, Callable


def load_factory(entry: str) -> Callable[..., Any]:
    """The callable named by ``package.module:factory``; ValueError naming what is wrong."""
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like package.module:factory, got {entry!r}")
    if os.getcwd() not in sys.path:  # as uvicorn does: modules in the current directory are importable
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        hint = ""
        if "/" in module_name or module_name.endswith(".py"):
            hint = (" (an entry point names a module, not a file: run from the folder holding the file, or put that "
                    "folder on PYTHONPATH, and name it module:factory)")
        raise ValueError(f"--model {entry}: cannot import {module_name}: {type(e).__name__}: {e}{hint}") from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--model {entry}: {module_name} has no {attr}")
    if not callable(factory):
        raise ValueError(f"--model {entry}: {attr} is a {type(factory).__name__}, not a callable")
    return factory
