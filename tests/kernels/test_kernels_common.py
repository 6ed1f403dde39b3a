"""grpo_kernels/kernels/host.py: one GPU-generation table for both tile tables; grpo_kernels/_testing.py: the one
set of test-only knobs."""
import pytest
import torch

from grpo_kernels import _testing
from grpo_kernels.kernels import host
from grpo_kernels.kernels.launch import recording


def test_one_generation_table_for_both_tile_tables():
    """Every capability from sm_80 to sm_121 maps to one tile key, and the fused-linear and row-sweep tables read
    the same key (they disagreed for sm_120 before: 80 for one, 90 for the other)."""
    from grpo_kernels.kernels import linear_tiles, logits_rows

    assert {c: host.generation_of(c).tiles for c in (80, 86, 89, 90, 100, 120)} == {
        80: 80, 86: 80, 89: 80, 90: 90, 100: 90, 120: 80}
    assert host.generation_of(75).tiles == 80 and host.generation_of(95).tiles == 90
    for arch in (80, 90):
        with recording(arch):
            tile, sms, _ = linear_tiles.launch_params("fwd", torch.bfloat16, torch.device("cuda"))
            rows = logits_rows.row_tiles("forward", torch.bfloat16, 151936, torch.device("cuda"))
        assert tile == linear_tiles.TILES[(arch, "fwd", "half")] and sms == host.GENERATIONS[arch].sms
        assert rows.block_v == (8192 if arch == 90 else 4096)
    assert host.cdiv(7, 2) == 4 and host.cdiv(0, 5) == 0 and host.cdiv(6, 3) == 2


def test_testing_override_nests_restores_and_rejects_unknown_knobs():
    from grpo_kernels.kernels import logits_rows

    assert _testing.knobs() == _testing.Knobs()
    with _testing.override(max_block_v=64):
        assert logits_rows.row_tiles("forward", torch.float32, 1000, torch.device("cpu")).block_v == 64
        with _testing.override(chunk_bytes=1):
            assert _testing.knobs() == _testing.Knobs(max_block_v=64, chunk_bytes=1)
        assert _testing.knobs().chunk_bytes is None
    assert _testing.knobs() == _testing.Knobs()
    assert logits_rows.row_tiles("forward", torch.float32, 1000, torch.device("cpu")).block_v == 1024
    with pytest.raises(TypeError, match="unknown override"):
        with _testing.override(max_block=64):
            pass
