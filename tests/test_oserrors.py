"""A failed file operation in train, export or serve is one line on stderr naming the file, the cause and what was
being done, exit code 2, and nothing left behind (recship/oserrors.py, recship/cli.py).

Full disks are small tmpfs mounts (root only: skipped elsewhere); permission errors are read-only folders, which
root reads and writes anyway, so as root the command runs without CAP_DAC_OVERRIDE (``setpriv``)."""

import errno
import math
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from recship.oserrors import doing, label, mount_point, no_space, one_line

TRAIN = ["--steps", "2", "--batch-size", "16", "--num-embeddings-per-feature", "2000", "--embedding-dim", "16",
         "--dense-arch", "8", "--over-arch", "8", "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0",
         "--no-plot"]
EXPORT = ["--format", "torchscript", "--no-progress", "--no-plot"]
PAGE = 4096


def _recship(*args, unprivileged=False, timeout=300):
    """``recship ARGS`` in a subprocess; ``unprivileged``: as root, without the capabilities that skip file modes."""
    prefix = []
    if unprivileged and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: a read-only folder cannot be made to refuse root")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    return subprocess.run([*prefix, sys.executable, "-m", "recship.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "default"})


def _one_error_line(done, command):
    """The single stderr line of a failed command (exit 2); fails showing stderr otherwise."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"recship {command}: error: "), \
        f"exit {done.returncode}, stderr:\n{done.stderr}"
    return lines[0]


def _kib(n):
    return f"{n / 1024:.1f} KiB"


@pytest.fixture
def small_disk(tmp_path):
    """``make(bytes)``: a tmpfs of that size (whole pages), unmounted after the test."""
    mounted = []

    def make(size):
        if os.geteuid() != 0:
            pytest.skip("a small file system needs root (mount -t tmpfs)")
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


@pytest.fixture
def read_only(tmp_path):
    where = tmp_path / "read-only"
    where.mkdir()
    where.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    yield where
    where.chmod(0o755)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained run's checkpoint and the sizes of its artifact's files, exported to a roomy disk."""
    root = tmp_path_factory.mktemp("oserrors")
    done = _recship("train", "--out", str(root / "run"), *TRAIN)
    assert done.returncode == 0, done.stderr
    checkpoint = root / "run" / "checkpoints" / "step_00000002"
    done = _recship("export", str(checkpoint), "--out", str(root / "art"), *EXPORT)
    assert done.returncode == 0, done.stderr
    sizes = {p.relative_to(root / "art").as_posix(): p.stat().st_size for p in (root / "art").rglob("*") if p.is_file()}
    return checkpoint, sizes


def _pages(n):
    return math.ceil(n / PAGE)


# -- export ------------------------------------------------------------------------------------------------------------

def test_export_whose_tables_do_not_fit_names_the_disk_and_the_bytes(run, small_disk):
    checkpoint, sizes = run
    disk = small_disk("512k")
    line = _one_error_line(_recship("export", str(checkpoint), "--out", str(disk / "art"), *EXPORT), "export")
    staging = rf"{re.escape(str(disk))}/\.art\.tmp-\d+-[0-9a-f]{{8}}"
    assert re.fullmatch(rf"recship export: error: {staging}/tables\.bin: No space left on device: "
                        rf"{re.escape(_kib(sizes['tables.bin']))} needed, 512\.0 KiB free on {re.escape(str(disk))} "
                        r"\(quantizing the tables into it\)", line), line
    assert "validation" not in line
    assert os.listdir(disk) == []  # no staging folder, no artifact


def test_export_into_a_new_model_repository_on_a_full_disk_leaves_no_folder(run, small_disk):
    checkpoint, sizes = run
    disk = small_disk("512k")
    done = _recship("export", str(checkpoint), "--model-repo", str(disk / "repo" / "models"), "--model-name", "m", *EXPORT)
    line = _one_error_line(done, "export")
    assert re.fullmatch(rf"recship export: error: {re.escape(str(disk))}/repo/models/m/\.version\.tmp-\d+-[0-9a-f]{{8}}/tables\.bin: "
                        rf"No space left on device: {re.escape(_kib(sizes['tables.bin']))} needed, 512\.0 KiB free on "
                        rf"{re.escape(str(disk))} \(quantizing the tables into it\)", line), line
    assert os.listdir(disk) == []  # neither the staging folder nor the repository's folders it made


def test_export_into_a_disk_that_fills_after_the_tables_says_which_file(run, small_disk):
    checkpoint, sizes = run
    disk = small_disk(str((_pages(sizes["tables.bin"]) + 2) * PAGE))  # tables.bin fits, model.pt does not
    line = _one_error_line(_recship("export", str(checkpoint), "--out", str(disk / "art"), *EXPORT), "export")
    staging = rf"{re.escape(str(disk))}/\.art\.tmp-\d+-[0-9a-f]{{8}}"
    assert re.fullmatch(rf"recship export: error: {staging}/model\.pt: No space left on device: "
                        rf"{re.escape(_kib(sizes['model.pt']))} needed, [0-9.]+ (B|KiB) free on {re.escape(str(disk))} "
                        r"\(writing model\.pt\)", line), line
    assert os.listdir(disk) == []


def test_export_into_a_disk_that_fills_at_model_pt2_says_so(run, small_disk):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("model.pt2 needs a C++ compiler (AOTInductor)")
    checkpoint, sizes = run
    disk = small_disk(str((_pages(sizes["tables.bin"]) + 8) * PAGE))  # the quantized tables fit, the compiled package not
    line = _one_error_line(_recship("export", str(checkpoint), "--out", str(disk / "art"), "--format", "aoti", "--no-progress",
                                    "--no-plot"), "export")
    assert re.fullmatch(rf"recship export: error: {re.escape(str(disk))}/\.art\.tmp-\d+-[0-9a-f]{{8}}/model\.pt2: No space left on "
                        rf"device: [0-9.]+ MiB needed, [0-9.]+ (B|KiB) free on {re.escape(str(disk))} \(writing model\.pt2\)",
                        line), line
    assert os.listdir(disk) == []


def test_export_into_a_disk_that_fills_at_the_manifest_says_so(run, small_disk):
    checkpoint, sizes = run
    before = sum(_pages(n) for name, n in sizes.items() if name != "manifest.json")
    assert _pages(sizes["manifest.json"]) > 1
    disk = small_disk(str((before + 1) * PAGE))  # all but the manifest fits
    line = _one_error_line(_recship("export", str(checkpoint), "--out", str(disk / "art"), *EXPORT), "export")
    assert re.fullmatch(rf"recship export: error: {re.escape(str(disk))}/\.art\.tmp-\d+-[0-9a-f]{{8}}/manifest\.json: "
                        r"No space left on device \(writing manifest\.json\)", line), line
    assert os.listdir(disk) == []


def test_export_into_a_read_only_folder(run, read_only):
    checkpoint, _ = run
    line = _one_error_line(_recship("export", str(checkpoint), "--out", str(read_only / "art"), *EXPORT, unprivileged=True), "export")
    assert re.fullmatch(rf"recship export: error: {re.escape(str(read_only))}/\.art\.tmp-\d+-[0-9a-f]{{8}}: Permission denied "
                        r"\(creating the export's staging folder\)", line), line
    assert os.listdir(read_only) == []


def test_export_of_a_missing_checkpoint_keeps_its_words(tmp_path):
    line = _one_error_line(_recship("export", str(tmp_path / "nope"), "--out", str(tmp_path / "art"), *EXPORT), "export")
    assert line == f"recship export: error: checkpoint not found: {tmp_path / 'nope'}"


# -- train -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nproc", [1, 2])
def test_train_whose_checkpoint_does_not_fit_leaves_no_partial_checkpoint(small_disk, nproc):
    disk = small_disk("256k")
    line = _one_error_line(_recship("train", "--out", str(disk / "run"), "--nproc-per-node", str(nproc), *TRAIN), "train")
    # 26 tables x 2000 x 16 float32, their optimizer state and the dense layers: more than the tables' 3.2 MiB to write,
    # split between the ranks (each rank checks its own part)
    m = re.fullmatch(rf"recship train: error: {re.escape(str(disk))}/run/checkpoints/step_00000002\.tmp-[0-9a-f]{{8}}: "
                     rf"No space left on device: ([0-9.]+) MiB needed, [0-9.]+ KiB free on {re.escape(str(disk))} "
                     r"\(saving checkpoint step_00000002\)", line)
    assert m, line
    assert float(m.group(1)) > 26 * 2000 * 16 * 4 / 2**20 / nproc
    assert os.listdir(disk / "run" / "checkpoints") == []  # the temporary folder is gone


def test_train_into_a_read_only_folder(read_only):
    line = _one_error_line(_recship("train", "--out", str(read_only / "run"), *TRAIN, unprivileged=True), "train")
    assert line == f"recship train: error: {read_only / 'run'}: Permission denied (training)"


# -- serve -------------------------------------------------------------------------------------------------------------

def test_serve_of_an_unreadable_repository(tmp_path):
    repo = tmp_path / "repo"
    (repo / "model").mkdir(parents=True)
    repo.chmod(0)
    try:
        done = _recship("serve", "--model-repo", str(repo), "--port", "0", unprivileged=True, timeout=120)
    finally:
        repo.chmod(0o755)
    line = _one_error_line(done, "serve")
    assert line == f"recship serve: error: {repo / 'manifest.json'}: Permission denied (reading the model repository)"


def test_serve_with_an_unreadable_allow_list(tmp_path):
    (tmp_path / "repo").mkdir()
    trusted = tmp_path / "trusted.txt"
    trusted.write_text("# none\n")
    trusted.chmod(0)
    done = _recship("serve", "--model-repo", str(tmp_path / "repo"), "--port", "0", "--trusted-sha256", str(trusted),
                    unprivileged=True, timeout=120)
    line = _one_error_line(done, "serve")
    assert line == f"recship serve: error: {trusted}: Permission denied (reading --trusted-sha256)"


# -- the line itself ---------------------------------------------------------------------------------------------------

def test_one_line_names_the_file_the_cause_and_what_was_done(tmp_path):
    with pytest.raises(OSError) as raised:
        with doing("reading the thing", tmp_path / "fallback"):
            with doing("opening it"):  # the innermost label wins
                open(tmp_path / "missing")
    assert one_line(raised.value) == f"{tmp_path / 'missing'}: {os.strerror(errno.ENOENT)} (opening it)"
    # an error without a file takes the labelled path
    e = label(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "writing", tmp_path / "f")
    assert one_line(e) == f"{tmp_path / 'f'}: {os.strerror(errno.ENOSPC)} (writing)"
    # a rename names both files
    assert one_line(OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")) == "/a -> /b: Invalid cross-device link"
    # a message alone stays as it was written, labelled or not
    assert one_line(label(FileNotFoundError("checkpoint not found: x"), "loading", "/p")) == "checkpoint not found: x"


def test_no_space_measures_the_file_system(tmp_path):
    e = no_space(tmp_path / "file", 3 * 2**20 + 2**19)
    stats = os.statvfs(tmp_path)
    assert (e.errno, e.filename) == (errno.ENOSPC, str(tmp_path / "file"))
    assert e.strerror == f"{os.strerror(errno.ENOSPC)}: 3.5 MiB needed, {_free(stats.f_bavail * stats.f_frsize)} free on {mount_point(tmp_path)}"
    assert os.path.ismount(mount_point(tmp_path)) and Path(tmp_path).resolve().is_relative_to(mount_point(tmp_path))


def _free(n):
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
