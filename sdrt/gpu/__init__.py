"""Device backends. Importing this package registers every one of them with sdrt.ops.backend
(each package's __init__ calls register_backend and imports nothing heavy: drivers and bindings
load only when a device is used). A new backend is one subpackage plus one name here."""
from . import cuda, vulkan  # noqa: F401
