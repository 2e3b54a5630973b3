"""The id rule: one check and one message (recship.sparse.ids), against a plain-Python reference."""

import random

import torch

from recship.sparse.ids import first_out_of_range, out_of_range_message


def reference(ids, rows):
    below = [i for i in ids if i < 0]
    above = [i for i in ids if i >= rows]
    return min(below) if below else (max(above) if above else None)


def test_first_out_of_range_matches_a_plain_reference_eager_and_scripted():
    rng = random.Random(0)
    scripted = torch.jit.script(first_out_of_range)
    for _ in range(300):
        rows = rng.randint(1, 50)
        ids = [rng.randint(-3, rows + 3) for _ in range(rng.randint(0, 8))]
        for dtype in (torch.int64, torch.int32):
            t = torch.tensor(ids, dtype=dtype)
            assert first_out_of_range(t, rows) == reference(ids, rows) == scripted(t, rows)


def test_one_wording_eager_and_scripted():
    want = "feature 'user': id 7 is out of range [0, 5)"
    assert out_of_range_message("user", 7, 5) == want == torch.jit.script(out_of_range_message)("user", 7, 5)
