"""Speculative generation of one prompt on a checkpoint split over N ranks (tensor + expert parallel).

    python -m mtp.distributed.launch CKPT --prompt "Explain MTP." --tp 8 --draft eagle --k 2     # one node: spawns 8
    torchrun --nproc-per-node 8 -m mtp.distributed.launch CKPT --prompt ...                      # or torchrun's ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m mtp.distributed.launch CKPT --prompt ...

NCCL on GPUs (rank r on local GPU r), gloo on CPU. Rank 0 drives (`mtp.distributed.driver`): it checks the
options, the checkpoint's split over the ranks and the tokenizer before any rank starts, tokenizes, and alone
prints; the other ranks serve it. On GPUs the defaults are the overlap scheduler and the Triton fast path
(`--mode`, `--no-fast-path`; `--elementwise` picks its glue ops between the GEMMs); generation stops at the tokenizer's EOS. `--check` compares every rank's tokens
with rank 0's (they must agree: every rank sees identical logits). An error on any rank ends every rank with one
line naming it; exit status 2 for bad input, 1 for a failure while generating.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..checkpoint.files import CheckpointError
from ..draft.modes import DRAFTERS
from ..spec.options import DEFAULT_LOAD_READER, LOAD_READERS, MODES, OptionError
from ..verify.registry import VERIFIER_REGISTRY
from ..model.config import NUMERICS, ConfigError
from ..preflight import PreflightError, preflight
from ..kernels.dispatch import ELEMENTWISE_IMPLS
from ..parallel.comm import ALLREDUCE_IMPLS
from ..parallel.layout import MLP_SPLITS
from ..parallel.memory import DTYPES
from ..placement import AUTO, LAYOUT_CHOICES


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mtp.distributed.launch", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: torchrun's WORLD_SIZE, else 1)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft", choices=DRAFTERS.keys(), default="eagle")  # live: plugins registered before main()
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--verify", choices=VERIFIER_REGISTRY.keys(), default="strict")
    ap.add_argument("--numerics", choices=NUMERICS, default="fp8")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--mlp-split", choices=MLP_SPLITS, default="blocks")
    ap.add_argument("--allreduce", choices=ALLREDUCE_IMPLS, default="nccl",
                    help="the ranks' all-reduce: nccl, or oneshot (NVLink peer memory, fused with the add + norm)")
    ap.add_argument("--expert-layout", choices=LAYOUT_CHOICES, default=AUTO,
                    help="which routed experts each rank holds (mtp/placement.py; auto: split where every rank gets "
                         "whole 128-blocks of each expert, else contiguous); the fast path runs every one")
    ap.add_argument("--load-reader", choices=LOAD_READERS, default=DEFAULT_LOAD_READER,
                    help="how the shards are read: mmap (safetensors' memory map) or pread (large explicit reads)")
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="decode loop (default: overlap on GPUs, eager on CPU)")
    ap.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=None,
                    help="Triton kernels (default: on with CUDA, an FP8 checkpoint, fp8 numerics and triton)")
    ap.add_argument("--elementwise", choices=ELEMENTWISE_IMPLS, default="triton",
                    help="the fast path's elementwise ops between the GEMMs (norms, rotary, SiLU-mul, FP8 quant): "
                         "triton (one Triton kernel each), compile (torch.compile: tens of seconds more start-up), "
                         "eager (the plain PyTorch ops)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill long prompts N tokens at a time")
    ap.add_argument("--check", action="store_true", help="verify that every rank generated the same ids")
    a = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else None
    a.tp = a.tp or world or 1
    if a.tp < 1 or (world is not None and a.tp != world):
        ap.error(f"--tp {a.tp}: expected an integer >= 1" + (f" equal to torchrun's WORLD_SIZE {world}" if world else ""))
    return a


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("RANK", "0") != "0":  # torchrun's ranks > 0 serve rank 0
        from .worker import main as serve

        return serve()
    a = _args(argv)
    prog = "python -m mtp.distributed.launch"
    from .group import RankFailure

    try:
        return _run(a)
    except (ConfigError, CheckpointError, PreflightError, OptionError) as e:  # bad checkpoint or settings
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code


def _run(a: argparse.Namespace) -> int:
    import torch

    import mtp
    from ..decode.config import GenerationConfig

    cuda = torch.cuda.is_available()
    k = 0 if a.draft == "none" else a.k
    mode = a.mode or ("overlap" if cuda else "eager")
    # options, config.json, the split over the ranks and the tokenizer before any rank starts or weight is read
    opts = {"prefill_chunk": a.prefill_chunk} if a.prefill_chunk else {}
    GenerationConfig.from_options(a.max_new_tokens, a.draft, k, a.verify, mode=mode, **opts)
    cfg, tok = preflight(a.checkpoint, draft=a.draft, k=k, tp=a.tp, mlp_split=a.mlp_split, numerics=a.numerics,
                         expert_layout=a.expert_layout)
    fast = a.fast_path if a.fast_path is not None else (cuda and a.numerics == "fp8" and cfg.is_fp8)
    if a.allreduce != "nccl" and (a.tp == 1 or not cuda):
        raise PreflightError(f"--allreduce {a.allreduce} needs --tp > 1 on CUDA GPUs (peer memory); use nccl")
    if fast:
        from ..kernels import available

        if not available():
            if a.fast_path:
                raise PreflightError("--fast-path needs triton and a CUDA device")
            fast = False
    if a.elementwise != "triton" and not fast:
        raise PreflightError(f"--elementwise {a.elementwise} picks the fast path's ops, and it is off here "
                             "(--no-fast-path, no CUDA, or not an FP8 checkpoint with fp8 numerics)")
    dtype = a.dtype or ("bf16" if cuda else "fp32")
    dtype_name = str(DTYPES[dtype]).replace("torch.", "")
    if tok.eos_id is not None:
        opts["eos_id"] = tok.eos_id
    ids = [tok.bos_id] + tok.encode(a.prompt)
    if a.tp == 1:
        model = mtp.load_model(a.checkpoint, device="cuda" if cuda else "cpu", dtype=DTYPES[dtype],
                               numerics=a.numerics, reader=a.load_reader)
        if fast:
            from ..backends.fast_path import enable_fast_path

            enable_fast_path(model, elementwise=a.elementwise)
        peers = None
    else:
        from .driver import LoadSpec, start

        peers = start(a.tp, "cuda" if cuda else "cpu")
        model = peers.load(LoadSpec(str(a.checkpoint), dtype=dtype_name, numerics=a.numerics,
                                    mlp_split=a.mlp_split, expert_layout=a.expert_layout, fast_path=fast,
                                    elementwise=a.elementwise, allreduce=a.allreduce, reader=a.load_reader))
    try:
        out = mtp.generate(model, [ids], max_new_tokens=a.max_new_tokens, draft=a.draft, k=k, verify=a.verify,
                           mode=mode, **opts)
        if a.check and peers is not None:
            peers.check_tokens(out.tokens)
        from ..parallel.load import param_bytes

        print(tok.decode(out.tokens[0]))
        m = out.metrics
        print(f"[world {a.tp}, {param_bytes(model) / 2**30:.2f} GiB params on rank 0] "
              f"{m.new_tokens} tokens, accepted/step {m.mean_accepted_len:.2f}", file=sys.stderr)
    finally:
        if peers is not None:
            peers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
