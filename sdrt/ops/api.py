"""Every op builder in one namespace: `from sdrt.ops import api as F; y = F.silu(F.add(a, b))`.

One line per op family; each family module lists its builders in `__all__`.
"""
from .attention import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .elementwise import *  # noqa: F401,F403
from .graph import Graph, compute, evaluate, mark_cut  # noqa: F401
from .layout import *  # noqa: F401,F403
from .matmul import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .position import *  # noqa: F401,F403
