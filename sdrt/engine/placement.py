"""Where each component computes and where its weights live: sd-cli's `--backend`,
`--params-backend`, `--offload-to-cpu`, `--clip-on-cpu`, `--vae-on-cpu`, `--max-vram` and
`--auto-fit` (stable-diffusion.cpp docs/backend.md, src/core/backend_fit.cpp).

- `--backend` is where graphs run, `--params-backend` where weights live: `cpu` (host RAM,
  streamed to the device), `disk` (read from the model file's memory map each time they are
  staged, pages dropped afterwards) or the compute device itself (kept there). Params follow the
  runtime backend when unset.
- Syntax: one name for every module (`cuda0`) or per module (`diffusion=cuda0,te=cpu`);
  `all=`, `default=` and `*=` set the default inside a list; module names are case-insensitive
  and ignore `-`/`_`; later entries win.
- `--offload-to-cpu` prepends `*=cpu` to the params spec, `--clip-on-cpu` / `--vae-on-cpu`
  prepend `te=cpu` / `vae=cpu` to the backend spec (so an explicit entry still overrides them).
- Auto-fit (on unless `--auto-fit off`) places the weights when `--params-backend` (and
  `--offload-to-cpu`) is not given: in priority order diffusion > te > vae, on the first location
  with room: the component's compute GPU (leaving a compute reserve and staging space), host RAM
  (keeping max(2 GiB, 10%) free), then disk. Without `--backend` (and the --*-on-cpu flags) it
  also picks one main GPU (the largest budget) for every component's compute. sd.cpp's third choice,
  another GPU, needs device-to-device staging, which sdrt does not have: it is skipped.

Nothing here imports numba, the models or a GPU driver unless a GPU name is resolved.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import UnsupportedError, UsageError
from ..ops.threads import mem_available

__all__ = ["COMPONENTS", "Placement", "auto_fit", "canonical_module", "check_devices", "classify_tensor", "component_sizes",
           "parse_assignments", "parse_max_vram", "ram_budget", "resolve_budget", "resolve_placement"]

log = logging.getLogger("sdrt")
MiB, GiB = 2**20, 2**30

# sd.cpp's module table: canonical name -> aliases (compared without case, '-' and '_')
MODULES = {
    "diffusion": ("model", "unet", "dit"),
    "te": ("clip", "text", "textencoder", "textencoders", "conditioner", "cond", "llm", "t5", "t5xxl"),
    "clip_vision": ("clipvision", "vision"),
    "vae": ("firststage", "autoencoder", "tae"),
    "controlnet": ("control",),
    "photomaker": ("photomakerid", "pmid", "photo"),
    "upscaler": ("esrgan", "hires"),
    "detector": ("adetailer", "yolo"),
}
COMPONENTS = ("diffusion", "te", "vae", "controlnet")  # what sdrt's image pipeline has, in auto-fit priority
DEFAULT_KEYS = ("all", "default", "*")
_ALIAS = {a: m for m, al in MODULES.items() for a in (m.replace("_", ""),) + al}
# auto-fit's compute reserves (backend_fit.cpp) and the GPU margin when --max-vram is unset
RESERVE = {"diffusion": 2048 * MiB, "te": 2048 * MiB, "vae": 1024 * MiB, "controlnet": 1024 * MiB}
GPU_MARGIN = 512 * MiB
TENSOR_OVERHEAD = 64            # sd.cpp counts nbytes + 64 per tensor
_OTHER_BACKENDS = ("vulkan", "metal", "opencl", "sycl", "rpc", "rocm", "hip")


def canonical_module(name: str, flag: str) -> str:
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key in DEFAULT_KEYS:
        return "*"
    m = _ALIAS.get(key)
    if m is None:
        raise UsageError(f"{flag}: unknown module '{name}'; modules: " + ", ".join(
            f"{m} ({', '.join(al)})" for m, al in MODULES.items()) + "; all/default/* set the default")
    return m


def _device_entry(d: str):
    """The registered compute-device backend (sdrt.ops.backend) a name belongs to, or None."""
    from ..ops.backend import entry_of
    e = entry_of(d)
    return e if e is not None and e.device else None


def check_device(name: str, flag: str, allow_disk: bool) -> str:
    """A device name's syntax: a registered device (cpu, cudaN, ...), gpu, auto/default (empty),
    disk (params only)."""
    from ..ops.backend import device_syntax, entries
    d = name.strip().lower()
    if d in ("", "auto", "default"):
        return "auto"
    if d == "gpu" or _device_entry(d) is not None:
        return d
    if d == "disk":
        if not allow_disk:
            raise UsageError(f"{flag}: 'disk' is only valid for --params-backend (weights stay in the model "
                             f"file); graphs run on cpu or a GPU")
        return d
    if "&" in d:
        raise UnsupportedError(f"{flag}: layer split across devices ('{name}') is planned and run on simulated "
                               f"devices only so far (sdrt.engine.layer_split); no GPU backend runs a split graph yet")
    if d.startswith(_OTHER_BACKENDS):
        raise UnsupportedError(f"{flag}: device '{name}': sdrt has no such backend yet "
                               f"({' and '.join(device_syntax())} only)")
    names = [f"{e.prefix}0, {e.prefix}1, ..." if e.indexed else e.prefix for e in entries() if e.device]
    valid = ", ".join(names + ["gpu", "auto"] + (["disk"] if allow_disk else []))
    raise UsageError(f"{flag}: unknown device '{name}'; valid: {valid}")


def parse_assignments(spec: str | None, flag: str, *, allow_disk: bool = False) -> dict[str, str]:
    """`cuda0` -> {'*': 'cuda0'}; `diffusion=cuda0,te=cpu` -> {'diffusion': 'cuda0', 'te': 'cpu'}."""
    out: dict[str, str] = {}
    parts = [p.strip() for p in str(spec or "").split(",") if p.strip()]
    for part in parts:
        if "=" in part:
            mod, dev = part.split("=", 1)
            out[canonical_module(mod, flag)] = check_device(dev, flag, allow_disk)
        elif len(parts) > 1:
            raise UsageError(f"{flag}: '{part}' in a list needs a module (module=device), e.g. "
                             f"diffusion=cuda0,te=cpu")
        else:
            out["*"] = check_device(part, flag, allow_disk)
    return out


def parse_max_vram(spec) -> dict[str, float]:
    """`--max-vram`: GiB as one number (every device) or `cuda0=6,cuda1=4`; {} when unset."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return {}
    if isinstance(spec, (int, float)):
        return {"*": float(spec)}
    out: dict[str, float] = {}
    for part in str(spec).split(","):
        part = part.strip()
        key, val = part.split("=", 1) if "=" in part else ("*", part)
        key = key.strip().lower()
        key = "*" if key in DEFAULT_KEYS else key
        if key != "*" and _device_entry(key) is None:
            raise UsageError(f"--max-vram: unknown device '{key}' in '{spec}'; e.g. 6 or cuda0=6,cuda1=4")
        try:
            out[key] = float(val)
        except ValueError:
            raise UsageError(f"--max-vram: '{val.strip()}' is not a number of GiB (e.g. 6, 0, -1)") from None
    return out


def max_vram_for(table: dict[str, float], device: str) -> float | None:
    return table.get(device, table.get("*"))


def resolve_budget(gib: float | None, free: int) -> int | None:
    """The managed byte budget of a device: positive GiB = that budget; negative = free memory
    now (startup snapshot) minus that many GiB; 0 or unset = None (live free memory decides)."""
    if gib is None or gib == 0:
        return None
    if gib > 0:
        return int(gib * GiB)
    return max(int(free + gib * GiB), 0)


def classify_tensor(name: str) -> str | None:
    """sd.cpp's classify_tensor on canonical names: diffusion, vae, te, controlnet or None."""
    if name.startswith("control_model."):    # --control-net's tensors (sdrt.models.diffusion.controlnet)
        return "controlnet"
    if name.startswith(("model.diffusion_model.", "unet.")):
        return "diffusion"
    if name.startswith(("first_stage_model.", "vae.", "tae.")):
        return "vae"
    if (name.startswith(("text_encoder.", "text_embedding_projection.", "te.text_model.")) or
            any(k in name for k in ("text_encoders", "cond_stage_model", "conditioner", ".aggregate_embed."))):
        return "te"
    return None


def component_sizes(tensors: dict) -> dict[str, tuple[int, int]]:
    """{component: (weight bytes incl. sd.cpp's 64 B per tensor, largest tensor bytes)}."""
    out: dict[str, list[int]] = {}
    for name, t in tensors.items():
        c = classify_tensor(name)
        if c is None:
            continue
        s = out.setdefault(c, [0, 0])
        s[0] += t.nbytes + TENSOR_OVERHEAD
        s[1] = max(s[1], t.nbytes)
    return {c: (a, b) for c, (a, b) in out.items()}


def ram_budget() -> int | None:
    """MemAvailable minus max(2 GiB, 10%) (backend_fit.cpp); None when it cannot be read."""
    avail = mem_available()
    return None if avail is None else max(avail - max(2 * GiB, avail // 10), 0)


@dataclass
class GpuInfo:
    name: str
    free: int
    total: int


@dataclass
class Placement:
    """Per component: `backend` (where it computes) and `params` (cpu, disk or that device)."""
    backend: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    auto_fit: bool = False
    max_vram: dict[str, float] = field(default_factory=dict)

    def devices(self) -> list[str]:
        return sorted({d for d in self.backend.values() if d != "cpu"})

    def spec(self) -> tuple[str, str]:
        """(--backend, --params-backend) strings that reproduce this placement."""
        be = ",".join(f"{c}={d}" for c, d in self.backend.items())
        pa = ",".join(f"{c}={d}" for c, d in self.params.items() if d != self.backend.get(c))
        return be, pa


def _gpu_budget(g: GpuInfo, max_vram: dict[str, float]) -> int:
    gib = max_vram_for(max_vram, g.name)
    if gib is not None and gib > 0:
        return min(int(gib * GiB), g.free)
    if gib is not None and gib < 0:
        return max(int(g.free + gib * GiB), 0)
    return max(g.free - GPU_MARGIN, 0)


def auto_fit(sizes: dict[str, tuple[int, int]], gpus: list[GpuInfo], max_vram: dict[str, float],
             ram: int | None, backend: dict[str, str] | None = None) -> Placement:
    """sd.cpp's auto-fit plan (compute_plan): one main GPU computes everything (or each component
    where `backend` says: an explicit --backend without --params-backend); weights go to their
    compute GPU, else host RAM, else disk, in priority order diffusion > te > vae."""
    comps = [c for c in COMPONENTS if c in sizes]
    plan = Placement(auto_fit=True, max_vram=dict(max_vram))
    budgets = {g.name: _gpu_budget(g, max_vram) for g in gpus}
    if backend is None:
        usable = [g for g in gpus if budgets[g.name] > 0]
        if not usable:
            for c in comps:
                plan.backend[c] = plan.params[c] = "cpu"
            why = "no GPU" if not gpus else "no GPU has memory to spare"
            log.info("auto-fit: %s; everything runs on cpu", why)
            return plan
        main = max(usable, key=lambda g: budgets[g.name]).name  # max() keeps the first on a tie
        backend = dict.fromkeys(comps, main)
    remaining, ram_left = dict(budgets), ram
    rank = {c: i for i, c in enumerate(COMPONENTS)}
    for c in comps:
        dev = plan.backend[c] = backend[c]

        def headroom(c=c, dev=dev) -> int:
            h = 0
            for o in comps:
                if backend[o] != dev:
                    continue
                resident = o == c or plan.params.get(o) == dev
                extra = 0 if resident else (sizes[o][0] if rank[o] < rank[c] else sizes[o][1])
                h = max(h, RESERVE[o] + extra)
            return h

        need = sizes[c][0]
        if dev == "cpu":
            plan.params[c] = "cpu"
        elif dev in remaining and need <= remaining[dev] - headroom():
            plan.params[c] = dev
            remaining[dev] -= need
        elif ram_left is not None and need <= ram_left:
            plan.params[c] = "cpu"
            ram_left -= need
        else:
            plan.params[c] = "disk"
    be, pa = plan.spec()
    devs = sorted({d for d in plan.backend.values() if d in budgets})
    log.info("auto-fit plan (compute on %s): budget %s; %s", ", ".join(devs) or "cpu",
             ", ".join(f"{d} {budgets[d] / MiB:.0f} MB" for d in devs) or "-",
             ", ".join(f"{c} {sizes[c][0] / MiB:.0f} MB -> {plan.params[c]}" for c in comps))
    log.info('auto-fit: --backend "%s" --params-backend "%s"', be, pa)
    return plan


def gpu_devices() -> list[GpuInfo]:
    """The usable devices with their own memory (sdrt.ops.backend's registry), with their live
    free/total memory ([] without any)."""
    from ..ops.backend import get_backend, gpu_names
    out = []
    for name in gpu_names():
        free, total = get_backend(name).memory.mem_get_info()
        out.append(GpuInfo(name, int(free), int(total)))
    return out


def check_devices(mp) -> None:
    """Fail fast (before any model file is read) when an explicit placement names a device this
    machine lacks; auto-fit only looks at devices that exist."""
    if mp.backend or mp.params_backend or mp.offload_to_cpu or mp.clip_on_cpu or mp.vae_on_cpu or not mp.auto_fit:
        resolve_placement(mp, dict.fromkeys(COMPONENTS, (0, 0)))


def _unusable_reason(d: str) -> str:
    """Why device `d` (a registered GPU name) is not usable: 'no CUDA device is usable: ...'."""
    from ..ops.backend import unavailable_reason
    e = _device_entry(d)
    why = unavailable_reason(e.prefix) if e is not None else None
    return f"no {e.prefix.upper() if e else 'such'} device is usable: {why or 'no device found'}"


def resolve_placement(mp, sizes: dict[str, tuple[int, int]], gpus: list[GpuInfo] | None = None,
                      ram: int | None = None) -> Placement:
    """The placement of every component in `sizes` for ModelParams `mp`. `gpus` defaults to the
    machine's CUDA devices (queried only when needed). Raises UsageError for bad specs and
    UnsupportedError for devices this machine or sdrt lacks."""
    # the compatibility flags come first, so the explicit specs override them entry by entry
    backend = {**({"te": "cpu"} if mp.clip_on_cpu else {}), **({"vae": "cpu"} if mp.vae_on_cpu else {}),
               **parse_assignments(mp.backend, "--backend")}
    params = {**({"*": "cpu"} if mp.offload_to_cpu else {}),
              **parse_assignments(mp.params_backend, "--params-backend", allow_disk=True)}
    max_vram = parse_max_vram(mp.max_vram)
    comps = [c for c in COMPONENTS if c in sizes]
    if mp.auto_fit and not backend and not params:
        gpus = gpu_devices() if gpus is None else gpus
        return _control_net_cpu(mp, auto_fit(sizes, gpus, max_vram, ram_budget() if ram is None else ram))
    wanted = set(backend.values()) | set(params.values())
    if not all(c in backend for c in comps) and "*" not in backend:
        wanted.add("auto")      # a component without a device runs on the default one
    needs_gpu = any(d not in ("cpu", "disk") for d in wanted)
    if gpus is None:
        gpus = gpu_devices() if needs_gpu else []
    names = [g.name for g in gpus]

    def device(d: str, flag: str) -> str:
        if d == "auto":
            return names[0] if names else "cpu"
        if d == "gpu":
            if not names:
                raise UnsupportedError(f"{flag}: 'gpu' asks for a GPU, and this machine has none sdrt can use "
                                       f"(devices: cpu)")
            return names[0]
        e = _device_entry(d)
        if e is not None and e.has_memory and d not in names:
            why = f"devices: {', '.join(['cpu'] + names)}" if names else _unusable_reason(d)
            raise UnsupportedError(f"{flag}: device '{d}' not found; {why}")
        return d

    plan = Placement(max_vram=max_vram)
    for c in comps:
        run = device(backend.get(c, backend.get("*", "auto")), "--backend")
        where = params.get(c, params.get("*"))
        where = run if where is None else ("disk" if where == "disk" else device(where, "--params-backend"))
        if where not in ("cpu", "disk") and where != run:
            raise UnsupportedError(f"--params-backend: {c} weights on {where} while {c} computes on {run}: sdrt "
                                   f"stages weights from host memory or disk only (use cpu, disk or {run})")
        plan.backend[c], plan.params[c] = run, where
    if mp.auto_fit and not params and any(d in names for d in plan.backend.values()):
        # sd.cpp: without --params-backend, auto-fit chooses where the weights live
        plan = auto_fit(sizes, gpus, max_vram, ram_budget() if ram is None else ram, backend=plan.backend)
    return _control_net_cpu(mp, plan)


def _control_net_cpu(mp, plan: Placement) -> Placement:
    """--control-net-cpu (sd.cpp's keep_control_net_on_cpu): the ControlNet computes on the CPU
    with its weights in RAM (or left on disk), whatever the other components do."""
    if getattr(mp, "control_net_cpu", False) and "controlnet" in plan.backend:
        plan.backend["controlnet"] = "cpu"
        if plan.params.get("controlnet") != "disk":
            plan.params["controlnet"] = "cpu"
    return plan
