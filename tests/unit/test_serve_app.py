"""``pkb serve``'s app without a server (issue 27): a failure of the service itself is a 500 that names it,
with its traceback in the server's log. The server as a user starts it: tests/integration/test_serve.py.
"""

from __future__ import annotations

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
