"""The Vulkan backend's op families: every module here registers its ops' kernels into
sdrt.gpu.vulkan.table.VULKAN when imported (its shader is shaders/<family>.comp). Nothing here
imports the Vulkan binding: the kernel table loads without a device (docs/ops.md)."""
