"""qerl.quant.kernels.cuda_build's cubin cache, on the CPU with a stand-in nvcc (a script that writes an ELF-headed
file and counts its runs): a kept cubin is loaded instead of compiled, and any change of source, arch or compiler
builds anew."""
from __future__ import annotations

import stat

import pytest

from qerl import compile_cache
from qerl.quant.kernels import cuda_build

FAKE_NVCC = """#!/bin/sh
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; shift; fi
  src="$1"; shift
done
echo run >> "$(dirname "$0")/runs"
printf '\\177ELF' > "$out"
cat "$src" >> "$out"
"""


@pytest.fixture
def nvcc(tmp_path, monkeypatch):
    path = tmp_path / "bin" / "nvcc"
    path.parent.mkdir()
    path.write_text(FAKE_NVCC)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(cuda_build, "_find_nvcc", lambda nvcc=None: str(path))
    monkeypatch.setattr(cuda_build, "BUILDS", {"seconds": 0.0, "compiled": 0, "loaded": 0})

    def runs():
        log = path.parent / "runs"
        return len(log.read_text().splitlines()) if log.exists() else 0
    return path, runs


def test_a_kept_cubin_is_loaded_and_a_new_source_arch_or_compiler_compiles(nvcc, tmp_path, monkeypatch):
    path, runs = nvcc
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path / "cache"))
    first = cuda_build.compile_cubin("kernel A", "sm_90")
    assert first == b"\x7fELFkernel A" and runs() == 1
    assert cuda_build.compile_cubin("kernel A", "sm_90") == first and runs() == 1  # loaded
    assert cuda_build.BUILDS["compiled"] == 1 and cuda_build.BUILDS["loaded"] == 1
    cuda_build.compile_cubin("kernel B", "sm_90")
    cuda_build.compile_cubin("kernel A", "sm_89")
    assert runs() == 3
    path.write_text(FAKE_NVCC + "# upgraded\n")  # another compiler binary: its size and mtime differ
    assert cuda_build.compile_cubin("kernel A", "sm_90") == first and runs() == 4
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 4 and not list((tmp_path / "cache").glob("*.tmp"))


def test_without_a_cache_every_call_compiles_and_a_bad_file_is_replaced(nvcc, tmp_path, monkeypatch):
    _, runs = nvcc
    monkeypatch.delenv(cuda_build.CACHE_ENV, raising=False)
    cuda_build.compile_cubin("kernel", "sm_90")
    cuda_build.compile_cubin("kernel", "sm_90")
    assert runs() == 2
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path / "cache"))
    cuda_build.compile_cubin("kernel", "sm_90")
    (kept,) = (tmp_path / "cache").glob("*.cubin")
    kept.write_bytes(b"\x7fE")  # cut short (a crash mid-write elsewhere): compiled again, then loaded
    assert cuda_build.compile_cubin("kernel", "sm_90") == b"\x7fELFkernel" and runs() == 4
    assert kept.read_bytes() == b"\x7fELFkernel"
    cuda_build.compile_cubin("kernel", "sm_90")
    assert runs() == 4


def test_a_cache_that_cannot_be_written_still_gives_the_cubin(nvcc, tmp_path, monkeypatch):
    _, runs = nvcc
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(cuda_build.CACHE_ENV, str(blocker / "cache"))
    assert cuda_build.compile_cubin("kernel", "sm_90") == b"\x7fELFkernel" and runs() == 1


def test_configure_puts_the_cubins_under_the_compile_cache_root(tmp_path):
    env = {"HOME": str(tmp_path)}
    where = compile_cache.configure(env)
    assert env[cuda_build.CACHE_ENV] == where["cuda"] == str(tmp_path / ".cache" / "qerl" / "compile" / "cuda")
