"""Prompts: the built-in verifiable task, JSONL datasets, chat formatting and the per-rank prompt sampler.

A dataset is a list of rows (dicts) with at least ``prompt`` (a string, or a list of chat messages
``{"role", "content"}``) and usually ``answer``; every other field is passed to the reward functions.
"""
from __future__ import annotations

import itertools
import json
import os

import torch

from .errors import UsageError

# The built-in task: copy a short string of letters, e.g. prompt "cab=" -> completion "cab" then EOS.
# A random-init 2-layer model learns it in a few hundred GRPO steps from partial credit (rewards.copy_reward).
COPY_LETTERS = "abcdefgh"
COPY_LENGTHS = (1, 2, 3)
# The built-in character tokenizer's text: printable ASCII (letters, digits, operators, punctuation, space) and
# newline, so a small JSONL of arithmetic or short strings works without a model checkpoint.
PRINTABLE_ASCII = "".join(chr(c) for c in range(32, 127)) + "\n"


def builtin_copy_task(letters: str = COPY_LETTERS, lengths=COPY_LENGTHS) -> list[dict]:
    """Every string of the given lengths over ``letters``: rows {"prompt": "cab=", "answer": "cab"}."""
    rows = []
    for n in lengths:
        for chars in itertools.product(letters, repeat=n):
            s = "".join(chars)
            rows.append({"prompt": s + "=", "answer": s})
    return rows


def balance_copy_lengths(rows: list[dict]) -> list[dict]:
    """Repeat the copy task's shorter strings so that every length is drawn equally often (there are 8x more
    strings of each next length); without it the policy sees mostly 3-letter strings and learns "always 3"."""
    counts: dict[int, int] = {}
    for r in rows:
        counts[len(r["answer"])] = counts.get(len(r["answer"]), 0) + 1
    most = max(counts.values())
    return [r for r in rows for _ in range(max(1, round((most / counts[len(r["answer"])]) ** 0.5)))]


BUILTIN_TASKS = {"copy": builtin_copy_task}
# The characters a built-in task's answers are made of: its default --completion-chars (sampling is restricted to
# them and EOS, in the sampler and in the loss alike).
TASK_COMPLETION_CHARS = {"copy": COPY_LETTERS}
# Applied to the training rows of a built-in task after the held-out split (held-out strings are never trained on).
TRAIN_ROW_WEIGHTING = {"copy": balance_copy_lengths}
EVAL_SPLIT_SEED = 1234  # the held-out rows are a property of the dataset, the same for every --seed


def split_eval(rows: list[dict], eval_size: int | None) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): ``eval_size`` rows drawn with a fixed seed (None: 10% of the rows, at most 128;
    datasets under 10 rows keep everything for training)."""
    if eval_size is None:
        eval_size = min(128, len(rows) // 10)
    if eval_size == 0:
        return rows, []
    if eval_size >= len(rows):
        raise UsageError(f"--eval-size {eval_size} leaves no training rows out of {len(rows)}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED)).tolist()
    held = set(order[:eval_size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def load_jsonl(path: str, require_answer: bool = True, flag: str = "--dataset") -> list[dict]:
    """Rows of a JSONL file; a clear UsageError (file and line) for anything that is not a usable row."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r}: file not found")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: not valid JSON ({exc.msg})")
            if not isinstance(row, dict):
                raise UsageError(f"{where}: expected a JSON object with 'prompt' and 'answer' fields")
            if "prompt" not in row:
                raise UsageError(f"{where}: missing field 'prompt'")
            prompt = row["prompt"]
            if not (isinstance(prompt, str) and prompt) and not _is_messages(prompt):
                raise UsageError(f"{where}: 'prompt' must be a non-empty string or a list of "
                                 "{'role': ..., 'content': ...} messages")
            if require_answer and "answer" not in row:
                raise UsageError(f"{where}: missing field 'answer' (needed by the built-in rewards)")
            rows.append(row)
    if not rows:
        raise UsageError(f"{flag} {path!r}: no rows")
    return rows


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def format_prompt(prompt, tokenizer, use_chat_template: bool, system_prompt: str | None = None) -> str:
    """The text the policy sees. Message lists always go through the chat template; plain strings only when
    ``use_chat_template`` (then wrapped as one user message, after the optional system prompt)."""
    if isinstance(prompt, list):
        messages = list(prompt)
    elif use_chat_template:
        messages = [{"role": "user", "content": prompt}]
    else:
        return prompt if system_prompt is None else f"{system_prompt}\n{prompt}"
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError("the prompts are chat messages (or --chat-template on) but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class PromptSampler:
    """Endless, epoch-shuffled, per-rank stream of row indices.

    Epoch e shuffles all rows with seed (seed, e); rank r of W takes every W-th row of that order, so ranks see
    disjoint prompts. ``state_dict`` / ``load_state_dict`` make a resumed run draw the same prompts.
    """

    def __init__(self, num_rows: int, seed: int, rank: int = 0, world_size: int = 1):
        self.num_rows, self.seed, self.rank, self.world_size = num_rows, seed, rank, world_size
        self.epoch, self.pos = 0, 0
        self._order = self._shard(0)

    def _shard(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_rows, generator=g).tolist()
        return order[self.rank::self.world_size] if self.num_rows >= self.world_size else order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shard(self.epoch)
            take = self._order[self.pos:self.pos + k - len(out)]
            out.extend(take)
            self.pos += len(take)
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._shard(self.epoch)
