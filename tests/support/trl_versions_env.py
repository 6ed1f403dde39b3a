"""The older TRL series' environments and trainer runs (tests/trl_versions/): TRL 1.12, 1.13, 1.14 and 1.15 each run
over the main .venv with their release first on PYTHONPATH (an overlay folder, ``.trl-versions/SERIES``, made by
scripts/setup_trl_versions.sh; ``bash scripts/trl_version.sh SERIES -m pytest ...`` runs a command so), since one
environment holds one TRL; elsewhere (the main .venv has TRL 1.16) the tests skip, naming the command that runs them.

``train`` is tests/hf/test_hf_trl.py's run for any of these series and for RLOO too: a tiny local Llama with the word
tokenizer (tests/support/trl_runs.py), every logged metric and final parameter, the number of grpo_kernels head calls,
and the number of calls that went to TRL's logits path (``LogitsPathCounter``).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

SERIES = ("1.12", "1.13", "1.14", "1.15")
# liger_kernel_config for use_liger_kernel=True runs: transformers' Trainer would otherwise patch the model with
# Liger's layers, whose Triton RMSNorm fails under the CPU interpreter (the seam under test is TRL's chunked head)
LIGER_LAYERS_OFF = {name: False for name in ("rope", "rms_norm", "swiglu", "cross_entropy",
                                             "fused_linear_cross_entropy")}
# The module-level functions of TRL's trainer modules that read full logits (the GRPO / RLOO logits path).
LOGITS_FUNCTIONS = ("selective_log_softmax", "selective_log_softmax_and_entropy", "entropy_from_logits")


OVERLAYS = ".trl-versions"  # scripts/setup_trl_versions.sh's folders: one per series, and "common"
# Set by scripts/trl_version.sh to the series it runs: a module for that series then fails instead of skipping when
# another TRL is imported (a layout Python does not see would otherwise skip every test, silently green).
SERIES_ASKED = "GRPO_KERNELS_TEST_TRL_SERIES"


def overlay_of(series: str) -> str:
    return f"{OVERLAYS}/{series}"


def run_command(series: str) -> str:
    """The one command that runs tests/trl_versions/ under ``series`` (it makes the overlay first if missing)."""
    return f"bash scripts/trl_version.sh {series} -m pytest tests/trl_versions -q"


def require_series(*series: str) -> str:
    """The installed TRL's series when it is one of ``series``, else skip the calling module, naming the command that
    runs it; fail it instead where scripts/trl_version.sh asked for one of ``series`` and another TRL is imported."""
    try:
        import trl
    except ImportError:
        trl = None
    found = ".".join(str(getattr(trl, "__version__", "none")).split(".")[:2])
    asked = os.environ.get(SERIES_ASKED)
    if asked in series and found != asked:
        pytest.fail(f"scripts/trl_version.sh {asked} ran this, but the TRL imported is {found} "
                    f"({getattr(trl, '__file__', None)}): {overlay_of(asked)} is not what Python finds first",
                    pytrace=False)
    if found not in series:
        commands = "; ".join(run_command(s) for s in series)
        pytest.skip(f"needs TRL {' or '.join(series)} (found {found}), each with its release over .venv: {commands} "
                    "(CI's slow step runs them)", allow_module_level=True)
    return found


class LogitsPathCounter:
    """Counts the calls that went to TRL's logits path while it is entered: TRL's full-logits functions in the GRPO
    and RLOO modules (``LOGITS_FUNCTIONS``) and every ``lm_head`` forward over more than one position (generation's
    steps score one position; TRL's method scores the completion)."""

    def __init__(self):
        self.functions = 0
        self.lm_head = 0

    @contextlib.contextmanager
    def counting(self):
        import importlib

        with pytest.MonkeyPatch.context() as mp:
            for name in ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer"):
                module = importlib.import_module(name)
                for fn in LOGITS_FUNCTIONS:
                    if hasattr(module, fn):
                        mp.setattr(module, fn, self._counted(getattr(module, fn)))
            yield self

    def _counted(self, fn):
        def counted(*args, **kwargs):
            self.functions += 1
            return fn(*args, **kwargs)

        return counted

    def hook(self, module, args, output):
        if args and args[0].dim() == 3 and args[0].shape[1] > 1:
            self.lm_head += 1


def train(model_path, tokenizer, tmp_path, patched: bool, trainer: str = "grpo", dtype=torch.float32, **overrides):
    """A few steps of TRL's GRPOTrainer (or RLOOTrainer) with the model in ``dtype``: (log_history, parameters, number
    of grpo_kernels head calls, LogitsPathCounter)."""
    import trl
    from datasets import Dataset

    from .trl_runs import even_words, head_calls, short

    dataset = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10", "w11 w12", "w13"] * 4})
    run = f"{trainer}-{'patched' if patched else 'trl'}-{str(dtype)[6:]}"
    options = dict(output_dir=str(tmp_path / run), per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=6, max_steps=3, learning_rate=3e-2, logging_steps=1, report_to="none",
                   use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True,
                   model_init_kwargs={"dtype": dtype})
    options.update(overrides)
    config_class, trainer_class = ((trl.GRPOConfig, trl.GRPOTrainer) if trainer == "grpo"
                                   else (trl.RLOOConfig, trl.RLOOTrainer))
    counter = LogitsPathCounter()
    with head_calls(patched) as calls:
        built = trainer_class(model=model_path, reward_funcs=[even_words, short], args=config_class(**options),
                              train_dataset=dataset, processing_class=tokenizer)
        for model in (built.model, getattr(built, "ref_model", None)):
            if model is not None:
                model.get_output_embeddings().register_forward_hook(counter.hook)
        with warnings.catch_warnings(), counter.counting():
            warnings.simplefilter("ignore")
            built.train()
    params = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    return built.state.log_history, params, len(calls), counter
