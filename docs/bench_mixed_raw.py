#!/usr/bin/env python3
"""Raw device bandwidth with readers and writers at the same time (no benchmark code involved).

    python3 docs/bench_mixed_raw.py READERS WRITERS DIRECTORY [SECONDS]

READERS threads read (over and over) 256 MiB files written beforehand, and
WRITERS threads write their own files, all with 8 MiB O_DIRECT requests (one in
flight per thread), for SECONDS (default 6). Prints the read and write GB/s the
device gave while both ran. Every file it makes in DIRECTORY is removed at the
end.

Used in docs/performance.md to show what the device itself delivers at the
storage-only run's mix of reads and writes in flight.
"""
import mmap
import os
import sys
import threading
import time

CHUNK = 8 << 20
FILE_BYTES = 256 << 20


def random_buffer():
    buf = mmap.mmap(-1, CHUNK)                   # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(CHUNK))
    return buf


def main():
    readers, writers, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 6.0
    paths = [os.path.join(directory, f"kvraw_r{i}_{os.getpid()}") for i in range(readers)]
    try:
        run(paths, writers, directory, seconds)
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def run(paths, writers, directory, seconds):
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
        buf = random_buffer()
        for off in range(0, FILE_BYTES, CHUNK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        os.close(fd)
    stop = time.perf_counter() + seconds
    moved = {"read": 0, "write": 0}
    lock = threading.Lock()

    def read(path):
        fd, buf, off, n = os.open(path, os.O_RDONLY | os.O_DIRECT), mmap.mmap(-1, CHUNK), 0, 0
        while time.perf_counter() < stop:
            n += os.preadv(fd, [buf], off)
            off = (off + CHUNK) % FILE_BYTES
        os.close(fd)
        with lock:
            moved["read"] += n

    def write(i):
        path = os.path.join(directory, f"kvraw_w{i}_{os.getpid()}")
        fd, buf, off, n = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT), random_buffer(), 0, 0
        try:
            while time.perf_counter() < stop:
                n += os.pwrite(fd, buf, off)
                off = (off + CHUNK) % (1 << 30)
            os.fdatasync(fd)
        finally:
            os.close(fd)
            os.unlink(path)
        with lock:
            moved["write"] += n

    threads = [threading.Thread(target=read, args=(p,)) for p in paths]
    threads += [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    print(f"{len(paths)} readers, {writers} writers: read {moved['read'] / elapsed / 1e9:.3f} GB/s, "
          f"write {moved['write'] / elapsed / 1e9:.3f} GB/s")


if __name__ == "__main__":
    main()
