"""Build and launch CUDA C without a torch extension: a cubin from nvcc or NVRTC (libnvrtc and the CUDA headers ship
with CUDA builds of torch), loaded into torch's context and launched through the driver API on torch's current
stream (with programmatic dependent launch where asked). Used by kernels.cuda_fp4; no triton, no qerl imports.
With QERL_CUDA_CACHE_DIR set (qerl.compile_cache.configure sets it under the compile-cache root) a cubin is kept
there, keyed by its source, arch and compiler binary, so later processes and other ranks load it instead of
compiling it again (seconds of nvcc per process).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from qerl.io import atomic_file


def _find_nvrtc() -> tuple[Path, Path] | None:
    """libnvrtc and the include dir with cuda_bf16.h: the CUDA torch wheel's nvidia package, else CUDA_HOME."""
    roots = [Path(torch.__file__).parent.parent / "nvidia"]
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    for root in roots:
        if not root.exists():
            continue
        libs = [lib for lib in sorted(root.glob("**/libnvrtc.so*"))
                if "builtins" not in lib.name and ".alt." not in lib.name]
        heads = sorted(root.glob("**/cuda_bf16.h"))
        if libs and heads:
            return libs[0], heads[0].parent
    return None


def _find_nvcc(nvcc: str | None = None) -> str | None:
    nvcc = nvcc or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return nvcc if Path(nvcc).exists() or shutil.which(nvcc) else None


def compilers() -> list[str]:
    """The CUDA compilers `compile_cubin` can use here, in its order of preference: "nvcc", "nvrtc"."""
    return [name for name, found in (("nvcc", _find_nvcc()), ("nvrtc", _find_nvrtc())) if found is not None]


def _compile_nvrtc(source: str, arch: str, found: tuple[Path, Path] | None) -> bytes:
    """found: _find_nvrtc()'s answer (the caller looked it up already, to key the cache)."""
    if found is None:
        raise RuntimeError("NVRTC not found (no libnvrtc.so + cuda_bf16.h in torch's nvidia package or CUDA_HOME)")
    lib_path, include = found
    lib = ctypes.CDLL(str(lib_path))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"qerl_fp4.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), f"-I{include}".encode(), b"--std=c++17"]
    try:
        if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.value.decode(errors='replace').strip().splitlines()[:3]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


CACHE_ENV = "QERL_CUDA_CACHE_DIR"
BUILDS = {"seconds": 0.0, "compiled": 0, "loaded": 0}  # this process's cubins (qerl.compile_cache.CompileClock)


def compile_cubin(source: str, arch: str, compiler: str = "auto", nvcc: str | None = None) -> bytes:
    """A cubin of `source` for `arch` (e.g. sm_90): nvcc when there is one (auto, nvcc), else NVRTC (auto, nvrtc);
    one clear error when neither is there or the source does not build. Kept in / loaded from $QERL_CUDA_CACHE_DIR
    when that is set."""
    nvcc_path = _find_nvcc(nvcc) if compiler in ("auto", "nvcc") else None
    if nvcc_path is None and compiler == "nvcc":
        raise RuntimeError(f"nvcc not found (looked on PATH and at {nvcc or '/usr/local/cuda/bin/nvcc'})")
    if nvcc_path is not None:
        found, binary = None, shutil.which(nvcc_path) or nvcc_path
    else:  # _find_nvrtc searches torch's nvidia package recursively: once, for the cache key and the build
        found = _find_nvrtc()
        binary = str(found[0]) if found is not None else None
    cached = _cache_file(source, arch, binary)
    if cached is not None:
        try:
            cubin = cached.read_bytes()
        except OSError:
            cubin = b""
        if cubin[:4] == b"\x7fELF":  # else absent, or cut short: compile again and replace it
            BUILDS["loaded"] += 1
            return cubin
    start = time.perf_counter()
    cubin = _compile_nvcc(source, arch, nvcc_path) if nvcc_path is not None else _compile_nvrtc(source, arch, found)
    BUILDS["seconds"] += time.perf_counter() - start
    BUILDS["compiled"] += 1
    if cached is not None:
        _store(cached, cubin)
    return cubin


def _cache_file(source: str, arch: str, binary: str | None) -> Path | None:
    """Where $QERL_CUDA_CACHE_DIR keeps this build: the key covers the source, the arch and the compiler binary
    (its path, size and mtime: another or an upgraded compiler builds anew). None: no cache set, or no compiler."""
    root = os.environ.get(CACHE_ENV, "").strip()
    if not root or binary is None:
        return None
    try:
        st = Path(binary).stat()
    except OSError:
        return None
    ident = f"{Path(binary).resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256("\0".join((source, arch, ident)).encode()).hexdigest()[:32]
    return Path(root).expanduser() / f"{key}-{arch}.cubin"


def _store(path: Path, cubin: bytes) -> None:
    """Write atomically (ranks building together write the same bytes; a reader never sees half a file); a cache
    that cannot be written is skipped: the next process compiles again."""
    try:
        with atomic_file(path) as tmp:
            tmp.write_bytes(cubin)
    except OSError:
        pass


def _compile_nvcc(source: str, arch: str, nvcc_path: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "qerl_fp4.cu"), Path(tmp, "qerl_fp4.cubin")
        src.write_text(source)
        proc = subprocess.run([nvcc_path, "-cubin", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise RuntimeError(f"nvcc failed: {proc.stderr.strip().splitlines()[:3]}")
        return out.read_bytes()


class CudaModule:
    """A cubin loaded into torch's CUDA context of one device (default: the current one); `launch` runs one of its
    kernels on that device's current stream (the caller makes the device current)."""

    def __init__(self, cubin: bytes, names: list[str], device_index: int | None = None):
        self.device_index = torch.cuda.current_device() if device_index is None else device_index
        with torch.cuda.device(self.device_index):
            torch.zeros(1, device=f"cuda:{self.device_index}")  # torch's primary context is current
            self._cuda = ctypes.CDLL("libcuda.so.1")
            self._cubin = cubin
            self._mod = ctypes.c_void_p()
            self._check(self._cuda.cuModuleLoadData(ctypes.byref(self._mod), cubin), "cuModuleLoadData")
        self.functions = {}
        for name in names:
            fn = ctypes.c_void_p()
            self._check(self._cuda.cuModuleGetFunction(ctypes.byref(fn), self._mod, name.encode()),
                        f"cuModuleGetFunction({name})")
            self.functions[name] = fn

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise RuntimeError(f"{what} returned CUDA error {code}")

    def occupancy(self, name: str, block: int) -> int:
        """Resident CTAs per SM of kernel `name` at `block` threads (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
        n = ctypes.c_int()
        self._check(self._cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.functions[name],
                                                                           block, ctypes.c_size_t(0)),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
        return n.value

    def launch(self, name: str, grid: tuple[int, int], block: int, args: list, pdl: bool = False) -> None:
        """pdl: programmatic dependent launch (sm_90+): the kernel may start while the previous kernel on the stream
        finishes and waits for it with griddepcontrol.wait before touching its output."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not pdl:
            self._check(self._cuda.cuLaunchKernel(self.functions[name], grid[0], grid[1], 1, block, 1, 1, 0, stream,
                                                  params, None), f"cuLaunchKernel({name})")
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.int_value = 1
        config = _LaunchConfig(grid[0], grid[1], 1, block, 1, 1, 0, stream, ctypes.pointer(attr), 1)
        self._check(self._cuda.cuLaunchKernelEx(ctypes.byref(config), self.functions[name], params, None),
                    f"cuLaunchKernelEx({name})")


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class _LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("int_value", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]
