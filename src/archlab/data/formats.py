"""The data formats a `--data` path can hold, in one registry: how each is recognised (a prepared folder by its
meta.json "format", a .jsonl file by the fields of its lines) and what it prepares into. Which formats a training
method reads is the method's own `data_formats` (training/methods); everything that decides what a path is asks
`detect` here instead of testing is_file / suffix / isinstance itself.

    found = detect(Path("prefs.jsonl"))        # Found(format="preference_pairs", folder=False)
    FORMATS.get(found.format).summary          # "preference pairs"
    require(Path("prefs.jsonl"), ("chat_examples",), who="--method sft")   # UserError: names both

The six formats: token_stream (archlab data prepare), seq2seq_pairs (source -> target for encoder-decoders,
`archlab data prepare --seq2seq`), chat_examples (messages, or prompt and completion), preference_pairs (chosen and
rejected, a prompt optional), unpaired_preferences (TRL's prompt, completion and a true/false label, what KTO reads),
prompts (a prompt and other columns, no completion). A prepared preference folder holds either preference form: it
detects as preference_pairs (unpaired_preferences has no folder format of its own), and data/preference.py reads
which its lines are.

A prepared folder describes itself in META_FILE; `load_meta` reads it for every reader (data/tokens.py re-exports
both), refusing a folder of another format with the words and the reader its DataFormat names.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.errors import DataError, UserError
from archlab.nn.registry import Registry

__all__ = ["DataFormat", "FORMATS", "Found", "detect", "line_format", "require", "describe", "by_folder_format",
           "load_meta", "META_FILE"]

META_FILE = "meta.json"     # a prepared data folder's description; its "format" names the folder's DataFormat


@dataclass(frozen=True)
class DataFormat:
    """One data format: its name, what it is in a few words (errors name it so), the meta.json "format" of its
    prepared folder (None: it has none), the fields a .jsonl line of it has (each tuple one accepted shape; ():
    no line form), the fields that mark a line as this format's (any one: the first format in FORMATS with a marker
    the line holds; so a line missing a field reaches the method's reader, which names it), what it prepares
    into, and for a prepared folder: what it is in words and what reads it (a folder handed to another reader's
    load_meta is refused with both, archlab.data.tokens)."""

    name: str
    summary: str
    folder_format: str | None
    line_shapes: tuple[tuple[str, ...], ...] = ()
    markers: tuple[str, ...] = ()
    prepares_into: str = ""
    folder_summary: str = ""
    reader: str = ""

    def shapes(self) -> str:
        """The line shapes in words: "messages or prompt+completion"."""
        return " or ".join("+".join(shape) for shape in self.line_shapes)


FORMATS: Registry[DataFormat] = Registry("data format")

# Checked in registration order: the first format with a field of the line is the line's (preference and chat lines
# may hold a prompt, so they come before prompts; an unpaired preference holds a completion, so it comes before chat
# examples; a prompts line may hold any other column, so seq2seq comes last).
for _format in (
    DataFormat("token_stream", "a token stream", "archlab-tokens", (), (),
               "memmap token files (archlab data prepare --corpus)",
               "a token-stream folder", "archlab.data.tokens.TokenDataset"),
    DataFormat("preference_pairs", "preference pairs", "preference", (("chosen", "rejected"),), ("chosen", "rejected"),
               "a preference folder (archlab finetune --method dpo|reward)",
               "a folder of preference pairs (archlab finetune)",
               "archlab.data.preference_folder.open_preference_folder"),
    DataFormat("unpaired_preferences", "unpaired preferences", None, (("prompt", "completion", "label"),),
               ("label",), "a preference folder (archlab finetune --method dpo --set train.dpo.loss=kto), which "
               "detects as preference_pairs"),
    DataFormat("chat_examples", "chat examples", "archlab-sft", (("messages",), ("prompt", "completion")),
               ("messages", "completion"),
               "an SFT folder, or a seq2seq folder for encoder-decoders (archlab finetune --method sft)",
               "a folder of chat examples (archlab finetune)", "archlab.data.sft.SFTDataset"),
    DataFormat("prompts", "prompts", "prompts", (("prompt",),), ("prompt",),
               "a prompts folder (archlab finetune --method grpo|ppo)",
               "a folder of prompts (archlab finetune)", "archlab.data.prompts.load_prompts"),
    DataFormat("seq2seq_pairs", "seq2seq (source/target) pairs", "archlab-pairs", (("source", "target"),),
               ("source", "target"),
               "memmap source/target files (archlab data prepare --seq2seq)",
               "a source/target pairs folder", "archlab.data.seq2seq.Seq2SeqDataset"),
):
    FORMATS.register(_format.name)(_format)


@dataclass(frozen=True)
class Found:
    """What `detect` found: the format's name and whether the path is a prepared folder (else a .jsonl file)."""

    format: str
    folder: bool


def describe(names: tuple[str, ...] | list[str]) -> str:
    """The formats `names` in words, for errors.
    Example: describe(("chat_examples", "prompts")) -> "chat examples or prompts"."""
    words = [FORMATS.get(name).summary for name in names]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def line_format(record: Any) -> str | None:
    """The format of one parsed .jsonl line (None: no format's shape)."""
    if not isinstance(record, dict):
        return None
    for name in FORMATS.names():
        if any(key in record for key in FORMATS.get(name).markers):
            return name
    return None


def by_folder_format(meta_format: str) -> DataFormat | None:
    """The format whose prepared folders say `meta_format` in their meta.json "format" (None: none of this archlab's).
    Example: by_folder_format("archlab-pairs").reader -> "archlab.data.seq2seq.Seq2SeqDataset"."""
    return next((f for f in map(FORMATS.get, FORMATS.names()) if f.folder_format == meta_format), None)


def load_meta(data_dir: str | os.PathLike, expect: str | None = "archlab-tokens") -> dict:
    """A data folder's meta.json; a folder of another format than `expect` (a meta.json "format"; None: any) is a
    DataError that names what the folder is and what reads it (both from FORMATS).
    Example: load_meta("data/shakespeare")["vocab_size"] -> 50257"""
    path = Path(data_dir) / META_FILE
    if not Path(data_dir).exists():
        raise DataError(f"{data_dir}: no such data folder; make one with `archlab data prepare --corpus TEXT "
                        f"--tokenizer TOKENIZER --out {data_dir}`")
    if not path.is_file():
        raise DataError(f"{data_dir} is not a prepared data folder (no {META_FILE}); "
                        "run `archlab data prepare` first")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise DataError(f"{path} is corrupt (not JSON: {exc}); prepare the data folder again") from exc
    if not isinstance(meta, dict) or "splits" not in meta:
        raise DataError(f"{path} is not an archlab data folder's meta.json (no `splits`)")
    found = meta.get("format", "archlab-tokens")
    if expect is not None and found != expect:
        have, want = by_folder_format(found), by_folder_format(expect)
        if have is None:
            raise DataError(f"{data_dir} has format {found!r}, which this archlab cannot read")
        wanted = want.folder_summary if want else f"a {expect!r} folder"
        raise DataError(f"{data_dir} is {have.folder_summary}, not {wanted}: read it with {have.reader}")
    return meta


def _folder_format(path: Path) -> str:
    found = load_meta(path, expect=None).get("format", "archlab-tokens")   # DataError (a UserError) when no folder
    known = by_folder_format(found)
    if known is None:
        raise UserError(f"{path} has format {found!r}, which this archlab cannot read")
    return known.name


def _file_format(path: Path, accepts: tuple[str, ...] | None) -> str:
    """The one format of every line of `path`; a UserError naming the file and line for a line of none or of
    another format than the first."""
    first: tuple[int, str] | None = None
    try:
        with path.open("rb") as fh:
            for number, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    raise UserError(f"{where}: not valid JSON ({exc})") from None
                name = line_format(record)
                if name is None:
                    fields = (", ".join(map(repr, record)) if isinstance(record, dict)
                              else f"a JSON {type(record).__name__}")
                    known = [n for n in (accepts or FORMATS.names()) if FORMATS.get(n).line_shapes]
                    shapes = "; ".join(f"{FORMATS.get(n).summary}: {FORMATS.get(n).shapes()}" for n in known)
                    raise UserError(f"{where} has {fields or 'no fields'}, not the fields of {describe(known)} "
                                    f"({shapes})")
                if first is None:
                    first = (number, name)
                elif name != first[1]:
                    raise UserError(f"{where} holds {FORMATS.get(name).summary}, line {first[0]} "
                                    f"{FORMATS.get(first[1]).summary}: one format per file")
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if first is None:
        raise UserError(f"{path} holds no lines")
    return first[1]


def detect(path: str | os.PathLike, *, flag: str = "--data", accepts: tuple[str, ...] | None = None) -> Found:
    """The format of `path`: a prepared folder by its meta.json, a .jsonl file by its lines (all of one format).
    A UserError for anything else, naming what was found (and for a line of no format, the fields of `accepts`).
    Example: detect("runs/sft/data").format -> "chat_examples"."""
    path = Path(path)
    if path.is_dir():
        return Found(_folder_format(path), folder=True)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file or folder")
    if path.suffix != ".jsonl":
        raise UserError(f"{flag} {path} is a file but not a .jsonl (line data) file; token data is a folder from "
                        "archlab data prepare")
    return Found(_file_format(path, accepts), folder=False)


def require(path: str | os.PathLike, accepts: tuple[str, ...], *, who: str, flag: str = "--data") -> Found:
    """`detect(path)`, refused unless its format is one of `accepts` (who: the method, as the user named it).
    Example: require(data, ("preference_pairs",), who="train.method=dpo")"""
    found = detect(path, flag=flag, accepts=accepts)
    if found.format not in accepts:
        shape = "a folder of" if found.folder else "a file of"
        raise UserError(f"{flag} {path} is {shape} {FORMATS.get(found.format).summary}; {who} reads "
                        f"{describe(accepts)}")
    return found
