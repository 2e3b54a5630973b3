"""Quantization of float embedding tables to fbgemm TBE weight types (int8/int4/int2/fp16/fp8)."""
