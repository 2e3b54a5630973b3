"""``recship inspect DIR``: the manifest as tables, the checksum, and the sample self-check."""

import argparse

from recship.export.artifact import open_artifact, self_check
from recship.export.pipeline import report_text
from recship.trainer.text import text_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="an exported artifact directory")


def run(args: argparse.Namespace) -> int:
    model, m = open_artifact(args.artifact, check=False)
    info, versions = m.model, m.versions
    print(f"model {info.name} version {info.version} ({info.kind}), format {m.format}")
    print(f"built with torch {versions.torch}, fbgemm_gpu {versions.fbgemm_gpu}; needs {', '.join(m.op_libraries)}")
    print(f"inputs: dense [B, {m.num_dense}] float32, lengths [F*B] int32, values [N] int64" + (", weights [N] float32" if m.weighted else ""))
    print("outputs: " + ", ".join(f"{k} {v.shape}" for k, v in m.outputs.items()))
    rows = [(f.name, f.table, f.pooling.lower(), f"{f.rows} x {f.dim}", f.weight_type.lower(), f.id_policy) for f in m.sparse_features]
    print(text_table(("feature", "table", "pooling", "rows x dim", "type", "ids"), rows))
    s = m.sharding
    print(f"sharding: {s.num_devices} {s.device} device(s), row alignment {s.row_alignment}, {len(s.shards)} shards")
    print(report_text(m.to_dict()))
    print("checksum: ok (sha256 matches the manifest)")
    worst = self_check(model, args.artifact, m)
    print(f"sample self-check: ok (batch {m.sample.batch_size}, max abs difference {worst:.3g})")
    return 0
