"""qerl.compile_cache: one root for the inductor, Triton and humming caches; the user's own variables win."""
from __future__ import annotations

import types

import pytest

from qerl import compile_cache
from qerl.errors import QerlError


def test_default_root_is_under_xdg_cache_home_and_every_library_gets_its_directory(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    where = compile_cache.configure(env)
    root = tmp_path / "xdg" / "qerl" / "compile"
    assert where == {name: str(root / name) for name in compile_cache.LIBRARIES}
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor") and (root / "humming").is_dir()
    assert env["TRITON_CACHE_DIR"] == str(root / "triton") and env["HUMMING_CACHE_DIR"] == str(root / "humming")


def test_home_is_the_fallback_and_a_named_root_wins(tmp_path):
    env = {"HOME": str(tmp_path / "home")}
    assert compile_cache.cache_root(env) == tmp_path / "home" / ".cache" / "qerl" / "compile"
    env = {"HOME": str(tmp_path / "home"), compile_cache.ENV: str(tmp_path / "shared")}
    compile_cache.configure(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "triton")


def test_a_variable_the_user_set_is_kept_and_off_leaves_the_library_defaults(tmp_path):
    env = {"HOME": str(tmp_path), "TRITON_CACHE_DIR": "/mine"}
    where = compile_cache.configure(env)
    assert env["TRITON_CACHE_DIR"] == "/mine" and where["triton"] == "/mine"
    assert env["HUMMING_CACHE_DIR"].startswith(str(tmp_path))
    env = {"HOME": str(tmp_path), compile_cache.ENV: "off"}
    assert compile_cache.configure(env) == dict.fromkeys(compile_cache.LIBRARIES, "(library default)")
    assert set(env) == {"HOME", compile_cache.ENV}


def test_a_root_that_cannot_be_created_is_one_line_naming_the_variable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(QerlError, match="QERL_COMPILE_CACHE: cannot create the compile cache"):
        compile_cache.configure({"HOME": str(tmp_path), compile_cache.ENV: str(blocker / "sub")})


def test_the_triton_clock_times_first_launches_and_chains_the_hooks_set_before(monkeypatch):
    """Triton calls jit_cache_hook before a kernel's first-launch compile (a true answer skips it) and
    jit_post_compile_hook after: the clock counts the time between, per key, and passes both calls on."""
    knobs = pytest.importorskip("triton").knobs
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("cache", kw["key"])) or None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("post", kw["key"])))
    compile_cache.install_triton_clock.cache_clear()
    monkeypatch.setattr(compile_cache, "TRITON_JIT", {"seconds": 0.0, "kernels": 0, "by_kernel": {}})
    assert compile_cache.install_triton_clock() and compile_cache.install_triton_clock()  # once: no double chain
    fn = types.SimpleNamespace(name="_mm_kernel", module="qerl.x")  # Triton's JitFunctionInfo
    knobs.runtime.jit_cache_hook(key=("k", 0), repr="f(M: i32)", fn=fn)  # before the clock: not in its summary
    knobs.runtime.jit_post_compile_hook(key=("k", 0), repr="f(M: i32)", fn=fn)
    clock = compile_cache.CompileClock()
    assert knobs.runtime.jit_cache_hook(key=("k", 1), repr="f(M: i32D)", fn=fn) is None  # None: Triton compiles
    knobs.runtime.jit_post_compile_hook(key=("k", 1), repr="f(M: i32D)", fn=fn)
    knobs.runtime.jit_post_compile_hook(key=("other",), repr="g")  # never started here (inductor's): not counted
    summary = clock.summary()
    assert summary["triton_kernels"] == 1 and 0 <= summary["triton_jit_s"] < 5
    by = clock.triton_by_kernel()
    assert list(by) == ["_mm_kernel"] and by["_mm_kernel"]["kernels"] == 1 and by["_mm_kernel"]["keys"] == [
        str(("k", 1))]
    assert seen == [("cache", ("k", 0)), ("post", ("k", 0)), ("cache", ("k", 1)), ("post", ("k", 1)),
                    ("post", ("other",))]
    compile_cache.install_triton_clock.cache_clear()  # the hooks go back with monkeypatch: so does the once-flag
