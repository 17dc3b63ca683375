#!/usr/bin/env python3
"""The hardware's GPU copy speed beside the benchmark's own GPU-tier operations, in one run.

    python3 docs/bench_gpu_tier.py                                  # 64/256/512 MiB, 1 and 16 threads
    python3 docs/bench_gpu_tier.py --sizes-mib 16,128 --threads 1,4,16 --library cupy --repeat 20

For each entry size and thread count, every thread moves `--repeat` entries on its own CUDA
stream and waits for that stream only. "raw" is the plain library (PyTorch or CuPy) call on
page-locked host memory from the library's own allocator; "ours" is the same operation
through kv-cache.py's GPU device (`open_gpu_device(...)`: h2d, d2h, d2d, fill, wait_for), on host
memory from its `pinned_empty`. Rows:

    h2d    pinned host -> GPU          (a CPU-tier hit delivered to the GPU)
    d2h    GPU -> pinned host          (a GPU entry evicted to the CPU tier)
    d2d    GPU -> GPU                  (a GPU-tier read)
    fill   KV made on the GPU from the generator's pool, stamped there (a GPU-tier write);
           its "raw" columns are a plain D2D copy of the same size

GB/s is decimal (1e9 bytes/s): all threads' bytes over the wall time from the first thread's
start to the last thread's end. P50/P95 are per operation, from enqueue to completion on the
thread's stream. ours/raw is the ratio of the GB/s figures (1.00: we move data at the
hardware's speed). Exits with status 2 and one line on stderr when no CUDA device is usable.
Needs numpy and PyTorch or CuPy, nothing else.
"""
import argparse
import ctypes
import importlib.util
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Sequence, Tuple

import numpy as np

SCRIPT = Path(__file__).resolve().parent.parent / "kv-cache.py"
MIB = 1024 * 1024
OPS = ("h2d", "d2h", "d2d", "fill")
DEVICE_API = ("h2d", "d2h", "d2d", "fill", "wait_for", "load_pool", "pinned_empty", "empty", "view", "device_index")


def load_kv_cache() -> Any:
    spec = importlib.util.spec_from_file_location("kv_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- Metrics (pure) -----------------------------------------------------------------------

@dataclass
class Phase:
    """One (operation, size, thread count) run: every operation's seconds and the wall time."""
    nbytes: int
    op_seconds: List[float]
    wall_s: float


def summarize(phase: Phase) -> Tuple[float, float, float]:
    """(GB/s decimal over the wall time, P50 ms, P95 ms per operation)."""
    total = phase.nbytes * len(phase.op_seconds)
    p50, p95 = np.percentile(np.array(phase.op_seconds) * 1e3, [50, 95])
    return total / phase.wall_s / 1e9 if phase.wall_s > 0 else float("inf"), float(p50), float(p95)


# --- Running threads ----------------------------------------------------------------------

def run_phase(threads: int, repeat: int, nbytes: int, op_for: Callable[[int], Callable[[], float]]) -> Phase:
    """Each thread i runs op_for(i) once untimed (stream creation, first touch), then all start
    together and run it `repeat` times; each call returns its own seconds."""
    barrier = threading.Barrier(threads)
    spans: List[Tuple[float, float]] = [(0.0, 0.0)] * threads
    samples: List[List[float]] = [[] for _ in range(threads)]
    errors: List[BaseException] = []

    def worker(i: int) -> None:
        try:
            op = op_for(i)
            op()
            barrier.wait()
            start = time.perf_counter()
            samples[i] = [op() for _ in range(repeat)]
            spans[i] = (start, time.perf_counter())
        except BaseException as exc:        # reported by the main thread
            errors.append(exc)
            barrier.abort()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return Phase(nbytes, [s for per_thread in samples for s in per_thread], wall)


# --- Plain library calls ("raw") ----------------------------------------------------------

class RawTorch:
    """Plain PyTorch: pinned tensors, copy_(non_blocking=True) on a per-thread stream."""

    def __init__(self, device_index: int):
        import torch
        self.torch = torch
        self.device = torch.device("cuda", device_index)
        self._local = threading.local()

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def _copy(self, dst: Any, src: Any) -> float:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self.torch.cuda.Stream(device=self.device)
        t0 = time.perf_counter()
        with self.torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        return time.perf_counter() - t0

    h2d = d2h = d2d = _copy                  # copy_ picks the direction from the tensors


class RawCupy:
    """Plain CuPy: pinned numpy arrays, MemoryPointer.copy_*_async on a per-thread stream."""

    def __init__(self, device_index: int):
        import cupy
        self.cupy = cupy
        self.device = cupy.cuda.Device(device_index)
        self._local = threading.local()

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self.device:
                stream = self._local.stream = self.cupy.cuda.Stream(non_blocking=True)
        return stream

    def _timed(self, enqueue: Callable[[Any], None]) -> float:
        stream = self._stream()
        t0 = time.perf_counter()
        with self.device:
            enqueue(stream)
        stream.synchronize()
        return time.perf_counter() - t0

    def h2d(self, dst: Any, src: np.ndarray) -> float:
        return self._timed(lambda s: dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), src.nbytes, s))

    def d2h(self, dst: np.ndarray, src: Any) -> float:
        return self._timed(lambda s: src.data.copy_to_host_async(ctypes.c_void_p(dst.ctypes.data), dst.nbytes, s))

    def d2d(self, dst: Any, src: Any) -> float:
        return self._timed(lambda s: dst.data.copy_from_device_async(src.data, src.nbytes, s))


# --- The table --------------------------------------------------------------------------------

@dataclass
class Slot:
    """One thread's buffers, allocated once at the largest size (pinned allocation is slow)."""
    raw_host: Any
    ours_host: np.ndarray
    dev_a: Any
    dev_b: Any


def make_slots(dev: Any, raw: Any, count: int, nbytes: int) -> List[Slot]:
    slots = []
    for _ in range(count):
        a, b = dev.empty(nbytes), dev.empty(nbytes)
        dev.d2d(b, a)                        # touch both
        slots.append(Slot(raw.pinned(nbytes), dev.pinned_empty(nbytes), a, b))
    dev.sync()
    return slots


def raw_op(raw: Any, slot: Slot, op: str, n: int) -> Callable[[], float]:
    a, b, host = slot.dev_a[:n], slot.dev_b[:n], slot.raw_host[:n]
    return {"h2d": lambda: raw.h2d(a, host), "d2h": lambda: raw.d2h(host, a),
            "d2d": lambda: raw.d2d(b, a), "fill": lambda: raw.d2d(b, a)}[op]


def ours_op(dev: Any, slot: Slot, op: str, n: int, layout: Any) -> Callable[[], float]:
    a, b, host = dev.view(slot.dev_a, 0, n), dev.view(slot.dev_b, 0, n), slot.ours_host[:n]
    enqueue = {"h2d": lambda: dev.h2d(a, host), "d2h": lambda: dev.d2h(host, a),
               "d2d": lambda: dev.d2d(b, a), "fill": lambda: dev.fill(layout, 0, b)}[op]
    def op() -> float:                       # as a Transfer times it: enqueue to completion
        t0 = time.perf_counter()
        dev.wait_for(enqueue)
        return time.perf_counter() - t0
    return op


HEADER = (f"{'op':<5} {'MiB':>5} {'thr':>3} | {'raw GB/s':>9} {'p50 ms':>8} {'p95 ms':>8} | "
          f"{'ours GB/s':>9} {'p50 ms':>8} {'p95 ms':>8} | {'ours/raw':>8}")


def format_row(op: str, size_mib: int, threads: int, raw: Phase, ours: Phase) -> str:
    r_gbps, r50, r95 = summarize(raw)
    o_gbps, o50, o95 = summarize(ours)
    return (f"{op:<5} {size_mib:>5} {threads:>3} | {r_gbps:>9.1f} {r50:>8.3f} {r95:>8.3f} | "
            f"{o_gbps:>9.1f} {o50:>8.3f} {o95:>8.3f} | {o_gbps / r_gbps:>8.2f}")


def run_table(kv: Any, dev: Any, raw: Any, sizes_mib: Sequence[int], thread_counts: Sequence[int], repeat: int) -> None:
    generator = kv.KVCacheGenerator(kv.MODEL_CONFIGS["tiny-1b"], global_seed=42)
    dev.load_pool(generator.precomputed_buffer.view(np.uint8))
    slots = make_slots(dev, raw, max(thread_counts), max(sizes_mib) * MIB)
    layouts = [generator.layout(f"bench-{i}") for i in range(len(slots))]
    print(HEADER)
    print("-" * len(HEADER))
    for op in OPS:
        for size_mib in sizes_mib:
            n = size_mib * MIB
            for threads in thread_counts:
                raw_phase = run_phase(threads, repeat, n, lambda i: raw_op(raw, slots[i], op, n))
                ours_phase = run_phase(threads, repeat, n, lambda i: ours_op(dev, slots[i], op, n, layouts[i]))
                print(format_row(op, size_mib, threads, raw_phase, ours_phase), flush=True)
    print("fill: ours makes the KV on the GPU (pool copy + stamps); its raw columns are a plain D2D copy.")


# --- Command line -----------------------------------------------------------------------------

def int_list(text: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return sorted(set(values))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Raw pinned H2D/D2H/D2D bandwidth beside the benchmark's GPU tier.")
    parser.add_argument("--sizes-mib", type=int_list, default=int_list("64,256,512"),
                        help="entry sizes in MiB, comma-separated (default 64,256,512)")
    parser.add_argument("--threads", type=int_list, default=int_list("1,16"),
                        help="thread counts, comma-separated; one CUDA stream each (default 1,16)")
    parser.add_argument("--library", choices=("auto", "torch", "cupy"), default="auto",
                        help="GPU library for both columns (default auto: PyTorch, then CuPy)")
    parser.add_argument("--repeat", type=int, default=10, help="operations per thread per row (default 10)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    kv = load_kv_cache()
    try:
        dev = kv.open_gpu_device(library=args.library)
    except Exception as exc:                 # whatever a missing or broken CUDA raises
        print(f"bench_gpu_tier: no usable CUDA device: {exc}", file=sys.stderr)
        return 2
    missing = [name for name in DEVICE_API if not hasattr(dev, name)]
    if missing:
        print(f"bench_gpu_tier: kv-cache.py's GPU device has no {', '.join(missing)} (older GPU tier)", file=sys.stderr)
        return 2
    library = dev.library.split()[0]
    raw = RawTorch(dev.device_index) if library == "torch" else RawCupy(dev.device_index)
    print(f"GPU: {dev.name}   library: {dev.library}   repeat: {args.repeat} per thread   "
          f"sizes: {args.sizes_mib} MiB   threads: {args.threads}")
    try:
        run_table(kv, dev, raw, args.sizes_mib, args.threads, args.repeat)
    finally:
        dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
