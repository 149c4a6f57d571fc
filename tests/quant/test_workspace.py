"""kernels.workspace: scratch buffers that only grow and outlive the graphs captured over them."""
import torch

from qerl.quant.kernels import workspace


def test_scratch_grows_by_doubling_and_keeps_what_it_outgrew(monkeypatch):
    monkeypatch.setattr(workspace, "_HELD", {})
    monkeypatch.setattr(workspace, "_RETIRED", [])
    cpu = torch.device("cpu")
    first = workspace.scratch("t.cnt", cpu, 10, torch.int32, zeroed=True, minimum=16)
    assert first.numel() == 16 and first.dtype == torch.int32 and not first.any()
    assert workspace.scratch("t.cnt", cpu, 16, torch.int32, zeroed=True, minimum=16) is first  # fits: the same
    assert workspace.held("t.cnt", cpu) is first
    grown = workspace.scratch("t.cnt", cpu, 17, torch.int32, zeroed=True, minimum=16)
    assert grown.numel() == 32 and not grown.any()  # doubled, not just enough
    assert workspace.scratch("t.cnt", cpu, 100, torch.int32, zeroed=True, minimum=16).numel() == 100  # need wins
    assert [t.numel() for t in workspace._RETIRED] == [16, 32]  # a captured graph may still address them
    assert workspace.retired_bytes() == (16 + 32) * 4
    other = workspace.scratch("t.part", cpu, 5, torch.float32, minimum=8)
    assert other.numel() == 8 and other.dtype == torch.float32 and workspace.held("t.cnt", cpu).numel() == 100
    assert workspace.held("nothing", cpu) is None


INTERPRETED_SPLIT_K = """
    from qerl.quant.kernels import triton_fp4, workspace
    gen = torch.Generator().manual_seed(0)
    out = []
    for split in (1, 3, 4):
        x = torch.randn(5, 512, generator=gen)
        w = torch.randn(40, 512, generator=gen)
        runs = [triton_fp4.small_matmul(x, w, split=split) for _ in range(2)]  # the second on re-armed counters
        exact = x.double() @ w.double().T
        counters = workspace.held("triton_fp4.arrivals", x.device)
        out.append([float((r.double() - exact).abs().max()) for r in runs] + [int(counters.abs().sum())])
    print(json.dumps(out))
"""


def test_split_k_tiles_finish_on_the_last_arrival_and_leave_the_counters_at_zero():
    """Triton's interpreter: small_matmul split 1 / 3 / 4 ways along K matches float64 twice in a row (the last
    program of each tile adds the partials, then re-arms its counter: all counters 0 after each launch)."""
    from tests.rollout.interpreted import run_interpreted

    results = run_interpreted(INTERPRETED_SPLIT_K, timeout=300)
    assert len(results) == 3
    for first, second, counters in results:
        assert first < 1e-4 and second < 1e-4 and counters == 0
