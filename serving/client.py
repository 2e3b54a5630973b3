"""PredictClient: a small Python client for the Predictor service.

    client = PredictClient("127.0.0.1:8500")
    out = client.predict("dlrm", {"cat_0": [[1, 2], [3]], ...}, dense=[[...], [...]])   # {"prob": array [2, 1], ...}
"""

import argparse
import json
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Union

import grpc
import numpy as np

from recship.serving.v1 import predictor_pb2 as pb
from recship.serving.v1 import predictor_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the client itself does not need torch
    from recship.sparse import KeyedJaggedTensor

Sparse = Union[Mapping[str, Sequence[Sequence[int]]], "KeyedJaggedTensor"]
Dense = Union[np.ndarray, Sequence[Sequence[float]]]  # [B, num_dense]
Weights = Mapping[str, Sequence[Sequence[float]]]


class PredictClient:
    def __init__(self, target: str, timeout: float = 10.0) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.PredictorStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "PredictClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(model: str, sparse: Sparse, dense: Optional[Dense] = None, weights: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
                version: int = 0, request_id: str = "") -> pb.PredictRequest:
        """A PredictRequest from {feature: [[ids of example 0], ...]} (or a KJT) and a dense [B, n] matrix."""
        features = []
        if hasattr(sparse, "to_dict") and hasattr(sparse, "stride"):  # a KeyedJaggedTensor
            batch = sparse.stride()
            for name, jt in sparse.to_dict().items():
                w = jt.weights_or_none()
                features.append(pb.SparseFeature(name=name, lengths=jt.lengths().tolist(), ids=jt.values().tolist(),
                                                 weights=[] if w is None else w.tolist()))
        else:
            batch = len(next(iter(sparse.values()))) if sparse else 0
            for name, rows in sparse.items():
                w = (weights or {}).get(name)
                features.append(pb.SparseFeature(
                    name=name, lengths=[len(r) for r in rows], ids=[int(i) for r in rows for i in r],
                    weights=[float(x) for r in w for x in r] if w is not None else [],
                ))
        d = np.zeros((batch, 0), dtype=np.float32) if dense is None else np.asarray(dense, dtype=np.float32)
        return pb.PredictRequest(
            model_name=model, model_version=version, request_id=request_id, batch_size=batch, sparse=features,
            dense=pb.DenseMatrix(rows=d.shape[0], cols=d.shape[1], values=d.reshape(-1).tolist()) if d.size else pb.DenseMatrix(),
        )

    def predict(self, model: str, sparse: Sparse, dense: Optional[Dense] = None, weights: Optional[Weights] = None, version: int = 0, timeout: Optional[float] = None) -> Dict[str, np.ndarray]:
        response = self.stub.Predict(self.request(model, sparse, dense, weights, version), timeout=timeout or self.timeout)
        return outputs_of(response)

    def metadata(self, model: str, version: int = 0):
        return self.stub.GetModelMetadata(pb.ModelMetadataRequest(model_name=model, model_version=version), timeout=self.timeout)

    def list_models(self) -> List[str]:
        return [m.name for m in self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout).models]


def outputs_of(response: pb.PredictResponse) -> Dict[str, np.ndarray]:
    return {t.name: np.asarray(t.values, dtype=np.float32).reshape(list(t.shape)) for t in response.outputs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:8500", help="the server's gRPC address, host:port (default 127.0.0.1:8500)")
    parser.add_argument("--model-name", "--model", dest="model", metavar="NAME", required=True,
                        help="the model's name in the server's repository, its folder (required)")
    parser.add_argument("--model-version", "--version", dest="version", metavar="N", type=int, default=0,
                        help="the model version to ask for; 0 asks for the newest the server serves (default 0)")
    parser.add_argument("--request", required=True,
                        help='a JSON file: {"sparse": {"f": [[1, 2], [3]]}, "dense": [[...]], "weights": {...}} (required)')


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    path = Path(args.request)
    if not path.is_file():
        raise FileNotFoundError(f"request file not found: {path}")
    body = json.loads(path.read_text())
    with PredictClient(args.target) as client:
        try:
            outputs = client.predict(args.model, body["sparse"], body.get("dense"), body.get("weights"), args.version)
        except grpc.RpcError as e:
            raise ValueError(f"{e.code().name}: {e.details()}") from None
    print(json.dumps({k: v.tolist() for k, v in outputs.items()}))
    return 0
