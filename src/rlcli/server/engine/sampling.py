"""Batched, KV-cached sampling for one model (base or one adapter) at a time.

Rows (prompt x sample) are left-padded into one batch, prefilled once, then decoded a token
per step with the cache. Each row has its own temperature, top-k, top-p, stop set and random
generator (so a seed reproduces its tokens whatever else shares the batch). Returned logprobs
are the model's own ``log_softmax`` of the sampled token (temperature 1, no filtering): the
numbers a forward pass gives for the same tokens, which is what importance ratios need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from rlcli.server.engine.sample_job import SampleJob, SampleOutput


def prompt_extras(
    logits: torch.Tensor, job: SampleJob, generator: torch.Generator | None
) -> dict[str, object]:
    """The tinker>=0.38 prompt outputs of one row's prefill logits [N, V]: target token
    logprobs and alternative draws (row i is about prompt position i + 1)."""
    out: dict[str, object] = {}
    logp = logits[:-1].float().log_softmax(-1)
    if job.target_prompt is not None:
        ids = torch.from_numpy(job.target_prompt).to(logp.device)
        values = logp.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
        out["target_prompt"] = values.cpu().numpy().astype(np.float32)
    if job.prompt_alt_k:
        scaled = logits[:-1].float() / max(job.temperature, 1e-6)
        probs = scaled.softmax(-1).cpu()
        if job.temperature <= 0:
            tokens = probs.argmax(-1, keepdim=True).expand(-1, job.prompt_alt_k)
        else:
            tokens = torch.multinomial(
                probs, job.prompt_alt_k, replacement=True, generator=generator
            )
        lps = logp.cpu().gather(-1, tokens)
        out["prompt_alt"] = (tokens.numpy().astype(np.int32), lps.numpy().astype(np.float32))
    return out


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
    """From one row's prefill logits over the prompt's last M positions [M, V] (M <= N, see
    ``logits_to_keep``): log p(prompt[t] | prompt[:t]) for its last M - 1 tokens (NaN before,
    and at t=0), and the top-k alternatives there (rows before empty, as row 0 is: nothing
    predicts the first token)."""
    logp = logits.float().log_softmax(-1)
    first = len(prompt) - len(logits) + 1  # the first token these logits predict
    values = torch.full((len(prompt),), float("nan"))
    if len(logits) > 1:
        values[first:] = logp[:-1].gather(-1, prompt[first:].unsqueeze(-1)).squeeze(-1).cpu()
    top = None
    if topk > 0:
        k = min(topk, logp.shape[-1])
        ids = torch.zeros(len(prompt), k, dtype=torch.int32)
        lps = torch.full((len(prompt), k), -99999.0)
        if len(logits) > 1:
            best = logp[:-1].topk(k, dim=-1)
            ids[first:] = best.indices.to(torch.int32).cpu()
            lps[first:] = best.values.cpu()
        top = (ids.numpy(), lps.numpy())
    return values.numpy().astype(np.float32), top


def logits_to_keep(jobs: list[SampleJob]) -> int:
    """How many of a prefill's last positions need logits (HF's ``logits_to_keep``; 0: all):
    1, the next token's, unless a job wants prompt logprobs; then the last N + 1 where every
    such job scores only its last N prompt tokens (``prompt_logprobs_last_n``), else all. A
    [rows, width, vocab] float tensor and its softmax are most of a scoring prefill's time
    (a teacher scoring a short answer after a long document)."""
    wanting = [job for job in jobs if job.wants_prompt]
    if not wanting:
        return 1
    if any(
        job.prompt_logprobs_last_n is None or job.prompt_alt_k or job.target_prompt is not None
        for job in wanting
    ):
        return 0
    return max(job.prompt_logprobs_last_n for job in wanting) + 1


def prompt_rows(logits: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """Row ``row``'s logits over its prompt of ``n`` tokens (left-padded, so the last ones),
    as many of them as the prefill kept."""
    kept = logits.shape[1]
    return logits[row, kept - min(n, kept) :]


def _hits_stop_string(tokens: list[int], stops: list[str], decode) -> bool:
    """Does the text end in a stop string? Only the last tokens are decoded: a token stands for
    at least one byte, so a stop string of L characters (<= 4L bytes) lies within the last
    4L + 1 tokens (one more for a token that straddles its start). Linear in length overall."""
    if not stops:
        return False
    window = 4 * max(len(stop) for stop in stops) + 1
    text = decode(tokens[-window:])
    return any(stop in text for stop in stops)


SPARE_TOKENS = 256


def row_seed(seed: int, sample: int) -> int:
    """The generator seed of sample ``sample`` of a request seeded ``seed`` (any uint64)."""
    return (seed * 1_000_003 + sample) % 2**63


class _GrowingLayer(DynamicLayer):
    """A KV-cache layer over a buffer with room to spare: a decode step writes its token in
    place instead of copying the whole cache (``DynamicLayer`` concatenates every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._k = self._v = None

    def set(self, keys: torch.Tensor, values: torch.Tensor, spare: int) -> None:
        """Hold ``keys``/``values`` [B, H, T, D], with room for ``spare`` more tokens."""
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        b, h, t, d = keys.shape
        self._k = keys.new_zeros(b, h, t + spare, d)
        self._v = values.new_zeros(b, h, t + spare, values.shape[-1])
        self._k[:, :, :t], self._v[:, :, :t] = keys, values
        self.length = t
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

    def update(self, key_states, value_states, *args, **kwargs):
        t = key_states.shape[-2]
        if self._k is None:
            self.set(key_states, value_states, 0)
            return self.keys, self.values
        if self.length + t > self._k.shape[-2]:  # out of room: double it
            self.set(self.keys, self.values, max(t, self._k.shape[-2]))
        n = self.length
        self._k[:, :, n : n + t] = key_states
        self._v[:, :, n : n + t] = value_states
        self.length = n + t
        self.keys, self.values = self._k[:, :, : n + t], self._v[:, :, : n + t]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


def _full_attention_only(model) -> bool:
    """Rows can join a running batch only when every layer keeps the whole sequence (no
    sliding-window or linear-attention layers, whose caches are not plain [B, H, T, D])."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not getattr(config, "sliding_window", None) or not getattr(
        config, "use_sliding_window", True
    )


@dataclass
class _Job:
    job: SampleJob
    ticket: Any
    output: SampleOutput
    left: int  # rows still decoding
    stops: frozenset[int] = frozenset()


@dataclass
class _Row:
    job: _Job
    sample: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None  # set when finished
    topk: list[tuple[np.ndarray, np.ndarray]] | None = None  # topk_sample_logprobs, per token


class DecodeBatch:
    """Rows decoding together on one model (already set to the right adapter).

    ``admit`` prefills new requests (each prompt once, in one pass) and merges their rows into
    the running batch, so a request that arrives mid-decode joins at the next ``step`` instead
    of waiting for the batch to end. Rows are left-padded to a common cache length; each row
    keeps its own position ids, and the attention mask hides the padding. A row leaves the
    batch (and its cache) when it finishes; a request is answered when all its rows have.
    ``decode(list[int]) -> str`` is used only for stop strings.
    """

    def __init__(self, model, *, device: torch.device, pad_id: int, decode) -> None:
        self.model, self.device, self.pad_id, self.decode = model, device, pad_id, decode
        self.key: str | None = None  # the sampler it decodes (the engine sets it)
        self.can_join = model is None or _full_attention_only(model)
        self.rows: list[_Row] = []
        self.steps = 0  # decode forward passes run
        # Streaming requests' tokens drawn since the caller last took them: ticket -> list of
        # (sample, token, logprob, top ids or None, top logprobs or None, reason or None).
        self.partials: dict[Any, list[tuple]] = {}
        self._cache = None
        self._attention = self._position = self._next_logits = None
        self._temperature = self._top_k = self._top_p = None

    def __len__(self) -> int:
        return len(self.rows)

    def accepts(self, key: str | None) -> bool:
        """Whether a request for sampler ``key`` can join: on this path, only its own."""
        return key == self.key

    @torch.inference_mode()
    def admit(self, jobs: list[SampleJob], tickets: list[Any]) -> list[tuple[Any, SampleOutput]]:
        """Prefill ``jobs`` and add their rows; returns the ones already done (max_tokens=0)."""
        width = max(len(job.prompt) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(jobs), width, dtype=torch.long)
        for j, job in enumerate(jobs):
            input_ids[j, width - len(job.prompt) :] = torch.from_numpy(job.prompt)
            attention[j, width - len(job.prompt) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        input_ids, attention, positions = (t.to(dev) for t in (input_ids, attention, positions))
        # Logits over the prompt only where prompt logprobs are wanted: [rows, width, vocab]
        # floats is gigabytes for a 50k vocabulary.
        cache = self._new_cache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=logits_to_keep(jobs),
        )
        logits = out.logits
        done, entries, expand = self._prepare(
            jobs, tickets, lambda j, n, all_=logits: prompt_rows(all_, j, n), range(len(jobs))
        )
        next_logits = logits[:, -1, :].float()
        del out, logits
        if not entries:
            return done
        index = torch.tensor(expand, device=dev)
        layers = [(layer.keys[index], layer.values[index]) for layer in cache.layers]
        self._merge(entries, layers, attention[index], positions[index, -1], next_logits[index])
        return done

    def _prepare(self, jobs, tickets, prompt_logits, sources):
        """Each job's prompt outputs and its rows (one per sample). ``prompt_logits(j, n)``:
        the logits [n, V] over job ``j``'s prompt, where ``j`` is the job's entry of
        ``sources`` (its row in the prefill). Returns (requests already done, new rows,
        the prefill row of each new row)."""
        done, entries, expand = [], [], []
        for j, job, ticket in zip(sources, jobs, tickets, strict=True):
            entry = _Job(job, ticket, SampleOutput(sequences=[None] * job.num_samples), 0)
            entry.stops = frozenset(job.stop_tokens)
            n = len(job.prompt)
            if job.prompt_logprobs or job.topk_prompt_logprobs:
                values, top = prompt_logprob_arrays(
                    prompt_logits(j, n), torch.from_numpy(job.prompt).to(self.device),
                    job.topk_prompt_logprobs,
                )  # fmt: skip
                if job.prompt_logprobs_last_n is not None:  # scored: the last N only
                    values[: n - job.prompt_logprobs_last_n] = np.nan
                entry.output.prompt_logprobs, entry.output.topk_prompt = values, top
            if job.prompt_alt_k or job.target_prompt is not None:
                generator = None
                if job.seed is not None:
                    generator = torch.Generator().manual_seed(row_seed(job.seed, 2**20))
                extras = prompt_extras(prompt_logits(j, n), job, generator)
                entry.output.target_prompt = extras.get("target_prompt")
                entry.output.target_layout = job.target_sparse
                entry.output.prompt_alt = extras.get("prompt_alt")
            if job.topk_sample_logprobs:
                entry.output.topk_sampled = [None] * job.num_samples
            if job.max_tokens == 0 or job.num_samples == 0:  # nothing to sample
                empty = (np.zeros(0, np.int32), np.zeros(0, np.float32), "length")
                entry.output.sequences = [empty] * job.num_samples
                done.append((ticket, entry.output))
                continue
            entry.left = job.num_samples
            for s in range(job.num_samples):  # one prefill per prompt, one row per sample
                generator = None
                if job.seed is not None:
                    generator = torch.Generator().manual_seed(row_seed(job.seed, s))
                row = _Row(entry, s, generator)
                if job.topk_sample_logprobs:
                    row.topk = []
                entries.append(row)
                expand.append(j)
        return done, entries, expand

    def _new_cache(self):
        if self.can_join:
            return Cache(layer_class_to_replicate=_GrowingLayer)
        return DynamicCache(config=self.model.config)

    def _merge(self, rows, layers, attention, position, next_logits) -> None:
        """Add prefilled rows to the batch, left-padding whichever side has the shorter cache."""
        spare = _spare(row.job.job.max_tokens for row in rows)
        if self.rows:
            if not self.can_join:
                raise RuntimeError("this model's cache layout cannot take rows mid-decode")
            old = self._cache.layers
            width = max(old[0].length, layers[0][0].shape[-2])
            spare = max(spare, _spare(r.job.job.max_tokens - len(r.tokens) for r in self.rows))
            layers = [
                (_cat_left(o.keys, k, width), _cat_left(o.values, v, width))
                for o, (k, v) in zip(old, layers, strict=True)
            ]
            attention = _cat_left(self._attention, attention, width)
            position = torch.cat([self._position, position])
            next_logits = torch.cat([self._next_logits, next_logits])
        if self.can_join:
            cache = Cache(layer_class_to_replicate=_GrowingLayer)
            for k, v in layers:
                layer = _GrowingLayer()
                layer.set(k, v, spare)
                cache.layers.append(layer)
        else:
            cache = self._cache_from(layers)
        self._cache, self._attention, self._position = cache, attention, position
        self._next_logits = next_logits
        self.rows.extend(rows)
        self._row_params()

    def _cache_from(self, layers):
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        return cache

    def _row_params(self) -> None:
        self._padded = self._attention is not None and bool((self._attention == 0).any())

        def per_row(attr, dtype):
            values = [getattr(row.job.job, attr) for row in self.rows]
            return torch.tensor(values, dtype=dtype, device=self.device)

        self._temperature = per_row("temperature", torch.float32)
        self._top_k = per_row("top_k", torch.long)
        self._top_p = per_row("top_p", torch.float32)
        self._filter = bool((self._top_k > 0).any() or (self._top_p < 1).any())
        self._unit_temperature = bool((self._temperature[self._temperature > 0] == 1).all())
        self._topk_sampled = max(row.job.job.topk_sample_logprobs for row in self.rows)
        greedy = (self._temperature <= 0).tolist()
        rows = self.rows
        self._random = [r for r in range(len(rows)) if not greedy[r]]
        self._greedy = [r for r in range(len(rows)) if greedy[r]]

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, SampleOutput]]:
        """Sample one token for every row, drop the rows that finished, run the model once on
        the rest. Returns the requests whose last row just finished."""
        chosen, chosen_logp = self._draw()
        top = self._top_sampled()
        done = []
        keep = []
        for r, row in enumerate(self.rows):
            token = chosen_logp[0][r]
            row.tokens.append(token)
            row.logprobs.append(chosen_logp[1][r])
            if top is not None and row.topk is not None:
                k = row.job.job.topk_sample_logprobs
                row.topk.append((top[0][r, :k], top[1][r, :k]))
            job = row.job.job
            if token in row.job.stops or _hits_stop_string(
                row.tokens, job.stop_strings, self.decode
            ):
                row.reason = "stop"
            elif len(row.tokens) >= job.max_tokens:
                row.reason = "length"
            if job.stream:
                ids, lps = row.topk[-1] if row.topk else (None, None)
                self.partials.setdefault(row.job.ticket, []).append(
                    (row.sample, token, row.logprobs[-1], _list(ids), _list(lps), row.reason)
                )
            if row.reason is None:
                keep.append(r)
                continue
            entry = row.job
            entry.output.sequences[row.sample] = (
                np.asarray(row.tokens, dtype=np.int32),
                np.asarray(row.logprobs, dtype=np.float32),
                row.reason,
            )
            if row.topk is not None:
                entry.output.topk_sampled[row.sample] = (
                    np.stack([ids for ids, _ in row.topk]).astype(np.int32),
                    np.stack([lps for _, lps in row.topk]).astype(np.float32),
                )
            entry.left -= 1
            if entry.left == 0:
                done.append((entry.ticket, entry.output))
        if len(keep) < len(self.rows):
            self._keep(keep)
            chosen = chosen[keep] if keep else chosen[:0]
        if not self.rows:
            return done
        self._forward(chosen)
        self.steps += 1
        return done

    def _forward(self, chosen: torch.Tensor) -> None:
        """Run the model on each row's drawn token; sets the next step's logits."""
        self._position = self._position + 1
        ones = torch.ones(len(self.rows), 1, dtype=torch.long, device=self.device)
        self._attention = torch.cat([self._attention, ones], 1)
        out = self.model(
            input_ids=chosen.unsqueeze(-1),
            # No padding (rows of one prompt, or of prompts of one length): no mask to build
            # and apply, which is a good part of a small model's step.
            attention_mask=self._attention if self._padded else None,
            position_ids=self._position.unsqueeze(-1),
            past_key_values=self._cache,
        )
        self._next_logits = out.logits[:, -1, :].float()

    @torch.inference_mode()  # as admit and step: it may write the batch's tensors in place
    def cancel(self, ticket: Any) -> bool:
        """Drop every row of request ``ticket`` (its client went away) between two steps;
        False if it has none here."""
        keep = [r for r, row in enumerate(self.rows) if row.job.ticket != ticket]
        if len(keep) == len(self.rows):
            return False
        self._keep(keep)
        self.partials.pop(ticket, None)
        return True

    def _top_sampled(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The top-k (the largest k any row asks for) of this step's distributions, for
        ``topk_sample_logprobs``; None when no row asks (the common case costs nothing)."""
        k = self._topk_sampled
        if not k:
            return None
        best = self._next_logits.log_softmax(-1).topk(min(k, self._next_logits.shape[-1]), -1)
        return best.indices.cpu().numpy(), best.values.cpu().numpy()

    def _draw(self) -> tuple[torch.Tensor, tuple[list[int], list[float]]]:
        """Each row's next token (its own temperature / top-k / top-p / generator) and the
        model's log-probability of it (temperature 1, unfiltered).

        The vocabulary-wide passes are most of this at small batch (16 rows x 49k: ~6 ms a
        step before, ~2 now), so the common cases take the fewest: no row indexing when every
        row samples, and at temperature 1 unfiltered the probabilities are
        ``exp(logits - logsumexp)``, the logsumexp the logprobs need anyway."""
        logits = self._next_logits
        lse = logits.logsumexp(-1)
        chosen = torch.empty(len(self.rows), dtype=torch.long, device=self.device)
        if self._random:
            every = len(self._random) == len(self.rows)
            rows = slice(None) if every else self._random
            if self._filter:
                scaled = filter_logits(logits, self._temperature, self._top_k, self._top_p)
                probs = scaled[rows].softmax(-1)
            elif self._unit_temperature:
                probs = (logits[rows] - lse[rows].unsqueeze(-1)).exp_()
            else:
                temperature = self._temperature[rows].clamp(min=1e-6).unsqueeze(-1)
                probs = (logits[rows] / temperature).softmax(-1)
            chosen[rows] = self._inverse_cdf(probs)
        if self._greedy:
            chosen[self._greedy] = logits[self._greedy].argmax(-1)
        picked = logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        logp = picked - lse
        return chosen, (chosen.tolist(), logp.tolist())

    def _inverse_cdf(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per sampled row, by inverting its CDF at a uniform drawn from the row's
        own generator (a seeded row, on the CPU) or the global one: one vectorised search,
        where a multinomial call per seeded row took hundreds of microseconds at a 50k
        vocabulary. The CDF is a float32 cumsum (non-decreasing, as the probabilities are
        not negative); ``right=True`` never lands on a zero-probability token."""
        uniform = torch.stack(
            [torch.rand((), generator=self.rows[r].generator, dtype=torch.float64)
             for r in self._random]
        ).to(probs.device)  # fmt: skip
        cdf = probs.cumsum(-1)
        total = cdf[:, -1:]
        point = (uniform.unsqueeze(-1) * total.double()).float()
        # below the total, always (rounding may reach it): the search stays in the vocabulary
        point = torch.minimum(point, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cdf, point, right=True).squeeze(-1)
        return picked.clamp(max=probs.shape[-1] - 1)

    def _keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` stay; cache columns no remaining row attends to are cut."""
        self.rows = [self.rows[r] for r in keep]
        if not keep:
            self._cache = self._attention = self._position = self._next_logits = None
            return
        index = torch.tensor(keep, device=self.device)
        attention = self._attention[index]
        start = int((attention.sum(0) > 0).long().argmax())  # first column in use
        self._attention = attention[:, start:]
        self._position = self._position[index]
        self._next_logits = self._next_logits[index]
        spare = _spare(row.job.job.max_tokens - len(row.tokens) for row in self.rows)
        layers = [
            (x.keys[index, :, start:], x.values[index, :, start:]) for x in self._cache.layers
        ]
        if self.can_join:
            self._cache = Cache(layer_class_to_replicate=_GrowingLayer)
            for k, v in layers:
                layer = _GrowingLayer()
                layer.set(k, v, spare)
                self._cache.layers.append(layer)
        else:
            self._cache = self._cache_from(layers)
        self._row_params()


def _list(values: np.ndarray | None) -> list | None:
    return None if values is None else values.tolist()


def _spare(tokens_left) -> int:
    """Cache room to reserve: what the rows may still need, at most SPARE_TOKENS (a request
    without max_tokens may ask for 16k; the buffer doubles when it runs out)."""
    return 1 + min(max(tokens_left), SPARE_TOKENS)


def _cat_left(old: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """Concatenate along the batch, each left-padded with zeros to ``width`` on its sequence
    axis (dim 2 for [B, H, T, D] caches, dim 1 for [B, T] masks)."""
    axis = 2 if old.dim() == 4 else 1

    def pad(t):
        missing = width - t.shape[axis]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[axis] = missing
        return torch.cat([t.new_zeros(shape), t], axis)

    return torch.cat([pad(old), pad(new)])


def decode_all(batch: DecodeBatch, jobs: list[SampleJob]) -> list[SampleOutput]:
    """Sample every job's rows on ``batch`` (empty, from ``Engine.decode_batch``), decoding
    to the end."""
    outputs: list[SampleOutput | None] = [None] * len(jobs)
    finished = batch.admit(jobs, list(range(len(jobs))))
    while len(batch):
        finished.extend(batch.step())
    for j, out in finished:
        outputs[j] = out
    return outputs
