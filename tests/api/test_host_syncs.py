"""Host syncs and host-to-device copies per call (docs/api.md, "Host syncs and transfers"): a default call of each
public function, forward and backward, reads the device at most once (the valid tokens per sequence, for the fused
head's compaction, or a packed sequence-level call's offsets), never inside a chunk loop, not at all with
``capturable=True`` (CUDA graph capture), and moves no host data to the device, whatever ``num_items_in_batch`` is
(None, a Python int, a tensor), padded or packed.

Counted on CPU tensors by ``tests/support/host_transfers.py`` (a dispatch mode: the aten ops that wait for the device
on a GPU, tensors made from host data, copies between devices, plus ``tolist`` / ``cpu`` / ``numpy``, which read
without dispatching). The Triton paths run under the interpreter; their launches are asynchronous on a GPU.
docs/api.md's table is rendered from ``TABLE`` below (``test_the_docs_table_is_this_test_s``; regenerate it with
``python -m tests.api.test_host_syncs``)."""
from __future__ import annotations

import itertools
import pathlib

import pytest
import torch

import grpo_kernels as gk

from ..support.host_transfers import counting_transfers, host_to_device, syncs
from ..support.tolerances import assert_three_way, grad_scale

B, T, V, H = 3, 5, 37, 8


# Packed: the first N = 9 rows as three sequences of 3, 5 and 1 tokens, flash-attn's cu_seqlens
CU_SEQLENS = (0, 3, 8, 9)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    return dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g) / 3,
                logits=torch.randn(B, T, V, generator=g), ids=torch.randint(0, V, (B, T), generator=g),
                mask=mask, adv=torch.randn(B, generator=g),
                old=torch.randn(B, T, generator=g) - 3, ref=torch.randn(B, T, generator=g) - 3,
                cu_seqlens=torch.tensor(CU_SEQLENS))


CONFIGS = {  # config overrides -> the path they take on the Triton impl at these shapes (knobs below)
    "token-level": dict(loss_type="dapo", beta=0.04),
    "sequence-level": dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
    "entropy-mask": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01),
    "no-grad-in-forward": dict(loss_type="bnpo", grad_in_forward=False),
}


def _head_logprobs(b, impl, capturable=False):
    h = b["hidden"].clone().requires_grad_(True)
    logp, ent = gk.linear_token_logprobs(h, b["weight"], b["ids"], mask=b["mask"], impl=impl, return_entropy=True,
                                         capturable=capturable)
    (logp.sum() + ent.sum()).backward()
    return logp, h.grad


NUM_ITEMS = {"none": None, "int": 7, "tensor": torch.tensor(7.0)}
LOSSES = ("grpo_loss", "fused_linear_grpo_loss")


def _call(b, name: str, impl: str, layout: str, masked: bool, num_items, capturable: bool, cfg: dict):
    """Forward and backward of one public call on the batch (``name``: "grpo_loss", "fused_linear_grpo_loss",
    "token_logprobs" or "linear_token_logprobs"; the log-prob functions also make a no-grad call, the old /
    reference pass), padded (B, T) or packed (N,) with ``CU_SEQLENS``."""
    packed = layout == "packed"
    group = dict(process_group=torch.distributed.group.WORLD) if layout == "vocab-parallel" else {}
    N = CU_SEQLENS[-1]
    flat = (lambda t: t.reshape(-1, *t.shape[2:])[:N]) if packed else (lambda t: t)  # noqa: E731
    mask = flat(b["mask"]) if masked else None
    x = flat(b["hidden"]).clone().requires_grad_(True)
    w = b["weight"].clone().requires_grad_(True)
    if name in ("grpo_loss", "token_logprobs"):
        x = (x.detach() @ w.detach().T).requires_grad_(True)
    args = (x, w) if name in ("fused_linear_grpo_loss", "linear_token_logprobs") else (x,)
    if name not in LOSSES:
        kw = dict(mask=mask, capturable=capturable) if name == "linear_token_logprobs" else {}
        logp, ent = getattr(gk, name)(*args, flat(b["ids"]), impl=impl, return_entropy=True, **kw, **group)
        (logp.sum() + ent.sum()).backward()
        with torch.no_grad():
            getattr(gk, name)(*[t.detach() for t in args], flat(b["ids"]), impl=impl, **kw, **group)
        return
    extra = dict(cu_seqlens=b["cu_seqlens"]) if packed else {}
    loss, _ = getattr(gk, name)(*args, flat(b["ids"]), b["adv"], mask, old_logps=flat(b["old"]),
                                ref_logps=flat(b["ref"]), impl=impl, num_items_in_batch=num_items,
                                capturable=capturable, **cfg, **extra, **group)
    loss.backward()


# docs/api.md's table, one row per (calls, when): its host syncs and host-to-device copies as documented, the
# cases it stands for (names, layouts, masked, capturable) and the syncs counted per call (None: 1 for a
# sequence-level configuration on the Triton impl, whose path chunks whole sequences, else 0). Every case is counted on both impls, every configuration family of
# CONFIGS and num_items_in_batch None / a Python int / a tensor.
TABLE = [
    (("grpo_loss", "token_logprobs"), "padded or packed, with or without a mask", "none", "none",
     (("grpo_loss", "token_logprobs"), ("padded", "packed"), (True, False), (False,)), 0),
    (("fused_linear_grpo_loss", "linear_token_logprobs"), "with a mask, padded (B, T) or packed (N,)",
     "one: the valid tokens per sequence (packed: and the sequences' offsets, in the same read); they size the "
     "compaction of the valid rows (padding costs no FLOPs) and plan the sequence-level chunks", "none",
     (("fused_linear_grpo_loss", "linear_token_logprobs"), ("padded", "packed"), (True,), (False,)), 1),
    (("fused_linear_grpo_loss", "linear_token_logprobs"), "without a mask, padded", "none", "none",
     (("fused_linear_grpo_loss", "linear_token_logprobs"), ("padded",), (False,), (False,)), 0),
    (("linear_token_logprobs",), "without a mask, packed", "none", "none",
     (("linear_token_logprobs",), ("packed",), (False,), (False,)), 0),
    (("fused_linear_grpo_loss",), "without a mask, packed", "Triton: one for a sequence-level configuration "
     "(GSPO's ratio, vespo, the off-policy mask): the sequences' offsets, to chunk whole sequences; none otherwise", "none",
     (("fused_linear_grpo_loss",), ("packed",), (False,), (False,)), None),
    (("fused_linear_grpo_loss", "linear_token_logprobs"), "`capturable=True`, padded or packed",
     "none: the padded rows are computed too (more FLOPs: the padding fraction of the head's work)", "none",
     (("fused_linear_grpo_loss", "linear_token_logprobs"), ("padded", "packed"), (True, False), (True,)), 0),
    # vocab-parallel: (syncs, host-to-device copies) per call
    (("fused_linear_grpo_loss", "linear_token_logprobs"), "vocab-parallel (`process_group`), with or without a mask, "
     "also `capturable=True`", "one: the validation table's all-gather, read with the valid-row counts in the same "
     "transfer", "one: the host's fields of the validation row (sizes, options, an error message), one small copy",
     (("fused_linear_grpo_loss", "linear_token_logprobs"), ("vocab-parallel",), (True, False), (False, True)),
     (1, 1)),
]


def _cases():
    for row, entry in enumerate(TABLE):
        for name, layout, masked, cap in itertools.product(*entry[4]):
            if cap and name == "token_logprobs":
                continue  # no capturable option: it never syncs
            yield pytest.param(row, name, layout, masked, cap,
                               id=f"{name}-{layout}-{'mask' if masked else 'nomask'}{'-capturable' if cap else ''}")


@pytest.fixture(autouse=True)
def _small_fast_path(knobs):
    knobs(fast_path_min_rows=1)  # the fast head paths at these small shapes


@pytest.fixture
def one_rank_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("row, name, layout, masked, cap", list(_cases()))
def test_syncs_and_copies_per_call(row, name, layout, masked, cap, impl, plans, request):
    """Each case of docs/api.md's table, for every configuration family and num_items_in_batch kind: the
    documented number of host syncs, and no host-to-device copy."""
    if layout == "vocab-parallel":
        request.getfixturevalue("one_rank_group")
    expected, copies = TABLE[row][-1] if isinstance(TABLE[row][-1], tuple) else (TABLE[row][-1], 0)
    b = _batch()
    # with a mask: every configuration family with num_items_in_batch None and every num_items kind with the
    # token-level one; the other cases: the token-level and the sequence-level families (the two kinds of chunking)
    runs = [(c, CONFIGS[c], "none", None) for c in (CONFIGS if masked else ("token-level", "sequence-level"))]
    runs += [("token-level", CONFIGS["token-level"], kind, n) for kind, n in NUM_ITEMS.items() if n is not None
             and masked]
    for config, cfg, kind, n in runs if name in LOSSES else [("log-probs", {}, "none", None)]:
        with counting_transfers() as records:
            _call(b, name, impl, layout, masked, n, cap, cfg)
        what = f"{name} ({layout}, {config}, num_items_in_batch {kind}) on {plans[-1].path}"
        calls = 1 if name in LOSSES else 2  # the log-prob functions: a call with gradients and one without
        assert len(host_to_device(records)) == copies * calls, f"{what}: host-to-device copies {records}"
        sequence_chunks = impl == "triton" and cfg.get("importance_sampling_level") == "sequence"
        want = int(sequence_chunks) if expected is None else expected
        want *= calls
        assert len(syncs(records)) == want, f"{what}: syncs {syncs(records)}, documented {want}"


def test_the_paths_above_are_every_path(plans):
    """The configurations above reach every path the planner has on one device."""
    b = _batch()
    for impl in ("triton", "torch"):
        for cfg in CONFIGS.values():
            _call(b, "fused_linear_grpo_loss", impl, "padded", True, None, False, cfg)
            _call(b, "grpo_loss", impl, "padded", True, None, False, cfg)
        _call(b, "linear_token_logprobs", impl, "padded", True, None, False, {})
        _call(b, "token_logprobs", impl, "padded", True, None, False, {})
    from grpo_kernels import paths
    expected = {paths.LOGITS_FAST, paths.LOGITS_SWEEP, paths.LOGITS_TORCH, paths.HEAD_FAST, paths.HEAD_FAST_SEQUENCE,
                paths.HEAD_LIGHT, paths.HEAD_NO_GRAD, paths.HEAD_TORCH}
    assert expected <= {p.path for p in plans}


def render_table() -> str:
    """docs/api.md's table of host syncs and copies, from ``TABLE``."""
    lines = ["| call | when | host syncs (forward + backward) | host-to-device copies |", "|---|---|---|---|"]
    for names, when, n_syncs, copies, *_ in TABLE:
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {when} | {n_syncs} | {copies} |")
    return "\n".join(lines)


def test_the_docs_table_is_this_test_s():
    """docs/api.md states exactly the cases counted above (regenerate: ``python -m tests.api.test_host_syncs``)."""
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert render_table() in docs, "docs/api.md's host-sync table differs from tests/api/test_host_syncs.py's " \
                                   "TABLE: paste the output of `python -m tests.api.test_host_syncs`"


def test_num_items_beside_device_inputs_is_read_on_the_host():
    """A CPU num_items_in_batch beside inputs on another device (TRL passes a CPU scalar; meta stands for CUDA
    here) is read on the host, never copied to the device; a Python number is a kernel argument."""
    from grpo_kernels.loss_types import reduction_weights

    mask = torch.ones(2, 3, device="meta")
    for n in (7, 7.0, torch.tensor(7.0), torch.tensor([7])):
        with counting_transfers(device="meta") as records:
            w = reduction_weights(mask, "dapo", n)
        assert records == [] and w.device.type == "meta", (n, records)


def test_the_fp32_gemm_probe_reads_nothing_back():
    """The fp32-output GEMM probe (first CUDA call per device) launches its GEMM and reads no value back (a read
    would be a sync, and would fail inside CUDA graph capture); run here on CPU tensors."""
    from grpo_kernels.kernels import fp32_gemm

    with counting_transfers() as records:
        fp32_gemm._probe("mm", torch.device("cpu"))
    assert records == []


def _loss_and_grads(b, impl, capturable, cfg, dtype=torch.float32):
    h, w = (b[k].to(dtype).clone().requires_grad_(True) for k in ("hidden", "weight"))
    loss, metrics = gk.fused_linear_grpo_loss(h, w, b["ids"], b["adv"], b["mask"], old_logps=b["old"],
                                              ref_logps=b["ref"], impl=impl, capturable=capturable, **cfg)
    loss.backward()
    return [loss.detach(), *metrics.values(), h.grad, w.grad]


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_capturable_gives_the_compacted_call_s_numbers(impl):
    """capturable=True computes the padded rows too; the loss, metrics and gradients are the default call's: the
    same maths on the same valid rows, the padded rows adding exact zeros in another chunking, so both are within
    the three-way rule of the float64 truth (the default call's error as the middle term)."""
    b = _batch()
    for name, cfg in CONFIGS.items():
        truth = _loss_and_grads(b, "torch", False, cfg, torch.float64)
        default, captured = (_loss_and_grads(b, impl, cap, cfg) for cap in (False, True))
        for i, (c, d, t) in enumerate(zip(captured, default, truth)):
            assert_three_way(c, d, t, torch.float32, f"{name}: output {i}", scale=grad_scale(t) if i >= 2 else None)
    logp, grad = _head_logprobs(b, impl)
    logp_c, grad_c = _head_logprobs(b, impl, capturable=True)
    b64 = {k: v.double() if v.is_floating_point() else v for k, v in b.items()}
    logp_t, grad_t = _head_logprobs(b64, "torch")
    assert_three_way(logp_c, logp, logp_t, torch.float32, "linear_token_logprobs(capturable=True)")
    assert_three_way(grad_c, grad, grad_t, torch.float32, "its d hidden", scale=grad_scale(grad_t))


def test_the_counter_sees_a_sync_and_a_copy():
    """The counter can fail: a scalar read, a boolean-mask index, a tolist, a cpu(), a tensor from a list, a number
    made a tensor and a copy to another device are each counted; arithmetic with a number is not."""
    x = torch.randn(4)
    with counting_transfers() as records:
        float(x.sum())
        x[x > 0].sum()
        x.tolist()
        x.cpu()
        torch.tensor([1, 2])
        torch.as_tensor(3, dtype=torch.float32)
        x.to("meta")
        x * 2  # not a sync, not a copy
    assert syncs(records) == ["_local_scalar_dense", "index", "tolist", "cpu"]
    assert host_to_device(records) == ["lift_fresh", "lift_fresh", "_to_copy"]


if __name__ == "__main__":
    print(render_table())
