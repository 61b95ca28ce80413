"""Draft models of the target's own tokenizer: the int8 copy of the target (archlab quantize) drafts for the float
target and greedy output stays plain greedy's (several families, batch 1 and left-padded batches, fixed and auto k;
slow: SmolLM2-135M-Instruct); and the acceptance rate counts the drafts the rule checked, so with drafts accepted
independently with probability p it measures p and the tokens per round meet (1 - p^(k+1)) / (1 - p)."""
import copy

import pytest
import torch
from test_speculative import FAMILIES, _model, _prompts

import archlab
from archlab.generation import SpeculativeStats
from archlab.generation.drafts import Proposal
from archlab.nn.int8 import is_quantized, quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("family", FAMILIES)
def test_the_int8_copy_of_the_target_drafts_plain_greedys_tokens(family):
    """The draft's int8 kernel may quantize a call's rows together (its logits depend on the batch): it only
    proposes, and the float target checks every token, so the output is plain greedy's."""
    model = _model(family)
    draft = quantize_int8(copy.deepcopy(model)).eval()
    assert any(map(is_quantized, draft.modules()))
    rows = _prompts(128, seed=2)
    for batch in ([rows[1]], rows):
        plain = archlab.generate(model, batch, max_new_tokens=24)
        for k in (1, 4, "auto"):
            stats = SpeculativeStats()
            out = archlab.generate(model, batch, max_new_tokens=24, draft=draft, draft_tokens=k, stats=stats)
            assert torch.equal(out, plain), (family, k, len(batch))
            assert stats.alpha > 0.5, (family, k, stats.summary())      # the int8 copy mostly agrees


class _Bernoulli:
    """A scripted draft: the target's own greedy tokens (`truth`: prompt + plain greedy's output), each replaced by
    a wrong token with probability 1 - p, independently: every checked draft is accepted with probability p."""

    name = "bernoulli"

    def __init__(self, truth: list[int], p: float, vocab: int, seed: int = 0):
        self.truth, self.p, self.vocab = truth, p, vocab
        self.g = torch.Generator().manual_seed(seed)
        self.rounds: list[tuple[int, int]] = []     # (k, the run the check must accept: drafts before the first wrong)

    def start(self, ids, mask, setup) -> None:
        pass

    def propose(self, seqs, k, choose) -> Proposal:
        right = self.truth[seqs.shape[1]:seqs.shape[1] + k]
        wrong = (torch.rand(len(right), generator=self.g) >= self.p).tolist()
        self.rounds.append((len(right), wrong.index(True) if True in wrong else len(right)))
        return Proposal(torch.tensor([[(t + 1) % self.vocab if w else t for t, w in zip(right, wrong)]]))

    def commit(self, length: int) -> None:
        pass


@pytest.mark.parametrize("k", [6, "auto"])
def test_alpha_counts_checked_drafts_and_the_theory_predicts_tokens_per_round(k):
    p, new = 0.7, 400
    model = _model("llama3-8b")
    model = archlab.TransformerLM(model.config.with_overrides({"max_seq_len": 512, "init.std": 0.2})).eval()
    prompt = _prompts(128)[0]
    truth = archlab.generate(model, prompt, max_new_tokens=new).tolist()
    stats = SpeculativeStats()
    draft = _Bernoulli(truth, p, 128)
    out = archlab.generate(model, prompt, max_new_tokens=new, draft=draft, draft_tokens=k, stats=stats)
    assert out.tolist() == truth
    # the counts are the draft's own: its runs before the first wrong token, and the rounds that had one
    assert stats.accepted == sum(run for _, run in draft.rounds)
    assert stats.rejected == sum(run < n for n, run in draft.rounds)
    assert stats.new_tokens - stats.prefills == stats.accepted + stats.rounds     # a run, then the target's token
    assert stats.alpha == pytest.approx(p, abs=0.06)
    assert stats.tokens_per_round == pytest.approx(stats.theory, rel=0.1)
    # the share of drafted tokens kept is not the acceptance rate: the drafts after a rejection were never checked
    assert stats.kept < p - 0.15


@pytest.mark.slow
def test_smollm2s_int8_copy_drafts_its_plain_greedy_tokens(tmp_path):
    """On the real model (~30 s of CPU on 2 cores): SmolLM2-135M-Instruct from the `models` extra, converted, drafted
    for by its own int8 copy; a rewrite prompt (the answer copies the passage) and an open one, greedy output
    identical."""
    pytest.importorskip("gguf")
    from archlab.cli import main
    from archlab.interop.gguf import packaged_model
    from archlab.runs.model_folder import load_model_and_tokenizer

    try:
        path = packaged_model("smollm2-135m-instruct")
    except Exception as exc:  # noqa: BLE001 - the models extra is not installed
        pytest.skip(f"SmolLM2 not installed: {exc}")
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "run")]) == 0
    model, tok = load_model_and_tokenizer(tmp_path / "run", "cpu")
    draft = quantize_int8(copy.deepcopy(model)).eval()
    passage = "The old lighthouse stood at the edge of the cliff. Every night its keeper climbed the narrow stairs."
    for text in (f"Rewrite this passage, changing nothing: {passage}\n\n{passage}", "Once upon a time, a robot"):
        prompt = tok.encode(text)
        plain = archlab.generate(model, prompt, max_new_tokens=24, eos_token_id=[])
        stats = SpeculativeStats()
        out = archlab.generate(model, prompt, max_new_tokens=24, eos_token_id=[], draft=draft, draft_tokens="auto",
                               stats=stats)
        assert torch.equal(out, plain), (text, tok.decode(out[len(prompt):].tolist()))
        assert stats.alpha > 0.6 and stats.tokens_per_forward > 1.5, stats.summary()     # (0.8 and 3.0 measured)
