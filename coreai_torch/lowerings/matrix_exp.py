"""``linalg_matrix_exp`` as ATen's CPU kernel computes it (``mexp`` in
``aten/src/ATen/native/LinearAlgebra.cpp``): the optimized Taylor polynomials of degree
1, 2, 4, 8, 12 and 18 of Bader, Blanes and Casas (2019), evaluated with few matrix products,
and scaling and squaring for larger norms.

* One matrix (batch size 1 after flattening): the degree follows the matrix's 1-norm (the
  smallest whose threshold ``θ`` covers it); above ``θ₁₂``, ``T₁₈(A / 2^s)`` squared ``s``
  times with ``s = max(ceil(log2(‖A‖₁ / θ₁₈)), 0)``.  A NaN norm gives NaN.
* Several matrices: every one takes the ``T₁₈`` scaling-and-squaring path (ATen does too).

The squarings run in one ``coreai.while`` over the batch, each matrix stopping after its own
``s`` (``helpers.loops.elementwise_loop``).  1x1 matrices are ``exp``.  float16/bfloat16 compute in
float32 and round once (PyTorch's own CPU kernel overflows there).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    add,
    all_of,
    cast,
    constant,
    div,
    dtype_of,
    greater,
    i32,
    known_sizes,
    less,
    mul,
    not_nan,
    pick,
    reshape,
    shape_of,
    static_shape_of,
)
from coreai_torch.lowerings.helpers.arithmetic import ceil_values
from coreai_torch.lowerings.helpers.loops import elementwise_loop
from coreai_torch.lowerings.helpers.matrices import matrix_product
from coreai_torch.lowerings.registry import LoweringContext, lowering

#: θ for degrees 1, 2, 4, 8, 12, 18 (float32, float64)
THETAS = {
    torch.float32: [1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                    5.800524627688768e-01, 1.461661507209034e00, 3.010066362817634e00],
    torch.float64: [2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                    4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e00],
}  # fmt: skip

_T12 = [
    [9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740],
    [5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031,
     0.01108844528519167989],
    [0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968,
     0.00610700528898058230],
    [-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359],
]  # fmt: skip
_T18 = [
    [0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03,
     -8.92138498045867084140e-04, 0.0],
    [0.0, 3.97849749499645077844e-01, 1.36783778460411720168e00,
     4.98289622525382669416e-01, -6.37898194594723280150e-04],
    [-1.09676396052962061844e01, 1.68015813878906206114e00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05],
    [-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05],
    [0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02,
     -1.40086798182036094347e-05],
]  # fmt: skip

#: enough squarings for any finite float64 norm (2^1100 > 1.8e308 / θ)
SQUARING_LIMIT = 1100


def _combination(matrices: list[ir.Value], coefficients: list[float]) -> ir.Value:
    """``Σ cᵢ Mᵢ`` with every term kept (a zero coefficient still multiplies, like ATen)."""
    out = mul(matrices[0], coefficients[0])
    for m, c in zip(matrices[1:], coefficients[1:], strict=True):
        out = add(out, mul(m, c))
    return out


def _powers(a: ir.Value, count: int) -> list[ir.Value]:
    """``[I, A, A², A³, A⁶][:count]`` (ATen's ``_fill_matrix_powers``)."""
    n = static_shape_of(a)[-1]
    out = [constant(np.eye(n), dtype_of(a)), a]
    if count > 2:
        out.append(matrix_product(a, a))
    if count > 3:
        out.append(matrix_product(a, out[2]))
    if count > 4:
        out.append(matrix_product(out[3], out[3]))
    return out


def taylor(a: ir.Value, degree: int) -> ir.Value:
    """ATen's ``compute_T{degree}``."""
    if degree == 1:
        i, a1 = _powers(a, 2)
        return add(i, a1)
    if degree == 2:
        i, a1, a2 = _powers(a, 3)
        return add(add(i, a1), div(a2, 2.0))
    if degree == 4:
        i, a1, a2 = _powers(a, 3)
        a4 = matrix_product(a2, _combination([i, a1, a2], [1 / 2.0, 1 / 6.0, 1 / 24.0]))
        return _combination([i, a1, a2, a4], [1.0, 1.0, 0.0, 1.0])
    if degree == 8:
        s = 0.1330413469565007072504e2
        x3 = 2.0 / 3.0
        x1, x2 = x3 * ((1.0 + s) / 88.0), x3 * ((1.0 + s) / 352.0)
        x4 = (-271.0 + 29.0 * s) / (315.0 * x3)
        x5 = (-11.0 + 11.0 * s) / (1260.0 * x3)
        x6 = (-99.0 + 11.0 * s) / (5040.0 * x3)
        x7 = (89.0 - s) / (5040.0 * x3)
        y2 = (857.0 - 58.0 * s) / 630.0
        i, a1, a2 = _powers(a, 3)
        a4 = matrix_product(a2, _combination([a1, a2], [x1, x2]))
        a8 = matrix_product(
            _combination([a2, a4], [x3, 1.0]), _combination([i, a1, a2, a4], [x4, x5, x6, x7])
        )
        return _combination([i, a1, a2, a4, a8], [1.0, 1.0, y2, 0.0, 1.0])
    if degree == 12:
        powers = _powers(a, 4)
        b = [_combination(powers, row) for row in _T12]
        a6 = add(b[2], matrix_product(b[3], b[3]))
        return add(b[0], matrix_product(add(b[1], a6), a6))
    powers = _powers(a, 5)
    b = [_combination(powers, row) for row in _T18]
    a9 = add(b[3], matrix_product(b[0], b[4]))
    return add(b[1], matrix_product(add(b[2], a9), a9))


def _scaled_and_squared(a: ir.Value, norm: ir.Value, theta: float) -> ir.Value:
    """``T₁₈(A / 2^s)`` squared ``s`` times per matrix (ATen's ``compute_T18_scale_square``)."""
    s = ceil_values(div(cai.log(div(norm, theta)), math.log(2.0)))
    s = pick(less(s, 0.0), 0.0, s, s)
    scaled = div(a, cai.broadcasting_pow(constant(2.0, dtype_of(a)), s))
    start = taylor(scaled, 18)

    def step(i: ir.Value, values: list[ir.Value]) -> tuple[list[ir.Value], ir.Value]:
        (m,) = values
        done = cast(cai.add(i, cai.constant(np.int32(1))), dtype_of(s))
        return [matrix_product(m, m)], greater(s, done)

    live = all_of(greater(s, 0.0), less(s, math.inf))
    return elementwise_loop(live, [start], step, SQUARING_LIMIT)[0]


def matrix_exp(a: ir.Value) -> ir.Value:
    """``exp`` of the (B, n, n) matrices ``a`` (n >= 2)."""
    thetas = THETAS[torch.float64 if dtype_of(a) == torch.float64 else torch.float32]
    norm = cai.reduce_max(cai.reduce_sum(cai.abs_(a), i32([-2])), i32([-1]))  # (B, 1, 1)
    large = _scaled_and_squared(a, norm, thetas[-1])
    if static_shape_of(a)[0] > 1:
        return large
    out = cai.broadcasting_where(cai.not_(not_nan(norm)), mul(a, math.nan), large)
    lower = -1.0
    for degree, theta in zip((1, 2, 4, 8, 12), thetas, strict=False):
        inside = all_of(greater(norm, lower), cai.not_(greater(norm, theta)))
        out = cai.broadcasting_where(inside, taylor(a, degree), out)
        lower = theta
    return cai.broadcasting_where(cai.not_(less(norm, thetas[-2])), large, out)


@lowering("aten::linalg_matrix_exp.default")
def linalg_matrix_exp(cx: LoweringContext, self: ir.Value) -> ir.Value:
    shape = known_sizes(shape_of(self))
    if shape is None:
        raise cx.unsupported("matrix_exp needs static shapes")
    dtype = cx.out_dtype
    if not dtype.is_floating_point:
        raise cx.unsupported(f"matrix_exp of {dtype} matrices (floating point only)")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    x = cast(self, compute)
    n = shape[-1]
    if n == 1:
        return cast(cai.exp(x), dtype)
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    out = matrix_exp(reshape(x, [batch, n, n]))
    return cast(reshape(out, shape), dtype)
