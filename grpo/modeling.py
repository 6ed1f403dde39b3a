"""Model and tokenizer: the built-in tiny Llama + character tokenizer, or any local causal-LM checkpoint.

Nothing here downloads: the tiny model is built from a ``LlamaConfig`` and the tokenizer from the ``tokenizers``
library; ``--model PATH`` loads with ``local_files_only=True``.
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from .errors import UsageError

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Attention implementations whose kernels (flash-attn) run only in bfloat16 / float16.
HALF_ONLY_ATTENTION = ("flash_attention_2", "flash_attention_3")


def build_char_tokenizer(alphabet: str):
    """A character-level ``PreTrainedTokenizerFast``: one token per character of ``alphabet`` plus pad/eos/bos/unk.

    It round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any Hub tokenizer, so a
    saved checkpoint of the tiny model is a regular ``--model`` directory. Left padding (decoder-only generation).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
    backend.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")


def build_tiny_model(tokenizer, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     max_positions: int = 128, tie_word_embeddings: bool = False, initializer_range: float = 0.02):
    """A random-init Llama (RMSNorm, SwiGLU, RoPE) sized for a CPU; the caller seeds torch first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise UsageError(f"--hidden-size {hidden_size} must be a multiple of the {num_heads} attention heads")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config)


def run_dtypes(dtype: str, autocast: str, device_type: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) of a run from ``--dtype`` / ``--autocast`` on ``device_type``:
    dtype auto is float32 master weights; autocast auto is bfloat16 on CUDA for float32 weights, else none."""
    param = torch.float32 if dtype == "auto" else DTYPES[dtype]
    if autocast == "auto":
        return param, torch.bfloat16 if device_type == "cuda" and param == torch.float32 else None
    return param, None if autocast == "none" else DTYPES[autocast]


def choose_attn_implementation(requested: str, device: torch.device, compute_dtype: torch.dtype) -> str | None:
    """'auto' -> flash_attention_2 when flash_attn is installed, the run is on CUDA and its forwards run in
    bfloat16 or float16 (``compute_dtype``: the autocast dtype, else the parameter dtype; flash-attn has no float32
    kernels), else None: transformers' default for the model (sdpa where the architecture supports it, eager
    otherwise; Gemma 2's soft-capped attention has no sdpa kernel). An explicit name is returned as given
    (``TrainConfig`` refuses a flash-attn name for a float32 run)."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and compute_dtype in HALF_DTYPES and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return None


def load_pretrained(path: str, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool = False,
                    flag: str = "--model"):
    """(model, tokenizer) from a local checkpoint directory; UsageError when it is not one (naming ``flag``, the
    option that gave the path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r}: not a directory (give a local checkpoint saved with save_pretrained)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path!r}: no config.json in that directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"{flag} {path!r}: cannot load the tokenizer ({type(exc).__name__}: {exc})")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                     attn_implementation=attn_implementation,
                                                     trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"{flag} {path!r}: cannot load the model ({type(exc).__name__}: {exc})")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UsageError(f"{flag} {path!r}: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos plus the generation config's (e.g. <|im_end|>)."""
    ids = []
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for i in (source if isinstance(source, (list, tuple)) else [source]):
            if i is not None and i not in ids:
                ids.append(int(i))
    if not ids:
        raise UsageError("the tokenizer has no eos token: completions could never stop")
    return ids


def disable_dropout(model: nn.Module) -> None:
    """RL on sampled tokens needs the same function at sampling and at training time: no dropout anywhere."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for attr in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(model.config, attr, None), float):
            setattr(model.config, attr, 0.0)


def apply_liger_layers(model, device: torch.device) -> None:
    """Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE on this instance (the LM head stays ours: no Liger loss)."""
    if device.type != "cuda":
        raise UsageError("--liger-layers needs a CUDA GPU (Liger's layer kernels are Triton kernels)")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise UsageError(f"--liger-layers: liger_kernel is not importable ({exc})")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UsageError(f"--liger-layers: Liger has no kernels for model type {model_type!r}")
    _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
