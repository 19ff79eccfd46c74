"""The order in which a GEMM's programs take their output tiles (fp8_gemm.py, int8_gemm.py, moe_gemm.py).

Programs run GROUP_M row tiles of one column tile after another, then the next column tile: the tiles
running at the same time share their B (weight) tile, read from DRAM once and from L2 by the others,
and GROUP_M rows of A. Inlined by Triton into each kernel (a jit function called from a jit function).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` among tiles_m x tiles_n."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m, pid_n
