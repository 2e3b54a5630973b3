"""``recship example-request``: a valid request for an exported model, printed as KServe v2 REST JSON (``curl -d @-``)
or as ``recship predict --request`` JSON: the first examples of the artifact's own self-check sample, so it works from
any install (no file of the source tree) and its answers are the sample's (every loader runs a batch in blocks of a
fixed size: an example's answer does not depend on the others in its request).

    recship example-request ART > request.json                       # KServe v2 REST
    recship example-request REPO/dlrm --format predict > predict.json  # the newest version's, for recship predict
"""

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List

FORMATS = ("kserve", "predict")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="an artifact folder (recship export --out), or a model's folder in a "
                        "model repository (its newest version); required")
    parser.add_argument("--format", choices=FORMATS, default="kserve", help="kserve: a KServe v2 REST body (POST "
                        "/v2/models/NAME/infer); predict: recship predict's --request JSON (default: kserve)")
    parser.add_argument("--batch", type=int, default=2, help="examples, the first of the artifact's sample (default 2)")


def run(args: argparse.Namespace) -> int:
    from recship.export.artifact import Manifest, read_sample  # lazy: `recship --help` imports no torch

    folder = artifact_folder(Path(args.model_dir))
    manifest = Manifest.read(folder)
    inputs, _ = read_sample(folder, manifest)
    print(json.dumps(example_request(manifest, {k: v.numpy() for k, v in inputs.items()}, args.batch, args.format)))
    return 0


def artifact_folder(path: Path) -> Path:
    """``path`` where it holds an artifact (manifest.json), else its newest numbered version that does."""
    if (path / "manifest.json").is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such folder")
    versions = sorted((int(p.name), p) for p in path.iterdir() if p.name.isdigit() and (p / "manifest.json").is_file())
    if not versions:
        raise ValueError(f"{path}: neither an artifact (no manifest.json) nor a model folder with numbered versions holding one")
    return versions[-1][1]


def example_request(manifest: Any, sample: Dict[str, Any], batch: int, format: str) -> Dict[str, Any]:
    """The first ``batch`` examples of the sample request ``sample`` (dense [B, n], lengths [F*B] feature-major, values,
    weights: numpy arrays) as a body of ``format`` (FORMATS)."""
    from recship.serving.kserve import input_metadata  # lazy: imports torch; `recship example-request --help` does not

    features = manifest.sparse_features
    lengths = sample["lengths"].reshape(len(features), -1)
    total = lengths.shape[1]
    if not 1 <= batch <= total:
        raise ValueError(f"--batch {batch}: the artifact's sample has {total} examples; give 1 to {total}")
    starts = lengths.sum(axis=1).cumsum() - lengths.sum(axis=1)  # where each feature's ids begin in values
    ids: Dict[str, List[List[int]]] = {}
    weights: Dict[str, List[List[float]]] = {}
    for f, feature in enumerate(features):
        at = int(starts[f])
        ids[feature.name], weights[feature.name] = [], []
        for n in lengths[f, :batch].tolist():
            ids[feature.name].append(sample["values"][at: at + n].tolist())
            if feature.weighted:
                weights[feature.name].append(sample["weights"][at: at + n].tolist())
            at += n
    dense = sample["dense"][:batch] if manifest.num_dense else None
    if format == "predict":
        body: Dict[str, Any] = {"sparse": ids}
        if dense is not None:
            body["dense"] = dense.tolist()
        if any(feature.weighted for feature in features):
            body["weights"] = {feature.name: weights[feature.name] for feature in features if feature.weighted}
        return body
    data: Dict[str, Any] = {"dense": None if dense is None else dense.reshape(-1).tolist()}
    for feature in features:
        data[f"{feature.name}.lengths"] = [len(example) for example in ids[feature.name]]
        data[f"{feature.name}.values"] = [i for example in ids[feature.name] for i in example]
        data[f"{feature.name}.weights"] = [w for example in weights[feature.name] for w in example]
    inputs = []
    for name, datatype, shape in input_metadata(manifest):  # the inputs the server lists, in its order
        shape = [batch, *shape[1:]] if name == "dense" or name.endswith(".lengths") else [len(data[name])]
        inputs.append({"name": name, "shape": shape, "datatype": datatype, "data": data[name]})
    return {"id": "example", "inputs": inputs}
