"""`archlab demo --post-training`: the notes' training stages on one tiny model, in a few minutes of CPU.

    1. pretraining     a 0.6M-parameter decoder reads plain-text documents `reverse abcde` / `edcba` (one per
                       document, `train.document_masks`): the base knows the task as text, never as a chat turn
    2. instruction     `finetune` on chat examples `reverse abcde` -> `edcba` through the ChatML template, the
       tuning (SFT)    loss on the answers only; two annotators wrote them, one in lowercase and one in capitals
    3. preference      DPO on pairs that prefer the lowercase answer to the capitals, the SFT model the reference
       tuning (DPO)
    4. RL with a       GRPO from the SFT model (as DPO starts from it), rewarded 1 when a sampled answer is exactly
       verifiable      the lowercase reversal: the same goal as DPO's, reached by sampling and a checkable reward
       reward (GRPO)   instead of written pairs

Reported on 200 held-out words (never in any training line): exact match, case ignored, of the base through the
chat template, of the SFT and of the DPO model (greedy; target: ~0% -> >= 90%), and the base's in its own plain
format; the share of answers in the preferred case before and after DPO (SFT leaves it to chance, DPO should make
it nearly all); DPO's logged reward accuracy; GRPO's greedy exact match (lowercase) and pass@1 / pass@8 of 8 answers
sampled at temperature 1, of the SFT and the GRPO model; the curves and pass@k in post_training.png. The notes'
point: instruction tuning teaches the format of a task the pretrained model can already do; RL with a verifiable
reward raises pass@1 far more than pass@8 (it sharpens what the model could already sample).

The task's text and held-out words are archlab.data.reverse_words, its scorers archlab.eval.reverse_words, the
model and the stages' settings (and why them) archlab.training.recipes.reverse_words.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from archlab.data.reverse_words import (
    INSTRUCTION,
    WORD_LENGTH,
    prepare_base_data,
    reverse_problems,
    write_grpo_prompts,
    write_task_data,
)
from archlab.eval.reverse_words import sample_reversal, score_plain, score_reversal
from archlab.training import recipes

__all__ = ["PostTrainingResult", "run_post_training_demo", "plot_stages"]


@dataclass
class PostTrainingResult:
    run_dir: Path
    exact_base_plain: float      # held-out exact match of the base in the pretraining text's format
    exact_base: float            # held-out exact match through the chat template, case ignored
    exact_sft: float
    exact_dpo: float
    preferred_sft: float         # share of held-out answers exactly the preferred (lowercase) reversal
    preferred_dpo: float
    dpo_reward_accuracy: float   # the last logged rewards/accuracies of DPO (TRL's name)
    exact_grpo: float            # greedy answers exactly the lowercase reversal after GRPO (preferred_sft before)
    pass_sft: dict               # {"pass@1", "pass@8"} of 8 answers sampled at temperature 1 per held-out word
    pass_grpo: dict
    stage_seconds: dict          # wall seconds per stage
    stage_cpu_seconds: dict      # this process's CPU seconds per stage (what a shared machine does not inflate)
    seconds: float
    cpu_seconds: float


def plot_stages(out: Path, png: Path, passes: dict[str, dict] | None = None) -> None:
    """The first three stages' training loss side by side (validation points where logged), DPO's reward accuracy,
    GRPO's mean reward per step, and `passes` ({"SFT": {"pass@1": .., "pass@8": ..}, "GRPO": ...}) as bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archlab.training.metrics import read_metrics

    fig, axes = plt.subplots(1, 5, figsize=(21, 3.6))
    titles = {"base": "1. pretraining (next token)", "sft": "2. SFT (answer tokens)", "dpo": "3. DPO"}
    for ax, (stage, title) in zip(axes, titles.items()):
        rows = read_metrics(out / stage / "metrics.jsonl")
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if train:
            ax.plot(*zip(*train), label="train loss", color="C0")
        if val:
            ax.plot(*zip(*val), "o--", label="val loss", color="C1", markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylim(bottom=0)
        if stage == "dpo":
            acc = [(r["step"], r["rewards/accuracies"]) for r in rows if "rewards/accuracies" in r]
            held = [(r["step"], r["val_rewards/accuracies"]) for r in rows if "val_rewards/accuracies" in r]
            if acc:
                twin = ax.twinx()
                twin.plot(*zip(*acc), label="rewards/accuracies", color="C2", linestyle=":")
                if held:
                    twin.plot(*zip(*held), "s", label="held-out", color="C2", markersize=4)
                twin.set_ylim(0, 1.05)
                twin.set_ylabel("reward accuracy")
                twin.legend(loc="center right", fontsize=8)
        ax.legend(loc="lower left" if stage == "dpo" else "upper right", fontsize=8)
    axes[0].set_ylabel("loss (nats)")
    rows = read_metrics(out / "grpo" / "metrics.jsonl") if (out / "grpo" / "metrics.jsonl").exists() else []
    reward = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    if reward:
        axes[3].plot(*zip(*reward), label="reward (exact match, sampled)", color="C3")
    axes[3].set(title="4. GRPO", xlabel="step", ylim=(0, 1.05))
    axes[3].legend(loc="lower right", fontsize=8)
    _plot_passes(axes[4], passes or {})
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _plot_passes(ax, passes: dict[str, dict]) -> None:
    """Grouped bars: pass@k (x) of each model (bars), held-out words."""
    ks = sorted({k for p in passes.values() for k in p}, key=lambda k: int(k.split("@")[1]))
    width = 0.8 / max(1, len(passes))
    for i, (name, p) in enumerate(passes.items()):
        xs = [j + i * width for j in range(len(ks))]
        bars = ax.bar(xs, [p[k] for k in ks], width, label=name, color=f"C{i + 4}")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks([j + width * (len(passes) - 1) / 2 for j in range(len(ks))], ks)
    ax.set(title="held-out pass@k (temperature 1)", ylim=(0, 1.3))
    ax.legend(loc="upper center", ncol=max(1, len(passes)), fontsize=8)


# ---- the demo --------------------------------------------------------------------------------------------------
def run_post_training_demo(out: str | Path = "runs/demo-post-training", *, quick: bool = False, seed: int = 0,
                           progress: bool = True, log=print) -> PostTrainingResult:
    """Pretrain, instruction-tune, preference-tune (DPO) and RL-tune (GRPO) a tiny model into `out` (base/, sft/,
    dpo/, grpo/ run folders); print each stage's figures and return them. `seed`: the model's init and the stages'
    data order.
    Example: run_post_training_demo("runs/p", quick=True, seed=1).exact_sft"""
    from archlab.demo.stages import _prepare_out
    from archlab.training.finetune import finetune
    from archlab.training.init_from import read_init_source
    from archlab.training.metrics import read_metrics
    from archlab.training.trainer import train

    out = Path(out)
    cfg = recipes.reverse_words(quick=quick, seed=seed)
    t0, c0 = time.time(), time.process_time()
    _prepare_out(out)
    words = reverse_problems(cfg["test_words"])
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}

    log(f"[1/5] pretraining the base: {cfg['base'].budget} steps on plain-text documents '{INSTRUCTION}abcde' / "
        f"'edcba' ({WORD_LENGTH}-letter words; a byte-level tokenizer carrying ChatML's tokens, untrained)")
    data = out / "data"
    vocab_size = prepare_base_data(data, cfg["base_documents"], progress)
    model_cfg = cfg["model"].with_overrides({"vocab_size": vocab_size})
    t, c = time.time(), time.process_time()
    train(model_cfg, cfg["base"], data, out / "base", progress=progress)
    seconds["base"], cpu["base"] = time.time() - t, time.process_time() - c
    base = score_reversal(out / "base", words)
    base_plain = score_plain(out / "base", words)
    log(f"      {_parameters(out / 'base'):,} parameters, {seconds['base']:.0f} s; held-out exact match of the base: "
        f"{base_plain:.0%} in its pretraining format, {base['exact']:.0%} through the chat template")

    sft_file, dpo_file = write_task_data(out, sft_examples=cfg["sft_examples"], dpo_pairs=cfg["dpo_pairs"])
    log(f"[2/5] instruction tuning: {cfg['sft'].budget} steps on {cfg['sft_examples']:,} chat examples "
        f"'{INSTRUCTION}abcde' -> 'edcba' (half the answers in capitals), loss on the answers, examples packed")
    t, c = time.time(), time.process_time()
    finetune(out / "base", sft_file, out / "sft", train_cfg=cfg["sft"], progress=progress)
    seconds["sft"], cpu["sft"] = time.time() - t, time.process_time() - c
    sft = score_reversal(out / "sft", words)
    log(f"      {seconds['sft']:.0f} s; held-out exact match (case ignored) {base['exact']:.0%} -> {sft['exact']:.0%}; "
        f"answers in lowercase {sft['preferred']:.0%}")

    log(f"[3/5] preference tuning (DPO, beta {cfg['dpo'].dpo.beta:g}): {cfg['dpo'].budget} steps on "
        f"{cfg['dpo_pairs']:,} pairs preferring the lowercase answer; the SFT model is the reference")
    source = read_init_source(out / "sft")
    t, c = time.time(), time.process_time()
    train(source.model_config, cfg["dpo"], dpo_file, out / "dpo", progress=progress, init_from=source)
    seconds["dpo"], cpu["dpo"] = time.time() - t, time.process_time() - c
    dpo = score_reversal(out / "dpo", words)
    rows = read_metrics(out / "dpo" / "metrics.jsonl")
    accuracy = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r]
    held = [r["val_rewards/accuracies"] for r in rows if "val_rewards/accuracies" in r]
    last = accuracy[-1] if accuracy else float("nan")
    on_held = f", on held-out pairs {held[-1]:.0%}" if held else ""
    log(f"      {seconds['dpo']:.0f} s; answers in the preferred case {sft['preferred']:.0%} -> "
        f"{dpo['preferred']:.0%}, exact match {dpo['exact']:.0%}; last reward accuracy {last:.0%}{on_held}")

    grpo_cfg = cfg["grpo"]
    section = grpo_cfg.grpo
    log(f"[4/5] RL with a verifiable reward (GRPO from the SFT model): {grpo_cfg.budget} steps of "
        f"{grpo_cfg.batch_size // section.num_generations} prompts x {section.num_generations} sampled answers, "
        "reward 1 when an answer is exactly the lowercase reversal")
    grpo_file = write_grpo_prompts(out, cfg["grpo_prompts"])
    samples = section.num_generations
    pass_sft = sample_reversal(out / "sft", words, samples=samples, temperature=section.temperature, seed=seed)
    t, c = time.time(), time.process_time()
    finetune(out / "sft", grpo_file, out / "grpo", train_cfg=grpo_cfg, method="grpo", progress=progress)
    seconds["grpo"], cpu["grpo"] = time.time() - t, time.process_time() - c
    grpo = score_reversal(out / "grpo", words)
    pass_grpo = sample_reversal(out / "grpo", words, samples=samples, temperature=section.temperature, seed=seed)
    k = f"pass@{samples}"
    log(f"      {seconds['grpo']:.0f} s ({cpu['grpo']:.0f} s CPU); held-out exact match (greedy, lowercase) "
        f"{sft['preferred']:.0%} -> {grpo['preferred']:.0%}; sampled: pass@1 {pass_sft['pass@1']:.1%} -> "
        f"{pass_grpo['pass@1']:.1%}, {k} {pass_sft[k]:.1%} -> {pass_grpo[k]:.1%}")

    plot_stages(out, out / "post_training.png", {"SFT": pass_sft, "GRPO": pass_grpo})
    total, total_cpu = time.time() - t0, time.process_time() - c0
    log(f"[5/5] {len(words)} held-out words; curves and pass@k in {out / 'post_training.png'}; {total:.0f} s in all "
        f"({total_cpu:.0f} s CPU of this process)")
    log(f"next: archlab chat {out / 'dpo'} --max-new-tokens 8   (type: {INSTRUCTION}hello)")
    return PostTrainingResult(out, base_plain, base["exact"], sft["exact"], dpo["exact"], sft["preferred"],
                              dpo["preferred"], last, grpo["preferred"], pass_sft, pass_grpo, seconds, cpu, total,
                              total_cpu)


def _parameters(run_dir: Path) -> int:
    from archlab.runs.model_folder import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(run_dir, need_tokenizer=False)
    return sum(p.numel() for p in model.parameters())

