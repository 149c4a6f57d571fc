"""Where compiled kernels outlive the process: torch.compile (inductor), Triton, humming-kernels and our own CUDA
kernels' cubins (qerl.quant.kernels.cuda_build) under one root.

    where = configure()            # at a stage's start, before anything compiles (qerl.stage.run_main does it)
    clock = CompileClock(); ...; clock.summary()   # seconds spent compiling since the clock started, by library

The first 7B rollout compiles the decoder layers (inductor), our Triton and CUDA kernels and humming's JIT GEMMs
(nvcc): a minute or two on a cold cache, seconds on a warm one. Each library keeps its own cache by default (inductor
in /tmp, which a cluster node may wipe between jobs; our cubins nowhere); QERL_COMPILE_CACHE=<dir> puts all four
under one directory, e.g. on a shared filesystem so that every rank, job and node after the first starts warm (as
vLLM's torch_compile_cache). The default root is ${XDG_CACHE_HOME:-~/.cache}/qerl/compile; QERL_COMPILE_CACHE=off
leaves the libraries' own defaults. A variable the user set (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR,
HUMMING_CACHE_DIR, QERL_CUDA_CACHE_DIR) wins.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from qerl.errors import QerlError

ENV = "QERL_COMPILE_CACHE"
LIBRARIES = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR", "humming": "HUMMING_CACHE_DIR",
             "cuda": "QERL_CUDA_CACHE_DIR"}


def cache_root(environ=None) -> Path | None:
    """The directory the caches live under, or None (QERL_COMPILE_CACHE=off: each library's default)."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(base).expanduser() / "qerl" / "compile"


def configure(environ=None) -> dict[str, str]:
    """Point each library's cache variable at its directory under cache_root (unless the user set it); returns the
    directories in use by library. A root that cannot be created is one line naming QERL_COMPILE_CACHE."""
    environ = os.environ if environ is None else environ
    root = cache_root(environ)
    if root is not None:
        for name, var in LIBRARIES.items():
            if not environ.get(var):
                path = root / name
                try:
                    path.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise QerlError(f"{ENV}: cannot create the compile cache {path} ({err.strerror or err}); set "
                                    f"{ENV} to a writable directory, or {ENV}=off") from None
                environ[var] = str(path)
    return {name: environ.get(var, "(library default)") for name, var in LIBRARIES.items()}


def dynamo_compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process (dynamo + inductor), 0 where torch does not say."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ()) or ()))


# our @triton.jit kernels' first launches in this process, each a compile or a load from Triton's disk cache
TRITON_JIT = {"seconds": 0.0, "kernels": 0, "by_kernel": {}}  # by_kernel: name -> {seconds, keys}
_TRITON_PENDING: dict[str, tuple[float, str]] = {}


@functools.cache  # once per process: a second install would chain the clock to itself
def install_triton_clock() -> bool:
    """Time every first launch of a @triton.jit kernel into TRITON_JIT, through Triton's JIT hooks (chained to any
    set before); once per process. False where this Triton has no such hooks. Inductor's kernels are not counted
    here: their compile is torch.compile's."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        before_cache, before_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def cache_hook(*, key, **kw):
        _TRITON_PENDING[str(key)] = (time.perf_counter(), getattr(kw.get("fn"), "name", "?"))
        return before_cache(key=key, **kw) if before_cache else None  # a true answer skips the compile

    def post_hook(*, key, **kw):
        pending = _TRITON_PENDING.pop(str(key), None)
        if pending is not None:
            seconds = time.perf_counter() - pending[0]
            TRITON_JIT["seconds"] += seconds
            TRITON_JIT["kernels"] += 1
            one = TRITON_JIT["by_kernel"].setdefault(pending[1], {"seconds": 0.0, "keys": []})
            one["seconds"] += seconds
            # Triton's key: each argument's type and specialization and the launch options (launch_pdl among
            # them), i.e. what made this compile a new one; its `repr` pairs the arguments with the wrong fields
            one["keys"].append(str(key))
        return before_post(key=key, **kw) if before_post else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = cache_hook, post_hook
    return True


class CompileClock:
    """Compile seconds by library since it started: torch.compile from dynamo's own metrics, humming from
    qerl.quant.kernels.humming_fp4's prepare timer (seconds waited; background compiles apart), our CUDA kernels
    from cuda_build's, our Triton kernels' JIT where install_triton_clock was called (the benchmarks do; 0
    otherwise); the rest of a slow first step (warm-up steps, captures) is what the caller's wall clock leaves."""

    def __init__(self):
        from qerl.quant.kernels import cuda_build, humming_fp4

        self._humming, self._cuda = humming_fp4.PREPARE, cuda_build.BUILDS
        self.start = time.perf_counter()
        self.dynamo0 = dynamo_compile_seconds()
        self.humming0, self.cuda0 = dict(self._humming), dict(self._cuda)
        self.triton0 = {"seconds": TRITON_JIT["seconds"], "kernels": TRITON_JIT["kernels"]}
        self.triton_by_kernel0 = {k: (len(v["keys"]), v["seconds"]) for k, v in TRITON_JIT["by_kernel"].items()}

    def summary(self) -> dict[str, float]:
        return {"wall_s": time.perf_counter() - self.start,
                "torch_compile_s": dynamo_compile_seconds() - self.dynamo0,
                "humming_prepare_s": self._humming["seconds"] - self.humming0["seconds"],
                "humming_background_s": self._humming["background"] - self.humming0["background"],
                "humming_kernels": self._humming["kernels"] - self.humming0["kernels"],
                "cuda_build_s": self._cuda["seconds"] - self.cuda0["seconds"],
                "triton_jit_s": TRITON_JIT["seconds"] - self.triton0["seconds"],
                "triton_kernels": TRITON_JIT["kernels"] - self.triton0["kernels"]}

    def triton_by_kernel(self) -> dict[str, dict]:
        """Our Triton kernels compiled since the clock started, by kernel: {name: {kernels, seconds, keys}}."""
        out = {}
        for name, v in TRITON_JIT["by_kernel"].items():
            n0, s0 = self.triton_by_kernel0.get(name, (0, 0.0))
            if len(v["keys"]) > n0:
                out[name] = {"kernels": len(v["keys"]) - n0, "seconds": v["seconds"] - s0, "keys": v["keys"][n0:]}
        return out


def report(times: dict, log) -> dict:
    """One `log` line when a rollout compiled for over a second (its first): what, and where it is kept; returns
    the seconds as stats. `times`: CompileClock.summary()."""
    t = {k: times.get(k, 0.0) for k in ("torch_compile_s", "humming_prepare_s", "humming_background_s", "cuda_build_s",
                                         "triton_jit_s")}
    spent = t["torch_compile_s"] + t["humming_prepare_s"] + t["cuda_build_s"] + t["triton_jit_s"]
    if spent > 1.0:
        log.info("rollout: %.1f s of this %.1f s call compiled: torch.compile of the decoder layers %.1f s, humming %d "
                 "kernels %.1f s waited (%.1f s in the background), qerl's CUDA kernels %.1f s, qerl's Triton kernels "
                 "%d specializations %.1f s (the rest: warm-up steps, captures); kept for later runs under %s", spent,
                 times["wall_s"], t["torch_compile_s"], times.get("humming_kernels", 0), t["humming_prepare_s"],
                 t["humming_background_s"], t["cuda_build_s"], times.get("triton_kernels", 0), t["triton_jit_s"],
                 cache_root() or "each library's default cache")
    return {"compile_torch_s": t["torch_compile_s"], "compile_humming_s": t["humming_prepare_s"],
            "compile_humming_background_s": t["humming_background_s"], "compile_cuda_s": t["cuda_build_s"],
            "compile_triton_s": t["triton_jit_s"]}
