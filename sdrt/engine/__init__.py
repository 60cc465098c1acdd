"""The diffusion engine. Importing it registers the device backends (sdrt.gpu), which the
engine places components on."""
from .. import gpu  # noqa: F401
