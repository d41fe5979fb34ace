"""A sandboxed rank's side of the build broker (pkb.runtime.builds): extensions that the parent built,
loaded from a cache the candidate can read but not write.

A rank's start-up sets ``pkb.kernels.build.BROKER`` to a ``BrokerClient`` on its channel, so that
``load_cuda`` (and upstream's ``compile_cuda_extension``) ask the parent instead of building in place.
"""

from __future__ import annotations

from pathlib import Path

from pkb.kernels.build import BuildError, cached_library, extension_name, import_extension
from pkb.runtime.channel import recv_job, send_reply
from pkb.runtime.messages import BuildRequest


class BrokerClient:
    """A cached build loads without asking; otherwise the request goes to the parent over the rank's
    channel and the rank waits for the answer (the path of the library the broker cached)."""

    def __init__(self, conn, cache_root: str):
        self.conn = conn
        self.cache_root = Path(cache_root)
        self._send, self._receive = send_reply, recv_job  # bound now: the candidate may not import the harness

    def load(self, request: dict):
        full_name = extension_name(request)
        library = cached_library(self.cache_root, full_name)
        if not library.is_file():
            self._send(self.conn, BuildRequest(build=request))
            answer = self._receive(self.conn)
            if answer.get("error"):
                raise BuildError(answer["error"])
            library = Path(answer["path"])
        return import_extension(full_name, library)
