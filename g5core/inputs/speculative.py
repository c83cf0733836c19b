"""Speculative decoding and multi-token prediction: the ``speculative:`` block of a configuration.

    speculative: {method: mtp, tokens: 1}                       # DeepSeek-V3's MTP, its published acceptance
    speculative: {method: eagle, tokens: 3, acceptance: [0.8, 0.6, 0.4]}
    speculative: {method: draft_model, tokens: 4, draft_model: llama-3.2-1b, mean_accepted: 2.6}
    speculative: {method: ngram, tokens: 3, mean_accepted: 1.7}

A decode step with ``tokens: k`` proposes ``k`` draft tokens per sequence, then one
verification step of the target runs ``k + 1`` query tokens per sequence (the last sampled
token and the ``k`` drafts) against its context. Draft token ``i`` is kept when it and every
draft before it are accepted, so with per-position conditional rates ``a_1 .. a_k`` a step
makes ``1 + sum_i prod_{j <= i} a_j`` tokens on average (the target's own token is always
kept). ``mean_accepted`` gives that mean directly (the EAGLE papers' "average acceptance
length" tau, tokens per step, bonus token included); G5 turns it into one constant rate ``a``
with ``sum_i a^i = mean_accepted - 1``.

Methods and their proposer (the work that makes the drafts, run ``k`` times in sequence):
``mtp`` the target's own extra layer(s) (DeepSeek-V3's MTP module: one decoder layer of the
target, its embedding and LM head shared), ``eagle`` one small decoder layer at the target's
width plus the target's LM head, ``draft_model`` a separate model (``draft_model:`` a
catalog name or file) on the same chips, ``ngram`` prompt lookup on the host (no chip cost).
Published defaults (mtp, eagle): ``g5core/data/speculative/acceptance.json``.
"""
from __future__ import annotations

import functools
import json
import pathlib
from typing import Any, Mapping

import attrs
import numpy as np

from g5core.api.errors import ConfigError, suggest
from g5core.inputs.reading import check_keys

FIELD = "speculative"
METHODS = ("mtp", "eagle", "draft_model", "ngram")
KEYS = ("method", "tokens", "acceptance", "mean_accepted", "draft_model", "layers")
#: the longest draft G5 accepts (frameworks run 1-8; EAGLE trees verify up to ~60 tokens)
MAX_TOKENS = 64
DEFAULTS_FILE = pathlib.Path(__file__).resolve().parent.parent / "data" / "speculative" / "acceptance.json"


@functools.lru_cache(maxsize=1)
def published_defaults() -> dict:
    """The shipped acceptance figures, by method (``acceptance.json``)."""
    data = json.loads(DEFAULTS_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def expected_tokens_per_step(acceptance) -> float:
    """Tokens one verification step keeps per sequence on average: ``1 + sum_i prod_{j<=i} a_j``."""
    total, keep = 1.0, 1.0
    for a in acceptance:
        keep *= a
        total += keep
    return total


def constant_rate(mean_tokens: float, k: int) -> float:
    """The one rate ``a`` with ``1 + a + ... + a^k = mean_tokens`` (bisection; monotone in ``a``)."""
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if expected_tokens_per_step((mid,) * k) < mean_tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def draw_accepted(acceptance, n: int, rng: np.random.Generator) -> np.ndarray:
    """Accepted draft tokens of ``n`` independent verification steps (0 .. k each), drawn with
    ``rng``: draft ``i`` is kept when a uniform draw is below ``a_i`` and every draft before
    it was kept. Tokens made per step are this plus one."""
    a = np.asarray(acceptance, dtype=float)
    if not len(a):
        return np.zeros(n, dtype=np.int64)
    hits = rng.random((n, len(a))) < a
    return np.cumprod(hits, axis=1).sum(axis=1)


@attrs.frozen(kw_only=True)
class Speculative:
    """A validated ``speculative:`` block. ``acceptance`` has one rate per draft position."""

    method: str
    tokens: int
    acceptance: tuple[float, ...]
    draft_model: str = ""
    layers: int = 1          # MTP modules (DeepSeek-V3: 1) or EAGLE decoder layers (1)
    source: str = ""         # where the acceptance came from: "configuration" or the default's citation
    given: tuple[tuple[str, Any], ...] = attrs.field(default=(), eq=False)  # the keys as written (the echo)

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    @property
    def tokens_per_step(self) -> float:
        """Expected tokens one verification step makes per sequence (1 .. k + 1)."""
        return expected_tokens_per_step(self.acceptance)

    @property
    def mean_accepted_drafts(self) -> float:
        return self.tokens_per_step - 1.0

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Tokens made by each of ``n`` verification steps (1 .. k + 1), drawn with ``rng``."""
        return draw_accepted(self.acceptance, n, rng) + 1

    def to_dict(self) -> dict:
        return dict(self.given)

    @classmethod
    def from_dict(cls, data: Any, field: str = FIELD) -> "Speculative":
        if not isinstance(data, Mapping):
            raise ConfigError(field, f"must be a mapping like {{method: mtp, tokens: 1}}, got {data!r}")
        check_keys(data, field, KEYS, ("method", "tokens"), missing="is required (e.g. speculative: {method: mtp, "
                                                                     "tokens: 1})")
        method = data["method"]
        if method not in METHODS:
            raise ConfigError(f"{field}.method", f"unknown method {method!r}{suggest(str(method), METHODS)}; "
                                                 f"use one of {', '.join(METHODS)}")
        k = data["tokens"]
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOKENS:
            raise ConfigError(f"{field}.tokens", f"must be a whole number 0..{MAX_TOKENS} (draft tokens per step; "
                                                 f"0 is plain decode), got {k!r}")
        layers = data.get("layers", 1)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ConfigError(f"{field}.layers", f"must be a positive whole number (the proposer's decoder layers), "
                                                 f"got {layers!r}")
        if "layers" in data and method not in ("mtp", "eagle"):
            raise ConfigError(f"{field}.layers", f"applies to mtp and eagle only; remove it for {method}")
        draft = data.get("draft_model", "")
        if method == "draft_model":
            if not isinstance(draft, str) or not draft:
                raise ConfigError(f"{field}.draft_model", "is required for method draft_model: a catalog model name "
                                                          "or a model file (e.g. draft_model: llama-3.2-1b)")
        elif "draft_model" in data:
            raise ConfigError(f"{field}.draft_model", f"applies to method draft_model only; remove it for {method}")
        acceptance, source = _acceptance(data, field, method, k)
        return cls(method=method, tokens=k, acceptance=acceptance, draft_model=draft, layers=layers, source=source,
                   given=tuple(data.items()))


def _acceptance(data: Mapping, field: str, method: str, k: int) -> tuple[tuple[float, ...], str]:
    if "acceptance" in data and "mean_accepted" in data:
        raise ConfigError(f"{field}.mean_accepted", "give acceptance (per-position rates) or mean_accepted "
                                                    "(tokens per step), not both")
    if "acceptance" in data:
        rates = data["acceptance"]
        if isinstance(rates, (int, float)) and not isinstance(rates, bool):
            rates = [rates] * k
        if not isinstance(rates, (list, tuple)) or len(rates) != k:
            raise ConfigError(f"{field}.acceptance", f"must list one rate per draft token ({k}), e.g. "
                                                     f"{[0.8] * max(k, 1)}, or be one rate for all; got {rates!r}")
        for i, a in enumerate(rates):
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
                raise ConfigError(f"{field}.acceptance.{i}", f"must be a rate in 0..1, got {a!r}")
        return tuple(float(a) for a in rates), "configuration"
    if "mean_accepted" in data:
        x = data["mean_accepted"]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 1.0 <= x <= k + 1:
            raise ConfigError(f"{field}.mean_accepted", f"must be the mean tokens per step, 1..{k + 1} (tokens + 1), "
                                                        f"got {x!r}")
        if k == 0:
            return (), "configuration"
        return (constant_rate(float(x), k),) * k, "configuration"
    if k == 0:
        return (), ""
    known = published_defaults().get(method)
    if known is None:
        raise ConfigError(f"{field}.acceptance", f"is required for method {method} (no published default ships): "
                                                 f"give acceptance: [rates] or mean_accepted: tokens per step")
    rates = list(known["acceptance"])
    if len(rates) < k:
        raise ConfigError(f"{field}.acceptance", f"the published {method} figure covers {len(rates)} draft token(s) "
                                                 f"({known['source'].split(',')[0]}); for tokens: {k} give acceptance "
                                                 f"or mean_accepted")
    return tuple(float(a) for a in rates[:k]), known["source"]


def parse_speculative(data: Mapping) -> Speculative | None:
    """The configuration's ``speculative:`` block, validated; None where it has none."""
    if FIELD not in data or data[FIELD] is None:
        return None
    return Speculative.from_dict(data[FIELD])


def draft_block(block: Mapping | None, method: str, k: int, field: str = FIELD) -> dict:
    """The ``speculative:`` block of ``method`` with ``k`` draft tokens, validated: the
    configuration's ``block`` where it names that method (its other keys, and the first
    ``k`` of its per-position rates: its ``acceptance`` list, or the constant rate its
    ``mean_accepted`` implies, given for its own ``tokens``), else the method's published
    default (:func:`published_defaults`). Neither: a :class:`ConfigError` naming
    ``speculative.acceptance``."""
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(field, f"must be a mapping like {{method: mtp, tokens: 1}}, got {block!r}")
    if block is None or block.get("method") != method:
        out = {"method": method, "tokens": k}
    else:
        out = {key: v for key, v in block.items() if key not in ("tokens", "acceptance", "mean_accepted")}
        out["tokens"] = k
        if "acceptance" in block or "mean_accepted" in block:
            given = Speculative.from_dict(block, field)
            if k > len(given.acceptance):
                raise ConfigError(f"{field}.acceptance", f"gives rates for {len(given.acceptance)} draft token(s); "
                                                         f"{k} drafts need {k}: list them (or mean_accepted at "
                                                         f"tokens: {k})")
            out["acceptance"] = list(given.acceptance[:k])
    Speculative.from_dict(out, field)
    return out


def search_blocks(text: str, block: Mapping | None, flag: str = "--speculative") -> tuple[dict | None, ...]:
    """The ``speculative:`` blocks ``g5 best --serve --speculative off,eagle:1,eagle:3`` tries,
    in order, repeats dropped: ``off`` (or ``METHOD:0``) is plain decode (None), ``METHOD:K``
    that method with ``K`` drafts, ``K`` alone the configuration's method (its ``block``);
    each block's acceptance as :func:`draft_block` gives it."""
    out: list = []
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        if item == "off":
            choice = None
        else:
            method, _, k = item.rpartition(":")
            if not k.isdigit():
                raise ConfigError(flag, f"{item!r}: give off, METHOD:K (e.g. eagle:3) or K, the draft tokens of the "
                                        f"configuration's method")
            if not method:
                if not isinstance(block, Mapping) or "method" not in block:
                    raise ConfigError(flag, f"{item!r} alone names the configuration's method, and it has no "
                                            f"speculative block: write METHOD:{k} (e.g. eagle:{k})")
                method = block["method"]
            if method not in METHODS:
                raise ConfigError(flag, f"unknown method {method!r}{suggest(method, METHODS)}; use one of "
                                        f"{', '.join(METHODS)}")
            choice = None if int(k) == 0 else draft_block(block, method, int(k))
        if choice not in out:
            out.append(choice)
    if not out:
        raise ConfigError(flag, "is empty: give off, METHOD:K or K, comma-separated (e.g. off,eagle:1,eagle:3)")
    return tuple(out)


def speculative_variants(block: Mapping | None, tokens=(0, 1, 2, 3, 4)) -> list[dict | None]:
    """The ``speculative:`` blocks a search tries for one method: ``None`` (plain decode) and
    ``block`` at each draft length of ``tokens`` (0: the same as None, left out), each as
    :func:`draft_block` gives it; a ``k`` it refuses (longer than the block's rates, or an
    MTP default beyond its published token) is left out."""
    out: list[dict | None] = [None]
    if block is None:
        return out
    Speculative.from_dict(block)
    for k in tokens:
        if k == 0:
            continue
        try:
            out.append(draft_block(block, block["method"], k))
        except ConfigError:
            continue
    return out
