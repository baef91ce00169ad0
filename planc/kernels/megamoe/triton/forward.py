"""The launchers of the Triton Mega MoE kernels: staging, the FP8 activations, the local experts computation (L1
with its SwiGLU epilogue, L2) and the combine, on local tensors (`layout.PackedExperts` weights)."""

from __future__ import annotations

import torch

from planc.kernels.megamoe.triton import decode, fp8, hopper_prefill, hopper_prefill_ws, jit, target
from planc.kernels.megamoe.triton.config import KernelConfig, pick_config
from planc.kernels.megamoe.triton.layout import PackedExperts
from planc.kernels.megamoe.triton.routing import FUSED_ROUTE_MAX_SLOTS, no_slots, other_slots, route
from planc.kernels.megamoe.triton.target import triton


def device_config(num_rows: int, num_local_experts: int, hidden: int, inter: int, device: torch.device,
                  fp8: bool | None = None, num_experts: int | None = None) -> KernelConfig:
    """`pick_config` for this device: its SM count and whether the Gluon kernels (and the warp-specialized L2) and
    FP8 MMAs run on it (what a forward without an explicit config runs; the benchmark's sweep marks it); `fp8=False`:
    the pick without the FP8 path's rows; `num_experts`: the layer's global expert count (None: all are local)."""
    return pick_config(num_rows, num_local_experts, hidden, inter, target.sm_count(device),
                       gluon=hopper_prefill.gluon_unavailable_reason(device) is None,
                       warp_specialized=hopper_prefill_ws.unavailable_reason is None,
                       fp8=target.has_fp8_mma(device) if fp8 is None else fp8 and target.has_fp8_mma(device),
                       num_experts=num_experts)


def bf16_clamp(activation_clamp: float | None) -> float | None:
    """The kernel's clamp constant: c rounded to BF16."""
    if activation_clamp is None:
        return None
    return float(torch.tensor(activation_clamp, dtype=torch.bfloat16))


def combine(slot_outputs: torch.Tensor) -> torch.Tensor:
    """`reference.combine` (``[n, K, H]`` BF16 slot outputs -> ``bf16(sum_j fp32(o_j))`` in slot order), one kernel."""
    n, k, hidden = slot_outputs.shape
    out = torch.empty((n, hidden), dtype=torch.bfloat16, device=slot_outputs.device)
    if n == 0:
        return out
    if slot_outputs.stride(2) != 1:
        slot_outputs = slot_outputs.contiguous()
    bh = min(1024, triton.next_power_of_2(hidden))
    jit.combine_kernel[(n, triton.cdiv(hidden, bh))](
        slot_outputs, out, hidden, slot_outputs.stride(0), slot_outputs.stride(1), NUM_TOPK=k, BH=bh, num_warps=4,
    )
    return out


def stage(buf, hidden_states: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, rows: int) -> None:
    """`reference.stage` in one kernel (the same bytes): at decode its ~20 small torch ops cost more than L2."""
    n, hidden = hidden_states.shape
    if rows == 0:
        return
    if hidden_states.stride(1) != 1:
        hidden_states = hidden_states.contiguous()
    num_topk = buf.topk_idx.shape[1]
    bh = min(1024, triton.next_power_of_2(hidden))
    jit.stage_kernel[(rows, triton.cdiv(hidden, bh))](
        hidden_states, topk_idx.contiguous(), topk_weights.contiguous(), buf.x.view(torch.uint8), buf.x_sf,
        buf.topk_idx, buf.topk_weights, n, hidden, hidden_states.stride(0),
        NUM_TOPK=num_topk, BK=triton.next_power_of_2(num_topk), BH=bh, num_warps=4,
    )


def dequantize_x(x_fp8: torch.Tensor, x_sf: torch.Tensor, zero: dict | None = None) -> torch.Tensor:
    """FP8 rows ``[M, H]`` with UE8M0 bytes ``[M, H/32]`` -> the exact BF16 values L1 reads, one kernel; `zero`
    (`other_slots`): that kernel also zeroes the slot outputs of no local expert."""
    m, hidden = x_fp8.shape
    out = torch.empty((m, hidden), dtype=torch.bfloat16, device=x_fp8.device)
    bh = min(1024, triton.next_power_of_2(hidden))
    jit.dequant_x_kernel[(m, triton.cdiv(hidden, bh))](
        x_fp8.contiguous().view(torch.uint8), x_sf.contiguous(), out, hidden, **(zero or no_slots(x_fp8)), BH=bh,
        num_warps=4)
    return out


def triton_local_experts_forward(
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PackedExperts,
    *,
    first_expert: int,
    activation_clamp: float | None,
    num_experts: int | None = None,
    config: KernelConfig | None = None,
    fp8_path: bool = True,
) -> torch.Tensor:
    """`reference.local_experts_forward` on packed FP4 weights: BF16 ``[M, K, H]`` slot outputs, zeros for
    slots whose expert is not in ``[first_expert, first_expert + E_loc)``. Without a `config`, the tiles are picked
    for the rows the local experts receive of the layer's `num_experts` (`config.local_rows`); `fp8_path=False`:
    without the FP8 path's rows (`experts.megamoe.math: bf16`)."""
    m, k = topk_idx.shape
    hidden, inter, num_local = experts.hidden, experts.intermediate, experts.num_local_experts
    device = x_fp8.device
    if m == 0:
        return torch.zeros((m, k, hidden), dtype=torch.bfloat16, device=device)
    cfg = config or device_config(m * k, num_local, hidden, inter, device, fp8=None if fp8_path else False,
                                  num_experts=num_experts)
    cfg = cfg.fit(hidden, inter)
    interpret = target.interpreting()
    race = None if interpret else cfg.pipeline_race(target.REGISTER_PREFETCH)
    if race is not None:  # refuse before any launch: the kernels would run, and some slots would come back garbage
        raise ValueError(race)

    clamp = bf16_clamp(activation_clamp)
    if cfg.fp8:
        return fp8.fp8_local_experts_forward(x_fp8, x_sf, topk_idx, topk_weights, experts, first_expert=first_expert,
                                             clamp=clamp, config=cfg)
    weights = topk_weights.reshape(-1).float().contiguous()
    prefetch = bool(cfg.prefetch) and target.REGISTER_PREFETCH
    if cfg.decode and cfg.prologue and m * k <= FUSED_ROUTE_MAX_SLOTS:
        # one launch routes, dequantizes the tokens and zeroes the slots of no local expert; then L1 and L2
        out = torch.empty((m * k, hidden), dtype=torch.bfloat16, device=device)
        x, routed = decode.prologue(x_fp8, x_sf, topk_idx, out, first_expert=first_expert,
                                    num_local_experts=num_local, block_t=cfg.block_t, pdl=bool(cfg.pdl))
        decode.decode_forward(x, routed, weights, experts, out, num_topk=k, clamp=clamp, config=cfg,
                              prefetch=prefetch, interpret=interpret)
        return out.view(m, k, hidden)
    out = torch.empty((m * k, hidden), dtype=torch.bfloat16, device=device)
    x = dequantize_x(x_fp8, x_sf, other_slots(topk_idx, out, first_expert, num_local))  # L1 reads it by token
    sorted_slots, block_expert, block_row, block_end = route(
        topk_idx, first_expert=first_expert, num_local_experts=num_local, block_t=cfg.block_t
    )
    if cfg.decode:
        decode.decode_forward(x, (sorted_slots, block_expert, block_row, block_end), weights, experts, out,
                              num_topk=k, clamp=clamp, config=cfg, prefetch=prefetch, interpret=interpret)
        return out.view(m, k, hidden)
    nblocks = block_expert.numel()
    act = torch.empty((nblocks * cfg.block_t, inter), dtype=torch.bfloat16, device=device)
    w1, w2 = experts.w1, experts.w2
    s1 = experts.s1.reshape(num_local, -1).view(torch.int32)  # one int32 per (K block, row group, r): `shuffle_fp4`
    s2 = experts.s2.reshape(num_local, -1).view(torch.int32)
    if cfg.gluon:
        hopper_prefill.l1(x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, clamp=clamp,
                          num_topk=k, large=experts.large_scales, config=cfg)
        l2 = hopper_prefill_ws.l2 if cfg.gluon == 2 else hopper_prefill.l2
        l2(act, w2, s2, sorted_slots, block_expert, block_row, block_end, out, hidden=hidden,
           large=experts.large_scales, config=cfg)
        return out.view(m, k, hidden)
    split = cfg.l1_split
    ws = torch.empty((split, nblocks * cfg.block_t, 2 * inter) if split > 1 else (1,), dtype=torch.float32,
                     device=device)
    common = dict(HAS_CLAMP=clamp is not None, BT=cfg.block_t, BN=cfg.l1_n)
    regs = cfg.launch_registers()
    jit.l1_swiglu_kernel[(nblocks * (inter // cfg.l1_n), split)](
        x, w1, s1, sorted_slots, weights, block_expert, block_row, block_end, act, ws,
        hidden, inter, k, num_local,
        x.stride(0), w1.stride(0), s1.stride(0), act.stride(0),
        0.0 if clamp is None else clamp,
        BK=cfg.l1_k, LARGE=experts.large_scales, INTERPRET=interpret, NUM_STAGES=cfg.num_stages, SPLIT=split,
        PREFETCH=prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common, **regs,
    )
    if split > 1:
        jit.l1_reduce_kernel[(nblocks * (inter // cfg.l1_n),)](
            ws, sorted_slots, weights, block_expert, block_row, block_end, act, inter, num_local, act.stride(0),
            0.0 if clamp is None else clamp, SPLIT=split, num_warps=4, **common,
        )
    jit.l2_kernel[(nblocks * (hidden // cfg.l2_n),)](
        act, w2, s2, sorted_slots, block_expert, block_row, block_end, out,
        hidden, inter, num_local,
        act.stride(0), w2.stride(0), s2.stride(0), out.stride(0),
        BT=cfg.block_t, BN=cfg.l2_n, BK=cfg.l2_k, LARGE=experts.large_scales, INTERPRET=interpret,
        NUM_STAGES=cfg.num_stages, PREFETCH=prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **cfg.launch_registers("L2"),
    )
    return out.view(m, k, hidden)
