"""Token sampling, vectorised over the batch.

Logits processors first, per row that asks for them: ``min_tokens`` (EOS and stop ids masked),
``logit_bias``, the Hugging Face repetition penalty, OpenAI's presence and frequency penalties. Then
greedy rows take the argmax; sampling rows apply temperature, top-k, top-p (nucleus, Holtzman et al.
2019, arXiv:1904.09751) and min-p (Nguyen et al. 2024, arXiv:2407.01082), and draw by inverse transform
sampling with one uniform number from each request's own generator, so a seeded request draws the same
numbers whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.sequence import Sequence
from inferd.model.kernels import fused_ops


@dataclass
class TokenLogprobs:
    """Log-probabilities for one position.

    Attributes:
        token_id: the token at that position; logprob: its log-probability (natural log).
        top: the most likely tokens as (token id, log-probability), most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def plain_greedy(seq: Sequence) -> bool:
    """The request's next token is its logits' argmax as they are (greedy, no penalties or logit bias, past its
    ``min_tokens``) and it asks for no log-probabilities: :func:`sample` would return ``argmax_rows(logits)`` and no
    entry for it, so the logits themselves are not needed."""
    p = seq.params
    return p.greedy and not p.has_penalties and p.logprobs is None and len(seq.output_token_ids) >= p.min_tokens


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, [S, V] -> [S] int64, as ``x.argmax(dim=-1)`` gives it: on a CPU with inferd's kernels, FP32
    rows in one vectorised pass each (csrc/fused_ops.cpp; torch's takes ~0.1 ms for 49,152 logits here)."""
    ops = fused_ops() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    return ops.argmax_rows(x) if ops is not None else x.argmax(dim=-1)


def logprobs_of(logits: torch.Tensor, token_ids: list[int], k: list[int]) -> list[TokenLogprobs]:
    """logits: [S, V] FP32; token_ids: S chosen tokens; k: top-k per row -> S entries."""
    lp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(token_ids, device=logits.device)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    kmax = max(k)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    out = []
    for r, t in enumerate(token_ids):
        top = list(zip(top_i[r, : k[r]].tolist(), top_v[r, : k[r]].tolist())) if k[r] else []
        out.append(TokenLogprobs(t, chosen[r], top))
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence],
           eos_token_ids: frozenset[int] = frozenset()) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row.

    Args:
        logits: [S, V] FP32, row i belongs to ``seqs[i]``.
        eos_token_ids: masked (with the stop token ids) while a row is under its ``min_tokens``.

    Returns:
        S token ids, and S log-probability entries (None for rows that did not ask for them).
    """
    raw = logits
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties or
            len(s.output_token_ids) < s.params.min_tokens]
    if rows:
        logits = logits.clone()
        for i in rows:
            _process_row(logits[i], seqs[i], eos_token_ids)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if len(rows) == len(seqs):
        tokens = _sample_rows(logits, seqs)
    else:
        tokens = argmax_rows(logits)
    if rows and len(rows) < len(seqs):
        idx = torch.tensor(rows, device=logits.device)
        picked = _sample_rows(logits.index_select(0, idx), [seqs[i] for i in rows])
        tokens.index_copy_(0, idx, picked)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        entries = logprobs_of(raw.index_select(0, idx), [token_list[i] for i in rows],
                              [seqs[i].params.logprobs for i in rows])
        for i, e in zip(rows, entries):
            logprobs[i] = e
    return token_list, logprobs


def _process_row(row: torch.Tensor, seq: Sequence, eos_token_ids: frozenset[int]) -> None:
    """Apply one request's logits processors in place. row: [V] FP32."""
    p = seq.params
    vocab = row.shape[0]
    if len(seq.output_token_ids) < p.min_tokens:
        banned = [t for t in (*eos_token_ids, *p.stop_token_ids) if t < vocab]
        row[banned] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=row.device), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sample one token per row: logits [s, V] FP32 -> [s] int64.

    Temperature, then top-k (the tokens below the k-th largest logit masked), softmax, top-p (the nucleus: a token
    is kept while the probability of the tokens ranked above it is under top_p, the most likely always) and min-p
    (tokens under min_p times the largest probability dropped), then one draw by inverse transform sampling: the
    first token whose cumulative probability (FP64, over the kept tokens) passes u times their total, u ~ U[0, 1)
    from the request's own generator. One number per row and step from that generator, so a seeded request draws
    the same tokens whatever else is in the batch. (The exponential race used before drew a number per vocabulary
    entry: 1.2 ms a row here, 38 ms of a 32-row step.) On a CPU with inferd's kernels the top-p and min-p floors and
    the draw are one call (``sample_probs``; the nucleus without sorting the row, docs/performance.md, stop 47);
    elsewhere torch operators, the nucleus by a sort.
    """
    dev = logits.device
    vocab = logits.shape[-1]
    temp = torch.tensor([s.params.temperature for s in seqs], device=dev).unsqueeze(1)
    logits = logits / temp
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    if any(k < vocab for k in top_k):
        kth = logits.topk(max(k for k in top_k if k < vocab), dim=-1).values  # [s, kmax], largest first
        k = torch.tensor([min(k, kth.shape[1]) - 1 for k in top_k], device=dev).unsqueeze(1)
        floor = kth.gather(1, k).masked_fill(torch.tensor(top_k, device=dev).unsqueeze(1) >= vocab, float("-inf"))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p, min_p = [s.params.top_p for s in seqs], [s.params.min_p for s in seqs]
    u = torch.cat([torch.rand(1, generator=s.generator, device=dev, dtype=torch.float64) for s in seqs])
    ops = fused_ops() if dev.type == "cpu" else None
    if ops is not None:  # the floors and the draw in one kernel (nucleus_floor's radix select for top-p)
        return ops.sample_probs(probs, torch.tensor(top_p), torch.tensor(min_p), u)
    if any(p < 1.0 for p in top_p):
        probs = probs.masked_fill(probs < nucleus_floor_sorted(probs, torch.tensor(top_p, device=dev)), 0.0)
    if any(p > 0.0 for p in min_p):
        floor = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    cdf = probs.double().cumsum(dim=-1)  # [s, V]
    total = cdf[:, -1:]
    # below the total, so that the token found has probability > 0 (u * total can round up to it)
    x = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=vocab - 1)
    # a row with nothing to draw from (NaN or infinite logits: its total NaN or 0) takes its argmax, as on the CPU
    return torch.where(total.squeeze(1) > 0, tokens, argmax_rows(logits))


def nucleus_floor_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p floor by sorting it (any device; on a CPU inferd's ``nucleus_floor`` kernel gives the same
    bits without a sort): probs [s, V] FP32, top_p [s] in (0, 1] -> [s, 1] FP32, the probability of the least likely
    token of the nucleus (Holtzman et al. 2019): the most likely tokens, in order, while the probability of those
    ranked above is under top_p. ``probs >= floor`` keeps it (and any token tied with its last one). top_p = 1: 0, so
    that rounding in the sums cannot drop a row's least likely tokens."""
    ranked = probs.sort(dim=-1, descending=True).values
    sums = ranked.double()
    above = sums.cumsum(dim=-1) - sums  # the probability of the tokens ranked above each (FP64, as the kernel's)
    kept = (above < top_p.double().unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    return ranked.gather(1, kept - 1).masked_fill_(top_p.unsqueeze(1) >= 1.0, 0.0)
