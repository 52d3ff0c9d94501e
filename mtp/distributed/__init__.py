"""The multi-rank runtime: rank 0 drives, the other ranks serve it (vLLM's executor / worker pattern).

    python -m mtp.distributed.launch CKPT --tp 8 --prompt "..."          # one prompt, no Hydra (spawns the ranks)
    torchrun --nproc-per-node 8 -m mtp.distributed.launch CKPT --prompt ...

Files: group (the data and control groups, the agreement after each phase, teardown), driver (rank 0: spawns or
joins the ranks, loads the shards, `model.peers`), worker (ranks > 0: rank 0's commands in a loop), launch (one
prompt on N ranks). It sits above what it runs: the sharded model (`mtp.parallel`), the fast path
(`mtp.backends`) and the decode engine (`mtp.decode`); the applications (mtp-eval, mtp-chat, mtp-serve) start it.
"""
