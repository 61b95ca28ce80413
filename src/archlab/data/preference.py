"""Preference data for DPO: `.jsonl` lines of a prompt and two completions, one preferred.

Two shapes of line, as TRL's preference datasets have them:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                 plain text, no template
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}
    {"chosen": [messages], "rejected": [messages]}   (or texts): TRL's implicit prompt, their shared start
                                                      (extract_prompt, as TRL splits it)

and TRL's unpaired form, one completion judged alone (what KTO trains on; data/formats.py: unpaired_preferences):

    {"prompt": "..." | [messages], "completion": "..." | [assistant messages], "label": true | false}

A file holds one form: paired lines become PreferenceData.pairs, unpaired ones PreferenceData.unpaired
(LabelledCompletion: true = desirable); `labelled_completions` gives KTO either as labelled completions, a pair
unpaired as TRL's unpair_preference_dataset does (every chosen side desirable, then every rejected side not).

Each side becomes one sequence, encoded as archlab.data.chat encodes a prompt/completion line with the loss mask
"completion": plain text is prompt + completion + the end-of-text token; messages render through the tokenizer's
chat template and the completion is what the assistant's messages add. labels score the completion only
(slot j holds token j + 1 or IGNORE), so a model's summed log-probability of a side is its completion's.
A side longer than `max_tokens` (train.seq_len) is handled by the policy `truncation` names (chat.TRUNCATIONS:
refuse, keep_start, keep_end, skip); a policy that leaves no completion token refuses the line. Every bad line is a
UserError naming the file and line: not JSON, a missing field, a bad message, chosen equal to rejected.

PreferenceBatches draws pairs in a shuffled order per epoch, a pure function of (seed, draw): its state is one
counter. A batch is (inputs, labels) with 2b rows, the b chosen sides then the b rejected ones, right-padded:
inputs {"input_ids": (2b, t), "attention_mask": (2b, t) (1 on real tokens), "pair_index": (b,)}, labels (2b, t).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from archlab.data.chat import (
    TRUNCATIONS,
    ChatDataError,
    Conversation,
    NoTemplateForMessages,
    _conversation,
    check_truncation,
    encode_conversation,
    truncation_advice,
)
from archlab.data.corpora import CorpusError, jsonl_records
from archlab.data.objectives import IGNORE
from archlab.errors import UserError
from archlab.progress import progress_bar
from archlab.tokenizer.chat import ChatTokenizer, NoChatTemplate

__all__ = ["SIDES", "NoTemplateForMessages", "extract_prompt", "PreferencePair", "LabelledCompletion",
           "PreferenceData", "load_preference_data", "labelled_completions", "pad_rows", "pad_pairs",
           "PreferenceBatches"]

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One line: per side its ids (n,) and labels (n,) (labels[j] = ids[j + 1] on the completion, else IGNORE)."""
    line: int
    chosen: tuple[list[int], list[int]]
    rejected: tuple[list[int], list[int]]

    @property
    def prompt_ids(self) -> list[int]:
        """The ids before the chosen completion's first scored token (the prompt as the model reads it)."""
        ids, labels = self.chosen
        return ids[:first_scored(labels) + 1]


def first_scored(labels: list[int]) -> int:
    """The slot of the first scored label: the prompt, as the model reads it, is ids[:first_scored(labels) + 1]."""
    return next(j for j, t in enumerate(labels) if t != IGNORE)


@dataclass(frozen=True)
class LabelledCompletion:
    """One prompt + completion judged alone (TRL's unpaired preference line, or one side of a pair): ids (n,), labels
    (n,) scoring the completion only (as a pair's side), and whether it is desirable (TRL's label)."""
    line: int
    ids: list[int]
    labels: list[int]
    desirable: bool

    @property
    def prompt_len(self) -> int:
        """How many leading ids are the prompt."""
        return first_scored(self.labels) + 1


@dataclass
class PreferenceData:
    """The pairs (or unpaired labelled completions) of one file and what the trainer records of a data source (the
    file's sha256 as fingerprint). A file holds one form: `pairs` or `unpaired` is empty."""
    path: Path
    pairs: list[PreferencePair]
    tokenizer_dir: Path
    vocab_size: int
    eot_id: int | None
    fingerprint: str
    skipped: int = 0
    bytes_per_token: float | None = None
    unpaired: list[LabelledCompletion] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(p.chosen[0]) + len(p.rejected[0]) for p in self.pairs) + sum(len(e.ids) for e in self.unpaired)

    def without_pairs(self) -> PreferenceData:
        """The same source with no pairs: what stands for a token validation split, which a DPO run has none of (its
        held-out pairs are DPOBatches.val, scored by DPOBatches.evaluate)."""
        return dataclasses.replace(self, pairs=[], unpaired=[])

    @property
    def meta(self) -> dict:
        return {"corpus": str(self.path), "tokenizer": str(self.tokenizer_dir.resolve())}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_prompt(chosen: Any, rejected: Any) -> dict:
    """TRL's extract_prompt (trl.data_utils): the longest shared prefix of chosen and rejected (messages, or
    characters of text, a space before the split going with the completions) is the prompt, the rests are the
    sides. Kept step for step as TRL has it, so a line reads alike in both.
    Example: extract_prompt("Sky? Blue", "Sky? Green") -> {"prompt": "Sky?", "chosen": " Blue", "rejected": " Green"}"""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":     # TRL: the space before the split goes with the completions
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _unpaired(value: dict, where: str) -> dict:
    """TRL's unpaired line checked: a prompt, a completion, and a label that is true or false."""
    for needed in ("prompt", "completion"):
        if needed not in value:
            raise ChatDataError(f"{where} has a 'label' but no {needed!r} (an unpaired preference line has prompt, "
                                "completion and label)")
    if not isinstance(value["label"], bool):
        raise ChatDataError(f"{where}: label is {json.dumps(value['label'])}, not true or false (true: the completion "
                            "is desirable)")
    return value


def _record(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ChatDataError(f"{where} is a JSON {type(value).__name__}, not an object with prompt, chosen, rejected")
    if "label" in value and not any(side in value for side in SIDES):
        return _unpaired(value, where)
    for needed in SIDES:
        if needed not in value:
            raise ChatDataError(f"{where} has no {needed!r} (a preference line has prompt, chosen and rejected)")
    if "prompt" not in value:      # TRL's implicit prompt: the sides are whole texts or conversations
        chosen, rejected = value["chosen"], value["rejected"]
        if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
            raise ChatDataError(f"{where} has no 'prompt', and chosen and rejected are not both texts or both lists "
                                "of messages that share it as their start")
        value = {**value, **extract_prompt(chosen, rejected)}
        if not value["prompt"]:
            raise ChatDataError(f"{where} has no 'prompt', and chosen and rejected share no start to take as it "
                                "(TRL's implicit prompt)")
    if value["chosen"] == value["rejected"]:
        raise ChatDataError(f"{where}: chosen equals rejected, so there is no preference to learn")
    return value


def _conversations(record: dict, where: str, line: int) -> list[Conversation]:
    """The chosen and rejected sides of a line (or an unpaired line's completion) as prompt/completion conversations,
    checked."""
    out = []
    for side in (SIDES if "chosen" in record else ("completion",)):
        try:
            conv = _conversation({"prompt": record["prompt"], "completion": record[side]}, where, line)
        except ChatDataError as exc:
            raise ChatDataError(str(exc).replace("completion", side) if side != "completion" else str(exc)) from None
        if not conv.is_plain and any(m["role"] != "assistant" for m in conv.messages[conv.prompt_len:]):
            raise ChatDataError(f"{where}: {side} must hold assistant messages only")
        out.append(conv)
    return out


def _side(chat: ChatTokenizer, template: str | None, conv: Conversation, side: str, where: str,
          max_tokens: int | None, truncation: str, setting: str) -> tuple[list[int], list[int]] | None:
    """(ids, labels) of one side, truncated by the policy (None: skipped)."""
    try:
        ids, mask = encode_conversation(chat, conv, mask="completion", template=template)
    except UserError as exc:
        raise ChatDataError(f"{where}: {side}: {exc}") from None
    if max_tokens is not None and len(ids) > max_tokens:
        if truncation == "refuse":
            raise ChatDataError(f"{where}: {side} has {len(ids)} tokens, more than the limit of {max_tokens}: "
                                f"{truncation_advice(setting)}")
        cut = TRUNCATIONS[truncation](ids, mask, max_tokens)
        if cut is None:
            return None
        ids, mask = cut
        if not any(mask[1:]):
            raise ChatDataError(f"{where}: {side} keeps no completion token under truncation {truncation!r} "
                                f"within {max_tokens} tokens")
    labels = [ids[j + 1] if mask[j + 1] else IGNORE for j in range(len(ids) - 1)] + [IGNORE]   # (n,)
    return ids, labels


def load_preference_data(path: str | os.PathLike, tokenizer: str | os.PathLike, *, max_tokens: int | None = None,
                         truncation: str = "refuse", chat_template: str | None = None, progress: bool = True,
                         setting: str = "truncation") -> PreferenceData:
    """Every line of `path` as a PreferencePair, encoded with the tokenizer folder `tokenizer` (its chat template for
    message lines); `setting` is how errors name the truncation option.
    Example: data = load_preference_data("prefs.jsonl", "runs/base/tokenizer", max_tokens=256)"""
    path, tokenizer = Path(path), Path(tokenizer)
    check_truncation(truncation, setting)
    if not path.is_file():
        what = "a folder, not a file" if path.is_dir() else "no such file"
        raise UserError(f"{path}: {what} (preference data is a .jsonl file)")
    chat = ChatTokenizer.of(tokenizer)
    template: str | None = None
    form: tuple[int, bool] | None = None            # (the first line, whether it is unpaired): one form per file
    data = PreferenceData(path, [], tokenizer, int(chat.tokenizer.vocab_size),
                          getattr(chat.tokenizer, "eot_id", None), file_sha256(path))
    bar = progress_bar(desc=f"reading {path.name}", unit=" pairs", disable=not progress)
    try:
        for line, value in jsonl_records(path):
            where = f"{path}:{line}"
            convs = _conversations(_record(value, where), where, line)
            if template is None and not convs[0].is_plain:
                try:
                    template = chat.template(chat_template)
                except NoChatTemplate:
                    raise NoTemplateForMessages(where, f"prompt, chosen and rejected are chat messages and the "
                                                f"tokenizer {tokenizer} has no chat template to render them (pass "
                                                "chat_template=, or write the sides as plain text)") from None
                except UserError as exc:
                    raise ChatDataError(f"{where}: {exc}") from None
            unpaired = len(convs) == 1
            if form is None:
                form = (line, unpaired)
            elif form[1] != unpaired:
                raise ChatDataError(f"{where} is {_FORMS[unpaired]}, line {form[0]} {_FORMS[form[1]]}: one form "
                                    "per file")
            names = ("completion",) if unpaired else SIDES
            sides = [_side(chat, template, conv, side, where, max_tokens, truncation, setting)
                     for conv, side in zip(convs, names)]
            if any(side is None for side in sides):
                data.skipped += 1
                continue
            if unpaired:
                ids, labels = sides[0]          # type: ignore[misc]   (None is skipped above)
                data.unpaired.append(LabelledCompletion(line, ids, labels, value["label"]))
            else:
                data.pairs.append(PreferencePair(line, sides[0], sides[1]))      # type: ignore[arg-type]
            bar.update()
    except CorpusError as exc:
        raise ChatDataError(str(exc)) from None
    finally:
        bar.close()
    if not data.pairs and not data.unpaired:
        raise ChatDataError(f"{path}: no preference pairs (an empty file, or every line skipped)")
    return data


_FORMS = {False: "a preference pair (chosen, rejected)", True: "an unpaired preference (prompt, completion, label)"}


def labelled_completions(data: PreferenceData) -> list[LabelledCompletion]:
    """What KTO trains on: the file's unpaired lines, or its pairs unpaired as TRL's unpair_preference_dataset does
    (every pair's chosen side, desirable, in file order; then every rejected side, undesirable).
    Example: [e.desirable for e in labelled_completions(two_pairs)] -> [True, True, False, False]"""
    if data.unpaired:
        return list(data.unpaired)
    return ([LabelledCompletion(p.line, *p.chosen, True) for p in data.pairs]
            + [LabelledCompletion(p.line, *p.rejected, False) for p in data.pairs])


def pad_pairs(pairs: list[PreferencePair], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (2b, t), labels (2b, t)): the chosen sides, then the rejected ones, right-padded (labels IGNORE)."""
    return pad_rows([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (r, t), labels (r, t)) of (ids, labels) rows, right-padded (labels IGNORE)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
    return ids, labels


class PreferenceBatches:
    """The training batches of one rank: `next(step, micro)` -> (inputs, labels) of `batch_size` pairs (global; this
    rank's share), drawn in a shuffled order per epoch from (seed, epoch) among `pool` (indices into data.pairs; all
    of them by default: a validation split leaves its pairs out); state: the draws made so far.
    Example: inputs, labels = PreferenceBatches(data, batch_size=8, seed=0).next(0, 0)"""

    def __init__(self, data: PreferenceData, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 pool: list[int] | None = None):
        self.data, self.batch_size, self.seed, self.rank, self.world_size = data, batch_size, seed, rank, world_size
        self.pool = torch.tensor(range(len(data.pairs)) if pool is None else pool, dtype=torch.long)
        self.draws = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, self.pool[torch.randperm(len(self.pool), generator=generator)])
        return self._order[1]

    def indices(self, draw: int) -> list[int]:
        """The pair indices (into data.pairs) of this rank's share of global draw `draw`."""
        n = len(self.pool)
        positions = range(draw * self.batch_size, (draw + 1) * self.batch_size)
        mine = list(positions)[self.rank::self.world_size]
        return [int(self._epoch_order(p // n)[p % n]) for p in mine]

    def next(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        index = self.indices(self.draws)
        self.draws += 1
        pairs = [self.data.pairs[i] for i in index]
        ids, labels = pad_pairs(pairs, self.data.eot_id or 0)
        lengths = torch.tensor([len(p.chosen[0]) for p in pairs] + [len(p.rejected[0]) for p in pairs])   # (2b,)
        real = (torch.arange(ids.shape[1]) < lengths[:, None]).long()      # (2b, t): what tokens/s counts
        return {"input_ids": ids, "attention_mask": real, "pair_index": torch.tensor(index, dtype=torch.long)}, labels

    @property
    def epoch(self) -> float:
        return self.draws * self.batch_size / len(self.pool)

    def state_dict(self) -> dict:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.draws = int(state["draws"])
