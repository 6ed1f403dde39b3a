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

Batch-invariant sums (``invariant=True``, the ``batch_invariant`` option): every sum of per-token values is a
pairwise tree over each sequence's positions counted from the sequence's start (``tree_sums``), then a pairwise
tree over the sequences (``total``). A pairwise tree padded with zeros at its end gives the same bits as the tree
without them (x + 0 = x exactly), so a sequence's sum is the same whether it is a padded row (zeros past its
length) or a packed segment, whatever else the batch holds; the tree is written with elementwise adds only (no
reduction kernel whose order could depend on the shape), so it is the same on every device.
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


class _TreeExpand(torch.autograd.Function):
    """A per-sequence tensor at every token of the grid (materialized), whose backward sums each sequence's tokens
    with the batch-invariant tree (``Sequences.tree_sums``) instead of autograd's own broadcast reduction (a plain
    sum over the row, whose order follows the row's length)."""

    @staticmethod
    def forward(ctx, per_seq, seqs: "Sequences"):
        ctx.seqs, ctx.shape = seqs, per_seq.shape
        if seqs.is_packed:
            return per_seq.index_select(0, seqs.seq_of_token).view(seqs.grid)
        return per_seq.reshape(-1, 1).expand(seqs.grid).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.seqs.tree_sums(grad).reshape(ctx.shape), None


@dataclass(frozen=True)
class Sequences:
    """``n_seq`` sequences over the tokens of a (B, T) grid. Padded: ``cu_seqlens`` None, sequence b is row b.
    Packed: B = 1, ``cu_seqlens`` (S + 1,) int64 offsets and ``seq_of_token`` (N,) int64 on the tokens' device."""

    n_seq: int
    grid: tuple
    cu_seqlens: torch.Tensor | None = None
    seq_of_token: torch.Tensor | None = None
    invariant: bool = False

    @classmethod
    def rows(cls, B: int, T: int, invariant: bool = False) -> "Sequences":
        """The padded layout: B sequences, one per row of a (B, T) grid."""
        return cls(B, (B, T), invariant=invariant)

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, n_tokens: int, invariant: bool = False) -> "Sequences":
        """The packed layout of ``n_tokens`` tokens in one row (validated offsets, ``_checks.cu_seqlens``)."""
        cu = cu_seqlens.to(torch.int64)
        S = cu.shape[0] - 1
        lengths = cu[1:] - cu[:-1]
        # output_size given: no host sync for the size of the result
        seq = torch.repeat_interleave(torch.arange(S, device=cu.device), lengths, output_size=n_tokens)
        return cls(S, (1, n_tokens), cu, seq, invariant)

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of a (B, T) per-token tensor: (B, 1) padded, (S,) packed (``tree_sums`` when
        invariant)."""
        if not self.is_packed and not self.invariant:
            return x.sum(-1, keepdim=True)
        if not x.is_floating_point():  # counts (a bool mask): exact in fp32 below 2^24 tokens a sequence
            x = x.to(torch.float32)
        if self.invariant:
            per_seq = self.tree_sums(x)
            return per_seq if self.is_packed else per_seq.reshape(-1, 1)
        return torch.segment_reduce(x.reshape(-1), "sum", offsets=self.cu_seqlens)

    def tree_sums(self, x: torch.Tensor) -> torch.Tensor:
        """(S,) per-sequence sums of a per-token tensor on the grid (or (N, k) / (B, T, k) with k columns: (S, k)),
        each a pairwise tree over the sequence's positions from its start (module docstring): level j adds the
        value at position p + 2^j to the one at p for every p divisible by 2^(j + 1) with p + 2^j inside the
        sequence, and the sum is left at the sequence's first position. Differentiable (adds and selects)."""
        B, T = self.grid
        flat = x.reshape(B * T, -1)
        N = flat.shape[0]
        if self.is_packed:
            first = self.cu_seqlens[:-1]
            starts = first.index_select(0, self.seq_of_token)
            lengths = (self.cu_seqlens[1:] - first).index_select(0, self.seq_of_token)
            pos = torch.arange(N, device=flat.device) - starts
        else:
            first = torch.arange(0, N, max(T, 1), device=flat.device)
            pos = torch.arange(N, device=flat.device) % max(T, 1)
            lengths = torch.full_like(pos, T)
        y, step = flat, 1
        while step < (T if not self.is_packed else N):
            take = ((pos[:-step] % (2 * step)) == 0) & (pos[:-step] + step < lengths[:-step])
            y = torch.cat([torch.where(take.unsqueeze(-1), y[:-step] + y[step:], y[:-step]), y[-step:]])
            step *= 2
        # an empty sequence (a zero length) starts where the next one does: its sum is 0
        empty = (self.cu_seqlens[1:] == first) if self.is_packed else torch.zeros_like(first, dtype=torch.bool)
        out = y.index_select(0, first.clamp(max=max(N - 1, 0))) if N else y.new_zeros((len(first), y.shape[-1]))
        out = torch.where(empty.unsqueeze(-1), 0.0, out)
        return out.reshape((self.n_seq,) + tuple(x.shape[len(self.grid):] if x.dim() > len(self.grid) else ()))

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of a per-token tensor on the grid (trailing dims kept): ``x.sum()`` over the tokens, or when
        invariant the pairwise tree over the sequences of their ``tree_sums`` (the same bits for the same
        sequences padded or packed)."""
        lead = len(self.grid)
        if not self.invariant:
            return x.sum(dim=tuple(range(lead))) if x.dim() > lead else x.sum()
        per_seq = self.tree_sums(x)
        return Sequences.rows(1, self.n_seq, invariant=True).tree_sums(per_seq.reshape((1, self.n_seq)
                                                                                      + per_seq.shape[1:]))[0]

    def expand(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A per-sequence tensor (``sums``' layout) made to broadcast against the (B, T) grid (invariant: the grid
        itself, with the tree sums as its backward, ``_TreeExpand``)."""
        if self.invariant:
            return _TreeExpand.apply(per_seq, self)
        if not self.is_packed:
            return per_seq
        return _ToTokens.apply(per_seq, self.seq_of_token, self.cu_seqlens).view(self.grid)

    def per_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """A caller's per-sequence tensor ((B,) / (B, 1) padded, (S,) packed) in ``sums``' layout."""
        return t.reshape(-1, 1) if not self.is_packed else t.reshape(-1)

    def mean(self, per_seq: torch.Tensor) -> torch.Tensor:
        """The mean over sequences of a per-sequence tensor (``sums``' layout): a pairwise tree when invariant."""
        if self.invariant:
            return Sequences.rows(1, self.n_seq, invariant=True).tree_sums(per_seq.reshape(1, -1))[0] \
                / max(self.n_seq, 1)
        return per_seq.sum() / max(self.n_seq, 1)

    def slice(self, s0: int, s1: int, t0: int, t1: int) -> "Sequences":
        """Sequences s0 .. s1, whose tokens are t0 .. t1 (host offsets, known to the caller): packed, their own
        offsets from 0; padded, rows s0 .. s1."""
        if not self.is_packed:
            return Sequences.rows(s1 - s0, self.grid[1], self.invariant)
        return Sequences(s1 - s0, (1, t1 - t0), self.cu_seqlens[s0:s1 + 1] - t0,
                         self.seq_of_token[t0:t1] - s0, self.invariant)


def token_sums(values: torch.Tensor, grid: tuple, cu_seqlens: torch.Tensor | None, tree: bool) -> torch.Tensor:
    """fp64 column sums of per-token values (N, k) laid out on ``grid`` (packed: one row, with ``cu_seqlens``): a
    plain fixed-order sum, or with ``tree`` the batch-invariant sums (``Sequences.total``: the same bits for the
    same sequences padded or packed). What a loss kernel's per-token terms become (``metrics.py``)."""
    if not tree:
        return values.sum(0, dtype=torch.float64)
    seqs = Sequences.packed(cu_seqlens, grid[1], True) if cu_seqlens is not None else \
        Sequences.rows(*grid, invariant=True)
    return seqs.total(values.double().reshape(*grid, -1))
