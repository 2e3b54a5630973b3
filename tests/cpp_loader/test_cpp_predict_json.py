"""recship_predict's JSON reader refuses what it cannot take as given, in the REST front's words.

A fractional id was truncated (``[[1.5]]`` ran as id 1), a string id or a boolean weight threw a JSON
type error (exit 1), a flat list of ids ran as one id per example. Every value the request gives now
either goes to the model exactly or is refused (exit 2) with the message serving/rest.py gives the
same data as a KServe input (``<feature>.values`` INT64, ``<feature>.weights`` and ``dense`` FP32):
the reference is rest.py's own check, called on the same values.
"""

import json

import pytest

from binaries import run_binary
from recship.export.artifact import Manifest
from recship.serving import rest
from recship.serving.requests import InvalidRequest


@pytest.fixture(scope="module")
def dlrm(small_artifacts):
    return small_artifacts("dlrm", "int8")


@pytest.fixture(scope="module")
def emb(small_artifacts):
    """The weighted EmbeddingBagCollection: features x, y (table a) and z."""
    return small_artifacts("emb", "int8")


def _good(art):
    """A valid two-example request for the artifact (sparse, dense or None, weights or None)."""
    manifest = Manifest.read(art)
    sparse = {f.name: [[1], [2, 0]] for f in manifest.sparse_features}
    dense = [[0.5] * manifest.num_dense, [0.25] * manifest.num_dense] if manifest.num_dense else None
    weights = {n: [[1.0], [0.5, 2.0]] for n in sparse} if manifest.weighted else None
    return sparse, dense, weights


def _run(binary, art, tmp_path, body):
    path = tmp_path / "request.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return run_binary(binary, art, "--request", path)


def _rest_message(name, datatype, data):
    with pytest.raises(InvalidRequest) as refused:
        rest._data(name, datatype, data)
    return str(refused.value)


# (what, KServe input, datatype, the values given in place of the good ones)
IDS = [
    ("fractional id", "INT64", [[1.5], [2]]),
    ("1e30", "INT64", [[1e30], [2]]),
    ("integral float", "INT64", [[1.0], [2]]),
    ("string id", "INT64", [["1"], [2]]),
    ("boolean id", "INT64", [[True], [2]]),
    ("null id", "INT64", [[None], [2]]),
    ("several kinds", "INT64", [[1.5, "x"], [False]]),
    ("past int64", "INT64", [[2**63], [2]]),
]


@pytest.mark.parametrize("what,datatype,ids", IDS, ids=[c[0] for c in IDS])
def test_ids_that_are_not_int64_are_refused_with_the_rest_fronts_message(binary, dlrm, tmp_path, what, datatype, ids):
    sparse, dense, _ = _good(dlrm)
    sparse["cat_3"] = ids
    result = _run(binary, dlrm, tmp_path, {"sparse": sparse, "dense": dense})
    want = _rest_message("cat_3.values", datatype, [i for row in ids for i in row])
    assert (result.returncode, result.stderr.strip()) == (2, f"recship_predict: invalid request: {want}")


@pytest.mark.parametrize("value", [True, "0.5", None])
def test_weights_and_dense_that_are_not_numbers_are_refused_with_the_rest_fronts_message(binary, dlrm, emb, tmp_path, value):
    sparse, _, weights = _good(emb)
    weights["y"] = [[value], [0.5, 2.0]]
    result = _run(binary, emb, tmp_path, {"sparse": sparse, "weights": weights})
    want = _rest_message("y.weights", "FP32", [value, 0.5, 2.0])
    assert (result.returncode, result.stderr.strip()) == (2, f"recship_predict: invalid request: {want}")

    sparse, dense, _ = _good(dlrm)
    dense[1][4] = value
    result = _run(binary, dlrm, tmp_path, {"sparse": sparse, "dense": dense})
    want = _rest_message("dense", "FP32", [x for row in dense for x in row])
    assert (result.returncode, result.stderr.strip()) == (2, f"recship_predict: invalid request: {want}")


def test_a_float_past_float32_is_infinite_and_refused_as_the_server_refuses_it(binary, dlrm, emb, tmp_path):
    """numpy casts 1e39 to float32 inf (REST), and validation refuses it: not a cast with undefined behaviour."""
    sparse, dense, _ = _good(dlrm)
    dense[0][0] = 1e39
    result = _run(binary, dlrm, tmp_path, {"sparse": sparse, "dense": dense})
    assert result.returncode == 2 and "dense values must be finite" in result.stderr, result.stderr
    sparse, _, weights = _good(emb)
    weights["z"] = [[-1e39], [0.5, 2.0]]
    result = _run(binary, emb, tmp_path, {"sparse": sparse, "weights": weights})
    assert result.returncode == 2 and "weights must be finite" in result.stderr, result.stderr


SHAPES = {
    "flat ids": ({"cat_0": [1, 2]}, "sparse feature 'cat_0' must be a list of examples, each a list of ids"),
    "ids not a list": ({"cat_0": 7}, "sparse feature 'cat_0' must be a list of examples, each a list of ids"),
    "flat dense": ({"dense": [0.5] * 13}, '"dense" must be a list of rows, each a list of numbers'),
    "ragged dense": ({"dense": [[0.5, 0.5], [0.5], [0.5, 0.5, 0.5]]},
                     "dense rows must all have the same length: row 0 has 2 values, row 1 has 1"),
    "weights of an unknown feature": ({"weights": {"nope": [[1.0], [1.0]]}}, "weights for 'nope', which \"sparse\" does not have"),
    "a misspelt key": ({"Dense": []}, "unknown key 'Dense' in the request: it takes \"sparse\", \"dense\" and \"weights\""),
}


@pytest.mark.parametrize("what", list(SHAPES))
def test_a_request_of_the_wrong_shape_is_refused_not_reshaped(binary, dlrm, tmp_path, what):
    change, message = SHAPES[what]
    sparse, dense, _ = _good(dlrm)
    body = {"sparse": {**sparse, **{k: v for k, v in change.items() if k.startswith("cat_")}}, "dense": dense}
    body.update({k: v for k, v in change.items() if not k.startswith("cat_")})
    result = _run(binary, dlrm, tmp_path, body)
    assert (result.returncode, result.stderr.strip()) == (2, f"recship_predict: invalid request: {message}")


def test_a_request_that_is_not_json_or_not_an_object_is_an_invalid_request(binary, dlrm, tmp_path):
    result = _run(binary, dlrm, tmp_path, '{"sparse": ')
    assert result.returncode == 2 and result.stderr.startswith("recship_predict: invalid request: the request file ")
    assert "is not JSON" in result.stderr
    for body in ([], {"dense": [[0.5] * 13]}, {"sparse": [[1]]}):
        result = _run(binary, dlrm, tmp_path, body)
        assert (result.returncode, result.stderr.strip()) == (
            2, 'recship_predict: invalid request: the request must be a JSON object with a "sparse" object')


def test_a_valid_request_still_runs_and_integral_ids_past_int32_reach_validation(binary, dlrm, tmp_path):
    sparse, dense, _ = _good(dlrm)
    result = _run(binary, dlrm, tmp_path, {"sparse": sparse, "dense": dense})
    assert result.returncode == 0, result.stderr
    assert sorted(json.loads(result.stdout)) == ["logit", "prob"]
    sparse["cat_0"] = [[2**40], [0]]
    result = _run(binary, dlrm, tmp_path, {"sparse": sparse, "dense": dense})
    assert result.returncode == 2 and f"id {2**40} is out of range" in result.stderr, result.stderr


@pytest.mark.parametrize("flag,value", [("--bench", "x"), ("--bench", "-1"), ("--threads", "2.5"), ("--threads", "99999999999"),
                                        ("--max-batch-size", "0"), ("--max-batch-size", "")])
def test_a_bad_number_for_a_flag_exits_2_with_a_message(binary, dlrm, flag, value):
    """std::stoi threw past main (abort, exit 134) or took '2.5' as 2."""
    result = run_binary(binary, dlrm, flag, value)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.startswith(f"recship_predict: error: {flag} takes a whole number from "), result.stderr


def test_a_request_file_that_cannot_be_read_is_exit_2_naming_it_before_the_model_loads(binary, tmp_path):
    missing = tmp_path / "nope.json"
    # the artifact does not exist either: the request file is read first
    result = run_binary(binary, tmp_path / "no-artifact", "--request", missing)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"recship_predict: invalid request: the request file {missing} cannot be read: No such file")
    folder = tmp_path / "a-folder.json"
    folder.mkdir()
    result = run_binary(binary, tmp_path / "no-artifact", "--request", folder)
    assert result.returncode == 2 and f"the request file {folder}" in result.stderr, result.stderr
