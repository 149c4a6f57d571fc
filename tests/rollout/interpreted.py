"""Triton kernels tested on CPU through Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when the
kernels are defined, so it cannot be switched on inside this pytest process).

    errors = run_interpreted(BODY)   # BODY: Python that prints one JSON line last; returns it parsed
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, sys
import torch
from triton.runtime import interpreter
original = interpreter._patch_lang_tensor
def patched(tensor, scope):  # Triton 3.6's interpreter int()s (1,)-shaped program ids, which numpy 2 refuses
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = patched
sys.path.insert(0, sys.argv[1])
"""


def run_interpreted(body: str, timeout: int = 600):
    """Run PRELUDE + body under TRITON_INTERPRET=1 with the repository importable; the last stdout line as JSON."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(REPO)], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
