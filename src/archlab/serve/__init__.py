"""The OpenAI-compatible server: `archlab serve RUN_OR_HF_FOLDER`. Needs the `serve` extra."""
from archlab.serve.engine import CompletionRequest, Engine, RequestError

__all__ = ["Engine", "CompletionRequest", "RequestError", "create_app"]


def create_app(engine: Engine):
    """The FastAPI app over `engine` (imports FastAPI only when asked)."""
    from archlab.serve.app import create_app as build
    return build(engine)
