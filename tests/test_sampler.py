"""The sampler (inferd/engine/sampler.py): every row's draw follows the distribution its request's parameters define
(temperature, top-k, top-p, min-p), with inferd's top-p kernel and with the sort that replaces it off the CPU; a
seeded request's tokens depend on its seed only, not on the rows beside it."""

from __future__ import annotations

import pytest
import torch

import inferd.engine.sampler as sampler
from inferd.engine.sampling_params import SamplingParams
from inferd.engine.sequence import Sequence

VOCAB = 4096
DRAWS = 4000


def _seq(params: SamplingParams, seed: int) -> Sequence:
    return Sequence(request_id=f"r{seed}", prompt_token_ids=[1], params=params, max_tokens=8, detokenizer=None,
                    generator=torch.Generator().manual_seed(seed))


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the parameters define, in FP64, the nucleus by a sort of the whole row."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    probs = x.softmax(dim=-1)
    if p.top_p < 1.0:
        ranked, order = probs.sort(descending=True)
        keep = (ranked.cumsum(0) - ranked) < p.top_p
        keep[0] = True
        probs = probs * torch.zeros_like(probs).index_fill_(0, order[keep], 1.0)
    if p.min_p > 0.0:
        probs = probs * (probs >= p.min_p * probs.max())
    return probs / probs.sum()


def _draw(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """DRAWS tokens, each from its own request (seeds 0 ..), in batches of 500 rows through ``sample``."""
    tokens = []
    for start in range(0, DRAWS, 500):
        seqs = [_seq(params, seed) for seed in range(start, start + 500)]
        tokens += sampler.sample(logits.expand(len(seqs), -1).contiguous(), seqs)[0]
    return torch.tensor(tokens)


CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=20),
         SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=500, top_p=0.95),
         SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=2.0, top_p=0.5, min_p=0.01)]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sort"])
@pytest.mark.parametrize("params", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_follow_the_requested_distribution(params, kernel, monkeypatch):
    """4,000 draws from one row of logits: none outside the distribution's support, and the frequency of each of its
    ten likeliest tokens within 4.5 standard errors of its probability (seeded: the same draws every run). Ignoring
    the temperature, or a top-k, top-p or min-p cut, fails one or the other."""
    if not kernel:
        monkeypatch.setattr(sampler, "fused_ops", lambda: None)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2.5
    expected = _expected(logits, params)
    counts = torch.bincount(_draw(logits, params), minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0
    for token in expected.topk(10).indices.tolist():
        p = expected[token].item()
        z = (counts[token].item() / DRAWS - p) / (p * (1 - p) / DRAWS) ** 0.5 if 0 < p < 1 else 0.0
        assert abs(z) < 4.5, (token, p, counts[token].item() / DRAWS)


def test_one_number_per_row_from_its_own_generator():
    """A seeded row's token depends on its seed and logits only: the same alone, beside other rows (greedy,
    penalised, other seeds) and at another place in the batch; a step takes one number from its generator."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=100)
    alone = sampler.sample(logits[:1], [_seq(params, 7)])[0]
    beside = [_seq(SamplingParams(temperature=0), 1), _seq(SamplingParams(temperature=1.0, min_p=0.1), 2),
              _seq(SamplingParams(temperature=0.8, presence_penalty=1.0), 3)]
    batch = sampler.sample(torch.cat([logits[1:], logits[:1]]), [*beside, _seq(params, 7)])[0]
    assert batch[-1] == alone[0]
    gen = torch.Generator().manual_seed(7)
    torch.rand(1, generator=gen, dtype=torch.float64)
    seq = _seq(params, 7)
    sampler.sample(logits[:1], [seq])
    assert torch.equal(seq.generator.get_state(), gen.get_state())


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sort"])
def test_a_row_without_a_distribution_still_gets_a_token_id(kernel, monkeypatch):
    """Logits with a NaN, +inf, or all -inf leave nothing to draw from (a NaN or zero total): the row still gets a
    token id in [0, V), on the kernel path and on the torch path CUDA takes."""
    if not kernel:
        monkeypatch.setattr(sampler, "fused_ops", lambda: None)
    logits = torch.zeros(4, 8)
    logits[0, 2] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    params = SamplingParams(temperature=1.0, top_p=0.9)
    tokens = sampler.sample(logits, [_seq(params, i) for i in range(4)])[0]
    assert all(0 <= t < 8 for t in tokens), tokens
