"""A `finetune` run of the lab (a suite with `runs: finetune`): the post-training demo's stages 1-2 as one row.

    1. the base     pretrained once per distinct BaseSpec (model + pretraining settings, archlab.lab.plan) into
                    SWEEP/bases/<hash>/run by archlab.lab.bases: every run (and seed, unless `finetune.bases:
                    per_seed`) reuses it
    2. fine-tuning  archlab.training.finetune on the data folder's SFT examples (archlab.data.reverse_words
                    SFT_FILE) with the run's TrainConfig: full fine-tuning, or LoRA with train.lora
    3. scoring      greedy answers to held-out words (archlab.eval.reverse_words.score_reversal): `exact_match`
                    (case ignored) and `preferred_case` in the row's extra; final_val_loss is the SFT validation loss
    4. RLVR         only with `finetune.rlvr` (archlab.lab.plan.RLVR_SETTINGS): pass@k of sampled answers of the
                    fine-tuned model, GRPO from it with the exact-match reward (the post-training demo's GRPO stage)
                    into the sibling folder RUN-grpo, pass@k again: `pass_before` / `pass_after` ({"pass@k": ..})
                    and the gains `pass1_gain`, `passk_gain` (k = rlvr.samples) and `passk_share` (their ratio)

The data folder is what data.reverse_words.prepare_task_folder writes (a sweep prepares it as corpus "reverse-words").
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from archlab.errors import UserError
from archlab.lab import bases
from archlab.lab.bases import BASE_RECORD
from archlab.lab.plan import RLVR_SETTINGS, BaseSpec, RunJob
from archlab.lab.store import RunRecord

__all__ = ["finetune_job", "ensure_base", "rlvr_stage", "BASE_RECORD"]


def ensure_base(spec: BaseSpec, data: Path) -> tuple[Path, dict]:
    """The base's run folder and its record (archlab.lab.bases.ensure_base) with `exact_plain`: the base's held-out
    exact match in the pretraining text's own format, scored once when it is built."""
    from archlab.data.reverse_words import reverse_problems
    from archlab.eval.reverse_words import score_plain

    return bases.ensure_base(spec, data, lambda run_dir: {
        "exact_plain": score_plain(run_dir, reverse_problems(spec.test_words or 1))})


def finetune_job(job: RunJob, train_and_measure: Callable[..., RunRecord],
                 failed: Callable[[RunRecord, BaseException, float], RunRecord]) -> RunRecord:
    """One finetune row: the base (built or reused), fine-tuning (continued from its last checkpoint), scores.
    The worker hands in its own train_and_measure and failed (archlab.lab.worker), so this module does not import it.
    Example: worker.RUN_KINDS["finetune"](job) -> finetune_job(job, train_and_measure, failed)"""
    from archlab.data.reverse_words import SFT_FILE, reverse_problems
    from archlab.eval.reverse_words import score_reversal
    from archlab.training.finetune import finetune

    run, record, spec = job.run, job.record, job.run.base
    assert spec is not None, "a finetune run is planned with its base"
    t0 = time.perf_counter()
    sft = Path(job.data) / SFT_FILE

    def check_sft() -> None:
        if not sft.is_file():
            raise UserError(f"{job.data} holds no {SFT_FILE}: a finetune suite reads the data of "
                            "archlab.data.reverse_words.prepare_task_folder (corpus reverse-words)")

    got = bases.run_base(job, failed, t0, build=ensure_base, check=check_sft)
    if isinstance(got, RunRecord):
        return got
    base_dir, base = got
    record.extra["base_exact_plain"] = base.get("exact_plain")

    def fine_tune(model, train_cfg, data, run_dir, *, resume, progress):
        return finetune(base_dir, sft, run_dir, train_cfg=train_cfg, resume=resume, progress=progress)

    record = train_and_measure(job.suite, run, job.data, record, fine_tune, measure=False)
    if record.status == "done":
        try:
            scores = score_reversal(run.run_dir, reverse_problems(spec.test_words))
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not lose the run
            record.extra["measure_error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.extra.update({"exact_match": scores["exact"], "preferred_case": scores["preferred"],
                                 "test_words": spec.test_words})
        rlvr = (job.suite.finetune or {}).get("rlvr")
        if rlvr is not None and "measure_error" not in record.extra:
            try:
                record.extra.update(rlvr_stage(run.run_dir, reverse_problems(spec.test_words), rlvr,
                                               seed=run.seed, device=run.train.device))
            except Exception as exc:  # noqa: BLE001 - a failed stage must not lose the run
                record.extra["measure_error"] = f"rlvr: {type(exc).__name__}: {exc}"
    record.wall_s = time.perf_counter() - t0
    return record


def pass_ks(samples: int) -> tuple[int, ...]:
    """The k of a pass@k curve from `samples` answers: the powers of two below it, and itself.
    Example: pass_ks(16) -> (1, 2, 4, 8, 16); pass_ks(6) -> (1, 2, 4, 6)"""
    return tuple(k for k in (2 ** i for i in range(samples.bit_length())) if k < samples) + (samples,)


def rlvr_stage(sft_dir: Path, words: list[str], settings: dict, *, seed: int, device: str) -> dict:
    """RL with a verifiable reward from the fine-tuned model in `sft_dir`: pass@k on `words` before, GRPO with the
    exact-match reward (the post-training demo's GRPO settings, `settings` over RLVR_SETTINGS) into sft_dir-grpo,
    pass@k after, both sampled with the same seed at GRPO's temperature.
    Example: rlvr_stage(run_dir, reverse_problems(200), {"steps": 60}, seed=0, device="cpu")["pass1_gain"]"""
    from archlab.data.reverse_words import write_grpo_prompts
    from archlab.eval.reverse_words import sample_reversal
    from archlab.training.config import TrainConfig
    from archlab.training.finetune import finetune
    from archlab.training.recipes import reverse_words

    s = {**RLVR_SETTINGS, **settings}
    demo = reverse_words(quick=False, seed=seed)["grpo"]
    cfg = TrainConfig.from_dict({**demo.to_dict(), "budget": s["steps"], "device": device})
    ks = pass_ks(s["samples"])
    out, data = sft_dir.with_name(sft_dir.name + "-grpo"), sft_dir.with_name(sft_dir.name + "-grpo-prompts")
    for folder in (out, data):                      # a stage cut short before: start it over
        if folder.exists():
            shutil.rmtree(folder)
    data.mkdir(parents=True)
    prompts = write_grpo_prompts(data, s["prompts"], seed=seed)

    def sample(folder: Path) -> dict[str, float]:
        return sample_reversal(folder, words, samples=s["samples"], temperature=cfg.grpo.temperature, seed=seed,
                               ks=ks)

    before = sample(sft_dir)
    t0 = time.perf_counter()
    finetune(sft_dir, prompts, out, train_cfg=cfg, method="grpo", progress=False)
    seconds = time.perf_counter() - t0
    after = sample(out)
    top = f"pass@{s['samples']}"
    gain1, gaink = after["pass@1"] - before["pass@1"], after[top] - before[top]
    return {"pass_before": before, "pass_after": after, "pass1_gain": gain1, "passk_gain": gaink,
            "passk_share": gaink / gain1 if gain1 else None, "rlvr_k": s["samples"], "rlvr_steps": s["steps"],
            "grpo_s": seconds}
