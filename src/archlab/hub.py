"""The Hugging Face hub, reached only where a user names it (`hf:` ids), never running remote code.

One wording for every "cannot get it" case, so `data prepare --corpus hf:NAME` and (later) model ids
say the same thing: the id, the reason in one line, and what to do without a network.
"""
from __future__ import annotations

from archlab.errors import UserError

__all__ = ["HubError", "hub_offline", "probe_dataset", "unreachable"]


class HubError(UserError):
    """An hf: id that cannot be resolved or downloaded."""


def hub_offline() -> bool:
    """Whether the user asked for the local cache only (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    import os
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def unreachable(spec: str, exc: BaseException) -> HubError:
    """The one message for an hf: id that could not be had."""
    reason = " ".join(str(exc).split())[:300] or type(exc).__name__
    where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if hub_offline() else "the Hugging Face hub"
    return HubError(f"{spec}: not available from {where}: {reason}. Without a network, set HF_HUB_OFFLINE=1 to "
                    "use what is already in the local cache, or pass a local folder or file instead")


def probe_dataset(spec: str, name: str, timeout: float = 10.0) -> None:
    """One request, no retry loop: an unreachable hub or a missing dataset fails in about a second
    (the `datasets` library retries for ~25 s first). Skipped when offline."""
    if hub_offline():
        return
    from huggingface_hub import HfApi
    try:
        HfApi().dataset_info(name, timeout=timeout)
    except Exception as exc:  # connection errors, 404s and auth errors all mean "not from the hub"
        raise unreachable(spec, exc) from exc
