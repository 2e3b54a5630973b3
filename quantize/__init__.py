"""Quantization of float embedding tables to fbgemm TBE weight types (int8/int4/int2/fp8/fp16/fp32)."""

from recship.quantize.modules import (
    QuantEmbeddingBagCollection,
    QuantEmbeddingCollection,
    quantize_embedding_bag_collection,
    quantize_embedding_collection,
    quantize_embeddings,
)
from recship.quantize.quantizer import BlockView, HostRows, QuantConfig, QuantizationReport, TableReport, TypeChoice, choose_types, quantize_into
from recship.quantize.rowwise import dequantize_rows, quantize_rows, row_bytes

__all__ = [
    "BlockView",
    "HostRows",
    "QuantConfig",
    "QuantEmbeddingBagCollection",
    "QuantEmbeddingCollection",
    "QuantizationReport",
    "TableReport",
    "TypeChoice",
    "choose_types",
    "dequantize_rows",
    "quantize_embedding_bag_collection",
    "quantize_embedding_collection",
    "quantize_embeddings",
    "quantize_into",
    "quantize_rows",
    "row_bytes",
]
