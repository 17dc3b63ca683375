#!/usr/bin/env python3
"""What the memory behind an O_DIRECT buffer costs: CPU per GB and bandwidth of 8 MiB reads.

    python3 docs/bench_direct_buffers.py DIRECTORY [GIB] [PASSES]

Writes one GIB (default 2) GiB file of random bytes in DIRECTORY, then reads it
with 8 MiB O_DIRECT preads, one thread, one request in flight, into each kind
of buffer in turn, PASSES (default 2) rounds:

- shared:  mmap.mmap(-1, n), a shared anonymous mapping (shmem: small pages only)
- private: a private anonymous mapping, 4 KiB pages
- huge:    a private anonymous mapping on a 2 MiB boundary with MADV_HUGEPAGE
           (what kv-cache.py's aligned_empty gives)

and prints, per read pass, the process CPU seconds per GB read, GB/s and the
huge pages the buffer got. The file is removed at the end. Used in
docs/performance.md ("Closing the gap to fio").
"""
import mmap
import os
import sys
import time

CHUNK = 8 << 20
HUGE = 2 << 20


def buffer(kind: str):
    if kind == "shared":
        area = mmap.mmap(-1, CHUNK)
        return area, memoryview(area)
    area = mmap.mmap(-1, CHUNK + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(area)
    if kind == "private":
        return area, view[:CHUNK]
    import ctypes
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    start = (-address) % HUGE
    area.madvise(mmap.MADV_HUGEPAGE, start, CHUNK)
    return area, view[start:start + CHUNK]


def anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    directory = sys.argv[1]
    gib = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    passes = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    path = os.path.join(directory, f"bench_direct_buffers.{os.getpid()}")
    size = gib << 30
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        _, src = buffer("huge")
        for off in range(0, size, CHUNK):
            src[:] = os.urandom(CHUNK)
            os.pwrite(fd, src, off)
        os.fdatasync(fd)
        os.close(fd)
        for _ in range(passes):
            for kind in ("shared", "private", "huge"):
                before = anon_huge_kb()
                area, buf = buffer(kind)
                buf[:] = b"\1" * CHUNK                    # first touch outside the timing
                huge_kb = anon_huge_kb() - before
                rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                c0, t0, moved = time.process_time(), time.perf_counter(), 0
                for off in range(0, size, CHUNK):
                    moved += os.preadv(rfd, [buf], off)
                c1, t1 = time.process_time(), time.perf_counter()
                os.close(rfd)
                buf.release()
                area.close()
                print(f"{kind:8s} {(c1 - c0) / (moved / 1e9):.4f} CPU s/GB  {moved / 1e9 / (t1 - t0):.2f} GB/s"
                      f"  huge pages in the buffer: {huge_kb // 2048}")
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
