"""torch.fx for models that hold recship modules (TorchRec's ``torchrec.fx``).

    tracer = Tracer(leaf_modules=["MyCustomLookup"])
    graph = tracer.trace(model)
    scripted = torch.jit.script(torch.fx.GraphModule(model, graph))

fbgemm's TBEs and recship's quantized (and inference-sharded) collections are always
leaves: their forwards validate ids and build KeyedJaggedTensors with data-dependent
checks that fx cannot trace, and TorchScript compiles them as they are.
"""

from typing import Any, Dict, Iterable, Optional

import torch
from torch import nn

DEFAULT_LEAF_MODULES = (
    "FlatPooledLookup",
    "FlatEmbeddingBagCollection",
    "FlatEmbeddingCollection",
    "IntNBitTableBatchedEmbeddingBagsCodegen",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "ShardedQuantEmbeddingBagCollection",
)


class Tracer(torch.fx.Tracer):
    """An fx tracer that keeps recship's lookup modules, and the ones named in ``leaf_modules``, as leaves.

    Args:
        leaf_modules: class names (``"MyLookup"``) or qualified module paths (``"tower.lookup"``)
            to keep as leaves besides the defaults.
    """

    def __init__(self, leaf_modules: Optional[Iterable[str]] = None) -> None:
        super().__init__()
        self.leaf_modules = set(DEFAULT_LEAF_MODULES) | set(leaf_modules or ())

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m).__name__ in self.leaf_modules or module_qualified_name in self.leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(root: nn.Module, concrete_args: Optional[Dict[str, Any]] = None,
                   leaf_modules: Optional[Iterable[str]] = None) -> torch.fx.GraphModule:
    """``root`` traced with ``Tracer(leaf_modules)`` into a GraphModule (ready for ``torch.jit.script``);
    ``concrete_args`` fixes some inputs to constants, as in ``torch.fx.symbolic_trace``."""
    graph = Tracer(leaf_modules).trace(root, concrete_args)
    return torch.fx.GraphModule(root, graph, class_name=type(root).__name__)
