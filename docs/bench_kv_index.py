#!/usr/bin/env python3
"""What tracking many KV blocks costs: the block tier's index memory and its clean-up time.

    python3 docs/bench_kv_index.py [DIRECTORY] [BLOCKS] [LAYOUT]

Writes BLOCKS blocks of 4 KiB (16 tokens of a 256-byte-per-token model, entries of 64
blocks) through BlockTier with LAYOUT (file-per-block, flat, as LMCache; or slot-file, as
Dynamo) in DIRECTORY (a tmpfs such as /dev/shm keeps the device out of it), then removes
them all as the end of a run does. Prints the process's resident memory growth per block
and in all (the index: entries, objects, names; not the data, which lies in the files),
and the seconds the clean-up took.
"""
import dataclasses
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("kv_cache", HERE / "kv-cache.py")
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)

BLOCKS_PER_ENTRY = 64


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main():
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/dev/shm")
    blocks = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    layout = sys.argv[3] if len(sys.argv) > 3 else "file-per-block"
    engine = "dynamo" if layout == "slot-file" else "lmcache"
    scheme = dataclasses.replace(kv.KV_ENGINES[engine], block_tokens=16, kv_io="engine")
    bpt = 256
    work = Path(tempfile.mkdtemp(prefix="kvcache_indexbench_", dir=directory))
    tier = kv.BlockTier(work, scheme, "llama3.1-8b", bpt)
    nbytes = BLOCKS_PER_ENTRY * 16 * bpt
    data = kv.np.random.default_rng(1).integers(0, 256, nbytes, dtype=kv.np.uint8)
    source = kv.EntrySource.of_array(data)
    entries = blocks // BLOCKS_PER_ENTRY
    before, t0 = rss_bytes(), time.perf_counter()
    with kv.Transfer("write", nbytes) as transfer:       # one staging area, reused
        for i in range(entries):
            tier.write_from(f"user_{i % 1000}_req_{i}", source, transfer)
    written_s, grown = time.perf_counter() - t0, rss_bytes() - before
    t1 = time.perf_counter()
    tier.clear()
    cleared_s = time.perf_counter() - t1
    left = sum(1 for _ in work.rglob("*"))
    work.rmdir()
    total = entries * BLOCKS_PER_ENTRY
    print(f"{layout}: {total:,} blocks in {entries:,} entries written in {written_s:.1f} s; index memory "
          f"{grown / 2**20:.0f} MiB ({grown / total:.0f} B a block); clean-up {cleared_s:.1f} s "
          f"({total / cleared_s:,.0f} blocks/s), {left} left")


if __name__ == "__main__":
    main()
