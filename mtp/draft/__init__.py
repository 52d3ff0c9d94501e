"""Draft heads: DeepSeek's MTP modules as speculative drafters (vanilla and eagle modes).

The names below load on first use, so the torch-free `mtp.draft.config` imports without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import DraftConfig
    from .proposer import Proposer

_EXPORTS = {"DraftConfig": "config", "Proposer": "proposer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
