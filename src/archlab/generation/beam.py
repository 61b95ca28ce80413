"""Beam search: keep the `num_beams` best partial sequences by summed log-probability.

A hypothesis that emits EOS is finished; finished ones are ranked by
sum(log p) / n_generated ** length_penalty (length_penalty > 0 favours longer sequences, < 0
shorter; the convention of transformers' BeamSearchScorer). A batch row stops once it holds
`num_beams` finished hypotheses and no running beam can beat the worst of them at the current
length; at max_new_tokens the running beams join the finished ones and the best is returned.
"""
from __future__ import annotations

import torch

from archlab.generation.stepper import Stepper


@torch.inference_mode()
def beam_search(model, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int,
                num_beams: int, length_penalty: float = 1.0, eos: list[int] = (),
                pad: int = 0, use_cache: bool = True, vocab_limit: int | None = None) -> torch.Tensor:
    """ids, mask (b, t) left-padded -> (b, t + n) best sequence per row, padded with `pad`."""
    if max_new_tokens < 1:
        return ids
    b, t = ids.shape
    nb = num_beams
    stepper = Stepper(model, ids.repeat_interleave(nb, 0), mask.repeat_interleave(nb, 0),
                      max_new_tokens, use_cache=use_cache, vocab_limit=vocab_limit)
    device = stepper.ids.device
    logits = stepper.prefill()                                           # (b*nb, v)
    vocab = logits.shape[-1]
    scores = torch.zeros(b, nb, device=device)
    scores[:, 1:] = float("-inf")  # all beams start equal: expand only the first at step 0
    seqs = torch.empty(b * nb, 0, dtype=torch.long, device=device)      # generated tokens
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b
    eos_set = set(eos)
    base = (torch.arange(b, device=device) * nb)[:, None]               # (b, 1)

    for step in range(max_new_tokens):
        logp = logits.float().log_softmax(-1).view(b, nb, vocab) + scores[..., None]
        top_scores, top_idx = logp.view(b, nb * vocab).topk(min(2 * nb, nb * vocab), dim=-1)
        new_scores = torch.full((b, nb), float("-inf"), device=device)
        new_src = torch.zeros(b, nb, dtype=torch.long, device=device)
        new_tok = torch.full((b, nb), pad, dtype=torch.long, device=device)
        top_scores_l, top_idx_l = top_scores.tolist(), top_idx.tolist()
        for i in range(b):
            if done[i]:
                new_src[i] = torch.arange(nb, device=device)
                continue
            j = 0
            for rank, (s, flat) in enumerate(zip(top_scores_l[i], top_idx_l[i])):
                src, tok = divmod(flat, vocab)
                if tok in eos_set:
                    if rank < nb:  # only EOS among the best nb counts (as in transformers)
                        tokens = seqs[i * nb + src].tolist() + [tok]
                        finished[i].append((s / len(tokens) ** length_penalty, tokens))
                    continue
                new_scores[i, j], new_src[i, j], new_tok[i, j] = s, src, tok
                j += 1
                if j == nb:
                    break
            finished[i] = sorted(finished[i], key=lambda h: -h[0])[:nb]
            if len(finished[i]) == nb:
                best_running = float(new_scores[i].max()) / (step + 1) ** length_penalty
                done[i] = best_running <= finished[i][-1][0]
        if all(done):
            break
        index = (base + new_src).view(-1)                                 # (b*nb,)
        seqs = torch.cat((seqs[index], new_tok.view(-1, 1)), dim=1)
        scores = new_scores
        if step < max_new_tokens - 1:
            stepper.reorder(index)
            logits = stepper.step(new_tok.view(-1))

    for i in range(b):
        if not done[i]:
            for beam in range(nb):
                s = float(scores[i, beam])
                if s > float("-inf"):
                    finished[i].append((s / seqs.shape[1] ** length_penalty, seqs[i * nb + beam].tolist()))
    best = [max(h, key=lambda x: x[0])[1] if h else [] for h in finished]
    width = max(len(x) for x in best)
    out = torch.full((b, t + width), pad, dtype=torch.long, device=device)
    out[:, :t] = ids.to(device)
    for i, tokens in enumerate(best):
        out[i, t:t + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
    return out
