#!/usr/bin/env python3
"""Side-by-side: the benchmark's storage path vs plain np.save / np.load (the original's method).

    python3 docs/bench_storage_path.py [DIRECTORY] [ENTRIES] [ENTRY_MIB]

Writes ENTRIES entries of ENTRY_MIB MiB of KV data (the same bytes for both
methods) into DIRECTORY, then reads them back, with four threads, and prints
GiB/s and CPU seconds per GiB for each method. Before every read pass the
files' pages are dropped from the page cache (posix_fadvise DONTNEED after an
fsync), so both methods read from the device. np.save gets an fsync per file so
that both methods' writes are durable; its timing includes it.
"""
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("kv_cache", HERE / "kv-cache.py")
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)

THREADS = 4


def timed(fn, items):
    """Run fn over items with THREADS threads; (wall seconds, process CPU seconds)."""
    chunks = [items[i::THREADS] for i in range(THREADS)]
    threads = [threading.Thread(target=lambda c=c: [fn(x) for x in c]) for c in chunks]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0


def drop_cache(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def main():
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir())
    entries = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    entry_mib = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    model = kv.MODEL_CONFIGS["llama3.1-8b"]
    tokens = entry_mib * kv.MIB // model.kv_cache_size_per_token
    gen = kv.KVCacheGenerator(model, 42)
    work = Path(tempfile.mkdtemp(prefix="kvcache_pathbench_", dir=directory))
    keys = [f"e{i}" for i in range(entries)]
    gib = entries * tokens * model.kv_cache_size_per_token / kv.GIB
    rows = []
    try:
        ours = kv.NVMeBackend(work / "ours")
        pool = kv.StagingPool(THREADS, kv.STAGING_BYTES)     # as the benchmark's workers: a staging area each
        nbytes = tokens * model.kv_cache_size_per_token

        def our_write(k):
            with kv.Transfer("write", nbytes, pool=pool) as transfer:
                ours.write_from(k, kv.EntrySource.generated(gen, k, nbytes, model.entry_shape(tokens), "<f2"),
                                transfer)

        def our_read(k):
            with kv.Transfer("read", nbytes, pool=pool) as transfer:
                ours.read_into(k, kv.HostSink(), transfer)
        w = timed(our_write, keys)
        r = timed(our_read, keys)
        rows.append((f"kv-cache.py path ({ours.io_mode})", w, r))

        plain = work / "plain"
        plain.mkdir()

        def np_write(k):
            with open(plain / f"{k}.npy", "wb") as f:
                np.save(f, gen.generate(tokens, k), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())

        def np_read(k):
            np.load(plain / f"{k}.npy")
        w = timed(np_write, keys)
        drop_cache([plain / f"{k}.npy" for k in keys])
        r = timed(np_read, keys)
        rows.append(("np.save + fsync / np.load (cold)", w, r))
    finally:
        for path in sorted(work.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        work.rmdir()
    print(f"{entries} entries x {entry_mib} MiB = {gib:.1f} GiB each way, {THREADS} threads, in {directory}")
    print(f"{'method':45} {'write GiB/s':>11} {'CPU s/GiB':>9} {'read GiB/s':>10} {'CPU s/GiB':>9}")
    for name, (ws, wc), (rs, rc) in rows:
        print(f"{name:45} {gib / ws:11.2f} {wc / gib:9.3f} {gib / rs:10.2f} {rc / gib:9.3f}")


if __name__ == "__main__":
    main()
