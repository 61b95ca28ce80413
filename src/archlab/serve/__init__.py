"""The OpenAI-compatible server: `archlab serve RUN_OR_HF_FOLDER`. Needs the `serve` extra."""
from archlab.serve.engine import CompletionRequest, Engine, RequestError
from archlab.serve.limits import Limits

__all__ = ["Engine", "CompletionRequest", "Limits", "RequestError", "create_app"]


def create_app(engine: Engine, limits: Limits | None = None):
    """The FastAPI app over `engine` under `limits` (imports FastAPI only when asked)."""
    from archlab.serve.app import create_app as build
    return build(engine, limits)
