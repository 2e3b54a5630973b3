"""recship's own gRPC API, ``recship.serving.v1.Predictor``: Predict, GetModelMetadata, ListModels.

Predict reads its request's bytes with the wire reader (``serving/wire.py``), not protobuf;
every method answers through the shared request path (``serving/inference.py``), whose
admission each one passes with its request's size first.
"""

from typing import Any

import grpc

from recship.serving import footprint, grpc_status, wire
from recship.serving.grpc_status import decode
from recship.serving.inference import Inference, Outcome
from recship.serving.requests import InvalidRequest, RequestArrays, output_shapes
from recship.serving.v1 import predictor_pb2 as pb
from recship.serving.v1 import predictor_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Predictor"].full_name


class PredictorServicer(pb_grpc.PredictorServicer):
    """recship.serving.v1.Predictor. Every method takes its request's bytes (see ``add_to_server``)."""

    def __init__(self, inference: Inference) -> None:
        self.inference = inference
        self.repo = inference.repo

    async def Predict(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def work(outcome: Outcome):
            with self.inference.admit(len(data), footprint.predict(data)):  # (refused before it is decoded)
                request = read_predict(data)
                served, outputs = await self.inference.run(request, context.time_remaining(), outcome)
                return pb.PredictResponse(
                    model_name=served.name,
                    model_version=served.version,
                    request_id=request.request_id,
                    outputs=[pb.Tensor(name=k, shape=list(v.shape), values=v.float().reshape(-1).tolist()) for k, v in outputs.items()],
                )

        return await grpc_status.answer(self.inference, context, "Predict", work)

    async def GetModelMetadata(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def work(outcome: Outcome):
            with self.inference.admit(len(data)):
                request = decode(pb.ModelMetadataRequest, data)
                served = self.inference.route(request.model_name, request.model_version, outcome)
            m = served.manifest
            return pb.ModelMetadataResponse(
                model_name=served.name,
                model_version=served.version,
                sparse_features=[
                    pb.FeatureSpec(name=f.name, table=f.table, pooling=f.pooling, dim=f.dim, rows=f.rows,
                                   weight_type=f.weight_type,
                                   id_policy="modulo" if served.spec.modulo[f.name] else "reject",  # config.yaml may override
                                   id_bound=f.bound)
                    for f in m.sparse_features
                ],
                num_dense=m.num_dense,
                weighted=m.weighted,
                outputs=[pb.OutputSpec(name=k, shape=shape) for k, shape in output_shapes(m).items()],
                max_batch_size=served.spec.max_batch_size,
                device=self.repo.config.device,
            )

        return await grpc_status.answer(self.inference, context, "GetModelMetadata", work)

    async def ListModels(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def work(outcome: Outcome):
            with self.inference.admit(len(data)):
                decode(pb.ListModelsRequest, data)
            return pb.ListModelsResponse(
                models=[pb.ModelStatus(name=s.name, versions=[v.version for v in self.repo.versions(s.name)], serving_version=s.version)
                        for s in self.repo.models()]
            )

        return await grpc_status.answer(self.inference, context, "ListModels", work)


def read_predict(data: bytes) -> RequestArrays:
    """A PredictRequest's bytes -> RequestArrays; bytes that are not one are an invalid request."""
    try:
        return wire.read_request(data)
    except wire.Malformed as e:
        raise InvalidRequest(f"the request is not a valid recship.serving.v1.PredictRequest: {e}") from None


def add_to_server(servicer: PredictorServicer, server: grpc.aio.Server) -> None:
    """Registers the Predictor service on a grpc.aio server."""
    responses = {"Predict": pb.PredictResponse, "GetModelMetadata": pb.ModelMetadataResponse, "ListModels": pb.ListModelsResponse}
    grpc_status.register(server, SERVICE, servicer, responses)
