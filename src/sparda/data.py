"""The bundled public-domain text: six Jane Austen novels.

Source: Debian package ``r-cran-janeaustenr`` 1.0.0-1 (the R package janeaustenr, MIT
licence; the novels themselves are in the public domain, from Project Gutenberg),
exported line by line and gzip-compressed into ``sparda/assets/text``.

Split: ``emma`` is held out (evaluation, passkey haystacks, selection reports); the
other five are the Forecast training corpus and never mix with it.
"""

from __future__ import annotations

import gzip
from importlib import resources

from sparda.errors import SpardaError

TRAIN_TEXTS = ("prideprejudice", "sensesensibility", "mansfieldpark", "northangerabbey", "persuasion")
HELDOUT_TEXTS = ("emma",)


def bundled_text(name: str) -> str:
    """The full text of one bundled novel (UTF-8 ``str``). Raises SpardaError if unknown."""
    if name not in TRAIN_TEXTS + HELDOUT_TEXTS:
        raise SpardaError(f"unknown bundled text {name!r}; choose one of {', '.join(TRAIN_TEXTS + HELDOUT_TEXTS)}")
    path = resources.files("sparda") / "assets" / "text" / f"{name}.txt.gz"
    with path.open("rb") as handle:
        return gzip.decompress(handle.read()).decode("utf-8")


def heldout_text() -> str:
    """The held-out split (Emma), never read by Forecast training."""
    return "\n".join(bundled_text(n) for n in HELDOUT_TEXTS)


def train_texts() -> list[str]:
    """The training split: one string per novel."""
    return [bundled_text(n) for n in TRAIN_TEXTS]
