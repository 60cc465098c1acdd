"""Every op builder in one namespace: `from sdrt.ops import api as F; y = F.silu(F.add(a, b))`."""
from .elementwise import *  # noqa: F401,F403
from .elementwise import abs, add, cast, clamp, cont, cos, div, exp, gelu, gelu_quick, leaky_relu, log, mul, neg, relu, scale, sigmoid, silu, sin, sqr, sqrt, step, sub, tanh  # noqa: F401,A004
from .conv import conv1d, conv2d, conv3d, conv_transpose2d, pool1d, pool2d  # noqa: F401
from .matmul import get_rows, linear, mul_mat  # noqa: F401
from .graph import Graph, compute, evaluate, mark_cut  # noqa: F401
from .layout import *  # noqa: F401,F403
from .position import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
