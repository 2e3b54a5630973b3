"""TorchRec's predict interface (``torchrec.inference.modules`` / ``dlrm_predict``): a PredictModule turns a batch
(a dict of tensors, as a serving front decodes a request) into its model's inputs; a PredictFactory builds the
quantized, sharded predict module and says how its inputs batch.

    class MyPredictModule(PredictModule):
        def predict_forward(self, batch):
            kjt = KeyedJaggedTensor(keys=KEYS, lengths=batch["id_list_features.lengths"],
                                    values=batch["id_list_features.values"])
            return {"default": self.predict_module(batch["float_features"], kjt).sigmoid().reshape(-1)}

TorchRec's DLRM example of both (``DLRMPredictModule`` / ``DLRMPredictFactory``) is in ``recship.inference``.
recship serves its own artifact (``recship export``); these are for TorchRec code that builds or packages predict
modules itself (``recship.export.package``).
"""

import abc
import json
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn


_PROPAGATE_DEVICE = False


def set_propogate_device(val: bool) -> None:
    """TorchRec's switch (its spelling) for inference-sharded modules to keep each shard's output on its device.
    recship's sharded collections always merge outputs on the first device: the value is kept and read back by
    ``get_propogate_device``, and changes nothing else."""
    global _PROPAGATE_DEVICE
    _PROPAGATE_DEVICE = bool(val)


def get_propogate_device() -> bool:
    return _PROPAGATE_DEVICE


@dataclass
class QualNameMetadata:
    """Per method of a predict module (``qualname_metadata``): whether its inputs need preprocessing."""

    need_preproc: bool


@dataclass
class BatchingMetadata:
    """How one input of a predict module batches (TorchRec's, kept in sync with its C++ server).

    Args:
        type: the input's kind, e.g. "dense", "sparse", "embedding".
        device: "cpu" or "cuda".
        pinned: suffixes of the input's tensors ("lengths", "values"; "" for the input itself) to put in pinned memory.
    """

    type: str
    device: str
    pinned: List[str]


class PredictFactory(abc.ABC):
    """Builds a predict module (with its learned weights, or to load them) and describes its inputs and outputs."""

    @abc.abstractmethod
    def create_predict_module(self) -> nn.Module:
        """The predict module, sharded and with its weights allocated; its state_dict is what the serving side loads."""

    @abc.abstractmethod
    def batching_metadata(self) -> Dict[str, BatchingMetadata]:
        """input name -> how that input batches across requests."""

    def batching_metadata_json(self) -> str:
        """``batching_metadata()`` as JSON ({input: {"type", "device", "pinned"}})."""
        return json.dumps({key: asdict(value) for key, value in self.batching_metadata().items()})

    @abc.abstractmethod
    def result_metadata(self) -> str:
        """The result's type (e.g. "dict_of_tensor"), by which the server splits a batched result."""

    @abc.abstractmethod
    def run_weights_independent_tranformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations that do not read the weights (fx tracing, splitting); TorchRec's spelling."""

    @abc.abstractmethod
    def run_weights_dependent_transformations(self, predict_module: nn.Module) -> nn.Module:
        """Transformations that read the weights (lowering to a backend)."""

    def qualname_metadata(self) -> Dict[str, QualNameMetadata]:
        """method name -> QualNameMetadata; none by default."""
        return {}

    def qualname_metadata_json(self) -> str:
        return json.dumps({key: asdict(value) for key, value in self.qualname_metadata().items()})

    def model_inputs_data(self) -> Dict[str, Any]:
        """Data for generating benchmark inputs; none by default."""
        return {}


class PredictModule(nn.Module):
    """A model behind a batch-of-tensors interface: subclasses implement ``predict_forward(batch) -> outputs``,
    turning ``batch`` (input name -> tensor) into the model's inputs. ``forward`` runs it under
    ``torch.inference_mode()``; the wrapped model is put in eval mode, and ``state_dict`` is the model's own
    (no ``_module.`` prefix).

    Args:
        module: the model.
        device: its primary device ("cpu", "cuda:0"); None: the current CUDA device where there is one, else the CPU
            (TorchRec: always the current CUDA device), fixed at the first forward.
    """

    def __init__(self, module: nn.Module, device: Optional[str] = None) -> None:
        super().__init__()
        self._module: nn.Module = module
        self._device: Optional[torch.device] = torch.device(device) if device else None
        self._module.eval()

    @property
    def predict_module(self) -> nn.Module:
        return self._module

    @abc.abstractmethod
    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Any:
        """The model's outputs for ``batch``."""

    def forward(self, batch: Dict[str, torch.Tensor]) -> Any:
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        with torch.inference_mode():
            return self.predict_forward(batch)

    def state_dict(self, destination: Optional[Dict[str, Any]] = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> Dict[str, Any]:
        if destination is None:
            return self._module.state_dict(prefix=prefix, keep_vars=keep_vars)
        return self._module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
