"""Where a model folder keeps its chat template: a run folder in tokenizer/, a Hugging Face folder beside its
tokenizer.json (chat_template.jinja, or tokenizer_config.json's chat_template). `archlab chat` and
`archlab serve` read it here; `archlab tokenizer chat-template DIR` writes one into the folder `tokenizer_dir`
names."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from archlab.tokenizer.chat import ChatTokenizer, read_chat_templates, read_special_tokens

__all__ = ["chat_tokenizer", "has_chat_template", "tokenizer_dir"]


def tokenizer_dir(folder: str | Path) -> Path:
    """The folder holding the model's tokenizer files: tokenizer/ of a run folder, else the folder itself."""
    folder = Path(folder)
    return folder / "tokenizer" if (folder / "config.yaml").is_file() else folder


def _template_dirs(folder: Path) -> list[Path]:
    return [d for d in (folder / "tokenizer", folder) if d.is_dir()]


def has_chat_template(folder: str | Path) -> bool:
    """Whether the folder (or its tokenizer/) holds a chat template; read as files, before any weights load."""
    return any(read_chat_templates(d) for d in _template_dirs(Path(folder)))


def chat_tokenizer(folder: str | Path, tokenizer: Any) -> ChatTokenizer | None:
    """`tokenizer` with the folder's chat template(s) and the special tokens they read, or None without one."""
    for tok_dir in _template_dirs(Path(folder)):
        templates = read_chat_templates(tok_dir)
        if templates:
            return ChatTokenizer(tokenizer, templates, read_special_tokens(tok_dir))
    return None
