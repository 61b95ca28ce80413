"""archlab models in lm-evaluation-harness: an `LM` adapter (the `eval` extra) and `run_tasks`, which
`archlab eval RUN --tasks ...` calls.

The adapter scores exactly as the harness's own `hf` backend does, so its numbers can be compared with
that backend on the same weights exported by `convert --to-hf` (tested): context and continuation are
encoded as HF's `_encode_pair` does (trailing spaces of the context move to the continuation; an empty
context gets the end-of-text token as its prefix), rows are scored in batches, right-padded (the causal
mask keeps padding out of every real position), and rolling log-likelihoods use the harness's own
disjoint windows. Tasks come from the harness's registry or `include_path`; datasets load as the harness
loads them (use local json/jsonl data files with HF_DATASETS_OFFLINE=1 where there is no network).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM

__all__ = ["ArchlabLM", "run_tasks"]


class ArchlabLM(LM):
    """lm-eval's three request types over an archlab TransformerLM and its tokenizer.
    Example: lm_eval.simple_evaluate(model=ArchlabLM(model, tok), tasks=["lambada_openai"])"""

    def __init__(self, model, tokenizer, batch_size: int = 8, max_length: int | None = None):
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.max_length = max_length or model.config.max_seq_len
        self._device = next(model.parameters()).device
        self.eot = getattr(tokenizer, "eot_id", None)
        if self.eot is None:
            raise ValueError("the tokenizer has no end-of-text token, which empty contexts are scored after")

    # ---- scoring
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.eot], self.tokenizer.encode(continuation)
        whole, head = self.tokenizer.encode(context + continuation), self.tokenizer.encode(context)
        return head, whole[len(head):]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per pair."""
        out = []
        for start in range(0, len(pairs), self.batch_size):
            batch = pairs[start:start + self.batch_size]
            rows = [(ctx + cont)[-(self.max_length + 1):][:-1] for ctx, cont in batch]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.eot, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r)
            logp = F.log_softmax(self.model(ids.to(self._device)).float(), dim=-1)   # (b, t, v)
            for i, (row, (_, cont)) in enumerate(zip(rows, batch)):
                n = len(cont)
                scores = logp[i, len(row) - n:len(row)]                                  # (n, v)
                target = torch.tensor(cont, device=scores.device)
                picked = scores.gather(1, target[:, None])[:, 0]
                out.append((float(picked.sum()), bool((scores.argmax(-1) == target).all())))
        return out

    # ---- the harness's request types
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._score([self._encode_pair(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(req.args[0]), prefix_token=self.eot,
                max_seq_len=self.max_length, context_len=1)]
            totals.append(sum(score for score, _ in self._score(windows)))
        return totals

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        import archlab

        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompt = self.tokenizer.encode(context)[-(self.max_length - 1):]
            new = min(int(kwargs.get("max_gen_toks", 256)), self.max_length - len(prompt))
            from archlab.generation.stepper import vocab_limit
            ids = archlab.generate(self.model, torch.tensor(prompt, device=self._device), new,
                                   eos_token_id=self.eot, vocab_limit=vocab_limit(self.model, self.tokenizer)
                                   )[len(prompt):].tolist()
            text = self.tokenizer.decode([t for t in ids if t != self.eot])
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out


def run_tasks(model, tokenizer, tasks: list[str], *, include_path: str | None = None, limit: int | None = None,
              num_fewshot: int | None = None, batch_size: int = 8) -> dict:
    """lm_eval.simple_evaluate over the adapter; returns the harness's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    return lm_eval.simple_evaluate(model=ArchlabLM(model, tokenizer, batch_size=batch_size), tasks=tasks,
                                   num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                                   bootstrap_iters=0, log_samples=False)
