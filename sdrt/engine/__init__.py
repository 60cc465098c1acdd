"""The diffusion engine. Importing it registers the device backends (sdrt.gpu), which the
engine places components on."""
from .. import gpu  # noqa: F401


# what an image generation imports after its pipeline is loaded (stages, samplers, the CLIP text
# encoder's model code), for prepare_generation
_GENERATION_MODULES = ("sdrt.ops.api", "sdrt.models.common", "sdrt.models.prompt", "sdrt.models.conditioning",
                       "sdrt.models.te.clip", "sdrt.engine.conditioning", "sdrt.engine.denoisers",
                       "sdrt.engine.samplers", "sdrt.engine.hires", "sdrt.engine.lora")


def prepare_generation() -> None:
    """On a daemon thread: import the modules an image generation needs after loading and read
    the CLIP BPE vocabulary (SD1/2/XL, SD3 and Flux tokenize with it). Started beside a GPU
    driver's warm-up (cli.main), it runs while the main thread waits for the device, a wait that
    releases the GIL, instead of after it; it never raises (the main thread meets any error itself)."""
    import importlib
    import threading

    def run():
        try:
            for m in _GENERATION_MODULES:
                importlib.import_module(m)
            from ..models.te.tokenizer import _load_vocab, vocab_path
            _load_vocab(vocab_path())
        except Exception:   # noqa: BLE001  (an optimisation only)
            pass
    threading.Thread(target=run, name="sdrt-prepare-generation", daemon=True).start()
