"""Padding-free micro-batches for ``grpo.train``: whole sequences packed into rows, cut by a token budget.

A rollout holds B sequences ``[prompt | completion]`` in a padded (B, P + T) rectangle (prompts left-padded,
completions padded after EOS); with long-tailed completion lengths most of it is padding. Packed, each sequence's
real tokens (its prompt, then its completion less the last token, whose prediction nobody scores) are laid end to
end in a row, with ``position_ids`` restarting at 0 per sequence and no attention mask: transformers then keeps each
sequence to itself (``masking_utils.find_packed_sequence_indices`` builds the block-diagonal causal mask for sdpa /
eager / flex; flash-attn's varlen kernels get ``cu_seq_lens_*`` directly). The model sees the same tokens at the
same positions as in the padded batch, so every hidden state is the padded one's, up to rounding.

Layout of one micro-batch:
- varlen attention (flash_attention_2 / 3): one row, the sequences one after another (attention costs
  ``sum L_s^2``);
- sdpa / eager / flex: rows as long as the micro-batch's longest sequence, filled first-fit decreasing, each row's
  tail (if any) a filler segment of token 0 at positions 0, 1, ... that attends only to itself and is never read. One
  long row would cost ``N^2`` attention with a dense mask; rows of the longest length cost about ``N x L_max``.

The loss reads the hidden states that predict completion tokens (``token_index``) in sequence order, flat (N,) with
``cu_seqlens`` (S + 1,) over the sequences: the packed layout of ``grpo_kernels.fused_linear_grpo_loss``.

Micro-batches are consecutive runs of the mini-batch's sequences holding at most ``max_tokens`` fed tokens (and at
most ``--micro-batch-size`` sequences); a sequence longer than the budget is a micro-batch of its own. Under DDP
and FSDP every rank runs the same number of micro-batches (their forwards are collectives under FSDP): a rank with
fewer splits its largest ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .distributed import DistEnv

PACKED_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Packing:
    """How a run packs. ``max_tokens``: fed tokens per micro-batch (None: no budget); ``one_row``: every micro-batch
    one row (varlen attention); ``env``: the ranks whose micro-batch counts must agree."""

    max_tokens: int | None = None
    one_row: bool = False
    env: DistEnv | None = None


def packing_unsupported(lm) -> str | None:
    """Why transformers cannot run packed rows through ``lm`` (a phrase), or None when it can: a model class of
    transformers itself (its masks come from ``masking_utils``), an attention implementation that handles packed
    rows, and attention in every layer (a recurrent / linear-attention layer would carry state across sequences)."""
    if not type(lm).__module__.startswith("transformers."):
        return f"{type(lm).__name__} is not a transformers model class (remote code)"
    attn = getattr(lm.config, "_attn_implementation", None) or "eager"
    if attn not in PACKED_ATTENTION:
        return f"attention implementation {attn!r} is not one of {', '.join(PACKED_ATTENTION)}"
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        return f"layer types {', '.join(other)} are not attention layers"
    return None


def is_varlen(lm) -> bool:
    return (getattr(lm.config, "_attn_implementation", None) or "") in VARLEN_ATTENTION


# ------------------------------------------------------------------------------------------------- micro-batches
def cut_micro_batches(fed: list[int], max_tokens: int | None, max_rows: int) -> list[list[int]]:
    """Positions 0..len(fed)-1 cut into consecutive runs of at most ``max_rows`` sequences and at most
    ``max_tokens`` fed tokens; a sequence longer than the budget is alone."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    parts, current, tokens = [], [], 0
    for i, n in enumerate(fed):
        full = len(current) >= max_rows or (max_tokens is not None and tokens + n > max_tokens)
        if current and full:
            parts.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        parts.append(current)
    return parts


def split_to_count(parts: list[list[int]], fed: list[int], count: int) -> list[list[int]]:
    """``parts`` split further (the one with the most tokens among those of >= 2 sequences, at its token middle)
    until there are ``count`` of them; each piece keeps its order and stays within any budget its part met."""
    parts = [list(p) for p in parts]
    if count > sum(len(p) for p in parts):
        raise ValueError(f"cannot cut {sum(len(p) for p in parts)} sequences into {count} micro-batches")
    while len(parts) < count:
        k = max((i for i, p in enumerate(parts) if len(p) > 1), key=lambda i: sum(fed[j] for j in parts[i]))
        part = parts[k]
        total, run, cut = sum(fed[j] for j in part), 0, 1
        for cut in range(1, len(part)):
            run += fed[part[cut - 1]]
            if 2 * run >= total:
                break
        parts[k:k + 1] = [part[:cut], part[cut:]]
    return parts


def plan_micro_batches(fed: list[int], packing: Packing, max_rows: int) -> list[list[int]]:
    """``cut_micro_batches``, then as many micro-batches on every rank as on the rank that needs the most."""
    parts = cut_micro_batches(fed, packing.max_tokens, max_rows)
    env = packing.env
    if env is not None and env.enabled:
        import torch.distributed as dist

        count = torch.full((1,), len(parts), dtype=torch.int64, device=env.device)  # a fill: no host transfer
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        parts = split_to_count(parts, fed, int(count.item()))
    return parts


def layout_rows(fed: list[int], one_row: bool) -> tuple[list[int], list[int], list[int]]:
    """(row of each sequence, its offset in the row, each row's used length). ``one_row``: all in row 0, in order;
    otherwise rows of the longest sequence's length, filled first-fit decreasing."""
    if one_row:
        offsets = [0]
        for n in fed[:-1]:
            offsets.append(offsets[-1] + n)
        return [0] * len(fed), offsets, [sum(fed)]
    capacity = max(fed)
    row_of, offset_of, used = [0] * len(fed), [0] * len(fed), []
    for i in sorted(range(len(fed)), key=lambda j: (-fed[j], j)):
        r = next((k for k, u in enumerate(used) if u + fed[i] <= capacity), len(used))
        if r == len(used):
            used.append(0)
        row_of[i], offset_of[i] = r, used[r]
        used[r] += fed[i]
    return row_of, offset_of, used


# ------------------------------------------------------------------------------------------------- packed batch
@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch of S sequences. Model inputs: ``input_ids`` / ``position_ids`` (R, L) and, for
    varlen attention, ``attention_kwargs`` (cu_seq_lens_q/k, max_length_q/k). Loss inputs, flat over the N
    completion tokens in sequence order: ``token_index`` (N,) into the (R * L) hidden states, ``completion_ids``,
    ``completion_mask`` (N,), ``cu_seqlens`` (S + 1,) int32. ``rows`` (S,): the rollout rows; ``token_rows`` /
    ``token_cols`` (N,): each token's place in the rollout's (B, T) tensors. ``positions``: R * L, what the model
    runs on."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_index: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    token_rows: torch.Tensor
    token_cols: torch.Tensor
    attention_kwargs: dict
    positions: int

    @property
    def num_sequences(self) -> int:
        return self.rows.numel()

    def gather(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        """(N,) values of a rollout's (B, T) per-token tensor (old / reference log-probs) for these tokens."""
        return None if per_token is None else per_token[self.token_rows, self.token_cols]


def host_to_device(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Int lists as int64 tensors on ``device`` in one host-to-device transfer: the lists laid end to end in one host
    buffer (pinned on CUDA, so the copy is asynchronous and the host goes on building the next micro-batch), moved
    at once and split into views on the device."""
    host = torch.tensor([v for values in lists for v in values], dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=host.is_pinned())
    return list(flat.split([len(values) for values in lists]))


def _segments(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment of each element, index inside its segment) for consecutive segments of ``lengths``."""
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    return seg, torch.arange(total, device=lengths.device) - starts[seg]


def pack_rows(rollout, rows: list[int], one_row: bool) -> PackedBatch:
    """The packed micro-batch of rollout ``rows`` (in this order): see the module docstring."""
    prompt_all, completion_all = rollout.sequence_lengths
    prompt, completion = [prompt_all[r] for r in rows], [completion_all[r] for r in rows]
    fed = [p + c - 1 for p, c in zip(prompt, completion)]
    row_of, offset_of, used = layout_rows(fed, one_row)
    width, device, P = max(used), rollout.input_ids.device, rollout.prompt_length
    # every index this micro-batch needs from the host, in one transfer
    b, p, c, n_fed, row, offset, row_used = host_to_device([rows, prompt, completion, fed, row_of, offset_of, used],
                                                            device)
    base = row * width + offset  # flat index of each sequence's first token
    # fed tokens: the contiguous slice [P - p, P + c - 1) of each sequence's padded row
    seg, local = _segments(n_fed, sum(fed))
    dest = base[seg] + local
    input_ids = torch.zeros(len(used) * width, dtype=rollout.input_ids.dtype, device=device)
    input_ids[dest] = rollout.input_ids[b[seg], P - p[seg] + local]
    # filler after a row's end counts 0, 1, ... (its own segment); the sequences' positions overwrite the rest
    position_ids = (torch.arange(width, device=device)[None, :] - row_used[:, None]).reshape(-1)
    position_ids[dest] = local
    # completion tokens: token j of sequence s is predicted by its fed token p - 1 + j
    seg_c, j = _segments(c, sum(completion))
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(c, 0)
    kwargs = {}
    if one_row:
        cu_fed = torch.zeros(len(rows) + 1, dtype=torch.int32, device=device)
        cu_fed[1:] = torch.cumsum(n_fed, 0)
        kwargs = dict(cu_seq_lens_q=cu_fed, cu_seq_lens_k=cu_fed, max_length_q=max(fed), max_length_k=max(fed))
    return PackedBatch(
        input_ids=input_ids.view(len(used), width), position_ids=position_ids.view(len(used), width),
        token_index=base[seg_c] + p[seg_c] - 1 + j, completion_ids=rollout.completion_ids[b[seg_c], j],
        completion_mask=rollout.completion_mask[b[seg_c], j], cu_seqlens=cu, rows=b, token_rows=b[seg_c],
        token_cols=j, attention_kwargs=kwargs, positions=len(used) * width)


def packed_micro_batches(rollout, rows: list[int], packing: Packing, max_rows: int) -> list[PackedBatch]:
    """The packed micro-batches of rollout ``rows`` (a mini-batch, in its order)."""
    prompt, completion = rollout.sequence_lengths
    fed = [prompt[r] + completion[r] - 1 for r in rows]
    return [pack_rows(rollout, [rows[i] for i in part], packing.one_row)
            for part in plan_micro_batches(fed, packing, max_rows)]


def padded_positions(rollout, rows: list[int], micro_batch_size: int) -> int:
    """The positions a padded run (``--no-packing``) spends on ``rows``: micro-batches of ``micro_batch_size``
    rows, each as wide as its longest prompt plus its longest completion (``trim``'s width)."""
    prompt, completion = rollout.sequence_lengths
    total = 0
    for k in range(0, len(rows), micro_batch_size):
        part = rows[k:k + micro_batch_size]
        total += len(part) * (max(prompt[r] for r in part) + max(completion[r] for r in part))
    return total


def sequence_lengths(attention_mask: torch.Tensor, completion_mask: torch.Tensor, prompt_length: int):
    """(prompt tokens, completion tokens) per row as host ints, in one host sync. A prompt is the left-padded
    block's real tokens (they must be contiguous and at least one); a completion runs through its last attended or
    scored token (at least 1: its first token is always predicted)."""
    P = prompt_length
    prompt_mask = attention_mask[:, :P].bool()
    T = completion_mask.shape[1]
    covered = attention_mask[:, P:].bool() | completion_mask.bool()
    cols = torch.arange(1, T + 1, device=covered.device)
    completion = (covered * cols).amax(dim=1).clamp(min=1)
    first = torch.where(prompt_mask.any(dim=1), prompt_mask.int().argmax(dim=1), torch.full_like(completion, P))
    count = prompt_mask.sum(dim=1)
    values = torch.stack([P - first, count, completion]).tolist()
    for row, (span, n) in enumerate(zip(values[0], values[1])):
        if n == 0 or span != n:
            why = "no prompt token" if n == 0 else "a prompt that is not one contiguous left-padded block"
            raise RuntimeError(f"rollout row {row} has {why} (attention_mask); it cannot be packed")
    return values[1], values[2]


def micro_batch_share(reduction: str, sequences: int, total_sequences: int, scored: torch.Tensor,
                      total_scored: torch.Tensor):
    """The factor of a micro-batch's loss in the optimizer step's loss, so that any cut of the mini-batch gives the
    loss of the whole mini-batch in one call: per-sequence reductions (row_mean, row_sum, fixed_length) by the
    micro-batch's share of the sequences, token_mean (bnpo) by its share of the scored tokens (device tensors:
    no host sync), num_items by 1 (the count of the whole step is passed as ``num_items_in_batch``)."""
    if reduction == "num_items":
        return 1.0
    if reduction == "token_mean":
        return scored.double() / total_scored.double().clamp(min=1.0)
    return sequences / total_sequences


def choose_packing(enabled: bool, max_tokens: int | None, lm, env: DistEnv,
                   single_pass: bool) -> tuple[Packing | None, str | None]:
    """(the run's Packing or None for padded rows, a line for the log or None). Packing is used when enabled and
    the model supports it (``packing_unsupported``); the line says what falls back to padded rows and why."""
    if not enabled:
        return None, None
    why = packing_unsupported(lm)
    if why is not None:
        return None, f"packing off: {why}; training on padded rows (--no-packing silences this line)"
    packing = Packing(max_tokens=max_tokens, one_row=is_varlen(lm), env=env)
    if single_pass:
        return packing, ("packing: --single-pass, the loss backpropagates through the sampling forward (padded rows); "
                         "the reference pass runs packed")
    return packing, None
