"""The CUDA backend's kernel table: each op family module in this package registers into it."""
from ...ops.registry import KernelTable

CUDA = KernelTable("cuda")
CUDA.name = "cuda"
