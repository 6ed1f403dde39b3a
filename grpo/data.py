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


def prompt_key(prompt) -> str:
    """A hashable identity of a prompt (a string, or a list of chat messages), for comparing prompts."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def split_eval(rows: list[dict], eval_size: int | None) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) over *distinct prompts*: ``eval_size`` prompts drawn with a fixed seed (None: 10%
    of the distinct prompts, at most 128; datasets under 10 prompts keep everything for training).

    Every row whose prompt is held out leaves the training rows, so a file with duplicate rows cannot put a held-out
    prompt into training; the held-out rows are the first row of each held-out prompt (a greedy completion of the
    same prompt twice would only count it twice)."""
    first: dict[str, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(prompt_key(r["prompt"]), i)
    distinct = list(first.values())  # index of each prompt's first row, in file order
    if eval_size is None:
        eval_size = min(128, len(distinct) // 10)
    if eval_size == 0:
        return rows, []
    if eval_size >= len(distinct):
        raise UsageError(f"--eval-size {eval_size} leaves no training prompts: the data has {len(distinct)} distinct "
                         f"prompts ({len(rows)} rows)")
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED)).tolist()
    held = sorted(distinct[j] for j in order[:eval_size])
    held_keys = {prompt_key(rows[i]["prompt"]) for i in held}
    return [r for r in rows if prompt_key(r["prompt"]) not in held_keys], [rows[i] for i in held]


def training_overlap(train_rows: list[dict], eval_rows: list[dict]) -> int:
    """How many distinct evaluation prompts also occur among the training prompts (0: a held-out set)."""
    train_keys = {prompt_key(r["prompt"]) for r in train_rows}
    return len({prompt_key(r["prompt"]) for r in eval_rows} & train_keys)


class Row(dict):
    """A dataset row (a plain dict to the reward functions) that remembers where it came from, ``file:line``, so
    that a check made long after loading (the prompt's length in tokens) can name the line."""

    __slots__ = ("where",)

    def __init__(self, values=(), where: str | None = None):
        super().__init__(values)
        self.where = where


def row_location(row: dict, index: int, flag: str) -> str:
    return getattr(row, "where", None) or f"{flag} row {index + 1}"


def load_jsonl(path: str, require_answer: bool = True, flag: str = "--dataset") -> list[dict]:
    """Rows of a UTF-8 JSONL file (a leading byte-order mark is allowed); a clear UsageError (file and line) for
    anything that is not a usable row, bytes that are not UTF-8 included."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r}: file not found")
    rows = []
    with open(path, "rb") as f:  # bytes: a decoding error can then name its line, not only a byte offset
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
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
            rows.append(Row(row, where))
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


def context_length(lm, tokenizer) -> int | None:
    """The number of positions the model was built for (prompt and completion together), or None when neither the
    model config nor the tokenizer states one."""
    config = getattr(lm, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**8 else None  # transformers' "no limit" is ~1e30


def fit_prompts(texts: list[str], rows: list[dict], tokenizer, *, context: int | None, max_new_tokens: int,
                max_prompt_length: int | None, truncate: str | None, add_special_tokens: bool,
                flag: str = "--dataset") -> tuple[list[str], int]:
    """(texts, number truncated): every prompt, as tokenized for sampling, must leave ``max_new_tokens`` positions of
    the model's ``context``. A longer one is a UsageError naming its row and the lengths, unless ``truncate`` is
    "left" (drop the prompt's beginning, keep its end, where a chat template puts the generation prompt) or "right"
    (keep the beginning). Prompts the sampler cuts to ``max_prompt_length`` tokens anyway count with that length.

    Why refuse: positions past the context are not an error for the model (rotary embeddings extrapolate), only
    garbage that costs the square of the length in attention, so an over-long row would silently slow every step
    it is drawn in and train on noise."""
    if context is None or not texts:
        return list(texts), 0
    if max_new_tokens >= context:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                         f"{context} tokens")
    limit = context - max_new_tokens
    lengths = [len(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]
    effective = [min(n, max_prompt_length) if max_prompt_length else n for n in lengths]
    over = [i for i, n in enumerate(effective) if n > limit]
    if not over:
        return list(texts), 0
    if truncate is None:
        i = over[0]
        more = f" ({len(over) - 1} more rows too long)" if len(over) > 1 else ""
        raise UsageError(f"{row_location(rows[i], i, flag)}: the prompt is {effective[i]} tokens; with "
                         f"--max-new-tokens {max_new_tokens} that is {effective[i] + max_new_tokens} > the model's "
                         f"context of {context} tokens{more}; use --truncate-prompts left|right, --max-prompt-length "
                         "or a smaller --max-new-tokens")
    out = list(texts)
    for i in over:
        out[i] = _truncate_text(out[i], tokenizer, limit, truncate, add_special_tokens)
    return out, len(over)


def fit_to_context(cfg, lm, tokenizer, add_special_tokens: bool, train_texts: list[str], train_rows: list[dict],
                   eval_texts: list[str], eval_rows: list[dict], verbose: bool = True) -> tuple[list[str], list[str]]:
    """``fit_prompts`` for the training and the evaluation prompts of a run (``cfg``: its TrainConfig), with one
    line saying how many prompts ``--truncate-prompts`` cut."""
    common = dict(tokenizer=tokenizer, context=context_length(lm, tokenizer), max_new_tokens=cfg.max_new_tokens,
                  max_prompt_length=cfg.max_prompt_length, truncate=cfg.truncate_prompts,
                  add_special_tokens=add_special_tokens)
    flag = "--dataset" if cfg.dataset is not None else f"--task {cfg.task}"
    train_texts, cut = fit_prompts(train_texts, train_rows, flag=flag, **common)
    eval_flag = "--eval-dataset" if cfg.eval_dataset is not None else flag
    eval_texts, eval_cut = fit_prompts(eval_texts, eval_rows, flag=eval_flag, **common)
    if verbose and cut + eval_cut:
        print(f"[grpo.train] --truncate-prompts {cfg.truncate_prompts}: cut {cut} training and {eval_cut} evaluation "
              f"prompts to {common['context'] - cfg.max_new_tokens} tokens (the context of "
              f"{common['context']} minus --max-new-tokens {cfg.max_new_tokens})", flush=True)
    return train_texts, eval_texts


def _truncate_text(text: str, tokenizer, limit: int, side: str, add_special_tokens: bool) -> str:
    """``text`` cut at a token boundary so that it tokenizes to at most ``limit`` tokens (the special tokens the
    tokenizer adds included). Cutting text, not ids, keeps prompts as strings for the rewards; re-tokenizing a cut
    text can merge differently at the cut, hence the loop."""
    for _ in range(8):
        total = len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        if total <= limit:
            return text
        content = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = max(1, limit - (total - len(content)))
        try:
            spans = [s for s in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                     ["offset_mapping"] if s[1] > s[0]]
        except (NotImplementedError, ValueError):  # slow tokenizers have no offsets: decode the kept ids instead
            text = tokenizer.decode(content[-keep:] if side == "left" else content[:keep], skip_special_tokens=False)
            continue
        if len(spans) <= keep:
            break
        text = text[spans[-keep][0]:] if side == "left" else text[:spans[keep - 1][1]]
    total = len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if total > limit:
        raise UsageError(f"--truncate-prompts {side}: cannot cut a prompt to {limit} tokens (still {total})")
    return text


def check_completion_chars(chars: str | None, tokenizer, vocab_size: int, banned: list[int],
                           builtin: bool) -> None:
    """Refuse ``--completion-chars`` with characters that no allowed token produces: they could never be sampled,
    and a task that needs them would train at reward 0. ``banned`` are the ids the sampler never draws (with
    ``chars`` given: every token with another character), so only the few allowed tokens are decoded."""
    if chars is None:
        return
    banned_set, covered = set(banned), set()
    for i in range(min(len(tokenizer), vocab_size)):
        if i not in banned_set:
            # Twice in a row too: SentencePiece-style decoders drop a token's leading space ("▁1" -> "1") only at
            # the start of a text, so the space such a token brings mid-completion shows only after another token.
            covered.update(tokenizer.decode([i, i], skip_special_tokens=True))
    unknown = sorted(set(chars) - covered)
    if unknown:
        what = "the built-in character tokenizer (printable ASCII and newline)" if builtin else "the tokenizer"
        hint = "; pass --model PATH for other text" if builtin else ""
        raise UsageError(f"--completion-chars uses characters {''.join(unknown[:20])!r} that {what} has no token for "
                         f"(completions could never contain them){hint}")


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
