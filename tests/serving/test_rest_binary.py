"""KServe REST with Triton's binary tensor data extension: ``tritonclient.http`` unchanged, the framing
read strictly (each malformed body is 400 with its message), and a property test of mutated framing.

The property test's reference re-states the extension's framing rules (Triton's
docs/protocol/extension_binary_data.md) and the serving rules in plain Python; it shares no code
with serving/rest.py. Answers that succeed equal the artifact run in-process, bitwise.
"""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

th = pytest.importorskip("tritonclient.http")

from recship.export.artifact import open_artifact  # noqa: E402
from recship.serving.server import Server, ServerConfig  # noqa: E402
from model_requests import in_process, model_repo  # noqa: E402
from serving_helpers import FEATURES, NUM_DENSE, ROWS, kserve_tensors, random_request, http_request  # noqa: E402

OUTPUTS = ("logit", "prob")
HEADER = "Inference-Header-Content-Length"
INFER = "/v2/models/dlrm/infer"
MAX_BATCH = 64
NUMPY = {"INT32": "<i4", "INT64": "<i8", "FP32": "<f4"}


@pytest.fixture(scope="module")
def served(small_artifact, tmp_path_factory):
    """(server with --http-port, the artifact in-process)."""
    repo = model_repo(tmp_path_factory.mktemp("binary-repo"), {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_batch_size=MAX_BATCH, max_delay_ms=1))
    model, _ = open_artifact(repo / "dlrm" / "1")
    yield server, model
    server.stop()


def binary_request(seed: int, json_inputs=(), outputs=None, binary_output=None):
    """(JSON document, [binary chunk per binary input]) of a valid request: every input binary except ``json_inputs``."""
    sparse, dense = random_request(seed)
    inputs, chunks = [], []
    for name, datatype, data in kserve_tensors(sparse, dense):
        tensor = {"name": name, "shape": list(data.shape), "datatype": datatype}
        if name in json_inputs:
            tensor["data"] = data.tolist()
        else:
            raw = data.astype(NUMPY[datatype]).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        inputs.append(tensor)
    doc = {"id": f"b{seed}", "inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    if binary_output is not None:
        doc["parameters"] = {"binary_data_output": binary_output}
    return doc, chunks


def framed(doc, chunks, length=None):
    """(body, headers): the JSON then the chunks, the header giving the JSON's length (or ``length``)."""
    head = json.dumps(doc).encode()
    return head + b"".join(chunks), {HEADER: str(len(head)) if length is None else length}


def post(server, body, headers=None):
    return http_request(server.rest.port, "POST", INFER, body, headers)


def read_answer(headers, body):
    """{output name: array} of a 200 answer, binary outputs sliced off after the JSON; and which were binary."""
    if HEADER.lower() in headers:
        n = int(headers[HEADER.lower()])
        assert headers["content-type"] == "application/octet-stream"
        doc, rest = json.loads(body[:n]), body[n:]
    else:
        assert headers["content-type"].startswith("application/json")
        doc, rest = json.loads(body), b""
    got, binary, offset = {}, {}, 0
    for out in doc["outputs"]:
        assert out["datatype"] == "FP32"
        size = out.get("parameters", {}).get("binary_data_size")
        binary[out["name"]] = size is not None
        if size is None:
            got[out["name"]] = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        else:
            assert "data" not in out
            got[out["name"]] = np.frombuffer(rest[offset:offset + size], dtype="<f4").reshape(out["shape"])
            offset += size
    assert offset == len(rest), "the answer's binary part is exactly its binary outputs"
    return got, binary


def good_request_still_exact(server, model, seed: int) -> None:
    doc, chunks = binary_request(seed, outputs=[{"name": "prob", "parameters": {"binary_data": True}}, {"name": "logit"}])
    status, headers, body = post(server, *framed(doc, chunks))
    assert status == 200, body
    got, binary = read_answer(headers, body)
    assert binary == {"prob": True, "logit": False}
    want = in_process(model, *random_request(seed))
    for k in OUTPUTS:
        np.testing.assert_array_equal(got[k], want[k])


# -- tritonclient.http, unchanged ---------------------------------------------------------------

def _triton_inputs(sparse, dense, json_inputs=()):
    inputs = []
    for name, datatype, data in kserve_tensors(sparse, dense):
        t = th.InferInput(name, list(data.shape), datatype)
        t.set_data_from_numpy(data, binary_data=name not in json_inputs)  # binary is tritonclient's default
        inputs.append(t)
    return inputs


def test_tritonclient_http_health_metadata_and_infer_bitwise(served):
    server, model = served
    client = th.InferenceServerClient(f"127.0.0.1:{server.rest.port}")
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("dlrm") and client.is_model_ready("dlrm", "1") and not client.is_model_ready("dlrm", "2")
        meta = client.get_model_metadata("dlrm")
        want_inputs = [(f"{f}.{part}", dtype, [-1]) for f in FEATURES for part, dtype in (("lengths", "INT32"), ("values", "INT64"))]
        assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == want_inputs + [("dense", "FP32", [-1, NUM_DENSE])]
        assert [o["name"] for o in meta["outputs"]] == list(OUTPUTS) and meta["versions"] == ["1"]
        server_meta = client.get_server_metadata()
        assert server_meta["name"] == "recship" and "binary_tensor_data" in server_meta["extensions"]
        Out = th.InferRequestedOutput
        cases = [  # (requested outputs, inputs sent as JSON, {output: expected binary})
            (None, (), {"logit": True, "prob": True}),  # no outputs named: tritonclient asks binary_data_output
            ([Out("prob")], (), {"prob": True}),
            ([Out("prob", binary_data=False)], (), {"prob": False}),
            ([Out("logit", binary_data=False), Out("prob")], ("dense", "cat_3.values"), {"logit": False, "prob": True}),
            ([Out("prob"), Out("logit")], tuple(n for n, _, _ in kserve_tensors(*random_request(0))), {"prob": True, "logit": True}),
        ]
        for seed, (outputs, json_inputs, binary) in enumerate(cases):
            sparse, dense = random_request(100 + seed)
            result = client.infer("dlrm", _triton_inputs(sparse, dense, json_inputs), outputs=outputs, request_id=f"t{seed}",
                                  model_version="1" if seed % 2 else "")
            response = result.get_response()
            assert response["id"] == f"t{seed}" and response["model_version"] == "1"
            assert {o["name"]: "parameters" in o for o in response["outputs"]} == binary
            want = in_process(model, sparse, dense)
            for name in binary:
                got = result.as_numpy(name)
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, want[name])  # lone requests: bitwise
        sparse, dense = random_request(7)
        sparse["cat_4"] = [[ROWS[4] + 3]] + sparse["cat_4"][1:]
        with pytest.raises(th.InferenceServerException) as err:
            client.infer("dlrm", _triton_inputs(sparse, dense))
        assert err.value.status() == "400" and "cat_4" in err.value.message()
    finally:
        client.close()


# -- hand-built bodies: each malformed framing -> 400 and its message ---------------------------

def _bad_cases():
    """[(what, body, headers, exact message or (prefix,))]."""
    doc, chunks = binary_request(1)
    body, headers = framed(doc, chunks)
    n = int(headers[HEADER])
    binary_len = sum(map(len, chunks))
    dense_size = doc["inputs"][-1]["parameters"]["binary_data_size"]
    rows = dense_size // (4 * NUM_DENSE)
    values_len = doc["inputs"][1]["shape"][0]
    cases = [
        ("a length that is not a number", body, {HEADER: "abc"}, f"{HEADER} must be the JSON request's length in bytes, got 'abc'"),
        ("a negative length", body, {HEADER: "-5"}, f"{HEADER} must be the JSON request's length in bytes, got '-5'"),
        ("a length with a sign", body, {HEADER: f"+{n}"}, f"{HEADER} must be the JSON request's length in bytes, got '+{n}'"),
        ("an empty length", body, {HEADER: ""}, f"{HEADER} must be the JSON request's length in bytes, got ''"),
        ("a length past the body", body, {HEADER: str(len(body) + 1)}, f"{HEADER} is '{len(body) + 1}' but the body has only {len(body)} bytes"),
        ("a 40-digit length", body, {HEADER: "9" * 40}, f"{HEADER} is {'9' * 32!r}... (40 characters) but the body has only {len(body)} bytes"),
        ("the length twice", body, {HEADER: str(n), HEADER.lower(): str(n)}, f"{HEADER} is given 2 times"),
        ("a length cutting the JSON", body, {HEADER: str(n - 1)},
         (f"the JSON request (the body's first {n - 1} bytes, {HEADER}) is not JSON: ",)),
        ("binary data without the header", body, {}, ("the body is not JSON: ",)),
        ("a byte too many", body + b"\x00", headers,
         f"the inputs' binary_data_size add up to {binary_len} bytes but {binary_len + 1} bytes follow the JSON request ({HEADER} {n})"),
        ("a byte too few", body[:-1], headers,
         f"the inputs' binary_data_size add up to {binary_len} bytes but {binary_len - 1} bytes follow the JSON request ({HEADER} {n})"),
    ]

    def edited(what, edit, message, chunks=chunks):
        d = json.loads(json.dumps(doc))
        edit(d)
        cases.append((what, *framed(d, chunks), message))

    def set_size(i, size):
        return lambda d: d["inputs"][i]["parameters"].update(binary_data_size=size)

    edited("a size that is not whole values", set_size(-1, dense_size - 1),
           f"input 'dense': binary_data_size {dense_size - 1} is not a whole number of FP32 values (4 bytes each)")
    edited("a size that does not fill the shape", set_size(1, 8 * (values_len + 1)),
           f"input 'cat_0.values': binary_data_size {8 * (values_len + 1)} holds {values_len + 1} INT64 values but shape [{values_len}] needs {values_len}",
           chunks=chunks[:1] + [chunks[1] + bytes(8)] + chunks[2:])
    edited("a size that does not fill the shape (2-D)", set_size(-1, dense_size + 4 * NUM_DENSE),
           f"input 'dense': binary_data_size {dense_size + 4 * NUM_DENSE} holds {(rows + 1) * NUM_DENSE} FP32 values "
           f"but shape [{rows}, {NUM_DENSE}] needs {rows * NUM_DENSE}")
    edited("a negative size", set_size(0, -4), "input 'cat_0.lengths': binary_data_size must be a non-negative integer, got '-4'")
    edited("a size as a string", set_size(0, "16"), "input 'cat_0.lengths': binary_data_size must be a non-negative integer, got '\"16\"'")
    edited("a size as a boolean", set_size(0, True), "input 'cat_0.lengths': binary_data_size must be a non-negative integer, got 'true'")
    edited("a size as a float", set_size(0, 4.0), "input 'cat_0.lengths': binary_data_size must be a non-negative integer, got '4.0'")
    edited("both data and a size", lambda d: d["inputs"][0].update(data=[1] * d["inputs"][0]["shape"][0]),
           "input 'cat_0.lengths': both data and binary_data_size given")
    edited("neither data nor a size", lambda d: d["inputs"][2].pop("parameters"),
           "inputs[2] must be an object with name, shape, datatype and data (or parameters.binary_data_size)")
    edited("parameters not an object", lambda d: d["inputs"][2].update(parameters=[16]), "input 'cat_1.lengths': parameters must be an object, got '[16]'")
    edited("binary_data not a boolean", lambda d: d.update(outputs=[{"name": "prob", "parameters": {"binary_data": 1}}]),
           "output 'prob': binary_data must be true or false, got '1'")
    edited("an output's parameters not an object", lambda d: d.update(outputs=[{"name": "prob", "parameters": "x"}]),
           "output 'prob': parameters must be an object, got '\"x\"'")
    edited("binary_data_output not a boolean", lambda d: d.update(parameters={"binary_data_output": "yes"}),
           "the request: binary_data_output must be true or false, got '\"yes\"'")
    edited("the request's parameters not an object", lambda d: d.update(parameters=3), "\"parameters\" must be an object, got '3'")
    plain = json.loads(json.dumps(doc))
    plain["inputs"][0]["parameters"]["binary_data_size"] = 0
    cases.append(("a size without the header", json.dumps(plain).encode(), {},
                  f"input 'cat_0.lengths': binary_data_size needs the {HEADER} header"))
    return cases


def test_malformed_framing_is_400_with_its_message_and_good_requests_stay_exact(served):
    server, model = served
    for k, (what, body, headers, message) in enumerate(_bad_cases()):
        status, _, answer = post(server, body, headers)
        error = json.loads(answer)["error"]
        assert status == 400, (what, answer)
        if isinstance(message, tuple):
            assert error.startswith(message[0]), (what, error)
        else:
            assert error == message, what
        good_request_still_exact(server, model, 50 + k)


def test_valid_framings_answer_exactly(served):
    """The header's edge cases that are valid, mixed JSON and binary inputs, and every way of asking for outputs."""
    server, model = served
    prob_json = {"name": "prob", "parameters": {"binary_data": False}}
    variants = [  # (doc and chunks, header value or None for the JSON's length, {output: binary})
        (binary_request(1), None, {"logit": False, "prob": False}),
        (binary_request(2, binary_output=True), None, {"logit": True, "prob": True}),
        (binary_request(3, outputs=[prob_json], binary_output=True), None, {"prob": False}),
        (binary_request(4, outputs=[{"name": "logit"}], binary_output=True), None, {"logit": True}),
        (binary_request(5, json_inputs=("dense", "cat_7.lengths", "cat_7.values")), None, {"logit": False, "prob": False}),
        (binary_request(6, json_inputs=[f"cat_{i}.{p}" for i in range(26) for p in ("lengths", "values")] + ["dense"],
                        binary_output=True), None, {"logit": True, "prob": True}),  # the header, no binary input
        (binary_request(7, binary_output=False), "leading zeros", {"logit": False, "prob": False}),
    ]
    for seed, ((doc, chunks), length, binary) in enumerate(variants, start=1):
        body, headers = framed(doc, chunks)
        if length == "leading zeros":
            headers[HEADER] = "000" + headers[HEADER]
        status, answer_headers, answer = post(server, body, headers)
        assert status == 200, answer
        got, was_binary = read_answer(answer_headers, answer)
        assert was_binary == binary and (HEADER.lower() in answer_headers) == any(binary.values())
        want = in_process(model, *random_request(seed))
        for name in binary:
            np.testing.assert_array_equal(got[name], want[name])
    # the JSON-only request without the header is unchanged
    doc, _ = binary_request(9, json_inputs=[f"cat_{i}.{p}" for i in range(26) for p in ("lengths", "values")] + ["dense"])
    status, answer_headers, answer = post(server, json.dumps(doc).encode())
    assert status == 200 and HEADER.lower() not in answer_headers
    got, _ = read_answer(answer_headers, answer)
    for name, value in in_process(model, *random_request(9)).items():
        np.testing.assert_array_equal(got[name], value)
    status, _, answer = http_request(server.rest.port, "GET", "/v2")
    assert status == 200 and json.loads(answer)["extensions"].count("binary_tensor_data") == 1


# -- the property test: mutated framing against an independent reference ------------------------

def _reject(name):
    raise ValueError(name)


def _shared_rules(tensors):
    """{name: (datatype, shape, flat values)} of a decoded request -> True when recship's request rules hold."""
    if set(tensors) != {f"{f}.{p}" for f in FEATURES for p in ("lengths", "values")} | {"dense"}:
        return False
    _, dense_shape, dense = tensors["dense"]
    if len(dense_shape) != 2 or dense_shape[1] != NUM_DENSE or not 0 < dense_shape[0] <= MAX_BATCH:
        return False
    b = dense_shape[0]
    for i, f in enumerate(FEATURES):
        lengths, ids = tensors[f"{f}.lengths"][2], tensors[f"{f}.values"][2]
        if len(lengths) != b or min(lengths) < 0 or sum(lengths) != len(ids) or any(not 0 <= x < ROWS[i] for x in ids):
            return False
    return all(np.isfinite(dense))


def expected(body: bytes, header_values, model):
    """(HTTP status, {output: (array, binary)} or None) of a POST with these Inference-Header-Content-Length values.

    The rules: no header, the body is all JSON; one header, ASCII digits (HTTP strips the spaces around a
    value) giving at most the body's length, the first N bytes are JSON and the rest the binary inputs, in
    order. Each input has data or parameters.binary_data_size (a non-negative JSON integer, a whole number
    of its datatype's values, exactly its shape's count), never both; the sizes add up to the bytes after
    the JSON. Outputs are binary when asked for by the output's binary_data, else by the request's
    binary_data_output (both booleans).
    """
    if len(header_values) > 1:
        return 400, None
    rest = None
    if header_values:
        text = header_values[0].strip(" \t")
        if not text or any(c not in "0123456789" for c in text) or int(text) > len(body):
            return 400, None
        body, rest = body[:int(text)], body[int(text):]
    try:
        doc = json.loads(body, parse_constant=_reject)
    except (ValueError, RecursionError):
        return 400, None
    params = doc.get("parameters", {})
    if not isinstance(params, dict) or not isinstance(params.get("binary_data_output", False), bool):
        return 400, None
    tensors, offset, decoded = {}, 0, []
    for t in doc["inputs"]:  # the mutations below keep names, datatypes and shapes valid
        tp = t.get("parameters", {})
        if not isinstance(tp, dict) or ("data" in t) == ("binary_data_size" in tp):
            return 400, None
        item = int(NUMPY[t["datatype"]][-1])
        count = int(np.prod(t["shape"], dtype=np.int64))
        if "data" in t:
            decoded.append((t, np.asarray(t["data"], dtype=NUMPY[t["datatype"]]).reshape(-1).tolist()))
            continue
        size = tp["binary_data_size"]
        if rest is None or type(size) is not int or size < 0 or size % item or size // item != count:
            return 400, None
        decoded.append((t, (offset, size)))
        offset += size
    if rest is not None and offset != len(rest):
        return 400, None
    for t, values in decoded:
        if isinstance(values, tuple):
            start, size = values
            values = np.frombuffer(rest[start:start + size], dtype=NUMPY[t["datatype"]]).tolist()
        tensors[t["name"]] = (t["datatype"], t["shape"], values)
    default = params.get("binary_data_output", False)
    wanted = {}
    for o in doc.get("outputs", []) or [{"name": k} for k in OUTPUTS]:
        flag = o.get("parameters", {}).get("binary_data", default)
        if not isinstance(flag, bool):
            return 400, None
        wanted[o["name"]] = flag
    if not _shared_rules(tensors):
        return 400, None
    b = tensors["dense"][1][0]
    sparse = {f: [] for f in FEATURES}
    for f in FEATURES:
        ids = iter(tensors[f"{f}.values"][2])
        sparse[f] = [[next(ids) for _ in range(n)] for n in tensors[f"{f}.lengths"][2]]
    outputs = in_process(model, sparse, np.asarray(tensors["dense"][2], dtype=np.float32).reshape(b, NUM_DENSE))
    return 200, {k: (outputs[k], flag) for k, flag in wanted.items()}


header_op = st.one_of(
    st.just(("keep",)),
    st.tuples(st.just("shift"), st.integers(-40, 40)),
    st.tuples(st.just("text"), st.sampled_from(["", "abc", "-1", "+0", "1e3", "0x10", "1.0", "12 34", "9" * 30, "0" * 30])),
    st.tuples(st.just("pad"), st.sampled_from(["0", "000", " ", "\t"])),
    st.just(("drop",)),
    st.tuples(st.just("twice"), st.integers(-2, 2)),
)
binary_op = st.one_of(
    st.just(("keep",)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("duplicate"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("dense"), st.integers(0, 10**6), st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -0.0, 1e-42, 3.4e38])),
)
json_op = st.one_of(
    st.just(("keep",)),
    st.tuples(st.just("size"), st.integers(0, 10**6), st.one_of(st.integers(-9, 9), st.sampled_from([2**63, "8", None, True, 1.5])), st.booleans()),
    st.tuples(st.just("drop_parameters"), st.integers(0, 10**6)),
    st.tuples(st.just("add_data"), st.integers(0, 10**6)),
    st.tuples(st.just("to_json"), st.integers(0, 10**6)),
    st.tuples(st.just("outputs"), st.sampled_from([None, [], ["prob"], ["logit", "prob"]]), st.sampled_from([None, True, False, 1]),
              st.sampled_from([None, True, False, "no"])),
)


def _mutate(seed, header_op, binary_op, json_op):
    """(body, [Inference-Header-Content-Length values]) of a valid binary request after the three mutations."""
    doc, chunks = binary_request(seed)
    inputs = doc["inputs"]
    kind = json_op[0]
    if kind in ("size", "drop_parameters", "add_data", "to_json"):
        i = json_op[1] % len(inputs)
        t = inputs[i]
        if kind == "size":  # a size shifted by a few values or bytes, or not an integer
            value = json_op[2]
            t["parameters"]["binary_data_size"] = t["parameters"]["binary_data_size"] + value * (int(NUMPY[t["datatype"]][-1]) if json_op[3] else 1) \
                if type(value) is int else value
        elif kind == "drop_parameters":
            del t["parameters"]
        elif kind == "add_data":
            t["data"] = [0] * int(np.prod(t["shape"]))
        else:  # the input goes as JSON instead: its bytes leave the binary part
            chunk = chunks[i]
            t["data"] = np.frombuffer(chunk, dtype=NUMPY[t["datatype"]]).reshape(t["shape"]).tolist()
            del t["parameters"]
            chunks = chunks[:i] + [b""] + chunks[i + 1:]
    elif kind == "outputs":
        names, flag, default = json_op[1:]
        if names is not None:
            doc["outputs"] = [{"name": n, **({} if flag is None else {"parameters": {"binary_data": flag}})} for n in names]
        if default is not None:
            doc["parameters"] = {"binary_data_output": default}
    binary = b"".join(chunks)
    kind = binary_op[0]
    pos = binary_op[1] % (len(binary) + 1) if len(binary_op) > 1 else 0
    if kind == "flip" and pos < len(binary):
        binary = binary[:pos] + bytes([binary[pos] ^ binary_op[2]]) + binary[pos + 1:]
    elif kind == "truncate":
        binary = binary[:pos]
    elif kind == "insert":
        binary = binary[:pos] + binary_op[2] + binary[pos:]
    elif kind == "delete":
        binary = binary[:pos] + binary[pos + binary_op[2]:]
    elif kind == "duplicate":
        binary = binary[:pos] + binary[pos:pos + binary_op[2]] * 2 + binary[pos + binary_op[2]:]
    elif kind == "dense" and len(binary) >= 4 * NUM_DENSE and "parameters" in inputs[-1]:  # the dense input's bytes close the binary part
        dense_start = len(binary) - inputs[-1]["parameters"]["binary_data_size"] if type(inputs[-1]["parameters"].get("binary_data_size")) is int else -1
        if 0 <= dense_start <= len(binary) - 4:
            at = dense_start + 4 * (binary_op[1] % ((len(binary) - dense_start) // 4))
            binary = binary[:at] + np.float32(binary_op[2]).astype("<f4").tobytes() + binary[at + 4:]
    head = json.dumps(doc).encode()
    body, n = head + binary, len(head)
    kind = header_op[0]
    if kind == "drop":
        return body, []
    if kind == "shift":
        return body, [str(n + header_op[1])]
    if kind == "text":
        return body, [header_op[1]]
    if kind == "pad":
        return body, [header_op[1] + str(n) + (header_op[1] if header_op[1].isspace() else "")]
    if kind == "twice":
        return body, [str(n), str(n + header_op[1])]
    return body, [str(n)]


KEEP = ("keep",)
# mostly one mutation at a time (so that valid requests and each rule are met often), sometimes all three
mutation = st.one_of(
    header_op.map(lambda h: (h, KEEP, KEEP)),
    binary_op.map(lambda b: (KEEP, b, KEEP)),
    json_op.map(lambda j: (KEEP, KEEP, j)),
    st.tuples(header_op, binary_op, json_op),
)


@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), ops=mutation)
def test_mutated_binary_framing_gets_the_references_status(served, seed, ops):
    server, model = served
    body, lengths = _mutate(seed, *ops)
    headers = {(HEADER if k == 0 else HEADER.lower()): v for k, v in enumerate(lengths)}
    want_status, want = expected(body, lengths, model)
    status, answer_headers, answer = post(server, body, headers)
    assert status == want_status, answer[:300]
    if status == 200:
        got, binary_flags = read_answer(answer_headers, answer)
        assert list(got) == list(want)
        for k, (value, flag) in want.items():
            assert binary_flags[k] == flag
            np.testing.assert_array_equal(got[k], value)
    else:
        assert len(json.loads(answer)["error"]) <= 1100
    good_request_still_exact(server, model, seed + 1)
