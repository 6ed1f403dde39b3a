"""Standalone GRPO training on top of grpo_kernels: ``python -m grpo.train`` (see grpo/train.py), or from Python
``grpo.train.train(grpo.TrainConfig(...))``.

Modules: config (TrainConfig), cli (flags -> TrainConfig), modeling (tiny model, tokenizer, checkpoint loading),
data (tasks, JSONL, held-out split, sampler), rewards (rule-based and custom rewards), rollout (sampling +
scoring), policy (the DDP-wrapped loss module), update (one optimizer step), evaluation (greedy held-out accuracy),
trainer (the loop), distillation (``--teacher``: the frozen teacher and the distillation term), checkpoint (and run
folders), run_folder (lock, atomic writes), run_settings (what a resume must match), metrics (jsonl, plot,
progress), distributed.

Public helpers for offline experiments (also with TRL): ``char_tokenizer`` (a character-level Hugging Face tokenizer
built locally, nothing downloaded) and ``build_tiny_model`` (a random-init Llama for it).
"""
from .config import TrainConfig

__all__ = ["TrainConfig", "char_tokenizer", "build_tiny_model", "PRINTABLE_ASCII"]


def char_tokenizer(alphabet: str | None = None):
    """An offline character-level ``transformers.PreTrainedTokenizerFast``: one token per character of ``alphabet``
    (default ``PRINTABLE_ASCII``: printable ASCII and newline) after ``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``;
    left padding. Saves and loads like any Hub tokenizer (``save_pretrained`` / ``AutoTokenizer``). Same as
    ``grpo.modeling.build_char_tokenizer(alphabet)``."""
    from .data import PRINTABLE_ASCII
    from .modeling import build_char_tokenizer

    if alphabet is None:
        alphabet = PRINTABLE_ASCII
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
    return build_char_tokenizer(alphabet)


def __getattr__(name):
    # Lazy (PEP 562): `import grpo` must not import transformers.
    if name == "build_tiny_model":
        from .modeling import build_tiny_model
        return build_tiny_model
    if name == "PRINTABLE_ASCII":
        from .data import PRINTABLE_ASCII
        return PRINTABLE_ASCII
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
