"""The Hugging Face hub, reached only where a user names it (`hf:` ids), never running remote code.

One wording for every "cannot get it" case, so `data prepare --corpus hf:NAME` and (later) model ids
say the same thing: the id, the reason in one line, and what to do without a network.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from archlab.errors import UserError

__all__ = ["HubError", "hub_offline", "offline_as_asked", "probe_dataset", "unreachable", "resolve_model",
           "parse_model_id"]


class HubError(UserError):
    """An hf: id that cannot be resolved or downloaded."""


def hub_offline() -> bool:
    """Whether the user asked for the local cache only (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


@contextlib.contextmanager
def offline_as_asked():
    """HF_HUB_OFFLINE honoured as it is now: huggingface_hub and datasets read it once, at import, so a process
    that imported them before the variable was set (a notebook, a test run) would still try the network and
    retry for ~25 s. While offline is asked for, their flags say so; restored on the way out."""
    if not hub_offline():
        yield
        return
    import huggingface_hub.constants as hub_constants
    flags = [hub_constants]
    with contextlib.suppress(ImportError):
        import datasets.config
        flags.append(datasets.config)
    before = [module.HF_HUB_OFFLINE for module in flags]
    try:
        for module in flags:
            module.HF_HUB_OFFLINE = True
        yield
    finally:
        for module, value in zip(flags, before):
            module.HF_HUB_OFFLINE = value


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


# ---- model ids ------------------------------------------------------------------------------------
MODEL_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "chat_template.jinja",
               "additional_chat_templates/*.jinja"]     # never *.py (remote code), *.bin / *.pt (pickles)


def parse_model_id(spec: str) -> tuple[str, str | None]:
    """`hf:ORG/NAME[@REVISION]` -> (repo id, revision or None); HubError for a malformed id."""
    body = spec[len("hf:"):]
    repo, _, revision = body.partition("@")
    if repo.count("/") > 1 or not repo or repo.startswith("/") or repo.endswith("/") or (_ and not revision):
        raise HubError(f"{spec}: expected hf:ORG/NAME[@REVISION]")
    return repo, revision or None


def resolve_model(path_or_id: str | os.PathLike) -> Path:
    """A local model folder for `path_or_id`: a path as is, or an `hf:ORG/NAME[@REVISION]` snapshot from the
    hub (cached by huggingface_hub; with HF_HUB_OFFLINE=1 from the cache only) holding safetensors, configs
    and tokenizer files only: no code, no pickles.
    Example: resolve_model("hf:Qwen/Qwen2.5-0.5B@main")"""
    text = os.fspath(path_or_id)
    if not text.startswith("hf:"):
        return Path(text)
    repo, revision = parse_model_id(text)
    from huggingface_hub import snapshot_download
    try:
        # the environment read now, not when huggingface_hub was first imported
        folder = snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None, local_files_only=hub_offline())
    except Exception as exc:  # offline, missing repo or revision, auth: all "not available"
        raise unreachable(text, exc) from exc
    return Path(folder)
