"""Start-up time, cold and warm: where the seconds before the first token go on the bundled model.

    python -m mtp.bench.startup --json eval/results/startup.json
    python -m mtp.bench.startup --configs fast fast-compile fast-eager reference --mode overlap eager
    python -m mtp.bench.startup --configs fast-eager --no-overlap-cuda-init    # CUDA start timed alone

Each configuration runs in a fresh process twice: cold (empty Triton and TorchInductor caches) and warm (the
caches the cold run filled), as a user's first and second start on one machine (after one throwaway import, so the
OS file cache is warm for every configuration alike). A run reports its phases:
import, CUDA start, load, fast-path set-up, the first generation (Triton JIT compiles, torch.compile of the
elementwise ops where asked, CUDA-graph capture) with its first-token time, and a second, identical generation
(steady state); plus the kernels each cache holds after it (what the cold run compiled), its autotune results
(Triton's `*.autotune.json`) and whether torch._dynamo was imported by the first token (1.4-3.4 s of import when
it is).
CUDA start: by default the loader starts CUDA on a thread while it reads the checkpoint
(`mtp.checkpoint.device_init`), so `load_s` holds what of it did not overlap and `cuda_init_s` is null; with
`--no-overlap-cuda-init` the process makes its first device allocation before the load, timed as `cuda_init_s`
(then the loader's thread finds CUDA up). The overlap's gain is the difference of the two runs' `load_s +
cuda_init_s`.
Configurations: `reference` (PyTorch ops), `fast` (the launcher's default: Triton kernels, the elementwise ops
between them too), `fast-compile` (Triton kernels + torch.compile'd elementwise ops), `fast-eager` (Triton
kernels, elementwise ops eager).
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

CONFIGS = ("reference", "fast", "fast-compile", "fast-eager")
ELEMENTWISE = {"fast": "triton", "fast-compile": "compile", "fast-eager": "eager"}  # enable_fast_path(elementwise=)


def _count(d: Path, pattern: str) -> int:
    return sum(1 for _ in d.rglob(pattern)) if d.is_dir() else 0


def child(config: str, mode: str, tokens: int, ckpt: str | None, overlap_cuda_init: bool = True) -> dict:
    """One start, in this process: phases in seconds since the interpreter began importing this module."""
    t0 = time.perf_counter()
    import torch

    import mtp
    from mtp.checkpoint.tiny import default_checkpoint

    out = {"import_s": time.perf_counter() - t0, "overlap_cuda_init": overlap_cuda_init, "cuda_init_s": None}
    if not overlap_cuda_init:
        t = time.perf_counter()
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        out["cuda_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model = mtp.load_model(ckpt or default_checkpoint(), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if config != "reference":
        from mtp.backends.fast_path import enable_fast_path

        enable_fast_path(model, elementwise=ELEMENTWISE[config])
    out["fast_path_s"] = time.perf_counter() - t
    prompt = [[(7 * i + 3) % model.cfg.vocab_size for i in range(40)]]
    for run in ("first", "second"):
        first: list[float] = []

        def on_step(ev) -> None:
            if not first:
                first.append(time.perf_counter())
                out.setdefault("dynamo_imported", "torch._dynamo" in sys.modules)  # at the first token

        t = time.perf_counter()
        res = mtp.generate(model, prompt, max_new_tokens=tokens, draft="eagle", k=3, mode=mode, on_step=on_step)
        torch.cuda.synchronize()
        out[f"{run}_generate_s"] = time.perf_counter() - t
        out[f"{run}_token_s"] = (first[0] - t) if first else None
        out[f"{run}_tokens"] = len(res.tokens[0])
    out["to_first_token_s"] = (out["import_s"] + (out["cuda_init_s"] or 0) + out["load_s"] + out["fast_path_s"]
                               + (out["first_token_s"] or 0))
    return out


def run(config: str, mode: str, tokens: int, ckpt: str | None, caches: Path, timeout: float,
        overlap_cuda_init: bool = True) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    cmd = [sys.executable, "-m", "mtp.bench.startup", "--child", config, "--mode", mode[0], "--tokens", str(tokens)]
    if ckpt:
        cmd += ["--ckpt", ckpt]
    if not overlap_cuda_init:
        cmd += ["--no-overlap-cuda-init"]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    res["triton_autotune_cached"] = _count(caches / "triton", "*.autotune.json")  # one per autotuned kernel and key
    # a kernel: its .json + __grp__*.json
    res["triton_kernels_cached"] = (_count(caches / "triton", "*.json") - res["triton_autotune_cached"]) // 2
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
    ap.add_argument("--no-overlap-cuda-init", dest="overlap_cuda_init", action="store_false",
                    help="start CUDA before the load, timed alone (default: the loader overlaps it with reading)")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mode[0], args.tokens, args.ckpt, args.overlap_cuda_init)))
        return 0
    # One throwaway import first, so that the first configuration does not alone pay the OS file cache of torch's
    # and Triton's libraries (seen: 4.3-4.6 s of import for the first configuration, 3.0 s for the last); "cold"
    # here means empty Triton / Inductor caches, a machine's second process on.
    from ..kernels import HAS_TRITON

    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, triton, mtp" if HAS_TRITON else "import torch, mtp"],
                   env=dict(os.environ), capture_output=True, text=True, timeout=args.timeout)
    warmup_s = time.perf_counter() - t
    print(f"file-cache warm-up import: {warmup_s:.1f} s", flush=True)
    rows = []
    for mode in args.mode:
        for config in args.configs:
            with tempfile.TemporaryDirectory(prefix="mtp-startup-") as d:
                for state in ("cold", "warm"):
                    r = {"config": config, "mode": mode, "cache": state,
                         **run(config, [mode], args.tokens, args.ckpt, Path(d), args.timeout, args.overlap_cuda_init)}
                    rows.append(r)
                    if "error" in r:
                        print(f"{config:15s} {mode:8s} {state}: FAILED ({r['error']})", flush=True)
                        break
                    cuda = "in load" if r["cuda_init_s"] is None else f"{r['cuda_init_s']:4.1f}"
                    dynamo = {True: "imported", False: "not imported"}.get(r.get("dynamo_imported"), "?")
                    print(f"{config:15s} {mode:8s} {state}: process {r['process_wall_s']:5.1f} s | import "
                          f"{r['import_s']:4.1f} cuda init {cuda} load {r['load_s']:4.1f} fast path "
                          f"{r['fast_path_s']:4.1f} first token {r['first_token_s']:5.1f} first generation "
                          f"{r['first_generate_s']:5.1f} second {r['second_generate_s']:4.2f} s | to first token "
                          f"{r['to_first_token_s']:5.1f} s | torch._dynamo at the first token: {dynamo} | cached: "
                          f"{r['triton_kernels_cached']} Triton kernels, {r['triton_autotune_cached']} autotune "
                          f"results, {r['inductor_files_cached']} Inductor files", flush=True)
    if args.json:
        import torch

        from ..utils import write_json_atomic

        write_json_atomic(args.json, {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                      "torch": torch.__version__, "tokens": args.tokens,
                                      "overlap_cuda_init": args.overlap_cuda_init,
                                      "file_cache_warmup_import_s": warmup_s, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
