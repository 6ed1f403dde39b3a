"""How the tokens of a call group into sequences (docs/api.md, "Packed sequences"): the one place that knows.

A loss call's per-token tensors have a (B, T) shape. Padded (the default), sequence b is row b: its advantage,
its row normalizer, its sequence-level ratio are row quantities, kept as (B, 1) tensors that broadcast. Packed
(``cu_seqlens=``, flash-attn's convention), the N tokens of S sequences of any lengths lie in one (1, N) row and
sequence s is tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``; a sequence quantity is an (S,) tensor, reduced with
``torch.segment_reduce`` over the offsets and handed to its tokens by a gather. ``Sequences`` gives both layouts the
same three operations (``sums``, ``expand``, ``mean``), so the reference, the reduction weights and the metrics are
written once; no (S, Tmax) tensor exists in the packed layout.

Deterministic by construction: a segment sum has no atomics; the gather's backward is a segment sum too (not
``index_put_(accumulate=True)``, which autograd would make of an indexed read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class _ToTokens(torch.autograd.Function):
    """(S,) -> (N,): each sequence's value at its tokens; the backward sums each sequence's tokens."""

    @staticmethod
    def forward(ctx, values, seq_of_token, cu_seqlens):
        ctx.save_for_backward(cu_seqlens)
        return values.index_select(0, seq_of_token)

    @staticmethod
    def backward(ctx, grad):
        (cu_seqlens,) = ctx.saved_tensors
        return torch.segment_reduce(grad, "sum", offsets=cu_seqlens), None, None


@dataclass(frozen=True)
class Sequences:
    """``n_seq`` sequences over the tokens of a (B, T) grid. Padded: ``cu_seqlens`` None, sequence b is row b.
    Packed: B = 1, ``cu_seqlens`` (S + 1,) int64 offsets and ``seq_of_token`` (N,) int64 on the tokens' device."""

    n_seq: int
    grid: tuple
    cu_seqlens: torch.Tensor | None = None
    seq_of_token: torch.Tensor | None = None

    @classmethod
    def rows(cls, B: int, T: int) -> "Sequences":
        """The padded layout: B sequences, one per row of a (B, T) grid."""
        return cls(B, (B, T))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, n_tokens: int) -> "Sequences":
        """The packed layout of ``n_tokens`` tokens in one row (validated offsets, ``_checks.cu_seqlens``)."""
        cu = cu_seqlens.to(torch.int64)
        S = cu.shape[0] - 1
        lengths = cu[1:] - cu[:-1]
        # output_size given: no host sync for the size of the result
        seq = torch.repeat_interleave(torch.arange(S, device=cu.device), lengths, output_size=n_tokens)
        return cls(S, (1, n_tokens), cu, seq)

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of a (B, T) per-token tensor: (B, 1) padded, (S,) packed."""
        if not self.is_packed:
            return x.sum(-1, keepdim=True)
        if not x.is_floating_point():  # counts (a bool mask): exact in fp32 below 2^24 tokens a sequence
            x = x.to(torch.float32)
        return torch.segment_reduce(x.reshape(-1), "sum", offsets=self.cu_seqlens)

    def expand(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A per-sequence tensor (``sums``' layout) made to broadcast against the (B, T) grid."""
        if not self.is_packed:
            return per_seq
        return _ToTokens.apply(per_seq, self.seq_of_token, self.cu_seqlens).view(self.grid)

    def per_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """A caller's per-sequence tensor ((B,) / (B, 1) padded, (S,) packed) in ``sums``' layout."""
        return t.reshape(-1, 1) if not self.is_packed else t.reshape(-1)

    def mean(self, per_seq: torch.Tensor) -> torch.Tensor:
        """The mean over sequences of a per-sequence tensor (``sums``' layout)."""
        return per_seq.sum() / max(self.n_seq, 1)

    def slice(self, s0: int, s1: int, t0: int, t1: int) -> "Sequences":
        """Sequences s0 .. s1, whose tokens are t0 .. t1 (host offsets, known to the caller): packed, their own
        offsets from 0; padded, rows s0 .. s1."""
        if not self.is_packed:
            return Sequences.rows(s1 - s0, self.grid[1])
        return Sequences(s1 - s0, (1, t1 - t0), self.cu_seqlens[s0:s1 + 1] - t0,
                         self.seq_of_token[t0:t1] - s0)
