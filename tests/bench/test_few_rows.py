"""bench.few_rows' A/B of few-row CUDA kernel sources: which source each alternate builds from, and that the shipped
kernel's module, source and caches are back afterwards (no GPU: the module builder is replaced)."""
from __future__ import annotations

import pytest
import torch

from bench import few_rows
from qerl.quant.kernels import cuda_fp4


@pytest.fixture
def builds(monkeypatch):
    """The sources the alternates compile, in order; _module's builder returns a tag instead of a cubin."""
    seen = []

    def build(dev):
        seen.append((cuda_fp4.source(), dev))
        return f"module{len(seen)}"

    shipped = cuda_fp4._module
    monkeypatch.setattr(shipped, "__wrapped__", build, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(few_rows, "_ALT_MODULES", {})
    return seen, shipped


def test_defines_go_in_front_of_the_shipped_source_once(builds):
    seen, shipped = builds
    for _ in range(2):
        with few_rows.cuda_source("+QERL_EXAMPLE=3+FLAG"):
            assert cuda_fp4._module(0) == "module1"
    assert len(seen) == 1  # compiled once for both uses
    text, dev = seen[0]
    assert dev == 0 and text == "#define QERL_EXAMPLE 3\n#define FLAG 1\n" + cuda_fp4.source()
    assert cuda_fp4._module is shipped and not cuda_fp4.source().startswith("#define")
    assert few_rows.source_label("+QERL_EXAMPLE=3") == "cuda:QERL_EXAMPLE=3"


def test_a_file_is_built_from_its_own_text(builds, tmp_path):
    seen, shipped = builds
    other = tmp_path / "old.cu"
    other.write_text(cuda_fp4.SOURCE_FILE.read_text().replace("Hand-written", "An older hand-written"))
    with few_rows.cuda_source(str(other)):
        assert cuda_fp4._module(0) == "module1"
    assert "An older hand-written" in seen[0][0] and "// QERL_DECODE8\n" not in seen[0][0]  # markers filled
    assert cuda_fp4.SOURCE_FILE.name == "fp4_gemv.cu" and "An older" not in cuda_fp4.source()
    assert cuda_fp4._module is shipped and few_rows.source_label(str(other)) == "cuda:old"


def test_none_is_the_shipped_kernel(builds):
    seen, shipped = builds
    with few_rows.cuda_source(None):
        assert cuda_fp4._module is shipped
    assert not seen


def test_mid_configs_time_each_tile_at_the_split_counts_the_few_row_rule_picks(monkeypatch):
    """One config per distinct split of tiling.pick_split at 2 and 6 waves (bench.kernels.split_counts, shared with
    the sweep, which also times split 1); on a faked 132-SM device."""
    import math

    from bench.kernels import split_counts
    from qerl.quant.kernels import tiling

    monkeypatch.setattr(tiling, "target_programs", lambda device: 264)
    m, n, k = 32, 37888, 3584
    configs = list(few_rows.mid_configs(m, n, k))
    for bm, bn, bk, warps, stages, maxnreg in few_rows.MID_TILES:
        bk = tiling.k_block(k, bk)
        tiles, k_tiles = math.ceil(m / bm) * math.ceil(n / bn), math.ceil(k / bk)
        want = sorted({tiling.pick_split(tiles, k_tiles, torch.device("cuda"), waves=w) for w in (2, 6)})
        got = [c.split for _, c in configs if (c.bm, c.bn, c.bk, c.warps, c.stages, c.maxnreg) ==
               (bm, bn, bk, warps, stages, maxnreg)]
        assert got == want
    assert split_counts(4, 64, one=True)[0] == 1 and 1 not in split_counts(4, 64)
