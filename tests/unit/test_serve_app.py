"""``pkb serve``'s app without a server: a failure of the service itself is a 500 that names it, with its
traceback in the server's log (issue 27); a request the client must change is a 400 that says what, and a service
that cannot store its verdicts refuses to start (issue 49). The server as a user starts it:
tests/integration/test_serve.py.
"""

from __future__ import annotations

import pytest

from helpers.sources import ALLGATHER

CORRECT = ALLGATHER.format(tail="")


def test_a_failure_of_the_server_itself_is_a_500_that_names_it(capsys):
    from starlette.testclient import TestClient

    from pkb.serve.app import create_app

    class Broken:
        def submit(self, request):
            raise OSError("No space left on device")

    response = TestClient(create_app(Broken()), raise_server_exceptions=False).post(
        "/v1/evaluations", json={"problem": "allgather", "source": CORRECT})
    assert response.status_code == 500
    assert response.json()["error"].startswith("pkb serve failed: OSError: No space left on device")
    assert "Traceback" in capsys.readouterr().err  # in the server's log


def test_a_request_the_service_cannot_run_as_asked_is_a_400_that_says_what_to_change(tmp_path):
    """A body that is not UTF-8, a Content-Length that is no number, an option out of its range and ``nodes`` that
    do not divide ``world_size`` are the client's to change: 400, never 500. No evaluation starts."""
    from starlette.testclient import TestClient

    from pkb.executor import LocalExecutor
    from pkb.serve.app import create_app
    from pkb.serve.service import EvaluationService

    service = EvaluationService(LocalExecutor(), tmp_path / "r.sqlite")
    try:
        client = TestClient(create_app(service), raise_server_exceptions=False)
        answers = [
            (client.post("/v1/evaluations", content=b'{"problem": "allgather", "source": "\xff\xfe"}'),
             "the body is not UTF-8 text"),
            (client.post("/v1/evaluations", content=b"{}", headers={"content-length": "lots"}), "Content-Length"),
            (client.post("/v1/evaluations", json={"problem": "allgather", "source": CORRECT, "timeout": 0}),
             "`timeout` must be from 1 to 3600, got 0"),
            (client.post("/v1/evaluations", json={"problem": "allgather", "source": CORRECT, "world_size": 4,
                                                  "nodes": 3}), "4 ranks do not split into 3 nodes of equal size"),
        ]
        for response, said in answers:
            assert response.status_code == 400 and said in response.json()["error"], response.text
        assert service.health()["queued_or_running"] == 0
    finally:
        service.close()


def test_a_service_that_cannot_store_its_verdicts_refuses_to_start(tmp_path):
    from pkb.executor import LocalExecutor
    from pkb.serve.service import EvaluationService
    from pkb.store.db import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="is a directory"):
        EvaluationService(LocalExecutor(), tmp_path)
    assert list(tmp_path.iterdir()) == []
