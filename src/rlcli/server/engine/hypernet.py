"""A doc-to-LoRA hypernetwork: a document's hidden states in, the rows of a LoRA out.

After Sakana's Doc-to-LoRA (``SakanaAI/doc-to-lora``: ``modeling/hypernet.py``,
``aggregator.py``), cut to what a small model needs. The frozen base model reads the document
once and gives every layer's hidden states (``d2l.py`` runs it); here, per layer, a Perceiver
block (``rank`` latent queries cross-attending to that layer's states, then an MLP) turns them
into ``rank`` latent vectors, and a per-layer head writes each latent out as one row of A and
one row of B of a LoRA on the layer's ``down_proj`` (the MLP's output projection, as in the
reference). The latents are normalised before the head, and B is scaled by a learned factor
that starts at zero, so a new hypernetwork's adapter is a no-op (the base model unchanged)
and training grows it from there.

A long document is cut into chunks of at most ``chunk_tokens``; each chunk gets its own rank-r
LoRA and the chunks' LoRAs are joined along the rank (``merge_chunks``, the reference's
``lora_merger.py``): the sum of the chunks' updates, plus one more rank-r block, the learned
bias LoRA, once per document (as the reference's ``combine_lora`` places it). Hypernetworks
saved before 2026-12-05 added the bias to every chunk's rows (``bias_per_chunk``): n chunks
counted it n times, with cross terms, and 4 chunks garbled SmolLM2's answers; they load and
internalize as they were trained. Training reads documents split into 1..8 pieces
(``d2l.split_ids``) so that the chunks' updates learn to add up.

This module is pure torch on tensors (no engine, no files), so its tests need no model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HypernetConfig:
    """The shape of one hypernetwork; saved with it, and what binds it to its base model."""

    base_model: str
    n_layers: int  # the decoder layers it adapts (one LoRA each): the last n of the model
    first_layer: int  # the first of them (0: every layer)
    hidden: int  # the base model's hidden size: the features read, and down_proj's output
    d_in: int  # down_proj's input (the MLP's intermediate size)
    rank: int = 8  # LoRA rank per chunk
    latent: int = 64  # width of the Perceiver and of the head's input
    heads: int = 4
    alpha: float = 16.0  # the LoRA scale is alpha / rank, per chunk
    chunk_tokens: int = 512
    max_chunks: int = 8  # the longest document: max_chunks * chunk_tokens tokens
    bias_per_chunk: bool = False  # True: the layout before 2026-12-05 (bias in every chunk)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> HypernetConfig:
        """A saved config; one without ``bias_per_chunk`` was saved in the old layout."""
        values = {"bias_per_chunk": True, **values}
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values})


class Perceiver(nn.Module):
    """Per layer: ``rank`` latent queries attend to the layer's (projected) token states, then
    a residual MLP. One set of weights for all layers; a learned per-layer embedding tells
    them apart (the reference's ``layer_to_layer`` mode)."""

    def __init__(self, config: HypernetConfig) -> None:
        super().__init__()
        d = config.latent
        self.project = nn.Linear(config.hidden, d)
        self.layer_embed = nn.Parameter(torch.randn(config.n_layers, 1, d) * 0.02)
        self.queries = nn.Parameter(torch.randn(config.rank, d) * 0.02)
        self.attend = nn.MultiheadAttention(d, config.heads, batch_first=True)
        self.norm_q = nn.LayerNorm(d)
        self.norm_kv = nn.LayerNorm(d)
        self.norm_mlp = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """features [batch, layers, tokens, hidden], mask [batch, tokens] (True: a token)
        -> latents [batch, layers, rank, latent]."""
        b, n_layers, t, _ = features.shape
        # Hidden states differ in scale by orders of magnitude between layers and tokens
        # (massive activations): normalise each token before projecting it.
        kv = self.project(F.layer_norm(features, features.shape[-1:])) + self.layer_embed
        kv = self.norm_kv(kv.reshape(b * n_layers, t, -1))
        q = self.queries.unsqueeze(0) + self.layer_embed.expand(n_layers, -1, -1)
        q = self.norm_q(q.repeat(b, 1, 1))  # [b * layers, rank, d]
        pad = (~mask.bool()).repeat_interleave(n_layers, dim=0)
        x, _ = self.attend(q, kv, kv, key_padding_mask=pad, need_weights=False)
        x = x + q
        x = x + self.mlp(self.norm_mlp(x))
        return x.reshape(b, n_layers, -1, x.shape[-1])


class Hypernet(nn.Module):
    """Hidden states of a document chunk -> (A [batch, layers, rank, d_in], B [batch, layers,
    rank, hidden]) of a LoRA on every layer's down_proj; the update is ``x A^T B * scale``."""

    def __init__(self, config: HypernetConfig) -> None:
        super().__init__()
        self.config = config
        n, r, d = config.n_layers, config.rank, config.latent
        out = config.d_in + config.hidden
        self.perceiver = Perceiver(config)
        # The reference's init: small enough that the first adapters are gentle.
        std = 0.5 / math.sqrt(d + out * r)
        self.head = nn.Parameter(torch.randn(n, d, out) * std)
        a_std = 0.2 / math.sqrt(config.d_in * r)
        self.bias_a = nn.Parameter(torch.randn(n, r, config.d_in) * a_std)
        self.bias_b = nn.Parameter(torch.zeros(n, r, config.hidden))
        self.scale_a = nn.Parameter(torch.ones(n, r, 1))
        self.scale_b = nn.Parameter(torch.zeros(n, r, 1))  # zero: a fresh hypernet is a no-op

    @property
    def scaling(self) -> float:
        return self.config.alpha / self.config.rank

    def forward(
        self, features: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.perceiver(features, mask)
        latents = latents / latents.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        rows = torch.einsum("blrd,ldo->blro", latents, self.head)
        a, b = rows.split([self.config.d_in, self.config.hidden], dim=-1)
        a, b = a * self.scale_a, b * self.scale_b
        if self.config.bias_per_chunk:
            return a + self.bias_a, b + self.bias_b
        return a, b

    def bias(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bias LoRA ([layers, rank, _] each) that a document's merged LoRA adds once;
        None for the old layout, whose chunks carry it."""
        return None if self.config.bias_per_chunk else (self.bias_a, self.bias_b)

    def weight_l1(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Mean absolute generated weight: the reference's penalty keeps adapters small."""
        return a.abs().mean() + b.abs().mean()


Bias = tuple[torch.Tensor, torch.Tensor] | None  # Hypernet.bias(): [layers, rank, _] each


def merge_chunks(
    a: torch.Tensor, b: torch.Tensor, bias: Bias = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks of one document ([chunks, layers, rank, _]) as one LoRA ([layers, (chunks
    + 1) * rank, _], or chunks * rank without a ``bias``): concatenated along the rank, so the
    update is the sum of the chunks' updates and the bias LoRA's."""
    c, n, r, _ = a.shape
    a, b = a.permute(1, 0, 2, 3).reshape(n, c * r, -1), b.permute(1, 0, 2, 3).reshape(n, c * r, -1)
    if bias is None:
        return a, b
    return torch.cat([a, bias[0].to(a.dtype)], dim=1), torch.cat([b, bias[1].to(b.dtype)], dim=1)


def merge_documents(
    a: torch.Tensor, b: torch.Tensor, owners: list[int], bias: Bias = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of several documents ([chunks, layers, rank, _], ``owners[i]``: chunk i's
    document) -> one LoRA per document ([documents, layers, rank, _]): each
    ``merge_chunks``'d, a document of fewer chunks padded with zero rows (they add nothing)."""
    merged = []
    for doc in range(max(owners) + 1):
        at = [i for i, o in enumerate(owners) if o == doc]
        merged.append(merge_chunks(a[at], b[at], bias))
    rank = max(ma.shape[1] for ma, _ in merged)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, rank - t.shape[1]))

    return (
        torch.stack([pad(ma) for ma, _ in merged]),
        torch.stack([pad(mb) for _, mb in merged]),
    )


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """One row's (or a batch's) LoRA update of down_proj: x [batch, tokens, d_in], a [batch,
    rank, d_in], b [batch, rank, hidden] -> [batch, tokens, hidden]."""
    return torch.einsum("btr,bro->bto", torch.einsum("btd,brd->btr", x, a), b) * scale


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
