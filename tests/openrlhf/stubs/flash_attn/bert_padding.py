"""TEST-ONLY stand-in for ``flash_attn.bert_padding`` (see the package docstring): the padding helpers OpenRLHF's
packed-sample path uses, in plain PyTorch with the same signatures and results as flash-attn 2.8.3's.

- ``unpad_input(hidden_states (B, S, ...), attention_mask (B, S), unused_mask=None)`` -> ``(rows (nnz, ...),
  indices (nnz,) of the kept positions in the flattened (B * S) grid, cu_seqlens (B + 1,) int32, max_seqlen,
  used_seqlens (B,) int32)``; the kept positions are those where the mask (plus ``unused_mask``) is non-zero, in
  row-major order.
- ``pad_input(rows (nnz, ...), indices, batch, seqlen)`` -> (batch, seqlen, ...), zeros where no row goes.
- ``index_first_axis(x, indices)``: ``x[indices]`` (differentiable, as flash-attn's autograd function).
"""
import torch
import torch.nn.functional as F
from einops import rearrange, repeat  # noqa: F401  (re-exported: OpenRLHF imports rearrange from here)


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return tensor[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    output = torch.zeros((first_axis_dim, *values.shape[1:]), device=values.device, dtype=values.dtype)
    return output.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices)
    return rows, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return rearrange(output, "(b s) ... -> b s ...", b=batch)
