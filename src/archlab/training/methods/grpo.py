"""`grpo`: group relative policy optimization (Shao et al. 2024) on prompts, with verifiable or learned rewards, as
TRL's GRPOTrainer does it (its defaults, loss types and log names; training/grpo.py holds the math):

    archlab finetune runs/sft --method grpo --data prompts.jsonl --out runs/grpo --reward exact_match
    archlab finetune runs/sft --method grpo --data prompts.jsonl --out runs/grpo --reward FILE.py:FUNC

Each step: train.batch_size * train.grad_accum / num_generations prompts (a seeded pass over the lines, epoch by
epoch), num_generations completions of each sampled through archlab's KV-cached generate (methods/rollout.py) from
the current weights, scored by the rewards (methods/rewards.py), advantages relative to each prompt's group; then one
gradient step of the clipped surrogate (+ β k3 KL to the starting weights, frozen). Each prompt's group is drawn
from its own generator, seeded by (train.seed, step, the prompt's slot in the step), so a run resumed from a
checkpoint samples what the uninterrupted run did, and what a prompt samples does not depend on who samples it.

Under torchrun (dist.strategy=ddp) each rank samples and scores every world_size-th prompt of the step (whole
groups: its group's advantages are its own), and the ranks' completions and rewards are gathered so that every rank
holds the step's whole generation batch, the one one process samples; each rank then scores the reference on and
trains on its share of each micro-batch's rows, its loss scaled so that DDP's mean of the ranks' gradients is the
one-process gradient, and the loss's figures are reduced over the ranks. The rollout (generation, rewards, the
reference) costs each rank 1/world_size of what it costs one process; held-out prompts are split the same way.

Lines: {"prompt": "text" | [messages], ...}; the other columns reach the reward functions by name (TRL's
**kwargs), e.g. "answer" for exact_match. Logged under TRL's names: reward, reward_std, rewards/<name>/mean and /std,
frac_reward_zero_std, completions/mean_length (min, max, clipped_ratio, mean_terminated_length), kl (β > 0), entropy,
clip_ratio/low_mean, low_min, high_mean, high_max, region_mean; with the trainer's loss and grad_norm.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

from archlab.data.corpora import jsonl_records
from archlab.data.formats import require
from archlab.data.prepare import held_out_indices
from archlab.data.prompts import PromptData, load_prompts
from archlab.errors import UserError
from archlab.models.decoder import LossOutput
from archlab.training import distributed as dist_util
from archlab.training.grpo import group_advantages, grpo_loss
from archlab.training.methods import rewards as reward_fns
from archlab.training.methods.base import METHODS, FinetuneRequest, Method
from archlab.training.methods.dpo import preference_settings
from archlab.training.methods.rollout import completion_logps, end_ids, gather_rollout, my_slots, rollout, slot_seed
from archlab.training.methods.staging import prepare_line_folder

__all__ = ["PROMPTS_FORMAT", "PROMPTS_FILE", "read_prompts", "GRPORun", "open_grpo", "prepare_grpo"]

PROMPTS_FORMAT = "prompts"                   # the data folder's format, as PPO's (write_line_folder)
PROMPTS_FILE = f"{PROMPTS_FORMAT}.jsonl"
PREFERENCE_KEYS = ("chosen", "rejected")


def _refuse_pairs(path: Path) -> None:
    """Preference pairs (chosen / rejected) given to --method grpo: a UserError naming the first such line."""
    for line, value in jsonl_records(path):
        if isinstance(value, dict) and all(k in value for k in PREFERENCE_KEYS):
            raise UserError(f"{path}:{line} is a preference pair (chosen / rejected): --method grpo reads prompt lines "
                            "({\"prompt\", ...}); train on pairs with --method dpo or --method reward")


def read_prompts(path: Path, tokenizer_dir: Path) -> PromptData:
    """The prompt lines of `path` (data/prompts.py: text as it is, messages through the chat template with the
    assistant's turn opened), preference pairs refused first."""
    _refuse_pairs(path)
    return load_prompts(path, tokenizer_dir)


def _columns(data: PromptData) -> set[str]:
    """The columns every line has."""
    return set.intersection(*(set(p.columns) for p in data.prompts))


def _check_data(data: PromptData, model_cfg: Any, cfg: Any) -> None:
    """What this run's settings need of the data and model: the end-of-text id, prompts + completion within the
    context, whole groups per step."""
    section = cfg.grpo
    if data.eot_id is None:
        raise UserError(f"the tokenizer of {data.tokenizer_dir} has no end-of-text token to end completions with")
    if model_cfg.arch != "decoder":
        raise UserError(f"--method grpo samples from decoder models, not arch={model_cfg.arch}")
    longest = max(data.prompts, key=lambda p: len(p.ids))
    if len(longest.ids) + section.max_completion_length > model_cfg.max_seq_len:
        raise UserError(f"{data.path}: the longest prompt ({len(longest.ids)} tokens, line {longest.line}) plus "
                        f"train.grpo.max_completion_length={section.max_completion_length} exceeds the model's "
                        f"context of {model_cfg.max_seq_len}")
    per_step = cfg.batch_size * cfg.grad_accum
    if per_step % section.num_generations:
        raise UserError(f"train.batch_size * train.grad_accum = {per_step} completions per step must be a multiple "
                        f"of train.grpo.num_generations={section.num_generations} (whole groups)")


def prepare_grpo(req: FinetuneRequest) -> tuple[Any, Path, Any]:
    """archlab finetune --method grpo: the rewards named on the command line loaded (FILE.py:FUNC), then the base
    staged and OUT/data written as a prompts folder (methods/staging.prepare_line_folder, as PPO's): every line read
    with the staged tokenizer, the rewards resolved against its columns and called once, before anything is written."""
    cfg = req.train_cfg
    if req.val is not None:
        raise UserError(f"--val {req.val}: --method grpo holds out --val-fraction of --data's lines "
                        "(train.grpo.val_fraction) instead")
    for spec in cfg.grpo.rewards:
        if reward_fns.is_code_spec(spec):
            reward_fns.load_user_reward(spec)              # the user's code, named on this command line

    def read(staged: Path) -> PromptData:
        data = read_prompts(req.data, staged)
        funcs = reward_fns.resolve(cfg.grpo.rewards, columns=_columns(data), format_regex=cfg.grpo.format_regex,
                                   policy_tokenizer=staged, data=req.data)
        reward_fns.probe(funcs, data)
        return data
    return prepare_line_folder(req, PROMPTS_FORMAT, {}, read)


class _Batches:
    """The trainer's view of the rollouts: at micro-step 0 the step's whole generation batch is sampled and scored
    (TRL's steps_per_generation = grad_accum), each micro-step takes its share. State: the equal-rewards streak."""

    def __init__(self, run: GRPORun):
        self.run = run
        self.buffer: list[dict[str, torch.Tensor]] = []

    def next(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if micro == 0:
            self.buffer = self.run.generation_batch(step)
        inputs = self.buffer[micro]
        return inputs, inputs["completion_ids"]

    def state_dict(self) -> dict:
        return {"equal_reward_steps": self.run.equal_steps}

    def load_state_dict(self, state: dict) -> None:
        self.run.equal_steps = int(state.get("equal_reward_steps", 0))


class GRPORun:
    """One GRPO run: the prompts, the rewards, the policy (set at `start`) and its frozen reference (β > 0)."""

    def __init__(self, data: PromptData, cfg: Any, funcs: list[reward_fns.RewardFunc], init_from: Any,
                 info: Any = None):
        from archlab.tokenizer.loading import load

        self.info = info if info is not None else dist_util.DistInfo()
        self.data, self.cfg, self.section, self.funcs, self.init_from = data, cfg, cfg.grpo, funcs, init_from
        self.train_data, self.val_data = data, data.without_prompts()
        self.tokenizer_dir: Path | None = data.tokenizer_dir
        self.tokenizer = load(data.tokenizer_dir)
        self.batches = _Batches(self)
        self.weights = torch.tensor(self.section.reward_weights or [1.0] * len(funcs))
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.vocab_limit: int | None = None
        self.end_ids = end_ids(data)                   # end-of-text, and a chat template's end of turn
        self.equal_steps = 0
        self._figures: dict[str, list[float]] = {}
        self._reward_model: dict[str, float] = {}      # reward runs' held-out accuracy, for the first log line
        # held-out prompts (train.grpo.val_fraction): a seeded hash of each line, as SFT's and DPO's splits
        self.val = held_out_indices(data.path, data.prompts, cfg.seed, self.section.val_fraction)
        held = set(self.val)
        self.pool = [i for i in range(len(data.prompts)) if i not in held]
        if not self.pool:
            raise UserError(f"{data.path}: train.grpo.val_fraction={self.section.val_fraction} holds out every prompt")

    # ---- the seam
    def extend(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {}

    def start(self, model: torch.nn.Module, run_dir: Path, *, resuming: bool, info: Any = None, **_: Any) -> None:
        """The policy to sample from; with β > 0 a frozen copy of the starting weights (on a resume: the base's
        weights from --init-from, adapters at zero) as the reference. Reward runs' held-out accuracy is said now,
        before the first step (rewards.announce_reward_runs)."""
        from archlab.generation.stepper import vocab_limit

        self._reward_model = reward_fns.announce_reward_runs(self.funcs, info if info is not None else self.info)
        self.model = model
        self.vocab_limit = vocab_limit(model, self.tokenizer)
        if self.section.beta == 0.0:
            return
        reference = copy.deepcopy(model)
        if resuming and self.init_from is not None:
            state = {k: v for k, v in self.init_from.state.items() if k in reference.state_dict()}
            reference.load_state_dict(state, strict=False)
            for name, p in reference.named_parameters():
                if name.endswith("lora_B"):
                    p.data.zero_()
        self.reference = reference.eval().requires_grad_(False)

    def check_resume(self, run_dir: Path) -> None:
        return None

    @torch.no_grad()
    def evaluate(self, model: Any, *, device: torch.device, dtype: str, info: Any) -> dict[str, float]:
        """The held-out prompts' figures: num_generations completions of each, sampled as in training from the same
        seed at every evaluation (so two evaluations differ by the weights alone): val_reward, val_reward_std,
        val_rewards/<name>/mean, val_frac_reward_zero_std; val_loss is -val_reward (lower is better, as the trainer
        reads it). {} without held-out prompts."""
        if not self.val:
            return {}
        group = self.section.num_generations
        _, per_func = self._sampled(self.val, -1)         # "step" -1: the same seeds at every evaluation
        rewards = (per_func * self.weights).sum(-1)                                              # (n,)
        _, zero_std = group_advantages(rewards, group, self.section.scale_rewards)
        out = {"val_loss": -float(rewards.mean()), "val_reward": float(rewards.mean()),
               "val_reward_std": float(rewards.std()), "val_frac_reward_zero_std": float(zero_std.float().mean())}
        out.update({f"val_rewards/{f.name}/mean": float(per_func[:, j].mean()) for j, f in enumerate(self.funcs)})
        return out

    # ---- a step's rollouts
    def _prompt_indices(self, step: int) -> list[int]:
        """The prompts of `step`: seeded passes over the lines, one permutation per epoch (a function of seed, step)."""
        n, per_step = len(self.pool), self.cfg.batch_size * self.cfg.grad_accum // self.section.num_generations
        out = []
        for k in range(step * per_step, (step + 1) * per_step):
            epoch, pos = divmod(k, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch))
            out.append(self.pool[int(order[pos])])
        return out

    def _completion_texts(self, tokens: list[list[int]]) -> list[str]:
        """Each completion's text without the token that ended it."""
        return [self.tokenizer.decode(t[:-1] if t and t[-1] in self.end_ids else t) for t in tokens]

    def _sample(self, index: list[int], seeds: list[int]) -> tuple[Any, torch.Tensor]:
        """(the Rollout of num_generations completions of each prompt in `index`, rewards per function (n, k)),
        sampled from the policy, each prompt's group from the generator seeded by its seed in `seeds`."""
        assert self.model is not None, "start() sets the policy before the first step"
        section, group = self.section, self.section.num_generations
        lines = [self.data.prompts[i] for i in index for _ in range(group)]
        out = rollout(self.model, [self.data.prompts[i].ids for i in index], group=group,
                      max_new_tokens=section.max_completion_length, eos_ids=self.end_ids, pad_id=self.end_ids[0],
                      seed=seeds, temperature=section.temperature, top_k=section.top_k or None,
                      top_p=section.top_p if section.top_p < 1 else None, vocab_limit=self.vocab_limit)
        if not index:
            return out, torch.zeros(0, len(self.funcs))
        tokens = out.completion_tokens()
        texts = self._completion_texts(tokens)
        prompts = [line.prompt for line in lines]
        if any(isinstance(p, list) for p in prompts):       # TRL's conversational form: the completion as a message
            completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        keys = sorted({k for line in lines for k in line.columns})
        columns = {k: [line.columns.get(k) for line in lines] for k in keys}
        per_func = torch.tensor([reward_fns.call(f, prompts, completions, tokens, columns,
                                                 prompt_ids=[line.ids for line in lines]) for f in self.funcs]
                                ).T                                                              # (n, k)
        return out, per_func

    def _sampled(self, index: list[int], step: int) -> tuple[Any, torch.Tensor]:
        """(the Rollout, rewards per function (n, k)) of every prompt in `index` (slot k's group seeded by (seed, step,
        k)), on every rank: under DDP this rank samples and scores its slots (rollout.my_slots) and the ranks' shares
        are gathered in slot order."""
        slots = my_slots(len(index), self.info)
        out, per_func = self._sample([index[k] for k in slots], [slot_seed(self.cfg.seed, step, k) for k in slots])
        out, extra = gather_rollout(out, slots, len(index), self.section.num_generations, self.end_ids[0], self.info,
                                    per_row={"rewards": per_func})
        return out, extra["rewards"]

    @torch.no_grad()
    def generation_batch(self, step: int) -> list[dict[str, torch.Tensor]]:
        """Sample, score and split the step's completions into grad_accum micro-batches of train.batch_size rows (this
        rank's share of each, with the reference's log-probs of those rows)."""
        section, group = self.section, self.section.num_generations
        out, per_func = self._sampled(self._prompt_indices(step), step)
        rewards = (per_func * self.weights).sum(-1)                                             # (n,)
        advantages, zero_std = group_advantages(rewards, group, section.scale_rewards)
        self._rollout_figures(per_func, rewards, zero_std, out.lengths, out.truncated)
        mask = out.completion_mask.clone()
        if section.mask_truncated_completions:
            mask = mask * (~out.truncated).long()[:, None]
        batch = {"prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask, "completion_ids": out.completion_ids,
                 "completion_mask": out.completion_mask, "loss_mask": mask,
                 "attention_mask": torch.cat([out.prompt_mask, out.completion_mask], 1),
                 "advantages": advantages.to(out.logps.device)}
        # dapo: the tokens of the whole generation batch, per micro-step (the trainer divides by grad_accum) and
        # per rank (DDP averages the ranks' gradients); bnpo: the micro-batch's tokens, on every rank
        world, rank, size = self.info.world_size, self.info.rank, self.cfg.batch_size
        items = mask.sum().float() / self.cfg.grad_accum
        if world > 1:
            items = items / world
        share = size // world                          # this rank's rows of each micro-batch
        mine = {k: v[torch.cat([torch.arange(m * size + rank * share, m * size + (rank + 1) * share)
                                for m in range(self.cfg.grad_accum)])] for k, v in batch.items()}
        if self.reference is not None:                 # on this rank's rows only
            mine["ref_logps"], _ = completion_logps(self.reference, mine["prompt_ids"], mine["prompt_mask"],
                                                    mine["completion_ids"], temperature=section.temperature,
                                                    completion_mask=mine["completion_mask"],
                                                    vocab_limit=self.vocab_limit, entropy=False)
        micros = []
        for m in range(self.cfg.grad_accum):
            micro = {k: v[m * share:(m + 1) * share] for k, v in mine.items()}
            micro["num_items"] = items
            if world > 1:
                micro["micro_items"] = mask[m * size:(m + 1) * size].sum().float()
            micros.append(micro)
        return micros

    def _rollout_figures(self, per_func: torch.Tensor, rewards: torch.Tensor, zero_std: torch.Tensor,
                         lengths: torch.Tensor, truncated: torch.Tensor) -> None:
        """TRL's per-generation-batch figures; the warning when every group's rewards have been equal for
        train.grpo.equal_rewards_warn_steps steps in a row (no group has anything to learn from)."""
        figures = {"reward": rewards.mean(), "reward_std": rewards.std(),
                   "frac_reward_zero_std": zero_std.float().mean()}
        for j, f in enumerate(self.funcs):
            figures[f"rewards/{f.name}/mean"] = per_func[:, j].mean()
            figures[f"rewards/{f.name}/std"] = per_func[:, j].std()
        lengths = lengths.float()
        terminated = lengths[~truncated] if bool((~truncated).any()) else torch.zeros(1)
        figures.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                        "completions/max_length": lengths.max(),
                        "completions/clipped_ratio": truncated.float().mean(),
                        "completions/mean_terminated_length": terminated.mean(),
                        "completions/min_terminated_length": terminated.min(),
                        "completions/max_terminated_length": terminated.max()})
        for name, value in figures.items():
            self._figures.setdefault(name, []).append(float(value))
        self.equal_steps = self.equal_steps + 1 if bool(zero_std.all()) else 0
        if self.equal_steps == self.section.equal_rewards_warn_steps:
            warnings.warn(f"every group's rewards have been equal for {self.equal_steps} steps (frac_reward_zero_std "
                          "= 1): the advantages are 0 and GRPO learns nothing; make the task easier or the rewards "
                          "finer, sample more (train.grpo.num_generations, temperature)", stacklevel=2)

    # ---- the loss
    def loss(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> LossOutput:
        section = self.section
        logps, entropy = completion_logps(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                          temperature=section.temperature, completion_mask=inputs["completion_mask"],
                                          vocab_limit=self.vocab_limit)
        out = grpo_loss(logps, None, inputs["advantages"], inputs["loss_mask"], loss_type=section.loss_type,
                        epsilon_low=section.epsilon, epsilon_high=section.epsilon_high, beta=section.beta,
                        ref_logps=inputs.get("ref_logps"), max_completion_length=section.max_completion_length,
                        num_items=inputs["num_items"], entropy=entropy.detach() if entropy is not None else None,
                        bias_correction_kl=section.use_bias_correction_kl)
        loss, figures = out.loss, out.figures
        if self.info.world_size > 1:
            tokens = inputs["loss_mask"].sum().float()
            if section.loss_type == "bnpo":          # this rank's tokens' mean -> its share of the micro-batch's
                loss = loss * tokens.clamp(min=1.0) * self.info.world_size / inputs["micro_items"].clamp(min=1.0)
            figures = _reduced_figures(figures, float(tokens), self.info)
        for name, value in figures.items():
            self._figures.setdefault(name, []).append(value)
        zero = loss.new_zeros(())
        return LossOutput(total=loss, ce=loss.detach(), z_loss=zero, aux_loss=zero)

    def log_fields(self) -> dict[str, float]:
        """Each figure's mean since the last log line (TRL averages its lists the same way)."""
        out = {name: sum(values) / len(values) for name, values in self._figures.items() if values}
        out.update(self._reward_model)                 # reward runs' held-out accuracy, on the first line only
        self._figures, self._reward_model = {}, {}
        return out


_EXTREMES = {"clip_ratio/low_min": -1.0, "clip_ratio/high_max": 1.0}   # min as the max of the negated values


def _reduced_figures(figures: dict[str, float], tokens: float, info: Any) -> dict[str, float]:
    """The loss's figures of a micro-batch split over the ranks: the masked means weighted by each rank's tokens,
    low_min and high_max as the ranks' min and max (what one process computes over the whole micro-batch)."""
    means = [k for k in figures if k not in _EXTREMES]
    sums = dist_util.all_reduce_sum([figures[k] * tokens for k in means] + [tokens], info)
    out = {k: s / max(sums[-1], 1.0) for k, s in zip(means, sums)}
    extremes = [k for k in figures if k in _EXTREMES]
    peaks = dist_util.all_reduce_max([figures[k] * _EXTREMES[k] for k in extremes], info)
    out.update({k: v * _EXTREMES[k] for k, v in zip(extremes, peaks)})
    return {k: out[k] for k in figures}


def open_grpo(model_cfg: Any, cfg: Any, data_dir: Path, init_from: Any, info: Any, *, progress: bool = True
              ) -> GRPORun:
    """The GRPORun of a prompts folder (archlab finetune --method grpo); UserError before any write for what this
    run cannot train."""
    if info.world_size > 1 and info.strategy != "ddp":
        raise UserError(f"train.method=grpo samples from the whole model on every rank: run it with "
                        f"dist.strategy=ddp, not {info.strategy}")
    if cfg.batch_size % info.world_size:
        raise UserError(f"train.batch_size={cfg.batch_size} (global) must be divisible by the world size "
                        f"{info.world_size}")
    if not require(data_dir, ("prompts",), who="train.method=grpo").folder:
        raise UserError(f"train.method=grpo reads a prompts folder from archlab finetune BASE --method grpo --data "
                        f"prompts.jsonl: {data_dir} is the file itself")
    data = read_prompts(data_dir / PROMPTS_FILE, data_dir / "tokenizer")
    _check_data(data, model_cfg, cfg)
    funcs = reward_fns.resolve(cfg.grpo.rewards, columns=_columns(data), format_regex=cfg.grpo.format_regex,
                               policy_tokenizer=data_dir / "tokenizer", data=data.path)
    if model_cfg.vocab_size < data.vocab_size:
        raise UserError(f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {data.vocab_size}")
    return GRPORun(data, cfg, funcs, init_from, info)


METHODS.register("grpo")(Method("grpo", "group relative policy optimization on prompts with rewards (TRL's GRPO)",
                                open_grpo, prepare=prepare_grpo, fit_settings=preference_settings,
                                data_help="prompt data is a .jsonl file of {\"prompt\", ...} lines",
                                data_formats=("prompts",)))
