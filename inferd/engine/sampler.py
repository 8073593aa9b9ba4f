"""Token sampling, vectorised over the batch.

Greedy rows take the argmax. Sampling rows apply temperature, top-k, top-p (nucleus, Holtzman et al.
2019, arXiv:1904.09751) and min-p (Nguyen et al. 2024, arXiv:2407.01082), then draw with the
exponential-race trick: ``argmax(p / E)`` with ``E ~ Exp(1)`` is a sample from ``p`` (the Gumbel-max
trick in another form). ``E`` comes from each request's own generator, so a seeded request draws the
same numbers whatever else is in the batch.
"""

from __future__ import annotations

import torch

from inferd.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [S, V] FP32, row i belongs to ``seqs[i]``.

    Returns:
        S token ids.
    """
    tokens = logits.argmax(dim=-1)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        picked = _sample_rows(logits.index_select(0, idx), [seqs[i] for i in rows])
        tokens.index_copy_(0, idx, picked)
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [s, V] FP32 -> [s] int64 sampled tokens."""
    dev = logits.device
    vocab = logits.shape[-1]
    temp = torch.tensor([s.params.temperature for s in seqs], device=dev).unsqueeze(1)
    logits = logits / temp
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        if any(k < vocab for k in top_k):
            k = torch.tensor(top_k, device=dev).unsqueeze(1)
            keep &= torch.arange(vocab, device=dev).unsqueeze(0) < k
        if any(p < 1.0 for p in top_p):
            probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
            keep &= mass_before < torch.tensor(top_p, device=dev).unsqueeze(1)
        keep[:, 0] = True
        mask = torch.zeros_like(keep).scatter_(1, sorted_idx, keep)
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p > 0.0 for p in min_p):
        floor = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    noise = torch.stack([torch.empty(vocab, device=dev).exponential_(generator=s.generator) for s in seqs])
    return (probs / noise).argmax(dim=-1)
