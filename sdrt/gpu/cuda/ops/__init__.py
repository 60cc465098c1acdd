"""The CUDA backend's op families: every module here registers its ops' kernels into
sdrt.gpu.cuda.table.CUDA when imported (its .cu source is kernels/<family>.cu). The backend
imports them all (sdrt.gpu.device_backend.import_families); infrastructure (driver, runtime, cuBLAS, graphs, fusing)
lives in the package above."""
