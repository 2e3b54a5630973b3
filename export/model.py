"""The exported module: plain tensors in, named outputs out.

    forward(dense [B, n_dense] float32,
            lengths [F * B] int32   (feature-major, in the manifest's feature order),
            values [N] int64,
            weights Optional[[N] float32]) -> Dict[str, Tensor]   (batch first)

``ExportedModule`` wraps any model that follows the contract (``recship.export.any_model``):
the built-in DLRM answers {"logit": [B, 1], "prob": [B, 1]}; a bare EmbeddingBagCollection
(``PooledEmbeddings``) each feature's pooled embedding [B, dim] (its ``dense`` input is [B, 0]).
Inside, the quantized, inference-sharded collections are their flat twins
(``recship.quantize.flat``); callers need no recship classes. The same module is what
torch.export / AOTInductor compile.
"""

import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from recship.fx import symbolic_trace
from recship.sparse import KeyedJaggedTensor
from recship.trainer.entry_point import user_line


@torch.fx.wrap
def build_kjt(
    keys: List[str], values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor]
) -> KeyedJaggedTensor:
    """The request's KJT (one fx node, so tracing records KJT methods, not their insides)."""
    if lengths.shape[0] % len(keys) != 0:
        raise ValueError(f"lengths has {lengths.shape[0]} entries, not a multiple of the {len(keys)} features")
    return KeyedJaggedTensor(
        keys=keys, values=values, weights=weights, lengths=lengths, offsets=None, stride=None, length_per_key=None
    )


class ExportedModule(nn.Module):
    """The artifact's entry point around a (quantized, flattened) model: request tensors in, named outputs out.

    What the model answers becomes named outputs as ``served_outputs`` says; ``single_output``: it
    answers one Tensor (known from an eager call: fx traces proxies, which are not Tensors).
    ``device``: where the model's dense layers are (its tables may be on several devices).
    """

    def __init__(self, model: nn.Module, feature_names: List[str], single_output: bool, device: str = "cpu") -> None:
        super().__init__()
        self.model = model
        self._feature_names = list(feature_names)
        self._single_output = single_output  # constants when traced: the branches below are resolved then
        self._named = hasattr(model, "serving_outputs")
        self._device = device

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        out = self.model(dense.to(torch.device(self._device)), build_kjt(self._feature_names, values, lengths, weights))
        if self._named:
            named = self.model.serving_outputs
            assert callable(named)  # checked at construction (hasattr): a method of the model
            return named(out)
        if self._single_output:
            return {"output": out}
        return out


def served_outputs(model: nn.Module, out: Any) -> Dict[str, torch.Tensor]:
    """The artifact's named outputs from what ``model``'s forward answered: its ``serving_outputs(out)``
    if it names them (the built-in DLRM: logit [B] -> logit and prob [B, 1]), else a Tensor as
    "output", a Dict[str, Tensor] as it is; ValueError for anything else."""
    named = getattr(model, "serving_outputs", None)
    if named is not None:
        out = named(out)
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, dict) and out and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()):
        return out
    raise ValueError(f"the model's forward returned {type(out).__name__}; a model to export returns a Tensor or a Dict[str, Tensor]"
                     + (" (from serving_outputs)" if named is not None else ""))


class PooledEmbeddings(nn.Module):
    """A bare EmbeddingBagCollection as a model: ``forward(dense [B, 0], features)`` -> each feature's pooled
    embedding [B, dim], named by the feature. Its tables keep their own names in the artifact."""

    num_dense = 0
    PATH = "collection"  # the collection's path inside, left out of the artifact's table names

    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.collection = collection

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        return self.collection(features).to_dict()


class StageError(RuntimeError):
    """A stage of turning the model into a program failed: ``stage`` names it ("fx trace", "TorchScript")
    and the message carries the line of the user's code the error came from, where its traceback
    passes through ``user_file``."""

    def __init__(self, stage: str, error: BaseException, user_file: Optional[str] = None) -> None:
        self.stage = stage
        where = user_line(error, user_file)
        super().__init__(f"{stage} failed: {type(error).__name__}: {_first_lines(error)}" + (f" (at {where})" if where else ""))


def _first_lines(error: BaseException, limit: int = 6) -> str:
    """The error's first line, plus the source line TorchScript / fx point at (their messages quote it)."""
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return ""
    where = [line.strip() for line in lines[1:] if line.lstrip().startswith(("File ", "forward", "~", "def ")) or ".py\"" in line]
    quoted = [line.strip() for line in lines[1:] if not set(line.strip()) <= set("~^ ")]
    extra = where[:2] or quoted[:2]
    return "; ".join([lines[0]] + extra[: limit - 1])


def trace(module: nn.Module, user_file: Optional[str] = None) -> torch.fx.GraphModule:
    """fx-trace with the lookup modules as leaves (StageError "fx trace" on failure, naming the line of
    ``user_file`` it failed on)."""
    try:
        return symbolic_trace(module)
    except Exception as e:
        raise StageError("fx trace", e, user_file) from e


def script(graph: torch.fx.GraphModule) -> torch.jit.ScriptModule:
    """TorchScript of an fx-traced graph (StageError "TorchScript" on failure)."""
    try:
        with warnings.catch_warnings():
            # torch's own fx GraphModule.__init__ trips TorchScript's annotation checker: not the user's business
            warnings.filterwarnings("ignore", message=r".*instance-level annotations on empty non-base types.*", category=UserWarning)
            return torch.jit.script(graph)
    except Exception as e:
        raise StageError("TorchScript", e) from e


def trace_and_script(module: nn.Module, user_file: Optional[str] = None) -> torch.jit.ScriptModule:
    """fx-trace with the lookup modules as leaves, then TorchScript the traced graph."""
    return script(trace(module, user_file))
