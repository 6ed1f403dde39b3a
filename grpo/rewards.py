"""Rule-based rewards and the ``--reward`` spec parser.

A reward function follows TRL's convention::

    fn(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float | None]

``completions`` are the texts the policy emitted before its EOS (special tokens are never sampled; nothing is
skipped when decoding). ``columns`` holds every other field of the dataset rows (one list per field, aligned with
``completions``) and ``truncated`` (True where the completion hit the length limit without an EOS).
``None`` means "cannot score this row" (ignored in the weighted sum, as in TRL). Built-ins are named below;
any importable function is accepted as ``package.module:function`` (or ``package.module.function``).
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable

from .errors import UsageError

RewardFn = Callable[..., list]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


# ---------------------------------------------------------------------------------------------- answer parsing
def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def extract_hash_answer(text: str) -> str | None:
    """Text after the last ``####`` (GSM8K's final-answer marker), or None."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip() or None


def extract_last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def parse_number(text: str | None) -> float | None:
    """'1,234' -> 1234.0, '3/4' -> 0.75, '$5.00' -> 5.0, '\\frac{1}{2}' -> 0.5; None when no number is found."""
    if text is None:
        return None
    text = text.replace("\\!", "").replace("$", "").strip()
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    if frac:
        num, den = float(frac.group(2)), float(frac.group(3))
        return (-1.0 if frac.group(1) else 1.0) * num / den if den else None
    found = _NUMBER.findall(text)
    if not found:
        return None
    tok = found[-1].replace(",", "")
    try:
        if "/" in tok:
            num, den = tok.split("/")
            return float(num) / float(den) if float(den) else None
        return float(tok)
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    r"""Final answer of a completion: ``\boxed{}`` first, then ``####``, then the last number."""
    for fn in (extract_boxed, extract_hash_answer, extract_last_number):
        found = fn(text)
        if found is not None:
            return found
    return None


def gold_value(answer) -> float | None:
    """The reference answer as a number; GSM8K-style solutions ('... #### 42') are reduced to their final answer."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    return parse_number(extract_answer(str(answer)))


def _same_number(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


# ---------------------------------------------------------------------------------------------- built-ins
def copy_reward(prompts, completions, answer, truncated=None, **_) -> list[float]:
    """Partial credit for the built-in copy task, with the stop as one more position to get right:
    (characters right in their position + 1 if it stopped with EOS right after len(target) characters)
    / (max(len target, len out) + 1).

    Full credit (1.0) only for the exact string followed by EOS. The denominator also charges for extra characters,
    and stopping early earns nothing, so the policy must learn where to stop. ``truncated`` (one bool per
    completion: no EOS within the length limit) is passed by grpo.train; without it (e.g. from TRL, which does not
    pass it) every completion counts as ended with EOS.
    """
    out = []
    for i, (text, target) in enumerate(zip(completions, answer)):
        target = str(target)
        hits = sum(a == b for a, b in zip(text, target))
        ended = not (truncated is not None and truncated[i])
        out.append((hits + (ended and len(text) == len(target))) / (max(len(target), len(text)) + 1))
    return out


def _marked_answer(text: str) -> str | None:
    found = extract_boxed(text)
    return found if found is not None else extract_hash_answer(text)


def math_reward(prompts, completions, answer, **_) -> list[float | None]:
    r"""1.0 when the completion's final answer (\boxed{}, ####, else last number) equals the reference number;
    a non-numeric reference is compared as text with the boxed / #### answer (else the whole completion)."""
    out = []
    for text, gold in zip(completions, answer):
        ref = gold_value(gold)
        if ref is None:  # non-numeric reference: exact match of the marked answer (else the whole completion)
            gold_text = "" if gold is None else str(gold).strip()
            got = _marked_answer(text) or text.strip()
            out.append(None if not gold_text else float(got == (_marked_answer(gold_text) or gold_text)))
        else:
            out.append(float(_same_number(parse_number(extract_answer(text)), ref)))
    return out


def boxed_reward(prompts, completions, answer, **_) -> list[float]:
    r"""1.0 when the last ``\boxed{}`` holds the reference number (a strict version of ``math``)."""
    return [float(_same_number(parse_number(extract_boxed(t)), gold_value(g))) for t, g in zip(completions, answer)]


def hash_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the text after the last ``####`` is the reference number (GSM8K format)."""
    return [float(_same_number(parse_number(extract_hash_answer(t)), gold_value(g)))
            for t, g in zip(completions, answer)]


def last_number_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the last number in the completion is the reference number."""
    return [float(_same_number(parse_number(extract_last_number(t)), gold_value(g)))
            for t, g in zip(completions, answer)]


def format_reward(prompts, completions, answer=None, **_) -> list[float]:
    r"""Answer format: 1.0 for a final ``\boxed{number}`` or ``#### number``, 0.5 for a completion that ends in a
    number, 0 otherwise (whatever the number is)."""
    out = []
    for text in completions:
        if parse_number(extract_boxed(text)) is not None or parse_number(extract_hash_answer(text)) is not None:
            out.append(1.0)
        elif re.search(r"\d\s*\.?\s*$", text):
            out.append(0.5)
        else:
            out.append(0.0)
    return out


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "copy": copy_reward,
    "math": math_reward,
    "boxed": boxed_reward,
    "hash": hash_reward,
    "last_number": last_number_reward,
    "format": format_reward,
}


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn
    weight: float = 1.0


def import_reward(path: str) -> RewardFn:
    """'pkg.mod:fn' or 'pkg.mod.fn' -> the function, with a clear UsageError on any failure."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UsageError(f"--reward {path!r}: expected a built-in name ({', '.join(BUILTIN_REWARDS)}) "
                         "or an importable 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a usage error here
        raise UsageError(f"--reward {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"--reward {path!r}: module {module_name!r} has no function {attr!r}")
    return fn


def parse_reward_spec(spec: str) -> RewardSpec:
    """'name', 'name=0.5', 'pkg.mod:fn', 'pkg.mod:fn=2' -> RewardSpec."""
    name, sep, weight_text = spec.rpartition("=")
    if not sep:
        name, weight_text = spec, ""
    weight = 1.0
    if weight_text:
        try:
            weight = float(weight_text)
        except ValueError:
            raise UsageError(f"--reward {spec!r}: weight {weight_text!r} is not a number (use NAME=WEIGHT)")
        if not math.isfinite(weight):
            raise UsageError(f"--reward {spec!r}: weight must be finite")
    name = name.strip()
    if not name:
        raise UsageError(f"--reward {spec!r}: missing reward name")
    fn = BUILTIN_REWARDS.get(name) or import_reward(name)
    return RewardSpec(name=name, fn=fn, weight=weight)


def compute_rewards(specs: list[RewardSpec], prompts: list[str], completions: list[str], rows: list[dict],
                    **extra) -> list[list[float]]:
    """(B, R) rewards as nested lists, NaN where a function returned None. ``rows`` are the dataset rows; their
    fields (except ``prompt``) and ``extra`` (e.g. ``truncated``) reach each function as keyword lists."""
    columns: dict[str, list] = {}
    for key in sorted({k for r in rows for k in r}):
        if key != "prompt":
            columns[key] = [r.get(key) for r in rows]
    columns.setdefault("answer", [None] * len(rows))
    columns.update(extra)
    table = []
    for spec in specs:
        values = spec.fn(prompts=prompts, completions=completions, **columns)
        values = list(values)
        if len(values) != len(completions):
            raise RuntimeError(f"reward {spec.name!r} returned {len(values)} values for {len(completions)} completions")
        table.append([float("nan") if v is None else float(v) for v in values])
    return [list(row) for row in zip(*table)]
