"""Atomic outputs: owned temporaries, removal of a killed writer's leftovers, umask-honouring modes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qerl.io import atomic_dir, atomic_write_text, owner_tag, process_alive, remove_stale_temporaries

# A stage that dies (SIGKILL, as a scheduler or OOM killer would) while writing its output.
KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from qerl.io import atomic_dir
with atomic_dir(sys.argv[1]) as tmp:
    (Path(tmp) / "model.safetensors").write_bytes(b"x" * 4096)
    print(tmp, flush=True)
    time.sleep(60)
"""


def killed_writer_leftover(target: Path) -> Path:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    tmp = Path(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert tmp.is_dir() and tmp.name.startswith(f".{target.name}.{socket.gethostname()}.{proc.pid}.")
    return tmp


def test_the_next_write_removes_a_killed_writers_temporary_and_keeps_a_live_one(tmp_path):
    target = tmp_path / "model"
    dead = killed_writer_leftover(target)
    other_host = tmp_path / f".model.otherhost.{os.getpid()}.1.abcd1234.tmp"
    other_target = tmp_path / f".model.json.{socket.gethostname()}.999999999.1.abcd1234.tmp"
    old_style = tmp_path / ".model.k2j4h5g6.tmp"  # from before owners were recorded: unknown owner
    for p in (other_host, other_target, old_style):
        p.mkdir()
    with atomic_dir(target) as live:
        (live / "w.bin").write_bytes(b"1")
        # a concurrent writer of the same target (alive: this process) must keep its temporary
        assert remove_stale_temporaries(target) == [] and live.is_dir()
    assert not dead.exists(), "the killed stage's temporary outlived the next write"
    assert (target / "w.bin").read_bytes() == b"1"
    assert other_host.exists() and other_target.exists() and old_style.exists()


def test_a_killed_atomic_write_text_leaves_a_temporary_the_next_write_removes(tmp_path):
    target = tmp_path / "eval.json"
    stale = tmp_path / f".eval.json.{socket.gethostname()}.{dead_pid()}.123.abcd_123.tmp"
    stale.write_text("half")
    journal = stale.with_name(stale.name + "-journal")  # beside a killed SQLite writer's temporary database
    journal.write_text("j")
    atomic_write_text(target, "{}")
    assert not stale.exists() and not journal.exists() and target.read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]


def test_a_reused_pid_does_not_make_a_dead_writer_look_alive(tmp_path):
    host, pid, start = owner_tag().rsplit(".", 2)
    assert process_alive(int(pid), start)
    assert not process_alive(int(pid), str(int(start) + 1)), "same pid, other start time: another process"
    reused = tmp_path / f".out.{host}.{pid}.{int(start) + 1}.abcdefgh.tmp"
    reused.write_text("x")
    assert remove_stale_temporaries(tmp_path / "out") == [reused]


def test_replacing_an_existing_output_leaves_no_sibling_behind(tmp_path):
    target = tmp_path / "merged"
    for content in (b"old", b"new"):
        with atomic_dir(target) as tmp:
            (tmp / "w.bin").write_bytes(content)
    assert (target / "w.bin").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_outputs_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    deadline = time.time() + 5
    while process_alive(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    return proc.pid


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_weights_written_0600_inside_an_atomic_dir_get_the_umask_mode(tmp_path, umask):
    """transformers' save_pretrained makes model.safetensors 0600 (mkstemp); the output must read like open()'s."""
    import tempfile

    old = os.umask(umask)
    try:
        with atomic_dir(tmp_path / "adapter") as tmp:
            fd, name = tempfile.mkstemp(dir=tmp)  # 0600, as the weight writers make it
            os.close(fd)
            os.replace(name, tmp / "adapter_model.safetensors")
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "model.safetensors").write_bytes(b"w")
            os.chmod(tmp / "sub" / "model.safetensors", 0o600)
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            os.chmod(tmp / "run.sh", 0o700)
    finally:
        os.umask(old)
    out = tmp_path / "adapter"
    assert (out / "adapter_model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (out / "sub" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (out / "sub").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (out / "run.sh").stat().st_mode & 0o777 == 0o777 & ~umask  # execute bits kept


def test_a_saved_model_in_an_atomic_dir_honours_the_umask(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "m") as tmp:
            model.save_pretrained(tmp)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "m").iterdir()}
    assert set(modes.values()) == {"0o644"}, modes
