"""mtp: speculative decoding with DeepSeek-V3.2's Multi-Token-Prediction heads."""

from .config import ConfigError, ModelConfig, RuntimeOptions
from .checkpoint import CheckpointError, load_model
from .model import DeepseekV32, ModelOutput

__all__ = ["ConfigError", "CheckpointError", "ModelConfig", "RuntimeOptions", "DeepseekV32", "ModelOutput",
           "load_model"]
