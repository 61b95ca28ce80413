"""KTO (training/kto.py) as `archlab finetune --method dpo --set train.dpo.loss=kto`: the loss, its KL reference point
and TRL's log figures equal TRL 1.16's own KTOTrainer._compute_loss on a frozen batch (TRL has no standalone KTO loss:
the trainer's method runs on a minimal stand-in for the trainer, its model answering with the log-probs archlab's
model gives); paired lines unpaired as TRL unpairs them and TRL's unpaired lines read alike; the bad input refused in
one line before anything is written; a run's first loss equal to the formula from its stored reference."""
from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from finetune_runs import WORDS

from archlab.cli import main
from archlab.data.objectives import IGNORE
from archlab.data.preference import LabelledCompletion, labelled_completions, load_preference_data
from archlab.training.config import TrainConfig
from archlab.training.kto import KTOBatches, kl_rows, kto_kl, kto_losses
from archlab.training.metrics import read_metrics

COMMON = ["--no-progress", "--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "train.log_every=1",
          "--set", "train.schedule.warmup_steps=0", "--set", "train.sample.every=-1", "--set", "train.budget=2",
          "--set", "train.lr=1e-2", "--set", "train.memory_check=false", "--set", "train.dpo.loss=kto"]


@pytest.fixture(scope="module")
def world(chat_world, make_base, tmp_path_factory):
    """An untrained base with the chat tokenizer; 16 preference pairs, and 16 unpaired lines (10 desirable)."""
    root = tmp_path_factory.mktemp("kto")
    base = make_base(root / "base", seed=1)
    rng = random.Random(0)
    pairs = [{"prompt": f"Repeat {w}:", "chosen": f" {w}", "rejected": f" {rng.choice(WORDS)}x"}
             for w in (rng.choice(WORDS) for _ in range(16))]
    (root / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    unpaired = [{"prompt": f"Repeat {w}:", "completion": f" {w}" if i < 10 else " no", "label": i < 10}
                for i, w in enumerate(rng.choice(WORDS) for _ in range(16))]
    (root / "kto.jsonl").write_text("".join(json.dumps(u) + "\n" for u in unpaired))
    return {"root": root, "base": base, "tok": chat_world["tok"]}


def _rows(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


# ---- the data -----------------------------------------------------------------------------------------------------
def test_pairs_unpair_as_trl_does_and_unpaired_lines_read_alike(world, tmp_path):
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    lines = [json.loads(x) for x in (world["root"] / "prefs.jsonl").read_text().splitlines()]
    theirs = unpair_preference_dataset(Dataset.from_list(lines))
    (tmp_path / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in theirs))
    paired = labelled_completions(load_preference_data(world["root"] / "prefs.jsonl", world["tok"], progress=False))
    alone = labelled_completions(load_preference_data(tmp_path / "unpaired.jsonl", world["tok"], progress=False))
    assert [(e.ids, e.labels, e.desirable) for e in paired] == [(e.ids, e.labels, e.desirable) for e in alone]
    assert [e.desirable for e in paired] == [True] * 16 + [False] * 16


def test_kl_rows_put_the_previous_completion_after_each_prompt():
    a = LabelledCompletion(1, [5, 6, 7, 8], [IGNORE, 7, 8, IGNORE], True)        # prompt [5, 6], completion [7, 8]
    b = LabelledCompletion(2, [9, 3, 4], [3, 4, IGNORE], False)                   # prompt [9], completion [3, 4]
    assert kl_rows([a, b]) == [([5, 6, 3, 4], [IGNORE, 3, 4, IGNORE]), ([9, 7, 8], [7, 8, IGNORE])]
    assert kl_rows([a, b], max_tokens=3)[0] == ([5, 6, 3], [IGNORE, 3, IGNORE])


# ---- the loss against TRL's KTOTrainer -------------------------------------------------------------------------
def _trl_batch(ids: torch.Tensor, labels: torch.Tensor, b: int):
    """TRL's collated KTO batch of archlab's 2b rows (b completions, then their KL rows): completion_mask marks the
    scored tokens (archlab's label slot j scores token j + 1)."""
    scored = torch.zeros_like(ids)
    scored[:, 1:] = (labels[:, :-1] != IGNORE).long()
    attention = torch.ones_like(ids)
    return {"input_ids": ids[:b], "attention_mask": attention[:b], "completion_mask": scored[:b],
            "KL_input_ids": ids[b:], "KL_attention_mask": attention[b:], "KL_completion_mask": scored[b:]}


class _TRLModel:
    """What TRL's KTOTrainer reads of model(..., labels=, fused_lm_head=True): per-token log-probs of the labels
    (b, t - 1), 0 where -100, from archlab's model."""

    training = True

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, labels, **_):
        logits = self.model(input_ids=input_ids).float()[:, :-1]                             # (b, t-1, v)
        target = labels[:, 1:]
        picked = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
        return SimpleNamespace(log_probs=picked * (target != -100), entropy=torch.zeros_like(picked),
                               mean_logits=logits.mean(-1))


def _trl_trainer(beta, desirable_weight, undesirable_weight):
    from trl.trainer.kto_trainer import KTOTrainer

    fake = SimpleNamespace(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                           loss_type="kto", calculate_KL=True, precompute_ref_logps=True, aux_loss_enabled=False,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1, model=SimpleNamespace(training=True),
                           accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x))
    fake._compute_kl_logps = lambda model, batch: KTOTrainer._compute_kl_logps(fake, model, batch)
    return fake, KTOTrainer


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33)])
def test_kto_loss_kl_and_logs_equal_trls_kto_trainer(world, weights):
    pytest.importorskip("trl.trainer.kto_trainer")
    from archlab.runs.model_folder import load_run

    model, _ = load_run(world["base"])
    model.train()
    cfg = TrainConfig(batch_size=6, seq_len=32, dpo={"loss": "kto", "beta": 0.5, "val_fraction": 0.0,
                                                     "desirable_weight": weights[0],
                                                     "undesirable_weight": weights[1]})
    data = load_preference_data(world["root"] / "kto.jsonl", world["tok"], progress=False)
    batches = KTOBatches(data, cfg)
    gen = torch.Generator().manual_seed(0)
    n = len(batches.examples)
    batches.reference = (-torch.rand(n, generator=gen) * 20 - 20, -torch.rand(n, generator=gen) * 20 - 25)
    inputs, labels = batches.next(0, 0)
    index = inputs["example_index"]
    assert batches.desirable[index].any() and (~batches.desirable[index]).any()
    ours = batches.loss(model, inputs, labels).total
    ours_grad = torch.autograd.grad(ours, [p for p in model.parameters()])
    logs = batches.metrics()

    fake, trainer = _trl_trainer(0.5, *weights)
    b = len(index)
    batch = {**_trl_batch(inputs["input_ids"], labels, b), "label": batches.desirable[index],
             "ref_logps": batches.reference[0][index], "ref_KL_logps": batches.reference[1][index]}
    theirs = trainer._compute_loss(fake, _TRLModel(model), batch, return_outputs=False)
    theirs_grad = torch.autograd.grad(theirs, [p for p in model.parameters()])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    for g, h in zip(ours_grad, theirs_grad):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-8)
    trl_logs = {k: v[-1] for k, v in fake._metrics["train"].items()}
    assert logs["kl"] > 0.5                                       # z is in play, not clamped away
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"):
        assert logs[name] == pytest.approx(trl_logs[name], rel=1e-5, abs=1e-6), name


def test_the_kl_point_is_detached_and_clamped_at_zero():
    logps = torch.tensor([-3.0, -4.0], requires_grad=True)
    assert float(kto_kl(logps, torch.tensor([-1.0, -1.0]))) == 0.0                # a negative mean clamps to 0
    z = kto_kl(logps, torch.tensor([-5.0, -5.0]))
    assert float(z) == 1.5 and not z.requires_grad
    # by hand, beta 0.1: desirable 1 - sigmoid(0.1 * (r - z)), undesirable 1 - sigmoid(0.1 * (z - r)), r = logp - ref
    losses = kto_losses(torch.tensor([-2.0, -6.0]), torch.tensor([-4.0, -4.0]), torch.tensor([True, False]),
                        torch.tensor(1.0), beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    expected = [2.0 * (1 - 1 / (1 + math.exp(-0.1))), 0.5 * (1 - 1 / (1 + math.exp(-0.3)))]
    torch.testing.assert_close(losses, torch.tensor(expected))


def test_the_reference_is_the_bases_own_logps_of_each_completion_and_kl_row(world):
    """kto.reference_logps scores padded batches in eval mode: each completion's and each KL row's summed log-prob
    equals the base's on that row alone (float64, unpadded), and the model's training mode comes back."""
    from archlab.runs.model_folder import load_run
    from archlab.training.kto import reference_logps

    data = load_preference_data(world["root"] / "kto.jsonl", world["tok"], max_tokens=32, progress=False)
    batches = KTOBatches(data, TrainConfig(batch_size=3, seq_len=32, method="dpo", dpo={"loss": "kto"}))
    model, _ = load_run(world["base"])
    model.train()
    logps, kl_logps = reference_logps(model, batches, device=torch.device("cpu"), progress=False)
    assert model.training and logps.shape == kl_logps.shape == (len(batches.rows),)

    def alone(ids: list[int], labels: list[int]) -> float:
        model.eval()
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids]))[0].double(), -1)     # (n, v)
        return sum(float(logprobs[j, t]) for j, t in enumerate(labels) if t != IGNORE)

    torch.testing.assert_close(logps, torch.tensor([alone(*r) for r in batches.rows]), atol=1e-4, rtol=0)
    torch.testing.assert_close(kl_logps, torch.tensor([alone(*r) for r in batches.kl]), atol=1e-4, rtol=0)
    assert not torch.equal(logps, kl_logps)


# ---- archlab finetune --method dpo --set train.dpo.loss=kto ---------------------------------------------------
@pytest.mark.parametrize("data", ["prefs.jsonl", "kto.jsonl"])
def test_a_kto_runs_first_loss_is_the_formula_at_the_reference(world, tmp_path, data):
    """At the first step the policy is the base that scored the reference: every r is 0 and z is 0, so the loss is
    the batch's mean weight / 2; TRL's names are logged, and a resume continues from the stored reference."""
    from archlab.data.preference_folder import open_preference_folder

    out = tmp_path / "kto"
    args = ["finetune", str(world["base"]), "--method", "dpo", "--data", str(world["root"] / data), "--out", str(out),
            *COMMON, "--set", "train.dpo.undesirable_weight=2", "--set", "train.dpo.val_fraction=0.25"]
    assert main(args) == 0
    cfg = TrainConfig.from_yaml((out / "config.yaml").read_text())
    assert cfg.dpo.loss == "kto" and cfg.dpo.undesirable_weight == 2.0
    batches = KTOBatches(open_preference_folder(out / "data", max_tokens=32, truncation="refuse", progress=False), cfg)
    flags = batches.desirable[batches.sampler.indices(0)]
    rows = _rows(out)
    assert rows[0]["loss"] == pytest.approx(float(torch.where(flags, 1.0, 2.0).mean()) / 2, abs=1e-5)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-5) and rows[0]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
    assert {"rewards/rejected", "logps/chosen", "logps/rejected"} <= set(rows[0]) or not flags.all()
    val = [r for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert val and {"val_kl", "val_rewards/chosen", "val_logps/chosen"} <= set(val[-1])
    if data == "prefs.jsonl":          # a pair's two sides are held out together: both kinds, so the margin too
        assert {"val_rewards/rejected", "val_rewards/margins"} <= set(val[-1])
    assert main([*args, "--set", "train.budget=3", "--resume"]) == 0
    assert [r["loss"] for r in _rows(out)][:2] == [r["loss"] for r in rows] and len(_rows(out)) == 3


def test_train_init_from_reads_unpaired_lines_as_finetune_does(world, tmp_path):
    out, plain = tmp_path / "ft", tmp_path / "plain"
    assert main(["finetune", str(world["base"]), "--method", "dpo", "--data", str(world["root"] / "kto.jsonl"),
                 "--out", str(out), *COMMON]) == 0
    assert main(["train", "--init-from", str(world["base"]), "--data", str(world["root"] / "kto.jsonl"), "--out",
                 str(plain), *COMMON, "--set", "train.method=dpo"]) == 0
    assert [r["loss"] for r in _rows(out)] == [r["loss"] for r in _rows(plain)]


BAD = {
    "label.jsonl": [{"prompt": "Repeat cat:", "completion": " cat", "label": True},
                    {"prompt": "Repeat dog:", "completion": " x", "label": "no"}],
    "chat.jsonl": [{"prompt": "Repeat cat:", "completion": " cat"}],
    "happy.jsonl": [{"prompt": f"Repeat {w}:", "completion": f" {w}", "label": True} for w in WORDS],
    "mixed.jsonl": [{"prompt": "Repeat cat:", "chosen": " cat", "rejected": " x"},
                    {"prompt": "Repeat dog:", "completion": " x", "label": False}],
}


@pytest.mark.parametrize("data, args, message", [
    ("label.jsonl", [], 'label.jsonl:2: label is "no", not true or false'),
    ("chat.jsonl", [], "chat.jsonl is a file of chat examples; --method dpo reads preference pairs or unpaired "
                       "preferences"),
    ("happy.jsonl", [], "happy.jsonl's lines hold only desirable (label true) completions: KTO"),
    ("mixed.jsonl", [], "mixed.jsonl:2 holds unpaired preferences, line 1 preference pairs: one format per file"),
    ("kto.jsonl", ["--set", "train.dpo.loss=sigmoid"], "kto.jsonl holds unpaired preferences (prompt, completion, "
                                                       "label): train.dpo.loss=sigmoid needs pairs"),
    ("kto.jsonl", ["--method", "reward"], "kto.jsonl is a file of unpaired preferences; --method reward reads "
                                          "preference pairs"),
    ("kto.jsonl", ["--set", "train.dpo.desirable_weight=0"], "train.dpo.desirable_weight=0"),
])
def test_bad_kto_input_is_one_line_exit_2_and_writes_nothing(world, tmp_path, capsys, data, args, message):
    path = world["root"] / data
    if data in BAD:
        path = tmp_path / data
        path.write_text("".join(json.dumps(line) + "\n" for line in BAD[data]))
    out = tmp_path / "run"
    method = [] if "--method" in args else ["--method", "dpo"]
    common = COMMON[:-2] if method == [] else COMMON        # train.dpo.* is refused under another --method
    assert main(["finetune", str(world["base"]), *method, "--data", str(path), "--out", str(out), *common,
                 *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


def _desirable_rate(run, prompts) -> float:
    """The share of `prompts` whose greedy completion under `run`'s weights begins with the tokens of " yes"."""
    from archlab import generate
    from archlab.runs.model_folder import load_run

    model, tok = load_run(run)
    yes = tok.encode(" yes")
    hits = 0
    for prompt in prompts:
        ids = tok.encode(prompt)
        hits += generate(model, ids, max_new_tokens=len(yes), temperature=0.0)[len(ids):].tolist() == yes
    return hits / len(prompts)


def test_kto_raises_the_desirable_rate_on_held_out_prompts(world, tmp_path):
    """Unpaired lines only, each prompt judged once (" yes" desirable, " no" undesirable, the label drawn at random):
    after 20 KTO steps the greedy completion of prompts it never saw is the desirable one (0 of 8 before, 8 of 8
    after on the 2-core Xeon; the test asks for at most 2 before and at least 6 after)."""
    rng = random.Random(1)
    flags = [rng.random() < 0.5 for _ in range(32)]
    lines = [{"prompt": f"Is it {rng.choice(WORDS)} {i}?", "completion": " yes" if desirable else " no",
              "label": desirable} for i, desirable in enumerate(flags)]
    data = tmp_path / "yes.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    held = [f"Is it {w} {32 + i}?" for i, w in enumerate(WORDS)]
    before = _desirable_rate(world["base"], held)
    out = tmp_path / "run"
    assert main(["finetune", str(world["base"]), "--method", "dpo", "--data", str(data), "--out", str(out), *COMMON,
                 "--set", "train.budget=20", "--set", "train.batch_size=8", "--set", "train.dpo.val_fraction=0"]) == 0
    after = _desirable_rate(out, held)
    assert before <= 0.25 and after >= 0.75, (before, after)


@pytest.mark.slow      # two torchrun processes; ~40 s on 2 cores
def test_two_process_kto_matches_single_process(world, tmp_path):
    """KTO under torchrun (2 CPU processes, gloo, DDP): each rank's share of the batch, z averaged over the ranks'
    KL rows (TRL gathers it) and the loss over ranks give the single-process run's loss and kl at every step."""
    import os
    import subprocess
    import sys

    args = ["train", "--init-from", str(world["base"]), "--data", str(world["root"] / "kto.jsonl"), *COMMON,
            "--set", "train.method=dpo", "--set", "train.budget=3", "--set", "train.dpo.val_fraction=0"]
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "archlab", *args, "--out", str(tmp_path / "ddp")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single, both = _rows(tmp_path / "single"), _rows(tmp_path / "ddp")
    assert len(both) == len(single) == 3
    for key in ("loss", "kl"):
        assert [r[key] for r in both] == pytest.approx([r[key] for r in single], rel=1e-4, abs=1e-5), key
