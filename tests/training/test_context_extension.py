"""Extending a run's context: `archlab train --init-from RUN --set position.rope_scaling.kind=... --set
position.rope_scaling.factor=F --set train.seq_len=...` takes the source's length as the original context and
max_seq_len to original x F, starts from the source's weights, and refuses a factor <= 1 or a model without RoPE."""
from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.nn.position import RotaryEmbedding, rope_frequencies
from archlab.training.init_from import extended_config

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--no-progress", "--set", "train.batch_size=2", "--set", "train.budget=1", "--set", "train.eval_batches=1",
        "--set", "train.sample_every=-1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("extend")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog".split()
    prepare([" ".join(rng.choice(words) for _ in range(150)) for _ in range(6)], "bytes", root / "data",
            num_workers=0, progress=False)
    assert main(["train", "--preset", "tiny:llama2-7b", "--data", str(root / "data"), "--out", str(root / "short"),
                 "--set", "d_model=32", "--set", "max_seq_len=16", "--set", "train.seq_len=16", *FAST]) == 0
    return root


def test_extension_sets_the_original_context_and_the_longer_one(world, capsys):
    out = world / "long"
    assert main(["train", "--init-from", str(world / "short"), "--data", str(world / "data"), "--out", str(out),
                 "--set", "position.rope_scaling.kind=yarn", "--set", "position.rope_scaling.factor=4",
                 "--set", "train.seq_len=64", *FAST]) == 0
    assert "extending the context: RoPE scaling yarn x4 over the original 16 positions; max_seq_len 16 -> 64" \
        in capsys.readouterr().err
    saved = yaml.safe_load((out / "config.yaml").read_text())
    cfg = ModelConfig.from_dict(saved["model"])
    assert cfg.max_seq_len == 64 and saved["train"]["seq_len"] == 64
    scaling = cfg.position.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_seq_len) == ("yarn", 4.0, 16)
    from archlab.runs.model_folder import load_run
    model, _ = load_run(out)
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    want, _ = rope_frequencies(cfg.rotary_dim, cfg.position.rope_theta, scaling)
    plain, _ = rope_frequencies(cfg.rotary_dim, cfg.position.rope_theta, None)
    assert torch.equal(rope.inv_freq, want) and not torch.equal(want, plain)   # the slow dims interpolated
    capsys.readouterr()
    assert main(["eval", str(out), "--lengths", "16,64", "--json"]) == 0        # scores at the extended length
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["by_length"]
    assert set(got) == {"16", "64"}


def test_names_given_with_set_win_over_the_defaults():
    src = ModelConfig(vocab_size=64, d_model=32, n_layers=1, max_seq_len=128, attention={"n_heads": 4})
    over = {"position.rope_scaling.kind": "linear", "position.rope_scaling.factor": "2", "max_seq_len": "200",
            "position.rope_scaling.original_max_seq_len": "100"}
    cfg, note = extended_config(src, src.with_overrides(over), over)
    assert cfg.max_seq_len == 200 and cfg.position.rope_scaling.original_max_seq_len == 100 and note
    assert extended_config(src, src.with_overrides({"attention.dropout": "0.1"}), {"attention.dropout": "0.1"}) == (
        src.with_overrides({"attention.dropout": "0.1"}), None)


@pytest.mark.parametrize("sets, needle", [
    (["position.rope_scaling.kind=linear", "position.rope_scaling.factor=1"],
     "position.rope_scaling.factor=1 must be > 1 to extend the context"),
    (["position.rope_scaling.kind=dynamic", "position.rope_scaling.factor=0.5"], "factor=0.5 must be > 1"),
    (["position.rope_scaling.kind=yarn"], "factor=1 must be > 1"),
])
def test_bad_extension_is_one_line_exit_2_before_writing(world, capsys, sets, needle):
    out = world / "bad"
    args = ["train", "--init-from", str(world / "short"), "--data", str(world / "data"), "--out", str(out), *FAST]
    for s in sets:
        args += ["--set", s]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not out.exists()


def test_extension_of_a_model_without_rope_is_refused():
    src = ModelConfig(vocab_size=64, d_model=32, n_layers=1, attention={"n_heads": 4}, position={"kind": "alibi"})
    over = {"position.rope_scaling.kind": "linear", "position.rope_scaling.factor": "2"}
    from archlab.errors import UserError
    with pytest.raises(UserError, match="extends RoPE; this model's position.kind is 'alibi'"):
        extended_config(src, src.with_overrides(over), over)
