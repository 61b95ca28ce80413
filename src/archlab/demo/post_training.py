"""`archlab demo --post-training`: the notes' three training stages on one tiny model, in a few minutes of CPU.

    1. pretraining     a 0.6M-parameter decoder reads plain-text documents `reverse abcde` / `edcba` (one per
                       document, `train.document_masks`): the base knows the task as text, never as a chat turn
    2. instruction     `finetune` on chat examples `reverse abcde` -> `edcba` through the ChatML template, the
       tuning (SFT)    loss on the answers only; two annotators wrote them, one in lowercase and one in capitals
    3. preference      DPO on pairs that prefer the lowercase answer to the capitals, the SFT model the reference
       tuning (DPO)

Reported on 200 held-out words (never in any training line): exact match, case ignored, of the base through the
chat template, of the SFT and of the DPO model (greedy; target: ~0% -> >= 90%), and the base's in its own plain
format; the share of answers in the preferred case before and after DPO (SFT leaves it to chance, DPO should make
it nearly all); DPO's logged reward accuracy; the three stages' loss curves in post_training.png. The notes' point:
instruction tuning teaches the format of a task the pretrained model can already do.

What was measured while choosing this (2-core CPU): the words have one length and each document or packed example
starts at position 0, so with learned absolute positions (GPT-2's) reversing is a fixed map from answer slot to
word slot. A base pretrained on lines of plain words instead stayed at 0-1% after 300 SFT steps (its attention
had learned to look locally); from a fresh init SFT found the map after a plateau whose length varied by seed
(100%, 100%, 45% at 200 steps); with RoPE the plateau outlasted 300 steps. DPO's learning rate is 1e-4: at 1e-3 the
loss reached 1e-4 within 60 steps while both answers' likelihoods fell, and held-out exact match dropped from 100%
to 18% (the likelihood displacement DPO is known for).
"""
from __future__ import annotations

import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.config import ModelConfig
from archlab.training.trainer import TrainConfig

__all__ = ["PostTrainingResult", "post_training_configs", "run_post_training_demo", "reverse_problems",
           "prepare_base_data", "prepare_task_folder", "score_reversal", "score_plain", "CORPUS", "SFT_FILE"]

WORD_LENGTH = 5
LETTERS = "abcdefghijklmnopqrstuvwxyz"
INSTRUCTION = "reverse "
TEMPLATE = "chatml"
CORPUS = "reverse-words"     # the name a lab sweep prepares this task's data under (archlab.lab.runner.ensure_data)
SFT_FILE = "sft.jsonl"


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
    stage_seconds: dict
    seconds: float


# ---- the task ------------------------------------------------------------------------------------------------
def _held_out(word: str) -> bool:
    return zlib.crc32(word.encode()) % 10 == 0


def _words(rng: random.Random, held_out: bool):
    while True:
        word = "".join(rng.choice(LETTERS) for _ in range(WORD_LENGTH))
        if _held_out(word) == held_out:
            yield word


def reverse_problems(n: int, seed: int = 1234) -> list[str]:
    """`n` held-out words: no training line of any stage holds them. Example: reverse_problems(3) -> three
    five-letter words, the same on every call"""
    words = _words(random.Random(seed), held_out=True)
    return [next(words) for _ in range(n)]


def _user(word: str) -> list[dict]:
    return [{"role": "user", "content": INSTRUCTION + word}]


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_task_data(out: Path, *, sft_examples: int, dpo_pairs: int, seed: int = 0) -> tuple[Path, Path]:
    """sft.jsonl (messages: the answer reversed, in lowercase or capitals by a coin) and dpo.jsonl (prompt /
    chosen = lowercase / rejected = capitals) under `out`."""
    rng = random.Random(seed)
    words = _words(rng, held_out=False)
    sft = []
    for _ in range(sft_examples):
        word = next(words)
        answer = word[::-1] if rng.random() < 0.5 else word[::-1].upper()
        sft.append({"messages": _user(word) + [{"role": "assistant", "content": answer}]})
    pairs = []
    for _ in range(dpo_pairs):
        word = next(words)
        pairs.append({"prompt": _user(word), "chosen": [{"role": "assistant", "content": word[::-1]}],
                      "rejected": [{"role": "assistant", "content": word[::-1].upper()}]})
    _write_jsonl(out / SFT_FILE, sft)
    _write_jsonl(out / "dpo.jsonl", pairs)
    return out / SFT_FILE, out / "dpo.jsonl"


def plain_prompt(word: str) -> str:
    """The task as the pretraining text writes it: the instruction, a line break, then the answer."""
    return f"{INSTRUCTION}{word}\n"


def _base_documents(n_docs: int, seed: int = 0) -> list[str]:
    """Pretraining text: one `reverse WORD` / reversal pair per document, lowercase, training words only."""
    words = _words(random.Random(seed + 1), held_out=False)
    return [plain_prompt(w) + w[::-1] for w in (next(words) for _ in range(n_docs))]


# ---- configs ---------------------------------------------------------------------------------------------------
def post_training_configs(*, quick: bool) -> dict[str, Any]:
    """The model and the three stages' training settings; `quick` shrinks the steps to seconds (for tests).
    Example: post_training_configs(quick=False)["sft"].budget -> 200"""
    model = ModelConfig(name="demo-post-training", vocab_size=260, d_model=96 if quick else 128, n_layers=2,
                        max_seq_len=128, attention={"n_heads": 4},
                        mlp={"activation": "swiglu", "d_ff": 256 if quick else 512},
                        norm={"kind": "rmsnorm"}, position={"kind": "learned"})
    common = dict(weight_decay=0.0, eval_batches=4, checkpoint_every=100_000, keep_last=1, sample_every=-1,
                  device="cpu", dtype="float32", budget_unit="steps")
    steps = {"base": 8, "sft": 12, "dpo": 6} if quick else {"base": 200, "sft": 200, "dpo": 40}
    return {
        "model": model,
        "base": TrainConfig(lr=3e-3, warmup_steps=min(10, steps["base"]), batch_size=32, seq_len=64,
                            budget=steps["base"], document_masks=True,
                            eval_every=max(4, steps["base"] // 3), log_every=max(2, steps["base"] // 30), **common),
        "sft": TrainConfig(lr=3e-3, warmup_steps=min(20, steps["sft"]), batch_size=32, seq_len=128,
                           budget=steps["sft"],
                           eval_every=max(4, steps["sft"] // 6), log_every=max(2, steps["sft"] // 60), **common),
        "dpo": TrainConfig(lr=1e-4, warmup_steps=5, batch_size=16, seq_len=64, budget=steps["dpo"],
                           eval_every=max(3, steps["dpo"] // 4), log_every=max(1, steps["dpo"] // 30),
                           objective="dpo", dpo_beta=0.1, **common),
        "sft_examples": 400 if quick else 24_000,
        "dpo_pairs": 200 if quick else 4_000,
        "test_words": 40 if quick else 200,
    }


# ---- scoring ---------------------------------------------------------------------------------------------------
def score_reversal(folder: Path, words: list[str]) -> dict[str, float]:
    """Greedy answers of the model in `folder` (a run folder with a chat template) to `reverse WORD`:
    exact (the reversal, case ignored) and preferred (exactly the lowercase reversal)."""
    import torch

    from archlab.generation.chat import end_of_turn_ids
    from archlab.generation.decode import generate
    from archlab.runs.model_folder import load_model_and_tokenizer
    from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template

    model, tokenizer = load_model_and_tokenizer(folder)
    chat = ChatTokenizer.of(folder)
    prompts = apply_chat_template(chat, [_user(w) for w in words], add_generation_prompt=True)
    ids = torch.tensor(prompts)                 # (n, t): every prompt has the same length (one word length)
    end = end_of_turn_ids(chat)
    out = generate(model, ids, max_new_tokens=WORD_LENGTH + 1, eos_token_id=end)     # (n, t + k)
    exact = preferred = 0
    for word, row in zip(words, out[:, ids.shape[1]:].tolist()):
        answer = tokenizer.decode([i for i in row if i not in end]).strip()
        exact += answer.lower() == word[::-1]
        preferred += answer == word[::-1]
    return {"exact": exact / len(words), "preferred": preferred / len(words)}


def score_plain(folder: Path, words: list[str]) -> float:
    """Greedy exact match of the model in `folder` on the task in the pretraining text's own format."""
    import torch

    from archlab.generation.decode import generate
    from archlab.runs.model_folder import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(folder)
    ids = torch.tensor([tokenizer.encode(plain_prompt(w)) for w in words])          # (n, t), one length
    out = generate(model, ids, max_new_tokens=WORD_LENGTH)                          # (n, t + 5)
    answers = [tokenizer.decode(row) for row in out[:, ids.shape[1]:].tolist()]
    return sum(a == w[::-1] for a, w in zip(answers, words)) / len(words)


def plot_stages(out: Path, png: Path) -> None:
    """The three stages' training loss side by side (validation points where logged), DPO's reward accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archlab.training.metrics import read_metrics

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
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
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---- the demo --------------------------------------------------------------------------------------------------
def prepare_base_data(folder: Path, n_docs: int, progress: bool) -> int:
    """A byte-level tokenizer with ChatML's tokens and template (as base models ship theirs, untrained) and the
    base corpus prepared with it into `folder`; its vocabulary size. Example: prepare_base_data(Path("d"), 2_000,
    False) -> 259"""
    from archlab.data.prepare import prepare
    from archlab.tokenizer import Tokenizer
    from archlab.tokenizer.chat_builtin import add_chat_tokens, install_chat_template

    tokenizer, _ = add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]), TEMPLATE)
    meta = prepare(_base_documents(n_docs), tokenizer, folder, num_workers=0, progress=progress,
                   corpus_name="reverse-a-word documents")
    install_chat_template(Path(folder) / "tokenizer", TEMPLATE)     # the tokens are there: writes the template
    return int(meta["vocab_size"])


def prepare_task_folder(folder: Path, *, quick: bool = False, progress: bool = True) -> Path:
    """The demo's first two stages' data in one folder, what a lab `finetune` run reads (archlab.lab.finetune):
    the base corpus prepared (meta.json, token shards, tokenizer/ with the ChatML template) and SFT_FILE, the
    SFT examples, at the demo's sizes (`quick`: the test sizes). Example: prepare_task_folder(Path("d"), quick=True)"""
    folder = Path(folder)
    prepare_base_data(folder, 2_000 if quick else 40_000, progress)
    cfg = post_training_configs(quick=quick)
    write_task_data(folder, sft_examples=cfg["sft_examples"], dpo_pairs=0)
    (folder / "dpo.jsonl").unlink()                              # no preference stage in the lab
    return folder


def run_post_training_demo(out: str | Path = "runs/demo-post-training", *, quick: bool = False,
                           progress: bool = True, log=print) -> PostTrainingResult:
    """Pretrain, instruction-tune and preference-tune a tiny model into `out` (base/, sft/, dpo/ run folders);
    print each stage's figures and return them. Example: run_post_training_demo("runs/p", quick=True).exact_sft"""
    from archlab.demo.stages import _prepare_out
    from archlab.training.finetune import finetune
    from archlab.training.init_from import read_init_source
    from archlab.training.metrics import read_metrics
    from archlab.training.trainer import train

    out = Path(out)
    cfg = post_training_configs(quick=quick)
    t0 = time.time()
    _prepare_out(out)
    words = reverse_problems(cfg["test_words"])
    seconds: dict[str, float] = {}

    log(f"[1/4] pretraining the base: {cfg['base'].budget} steps on plain-text documents '{INSTRUCTION}abcde' / "
        f"'edcba' ({WORD_LENGTH}-letter words; a byte-level tokenizer carrying ChatML's tokens, untrained)")
    data = out / "data"
    vocab_size = prepare_base_data(data, 2_000 if quick else 40_000, progress)
    model_cfg = cfg["model"].with_overrides({"vocab_size": vocab_size})
    t = time.time()
    train(model_cfg, cfg["base"], data, out / "base", progress=progress)
    seconds["base"] = time.time() - t
    base = score_reversal(out / "base", words)
    base_plain = score_plain(out / "base", words)
    log(f"      {_parameters(out / 'base'):,} parameters, {seconds['base']:.0f} s; held-out exact match of the base: "
        f"{base_plain:.0%} in its pretraining format, {base['exact']:.0%} through the chat template")

    sft_file, dpo_file = write_task_data(out, sft_examples=cfg["sft_examples"], dpo_pairs=cfg["dpo_pairs"])
    log(f"[2/4] instruction tuning: {cfg['sft'].budget} steps on {cfg['sft_examples']:,} chat examples "
        f"'{INSTRUCTION}abcde' -> 'edcba' (half the answers in capitals), loss on the answers, examples packed")
    t = time.time()
    finetune(out / "base", sft_file, out / "sft", train_cfg=cfg["sft"], progress=progress)
    seconds["sft"] = time.time() - t
    sft = score_reversal(out / "sft", words)
    log(f"      {seconds['sft']:.0f} s; held-out exact match (case ignored) {base['exact']:.0%} -> {sft['exact']:.0%}; "
        f"answers in lowercase {sft['preferred']:.0%}")

    log(f"[3/4] preference tuning (DPO, beta {cfg['dpo'].dpo_beta:g}): {cfg['dpo'].budget} steps on "
        f"{cfg['dpo_pairs']:,} pairs preferring the lowercase answer; the SFT model is the reference")
    source = read_init_source(out / "sft")
    t = time.time()
    train(source.model_config, cfg["dpo"], dpo_file, out / "dpo", progress=progress, init_from=source)
    seconds["dpo"] = time.time() - t
    dpo = score_reversal(out / "dpo", words)
    rows = read_metrics(out / "dpo" / "metrics.jsonl")
    accuracy = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r]
    held = [r["val_rewards/accuracies"] for r in rows if "val_rewards/accuracies" in r]
    last = accuracy[-1] if accuracy else float("nan")
    on_held = f", on held-out pairs {held[-1]:.0%}" if held else ""
    log(f"      {seconds['dpo']:.0f} s; answers in the preferred case {sft['preferred']:.0%} -> "
        f"{dpo['preferred']:.0%}, exact match {dpo['exact']:.0%}; last reward accuracy {last:.0%}{on_held}")

    plot_stages(out, out / "post_training.png")
    total = time.time() - t0
    log(f"[4/4] {len(words)} held-out words; loss curves in {out / 'post_training.png'}; {total:.0f} s in all")
    log(f"next: archlab chat {out / 'dpo'} --max-new-tokens 8   (type: {INSTRUCTION}hello)")
    return PostTrainingResult(out, base_plain, base["exact"], sft["exact"], dpo["exact"], sft["preferred"],
                              dpo["preferred"], last, seconds, total)


def _parameters(run_dir: Path) -> int:
    from archlab.runs.model_folder import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(run_dir, need_tokenizer=False)
    return sum(p.numel() for p in model.parameters())

