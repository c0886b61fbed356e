"""Our own decode step for Llama-family models: one token per row, static shapes, no Python
work per layer that depends on the batch, compiled once per batch-size bucket.

transformers' forward costs a decode step far more than its matmuls (SmolLM2 at batch 8: ~95
ms a step, of which the projections are ~27 ms): 30 layers of small ops dispatched one by one,
peft's per-module LoRA, masks and positions rebuilt every step. This step is the same
arithmetic on tensors laid out for it:
- q/k/v are one matmul and gate/up another: the base model's own ``Linear`` weights become
  views into the fused tensors (frozen, so memory is not doubled and training sees the same
  weights);
- a slot cache: each row owns slot ``b`` of a preallocated ``[B, kv_heads, S, head_dim]`` K/V
  tensor per layer, writes its token's K/V at its own position, and attends to keys at indices
  ``<= position`` (no left padding; a row joining mid-decode just fills a free slot);
- LoRA for the rows of several adapters at once (``LoraStack``): per projection one matmul
  into the stacked A of every adapter present, a per-row mask keeping each row's own block
  (none when one adapter has every row), and a matmul out of each part's (q, k, v; gate, up)
  stacked B that adds to the base output; a base-only batch runs no LoRA op at all;
- on a CPU, the matmuls read oneDNN's packed copies of the weights (``pack``: about 1.4x the
  plain layout's speed at decode batch sizes, for a second copy of the weights in memory);
- attention of one query token as two batched matmuls over (slot, kv head), over the cache
  positions up to the furthest row's only (SDPA's kernel cost ~3x that here).

The arithmetic copies the HF modules exactly, dtype for dtype (``precision.py``'s bf16 matmuls
with float32 results, RMSNorm's casts, RoPE tables in the embedding's dtype), so sampled
logprobs agree with training's forward within the precision's tolerance (tested). Anything the
step does not know (another model type, sliding windows, dynamic RoPE, biases in the MLP, a
DoRA adapter) uses the HF path (``sampling.DecodeBatch``) instead, with one log line.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import torch
import torch.nn.functional as F

log = logging.getLogger("rlcli.engine")

MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
# RoPE variants whose cos/sin depend on the position alone: one table serves every step.
ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = (*ATTN, *MLP)
HEAD = "lm_head"
# Batch-size buckets: a batch runs at the smallest bucket that holds its rows (one compiled
# graph each); the cache's length grows in steps of slot_batch.LENGTH_STEP.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def compile_wanted(flag: bool | None, device: torch.device) -> bool:
    """``--compile`` / ``--no-compile``; else ``RLCLI_COMPILE`` (``0`` or ``1``; the test suite
    sets 0); else on a GPU only. On a CPU a compiled step gains 8-16% a step on SmolLM2
    (bf16, batch 8), after 36-53 s of compiling per batch bucket and LoRA layout that a first
    request waits for: worth it for a long-lived server only (docs/server-engine.md, "The
    decode step")."""
    if flag is not None:
        return flag
    if os.environ.get("RLCLI_COMPILE") in ("0", "1"):
        return os.environ["RLCLI_COMPILE"] == "1"
    return device.type == "cuda"


def bucket(rows: int) -> int:
    for size in BUCKETS:
        if size >= rows:
            return size
    return rows


def unsupported(model) -> str | None:
    """Why the step cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in MODEL_TYPES:
        return f"model_type {config.model_type!r}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "nested"
    if rope_type not in ROPE_TYPES:
        return f"rope_type {rope_type!r}"
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return "sliding-window layers"
    if (
        types is None
        and getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True)
    ):
        return "a sliding window"
    if getattr(config, "mlp_bias", False):
        return "biases in the MLP"
    if getattr(config, "final_logit_softcapping", None):
        return "a logit soft-cap"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "an unexpected module layout"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, n, None) for n in ATTN] + [getattr(mlp, n, None) for n in MLP]
        if any(type(m).__name__ not in {"Linear", "Bf16Linear"} for m in linears):
            return "projections that are not plain Linear layers"
        if not type(layer.input_layernorm).__name__.endswith("RMSNorm"):
            return "a norm that is not RMSNorm"
    return None


class LayerWeights(torch.nn.Module):
    """One layer's tensors, as buffers (never copied: views of the model's own weights, but
    for oneDNN's packed copies and float32 norm weights of a bf16 model), so a compiler sees
    them as the module's state and not as inputs to copy in each call."""

    NAMES = ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "down", "norm_in", "norm_post",
             "q_norm", "k_norm", "norm_in32", "norm_post32", "q_norm32", "k_norm32",
             "qkv_packed", "o_packed", "gate_up_packed", "down_packed")  # fmt: skip

    def __init__(self, **tensors) -> None:
        super().__init__()
        for name in self.NAMES:
            self.register_buffer(name, tensors.get(name), persistent=False)


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears``, whose own weights become views into it."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None
        if all(m.bias is not None for m in linears):
            bias = torch.cat([m.bias for m in linears])
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = weight[start : start + n]
            if bias is not None:
                m.bias.data = bias[start : start + n]
            start += n
    if bias is None and any(m.bias is not None for m in linears):
        raise ValueError("some fused projections have a bias and some do not")
    return weight, bias


def _linear(x: torch.Tensor, weight: torch.Tensor, bias, packed=None, upcast: bool = True):
    """As the model's own Linear computes: a float32 layer as is, a bf16 one as
    ``precision.Bf16Linear`` (bf16 matmul, float32 result; ``upcast=False`` leaves the result
    bf16 where the next op's type promotion does the same upcast for free); on oneDNN's
    ``packed`` copy of the weight where there is one (``pack``; in a compiled step its int
    key, ``_packed_linear``)."""
    low = weight.dtype != torch.float32
    if low:
        x = x.to(weight.dtype)
    if packed is None:
        y = F.linear(x, weight, bias)
    elif isinstance(packed, int):  # a compiled step's key (``_packed_linear``)
        y = _packed_linear(x, bias, packed, weight.shape[0])
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y.float() if low and upcast else y


def _pick(keys: dict[str, int] | None, weights: LayerWeights, name: str, packed: bool):
    """What ``_linear`` multiplies by for projection ``name``: its packed weight's key
    (compiling: a graph must not touch the packed tensor), the packed weight (eager), or
    None (the plain weight)."""
    if keys is not None:
        return keys[name]
    return getattr(weights, f"{name}_packed") if packed else None


def pack(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of ``weights`` in oneDNN's blocked layout, or None where this build or CPU
    cannot make them or they would not give F.linear's results.

    Why: a decode step multiplies a few rows by every weight, so it is a stream of the
    weights through the cores; F.linear's plain layout streamed SmolLM2's projections at
    ~11 GB/s here and the blocked one at ~16 GB/s (benchmarks/sampling_smollm2.py), its
    float32 head at 2.3x. The price is a second copy of those weights in memory."""
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        gen = torch.Generator().manual_seed(0)
        for w, p in zip(weights, packed, strict=True):
            probe = torch.randn(3, w.shape[1], generator=gen).to(w.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, p, None, "none", [], "")
            if not torch.allclose(got.float(), F.linear(probe, w).float(), atol=1e-3, rtol=1e-2):
                return None
    except (RuntimeError, AttributeError):  # no oneDNN, or no kernel for this dtype
        return None
    return packed


# oneDNN's packed weights by key, for compiled steps: inductor cannot take a packed
# (mkldnn-layout) tensor as a graph input, but an op that finds it by an int key is opaque to
# the compiler, which fuses the small ops between such calls (``_packed_linear``).
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _register_packed(weight: torch.Tensor) -> int:
    _PACKED[id(weight)] = weight
    return id(weight)


@torch.library.custom_op("rlcli::packed_linear", mutates_args=())
def _packed_linear(
    x: torch.Tensor, bias: torch.Tensor | None, key: int, out_features: int
) -> torch.Tensor:
    """``x`` times the packed weight registered as ``key`` (+ ``bias``), as in eager."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _PACKED[key], bias, "none", [], "")


@_packed_linear.register_fake
def _(x, bias, key, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def spare_memory() -> int:
    """Bytes the kernel says could still be allocated (MemAvailable), 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, weight32, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, casts included; torch's fused kernel on a float32
    input (the same arithmetic: ``weight32`` is the weight in float32, as the HF module's
    ``weight * x`` promotes it)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight32, eps)
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's ``x * cos + rotate_half(x) * sin``, exactly: ``rotate_half(x) * sin`` is
    ``cat(-x2 * s1, x1 * s2)``, which is ``roll(x, half) * cat(-s1, s2)``."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _lora(y: torch.Tensor, x: torch.Tensor, stacked, mask) -> torch.Tensor:
    """``y`` (a projection's base output) plus the rows' LoRA deltas: ``x`` [B, in] into every
    present adapter's A (stacked [parts x adapters x rank, in]), each row's own block kept by
    ``mask`` (None: every row has the one adapter), out through each part's stacked B
    (transposed: [adapters x rank, out], its scaling in it) into that part's columns of ``y``
    (a fused q/k/v or gate/up projection has several parts), added by the same matmul.
    Float32, as peft's."""
    a, b_parts = stacked
    t = F.linear(x.float(), a)
    if mask is not None:
        t = t * mask
    y = y.float()  # the projection's own output (or a copy): added to in place
    if len(b_parts) == 1:
        return y.addmm_(t, b_parts[0])
    width, start = t.shape[1] // len(b_parts), 0
    for p, b in enumerate(b_parts):
        y[:, start : start + b.shape[1]].addmm_(t[:, p * width : (p + 1) * width], b)
        start += b.shape[1]
    return y


class LlamaStep(torch.nn.Module):
    """The decode step of one Llama-family model (see the module docstring).

    ``forward(tokens [B], positions [B], keys, values, lora, attend)`` runs one token per
    slot: writes each slot's K/V at its position, returns float32 logits [B, vocab]. ``keys``
    and ``values`` are per layer ``[B, kv_heads, S, head_dim]``; ``lora`` is None (base only)
    or a ``LoraStack.tensors()`` tuple; ``attend`` (None: all S) how many cache positions to
    attend to, more than any slot's position."""

    def __init__(self, model, max_positions: int, packed: bool | None = None) -> None:
        """``packed``: multiply by oneDNN's packed copies of the weights (``pack``; None: on a
        CPU where the copies take under half the memory the kernel says is available)."""
        super().__init__()
        config = model.config
        inner = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        head = model.get_output_embeddings()
        head_weight = getattr(head, "weight32", head.weight)  # precision.Float32Head's copy
        layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            norms = {
                "norm_in": layer.input_layernorm.weight,
                "norm_post": layer.post_attention_layernorm.weight,
                "q_norm": getattr(getattr(attn, "q_norm", None), "weight", None),
                "k_norm": getattr(getattr(attn, "k_norm", None), "weight", None),
            }
            norms |= {f"{k}32": None if v is None else v.float() for k, v in norms.items()}
            layers.append(
                dict(qkv=qkv, qkv_bias=qkv_bias, o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
                     gate_up=gate_up, down=mlp.down_proj.weight, **norms)
            )  # fmt: skip
        matrices = [w[n] for w in layers for n in ("qkv", "o", "gate_up", "down")]
        matrices.append(head_weight)
        self.packed = False
        if packed is None:
            extra = sum(m.numel() * m.element_size() for m in matrices)
            packed = head_weight.device.type == "cpu" and 2 * extra < spare_memory()
        copies = pack(matrices) if packed else None
        # the same copies by key, for a compiled step (``_packed_linear``)
        self.packed_keys: list[dict[str, int]] = [{} for _ in layers]
        self.head_key: int | None = None
        if copies is not None:
            self.packed = True
            for i, w in enumerate(layers):
                for j, name in enumerate(("qkv", "o", "gate_up", "down")):
                    w[f"{name}_packed"] = copies[4 * i + j]
                    self.packed_keys[i][name] = _register_packed(copies[4 * i + j])
            self.head_key = _register_packed(copies[-1])
        elif packed:
            log.info("decode step: oneDNN cannot pack these weights; plain matmuls")
        self.layers = torch.nn.ModuleList(LayerWeights(**w) for w in layers)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = self.layers[0].gate_up.shape[0] // 2
        cos, sin = self._rope_tables(inner, max_positions)
        half = self.head_dim // 2
        buffers = {
            "embed": inner.embed_tokens.weight,
            "final_norm": inner.norm.weight,
            "final_norm32": inner.norm.weight.float(),
            "head": head_weight,
            "head_packed": copies[-1] if copies is not None else None,
            "head_bias": None if head.bias is None else head.bias.float(),
            "cos": cos,
            "sin_signed": torch.cat([-sin[:, :half], sin[:, half:]], -1),  # for _rotate
        }
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    @torch.no_grad()
    def _rope_tables(self, inner, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..length-1 from the model's own rotary module, in the
        embedding's dtype (as the model's forward casts them)."""
        weight = inner.embed_tokens.weight
        probe = torch.zeros(1, dtype=weight.dtype, device=weight.device)
        positions = torch.arange(length, device=probe.device).unsqueeze(0)
        cos, sin = inner.rotary_emb(probe, positions)
        return cos[0], sin[0]

    def uses_packed(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows multiplies by the packed weights: float32 matmuls of
        one row do not (F.linear's gemv beat the packed layout, 16 vs 24 ms a step on
        SmolLM2); bf16 ones and any batch do."""
        return self.packed and (rows > 1 or self.dtype != torch.float32)

    def new_cache(self, rows: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed K/V slots: per layer [rows, kv_heads, length, head_dim], float32 as the
        model's projections return them (what training's forward attends to).

        (Keys stored transposed, [.., head_dim, length], made the scores' matmul ~10% faster
        at 300 positions, but each step's write of a token's keys then touched a cache line
        per head dimension: a wash at 300 positions, a loss at 80. Measured, not kept.)"""
        shape = (rows, self.num_kv_heads, length, self.head_dim)
        make = [torch.zeros(shape, dtype=torch.float32, device=self.device) for _ in self.layers]
        return make, [torch.zeros_like(k) for k in make]

    def forward(self, tokens, positions, keys, values, lora=None, attend=None):
        rows, kv, heads, dim = tokens.shape[0], self.num_kv_heads, self.num_heads, self.head_dim
        length = keys[0].shape[2]
        attend = length if attend is None else attend
        group = heads // kv
        # A compiled step finds the packed weights by key (``_packed_linear``): a graph
        # cannot hold them.
        packed = self.uses_packed(rows)
        keyed = packed and torch.compiler.is_compiling()
        h = F.embedding(tokens, self.embed)  # [B, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [B, 1, head_dim]
        sin = self.sin_signed[positions].unsqueeze(1)
        # Attention as batched matmuls over (slot, kv head) pairs, each with its group of
        # query heads (what SDPA's kernel does for one query token, at a third of its cost
        # here); additive mask [B * kv, 1, attend], built once: each slot sees its keys up
        # to its own position.
        hidden = torch.arange(attend, device=tokens.device) > positions.unsqueeze(-1)
        mask = torch.zeros(hidden.shape, device=tokens.device).masked_fill(hidden, float("-inf"))
        mask = mask.repeat_interleave(kv, 0).unsqueeze(1)
        # Where each (slot, kv head)'s new K/V goes in a layer's cache, flattened to rows.
        slot_heads = torch.arange(rows * kv, device=tokens.device)
        where = slot_heads * length + positions.repeat_interleave(kv)
        masks, per_layer, head_lora = lora if lora is not None else (None, None, None)
        masks = masks or (None, None, None, None)  # None: one adapter, every row its own
        for i, w in enumerate(self.layers):
            x = _rms_norm(h, w.norm_in, w.norm_in32, self.eps)
            pk = self.packed_keys[i] if keyed else None
            qkv = _linear(x, w.qkv, w.qkv_bias, _pick(pk, w, "qkv", packed))
            if per_layer is not None and per_layer[i][0] is not None:
                qkv = _lora(qkv, x, per_layer[i][0], masks[3])
            qk = qkv[:, : self.q_size + self.kv_size].view(rows, heads + kv, dim)
            if w.q_norm is None:
                qk = _rotate(qk, cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = _rotate(_rms_norm(qk[:, :heads], w.q_norm, w.q_norm32, self.eps), cos, sin)
                k = _rotate(_rms_norm(qk[:, heads:], w.k_norm, w.k_norm32, self.eps), cos, sin)
            v = qkv[:, self.q_size + self.kv_size :]
            keys[i].view(-1, dim).index_copy_(0, where, k.reshape(-1, dim))
            values[i].view(-1, dim).index_copy_(0, where, v.reshape(-1, dim))
            scores = torch.baddbmm(
                mask, q.reshape(rows * kv, group, dim),
                keys[i][:, :, :attend].view(rows * kv, attend, dim).transpose(1, 2),
                alpha=self.scaling,
            )  # fmt: skip
            a = torch.bmm(scores.softmax(-1), values[i][:, :, :attend].view(rows * kv, attend, dim))
            a = a.view(rows, self.q_size)
            # bf16 + bf16 would stay bf16: the first layer's residual (the embedding) is bf16
            o = _linear(a, w.o, w.o_bias, _pick(pk, w, "o", packed), h.dtype != a.dtype)
            if per_layer is not None and per_layer[i][1] is not None:
                o = _lora(o, a, per_layer[i][1], masks[1])
            h = h + o  # float32 (+ bf16: promoted exactly)
            x = _rms_norm(h, w.norm_post, w.norm_post32, self.eps)
            gu = _linear(x, w.gate_up, None, _pick(pk, w, "gate_up", packed))
            if per_layer is not None and per_layer[i][2] is not None:
                gu = _lora(gu, x, per_layer[i][2], masks[2])
            gate, up = gu.split([self.intermediate, self.intermediate], dim=-1)
            m = F.silu(gate) * up
            d = _linear(m, w.down, None, _pick(pk, w, "down", packed), False)
            if per_layer is not None and per_layer[i][3] is not None:
                d = _lora(d, m, per_layer[i][3], masks[1])
            h = h + d
        x = _rms_norm(h, self.final_norm, self.final_norm32, self.eps)
        head = self.head_key if keyed else (self.head_packed if packed else None)
        logits = _linear(x.float(), self.head, self.head_bias, head)
        if head_lora is not None:
            logits = _lora(logits, x, head_lora, masks[1])
        return logits


class Compiled:
    """``LlamaStep`` compiled lazily (CPU: inductor; CUDA: CUDA graphs), one graph per batch
    bucket and LoRA layout; eager where compilation fails (one log line) or is off.

    ``compiles`` counts graphs built and ``seconds`` their compile times (the engine's info,
    so ``/rlcli/status``, shows them): a test checks that requests reuse them."""

    def __init__(self, step: LlamaStep, enabled: bool) -> None:
        self.step = step
        self.enabled = enabled
        self.compiles = 0
        self.seconds: dict[str, float] = {}
        self.failed: str | None = None
        self._fn = None
        if enabled:
            # A graph per batch bucket, with LoRA or not (and per LoRA layout: which
            # projections have one): more than dynamo's default limit of 8.
            config = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(config, name):
                    setattr(config, name, max(getattr(config, name), 64))
            self._fn = torch.compile(step, backend=self._backend)

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        patches = {"triton.cudagraphs": True} if self.step.device.type == "cuda" else {}
        return compile_fx(gm, example_inputs, config_patches=patches)

    @property
    def compiling(self) -> bool:
        """Whether calls run a compiled graph (not eager: off, or fallen back)."""
        return self._fn is not None

    def __call__(self, tokens, positions, keys, values, lora=None, attend=None):
        """``attend``: as ``LlamaStep.forward``'s, eager only (a graph attends to the whole
        cache: one graph for every length)."""
        if self._fn is None:
            return self.step(tokens, positions, keys, values, lora, attend)
        # One graph for every cache length and LoRA width (they change as rows come and go);
        # the batch size stays static: a graph per bucket.
        for t in (*keys, *values):
            torch._dynamo.maybe_mark_dynamic(t, 2)
        if lora is not None:
            for t in (lora[0] or (None,))[1:]:
                torch._dynamo.maybe_mark_dynamic(t, 1)
            for pair in (*lora[1], (lora[2],)):
                for a_b in pair:
                    if a_b is not None:
                        for t in (a_b[0], *a_b[1]):
                            torch._dynamo.maybe_mark_dynamic(t, 0)
        started, before = time.perf_counter(), self.compiles
        try:
            out = self._fn(tokens, positions, keys, values, lora)
        except Exception as e:  # noqa: BLE001 - a compiler failure: run eager from now on
            out = self.step(tokens, positions, keys, values, lora)  # its own error: raised
            why = f"{type(e).__name__}: {e}"
            log.warning("decode step: compiling failed, running eager (%s)", why)
            self.failed = why[:300]
            self._fn = None
            return out
        if self.compiles > before:
            took = time.perf_counter() - started
            name = f"batch {tokens.shape[0]}" + ("" if lora is None else " +lora")
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 2)
            log.info("decode step compiled for %s in %.1f s", name, took)
        return out

    def info(self) -> dict:
        return {
            "compile": "failed" if self.failed else ("on" if self.enabled else "off"),
            "compiled_graphs": self.compiles,
            "compile_seconds": dict(self.seconds),
            **({"compile_error": self.failed} if self.failed else {}),
        }
