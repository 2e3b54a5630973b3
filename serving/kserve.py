"""The KServe v2 / Open Inference Protocol: its messages and how recship reads and answers them (the codec the
gRPC service, ``serving/kserve_grpc.py``, and the REST front, ``serving/rest.py``, share).

Same port, same batcher, validation and metrics as ``Predict``; only the shape of the
request differs. Inputs, for a model with sparse features f1..fn:

    <f>.lengths   INT32 [B]      ids per example
    <f>.values    INT64 [N]      the ids, N = sum(lengths)
    <f>.weights   FP32  [N]      weighted models only
    dense         FP32  [B, D]   D = the model's dense features (absent when D = 0)

Outputs by name, FP32, [B, ...]. Values come as typed ``contents`` or as
``raw_input_contents`` (little-endian); the answer uses the same style. Model versions
are the repository's version numbers, as strings.

The messages come from protos/inference/grpc_service.proto through a private
descriptor pool (see serving/codegen.py), so tritonclient can share the process.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from recship import __version__
from recship.export.artifact import Manifest
from recship.serving.inference import Inference, Outcome
from recship.serving.metrics import Metrics
from recship.serving.repository import VERSION_NAME, ModelNotFound, ModelRepository, ServedVersion
from recship.serving.requests import InvalidRequest, RequestArrays, SparseArrays, output_shapes, shown
from recship.serving.settings import PER_MODEL
from recship.serving.v1 import kserve_descriptor

SERVICE = "inference.GRPCInferenceService"
PLATFORMS = {"torchscript": "recship_torchscript", "aoti": "recship_aoti"}  # by the format a version runs

POOL = descriptor_pool.DescriptorPool()  # recship's own, apart from the default pool tritonclient fills
POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(kserve_descriptor.SERIALIZED))


def message(name: str):
    """The message class ``inference.<name>`` (from recship's private pool)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"inference.{name}"))


# KServe datatype -> (numpy little-endian dtype, InferTensorContents field)
DTYPES = {
    "INT32": ("<i4", "int_contents"),
    "INT64": ("<i8", "int64_contents"),
    "FP32": ("<f4", "fp32_contents"),
}
_SUFFIXES = {"lengths": "INT32", "values": "INT64", "weights": "FP32"}


def input_metadata(manifest: Manifest) -> List[Tuple[str, str, List[int]]]:
    """(name, datatype, shape) of every input the model takes; -1 marks the batch / id count."""
    inputs = []
    for f in manifest.sparse_features:
        inputs.append((f"{f.name}.lengths", "INT32", [-1]))
        inputs.append((f"{f.name}.values", "INT64", [-1]))
        if f.weighted:
            inputs.append((f"{f.name}.weights", "FP32", [-1]))
    if manifest.num_dense:
        inputs.append(("dense", "FP32", [-1, manifest.num_dense]))
    return inputs


def parse_version(text: str) -> int:
    """A KServe version string -> a repository version; "" is 0, the version the server routes to."""
    if text == "":
        return 0
    if not VERSION_NAME.fullmatch(text):  # ASCII digits only: "²".isdigit() is true, int("²") fails
        raise InvalidRequest(f"model_version must be a version number, got {shown(text)}")
    return int(text)


class Tensor(NamedTuple):
    """One input of a ModelInfer request as its transport decoded it: ``values`` a flat array of the datatype's dtype
    (``DTYPES``), its count not yet held to ``shape`` (``request_arrays`` checks it)."""

    name: str
    datatype: str
    shape: List[int]
    values: np.ndarray  # [n]


class InferRequest(NamedTuple):
    """KServe's ModelInfer request in no transport's terms: what the gRPC message (``from_grpc``) and the REST JSON
    body (serving/rest.py) both decode into, and ``request_arrays`` reads. ``outputs``: the output names asked for
    (none: every output)."""

    model_name: str
    model_version: str
    id: str
    inputs: List[Tensor]
    outputs: List[str]


def check_datatype(name: str, datatype: str) -> None:
    """InvalidRequest unless ``datatype`` is one of ``DTYPES`` (the one message for either transport)."""
    if datatype not in DTYPES:
        raise InvalidRequest(f"input {shown(name)}: datatype {shown(datatype, 16)} is not one recship takes ({', '.join(DTYPES)})")


def from_grpc(request: Any) -> InferRequest:
    """A ModelInferRequest message -> InferRequest: each input's typed contents, or its raw_input_contents (read in
    place, little-endian), as an array."""
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise InvalidRequest(f"{len(raws)} raw_input_contents for {len(request.inputs)} inputs")
    inputs = []
    for i, inp in enumerate(request.inputs):
        check_datatype(inp.name, inp.datatype)
        dtype, field = DTYPES[inp.datatype]
        if raws:
            if inp.HasField("contents"):
                raise InvalidRequest(f"input {shown(inp.name)}: both contents and raw_input_contents given")
            if len(raws[i]) % np.dtype(dtype).itemsize:
                raise InvalidRequest(f"input {shown(inp.name)}: {len(raws[i])} raw bytes is not a whole number of {inp.datatype} values")
            values = np.frombuffer(raws[i], dtype=dtype)
        else:  # one value at a time into the array (np.asarray would make a list of Python ints first: 36 bytes an id)
            contents = getattr(inp.contents, field)
            values = np.fromiter(contents, dtype=dtype, count=len(contents))
        inputs.append(Tensor(inp.name, inp.datatype, list(inp.shape), values))
    return InferRequest(request.model_name, request.model_version, request.id, inputs, [o.name for o in request.outputs])


def request_arrays(request: InferRequest, num_dense: int) -> RequestArrays:
    """An InferRequest -> RequestArrays for ``requests.validate`` (which words the remaining errors): the inputs
    by KServe's names for recship (the module's docstring), each one's values counted against its shape."""
    features: Dict[str, Dict[str, np.ndarray]] = {}
    dense, dense_shape = None, None
    seen = set()
    for inp in request.inputs:
        if inp.name in seen:
            raise InvalidRequest(f"input {shown(inp.name)} appears twice")
        seen.add(inp.name)
        shape, values = inp.shape, inp.values
        if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) != values.size:
            raise InvalidRequest(f"input {shown(inp.name)}: shape {shown(shape)} does not match its {values.size} values")
        if inp.name == "dense":
            if inp.datatype != "FP32" or len(shape) != 2:
                raise InvalidRequest(f"input 'dense' must be FP32 [batch_size, {num_dense}], got {inp.datatype} {shown(shape)}")
            dense, dense_shape = values, shape
            continue
        name, _, part = inp.name.rpartition(".")
        if not name or part not in _SUFFIXES:
            raise InvalidRequest(f"unknown input {shown(inp.name)}: inputs are <feature>.lengths, <feature>.values, <feature>.weights and dense")
        if inp.datatype != _SUFFIXES[part] or len(shape) != 1:
            raise InvalidRequest(f"input {shown(inp.name)} must be {_SUFFIXES[part]} [n], got {inp.datatype} {shown(shape)}")
        features.setdefault(name, {})[part] = values
    if dense_shape is not None:
        batch = dense_shape[0]
    else:
        batch = next((len(f["lengths"]) for f in features.values() if "lengths" in f), 0)
    empty = {"lengths": np.empty(0, np.int32), "values": np.empty(0, np.int64), "weights": np.empty(0, np.float32)}
    names = list(features)
    cols = [[features[n].get(part, empty[part]) for n in names] for part in ("lengths", "values", "weights")]
    return RequestArrays(
        model_name=request.model_name,
        model_version=parse_version(request.model_version),
        request_id=request.id,
        batch_size=batch,
        sparse=SparseArrays.from_features(names, *cols),
        dense_rows=dense_shape[0] if dense_shape else 0,
        dense_cols=dense_shape[1] if dense_shape else 0,
        dense=dense if dense is not None else np.empty(0, np.float32),
    )


def model_metadata(served: ServedVersion, versions: Optional[List[int]] = None) -> dict:
    """ModelMetadataResponse as JSON (the REST front answers it as is; gRPC parses it into the message).

    ``versions``: every served version of the model, newest first (None: only ``served``'s)."""
    m = served.manifest
    return {
        "name": served.name,
        "versions": [str(v) for v in (versions or [served.version])],
        "platform": PLATFORMS[served.format],
        "inputs": [{"name": n, "datatype": d, "shape": shape} for n, d, shape in input_metadata(m)],
        "outputs": [{"name": k, "datatype": "FP32", "shape": shape} for k, shape in output_shapes(m).items()],
    }


def server_metadata() -> dict:
    # Triton's extension names, only those implemented; REST adds binary_tensor_data (serving/rest.py)
    return {"name": "recship", "version": __version__, "extensions": ["model_repository", "model_configuration", "statistics"]}


_TYPES = {"INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP32": "TYPE_FP32"}


def model_config(served: ServedVersion) -> dict:
    """Triton's ModelConfig of a served version, as JSON (REST answers it as is; gRPC parses it into the message).

    As Triton writes it with ``max_batch_size > 0``, ``dims`` leave the batch dimension out: dense [B, n] is dims [n],
    an output [B, d] dims [d]; a feature's lengths, one per example ([B]), is dims [1] with ``reshape`` [] (Triton's
    form of a batched scalar); its values and weights, ids of the whole request ([N], not batch-first), are dims [-1]
    with ``allow_ragged_batch`` (requests concatenate along it). ``platform`` is the format the version runs
    (recship_aoti: model.pt2, recship_torchscript: model.pt). ``parameters`` carry what Triton's schema has no field
    for: the batching switch, queue size, threads, file format, id policy per feature."""
    m, s = served.manifest, served.settings
    # every per-model setting ModelConfig has no field for (max_batch_size and max_delay_ms have theirs), by its name
    parameters = {name: _parameter(getattr(s, name)) for name in PER_MODEL if name not in ("max_batch_size", "max_delay_ms")}
    parameters.update(format=served.format,
                      **{f"id_policy.{f.name}": ("modulo" if served.spec.modulo[f.name] else "reject") for f in m.sparse_features})
    config: Dict[str, Any] = {
        "name": served.name,
        "platform": PLATFORMS[served.format],
        "backend": "recship",
        "version_policy": s.version_policy.to_triton(),
        "max_batch_size": s.max_batch_size,
        "input": [_config_input(n, d, shape) for n, d, shape in input_metadata(m)],
        "output": [{"name": k, "data_type": "TYPE_FP32", **_per_example(shape[1:])} for k, shape in output_shapes(m).items()],
        "instance_group": [{"name": served.name, "count": 1, "kind": "KIND_GPU" if served.batcher.device.type == "cuda" else "KIND_CPU"}],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }
    if s.batching:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": int(round(s.max_delay_ms * 1000))}
    return config


def _per_example(dims: List[int]) -> Dict[str, Any]:
    """ModelConfig's dims of a batch-first tensor whose shape after the batch is ``dims``: a scalar per example is
    dims [1] reshaped to [] (Triton's convention)."""
    return {"dims": list(dims)} if dims else {"dims": [1], "reshape": {"shape": []}}


def _config_input(name: str, datatype: str, shape: List[int]) -> Dict[str, Any]:
    base = {"name": name, "data_type": _TYPES[datatype]}
    if name == "dense":  # [B, n]
        return {**base, "dims": shape[1:], "allow_ragged_batch": False}
    if name.endswith(".lengths"):
        return {**base, **_per_example([]), "allow_ragged_batch": False}
    return {**base, "dims": [-1], "allow_ragged_batch": True}  # .values / .weights: the request's ids, concatenated


def _parameter(value: Any) -> str:
    """A setting as ModelConfig's string parameter: true/false, a number, or "auto" for the default (None)."""
    return "auto" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def model_statistics(repo: ModelRepository, metrics: Metrics, name: str, version: str) -> dict:
    """Triton's ModelStatisticsResponse as JSON: the served versions of model ``name`` ("": of every model), or its
    ``version``; ModelNotFound if that is not served. Counts cover requests since the server started, the C++
    front's included."""
    if name:
        number = parse_version(version)
        chosen = [repo.get(name, number)] if number else repo.versions(name)
        if not chosen:
            repo.get(name)  # raises ModelNotFound with the served models listed
    elif version:
        raise InvalidRequest("a statistics request naming a version must name its model too")
    else:
        chosen = repo.versions()
    out = []
    for served in chosen:
        st = metrics.stats(served.name, str(served.version))

        def d(pair):
            return {"count": pair[0], "ns": pair[1]}

        zero = {"count": 0, "ns": 0}
        out.append({
            "name": served.name, "version": str(served.version), "last_inference": st.last_inference_ms,
            "inference_count": st.inference_count, "execution_count": st.execution_count,
            "inference_stats": {"success": d(st.success), "fail": d(st.fail), "queue": d(st.queue), "compute_input": zero,
                                "compute_infer": d(st.compute), "compute_output": zero, "cache_hit": zero, "cache_miss": zero},
            "batch_stats": [{"batch_size": size, "compute_input": zero, "compute_infer": {"count": n, "ns": ns}, "compute_output": zero}
                            for size, (n, ns) in sorted(st.batches.items())],
            "memory_usage": [],
        })
    return {"model_stats": out}


def control_parameters(parameters: Dict[str, Any], what: str) -> None:
    """Load/unload parameters recship takes: none, but Triton's unload_dependents (a recship model has no dependents);
    anything else is refused rather than ignored (a ``config`` override would otherwise silently not apply)."""
    unknown = sorted(k for k in parameters if not (what == "unload" and k == "unload_dependents"))
    if unknown:
        names = ", ".join(shown(k) for k in unknown[:8])
        raise InvalidRequest(f"{what} parameter{'s' if len(unknown) > 1 else ''} {names} not supported: a model's settings "
                             "come from its config.yaml in the repository")


def check_repository_name(name: str) -> None:
    """ModelNotFound unless ``name`` is "" (the one repository a Repository* request may name)."""
    if name:
        raise ModelNotFound(f"repository {shown(name)} is not served: recship serves one repository, named \"\"")


async def model_infer(
    inference: Inference, request: InferRequest, remaining: Optional[float], outcome: Outcome, served: Optional[ServedVersion] = None
) -> Tuple[ServedVersion, Dict[str, torch.Tensor]]:
    """KServe's ModelInfer (over gRPC or HTTP): a request through the request path -> (the version that answered, the
    requested outputs). ``served``: the version the front already routed it to (None: routed here)."""
    if served is None:
        served = route(inference, request, outcome)
    arrays = request_arrays(request, served.manifest.num_dense)
    given = list(output_shapes(served.manifest))
    wanted = request.outputs or given
    unknown = [o for o in wanted if o not in given]
    if unknown:
        raise InvalidRequest(f"unknown outputs {shown(unknown)}; the model gives {given}")
    if len(set(wanted)) != len(wanted):
        raise InvalidRequest(f"outputs {shown(wanted)} name one twice")
    served, outputs = await inference.run(arrays, remaining, outcome, served)
    return served, {k: outputs[k] for k in wanted}


def route(inference: Inference, request: Any, outcome: Outcome) -> ServedVersion:
    """The version a ModelInfer request (an InferRequest, or the gRPC message before its inputs are read) asks for."""
    return inference.route(request.model_name, parse_version(request.model_version), outcome)


def repository_index(repo: ModelRepository, ready: bool = False) -> List[dict]:
    """Every served version (READY) and every refused version, folder or config.yaml (UNAVAILABLE, with its reason;
    a refused config.yaml or model folder has the version ""). Under explicit model control also the repository's
    models that are not loaded: UNAVAILABLE "unloaded" after an unload, no state if never loaded (as Triton lists them).
    ``ready``: only the READY versions."""
    index = [{"name": s.name, "version": str(s.version), "state": "READY" if s.batcher.alive else "UNAVAILABLE",
              "reason": "" if s.batcher.alive else "its worker died; it is being restarted"} for s in repo.versions()]
    index += [{"name": u.model, "version": u.version, "state": "UNAVAILABLE", "reason": u.reason} for u in repo.unavailable()]
    index += [{"name": n, "version": "", "state": "UNAVAILABLE" if why else "", "reason": why} for n, why in repo.not_loaded()]
    index += [{"name": n, "version": str(v), "state": "UNAVAILABLE", "reason": why} for n, v, why in repo.left_out()]
    if ready:
        index = [m for m in index if m["state"] == "READY"]
    return sorted(index, key=lambda m: (m["name"], m["version"]))


def infer_response(request: Any, served: ServedVersion, outputs: Dict[str, torch.Tensor]) -> Any:
    """The ModelInferResponse to ``request`` of ``served``'s ``outputs``, in the request's style (raw or typed contents)."""
    R = message("ModelInferResponse")
    response = R(model_name=served.name, model_version=str(served.version), id=request.id)
    raw = bool(request.raw_input_contents) or not request.inputs
    for k, t in outputs.items():
        values = t.float().contiguous().numpy()
        out = response.outputs.add(name=k, datatype="FP32", shape=list(values.shape))
        if raw:
            response.raw_output_contents.append(values.astype("<f4", copy=False).tobytes())
        else:
            out.contents.fp32_contents.extend(values.reshape(-1).tolist())
    return response
