"""Loading at scale, measured: write a real-width DeepSeek-V3.2 checkpoint of a few layers to local disk, then
load it the way `runtime.tp=N` does (rank 0 spawns N-1 ranks, each reads only its slices) once per shard reader
(`--loader mmap pread`: `mtp.spec.options.LOAD_READERS`) and hold the per-rank and per-node load rates against the
disk's raw sequential read rate, measured on the same files in the same call.

    python -m mtp.bench.load write /scratch/dsv32-4l --moe-layers 3        # 1 dense + 3 MoE + 1 MTP: ~52 GB
    python -m mtp.bench.load measure /scratch/dsv32-4l --tp 2 --loader mmap pread --json eval/results/load_tp2.json

The JSON holds every raw read (`raw`) and, per loader, its load (`loads[loader]`: `load` the `Peers.load` report,
`node_vs_raw`, `extrapolated_690gb`); with `--repeats N` each is measured N times (raw reads, then each loader, in
turn) and the run of median node rate is the one reported.

The page cache is emptied of the checkpoint's files (posix_fadvise DONTNEED after fsync: no root needed) before
every read, and each rank reports the bytes it read from storage (`/proc/self/io`), so a rate that came from
memory shows as such. The weights are random (seeded per tensor), in the real format: FP8 e4m3 with 128 x 128
float32 block scales, bf16 norms / embeddings / head, the real tensor names and shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from ..spec.options import DEFAULT_LOAD_READER, LOAD_READERS

GB = 1e9


def evict(files: list[Path]) -> None:
    """Drop `files` from the page cache (clean pages only: fsync first when just written)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shard_files(path: Path) -> list[Path]:
    from ..checkpoint.files import weight_map

    return [path / f for f in sorted(set(weight_map(path).values()))]


# ------------------------------------------------------------------------------------------------ writing
def plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names in checkpoint order, cut into shards of about `shard_bytes` (a tensor is never split)."""
    shards: list[list[str]] = [[]]
    acc = 0
    for name, n in sizes.items():
        if shards[-1] and acc + n > shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += n
    return shards


def write(out: Path, cfg, seed: int, shard_gb: float, device: str) -> dict:
    """Write the checkpoint shard by shard (one shard's tensors in memory at a time) into a temp folder beside
    `out`, then rename it into place (a crash leaves no half-written checkpoint under `out`)."""
    from safetensors.torch import save_file

    from ..checkpoint.files import INDEX_NAME
    from ..checkpoint.inventory import checkpoint_spec
    from ..checkpoint.random_weights import random_tensor
    from ..utils import publish_dir

    spec = checkpoint_spec(cfg)
    sizes = tensor_bytes(spec)
    total = sum(sizes.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total * 1.02:
        raise SystemExit(f"mtp.bench.load write: {out.parent} has {free / GB:.1f} GB free, the checkpoint needs "
                         f"{total / GB:.1f} GB (lower --moe-layers)")
    shards = plan_shards(sizes, int(shard_gb * GB))
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-ckpt-", dir=out.parent))
    t0, wm, files = time.perf_counter(), {}, []
    try:
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors"
            tensors = {n: random_tensor(cfg, n, seed, device, spec).cpu() for n in names}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
            fd = os.open(tmp / fname, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            files.append(tmp / fname)
            evict([tmp / fname])
            wm.update({n: fname for n in names})
            print(f"  shard {i + 1}/{len(shards)} written ({sum(sizes[n] for n in names) / GB:.2f} GB, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), "bytes": total, "tensors": len(spec), "shards": len(shards),
            "layers": {"dense": cfg.first_k_dense_replace, "moe": cfg.num_hidden_layers - cfg.first_k_dense_replace,
                       "mtp": cfg.num_nextn_predict_layers}, "write_s": time.perf_counter() - t0}


def tensor_bytes(spec) -> dict[str, int]:
    """Bytes of each checkpoint tensor of an inventory (`mtp.checkpoint.inventory.checkpoint_spec`), in file order."""
    return {n: math.prod(ts.shape) * ts.dtypes[0].itemsize for n, ts in spec.items()}


# ------------------------------------------------------------------------------------------------ reading
def raw_read(files: list[Path], readers: int, chunk: int = 64 << 20) -> dict:
    """Sequential reads of every file by `readers` threads (files dealt out largest first), page cache emptied
    first: the disk's rate for this access pattern."""
    evict(files)
    queues: list[list[Path]] = [[] for _ in range(readers)]
    loads = [0] * readers
    for f in sorted(files, key=lambda f: -f.stat().st_size):
        i = loads.index(min(loads))
        queues[i].append(f)
        loads[i] += f.stat().st_size
    done = [0] * readers

    def read(i: int) -> None:
        buf = bytearray(chunk)
        view = memoryview(buf)
        for f in queues[i]:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(view):
                    done[i] += n

    threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    evict(files)
    return {"readers": readers, "bytes": sum(done), "seconds": dt, "gb_per_s": sum(done) / dt / GB}


def load_tp(path: Path, tp: int, device_type: str, dtype: str, reader: str = DEFAULT_LOAD_READER) -> dict:
    """The product path: `mtp.distributed.driver.start` + `Peers.load` with shard reader `reader`, page cache
    emptied first."""
    from ..distributed.driver import LoadSpec, start

    files = shard_files(path)
    evict(files)
    peers = start(tp, device_type)
    try:
        t0 = time.perf_counter()
        model = peers.load(LoadSpec(str(path), dtype=dtype, numerics="fp8", reader=reader), progress=True)
        wall = time.perf_counter() - t0
        ranks = model.load_report
    finally:
        peers.close()
    delivered = sum(r["bytes"] for r in ranks)
    disk = [r["disk_read_bytes"] for r in ranks]
    storage = None if None in disk else sum(disk)
    for r in ranks:
        r["gb_per_s"] = r["bytes"] / r["seconds"] / GB
    return {"tp": tp, "reader": reader, "wall_s": wall, "ranks": ranks, "checkpoint_bytes_per_node": delivered,
            "node_gb_per_s": delivered / wall / GB,
            "storage_bytes_read": storage, "storage_gb_per_s": None if storage is None else storage / wall / GB}


def real_checkpoint_bytes() -> int:
    """Bytes of the full DeepSeek-V3.2 checkpoint (61 layers + 1 MTP module) from its tensor inventory."""
    from ..checkpoint.inventory import checkpoint_spec
    from ..model.config import ModelConfig

    return sum(tensor_bytes(checkpoint_spec(ModelConfig())).values())


def median_run(runs: list[dict], key: str) -> dict:
    """The run of median `key` (the lower middle one of an even count): a measured run, not an average of runs."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def measure(path: Path, tp: int, device_type: str, dtype: str, readers: list[int], loaders: list[str],
            repeats: int = 1) -> dict:
    files = shard_files(path)
    size = sum(f.stat().st_size for f in files)
    raw: list[dict] = []
    runs: dict[str, list[dict]] = {name: [] for name in loaders}
    for i in range(repeats):
        for n in readers:
            raw.append(raw_read(files, n))
            r = raw[-1]
            print(f"[{i + 1}/{repeats}] raw read, {r['readers']} reader(s): {r['bytes'] / GB:.1f} GB in "
                  f"{r['seconds']:.1f} s = {r['gb_per_s']:.2f} GB/s", flush=True)
        for name in loaders:
            runs[name].append(load_tp(path, tp, device_type, dtype, name))
            got = runs[name][-1]
            print(f"[{i + 1}/{repeats}] {name} load: {got['checkpoint_bytes_per_node'] / GB:.1f} GB in "
                  f"{got['wall_s']:.1f} s = {got['node_gb_per_s']:.2f} GB/s per node", flush=True)
    raw_median = {n: median_run([r for r in raw if r["readers"] == n], "gb_per_s")["gb_per_s"] for n in readers}
    best_raw = max(raw_median.values())
    real = real_checkpoint_bytes()
    loads = {}
    for name in loaders:
        got = median_run(runs[name], "node_gb_per_s")
        loads[name] = {"load": got, "node_vs_raw": got["node_gb_per_s"] / best_raw,
                       "all_node_gb_per_s": [r["node_gb_per_s"] for r in runs[name]],
                       "extrapolated_690gb": {
                           "seconds": real / (got["node_gb_per_s"] * GB),
                           "assumes": (f"one node reads the whole real checkpoint ({real / GB:.0f} GB) at this run's node "
                                       f"rate ({got['node_gb_per_s']:.2f} GB/s with {tp} ranks, reader {name}): the "
                                       "node's disk is the limit and 8 ranks do not read faster or slower together "
                                       "than these did; two nodes with their own disks each read half")}}
    res = {"checkpoint": str(path), "files_bytes": size, "repeats": repeats, "raw": raw,
           "raw_median_gb_per_s": {str(n): v for n, v in raw_median.items()}, "best_raw_gb_per_s": best_raw,
           "loads": loads, "real_checkpoint_bytes": real}
    print(f"median of {repeats} run(s) each; % of the best raw rate ({best_raw:.2f} GB/s)")
    print(f"{'read':<22}{'node GB/s':>10}{'% of raw':>10}   per rank GB/s (read from storage GB)")
    for n, v in raw_median.items():
        label = f"raw, {n} thread(s)"
        print(f"{label:<22}{v:>10.2f}{100 * v / best_raw:>9.0f}%")
    for name, entry in loads.items():
        got = entry["load"]
        disk = ["?" if r["disk_read_bytes"] is None else f"{r['disk_read_bytes'] / GB:.1f}" for r in got["ranks"]]
        per_rank = ", ".join(f"{r['gb_per_s']:.2f} ({d})" for r, d in zip(got["ranks"], disk))
        label = f"{name}, TP={tp}"
        print(f"{label:<22}{got['node_gb_per_s']:>10.2f}{100 * entry['node_vs_raw']:>9.0f}%   {per_rank}")
    for name, entry in loads.items():
        ex = entry["extrapolated_690gb"]
        print(f"EXTRAPOLATED ({name}): the real checkpoint in {ex['seconds']:.0f} s; assumes {ex['assumes']}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.load", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a real-width checkpoint of a few layers")
    w.add_argument("out", type=Path)
    w.add_argument("--dense-layers", type=int, default=1)
    w.add_argument("--moe-layers", type=int, default=3)
    w.add_argument("--mtp-modules", type=int, default=1)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shard-gb", type=float, default=5.0, help="about this many GB per shard (the real: ~4.3)")
    w.add_argument("--device", default=None, help="where the random weights are drawn (default: cuda if present)")
    m = sub.add_parser("measure", help="raw read rate, then a TP=N load through the product path")
    m.add_argument("path", type=Path)
    m.add_argument("--tp", type=int, default=2)
    m.add_argument("--device-type", default=None, help="cuda or cpu (default: cuda if present)")
    m.add_argument("--dtype", default="bfloat16", help="activation dtype of the loaded model")
    m.add_argument("--readers", type=int, nargs="+", default=None, help="raw-read thread counts (default: 1 and tp)")
    m.add_argument("--loader", nargs="+", choices=LOAD_READERS, default=list(LOAD_READERS),
                   help="the shard readers whose TP=N load is measured, each with the page cache emptied (default: all)")
    m.add_argument("--repeats", type=int, default=1, help="measure everything this many times, report the median run")
    for p in (w, m):
        p.add_argument("--json", type=Path, default=None, help="write the result here (atomically)")
    args = ap.parse_args(argv)
    import torch

    from ..utils import write_json_atomic

    cuda = torch.cuda.is_available()
    if args.cmd == "write":
        if min(args.dense_layers, args.moe_layers, args.mtp_modules) < 0 or args.dense_layers + args.moe_layers < 1:
            ap.error("layer counts must be >= 0 with at least one trunk layer")
        from ..model.presets import real_config

        cfg = real_config(layers=args.dense_layers + args.moe_layers, dense_layers=args.dense_layers,
                          mtp_modules=args.mtp_modules)
        res = write(args.out, cfg, args.seed, args.shard_gb, args.device or ("cuda" if cuda else "cpu"))
        print(f"wrote {res['bytes'] / GB:.1f} GB in {res['shards']} shards to {res['path']} in {res['write_s']:.0f} s")
    else:
        if args.tp < 1 or args.repeats < 1:
            ap.error(f"--tp and --repeats must be >= 1, got {args.tp} and {args.repeats}")
        readers = args.readers or sorted({1, args.tp})
        loaders = list(dict.fromkeys(args.loader))
        res = measure(args.path, args.tp, args.device_type or ("cuda" if cuda else "cpu"), args.dtype, readers, loaders,
                      args.repeats)
    if args.json:
        write_json_atomic(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
