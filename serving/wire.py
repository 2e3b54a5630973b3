"""Reads a serialized PredictRequest straight into numpy arrays.

Python protobuf hands a repeated field over one element at a time (about 35 ns an
element, measured here), which made converting a 512-example request slower than
running the model on it. On the wire a packed repeated field is one run of bytes, so
this reader walks the message's few dozen fields in Python and turns the packed runs
of all features into arrays with a handful of numpy calls: ids (sfixed64) and floats
are fixed-width, so that is one copy; lengths are varints, one byte each in practice.

It reads what protobuf writes for ``predictor.proto`` (packed repeated scalars, one
run per field). An encoding that is legal but unusual (a repeated scalar sent
unpacked or in two runs, an unknown field inside a feature, ``dense`` sent twice to
be merged) makes ``decode`` return None, and ``read_request`` parses with protobuf
instead: the same result, only slower. Bytes that are not a message raise ``Malformed``.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from google.protobuf.message import DecodeError

from recship.serving.requests import RequestArrays, SparseArrays
from recship.serving.v1 import predictor_pb2 as pb

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_PACKED = {0x12: 0, 0x1A: 1, 0x22: 2}  # SparseFeature fields 2, 3, 4 packed (wire type 2) -> lengths, ids, weights


class Malformed(ValueError):
    """The bytes are not a well-formed protobuf message."""


class _Unusual(Exception):
    """A legal encoding this reader leaves to protobuf."""


def read_request(buf: bytes) -> RequestArrays:
    """A serialized PredictRequest -> RequestArrays: the fast reader, or protobuf where it declines."""
    request = decode(buf)
    if request is not None:
        return request
    try:
        return RequestArrays.from_message(pb.PredictRequest.FromString(buf))
    except DecodeError as e:
        raise Malformed(str(e)) from None


def decode(buf: bytes) -> Optional[RequestArrays]:
    """A serialized ``recship.serving.v1.PredictRequest`` -> RequestArrays, or None (parse with protobuf)."""
    try:
        return _request(buf)
    except _Unusual:
        return None
    except IndexError:
        raise Malformed("truncated message") from None
    except UnicodeDecodeError as e:
        raise Malformed(f"a string field is not UTF-8: {e}") from None


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise Malformed("varint longer than 10 bytes")


def _fields(buf: bytes, pos: int, end: int):
    """Yields (field number, wire type, value): an int for varints, (start, stop) byte bounds otherwise.

    The one-byte case of each varint is inlined: this loop runs for every field of every feature.
    """
    while pos < end:
        key = buf[pos]
        pos += 1
        if key >= 0x80:
            key, pos = _varint(buf, pos - 1)
            if key > 0xFFFFFFFF:
                raise Malformed("field key longer than 32 bits")
        if key < 8:
            raise Malformed("field number 0")
        wire = key & 7
        if wire == _VARINT:
            value = buf[pos]
            pos += 1
            if value >= 0x80:
                value, pos = _varint(buf, pos - 1)
            yield key >> 3, wire, value
            continue
        if wire == _LEN:
            n = buf[pos]
            pos += 1
            if n >= 0x80:
                n, pos = _varint(buf, pos - 1)
        elif wire == _FIXED64:
            n = 8
        elif wire == _FIXED32:
            n = 4
        else:
            raise Malformed(f"wire type {wire} (groups are not part of proto3)")
        if pos + n > end:
            raise Malformed("field runs past the end of its message")
        yield key >> 3, wire, (pos, pos + n)
        pos += n
    if pos != end:
        raise Malformed("field runs past the end of its message")


def _expect(wire: int, want: int) -> None:
    if wire != want:
        raise _Unusual()


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _int64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _text(buf: bytes, bounds: Tuple[int, int]) -> str:
    return buf[bounds[0]:bounds[1]].decode("utf-8")


# PredictRequest's scalar fields: number -> (name, wire type, reader of the value ``_fields`` yields)
_SCALARS: Dict[int, Tuple[str, int, Callable[[bytes, Any], Any]]] = {
    1: ("model_name", _LEN, _text),
    2: ("model_version", _VARINT, lambda buf, v: _int64(v)),
    3: ("request_id", _LEN, _text),
    4: ("batch_size", _VARINT, lambda buf, v: _int32(v)),
}


def _request(buf: bytes) -> RequestArrays:
    out: Dict[str, Any] = {"model_name": "", "model_version": 0, "request_id": "", "batch_size": 0, "dense_rows": 0, "dense_cols": 0}
    dense = np.empty(0, dtype=np.float32)
    names: List[str] = []
    runs: Tuple[List[bytes], List[bytes], List[bytes]] = ([], [], [])  # lengths, ids, weights: one per feature
    dense_seen = False
    for field, wire, v in _fields(buf, 0, len(buf)):
        if field == 5:
            _expect(wire, _LEN)
            names.append(_feature(buf, v[0], v[1], runs))
        elif field in _SCALARS:
            name, want, read = _SCALARS[field]
            _expect(wire, want)
            out[name] = read(buf, v)
        elif field == 6:
            _expect(wire, _LEN)
            if dense_seen:
                raise _Unusual()  # protobuf merges a repeated message field: leave that to it
            dense_seen = True
            out["dense_rows"], out["dense_cols"], dense = _dense(buf, v[0], v[1])
    lengths, length_counts = _varints(runs[0])
    ids, id_counts = _fixed(runs[1], "<i8", np.int64)
    weights, weight_counts = _fixed(runs[2], "<f4", np.float32)
    sparse = SparseArrays(names, lengths.astype(np.uint32).view(np.int32), length_counts, ids, id_counts, weights, weight_counts)
    return RequestArrays(sparse=sparse, dense=dense, **out)


def _feature(buf: bytes, pos: int, end: int, runs) -> str:
    """Reads one SparseFeature; appends its packed lengths, ids and weights bytes to ``runs``.

    A straight loop over the usual layout (tags are single bytes; every field is
    length-delimited): this runs for every feature of every request. A field this
    reader does not expect, or a field sent twice, is left to protobuf.
    """
    name = ""
    got = [b"", b"", b""]
    seen = 0
    while pos < end:
        key = buf[pos]
        if key & 7 != _LEN or key >= 0x80:
            raise _Unusual()  # an unpacked element, or a field number past 15
        n = buf[pos + 1]
        pos += 2
        if n >= 0x80:
            n, pos = _varint(buf, pos - 1)
        stop = pos + n
        if stop > end:
            raise Malformed("field runs past the end of its message")
        if key == 0x0A:  # field 1 (name), length-delimited
            name = buf[pos:stop].decode("utf-8")
        elif key in _PACKED and not seen & (1 << key):
            seen |= 1 << key
            got[_PACKED[key]] = buf[pos:stop]
        else:
            raise _Unusual()
        pos = stop
    for run, part in zip(runs, got):
        run.append(part)
    return name


def _dense(buf: bytes, pos: int, end: int) -> Tuple[int, int, np.ndarray]:
    rows = cols = 0
    values: List[bytes] = []
    for field, wire, v in _fields(buf, pos, end):
        if field == 1:
            _expect(wire, _VARINT)
            rows = _int64(v)
        elif field == 2:
            _expect(wire, _VARINT)
            cols = _int64(v)
        elif field == 3:
            _expect(wire, _LEN)
            values.append(buf[v[0]:v[1]])
    data, _ = _fixed([b"".join(values)], "<f4", np.float32)
    return rows, cols, data


def _fixed(runs: List[bytes], wire_dtype: str, dtype) -> Tuple[np.ndarray, np.ndarray]:
    """Packed fixed-width runs (one per feature) -> (all values, values per feature); a read-only view."""
    width = np.dtype(wire_dtype).itemsize
    sizes = np.array([len(r) for r in runs], dtype=np.int64)
    if (sizes % width).any():
        raise Malformed(f"packed field of a length not divisible by {width}")
    return np.frombuffer(b"".join(runs), dtype=wire_dtype).astype(dtype, copy=False), sizes // width


def _varints(runs: List[bytes]) -> Tuple[np.ndarray, np.ndarray]:
    """Packed varint runs (one per feature) -> (uint64 values of all runs, values per run)."""
    b = np.frombuffer(b"".join(runs), dtype=np.uint8)
    sizes = np.array([len(r) for r in runs], dtype=np.int64)
    last = b < 0x80
    if last.all():  # every value below 128, one byte each: the usual case for lengths
        return b.astype(np.uint64), sizes
    ends = np.cumsum(sizes)
    nonempty = sizes > 0
    if not last[ends[nonempty] - 1].all():
        raise Malformed("packed varint field ends inside a varint")
    stops = np.flatnonzero(last)  # the last byte of each varint
    counts = np.diff(np.searchsorted(stops, ends, side="left"), prepend=0)
    starts = np.empty_like(stops)
    starts[:1] = 0
    starts[1:] = stops[:-1] + 1
    nbytes = stops - starts + 1
    if nbytes.max() > 10:
        raise Malformed("varint longer than 10 bytes")
    shift = ((np.arange(b.size) - np.repeat(starts, nbytes)) * 7).astype(np.uint64)
    # bits of different bytes never overlap; bits shifted past 64 are dropped, as protobuf drops them
    values = np.bitwise_or.reduceat((b & 0x7F).astype(np.uint64) << shift, starts)
    return values, counts
