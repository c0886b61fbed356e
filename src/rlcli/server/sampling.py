"""Batched, KV-cached sampling for one model (base or one adapter) at a time.

Rows (prompt x sample) are left-padded into one batch, prefilled once, then decoded a token
per step with the cache. Each row has its own temperature, top-k, top-p, stop set and random
generator (so a seed reproduces its tokens whatever else shares the batch). Returned logprobs
are the model's own ``log_softmax`` of the sampled token (temperature 1, no filtering): the
numbers a forward pass gives for the same tokens, which is what importance ratios need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SampleJob:
    """One ``asample`` request, as the engine receives it."""

    prompt: np.ndarray  # int64 [N]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    sampler: str | None = None  # engine adapter name; None = the base model


@dataclass
class SampleOutput:
    sequences: list[tuple[np.ndarray, np.ndarray, str]]  # (tokens int32, logprobs f32, reason)
    prompt_logprobs: np.ndarray | None = None  # float32 [N], NaN first
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None  # ([N, k] int32, [N, k] f32)


@dataclass
class _Row:
    job: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # set when finished


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-row temperature, top-k (<= 0: off) and nucleus (1.0: off) on [B, V] logits."""
    scaled = logits / temperature.clamp(min=1e-6).unsqueeze(-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, scaled.shape[-1]).unsqueeze(-1)
    drop = ranks >= k
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before > top_p.unsqueeze(-1)  # keeps at least the top token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def prompt_logprob_arrays(
    logits: torch.Tensor, prompt: torch.Tensor, topk: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """From one row's prefill logits [N, V]: log p(prompt[t] | prompt[:t]) (NaN at t=0), and
    the top-k alternatives per position (row 0 empty: nothing predicts the first token)."""
    logp = logits.float().log_softmax(-1)
    values = torch.full((len(prompt),), float("nan"))
    if len(prompt) > 1:
        values[1:] = logp[:-1].gather(-1, prompt[1:].unsqueeze(-1)).squeeze(-1).cpu()
    top = None
    if topk > 0:
        k = min(topk, logp.shape[-1])
        ids = torch.zeros(len(prompt), k, dtype=torch.int32)
        lps = torch.full((len(prompt), k), -99999.0)
        if len(prompt) > 1:
            best = logp[:-1].topk(k, dim=-1)
            ids[1:] = best.indices.to(torch.int32).cpu()
            lps[1:] = best.values.cpu()
        top = (ids.numpy(), lps.numpy())
    return values.numpy().astype(np.float32), top


def _hits_stop_string(tokens: list[int], stops: list[str], decode) -> bool:
    """Does the text end in a stop string? Only the last tokens are decoded: a token stands for
    at least one byte, so a stop string of L characters (<= 4L bytes) lies within the last
    4L + 1 tokens (one more for a token that straddles its start). Linear in length overall."""
    if not stops:
        return False
    window = 4 * max(len(stop) for stop in stops) + 1
    text = decode(tokens[-window:])
    return any(stop in text for stop in stops)


def row_seed(seed: int, sample: int) -> int:
    """The generator seed of sample ``sample`` of a request seeded ``seed`` (any uint64)."""
    return (seed * 1_000_003 + sample) % 2**63


@torch.inference_mode()
def generate(
    model, jobs: list[SampleJob], *, device: torch.device, pad_id: int, decode
) -> list[SampleOutput]:
    """Sample every job's rows in one batch on ``model`` (already set to the right adapter).

    ``decode(list[int]) -> str`` is used only for stop strings.
    """
    rows: list[_Row] = []
    for j, job in enumerate(jobs):
        for s in range(job.num_samples):
            generator = None
            if job.seed is not None:
                generator = torch.Generator().manual_seed(row_seed(job.seed, s))
            rows.append(_Row(job=j, generator=generator))
    width = max(len(job.prompt) for job in jobs)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.long)
    for r, row in enumerate(rows):
        prompt = torch.from_numpy(jobs[row.job].prompt)
        input_ids[r, width - len(prompt) :] = prompt
        attention[r, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    input_ids, attention, positions = (t.to(device) for t in (input_ids, attention, positions))

    # Logits over the whole prompt only when prompt logprobs are wanted: [rows, width, vocab]
    # floats is gigabytes for a 50k vocabulary.
    want_prompt = any(job.prompt_logprobs or job.topk_prompt_logprobs for job in jobs)
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        logits_to_keep=0 if want_prompt else 1,
    )
    cache, logits = out.past_key_values, out.logits

    outputs = [SampleOutput(sequences=[]) for _ in jobs]
    first_row = {}
    for r, row in enumerate(rows):
        first_row.setdefault(row.job, r)
    for j, job in enumerate(jobs):
        if job.prompt_logprobs or job.topk_prompt_logprobs:
            n = len(job.prompt)
            r = first_row[j]
            values, top = prompt_logprob_arrays(
                logits[r, width - n :], torch.from_numpy(job.prompt).to(device),
                job.topk_prompt_logprobs,
            )  # fmt: skip
            outputs[j].prompt_logprobs = values
            outputs[j].topk_prompt = top
    next_logits = logits[:, -1, :].float()
    del logits, out

    def per_row(attr, dtype):
        return torch.tensor([getattr(jobs[row.job], attr) for row in rows], dtype=dtype)

    temperature = per_row("temperature", torch.float32).to(device)
    top_k = per_row("top_k", torch.long).to(device)
    top_p = per_row("top_p", torch.float32).to(device)
    needs_filter = bool((top_k > 0).any() or (top_p < 1).any())
    greedy = (temperature <= 0).tolist()
    seeded = [r for r, row in enumerate(rows) if row.generator is not None and not greedy[r]]
    free = [r for r, row in enumerate(rows) if row.generator is None and not greedy[r]]
    greedy_rows = [r for r in range(batch) if greedy[r]]
    for row in rows:  # asked for nothing: done before the first step, alone or batched
        if jobs[row.job].max_tokens == 0:
            row.reason = "length"
    max_new = max(job.max_tokens for job in jobs)
    position = positions[:, -1]
    for _ in range(max_new):
        logp = next_logits.log_softmax(-1)
        if needs_filter:
            scaled = filter_logits(next_logits, temperature, top_k, top_p)
        else:
            scaled = next_logits / temperature.clamp(min=1e-6).unsqueeze(-1)
        probs = scaled.softmax(-1)
        chosen = torch.empty(batch, dtype=torch.long, device=device)
        if free:  # one draw for every unseeded row
            chosen[free] = torch.multinomial(probs[free], 1).squeeze(-1)
        for r in seeded:  # a seeded row draws from its own generator, on the CPU
            chosen[r] = torch.multinomial(probs[r].cpu(), 1, generator=rows[r].generator)[0]
        if greedy_rows:
            chosen[greedy_rows] = next_logits[greedy_rows].argmax(-1)
        chosen_logp = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()
        chosen_list = chosen.tolist()
        for r, row in enumerate(rows):
            if row.reason is not None:
                continue
            job = jobs[row.job]
            token = chosen_list[r]
            row.tokens.append(token)
            row.logprobs.append(chosen_logp[r])
            if token in job.stop_tokens or _hits_stop_string(row.tokens, job.stop_strings, decode):
                row.reason = "stop"
            elif len(row.tokens) >= job.max_tokens:
                row.reason = "length"
        if all(row.reason is not None for row in rows):
            break
        position = position + 1
        attention = torch.cat([attention, torch.ones(batch, 1, dtype=torch.long, device=device)], 1)
        out = model(
            input_ids=chosen.unsqueeze(-1),
            attention_mask=attention,
            position_ids=position.unsqueeze(-1),
            past_key_values=cache,
        )
        cache, next_logits = out.past_key_values, out.logits[:, -1, :].float()

    for row in rows:
        outputs[row.job].sequences.append(
            (
                np.asarray(row.tokens, dtype=np.int32),
                np.asarray(row.logprobs, dtype=np.float32),
                row.reason or "length",
            )
        )
    return outputs
