"""The bit tricks of the low-bit GEMVs' inline PTX, emulated in Python on every input they
can see (the interpreter runs no PTX, so the kernels' CPU tests take the plain-Triton
conversions; the GPU tests compare both). The PTX lines emulated here are asserted to be
the kernels' own."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from kvflow.kernels import gemv_w4, gemv_w8


def prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 d, a, b, sel (default mode): byte i of d is byte sel[4i+3:4i] of {b, a}."""
    src = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def lop3_ea(a: int, b: int, c: int) -> int:
    return (a & b) | c  # LUT 0xEA


def bf16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).__lshift__(16).view(torch.float32))


def f16_bits(v: float) -> int:
    return int(np.array([v], dtype=np.float16).view(np.uint16)[0])


def f16(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def to_bf16_scaled(h: int) -> int:
    """The f16 pair -> bf16 bits move of both 8-bit conversions."""
    return lop3_ea(h >> 3, 0x0FFF0FFF, h & 0x80008000)


def test_the_emulated_lines_are_the_kernels():
    w4 = inspect.getsource(gemv_w4._planes_asm.fn)
    for line in ("prmt.b32 lo, $8, $9, 0x5410", "prmt.b32 hi, $8, $9, 0x7632",
                 "lop3.b32 $0, lo, 0x000F000F, 0x43004300, 0xEA", "shr.u32 t, lo, 4"):
        assert line in w4
    w8 = inspect.getsource(gemv_w8._int8_operand.fn) + inspect.getsource(
        gemv_w8._fp8_operand.fn)
    for line in ("xor.b32 u, w, 0x8080", "prmt.b32 a, u, c, 0x4140", "mov.b32 c, 0x64806480",
                 "shr.u32 t, a, 3", "and.b32 s, a, 0x80008000",
                 "lop3.b32 $0, t, 0x0FFF0FFF, s, 0xEA", "mov.b32 c, 0x64646464"):
        assert line in w8
    assert gemv_w8.ASM_SCALE == 2.0 ** 112


def test_int4_planes_are_128_plus_each_nibble():
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 2**32, size=(500, 2), dtype=np.uint64).tolist():
        lo, hi = prmt(a, b, 0x5410), prmt(a, b, 0x7632)
        for j in range(8):
            src = lo if j < 4 else hi
            out = lop3_ea(src >> 4 * (j % 4), 0x000F000F, 0x43004300)
            assert bf16(out & 0xFFFF) == 128 + ((a >> 4 * j) & 15)  # element a: low half
            assert bf16(out >> 16) == 128 + ((b >> 4 * j) & 15)


def test_every_int8_pair_becomes_its_value_times_2_to_the_minus_112():
    for b0 in range(-128, 128):
        for b1 in (-128, -77, -1, 0, 1, 64, 127):
            w = (b0 & 255) | (b1 & 255) << 8  # the 16-bit input register
            a = prmt(w ^ 0x8080, 0x64646464, 0x4140)  # {1024 + u0, 1024 + u1} as f16
            a = f16_bits(f16(a & 0xFFFF) - 1152) | f16_bits(f16(a >> 16) - 1152) << 16
            out = to_bf16_scaled(a)
            assert bf16(out & 0xFFFF) * 2.0 ** 112 == b0
            assert bf16(out >> 16) * 2.0 ** 112 == b1


def test_every_e4m3_value_becomes_itself_times_2_to_the_minus_112():
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for v in vals:
        if v != v:  # NaN codes: no weight quantizes to them
            continue
        out = to_bf16_scaled(f16_bits(v) | f16_bits(-v) << 16)  # cvt.rn.f16x2.e4m3x2: exact
        assert bf16(out & 0xFFFF) * 2.0 ** 112 == v
        assert bf16(out >> 16) * 2.0 ** 112 == -v
