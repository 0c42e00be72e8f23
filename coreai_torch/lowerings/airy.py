"""``special_airy_ai``: the Airy function Ai as ATen's CPU kernel evaluates it
(``airy_ai_forward`` in ``aten/src/ATen/native/Math.h``, after Cephes): NaN at ±inf, 0 above
103.892, the oscillating asymptotic form below -2.09, the decaying one from 2.09 (used
from there on), and between them the Maclaurin series summed until a term is below the
dtype's epsilon relative to the sum (an elementwise loop, ``helpers.loops.elementwise_loop``).
16-bit floats compute in float32.
"""

from __future__ import annotations

import math

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    add,
    all_of,
    cast,
    div,
    dtype_of,
    greater,
    less,
    mul,
    not_nan,
    pick,
    sub,
)
from coreai_torch.lowerings.helpers.arithmetic import isinf_values
from coreai_torch.lowerings.helpers.float_math import polynomial
from coreai_torch.lowerings.helpers.loops import elementwise_loop
from coreai_torch.lowerings.helpers.operands import opmath
from coreai_torch.lowerings.registry import LoweringContext, lowering

_AN = [3.46538101525629032477e-01, 1.20075952739645805542e01, 7.62796053615234516538e01,
       1.68089224934630576269e02, 1.59756391350164413639e02, 7.05360906840444183113e01,
       1.40264691163389668864e01, 9.99999999999999995305e-01]  # fmt: skip
_AD = [5.67594532638770212846e-01, 1.47562562584847203173e01, 8.45138970141474626562e01,
       1.77318088145400459522e02, 1.64234692871529701831e02, 7.14778400825575695274e01,
       1.40959135607834029598e01, 1.00000000000000000470e00]  # fmt: skip
_AFN = [-1.31696323418331795333e-01, -6.26456544431912369773e-01,
        -6.93158036036933542233e-01, -2.79779981545119124951e-01,
        -4.91900132609500318020e-02, -4.06265923594885404393e-03,
        -1.59276496239262096340e-04, -2.77649108155232920844e-06,
        -1.67787698489114633780e-08]  # fmt: skip
_AFD = [1.33560420706553243746e01, 3.26825032795224613948e01, 2.67367040941499554804e01,
        9.18707402907259625840e00, 1.47529146771666414581e00, 1.15687173795188044134e-01,
        4.40291641615211203805e-03, 7.54720348287414296618e-05,
        4.51850092970580378464e-07]  # fmt: skip
_AGN = [1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e00,
        9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
        5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
        8.11789239554389293311e-08, 3.41551784765923618484e-10]  # fmt: skip
_AGD = [9.30892908077441974853e00, 1.98352928718312140417e01, 1.55646628932864612953e01,
        5.47686069422975497931e00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
        4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
        4.91834570062930015649e-09]  # fmt: skip
_ONE_OVER_SQRT_PI = 5.64189583547756286948e-01
#: the series stops within this many terms for |x| < 2.09 (ATen's loop has no bound)
SERIES_LIMIT = 64


def _oscillating(x: ir.Value) -> ir.Value:
    """x < -2.09."""
    root = cai.sqrt(sub(0.0, x))
    zeta = div(mul(mul(x, -2.0), root), 3.0)
    z = div(1.0, zeta)
    zz = mul(z, z)
    afn, afd = polynomial(zz, _AFN), polynomial(zz, _AFD)
    agn, agd = polynomial(zz, _AGN), polynomial(zz, _AGD)
    t = add(zeta, 0.25 * math.pi)
    first = mul(cai.sin(t), add(div(mul(zz, afn), afd), 1.0))
    second = mul(cai.cos(t), div(mul(z, agn), agd))
    return mul(div(_ONE_OVER_SQRT_PI, cai.sqrt(root)), sub(first, second))


def _decaying(x: ir.Value) -> ir.Value:
    """x >= 2.09."""
    zeta = div(mul(mul(x, 2.0), cai.sqrt(x)), 3.0)
    inverse = div(1.0, zeta)
    ratio = div(polynomial(inverse, _AN), polynomial(inverse, _AD))
    scale = mul(mul(cai.sqrt(cai.sqrt(x)), 2.0), cai.exp(zeta))
    return div(mul(ratio, _ONE_OVER_SQRT_PI), scale)


def _series(x: ir.Value, live: ir.Value) -> ir.Value:
    """``0.355 f(x) - 0.259 g(x)``, the Maclaurin series, where ``live``."""
    eps = float(torch.finfo(dtype_of(x)).eps)
    z = mul(mul(x, x), x)
    one = pick(live, 1.0, 1.0, x)

    def step(i: ir.Value, values: list[ir.Value]) -> tuple[list[ir.Value], ir.Value]:
        f, g, k, m, n = values
        m = mul(m, z)
        k = add(k, 1.0)
        m = div(m, k)
        n = mul(n, z)
        k = add(k, 1.0)
        n = div(n, k)
        m = div(m, k)
        f = add(f, m)
        k = add(k, 1.0)
        n = div(n, k)
        g = add(g, n)
        return [f, g, k, m, n], greater(cai.abs_(div(m, f)), eps)

    x_full = pick(live, x, x, x)
    f, g, *_ = elementwise_loop(live, [one, x_full, one, one, x_full], step, SERIES_LIMIT)
    return sub(mul(f, 0.355028053887817239260), mul(g, 0.258819403792806798405))


def airy_ai_values(x: ir.Value) -> ir.Value:
    central = all_of(less(x, 2.09), cai.not_(less(x, -2.09)), not_nan(x))
    out = _series(x, central)
    out = pick(less(x, -2.09), _oscillating(x), out, x)
    out = pick(cai.not_(less(x, 2.09)), _decaying(x), out, x)
    out = pick(greater(x, 103.892), 0.0, out, x)
    return pick(isinf_values(x), math.nan, out, x)


@lowering("aten::special_airy_ai.default")
def special_airy_ai(cx: LoweringContext, x: ir.Value) -> ir.Value:
    dtype = opmath(cx.out_dtype)
    return cast(airy_ai_values(cast(x, dtype)), cx.out_dtype)
