"""The two signals a conversion gives its caller: ConversionError (stop) and ConversionWarning (go on)."""

from __future__ import annotations


class ConversionError(ValueError):
    """The source checkpoint or the conversion request cannot be converted; the message says what to fix."""


class ConversionWarning(UserWarning):
    """The conversion succeeded but left something out (for example a tokenizer the source does not ship)."""
