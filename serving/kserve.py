"""The KServe v2 / Open Inference Protocol front: ``inference.GRPCInferenceService`` beside Predictor.

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

from typing import Dict, List, Optional, Tuple

import grpc
import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from recship.serving.requests import InvalidRequest, RequestArrays, SparseArrays, output_shapes
from recship.serving.v1 import kserve_descriptor

SERVICE = "inference.GRPCInferenceService"
PLATFORM = "recship_torchscript"

_pool = descriptor_pool.DescriptorPool()
_pool.Add(descriptor_pb2.FileDescriptorProto.FromString(kserve_descriptor.SERIALIZED))


def message(name: str):
    """The message class ``inference.<name>`` (from recship's private pool)."""
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


# KServe datatype -> (numpy little-endian dtype, InferTensorContents field)
DTYPES = {
    "INT32": ("<i4", "int_contents"),
    "INT64": ("<i8", "int64_contents"),
    "FP32": ("<f4", "fp32_contents"),
}
_SUFFIXES = {"lengths": "INT32", "values": "INT64", "weights": "FP32"}


def input_metadata(manifest: dict) -> List[Tuple[str, str, List[int]]]:
    """(name, datatype, shape) of every input the model takes; -1 marks the batch / id count."""
    inputs = []
    for f in manifest["sparse_features"]:
        inputs.append((f"{f['name']}.lengths", "INT32", [-1]))
        inputs.append((f"{f['name']}.values", "INT64", [-1]))
        if manifest["weighted"]:
            inputs.append((f"{f['name']}.weights", "FP32", [-1]))
    if manifest["num_dense"]:
        inputs.append(("dense", "FP32", [-1, int(manifest["num_dense"])]))
    return inputs


def parse_version(text: str) -> int:
    """A KServe version string -> a repository version; "" is 0, the version the server routes to."""
    if text == "":
        return 0
    if not text.isdigit():
        raise InvalidRequest(f"model_version must be a version number, got {text!r}")
    return int(text)


def _tensor(inp, raw: Optional[bytes]) -> np.ndarray:
    """One input tensor as a flat numpy array of its declared datatype, its element count checked."""
    if inp.datatype not in DTYPES:
        raise InvalidRequest(f"input {inp.name!r}: datatype {inp.datatype} is not one recship takes ({', '.join(DTYPES)})")
    dtype, field = DTYPES[inp.datatype]
    if raw is not None:
        if inp.HasField("contents"):
            raise InvalidRequest(f"input {inp.name!r}: both contents and raw_input_contents given")
        if len(raw) % np.dtype(dtype).itemsize:
            raise InvalidRequest(f"input {inp.name!r}: {len(raw)} raw bytes is not a whole number of {inp.datatype} values")
        values = np.frombuffer(raw, dtype=dtype)
    else:
        values = np.asarray(getattr(inp.contents, field), dtype=dtype)
    shape = list(inp.shape)
    if any(d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) != values.size:
        raise InvalidRequest(f"input {inp.name!r}: shape {shape} does not match its {values.size} values")
    return values


def to_request_arrays(request, num_dense: int) -> RequestArrays:
    """A ModelInferRequest -> RequestArrays for ``requests.validate`` (which words the remaining errors)."""
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise InvalidRequest(f"{len(raws)} raw_input_contents for {len(request.inputs)} inputs")
    features: Dict[str, Dict[str, np.ndarray]] = {}
    dense, dense_shape = None, None
    for i, inp in enumerate(request.inputs):
        values = _tensor(inp, raws[i] if raws else None)
        if inp.name == "dense":
            if inp.datatype != "FP32" or len(inp.shape) != 2:
                raise InvalidRequest(f"input 'dense' must be FP32 [batch_size, {num_dense}], got {inp.datatype} {list(inp.shape)}")
            dense, dense_shape = values, list(inp.shape)
            continue
        name, _, part = inp.name.rpartition(".")
        if not name or part not in _SUFFIXES:
            raise InvalidRequest(f"unknown input {inp.name!r}: inputs are <feature>.lengths, <feature>.values, <feature>.weights and dense")
        if inp.datatype != _SUFFIXES[part] or len(inp.shape) != 1:
            raise InvalidRequest(f"input {inp.name!r} must be {_SUFFIXES[part]} [n], got {inp.datatype} {list(inp.shape)}")
        if part in features.setdefault(name, {}):
            raise InvalidRequest(f"input {inp.name!r} appears twice")
        features[name][part] = values
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


def model_metadata(served) -> dict:
    """ModelMetadataResponse as JSON (the REST front answers it as is; gRPC parses it into the message)."""
    m = served.manifest
    return {
        "name": served.name,
        "versions": [str(served.version)],
        "platform": PLATFORM,
        "inputs": [{"name": n, "datatype": d, "shape": shape} for n, d, shape in input_metadata(m)],
        "outputs": [{"name": k, "datatype": "FP32", "shape": shape} for k, shape in output_shapes(m).items()],
    }


def server_metadata() -> dict:
    from recship import __version__

    return {"name": "recship", "version": __version__, "extensions": ["model_repository"]}


async def infer(inference, request, remaining: Optional[float], outcome) -> Tuple[object, Dict[str, torch.Tensor]]:
    """A ModelInferRequest through recship's inference path -> (the version that answered, the requested outputs)."""
    outcome.model, outcome.version = request.model_name, parse_version(request.model_version)  # until routed
    served = inference.repo.get(request.model_name, outcome.version)
    outcome.version = served.version
    arrays = to_request_arrays(request, int(served.manifest["num_dense"]))
    served, outputs = await inference.infer(arrays, remaining, outcome, served)
    wanted = [o.name for o in request.outputs] or list(outputs)
    unknown = [o for o in wanted if o not in outputs]
    if unknown:
        raise InvalidRequest(f"unknown outputs {unknown}; the model gives {list(outputs)}")
    return served, {k: outputs[k] for k in wanted}


class KServeServicer:
    """inference.GRPCInferenceService over a recship server's repository and inference path."""

    def __init__(self, server) -> None:
        self.server = server
        self.repo = server.repo
        self.inference = server.inference
        self.M = {name: message(name) for name in (
            "ServerLiveResponse", "ServerReadyResponse", "ModelReadyResponse", "ServerMetadataResponse",
            "ModelMetadataResponse", "ModelInferResponse", "RepositoryIndexResponse",
        )}

    async def ServerLive(self, request, context):
        return self.M["ServerLiveResponse"](live=True)

    async def ServerReady(self, request, context):
        return self.M["ServerReadyResponse"](ready=self.server.accepting and bool(self.repo.models()))

    async def ModelReady(self, request, context):
        from recship.serving.server import ModelNotFound, status_of

        try:
            self.repo.get(request.name, parse_version(request.version))
            ready = self.server.accepting
        except ModelNotFound:
            ready = False
        except InvalidRequest as e:
            await context.abort(*status_of(e))
        return self.M["ModelReadyResponse"](ready=ready)

    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(server_metadata(), self.M["ServerMetadataResponse"]())

    async def ModelMetadata(self, request, context):
        from recship.serving.server import ModelNotFound, status_of

        try:
            served = self.repo.get(request.name, parse_version(request.version))
        except (ModelNotFound, InvalidRequest) as e:
            await context.abort(*status_of(e))
        return json_format.ParseDict(model_metadata(served), self.M["ModelMetadataResponse"]())

    async def RepositoryIndex(self, request, context):
        M = self.M["RepositoryIndexResponse"]
        return M(models=[M.ModelIndex(name=s.name, version=str(s.version), state="READY") for s in self.repo.models()])

    async def ModelInfer(self, request, context):
        async def work(outcome):
            served, outputs = await infer(self.inference, request, context.time_remaining(), outcome)
            return self._response(request, served, outputs)

        return await self.inference.answer(context, work)

    def _response(self, request, served, outputs):
        R = self.M["ModelInferResponse"]
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


def add_to_server(servicer: KServeServicer, server) -> None:
    """Registers inference.GRPCInferenceService on a grpc.aio server."""
    rpc = grpc.unary_unary_rpc_method_handler
    methods = {
        "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
        "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
        "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
        "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
        "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
        "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
        "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
    }
    handlers = {
        method: rpc(getattr(servicer, method), request_deserializer=message(req).FromString,
                    response_serializer=message(resp).SerializeToString)
        for method, (req, resp) in methods.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
