"""The uvicorn server `archlab serve` runs: uvicorn's, plus one step when it starts stopping: the app's requests
whose body is still arriving are answered 503 at once (archlab.serve.app), so a client holding a half-sent body
does not keep a stopping server up for the whole graceful-shutdown timeout; requests already generating still
get that timeout to finish.
"""
from __future__ import annotations

import socket
from typing import Any

import uvicorn

__all__ = ["Server", "make_server"]


class Server(uvicorn.Server):
    """uvicorn.Server that tells the app it is stopping before it waits for open requests."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stopping = getattr(getattr(self.config.app, "state", None), "stopping", None)
        if stopping is not None:
            stopping.set()                 # on the server's loop: the readers waiting on it wake now
        await super().shutdown(sockets)


def make_server(app: Any, **config: Any) -> Server:
    """A Server for `app` with uvicorn.Config's keywords.
    Example: make_server(create_app(engine), host="127.0.0.1", port=8000, timeout_graceful_shutdown=10).run()"""
    return Server(uvicorn.Config(app, **config))
