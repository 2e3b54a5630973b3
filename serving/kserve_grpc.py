"""The KServe v2 gRPC service, ``inference.GRPCInferenceService``: each method decodes its request with the
protocol's codec (``recship.serving.kserve``), runs it through the serving core and answers in gRPC's terms
(``recship.serving.grpc_status``). The REST front (``recship.serving.rest``) uses the same codec over HTTP."""

import asyncio
from typing import Any

import grpc
from google.protobuf import json_format

from recship.serving import footprint, grpc_status
from recship.serving.grpc_status import decode
from recship.serving.inference import Inference, Outcome
from recship.serving.kserve import (SERVICE, check_repository_name, control_parameters, from_grpc, infer_response, message, model_config,
                                    model_infer, model_metadata, model_statistics, parse_version, repository_index, route,
                                    server_metadata)
from recship.serving.repository import ModelNotFound


class KServeServicer:
    """inference.GRPCInferenceService over recship's inference path. Every method takes its request's
    bytes (see ``add_to_server``), so bytes that do not decode get INVALID_ARGUMENT and are counted."""

    def __init__(self, inference: Inference) -> None:
        self.inference = inference
        self.repo = inference.repo

    async def _answer(self, method: str, data: bytes, context, respond):
        """Decodes ``data`` as ``<method>Request``, answers ``<method>Response`` from ``respond(request, outcome)``."""
        request_class, response_class = message(f"{method}Request"), message(f"{method}Response")

        async def work(outcome: Outcome):
            with self.inference.admit(len(data)):
                return await respond(decode(request_class, data), outcome, response_class)

        return await grpc_status.answer(self.inference, context, method, work)

    async def ServerLive(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            return R(live=True)

        return await self._answer("ServerLive", data, context, respond)

    async def ServerReady(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            return R(ready=self.inference.server_ready())

        return await self._answer("ServerReady", data, context, respond)

    async def ModelReady(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            try:
                served = self.inference.route(request.name, parse_version(request.version), outcome)
            except ModelNotFound:
                return R(ready=False)
            return R(ready=self.inference.model_ready(served))

        return await self._answer("ModelReady", data, context, respond)

    async def ServerMetadata(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            return json_format.ParseDict(server_metadata(), R())

        return await self._answer("ServerMetadata", data, context, respond)

    async def ModelMetadata(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            served = self.inference.route(request.name, parse_version(request.version), outcome)
            return json_format.ParseDict(model_metadata(served, [s.version for s in self.repo.versions(served.name)]), R())

        return await self._answer("ModelMetadata", data, context, respond)

    async def RepositoryIndex(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            check_repository_name(request.repository_name)
            return R(models=[R.ModelIndex(**m) for m in repository_index(self.repo, request.ready)])

        return await self._answer("RepositoryIndex", data, context, respond)

    async def RepositoryModelLoad(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            check_repository_name(request.repository_name)
            control_parameters(dict(request.parameters), "load")
            await asyncio.get_running_loop().run_in_executor(None, self.repo.load, request.model_name)
            return R()

        return await self._answer("RepositoryModelLoad", data, context, respond)

    async def RepositoryModelUnload(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            check_repository_name(request.repository_name)
            control_parameters(dict(request.parameters), "unload")
            await asyncio.get_running_loop().run_in_executor(None, self.repo.unload, request.model_name)
            return R()

        return await self._answer("RepositoryModelUnload", data, context, respond)

    async def ModelConfig(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            served = self.inference.route(request.name, parse_version(request.version), outcome)
            return R(config=json_format.ParseDict(model_config(served), message("ModelConfig")()))

        return await self._answer("ModelConfig", data, context, respond)

    async def ModelStatistics(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def respond(request, outcome, R):
            return json_format.ParseDict(model_statistics(self.repo, self.inference.metrics, request.name, request.version), R())

        return await self._answer("ModelStatistics", data, context, respond)

    async def ModelInfer(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        async def work(outcome: Outcome):
            with self.inference.admit(len(data), footprint.kserve_infer(data)):  # (refused before it is decoded)
                request = decode(message("ModelInferRequest"), data)
                served = route(self.inference, request, outcome)  # (a request for no served version: its inputs unread)
                served, outputs = await model_infer(self.inference, from_grpc(request), context.time_remaining(), outcome, served)
                return infer_response(request, served, outputs)

        return await grpc_status.answer(self.inference, context, "ModelInfer", work)


_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "RepositoryIndex",
            "RepositoryModelLoad", "RepositoryModelUnload", "ModelConfig", "ModelStatistics")


def add_to_server(servicer: KServeServicer, server: grpc.aio.Server) -> None:
    """Registers inference.GRPCInferenceService on a grpc.aio server."""
    grpc_status.register(server, SERVICE, servicer, {method: message(f"{method}Response") for method in _METHODS})
