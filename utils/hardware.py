"""Which GPU is here, what it can run, and the per-SM figures the course reasons with.

``PER_SM`` is the one place the hardware table lives (per SM, per clock; ANCHORS.md). Peak
figures for the whole chip follow from it and a clock: with the boost clock they are the
course's model figures (labelled "(model)"), not NVIDIA's datasheet figures, which assume a
lower clock (DATASHEET_DENSE_BF16_TFLOPS). Measured ceilings live in results files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchFigures:
    name: str  # marketing name of a typical part
    arch: str  # compile target
    mma_flops_per_clk: int  # dense bf16 tensor-core FLOP per clock per SM
    exp2_per_clk: int  # MUFU ex2 per clock per SM
    fma_per_clk: int  # fp32 FMA per clock per SM
    smem_bytes_per_clk: int  # shared-memory bandwidth per SM
    tmem_bytes: int  # tensor memory per SM (0: none)
    sms: int
    boost_clock_ghz: float  # typical boost clock used for chip-level estimates

    def chip_peak(self, per_clk: float) -> float:
        """Scale a per-SM per-clock figure to the whole chip per second."""
        return per_clk * self.sms * self.boost_clock_ghz * 1e9


PER_SM = {
    "sm_90": ArchFigures("H100 / H200", "sm_90a", 4096, 16, 128, 128, 0, 132, 1.98),
    "sm_100": ArchFigures("B200", "sm_100a", 8192, 16, 128, 128, 256 * 1024, 148, 1.965),
    "sm_103": ArchFigures("B300", "sm_103a", 8192, 32, 128, 128, 256 * 1024, 148, 1.965),
}


# NVIDIA's dense bf16 tensor-core figure for the H100/H200 SXM (datasheet): 4096 FLOP/clk/SM x
# 132 SMs at about 1.83 GHz. The boost clock above gives more: that product is the model's.
DATASHEET_DENSE_BF16_TFLOPS = {"sm_90": 989}

# HBM bandwidth by part, from NVIDIA's datasheets (peak; a streaming copy gets less, and
# results/<gpu>/microbench.json holds what one measured). Parts of one arch differ here.
HBM_DATASHEET_BYTES_PER_S = {
    "H200": 4.8e12,  # H200 SXM, HBM3e
}


@dataclass(frozen=True)
class Machine:
    gpu_name: str | None  # None: no CUDA GPU
    capability: tuple[int, int] | None
    arch: str  # "cpu", "sm_80", "sm_90", "sm_100", or "sm_XY" for others
    sm_count: int | None
    driver: str | None
    memory_gib: float | None

    @property
    def has_gpu(self) -> bool:
        return self.gpu_name is not None

    def can_run(self, needed: str) -> bool:
        """Whether a cell or kernel that needs ``needed`` ("cpu", "sm_80", "sm_90", "sm_100")
        can run here. Hopper-only (sm_90a) and Blackwell-only (sm_100a) instructions need that
        exact family; Ampere-style code runs on any later GPU."""
        if needed == "cpu":
            return True
        if not self.has_gpu:
            return False
        major = self.capability[0]
        if needed == "sm_80":
            return major >= 8
        if needed == "sm_90":
            return major == 9
        if needed == "sm_100":
            return major == 10
        raise ValueError(f"unknown requirement {needed!r}; use cpu, sm_80, sm_90 or sm_100")


def missing(need: str, machine: Machine | None = None) -> str | None:
    """Why this machine cannot run what needs ``need`` ("sm_80", "sm_90", "sm_100"), or None.
    The sentence is what a skipped GPU test reports."""
    m = machine or detect()
    if m.can_run(need):
        return None
    if not m.has_gpu:
        return f"needs a {need} GPU; this machine has no CUDA GPU (run `make gpu-test` on one)"
    return (f"needs a {need} GPU; this one is {m.gpu_name}, compute capability "
            f"{m.capability[0]}.{m.capability[1]}")


def _arch_of(capability: tuple[int, int]) -> str:
    major, minor = capability
    if major == 8:
        return "sm_80"
    if major == 9:
        return "sm_90"
    if major == 10:
        return "sm_100"
    return f"sm_{major}{minor}"


def device_arch(device) -> str | None:
    """The arch family of a torch device ("sm_80", "sm_90", "sm_100", ...); None for a CPU."""
    if torch.device(device).type != "cuda":
        return None
    return _arch_of(torch.cuda.get_device_capability(device))


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def detect() -> Machine:
    """Describe the machine. ``COURSE_FORCE_CPU=1`` pretends there is no GPU."""
    if os.environ.get("COURSE_FORCE_CPU") == "1" or not torch.cuda.is_available():
        return Machine(None, None, "cpu", None, None, None)
    props = torch.cuda.get_device_properties(0)
    cap = (props.major, props.minor)
    return Machine(
        gpu_name=props.name,
        capability=cap,
        arch=_arch_of(cap),
        sm_count=props.multi_processor_count,
        driver=_driver_version(),
        memory_gib=props.total_memory / 2**30,
    )


CHAPTER_NEEDS = {
    "00-02 (roofline, naive, online softmax)": "cpu",
    "03-04 (CuTe basics, Ampere-style flash kernel)": "sm_80",
    "05-08 (Hopper TMA + WGMMA kernels)": "sm_90",
    "09-10 (Blackwell TMEM, tcgen05, 2-CTA)": "sm_100",
}


def describe(machine: Machine | None = None) -> str:
    m = machine or detect()
    if m.has_gpu:
        head = (
            f"GPU: {m.gpu_name} (compute capability {m.capability[0]}.{m.capability[1]}, {m.arch}, "
            f"{m.sm_count} SMs, {m.memory_gib:.0f} GiB, driver {m.driver or 'unknown'})"
        )
    else:
        head = "No CUDA GPU here: GPU cells are skipped; kernels are compiled for their target."
    lines = [head]
    for chapters, need in CHAPTER_NEEDS.items():
        live = "runs live" if m.can_run(need) else "compile-only + stored results"
        lines.append(f"  chapters {chapters}: {live}")
    return "\n".join(lines)


def gpu_slug(name: str | None) -> str:
    """Folder name for results measured on a GPU: 'NVIDIA H200' -> 'h200'."""
    if not name:
        return "cpu"
    low = name.lower().replace("nvidia", "").strip()
    for token in ("gb200", "h200", "h100", "b200", "b300", "a100", "l40s", "rtx 4090"):
        if token in low:
            return token.replace(" ", "")
    return "".join(c if c.isalnum() else "-" for c in low).strip("-") or "gpu"
