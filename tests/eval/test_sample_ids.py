"""eval.evaluate.sample_ids: progress samples through archlab.generate, cached or recomputed, sliding past the
context; greedy tokens equal a plain full-forward argmax loop."""
import torch

from archlab import TransformerLM, presets
from archlab.eval.evaluate import sample_ids


def _model(max_seq_len: int = 24) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(presets.tiny("llama2-7b").with_overrides({"max_seq_len": max_seq_len})).eval()


@torch.no_grad()
def _greedy_by_hand(model, prompt: list[int], n: int, limit: int) -> list[int]:
    """The sliding rule written out token by token: a full forward over the window that sample_ids would
    use; rounds start with the last limit // 2 ids once the sequence fills the context."""
    ids, window_start, out = list(prompt), 0, []
    for _ in range(n):
        if len(ids) - window_start >= limit:        # the window is full: a new round from the last half
            window_start = len(ids) - limit // 2
        logits = model(torch.tensor([ids[window_start:]]))[0, -1]
        ids.append(int(logits.argmax()))
        out.append(ids[-1])
    return out


def test_greedy_samples_equal_a_full_forward_loop_within_and_past_the_context():
    model = _model(max_seq_len=24)
    prompt = [1, 5, 9, 3]
    for n in (10, 50):          # 10 fits the context; 50 slides three times
        got = sample_ids(model, prompt, n, temperature=0.0)
        assert got == _greedy_by_hand(model, prompt, n, limit=24)
        assert got == sample_ids(model, prompt, n, temperature=0.0, use_cache=False)


def test_sampling_is_seeded_privately_and_respects_the_vocabulary_limit():
    model = _model()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = sample_ids(model, [1, 2], 30, temperature=1.0, top_k=None, seed=7, vocab_limit=40)
    after = torch.rand(1)
    assert torch.equal(before, after)                          # the caller's RNG stream is untouched
    assert a == sample_ids(model, [1, 2], 30, temperature=1.0, top_k=None, seed=7, vocab_limit=40)
    assert len(a) == 30 and max(a) < 40
    assert a != sample_ids(model, [1, 2], 30, temperature=1.0, top_k=None, seed=8, vocab_limit=40)
    assert model.training is False
