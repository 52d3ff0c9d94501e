"""The README's library snippet runs as written (on the bundled model, CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_library_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    snippet = next(b for b in blocks if "mtp.generate(" in b)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {}
        exec(compile(snippet, str(README), "exec"), namespace)
    finally:
        torch.set_num_threads(n)
    out = namespace["out"]
    assert out.tokens[0] and out.metrics.mean_accepted_len >= 1
    assert namespace["tok"].decode(out.tokens[0]) in capsys.readouterr().out
