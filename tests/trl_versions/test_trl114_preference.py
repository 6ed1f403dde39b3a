"""patch_trl on TRL 1.14's DPO and KTO trainers (run with scripts/trl_version.sh 1.14): under
``use_liger_kernel=True`` they compute their policy and reference log-probs with ``_ChunkedLogProbFunction``,
imported by name into their modules, which patch_trl swaps. Stock (TRL's chunked function) against patched, the
float64 truth being TRL's own full-logits run (``use_liger_kernel=False``: TRL's chunked function keeps its logits
tiles in fp32)."""
import warnings

import pytest
import torch

from ..support.trl_runs import save_tiny_lm
from ..support.trl_versions_env import LIGER_LAYERS_OFF, require_series

require_series("1.14")

import trl.trainer.dpo_trainer as trl_dpo  # noqa: E402

from ..support.trl_runs import assert_informative, assert_same_run, head_calls  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")
PROMPTS = ["w1 w2", "w3", "w4 w5 w6", "w7", "w8 w9", "w10 w11 w12", "w13", "w14 w15"]
GOOD = [" w2 w4", " w6", " w8 w10 w12", " w14 w16", " w18", " w3 w5", " w7 w9", " w11"]
BAD = [" w20 w22", " w31", " w25 w27 w29", " w33 w35", " w36", " w21 w23", " w37 w39", " w24"]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_llama"))


def _dataset(kind):
    from datasets import Dataset

    if kind == "dpo":
        return Dataset.from_dict({"prompt": PROMPTS, "chosen": GOOD, "rejected": BAD})
    return Dataset.from_dict({"prompt": PROMPTS, "completion": [g if i % 2 else b for i, (g, b) in
                                                                enumerate(zip(GOOD, BAD))],
                              "label": [bool(i % 2) for i in range(len(PROMPTS))]})


def _train(kind, tiny_lm, tmp_path, patched, dtype=torch.float32, liger=True):
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    path, tokenizer = tiny_lm
    options = dict(output_dir=str(tmp_path / f"{kind}-{patched}-{str(dtype)[6:]}"), per_device_train_batch_size=4,
                   max_steps=2, learning_rate=3e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                   seed=0, save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": dtype}, max_length=16,
                   use_liger_kernel=liger, liger_kernel_config=LIGER_LAYERS_OFF if liger else None)
    trainer_cls, config_cls = {"dpo": (DPOTrainer, DPOConfig), "kto": (KTOTrainer, KTOConfig)}[kind]
    with head_calls(patched) as calls:
        trainer = trainer_cls(model=path, args=config_cls(**options), train_dataset=_dataset(kind),
                              processing_class=tokenizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    return trainer.state.log_history, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, len(calls)


@pytest.mark.parametrize("kind, informative", [
    ("dpo", ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm")),
    ("kto", ("loss", "rewards/margins", "logps/chosen", "grad_norm")),
])
def test_use_liger_kernel_stock_vs_patched(kind, informative, tiny_lm, tmp_path):
    assert trl_dpo._ChunkedLogProbFunction is not None  # the name TRL 1.14's DPO module calls
    ref = _train(kind, tiny_lm, tmp_path, False)
    out = _train(kind, tiny_lm, tmp_path, True)
    truth = _train(kind, tiny_lm, tmp_path, False, torch.float64, liger=False)
    # the full-logits run also logs the metrics that need the logits (logits/chosen, mean_token_accuracy): the truth
    # of those the chunked runs log
    assert all(set(a) <= set(t) for a, t in zip(ref[0], truth[0]))
    truth = ([{key: t[key] for key in a} for a, t in zip(ref[0], truth[0])], *truth[1:])
    assert_informative(ref[0], *informative)
    assert_same_run(ref, out, truth, truth_patched=False)
