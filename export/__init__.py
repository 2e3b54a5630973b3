"""Export pipeline: checkpoint -> quantize -> reshard -> fx-trace -> TorchScript / AOTInductor artifact,
and the artifact's reader.

Names load on first use (PEP 562), so a command that only needs part of the package (``recship
inspect --help``) does not import torch.
"""

from typing import TYPE_CHECKING

from recship.lazy import lazy_names

_NAMES = {
    **dict.fromkeys(["ExportConfig", "ExportError"], "recship.export.config"),
    "export_model": "recship.export.pipeline",
    "shard_quant_model": "recship.quantize.sharded",
    **dict.fromkeys(["ArtifactError", "Manifest", "open_artifact"], "recship.export.artifact"),
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_names(__name__, _NAMES, globals())

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from recship.export.artifact import ArtifactError as ArtifactError, Manifest as Manifest, open_artifact as open_artifact
    from recship.export.config import ExportConfig as ExportConfig, ExportError as ExportError
    from recship.export.pipeline import export_model as export_model
    from recship.quantize.sharded import shard_quant_model as shard_quant_model
