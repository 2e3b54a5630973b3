"""KServe's ModelInfer decodes into one protocol-neutral request (serving/kserve.py InferRequest) whichever transport
brought it: the gRPC message (typed contents or raw_input_contents, ``kserve.from_grpc``) and the REST JSON body
(JSON data or Triton's binary data, ``rest._infer_request``). For the same tensors, valid or mutated, every way of
sending them decodes to the same InferRequest and then the same RequestArrays, or is refused with the same status
and message."""

import json
from typing import Any, List, Tuple

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recship.serving import kserve, rest
from recship.serving.json_tensors import Body
from recship.serving.requests import InvalidRequest

NUM_DENSE = 2
NAMES = ["a.lengths", "a.values", "a.weights", "b.lengths", "b.values", "dense", "a.ids", "dense.values"]
DATATYPES = ["INT32", "INT64", "FP32", "FP64", "BYTES"]  # the last two: no datatype recship takes
RANGES = {"INT32": (-2**31, 2**31 - 1), "INT64": (-2**63, 2**63 - 1)}


@st.composite
def tensors(draw) -> List[Tuple[str, str, List[int], list]]:
    """1-5 inputs (name, datatype, shape, values): mostly each name's own datatype and a shape its values fill, and
    sometimes not (another datatype or one recship does not take, a value too many or too few, a name given twice,
    one that is not an input)."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        name = draw(st.sampled_from(NAMES[:6] * 4 + NAMES))
        own = "FP32" if name == "dense" or name.endswith(".weights") else "INT32" if name.endswith(".lengths") else "INT64"
        datatype = draw(st.sampled_from([own] * 30 + DATATYPES))
        dims = draw(st.sampled_from([2] * 8 + [1, 3] if name == "dense" else [1] * 8 + [0, 2]))
        shape = draw(st.lists(st.integers(0, 3), min_size=dims, max_size=dims))
        count = int(np.prod(shape)) + draw(st.sampled_from([0] * 8 + [-1, 1]))
        if datatype in RANGES:
            values = draw(st.lists(st.integers(*RANGES[datatype]), min_size=max(count, 0), max_size=max(count, 0)))
        else:
            values = draw(st.lists(st.floats(-2.0**100, 2.0**100, width=32), min_size=max(count, 0), max_size=max(count, 0)))
        out.append((name, datatype, shape, values))
    return out


def _grpc(inputs, raw: bool):
    m = kserve.message("ModelInferRequest")(model_name="m", model_version="1", id="req-7")
    m.outputs.add(name="prob")
    for name, datatype, shape, values in inputs:
        t = m.inputs.add(name=name, datatype=datatype, shape=shape)
        if datatype not in kserve.DTYPES:
            continue  # (a datatype recship does not take: refused before its values are read)
        dtype, field = kserve.DTYPES[datatype]
        if raw:
            m.raw_input_contents.append(np.asarray(values, dtype=dtype).tobytes())
        else:
            getattr(t.contents, field).extend(values)
    if raw:  # every input has its raw bytes, even one whose datatype is refused
        m.raw_input_contents.extend([b""] * (len(m.inputs) - len(m.raw_input_contents)))
    return kserve.from_grpc(kserve.message("ModelInferRequest").FromString(m.SerializeToString()))


def _rest(inputs, binary: bool):
    doc: dict = {"id": "req-7", "inputs": [], "outputs": [{"name": "prob"}]}
    data = b""
    for name, datatype, shape, values in inputs:
        entry: dict = {"name": name, "datatype": datatype, "shape": shape}
        if binary and datatype in kserve.DTYPES:
            raw = np.asarray(values, dtype=kserve.DTYPES[datatype][0]).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            data += raw
        else:
            entry["data"] = values
        doc["inputs"].append(entry)
    header = json.dumps(doc).encode()
    head, tail = rest.split_body([str(len(header))] if binary else [], header + data)
    return rest._infer_request("m", "1", Body(head, rest._reject_constant), tail)[0]


def _outcome(decode) -> Any:
    """("ok", the InferRequest and the RequestArrays as plain values) or ("refused", the message), either way."""
    try:
        request = decode()
        arrays = kserve.request_arrays(request, NUM_DENSE)
    except InvalidRequest as e:
        return "refused", str(e)
    plain = (request.model_name, request.model_version, request.id, request.outputs,
             [(t.name, t.datatype, t.shape, t.values.dtype.str, t.values.tolist()) for t in request.inputs])
    s = arrays.sparse
    return "ok", plain, (arrays.model_name, arrays.model_version, arrays.request_id, arrays.batch_size, arrays.dense_rows,
                         arrays.dense_cols, s.names, *[(a.dtype.str, a.tolist()) for a in (arrays.dense, s.lengths, s.length_counts,
                                                                                            s.ids, s.id_counts, s.weights, s.weight_counts)])


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(inputs=tensors())
def test_rest_and_grpc_decode_the_same_tensors_into_the_same_request_or_the_same_refusal(inputs):
    by_contents = _outcome(lambda: _grpc(inputs, raw=False))
    assert _outcome(lambda: _grpc(inputs, raw=True)) == by_contents
    assert _outcome(lambda: _rest(inputs, binary=False)) == by_contents
    if all(len(v) == int(np.prod(s)) for _, _, s, v in inputs):  # (binary data of the wrong size is refused earlier, in REST's own words)
        assert _outcome(lambda: _rest(inputs, binary=True)) == by_contents


def test_a_valid_request_decodes_to_its_tensors():
    """One hand-checked case, so that "all refused alike" cannot pass alone."""
    inputs = [("a.lengths", "INT32", [2], [1, 2]), ("a.values", "INT64", [3], [5, 6, 2**40]), ("dense", "FP32", [2, 2], [0.5, 1.5, -2.0, 3.0])]
    kind, plain, arrays = _outcome(lambda: _rest(inputs, binary=False))
    assert kind == "ok" and plain[3] == ["prob"]
    assert arrays[:7] == ("m", 1, "req-7", 2, 2, 2, ["a"])
    assert arrays[7] == ("<f4", [0.5, 1.5, -2.0, 3.0]) and arrays[10] == ("<i8", [5, 6, 2**40])
    assert _outcome(lambda: _grpc(inputs, raw=True)) == _outcome(lambda: _grpc(inputs, raw=False)) == (kind, plain, arrays)
