"""`--device-memory`: a size (`80GB` decimal, `80GiB` binary, bytes) or a card name, and how it was read.

A card name means the memory torch reports for that card (`torch.cuda.get_device_properties(0).total_memory`,
what planc.load compares against), not the marketing figure: an "80 GB" H100 is 79.18 GiB to torch. Each row
says where its number comes from; where only the driver's total (`nvidia-smi --query-gpu=memory.total`) is
public, the row uses it and says so (torch reports about 0.5 GiB less: the driver's own reservation).

A card also names its compute capability, which sets the cuBLAS workspaces torch allocates through its caching
allocator (`cuda_workspaces`): they count in the peak a CUDA rank allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.compiler.memory import parse_size
from planc.compiler.units import human_bytes

MIB = 2**20


@dataclass(frozen=True)
class Card:
    """One accelerator: its name on the command line, its memory in bytes and where that number comes from."""

    name: str
    title: str
    memory: int
    source: str
    capability: tuple[int, int]  # CUDA compute capability (major, minor): sets torch's cuBLAS workspace size


CARDS = {c.name.lower(): c for c in (
    Card("H100", "NVIDIA H100 80GB HBM3 (SXM)", 85_017_493_504,
         "torch.cuda.get_device_properties(0).total_memory, measured 2026-12-06 on two machines (torch 2.11.0+cu130, "
         "driver 580.159.04); nvidia-smi: 81559 MiB", (9, 0)),
    Card("H200", "NVIDIA H200 141GB HBM3e (SXM)", round(139.81 * 2**30),
         "torch's out-of-memory message on an H200: `total capacity of 139.81 GiB`; nvidia-smi: 143771 MiB", (9, 0)),
    Card("B200", "NVIDIA B200 (HBM3e)", round(178.35 * 2**30),
         "cudaDeviceProp.totalGlobalMem (what torch reports) 178.35 GiB (pytorch/ao#4002); nvidia-smi: 183359 MiB "
         "(NVIDIA/TensorRT-LLM#10278)", (10, 0)),
    Card("A100-80GB", "NVIDIA A100 80GB", 81_920 * MIB, "nvidia-smi memory.total 81920 MiB (modal-labs/modal-client#2797)", (8, 0)),
    Card("A100-40GB", "NVIDIA A100 40GB", 40_960 * MIB, "nvidia-smi memory.total 40960 MiB (modal-labs/modal-client#2797)", (8, 0)),
    Card("H20", "NVIDIA H20 96GB HBM3", 97_871 * MIB, "nvidia-smi memory.total 97871 MiB (NVIDIA/nvtrust#128)", (9, 0)),
)}


# The cuBLAS workspaces torch hands each cuBLAS handle (pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp, read
# at commit 26a3905):
# one workspace per (handle, stream), allocated through the caching allocator at the handle's first matmul and kept
# for the process's life. Its size, without CUBLAS_WORKSPACE_CONFIG: 32 MiB on sm_90 (`4096 * 8 * 1024`), else
# `:4096:2:16:8` (two 4 MiB and eight 16 KiB chunks). A matmul through cuBLASLt (a Linear with a bias: the bias
# epilogue) gets a second, separate workspace per (handle, stream) unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1:
# CUBLASLT_WORKSPACE_SIZE, default 1024 KiB, capped at the cuBLAS workspace.
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLASLT_WORKSPACE = 1024 * 1024


def cuda_workspace_per_handle(capability: tuple[int, int] | None) -> int:
    """Bytes torch allocates for one cuBLAS handle on one stream on a card of `capability` (None: not known, the
    sm_90 rule, the larger): the cuBLAS workspace and the cuBLASLt one (counted always: a model without a biased
    Linear never allocates it, 1 MiB high)."""
    cublas = CUBLAS_WORKSPACE_DEFAULT if capability is not None and capability != (9, 0) else CUBLAS_WORKSPACE_SM90
    return cublas + min(CUBLASLT_WORKSPACE, cublas)


def cuda_workspaces(capability: tuple[int, int] | None, workload: str) -> int:
    """The workspaces one rank holds through a `workload`: one cuBLAS handle for the thread that runs the forward,
    and in training a second for autograd's device thread, which runs the backward (torch hands each thread a
    handle of its own, and each handle its own workspace)."""
    return (2 if workload == "train" else 1) * cuda_workspace_per_handle(capability)


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of device memory per rank and how `--device-memory` was read (printed with the budget); `card`: the
    card it named, if any."""

    bytes: int
    how: str
    card: Card | None = None


def _key(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def read_device_memory(text: str) -> DeviceMemory:
    """`H100` (a card in CARDS), `80GB` (10^9 bytes a GB), `80GiB` (2^30), `85899345920` (bytes) -> DeviceMemory;
    ValueError naming the forms and the cards otherwise."""
    by_key = {_key(name): card for name, card in CARDS.items()}
    card = by_key.get(_key(text))
    if card is None:
        started = [c for k, c in by_key.items() if k.startswith(_key(text))] if _key(text) else []
        if len(started) == 1:
            card = started[0]
        elif len(started) > 1 and text.strip() and not text.strip()[0].isdigit():
            raise ValueError(f"--device-memory {text!r} names several cards: write one of "
                             f"{', '.join(c.name for c in started)}")
    if card is not None:
        return DeviceMemory(card.memory, f"{text} read as the {card.title}: {human_bytes(card.memory, 2)} "
                                         f"({card.source})", card)
    try:
        size = parse_size(text)
    except ValueError:
        raise ValueError(
            f"--device-memory {text!r}: write a size (80GiB: 2^30 bytes a GiB, 80GB: 10^9 bytes a GB, or bytes) "
            f"or a card: {', '.join(c.name for c in CARDS.values())}"
        ) from None
    if size <= 0:
        raise ValueError(f"--device-memory {text!r}: the device needs some memory; write e.g. 80GiB or H100")
    unit = "".join(ch for ch in text if ch.isalpha()).lower()
    if unit.endswith("ib"):
        how = f"{text} read as binary units (2^30 bytes a GiB): {human_bytes(size, 2)}"
    elif unit:
        how = (f"{text} read as decimal units (10^9 bytes a GB): {human_bytes(size, 2)}; write "
               f"{text.strip()[:-1]}iB for binary units, or a card name such as H100")
    else:
        how = f"{text} read as bytes: {human_bytes(size, 2)}"
    return DeviceMemory(size, how)
