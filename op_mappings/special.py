"""Special functions: Bessel functions, orthogonal polynomials, polygamma and the rest of torch.special.

torch's CPU kernels evaluate these with Cephes' rational and Chebyshev approximations and with
plain recurrences for the polynomials; the entries follow the same algorithms (the coefficients
are Cephes', by Stephen L. Moshier) so that results agree to the last bits, special cases included.
Every branch of a piecewise definition is computed and the right one selected with `jnp.where`.
"""

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jax_special
from jax import lax

from bridge.runtime.dtypes import INT_TO_FLOAT, is_lifted_float
from bridge.runtime.registry import aten, register_mapping
from .common import default_float, is_integral


def _horner(x, coefficients):
    """sum(c[i] * x**(n - i)): Cephes' polevl, highest power first."""
    result = jnp.zeros_like(x)
    for coefficient in coefficients:
        result = result * x + coefficient
    return result


def _chebyshev_series(x, coefficients):
    """Cephes' chbevl: a Chebyshev series by Clenshaw's recurrence, as torch unrolls it."""
    previous = jnp.zeros_like(x)
    current = jnp.zeros_like(x)
    value = jnp.full_like(x, coefficients[0])
    for coefficient in coefficients[1:]:
        previous, current = current, value
        value = x * current - previous + coefficient
    return 0.5 * (value - previous)


# ---------------------------------------------------------------- digamma and polygamma


_DIGAMMA_ASYMPTOTIC = (
    8.33333333333333333333e-2, -2.10927960927960927961e-2, 7.57575757575757575758e-3, -4.16666666666666666667e-3,
    3.96825396825396825397e-3, -8.33333333333333333333e-3, 8.33333333333333333333e-2,
)
_PSI_10 = 2.25175258906672110764


def _digamma_positive(x):
    """Cephes' psi for x > 0: the recurrence up to 10, then the asymptotic series."""
    result = jnp.zeros_like(x)
    for _ in range(10):  # x >= 1 after the reflection, or x > 0: ten steps reach 10
        below = x < 10
        result = jnp.where(below, result - 1 / jnp.where(below, x, 1), result)
        x = jnp.where(below, x + 1, x)
    inverse_square = 1 / (x * x)
    tail = jnp.where(x < 1.0e17, inverse_square * _horner(inverse_square, _DIGAMMA_ASYMPTOTIC), 0)
    return jnp.where(x == 10, result + _PSI_10, result + jnp.log(x) - 0.5 / x - tail)


def _digamma(x):
    """torch's digamma: +-inf at +-0, NaN at negative integers, reflection for other negatives."""
    negative = x < 0
    integer = x == jnp.trunc(x)
    reflected = jnp.where(negative, 1 - x, x)
    value = _digamma_positive(jnp.where(jnp.isnan(reflected) | (reflected <= 0), 1, reflected))
    # torch takes pi / tan(pi * r) in double whatever the dtype, r the fractional part of x.
    fraction = (x - jnp.trunc(x)).astype(jnp.float64)
    reflection = (math.pi / jnp.tan(math.pi * fraction)).astype(x.dtype)
    value = jnp.where(negative, value - reflection, value)
    value = jnp.where(negative & integer, jnp.nan, value)
    value = jnp.where(jnp.isnan(x), x, value)
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), value)


def _trigamma(x):
    """torch's trigamma: reflection below 1/2, six recurrence steps, then the asymptotic series."""
    reflected = x < 0.5
    sin_pi_x = jnp.sin(math.pi * x)
    reflection = -(math.pi * math.pi) / (sin_pi_x * sin_pi_x)
    x = jnp.where(reflected, 1 - x, x)
    result = jnp.where(reflected, reflection, jnp.zeros_like(x))
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    inverse_square = 1 / (x * x)
    series = 1 + 1 / (2 * x) + inverse_square * (1.0 / 6 - inverse_square * (1.0 / 30 - inverse_square * (1.0 / 42)))
    result = result + series / x
    return jnp.where(reflected, -result, result)


# digamma's and polygamma's derivatives near their poles (and log_ndtr's in the far tail, in
# traits.py): JAX's rules differ from torch's formulas there (by up to 1.6 in float32, or NaN
# where torch is finite).
@register_mapping(aten.digamma.default, promote=INT_TO_FLOAT, gradient="torch")
def digamma(self):
    return _digamma(self)


_ZETA_EULER_MACLAURIN = (
    12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
    -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15, 1.8152105401943546773e17,
    -7.1661652561756670113e18,
)
_MACHEP = 1.11022302462515654042e-16


def _zeta(x, q):
    """Cephes' Hurwitz zeta as torch runs it: direct sums until the terms are negligible or a > 9
    (after at least nine), then the Euler-Maclaurin tail; q <= 0 only for integer x."""
    power = lambda base: jnp.power(base, -x)  # noqa: E731
    s = power(q)
    state = (jnp.zeros(q.shape, jnp.int32), q, jnp.zeros_like(q), s, jnp.zeros(q.shape, bool))

    def summing(state):
        i, a, _, _, done = state
        return (~done) & ((i < 9) | (a <= 9))

    def direct(state):
        i, a, b, s, done = state
        active = summing(state)
        a_next = a + 1
        b_next = power(a_next)
        s_next = s + b_next
        converged = (-_MACHEP * s_next < b_next) & (b_next < _MACHEP * s_next)
        return (
            jnp.where(active, i + 1, i), jnp.where(active, a_next, a), jnp.where(active, b_next, b),
            jnp.where(active, s_next, s), done | (active & converged),
        )

    _, a, b, s, done = lax.while_loop(lambda state: jnp.any(summing(state)), direct, state)
    w = a
    tail = s + b * w / (x - 1) - 0.5 * b
    factor = jnp.ones_like(q)
    k = 0.0
    finished = done
    for coefficient in _ZETA_EULER_MACLAURIN:
        factor = factor * (x + k)
        b = b / w
        term = factor * b / coefficient
        tail = jnp.where(finished, tail, tail + term)
        finished = finished | (jnp.abs(term / tail) < _MACHEP)
        k += 1.0
        factor = factor * (x + k)
        b = b / w
        k += 1.0
    value = jnp.where(done, s, tail)
    value = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, value)
    return value


@register_mapping(aten.polygamma.default, promote=INT_TO_FLOAT, operands=("self",), gradient="torch")
def polygamma(n, self):
    if n == 0:
        return _digamma(self)
    if n == 1:
        return _trigamma(self)
    # torch: (-1)**(n+1) * n! * zeta(n + 1, x), the zeta summed in double (float for bfloat16/float16).
    wide = jnp.float64 if self.dtype in (jnp.float32, jnp.float64) else jnp.float32
    zeta = _zeta(jnp.asarray(n + 1, wide), self.astype(wide)).astype(self.dtype)
    sign = 1.0 if n % 2 else -1.0
    return sign * jnp.asarray(math.exp(math.lgamma(n + 1)), self.dtype) * zeta


# ---------------------------------------------------------------- angle


@register_mapping(aten.angle.default)
def angle(self):
    if jnp.iscomplexobj(self):
        return jnp.angle(self)
    if is_integral(self):
        self = self.astype(default_float())
    # torch: pi for negative numbers, 0 otherwise, NaN kept.
    return jnp.where(jnp.isnan(self), self, jnp.where(self < 0, jnp.asarray(math.pi, self.dtype), jnp.zeros_like(self)))


# ---------------------------------------------------------------- Bessel functions of the first and second kind

_QUARTER_PI = 0.785398163397448309615660845819875721
_THREE_QUARTERS_PI = 2.356194490192344928846982537459627163
_SQRT_TWO_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448

_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e00, 5.44725003058768775090e00,
          8.74716500199817011941e00, 5.30324038235394892183e00, 9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e00, 5.47097740330417105182e00,
          8.76190883237069594232e00, 5.30605288235394617618e00, 1.00000000000000000218e00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e00, -1.95539544257735972385e01, -9.32060152123768231369e01,
          -1.77681167980488050595e02, -1.47077505154951170175e02, -5.14105326766599330220e01, -6.05014350600728481186e00)
_J0_QQ = (6.43178256118178023184e01, 8.56430025976980587198e02, 3.88240183605401609683e03, 7.24046774195652478189e03,
          5.93072701187316984827e03, 2.06209331660327847417e03, 2.42005740240291393179e02)
_J0_RP = (-4.79443220978201773821e09, 1.95617491946556577543e12, -2.49248344360967716204e14, 9.70862251047306323952e15)
_J0_RQ = (4.99563147152651017219e02, 1.73785401676374683123e05, 4.84409658339962045305e07, 1.11855537045356834862e10,
          2.11277520115489217587e12, 3.10518229857422583814e14, 3.18121955943204943306e16, 1.71086294081043136091e18)
_Y0_YP = (1.55924367855235737965e04, -1.46639295903971606143e07, 5.43526477051876500413e09, -9.82136065717911466409e11,
          8.75906394395366999549e13, -3.46628303384729719441e15, 4.42733268572569800351e16, -1.84950800436986690637e16)
_Y0_YQ = (1.04128353664259848412e03, 6.26107330137134956842e05, 2.68919633393814121987e08, 8.64002487103935000337e10,
          2.02979612750105546709e13, 3.17157752842975028269e15, 2.50596256172653059228e17)

_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e00, 5.11207951146807644818e00,
          8.42404590141772420927e00, 5.21451598682361504063e00, 1.00000000000000000254e00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e00, 5.07386386128601488557e00,
          8.39985554327604159757e00, 5.20982848682361821619e00, 9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e00, 7.58238284132545283818e01, 3.66779609360150777800e02,
          7.10856304998926107277e02, 5.97489612400613639965e02, 2.11688757100572135698e02, 2.52070205858023719784e01)
_J1_QQ = (7.42373277035675149943e01, 1.05644886038262816351e03, 4.98641058337653607651e03, 9.56231892404756170795e03,
          7.99704160447350683650e03, 2.82619278517639096600e03, 3.36093607810698293419e02)
_J1_RP = (-8.99971225705559398224e08, 4.52228297998194034323e11, -7.27494245221818276015e13, 3.68295732863852883286e15)
_J1_RQ = (6.20836478118054335476e02, 2.56987256757748830383e05, 8.35146791431949253037e07, 2.21511595479792499675e10,
          4.74914122079991414898e12, 7.84369607876235854894e14, 8.95222336184627338078e16, 5.32278620332680085395e18)
_Y1_YP = (1.26320474790178026440e09, -6.47355876379160291031e11, 1.14509511541823727583e14, -8.12770255501325109621e15,
          2.02439475713594898196e17, -7.78877196265950026825e17)
_Y1_YQ = (5.94301592346128195359e02, 2.35564092943068577943e05, 7.34811944459721705660e07, 1.87601316108706159478e10,
          3.88231277496238566008e12, 6.20557727146953693363e14, 6.87141087355300489866e16, 3.97270608116560655612e18)


def _asymptotic(x, pp, pq, qp, qq, phase, first_kind):
    """The Hankel asymptotic form for |x| > 5, shared by J and Y of orders 0 and 1."""
    w = 5.0 / x
    z = w * w
    p = _horner(z, pp) / _horner(z, pq)
    q = _horner(z, qp) / _horner(z, qq)
    shifted = x - phase
    if first_kind:
        combined = p * jnp.cos(shifted) - w * q * jnp.sin(shifted)
    else:
        combined = p * jnp.sin(shifted) + w * q * jnp.cos(shifted)
    return combined * _SQRT_TWO_OVER_PI / jnp.sqrt(x)


def _safe(x, use, fill):
    """x where it will be used, `fill` elsewhere: keeps unused branches free of NaN and overflow."""
    return jnp.where(use, x, jnp.asarray(fill, x.dtype))


def _bessel_j0(x):
    x = jnp.abs(x)
    near = x <= 5.0
    small = _safe(x, near, 1.0)
    square = small * small
    series = (square - 5.78318596294678452118e00) * (square - 3.04712623436620863991e01) * _horner(square, _J0_RP) / _horner(square, _J0_RQ)
    series = jnp.where(small < 0.00001, 1.0 - square / 4.0, series)
    far = _asymptotic(_safe(x, ~near, 10.0), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _QUARTER_PI, True)
    return jnp.where(near, series, far)


def _bessel_j1(x):
    sign = jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)
    x = jnp.abs(x)
    near = x <= 5.0
    small = _safe(x, near, 1.0)
    square = small * small
    series = _horner(square, _J1_RP) / _horner(square, _J1_RQ) * small * (square - 1.46819706421238932572e01) * (square - 4.92184563216946036703e01)
    far = _asymptotic(_safe(x, ~near, 10.0), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _THREE_QUARTERS_PI, True)
    return sign * jnp.where(near, series, far)


def _bessel_y0(x):
    near = x <= 5.0
    small = _safe(x, near & (x > 0), 1.0)
    square = small * small
    series = _horner(square, _Y0_YP) / _horner(square, _Y0_YQ) + _TWO_OVER_PI * jnp.log(small) * _bessel_j0(small)
    series = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, series))
    far = _asymptotic(_safe(x, ~near, 10.0), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _QUARTER_PI, False)
    return jnp.where(near, series, far)


def _bessel_y1(x):
    near = x <= 5.0
    small = _safe(x, near & (x > 0), 1.0)
    square = small * small
    series = small * (_horner(square, _Y1_YP) / _horner(square, _Y1_YQ)) + _TWO_OVER_PI * (_bessel_j1(small) * jnp.log(small) - 1.0 / small)
    series = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, series))
    far = _asymptotic(_safe(x, ~near, 10.0), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _THREE_QUARTERS_PI, False)
    return jnp.where(near, series, far)


for _op, _function in (
    (aten.special_bessel_j0.default, _bessel_j0),
    (aten.special_bessel_j1.default, _bessel_j1),
    (aten.special_bessel_y0.default, _bessel_y0),
    (aten.special_bessel_y1.default, _bessel_y1),
):
    register_mapping(_op, promote=INT_TO_FLOAT, family="special")(_function)


# ---------------------------------------------------------------- modified Bessel functions

_I0_A = (-4.41534164647933937950e-18, 3.33079451882223809783e-17, -2.43127984654795469359e-16, 1.71539128555513303061e-15,
         -1.16853328779934516808e-14, 7.67618549860493561688e-14, -4.85644678311192946090e-13, 2.95505266312963983461e-12,
         -1.72682629144155570723e-11, 9.67580903537323691224e-11, -5.18979560163526290666e-10, 2.65982372468238665035e-09,
         -1.30002500998624804212e-08, 6.04699502254191894932e-08, -2.67079385394061173391e-07, 1.11738753912010371815e-06,
         -4.41673835845875056359e-06, 1.64484480707288970893e-05, -5.75419501008210370398e-05, 1.88502885095841655729e-04,
         -5.76375574538582365885e-04, 1.63947561694133579842e-03, -4.32430999505057594430e-03, 1.05464603945949983183e-02,
         -2.37374148058994688156e-02, 4.93052842396707084878e-02, -9.49010970480476444210e-02, 1.71620901522208775349e-01,
         -3.04682672343198398683e-01, 6.76795274409476084995e-01)
_I0_B = (-7.23318048787475395456e-18, -4.83050448594418207126e-18, 4.46562142029675999901e-17, 3.46122286769746109310e-17,
         -2.82762398051658348494e-16, -3.42548561967721913462e-16, 1.77256013305652638360e-15, 3.81168066935262242075e-15,
         -9.55484669882830764870e-15, -4.15056934728722208663e-14, 1.54008621752140982691e-14, 3.85277838274214270114e-13,
         7.18012445138366623367e-13, -1.79417853150680611778e-12, -1.32158118404477131188e-11, -3.14991652796324136454e-11,
         1.18891471078464383424e-11, 4.94060238822496958910e-10, 3.39623202570838634515e-09, 2.26666899049817806459e-08,
         2.04891858946906374183e-07, 2.89137052083475648297e-06, 6.88975834691682398426e-05, 3.36911647825569408990e-03,
         8.04490411014108831608e-01)
_I1_A = (2.77791411276104639959e-18, -2.11142121435816608115e-17, 1.55363195773620046921e-16, -1.10559694773538630805e-15,
         7.60068429473540693410e-15, -5.04218550472791168711e-14, 3.22379336594557470981e-13, -1.98397439776494371520e-12,
         1.17361862988909016308e-11, -6.66348972350202774223e-11, 3.62559028155211703701e-10, -1.88724975172282928790e-09,
         9.38153738649577178388e-09, -4.44505912879632808065e-08, 2.00329475355213526229e-07, -8.56872026469545474066e-07,
         3.47025130813767847674e-06, -1.32731636560394358279e-05, 4.78156510755005422638e-05, -1.61760815825896745588e-04,
         5.12285956168575772895e-04, -1.51357245063125314899e-03, 4.15642294431288815669e-03, -1.05640848946261981558e-02,
         2.47264490306265168283e-02, -5.29459812080949914269e-02, 1.02643658689847095384e-01, -1.76416518357834055153e-01,
         2.52587186443633654823e-01)
_I1_B = (7.51729631084210481353e-18, 4.41434832307170791151e-18, -4.65030536848935832153e-17, -3.20952592199342395980e-17,
         2.96262899764595013876e-16, 3.30820231092092828324e-16, -1.88035477551078244854e-15, -3.81440307243700780478e-15,
         1.04202769841288027642e-14, 4.27244001671195135429e-14, -2.10154184277266431302e-14, -4.08355111109219731823e-13,
         -7.19855177624590851209e-13, 2.03562854414708950722e-12, 1.41258074366137813316e-11, 3.25260358301548823856e-11,
         -1.89749581235054123450e-11, -5.58974346219658380687e-10, -3.83538038596423702205e-09, -2.63146884688951950684e-08,
         -2.51223623787020892529e-07, -3.88256480887769039346e-06, -1.10588938762623716291e-04, -9.76109749136146840777e-03,
         7.78576235018280120474e-01)
_K0_A = (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11, 1.90451637722020886025e-09,
         2.53479107902614945675e-07, 2.28621210311945178607e-05, 1.26461541144692592338e-03, 3.59799365153615016266e-02,
         3.44289899924628486886e-01, -5.35327393233902768720e-01)
_K0_B = (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17, -1.67823109680541210385e-16,
         5.51205597852431940784e-16, -1.84859337734377901440e-15, 6.34007647740507060557e-15, -2.22751332699166985548e-14,
         8.03289077536357521100e-14, -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
         1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10, -1.69753450938905987466e-09,
         8.57403401741422608519e-09, -4.66048989768794782956e-08, 2.76681363944501510342e-07, -1.83175552271911948767e-06,
         1.39498137188764993662e-05, -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
         2.44030308206595545468e00)
_K1_A = (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13, -1.41148839263352776110e-10,
         -2.21338763073472585583e-08, -2.43340614156596823496e-06, -1.73028895751305206302e-04, -6.97572385963986435018e-03,
         -1.22611180822657148235e-01, -3.53155960776544875667e-01, 1.52530022733894777053e00)
_K1_B = (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17, 1.83809354436663880070e-16,
         -6.05704724837331885336e-16, 2.03870316562433424052e-15, -7.01983709041831346144e-15, 2.47715442448130437068e-14,
         -8.97670518232499435011e-14, 3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
         -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10, 2.01504975519703286596e-09,
         -1.03457624656780970260e-08, 5.74108412545004946722e-08, -3.50196060308781257119e-07, 2.40648494783721712015e-06,
         -1.93619797416608296024e-05, 1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
         2.72062619048444266945e00)


def _modified_bessel_i0(x):
    x = jnp.abs(x)
    near = x <= 8.0
    series = _chebyshev_series(x / 2.0 - 2.0, _I0_A)
    far = _chebyshev_series(32.0 / _safe(x, ~near, 16.0) - 2.0, _I0_B) / jnp.sqrt(x)
    return jnp.exp(x) * jnp.where(near, series, far)


def _modified_bessel_i1(x):
    magnitude = jnp.abs(x)
    near = magnitude <= 8.0
    series = _chebyshev_series(magnitude / 2.0 - 2.0, _I1_A) * magnitude * jnp.exp(magnitude)
    far = jnp.exp(magnitude) * _chebyshev_series(32.0 / _safe(magnitude, ~near, 16.0) - 2.0, _I1_B) / jnp.sqrt(magnitude)
    value = jnp.where(near, series, far)
    return jnp.where(x < 0, -value, value)


def _modified_bessel_k(x, order, scaled):
    near = x <= 2.0
    small = _safe(x, near & (x > 0), 1.0)
    large = _safe(x, ~near, 4.0)
    if order == 0:
        series = _chebyshev_series(small * small - 2.0, _K0_A) - jnp.log(0.5 * small) * _modified_bessel_i0(small)
        far = _chebyshev_series(8.0 / large - 2.0, _K0_B) / jnp.sqrt(large)
    else:
        series = jnp.log(0.5 * small) * _modified_bessel_i1(small) + _chebyshev_series(small * small - 2.0, _K1_A) / small
        far = _chebyshev_series(8.0 / large - 2.0, _K1_B) / jnp.sqrt(large)
    if scaled:
        series = series * jnp.exp(small)
    else:
        far = jnp.exp(-large) * far
    value = jnp.where(near, series, far)
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, value))


for _op, _function in (
    (aten.special_modified_bessel_i0.default, _modified_bessel_i0),
    (aten.special_modified_bessel_i1.default, _modified_bessel_i1),
    (aten.special_modified_bessel_k0.default, lambda x: _modified_bessel_k(x, 0, False)),
    (aten.special_modified_bessel_k1.default, lambda x: _modified_bessel_k(x, 1, False)),
    (aten.special_scaled_modified_bessel_k0.default, lambda x: _modified_bessel_k(x, 0, True)),
    (aten.special_scaled_modified_bessel_k1.default, lambda x: _modified_bessel_k(x, 1, True)),
):
    register_mapping(_op, promote=INT_TO_FLOAT, family="special")(_function)


# ---------------------------------------------------------------- Airy function

_AIRY_AN = (3.46538101525629032477e-01, 1.20075952739645805542e01, 7.62796053615234516538e01, 1.68089224934630576269e02,
            1.59756391350164413639e02, 7.05360906840444183113e01, 1.40264691163389668864e01, 9.99999999999999995305e-01)
_AIRY_AD = (5.67594532638770212846e-01, 1.47562562584847203173e01, 8.45138970141474626562e01, 1.77318088145400459522e02,
            1.64234692871529701831e02, 7.14778400825575695274e01, 1.40959135607834029598e01, 1.00000000000000000470e00)
_AIRY_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01, -2.79779981545119124951e-01,
             -4.91900132609500318020e-02, -4.06265923594885404393e-03, -1.59276496239262096340e-04, -2.77649108155232920844e-06,
             -1.67787698489114633780e-08)
_AIRY_AFD = (1.33560420706553243746e01, 3.26825032795224613948e01, 2.67367040941499554804e01, 9.18707402907259625840e00,
             1.47529146771666414581e00, 1.15687173795188044134e-01, 4.40291641615211203805e-03, 7.54720348287414296618e-05,
             4.51850092970580378464e-07)
_AIRY_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e00, 9.39169229816650230044e-01,
             3.51465656105547619242e-01, 6.33888919628925490927e-02, 5.85804113048388458567e-03, 2.82851600836737019778e-04,
             6.98793669997260967291e-06, 8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AIRY_AGD = (9.30892908077441974853e00, 1.98352928718312140417e01, 1.55646628932864612953e01, 5.47686069422975497931e00,
             9.54293611618961883998e-01, 8.64580826352392193095e-02, 4.12656523824222607191e-03, 1.01259085116509135510e-04,
             1.17166733214413521882e-06, 4.91834570062930015649e-09)


def _airy_series(x, active):
    """Ai's Maclaurin series, summed per element until its last term is below the dtype's epsilon."""
    epsilon = jnp.finfo(x.dtype).eps
    cube = x * x * x
    one = jnp.ones_like(x)

    def keep_going(state):
        return jnp.any(state[-1])

    def step(state):
        f, g, k, m, n, running = state
        m_next = m * cube
        k_next = k + 1.0
        m_next = m_next / k_next
        n_next = n * cube
        k_next = k_next + 1.0
        n_next = n_next / k_next
        m_next = m_next / k_next
        f_next = f + m_next
        k_next = k_next + 1.0
        n_next = n_next / k_next
        g_next = g + n_next
        updated = (f_next, g_next, k_next, m_next, n_next)
        f, g, k, m, n = (jnp.where(running, new, old) for new, old in zip(updated, (f, g, k, m, n)))
        running = running & (jnp.abs(m_next / f_next) > epsilon)
        return f, g, k, m, n, running

    f, g, *_ = lax.while_loop(keep_going, step, (one, x, one, one, x, active))
    return 0.355028053887817239260 * f - 0.258819403792806798405 * g


def _airy_ai(x):
    negative = x < -2.09
    positive = x >= 2.09
    # x < -2.09: the oscillating asymptotic form
    minus = _safe(x, negative, -4.0)
    zeta = -2.0 * minus * jnp.sqrt(-minus) / 3.0
    z = 1.0 / zeta
    square = z * z
    phase = zeta + 0.25 * math.pi
    oscillating = (
        5.64189583547756286948e-01 / jnp.sqrt(jnp.sqrt(-minus))
        * (jnp.sin(phase) * (1.0 + square * _horner(square, _AIRY_AFN) / _horner(square, _AIRY_AFD))
           - jnp.cos(phase) * (z * _horner(square, _AIRY_AGN) / _horner(square, _AIRY_AGD)))
    )
    # x >= 2.09: the decaying asymptotic form
    plus = _safe(x, positive, 4.0)
    zeta = 2.0 * plus * jnp.sqrt(plus) / 3.0
    decaying = 5.64189583547756286948e-01 * (_horner(1.0 / zeta, _AIRY_AN) / _horner(1.0 / zeta, _AIRY_AD)) / (
        2.0 * jnp.sqrt(jnp.sqrt(plus)) * jnp.exp(zeta)
    )
    near = ~negative & ~positive & jnp.isfinite(x)
    series = _airy_series(_safe(x, near, 0.0), near)
    value = jnp.where(negative, oscillating, jnp.where(positive, decaying, series))
    value = jnp.where(x > 103.892, jnp.zeros_like(x), value)
    return jnp.where(jnp.isinf(x) | jnp.isnan(x), jnp.nan, value)


register_mapping(aten.special_airy_ai.default, promote=INT_TO_FLOAT, family="special")(_airy_ai)


# ---------------------------------------------------------------- orthogonal polynomials
#
# torch evaluates P_n(x) by its three-term recurrence (stopping early once the value is NaN), with
# special cases: n < 0 gives 0, |x| == 1 (0 or 1 for the shifted ones) a closed form, and for the
# Chebyshev polynomials with |x| < 1 and n above a small threshold the trigonometric form. Here the
# recurrence runs as a lax.while_loop until every element has done its n - 1 steps, each element
# stopping at its own n: no host read of n.


def _as_degree(n):
    """torch casts the degree to int64 (NaN and infinity are undefined behaviour in C++; torch's
    Hermite kernels map them to -1)."""
    finite = jnp.isfinite(n) if jnp.issubdtype(n.dtype, jnp.floating) else jnp.ones(n.shape, dtype=bool)
    return jnp.where(finite, jnp.where(finite, n, 0).astype(jnp.int64), -1)


def _recurrence(x, degree, first, step, stop_at_nan=True):
    """q after the steps i = 1 .. n-1 of (p, q) <- (q, step(i, p, q)), from p = 1, q = `first`;
    1 for n == 0."""
    x, degree = jnp.broadcast_arrays(x, degree)
    first = jnp.broadcast_to(first, x.shape)
    one = jnp.ones_like(x)

    def running(index, q):
        active = index < degree
        return active & ~jnp.isnan(q) if stop_at_nan else active

    def keep_going(state):
        index, _, q = state
        return jnp.any(running(index, q))

    def body(state):
        index, p, q = state
        active = running(index, q)
        r = step(index.astype(x.dtype), p, q)
        return index + 1, jnp.where(active, q, p), jnp.where(active, r, q)

    start = jnp.ones(x.shape, dtype=jnp.int64)
    _, _, q = lax.while_loop(keep_going, body, (start, one, first))
    return jnp.where(degree == 0, one, q)


def _with_special_cases(value, degree, cases):
    for condition, result in reversed(cases):
        value = jnp.where(condition, result, value)
    return jnp.where(degree < 0, jnp.zeros_like(value), value)


def _odd(degree):
    return degree % 2 == 1


def _chebyshev_t(x, n):
    degree = _as_degree(n)
    inside = (degree > 6) & (jnp.abs(x) < 1)
    masked = jnp.where(inside, 0.0, x)
    value = _recurrence(masked, degree, masked, lambda i, p, q: (masked + masked) * q - p)
    trigonometric = jnp.cos(degree.astype(x.dtype) * jnp.arccos(jnp.where(inside, x, 0.0)))
    plus_minus_one = jnp.where((x > 0) | ~_odd(degree), 1.0, -1.0).astype(x.dtype)
    return _with_special_cases(value, degree, [(jnp.abs(x) == 1, plus_minus_one), (inside, trigonometric)])


def _chebyshev_u(x, n):
    degree = _as_degree(n)
    count = degree.astype(x.dtype)
    inside = (degree > 8) & (jnp.abs(x) < 1)
    masked = jnp.where(inside, 0.0, x)
    value = _recurrence(masked, degree, masked + masked, lambda i, p, q: (masked + masked) * q - p)
    theta = jnp.arccos(jnp.where(inside, x, 0.0))
    trigonometric = jnp.where(
        jnp.sin(theta) != 0, jnp.sin((count + 1) * theta) / jnp.sin(theta), (count + 1) * jnp.cos((count + 1) * theta) / x
    )
    at_one = jnp.where((x > 0) | ~_odd(degree), count + 1, -(count + 1))
    return _with_special_cases(value, degree, [(jnp.abs(x) == 1, at_one), (inside, trigonometric)])


def _chebyshev_v(x, n):
    degree = _as_degree(n)
    count = degree.astype(x.dtype)
    inside = (degree > 8) & (jnp.abs(x) < 1)
    masked = jnp.where(inside, 0.0, x)
    value = _recurrence(masked, degree, masked + masked - 1.0, lambda i, p, q: (masked + masked) * q - p)
    theta = jnp.arccos(jnp.where(inside, x, 0.0))
    alternating = jnp.where(_odd(degree), -(count + count + 1), count + count + 1)
    trigonometric = jnp.where(
        jnp.sin(theta / 2.0) != 1, jnp.cos((count + 0.5) * theta) / jnp.cos(theta / 2.0), alternating
    )
    at_one = jnp.where(x > 0, jnp.ones_like(x), alternating)
    return _with_special_cases(value, degree, [(jnp.abs(x) == 1, at_one), (inside, trigonometric)])


def _chebyshev_w(x, n):
    degree = _as_degree(n)
    count = degree.astype(x.dtype)
    inside = (degree > 8) & (jnp.abs(x) < 1)
    masked = jnp.where(inside, 0.0, x)
    value = _recurrence(masked, degree, masked + masked + 1.0, lambda i, p, q: (masked + masked) * q - p)
    theta = jnp.arccos(jnp.where(inside, x, 0.0))
    at_one = jnp.where(x > 0, count + count + 1, jnp.where(_odd(degree), -1.0, 1.0).astype(x.dtype))
    trigonometric = jnp.where(
        jnp.cos(theta / 2.0) != 1, jnp.sin((count + 0.5) * theta) / jnp.sin(theta / 2.0), at_one
    )
    return _with_special_cases(value, degree, [(jnp.abs(x) == 1, at_one), (inside, trigonometric)])


def _shifted(x, n, threshold, first, at_one, at_zero, trigonometric):
    """The shifted Chebyshev polynomials: P*_n(x) = P_n(2x - 1), with torch's own special cases
    (x == 1 and x == 0 exactly, and its own thresholds for the trigonometric form)."""
    degree = _as_degree(n)
    count = degree.astype(x.dtype)
    y = x + x - 1.0
    inside = (degree > threshold) & (jnp.abs(y) < 1)
    masked = jnp.where(inside, 0.0, y)
    value = _recurrence(masked, degree, first(masked), lambda i, p, q: (masked + masked) * q - p)
    theta = jnp.arccos(jnp.where(inside, y, 0.0))
    return _with_special_cases(
        value,
        degree,
        [(x == 1, at_one(count, degree)), (x == 0, at_zero(count, degree)), (inside, trigonometric(theta, count, degree, y))],
    )


def _alternating(value, degree):
    return jnp.where(_odd(degree), -value, value)


def _shifted_chebyshev_t(x, n):
    return _shifted(
        x, n, 6, lambda y: y,
        lambda count, degree: jnp.ones_like(count),
        lambda count, degree: _alternating(jnp.ones_like(count), degree),
        lambda theta, count, degree, y: jnp.cos(count * theta),
    )


def _shifted_chebyshev_u(x, n):
    def trigonometric(theta, count, degree, y):
        return jnp.where(
            jnp.sin(theta) != 0, jnp.sin((count + 1) * theta) / jnp.sin(theta), (count + 1) * jnp.cos((count + 1) * theta) / y
        )

    return _shifted(
        x, n, 6, lambda y: y + y,
        lambda count, degree: count + 1,
        lambda count, degree: _alternating(count + 1, degree),
        trigonometric,
    )


def _shifted_chebyshev_v(x, n):
    def trigonometric(theta, count, degree, y):
        return jnp.where(
            jnp.sin(theta / 2.0) != 1,
            jnp.cos((count + 0.5) * theta) / jnp.cos(theta / 2.0),
            _alternating(count + count + 1, degree),
        )

    return _shifted(
        x, n, 6, lambda y: y + y - 1.0,
        lambda count, degree: jnp.ones_like(count),
        lambda count, degree: _alternating(count + count + 1, degree),
        trigonometric,
    )


def _shifted_chebyshev_w(x, n):
    def trigonometric(theta, count, degree, y):
        return jnp.where(
            jnp.cos(theta / 2.0) != 1,
            jnp.sin((count + 0.5) * theta) / jnp.sin(theta / 2.0),
            _alternating(jnp.ones_like(count), degree),
        )

    return _shifted(
        x, n, 4, lambda y: y + y + 1.0,
        lambda count, degree: count + count + 1,
        lambda count, degree: _alternating(jnp.ones_like(count), degree),
        trigonometric,
    )


def _hermite_limit(dtype):
    return 128 if dtype == jnp.float32 else 512


def _hermite_degree(n, dtype):
    """Above a limit torch returns NaN without running the recurrence."""
    degree = _as_degree(n)
    return degree, jnp.where(degree > _hermite_limit(dtype), 0, degree)


def _hermite_h(x, n):
    degree, steps = _hermite_degree(n, x.dtype)
    value = _recurrence(x, steps, x + x, lambda i, p, q: (x + x) * q - (i + i) * p, stop_at_nan=False)
    return jnp.where(degree > _hermite_limit(x.dtype), jnp.nan, _with_special_cases(value, degree, []))


def _hermite_he(x, n):
    degree, steps = _hermite_degree(n, x.dtype)
    value = _recurrence(x, steps, x, lambda i, p, q: x * q - i * p, stop_at_nan=False)
    return jnp.where(degree > _hermite_limit(x.dtype), jnp.nan, _with_special_cases(value, degree, []))


def _laguerre_l(x, n):
    degree = _as_degree(n)
    value = _recurrence(x, degree, 1.0 - x, lambda i, p, q: (((i + i) + (1.0 - x)) * q - i * p) / (i + 1))
    return _with_special_cases(value, degree, [(x == 0, jnp.ones_like(x))])


def _legendre_p(x, n):
    degree = _as_degree(n)
    value = _recurrence(x, degree, x, lambda i, p, q: ((i + i + 1) * x * q - i * p) / (i + 1))
    plus_minus_one = jnp.where((x > 0) | ~_odd(degree), 1.0, -1.0).astype(x.dtype)
    return _with_special_cases(value, degree, [(jnp.abs(x) == 1, plus_minus_one)])


def _polynomial_operands(x, n):
    """The x_scalar and n_scalar overloads: a Python x takes the compute dtype (n's, after promotion)."""
    if not hasattr(x, "dtype") or is_lifted_float(x):  # a Python number
        x = jnp.asarray(x, dtype=n.dtype)
    return x, jnp.asarray(n)


for _packet, _function in (
    (aten.special_chebyshev_polynomial_t, _chebyshev_t),
    (aten.special_chebyshev_polynomial_u, _chebyshev_u),
    (aten.special_chebyshev_polynomial_v, _chebyshev_v),
    (aten.special_chebyshev_polynomial_w, _chebyshev_w),
    (aten.special_shifted_chebyshev_polynomial_t, _shifted_chebyshev_t),
    (aten.special_shifted_chebyshev_polynomial_u, _shifted_chebyshev_u),
    (aten.special_shifted_chebyshev_polynomial_v, _shifted_chebyshev_v),
    (aten.special_shifted_chebyshev_polynomial_w, _shifted_chebyshev_w),
    (aten.special_hermite_polynomial_h, _hermite_h),
    (aten.special_hermite_polynomial_he, _hermite_he),
    (aten.special_laguerre_polynomial_l, _laguerre_l),
    (aten.special_legendre_polynomial_p, _legendre_p),
):
    register_mapping(_packet.default, _packet.x_scalar, _packet.n_scalar, promote=INT_TO_FLOAT, family="special")(
        lambda x, n, _function=_function: _function(*_polynomial_operands(x, n))
    )

