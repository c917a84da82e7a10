"""The attention forward for Hopper GPUs (sm_90) in Gluon, FlashAttention-3's structure; an alternative to the tl
forward of kernels/flash that the same backward consumes, used where it was measured faster.

    flash_hopper_forward(q, k, v, causal=True, sm_scale=None) -> (o, lse)
    unsupported(q, k, v, window=0, docs=None) -> str | None      None when the Gluon kernel takes these inputs
    AVAILABLE, UNAVAILABLE_REASON                                 this Triton has the Gluon API it uses

kernels.flash_attention (and the packed and compiled forms) launches it instead of the tl forward where
unsupported() says None and the hopper_forward option (kernels/options.py, FLASHGPT_HOPPER_FWD) gives it the
inputs: "auto" (the default) at head dim 128 with at least 4096 queries and keys, or at least 1024 with
B·Hq·Nq >= 262,144 query rows in all, and at head dim 64 without a causal mask the same from 2048, with one
from 4096 (kernels/flash/launch.py: _hopper_auto), "on" always, "off" never.
The backward: backward_launch.py launches a Gluon dK/dV kernel in FA3's structure with the tl backward's
inputs and outputs; kernels/flash/launch.py's _hopper_bwd runs the whole backward around it, after the tl dQ
kernel (fused=0) or with dQ added by the kernel itself (fused=1 to 6; 3 to 6 by TMA reduce-adds).
kernels.flash_attention's backward runs fused=5 at head dim 128 causal, 3 at 128 without a mask, 4 at 64 causal
and 6 at 64 without (kernels/flash/launch.py: hopper_bwd_form), where the hopper_backward option
(FLASHGPT_HOPPER_BWD) gives it the inputs: "auto" where it was timed faster than the tl backward
(kernels/flash/launch.py: HOPPER_BWD_AUTO_MIN_LEN, _hopper_bwd_takes), "on" always, "off" never; elsewhere the
tl backward, which reads either forward's O and log-sum-exp.

Supported: float16 and bfloat16; head dims 64 and 128; any Nq, Nk >= 1; causal (bottom-right aligned) or not;
GQA/MQA (Hq a multiple of Hkv); q, k, v with any strides that are 16-byte multiples and unit stride along the
head dim; compute capability 9.0 only. Not supported (the tl kernel's): float32, other head dims, sliding
windows, documents (varlen), the interpreter, other GPUs.

    forward.py   the Gluon kernel: producer warp (TMA), two or three consumer warpgroups (wgmma, online
                 softmax), ping-pong, persistent grid (causal: a tile list per program)
    schedule.py  the causal tile lists: longest first within groups of heads whose K/V fit in L2, balanced
    launch.py    which inputs it takes, TMA descriptors, grid, launch
    backward.py  the Gluon dK/dV kernel: producer warp (TMA: K, V once, a Q/dO ring), two consumer warpgroups
                 (wgmma), one program per 128 keys looping over the query blocks of the GQA group
    backward_launch.py   which inputs the Gluon dK/dV kernel takes, its descriptors, grid and launch
"""
from .launch import AVAILABLE, UNAVAILABLE_REASON, flash_hopper_forward, unsupported

__all__ = ["flash_hopper_forward", "unsupported", "AVAILABLE", "UNAVAILABLE_REASON"]
