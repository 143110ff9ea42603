"""The fidelity target of a mixed-precision search (option ``FidelityTarget``).

A target is the verdict's own pair of thresholds, set higher: ``sqnr`` (dB) for every part judged
by its values and ``agreement`` for every part judged by its decisions (score parts, per-sample
score vectors, dense maps). Written ``"sqnr=20,agreement=0.95"``; a term left out keeps the
verdict's threshold (``FidelityMinSQNR`` / ``FidelityMinAgreement``), so a target never asks for
less than the verdict does without one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from quark_onnx.errors import ConfigError

__all__ = ["FidelityTarget", "parse_target", "with_target"]

_TERMS = {"sqnr": "sqnr_db", "agreement": "agreement"}


@dataclass(frozen=True)
class FidelityTarget:
    """Thresholds a quantized model's parts must meet (None: the verdict's own)."""

    sqnr_db: float | None = None
    agreement: float | None = None

    def thresholds(self, min_sqnr_db: float, min_agreement: float) -> tuple[float, float]:
        """The (SQNR, agreement) thresholds in force: the target's, else the verdict's."""
        sqnr = self.sqnr_db if self.sqnr_db is not None else min_sqnr_db
        agreement = self.agreement if self.agreement is not None else min_agreement
        return sqnr, agreement

    def describe(self) -> str:
        terms = []
        if self.sqnr_db is not None:
            terms.append(f"SQNR >= {self.sqnr_db:g} dB")
        if self.agreement is not None:
            terms.append(f"agreement >= {self.agreement:g}")
        return ", ".join(terms)


def parse_target(text: str) -> FidelityTarget | None:
    """``"sqnr=20,agreement=0.95"`` -> :class:`FidelityTarget`; ``""`` -> None.

    Raises:
        ConfigError: an unknown term, a value that is not a number, an agreement outside [0, 1]
            or an SQNR outside [-200, 200] dB, naming the option and the term.
    """
    text = text.strip()
    if not text:
        return None
    values: dict[str, float] = {}
    for term in text.split(","):
        key, sep, raw = term.partition("=")
        key = key.strip().lower()
        if not sep or key not in _TERMS:
            raise ConfigError(
                f"FidelityTarget={text!r}: term {term.strip()!r} is not 'sqnr=DB' or "
                "'agreement=SHARE' (e.g. 'sqnr=20,agreement=0.95')"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(
                f"FidelityTarget={text!r}: {key}={raw.strip()!r} is not a number"
            ) from None
        low, high = (0.0, 1.0) if key == "agreement" else (-200.0, 200.0)
        if not low <= value <= high:  # NaN fails both
            raise ConfigError(
                f"FidelityTarget={text!r}: {key}={value:g} is outside [{low:g}, {high:g}]"
            )
        values[_TERMS[key]] = value
    return FidelityTarget(**values)


def with_target(options: Any) -> Any:
    """``options`` (:class:`~quark_onnx.config.options.ExtraOptions`) with the verdict's
    thresholds raised to its ``FidelityTarget`` (unchanged without one): with a target, the
    verdict's "faithful" means "meets the target"."""
    target = parse_target(options.FidelityTarget)
    if target is None:
        return options
    sqnr, agreement = target.thresholds(options.FidelityMinSQNR, options.FidelityMinAgreement)
    return dataclasses.replace(options, FidelityMinSQNR=sqnr, FidelityMinAgreement=agreement)
