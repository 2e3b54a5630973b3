"""What a request will cost in memory, known before it is decoded: what each front charges to the in-flight budget
(--max-inflight-mb, ``Inference.admit``), so that a request that would not fit is refused (RESOURCE_EXHAUSTED,
HTTP 429) before it costs more than its bytes, whichever protocol brought it.

A request's cost is the bytes it holds until its answer (its message, the text of a JSON body) plus
``TENSOR_COPIES`` times its decoded tensors: the arrays validation makes of them, the batch they join (merging
requests concatenates the ids, then reorders them by feature with a sort's keys and order: 3.25 times the ids),
and the model's own copies. The decoded size comes from a cheap look at the bytes: a recship Predict carries its
ids and values at fixed width (sfixed64, float), so its tensors are its size; a KServe ModelInferRequest's typed
contents are varints (an id of 1 byte on the wire is 8 bytes decoded), counted by the bytes that end a varint;
a REST JSON body is scanned for its number arrays (``rest_json``, ``json_tensors.Body``).

Measured (tests/serving/test_memory_bounds.py, the small DLRM at --max-inflight-mb 32, the cgroup's peak above its
usage before each request): one request charged 19 MiB peaked at 0.5 to 1.1 times its charge (Predict, KServe gRPC,
REST JSON; both fronts; 0.6 to 1.5 times at 5 copies, which this replaced), and the whole mix of that test, large
requests alone, together inside the budget, over it and the 24.9 MiB JSON body of 13M ids, at most 48 MiB above the
server's baseline (1.5 times the budget; the bound it asserts is 3 times).
"""

from typing import Optional

import numpy as np

from recship.serving import json_tensors, rules, wire

TENSOR_COPIES = rules.TENSOR_COPIES  # a request's decoded tensors at its peak: its arrays, the merged batch (3.25), the model's (measured)
VALUE_BYTES = 8  # a decoded varint (int64 ids; int32 lengths take 4, counted as 8)
_CHUNK = 1 << 20  # bytes counted at a time (numpy's comparison makes a bool per byte)
_MAX_FIELDS = 64  # past this many fields, a contents message is values encoded one field each (unpacked): bounded


def cost(held: int, tensor_bytes: int) -> int:
    """The in-flight bytes of a request holding ``held`` bytes until its answer and ``tensor_bytes`` of tensors."""
    return held + TENSOR_COPIES * tensor_bytes


def predict(data: bytes) -> int:
    """A recship PredictRequest's cost: its ids (sfixed64), weights and dense values (float) decode to their own
    size, its lengths (varints, one per example and feature) to at most 4 bytes each: its size bounds its tensors
    but for lengths, which max_batch_size bounds (a few KiB)."""
    return cost(len(data), len(data))


def kserve_infer(data: bytes) -> int:
    """A KServe ModelInferRequest's cost: the parsed message holds its tensors once more (a typed int64 value is 8
    bytes in it), then as for every request. Bytes that do not parse are charged as typed values of one byte each
    (8x): their decode fails at once, or they are refused."""
    tensors = _infer_tensor_bytes(data)
    if tensors is None:
        tensors = VALUE_BYTES * len(data)
    return cost(len(data) + tensors, tensors)


def rest_json(body: "json_tensors.Body", binary_bytes: int) -> int:
    """A KServe REST request's cost past its body (which the front holds from before it is read): what decoding its
    JSON holds (its text, the arrays, the standard parser's objects), and its tensors (the JSON's numbers and the
    binary data after it)."""
    return cost(body.held(), body.tensor_bytes() + binary_bytes)


def _infer_tensor_bytes(data: bytes) -> Optional[int]:
    """The decoded bytes of a ModelInferRequest's inputs (typed contents and raw_input_contents), None if it does not
    parse as protobuf fields."""
    total = 0
    try:
        for field, kind, value in wire._fields(data, 0, len(data)):
            if kind != wire._LEN:
                continue
            start, stop = value
            if field == 7:  # raw_input_contents
                total += stop - start
            elif field == 5:  # inputs: InferInputTensor, whose field 5 is its InferTensorContents
                for f, k, v in wire._fields(data, start, stop):
                    if f == 5 and k == wire._LEN:
                        total += _contents_bytes(data, *v)
    except (wire.Malformed, IndexError):
        return None
    return total


def _contents_bytes(data: bytes, start: int, stop: int) -> int:
    """Decoded bytes of an InferTensorContents: fp32 (6), fp64 (7) and bytes (8) as they are, every varint of the
    others as VALUE_BYTES."""
    total = 0
    for i, (field, kind, value) in enumerate(wire._fields(data, start, stop)):
        if i >= _MAX_FIELDS:  # unpacked: each value at least 2 bytes (key, varint)
            return VALUE_BYTES * (stop - start)
        if kind != wire._LEN:
            total += VALUE_BYTES
        elif field in (6, 7, 8):
            total += value[1] - value[0]
        else:
            total += VALUE_BYTES * varints(data, *value)
    return total


def varints(data: bytes, start: int, stop: int) -> int:
    """How many varints data[start:stop] holds: its bytes below 0x80, each the last of one."""
    view = memoryview(data)
    n = 0
    for at in range(start, stop, _CHUNK):
        n += int(np.count_nonzero(np.frombuffer(view[at:min(stop, at + _CHUNK)], dtype=np.uint8) < 0x80))
    return n
