"""``recship inspect DIR``: the manifest as tables, the checksum, and the sample self-check."""

import argparse

from recship.export.artifact import open_artifact, self_check
from recship.export.pipeline import report_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="an exported artifact directory")


def run(args: argparse.Namespace) -> int:
    model, m = open_artifact(args.artifact, check=False)
    info, versions = m.model, m.versions
    print(f"model {info.name} version {info.version} ({info.kind}), format {m.format}")
    print(f"built with torch {versions.torch}, fbgemm_gpu {versions.fbgemm_gpu}; needs {', '.join(m.op_libraries)}")
    print(f"inputs: dense [B, {m.num_dense}] float32, lengths [F*B] int32, values [N] int64" + (", weights [N] float32" if m.weighted else ""))
    print("outputs: " + ", ".join(f"{k} {v.shape}" for k, v in m.outputs.items()))
    rows = [("feature", "table", "pooling", "rows x dim", "type", "ids")]
    rows += [(f.name, f.table, f.pooling.lower(), f"{f.rows} x {f.dim}", f.weight_type.lower(), f.id_policy) for f in m.sparse_features]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    s = m.sharding
    print(f"sharding: {s.num_devices} {s.device} device(s), row alignment {s.row_alignment}, {len(s.shards)} shards")
    print(report_text(m.to_dict()))
    print("checksum: ok (sha256 matches the manifest)")
    worst = self_check(model, args.artifact, m)
    print(f"sample self-check: ok (batch {m.sample.batch_size}, max abs difference {worst:.3g})")
    return 0
