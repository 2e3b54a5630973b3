"""Public names that load on first use (PEP 562), the one way recship's packages export them.

A package lists ``name -> module`` and gets its ``__getattr__`` and ``__dir__``; importing the
package imports none of the modules (nor torch), so ``--help`` and the gRPC client stay light.
A submodule used as an attribute (``recship.trainer.planner``) before anything imported it loads too.
"""

import importlib
from typing import Any, Callable, Dict, List, Tuple


def lazy_names(package: str, names: Dict[str, str], namespace: Dict[str, Any]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``__getattr__, __dir__`` for ``package`` (its ``__name__``), whose ``namespace`` is its ``globals()``."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value  # later lookups skip this function
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
