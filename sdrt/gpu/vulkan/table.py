"""The Vulkan backend's kernel table: each op family module in ops/ registers into it.
A kernel is `fn(node, xs, out, rec)`: xs/out are VkTensors (backend.py), rec the Recorder
whose `dispatch` queues one compute dispatch."""
from ...ops.registry import KernelTable

VULKAN = KernelTable("vulkan")
VULKAN.name = "vulkan"
