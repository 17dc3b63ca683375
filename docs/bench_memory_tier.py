#!/usr/bin/env python3
"""The CPU tier's write and read rates beside numpy's own copy, on the same machine, in one run.

    python3 docs/bench_memory_tier.py                          # 256 MiB entries; 1, 2 and all cores
    python3 docs/bench_memory_tier.py --size-mib 64 --threads 1,4 --entries 4 --repeat 5

For each thread count, every thread works on entries of its own, all threads started together:

    copyto   numpy.copyto of a SIZE array into another, already mapped (the machine's copy rate)
    write    MultiTierCache.allocate_cache of a new SIZE entry in the CPU tier (kv-cache.py's
             prefill write: the KV made from the generator's pool into the tier's arena)
    read     MultiTierCache.read_entry of such an entry (a hit copied out through a 4 MiB bounce area)

GB/s is decimal (1e9 bytes/s): all threads' bytes over the wall time from the first thread's
start to the last thread's end; ours/copyto is the ratio of those rates. P95 is per operation.
Needs numpy and kv-cache.py beside this folder; no GPU (the CPU tier alone, --gpu-mem-gb 0).
"""
import argparse
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

SCRIPT = Path(__file__).resolve().parent.parent / "kv-cache.py"
MIB = 1024 * 1024
MODEL = "llama3.1-8b"                        # 128 KiB of KV per token


def load_kv_cache() -> Any:
    spec = importlib.util.spec_from_file_location("kv_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_threads(count: int, work: Callable[[int], List[float]]) -> Tuple[float, List[float]]:
    """Run work(i) on `count` threads started together: (wall seconds, every operation's seconds)."""
    barrier, times = threading.Barrier(count + 1), [[] for _ in range(count)]

    def run(i: int) -> None:
        barrier.wait()
        times[i] = work(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, [s for per in times for s in per]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row(name: str, threads: int, nbytes: int, wall: float, ops: List[float], base: float) -> Tuple[str, float]:
    gbps = nbytes * len(ops) / wall / 1e9
    p95 = float(np.percentile(ops, 95)) * 1e3
    ratio = f"{gbps / base:8.2f}" if base else "       -"
    return f"{name:<7} {threads:>3} | {gbps:8.2f} GB/s | P95 {p95:9.2f} ms | {ratio}", gbps


def measure(kv: Any, threads: int, size_mib: int, entries: int, repeat: int, cache_dir: str) -> List[str]:
    nbytes = size_mib * MIB
    arrays = [(np.full(nbytes, 1, np.uint8), np.full(nbytes, 2, np.uint8)) for _ in range(threads)]   # both mapped
    wall, ops = on_threads(threads, lambda i: [timed(lambda: np.copyto(arrays[i][1], arrays[i][0]))
                                              for _ in range(entries * repeat)])
    lines = [row("copyto", threads, nbytes, wall, ops, 0)[0]]
    base = nbytes * len(ops) / wall / 1e9
    del arrays
    tokens = nbytes // kv.MODELS[MODEL].kv_cache_size_per_token
    budget_gb = threads * entries * nbytes / kv.TIER_HEADROOM / 1024 ** 3 * 1.05      # every entry fits
    cache = kv.MultiTierCache(kv.MODELS[MODEL], gpu_memory_gb=0, cpu_memory_gb=budget_gb, cache_dir=cache_dir, seed=1)
    try:
        keys = [[f"t{i}-e{j}" for j in range(entries)] for i in range(threads)]
        wall, ops = on_threads(threads, lambda i: [cache.write_entry(k, tokens).latency_s for k in keys[i]])
        assert all(cache.entry_location(k) == "cpu" for per in keys for k in per), "an entry left the CPU tier"
        lines.append(row("write", threads, nbytes, wall, ops, base)[0])
        wall, ops = on_threads(threads, lambda i: [cache.read_entry(k).latency_s for _ in range(repeat) for k in keys[i]])
        lines.append(row("read", threads, nbytes, wall, ops, base)[0])
    finally:
        cache.close()
    return lines


def thread_counts(text: str) -> List[int]:
    counts = {os.cpu_count() or 1 if part.strip() == "all" else int(part) for part in text.split(",") if part.strip()}
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"need positive thread counts or 'all': {text!r}")
    return sorted(counts)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The CPU tier's write and read rates beside numpy.copyto.")
    parser.add_argument("--size-mib", type=int, default=256, help="entry size in MiB (default 256)")
    parser.add_argument("--threads", type=thread_counts, default=thread_counts("1,2,all"),
                        help="thread counts, comma-separated, 'all' for every core (default 1,2,all)")
    parser.add_argument("--entries", type=int, default=2, help="entries per thread (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="reads of each entry (default 3)")
    parser.add_argument("--cache-dir", default=tempfile.gettempdir(), help="where the run directory goes")
    args = parser.parse_args(argv)
    for name in ("size_mib", "entries", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    kv = load_kv_cache()
    print(f"{os.cpu_count()} cores; {args.size_mib} MiB entries ({MODEL}); {args.entries} entries per thread, "
          f"each read {args.repeat} times")
    print(f"{'op':<7} {'thr':>3} | {'rate':>13} | {'per operation':>17} | ours/copyto")
    for threads in args.threads:
        for line in measure(kv, threads, args.size_mib, args.entries, args.repeat, args.cache_dir):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
