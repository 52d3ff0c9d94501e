"""Checkpoint tensors read with large explicit reads (`os.preadv`) instead of the page faults of an mmap.

safetensors' `safe_open` maps a shard and serves a tensor (or a slice) from the mapping: each 4 KiB page is a page
fault, served by the kernel's readahead, on the one thread of the rank; the bytes are then copied once more
(`.to(copy=True)`: a model must not alias a private mapping). Measured on 2 x H100 from local disk that path loads
at 68% of the disk's sequential rate (BENCHMARKS.md). `ShardReader` parses the shard's header itself
(`header.shard_header`, every entry checked by `header.tensor_extent` before its bytes are read) and reads exactly the
byte ranges a tensor part covers, in chunks of `CHUNK` bytes:

- a whole tensor or a row range [r0, r1) of a row-major tensor is one contiguous byte range: on the CPU it is read
  straight into the memory of the tensor that is returned (no second copy); for a CUDA device it goes through two
  pinned staging buffers (`Staging`): the disk fills one while the other is copied to the GPU asynchronously;
- a column range [c0, c1) of a 2-D tensor: the rows covering it are read a chunk of whole rows at a time (one
  contiguous range each) and the columns copied out (on the GPU for a CUDA device). One read per row of
  (c1 - c0) x itemsize bytes instead was slower: measured on the column-split tensors of a real-width layer pair
  (two o_proj and a dense down_proj, half the columns, 184 MB of slices, page cache emptied) 2.0 s per row against
  0.5-0.8 s covering, though it read 265 MB from storage instead of 458 MB. The other ranks read the same rows.

A caller reads the tensors of a shard in file-offset order (`in_file_order`), so each rank reads each shard front to
back with the gaps of what it does not hold, and tells the reader those ranges first (`will_read`): each read then
asks the kernel (POSIX_FADV_WILLNEED) for the next AHEAD bytes of them, so the disk has many reads in flight while
this one is copied, checked and sent to the device. That advice is what makes explicit reads faster than the mmap:
a rank's 8.1 GB of byte ranges into a reused buffer on the CPU VM (eval/results/load_readers_cpu) took 1.1-1.6 GB/s
through an mmap, 0.65-0.83 GB/s as bare 64 MiB preads (each waits for its pages), 2.2 GB/s as preads with the advice.
A file shortened after its header was read gives a short read: CheckpointError naming file and tensor, never a
SIGBUS (which is what an mmap gives).
"""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path

import torch

from .header import CheckpointError, in_file_order, shard_header, tensor_extent

CHUNK = 64 << 20  # bytes per read and per staging buffer
AHEAD = 256 << 20  # bytes of the reads to come asked of the kernel ahead of the read position (`will_read`)
ADVICE = 8 << 20  # bytes per POSIX_FADV_WILLNEED: Linux reads at most its readahead size (8-16 MiB here) per call


def read_at(fd: int, buf: memoryview, offset: int) -> int:
    """One `preadv` of `buf` at `offset` (a function of its own, so a test can watch which bytes are read)."""
    return os.preadv(fd, [buf], offset)


def advise(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start reading [offset, offset + n) into the page cache now (returns without waiting)."""
    os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory of a contiguous CPU uint8 tensor (pinned or not)."""
    return memoryview(t.numpy()).cast("B")


class Staging:
    """Two pinned host buffers through which bytes go to a CUDA device: while one is copied (asynchronously, on the
    current stream), the disk fills the other; a buffer is refilled only after its last copy's event."""

    def __init__(self, device: torch.device, nbytes: int = CHUNK):
        self.device = torch.device(device)
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.next = 0

    @property
    def nbytes(self) -> int:
        return self.bufs[0].numel()

    def take(self) -> tuple[int, torch.Tensor]:
        i, self.next = self.next, 1 - self.next
        if self.events[i] is not None:
            self.events[i].synchronize()
        return i, self.bufs[i]

    def sent(self, i: int) -> None:
        """Buffer i's copy has been queued on the current stream."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.events[i] = ev


class ShardReader:
    """One safetensors shard, read with `preadv` (see the module docstring). `read(name, dim, start, stop)`: the
    whole tensor (dim None), rows [start, stop) (dim 0) or columns [start, stop) (dim 1) of tensor `name`, on
    `device` (a CUDA device needs `staging`). `get_tensor` / `get_slice` answer as safetensors' `safe_open` does, so
    a loader takes either: `get_tensor(name)` is the whole tensor on the CPU, `get_slice(name)[a:b]` (rows),
    `[:, a:b]` (columns) or `[:]` read that part to `device`."""

    def __init__(self, file: str | os.PathLike, device: str | torch.device = "cpu", staging: Staging | None = None,
                 chunk: int = CHUNK):
        self.file, self.device = Path(file), torch.device(device)
        if self.device.type == "cuda" and staging is None:
            raise ValueError(f"ShardReader({self.file}) to {self.device}: a CUDA device needs a Staging")
        self.start, self.header = shard_header(self.file)
        self.staging, self.chunk = staging, staging.nbytes if staging is not None else chunk
        self.todo: deque[list[int]] = deque()  # [begin, end) of the reads to come not yet advised (`will_read`)
        self.advised: deque[tuple[int, int]] = deque()  # advised, not yet passed by the read position
        self.ahead = 0  # bytes in `advised`
        self.fd = os.open(self.file, os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            os.close(self.fd)
            raise

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.read(name, device="cpu")

    def get_slice(self, name: str) -> TensorPart:
        return TensorPart(self, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def extent(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        """(dtype, shape, first byte, end byte) of tensor `name`, checked (`header.tensor_extent`)."""
        return tensor_extent(self.file, self.header, self.start, self.size, name)

    def span(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> tuple[int, int]:
        """[begin, end) of the bytes `read(name, dim, start, stop)` reads: the rows' range, or the whole tensor (for
        a column slice: every row covers some of its columns)."""
        dtype, shape, begin, end = self.extent(name)
        if dim != 0:
            return begin, end
        row = math.prod(shape[1:]) * dtype.itemsize
        return begin + start * row, begin + stop * row

    def will_read(self, spans) -> None:
        """The [begin, end) byte ranges the next reads will read, in order. One read at a time waits for the disk's
        answer, and the kernel's readahead stops at every gap (another rank's experts): measured on this project's
        2-core VM (virtio disk), a rank's reads in file order ran at 0.37-0.56 GB/s alone, 1.0-1.5 GB/s with the
        next AHEAD bytes advised (POSIX_FADV_WILLNEED), which keeps many reads in flight. Each read then advises
        up to AHEAD bytes past where it reads."""
        if not hasattr(os, "posix_fadvise"):
            return
        for b, e in spans:
            if e <= b:
                continue
            if self.todo and self.todo[-1][1] == b:  # adjacent: one range
                self.todo[-1][1] = e
            else:
                self.todo.append([b, e])

    def in_file_order(self, names) -> list[str]:
        """`names` sorted by where their bytes start in the file: reading them in this order reads it front to back."""
        return in_file_order(self.header, names)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0,
             device: str | torch.device | None = None) -> torch.Tensor:
        dtype, shape, begin, end = self.extent(name)  # checked before any byte of it is read
        device = self.device if device is None else torch.device(device)
        if device.type == "cuda" and self.staging is None:
            raise ValueError(f"{self.file}: tensor {name!r} to {device}: a CUDA device needs the reader's Staging")
        if dim is not None and not (dim < len(shape) <= 2 and 0 <= start <= stop <= shape[dim]):
            raise ValueError(f"{self.file}: tensor {name!r} of shape {list(shape)} has no slice [{start}, {stop}) "
                             f"of dim {dim} (rows of a 1-D or 2-D tensor, columns of a 2-D one)")
        if dim == 1:
            return self._columns(name, dtype, shape, begin, start, stop, device)
        row = math.prod(shape[1:]) * dtype.itemsize  # bytes per row (dim 0)
        if dim is None:
            out_shape, first, n = shape, begin, end - begin
        else:
            out_shape, first, n = (stop - start, *shape[1:]), begin + start * row, (stop - start) * row
        out = torch.empty(n, dtype=torch.uint8, device=device)
        if n and device.type == "cuda":
            self._to_device(name, first, out)
        elif n:
            self._fill(name, first, _bytes_of(out))
        return out.view(dtype).view(out_shape)

    # ------------------------------------------------------------------------------------------------ internals
    def _advise(self, pos: int) -> None:
        """Keep up to AHEAD bytes of the reads to come (`will_read`) past `pos` advised to the kernel."""
        while self.advised and self.advised[0][1] <= pos:
            b, e = self.advised.popleft()
            self.ahead -= e - b
        while self.todo and self.todo[0][1] <= pos:  # passed without being advised
            self.todo.popleft()
        while self.todo and self.ahead < AHEAD:
            r = self.todo[0]
            b, e = max(r[0], pos), min(r[1], max(r[0], pos) + ADVICE)
            advise(self.fd, b, e - b)
            self.advised.append((b, e))
            self.ahead += e - b
            r[0] = e
            if e == r[1]:
                self.todo.popleft()

    def _fill(self, name: str, offset: int, buf: memoryview) -> None:
        """Read len(buf) bytes at `offset` into `buf`, a chunk per call; a short file is a CheckpointError."""
        pos, n = 0, len(buf)
        while pos < n:
            if self.todo:
                self._advise(offset + pos)
            got = read_at(self.fd, buf[pos: min(n, pos + self.chunk)], offset + pos)
            if got <= 0:
                raise CheckpointError(f"{self.file}: tensor {name!r}: the file ends at byte {offset + pos}, before the "
                                      f"{n} bytes at {offset} its header promised (shortened while loading?)")
            pos += got

    def _to_device(self, name: str, offset: int, out: torch.Tensor) -> None:
        """Contiguous bytes at `offset` into the device byte tensor `out`, through the staging buffers."""
        st = self.staging
        for pos in range(0, out.numel(), st.nbytes):
            m = min(st.nbytes, out.numel() - pos)
            i, buf = st.take()
            self._fill(name, offset + pos, _bytes_of(buf[:m]))
            out[pos: pos + m].copy_(buf[:m], non_blocking=True)
            st.sent(i)

    def _columns(self, name: str, dtype: torch.dtype, shape: tuple[int, int], begin: int, c0: int, c1: int,
                 device: torch.device) -> torch.Tensor:
        """Columns [c0, c1) of a 2-D tensor: whole rows read a chunk at a time, the columns copied out."""
        N, K = shape
        isz = dtype.itemsize
        row = K * isz
        flat = torch.empty(N * (c1 - c0) * isz, dtype=torch.uint8, device=device)
        out = flat.view(N, (c1 - c0) * isz)
        if out.numel():
            per = max(1, self.chunk // row)  # rows per read
            bounce = None if device.type == "cuda" else torch.empty(min(N, per) * row, dtype=torch.uint8)
            for r0 in range(0, N, per):
                r1 = min(N, r0 + per)
                n = (r1 - r0) * row
                if device.type == "cuda" and n <= self.staging.nbytes:
                    i, buf = self.staging.take()
                    self._fill(name, begin + r0 * row, _bytes_of(buf[:n]))
                    rows = buf[:n].to(device, non_blocking=True)
                    self.staging.sent(i)
                elif device.type == "cuda":  # one row longer than a staging buffer
                    rows = torch.empty(n, dtype=torch.uint8, device=device)
                    self._to_device(name, begin + r0 * row, rows)
                else:
                    rows = bounce[:n]
                    self._fill(name, begin + r0 * row, _bytes_of(rows))
                out[r0:r1].copy_(rows.view(r1 - r0, row)[:, c0 * isz: c1 * isz])
        return flat.view(dtype).view(N, c1 - c0)


class TensorPart:
    """A tensor of a shard, read when indexed: `[:]`, rows `[a:b]`, columns `[:, a:b]` (what `mtp.parallel.load.take`
    asks of a safetensors slice), on the reader's device."""

    def __init__(self, reader: ShardReader, name: str):
        self.reader, self.name = reader, name

    def get_shape(self) -> list[int]:
        return list(self.reader.extent(self.name)[1])

    def __getitem__(self, key) -> torch.Tensor:
        shape = self.get_shape()
        if isinstance(key, slice) and key.step is None:
            dim, s = (None, key) if key == slice(None) else (0, key)
        elif (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
              and key[1].step is None):
            dim, s = 1, key[1]
        else:
            raise TypeError(f"{self.reader.file}: tensor {self.name!r}: index {key!r} is not [:], [a:b] or [:, a:b]")
        if dim is None:
            return self.reader.read(self.name)
        start, stop, _ = s.indices(shape[dim] if dim < len(shape) else 0)
        return self.reader.read(self.name, dim, start, max(start, stop))
