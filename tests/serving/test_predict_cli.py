"""`recship predict` as a user runs it: a request on standard input, the version that answered, a timeout, and TLS
(mutual) against a server started with --tls-cert / --tls-client-ca; answers equal the artifact in process."""

import io
import json

import numpy as np
import pytest

from recship.cli import main
from recship.export.artifact import open_artifact
from recship.serving.server import Server, ServerConfig

from model_requests import dlrm_request, in_process, model_repo


@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    return model_repo(tmp_path_factory.mktemp("predict") / "repo", {"dlrm": small_artifact})


def _request(seed):
    sparse, dense = dlrm_request(3, seed)
    return sparse, dense, json.dumps({"sparse": sparse, "dense": dense.tolist()})


def test_a_request_on_stdin_answers_as_in_process_and_names_the_version(repo, monkeypatch, capsys):
    sparse, dense, body = _request(1)
    want = in_process(open_artifact(repo / "dlrm" / "1")[0], sparse, dense)
    server = Server(ServerConfig(model_repo=str(repo), port=0))
    try:
        monkeypatch.setattr("sys.stdin", io.StringIO(body))
        assert main(["predict", "--target", f"127.0.0.1:{server.port}", "--model-name", "dlrm", "--request", "-", "--timeout", "30"]) == 0
        out, err = capsys.readouterr()
        got = json.loads(out)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32), want[k])
        assert err.strip() == "recship predict: dlrm version 1 answered"
        monkeypatch.setattr("sys.stdin", io.StringIO("{not json"))
        assert main(["predict", "--target", f"127.0.0.1:{server.port}", "--model-name", "dlrm", "--request", "-"]) == 2
        assert "the request file <stdin> is not JSON" in capsys.readouterr().err
        monkeypatch.setattr("sys.stdin", io.StringIO(body))
        assert main(["predict", "--target", f"127.0.0.1:{server.port}", "--model-name", "dlrm", "--request", "-", "--timeout", "0"]) == 2
        assert "--timeout must be > 0 seconds, got 0" in capsys.readouterr().err
    finally:
        server.stop()


def test_tls_flags_reach_a_tls_server_and_plaintext_does_not(repo, tmp_path, capsys):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("client")
    files = {}
    for name, blob in [("cert", b"".join(p.bytes() for p in cert.cert_chain_pems)), ("key", cert.private_key_pem.bytes()),
                       ("ca", ca.cert_pem.bytes()), ("client", b"".join(p.bytes() for p in client.cert_chain_pems)),
                       ("client_key", client.private_key_pem.bytes())]:
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(blob)
    sparse, dense, body = _request(2)
    (tmp_path / "r.json").write_text(body)
    want = in_process(open_artifact(repo / "dlrm" / "1")[0], sparse, dense)
    server = Server(ServerConfig(model_repo=str(repo), port=0, tls_cert=str(files["cert"]), tls_key=str(files["key"]),
                                 tls_client_ca=str(files["ca"]), reflection=False))
    try:
        base = ["predict", "--target", f"localhost:{server.port}", "--model-name", "dlrm", "--request", str(tmp_path / "r.json"),
                "--timeout", "5"]
        assert main([*base, "--tls-ca", str(files["ca"]), "--tls-cert", str(files["client"]), "--tls-key", str(files["client_key"])]) == 0
        out, err = capsys.readouterr()
        np.testing.assert_array_equal(np.asarray(json.loads(out)["prob"], dtype=np.float32), want["prob"])
        assert main(base) == 2  # plaintext to a TLS server
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert main([*base, "--tls-ca", str(files["ca"])]) == 2  # no client certificate: mutual TLS refuses it
        assert capsys.readouterr().err.startswith("recship predict: error: UNAVAILABLE")
        assert main([*base, "--tls-cert", str(files["client"])]) == 2
        assert "--tls-cert and --tls-key need --tls-ca" in capsys.readouterr().err
    finally:
        server.stop()
