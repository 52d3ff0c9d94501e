"""Draft heads: DeepSeek's MTP modules as speculative drafters (vanilla and eagle modes)."""

from .proposer import DraftConfig, Proposer

__all__ = ["DraftConfig", "Proposer"]
