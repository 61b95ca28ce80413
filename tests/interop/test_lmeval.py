"""lm-evaluation-harness over archlab: the adapter's numbers equal the harness's own `hf` backend on the
same weights exported with `convert --to-hf`, on a local task (a YAML over a local .jsonl, offline)."""
from __future__ import annotations

import json
import math

import pytest

from archlab.cli import main

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow          # the harness imports and builds its task index: ~20 s

TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture
def task_and_export(tmp_path, monkeypatch):
    from test_export import _chain_run  # a run whose model continues a -> b -> c -> end of text
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"question": "a", "choices": ["b", "c", " x"], "answer": 0},
            {"question": "ab", "choices": ["a", "c", "bc"], "answer": 1},
            {"question": "say ", "choices": ["abc", "cba"], "answer": 0},
            {"question": "", "choices": ["a", "zz"], "answer": 0}]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(TASK.format(data=data))
    run, tok, _ = _chain_run(tmp_path)
    exported = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(exported)]) == 0
    return run, exported, tasks


def test_adapter_scores_equal_the_hf_backend(task_and_export):
    from lm_eval.tasks import TaskManager

    from archlab.eval.lmeval import run_tasks
    from archlab.runs.model_folder import load_run
    run, exported, tasks = task_and_export
    model, tok = load_run(run)
    ours = run_tasks(model, tok, ["tiny_choice"], include_path=str(tasks))["results"]["tiny_choice"]
    theirs = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={exported},dtype=float32", device="cpu",
                                     tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tasks)),
                                     bootstrap_iters=0, log_samples=False)["results"]["tiny_choice"]
    for metric in ("acc,none", "acc_norm,none"):
        assert math.isclose(ours[metric], theirs[metric]), metric
    assert ours["acc,none"] >= 0.5


def test_adapter_loglikelihoods_equal_hf_per_request(task_and_export):
    """Request by request, not only the aggregate: the log-likelihoods agree to float precision."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from archlab.eval.lmeval import ArchlabLM
    from archlab.runs.model_folder import load_run
    run, exported, _ = task_and_export
    model, tok = load_run(run)
    pairs = [("a", " b"), ("abc", " def"), ("say ", "abc"), ("", "a"), ("x", " y z")]   # a BPE merge across
    # the boundary ("ab" + "c" -> "abc") leaves the hf backend an empty continuation, which it refuses
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    ours = ArchlabLM(model, tok).loglikelihood(requests)
    theirs = HFLM(pretrained=str(exported), dtype="float32", device="cpu").loglikelihood(requests)
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) and greedy_a == greedy_b
    rolling = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=("abc abc abc",), idx=0)]
    assert math.isclose(ArchlabLM(model, tok).loglikelihood_rolling(rolling)[0],
                        HFLM(pretrained=str(exported), dtype="float32", device="cpu").loglikelihood_rolling(rolling)[0],
                        rel_tol=1e-4)


def test_eval_tasks_prints_the_harness_table(task_and_export, capsys):
    run, _, tasks = task_and_export
    assert main(["eval", str(run), "--tasks", "tiny_choice", "--include-path", str(tasks), "--limit", "4"]) == 0
    out = capsys.readouterr().out
    assert "tiny_choice" in out and "acc" in out and "|" in out
