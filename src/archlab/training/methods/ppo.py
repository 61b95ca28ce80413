"""`ppo`: the RLHF loop of Ouyang et al. 2022 (Ziegler et al. 2019; Schulman et al. 2017) as a readable reference, with
TRL's experimental PPOTrainer's settings (train.ppo) and log names. Pieces, in the order a rollout uses them:

    policy       the run's model; a value head (nn/heads.py ScoreHead, `value_head`, zeros at the start) on its normed
                 hidden states gives V(state before each completion token): one trunk for both
    reference    the starting weights (--init-from / BASE), frozen: the KL penalty's anchor
    reward       a reward run's score head on prompt + completion, or the user's FILE.py:FUNC (training/methods/rewards)
    rollout      prompts -> completions sampled through archlab.generate's KV cache (training/methods/rollout.py), each
                 ending at its first end-of-text / end-of-turn token (kept)
    math         per-token rewards (-kl_coef * KL, the score on the last token), GAE, whitened advantages, the clipped
                 policy and value losses: training/ppo.py, pure functions

The trainer drives it as any method: one optimizer step per mini-batch. `batches.next(step, micro)` samples rollout
k = step // (num_ppo_epochs * num_mini_batches) when the step first needs it (the policy as it stands, each prompt's
completion from a private generator seeded by (seed, k, its slot)), then hands out rows of it in a seeded permutation
per PPO epoch; the rollout is part of the checkpoint, so a resume mid-rollout trains on the same rollout.

Under torchrun (dist.strategy=ddp) each rank samples every world_size-th prompt of the rollout and scores its values,
reference log-probs and rewards; the shares are gathered, so every rank holds the whole rollout (whitening and GAE run
on it as on one process), and trains on its share of each micro-batch's rows, its loss scaled by its share of the
micro-batch's tokens (the losses are token means) so that DDP's mean gradient is one process's; the step's figures
are token-weighted over the ranks. The rollout costs each rank 1/world_size of what it costs one process.

Logged per line under TRL's names: objective/kl, objective/entropy, objective/non_score_reward, objective/rlhf_reward,
objective/scores, policy/approxkl_avg, policy/clipfrac_avg, loss/policy_avg, loss/value_avg, val/clipfrac_avg,
policy/entropy_avg, val/ratio, val/ratio_var, val/num_eos_tokens, and episode (completions sampled so far).

    archlab finetune runs/sft --method ppo --data prompts.jsonl --reward runs/rm --out runs/ppo
    archlab finetune runs/sft --method ppo --data prompts.jsonl --reward my_rewards.py:correct --out runs/ppo
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from archlab.data.formats import require
from archlab.data.prompts import Prompt, PromptData, load_prompts
from archlab.errors import UserError
from archlab.models.decoder import LossOutput
from archlab.nn.heads import VALUE_HEAD, attach_score_head
from archlab.training import distributed as dist_util
from archlab.training import ppo
from archlab.training.methods import rewards as reward_fns
from archlab.training.methods.base import METHODS, FinetuneRequest, Method
from archlab.training.methods.reward import _unwrapped
from archlab.training.methods.rollout import (
    Rollout,
    completion_logps,
    end_ids,
    gather_rollout,
    my_slots,
    prompt_completion,
    rollout,
    slot_seed,
    token_logps,
)
from archlab.training.methods.staging import prepare_line_folder

__all__ = ["PROMPTS", "PPOBatches", "PPORun", "open_ppo", "prepare_ppo", "policy_forward"]

PROMPTS = "prompts"         # the data folder's format (data/preference_folder.write_line_folder)
ROLLOUT_FIGURES = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                   "objective/scores", "val/num_eos_tokens")
STEP_FIGURES = ("policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
                "policy/entropy_avg", "val/ratio")


def policy_forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, completion: torch.Tensor, *,
                   temperature: float, vocab_limit: int | None = None, entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One forward of prompt + completion rows (b, p + c): the completion tokens' log-probs (b, c) at `temperature`,
    their entropy (b, c) or None, and the value head's V of the state before each completion token (b, c)."""
    c = completion.shape[1]
    hidden = model(input_ids=input_ids, positions=positions, return_hidden=True)[:, -c - 1:-1]     # (b, c, d)
    inner = _unwrapped(model)
    logps, ent = token_logps(inner.lm_head(hidden), completion, temperature=temperature, vocab_limit=vocab_limit,
                             entropy=entropy)
    return logps, ent, getattr(inner, VALUE_HEAD).values(hidden)


class PPOBatches:
    """Rollouts and the mini-batches PPO trains on: `next(step, micro)` -> (inputs, labels) where inputs hold the rows'
    prompt + completion ids and positions (-1 on padding) and the rollout's per-token old log-probs, old values,
    advantages and returns (b, c); labels are the completion ids (b, c). The policy and the reference arrive at `start`.
    """

    def __init__(self, data: PromptData, cfg: Any, reward: Any, end_ids: list[int], vocab_limit: int | None,
                 info: Any = None):
        self.data, self.cfg, self.section = data, cfg, cfg.ppo
        self.info = info if info is not None else dist_util.DistInfo()
        self.reward, self.end_ids, self.vocab_limit = reward, end_ids, vocab_limit
        self.rows = cfg.batch_size * cfg.grad_accum                      # rows per optimizer step (a mini-batch)
        self.size = self.rows * self.section.num_mini_batches            # prompts per rollout
        self.steps_per_rollout = self.section.num_ppo_epochs * self.section.num_mini_batches
        self.policy: Any = None
        self.reference: Any = None
        self.tokenizer: Any = None
        self.current: dict[str, Any] | None = None                       # the rollout being trained on
        self.figures: list[dict[str, float]] = []                        # rollout figures since the last log line

    # ---- which prompts, which rows: functions of (seed, step, micro)
    def prompts_of(self, k: int) -> list[Prompt]:
        """Rollout k's prompts: draws k * size ... of seeded passes over the lines, one permutation per pass."""
        n, out = len(self.data.prompts), []
        for draw in range(k * self.size, (k + 1) * self.size):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + draw // n))
            out.append(self.data.prompts[int(order[draw % n])])
        return out

    def rows_of(self, step: int, micro: int) -> torch.Tensor:
        """The rollout rows (b,) of `step`'s micro-batch: a seeded permutation per PPO epoch, cut into mini-batches."""
        k, within = divmod(step, self.steps_per_rollout)
        epoch, mini = divmod(within, self.section.num_mini_batches)
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
            (self.cfg.seed * 1_000_003 + k) * 101 + epoch))
        start = mini * self.rows + micro * self.cfg.batch_size
        return order[start:start + self.cfg.batch_size]

    def next(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """This rank's rows of the micro-batch (all of them on one process); under DDP also `micro_tokens`, the
        completion tokens of the whole micro-batch (what the loss's token means divide by on one process)."""
        k = step // self.steps_per_rollout
        if self.current is None or self.current["index"] != k:
            self.current = self.collect(k)
        r, rows = self.current, self.rows_of(step, micro)
        extra = {}
        if self.info.world_size > 1:
            share = len(rows) // self.info.world_size
            extra["micro_tokens"] = r["completion_mask"][rows].sum().float()
            rows = rows[self.info.rank * share:(self.info.rank + 1) * share]
        ids, positions = prompt_completion(r["prompt_ids"][rows], r["prompt_mask"][rows], r["completion_ids"][rows],
                                           r["completion_mask"][rows])                      # (b, p + c) each
        inputs = {"input_ids": ids, "positions": positions, "attention_mask": (positions >= 0).long(),
                  **{name: r[name][rows] for name in ("completion_mask", "logps", "values", "advantages",
                                                      "returns")}, **extra}
        return inputs, r["completion_ids"][rows]

    # ---- one rollout
    @torch.no_grad()
    def collect(self, k: int) -> dict[str, Any]:
        """Rollout k under the current policy: completions, the reference's log-probs, values, scores, the per-token
        rewards, advantages (whitened) and returns; its figures join `figures`."""
        s = self.section
        prompts = self.prompts_of(k)
        slots = my_slots(len(prompts), self.info)               # this rank's prompts (all of them on one process)
        mine = [prompts[i] for i in slots]
        out: Rollout = rollout(self.policy, [p.ids for p in mine], group=1, max_new_tokens=s.response_length,
                               eos_ids=self.end_ids, pad_id=self.end_ids[0],
                               seed=[slot_seed(self.cfg.seed, k, i) for i in slots], temperature=s.temperature,
                               vocab_limit=self.vocab_limit)
        values, ref_logps = out.logps.clone(), out.logps.clone()     # (b, c); no rows: empty
        scores = torch.zeros(len(mine))
        if mine:
            ids, positions = prompt_completion(out.prompt_ids, out.prompt_mask, out.completion_ids,
                                               out.completion_mask)
            was_training = self.policy.training
            self.policy.eval()
            try:
                _, _, values = policy_forward(self.policy, ids, positions, out.completion_ids,
                                              temperature=s.temperature)
            finally:
                self.policy.train(was_training)
            ref_logps, _ = completion_logps(self.reference, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                            temperature=s.temperature, completion_mask=out.completion_mask,
                                            vocab_limit=self.vocab_limit, entropy=False)
            scores = self.score(mine, out)
        out, extra = gather_rollout(out, slots, len(prompts), 1, self.end_ids[0], self.info,
                                    per_row={"scores": scores}, per_token={"values": values, "ref_logps": ref_logps})
        mask = out.completion_mask.bool()                                                           # (b, c)
        values, ref_logps = extra["values"], extra["ref_logps"]
        scores = extra["scores"].to(values.device)                                                  # (b,)
        if s.missing_eos_penalty is not None:
            scores = scores - s.missing_eos_penalty * out.truncated.float()
        kl = torch.where(mask, ppo.kl_estimate(out.logps, ref_logps, s.kl_estimator), 0.0)        # (b, c)
        rewards, non_score = ppo.token_rewards(scores, kl, mask, s.kl_coef)
        if s.whiten_rewards:
            rewards = torch.where(mask, ppo.masked_whiten(rewards, mask, shift_mean=False), 0.0)
        advantages, returns = ppo.gae(rewards, values, mask, s.gamma, s.lam)
        advantages = torch.where(mask, ppo.masked_whiten(advantages, mask), 0.0)
        self.figures.append(dict(zip(ROLLOUT_FIGURES, (
            float(kl.sum(1).mean()), float((-out.logps * mask).sum(1).mean()), float(non_score.sum(1).mean()),
            float(non_score.sum(1).mean() + scores.mean()), float(scores.mean()),
            float(torch.isin(out.completion_ids[mask], torch.tensor(self.end_ids, device=mask.device)).sum())))))
        return {"index": k, "prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask,
                "completion_ids": out.completion_ids, "completion_mask": out.completion_mask, "logps": out.logps,
                "values": torch.where(mask, values, 0.0), "advantages": advantages, "returns": returns,
                "scores": scores}

    def score(self, prompts: list[Prompt], out: Rollout) -> torch.Tensor:
        """The reward of each completion (b,): text without its end token, TRL's conversational form for chat
        prompts, the lines' other columns as keyword lists."""
        tokens = out.completion_tokens()
        bare = [t[:-1] if t and t[-1] in self.end_ids else t for t in tokens]
        texts = [self.tokenizer.decode(t) for t in bare]
        completions: list[Any] = [[{"role": "assistant", "content": t}] if not isinstance(p.prompt, str) else t
                                  for p, t in zip(prompts, texts)]
        names = sorted({name for p in prompts for name in p.columns})
        columns = {name: [p.columns.get(name) for p in prompts] for name in names}
        values = reward_fns.call(self.reward, [p.prompt for p in prompts], completions, tokens, columns,
                                 prompt_ids=[p.ids for p in prompts])
        return torch.tensor(values, dtype=torch.float32)

    # ---- checkpoint state: the rollout being trained on (a resume mid-rollout trains on it, not on a new one)
    def state_dict(self) -> dict:
        if self.current is None:
            return {"rollout": None}
        return {"rollout": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in self.current.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.current = state.get("rollout")


class PPORun:
    """PPOBatches as the trainer drives a method: the clipped losses of a mini-batch, the value head, the reference."""

    def __init__(self, batches: PPOBatches, model_cfg: Any, init_from: Any):
        self.batches, self.model_cfg, self.init_from = batches, model_cfg, init_from
        self.train_data, self.val_data = batches.data, batches.data.without_prompts()
        self.tokenizer_dir: Path | None = Path(batches.data.tokenizer_dir)
        self._figures: list[torch.Tensor] = []          # each micro-batch's STEP_FIGURES since the last log line
        self._reward_model: dict[str, float] = {}       # a reward run's held-out accuracy, for the first log line

    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The value head (zeros) on the policy; its fresh state, which starting weights do not hold."""
        head = attach_score_head(model, VALUE_HEAD)
        return {f"{VALUE_HEAD}.{name}": t for name, t in head.state_dict().items()}

    def start(self, model: torch.nn.Module, run_dir: Path, *, device: torch.device, info: Any = None, **_: Any
              ) -> None:
        """The policy samples rollouts; the reference is the starting weights (BASE), frozen, on a resume too. A
        reward run's held-out accuracy is said now, before the first step (rewards.announce_reward_runs)."""
        from archlab.data.tokenizer_adapter import load_tokenizer
        from archlab.models import build_model

        reference = build_model(self.model_cfg)
        reference.load_state_dict({k: v for k, v in self.init_from.state.items() if k in reference.state_dict()})
        self.batches.reference = reference.to(device).eval().requires_grad_(False)
        self.batches.policy = model
        self.batches.tokenizer = load_tokenizer(self.tokenizer_dir)
        self._reward_model = reward_fns.announce_reward_runs([self.batches.reward], info)

    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> LossOutput:
        s = self.batches.section
        mask = inputs["completion_mask"].bool()                                                    # (b, c)
        logps, entropy, values = policy_forward(model, inputs["input_ids"], inputs["positions"], labels,
                                                temperature=s.temperature, vocab_limit=self.batches.vocab_limit,
                                                entropy=True)
        policy = ppo.policy_loss(logps, inputs["logps"], inputs["advantages"], mask, s.cliprange)
        value = ppo.value_loss(values, inputs["values"], inputs["returns"], mask, s.cliprange_value)
        loss = policy.loss + s.vf_coef * value.loss
        assert entropy is not None
        figures = torch.stack([policy.approxkl, policy.clipfrac, policy.loss.detach(), value.loss.detach(),
                               value.clipfrac, ppo.masked_mean(entropy.detach(), mask), policy.ratio])
        if "micro_tokens" in inputs:      # DDP: this rank's token mean -> its share of the micro-batch's token mean
            tokens = mask.sum().float()
            loss = loss * tokens * self.batches.info.world_size / inputs["micro_tokens"]
            figures = torch.cat([figures * tokens, tokens[None]])      # token-weighted, reduced at log_fields
        self._figures.append(figures)                                  # on device: no host sync per batch
        zero = loss.new_zeros(())
        return LossOutput(total=loss, ce=loss.detach(), z_loss=zero, aux_loss=zero)

    def log_fields(self) -> dict[str, float]:
        out, self._reward_model = self._reward_model, {}        # the reward run's held-out accuracy, once
        figures, self.batches.figures = self.batches.figures, []
        if figures:
            out.update({name: sum(f[name] for f in figures) / len(figures) for name in ROLLOUT_FIGURES})
        if self._figures:
            rows = torch.stack(self._figures).double().cpu()          # (micro-batches, STEP_FIGURES [+ tokens])
            info = self.batches.info
            if info.world_size > 1:                                   # each micro-batch's figures over all its tokens
                rows = torch.tensor(dist_util.all_reduce_sum(rows.flatten().tolist(), info),
                                    dtype=rows.dtype).view_as(rows)
                rows = rows[:, :-1] / rows[:, -1:]
            out.update(zip(STEP_FIGURES, rows.mean(0).tolist()))
            ratios = rows[:, STEP_FIGURES.index("val/ratio")]
            out["val/ratio_var"] = float(ratios.float().var()) if len(ratios) > 1 else 0.0
        current = self.batches.current
        if current is not None:
            out["episode"] = float((current["index"] + 1) * self.batches.size)
        self._figures = []
        return out

    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        return {}                                 # the rollouts' scores are the figures; no prompts are held out

    def check_resume(self, run_dir: Path) -> None:
        """The reference is --init-from's weights: a resume must start from the base the run started from."""
        from archlab.runs.model_folder import read_run_config

        recorded = (read_run_config(run_dir).get("init_from") or {}).get("weights")
        if recorded is not None and recorded != self.init_from.weights:
            raise UserError(f"--resume: {run_dir} started from {recorded}, this command from {self.init_from.weights}: "
                            "PPO's reference is the starting weights, so resume from the same base")


def _read(path: Path, tokenizer_dir: Path, cfg: Any) -> PromptData:
    room = cfg.seq_len - cfg.ppo.response_length
    if room < 1:
        raise UserError(f"train.ppo.response_length={cfg.ppo.response_length} leaves no room for a prompt within "
                        f"train.seq_len={cfg.seq_len} (prompt + completion)")
    return load_prompts(path, tokenizer_dir, max_tokens=room,
                        setting=f"train.seq_len={cfg.seq_len} - train.ppo.response_length={cfg.ppo.response_length}")


def _resolve_reward(cfg: Any, data: PromptData) -> Any:
    if cfg.ppo.reward is None:
        raise UserError("--method ppo needs a reward: --reward RUN (a reward run from archlab finetune --method "
                        "reward) or --reward FILE.py:FUNC (train.ppo.reward)")
    columns = set.intersection(*(set(p.columns) for p in data.prompts))
    (reward,) = reward_fns.resolve((cfg.ppo.reward,), columns=columns, format_regex="",
                                   policy_tokenizer=Path(data.tokenizer_dir), data=data.path,
                                   setting="train.ppo.reward")
    return reward


def open_ppo(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True) -> PPORun:
    """The PPORun of a prompts folder (archlab finetune --method ppo) or a prompts .jsonl (archlab train --init-from
    BASE --set train.method=ppo, encoded with BASE's tokenizer); UserError before any write for what PPO cannot run."""

    if info.world_size > 1 and info.strategy != "ddp":    # generation and the heads read the whole model
        raise UserError(f"train.method=ppo runs data-parallel with dist.strategy=ddp, not {info.strategy}")
    if cfg.batch_size % info.world_size:
        raise UserError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the world size "
                        f"{info.world_size}")
    if model_cfg.arch != "decoder":
        raise UserError(f"train.method=ppo trains decoder models, not arch={model_cfg.arch}")
    if init_from is None:
        raise UserError("train.method=ppo needs a starting policy, which is also its reference: archlab finetune BASE "
                        "--method ppo (or --init-from RUN)")
    if require(data_dir, ("prompts",), who="train.method=ppo").folder:
        data = _read(data_dir / f"{PROMPTS}.jsonl", data_dir / "tokenizer", cfg)
    elif init_from.tokenizer_dir is not None:
        data = _read(data_dir, Path(init_from.tokenizer_dir), cfg)
    else:
        raise UserError(f"train.method=ppo on the file {data_dir} encodes it with --init-from's tokenizer, and the "
                        "starting model holds none: archlab finetune BASE --method ppo")
    if model_cfg.vocab_size < data.vocab_size:
        raise UserError(f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {data.vocab_size} "
                        f"({data.tokenizer_dir})")
    if cfg.batch_size * cfg.grad_accum * cfg.ppo.num_mini_batches < 2:
        raise UserError("a PPO rollout of 1 prompt cannot whiten its advantages: train.batch_size * grad_accum * "
                        "train.ppo.num_mini_batches must be at least 2")
    reward = _resolve_reward(cfg, data)
    limit = data.vocab_size if data.vocab_size < model_cfg.vocab_size else None
    return PPORun(PPOBatches(data, cfg, reward, end_ids(data), limit, info), model_cfg, init_from)


def prepare_ppo(req: FinetuneRequest) -> tuple[Any, Path, Any]:
    """archlab finetune --method ppo: every prompt line checked with the staged tokenizer (and the reward resolved)
    before OUT/data, a prompts folder holding the lines and that tokenizer, is written."""
    cfg = req.train_cfg
    if cfg.ppo.reward is not None and reward_fns.is_code_spec(cfg.ppo.reward):
        reward_fns.load_user_reward(cfg.ppo.reward)         # the user's code, named on this command line

    def read(staged: Path) -> PromptData:
        data = _read(req.data, staged, cfg)
        reward_fns.probe([_resolve_reward(cfg, data)], data)   # called once: one number per completion, or refused
        return data

    return prepare_line_folder(req, PROMPTS, {"response_length": cfg.ppo.response_length}, read)


METHODS.register("ppo")(Method("ppo", "proximal policy optimization: a value head, the clipped losses, a KL penalty to "
                               "the start, against a reward run or function", open_ppo, prepare=prepare_ppo,
                               data_help="prompt data is a .jsonl file of {\"prompt\": text or messages, ...} lines",
                               data_formats=("prompts",)))
