"""``recship demo``: the whole path on built-in defaults, each step checked.

The TorchRec tutorial's data types and float modules (JaggedTensor, KJT,
EmbeddingBagCollection, EmbeddingCollection, TorchScript, fx), sharding over 2 gloo
ranks, then a DLRM trained on synthetic data, quantized, exported (INT8, INT4),
served over gRPC and KServe and run from C++, and the two-tower example from
training to serving. Every step checks its numbers against plain PyTorch (or the
step before) and stops with an error if one is off.
"""

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

import numpy as np

from recship import cli
from recship.native import NativeError, find, packaged, runtime_env
from recship.serving import PredictClient
from recship.serving.settings import ServerConfig

# torch and the modules that import it are imported inside the functions that run: `recship demo --help` needs none
if TYPE_CHECKING:
    from recship import EmbeddingBagCollection


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="the random seed of every step's data and models (default 0)")
    parser.add_argument("--out", default="runs/demo",
                        help="where the demo's training run, checkpoints and artifacts go (default runs/demo)")


def _step(title: str) -> None:
    print(f"\n== {title}")


def _compare_formats(path: str, manifest) -> None:
    """model.pt2 against model.pt: outputs on random requests, and batch-1 latency."""
    # lazy: keeps `recship demo --help` torch-free
    import torch

    from recship.export.artifact import open_artifact

    compiled, _ = open_artifact(path, format="aoti")
    scripted, _ = open_artifact(path, format="torchscript")
    g = torch.Generator().manual_seed(0)
    rows = [f.rows for f in manifest.sparse_features]
    worst = 0.0
    timings: Dict[str, List[float]] = {"model.pt": [], "model.pt2": []}
    with torch.inference_mode():
        for batch in (1, 7, 64):
            lengths = torch.randint(0, 3, (len(rows) * batch,), generator=g)
            limit = torch.tensor(rows).repeat_interleave(batch).repeat_interleave(lengths)
            values = (torch.rand(int(lengths.sum()), generator=g) * limit).long()
            inputs = (torch.rand(batch, manifest.num_dense, generator=g), lengths.to(torch.int32), values, None)
            want, got = scripted(*inputs), compiled(*inputs)
            worst = max([worst] + [float((got[k] - want[k]).abs().max()) for k in want])
            if batch == 1:
                for _ in range(100):
                    for name, model in (("model.pt", scripted), ("model.pt2", compiled)):
                        start = time.perf_counter()
                        model(*inputs)
                        timings[name].append(time.perf_counter() - start)
    us = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
    # across formats to a tolerance: inductor's own kernels (the sigmoid) can round differently from ATen's by an ulp,
    # e.g. where this CPU runs ATen's AVX-512 code and model.pt2 was compiled for AVX2
    _expect(worst <= 1e-6, f"model.pt2 (AOTInductor, {manifest.aoti.target_isa}, compiled in {manifest.aoti.compile_seconds:.0f} s) equals "
                           f"model.pt at batch 1, 7, 64 (max |difference| {worst:.1e}); batch-1 forward {us['model.pt2']:.0f} us "
                           f"vs {us['model.pt']:.0f} us (TorchScript)")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"demo check failed: {what}")
    print(f"   ok: {what}")


def tutorial_ebc() -> "EmbeddingBagCollection":
    """The tutorial's two 4096 x 64 tables, 'product' and 'user'."""
    # lazy: keeps `recship demo --help` torch-free
    from recship import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    return EmbeddingBagCollection(
        device="cpu",
        tables=[
            EmbeddingBagConfig(name=f"{f}_table", embedding_dim=64, num_embeddings=4096, feature_names=[f], pooling=PoolingType.SUM)
            for f in ("product", "user")
        ],
    )


def run(args: argparse.Namespace) -> int:
    # lazy: keeps `recship demo --help` torch-free
    import torch

    from recship import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        JaggedTensor,
        KeyedJaggedTensor,
        PoolingType,
    )
    from recship.export import ExportConfig, export_model
    from recship.export.artifact import open_artifact
    from recship.quantize import QuantConfig, quantize_embedding_bag_collection
    from recship.serving.server import Server
    from recship.trainer import sharding_walkthrough
    from recship.trainer.checkpoint_reader import CheckpointReader
    from recship.trainer.train import TrainConfig, launch

    torch.manual_seed(args.seed)

    _step("nn.EmbeddingBag: one bag per example, ids [101, 202], [], [303]")
    product_eb = torch.nn.EmbeddingBag(4096, 64)
    pooled = product_eb(input=torch.tensor([101, 202, 303]), offsets=torch.tensor([0, 2, 2]))
    print(f"   pooled shape {tuple(pooled.shape)}")
    w = product_eb.weight
    _expect(torch.allclose(pooled[0], (w[101] + w[202]) / 2), "bag 0 is the mean of rows 101 and 202")
    _expect(bool((pooled[1] == 0).all()), "the empty bag pools to zeros")

    _step("JaggedTensor: lengths [1, 2], values [5, 7, 1]")
    jt = JaggedTensor(values=torch.tensor([5, 7, 1]), lengths=torch.tensor([1, 2]))
    print("   offsets:", jt.offsets().tolist())
    print("   " + str(jt).replace("\n", "\n   "))

    _step("KeyedJaggedTensor.from_jt_dict: product [[1,2,1],[5]], user [[2,3],[4,1]]")
    kjt = KeyedJaggedTensor.from_jt_dict(
        {
            "product": JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1])),
            "user": JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2])),
        }
    )
    print("   keys:", kjt.keys())
    print("   lengths:", kjt.lengths().tolist())
    print("   values:", kjt.values().tolist())
    print("   offsets:", kjt.offsets().tolist())
    print("   " + str(kjt).replace("\n", "\n   "))

    _step("EmbeddingBagCollection: product_table and user_table, 4096 x 64 each")
    ebc = tutorial_ebc()
    print("   " + str(ebc.embedding_bags).replace("\n", "\n   "))
    result = ebc(kjt)
    print("   keys:", result.keys(), "values:", tuple(result.values().shape))
    for key, emb in result.to_dict().items():
        print(f"   {key} {tuple(emb.shape)}")
    product_table = ebc.embedding_bags["product_table"]
    assert isinstance(product_table, torch.nn.EmbeddingBag)  # ModuleDict items are typed nn.Module
    table = product_table.weight
    _expect(
        torch.allclose(result["product"][0], table[1] + table[2] + table[1]),
        "product of example 0 is rows 1 + 2 + 1 of product_table",
    )

    _step("A batch of three: product [101, 202], [], [303]; user [404], [505], [606]")
    mb = KeyedJaggedTensor(
        keys=["product", "user"],
        values=torch.tensor([101, 202, 303, 404, 505, 606]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 1], dtype=torch.int64),
    )
    print("   batch size (stride):", mb.stride())
    pooled = ebc(mb)
    print("   pooled:", pooled)
    _expect(tuple(pooled.values().shape) == (3, 128), "the KeyedTensor is [3, 128]")

    _step("MEAN pooling and the unpooled EmbeddingCollection")
    mean_ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=16, pooling=PoolingType.MEAN)]
    )
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=16)])
    mean_table = mean_ebc.embedding_bags["t"]
    assert isinstance(mean_table, torch.nn.EmbeddingBag)
    ec.load_state_dict({"embeddings.t.weight": mean_table.weight.detach()})
    ids = KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 3, 5, 7]), lengths=torch.tensor([3, 1]))
    rows = ec(ids)["t"].to_dense()
    means = torch.stack([r.mean(dim=0) for r in rows])
    _expect(torch.allclose(mean_ebc(ids).values(), means), "MEAN pooling equals the mean of the looked-up rows")

    _step("TorchScript and torch.fx give the same answer")
    scripted = torch.jit.script(ebc)
    traced = torch.fx.symbolic_trace(ebc)
    _expect(torch.equal(scripted(mb).values(), pooled.values()), "torch.jit.script(ebc) matches eager")
    _expect(torch.equal(traced(mb).values(), pooled.values()), "torch.fx.symbolic_trace(ebc) matches eager")

    _step("Sharding the tutorial's 4 tables over 2 ranks, each sharding type")
    sharding_walkthrough.run()

    _step("Train the default DLRM on synthetic Criteo-like data: 2 gloo ranks, checkpoint at the end")
    summary = launch(TrainConfig(out=args.out, steps=200, nproc_per_node=2, eval_every=100, checkpoint_every=100, seed=args.seed,
                                 overwrite=True))  # the walk-through starts over each time it runs
    first = sum(summary["losses"][:20]) / 20
    last = sum(summary["losses"][-20:]) / 20
    print(f"   loss {first:.4f} -> {last:.4f} (mean of first/last 20 steps); eval {summary['final_eval']}")
    _expect(last < first - 0.02, "the training loss drops")
    _expect(summary["final_eval"]["auc"] > 0.6, f"held-out AUC {summary['final_eval']['auc']:.3f} > 0.6")
    reader = CheckpointReader(summary["checkpoint"])
    n_tables = sum(1 for _ in reader.table_configs())
    _expect(reader.step == 200 and n_tables == 26, f"checkpoint {summary['checkpoint']} holds step 200 and 26 tables")
    if summary["curves"] is None:  # matplotlib is an optional extra (make demo installs it)
        print("   curves: not drawn, matplotlib is not installed (pip install 'recship[plots]')")
    else:
        curves = Path(summary["curves"])
        _expect(curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"training curves (loss, eval log loss, AUC): {curves}")

    _step("Quantize the tutorial's product/user tables to INT8 (fbgemm inference TBE)")
    qebc, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    data, scale_bias = qebc.table_weights()["product_table"]
    assert scale_bias is not None  # INT8 rows carry an fp16 scale and bias
    print(f"   product_table rows: {data.dtype} x {data.shape[1]} + {scale_bias.shape[1]} bytes of fp16 scale/bias "
          "(the tutorial's 80 is a GPU's 16-byte row alignment)")
    quantized = qebc(mb).values()
    error = float((quantized - pooled.values()).norm() / pooled.values().norm())
    _expect(error < 6e-3, f"INT8 pooled lookups are within {error:.1e} of float32")

    _step("Quantize the trained DLRM's 26 tables from its checkpoint: INT8, then INT4")
    trained = EmbeddingBagCollection([cfg for _, cfg in reader.table_configs()], device="meta")
    for _, cfg, weight in reader.tables():
        trained.embedding_bags[cfg.name].weight = torch.nn.Parameter(weight, requires_grad=False)
    for dtype in ("int8", "int4"):
        _, report = quantize_embedding_bag_collection(trained, QuantConfig(dtype=dtype))
        print(f"   {dtype}:\n   " + str(report).replace("\n", "\n   "))

    _step("Export the trained DLRM: INT8 (TorchScript + AOTInductor) into a model repository, and INT4 (2 shards each), "
          "then load and self-check each")
    repo = Path(args.out) / "repo"
    shutil.rmtree(repo, ignore_errors=True)  # the walk-through starts over each time it runs: the export is version 1
    served_artifact = repo / "dlrm" / "1"
    for dtype in ("int8", "int4"):
        # INT8: model.pt2 too where a C++ compiler is present (auto); INT4: model.pt only, to keep the demo short
        if dtype == "int8":  # into service in one step: the next version folder of the repository, written atomically
            print(f"   recship export {summary['checkpoint']} --model-repo {repo} --model-name dlrm --dtype int8 --shards 2")
            # plot=None: tables.png in the artifact as `recship export` draws it (when matplotlib is installed)
            written = export_model(summary["checkpoint"], ExportConfig(repo=str(repo), model_name="dlrm", dtype=dtype, shards=2,
                                                                       progress=False, plot=None))
            out = str(repo / "dlrm" / str(written["model"]["version"]))
            print(f"   wrote {out} (version {written['model']['version']})")
            if (Path(out) / "tables.png").is_file():
                print(f"   chart of its tables (bytes, quantization error): {Path(out) / 'tables.png'}")
            _expect(out == str(served_artifact), f"the empty repository's first version is {served_artifact}")
        else:
            out = f"{args.out}/artifacts/dlrm_{dtype}"
            export_model(summary["checkpoint"], ExportConfig(out=out, dtype=dtype, shards=2, overwrite=True, progress=False,
                                                             format="torchscript"))
        _, manifest = open_artifact(out)  # checksum + sample self-check
        if manifest.aoti is not None:
            _compare_formats(out, manifest)
        v = manifest.validation
        _expect(
            abs(v["auc"] - v["float_auc"]) < 0.01,
            f"{out}: {manifest.quantization['quantized_bytes']:,} bytes of tables, AUC {v['auc']:.4f} vs float {v['float_auc']:.4f}, "
            f"max |prob diff| {v['max_abs_diff_vs_float']['prob']:.2g}; reloaded and self-checked",
        )

    _step("Serve the repository (the INT8 artifact) over gRPC, query it with the client, shut down")
    server = Server(ServerConfig(model_repo=str(repo), port=0))
    try:
        _expect(server.repo.get("dlrm").version == 1, f"the server loaded dlrm version 1 from {repo}")
        scripted, _ = open_artifact(served_artifact)
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            g = np.random.default_rng(args.seed)
            rows = [f.rows for f in manifest.sparse_features]
            names = manifest.feature_names
            sparse = {n: [list(g.integers(0, r, size=2)) for _ in range(3)] for n, r in zip(names, rows)}
            dense = g.random((3, manifest.num_dense), dtype=np.float32)
            served = client.predict("dlrm", sparse, dense)
            print("   predictions (prob) for 3 examples:", [round(float(p), 4) for p in served["prob"][:, 0]])
            lengths = torch.tensor([len(r) for n in names for r in sparse[n]], dtype=torch.int32)
            values = torch.tensor([i for n in names for r in sparse[n] for i in r], dtype=torch.int64)
            with torch.no_grad():
                local = scripted(torch.from_numpy(dense), lengths, values, None)["prob"].numpy()
            _expect(np.array_equal(served["prob"], local), "gRPC answers equal the artifact run in-process, bitwise")
            latencies = []
            for _ in range(200):
                t = time.perf_counter()
                client.predict("dlrm", sparse, dense)
                latencies.append((time.perf_counter() - t) * 1e3)
            p50, p99 = np.percentile(latencies, [50, 99])
            print(f"   200 sequential 3-example requests: p50 {p50:.2f} ms, p99 {p99:.2f} ms end to end")
        _kserve_query(server.port, sparse, dense, served["prob"])
    finally:
        server.stop()
    print("   server stopped")

    _step("Build the C++ loader and run recship_predict on the same artifact and request")
    if packaged("recship_predict") is None:  # not installed with recship: the source checkout's, built now
        print("   building (cmake, Release, -j2; cached after the first time)...", flush=True)
    try:
        binary = find("recship_predict")
    except NativeError as e:
        raise RuntimeError(str(e)) from None
    request_file = Path(args.out) / "request.json"
    request_file.write_text(json.dumps({"sparse": {k: [[int(i) for i in r] for r in v] for k, v in sparse.items()}, "dense": dense.tolist()}))
    result = subprocess.run([str(binary), str(served_artifact), "--request", str(request_file), "--bench", "200"],
                            capture_output=True, text=True, env=runtime_env())
    if result.returncode != 0:
        raise RuntimeError(f"recship_predict failed: {result.stderr.strip()}")
    cpp = np.asarray(json.loads(result.stdout)["prob"], dtype=np.float32)
    print("   recship_predict (prob):", [round(float(p), 4) for p in cpp[:, 0]])
    print("   " + result.stderr.strip())
    _expect(np.array_equal(cpp, served["prob"]), "C++ predictions equal the gRPC server's, bitwise")

    two_tower(args)
    print("\ndemo finished: every check passed")
    return 0


def two_tower(args: argparse.Namespace) -> None:
    """A model that is not the DLRM, through the same commands: recship.models:TwoTower."""
    # lazy: keeps `recship demo --help` torch-free
    import torch

    from recship.export.artifact import open_artifact
    from recship.serving.server import Server

    _step("Bring your own model: train the two-tower example (recship.models:TwoTower) on 2 ranks, export it, serve it")
    model_args = {"num_users": 2000, "num_items": 5000, "num_countries": 50, "num_categories": 200, "dim": 32}
    run_dir, repo = Path(args.out) / "two_tower", Path(args.out) / "two_tower_repo"
    command = ["train", "--model", "recship.models:TwoTower", "--model-args", json.dumps(model_args), "--out", str(run_dir),
               "--steps", "150", "--nproc-per-node", "2", "--eval-every", "0", "--checkpoint-every", "0", "--overwrite", "--no-progress"]
    print("   recship " + " ".join(command[:4]) + " '" + command[4] + "' " + " ".join(command[5:]))
    _expect(cli.main(command) == 0, "trained (its own loss: binary cross-entropy of the towers' dot product)")
    checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
    shutil.rmtree(repo, ignore_errors=True)  # starts over each run: the export below is version 1
    export = ["export", str(checkpoint), "--model-repo", str(repo), "--model-name", "two_tower"]
    print("   recship " + " ".join(export))
    _expect(cli.main(export) == 0, "exported from the checkpoint alone (it records the entry point and its arguments)")
    artifact = repo / "two_tower" / "1"
    model, manifest = open_artifact(artifact)
    print("   features:", [(f.name, f.pooling.lower()) for f in manifest.sparse_features],
          "outputs:", {k: v.shape for k, v in manifest.outputs.items()})
    g = np.random.default_rng(args.seed)
    sparse = {f.name: [[int(i) for i in g.integers(0, f.rows, size=g.integers(1, 4))] for _ in range(3)]
              for f in manifest.sparse_features}
    dense = g.integers(0, 20, size=(3, manifest.num_dense)).astype(np.float32)
    names = manifest.feature_names
    with torch.no_grad():
        want = model(torch.from_numpy(dense), torch.tensor([len(r) for n in names for r in sparse[n]], dtype=torch.int32),
                     torch.tensor([i for n in names for r in sparse[n] for i in r], dtype=torch.int64), None)
    server = Server(ServerConfig(model_repo=str(repo), port=0))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            got = client.predict("two_tower", sparse, dense)
    finally:
        server.stop()
    print("   scores for 3 user-item pairs:", [round(float(x), 4) for x in got["score"][:, 0]])
    _expect(all(np.array_equal(got[k], want[k].numpy()) for k in want), "served answers equal the artifact in-process, bitwise")


def _kserve_query(port: int, sparse, dense, want) -> None:
    """The same request through the KServe v2 protocol with tritonclient (a dev dependency)."""
    try:
        import tritonclient.grpc as tg  # lazy: tritonclient is a dev dependency, absent from a plain install
    except ImportError:
        print("   tritonclient is not installed: KServe v2 query skipped")
        return
    inputs = []
    for name, rows in sparse.items():
        for suffix, data, dtype in (
            (".lengths", np.array([len(r) for r in rows], dtype=np.int32), "INT32"),
            (".values", np.array([i for r in rows for i in r], dtype=np.int64), "INT64"),
        ):
            t = tg.InferInput(name + suffix, list(data.shape), dtype)
            t.set_data_from_numpy(data)
            inputs.append(t)
    d = tg.InferInput("dense", list(dense.shape), "FP32")
    d.set_data_from_numpy(dense)
    inputs.append(d)
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        prob = client.infer("dlrm", inputs).as_numpy("prob")
    finally:
        client.close()
    _expect(np.array_equal(prob, want), "KServe v2 (tritonclient) answers equal Predict's, bitwise")
