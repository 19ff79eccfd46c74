"""Exact FP8 conversions for the Triton interpreter, so kernels that write e4m3 can be compared bit for bit.

Triton 3.6's interpreter converts float32 to fp8 with its own bit arithmetic, which drops the carry when
rounding up overflows the mantissa (126.0 becomes 64 in e4m3, not 128) and truncates subnormals. The GPU
converts with cvt.rn.satfinite (round to nearest even), exactly as torch's .to(float8_e4m3fn) does, so
the tests route the interpreter's fp32/fp16 -> fp8 conversions through torch. Nothing else changes: the
other direction and every other dtype still use the interpreter's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def exact_fp8_casts() -> Iterator[None]:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter._convert_float
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    floats = {tl.float32: np.float32, tl.float16: np.float16}

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if output_dtype not in fp8 or input_dtype not in floats:
            return original(values, input_dtype, output_dtype, rounding_mode)
        src = torch.from_numpy(np.ascontiguousarray(values).view(floats[input_dtype]))
        return src.to(fp8[output_dtype]).view(torch.uint8).numpy()

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
