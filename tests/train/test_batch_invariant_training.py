"""``grpo.train --batch-invariant`` (docs/numerics.md, "Batch invariance"; docs/training.md): the old and reference
log-probs computed at generation time (no gradients, in their own micro-batches) are bitwise the loss's own
log-probs at the first iteration, so the ratio is exactly 1 and nothing is clipped; and a packed step equals a padded
step bitwise in its loss, its metrics and each sequence's gradient (given the same hidden states: the model body is
the model's, docs/numerics.md says what composes).

"Ratio exactly 1" is checked where it can fail: each loss call of the step runs a second time with
``old_logps=None`` (the loss's own log-probs, detached: a ratio of exactly 1 by construction) and must give the same
loss bit for bit; at the second iteration, after the weights moved, the same comparison must see a difference."""
from __future__ import annotations

import pytest
import torch

import grpo.policy
from grpo import TrainConfig
from grpo.cli import config_from_argv
from grpo.distributed import DistEnv
from grpo.errors import UsageError
from grpo.packing import Packing, packed_micro_batches
from grpo.trainer import Trainer
from grpo.update import StepOptions, optimizer_step, rollout_logprobs, trim
from grpo_kernels import GRPOLossConfig

SMALL = dict(prompts_per_step=4, num_generations=4, eval_size=0, save_steps=0, progress=False, seed=0)


def _trainer(tmp_path, name: str, packing: bool = True, batch_invariant: bool = True, **loss) -> Trainer:
    cfg = TrainConfig(output_dir=str(tmp_path / name), max_steps=2, micro_batch_size=4, num_iterations=2,
                      warmup_steps=0, packing=packing,
                      loss=GRPOLossConfig(beta=0.02, batch_invariant=batch_invariant, **loss), **SMALL)
    return Trainer(cfg, DistEnv())


class RatioSpy:
    """Wraps the package's loss as grpo.policy calls it: each call also runs with old_logps=None (ratio exactly 1)
    and records whether the loss was the same bit for bit."""

    def __init__(self, monkeypatch):
        self.same: list[bool] = []
        original = grpo.policy.gk.fused_linear_grpo_loss

        def spy(hidden, weight, *args, **kwargs):
            loss, metrics = original(hidden, weight, *args, **kwargs)
            if kwargs.get("old_logps") is not None:
                with torch.no_grad():
                    exact, _ = original(hidden.detach(), weight.detach(), *args, **{**kwargs, "old_logps": None})
                self.same.append(torch.equal(loss.detach(), exact))
            return loss, metrics

        monkeypatch.setattr(grpo.policy.gk, "fused_linear_grpo_loss", spy)

    def take(self) -> list[bool]:
        out, self.same = self.same, []
        return out


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["option", "option-off"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_generation_time_logps_give_a_ratio_of_exactly_one(loss_type, packing, batch_invariant, tmp_path,
                                                           monkeypatch):
    """One rollout, two iterations of micro-batches of 4 sequences: the reference log-probs equal the old ones
    (the reference is the initial policy), the first iteration's loss calls all see a ratio of exactly 1 and clip
    nothing, the second iteration's do not (the comparison can fail).

    On the CPU this holds by construction, with or without the option (both checked): the trainer computes the old
    log-probs on the step's own micro-batches, and the no-gradient call and the loss run the same head.torch tiles
    on them (one tile per micro-batch), the same GEMM shapes. What the option adds, other batches and other paths:
    tests/api/test_batch_invariance.py::test_old_logps_without_gradients_give_a_ratio_of_exactly_one; on a GPU,
    where the no-gradient call runs head.no_grad and the loss head.fast / head.light:
    tests/kernels/test_gpu_invariance.py::test_no_gradient_logps_give_a_ratio_of_exactly_one_on_the_gpu."""
    trainer = _trainer(tmp_path, "run", packing, batch_invariant, loss_type=loss_type)
    assert trainer.policy.loss_config.batch_invariant == batch_invariant
    assert (trainer.packing is not None) == packing
    rollout, advantages = trainer.make_rollout()
    old = rollout_logprobs(trainer.policy, rollout, trainer.cfg.micro_batch_size, trainer.packing)
    ref = rollout_logprobs(trainer.ref, rollout, trainer.cfg.micro_batch_size, trainer.packing)
    assert torch.equal(old, ref), "the reference model's log-probs differ from the initial policy's"
    spy = RatioSpy(monkeypatch)
    rows = torch.arange(rollout.batch_size)
    first = optimizer_step(trainer.model, trainer.policy, trainer.optimizer, trainer.scheduler, rollout, rows,
                           advantages, old, ref, trainer.step_options)
    same = spy.take()
    assert len(same) >= 3 and all(same), f"first iteration: ratio != 1 in micro-batches {same}"
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert first[key] == 0.0, f"first iteration: {key} = {first[key]!r}"
    optimizer_step(trainer.model, trainer.policy, trainer.optimizer, trainer.scheduler, rollout, rows, advantages,
                   old, ref, trainer.step_options)
    assert not any(spy.take()), "second iteration: the moved weights left the ratio at exactly 1"


def _padded_and_packed(trainer: Trainer, rollout, advantages, old, ref):
    """(padded batch, packed batch, the packed hidden states): the whole rollout as one micro-batch of each kind;
    the hidden states come from one packed backbone pass, laid out on the padded grid for the padded batch."""
    packed = packed_micro_batches(rollout, list(range(rollout.batch_size)), Packing(), rollout.batch_size)
    assert len(packed) == 1
    packed = packed[0]
    with torch.no_grad():
        flat = trainer.policy.packed_hidden(packed)
    padded = trim(rollout.batch(torch.arange(rollout.batch_size), advantages=advantages, old_logps=old,
                                ref_logps=ref))
    grid = flat.new_zeros((*padded["completion_ids"].shape, flat.shape[-1]))
    grid[packed.token_rows, packed.token_cols] = flat
    packed_batch = {"packed": packed, "advantages": advantages[packed.rows], "old_logps": packed.gather(old),
                    "ref_logps": packed.gather(ref)}
    return padded, grid, packed_batch, flat


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_a_packed_step_equals_the_padded_step_bitwise(loss_type, tmp_path):
    """The policy's loss on the rollout padded (B, T) and packed (N,), from the same hidden states: loss, every
    metric and each token's d hidden bitwise equal (num_items_in_batch as the trainer passes it)."""
    trainer = _trainer(tmp_path, "run", loss_type=loss_type)
    rollout, advantages = trainer.make_rollout()
    old = rollout_logprobs(trainer.policy, rollout, 3, trainer.packing)  # other micro-batches than the step's
    ref = old - 0.01 * torch.arange(old.shape[1], dtype=old.dtype)   # a reference that differs per token
    padded, grid, packed, flat = _padded_and_packed(trainer, rollout, advantages, old, ref)
    num_items = rollout.completion_mask.sum().to(torch.float32)
    results = []
    for batch, hidden in ((padded, grid), (packed, flat)):
        hidden = hidden.clone().requires_grad_(True)
        loss, metrics = trainer.policy(batch, num_items_in_batch=num_items, hidden=hidden)
        loss.backward()
        results.append((loss.detach(), metrics, hidden.grad))
    (loss_p, metrics_p, grad_p), (loss_k, metrics_k, grad_k) = results
    assert torch.equal(loss_p, loss_k), f"padded {loss_p.item()!r} != packed {loss_k.item()!r}"
    for key in metrics_p:
        assert torch.equal(metrics_p[key], metrics_k[key]), f"metric {key}: padded != packed"
    tokens = packed["packed"]
    assert torch.equal(grad_p[tokens.token_rows, tokens.token_cols], grad_k), "d hidden padded != packed"
    assert grad_k.abs().max() > 0 and torch.equal(grad_p.sum(-1).ne(0).sum(), grad_k.sum(-1).ne(0).sum())


def test_the_flag_reaches_every_log_prob_call(tmp_path, monkeypatch):
    """--batch-invariant sets the loss config, and the policy's generation-time log-probs ask for it."""
    cfg = config_from_argv(["--batch-invariant", "--output-dir", str(tmp_path / "run")])
    assert cfg.loss.batch_invariant and cfg.loss.deterministic
    assert not config_from_argv(["--output-dir", str(tmp_path / "run")]).loss.batch_invariant
    seen = []
    original = grpo.policy.gk.linear_token_logprobs
    monkeypatch.setattr(grpo.policy.gk, "linear_token_logprobs",
                        lambda *a, **k: seen.append(k.get("batch_invariant")) or original(*a, **k))
    trainer = _trainer(tmp_path, "flag")
    rollout, _ = trainer.make_rollout()
    rollout_logprobs(trainer.policy, rollout, 8, trainer.packing)
    assert seen and all(seen)


def test_the_chosen_block_reaches_every_log_prob_call(tmp_path, monkeypatch):
    """--invariant-block-rows R sets the loss config's block, the policy's generation-time log-probs take the same R
    (else their bit pattern would differ from the loss's), and without --batch-invariant it is refused."""
    cfg = config_from_argv(["--batch-invariant", "--invariant-block-rows", "8", "--output-dir", str(tmp_path / "r")])
    assert cfg.loss.invariant_block_rows == 8
    with pytest.raises(UsageError, match="invariant_block_rows=8 .* but batch_invariant is False"):
        config_from_argv(["--invariant-block-rows", "8", "--output-dir", str(tmp_path / "r")])
    seen = []
    original = grpo.policy.gk.linear_token_logprobs
    monkeypatch.setattr(grpo.policy.gk, "linear_token_logprobs",
                        lambda *a, **k: seen.append(k.get("invariant_block_rows")) or original(*a, **k))
    trainer = _trainer(tmp_path, "block", invariant_block_rows=8)
    rollout, _ = trainer.make_rollout()
    rollout_logprobs(trainer.policy, rollout, 8, trainer.packing)
    assert seen and all(rows == 8 for rows in seen), seen
