"""The lab's `extend` run kind and the context_extension suite: a base trained once at L per seed (or shared), every
method and step count extended from it to factor x L, rows with perplexity by length and passkey accuracy, and the
report's section; bad settings refused by name, a scaling factor <= 1 in one line with exit status 2."""
import json
import math
from pathlib import Path

import pytest
import yaml

from archlab.cli import main
from archlab.config import ConfigError
from archlab.lab import suites
from archlab.lab.bases import BASE_RECORD
from archlab.lab.plan import plan
from archlab.lab.report import build_report
from archlab.lab.runner import run_suite
from archlab.lab.verdicts import Rule


def _tiny_suite(**kw) -> suites.Suite:
    fields = dict(
        name="ext_tiny", claim="YaRN extends", runs="extend", analysis="context", seeds=1,
        axes=[{"name": "method", "values": [{"label": "none", "set": {}},
                                            {"label": "yarn", "set": {"position.rope_scaling.kind": "yarn"}}]},
              {"name": "steps", "values": [{"label": str(n), "set": {"extend.steps": n}} for n in (0, 2)]}],
        base={"model": {"d_model": 32, "n_layers": 1, "attention.n_heads": 2, "mlp.d_ff": 64},
              "train": {"seq_len": 16, "batch_size": 4, "eval_every": 2, "eval_batches": 2, "warmup_steps": 1}},
        scales={"small": {"budget": 3, "unit": "steps"}},
        extend={"factor": 4, "lengths": [1, 4], "passkey_trials": 1, "train": {"batch_size": 2, "warmup_steps": 1}},
        rules=[Rule(kind="less", metric="ppl_extended", a={"method": "yarn", "steps": "0"},
                    b={"method": "none", "steps": "0"}, statement="YaRN below none zero-shot")])
    return suites.Suite(**{**fields, **kw})


def test_context_extension_declares_four_methods_three_step_counts_and_yarn_at_100():
    suite = suites.BUILTIN["context_extension"]
    labels = [v.labels for v in suite.expand()]
    assert len(labels) == 13 and {"method": "yarn", "steps": "100"} in labels
    assert {(lab["method"], lab["steps"]) for lab in labels[:12]} == {
        (m, s) for m in ("none", "linear", "ntk", "yarn") for s in ("0", "50", "200")}
    kinds = [r.kind for r in suite.rules]
    assert kinds.count("less") == 5 and kinds.count("above") == 1 and kinds.count("below") == 1
    assert all(r.metric == "ppl_extended" for r in suite.rules if r.kind == "less")
    passkey = {r.kind: (r.expected, r.a) for r in suite.rules if r.metric == "passkey_extended"}
    assert passkey == {"above": (0.9, {"method": "yarn", "steps": "200"}),
                       "below": (0.2, {"method": "none", "steps": "0"})}


def test_every_extension_starts_from_its_seeds_base_trained_at_L(tmp_path):
    runs = plan(suites.BUILTIN["context_extension"], tmp_path, vocab_size=257)
    assert len(runs) == 26
    by_seed = {seed: {r.base.folder for r in runs if r.seed == seed} for seed in (0, 1)}
    assert all(len(folders) == 1 for folders in by_seed.values()) and by_seed[0] != by_seed[1]
    for r in runs:
        assert r.base.model.max_seq_len == r.base.train.seq_len == 64 and r.base.train.budget == 600
        assert r.base.model.position.rope_scaling is None and r.base.model.seed == r.seed
        assert r.model.max_seq_len == r.train.seq_len == 256 and r.train.lr == 1e-3
        steps = int(r.variant.labels["steps"])
        assert r.variant.extend == {"steps": steps} and r.train.budget == max(steps, 1)
        scaling = r.model.position.rope_scaling
        kind = suites._EXTENSIONS[r.variant.labels["method"]]
        assert (scaling is None) if kind is None else (scaling.kind, scaling.factor, scaling.original_max_seq_len) \
            == (kind, 4, 64)
        assert r.config["overrides"]["extend"] == {"steps": steps}
    shared = plan(_tiny_suite(seeds=2, extend={"bases": "shared"}), tmp_path, vocab_size=257)
    assert len({r.base.folder for r in shared}) == 1 and {r.seed for r in shared} == {0, 1}


@pytest.mark.parametrize("settings, word", [
    ({"factor": 1}, "extend.factor"), ({"factor": 0.5}, "extend.factor"), ({"bases": "each"}, "extend.bases"),
    ({"colour": 1}, "unknown extend"), ({"passkey_trials": -1}, "passkey_trials"), ({"lengths": []}, "lengths"),
    ({"train": 3}, "extend.train must be a mapping")])
def test_bad_extend_settings_are_refused_by_name(tmp_path, settings, word):
    with pytest.raises(ConfigError, match=word):
        plan(_tiny_suite(extend=settings), tmp_path, vocab_size=257)


def test_bad_steps_and_extend_keys_outside_an_extend_suite_are_refused(tmp_path):
    bad = [{"label": "neg", "set": {"extend.steps": -1}}]
    with pytest.raises(ConfigError, match="extend.steps|whole number >= 0"):
        plan(_tiny_suite(axes=[], variants=bad), tmp_path, vocab_size=257)
    with pytest.raises(ConfigError, match="runs: extend"):
        plan(_tiny_suite(runs="train", analysis=None), tmp_path, vocab_size=257)


@pytest.mark.parametrize("where", ["extend", "variant"])
def test_a_scaling_factor_of_at_most_one_is_one_line_and_exit_2(tmp_path, capsys, where):
    suite = _tiny_suite().to_dict()
    if where == "extend":
        suite["extend"]["factor"] = 1
    else:
        suite["axes"] = []
        suite["variants"] = [{"label": "yarn-half", "set": {"position.rope_scaling.kind": "yarn",
                                                            "position.rope_scaling.factor": 0.5}}]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "sweep"
    assert main(["ablate", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "factor" in lines[0] and "> 1" in lines[0], err
    assert not out.exists()                                   # refused before any folder or data was made


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    from archlab.data.prepare import prepare

    folder = tmp_path_factory.mktemp("ext") / "data"
    docs = ["".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(j, j + 40))
            for j in range(0, 800, 40)]
    prepare(docs, "bytes", folder, progress=False, overwrite=True, val_fraction=0.1)
    return folder


@pytest.mark.slow         # ~4 s alone, ~9 s on a loaded 2-core machine
def test_an_extend_sweep_builds_one_base_extends_it_and_reports(tmp_path, byte_data):
    sweep = tmp_path / "sweep"
    rows = run_suite(_tiny_suite(), sweep, data_dir=byte_data, progress=False)
    assert [r.status for r in rows] == ["done"] * 4, [r.error for r in rows]
    (base,) = (sweep / "bases").iterdir()
    record = json.loads((base / BASE_RECORD).read_text())
    assert record["train"]["seq_len"] == 16 and record["train"]["budget"] == 3
    assert sum("base_s" in r.extra for r in rows) == 1 and {r.extra["base"] for r in rows} == {base.name}
    for r in rows:
        steps = int(r.extra["labels"]["steps"])
        assert r.extra["steps"] == steps and r.steps == steps
        assert set(r.extra["ppl_by_length"]) == {"16", "64"} and r.extra["extended_len"] == 64
        assert r.final_val_loss == pytest.approx(math.log(r.extra["ppl_extended"]))
        assert "passkey_extended_note" in r.extra          # 64 tokens cannot hold the passkey prompt
        assert Path(r.run_dir).exists() == (steps > 0)     # a 0-step run trains nothing and writes no run folder
    zero = {r.extra["labels"]["method"]: r for r in rows if r.steps == 0}
    # at the base's own length the YaRN base's perplexity differs from plain RoPE's only through YaRN's
    # attention factor and frequencies; both are the same weights
    assert zero["none"].extra["base_val_loss"] == zero["yarn"].extra["base_val_loss"]
    text = build_report(sweep)["md"].read_text()
    assert "Perplexity by length and passkey retrieval" in text and "ext_tiny_ppl_by_length.png" in text
    assert "1 base trained at 16 tokens" in text and "extended to 64" in text
