"""Export pipeline: checkpoint -> quantize -> reshard -> fx-trace -> TorchScript artifact."""

from recship.export.pipeline import ExportConfig, ExportError, export_model
from recship.export.sharded import shard_quant_model

__all__ = ["ExportConfig", "ExportError", "export_model", "shard_quant_model"]
