"""Say what the peers say (issue 30): TRL 1.16 warns about sequence-level ratios with loss types that sum per-token
contributions and with vespo; Liger-Kernel 0.8.5 refuses sequence-level cispo / sapo / vespo and warns when a
reference is given twice. grpo_kernels computes these configurations (TRL's definitions) and warns with TRL's
words, adding Liger's refusal where it applies."""
import inspect
import warnings

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.peer_warnings import sequence_level_messages

WARNED = ["bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo"]


@pytest.mark.parametrize("loss_type", WARNED)
def test_sequence_level_configurations_warn(loss_type):
    with pytest.warns(UserWarning, match="grpo_kernels: ") as caught:
        cfg = gk.GRPOLossConfig(loss_type=loss_type, importance_sampling_level="sequence")
    text = str(caught[0].message)
    assert cfg.importance_sampling_level == "sequence"  # computed all the same
    assert ("Liger-Kernel 0.8.5 refuses" in text) == (loss_type in ("cispo", "sapo", "vespo"))
    # the keyword-override route of the public functions warns too
    with pytest.warns(UserWarning, match="importance_sampling_level"):
        gk.grpo_loss(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2), loss_type=loss_type,
                     importance_sampling_level="sequence", impl="torch")


@pytest.mark.parametrize("loss_type,level", [("grpo", "sequence"), ("luspo", "sequence")]
                         + [(lt, "token") for lt in gk.config.LOSS_TYPES])
def test_other_configurations_are_silent(loss_type, level):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gk.GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level)


def test_the_words_are_trl_s():
    """The warnings quote TRL 1.16's GRPOTrainer (checked against the installed source)."""
    trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs trl (test extra)")
    source = " ".join(inspect.getsource(trainer).split())  # TRL splits its messages over string literals
    source = source.replace('" "', "")
    for loss_type in ("cispo", "vespo"):
        (message,) = sequence_level_messages(loss_type, "sequence")
        trl_part = message.split(" Liger-Kernel")[0].replace(f"'{loss_type}'", "'{args.loss_type}'")
        assert trl_part in source, trl_part


def test_reference_given_twice_warns():
    """FusedLinearGRPOLoss with ref_logps and ref_input: Liger's warning, and ref_logps is used."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(11, 8, generator=g)
    ids, adv = torch.randint(0, 11, (2, 3), generator=g), torch.randn(2, generator=g)
    ref = torch.randn(2, 3, generator=g) - 2.5
    module = gk.FusedLinearGRPOLoss(beta=0.04)
    with pytest.warns(UserWarning, match="both ref_logps .* and ref_input are given; using ref_logps"):
        both, _ = module(hidden, weight, ids, None, adv, ref_logps=ref, ref_input=hidden + 1)
    alone, _ = module(hidden, weight, ids, None, adv, ref_logps=ref)
    assert torch.equal(both, alone)
