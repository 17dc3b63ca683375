#!/usr/bin/env python3
"""Side-by-side: the storage tier's KV blocks (--kv-block-tokens) vs fio, same objects.

    python3 docs/bench_kv_blocks.py [DIRECTORY] [OBJECT_MIB] [TOTAL_GIB] [THREADS] [ENGINE]

THREADS threads each write entries of 8 objects of OBJECT_MIB MiB (an ENGINE preset's
layout: lmcache by default, 32 MiB objects; vllm for 2 MiB) through BlockTier with
--kv-io direct (O_DIRECT, fdatasync per object, a stat before each store and load,
temp file + rename where the engine does so), TOTAL_GIB in all, then read them back.
fio then writes and reads the same number of files of the same size, one I/O per file,
with the same threads (numjobs), O_DIRECT, psync and an fdatasync per file. Prints
GiB/s and CPU seconds per GB for each, and ours / fio.
"""
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("kv_cache", HERE / "kv-cache.py")
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)

OBJECTS_PER_ENTRY = 8


def cpu_s() -> tuple:
    """(user, system) CPU seconds of this process so far."""
    t = os.times()
    return t.user, t.system


def ours(directory: Path, object_mib: int, entries: int, threads: int, engine: str):
    model = kv.MODEL_CONFIGS["llama3.1-8b"]
    bpt = model.kv_cache_size_per_token
    scheme = kv.dataclasses.replace(kv.KV_ENGINES[engine], block_tokens=object_mib * kv.MIB // bpt, kv_io="direct")
    tier = kv.BlockTier(directory, scheme, model.name, bpt)
    gen = kv.KVCacheGenerator(model, 42)
    tokens = scheme.block_tokens * OBJECTS_PER_ENTRY
    pool = kv.StagingPool(threads, kv.STAGING_BYTES)
    keys = [f"bench_{i}" for i in range(entries)]

    def write(key):
        source = kv.EntrySource.generated(gen, key, tokens * bpt, model.entry_shape(tokens), model.numpy_dtype.str)
        with kv.Transfer("write", tokens * bpt, pool=pool) as t:
            tier.write_from(key, source, t)

    def read(key):
        with kv.Transfer("read", tokens * bpt, pool=pool) as t:
            tier.read_into(key, kv.HostSink(), t)
    out = {}
    for name, fn in (("write", write), ("read", read)):
        chunks = [keys[i::threads] for i in range(threads)]
        workers = [threading.Thread(target=lambda c=c: [fn(k) for k in c]) for c in chunks]
        c0, t0 = cpu_s(), time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        c1 = cpu_s()
        out[name] = (time.perf_counter() - t0, c1[0] - c0[0] + c1[1] - c0[1], c1[1] - c0[1])
    gb = entries * tokens * bpt
    tier.clear()
    pool.drop()
    return gb, out, tier.io_mode


def fio(directory: Path, object_mib: int, files: int, threads: int):
    per_job = files // threads
    out = {}
    for name, rw in (("write", "write"), ("read", "read")):
        job = ["fio", "--name=kvblocks", f"--directory={directory}", f"--rw={rw}", f"--bs={object_mib}M",
               f"--filesize={object_mib}M", f"--nrfiles={per_job}", f"--numjobs={threads}", "--direct=1",
               "--ioengine=psync", "--file_service_type=sequential", "--group_reporting", "--output-format=json"]
        if rw == "write":
            job += ["--create_on_open=1", "--fdatasync=1", "--refill_buffers=1"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(job, capture_output=True, text=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        side = json.loads(proc.stdout)["jobs"][0][rw]
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        out[name] = (side["io_bytes"] / (side["bw_bytes"] or 1), cpu)
    return files * object_mib * kv.MIB, out


def main():
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir())
    object_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    total_gib = float(sys.argv[3]) if len(sys.argv) > 3 else 8
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    engine = sys.argv[5] if len(sys.argv) > 5 else "lmcache"
    entries = max(threads, int(total_gib * 1024 / object_mib / OBJECTS_PER_ENTRY) // threads * threads)
    work = Path(tempfile.mkdtemp(prefix="kvcache_blockbench_", dir=directory))
    try:
        gb, mine, mode = ours(work / "ours", object_mib, entries, threads, engine)
        fio_dir = work / "fio"
        fio_dir.mkdir()
        _, theirs = fio(fio_dir, object_mib, entries * OBJECTS_PER_ENTRY, threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{entries * OBJECTS_PER_ENTRY} objects of {object_mib} MiB ({gb / kv.GIB:.1f} GiB), {threads} threads; "
          f"ours: {mode}")
    for op in ("write", "read"):
        (ws, wc, wsys), (fs, fc) = mine[op], theirs[op]
        print(f"  {op:5s}  ours {gb / kv.GIB / ws:6.2f} GiB/s {wc / (gb / 1e9):5.3f} CPU s/GB "
              f"({wsys / (gb / 1e9):5.3f} system)   fio {gb / kv.GIB / fs:6.2f} GiB/s {fc / (gb / 1e9):5.3f} CPU s/GB   "
              f"ours/fio {fs / ws:4.2f}")


if __name__ == "__main__":
    main()
