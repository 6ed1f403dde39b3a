"""Vocab-parallel lm_head: ``linear_token_logprobs`` / ``fused_linear_grpo_loss`` with ``process_group``.

Each rank of the group holds a contiguous shard of the head, ``weight`` (V_r, H) and ``bias`` (V_r,) covering the
full-vocabulary ids [vocab_start, vocab_start + V_r); hidden, ids, mask and the loss inputs are replicated (the
same on every rank, as after a tensor-parallel block). The shards' outputs combine exactly (docs/DESIGN.md
section 3's maths, split over the vocabulary):

- per rank, the ordinary fused head on the shard (the plan's light, no-grad or torch path) gives the
  shard's log-prob ``logp_r`` of the id clamped into the shard and its entropy ``H_r``; the clamped id's logit
  ``z_c`` (an N x H gather, ``_TargetLogit``) turns it into the shard's logsumexp ``lse_r = z_c - logp_r``, with
  its exact gradient (d lse_r / dz = p_r);
- one all-gather of the three per-token numbers (lse_r, z_c where the rank owns the id, H_r) then gives, on every
  rank alike, ``lse = logsumexp_r lse_r``, ``logp = z_target - lse`` and, with ``w_r = exp(lse_r - lse)``,
  ``H = sum_r w_r (H_r - log w_r)`` (the entropy of a mixture of the shards' softmaxes): 12 N bytes per rank
  (fp32), never a V-sized tensor. Each shard needs a finite logit per valid token (a shard whose logits are all
  -inf gives NaN; the unsharded head needs one finite logit in the whole row);
- the loss stage runs on the (B, T) log-probs, replicated. In the backward each rank keeps the gradient of its own
  slot of the gathered table (every rank computed the same loss from it: no communication), its dW / dbias stay
  local, and the hidden state's gradient is all-reduced over the group (the head's input is replicated), so every
  rank ends with the full dh. With ``hidden_grad="partial"`` (log-probs only) that all-reduce is left out: each rank
  returns its own shard's part of dh, whose sum over the ranks is the full dh, for a caller whose next op reduces
  it anyway (Megatron's sequence-parallel gather, whose backward reduce-scatters; verl's fused-kernel seam).

Loss with gradients (``head.fast_vocab_parallel``, the planner's choice wherever the single-device fast paths would
run): per chunk of whole sequences, each rank computes its shard's fp32 logits chunk and folds it; the shards'
(logsumexp, target logit, entropy) of the chunk's rows are all-gathered (12 bytes per row and rank) and combined
before the d-logits epilogue runs with the global logsumexp; dW / dbias stay local and dh is summed over the group
in the backward: 6NHV / TP FLOPs per rank (4 frozen), no recompute (``fast_path_view``). Everything else (log-probs,
the top-entropy mask, ``grad_in_forward=False``, small budgets) runs the memory-light path per shard
(``sharded_head_logprobs``).

Validation: every rank validates its own arguments, then one all-gather of a small table (shard size, start, N,
ids / mask checksums, the local error message if any) lets every rank reach the same verdict, so a bad shard,
a mismatched N or an error on one rank raises the same ValueError on every rank instead of a hang.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..head.light import head_token_logprobs
from ..head.torch_tiles import accumulation_dtype
from ..inputs import HeadInputs, ValidRows
from ..invariance import block_rows, padded
from ..reference import round_logits, soft_cap, soft_cap_derivative

# Rows per chunk of the target-logit gather (bounds its fp32 scratch to TARGET_CHUNK_ROWS x H).
TARGET_CHUNK_ROWS = 4096
# Bytes of a rank's error message carried by the validation all-gather.
MESSAGE_BYTES = 512
# What the hidden state's gradient is on each rank: summed over the group, or this rank's shard's part of it.
HIDDEN_GRADS = ("reduced", "partial")


def check_hidden_grad(hidden_grad, process_group) -> None:
    """``hidden_grad`` is one of HIDDEN_GRADS, and "partial" comes with a process_group (one device has no parts)."""
    if not isinstance(hidden_grad, str) or hidden_grad not in HIDDEN_GRADS:
        raise ValueError(f"hidden_grad must be one of {HIDDEN_GRADS}, got {hidden_grad!r}")
    if hidden_grad == "partial" and process_group is None:
        raise ValueError('hidden_grad="partial" is only meaningful with process_group (a vocab-parallel head)')


@dataclass(frozen=True)
class VocabShard:
    """This rank's shard [start, start + size) of a vocabulary of ``total`` ids, in a group of ``world`` ranks."""

    group: object
    rank: int
    world: int
    start: int
    size: int
    total: int


# ----------------------------------------------------------------------------------------------- autograd pieces

class _ReplicatedInput(torch.autograd.Function):
    """Identity in the forward; the backward sums the gradient over the group (the input is replicated and each
    rank's shard contributes its part of dh). Summed in fp32: half-precision partials would lose bits.

    ``ordered`` (batch invariance): the parts are all-gathered and added in rank order, element by element, so that
    each element's sum has one order for a fixed world size; an all-reduce's order may follow the message size and
    the element's place in it (NCCL picks ring or tree by size, and a ring reduces each chunk from another rank).
    It costs world - 1 more gradient-sized buffers in the backward."""

    @staticmethod
    def forward(ctx, x, group, ordered: bool = False):
        ctx.group, ctx.ordered = group, ordered
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        total = grad.to(torch.float32) if grad.dtype in (torch.bfloat16, torch.float16) else grad.clone()
        if ctx.ordered:
            parts = [torch.empty_like(total) for _ in range(dist.get_world_size(ctx.group))]
            dist.all_gather(parts, total.contiguous(), group=ctx.group)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
        else:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total.to(grad.dtype), None, None


class _GatherReplicated(torch.autograd.Function):
    """(K, n) per rank -> (world, K, n) on every rank. Every rank computes the same loss from the gathered table,
    so the gradient of a rank's own slot is already the full one: the backward keeps it, with no communication."""

    @staticmethod
    def forward(ctx, local, shard: "VocabShard"):
        ctx.rank = shard.rank
        parts = [torch.empty_like(local) for _ in range(shard.world)]
        dist.all_gather(parts, local.contiguous(), group=shard.group)
        return torch.stack(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad[ctx.rank], None


class _TargetLogit(torch.autograd.Function):
    """z_c = soft_cap(h . W[c] + b[c]) / tau for one shard-local id c per row, in the accumulation dtype; chunks of
    TARGET_CHUNK_ROWS rows keep its scratch small, and the backward adds each row's gradient into the dW / dbias row
    of its id (fp32 accumulation): deterministically by default (``add_rows_by_id``), by ``index_add_`` (atomic on
    CUDA where an id repeats) when the plan's backward is the atomic one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, local_ids, transform, deterministic: bool, fixed_rows: int = 0):
        acc = accumulation_dtype(hidden)
        N = hidden.shape[0]
        z = torch.empty(N, dtype=acc, device=hidden.device)
        # fixed_rows (batch invariance): every chunk's row sums on exactly that many rows (the last one padded)
        step = fixed_rows or TARGET_CHUNK_ROWS
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            n = fixed_rows or r1 - r0
            c = padded(local_ids, r0, r1, n)
            rows = padded(hidden, r0, r1, n).to(acc) * weight.index_select(0, c).to(acc)
            z[r0:r1] = rows.sum(-1)[: r1 - r0]
        if bias is not None:
            z += bias.index_select(0, local_ids).to(acc)
        # the rounding (round_logits) is straight-through: the backward below passes d z through it unchanged
        z = soft_cap(round_logits(z, transform.round_logits), transform.softcap)
        # the cap's derivative at the target, (N,): the backward's only extra state
        ctx.cap_grad = soft_cap_derivative(z, transform.softcap)
        z /= transform.temperature
        ctx.save_for_backward(hidden, weight, bias, local_ids)
        ctx.temperature, ctx.deterministic = transform.temperature, deterministic
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, local_ids = ctx.saved_tensors
        acc = accumulation_dtype(hidden)
        g = grad.to(acc) / ctx.temperature * ctx.cap_grad
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        d_hidden = torch.empty_like(hidden) if need_h else None
        V, H = weight.shape
        # one (V + scratch, H [+ 1]) fp32 sum: dW in the first H columns, dbias in the last
        cols = (H if need_w else 0) + (1 if need_b else 0)
        scratch = SUM_ROWS if ctx.deterministic else 0
        sums = torch.zeros((V + scratch, cols), dtype=acc, device=weight.device) if cols else None
        for r0 in range(0, hidden.shape[0], TARGET_CHUNK_ROWS):
            c = local_ids[r0:r0 + TARGET_CHUNK_ROWS]
            gc = g[r0:r0 + c.shape[0]].unsqueeze(-1)
            if need_h:
                d_hidden[r0:r0 + c.shape[0]] = gc * weight.index_select(0, c).to(acc)
            if sums is not None:
                parts = ([gc * hidden[r0:r0 + c.shape[0]].to(acc)] if need_w else []) + ([gc] if need_b else [])
                values = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
                if ctx.deterministic:
                    add_rows_by_id(sums, c, values, V)
                else:
                    sums.index_add_(0, c, values)
        d_weight = sums[:V, :H].to(weight.dtype) if need_w else None
        d_bias = sums[:V, -1].to(bias.dtype) if need_b else None
        return d_hidden, d_weight, d_bias, None, None, None, None


# Rows per segment-sum GEMM of ``add_rows_by_id``: R x R x K FLOPs per R rows (0.1% of the head's at K = 4096).
SUM_ROWS = 256


def add_rows_by_id(out, ids, values, scratch_at: int) -> None:
    """``out[ids[i]] += values[i]`` for every i, deterministic without atomics: the same sums, in the same order, on
    every run of any device, whatever ids repeat.

    Per block of ``SUM_ROWS`` rows: a stable sort of the ids (runs of equal ids, in row order), each run summed by a
    fixed-order GEMM with a 0 / 1 run-membership matrix, and each run's sum added to its id's row with an indexed
    assignment whose indices are distinct (a run's id, or one of the ``SUM_ROWS`` scratch rows of ``out`` from
    ``scratch_at`` on for the runs a block does not have). Why not ``index_add_``: on CUDA it is atomic, and
    repeated ids then add in a different order on every run."""
    for r0 in range(0, ids.shape[0], SUM_ROWS):
        c, v = ids[r0:r0 + SUM_ROWS], values[r0:r0 + SUM_ROWS]
        R = c.shape[0]
        order = torch.argsort(c, stable=True)
        sorted_ids = c[order]
        starts = torch.ones(R, dtype=torch.bool, device=c.device)
        starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
        run = torch.cumsum(starts.to(torch.int64), 0) - 1  # integer: exact, and the same on every run
        slots = torch.arange(R, device=c.device)
        member = torch.zeros((R, R), dtype=v.dtype, device=v.device)
        # distinct (run, slot) pairs; a device scalar (``= 1.0`` would make a host tensor and copy it)
        member.index_put_((run, slots), torch.ones((), dtype=v.dtype, device=v.device))
        run_sums = member @ v[order]
        # the id of run j, or a scratch row for the runs this block has fewer of (distinct destinations)
        # run starts write their id at slot ``run`` (< R), the other rows past R: distinct destinations
        dest = torch.where(starts, run, R + slots)
        run_ids = torch.cat([scratch_at + slots, scratch_at + slots]).scatter(0, dest, sorted_ids)[:R]
        out[run_ids] = out[run_ids] + run_sums


# ---------------------------------------------------------------------------------------------------- validation

# The table's fields: first those computed on the device (from ids and mask), then the host's own numbers.
_DEVICE_FIELDS = ("n_valid", "id_min", "id_max", "ids_sum", "mask_sum")
_FIELDS = _DEVICE_FIELDS + ("ok", "size", "start", "n", "h", "bias", "temperature", "softcap", "round_logits",
                            "hidden_grad",
                            "partial_hidden_grad", "msg_len")


# Fields sent as the int64 view of a float64 (softcap: 0.0 for None).
_FLOAT_FIELDS = ("temperature", "softcap")


def _to_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _from_bits(bits: int):
    value = struct.unpack("<d", struct.pack("<q", bits))[0]
    return value if value != 0.0 else None


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """An order-sensitive integer checksum (int64 wrap-around, the same on every rank) of an integer tensor."""
    x = x.reshape(-1).long()
    pos = torch.arange(x.numel(), device=x.device)
    return ((x + 1) * (2 * pos + 1)).sum()


def _local_row(inputs: HeadInputs | None, mask, vocab_start, message: str | None, device,
               partial_hidden_grad: bool = False) -> torch.Tensor:
    """This rank's row of the validation table (int64 on ``device``), formed without a host sync: the values read
    from ids and mask stay on their device (one copy to ``device`` if it is another, e.g. gloo's CPU table), the
    host's numbers and the message bytes make one host-to-device copy."""
    encoded = list((message or "").encode()[:MESSAGE_BYTES])
    text = encoded + [0] * (MESSAGE_BYTES - len(encoded))
    if inputs is None:
        row = dict.fromkeys(_FIELDS, -1)
        row.update(ok=0, msg_len=len(encoded))
        return torch.tensor([row[f] for f in _FIELDS] + text, dtype=torch.int64, device=device)
    ids = inputs.ids
    valid = None if mask is None else (mask.reshape(-1) != 0)
    lo, hi = torch.aminmax(ids) if ids.numel() else (ids.new_zeros(()), ids.new_zeros(()))
    on_device = torch.stack([ids.new_full((), ids.numel()) if valid is None else valid.sum(), lo, hi, _checksum(ids),
                             ids.new_zeros(()) if valid is None else _checksum(valid)]).to(torch.int64)
    host = {"ok": 1, "size": inputs.weight.shape[0], "start": -1 if vocab_start is None else vocab_start,
            "n": ids.numel(), "h": inputs.hidden.shape[-1], "bias": int(inputs.bias is not None),
            "temperature": _to_bits(inputs.transform.temperature),
            "softcap": _to_bits(inputs.transform.softcap or 0.0),
            "round_logits": (None, "bf16", "fp16").index(inputs.transform.round_logits),
            "hidden_grad": int(torch.is_grad_enabled() and inputs.hidden.requires_grad),
            "partial_hidden_grad": int(partial_hidden_grad), "msg_len": 0}
    host_part = torch.tensor([host[f] for f in _FIELDS[len(_DEVICE_FIELDS):]] + text, dtype=torch.int64,
                             device=device)
    return torch.cat([on_device.to(device), host_part])


def _verdict(table: list[list[int]], world: int) -> tuple[list[int], int, str | None]:
    """(each rank's start, V_total, error message or None) from the gathered table: the same on every rank."""
    rows = [dict(zip(_FIELDS, r[:len(_FIELDS)])) for r in table]
    head = f"vocab-parallel lm_head over a process_group of {world} ranks: "
    failed = [(k, bytes(table[k][len(_FIELDS):len(_FIELDS) + rows[k]["msg_len"]]).decode(errors="replace"))
              for k in range(world) if not rows[k]["ok"]]
    if failed:
        return [], 0, head + "invalid arguments on " + "; ".join(f"rank {k}: {m}" for k, m in failed)

    def same(field, what):
        values = [r[field] for r in rows]
        if len(set(values)) > 1:
            got = "their checksums differ" if field.endswith("_sum") else "got"
            if field in _FLOAT_FIELDS:  # sent as float64 bits: shown as the numbers the ranks were given
                values = [_from_bits(v) for v in values]
            return head + f"{what} must be the same on every rank, {got} {values} on ranks 0..{world - 1}"
        return None

    for field, what in (("n", "the number of tokens N of hidden / ids (the head's input is replicated)"),
                        ("h", "hidden's size H"), ("ids_sum", "ids"),
                        ("n_valid", "the number of valid tokens in mask"), ("mask_sum", "mask"),
                        ("bias", "whether a bias is given (1) or not (0)"),
                        ("temperature", "temperature"),
                        ("softcap", "softcap"), ("round_logits", 'round_logits (None: 0, "bf16": 1, "fp16": 2)'),
                        ("hidden_grad", "whether hidden requires grad (1) or not (0): its backward all-reduces"),
                        ("partial_hidden_grad", 'hidden_grad ("reduced": 0, "partial": 1)')):
        error = same(field, what)
        if error:
            return [], 0, error
    sizes = [r["size"] for r in rows]
    given = [r["start"] for r in rows]
    if any(s >= 0 for s in given) and any(s < 0 for s in given):
        return [], 0, head + ("vocab_start must be given on every rank or on none, got "
                              f"{[None if s < 0 else s for s in given]} on ranks 0..{world - 1}")
    starts = given if given[0] >= 0 else [sum(sizes[:k]) for k in range(world)]
    total = sum(sizes)
    order = sorted(range(world), key=lambda k: starts[k])
    end = 0
    for k in order:
        if starts[k] != end:
            shards = ", ".join(f"rank {j}: [{starts[j]}, {starts[j] + sizes[j]})" for j in range(world))
            return [], 0, head + ("the weight shards must be contiguous and cover [0, V) without overlap "
                                  f"(vocab_start and weight.shape[0] of each rank), got {shards}")
        end += sizes[k]
    lo, hi = min(r["id_min"] for r in rows), max(r["id_max"] for r in rows)
    if rows[0]["n"] > 0 and (lo < 0 or hi >= total):
        return [], 0, head + (f"ids must lie in [0, V) = [0, {total}) (V = the sum of the shards' sizes "
                              f"{sizes}), got values in [{lo}, {hi}]")
    return starts, total, None


def _table_device(group, hidden) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    if isinstance(hidden, torch.Tensor):
        return hidden.device
    return torch.device("cuda", torch.cuda.current_device())


def validate(process_group, vocab_start, hidden, local, keep_padding: bool = False, hidden_grad: str = "reduced"):
    """Run ``local()`` -> (HeadInputs, mask or None, extra) on this rank, then agree with the group in one
    all-gather. Returns (inputs, mask, extra, VocabShard, ValidRows); raises the same ValueError on every rank.
    The valid-row counts of the mask are read in the same transfer as the gathered table: the call's one sync.
    ``hidden_grad`` (HIDDEN_GRADS) must be the same on every rank: "reduced" all-reduces in the backward."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group needs an initialized torch.distributed (init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed.ProcessGroup, got "
                         f"{type(process_group).__name__}")
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    result, message = (None, None, None), None
    try:
        if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)
                                        or vocab_start < 0):
            raise ValueError(f"vocab_start must be an int >= 0 or None, got {vocab_start!r}")
        result = local()
    except Exception as error:  # reported through the gather below, so that every rank raises alike
        message = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    device = _table_device(process_group, hidden)
    mine = _local_row(result[0], result[1], vocab_start, message, device, hidden_grad == "partial")
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=process_group)
    seqs = getattr(result[2], "seqs", None)  # the loss's sequences (packed or rows), None for log-probs
    counts = None if message else ValidRows.counts_on_device(result[1], keep_padding, seqs)
    table = torch.stack(parts)
    read = torch.cat([table.reshape(-1), counts.to(device)]) if counts is not None else table.reshape(-1)
    values = read.tolist()  # the one host sync: the table, and this rank's valid-row counts
    starts, total, error = _verdict([values[k * mine.numel():(k + 1) * mine.numel()] for k in range(world)], world)
    if error:
        raise ValueError(error)
    inputs, mask, extra = result
    rows = ValidRows.from_counts(mask, inputs.ids.numel(), None if counts is None else values[world * mine.numel():],
                                 keep_padding, seqs)
    shard = VocabShard(process_group, rank, world, starts[rank], inputs.weight.shape[0], total)
    return inputs, mask, extra, shard, rows


# ------------------------------------------------------------------------------------------------- the sharded head

def sharded_head_logprobs(inputs: HeadInputs, shard: VocabShard, plan, rows: ValidRows,
                          reduce_hidden_grad: bool = True):
    """(logp, entropy, lse) over the full vocabulary, shaped like the caller's ids, from this rank's shard.

    ``inputs.ids`` are full-vocabulary ids. Rows ``rows`` leaves out are skipped (0, no gradient).
    ``reduce_hidden_grad``: d hidden summed over the group (True), or this shard's part of it (False)."""
    inputs = inputs.in_compute_dtype()
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    if reduce_hidden_grad and torch.is_grad_enabled() and hidden.requires_grad:
        hidden = _ReplicatedInput.apply(hidden, shard.group, plan.batch_invariant)
    owned = (ids >= shard.start) & (ids < shard.start + shard.size)
    local_ids = (ids - shard.start).clamp(0, shard.size - 1)
    local = replace(inputs, hidden=hidden, ids=local_ids, shape=local_ids.shape)
    logp_r, entropy_r, _, _ = head_token_logprobs(local, plan, ValidRows(None, local_ids.numel()))
    z_c = _TargetLogit.apply(hidden, inputs.weight, inputs.bias, local_ids, inputs.transform, plan.deterministic,
                             (plan.chunk_rows or block_rows(hidden.device)) if plan.batch_invariant else 0)
    lse_r = z_c - logp_r  # the shard's logsumexp, differentiable: d lse_r / dz = softmax of the shard
    table = _GatherReplicated.apply(torch.stack([lse_r, torch.where(owned, z_c, 0.0), entropy_r]), shard)
    # the entropy of a mixture of the shards' softmaxes with weights w_r = exp(lse_r - lse): sum_r w_r H_r + H(w).
    # Every term is >= 0 (no cancellation against lse, unlike lse - sum_v p_v z_v).
    lse, logp, entropy = _combine_rows(table)
    logp, entropy, lse = rows.scatter(logp, entropy, lse)
    shape = inputs.shape
    return logp.view(shape), entropy.view(shape), lse.detach().view(shape)


def _combine_rows(table: torch.Tensor):
    """(lse, logp, entropy) over the whole vocabulary from the gathered (world, 3, n) table of the shards'
    (logsumexp, target logit where the rank owns the id else 0, entropy): the mixture identities of the module
    docstring, every term >= 0 in the entropy."""
    lse = torch.logsumexp(table[:, 0], 0)
    logp = table[:, 1].sum(0) - lse
    log_w = table[:, 0] - lse
    entropy = (torch.exp(log_w) * (table[:, 2] - log_w)).sum(0)
    return lse, logp, entropy


def fast_path_view(shard: VocabShard):
    """The ``shard_view`` of ``head.fast_vocab_parallel`` (``head.fast.head_sequence_loss_in_forward``): per chunk
    of rows, the shard's (lse, target logit, entropy) are all-gathered (3 fp32 numbers per row and rank) and
    combined into the whole vocabulary's before the d-logits epilogue runs with the global logsumexp. d weight and
    d bias stay local; d hidden (each rank's part of dz W) is summed over the group in the backward."""
    def view(hidden, ids):
        owned = (ids >= shard.start) & (ids < shard.start + shard.size)
        local_ids = (ids - shard.start).clamp(0, shard.size - 1)
        onehot_ids = torch.where(owned, local_ids, torch.full_like(local_ids, -1))
        if torch.is_grad_enabled() and hidden.requires_grad:
            hidden = _ReplicatedInput.apply(hidden, shard.group)

        def combine(r0, r1, logp, lse, ent):
            z_c = logp + lse  # the shard's logit of the (clamped) target
            local = torch.stack([lse, torch.where(owned[r0:r1], z_c, 0.0), ent]).contiguous()
            parts = [torch.empty_like(local) for _ in range(shard.world)]
            dist.all_gather(parts, local, group=shard.group)
            g_lse, g_logp, g_ent = _combine_rows(torch.stack(parts))
            lse.copy_(g_lse)
            logp.copy_(g_logp)
            ent.copy_(g_ent)
        return hidden, local_ids.contiguous(), onehot_ids.contiguous(), combine
    return view
