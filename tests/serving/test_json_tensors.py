"""The REST front's JSON reader (serving/json_tensors.py) against json.loads, and the costs serving/footprint.py
charges against what protobuf's own parser finds: random documents whose long number arrays hold every kind of
JSON number (and numbers JSON does not allow), each read both ways."""

import json

import numpy as np
import pytest

from recship.serving import footprint
from recship.serving.json_tensors import FAST_CHARS, Body, Numbers
from recship.serving.kserve import message
from recship.serving.values import number_error

GOOD = ["0", "-0", "1", "17", "-5", "123456789012345678", "9223372036854775807", "-9223372036854775808", "9223372036854775808",
        "1.5", "-0.25", "1e5", "2E-3", "0.0", "-0.0", "0.5e-0", "1E+5", "-0.0e01", "10.05", "100e007", "1" * 20, "1" * 320]
BAD = ["01", "1.", "--1", "1e", "+1", ".5", "1.e5", "-", "", "1.2.3", "1e5e5", "1e5.5", "1 2", "00", "-01", "1e+", "e5", ".", "1-2",
       "1+2", "+", "\f1"]
DTYPES = {"INT32": "<i4", "INT64": "<i8", "FP32": "<f4"}


def _reject(name):
    raise ValueError(f"constant {name}")


def _same(want, got) -> None:
    """``got`` (json_tensors) reads as ``want`` (json.loads): a Numbers array as the list it stands for."""
    if isinstance(got, Numbers):
        assert isinstance(want, list) and len(got) == len(want)
        assert str(got) == str(want)  # what a message shows of it
        for datatype, dtype in DTYPES.items():
            assert number_error("x", datatype, got.sample) == number_error("x", datatype, want), datatype
            if number_error("x", datatype, want) is None:  # the array the request path makes of it, bit for bit
                values = got.values.astype(np.float64).astype(dtype) if datatype == "FP32" else got.values.astype(dtype)
                assert values.tobytes() == np.asarray(want, dtype=dtype).tobytes(), datatype
    elif isinstance(got, list):
        assert isinstance(want, list) and len(got) == len(want)
        for w, g in zip(want, got):
            _same(w, g)
    elif isinstance(got, dict):
        assert isinstance(want, dict) and list(got) == list(want)
        for k in got:
            _same(want[k], got[k])
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("seed", range(4))
def test_number_arrays_read_as_json_loads_reads_them(seed):
    rng = np.random.default_rng(seed)
    fast = 0
    for _ in range(600):
        n = int(rng.choice([1, 5, 60, 200]))
        pool = GOOD[:10] if rng.random() < 0.7 else GOOD
        items = [str(rng.choice(pool)) for _ in range(n)]
        if rng.random() < 0.2:
            items[int(rng.integers(n))] = str(rng.choice(BAD))
        sep = str(rng.choice([",", ", ", " ,\n"]))
        array = "[" + sep.join(items) + ("," if rng.random() < 0.05 else "") + "]"
        text = '{"inputs": [{"data": %s, "nested": [[%s], %s], "n": NaN}]}' % (array, array, array)
        if rng.random() < 0.8:
            text = text.replace(', "n": NaN', "")
        fast += len(array) >= FAST_CHARS
        try:
            want = ("ok", json.loads(text, parse_constant=_reject))
        except ValueError as e:
            want = ("error", str(e))
        try:
            got = ("ok", Body(text.encode(), _reject).loads())
        except ValueError as e:
            got = ("error", str(e))
        assert got[0] == want[0], (text[:200], want, got)
        if want[0] == "error":
            assert got[1] == want[1], text[:200]  # the same words, at the same character
        else:
            _same(want[1], got[1])
    assert fast > 100  # the fast path was taken


def test_a_body_is_charged_what_decoding_it_holds_before_it_is_decoded():
    ids = np.arange(300_000) % 97
    body = json.dumps({"inputs": [{"name": "f.values", "datatype": "INT64", "shape": [ids.size], "data": ids.tolist()}]}).encode()
    parsed = Body(body, _reject)
    assert parsed.fast_values == ids.size and parsed.slow_chars < 200
    assert parsed.tensor_bytes() >= 8 * ids.size
    doc = parsed.loads()
    data = doc["inputs"][0]["data"]
    assert isinstance(data, Numbers) and data.values.dtype == np.int64
    np.testing.assert_array_equal(data.values, ids)
    # a body of no long arrays: every character at the standard parser's worst
    small = Body(b'{"inputs": [{}, {}, []]}', _reject)
    assert small.fast_values == 0 and small.held() >= 24 * len(b'{"inputs": [{}, {}, []]}')


def test_kserve_tensors_are_counted_as_the_parsed_message_holds_them():
    rng = np.random.default_rng(0)
    for raw in (False, True):
        r = message("ModelInferRequest")(model_name="m")
        want = 0
        for name, datatype, values in [("a.lengths", "INT32", rng.integers(0, 300, 50)), ("a.values", "INT64", rng.integers(0, 2**40, 4000)),
                                       ("dense", "FP32", rng.random(130))]:
            inp = r.inputs.add(name=name, datatype=datatype, shape=[len(values)])
            if raw:
                r.raw_input_contents.append(np.asarray(values, DTYPES[datatype]).tobytes())
                want += np.dtype(DTYPES[datatype]).itemsize * len(values)
            else:
                field = {"INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents"}[datatype]
                getattr(inp.contents, field).extend(values.tolist())
                want += (4 if datatype == "FP32" else 8) * len(values)
        data = r.SerializeToString()
        assert footprint.kserve_infer(data) == footprint.cost(len(data) + want, want), raw
    assert footprint.kserve_infer(b"\xff" * 10) == footprint.cost(10 + 80, 80)  # not protobuf: 8 bytes a byte
