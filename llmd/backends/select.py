"""Machine probe and backend choice, with the reasons and every rejected option.

`probe()` reads the machine: OS and CPU (psutil, /proc/cpuinfo), RAM, NVIDIA GPUs through NVML
(nvidia-ml-py; no library or no driver simply means no GPU), whether tensorrt_llm imports, and
whether llama-cpp-python was built with GPU offload. `choose()` is a pure function of a probe
and what formats a model has, so it is tested on real-shaped profiles:

    TensorRT-LLM FP8   compute capability >= 8.9, tensorrt_llm present, a HF checkpoint or engine
    TensorRT-LLM INT8  compute capability 8.0 to < 8.9, same conditions
    llama.cpp (GGUF)   everywhere else; with GPU layers when offload exists, as many as fit
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VRAM_HEADROOM = 0.9  # leave room for the desktop and the CUDA context


@dataclass(frozen=True)
class GPU:
    name: str
    compute_capability: tuple[int, int]
    total_vram: int
    free_vram: int
    driver: str = ""


@dataclass(frozen=True)
class Probe:
    os: str
    arch: str
    cpu: str
    cpu_features: tuple[str, ...]
    physical_cores: int
    logical_cores: int
    ram_total: int
    ram_available: int
    gpus: tuple[GPU, ...] = ()
    nvml: str = "not probed"  # "ok", or why there is no NVML view of GPUs
    tensorrt_llm: str | None = None  # version when it imports
    tensorrt_llm_error: str | None = None
    llama_gpu_offload: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelFormats:
    """What a model is available as (a model may have several)."""

    gguf: bool = True
    hf_checkpoint: bool = False  # config.json + safetensors: TensorRT-LLM can build from it
    trt_engine: bool = False  # a built TensorRT-LLM engine folder
    n_layer: int = 0
    weights_bytes: int = 0  # of the GGUF, for the GPU layer split
    kv_bytes: int = 0  # KV cache for the configured context and slots


@dataclass(frozen=True)
class Choice:
    backend: str  # "tensorrt" | "llama.cpp"
    precision: str  # "fp8" | "int8" | "gguf"
    gpu_layers: int = 0
    gpu: str | None = None
    reasons: tuple[str, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    overridden: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rejected"] = [{"option": o, "why": w} for o, w in self.rejected]
        return d

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


# llmd's TensorRT-LLM backend is written against TensorRT-LLM 1.2's documented API but has not run on
# a GPU yet: until benchmarks/gpu_check.sh passes on one, it is chosen only when asked for.
TRT_VERIFIED = False


def choose(probe: Probe, model: ModelFormats, override: str | None = None,
           trt_verified: bool = TRT_VERIFIED) -> Choice:
    """The fastest engine this machine and model support, why, and why not the others."""
    rejected: list[tuple[str, str]] = []
    gpu = max(probe.gpus, key=lambda g: (g.compute_capability, g.free_vram), default=None)

    trt_why_not = None
    if gpu is None:
        trt_why_not = "no NVIDIA GPU found" + (f" ({probe.nvml})" if probe.nvml not in ("ok", "") else "")
    elif gpu.compute_capability < (8, 0):
        cc = "{}.{}".format(*gpu.compute_capability)
        trt_why_not = f"{gpu.name} has compute capability {cc}; FP8 needs 8.9+ and INT8 kernels 8.0+"
    elif probe.tensorrt_llm is None:
        trt_why_not = "tensorrt_llm is not installed (pip install 'llmd[tensorrt]' from NVIDIA's index)" + (
            f": {probe.tensorrt_llm_error}" if probe.tensorrt_llm_error else "")
    elif not (model.hf_checkpoint or model.trt_engine):
        trt_why_not = "the model is only a GGUF file; TensorRT-LLM needs a Hugging Face checkpoint or a built engine"

    if gpu is not None and trt_why_not is None:
        fp8 = gpu.compute_capability >= (8, 9)
        cc = "{}.{}".format(*gpu.compute_capability)
        precision = "fp8" if fp8 else "int8"
        if not fp8:
            rejected.append(("tensorrt fp8", f"{gpu.name} (compute capability {cc}) has no FP8 tensor cores (8.9+)"))
        rejected.append(("llama.cpp gguf", "TensorRT-LLM is faster on this GPU"))
        trt = Choice("tensorrt", precision, gpu=gpu.name, rejected=tuple(rejected), reasons=(
            f"{gpu.name}, compute capability {cc}, {_gib(gpu.free_vram)} free",
            f"TensorRT-LLM {probe.tensorrt_llm} {precision.upper()}"
            + (" (FP8 weights and KV cache)" if fp8 else " (INT8 SmoothQuant or weight-only)"),
        ))
        if override == "tensorrt" or (override in (None, "auto") and trt_verified):
            return trt
        rejected.pop()  # llama.cpp is not rejected after all
        rejected.append(("tensorrt", f"TensorRT-LLM {precision.upper()} would apply on {gpu.name}, but llmd's "
                         "TensorRT backend has not been verified on a GPU yet; ask for it explicitly "
                         "(LLMD_BACKEND=tensorrt or --backend tensorrt)"))
    else:
        rejected.append(("tensorrt", trt_why_not or "not applicable"))

    if not model.gguf and override != "tensorrt":
        return Choice("none", "-", reasons=("this model is only a Hugging Face checkpoint or a TensorRT-LLM engine, "
                                            "and TensorRT-LLM cannot run here; add a GGUF of it for llama.cpp",),
                      rejected=tuple(rejected))
    # llama.cpp with as many layers on the GPU as fit
    layers, reasons = 0, ["llama.cpp with a GGUF model runs everywhere"]
    if gpu is not None and probe.llama_gpu_offload and model.n_layer:
        need = model.weights_bytes + model.kv_bytes
        room = int(gpu.free_vram * VRAM_HEADROOM)
        if need <= room:
            layers = model.n_layer
            reasons.append(f"all {layers} layers on {gpu.name} ({_gib(need)} of {_gib(room)} usable VRAM)")
        else:
            per_layer = need / model.n_layer
            layers = max(0, min(model.n_layer, int(room // per_layer)))
            reasons.append(f"{layers} of {model.n_layer} layers on {gpu.name}: the model needs {_gib(need)}, "
                           f"{_gib(room)} of VRAM is usable; the rest run on the CPU")
    elif gpu is not None and not probe.llama_gpu_offload:
        reasons.append(f"llama-cpp-python was built without GPU offload, so {gpu.name} is unused; "
                       "rebuild with CMAKE_ARGS=\"-DGGML_CUDA=on\"")
    else:
        reasons.append(f"on the CPU: {probe.physical_cores} cores, {_gib(probe.ram_available)} RAM available")
    choice = Choice("llama.cpp", "gguf", gpu_layers=layers, gpu=gpu.name if layers and gpu else None,
                    reasons=tuple(reasons), rejected=tuple(rejected))
    if override == "tensorrt":
        return Choice("tensorrt", "fp8" if gpu and gpu.compute_capability >= (8, 9) else "int8",
                      gpu=gpu.name if gpu else None, overridden=True,
                      reasons=("chosen by the user (LLMD_BACKEND / --backend)",),
                      rejected=(("automatic choice", choice.reason),))
    if override == "llama.cpp":
        return Choice(choice.backend, choice.precision, choice.gpu_layers, choice.gpu, overridden=True,
                      reasons=("chosen by the user (LLMD_BACKEND / --backend)", *choice.reasons),
                      rejected=choice.rejected)
    return choice


# ---- the probe --------------------------------------------------------------------------------


def cpu_identity() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and every flag it reports (the kernels llama.cpp picks follow them)."""
    name, flags = platform.processor() or platform.machine(), tuple[str, ...]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in ("", platform.machine()):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = tuple(sorted(set(value.split())))
    except OSError:
        pass
    return name, flags


_SIMD = ("avx", "avx2", "avx512f", "avx512_vnni", "fma", "f16c", "neon", "asimd", "sve", "amx_tile", "avx_vnni")


def _cpu() -> tuple[str, tuple[str, ...]]:
    name, flags = cpu_identity()
    return name, tuple(w for w in _SIMD if w in flags)


def _gpus() -> tuple[tuple[GPU, ...], str]:
    try:
        import pynvml
    except ImportError:
        return (), "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        return (), f"NVML unavailable: {e}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            out.append(GPU(name.decode() if isinstance(name, bytes) else str(name), (int(major), int(minor)),
                           int(mem.total), int(mem.free), driver))
        return tuple(out), "ok"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _tensorrt_llm() -> tuple[str | None, str | None]:
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("tensorrt_llm") is None:
        return None, None
    try:  # from the package metadata: importing tensorrt_llm takes seconds and loads CUDA into the daemon
        return metadata.version("tensorrt_llm"), None
    except metadata.PackageNotFoundError as e:
        return None, f"tensorrt_llm is importable but has no package metadata ({e})"


def _llama_offload() -> bool:
    try:
        import llama_cpp

        return bool(llama_cpp.llama_supports_gpu_offload())
    except Exception:
        return False


def probe() -> Probe:
    import psutil

    cpu, flags = _cpu()
    vm = psutil.virtual_memory()
    gpus, nvml = _gpus()
    trt, trt_err = _tensorrt_llm()
    return Probe(
        os=f"{platform.system()} {platform.release()}", arch=platform.machine(), cpu=cpu, cpu_features=flags,
        physical_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        logical_cores=psutil.cpu_count() or 1, ram_total=int(vm.total), ram_available=int(vm.available),
        gpus=gpus, nvml=nvml, tensorrt_llm=trt, tensorrt_llm_error=trt_err, llama_gpu_offload=_llama_offload(),
    )


def refresh_gpus(p: Probe) -> Probe:
    """`p` with the GPUs' free memory read now (NVML: a few milliseconds), the rest as probed."""
    gpus, nvml = _gpus()
    return dataclasses.replace(p, gpus=gpus, nvml=nvml) if gpus else p


def formats_of(row: dict[str, Any], fixed_ctx: int, n_slots: int) -> ModelFormats:
    """A registry row's formats and the sizes the GPU split needs (`fixed_ctx`: LLMD_CTX, 0 for auto)."""
    from llmd.models.gguf import read_gguf
    from llmd.models.memory import choose_ctx, estimate

    fmt = row.get("format", "gguf")
    folder = row.get("hf_path")
    engine = fmt == "engine" or bool(folder and list(Path(folder).glob("*.engine")))
    hf = bool(folder) and not engine
    if fmt != "gguf":
        return ModelFormats(gguf=False, hf_checkpoint=hf, trt_engine=engine)
    info = read_gguf(row["path"])
    est = estimate(info, choose_ctx(info, n_slots, fixed_ctx).n_ctx, n_slots)
    return ModelFormats(gguf=True, hf_checkpoint=hf, trt_engine=engine,
                        n_layer=info.n_layer, weights_bytes=est.weights, kv_bytes=est.kv)


__all__ = ["GPU", "Probe", "ModelFormats", "Choice", "choose", "probe", "formats_of"]
