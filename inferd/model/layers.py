"""Building blocks of a Llama-family decoder: linear, RMSNorm, rotary embedding.

Every op here is row-wise: a token's result depends only on its own row. ``BatchInvariantLinear``
makes the matrix multiplies keep that property too (see its docstring), which is what makes greedy
output independent of the batch a request is scheduled with.
"""

from __future__ import annotations

import itertools
import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferd.model.kernels import bf16_pair_panels, onednn_bf16_gemm, pack_panels_kernel, panel_linear_kernel
from inferd.model.loader import madvise


class BatchInvariantLinear:
    """``y = x @ W.T + b`` computed in tiles of a fixed number of rows.

    BLAS libraries pick their kernels and their split of the reduction by the problem shape: on this
    project's CPUs, MKL's result for a row changes with the number of rows M (gemv for M=1, other
    blockings for larger M). Calling the GEMM always with M = ``tile`` rows gives every row the same
    sequence of floating-point operations whatever else is in the batch (checked in
    tests/test_model.py); the caller then pads the token count to a multiple of ``tile``.

    With ``ragged`` the last tile may be shorter and nothing is padded: right where a kernel's row
    results are the same for every M up to ``tile`` (oneDNN's BF16 kernels on packed weights, up to 32
    rows on this project's CPUs; :func:`rows_invariant_up_to` checks it at load).

    With ``prefill_tile`` the rows after the first ``num_decode`` of a call (the prefill rows of a step)
    go in tiles of exactly that many rows instead, the caller padding them to a multiple of it: fewer passes
    over the weights (one layer's GEMMs over 2,048 rows: 64-row tiles 1.35x faster than 32-row tiles, in
    docs/performance.md), and with a fixed M a row's bits depend neither on its place in the tile nor on the
    other rows where :func:`rows_invariant_in_tiles` says so. A prompt token is always a prefill row, a
    generated token always a decode row, so each keeps one tiling whatever the batch.

    Args:
        tile: rows per GEMM call; 0 disables tiling (one GEMM over all rows: fastest, and invariant only where
            the kernel is by construction, as inferd's kernel on :class:`PanelWeight` weights is).
        ragged: the last tile may have fewer than ``tile`` rows.
        prefill_tile: rows per GEMM call for prefill rows (0: they are tiled like the others).
    """

    def __init__(self, tile: int, ragged: bool = False, prefill_tile: int = 0) -> None:
        self.tile = tile
        self.ragged = ragged
        self.prefill_tile = prefill_tile

    @property
    def row_multiple(self) -> int:
        """The caller pads the row count to a multiple of this (1: no padding)."""
        return self.tile if self.tile and not self.ragged else 1

    def padded_rows(self, num_decode: int, num_prefill: int) -> int:
        """Rows, padding included, of a call over ``num_decode`` decode rows then ``num_prefill`` prefill rows."""
        if self.prefill_tile and num_prefill:
            return num_decode + -(-num_prefill // self.prefill_tile) * self.prefill_tile
        n, m = num_decode + num_prefill, self.row_multiple
        return -(-n // m) * m

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 num_decode: int | None = None) -> torch.Tensor:
        """x: [T, in]; w: [out, in] (plain, or packed by :func:`pack_linear_weight`); b: [out] or None;
        num_decode: the first rows that are decode rows, the rest prefill rows (None: all decode rows)
        -> [T, out]. T is what :meth:`padded_rows` gives.

        Raises:
            ValueError: T is not a multiple of ``row_multiple`` (of ``prefill_tile`` after ``num_decode``).
        """
        linear = _linear_for(w)
        n = x.shape[0]
        split = n if num_decode is None or not self.prefill_tile else num_decode
        t, p = self.tile, self.prefill_tile
        if split % self.row_multiple or p and (n - split) % p:
            raise ValueError(f"row count {n} ({split} decode rows) does not fit the tiles {t} / {p}")
        if t == 0:
            bounds = [0, n]
        else:
            bounds = [*range(0, split, t), *range(split, n, p or t), n]
        if len(bounds) == 2:
            return linear(x, w, b)
        return torch.cat([linear(x[i:j], w, b) for i, j in zip(bounds, bounds[1:]) if j > i])


def rows_invariant_up_to(weights: list[torch.Tensor], rows: int) -> bool:
    """Whether each weight's GEMM gives every row the same bits for any M from 1 to ``rows``, checked on
    random BF16 inputs (kernels are chosen by shape, not by values).

    weights: [out, in] GEMM weights, plain or packed. About 2 * ``rows`` GEMMs per weight.
    """
    gen = torch.Generator().manual_seed(0)
    for w in weights:
        linear = _linear_for(w)
        x = torch.randn(rows, w.shape[1], generator=gen).to(dtype=w.dtype, device=w.device)
        alone = torch.cat([linear(x[i : i + 1], w, None) for i in range(rows)])
        if not all(torch.equal(linear(x[:m], w, None), alone[:m]) for m in range(2, rows + 1)):
            return False
    return True


def rows_invariant_in_tiles(weights: list[torch.Tensor], rows: int) -> bool:
    """Whether each weight's GEMM with exactly ``rows`` rows gives a row the same bits wherever it sits in
    the tile and whatever the other rows hold, checked on random inputs at a few offsets (oneDNN's packed
    BF16 kernels pass at 48 to 256 rows on this project's CPUs with torch 2.13; a row's bits do change
    between different fixed M, which is why the tile is fixed).

    weights: [out, in] GEMM weights, plain or packed. Five ``rows``-row GEMMs per weight.
    """
    gen = torch.Generator().manual_seed(0)
    for w in weights:
        linear = _linear_for(w)
        x = torch.randn(2 * rows, w.shape[1], generator=gen).to(dtype=w.dtype, device=w.device)
        ref = linear(x[:rows], w, None)
        for s in (1, rows // 2 - 1, rows - 1):
            if not torch.equal(linear(x[s : s + rows], w, None)[: rows - s], ref[s:]):
                return False
        other = torch.cat([x[: rows // 2], x[rows:].flip(0)[: rows - rows // 2]])
        if not torch.equal(linear(other, w, None)[: rows // 2], ref[: rows // 2]):
            return False
    return True


@dataclass(frozen=True)
class PanelWeight:
    """A BF16 or FP32 weight packed for inferd's GEMM (:func:`inferd.model.kernels.panel_linear_kernel`), on CPUs
    with AVX2: panels of 16 output columns (the pair layout is also AMX's B tile layout). BF16 in pairs of k for the AVX512-BF16 micro-kernel (where
    :func:`inferd.model.kernels.bf16_pair_panels` and ``in`` is even) ``data[p, kk, j, t] = W[16 p + j, 2 kk + t]``,
    else interleaved ``data[p, k, j, h] = W[16 p + 8 h + j, k]``; FP32 ``data[p, k, h, j] = W[16 p + 8 h + j, k]``.

    Attributes:
        data: BF16 [ceil(out / 16), in / 2, 16, 2] (pairs) or [ceil(out / 16), in, 8, 2], or FP32 [ceil(out / 16),
            in, 2, 8] (rows past ``out`` are zero).
        out_features: ``out``, rows of the original [out, in] weight.
        out_fp32: the GEMM returns its FP32 sums instead of rounding them to BF16 (the lm_head's logits; always
            with FP32 weights).
    """

    data: torch.Tensor
    out_features: int
    out_fp32: bool = False
    is_mkldnn = False

    @property
    def pairs(self) -> bool:
        """The BF16 pair layout ([P, in / 2, 16, 2])."""
        return self.data.shape[2] == 16

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.out_features, self.data.shape[1] * (2 if self.pairs else 1)])

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _panel_linear(x: torch.Tensor, w: PanelWeight, b: torch.Tensor | None) -> torch.Tensor:
    return panel_linear_kernel()(x, w.data, w.out_features, b, w.out_fp32)


def _linear_for(w):
    if isinstance(w, PanelWeight):
        return _panel_linear
    return _packed_linear if w.is_mkldnn else F.linear


def pack_linear_weight(w: torch.Tensor, rows: int, out_fp32: bool = False,
                       out: torch.Tensor | None = None) -> torch.Tensor | PanelWeight:
    """A weight [out, in] packed once for the CPU's fastest GEMM, for ``rows``-row inputs.

    - BF16 where oneDNN serves (:func:`inferd.model.kernels.onednn_bf16_gemm`: native BF16 matmul where inferd's
      kernels cannot serve it):
      reordered into oneDNN's blocked layout. ``F.linear`` on BF16 CPU tensors runs the same oneDNN kernel but
      reorders the weight at every call; doing it once at load makes the decode GEMMs about 1.6x faster in a
      micro-benchmark (docs/performance.md) and gives bit-identical results (tests/test_model.py).
    - BF16 or FP32 on other CPUs with AVX2 and FMA (torch's BF16 GEMM there is a generic kernel, 3-5x slower than
      FP32, and MKL's FP32 GEMM on a decode step's rows reaches 20-60 GFLOP/s on AMD Zen 3; on Zen 4/5, with
      AVX512-BF16, inferd's pair panels beat oneDNN's, and on AMX tiles too on Sapphire Rapids): a
      :class:`PanelWeight` for inferd's kernel, which reads the
      weight and accumulates in FP32 (``out_fp32``: returns the FP32 sums, as it always does for FP32 weights), its
      panels written into ``out`` where given (:func:`panel_buffers`).

    Returns ``w`` unchanged where neither applies: not on a CPU, FP32 where oneDNN serves BF16 (MKL's FP32 GEMM on
    those Intel CPUs), or the kernels unavailable.
    """
    if w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float32):
        return w
    if w.dtype == torch.bfloat16 and onednn_bf16_gemm():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), max(rows, 1))
    if not takes_panels(w.dtype, w.device):
        return w
    return pack_panels(w, out_fp32 or w.dtype == torch.float32, out)


def takes_panels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`pack_linear_weight` packs weights of this dtype and device into :class:`PanelWeight` s: BF16 or
    FP32 on a CPU with inferd's kernel where oneDNN's BF16 GEMM does not serve."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and not onednn_bf16_gemm() \
        and panel_linear_kernel() is not None


def panel_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The shape of a [n, k] weight's panels (:class:`PanelWeight`): BF16 [ceil(n / 16), k / 2, 16, 2] (pairs) or
    [ceil(n / 16), k, 8, 2], FP32 [ceil(n / 16), k, 2, 8]."""
    if dtype != torch.bfloat16:
        return (-(-n // 16), k, 2, 8)
    return (-(-n // 16), k // 2, 16, 2) if _pairs(k) else (-(-n // 16), k, 8, 2)


def _pairs(k: int) -> bool:
    return k % 2 == 0 and bf16_pair_panels()


def panel_buffers(shapes: list[tuple[int, int]], dtype: torch.dtype,
                  device: torch.device) -> tuple[HugePageBuffer, list[torch.Tensor]] | None:
    """Where :func:`pack_linear_weight` packs [N, K] weights of this dtype and device into :class:`PanelWeight` s,
    one :class:`HugePageBuffer` and in it a view for the panels of each of ``shapes`` (:func:`panel_shape`, 64-byte
    aligned, back to back); None elsewhere."""
    if not shapes or not takes_panels(dtype, device):
        return None
    panels = [panel_shape(n, k, dtype) for n, k in shapes]
    align = 64 // dtype.itemsize  # elements in 64 bytes
    sizes = [-(-math.prod(shape) // align) * align for shape in panels]
    buf = HugePageBuffer(sum(sizes), dtype)
    starts = itertools.accumulate(sizes, initial=0)
    return buf, [buf.tensor[start:start + math.prod(shape)].view(shape) for start, shape in zip(starts, panels)]


HUGE_PAGE = 2 * 1024 * 1024  # bytes: x86-64's transparent huge page
MADV_COLLAPSE = 25  # linux/mman.h (Linux 6.1); Python's mmap module has no name for it before 3.13


class HugePageBuffer:
    """``numel`` zeros of ``dtype`` (``tensor``, 1-D, CPU) in an anonymous private mapping that starts on a 2 MiB
    boundary (mmap(2)), written with ordinary 4 KiB pages, then moved into transparent huge pages by
    :meth:`collapse`. A decode step streams every weight once, and from 2 MiB pages (one TLB entry where 4 KiB
    pages take 512) it read faster on the AMD EPYC VM of docs/performance.md (stop 21): ``torch.sum`` over 256
    MiB 17-21% more GB/s, a single-stream decode step 0.99 ms (7.7%) shorter. Huge pages are not taken at the first
    write because there a fault of a fresh 2 MiB page cost 3-5 ms (0.15-0.7 s for SmolLM2-135M's weights, on the
    load's critical path, against 0.1-0.17 s with 4 KiB pages).
    """

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * dtype.itemsize
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor (and its views) keep the mapping alive
        offset = -raw.data_ptr() % HUGE_PAGE  # the pages before and past it are never written
        self.tensor = raw[offset:offset + nbytes].view(dtype)

    def collapse(self) -> bool:
        """Move the buffer's whole 2 MiB pages into transparent huge pages: ``madvise(MADV_HUGEPAGE)`` then
        ``madvise(MADV_COLLAPSE)`` (Linux 6.1+; madvise(2)). Blocks while the kernel copies them (0.1-1.1 s for
        269 MB on the machine of docs/performance.md), so call it off the serving path; the contents stay the
        same and readers may go on meanwhile. Returns whether the kernel collapsed them; where it cannot (an
        older kernel, THP disabled, no free huge pages), MADV_HUGEPAGE still lets khugepaged do it in the
        background where THP is enabled.
        """
        length = self.tensor.numel() * self.tensor.element_size() // HUGE_PAGE * HUGE_PAGE
        start = self.tensor.data_ptr()
        return madvise(start, length, getattr(mmap, "MADV_HUGEPAGE", None)) and madvise(start, length, MADV_COLLAPSE)


def pack_panels(w: torch.Tensor, out_fp32: bool = False, out: torch.Tensor | None = None) -> PanelWeight:
    """A BF16 or FP32 weight [out, in] in :class:`PanelWeight`'s layout (whatever kernel the CPU would use), written
    into ``out`` (:func:`panel_shape`, w's dtype, contiguous) where given: by the compiled kernel where it exists
    (0.04 s for SmolLM2-135M's 30 layers in BF16 against 0.20 s for the permuted copy below, docs/performance.md),
    else torch."""
    pack = pack_panels_kernel()
    if pack is not None and w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float32):
        return PanelWeight(pack(w, out, w.dtype == torch.bfloat16 and _pairs(w.shape[1])), w.shape[0], out_fp32)
    n, k = w.shape
    panels = -(-n // 16)
    padded = torch.cat([w, w.new_zeros(panels * 16 - n, k)]) if panels * 16 != n else w
    if w.dtype == torch.bfloat16 and _pairs(k):  # [p, j, kk, t] -> [p, kk, j, t]
        data = padded.reshape(panels, 16, k // 2, 2).permute(0, 2, 1, 3)
    else:  # [p, h, j, k] -> BF16 [p, k, j, h], FP32 [p, k, h, j]
        data = padded.reshape(panels, 2, 8, k).permute((0, 3, 2, 1) if w.dtype == torch.bfloat16 else (0, 3, 1, 2))
    return PanelWeight(out.copy_(data) if out is not None else data.contiguous(), n, out_fp32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed in FP32 as Hugging Face Llama does.

    x: [T, hidden] (FP32 residual stream); weight: [hidden] in ``dtype`` -> [T, hidden] in ``dtype``.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE (Su et al. 2021, arXiv:2104.09864), [head_dim // 2] FP32.

    Supports ``rope_type`` ``default``, ``linear`` (position interpolation, Chen et al. 2023,
    arXiv:2306.15595) and ``llama3`` (Meta's Llama 3.1 frequency-dependent scaling, as in Hugging Face
    ``_compute_llama3_parameters``), and llama.cpp's ``rope_freqs`` per-frequency divisors.

    Raises:
        ValueError: an unsupported scaling type.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"RoPE scaling {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates query and key heads by their positions ("rotate
    half" layout, as Hugging Face Llama).

    Args:
        max_len: positions covered, in tokens.
    """

    def __init__(self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device: torch.device):
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, head_dim]
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D]; looked up once per step for all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (the query and key heads of a step together) rotated by :meth:`lookup`'s tables."""
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
