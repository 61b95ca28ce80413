"""Preference tuning (train.objective=dpo, archlab.training.dpo): the first step's loss is ln 2 (policy = reference);
the loss and the implicit rewards equal the formulas computed in the test from the two models' log-probabilities,
each scored here one unpadded sequence at a time; IPO and SimPO against their formulas; the stored reference equals
the base's own log-probabilities; a short run raises the chosen-vs-rejected rate; resume is exact; LoRA's reference
is the frozen base; preference lines (plain and messages) score the completion only."""
from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import tiny_model

from archlab.cli import main
from archlab.data.objectives import IGNORE
from archlab.data.preference import PreferenceBatches, load_preference_data
from archlab.errors import UserError
from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint
from archlab.runs.model_folder import load_run
from archlab.tokenizer import train as train_tokenizer
from archlab.tokenizer.chat import ChatTokenizer
from archlab.tokenizer.chat_builtin import install_chat_template
from archlab.training.config import DPOConfig, TrainConfig
from archlab.training.dpo import REFERENCE_FILE, DPOBatches, implicit_rewards, preference_loss
from archlab.training.metrics import read_metrics
from archlab.training.trainer import train

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "one", "two", "three", "yes", "no", "good", "bad", "sky",
         "tree", "river"]
COMMON = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.log_every=1",
          "--set", "train.warmup_steps=0", "--set", "train.sample_every=-1", "--set", "train.weight_decay=0"]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _pairs(n: int, seed: int) -> list[dict]:
    """A synthetic preference: after any prompt of words, " good" is preferred to " bad"."""
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) + ":",
             "chosen": " good", "rejected": " bad"} for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A BPE tokenizer with the chatml template, a tiny decoder trained a few steps on word soup (the base)."""
    root = tmp_path_factory.mktemp("dpo")
    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + ": good bad\n")
    tok = train_tokenizer(corpus / "d0.txt", 300, ["<|endoftext|>"])
    tok.save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    assert main(["data", "prepare", "--corpus", str(corpus), "--tokenizer", str(root / "tok"), "--out",
                 str(root / "data"), "--workers", "0", "--quiet"]) == 0
    vocab = ChatTokenizer.of(root / "tok").tokenizer.vocab_size
    train(tiny_model().with_overrides({"vocab_size": int(vocab)}), TrainConfig(
        batch_size=4, seq_len=32, budget=3, lr=3e-3, warmup_steps=0, eval_batches=1, sample_every=-1),
        root / "data", root / "base", progress=False)
    _jsonl(root / "prefs.jsonl", _pairs(24, seed=1))
    return root


def _dpo(world, out, *extra, data="prefs.jsonl") -> None:
    assert main(["train", "--init-from", str(world / "base"), "--data", str(world / data), "--out", str(out),
                 *COMMON, "--set", "train.objective=dpo", *extra]) == 0


def _steps(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _logps_by_hand(model, ids: list[int], labels: list[int]) -> float:
    """Summed log-probability of the scored labels of one unpadded sequence, in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]))[0].double()             # (n, v)
    logprobs = torch.log_softmax(logits, -1)
    return sum(float(logprobs[j, t]) for j, t in enumerate(labels) if t != IGNORE)


def test_first_step_loss_is_ln2_and_rewards_start_at_zero(world, tmp_path):
    _dpo(world, tmp_path / "run", "--set", "train.budget=1")
    first = _steps(tmp_path / "run")[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    assert abs(first["rewards/margins"]) < 1e-6 and first["rewards/accuracies"] == 0.0
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert name in first


def test_loss_and_rewards_equal_the_formula_from_both_models_logps(world, tmp_path):
    run = tmp_path / "run"
    _dpo(world, run, "--set", "train.budget=3", "--set", "train.lr=1e-2", "--set", "train.dpo.beta=0.5")
    base, _ = load_run(world / "base")
    policy, _ = load_run(run)
    base.eval()
    policy.eval()
    cfg = TrainConfig(batch_size=4, seq_len=32, method="dpo", dpo=DPOConfig(beta=0.5))
    data = load_preference_data(world / "prefs.jsonl", world / "tok", max_tokens=32, progress=False)
    stored = load_file(str(run / REFERENCE_FILE))
    assert stored["line"].tolist() == [p.line for p in data.pairs]
    for i, pair in enumerate(data.pairs):   # the reference stored before the first step is the base's own
        assert float(stored["chosen"][i]) == pytest.approx(_logps_by_hand(base, *pair.chosen), abs=1e-4)
        assert float(stored["rejected"][i]) == pytest.approx(_logps_by_hand(base, *pair.rejected), abs=1e-4)
    batches = DPOBatches(data, cfg)
    batches.reference = (stored["chosen"], stored["rejected"])
    inputs, labels = batches.next(0, 0)
    with torch.no_grad():
        loss = float(batches.loss(policy, inputs, labels).total)
    margins, expected = [], []
    for i in inputs["pair_index"].tolist():
        pair = data.pairs[i]
        pc, pr = _logps_by_hand(policy, *pair.chosen), _logps_by_hand(policy, *pair.rejected)
        rc, rr = _logps_by_hand(base, *pair.chosen), _logps_by_hand(base, *pair.rejected)
        margin = 0.5 * ((pc - rc) - (pr - rr))
        expected.append(-math.log(1 / (1 + math.exp(-margin))))
        margins.append(margin)
    assert abs(max(margins)) > 1e-3                       # the policy has moved: a real check of the formula
    assert loss == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert float(implicit_rewards(torch.tensor(-3.0), torch.tensor(-5.0), 0.5)) == pytest.approx(1.0)
    metrics = batches.metrics()
    assert metrics["rewards/margins"] == pytest.approx(sum(margins) / len(margins), abs=1e-5)


def test_ipo_and_simpo_equal_their_formulas():
    lc, lr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in ([-4.0, -9.0], [-6.0, -2.0],
                                                                      [-5.0, -8.0], [-5.5, -3.0]))
    nc, nr = torch.tensor([2.0, 3.0], dtype=torch.float64), torch.tensor([4.0, 1.0], dtype=torch.float64)
    beta, gamma = 0.2, 0.7
    ipo = [((lc[i] - rc[i]) / nc[i] - (lr[i] - rr[i]) / nr[i] - 1 / (2 * beta)) ** 2 for i in range(2)]
    simpo = [-math.log(1 / (1 + math.exp(-(beta * (lc[i] / nc[i] - lr[i] / nr[i]) - gamma)))) for i in range(2)]
    dpo = [-math.log(1 / (1 + math.exp(-beta * ((lc[i] - rc[i]) - (lr[i] - rr[i]))))) for i in range(2)]
    for kind, want in (("ipo", ipo), ("simpo", simpo), ("sigmoid", dpo)):
        got = preference_loss(kind, lc, lr, rc, rr, nc, nr, beta=beta, gamma=gamma)
        assert float(got) == pytest.approx(float(sum(want)) / 2, rel=1e-12), kind


def _chosen_rate(model, data) -> float:
    return sum(_logps_by_hand(model, *p.chosen) > _logps_by_hand(model, *p.rejected) for p in data.pairs) / len(
        data.pairs)


def test_a_short_run_raises_the_chosen_rate_on_held_out_prompts(world, tmp_path):
    held_out = load_preference_data(_jsonl(tmp_path / "held.jsonl", _pairs(20, seed=7)), world / "tok",
                                    progress=False)
    base, _ = load_run(world / "base")
    before = _chosen_rate(base.eval(), held_out)
    _dpo(world, tmp_path / "run", "--set", "train.budget=12", "--set", "train.lr=3e-3")
    policy, _ = load_run(tmp_path / "run")
    after = _chosen_rate(policy.eval(), held_out)
    assert after == 1.0 and after > before, (before, after)
    lines = _steps(tmp_path / "run")
    assert lines[-1]["rewards/accuracies"] == 1.0 and lines[-1]["loss"] < math.log(2)


def test_resume_is_exact(world, tmp_path):
    args = ("--set", "train.budget=4", "--set", "train.checkpoint_every=2", "--set", "train.lr=3e-3")
    _dpo(world, tmp_path / "full", *args)
    shutil.copytree(tmp_path / "full", tmp_path / "part")
    shutil.rmtree(latest_checkpoint(tmp_path / "part"))
    _dpo(world, tmp_path / "part", *args, "--resume")
    a, _ = load_checkpoint(latest_checkpoint(tmp_path / "full"))
    b, _ = load_checkpoint(latest_checkpoint(tmp_path / "part"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    full, part = (_steps(tmp_path / d) for d in ("full", "part"))
    assert [r["loss"] for r in full] == [r["loss"] for r in part] and len(full) == 4


def test_with_lora_the_reference_is_the_base_and_only_adapters_train(world, tmp_path):
    _dpo(world, tmp_path / "run", "--set", "train.budget=2", "--set", "train.lora.r=2", "--set", "train.lr=1e-2")
    first = _steps(tmp_path / "run")[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6
    trained, _ = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    base, _ = load_checkpoint(latest_checkpoint(world / "base"))
    assert all(torch.equal(trained[k], v) for k, v in base.items())
    assert any("lora" in k and v.abs().sum() > 0 for k, v in trained.items() if k not in base)


def test_preference_lines_score_the_completion_only(world, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "red cat:", "chosen": " good", "rejected": " bad"},
        {"prompt": [{"role": "user", "content": "red cat?"}],
         "chosen": [{"role": "assistant", "content": "good"}], "rejected": [{"role": "assistant", "content": "bad"}]},
    ])
    data = load_preference_data(path, world / "tok", progress=False)
    tok = ChatTokenizer.of(world / "tok").tokenizer
    scored = [[tok.decode([t for t in labels if t != IGNORE]) for _, labels in (p.chosen, p.rejected)]
              for p in data.pairs]
    assert scored[0] == [" good<|endoftext|>", " bad<|endoftext|>"]
    assert scored[1][0].startswith("good<|im_end|>") and scored[1][1].startswith("bad<|im_end|>")
    assert tok.decode(data.pairs[1].prompt_ids).endswith("<|im_start|>assistant\n")
    sampler = PreferenceBatches(data, batch_size=2, seed=0)
    inputs, labels = sampler.next(0, 0)
    assert inputs["input_ids"].shape[0] == 4 and sorted(inputs["pair_index"].tolist()) == [0, 1]
    rows = [data.pairs[i].chosen for i in inputs["pair_index"]] + [data.pairs[i].rejected for i in inputs["pair_index"]]
    assert inputs["attention_mask"].sum(1).tolist() == [len(ids) for ids, _ in rows]     # padding is not counted
    for row, (ids, row_labels) in enumerate(rows):
        assert inputs["input_ids"][row, :len(ids)].tolist() == ids and labels[row, :len(ids)].tolist() == row_labels
        assert (labels[row, len(ids):] == IGNORE).all()


def _trl_loss(loss_type: str, beta: float, ids, labels, logprobs, ref) -> tuple[float, dict]:
    """TRL's DPOTrainer._compute_loss on one batch, given the per-token log-probs our model gives (TRL's fused head
    hands it the same quantity: slot j holds log p(token j + 1), 0 off the completion) and the stored reference."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl import DPOTrainer

    scored = labels != IGNORE                                                        # (2b, t)
    completion_mask = torch.cat([torch.zeros_like(scored[:, :1]), scored[:, :-1]], 1).long()   # token j scored
    per_token = (logprobs * scored)[:, :-1]                                          # (2b, t - 1)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token).bool())
    same = lambda x: x                                                               # noqa: E731 (one process)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=same, gather_for_metrics=same)
    stub = SimpleNamespace(model=SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None,
                           accelerator=accelerator,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                           _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion_mask,
              "ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
    loss = DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, False)
    return float(loss), {k: v[0] for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_loss_and_logs_equal_trls_on_one_batch(world, tmp_path, kind):
    pytest.importorskip("trl")
    run = tmp_path / "run"
    _dpo(world, run, "--set", "train.budget=2", "--set", "train.lr=1e-2", "--set", f"train.dpo.loss={kind}")
    policy, _ = load_run(run)
    cfg = TrainConfig(batch_size=4, seq_len=32, method="dpo", dpo=DPOConfig(beta=0.1, loss=kind))
    data = load_preference_data(world / "prefs.jsonl", world / "tok", max_tokens=32, progress=False)
    stored = load_file(str(run / REFERENCE_FILE))
    batches = DPOBatches(data, cfg)
    batches.reference = (stored["chosen"], stored["rejected"])
    inputs, labels = batches.next(2, 0)
    with torch.no_grad():
        ours = float(batches.loss(policy.eval(), inputs, labels).total)
        logits = policy(input_ids=inputs["input_ids"]).float()                      # (2b, t, v)
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    index = inputs["pair_index"]
    theirs, logs = _trl_loss(kind, 0.1, inputs["input_ids"], labels, logprobs,
                             (stored["chosen"][index], stored["rejected"][index]))
    assert abs(logs["rewards/margins"]) > 1e-4            # the policy has left the reference
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)
    for name, value in batches.metrics().items():
        assert value == pytest.approx(logs[name], rel=1e-5, abs=1e-6), name


def test_truncation_policies_keep_the_completion_or_refuse(world, tmp_path):
    long_prompt = " ".join(["red cat"] * 30) + ":"
    path = _jsonl(tmp_path / "long.jsonl", [{"prompt": long_prompt, "chosen": " good", "rejected": " bad"},
                                            {"prompt": "sky:", "chosen": " good", "rejected": " bad"}])
    tok = ChatTokenizer.of(world / "tok").tokenizer
    kept = load_preference_data(path, world / "tok", max_tokens=12, truncation="keep_end", progress=False)
    ids, labels = kept.pairs[0].chosen
    assert len(ids) == 12 and tok.decode([t for t in labels if t != IGNORE]) == " good<|endoftext|>"
    skipped = load_preference_data(path, world / "tok", max_tokens=12, truncation="skip", progress=False)
    assert [p.line for p in skipped.pairs] == [2]
    with pytest.raises(UserError, match=r"long.jsonl:1: chosen keeps no completion token under truncation"):
        load_preference_data(path, world / "tok", max_tokens=12, truncation="keep_start", progress=False)
    with pytest.raises(UserError, match=r"long.jsonl:1: chosen has \d+ tokens, more than the limit of 12"):
        load_preference_data(path, world / "tok", max_tokens=12, progress=False)


def test_from_an_hf_folder_the_run_copies_its_tokenizer_not_its_weights(world, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    tok_file = world / "tok" / "tokenizer.json"
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(hf), "--data", str(world / "prefs.jsonl"), "--out", str(out), *COMMON,
                 "--set", "train.objective=dpo", "--set", "train.budget=1"]) == 0
    assert abs(_steps(out)[0]["loss"] - math.log(2)) < 1e-6
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert not list((out / "tokenizer").glob("*.safetensors")) and not (out / "tokenizer" / "config.json").exists()


def test_resume_with_other_data_is_refused_and_leaves_the_run_as_it_was(world, tmp_path, capsys):
    """config.yaml, metrics and the stored reference log-probabilities stay as the first run wrote them."""
    args = ("--set", "train.budget=2", "--set", "train.checkpoint_every=2")
    _dpo(world, tmp_path / "run", *args)
    _jsonl(world / "other.jsonl", _pairs(24, seed=7))
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    capsys.readouterr()
    code = main(["train", "--init-from", str(world / "base"), "--data", str(world / "other.jsonl"), "--out",
                 str(tmp_path / "run"), *COMMON, "--set", "train.objective=dpo", *args, "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "error" in err[0], err
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert after == before


def test_held_out_pairs_never_train_and_their_loss_equals_the_formula(world, tmp_path):
    """train.dpo.val_fraction: the held-out lines (a seeded hash of each line) are never drawn; val_loss and the
    val_ rewards at the end equal the formula from both models' log-probabilities over exactly those pairs."""
    run = tmp_path / "run"
    _dpo(world, run, "--set", "train.budget=3", "--set", "train.lr=1e-2", "--set", "train.dpo.beta=0.5",
         "--set", "train.dpo.val_fraction=0.25")
    data = load_preference_data(world / "prefs.jsonl", world / "tok", max_tokens=32, progress=False)
    cfg = TrainConfig(batch_size=4, seq_len=32, method="dpo", dpo=DPOConfig(beta=0.5, val_fraction=0.25))
    from archlab.training.dpo import held_out
    val = held_out(data, cfg)
    assert 0 < len(val) < len(data.pairs)
    assert held_out(data, cfg) == val and held_out(data, TrainConfig(dpo=DPOConfig(val_fraction=0.25), seed=7)) != val
    batches = DPOBatches(data, cfg, val=val)
    drawn = {i for draw in range(40) for i in batches.sampler.indices(draw)}
    assert drawn == set(range(len(data.pairs))) - set(val)          # every training pair, no held-out one
    record = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1]
    base, _ = load_run(world / "base")
    policy, _ = load_run(run)
    margins, losses = [], []
    for i in val:
        pair = data.pairs[i]
        pc, pr = _logps_by_hand(policy.eval(), *pair.chosen), _logps_by_hand(policy, *pair.rejected)
        rc, rr = _logps_by_hand(base.eval(), *pair.chosen), _logps_by_hand(base, *pair.rejected)
        margins.append(0.5 * ((pc - rc) - (pr - rr)))
        losses.append(-math.log(1 / (1 + math.exp(-margins[-1]))))
    assert abs(max(margins)) > 1e-3                                 # the policy has moved on held-out pairs too
    assert record["val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert record["val_rewards/margins"] == pytest.approx(sum(margins) / len(margins), abs=1e-5)
    assert record["val_rewards/accuracies"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))
    # without a hold-out there is nothing to validate on
    _dpo(world, tmp_path / "all", "--set", "train.budget=1", "--set", "train.dpo.val_fraction=0")
    assert not [r for r in read_metrics(tmp_path / "all" / "metrics.jsonl") if "val_loss" in r]


@pytest.mark.slow      # two torchrun processes; ~40 s on 2 cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_dpo_matches_single_process(world, tmp_path, strategy):
    """DPO under torchrun (2 CPU processes, gloo): the reference scored on every rank, each rank's share of the
    global batch, the loss averaged over ranks and the held-out pairs scored on every rank give the single-process
    run's loss and val_loss at every step."""
    import os
    import subprocess
    import sys

    settings = [*COMMON, "--set", "train.objective=dpo", "--set", "train.budget=4", "--set", "train.lr=1e-2",
                "--set", "train.eval_every=2", "--set", "train.dpo.val_fraction=0.25"]
    args = ["train", "--init-from", str(world / "base"), "--data", str(world / "prefs.jsonl"), *settings]
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "archlab", *args, "--out", str(tmp_path / strategy), "--set",
                           f"dist.strategy={strategy}"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single, both = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("single", strategy))
    for key in ("loss", "val_loss"):
        ours = [(r["step"], r[key]) for r in both if key in r]
        reference = [(r["step"], r[key]) for r in single if key in r]
        assert [s for s, _ in ours] == [s for s, _ in reference] and len(ours) >= 2, key
        assert [v for _, v in ours] == pytest.approx([v for _, v in reference], rel=1e-4, abs=1e-5), key
