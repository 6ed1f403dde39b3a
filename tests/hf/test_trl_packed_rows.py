"""patch_trl on TRL's padding-free route: one packed row through ``fused_lm_head=True`` (TRL 1.16's AsyncGRPO).

TRL's ``AsyncGRPOTrainer.compute_loss`` packs a rank's samples into one row with ``TreeRow.pack`` and calls
``model(input_ids (1, N), position_ids (1, N), shift_labels (1, N), fused_lm_head=True, tree_*=...)``:
``position_ids`` restart at 0 per sequence (the depth in a prefix trie: a group's samples share their prompt
tokens), ``shift_labels`` is the next token at each trained position and -100 elsewhere. The fused forward makes one
``_ChunkedLogProbFunction.apply`` call on the row's (N, H) hidden states, which ``patch_trl`` serves with
``grpo_kernels.linear_token_logprobs``. Here, on tiny locally built models (no model hub):

- the fused forward on a packed row (transformers' packed-sequence attention from ``position_ids``), stock TRL and
  patched, against float64 ground truth computed one sequence at a time, by the three-way rule
  (tests/support/tolerances.py), log-probs, entropies and (fp32) the model's gradients, and the padded (B, T) call
  as close to it as the packed one;
- the exact AsyncGRPO call (TRL's ``TreeRow.pack``, shared prompts, TRL's ``tree_fa3`` attention), with flash-attn's
  varlen function replaced by a PyTorch equivalent: the real one is a CUDA kernel fetched from the Hugging Face hub;
  also through TRL's CUDA branch, which hands the head only the labelled positions;
- ``patch_trl(strict=True)`` accepts an AsyncGRPO model at setup, and the report lists the route;
- a two-step AsyncGRPO run, stock vs patched, with an in-process rollout stub (no vLLM server).
Every patched call must reach grpo_kernels: TRL's own kernel raises if it is called.
"""
import os
import queue
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL's notice on importing trl.experimental
pytest.importorskip("trl.experimental.async_grpo")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer as trl_async  # noqa: E402
from trl.experimental.async_grpo import packing as trl_packing  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels.integrations.trl import patch_trl, unpatch_trl  # noqa: E402
from tests.support.tolerances import assert_three_way  # noqa: E402
from tests.support.trl_runs import train_quietly  # noqa: E402

VOCAB, TEMPERATURE = 45, 0.7
# (prompt length, completion length) per sample: ragged, a 1-token completion, a 1-token prompt.
SHAPES = [(3, 5), (2, 1), (4, 8), (1, 3)]


@pytest.fixture(autouse=True)
def _always_unpatched():
    unpatch_trl()
    yield
    unpatch_trl()


def _tiny_model(family: str, attn: str = "sdpa"):
    """A 2-layer causal LM built locally (``initializer_range=0.2``: peaked distributions, so errors show)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, initializer_range=0.2, tie_word_embeddings=False, max_position_embeddings=64)
    config = LlamaConfig(**kw) if family == "llama" else Qwen2Config(**kw)  # Qwen2: q/k/v biases
    config._attn_implementation = attn
    return (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(config).float()


def _samples(shared_prompts: bool, seed: int = 0):
    """Rollout samples as AsyncGRPO's planner sees them. shared_prompts: two groups of two samples, each group's
    samples with one prompt (TreeRow then forwards it once); else four unrelated sequences (plain packing)."""
    g = np.random.default_rng(seed)
    samples = []
    for i, (p, c) in enumerate(SHAPES):
        group = i // 2 if shared_prompts else i
        if shared_prompts and i % 2:
            prompt = samples[-1]["input_ids"][:len(samples[-1]["input_ids"]) - SHAPES[i - 1][1]]
            p = len(prompt)
        else:
            prompt = np.r_[3 + group, g.integers(3, VOCAB, size=p - 1)]  # distinct first tokens: no sharing across
        ids = np.r_[prompt, g.integers(3, VOCAB, size=c)]
        mask = torch.as_tensor(np.r_[np.zeros(p), np.ones(c)], dtype=torch.long)
        samples.append(dict(input_ids=torch.as_tensor(ids), completion_mask=mask, old_log_probs=torch.zeros(len(ids)),
                            advantage=1.0, group_id=group, metrics={}))
    return samples


def _pack(samples):
    """TRL's own packing (``TreeRow.pack``), then the tensors ``AsyncGRPOTrainer.compute_loss`` passes the model."""
    row = trl_packing.TreeRow()
    for s in samples:
        row.add(s)
    packed = row.pack()
    inputs = {k: packed[k][None] for k in ("input_ids", "position_ids", "shift_labels")}
    tree = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree["tree_max_seqlen_q"], tree["tree_max_seqlen_k"] = packed["tree_max_seqlens"].tolist()
    return inputs, tree, packed["token_index"]


def _varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1),
                      **_):
    """flash-attn's ``flash_attn_varlen_func`` (causal, aligned bottom-right as flash-attn does when a query segment
    is shorter than its keys), in PyTorch: segment s's queries attend to keys cu_k[s]:cu_k[s+1]."""
    assert causal and tuple(window_size) == (-1, -1)
    rep = q.shape[1] // k.shape[1]  # grouped-query attention: query head h reads key head h // rep
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = []
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (x[int(c[s]):int(c[s + 1])].transpose(0, 1) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = (qs @ ks.transpose(1, 2) * softmax_scale).masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


class _FlashAttn:
    flash_attn_varlen_func = staticmethod(_varlen_attention)


@pytest.fixture
def tree_attention(monkeypatch):
    """TRL's ``tree_fa3`` attention registered, its flash-attn kernel replaced by ``_varlen_attention``."""
    monkeypatch.setattr(trl_packing, "_flash_attn", lambda: _FlashAttn)
    trl_packing.register_tree_attention()
    return trl_packing.TREE_ATTENTION


@pytest.fixture
def only_grpo_kernels(monkeypatch):
    """Counts grpo_kernels' head calls; TRL's ChunkedLogProbFunction raises if anything falls back to it."""
    calls = []
    original = grpo_kernels.linear_token_logprobs

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("TRL's ChunkedLogProbFunction was called under patch_trl: a fallback")

    def arm():
        monkeypatch.setattr(grpo_kernels, "linear_token_logprobs", spy)
        monkeypatch.setattr(ChunkedLogProbFunction, "apply", refuse)
        return calls

    return arm


def _fused(model, inputs, tree=None, autocast=False):
    """Per-token (log_probs, entropy) of TRL's fused forward on the model's device, returned on the CPU: (1, N) for a
    packed row, (B, T-1) for the padded call."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(**{k: v.to(device) for k, v in inputs.items()}, **(tree or {}), fused_lm_head=True)
    return out.log_probs.cpu(), out.entropy.cpu()


def _logprobs_entropy(logits, ids):
    """tests/support/tolerances.py's ``naive_logprobs_entropy``, kept in the logits' dtype (float64 for the ground
    truth)."""
    logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp_all.gather(-1, ids[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _per_sequence(model, samples, coef=None, autocast=False):
    """Each sample alone through the plain model: logits, then the naive log-softmax in the logits' own dtype (the
    float64 model gives the ground truth). Returns (logp, entropy) at the trained tokens in TRL's ``token_index``
    order and, with coef, the gradients of ``sum(coef[0] * logp + coef[1] * entropy)``."""
    logps, ents = [], []
    device = next(model.parameters()).device
    for s in samples:
        ids, scored = s["input_ids"].to(device), s["completion_mask"][1:].bool().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids[None]).logits[0, :-1]
        lp, ent = _logprobs_entropy(logits.detach() if coef is None else logits, ids[1:])
        logps.append(lp[scored])
        ents.append(ent[scored])
    logp, ent = torch.cat(logps).cpu(), torch.cat(ents).cpu()
    if coef is None:
        return logp, ent, None
    model.zero_grad()
    (coef[0].to(logp.dtype) @ logp + coef[1].to(ent.dtype) @ ent).backward()
    return logp.detach(), ent.detach(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def _grads_of(model, logp, ent, coef):
    model.zero_grad()
    (coef[0] @ logp.double() + coef[1] @ ent.double()).backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters()}


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("family, precision, impl, device", [
    ("llama", "fp32", "auto", "cpu"), ("llama", "bf16-autocast", "auto", "cpu"), ("qwen2", "fp32", "auto", "cpu"),
    ("qwen2", "bf16-autocast", "auto", "cpu"),
    pytest.param("llama", "fp32", "triton", "cpu", marks=pytest.mark.interpreter),
    pytest.param("qwen2", "bf16-autocast", "triton", "cpu", marks=pytest.mark.interpreter),
    # CUDA: TRL compacts the row to its labelled positions; TRL's Triton kernel vs grpo_kernels' Triton kernels.
    pytest.param("llama", "fp32", "auto", "cuda", marks=_CUDA),
    pytest.param("qwen2", "bf16-autocast", "auto", "cuda", marks=_CUDA),
], ids=lambda v: v)
def test_packed_row_stock_vs_patched(family, precision, impl, device, only_grpo_kernels, monkeypatch):
    """A packed row (position_ids restarting, shift_labels) through TRL's fused forward: stock and patched against
    float64 per-sequence truth (three-way rule), gradients too in fp32; the padded (B, T) call gives the same
    log-probs at the completion tokens."""
    if impl == "triton":
        monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    autocast, dtype = precision == "bf16-autocast", (torch.bfloat16 if precision == "bf16-autocast" else torch.float32)
    model = _tiny_model(family).to(device)
    model64 = _tiny_model(family).double()
    samples = _samples(shared_prompts=False)
    inputs, _, token_index = _pack(samples)
    lens = [len(s["input_ids"]) for s in samples]
    assert inputs["position_ids"][0].tolist() == [i for n in lens for i in range(n)]  # plain packing, restarting
    m = len(token_index)
    g = torch.Generator().manual_seed(1)
    coef = (torch.randn(m, generator=g, dtype=torch.float64), torch.randn(m, generator=g, dtype=torch.float64))
    truth_lp, truth_ent, truth_grads = _per_sequence(model64, samples, coef)
    naive_lp, naive_ent, naive_grads = _per_sequence(model, samples, None if autocast else coef, autocast)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))

    stock_lp, stock_ent = _fused(model, inputs, autocast=autocast)
    calls = only_grpo_kernels()
    with patch_trl(strict=True):
        lp, ent = _fused(model, inputs, autocast=autocast)
        ours_grads = None if autocast else _grads_of(model, lp[0, token_index], ent[0, token_index], coef)
        # The padded batch of the same sequences, as GRPOTrainer makes it: right-padded, labels shifted inside.
        width = max(lens)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.full((len(samples), width), -100)
        for b, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[b, :n] = s["input_ids"]
            labels[b, :n] = torch.where(s["completion_mask"].bool(), s["input_ids"], -100)
        padded = dict(input_ids=ids, attention_mask=(torch.arange(width)[None] < torch.tensor(lens)[:, None]).long(),
                      labels=labels)
        lp_pad, ent_pad = _fused(model, padded, autocast=autocast)
    # One call per forward: the whole row (TRL scores every position off CUDA), its labelled positions on CUDA.
    assert len(calls) == 2 and calls[0][0] == (m if device == "cuda" else inputs["input_ids"].shape[1])
    assert lp.shape == ent.shape == inputs["input_ids"].shape and lp.dtype == torch.float32
    untrained = inputs["shift_labels"] == -100
    assert (lp[untrained] == 0).all() and (stock_lp[untrained] == 0).all()  # TRL's convention: zero where not trained

    what = f"{family} {precision}"
    for name, (ours_lp, ours_ent) in {"patched": (lp, ent), "stock TRL": (stock_lp, stock_ent)}.items():
        assert_three_way(ours_lp[0, token_index], naive_lp, truth_lp, dtype, f"{what} {name} log-probs")
        assert_three_way(ours_ent[0, token_index], naive_ent, truth_ent, dtype, f"{what} {name} entropies")
    if not autocast:  # bf16 autocast: TRL rounds logits tiles to bf16, grpo_kernels does not (docs/api.md, "TRL")
        # patched no worse than stock TRL, the oracle, as the middle term
        assert_three_way(lp[0, token_index], stock_lp[0, token_index], truth_lp, dtype, f"{what} log-probs vs TRL")
        assert_three_way(ent[0, token_index], stock_ent[0, token_index], truth_ent, dtype, f"{what} entropies vs TRL")
        for n, grad in ours_grads.items():
            assert_three_way(grad, naive_grads[n], truth_grads[n], dtype, f"{what} d {n}")

    # Padded (B, T) vs packed at the completion tokens: position t of row b scores token t + 1.
    scored = labels[:, 1:] != -100
    assert scored.sum() == m
    assert_three_way(lp_pad[scored], naive_lp, truth_lp, dtype, f"{what} padded log-probs")
    assert_three_way(ent_pad[scored], naive_ent, truth_ent, dtype, f"{what} padded entropies")
    if not autocast:  # in bf16 the two backbones round differently: both are held to the truth above instead
        # the padded call no worse than the packed one, the middle term
        assert_three_way(lp_pad[scored], lp[0, token_index], truth_lp, dtype, f"{what} padded vs packed log-probs")
        assert_three_way(ent_pad[scored], ent[0, token_index], truth_ent, dtype, f"{what} padded vs packed entropies")


@pytest.mark.parametrize("family, compact", [("llama", False), ("qwen2", False), ("llama", True)],
                         ids=["llama", "qwen2", "llama-compact"])
def test_async_grpo_tree_row(family, compact, tree_attention, only_grpo_kernels, monkeypatch):
    """AsyncGRPO's exact call: TRL's TreeRow packing (a group's samples share their prompt, forwarded once) and its
    tree attention; stock and patched log-probs / entropies at ``token_index`` against float64 per-sequence truth.
    compact: TRL's CUDA branch (only the labelled positions reach the head, scattered back), taken here on CPU."""
    if compact:
        monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)
    model, model64 = _tiny_model(family, tree_attention), _tiny_model(family).double()
    samples = _samples(shared_prompts=True)
    inputs, tree, token_index = _pack(samples)
    assert inputs["input_ids"].shape[1] < sum(len(s["input_ids"]) for s in samples)  # prompts are shared
    naive_lp, naive_ent, _ = _per_sequence(_tiny_model(family), samples)
    truth_lp, truth_ent, _ = _per_sequence(model64, samples)
    patch_trl(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict accepts the model at setup, silently
        trl_async.add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    unpatch_trl()
    stock = [x.flatten()[token_index] for x in _fused(model, inputs, tree)]
    calls = only_grpo_kernels()
    with patch_trl(strict=True):
        ours = [x.flatten()[token_index] for x in _fused(model, inputs, tree)]
    labelled = int((inputs["shift_labels"] != -100).sum())
    assert len(calls) == 1 and calls[0][0] == (labelled if compact else inputs["input_ids"].shape[1])
    for name, (lp, ent) in {"patched": ours, "stock TRL": stock}.items():
        assert_three_way(lp, naive_lp, truth_lp, torch.float32, f"{family} tree row {name} log-probs")
        assert_three_way(ent, naive_ent, truth_ent, torch.float32, f"{family} tree row {name} entropies")
    # patched no worse than stock TRL, the oracle, as the middle term
    assert_three_way(ours[0], stock[0], truth_lp, torch.float32, f"{family} tree row log-probs vs TRL")
    assert_three_way(ours[1], stock[1], truth_ent, torch.float32, f"{family} tree row entropies vs TRL")


def test_report_and_strict_setup_for_async_grpo():
    """The report lists the packed-row route on grpo_kernels and the async trainer's swapped setup hook; strict
    refuses an invalid logit scale at AsyncGRPO's setup, as it does at GRPOTrainer's."""
    report = patch_trl(strict=True)
    assert "trl.experimental.async_grpo.async_grpo_trainer.add_fused_lm_head" in report.patched
    route = [r for r in report.routes if r.calls.startswith("padding-free packed row")]
    assert len(route) == 1 and route[0].runs_on == "grpo_kernels" and route[0] in report.kernel_calls
    assert "padding-free packed row (AsyncGRPO)" in str(report)
    model = _tiny_model("llama")
    model.config.logit_scale = 0.0
    with pytest.raises(ValueError, match=r"strict=True\): logit_scale=0.0 is not supported"):
        trl_async.add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    unpatch_trl()
    assert trl_async.add_fused_lm_head is add_fused_lm_head  # restored


# ---- a short AsyncGRPO run, stock vs patched -------------------------------------------------------------------

class _RolloutStub:
    """``RolloutWorkerProtocol`` in process: hands out pre-made scored samples (no vLLM server, no child process)."""

    def __init__(self, samples):
        items = iter(samples)

        class Buffer:
            def get(self, timeout=None):
                return next(items)

            def qsize(self):
                return 1

        self.rollout_buffer, self.metrics_queue = Buffer(), queue.Queue()

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        pass


class _NoWeightSync:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def _rollouts(n_groups=8, group_size=4, seed=0):
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    g = np.random.default_rng(seed)
    out = []
    for group in range(n_groups):
        prompt = g.integers(3, VOCAB, size=int(g.integers(2, 5)))
        advantages = g.standard_normal(group_size)
        for k in range(group_size):
            ids = np.r_[prompt, g.integers(3, VOCAB, size=int(g.integers(1, 7)))]
            mask = (np.arange(len(ids)) >= len(prompt)).astype(np.int64)
            old = np.where(mask == 1, -3.0 + 0.3 * g.standard_normal(len(ids)), 0.0).astype(np.float32)
            out.append(RolloutSample(prompt=[], completion=[], input_ids=ids, completion_mask=mask, old_log_probs=old,
                                     advantage=float(advantages[k]), model_version=0, group_id=group, metrics={}))
    return out


def _async_run(tmp_path, patched: bool, dtype=torch.float32):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    path = tmp_path / "model"
    _tiny_model("llama").save_pretrained(path)
    words = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<unk>")),
                                        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    run = ("patched" if patched else "trl") + ("-float64" if dtype == torch.float64 else "")
    args = AsyncGRPOConfig(output_dir=str(tmp_path / run), per_device_train_batch_size=8,
                           max_steps=2, learning_rate=3e-2, epsilon=0.1, temperature=TEMPERATURE, logging_steps=1,
                           report_to="none", use_cpu=True, bf16=False, dtype="float32", token_budget=0,
                           save_strategy="no", disable_tqdm=True, seed=0, max_staleness=100,
                           model_init_kwargs={"dtype": dtype})
    if patched:
        patch_trl(strict=True)
    try:
        trainer = AsyncGRPOTrainer(model=str(path), args=args, train_dataset=Dataset.from_dict({"prompt": ["w1"] * 8}),
                                   processing_class=tokenizer, reward_funcs=[lambda completions, **kw: [0.0]],
                                   rollout_worker=_RolloutStub(_rollouts()), weight_transfer=_NoWeightSync())
        train_quietly(trainer)
    finally:
        unpatch_trl()
    return trainer.state.log_history, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.slow
def test_async_grpo_run_stock_vs_patched(tmp_path, tree_attention, only_grpo_kernels, monkeypatch):
    """Two optimizer steps of AsyncGRPOTrainer (fp32), stock then patched: the same per-step loss, ratio, KL, entropy,
    clip fractions and grad norm, and the same parameters, by the three-way rule against the patched run in float64
    (stock TRL in fp32 the middle term, as tests/support/trl_runs.py's ``assert_same_run``). Stubbed, as the run needs no GPU otherwise: the rollout
    worker (samples with fixed old log-probs and advantages), the weight sync to vLLM, the vLLM client (only used for
    an unset token_budget) and the CUDA-only peak-FLOPs lookup (MFU metrics)."""
    monkeypatch.setattr(trl_async, "VLLMClient", lambda *args, **kwargs: None)
    monkeypatch.setattr(trl_async, "get_peak_flops_per_device", lambda *args, **kwargs: None)
    ref_logs, ref_params = _async_run(tmp_path, patched=False)
    calls = only_grpo_kernels()
    logs, params = _async_run(tmp_path, patched=True)
    assert len(calls) == 2  # one packed row per step
    truth_logs, truth_params = _async_run(tmp_path, patched=True, dtype=torch.float64)
    assert next(iter(truth_params.values())).dtype == torch.float64
    keys = ("loss", "grad_norm", "ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean")
    steps = [(a, b, t) for a, b, t in zip(ref_logs, logs, truth_logs) if "loss" in a]
    assert len(steps) == 2 and len(ref_logs) == len(logs) == len(truth_logs)
    assert any(a["clip_ratio/region_mean"] > 0 for a, _, _ in steps) and all(a["grad_norm"] > 0 for a, _, _ in steps)
    for step, (a, b, t) in enumerate(steps):
        for key in keys:
            assert_three_way(float(b[key]), float(a[key]), float(t[key]), torch.float32, f"step {step} {key}")
    for name, p in ref_params.items():
        assert_three_way(params[name], p, truth_params[name], torch.float32, name)
