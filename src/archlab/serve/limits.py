"""What one request may cost the server before it is refused, and how long a stopping server waits.

A request body past `max_body_bytes` is a 413 (declared or counted as it arrives), one that has not arrived
after `body_timeout_s` a 408, a chat template still rendering after `render_timeout_s` a 400; `max_n` bounds
the choices of one request; `shutdown_timeout_s` is how long SIGTERM waits for open requests (uvicorn's
timeout_graceful_shutdown) before it cancels them: a client holding a half-sent body cannot keep the server up.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limits"]

MB = 2 ** 20


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * MB
    body_timeout_s: float = 30.0
    render_timeout_s: float = 5.0
    max_n: int = 16
    shutdown_timeout_s: float = 10.0
