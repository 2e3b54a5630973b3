"""``torch.ops.fbgemm.*`` after ``import recship``, as after ``import torchrec``, without loading fbgemm_gpu up front.

``import torchrec`` imports fbgemm_gpu, which registers fbgemm's operators with torch, and user code relies on
it (``torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)``, ``torch.ops.fbgemm.jagged_2d_to_dense(...)``).
Importing fbgemm_gpu costs ~2.5 s and ~300 MB (STACK.md), and ``import recship`` does not even import torch. So
``install()`` (called by ``import recship``) makes torch's ``torch.ops.fbgemm`` namespace import fbgemm_gpu the
first time it is asked for an operator it does not have, then answers again; after that the operators are
registered and torch finds them itself. If torch is not imported yet, a one-shot import hook does this as soon
as torch's import finishes. Nothing else of torch is changed: other namespaces, and an operator fbgemm_gpu does
not have either, behave as before (AttributeError).
"""

import functools
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional, Sequence


def install() -> None:
    """Makes ``torch.ops.fbgemm`` load fbgemm_gpu on demand: now if torch is imported, else right after its import."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "ops"):
        _patch(torch)
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def _patch(torch: ModuleType) -> None:
    from torch._ops import _OpNamespace  # lazy: called once torch is imported; `import recship` loads no torch

    namespace = torch.ops.fbgemm  # torch creates the namespace object on first access
    if type(namespace) is _OpNamespace:  # not yet ours (and not a namespace someone else replaced)
        namespace.__class__ = _namespace_class(_OpNamespace)


@functools.lru_cache(maxsize=None)
def _namespace_class(base: type) -> type:
    class FbgemmNamespace(base):  # type: ignore[misc, valid-type]
        """``torch.ops.fbgemm``: imports fbgemm_gpu (which registers the operators) when an operator is missing."""

        def __getattr__(self, op_name: str) -> Any:
            try:
                return super().__getattr__(op_name)
            except AttributeError:
                # dunder probes (TorchScript asks for __origin__) never load anything; nor does a second miss
                if op_name.startswith("__") or "fbgemm_gpu" in sys.modules:
                    raise
            try:
                # lazy: the point of this module, fbgemm_gpu on the first missing operator (`import recship` loads none)
                import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm.*
            except ImportError as e:
                raise AttributeError(f"torch.ops.fbgemm.{op_name}: fbgemm_gpu, which registers fbgemm's operators, "
                                     f"does not import: {e}") from e
            return super().__getattr__(op_name)

    FbgemmNamespace.__qualname__ = FbgemmNamespace.__name__
    return FbgemmNamespace


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on ``import torch`` it takes itself off ``sys.meta_path`` and has torch's own loader
    call ``_patch`` once torch's module has run."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[ModuleSpec]:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
