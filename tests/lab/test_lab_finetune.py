"""The lab's `finetune` run kind: a base pretrained once per distinct base config and shared, fine-tuned per run
(full or LoRA), scored on held-out words; the rows carry exact_match and the SFT validation loss, and the report
renders them. Tiny budgets: a few steps each."""
import json
import threading
import time

import pytest

from archlab.config import ConfigError
from archlab.data import reverse_words
from archlab.lab import bases as lab_bases
from archlab.lab import finetune as lab_finetune
from archlab.lab import suites
from archlab.lab.plan import plan
from archlab.lab.report import build_report
from archlab.lab.runner import run_suite
from archlab.lab.store import ResultStore
from archlab.runs.lock import RunLock
from archlab.training import recipes


def _tiny_suite(**kw) -> suites.Suite:
    base = suites._post_training_base()
    base["model"].update({"d_model": 32, "mlp.d_ff": 64, "attention.n_heads": 2})
    base["train"].update({"eval_every": 2, "log_every": 1, "batch_size": 8, "warmup_steps": 1})
    fields = dict(name="ft_tiny", claim="LoRA comes close", runs="finetune", corpus="reverse-words", seeds=1,
                  axes=[{"name": "method", "values": [
                      {"label": "full", "set": {}},
                      {"label": "lora-r2", "set": {"train.lora.r": 2, "train.lora.targets": "all-linear"}}]}],
                  base=base, scales={"small": {"budget": 3, "unit": "steps"}},
                  finetune={"pretrain": {"budget": 4, "batch_size": 8, "eval_every": 2, "warmup_steps": 1},
                            "test_words": 6},
                  rules=[suites.Rule(kind="parity", metric="exact_match", a={"method": "lora-r2"},
                                     b={"method": "full"}, tol_abs=0.05, statement="LoRA r=2 within 5 points")])
    return suites.Suite(**{**fields, **kw})


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    return reverse_words.prepare_task_folder(tmp_path_factory.mktemp("lab-ft") / "data", quick=True, progress=False)


def test_finetune_suites_share_one_base_unless_per_seed(tmp_path):
    lora = plan(suites.BUILTIN["lora_rank"], tmp_path, vocab_size=259)
    assert len({p.base.folder for p in lora}) == 1                  # full and every rank, every seed: one base
    assert {p.train.lora and p.train.lora.r for p in lora} == {None, 1, 4, 16}
    norm = plan(suites.BUILTIN["norm_transfer"], tmp_path, vocab_size=259)
    assert len({p.base.folder for p in norm}) == len(norm)         # per seed and per norm position
    assert {p.base.model.norm.position for p in norm} == {"pre", "post"}
    demo = recipes.reverse_words(quick=False)
    model = lora[0].base.model.to_dict()
    assert {**model, "name": "", "vocab_size": 0, "seed": 0} == {**demo["model"].to_dict(), "name": "",
                                                                  "vocab_size": 0, "seed": 0}
    assert lora[0].base.train.budget == demo["base"].budget and lora[0].train.budget == demo["sft"].budget
    assert lora[0].train.lr == demo["sft"].lr and lora[0].train.batch_size == demo["sft"].batch_size


@pytest.mark.parametrize("settings, word", [
    ({"bases": "each"}, "finetune.bases='each'; known: shared, per_seed"), ({"test_words": 0}, "finetune.test_words"),
    ({"colour": 1}, r"unknown finetune key\(s\) \['colour'\]"), ({"pretrain": {"lr": -1}}, "finetune.pretrain"),
    ({"pretrain": 3}, "finetune.pretrain must be a mapping")])
def test_bad_finetune_settings_are_refused_by_name(tmp_path, settings, word):
    with pytest.raises(ConfigError, match=word):
        plan(_tiny_suite(finetune=settings), tmp_path, vocab_size=259)


def test_finetune_settings_need_runs_finetune(tmp_path):
    with pytest.raises(ConfigError, match="runs: finetune"):
        plan(_tiny_suite(runs="train"), tmp_path, vocab_size=259)


def test_a_finetune_sweep_records_exact_match_builds_the_base_once_and_reports(tmp_path, task_data):
    sweep = tmp_path / "sweep"
    rows = run_suite(_tiny_suite(), sweep, data_dir=task_data, progress=False)
    assert [r.status for r in rows] == ["done", "done"], [r.error for r in rows]
    for r in rows:
        assert 0.0 <= r.extra["exact_match"] <= 1.0 and r.extra["test_words"] == 6
        assert r.final_val_loss is not None and r.final_val_loss > 0 and r.steps == 3
    assert len({r.extra["base"] for r in rows}) == 1
    assert sum("base_s" in r.extra for r in rows) == 1                # pretrained by the first run only
    (base,) = (sweep / "bases").iterdir()
    record = json.loads((base / lab_finetune.BASE_RECORD).read_text())
    assert record["train"]["budget"] == 4 and 0.0 <= record["exact_plain"] <= 1.0
    from safetensors import safe_open
    with safe_open(next((sweep / "runs").glob("*lora*/seed0/checkpoints/*")) / "model.safetensors", "pt") as f:
        assert any(key.endswith("lora_A") for key in f.keys())        # the LoRA row trained adapters
    again = run_suite(_tiny_suite(), sweep, data_dir=task_data, progress=False)      # resumed: nothing re-runs
    assert [r.finished_at for r in again] == [r.finished_at for r in rows]
    paths = build_report(sweep)
    text = paths["md"].read_text()
    assert "ft_tiny" in text and "exact_match" in text and "1 pretrained base" in text
    assert "ft_tiny_curves.png" in text
    with ResultStore(sweep, readonly=True) as store:
        assert store.runs("ft_tiny")[0].metric("exact_match") is not None


def test_a_worker_waits_for_the_base_another_is_building(tmp_path, task_data, monkeypatch):
    spec = plan(_tiny_suite(), tmp_path, vocab_size=259)[0].base
    monkeypatch.setattr(lab_bases, "WAIT_S", 0.05)
    lock = RunLock(spec.folder, what="base folder").acquire()       # another worker is building it

    def finish():
        time.sleep(0.5)
        (spec.folder / lab_finetune.BASE_RECORD).write_text(json.dumps({"seconds": 1.0, "exact_plain": 0.5}))
        lock.release()

    threading.Thread(target=finish).start()
    run_dir, record = lab_finetune.ensure_base(spec, task_data)
    assert record == {"seconds": 1.0, "exact_plain": 0.5}          # its record, not a second pretraining
    assert run_dir == spec.folder / "run" and not run_dir.exists()


def test_run_base_notes_the_base_or_fails_the_row_and_lets_a_lock_through(tmp_path):
    from types import SimpleNamespace

    from archlab.lab.store import RunRecord
    from archlab.lab.worker import failed
    from archlab.runs.lock import LockedError

    spec = plan(_tiny_suite(), tmp_path, vocab_size=259)[0].base

    def job():
        return SimpleNamespace(run=SimpleNamespace(base=spec), data=tmp_path,
                               record=RunRecord(suite="s", variant="v", seed=0, status="running"))

    built = job()
    got = lab_bases.run_base(built, failed, 0.0, build=lambda s, d: (s.folder / "run", {
        "seconds": 2.0, "final_val_loss": 1.5, "built_here": True}))
    assert got == (spec.folder / "run", {"seconds": 2.0, "final_val_loss": 1.5, "built_here": True})
    assert built.record.extra == {"base": spec.folder.name, "base_val_loss": 1.5, "base_s": 2.0}
    reused = job()
    lab_bases.run_base(reused, failed, 0.0, build=lambda s, d: (s.folder / "run", {"seconds": 2.0}))
    assert "base_s" not in reused.record.extra                      # built by another run: not this row's time

    def missing():
        raise FileNotFoundError("no sft.jsonl")

    broken = job()
    row = lab_bases.run_base(broken, failed, 0.0, check=missing, build=lambda s, d: pytest.fail("built anyway"))
    assert row is broken.record and row.status == "failed" and "no sft.jsonl" in row.error

    def locked(s, d):
        raise LockedError("busy")

    with pytest.raises(LockedError):                                # the worker retries it: no failed row
        lab_bases.run_base(job(), failed, 0.0, build=locked)
