"""One table of bad requests that every front refuses with the same words.

The fronts are recship's gRPC Predict, KServe v2 over gRPC and over REST, and the C++
``recship_predict``. The reference message is what ``serving.requests.validate`` (the
server's rule) says for the request: every front must answer exactly that, so a change
to the rules or their wording in one place shows up in the others' tests.
"""

from typing import Dict, List, Optional, Tuple

Sparse = Dict[str, List[List[int]]]
Case = Tuple[str, Sparse, List[List[float]], Optional[Dict[str, List[List[float]]]]]


def bad_requests(rows: List[int], num_dense: int) -> List[Case]:
    """(what is wrong, sparse, dense, weights) for a two-example request to a DLRM whose
    features are cat_0 .. cat_<n-1> with ``rows`` rows each (ids may reach rows - 1)."""
    names = [f"cat_{i}" for i in range(len(rows))]
    good = {name: [[1], [2]] for name in names}
    dense = [[0.5] * num_dense, [0.25] * num_dense]
    return [
        ("id one past its table", {**good, names[3]: [[1], [rows[3]]]}, dense, None),
        ("negative id", {**good, names[1]: [[-1], [2]]}, dense, None),
        ("far too large id", {**good, names[0]: [[2**40], [0]]}, dense, None),
        ("missing feature", {n: v for n, v in good.items() if n != names[-1]}, dense, None),
        ("unknown feature", {**good, "nope": [[1], [1]]}, dense, None),
        ("dense too narrow", good, [row[:-1] for row in dense], None),
        ("weights for an unweighted model", good, dense, {names[0]: [[1.0], [1.0]]}),
    ]
