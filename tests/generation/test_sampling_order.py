"""generation sampling_order: transformers' order (temperature first, the default) and the notes' order
(top-k -> top-p -> temperature) keep different tokens under top-p; each order equals transformers' own warpers
applied in that order; an unknown step is a one-line error (exit 2 on the command line)."""
from __future__ import annotations

import pytest
import torch

from archlab.generation import SamplingParams, filter_logits
from archlab.generation.config import GenerationConfig
from archlab.generation.sampling import SAMPLING_ORDERS, SAMPLING_STEPS, sampling_order

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def kept(order, **kw) -> list[bool]:
    return torch.isfinite(filter_logits(LOGITS, SamplingParams(order=order, **kw)))[0].tolist()


def test_order_changes_which_tokens_survive_top_p():
    """By hand: softmax([2, 1, 0, -1]) = [.644, .237, .087, .032]: top-p 0.8 keeps 2 tokens (.644 < .8, .881 >= .8).
    At temperature 2, softmax([1, .5, 0, -.5]) = [.455, .276, .167, .101]: top-p 0.8 keeps 3 (.731 < .8, .898)."""
    assert kept("transformers", temperature=2.0, top_p=0.8) == [True, True, True, False]
    assert kept("notes", temperature=2.0, top_p=0.8) == [True, True, False, False]
    assert kept("top_k,top_p,temperature", temperature=2.0, top_p=0.8) == [True, True, False, False]
    # below 1 the temperature sharpens: temperature first keeps fewer
    assert kept("transformers", temperature=0.5, top_p=0.9) == [True, True, False, False]
    assert kept("notes", temperature=0.5, top_p=0.9) == [True, True, True, False]
    # the surviving logits are the same scaled values either way
    a = filter_logits(LOGITS, SamplingParams(temperature=2.0, top_p=0.99, order="notes"))
    b = filter_logits(LOGITS, SamplingParams(temperature=2.0, top_p=0.99))
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.allclose(a[torch.isfinite(a)], LOGITS[0] / 2)


@pytest.mark.parametrize("order", ["transformers", "notes", "top_p,temperature,top_k"])
def test_each_order_equals_transformers_warpers_in_that_order(order):
    lp = pytest.importorskip("transformers.generation.logits_process")

    warpers = {"temperature": lp.TemperatureLogitsWarper(1.7), "top_k": lp.TopKLogitsWarper(20),
               "top_p": lp.TopPLogitsWarper(0.7), "min_p": lp.MinPLogitsWarper(0.05)}
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    want = logits.clone()
    for step in sampling_order(order):
        want = warpers[step](None, want)
    got = filter_logits(logits, SamplingParams(temperature=1.7, top_k=20, top_p=0.7, min_p=0.05, order=order))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_orders_name_every_registered_step_once():
    assert set(SAMPLING_STEPS.names()) == set(SAMPLING_ORDERS["transformers"])
    assert sampling_order("top_k,top_p,temperature") == ("top_k", "top_p", "temperature", "min_p")
    assert SamplingParams().order == ("temperature", "top_k", "top_p", "min_p")
    assert GenerationConfig(sampling_order="notes").sampling_order == SAMPLING_ORDERS["notes"]


@pytest.mark.parametrize("order, needle", [
    ("top_k,nucleus", "unknown step 'nucleus'"),
    ("top_k,top_k", "each step at most once"),
    ("", "no step"),
])
def test_bad_orders_are_named(order, needle):
    with pytest.raises(ValueError, match=needle):
        sampling_order(order)


def test_generate_cli_refuses_an_unknown_step_in_one_line(capsys):
    from archlab.cli import main

    assert main(["generate", "no/such/run", "--prompt", "x", "--sampling-order", "top_k,typical"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sampling-order: sampling order top_k,typical: unknown step 'typical'" in err
    assert len(err.splitlines()) == 1


def test_generate_samples_with_the_order_it_is_given():
    """Same seed: the notes' order can draw a token that temperature-first top-p removed, never the reverse here."""
    from archlab import generate
    from archlab.config import ModelConfig
    from archlab.models.decoder import TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=32, d_model=32, n_layers=1, attention={"n_heads": 4},
                                      init={"std": 0.5})).eval()
    prompt = torch.tensor([1, 2, 3])
    logits = model(prompt[None])[:, -1]
    allowed = {o: set(torch.isfinite(filter_logits(logits, SamplingParams(temperature=3.0, top_p=0.5, order=o)))
                      .nonzero()[:, 1].tolist()) for o in ("transformers", "notes")}
    assert allowed["notes"] < allowed["transformers"]
    for order in ("transformers", "notes"):
        firsts = {int(generate(model, prompt, 1, temperature=3.0, top_p=0.5, seed=s, sampling_order=order)[-1])
                  for s in range(40)}
        assert firsts <= allowed[order]
    from archlab.config import ConfigError
    with pytest.raises(ConfigError, match="sampling_order='x': sampling order x: unknown step 'x'"):
        generate(model, prompt, 1, temperature=3.0, top_p=0.5, seed=0, sampling_order="x")
