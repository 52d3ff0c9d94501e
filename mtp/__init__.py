"""mtp: speculative decoding with DeepSeek-V3.2's Multi-Token-Prediction heads.

    model = mtp.load_model(path, device="cuda", dtype=torch.bfloat16)
    out = mtp.generate(model, [prompt_ids], max_new_tokens=128, draft="eagle", k=2, verify="strict")
    out.tokens, out.metrics.mean_accepted_len
"""

from .checkpoint.files import CheckpointError, load_model
from .model.config import ConfigError, ModelConfig, RuntimeOptions
from .decode.engine import Engine, GenerateResult, GenerationConfig, StepEvent, generate
from .decode.metrics import SpecMetrics
from .model.deepseek import DeepseekV32, ModelOutput

__all__ = ["CheckpointError", "ConfigError", "DeepseekV32", "Engine", "GenerateResult", "GenerationConfig",
           "ModelConfig", "ModelOutput", "RuntimeOptions", "SpecMetrics", "StepEvent", "generate", "load_model"]
