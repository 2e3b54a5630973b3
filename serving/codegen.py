"""Generates the gRPC/protobuf stubs of protos/ into serving/v1/ (run by the build; never hand-edit the output).

    python serving/codegen.py          # what setup.py's build_py does before copying modules
"""

import shutil
import sys
import tempfile
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = "recship/serving/v1"  # the protos' package path; it maps onto serving/v1/
OUT = ROOT / "serving" / "v1"


def generate(out: Path = OUT) -> List[Path]:
    """Compiles every .proto under protos/recship/serving/v1 into ``out``; returns the written files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_ROOT / PACKAGE}")
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [str(p.relative_to(PROTO_ROOT)) for p in protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(str(p) for p in protos)}")
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((Path(tmp) / PACKAGE).iterdir()):
            target = out / f.name
            shutil.copyfile(f, target)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path)
