"""Time per optimizer step of TRL's ``SFTTrainer``, stock against ``grpo_kernels.patch_trl()`` (CPU now; the same
file on a GPU).

Both runs train the same saved tiny Llama (hidden 64, 2 layers, an untied head over a V = 8000 word vocabulary, so
that the LM head is a visible part of the step) on the same 64 random 64-token texts, batch 8, AdamW, fp32. The
trainer asks its fused LM head for log-probs, entropies and is_top1 (its ``mean_token_accuracy``); stock, TRL's
``ChunkedLogProbFunction`` serves them (on a CPU its torch tiles), patched, ``linear_token_logprobs`` (on a CPU the
chunked PyTorch path ``head.torch``, on CUDA the Triton kernels). A step is the whole optimizer step: forward,
backward, metrics, optimizer. Runs alternate (stock, patched, stock, patched) so that a busy machine slows both alike;
the median step after the first two of each run is reported in ``extra_info`` (``stock_step_s``,
``patched_step_s``, ``ratio`` = patched / stock). About 40 s on one CPU thread.
"""
from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch

pytest.importorskip("trl")

STEPS = 10       # optimizer steps per run; the first 2 (warm-up, allocator) are not counted
REPEATS = 2      # runs per variant, alternating
VOCAB = 8000
SHAPE = dict(texts=64, words=64, batch=8, hidden=64, layers=2)


def _save_tiny_model(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=SHAPE["hidden"], intermediate_size=2 * SHAPE["hidden"],
                         num_hidden_layers=SHAPE["layers"], num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _texts() -> list[str]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 3, (SHAPE["texts"], SHAPE["words"]), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def _run(model_dir: str, out_dir: str, patched: bool) -> list[float]:
    """Seconds per optimizer step of TRL's SFTTrainer (between on_step_end callbacks)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import grpo_kernels

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter())

    clock = StepClock()
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=SHAPE["batch"], max_steps=STEPS,
                     learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=not torch.cuda.is_available(),
                     bf16=False, seed=0, save_strategy="no", disable_tqdm=True, max_length=SHAPE["words"] + 1,
                     model_init_kwargs={"dtype": torch.float32})
    if patched:
        grpo_kernels.patch_trl()
    try:
        trainer = SFTTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict({"text": _texts()}),
                             processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        grpo_kernels.unpatch_trl()
    return [b - a for a, b in zip(clock.times, clock.times[1:])][1:]


def test_sft_step_stock_vs_patched(benchmark, tmp_path):
    model_dir = str(tmp_path / "tiny")
    _save_tiny_model(model_dir)
    stock, patched = [], []

    def both():
        for i in range(REPEATS):
            stock.extend(_run(model_dir, str(tmp_path / f"stock{i}"), False))
            patched.extend(_run(model_dir, str(tmp_path / f"patched{i}"), True))

    benchmark.pedantic(both, rounds=1, iterations=1)
    stock_s, patched_s = statistics.median(stock), statistics.median(patched)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    benchmark.extra_info.update(path="trl_sft", provider="TRL SFTTrainer, patch_trl() vs stock", mode="train_step",
                                stock_step_s=stock_s, patched_step_s=patched_s, ratio=patched_s / stock_s,
                                device=device, vocab=VOCAB, tokens_per_step=SHAPE["batch"] * SHAPE["words"],
                                threads=torch.get_num_threads(), steps_timed=len(patched))
    print(f"\nSFTTrainer per optimizer step ({device}): stock {stock_s * 1e3:.1f} ms, patch_trl() "
          f"{patched_s * 1e3:.1f} ms, ratio {patched_s / stock_s:.2f}")
    # Not a timing assertion (shared CI machines): only that both ran and were measured.
    assert len(stock) == len(patched) == REPEATS * (STEPS - 2)
