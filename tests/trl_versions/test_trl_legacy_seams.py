"""patch_trl's seams on TRL 1.12, 1.13 and 1.14, call by call (each series run with scripts/trl_version.sh): what it
swaps and restores, the report, TRL's method against ours on one batch (padding, chunks of rows, entropy and its
gradient, the float64 truth), TRL's chunked function against ours, and the calls handed back to TRL's own method."""
import functools
import inspect
import warnings

import pytest
import torch

from ..support.trl_runs import save_tiny_lm
from ..support.trl_versions_env import require_series

SERIES = require_series("1.12", "1.13", "1.14")

import trl  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402

from grpo_kernels.integrations import trl_versions  # noqa: E402
from grpo_kernels.integrations.trl import is_trl_patched, patch_trl, unpatch_trl  # noqa: E402

from ..support.tolerances import assert_three_way, grad_scale  # noqa: E402
from ..support.trl_runs import head_inputs, head_truth  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")
METHOD = "_get_per_token_logps_and_entropies"
NAMED = ("trl.trainer.grpo_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer") if SERIES == "1.14" else ()


def _swapped():
    import importlib

    values = [getattr(GRPOTrainer, METHOD), getattr(RLOOTrainer, METHOD), trl_utils._ChunkedLogProbFunction]
    return values + [importlib.import_module(m)._ChunkedLogProbFunction for m in NAMED]


def test_patch_swaps_and_unpatch_restores_exactly():
    before = _swapped()
    report = patch_trl()
    patch_trl()  # idempotent
    after = _swapped()
    assert is_trl_patched() and all(a is not b for a, b in zip(after, before))
    assert set(report.patched) == {"trl.trainer.utils._ChunkedLogProbFunction",
                                   *(f"{m}._ChunkedLogProbFunction" for m in NAMED),
                                   f"trl.trainer.grpo_trainer.GRPOTrainer.{METHOD}",
                                   f"trl.trainer.rloo_trainer.RLOOTrainer.{METHOD}",
                                   # DistillationTrainer (tests/trl_versions/test_trl_distill_versions.py)
                                   "trl.trainer.distillation_trainer._chunked_divergence_loss"}
    unpatch_trl()
    assert all(a is b for a, b in zip(_swapped(), before)) and not is_trl_patched()


def test_report_says_what_runs_where():
    report = patch_trl()
    text = str(report)
    assert f"TRL {trl.__version__} patched" in text
    calls = {r.calls.strip(): r.runs_on for r in report.routes}
    assert calls["GRPO/RLOO per-token log-probs + entropy (policy, old, ref)"] == "grpo_kernels"
    assert calls["vision inputs, compute_aux_loss (MoE), FSDP, ZeRO-3"] == "TRL"
    assert calls["AsyncGRPO packed rows (patch_chunked_lm_head)"] == "grpo_kernels"
    if SERIES == "1.14":
        assert calls["DPO/KTO use_liger_kernel=True (policy + reference)"] == "grpo_kernels"
        assert calls["GRPO use_liger_kernel=True (ZeRO-3, FSDP too)"] == "grpo_kernels"
    else:
        assert calls["DPO/KTO/SFT"] == "TRL"


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    """A GRPOTrainer and an RLOOTrainer on the tiny Llama, and the same in float64 (built once, never trained)."""
    from datasets import Dataset

    from ..support.trl_runs import even_words

    path, tokenizer = save_tiny_lm(tmp_path_factory.mktemp("tiny_llama"))
    built = {}
    for name, config_class, trainer_class in (("grpo", trl.GRPOConfig, GRPOTrainer),
                                              ("rloo", trl.RLOOConfig, RLOOTrainer)):
        for dtype in (torch.float32, torch.float64):
            args = config_class(output_dir=str(tmp_path_factory.mktemp(name)), per_device_train_batch_size=4,
                                num_generations=4, max_completion_length=6, report_to="none", use_cpu=True,
                                temperature=0.7, model_init_kwargs={"dtype": dtype}, disable_tqdm=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built[name, dtype] = trainer_class(model=path, reward_funcs=even_words, args=args,
                                                   train_dataset=Dataset.from_dict({"prompt": ["w1"] * 4}),
                                                   processing_class=tokenizer)
    return built


def _batch():
    """Three left-padded prompts + completions of 5 tokens, one right-padded (its last two positions masked)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 43, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding of a prompt
    mask[1, -2:] = 0  # a completion that ended early
    ids[mask == 0] = 0
    return ids, mask, 5


def _call(trainer, entropy: bool, batch_size=None):
    ids, mask, keep = _batch()
    for p in trainer.model.parameters():
        p.grad = None
    logps, entropies, aux = getattr(type(trainer), METHOD)(trainer, trainer.model, ids, mask, keep,
                                                           batch_size=batch_size, compute_entropy=entropy)
    assert aux is None
    weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps).to(logps.dtype)
    loss = (logps * weights).sum() + (0.3 * entropies.sum() if entropy and entropies.requires_grad else 0)
    loss.backward()
    head = trainer.model.get_output_embeddings().weight
    first = next(trainer.model.parameters())
    return [logps.detach(), None if entropies is None else entropies.detach()], [head.grad.clone(),
                                                                             first.grad.clone()], entropies


@pytest.mark.parametrize("name, entropy_bonus", [("grpo", False), ("grpo", True), ("rloo", False)])
def test_method_matches_trl(trainers, name, entropy_bonus):
    """Ours against TRL's own method (fp32) and the float64 truth (TRL's method on the float64 model): log-probs at
    every completion position (1.14: zeros where the mask is 0, as TRL's row mask), entropies, the gradient of the
    head and of the embeddings; rows two at a time (``batch_size``) as TRL chunks them; the entropy's gradient as
    TRL's (RLOO has no entropy bonus: never one)."""
    trainer, trainer64 = trainers[name, torch.float32], trainers[name, torch.float64]
    for t in (trainer, trainer64):
        t._entropy_bonus_enabled = entropy_bonus
    stock_values, stock_grads, stock_entropy = _call(trainer, True, batch_size=2)
    truth_values, truth_grads, _ = _call(trainer64, True)  # TRL's own method in float64: independent of ours
    patch_trl()
    values, grads, entropy = _call(trainer, True, batch_size=2)
    assert entropy.requires_grad == stock_entropy.requires_grad == (name == "grpo" and entropy_bonus)
    assert values[0].dtype == torch.float32 and truth_values[0].dtype == torch.float64
    for what, o, n, t in zip(("logp", "entropy"), values, stock_values, truth_values):
        assert_three_way(o, n, t, torch.float32, f"{name} {what}")
    for what, o, n, t in zip(("d lm_head", "d embed_tokens"), grads, stock_grads, truth_grads):
        assert_three_way(o, n, t, torch.float32, f"{name} {what}", scale=grad_scale(t))
    padded = _batch()[1][:, -5:] == 0
    if SERIES == "1.14":  # TRL 1.14's row mask: exactly 0 where the completion mask is 0
        assert (values[0][padded] == 0).all() and (stock_values[0][padded] == 0).all()
    else:  # 1.12 / 1.13 score the padded positions too
        assert (stock_values[0][padded] != 0).all() and (values[0][padded] != 0).all()


def test_no_entropy_asked(trainers):
    patch_trl()
    values, _, entropy = _call(trainers["grpo", torch.float32], False)
    assert entropy is None and values[1] is None


def _chunked_call(fn, takes_bias: bool, h, w, b, ids, temperature, softcap, scale):
    """TRL's chunked function's positional call: TRL 1.12's has no bias argument."""
    head = (h, w, b) if takes_bias else (h, w)
    return fn.apply(*head, ids, temperature, 16, softcap, scale)


def test_chunked_function_matches_trl():
    """TRL's ``_ChunkedLogProbFunction`` (1.12: 7 arguments, no bias; 1.13 / 1.14: 8) against ours: values and
    gradients, with a logit scale and a soft cap (the three-way rule against the float64 reference)."""
    theirs = trl_utils._ChunkedLogProbFunction
    takes_bias = "bias" in inspect.signature(theirs.forward).parameters
    assert takes_bias == (SERIES != "1.12")
    patch_trl()
    ours = trl_utils._ChunkedLogProbFunction
    assert ours is not theirs and ours.takes_bias == takes_bias
    h, w, b, ids = head_inputs()
    if not takes_bias:
        b = torch.zeros_like(b, requires_grad=True)  # the truth's bias: none
    results = []
    for fn in (ours, theirs):
        for t in (h, w, b):
            t.grad = None
        logp, entropy = _chunked_call(fn, takes_bias, h, w, b, ids, 0.8, 3.0, 0.5)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        results.append(([logp, entropy], [t.grad.clone() for t in (h, w, b)[:3 if takes_bias else 2]]))
    truth = head_truth(h, w, b, ids, temperature=0.8, final_logit_softcapping=3.0, logit_scale=0.5)
    (values, grads), (n_values, n_grads) = results
    for what, o, n, t in zip(("logp", "entropy"), values, n_values, truth[0]):
        assert_three_way(o, n, t, torch.float32, what)
    for what, o, n, t in zip(("d hidden", "d weight", "d bias"), grads, n_grads, truth[1]):
        assert_three_way(o, n, t, torch.float32, what, scale=grad_scale(t))


def test_chunked_function_hands_back_to_trl(monkeypatch):
    """A soft cap that does not fold and an empty batch: TRL's own chunked function serves them (its pair)."""
    seen = []
    original = trl_utils._ChunkedLogProbFunction
    takes_bias = "bias" in inspect.signature(original.forward).parameters
    monkeypatch.setattr(original, "apply", lambda *a: (seen.append((len(a), a[0].shape[0])), (a[0][:, 0] * 0,) * 2)[1])
    patch_trl()
    h, w, b, ids = head_inputs()
    b = b if takes_bias else None
    with pytest.warns(UserWarning, match="final_logit_softcapping=-1.0"):
        _chunked_call(trl_utils._ChunkedLogProbFunction, takes_bias, h, w, b, ids, 1.0, -1.0, 1.0)
    _chunked_call(trl_utils._ChunkedLogProbFunction, takes_bias, h[:0], w, b, ids[:0], 1.0, None, 1.0)
    arity = 8 if takes_bias else 7
    assert seen == [(arity, h.shape[0]), (arity, 0)]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("extra, option", [
    (dict(compute_aux_loss=True), "compute_aux_loss=True"),
    (dict(pixel_values=torch.zeros(1, 3, 4, 4)), "pixel_values"),
])
def test_calls_handed_back_to_trl(trainers, monkeypatch, extra, option):
    """What ours cannot serve goes to TRL's own method with the same arguments, warned once; strict raises."""
    handed = []

    @functools.wraps(getattr(GRPOTrainer, METHOD))  # its signature, which ours binds the call against
    def trl_method(self, model, *args, **kwargs):
        handed.append(kwargs)
        raise _Stop

    monkeypatch.setattr(GRPOTrainer, METHOD, trl_method)  # what patch_trl finds and hands back to
    patch_trl()
    trainer = trainers["grpo", torch.float32]
    ids, mask, keep = _batch()
    with pytest.warns(UserWarning, match=option):
        with pytest.raises(_Stop):
            getattr(GRPOTrainer, METHOD)(trainer, trainer.model, ids, mask, keep, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        with pytest.raises(_Stop):
            getattr(GRPOTrainer, METHOD)(trainer, trainer.model, ids, mask, keep, **extra)
    assert handed == [extra, extra]
    unpatch_trl()
    patch_trl(strict=True)
    with pytest.raises(ValueError, match=f"strict=True.*{option}"):
        getattr(GRPOTrainer, METHOD)(trainer, trainer.model, ids, mask, keep, **extra)


def test_series_names():
    assert trl_versions.series_of(trl.__version__) == SERIES
    assert trl_versions.series_of("1.14.0.dev0") == "1.14"
