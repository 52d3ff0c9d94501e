"""The reference model: plain PyTorch, float32-capable, runs on CPU. Imports nothing above it (no kernels,
engine or parallel code); backends swap its modules on a loaded model (`mtp.backends`, `mtp.parallel`).

config.py: typed `config.json` and run-time numerics; presets.py: named configs (real, GPU-test, tiny); fp8.py:
DeepSeek's FP8 formulas; layers.py: norms, Linear, MLP, rotary, the elementwise ops; attention.py: MLA +
lightning indexer; moe.py: router and experts; cache.py: the static KV cache; deepseek.py: the target model and
its MTP modules.
"""
