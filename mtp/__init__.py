"""mtp: speculative decoding with DeepSeek-V3.2's Multi-Token-Prediction heads.

    model = mtp.load_model(path, device="cuda", dtype=torch.bfloat16)
    out = mtp.generate(model, [prompt_ids], max_new_tokens=128, draft="eagle", k=2, verify="strict")
    out.tokens, out.metrics.mean_accepted_len

The names below load on first use, so `import mtp` (or a torch-free module such as `mtp.spec.options`) does
not import torch.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "checkpoint.files", "load_model": "checkpoint.files",
    "ConfigError": "model.config", "ModelConfig": "model.config", "RuntimeOptions": "model.config",
    "GenerationConfig": "decode.config",
    "Engine": "decode.engine", "GenerateResult": "decode.engine", "StepEvent": "decode.engine",
    "generate": "decode.engine",
    "SpecMetrics": "decode.metrics",
    "DeepseekV32": "model.deepseek", "ModelOutput": "model.deepseek",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    try:  # subpackages, as after `import mtp.<name>`
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
