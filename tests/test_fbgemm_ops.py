"""``import recship`` makes ``torch.ops.fbgemm.*`` usable as ``import torchrec`` does (recship/fbgemm.py), while
``import recship`` itself loads neither torch nor fbgemm_gpu. Each case runs in a fresh interpreter, since a
process that already imported fbgemm_gpu has the operators whatever recship does."""

import json
import subprocess
import sys
import textwrap

import pytest

# user code as TorchRec users write it; checked against plain torch on random jagged inputs (fixed seed)
USER_CODE = """
import json, sys
{imports}
before = "fbgemm_gpu" in sys.modules
g = torch.Generator().manual_seed(7)
lengths = torch.randint(0, 5, (9,), generator=g)
offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
values = torch.randn(int(lengths.sum()), 3, generator=g)
dense = torch.ops.fbgemm.jagged_2d_to_dense(values, offsets, 4)
ref_offsets = torch.cat([torch.zeros(1, dtype=lengths.dtype), torch.cumsum(lengths, 0)])
ref = torch.zeros(9, 4, 3)
for b in range(9):
    n = min(int(lengths[b]), 4)
    ref[b, :n] = values[int(ref_offsets[b]):int(ref_offsets[b]) + n]
def cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.fbgemm.asynchronous_complete_cumsum(x)
scripted = torch.jit.script(cumsum)
try:
    torch.ops.fbgemm.no_such_operator
    missing = "no error"
except AttributeError as e:
    missing = str(e)
print(json.dumps({{"before": before, "after": "fbgemm_gpu" in sys.modules,
                  "offsets": torch.equal(offsets, ref_offsets), "dense": torch.equal(dense, ref),
                  "scripted": torch.equal(scripted(lengths), ref_offsets), "missing": missing}}))
"""


def _run(code: str, tmp_path) -> dict:
    script = tmp_path / "user_code.py"  # a file: TorchScript reads the function's source
    script.write_text(textwrap.dedent(code))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("imports", ["import torch\nimport recship as torchrec", "import recship as torchrec\nimport torch",
                                     "import recship.sparse\nimport torch"])
def test_fbgemm_operators_work_after_import_recship(imports, tmp_path):
    got = _run(USER_CODE.format(imports=imports), tmp_path)
    assert got["before"] is False  # not loaded by the import itself
    assert got["offsets"] and got["dense"] and got["scripted"]
    assert got["after"] is True
    assert "no_such_operator" in got["missing"]


def test_without_recship_torch_has_no_fbgemm_operators(tmp_path):
    """The check above can fail: plain torch does not have them."""
    got = _run("""
        import json, torch
        try:
            torch.ops.fbgemm.asynchronous_complete_cumsum
            print(json.dumps({"found": True}))
        except AttributeError:
            print(json.dumps({"found": False}))
    """, tmp_path)
    assert got == {"found": False}


def test_import_recship_loads_neither_torch_nor_fbgemm(tmp_path):
    got = _run("""
        import json, sys
        import recship
        print(json.dumps({"torch": "torch" in sys.modules, "fbgemm_gpu": "fbgemm_gpu" in sys.modules}))
    """, tmp_path)
    assert got == {"torch": False, "fbgemm_gpu": False}
