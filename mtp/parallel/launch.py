"""torchrun entry: load a checkpoint sharded over all ranks and run speculative generation on every rank.

    torchrun --nproc-per-node 8 -m mtp.parallel.launch CKPT --prompt "Explain MTP." --draft eagle --k 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        -m mtp.parallel.launch CKPT --prompt ...

NCCL on GPUs (one per local rank), gloo on CPU. Rank 0 does the I/O: it tokenizes the prompt and broadcasts
the ids, and it alone prints. On GPUs the defaults are the overlap scheduler and the Triton fast path
(`--mode`, `--no-fast-path`); generation stops at the tokenizer's EOS. Every rank runs the same `mtp.generate` call; `--check` all-gathers the
generated ids and fails if any rank disagrees (they must not: every rank sees identical logits).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..checkpoint.files import CheckpointError
from ..decode.engine import generate, release
from ..decode.options import DRAFTS, MODES, VERIFIERS
from ..model.config import NUMERICS, ConfigError
from ..preflight import PreflightError, preflight
from .comm import Comm, init_process_group
from .layout import MLP_SPLITS, ParallelPlan
from .load import load_parallel, param_bytes
from .memory import DTYPES


def init_distributed() -> tuple[Comm, torch.device]:
    """Process group from torchrun's environment; NCCL with one GPU per local rank when CUDA is there."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        init_process_group("gloo")
    return Comm(), device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.parallel.launch", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft", choices=DRAFTS, default="eagle")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--verify", choices=VERIFIERS, default="strict")
    ap.add_argument("--numerics", choices=NUMERICS, default="fp8")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--mlp-split", choices=MLP_SPLITS, default="blocks")
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="decode loop (default: overlap on GPUs, eager on CPU)")
    ap.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=None,
                    help="Triton kernels (default: on with CUDA, an FP8 checkpoint, fp8 numerics and triton)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill long prompts N tokens at a time")
    ap.add_argument("--check", action="store_true", help="verify that every rank generated the same ids")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except (ConfigError, CheckpointError, PreflightError) as e:  # bad checkpoint or settings: one line per rank
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    k = 0 if a.draft == "none" else a.k
    # config.json, the draft settings and the tokenizer before the process group and any weight; every rank
    # loads the tokenizer (the stop token must be the same everywhere)
    _, tok = preflight(a.checkpoint, draft=a.draft, k=k)
    comm, device = init_distributed()
    try:
        dtype = DTYPES[a.dtype] if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        ids = [[tok.bos_id] + tok.encode(a.prompt)] if comm.rank == 0 else [None]
        dist.broadcast_object_list(ids, src=0)
        model = load_parallel(a.checkpoint, comm, plan=ParallelPlan(comm.world, a.mlp_split), device=device,
                              dtype=dtype, numerics=a.numerics)
        mode = a.mode or ("overlap" if device.type == "cuda" else "eager")
        if a.fast_path or (a.fast_path is None and device.type == "cuda" and a.numerics == "fp8"
                           and model.cfg.is_fp8):
            from ..backends.fast_path import enable_fast_path
            from ..kernels import available

            if available():
                enable_fast_path(model)
            elif a.fast_path:
                raise SystemExit("--fast-path needs triton and a CUDA device")
        opts = {"prefill_chunk": a.prefill_chunk} if a.prefill_chunk else {}
        if tok.eos_id is not None:
            opts["eos_id"] = tok.eos_id
        out = generate(model, [ids[0]], max_new_tokens=a.max_new_tokens, draft=a.draft, k=k, verify=a.verify,
                       mode=mode, **opts)
        if a.check:
            every = [None] * comm.world
            dist.all_gather_object(every, out.tokens)
            if any(t != every[0] for t in every):
                bad = [r for r, t in enumerate(every) if t != every[0]]
                raise RuntimeError(f"ranks {bad} generated different tokens than rank 0")
        if comm.rank == 0:
            print(tok.decode(out.tokens[0]))
            m = out.metrics
            print(f"[world {comm.world}, {param_bytes(model) / 2**30:.2f} GiB params on rank 0] "
                  f"{m.new_tokens} tokens, accepted/step {m.mean_accepted_len:.2f}", file=sys.stderr)
    finally:
        release()  # kept graphs with NCCL collectives in them must go before the process group
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
