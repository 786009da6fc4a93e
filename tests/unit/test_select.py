"""Backend choice on real-shaped machine profiles, and the probe on this machine."""

from dataclasses import replace

import pytest

from llmd.backends import select
from llmd.backends.select import GPU, ModelFormats, Probe, choose, probe, refresh_gpus

GiB = 1024**3
CPU = Probe(os="Linux 6.1", arch="x86_64", cpu="AMD Ryzen 7", cpu_features=("avx2", "fma"), physical_cores=8,
            logical_cores=16, ram_total=32 * GiB, ram_available=24 * GiB, nvml="NVML unavailable: driver not loaded")
TRT = "1.2.1"
HF = ModelFormats(gguf=True, hf_checkpoint=True, n_layer=30, weights_bytes=100 * 1024**2, kv_bytes=400 * 1024**2)
GGUF_ONLY = replace(HF, hf_checkpoint=False)


def gpu(name: str, cc: tuple[int, int], vram_gib: float) -> GPU:
    return GPU(name, cc, int(vram_gib * GiB), int(vram_gib * 0.95 * GiB), "560.35")


def machine(g: GPU | None, trt: str | None = TRT, offload: bool = True, arch: str = "x86_64") -> Probe:
    return replace(CPU, gpus=(g,) if g else (), nvml="ok" if g else CPU.nvml, tensorrt_llm=trt,
                   llama_gpu_offload=offload, arch=arch)


def test_no_gpu_is_llama_cpp_on_the_cpu():
    c = choose(CPU, HF)
    assert (c.backend, c.precision, c.gpu_layers) == ("llama.cpp", "gguf", 0)
    assert "8 cores" in c.reason
    assert dict(c.rejected)["tensorrt"].startswith("no NVIDIA GPU found")


@pytest.mark.parametrize("g,precision", [
    (gpu("NVIDIA GeForce RTX 4090", (8, 9), 24), "fp8"),
    (gpu("NVIDIA H100", (9, 0), 80), "fp8"),
    (gpu("NVIDIA GeForce RTX 3060", (8, 6), 12), "int8"),
    (gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80), "int8"),
])
def test_tensorrt_by_compute_capability(g: GPU, precision: str):
    c = choose(machine(g), HF, trt_verified=True)
    assert (c.backend, c.precision, c.gpu) == ("tensorrt", precision, g.name)
    assert "{}.{}".format(*g.compute_capability) in c.reason
    assert "llama.cpp gguf" in dict(c.rejected)
    if precision == "int8":
        assert "FP8" in dict(c.rejected)["tensorrt fp8"]


def test_jetson_orin_is_int8():
    c = choose(machine(gpu("Orin", (8, 7), 32), arch="aarch64"), HF, trt_verified=True)
    assert (c.backend, c.precision) == ("tensorrt", "int8")


@pytest.mark.parametrize("g", [gpu("Tesla T4", (7, 5), 16), gpu("NVIDIA GeForce GTX 1080", (6, 1), 8)])
def test_older_gpus_use_llama_cpp_with_all_layers(g: GPU):
    c = choose(machine(g), HF)
    assert (c.backend, c.gpu_layers, c.gpu) == ("llama.cpp", 30, g.name)
    assert "compute capability" in dict(c.rejected)["tensorrt"]
    assert "all 30 layers" in c.reason


def test_unverified_tensorrt_is_chosen_only_when_asked_for():
    g = machine(gpu("NVIDIA GeForce RTX 4090", (8, 9), 24))
    c = choose(g, HF)
    assert c.backend == "llama.cpp" and c.gpu_layers == 30
    why = dict(c.rejected)["tensorrt"]
    assert "FP8 would apply" in why and "not been verified on a GPU" in why and "LLMD_BACKEND=tensorrt" in why
    asked = choose(g, HF, override="tensorrt")
    assert (asked.backend, asked.precision) == ("tensorrt", "fp8")


def test_gpu_without_tensorrt_llm():
    c = choose(machine(gpu("NVIDIA GeForce RTX 4090", (8, 9), 24), trt=None), HF)
    assert c.backend == "llama.cpp" and c.gpu_layers == 30
    assert "tensorrt_llm is not installed" in dict(c.rejected)["tensorrt"]


def test_model_with_only_a_gguf():
    c = choose(machine(gpu("NVIDIA GeForce RTX 4090", (8, 9), 24)), GGUF_ONLY)
    assert c.backend == "llama.cpp"
    assert "only a GGUF" in dict(c.rejected)["tensorrt"]


def test_partial_offload_when_vram_is_short():
    big = replace(GGUF_ONLY, weights_bytes=12 * GiB, kv_bytes=4 * GiB, n_layer=40)
    c = choose(machine(gpu("NVIDIA GeForce GTX 1080", (6, 1), 8)), big)
    assert c.backend == "llama.cpp" and 0 < c.gpu_layers < 40
    assert f"{c.gpu_layers} of 40 layers" in c.reason


def test_llama_cpp_without_offload_says_how_to_rebuild():
    c = choose(machine(gpu("Tesla T4", (7, 5), 16), offload=False), HF)
    assert c.gpu_layers == 0 and "GGML_CUDA=on" in c.reason


def test_overrides():
    g = machine(gpu("NVIDIA GeForce RTX 4090", (8, 9), 24))
    c = choose(g, HF, override="llama.cpp")
    assert c.backend == "llama.cpp" and c.overridden and c.gpu_layers == 30
    c = choose(CPU, HF, override="tensorrt")
    assert c.backend == "tensorrt" and c.overridden


def test_probe_on_this_machine_returns_cleanly():
    p = probe()
    assert p.physical_cores >= 1 and p.ram_total > 0
    if p.nvml != "ok":  # this CI machine: no NVML library, so no GPU, and no error either
        assert p.gpus == ()
        c = choose(p, GGUF_ONLY)
        assert c.backend == "llama.cpp" and c.gpu_layers == 0
    else:  # a GPU machine: every GPU has a compute capability and VRAM
        assert all(g.compute_capability >= (3, 0) and g.total_vram > 0 for g in p.gpus)


def test_each_load_reads_the_gpus_free_memory_again(monkeypatch: pytest.MonkeyPatch):
    """Another model (llmd's or another program's) took VRAM since the start: the next load puts
    only the layers that fit now on the GPU."""
    g = gpu("NVIDIA GeForce RTX 4060", (8, 9), 8)
    at_start = machine(g, trt=None)
    assert choose(at_start, GGUF_ONLY).gpu_layers == 30
    monkeypatch.setattr(select, "_gpus", lambda: ((replace(g, free_vram=300 * 1024**2),), "ok"))
    now = refresh_gpus(at_start)
    assert now.gpus[0].free_vram == 300 * 1024**2 and now.cpu == at_start.cpu
    assert 0 < choose(now, GGUF_ONLY).gpu_layers < 30
