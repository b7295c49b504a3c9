"""Device identity: which machine a profile was measured on, and its canonical hardware name.

The canonical names (`a100`, `h100`, `h200`, `l4`, `rtx4090`, `cpu`) key the spec sheets in
configs/hardware/ and the profile file names (profiles/<hardware>-<target>.json). A GPU is read
through NVML (pynvml: name, memory, clocks, driver, power limit) and torch (compute capability,
SM count); without a GPU, or without the NVML library, pynvml raises `pynvml.NVMLError` and the
identity falls back to torch alone, or to the CPU model and core count from the OS.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass

import torch

from decode.runtime.machine import cpu_cores, cpu_isa, cpu_model

logger = logging.getLogger(__name__)

# (regex on the device name, canonical name); first match wins. `L4` must not match L40/L40S.
_GPU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bA100\b", "a100"),
    (r"\bH100\b", "h100"),
    (r"\bH200\b", "h200"),
    (r"\bL4\b(?!\d)", "l4"),
    (r"\bRTX\s*4090\b", "rtx4090"),
)
HARDWARE_NAMES = ("a100", "h100", "h200", "l4", "rtx4090", "cpu")


@dataclass(frozen=True)
class DeviceInfo:
    """What a profile records about the machine it was measured on."""

    hardware: str  # canonical name (HARDWARE_NAMES) or "gpu-<slug>" for a GPU without a spec sheet
    kind: str  # "cuda" | "cpu"
    name: str  # raw device name (GPU product name or CPU model)
    memory_bytes: int
    variant: str | None = None  # e.g. "40gb" / "80gb" for the A100
    capability: str | None = None  # CUDA compute capability "9.0"
    sm_count: int | None = None
    sm_clock_mhz: int | None = None  # max SM clock
    mem_clock_mhz: int | None = None  # max memory clock
    driver: str | None = None
    power_limit_w: float | None = None
    cpu_model: str = ""
    cpu_cores: int = 0
    torch_threads: int = 0
    cpu_isa: str = ""  # the CPU's vector extensions that decide which kernels are fast (cpu_isa()), "" = unknown

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def canonical_name(device_name: str, kind: str = "cuda") -> str:
    """Canonical hardware name for a device name ("NVIDIA H200" -> "h200", any CPU -> "cpu")."""
    if kind == "cpu":
        return "cpu"
    for pattern, name in _GPU_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return name
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().replace("nvidia", "")).strip("-")
    return f"gpu-{slug or 'unknown'}"


def memory_variant(hardware: str, memory_bytes: int) -> str | None:
    """The memory variant of products sold in several sizes (A100 40/80 GB)."""
    if hardware != "a100" or memory_bytes <= 0:
        return None
    return "40gb" if memory_bytes < 60 * 2**30 else "80gb"


def other_machine(measured_on: DeviceInfo, here: DeviceInfo) -> str | None:
    """Why a profile measured on `measured_on` does not describe `here` (None: the same kind of machine).
    CPUs: model, cores and vector extensions (when both are known); GPUs: product name and memory variant."""
    if measured_on.kind != here.kind:
        return f"{measured_on.kind} vs {here.kind}"
    if here.kind == "cpu":
        a = (measured_on.cpu_model, measured_on.cpu_cores)
        b = (here.cpu_model, here.cpu_cores)
        if a != b:
            return f"{a[0]} ({a[1]} cores) vs {b[0]} ({b[1]} cores)"
        if measured_on.cpu_isa and here.cpu_isa and measured_on.cpu_isa != here.cpu_isa:
            return f"{a[0]} with {measured_on.cpu_isa} vs {here.cpu_isa}"
        return None
    if (measured_on.name, measured_on.variant) != (here.name, here.variant):
        return f"{measured_on.name} vs {here.name}"
    return None


def system_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _nvml_handle(pynvml, index: int, uuid: str | None):
    """NVML handle of torch's CUDA device `index`.

    Under CUDA_VISIBLE_DEVICES, torch's index is not NVML's (NVML always sees every GPU), so the
    device is looked up by its UUID when torch reports one; the index is the fallback.
    """
    if uuid:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except pynvml.NVMLError as err:
            logger.debug("NVML has no GPU with UUID %s (%s); using index %d", uuid, err, index)
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _nvml_fields(index: int, uuid: str | None = None) -> dict:
    """Fields NVML knows; {} when there is no NVML library (or no pynvml) or no such GPU.

    Every field is read on its own: boards differ in what they support (power limit on laptops,
    memory info on unified-memory parts), and a missing field must only leave that field None.
    """
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py is optional at run time: torch alone still names the GPU
        logger.debug("pynvml not installed; device identity from torch only")
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:  # LibraryNotFound / DriverNotLoaded on machines without a GPU
        logger.debug("NVML unavailable: %s", err)
        return {}

    def text(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    try:
        h = _nvml_handle(pynvml, index, uuid)
        out = {}
        for key, fn in (("name", lambda: text(pynvml.nvmlDeviceGetName(h))),
                        ("memory_bytes", lambda: int(pynvml.nvmlDeviceGetMemoryInfo(h).total)),
                        ("driver", lambda: text(pynvml.nvmlSystemGetDriverVersion())),
                        ("sm_clock_mhz", lambda: int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))),
                        ("mem_clock_mhz", lambda: int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM))),
                        ("power_limit_w", lambda: pynvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0)):
            try:
                out[key] = fn()
            except pynvml.NVMLError as err:
                logger.debug("NVML field %s unavailable: %s", key, err)
        return out
    except pynvml.NVMLError as err:
        logger.warning("NVML could not read GPU %d: %s", index, err)
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def local_device(device: torch.device | str | None = None) -> DeviceInfo:
    """Identity of the device that `device` (default: cuda if available, else cpu) names."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(cpu_model=cpu_model(), cpu_cores=cpu_cores(), torch_threads=torch.get_num_threads(),
                  cpu_isa=cpu_isa())
    if dev.type != "cuda":
        return DeviceInfo(hardware="cpu", kind="cpu", name=common["cpu_model"], memory_bytes=system_memory_bytes(),
                          **common)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)  # torch >= 2.0 on CUDA builds
    nvml = _nvml_fields(index, str(uuid) if uuid is not None else None)
    name = nvml.get("name", props.name)
    memory = int(nvml.get("memory_bytes", props.total_memory))
    hardware = canonical_name(name)
    return DeviceInfo(
        hardware=hardware, kind="cuda", name=name, memory_bytes=memory, variant=memory_variant(hardware, memory),
        capability=f"{props.major}.{props.minor}", sm_count=int(props.multi_processor_count),
        sm_clock_mhz=nvml.get("sm_clock_mhz"), mem_clock_mhz=nvml.get("mem_clock_mhz"), driver=nvml.get("driver"),
        power_limit_w=nvml.get("power_limit_w"), **common,
    )
