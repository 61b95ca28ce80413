"""Beam search, step for step the algorithm of transformers' generate(num_beams=..., do_sample=False).

Per batch row, `num_beams` running hypotheses are scored by their summed log-probabilities (after the
logits processors, which beam search applies to the log-probabilities). Each step:

  1. every running beam's next-token log-probs are added to its score; the best
     K = max(2, 1 + number of EOS ids) x num_beams continuations over all beams are kept, so that
     num_beams of them go on even when some end;
  2. a continuation ends when its token is an EOS id, or when it reaches max_new_tokens (then all do);
     the best num_beams continuations that do not end run on;
  3. those among the best num_beams (of K) that end are candidates for the finished set, scored
     sum(log p) / n ** length_penalty, n = the number of generated tokens (EOS included; the prompt's
     length does not count). The finished set keeps the best num_beams hypotheses. length_penalty > 0
     favours longer hypotheses, < 0 shorter ones; 0 ranks them by summed log-probability alone;
  4. a row stops taking candidates once it is full (num_beams finished) and cannot improve:
       early_stopping=True     as soon as it is full;
       early_stopping=False    when the best running score / n ** length_penalty, n the current
                               length, is no better than the worst finished score (transformers'
                               default; a heuristic when length_penalty > 0);
       early_stopping="never"  the same, but with n = max_new_tokens when length_penalty > 0: the
                               best a running beam could still reach, so the search is exact.
Generation ends when no row can improve (with early_stopping=True: when every row is full), or at
max_new_tokens. Each row returns its best finished hypothesis; rows shorter than the longest are
filled with `pad`.

The bookkeeping uses transformers' -1e9 where a score is ruled out (the beams that start as copies of
the first, continuations that cannot be finished or run on), so that ties break the same way.
Known difference: transformers fills short rows with eos_token_id when pad_token_id is 0 (a
precedence slip in `pad_token_id or eos_token_id[0] if ...`); archlab fills with `pad`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from archlab.generation.processors import Processor, apply
from archlab.generation.stepper import Stepper

RULED_OUT = -1.0e9   # transformers' stand-in for -inf in beam scores


@torch.inference_mode()
def beam_search(model, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int,
                num_beams: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
                eos: Sequence[int] = (), pad: int = 0, use_cache: bool = True,
                vocab_limit: int | None = None, processors: Sequence[Processor] = (),
                source: tuple[torch.Tensor, torch.Tensor | None] | None = None, compile: bool = False) -> torch.Tensor:
    """ids, mask (b, t) left-padded -> (b, t + n) best hypothesis per row, padded with `pad`.
    source: an encoder-decoder's (source ids, mask or None) (b, s): `ids` are then its decoder prompts (the start
    token); the encoder runs once per source, its output repeated for the row's beams (Stepper).

    processors: functions (seqs (b * num_beams, t + step), log_probs) -> log_probs applied every step
    (archlab.generation.processors); seqs starts with `ids` as given, padding included. compile: steps through
    the model's compiled step (archlab.nn.compiled_step), as generate's compile=True."""
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping={early_stopping!r} must be True, False or 'never'")
    if num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be >= 1")
    if max_new_tokens < 1:
        return ids
    b, t = ids.shape
    nb, n_max = num_beams, max_new_tokens
    stepper = Stepper(model, ids.repeat_interleave(nb, 0), mask.repeat_interleave(nb, 0), n_max,
                      use_cache=use_cache, vocab_limit=vocab_limit, source=source, source_repeats=nb,
                      compile=compile)
    device = stepper.ids.device
    prompt = ids.to(device).repeat_interleave(nb, 0)                     # (b*nb, t) what processors see
    eos_t = torch.tensor(list(eos), dtype=torch.long, device=device)
    keep = max(2, 1 + len(eos)) * nb                                     # K continuations per row
    in_top = torch.arange(keep, device=device) < nb                      # (K,) the best nb of them
    base = (torch.arange(b, device=device) * nb)[:, None]                # (b, 1)

    running = torch.empty(b, nb, 0, dtype=torch.long, device=device)     # generated tokens per beam
    running_scores = torch.zeros(b, nb, device=device)
    running_scores[:, 1:] = RULED_OUT      # the beams start equal: only the first one expands at step 0
    done = torch.full((b, nb, n_max), pad, dtype=torch.long, device=device)   # finished, best first
    done_len = torch.zeros(b, nb, dtype=torch.long, device=device)
    done_scores = torch.full((b, nb), RULED_OUT, device=device)
    is_done = torch.zeros(b, nb, dtype=torch.bool, device=device)        # slot holds a finished hypothesis
    improvable = torch.ones(b, 1, dtype=torch.bool, device=device)       # row may still take candidates

    logits = stepper.prefill()                                           # (b*nb, v)
    for step in range(n_max):
        n = step + 1                                                     # generated tokens after this step
        logp = logits.float().log_softmax(-1)
        if processors:
            logp = apply(processors, torch.cat((prompt, running.reshape(b * nb, step)), 1), logp)
        vocab = logp.shape[-1]
        logp = (logp.view(b, nb, vocab) + running_scores[..., None]).view(b, nb * vocab)
        top_scores, flat = logp.topk(keep, dim=-1)                       # (b, K), best first
        src, tok = flat // vocab, flat % vocab
        cand = torch.cat((running.gather(1, src[..., None].expand(-1, -1, step)), tok[..., None]), -1)
        ends = torch.isin(tok, eos_t) if len(eos) else torch.zeros_like(tok, dtype=torch.bool)
        if n == n_max:
            ends = torch.ones_like(ends)                                 # the length limit ends them all

        # the best nb continuations that do not end run on
        alive = top_scores + ends.to(torch.float32) * RULED_OUT
        pick = alive.topk(nb, dim=-1).indices                            # (b, nb)
        running = cand.gather(1, pick[..., None].expand(-1, -1, n))
        running_scores = alive.gather(1, pick)
        running_src = src.gather(1, pick)

        # those of the best nb that end compete for the finished set
        ended = ends & in_top
        scores = top_scores / (n ** length_penalty)
        scores += (is_done.all(-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * RULED_OUT
        scores += (~improvable).to(torch.float32) * RULED_OUT
        scores += (~ended).to(torch.float32) * RULED_OUT
        merged = torch.cat((done_scores, scores), 1)                     # (b, nb + K)
        best = merged.topk(nb, dim=-1).indices
        done_scores = merged.gather(1, best)
        is_done = torch.cat((is_done, ended), 1).gather(1, best)
        done = torch.cat((done, F.pad(cand, (0, n_max - n), value=pad)), 1)
        done = done.gather(1, best[..., None].expand(-1, -1, n_max))
        done_len = torch.cat((done_len, torch.full_like(tok, n)), 1).gather(1, best)

        # can a running beam still beat the worst finished hypothesis?
        reach = n_max if early_stopping == "never" and length_penalty > 0.0 else n
        best_running = running_scores[:, :1] / (reach ** length_penalty)
        worst_done = torch.where(is_done, done_scores.min(-1, keepdim=True).values, RULED_OUT)
        improvable &= (best_running > worst_done).any(-1, keepdim=True)
        if (not bool(improvable.any()) or (early_stopping is True and bool(is_done.all()))
                or bool(ends.all())):
            break
        stepper.reorder((base + running_src).view(-1))
        logits = stepper.step(running[..., -1].reshape(-1))

    width = int(done_len[:, 0].max())
    return torch.cat((ids.to(device), done[:, 0, :width]), 1)
