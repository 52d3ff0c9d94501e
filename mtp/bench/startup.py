"""Start-up time, cold and warm: where the seconds before the first token go on the bundled model.

    python -m mtp.bench.startup --json eval/results/startup.json
    python -m mtp.bench.startup --configs fast fast-nocompile reference --mode overlap eager

Each configuration runs in a fresh process twice: cold (empty Triton and TorchInductor caches) and warm (the
caches the cold run filled), as a user's first and second start on one machine. A run reports its phases:
import, load, fast-path set-up, the first generation (Triton JIT compiles, torch.compile of the elementwise ops,
CUDA-graph capture) with its first-token time, and a second, identical generation (steady state); plus the
kernels each cache holds after it (what the cold run compiled).
Configurations: `reference` (PyTorch ops), `fast-nocompile` (Triton kernels, elementwise ops eager), `fast` (the
launcher's default: Triton kernels + torch.compile'd elementwise ops).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("reference", "fast-nocompile", "fast")


def _count(d: Path, pattern: str) -> int:
    return sum(1 for _ in d.rglob(pattern)) if d.is_dir() else 0


def child(config: str, mode: str, tokens: int, ckpt: str | None) -> dict:
    """One start, in this process: phases in seconds since the interpreter began importing this module."""
    t0 = time.perf_counter()
    import torch

    import mtp
    from mtp.checkpoint.tiny import default_checkpoint

    out = {"import_s": time.perf_counter() - t0}
    t = time.perf_counter()
    model = mtp.load_model(ckpt or default_checkpoint(), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if config != "reference":
        from mtp.backends.fast_path import enable_fast_path

        enable_fast_path(model, compile_elementwise=config == "fast")
    out["fast_path_s"] = time.perf_counter() - t
    prompt = [[(7 * i + 3) % model.cfg.vocab_size for i in range(40)]]
    for run in ("first", "second"):
        first: list[float] = []
        t = time.perf_counter()
        res = mtp.generate(model, prompt, max_new_tokens=tokens, draft="eagle", k=3, mode=mode,
                           on_step=lambda ev: first or first.append(time.perf_counter()))
        torch.cuda.synchronize()
        out[f"{run}_generate_s"] = time.perf_counter() - t
        out[f"{run}_token_s"] = (first[0] - t) if first else None
        out[f"{run}_tokens"] = len(res.tokens[0])
    out["to_first_token_s"] = out["import_s"] + out["load_s"] + out["fast_path_s"] + (out["first_token_s"] or 0)
    return out


def run(config: str, mode: str, tokens: int, ckpt: str | None, caches: Path, timeout: float) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    cmd = [sys.executable, "-m", "mtp.bench.startup", "--child", config, "--mode", mode[0], "--tokens", str(tokens)]
    if ckpt:
        cmd += ["--ckpt", ckpt]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    res["triton_kernels_cached"] = _count(caches / "triton", "*.json") // 2  # a kernel: its .json + __grp__*.json
    res["inductor_files_cached"] = _count(caches / "inductor", "*.py")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--mode", nargs="+", choices=("eager", "graph", "overlap"), default=["overlap"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--ckpt", default=None, help="default: the bundled model")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per start")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mode[0], args.tokens, args.ckpt)))
        return 0
    rows = []
    for mode in args.mode:
        for config in args.configs:
            with tempfile.TemporaryDirectory(prefix="mtp-startup-") as d:
                for state in ("cold", "warm"):
                    r = {"config": config, "mode": mode, "cache": state,
                         **run(config, [mode], args.tokens, args.ckpt, Path(d), args.timeout)}
                    rows.append(r)
                    if "error" in r:
                        print(f"{config:15s} {mode:8s} {state}: FAILED ({r['error']})", flush=True)
                        break
                    print(f"{config:15s} {mode:8s} {state}: process {r['process_wall_s']:5.1f} s | import "
                          f"{r['import_s']:4.1f} load {r['load_s']:4.1f} fast path {r['fast_path_s']:4.1f} first "
                          f"token {r['first_token_s']:5.1f} first generation {r['first_generate_s']:5.1f} second "
                          f"{r['second_generate_s']:4.2f} s | to first token {r['to_first_token_s']:5.1f} s | "
                          f"cached: {r['triton_kernels_cached']} Triton kernels, {r['inductor_files_cached']} "
                          "Inductor files", flush=True)
    if args.json:
        import torch

        from ..utils import write_json_atomic

        write_json_atomic(args.json, {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                      "torch": torch.__version__, "tokens": args.tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
