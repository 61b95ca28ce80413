"""Long-context evaluation: overlapping windows equal transformers' perplexity-guide loop on an exported model;
loss by position agrees with the plain evaluation; the CLI's --stride / --by-position / --lengths and their bad
input (one line, exit 2)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from archlab.cli import main
from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.data.tokens import TokenDataset
from archlab.eval.evaluate import evaluate
from archlab.eval.long_context import (
    loss_by_position,
    position_buckets,
    strided_nll,
    strided_perplexity,
    strided_windows,
)
from archlab.models.decoder import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()


def tiny_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=2, max_seq_len=64, init={"std": 0.1},
                      attention={"n_heads": 4, "n_kv_heads": 2}, **kw)
    return TransformerLM(cfg).eval()


def test_strided_windows_score_every_token_after_the_first_once():
    assert list(strided_windows(10, 4, 2)) == [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    for n, length, stride in [(75, 32, 12), (64, 16, 15), (33, 8, 1), (5, 8, 3)]:
        scored = [t for _, end, first in strided_windows(n, length, stride) for t in range(first, end)]
        assert scored == list(range(1, n))
    for stride in (0, 4, 5):
        with pytest.raises(ValueError, match="stride"):
            list(strided_windows(10, 4, stride))


@torch.no_grad()
def guide_loop(hf_model, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """transformers' "Perplexity of fixed-length models" loop, verbatim but for one line: each window's mean
    loss is weighted by the number of labels transformers scored after its shift (the guide's
    `num_valid_tokens - batch_size` is one short in every window after the first)."""
    encodings = ids[None]                               # (1, n): one stream, as the guide's wikitext
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        outputs = hf_model(input_ids, labels=target_ids)
        num_loss_tokens = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(outputs.loss) * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


@pytest.mark.parametrize("n, max_length, stride", [(75, 32, 12), (64, 16, 15), (40, 24, 5)])
def test_strided_perplexity_equals_transformers_perplexity_guide(tmp_path, n, max_length, stride):
    transformers = pytest.importorskip("transformers")
    from archlab.interop import save_hf

    ours = tiny_model(position={"rope_theta": 500.0})
    save_hf(ours, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
    theirs, count = guide_loop(hf_model, ids, max_length, stride)
    assert count == n - 1
    for batch_size in (1, 3):
        nats, tokens = strided_nll(ours, ids, seq_len=max_length, stride=stride, batch_size=batch_size)
        assert tokens == count and nats == pytest.approx(theirs, rel=1e-5)
    # overlapping windows give each token more context than non-overlapping ones: the figure changes
    plain = strided_nll(ours, ids, seq_len=max_length, stride=max_length - 1)[0]
    assert abs(plain - theirs) > 1e-4 or stride == max_length - 1


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(12)]
    path = tmp_path_factory.mktemp("data") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def test_loss_by_position_averages_to_the_evaluation_loss(data_dir):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64,
                                      attention={"n_heads": 4}, init={"std": 0.2})).eval()
    val = TokenDataset(data_dir, "val")
    by_pos = loss_by_position(model, val, seq_len=16, batch_size=4, max_batches=3)
    plain = evaluate(model, val, batch_size=4, seq_len=16, max_batches=3)     # the fused head + loss
    assert by_pos.shape == (16,)
    assert float(by_pos.mean()) == pytest.approx(plain.loss, rel=1e-5)
    assert float(by_pos.max() - by_pos.min()) > 1e-3      # positions differ: the curve is not flat


def test_position_buckets_double_in_width():
    assert position_buckets([3.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.5, 9.0]) == [
        (0, 0, 3.0), (1, 1, 2.0), (2, 3, 1.0), (4, 7, 0.75), (8, 8, 9.0)]


@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", "--preset", "tiny:llama2-7b", "--data", str(data_dir), "--out", str(out), "--no-progress",
                 "--set", "d_model=32", "--set", "max_seq_len=32", "--set", "train.batch_size=2",
                 "--set", "train.seq_len=16", "--set", "train.budget=1", "--set", "train.eval_batches=1",
                 "--set", "train.sample_every=-1"]) == 0
    return out


def test_cli_stride_prints_the_strided_perplexity(run_dir, data_dir, capsys):
    from archlab.runs.model_folder import load_run

    capsys.readouterr()
    assert main(["eval", str(run_dir), "--seq-len", "16", "--stride", "6", "--batches", "2", "--batch-size", "3",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model, _ = load_run(run_dir)
    ids = torch.from_numpy(TokenDataset(data_dir, "val").tokens.astype("int64"))
    want = strided_perplexity(model, ids, seq_len=16, stride=6, max_windows=6)
    assert got["windows"] == 6 and got["tokens"] == 15 + 5 * 6
    assert got["loss"] == pytest.approx(want.loss, rel=1e-6) and got["stride"] == 6


@pytest.mark.parametrize("extra, needle", [
    (["--stride", "16"], "--stride 16 must be between 1 and --seq-len - 1 = 15"),
    (["--stride", "0"], "--stride 0 must be between 1"),
    (["--stride", "-3"], "--stride -3 must be between 1"),
    (["--stride", "4", "--by-position"], "--stride scores one stream"),
    (["--lengths", "16,x"], "--lengths '16,x' must be a comma-separated list"),
    (["--lengths", "1"], "every value must be at least 2"),
    (["--passkey", "--depths", "0,2"], "--depths '0,2': every value must be in [0.0, 1.0]"),
    (["--plot", "x.png"], "--plot needs --by-position or --lengths"),
])
def test_bad_long_context_options_are_one_line_exit_2(run_dir, capsys, extra, needle):
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--seq-len", "16", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_a_plot_path_that_is_no_image_is_refused_before_the_evaluation(run_dir, tmp_path, capsys):
    """--plot over a run's own file (config.yaml), a data file or a folder: one line, exit 2, nothing written; it
    used to evaluate first and end in matplotlib's ValueError traceback."""
    config = (run_dir / "config.yaml").read_bytes()
    for plot in (run_dir / "config.yaml", run_dir, tmp_path / "pos.bin"):
        capsys.readouterr()
        assert main(["eval", str(run_dir), "--by-position", "--batches", "1", "--plot", str(plot), "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--plot {plot} must name an image file ending in .pdf, .png, .svg" in err and len(err.splitlines()) == 1
    assert (run_dir / "config.yaml").read_bytes() == config and not (tmp_path / "pos.bin").exists()


def test_cli_by_position_and_lengths_write_a_plot_and_refuse_to_overwrite(run_dir, tmp_path, capsys):
    plot = tmp_path / "pos.png"
    args = ["eval", str(run_dir), "--by-position", "--lengths", "8,16", "--batches", "1", "--plot", str(plot)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "windows of 8" in out and "windows of 16" in out and "8-15" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = plot.stat().st_mtime_ns
    assert main(args) == 2
    assert "exists: pass --overwrite" in capsys.readouterr().err and plot.stat().st_mtime_ns == before
    assert main(args + ["--overwrite"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--lengths", "8,16", "--batches", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(got["by_length"]) == {"8", "16"} and (run_dir / "ppl_by_length.png").is_file()
    assert got["by_length"]["8"]["tokens"] == 2 * 8


def test_eval_set_scores_the_same_weights_under_a_zero_shot_rope_scaling(run_dir, data_dir, tmp_path, capsys):
    """--set position.rope_scaling...: the run's max_seq_len (32) becomes the original context, the figures are
    evaluate()'s on a model built with that config and the run's weights."""
    from archlab.models import build_model
    from archlab.runs.model_folder import load_run

    capsys.readouterr()
    sets = ["--set", "position.rope_scaling.kind=yarn", "--set", "position.rope_scaling.factor=4"]
    assert main(["eval", str(run_dir), "--lengths", "64", "--batches", "1", "--json", "--plot",
                 str(tmp_path / "yarn.png"), *sets]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out.strip().splitlines()[-1])["by_length"]["64"]
    assert "original 32 positions; max_seq_len 32 -> 128" in out.err
    model, _ = load_run(run_dir)
    cfg = model.config.with_overrides({"position.rope_scaling.kind": "yarn", "position.rope_scaling.factor": 4,
                                       "position.rope_scaling.original_max_seq_len": 32, "max_seq_len": 128})
    scaled = build_model(cfg).eval()
    scaled.load_state_dict(model.state_dict())
    val = TokenDataset(data_dir, "val")
    want = evaluate(scaled, val, batch_size=2, seq_len=64, max_batches=1)
    assert got["loss"] == pytest.approx(want.loss, rel=1e-6)
    x = torch.arange(64)[None] % 200
    with torch.no_grad():
        assert float((scaled(x) - model(x)).abs().max()) > 1e-5          # the scaling changed the model
    for extra, needle in [(["--set", "train.lr=1"], "eval --set takes model keys only"),
                          (["--set", "d_model=64"], "changes the model's weights"),
                          (["--set", "position.rope_scaling.kind=linear"], "factor=1 must be > 1")]:
        assert main(["eval", str(run_dir), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1
