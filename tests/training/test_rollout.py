"""Rollouts (training/methods/rollout.py): groups of sampled completions through the KV-cached generate, masks that
end at the first EOS, and per-token log-probs that do not depend on the padding a batch puts around a row."""
from __future__ import annotations

import pytest
import torch

from archlab import TransformerLM
from archlab.training.methods.rollout import completion_logps, mask_at_eos, rollout

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model():
    from test_checkpoint import tiny_model

    torch.manual_seed(0)
    return TransformerLM(tiny_model()).eval()


def test_mask_at_eos_keeps_the_first_eos_and_nothing_after():
    ids = torch.tensor([[4, 0, 7, 0], [4, 5, 6, 7], [0, 1, 2, 3]])
    assert mask_at_eos(ids, [0]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert mask_at_eos(ids, [6, 7]).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_a_rollout_is_a_function_of_the_seed_and_groups_rows_by_prompt(model):
    kw = dict(group=4, max_new_tokens=6, eos_ids=list(range(100)), pad_id=0, temperature=1.0)
    a, b, c = rollout(model, PROMPTS, seed=3, **kw), rollout(model, PROMPTS, seed=3, **kw), rollout(model, PROMPTS,
                                                                                                       seed=4, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logps, b.logps)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert a.completion_ids.shape[0] == 12 and a.prompt_ids.shape == (12, 4)
    for i, prompt in enumerate(PROMPTS):                      # rows 4i..4i+3 hold prompt i, left-padded
        for row in range(4 * i, 4 * i + 4):
            assert a.prompt_ids[row][a.prompt_mask[row].bool()].tolist() == prompt
    eos = torch.tensor(kw["eos_ids"])
    for row, n in zip(a.completion_ids, a.lengths):           # the mask ends at the first EOS; pad after it
        hits = torch.isin(row[:n], eos).nonzero()
        assert (len(hits) == 0 and n == row.numel()) or (len(hits) == 1 and hits[0, 0] == n - 1)
        assert (row[n:] == 0).all()
    assert a.truncated.tolist() == [not bool(torch.isin(r[n - 1], eos)) for r, n in zip(a.completion_ids, a.lengths)]
    assert (a.logps[a.completion_mask == 0] == 0).all() and (a.logps[a.completion_mask == 1] < 0).all()
    assert model.training is False


def test_rollout_logps_equal_each_row_scored_alone_without_padding(model):
    out = rollout(model, PROMPTS, group=2, max_new_tokens=5, eos_ids=[1], pad_id=0, seed=0, temperature=0.7)
    for row in range(out.completion_ids.shape[0]):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        n = int(out.lengths[row])
        ids = torch.cat([prompt, out.completion_ids[row, :n]])[None]
        with torch.no_grad():
            logits = model(ids)[0, len(prompt) - 1: -1].float() / 0.7                  # (n, v)
        alone = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        torch.testing.assert_close(out.logps[row, :n], alone, atol=1e-5, rtol=0)
    logps, entropy = completion_logps(model, out.prompt_ids, out.prompt_mask, out.completion_ids, temperature=0.7,
                                      completion_mask=out.completion_mask)
    torch.testing.assert_close(logps * out.completion_mask, out.logps, atol=1e-5, rtol=0)
    assert entropy is not None and (entropy >= 0).all() and (entropy <= torch.log(torch.tensor(257.0)) + 1e-4).all()


def test_completions_of_chat_prompts_also_end_at_the_templates_end_of_turn(tmp_path):
    import json
    import shutil

    from archlab.data.prompts import load_prompts
    from archlab.tokenizer import train as train_tokenizer
    from archlab.tokenizer.chat_builtin import install_chat_template
    from archlab.tokenizer.loading import load
    from archlab.training.methods.rollout import end_ids

    (tmp_path / "c.txt").write_text("the cat sat on the mat " * 20)
    train_tokenizer(tmp_path / "c.txt", 260, ["<|endoftext|>"]).save(tmp_path / "tok")
    shutil.copytree(tmp_path / "tok", tmp_path / "chat")
    install_chat_template(tmp_path / "chat", "chatml")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "the cat"}) + "\n")
    (tmp_path / "msgs.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "the cat"}]}) + "\n")
    eot = load(tmp_path / "tok").eot_id
    assert end_ids(load_prompts(tmp_path / "plain.jsonl", tmp_path / "tok")) == [eot]
    chat = end_ids(load_prompts(tmp_path / "msgs.jsonl", tmp_path / "chat"))
    assert chat[0] == eot and load(tmp_path / "chat").decode(chat[1:]) == "<|im_end|>"


def test_with_a_seed_per_prompt_a_prompts_completions_do_not_depend_on_the_rest_of_the_batch(model):
    kw = dict(group=3, max_new_tokens=6, eos_ids=[1, 2, 3], pad_id=0, temperature=1.0)
    whole = rollout(model, PROMPTS, seed=[7, 8, 9], **kw)
    alone = rollout(model, [PROMPTS[2], PROMPTS[0]], seed=[9, 7], **kw)
    for mine, theirs in ((alone.completion_tokens()[:3], whole.completion_tokens()[6:]),
                         (alone.completion_tokens()[3:], whole.completion_tokens()[:3])):
        assert mine == theirs
    other = rollout(model, PROMPTS, seed=[7, 5, 9], **kw)        # another seed for prompt 1: only its rows change
    assert other.completion_tokens()[:3] == whole.completion_tokens()[:3]
    assert other.completion_tokens()[3:6] != whole.completion_tokens()[3:6]


def test_ranks_shares_gathered_are_the_rollout_one_process_samples(model, monkeypatch):
    """Two ranks each sample their slots (rollout.my_slots) of five prompts; gathered (gather_rollout, the collective
    replaced by the two ranks' pieces) they are the one-process rollout of all five, padding included."""
    from types import SimpleNamespace

    from archlab.training import distributed as dist_util
    from archlab.training.methods.rollout import gather_rollout, my_slots, slot_seed

    prompts = [[5, 6, 7, 8, 9, 10], [9, 10], [11, 12, 13], [14], [15, 16, 17, 18]]
    kw = dict(group=2, max_new_tokens=5, eos_ids=[1, 2, 3, 4], pad_id=0, temperature=1.0)
    seeds = [slot_seed(0, 4, k) for k in range(5)]
    one = rollout(model, prompts, seed=seeds, **kw)
    infos = [SimpleNamespace(rank=r, world_size=2, enabled=True) for r in range(2)]
    assert [my_slots(5, i) for i in infos] == [[0, 2, 4], [1, 3]]
    shares = []
    for info in infos:
        slots = my_slots(5, info)
        out = rollout(model, [prompts[k] for k in slots], seed=[seeds[k] for k in slots], **kw)
        shares.append((slots, out, torch.arange(len(slots) * 2, dtype=torch.float32) + 10 * info.rank))
    pieces = [(slots, [t for t in (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask, out.logps,
                                   out.truncated, score)]) for slots, out, score in shares]
    assert shares[1][1].prompt_ids.shape[1] == 2                 # rank 1's prompts are padded to its own widest
    monkeypatch.setattr(dist_util, "gather_objects", lambda obj, info: pieces)
    whole, extra = gather_rollout(shares[1][1], shares[1][0], 5, 2, 0, infos[1], per_row={"score": shares[1][2]})
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(whole, name), getattr(one, name)), name
    torch.testing.assert_close(whole.logps, one.logps, atol=1e-5, rtol=0)
    assert extra["score"].tolist() == [0, 1, 10, 11, 2, 3, 12, 13, 4, 5]       # slot order: 0, 1, 2, 3, 4
    empty = rollout(model, [], seed=[], **kw)
    assert empty.completion_ids.shape == (0, 0)
