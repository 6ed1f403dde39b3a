"""A user's GRPO module written against Liger-Kernel's API runs on grpo_kernels after its import lines change and
nothing else (issue 30): the same steps, losses, metrics and parameter gradients as with Liger-Kernel itself."""
import pytest
import torch

pytest.importorskip("liger_kernel.chunked_loss", reason="needs liger-kernel (test extra)")

from ..support.tolerances import assert_three_way, grad_scale  # noqa: E402

USER_CODE = '''
import torch
from torch import nn
from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
from liger_kernel.transformers.grpo_loss import triton_grpo_loss


class TinyPolicy(nn.Module):
    """A user's GRPO step written against Liger-Kernel's API."""

    def __init__(self, vocab=29, hidden=16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.grpo = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="grpo", temperature=0.9, epsilon_high=0.28)

    def fused_step(self, ids, mask, advantages, old, ref):
        hidden = torch.tanh(self.embed(ids))
        loss, (kl, clip_ratio) = self.grpo(hidden, self.lm_head.weight, ids, mask, advantages, None, ref, old)
        loss.backward()
        return loss.item(), kl.item(), clip_ratio.item()

    def logits_step(self, input_ids, mask, advantages, old, ref):
        logits = self.lm_head(torch.tanh(self.embed(input_ids)))  # (B, L + 1, V)
        completion_ids = input_ids[:, 1:].contiguous()
        per_token_loss, per_token_kl, is_clipped = triton_grpo_loss(
            logits, old, ref, completion_ids, advantages, mask, temperature=0.9, beta=0.04)
        loss = (per_token_loss * mask).sum() / mask.sum()
        loss.backward()
        return loss.item(), ((per_token_kl * mask).sum() / mask.sum()).item(), (is_clipped.sum() / mask.sum()).item()
'''
LIGER_IMPORTS = ("from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss\n"
                 "from liger_kernel.transformers.grpo_loss import triton_grpo_loss")
SWITCHED = USER_CODE.replace(LIGER_IMPORTS, "from grpo_kernels.liger import LigerFusedLinearGRPOLoss, triton_grpo_loss")


def _user_module(source: str):
    namespace = {"__name__": "user_grpo"}
    exec(compile(source, "user_grpo.py", "exec"), namespace)  # noqa: S102 - the test's own source text
    return namespace["TinyPolicy"]()


def _user_batch(L: int):
    g = torch.Generator().manual_seed(7)
    B = 4
    ids = torch.randint(0, 29, (B, L), generator=g)
    mask = (torch.arange(L - 1)[None] < torch.tensor([[L - 1], [2], [L - 3], [1]])).long()
    adv = torch.tensor([0.9, -1.2, 0.3, -0.4])
    old = -3.4 + 0.3 * torch.randn(B, L - 1, generator=g)
    ref = -3.4 + 0.3 * torch.randn(B, L - 1, generator=g)
    return ids, mask, adv, old, ref


def _compare_users(step: str, batch):
    """The switched user code (grpo_kernels, fp32) against Liger-Kernel's (fp32) by the three-way rule: the float64
    truth is the switched code with the module and the batch's floating tensors in float64 (the PyTorch path of
    grpo_kernels, the reference maths), Liger's fp32 run the middle term; gradients relative to their largest value."""
    liger_user, switched_user, truth_user = _user_module(USER_CODE), _user_module(SWITCHED), _user_module(SWITCHED)
    assert SWITCHED.count("\n") == USER_CODE.count("\n") - 1 and "liger_kernel" not in SWITCHED
    theirs, mine = getattr(liger_user, step)(*batch), getattr(switched_user, step)(*batch)
    truth = getattr(truth_user.double(), step)(*(t.double() if t.is_floating_point() else t for t in batch))
    for name, a, b, t in zip(("loss", "kl", "clip ratio"), mine, theirs, truth):
        assert_three_way(a, b, t, torch.float32, f"{step} {name}")
    for (name, a), b, t in zip(switched_user.named_parameters(), liger_user.parameters(), truth_user.parameters()):
        assert_three_way(a.grad, b.grad, t.grad, torch.float32, f"{step} d {name}", scale=grad_scale(t.grad))


def test_user_code_switches_with_one_import_fused_linear():
    ids, mask, adv, old, ref = _user_batch(9)
    _compare_users("fused_step", (ids[:, 1:], mask, adv, old, ref))


@pytest.mark.interpreter
def test_user_code_switches_with_one_import_logits():
    """Liger's triton_grpo_loss runs its Triton kernels (the interpreter on CPU); the switched code runs ours."""
    _compare_users("logits_step", _user_batch(9))
