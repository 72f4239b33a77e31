"""Rotary position embedding (RoFormer, arXiv 2104.09864) with interchangeable backends.

Convention (the one RoFormer and HF ``transformers`` use):
    head dimension d (even), pairs (x[2i], x[2i+1]) for i < d/2, angle theta_i = m / 10000^(2i/d) at
    position m:
        out[2i]   = x[2i] * cos(theta_i) - x[2i+1] * sin(theta_i)
        out[2i+1] = x[2i+1] * cos(theta_i) + x[2i] * sin(theta_i)
    i.e. the complex number x[2i] + 1j*x[2i+1] is multiplied by exp(1j*theta_i). This is the
    *interleaved* (GPT-J) layout, not the rotate-half (GPT-NeoX) layout that pairs (i, i + d/2).

Base and context extension (``model.rope_theta`` = T, ``rope_scaling``, ``rope_scaling_factor`` = s,
``rope_original_max_position`` = L; :func:`pair_divisors`), with inv_freq_i = T^(-2i/d):
    none    angle_i(m) = m * inv_freq_i                                  (RoFormer: T = 10000)
    linear  angle_i(m) = (m / s) * inv_freq_i               position interpolation (Chen et al. 2023)
    ntk     angle_i(m) = m * T'^(-2i/d), T' = T * s^(d/(d-2))   NTK-aware: the base raised so that the
            slowest pair is interpolated by s and the fastest barely changes (HF's dynamic NTK at factor s)
    yarn    (Peng et al. 2023, HF ``_compute_yarn_parameters`` with beta_fast = 32, beta_slow = 1)
            pair i turns L / (2 pi T^(2i/d)) times over L; c(r) = d ln(L / (2 pi r)) / (2 ln T) is the pair
            index that turns r times; lo = max(floor(c(32)), 0), hi = min(ceil(c(1)), d - 1) (hi += 0.001
            if equal); ramp_i = clamp((i - lo) / (hi - lo), 0, 1);
            angle_i(m) = m * inv_freq_i * ((1 - ramp_i) + ramp_i / s): fast pairs extrapolate unchanged,
            slow ones are interpolated by s, a linear blend between; and cos, sin are multiplied by the
            attention factor mscale = 0.1 ln(s) + 1 (1 for s = 1), so every q.k scales by mscale^2.
Tables are computed in float64 and rounded to float32 once. A model reconfigures its tables in place
with :func:`set_rope` (no parameters change: a curriculum stage or an evaluation may switch settings).

Shapes:
    q, k, x   (B, S, N, D)  batch, sequence, heads, head_dim; any strides with stride(-1) == 1.
              (B, S, H, D) is what a QKV projection gives without a transpose; pass
              ``q.transpose(1, 2)`` to SDPA afterwards.
    cos, sin  (S, D/2) float32, from :class:`RotaryCache`.
All backends compute in float32 and cast the result back to the input dtype.

Backends (``rotate_pair`` is the one dispatch; ``apply_rotary`` / ``rotate`` call it for two / one tensor):
    reference   eager: one complex multiplication per tensor, and an autograd.Function whose backward
                is the inverse rotation (nothing but cos/sin is saved for backward).
    compiled    the same rotation as one ``torch.compile``d kernel for q and k; backward reuses it with -sin.
    triton      one kernel launch for q and k together, forward and backward (``rotary_triton.py``;
                GPU; on CPU only under ``TRITON_INTERPRET=1``, which the tests use).
    apex        NVIDIA apex's fused RoPE. It only does rotate-half; the model permutes its projection
                weights (:func:`half_layout_weights`, kernel name :data:`HALF_LAYOUT`) so that no
                activation is permuted at run time; ``apply_rotary(backend="apex")`` permutes activations.
    flash_attn  ``flash_attn.layers.rotary.apply_rotary_emb(..., interleaved=True)``.
    auto        chosen by measurement (``nn/rotary_tune.py``): the trainer times forward and backward of
                each candidate at the stage's shape on its device (compiled when the model is) and takes
                the fastest, once per stage shape (cached in the run directory). Without a measurement
                (a model used outside the trainer) :func:`model_kernel` takes the fixed preference:
                CUDA: triton > flash_attn > reference; CPU: reference (apex only when asked for).

The model resolves its backend once, outside the forward (``model.set_rotary_kernel``: at build for a
device and at each curriculum stage), and calls :func:`run_kernel` with the name: ``torch.compile``
cannot trace the resolution (it looks for installed packages).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from typing import Callable, Optional

import torch

from roformer_dist.config import RopeScaling, RopeSettings, RotaryBackend, choices

BACKENDS: tuple[str, ...] = choices(RotaryBackend)
"""The values of ``model.rotary_backend``."""

HALF_LAYOUT = "apex:half"
"""Kernel name for inputs already in the rotate-half layout (the model's permuted projection rows,
see :func:`half_layout_weights`): apex's kernel applies directly, no permutation at run time."""


# --------------------------------------------------------------------------- cos/sin cache


DEFAULT_ROPE = RopeSettings()
"""RoFormer's rotary settings (base 10000, no scaling)."""

YARN_BETA_FAST = 32.0
"""YaRN: pairs that turn more often than this over the original length keep their frequency."""
YARN_BETA_SLOW = 1.0
"""YaRN: pairs that turn less often than this over the original length are interpolated fully."""


def yarn_mscale(factor: float) -> float:
    """YaRN's attention factor for cos and sin: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def _yarn_ramp(head_dim: int, base: float, original_len: float, device) -> torch.Tensor:
    """(D/2,) float64 ramp_i of the module docstring: 0 = extrapolate (keep), 1 = interpolate."""
    def pair_turning(rotations):  # the (fractional) pair index that turns ``rotations`` times over L
        return head_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(pair_turning(YARN_BETA_FAST)), 0)
    hi = min(math.ceil(pair_turning(YARN_BETA_SLOW)), head_dim - 1)
    if hi == lo:
        hi += 0.001
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return ((i - lo) / (hi - lo)).clamp(0.0, 1.0)


def pair_divisors(head_dim: int, base: float = 10000.0, scaling: RopeScaling = "none", factor: float = 1.0,
                  original_len: Optional[float] = None, device: Optional[torch.device] = None
                  ) -> tuple[torch.Tensor, float]:
    """(w, mscale): float64 (head_dim/2,) divisors with angle_i(m) = m / w_i, and the factor on cos and sin,
    for the settings of the module docstring (``original_len``: yarn's L, needed for yarn only)."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    if scaling not in choices(RopeScaling):
        raise ValueError(f"rope_scaling: expected one of {', '.join(choices(RopeScaling))}, got {scaling!r}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim  # 2i/d
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    divisors = torch.pow(torch.tensor(base, dtype=torch.float64, device=device), exponents)  # T^(2i/d)
    if scaling == "linear":
        return divisors * factor, 1.0
    if scaling == "yarn":
        if original_len is None:
            raise ValueError("rope_scaling yarn: needs the original length (rope_original_max_position)")
        ramp = _yarn_ramp(head_dim, base, original_len, device)
        return divisors / ((1.0 - ramp) + ramp / factor), yarn_mscale(factor)
    return divisors, 1.0


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0, device: Optional[torch.device] = None, *,
                  scaling: RopeScaling = "none", factor: float = 1.0, original_len: Optional[float] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim/2), float32, for the settings of :func:`pair_divisors`.

    Angles are computed in float64 as ``m / w_i`` and rounded once; with the defaults (``m / base**(2i/d)``)
    exactly as HF's ``RoFormerSinusoidalPositionalEmbedding`` does, so our tables match theirs.
    """
    divisors, mscale = pair_divisors(head_dim, base, scaling, factor, original_len, device)
    pos = torch.arange(seq_len, dtype=torch.float64, device=device)
    angles = pos[:, None] / divisors[None, :]  # (S, D/2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.float(), sin.float()


class RotaryCache:
    """float32 cos/sin tables per device, built for ``max_len`` and extended on demand.

    ``rope``: the settings (``config.RopeSettings``, e.g. ``config.rope_settings(model_cfg)``); None =
    :data:`DEFAULT_ROPE`. ``max_len``: the longest length expected
    (model.max_position_embeddings): the tables' first size and, with rope_original_max_position None,
    the original length is ``max_len / rope_scaling_factor``. Any longer length is served on demand.

    Not an ``nn.Module`` buffer on purpose: ``model.to(torch.bfloat16)`` (DeepSpeed bf16) must not
    round the angles, and :func:`set_rope` may change the settings of a built model.
    """

    def __init__(self, head_dim: int, max_len: int, rope: Optional[RopeSettings] = None):
        self.head_dim = head_dim
        self.configure(DEFAULT_ROPE if rope is None else rope, max_len)

    def configure(self, rope: RopeSettings, max_len: Optional[int] = None) -> None:
        """New settings (and ``max_len``, if given); the cached tables are dropped."""
        if not isinstance(rope, RopeSettings):
            raise TypeError(f"rotary settings: expected a config.RopeSettings, got {type(rope).__name__}")
        self.rope = rope
        if max_len is not None:
            self.max_len = max_len
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def original_len(self) -> float:
        """yarn's original length L: rope_original_max_position, or max_len / rope_scaling_factor."""
        original = self.rope.rope_original_max_position
        return original if original is not None else self.max_len / self.rope.rope_scaling_factor

    def get(self, seq_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (seq_len, head_dim/2) float32 on ``device``."""
        device = torch.device(device)
        tables = self._tables.get(device)
        if tables is None or tables[0].shape[0] < seq_len:
            length = max(seq_len, self.max_len)
            if tables is not None:  # extending: grow geometrically so a slowly growing S rebuilds rarely
                length = max(length, 2 * tables[0].shape[0])
            tables = rotary_tables(length, self.head_dim, self.rope.rope_theta, device,
                                   scaling=self.rope.rope_scaling, factor=self.rope.rope_scaling_factor,
                                   original_len=self.original_len)
            self._tables[device] = tables
        cos, sin = tables
        return cos[:seq_len], sin[:seq_len]


def set_rope(module: torch.nn.Module, rope: RopeSettings, max_len: Optional[int] = None) -> int:
    """Give every :class:`RotaryCache` reachable from ``module`` the settings ``rope``
    (a stage plan's ``rope``, ``config.rope_settings(cfg.model)``) and, if given, ``max_len`` (the model.max_position_embeddings
    in force, e.g. raised by a fork: yarn's default original length is ``max_len / factor``); their tables
    are rebuilt on next use. Returns how many caches changed (0 for absolute positions or a pipeline stage
    without layers).

    ``module``: a plain model, its tensor-parallel form, a pipeline stage or ``PipelineModule``, or a
    DeepSpeed engine (its ``.module`` is a submodule): caches are found as attributes of any submodule.
    Validate the settings first (``config.validate_rope``)."""
    caches = {id(c): c for m in module.modules() for c in vars(m).values() if isinstance(c, RotaryCache)}
    for cache in caches.values():
        cache.configure(rope, max_len)
    return len(caches)


# --------------------------------------------------------------------------- reference (eager)


def _as_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., D) real -> (..., D/2) complex view, float32 (a view when x is fp32 with even strides)."""
    x = x.float()
    if x.stride(-1) != 1 or any(s % 2 for s in x.stride()[:-1]) or x.storage_offset() % 2:
        x = x.contiguous()
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def _broadcast_table(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(S, D/2) -> (S, 1, ..., 1, D/2) so that it broadcasts against x (B, S, ..., D)."""
    return t.view(t.shape[0], *([1] * (x.dim() - 3)), t.shape[1])


def _rotate_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # Inside a compiled model (trainer.compile): inductor has no complex dtype; the same rotation
        # in real arithmetic (equal up to rounding, see tests/test_compile.py).
        return _rotate_pairs_formula(x, cos, sin)
    freqs = _broadcast_table(torch.complex(cos.float(), sin.float()), x)
    return torch.view_as_real(_as_pairs(x) * freqs).flatten(-2).to(x.dtype)


class _ReferenceRotary(torch.autograd.Function):
    """Rotation of any number of tensors at the same positions; backward rotates by -theta."""

    @staticmethod
    def forward(ctx, cos, sin, *xs):
        ctx.save_for_backward(cos, sin)
        return tuple(_rotate_complex(x, cos, sin) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        cos, sin = ctx.saved_tensors
        return (None, None, *(None if g is None else _rotate_complex(g, cos, -sin) for g in grads))


# --------------------------------------------------------------------------- compiled


def _rotate_pairs_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain real-arithmetic formula; inductor fuses it into one loop (no complex dtype in inductor)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = _broadcast_table(cos, x), _broadcast_table(sin, x)
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(x.dtype)


def _pair_formula(q, k, cos, sin):
    return _rotate_pairs_formula(q, cos, sin), _rotate_pairs_formula(k, cos, sin)


@functools.cache
def _compiled_kernel(which: str):
    fn = _pair_formula if which == "pair" else _rotate_pairs_formula
    return torch.compile(fn, dynamic=None)


def _compiled(which: str):
    """The compiled formula; inside a compiled model (``trainer.compile``) the plain formula, which the
    model's own compilation fuses (no second compile, and no cached call for dynamo to trace)."""
    if torch.compiler.is_compiling():
        return _pair_formula if which == "pair" else _rotate_pairs_formula
    return _compiled_kernel(which)


class _CompiledRotary(torch.autograd.Function):
    """Compiled forward; backward is the same compiled kernel with -sin (the inverse rotation), which
    is ~2x faster than inductor's generated backward and saves nothing but cos/sin."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        if k is None:
            return _compiled("single")(q, cos, sin), None
        return _compiled("pair")(q, k, cos, sin)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        if gk is None:
            return _compiled("single")(gq, cos, -sin), None, None, None
        dq, dk = _compiled("pair")(gq, gk, cos, -sin)
        return dq, dk, None, None


# --------------------------------------------------------------------------- triton


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``): the kernel then runs on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON: Optional[tuple] = None
"""(kernel, next_power_of_2, cdiv) once :func:`load_triton` ran."""


def load_triton() -> None:
    """Import the Triton kernel (first use only): triton decides when a kernel is defined whether it is
    compiled or interpreted, and triton is an optional dependency. Called when the kernel is chosen
    (:func:`model_kernel`), so that a compiled forward reads a plain global."""
    global _TRITON
    if _TRITON is None:
        import triton

        from roformer_dist.nn import rotary_triton

        _TRITON = (rotary_triton.rope_kernel, triton.next_power_of_2, triton.cdiv)


TRITON_TILE = 4096
"""Elements of x1 one program of the Triton kernel rotates (whole rows of D): enough contiguous work per
program to stream at memory speed on a GPU, and few programs for the CPU interpreter."""


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 4:
        raise ValueError(f"triton rotary expects (B, S, H, D) tensors, got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _triton_launch(x1, x2, cos, sin, backward: bool):
    """One kernel launch rotating x1 and (if given) x2, (B, S, H, D) each with any head/position strides;
    x1 and x2 of different head counts take a launch each."""
    if _TRITON is None:
        load_triton()
    kernel, next_pow2, cdiv = _TRITON
    if x2 is not None and x2.shape != x1.shape:
        return _triton_launch(x1, None, cos, sin, backward)[0], _triton_launch(x2, None, cos, sin, backward)[0]
    x1 = _as_4d(x1)
    x2 = _as_4d(x2) if x2 is not None else None
    B, S, H, D = x1.shape
    o1 = torch.empty(x1.shape, dtype=x1.dtype, device=x1.device)
    o2 = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device) if x2 is not None else o1
    x2_ = x2 if x2 is not None else x1
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    block_d2 = next_pow2(D // 2)
    block_r = max(1, TRITON_TILE // (2 * block_d2))
    rows = B * S * H
    kernel[(cdiv(rows, block_r),)](
        x1, x2_, o1, o2, cos, sin,
        x1.stride(0), x1.stride(1), x1.stride(2), x2_.stride(0), x2_.stride(1), x2_.stride(2),
        o1.stride(0), o1.stride(1), o1.stride(2), o2.stride(0), o2.stride(1), o2.stride(2),
        rows, S, H, D // 2,
        HAS_X2=x2 is not None, BACKWARD=backward, BLOCK_R=block_r, BLOCK_D2=block_d2,
    )
    return o1, (o2 if x2 is not None else None)


class _TritonRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.has_x2 = x2 is not None
        return _triton_launch(x1, x2, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, g1, g2):
        # autograd materialises missing output grads as zeros, so g1 (and g2 with x2) are tensors
        cos, sin = ctx.saved_tensors
        d1, d2 = _triton_launch(g1, g2 if ctx.has_x2 else None, cos, sin, backward=True)
        return d1, d2, None, None


# --------------------------------------------------------------------------- apex (rotate-half)


def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None and \
        importlib.util.find_spec("apex.transformer.functional") is not None


def interleaved_to_half_index(head_dim: int) -> torch.Tensor:
    """Index that reorders one head's dims to evens-then-odds: [0, 2, 4, ..., 1, 3, 5, ...].

    After it, interleaved pair (2i, 2i+1) sits at (i, i + d/2): the rotate-half layout.
    """
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def qk_half_permutation(num_heads: int, head_dim: int, num_parts: int = 3,
                        permuted_parts: tuple[int, ...] = (0, 1)) -> torch.Tensor:
    """Row order of a fused (q, k, v) projection weight that makes rotate-half compute RoFormer.

    Permuting the rows of the q and k projections per head (evens then odds) permutes the head dims
    of q and k identically; q.k is unchanged by a common permutation, and rotate-half on the
    permuted vectors rotates exactly the interleaved pairs. So an apex (rotate-half-only) kernel
    gives RoFormer's attention scores with no runtime permutation of activations. ``permuted_parts``
    includes 2 (v) with ``rotary_value``; then the attention output is in permuted order too and the
    output projection's input columns take :func:`interleaved_to_half_index` per head.
    """
    inner = num_heads * head_dim
    per_head = interleaved_to_half_index(head_dim)
    permuted = torch.cat([h * head_dim + per_head for h in range(num_heads)])
    parts = [(p * inner + (permuted if p in permuted_parts else torch.arange(inner))) for p in range(num_parts)]
    return torch.cat(parts)


def half_layout_weights(qkv_weight: torch.Tensor, qkv_bias: torch.Tensor, out_weight: torch.Tensor,
                        num_heads: int, head_dim: int, rotary_value: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention weights for the :data:`HALF_LAYOUT` kernel: fused QKV rows (3 * H * D, in) and
    bias permuted per head by :func:`qk_half_permutation`, and (with ``rotary_value``, when the
    context comes out permuted) the output projection's input columns permuted to match.

    Anything computed from q and k alone (dot products, elementwise feature maps) is unchanged by
    the common permutation. Gathering the weights costs O(hidden^2), nothing per token."""
    parts = (0, 1, 2) if rotary_value else (0, 1)
    rows = qk_half_permutation(num_heads, head_dim, 3, parts).to(qkv_weight.device)
    weight, bias = qkv_weight.index_select(0, rows), qkv_bias.index_select(0, rows)
    if rotary_value:
        inner = num_heads * head_dim
        out_weight = out_weight.index_select(1, rows[2 * inner:] - 2 * inner)
    return weight, bias, out_weight


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (GPT-NeoX) rotary on (B, S, ..., D): pairs (i, i + D/2), cos/sin (S, D/2).

    What apex's fused kernel computes; used to test the permutation trick on CPU.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = _broadcast_table(cos.float(), x), _broadcast_table(sin.float(), x)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _apex_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apex's fused rotate-half RoPE on (B, S, H, D); apex wants (S, B, H, D) and full-width tables."""
    from apex.transformer.functional import fused_apply_rotary_pos_emb_cached

    cos_full = torch.cat((cos, cos), dim=-1)[:, None, None, :]
    sin_full = torch.cat((sin, sin), dim=-1)[:, None, None, :]
    out = fused_apply_rotary_pos_emb_cached(x.transpose(0, 1), cos_full, sin_full)
    return out.transpose(0, 1)


# Swappable so that tests can stand in the reference rotate-half for apex on CPU.
rotate_half_kernel = _apex_rotate_half


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary through :data:`rotate_half_kernel` (apex's fused kernel)."""
    return rotate_half_kernel(x, cos, sin)


def _apex_interleaved(x, cos, sin):
    """Interleaved rotary through the rotate-half kernel by permuting activations (slow path, for
    ``apply_rotary(backend="apex")`` callers; the model permutes weights instead)."""
    idx = interleaved_to_half_index(x.shape[-1]).to(x.device)
    inv = torch.argsort(idx)
    return rotate_half(x.index_select(-1, idx), cos, sin).index_select(-1, inv)


# --------------------------------------------------------------------------- flash-attn


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _flash_attn_rotate(x, cos, sin):
    from flash_attn.layers.rotary import apply_rotary_emb

    # flash-attn wants cos/sin in x's dtype; its kernel computes in fp32 after loading them.
    return apply_rotary_emb(x, cos.to(x.dtype), sin.to(x.dtype), interleaved=True)


# --------------------------------------------------------------------------- dispatch


@functools.cache
def _resolve(backend: str, device_type: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"model.rotary_backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        if device_type == "cuda":
            if triton_available():
                return "triton"
            if flash_attn_available():
                return "flash_attn"
        return "reference"
    if backend == "triton" and not triton_available():
        raise ValueError("model.rotary_backend: triton is not installed (pip install 'roformer-dist[gpu]')")
    if backend == "apex" and not apex_available():
        raise ValueError("model.rotary_backend: apex is not installed (NVIDIA apex with its CUDA extensions)")
    if backend == "flash_attn" and not flash_attn_available():
        raise ValueError("model.rotary_backend: flash_attn is not installed")
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend ``backend`` means on ``device`` ("auto" -> fastest available)."""
    device_type = torch.device(device).type
    resolved = _resolve(backend, device_type)
    if resolved == "triton" and device_type != "cuda" and not triton_interpreted():
        raise ValueError(f"model.rotary_backend: triton runs on CUDA devices, not {device_type} "
                         "(on CPU only under Triton's interpreter, TRITON_INTERPRET=1, for tests)")
    return resolved


def model_kernel(backend: str, device: torch.device | str) -> str:
    """The kernel the model uses for ``backend`` on ``device``: the resolved backend, except that apex
    becomes :data:`HALF_LAYOUT` (the model permutes its projection weights instead of activations)."""
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        load_triton()
    return HALF_LAYOUT if resolved == "apex" else resolved


PairKernel = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor],
                      tuple[torch.Tensor, Optional[torch.Tensor]]]


def _one_at_a_time(fn) -> PairKernel:
    """A pair kernel from a one-tensor kernel (backends without a fused q+k launch)."""
    def pair(x1, x2, cos, sin):
        return fn(x1, cos, sin), (None if x2 is None else fn(x2, cos, sin))
    return pair


def _reference_pair(x1, x2, cos, sin):
    if x2 is None:
        return _ReferenceRotary.apply(cos, sin, x1)[0], None
    return _ReferenceRotary.apply(cos, sin, x1, x2)


_KERNELS: dict[str, PairKernel] = {
    "reference": _reference_pair,
    "compiled": lambda x1, x2, cos, sin: _CompiledRotary.apply(x1, x2, cos, sin),
    "triton": lambda x1, x2, cos, sin: _TritonRotary.apply(x1, x2, cos, sin),
    "apex": _one_at_a_time(_apex_interleaved),
    "flash_attn": _one_at_a_time(_flash_attn_rotate),
    HALF_LAYOUT: _one_at_a_time(rotate_half),
}


def rotate_pair(x1: torch.Tensor, x2: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                backend: str = "reference") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotate x1 and x2 (B, S, H, D; x2 may be None) at positions 0..S-1 with ``backend`` (a config value,
    resolved for x1's device, or a kernel name from :func:`model_kernel`); cos/sin (S, D/2) fp32, or
    (B, S, D/2) for a table per row (packed documents that keep their row positions).
    Returns new tensors in the inputs' dtypes. The model resolves once and calls :func:`run_kernel`."""
    kernel = backend if backend == HALF_LAYOUT else resolve_backend(backend, x1.device)
    return run_kernel(kernel, x1, x2, cos, sin)


def run_kernel(kernel: str, x1: torch.Tensor, x2: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The one dispatch, for a kernel already chosen (:func:`model_kernel`, or a measured choice): no
    resolution, nothing that a compiled forward would have to trace besides the kernel itself."""
    if cos.dim() == 3:  # one table per row: the rows as one long sequence, so every kernel applies
        B, S = x1.shape[:2]
        def seq(x):
            return None if x is None else x.reshape(1, B * S, *x.shape[2:])
        o1, o2 = _KERNELS[kernel](seq(x1), seq(x2), cos.reshape(B * S, -1), sin.reshape(B * S, -1))
        return o1.reshape(x1.shape), (None if o2 is None else o2.reshape(x2.shape))
    return _KERNELS[kernel](x1, x2, cos, sin)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 backend: str = "reference") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (B, S, H, D) at positions 0..S-1 (one launch where the backend can)."""
    return rotate_pair(q, k, cos, sin, backend)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "reference") -> torch.Tensor:
    """Rotate one tensor (B, S, H, D), e.g. v with ``rotary_value``."""
    return rotate_pair(x, None, cos, sin, backend)[0]


__all__ = [
    "BACKENDS", "HALF_LAYOUT", "DEFAULT_ROPE", "RotaryCache", "set_rope", "rotary_tables", "pair_divisors",
    "yarn_mscale", "rotate_pair", "run_kernel", "apply_rotary", "rotate", "load_triton",
    "resolve_backend", "model_kernel", "triton_available", "triton_interpreted",
    "apex_available", "flash_attn_available", "interleaved_to_half_index", "qk_half_permutation",
    "half_layout_weights", "rotate_half_reference", "rotate_half",
]
