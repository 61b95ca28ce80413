"""Rewards for the RL methods (grpo, ppo): each a function with TRL's signature

    reward(prompts, completions, completion_ids, **columns) -> list[float]      # one number per completion

from one of three sources, named in train.grpo.rewards:

    exact_match        1.0 when the completion, stripped, equals the line's `answer` column (stripped), else 0.0
    format             1.0 when train.grpo.format_regex matches the whole completion (re.fullmatch, DOTALL), else 0.0
    runs/rm            a reward run (archlab finetune --method reward): its score head on prompt + completion; its
                       tokenizer must be the policy's
    FILE.py:FUNC   the user's own function, loaded only from archlab finetune's --reward (the command line):
                       code is never imported because a config file, a data folder or a run folder names it

    funcs = resolve(("exact_match", "FILE.py:FUNC"), columns=["answer"], ...)   # RewardFunc(name, fn) each
    values = call(funcs[0], prompts, completions, completion_ids, columns)  # checked: numbers, one per completion
"""
from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from archlab.errors import UserError
from archlab.nn.registry import Registry

__all__ = ["RewardFunc", "BUILTINS", "load_user_reward", "resolve", "call", "probe", "is_code_spec",
           "announce_reward_runs"]


@dataclass(frozen=True)
class RewardFunc:
    """A reward under the name its figures are logged with (rewards/<name>/mean) and where it came from."""

    name: str
    fn: Callable[..., Any]
    source: str


BUILTINS: Registry[Callable[..., Callable[..., list[float]]]] = Registry("reward")


def _text(completion: Any) -> str:
    """A completion's text: itself, or the content of its last message (TRL's conversational form)."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


@BUILTINS.register("exact_match")
def _exact_match(**_: Any) -> Callable[..., list[float]]:
    def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
        return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]
    return exact_match


@BUILTINS.register("format")
def _format(format_regex: str = "", **_: Any) -> Callable[..., list[float]]:
    pattern = re.compile(format_regex, re.DOTALL)

    def format(prompts, completions, **kwargs) -> list[float]:     # noqa: A001  (the name TRL logs it under)
        return [float(pattern.fullmatch(_text(c).strip()) is not None) for c in completions]
    return format


# FILE.py:FUNC specs given on this process's command line (archlab finetune --reward), loaded there
_FROM_COMMAND_LINE: dict[str, Callable[..., Any]] = {}


def is_code_spec(spec: str) -> bool:
    """Whether a reward spec names code (FILE.py:FUNC)."""
    file, sep, func = spec.rpartition(":")
    return bool(sep) and file.endswith(".py") and bool(func)


def load_user_reward(spec: str) -> Callable[..., Any]:
    """Import FUNC from FILE.py (the user's own code, named on the command line) and keep it for this process's run.
    A missing file or function is a UserError naming it. Example: load_user_reward("rewards.py:correct")"""
    file, _, func = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise UserError(f"--reward {spec}: no such file {file}")
    module_name = f"archlab_user_reward_{abs(hash(str(path.resolve())))}"
    try:
        loader = importlib.util.spec_from_file_location(module_name, path)
        if loader is None or loader.loader is None:
            raise ImportError(f"cannot load {file} as a module")
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        loader.loader.exec_module(module)
    except Exception as exc:     # the user's module failed to import: say so in one line
        raise UserError(f"--reward {spec}: importing {file} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"--reward {spec}: {file} has no function {func}")
    _FROM_COMMAND_LINE[spec] = fn
    return fn


class _RewardRun:
    """A reward run's score head as a reward function of token ids (prompt + completion, as the policy encodes them)."""

    def __init__(self, folder: Path, policy_tokenizer: Path | None):
        from archlab.nn.heads import SCORE_HEAD
        from archlab.runs.model_folder import load_run

        if not (folder / "tokenizer" / "tokenizer.json").is_file():
            raise UserError(f"reward run {folder} has no tokenizer: train it with archlab finetune --method reward")
        if policy_tokenizer is not None and not _same_tokenizer(folder / "tokenizer", policy_tokenizer):
            raise UserError(f"reward run {folder} was trained with another tokenizer than the policy's "
                            f"({policy_tokenizer}): it would score other tokens than the policy writes")
        self.model, _ = load_run(folder)
        if not hasattr(self.model, SCORE_HEAD):
            raise UserError(f"{folder} is not a reward run (its checkpoint has no score head): train one with "
                            "archlab finetune BASE --method reward")
        self.model.eval().requires_grad_(False)
        self.folder = folder

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids, prompt_ids=None, **kwargs) -> list[float]:
        from archlab.training.methods.reward import sequence_rewards

        rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)                                    # (b, t)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
        device = next(self.model.parameters()).device
        lengths = torch.tensor([len(r) for r in rows], device=device)
        return sequence_rewards(self.model, ids.to(device), lengths).float().cpu().tolist()


def announce_reward_runs(funcs: list[RewardFunc], info: Any) -> dict[str, float]:
    """Before the first step of a run that trains against reward runs: each one's held-out accuracy (recorded by the
    reward run, or computed now on its held-out pairs: the line says which) printed on rank 0, and returned as
    `reward_model/<name>/val_accuracy` for the run's first log line (none for a run that held no pairs out).
    Example: announce_reward_runs(funcs, info) -> {"reward_model/rm/val_accuracy": 0.875}"""
    from archlab.training.methods.reward import held_out_accuracy

    out: dict[str, float] = {}
    for func in funcs:
        if not isinstance(func.fn, _RewardRun):
            continue
        found = held_out_accuracy(func.fn.folder, func.fn.model)
        if found.accuracy is not None:
            out[f"reward_model/{func.name}/val_accuracy"] = found.accuracy
        if info is None or info.is_main:
            figure = "unknown" if found.accuracy is None else f"{found.accuracy:.4f}"
            print(f"reward run {func.source}: held-out accuracy {figure} ({found.source})", file=sys.stderr,
                  flush=True)
    return out


def _same_tokenizer(a: Path, b: Path) -> bool:
    import json

    def vocab(folder: Path) -> Any:
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        return data.get("model", {}).get("vocab"), data.get("added_tokens")
    return (b / "tokenizer.json").is_file() and vocab(a) == vocab(b)


def resolve(specs: tuple[str, ...], *, columns: set[str], format_regex: str, policy_tokenizer: Path | None,
            data: Path, setting: str = "train.grpo.rewards") -> list[RewardFunc]:
    """The reward functions train.grpo.rewards names, each checked before anything is written: a built-in's columns
    (exact_match needs `answer` on every line of `data`), a reward run's tokenizer, a FILE.py:FUNC loaded from this
    process's command line (a config naming one otherwise is refused)."""
    out = []
    for spec in specs:
        if is_code_spec(spec):
            if spec not in _FROM_COMMAND_LINE:
                raise UserError(f"{setting} names code ({spec}): pass it as --reward {spec} on archlab "
                                "finetune's command line (code named by a config or run folder is never imported)")
            fn = _FROM_COMMAND_LINE[spec]
            out.append(RewardFunc(getattr(fn, "__name__", spec.rpartition(":")[2]), fn, spec))
        elif spec in BUILTINS.names():
            if spec == "exact_match" and "answer" not in columns:
                raise UserError(f"--data {data}: the exact_match reward compares with an 'answer' on every line; "
                                "some line has none")
            if spec == "format":
                try:
                    re.compile(format_regex)
                except re.error as exc:
                    raise UserError(f"train.grpo.format_regex={format_regex!r} is not a regular expression: {exc}"
                                    ) from None
            out.append(RewardFunc(spec, BUILTINS.get(spec)(format_regex=format_regex), spec))
        elif Path(spec).is_dir():
            run = _RewardRun(Path(spec), policy_tokenizer)
            out.append(RewardFunc(Path(spec).name, run, spec))
        else:
            raise UserError(f"reward {spec!r}: neither a built-in ({', '.join(BUILTINS.names())}), a reward run "
                            "folder, nor FILE.py:FUNC")
    return out


def call(reward: RewardFunc, prompts: list, completions: list[str], completion_ids: list[list[int]],
         columns: dict[str, list], prompt_ids: list[list[int]] | None = None) -> list[float]:
    """reward(prompts=..., completions=..., completion_ids=..., **columns) checked: a list of finite numbers, one per
    completion; anything else (or an exception) is a UserError naming the reward."""
    extra = {"prompt_ids": prompt_ids} if isinstance(reward.fn, _RewardRun) else {}
    try:
        values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                           **extra)
    except UserError:
        raise
    except Exception as exc:     # the user's function failed: one line naming it, not a traceback
        raise UserError(f"reward {reward.source} raised {type(exc).__name__}: {exc}") from None
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward {reward.source} returned {got} for {len(completions)} completions: it must return "
                        "a list of numbers, one per completion")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"reward {reward.source} returned {v!r}: every reward must be a finite number")
    return [float(v) for v in values]


def probe(funcs: list[RewardFunc], data: Any) -> None:
    """Each reward called once before anything is written, on the first line of `data` (data/prompts.PromptData) with
    an empty completion and its answer (or "0"): a function that raises or returns other than one number per
    completion is refused now."""
    first = data.prompts[0]
    columns = {k: [v, v] for k, v in first.columns.items()}
    texts = ["", str(first.columns.get("answer", "0"))]
    for fn in funcs:
        call(fn, [first.prompt] * 2, texts, [[], []], columns, prompt_ids=[first.ids] * 2)
