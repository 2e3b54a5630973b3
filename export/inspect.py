"""``recship inspect DIR [--plot [PNG]]``: the manifest as tables, the checksums (every file the manifest
lists, as a server verifies them), the sample self-check, and on request the chart of its tables
(recship/plots.py).

``--plot`` alone is a switch, as in ``recship train`` and ``recship export``: it writes ``tables.png`` (export's
name for the same chart) in the current folder, never into the artifact; ``--plot PNG`` writes that file."""

import argparse
from pathlib import Path

CHART = "tables.png"  # --plot's file without a PNG, in the current folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="the exported artifact directory to describe and self-check (required)")
    parser.add_argument("--plot", nargs="?", const=CHART, metavar="PNG",
                        help=f"also draw the chart of the artifact's tables (bytes and quantization error): --plot alone "
                             f"to {CHART} in the current folder, --plot PNG to that file; needs matplotlib, pip install "
                             "'recship[plots]' (default: no chart)")


def run(args: argparse.Namespace) -> int:
    # lazy: `recship inspect --help` stays torch-free
    from recship.export.artifact import aoti_runs_here, open_artifact, self_check
    from recship.export.pipeline import report_text
    from recship.plots import plot_artifact, require
    from recship.trainer.text import text_table

    if args.plot:
        require()  # before the report: a chart that cannot be drawn is the one-line error, not a trailing one
    model, m = open_artifact(args.artifact, check=False, format="auto")
    info, versions = m.model, m.versions
    print(f"model {info.name} version {info.version} ({info.kind}), format {m.format}")
    print(f"built with torch {versions.torch}, fbgemm_gpu {versions.fbgemm_gpu}; needs {', '.join(m.op_libraries)}")
    print(f"inputs: dense [B, {m.num_dense}] float32, lengths [F*B] int32, values [N] int64" + (", weights [N] float32" if m.weighted else ""))
    print("outputs: " + ", ".join(f"{k} {v.shape}" for k, v in m.outputs.items()))
    print(f"forwards: blocks of {m.row_block} examples (an answer does not depend on its batch)" if m.row_block
          else "forwards: whole batches (row_block 0: an answer's last bits may depend on its batch)")
    rows = [(f.name, f.table, f.pooling.lower(), f"{f.rows} x {f.dim}", f.weight_type.lower(), f.id_policy,
             "yes" if f.weighted else "no") for f in m.sparse_features]
    print(text_table(("feature", "table", "pooling", "rows x dim", "type", "ids", "weighted"), rows))
    s = m.sharding
    print(f"sharding: {s.num_devices} {s.device} device(s), row alignment {s.row_alignment}, {len(s.shards)} shards")
    print(report_text(m.to_dict()))
    if args.plot:
        print(f"chart: {plot_artifact(Path(args.plot).absolute(), m.to_dict())}")
    files = (["model.pt"] if m.model_sha256 is not None else []) + (["model.pt2"] if m.aoti is not None else []) \
        + (["tables.bin (every table)"] if m.tables is not None else [])
    print(f"checksum: ok (sha256 of {', '.join(files)} as the manifest says; verified as a unit, whichever file runs)")
    if m.model_sha256 is None:
        print("model.pt: none (TorchScript could not compile the model; model.pt2 is its program)")
    else:
        scripted, _ = open_artifact(args.artifact, check=False, format="torchscript") if getattr(model, "format", "torchscript") == "aoti" else (model, m)
        worst = self_check(scripted, args.artifact, m)
        print(f"sample self-check: ok (model.pt, batch {m.sample.batch_size}, max abs difference {worst:.3g})")
    if m.aoti is not None:
        a = m.aoti
        print(f"model.pt2: AOTInductor, kernels for {a.target_isa}, compiled by torch {a.torch} in {a.compile_seconds:.1f} s")
        runs, why = aoti_runs_here(m)
        if not runs:
            print(f"model.pt2: not runnable here: {why}" + (" (loaders use model.pt)" if m.model_sha256 is not None else ""))
        else:
            compiled = model if getattr(model, "format", "torchscript") == "aoti" else open_artifact(args.artifact, check=False, format="aoti")[0]
            worst = self_check(compiled, args.artifact, m)
            print(f"sample self-check: ok (model.pt2, batch {m.sample.batch_size}, max abs difference {worst:.3g})")
    else:
        print("model.pt2: none (exported with --format torchscript, or without a C++ compiler)")
    return 0
