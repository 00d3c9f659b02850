"""The DFlash block-diffusion drafter (z-lab checkpoint format).

A small Qwen3-style stack with no embedding and no LM head of its own: it borrows the
target's (``bind``). One call drafts a whole block ``[anchor, MASK, ..., MASK]``,
conditioned on the target's tapped hidden states ("KV injection": the projected context
features are extra keys/values in every layer). Only context K/V enter the drafter's
cache; block K/V are used for the call and dropped, so the cache only ever grows with
committed context and is never rolled back.

Semantics follow z-lab's ``dflash==0.1.0`` (see tests/reference/DFLASH_REFERENCE_NOTES.md):
positions are absolute (context row j at its token's position, block row i at
``anchor_pos + i``); full-attention layers have no mask at all; sliding layers (or every
layer when ``is_causal``) are causal, with a window only when ``use_sliding_window``.

DFlash 2 (``DFlash2DraftModel``, z-lab's ``dflash/model_mlx.py``) is the same stack plus, in
every layer, a grouped dynamic causal convolution along the block around attention and
around the MLP (``ConvDrafterLayer``), and a ``CandidateSelector`` that drafts the block as
the best left-to-right path through each position's top-k logits, scored by the logit plus
a low-rank edge with the previous chosen token (the anchor before the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..branches import branch_drafts
from ..cache import DeviceKVCache, KVCache, advance_layers, bucketed, cache_arrays, traced_caches
from ..errors import CheckpointError, UnsupportedArchitectureError
from .attention import cache_attention, uses_kernel
from .base import RoPE
from .decoder import DecoderModel, TransposedLinear, concatenated
from .llama import MLP
from .steps import CompiledSteps, default_compile_steps, traceable

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE_2 = "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# z-lab stores DFlash 2's codebooks without the ``.weight`` of their Embedding modules
UNSUFFIXED_TENSORS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")

# (b, L): the drafter's layers run on rows [b*L, H], so its projections are 2D matmuls
Rows = tuple[int, int]


@dataclass
class DrafterArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    causal_layers: list[bool]
    sliding_layers: list[bool]
    sliding_window: int | None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash 2 (all 0 for DFlash 1): each layer's two convolutions, and the candidate selector
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    vocab_size: int = 0  # rows of the selector's codebooks: the target's vocabulary


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """z-lab's default taps: spread from layer 1 to N-3."""
    if num_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_layers - 1)) for i in range(num_layers)]


def drafter_args(config: dict[str, Any]) -> DrafterArgs:
    """Read a z-lab config.json: DFlash fields from ``dflash_config`` first, then top level."""
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures and ARCHITECTURE_2 not in architectures:
        raise UnsupportedArchitectureError(
            f"drafter architecture {architectures!r} is not supported: this runtime reads "
            f"{ARCHITECTURE!r} (DFlash 1) and {ARCHITECTURE_2!r} (DFlash 2) checkpoints"
        )
    dflash = config.get("dflash_config") or {}

    def field(name: str, default: Any = None) -> Any:
        value = dflash.get(name, config.get(name, default))
        if value is None and default is None:
            raise CheckpointError(f"drafter config.json lacks {name!r} (top level or dflash_config)")
        return value

    try:
        layers = config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        num_target_layers = int(field("num_target_layers"))
        layer_types = config.get("layer_types") or ["full_attention"] * layers
        global_causal = config.get("is_causal")
        causal = [bool(global_causal) if global_causal is not None else t == "sliding_attention" for t in layer_types]
        rope = config.get("rope_parameters") or {}
        return DrafterArgs(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
            block_size=int(field("block_size", 16)),
            target_layer_ids=[int(i) for i in field("target_layer_ids", default_target_layer_ids(num_target_layers, layers))],
            num_target_layers=num_target_layers,
            mask_token_id=int(field("mask_token_id")),
            causal_layers=causal,
            sliding_layers=[t == "sliding_attention" for t in layer_types],
            # Qwen3Config (the official loader) drops the window unless use_sliding_window
            sliding_window=config.get("sliding_window") if config.get("use_sliding_window") else None,
            input_embedding_scale=float(field("input_embedding_scale", 1.0)),
            output_multiplier=float(field("output_multiplier", 1.0)),
            final_logit_softcapping=dflash.get("final_logit_softcapping", config.get("final_logit_softcapping")),
            **(dflash2_fields(config, field) if ARCHITECTURE_2 in architectures else {}),
        )
    except KeyError as exc:
        raise CheckpointError(f"drafter config.json lacks the field {exc.args[0]!r}") from None


def dflash2_fields(config: dict[str, Any], field: Callable[[str], Any]) -> dict[str, int]:
    """A DFlash 2 config's convolution and selector sizes (``dflash_config`` first), checked."""
    values = {name: int(field(name)) for name in DFLASH2_FIELDS}
    values["vocab_size"] = int(config["vocab_size"])
    bad = [name for name, value in values.items() if value < 1]
    if bad:
        raise CheckpointError(f"drafter config.json: {bad[0]} = {values[bad[0]]}, a DFlash 2 drafter needs at least 1")
    if config["hidden_size"] % values["conv_group_size"]:
        raise CheckpointError(f"drafter config.json: conv_group_size {values['conv_group_size']} does not divide "
                              f"hidden_size {config['hidden_size']}")
    if values["selector_top_k"] > values["vocab_size"]:
        raise CheckpointError(f"drafter config.json: selector_top_k {values['selector_top_k']} exceeds "
                              f"vocab_size {values['vocab_size']}")
    return values


def block_mask(ctx_len: int | mx.array, block_len: int, causal: bool, window: int | None,
               ctx_extent: int | None = None, block_lens: mx.array | None = None) -> mx.array | None:
    """Which keys ``[ctx ; block]`` each block query may see; None means all of them.

    ``ctx_len`` may be a device scalar (pipelined rounds): the context keys then span
    ``ctx_extent`` buffer rows, of which those at or past ``ctx_len`` are not yet valid.
    Stacked requests pass ``ctx_len [R]`` and their own ``block_lens [R]``: the mask is
    then ``[R, 1, L, extent + L]`` and a row's padding past its block is never seen, so a
    request drafts the same in a batch as alone.
    """
    extent = ctx_len if ctx_extent is None else ctx_extent
    if isinstance(ctx_len, int) and extent == ctx_len and not causal and window is None and block_lens is None:
        return None
    assert isinstance(extent, int)
    stacked = isinstance(ctx_len, mx.array) and ctx_len.ndim == 1
    c = (ctx_len if isinstance(ctx_len, mx.array) else mx.array(ctx_len)).reshape(-1, 1)  # [R, 1]
    rows, block = mx.arange(extent)[None], mx.arange(block_len)[None]
    n = c.shape[0]
    key_pos = mx.concatenate([mx.broadcast_to(rows, (n, extent)), c + block], axis=1)  # [R, extent + L]
    in_block = block < (block_lens.reshape(-1, 1) if block_lens is not None else block_len)
    valid = mx.concatenate([rows < c, mx.broadcast_to(in_block, (n, block_len))], axis=1)
    query_pos = (c + block)[:, :, None]  # [R, L, 1]
    allowed = mx.broadcast_to(valid[:, None, :], (n, block_len, extent + block_len))
    if causal:
        allowed = allowed & (key_pos[:, None, :] <= query_pos)
    if window is not None:
        allowed = allowed & (query_pos - key_pos[:, None, :] < window)
        if not causal:
            allowed = allowed & (key_pos[:, None, :] - query_pos < window)
    return allowed[:, None] if stacked else allowed[0]


class DrafterAttention(nn.Module):
    def __init__(self, args: DrafterArgs, causal: bool, sliding: bool) -> None:
        super().__init__()
        hd = args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.causal = causal
        self.window = args.sliding_window if sliding else None
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = RoPE(hd, args.rope_theta, args.rope_scaling)

    def _rope_blocks(self, x: mx.array, anchors: int | mx.array, n_blocks: int) -> mx.array:
        """RoPE on ``[b, heads, n_blocks*B, D]``: block j's row i sits at ``anchors[j] + i``.

        Each block becomes its own batch row so one rope call with per-row offsets places
        every block at its anchor; ``anchors`` is an int (one block) or ``[b * n_blocks]``.
        """
        if n_blocks == 1:  # the decode loop's case: no regrouping needed
            return self.rope(x, anchors)
        b, heads, length, d = x.shape
        block = length // n_blocks
        rows = x.reshape(b, heads, n_blocks, block, d).transpose(0, 2, 1, 3, 4).reshape(b * n_blocks, heads, block, d)
        roped = self.rope(rows, anchors)
        return roped.reshape(b, n_blocks, heads, block, d).transpose(0, 2, 1, 3, 4).reshape(b, heads, length, d)

    def _heads(self, x: mx.array, shape: Rows, heads: int) -> mx.array:
        b, length = shape
        return x.reshape(b, length, heads, self.head_dim).transpose(0, 2, 1, 3)

    def _projections(self, x: mx.array, shape: Rows, queries: bool = True) -> tuple[mx.array | None, mx.array, mx.array]:
        """q, k and v ``[b, heads, L, D]`` of rows ``x [b*L, H]`` (q and k normed, before RoPE).

        Fused for inference (``fuse_projections``): one matmul, whose q part context rows
        do not need (16 rows: cheaper than a second op). Else context rows skip q.
        """
        if "qkv_proj" in self:
            q, k, v = mx.split(self._heads(self.qkv_proj(x), shape, self.n_heads + 2 * self.n_kv_heads),
                               [self.n_heads, self.n_heads + self.n_kv_heads], axis=1)
        else:
            q = self._heads(self.q_proj(x), shape, self.n_heads) if queries else None
            k, v = (self._heads(p(x), shape, self.n_kv_heads) for p in (self.k_proj, self.v_proj))
        return (self.q_norm(q) if queries else None), self.k_norm(k), v

    def fuse_projections(self) -> None:
        """Inference: q/k/v in one pre-transposed matmul, o as one (the HF names are gone after it)."""
        fused = concatenated([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self["q_proj"], self["k_proj"], self["v_proj"]
        self.o_proj = TransposedLinear.of(self.o_proj)

    def context_kv(self, h_ctx: mx.array, shape: Rows, first_position: int | mx.array) -> tuple[mx.array, mx.array]:
        """Context keys (RoPE at their tokens' positions, from ``first_position``) and values."""
        _, k, v = self._projections(h_ctx, shape, queries=False)
        return self.rope(k, first_position), v

    def attend_blocks(
        self, x: mx.array, shape: Rows, anchors: int | mx.array, ctx_kv: tuple[mx.array, mx.array] | None,
        mask: mx.array | None,
    ) -> mx.array:
        """Block queries over keys ``[ctx ; every block]``, blocks laid end to end in ``x``.

        ``x`` holds rows ``[b*L, H]`` of ``shape (b, L)``. Inference passes one block and
        its anchor position (an int); training passes many blocks, ``anchors``
        ``[b * n_blocks]``, and a mask that keeps each block to its own context and
        itself. Both run this same projection, norm, RoPE and attention.
        """
        b, length = shape
        q, k, v = self._block_qkv(x, shape, anchors)
        if ctx_kv is not None:
            k, v = mx.concatenate([ctx_kv[0], k], axis=2), mx.concatenate([ctx_kv[1], v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b * length, -1))

    def _block_qkv(self, x: mx.array, shape: Rows, anchors: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The blocks' queries and keys (normed, RoPE at each block's anchor) and values."""
        n_blocks = 1 if isinstance(anchors, int) else anchors.size // shape[0]
        q, k, v = self._projections(x, shape)
        assert q is not None
        return self._rope_blocks(q, anchors, n_blocks), self._rope_blocks(k, anchors, n_blocks), v

    def add_context(self, h_ctx: mx.array, shape: Rows, cache: KVCache | DeviceKVCache) -> None:
        """New context rows into the cache (a device cache's valid length advances after every layer's write)."""
        if isinstance(cache, KVCache):
            cache.update_and_fetch(*self.context_kv(h_ctx, shape, cache.offset))
            return
        cache.write(*self.context_kv(h_ctx, shape, cache.length))

    def mask(self, cache: KVCache | DeviceKVCache, block_len: int, block_lens: mx.array | None) -> mx.array | None:
        """This layer kind's block mask over the cache's context (the same for every layer's cache)."""
        anchor_pos, extent = context_span(cache)
        return block_mask(anchor_pos, block_len, self.causal, self.window, ctx_extent=extent, block_lens=block_lens)

    def uses_kernel(self, cache: KVCache | DeviceKVCache, block: int, dtype: mx.Dtype) -> bool:
        """Whether this layer attends with runtime.models.attention's kernel: over a device cache
        that holds context, without a causal or windowed mask (which the kernel does not draw)."""
        return (isinstance(cache, DeviceKVCache) and cache.keys is not None and not self.causal
                and self.window is None and uses_kernel(block, self.head_dim, dtype, self.head_dim**-0.5))

    def attend_cache(self, x: mx.array, shape: Rows, cache: DeviceKVCache, block_lens: mx.array) -> mx.array:
        """``attend_blocks`` as one kernel: the valid context rows of the cache, then the block's
        own keys (``block_lens`` of them: one length for all rows, or one per stacked request)."""
        b, length = shape
        q, k, v = self._block_qkv(x, shape, cache.length)
        out = cache_attention(q, cache.keys, cache.values, cache.length, causal=False, scale=self.head_dim**-0.5,
                              fresh=(k, v, block_lens))
        return self.o_proj(out.reshape(b * length, -1))

    def __call__(self, x: mx.array, shape: Rows, cache: KVCache | DeviceKVCache, mask: mx.array | None) -> mx.array:
        anchor_pos, extent = context_span(cache)
        ctx_kv = None
        if extent and cache.keys is not None and cache.values is not None:
            ctx_kv = (cache.keys[..., :extent, :], cache.values[..., :extent, :])
        return self.attend_blocks(x, shape, anchor_pos, ctx_kv, mask)


def context_span(cache: KVCache | DeviceKVCache) -> tuple[int | mx.array, int]:
    """The block's anchor position and how many context rows attention reads.

    Context keys are read in whole buckets under the mask, as the target's cache does:
    few key shapes per request. A device cache's anchor position is a device scalar.
    """
    if isinstance(cache, DeviceKVCache):
        return cache.length, cache.extent
    anchor_pos = cache.offset
    if not anchor_pos or cache.keys is None:
        return anchor_pos, 0
    return anchor_pos, bucketed(anchor_pos, cache.keys.shape[2])


class DrafterLayer(nn.Module):
    def __init__(self, args: DrafterArgs, causal: bool, sliding: bool) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(args, causal, sliding)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def attend_with(self, h: mx.array, shape: Rows, attend: Callable[[mx.array], mx.array]) -> mx.array:
        """The layer with ``attend`` as its attention (it gets the normed rows ``[b*L, H]`` of ``shape``)."""
        h = h + attend(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, h: mx.array, shape: Rows, cache: KVCache | DeviceKVCache, mask: mx.array | None) -> mx.array:
        return self.attend_with(h, shape, lambda x: self.self_attn(x, shape, cache, mask))

    def forward_blocks(self, h: mx.array, shape: Rows, h_ctx: mx.array, ctx_shape: Rows, anchors: mx.array,
                       mask: mx.array) -> mx.array:
        """Training: many blocks over one whole context (positions from 0), kept apart by ``mask``."""
        attn = self.self_attn
        return self.attend_with(h, shape, lambda x: attn.attend_blocks(x, shape, anchors, attn.context_kv(h_ctx, ctx_shape, 0), mask))

    def fuse_projections(self) -> None:
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()
        self.mlp.down_proj = TransposedLinear.of(self.mlp.down_proj)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash 2's causal convolution along a block, one kernel per channel group and row.

    Row t's output is ``sum_o (base[o] + dynamic[t, o]) * x[t - o]`` (zero before the
    block's first row): ``base`` a learned kernel per channel, ``dynamic`` one weight per
    group computed from the rows themselves. ``prepare`` convolves the sublayer's input
    with ``base_kernel[0]`` and the first half of the rows' dynamic kernels; ``finish``
    the sublayer's output with ``base_kernel[1]`` and the second half.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: mx.array, shape: Rows) -> tuple[mx.array, mx.array]:
        """The convolved rows ``[b*L, H]`` and the dynamic kernels ``finish`` takes."""
        b, length = shape
        dynamic = self.kernel_projection(x).reshape(b, length, 2, self.kernel_size, self.groups)
        return self._convolve(x, shape, 0, dynamic[:, :, 0]), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array, shape: Rows) -> mx.array:
        return self._convolve(x, shape, 1, dynamic)

    def _convolve(self, x: mx.array, shape: Rows, half: int, dynamic: mx.array) -> mx.array:
        """``x [b*L, H]`` convolved with ``base_kernel[half]`` plus ``dynamic [b, L, K, groups]``."""
        b, length = shape
        k, hidden = self.kernel_size, x.shape[-1]
        padded = mx.pad(x.reshape(b, length, hidden), [(0, 0), (k - 1, 0), (0, 0)])
        shifted = mx.stack([padded[:, k - 1 - o : k - 1 - o + length] for o in range(k)], axis=2)  # [b, L, K, H]: x[t-o]
        base = self.base_kernel[half].reshape(1, 1, k, self.groups, self.group_size)
        weights = (base + dynamic[..., None]).reshape(b, length, k, hidden)
        return (weights * shifted).sum(axis=2).reshape(b * length, hidden)

    def fuse_projections(self) -> None:
        self.kernel_projection = TransposedLinear.of(self.kernel_projection)


class ConvDrafterLayer(DrafterLayer):
    """A DFlash 2 layer: a convolution along the block before and after attention, and the MLP."""

    def __init__(self, args: DrafterArgs, causal: bool, sliding: bool) -> None:
        super().__init__(args, causal, sliding)
        self.attention_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def attend_with(self, h: mx.array, shape: Rows, attend: Callable[[mx.array], mx.array]) -> mx.array:
        x, kernel = self.attention_conv.prepare(self.input_layernorm(h), shape)
        h = h + self.attention_conv.finish(attend(x), kernel, shape)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h), shape)
        return h + self.mlp_conv.finish(self.mlp(x), kernel, shape)

    def fuse_projections(self) -> None:
        super().fuse_projections()
        self.attention_conv.fuse_projections()
        self.mlp_conv.fuse_projections()


class Selection(NamedTuple):
    path: mx.array  # [R, n]: the chosen token of each position
    candidates: mx.array  # [R, n, k]: each position's top-k tokens (in no particular order)
    probs: mx.array | None  # [R, n, k] float32: the distribution each position was drawn from (None: greedy)


class CandidateSelector(nn.Module):
    """DFlash 2's drafts: a left-to-right path through each block position's top-k candidates.

    Candidate c at position t scores ``logit(c) + <pred(prev), proj(h_t) * succ(c)>``, with
    ``prev`` the token chosen at t-1 (the block's anchor at t = 0). Greedy takes the best
    score; sampling draws from ``softmax(scores / T)`` over the k candidates.
    """

    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        self.top_k = args.selector_top_k
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)

    def select(self, hidden: mx.array, logits: mx.array, anchors: mx.array, temperatures: mx.array | None = None,
               noise: mx.array | None = None) -> Selection:
        """The path of blocks' positions ``hidden [R, n, H]`` (post-norm), ``logits [R, n, V]``.

        Greedy without ``temperatures``; with ``temperatures [R]`` and Gumbel ``noise
        [R, n, k]``, position t is the argmax of ``scores / T + noise[t]``: a draw from
        ``softmax(scores / T)``, which is returned per position.
        """
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        successors = self.hidden_projection(hidden)[:, :, None] * self.successor_codebook(candidates)  # [R, n, k, r]
        # edge scores from each candidate at t-1 to each at t: [R, n-1, k, k]
        edges = self.predecessor_codebook(candidates[:, :-1]) @ successors[:, 1:].swapaxes(-1, -2)
        scores = unary[:, 0] + (successors[:, 0] @ self.predecessor_codebook(anchors)[..., None])[..., 0]
        picks, probs = [], []
        for t in range(hidden.shape[1]):
            if t:
                scores = unary[:, t] + mx.take_along_axis(edges[:, t - 1], picks[-1][:, None, None], axis=1)[:, 0]
            if temperatures is None or noise is None:
                picks.append(mx.argmax(scores, axis=-1))
                continue
            scaled = scores.astype(mx.float32) / temperatures[:, None]
            probs.append(mx.softmax(scaled, axis=-1))
            picks.append(mx.argmax(scaled + noise[:, t], axis=-1))
        path = mx.take_along_axis(candidates, mx.stack(picks, axis=1)[..., None], axis=-1)[..., 0]
        return Selection(path, candidates, mx.stack(probs, axis=1) if probs else None)


class Proposal(NamedTuple):
    """A block's drafts, and the distribution each was drawn from where it was sampled."""

    tokens: mx.array  # [R, K, n] int32: K blocks a round verifies (runtime/branches.py), the first the drafter's pick
    probs: mx.array | None  # [R, n, V]: q over the vocabulary (zero outside the selector's top-k); None: argmax, q one-hot


class DFlashDrafter(nn.Module):
    def __init__(self, args: DrafterArgs) -> None:
        super().__init__()
        self.args = args
        n_taps = len(args.target_layer_ids)
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        layer = ConvDrafterLayer if args.conv_kernel_size else DrafterLayer
        self.layers = [layer(args, c, s) for c, s in zip(args.causal_layers, args.sliding_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if args.selector_top_k:
            self.candidate_selector = CandidateSelector(args)
        # the target's embedding and head, borrowed by bind(); plain callables so they are
        # not parameters of the drafter (never saved with it, never trained)
        self._embed: Callable[[mx.array], mx.array] | None = None
        self._head: Callable[[mx.array], mx.array] | None = None
        self.compile_steps = default_compile_steps()  # drafts over device caches
        self._steps = CompiledSteps()

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.args.target_layer_ids)

    @property
    def selector(self) -> CandidateSelector | None:
        """DFlash 2's candidate selector (None: DFlash 1, whose drafts are the argmax)."""
        return self.get("candidate_selector")

    def bind(self, target: DecoderModel) -> "DFlashDrafter":
        """Borrow the target's embedding and LM head, refusing a pair that cannot work."""
        check_compatible(self.args, target)
        self._embed, self._head = target.embed, target.logits
        return self

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def make_device_cache(self) -> list[DeviceKVCache]:
        return [DeviceKVCache() for _ in self.layers]

    def hidden(self, block: mx.array, ctx_features: mx.array | None, cache: Sequence[KVCache] | Sequence[DeviceKVCache],
               keep: mx.array | None = None, block_lens: mx.array | None = None) -> mx.array:
        """Post-norm hidden states ``[b, L, H]`` of the block; new context rows enter the cache.

        With device caches, ``keep`` (a device scalar, ``[R]`` when stacked) says how many
        leading context rows are real: the verifier's accepted count, not yet known to
        the host. Stacked requests with shorter blocks pass their ``block_lens``. With
        ``compile_steps``, a draft over device caches that already hold buffers runs as a
        compiled step.
        """
        if self.compile_steps and traceable(cache):
            return self._compiled_hidden(block, ctx_features, cache, keep, block_lens)  # type: ignore[arg-type]
        return self._hidden(block, ctx_features, cache, keep, block_lens)

    def _compiled_hidden(self, block: mx.array, ctx_features: mx.array | None, cache: Sequence[DeviceKVCache],
                         keep: mx.array | None, block_lens: mx.array | None) -> mx.array:
        rows = ctx_features.shape[1] if ctx_features is not None else 0
        optional = (ctx_features if rows else None, keep, block_lens)
        present = tuple(x is not None for x in optional)
        (hidden,) = self._steps.run(cache, rows, present, lambda extent: partial(
            self._traced_hidden, extent=extent, present=present), [block, *(x for x in optional if x is not None)])
        return hidden

    def _traced_hidden(self, inputs: list[mx.array], arrays: list[mx.array], *, extent: int,
                       present: tuple[bool, ...]) -> list[mx.array]:
        given = iter(inputs[1:])
        ctx_features, keep, block_lens = (next(given) if p else None for p in present)
        traced = traced_caches(arrays, extent)
        return [self._hidden(inputs[0], ctx_features, traced, keep, block_lens), *cache_arrays(traced)]

    def _hidden(self, block: mx.array, ctx_features: mx.array | None, cache: Sequence[KVCache] | Sequence[DeviceKVCache],
                keep: mx.array | None = None, block_lens: mx.array | None = None) -> mx.array:
        shape: Rows = block.shape  # type: ignore[assignment]
        h = self._embed_block(block.reshape(-1))
        if ctx_features is not None and ctx_features.shape[1]:
            self.write_context(ctx_features, cache, keep)
        # one mask per layer kind, not per layer: they depend on the context length alone
        masks: dict[tuple[bool, int | None], mx.array | None] = {}
        seen = block_lens if block_lens is not None else mx.array(shape[1], dtype=mx.int32)  # the kernel's block rows
        for layer, layer_cache in zip(self.layers, cache):
            attn = layer.self_attn
            if attn.uses_kernel(layer_cache, shape[1], h.dtype):
                h = layer.attend_with(h, shape, lambda x: attn.attend_cache(x, shape, layer_cache, seen))  # type: ignore[arg-type]
                continue
            kind = (attn.causal, attn.window)
            if kind not in masks:
                masks[kind] = attn.mask(layer_cache, shape[1], block_lens)
            h = layer(h, shape, layer_cache, masks[kind])
        return self.norm(h).reshape(*shape, -1)

    def context_features(self, ctx_features: mx.array) -> tuple[mx.array, Rows]:
        """The projected context rows ``[b*C, H]`` of taps ``[b, C, n_taps*H]``, and ``(b, C)``."""
        b, c, features = ctx_features.shape
        return self.hidden_norm(self.fc(ctx_features.reshape(b * c, features))), (b, c)

    def write_context(self, ctx_features: mx.array, cache: Sequence[KVCache] | Sequence[DeviceKVCache],
                      keep: mx.array | None) -> None:
        """Only the context part of ``hidden``: the new rows enter every layer's cache."""
        h_ctx, shape = self.context_features(ctx_features)
        for layer, layer_cache in zip(self.layers, cache):
            layer.self_attn.add_context(h_ctx, shape, layer_cache)
        if cache and isinstance(cache[0], DeviceKVCache):
            advance_layers(cache, keep if keep is not None else shape[1])  # type: ignore[arg-type]

    def training_hidden(self, blocks: mx.array, anchors: mx.array, ctx_features: mx.array, mask: mx.array) -> mx.array:
        """Post-norm hidden ``[b, n*B, H]`` of n blocks per sequence, all in one forward.

        ``blocks [b, n*B]`` are the blocks end to end, ``anchors [b, n]`` their anchor
        positions, ``ctx_features [b, T, n_taps*H]`` the target taps of whole sequences
        (row t at position t) and ``mask [b, 1, n*B, T + n*B]`` what each block query may
        see (runtime.training.batches.training_mask). The layers' own attention runs, so
        a block at anchor a gets what ``hidden`` gives with context ``taps[:a]``.
        """
        if self.args.conv_kernel_size or self.selector is not None:
            raise UnsupportedArchitectureError("training DFlash 2 drafters (convolutions, candidate selector) is not supported")
        if any(self.args.causal_layers) or any(self.args.sliding_layers):
            raise UnsupportedArchitectureError(
                "training supports full-attention drafter layers only (no causal or sliding layers): "
                "drop layer_types/is_causal from the drafter config"
            )
        shape: Rows = blocks.shape  # type: ignore[assignment]
        h = self._embed_block(blocks.reshape(-1))
        h_ctx, ctx_shape = self.context_features(ctx_features)
        for layer in self.layers:
            h = layer.forward_blocks(h, shape, h_ctx, ctx_shape, anchors.reshape(-1), mask)
        return self.norm(h).reshape(*shape, -1)

    def fuse_projections(self) -> None:
        """For inference: each layer's q/k/v and gate/up in one matmul, every weight stored
        transposed (``TransposedLinear``); the HF names are gone after it, so a fused drafter
        is neither trained nor saved."""
        self.fc = TransposedLinear.of(self.fc)
        for layer in self.layers:
            layer.fuse_projections()
        mx.eval(self.parameters())  # once, here: lazy concatenations would be recomputed by every draft

    def _embed_block(self, tokens: mx.array) -> mx.array:
        if self._embed is None:
            raise CheckpointError("the drafter is not bound to a target: call drafter.bind(target)")
        scale = self.args.input_embedding_scale
        return self._embed(tokens) * scale if scale != 1.0 else self._embed(tokens)  # no op for a no-op

    def logits(self, hidden: mx.array) -> mx.array:
        assert self._head is not None
        logits = self._head(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def __call__(self, block: mx.array, ctx_features: mx.array | None, cache: list[KVCache]) -> mx.array:
        """Draft logits for block rows 1.. (row 0, the anchor, predicts nothing)."""
        return self.logits(self.hidden(block, ctx_features, cache)[:, 1:])

    @property
    def copies_blocks(self) -> bool:
        """Whether its rounds may verify a block copied from the request's own text (runtime/lookup.py):
        a DFlash 1 drafter's, whose blocks are argmax picks; a DFlash 2 selector draws one path."""
        return self.selector is None

    def propose(self, hidden: mx.array, anchors: mx.array, temperatures: mx.array | None = None,
                noise: mx.array | None = None, branches: int = 1,
                context: tuple[mx.array, mx.array] | None = None) -> Proposal:
        """The drafts of blocks whose rows 1.. have the post-norm ``hidden [R, n, H]``.

        DFlash 1: the argmax of each row, and with ``branches`` > 1 more blocks from each
        row's runner-ups and ``context``, the blocks copied from each row's own text
        (runtime/branches.py, runtime/lookup.py). DFlash 2: the selector's path after ``anchors
        [R]``, greedy, or drawn with ``temperatures [R]`` and Gumbel ``noise [R, n, k]``
        (a row at temperature 1 with zero noise is greedy), with each draw's q; one path,
        repeated as every block.
        """
        logits = self.logits(hidden)
        selector = self.selector
        if selector is None:
            return Proposal(branch_drafts(logits, branches, context), None)
        path, candidates, q = selector.select(hidden, logits, anchors, temperatures, noise)
        probs = None if q is None else mx.put_along_axis(mx.zeros(logits.shape, dtype=q.dtype), candidates, q, axis=-1)
        rows, n = path.shape
        return Proposal(mx.broadcast_to(path.astype(mx.int32)[:, None], (rows, branches, n)), probs)

    def checkpoint_names(self) -> dict[str, str]:
        """Each parameter's name in a z-lab checkpoint -> its name here (they differ for DFlash 2's codebooks)."""
        names = {}
        for name, _ in tree_flatten(self.parameters()):
            stem = name.removesuffix(".weight")
            names[stem if stem in UNSUFFIXED_TENSORS else name] = name
        return names


def check_compatible(args: DrafterArgs, target: DecoderModel) -> None:
    t = target.args
    problems = []
    if args.hidden_size != t.hidden_size:
        problems.append(f"hidden size {args.hidden_size} != target's {t.hidden_size}")
    if args.num_target_layers != t.num_hidden_layers:
        problems.append(f"trained for a {args.num_target_layers}-layer target, this one has {t.num_hidden_layers}")
    bad_taps = [i for i in args.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad_taps:
        problems.append(f"tap layer ids {bad_taps} outside the target's 0..{t.num_hidden_layers - 1}")
    if not 0 <= args.mask_token_id < t.vocab_size:
        problems.append(f"mask token id {args.mask_token_id} outside the target's embedding (0..{t.vocab_size - 1})")
    if args.block_size < 2:
        problems.append(f"block size {args.block_size} < 2 drafts nothing")
    if args.selector_top_k and args.vocab_size != t.vocab_size:
        problems.append(f"selector codebooks of {args.vocab_size} tokens, the target's vocabulary has {t.vocab_size}")
    if problems:
        raise CheckpointError(
            "this drafter does not fit this target: " + "; ".join(problems)
            + ". Use the drafter trained for this target (or train one: python -m runtime.train)"
        )
