"""Quantization of float embedding tables to fbgemm TBE weight types (int8/int4/int2/fp8/fp16/fp32)."""

from recship.quantize.modules import QuantEmbeddingBagCollection, QuantEmbeddingCollection
from recship.quantize.quantizer import (
    QuantConfig,
    QuantizationReport,
    TableReport,
    quantize_embedding_bag_collection,
    quantize_embedding_collection,
    quantize_embeddings,
)
from recship.quantize.rowwise import dequantize_rows, quantize_rows, row_bytes

__all__ = [
    "QuantConfig",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantizationReport",
    "TableReport",
    "dequantize_rows",
    "quantize_embedding_bag_collection",
    "quantize_embedding_collection",
    "quantize_embeddings",
    "quantize_rows",
    "row_bytes",
]
