"""A decode batch on ``decode_step.LlamaStep``: cache slots, rows of several samplers at once.

Each row owns one slot of a preallocated K/V cache (``[slots, kv_heads, length, head_dim]`` per
layer): it writes its token at its own position and attends to its keys up to it, so there is
no left padding, and a request that arrives mid-decode fills free slots and joins at the next
step. The slot count is a bucket (1, 2, 4, ... rows, one compiled graph each) that grows when
rows join and shrinks when most have left; the length grows by ``LENGTH_STEP`` tokens.

Rows may belong to different samplers (the base model, adapter snapshots of several training
clients): each prompt is prefilled by the HF model with its adapter active (peft, once per
distinct prompt and sampler: the samples of a request, and identical prompts of other
requests, share one prefill) and its K/V copied into the rows' slots; decode applies every
row's own LoRA in one batched op per projection (``LoraStack``). The row bookkeeping
(sampling, stops, outputs, streaming) is ``sampling.DecodeBatch``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlcli.server.engine.decode_step import ATTN, HEAD, MLP, Compiled, LlamaStep, bucket
from rlcli.server.engine.sampling import (
    DecodeBatch,
    SampleJob,
    SampleOutput,
    logits_to_keep,
    prompt_rows,
)

LENGTH_STEP = 128  # cache length granularity (tokens): the step attends to all of it, masked
SHARED_PREFIX_MIN = 64  # tokens: prompts sharing a shorter opening are prefilled whole

# A LoRA's weights for the step, read once from peft: {(layer, projection) or "lm_head":
# (A [r, in], B [out, r] * scaling)}.
LoraWeights = dict[Any, tuple[torch.Tensor, torch.Tensor]]
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def prefix_groups(prompts, keep: int) -> list[tuple[list[int], int]]:
    """``prompts`` grouped for prefill, as (indices, tokens shared): those opening with the same
    ``SHARED_PREFIX_MIN`` tokens, each group with its ``shared_prefix``; every prompt that
    shares nothing in one last group with 0. A batch of a teacher's probes mixes several
    documents' chunks."""
    if len(prompts) < 2 or keep == 0:
        return [(list(range(len(prompts))), 0)]
    openings: dict[bytes, list[int]] = {}
    alone = []
    for u, prompt in enumerate(prompts):
        if len(prompt) > SHARED_PREFIX_MIN:
            openings.setdefault(prompt[:SHARED_PREFIX_MIN].tobytes(), []).append(u)
        else:
            alone.append(u)
    groups = []
    for rows in openings.values():
        shared = shared_prefix([prompts[u] for u in rows], keep)
        if shared:
            groups.append((rows, shared))
        else:
            alone += rows
    if alone:
        groups.append((sorted(alone), 0))
    return groups


def _stacked(parts, count: int):
    """The groups' prefills (``parts``: (indices, (logits, layers, width))) as one: rows in
    index order, each left-padded to the widest (a row's prompt the last of its positions)."""
    kept = max(logits.shape[1] for _, (logits, _, _) in parts)
    width = max(w for _, (_, _, w) in parts)
    sample_logits, sample_layers, _ = parts[0][1]
    logits = sample_logits.new_zeros(count, kept, sample_logits.shape[-1])
    layers = [
        tuple(t.new_zeros(count, t.shape[1], width, t.shape[3]) for t in pair)
        for pair in sample_layers
    ]
    for rows, (part_logits, part_layers, part_width) in parts:
        index = torch.tensor(rows, device=logits.device)
        logits[index, kept - part_logits.shape[1] :] = part_logits
        for whole, pair in zip(layers, part_layers, strict=True):
            for into, t in zip(whole, pair, strict=True):
                into[index, :, width - part_width :] = t
    return logits, layers, width


def shared_prefix(prompts, keep: int) -> int:
    """How many opening tokens ``prompts`` (two or more) prefill once: their common prefix,
    short of the last ``keep`` positions of the shortest (its logits come from its rest) and
    of its last token, if that is ``SHARED_PREFIX_MIN`` or more; else 0. Not where every
    position's logits are wanted (``keep`` 0)."""
    if len(prompts) < 2 or keep == 0:
        return 0
    shortest = min(len(p) for p in prompts)
    first = prompts[0][:shortest]
    same = np.ones(shortest, dtype=bool)
    for prompt in prompts[1:]:
        same &= prompt[:shortest] == first
    common = shortest if same.all() else int(np.argmin(same))
    shared = min(common, shortest - max(keep, 1))
    return shared if shared >= SHARED_PREFIX_MIN else 0


class LoraStack:
    """The LoRA of the adapters present in a batch, stacked for ``decode_step._lora``: per
    projection group (q/k/v fused, o, gate/up fused, down) A [parts x adapters x rank, in]
    (part-major) and per part its B, transposed: [adapters x rank, part's out] (so the matmul
    out of it reads it in order: ~1.5x faster than through a transposed view here; and a
    fused group's B is not one block-diagonal matrix, a third of whose bytes, zeros, each
    step would read); per row a 0/1 mask over the columns of its own adapter. Ranks are
    padded to the largest; a projection no adapter has is None."""

    def __init__(self, step: LlamaStep, adapters: list[LoraWeights]) -> None:
        self.count = len(adapters)
        self.rank = max(a.shape[0] for weights in adapters for a, _ in weights.values())
        sizes = {
            "q_proj": step.q_size, "k_proj": step.kv_size, "v_proj": step.kv_size,
            "o_proj": step.embed.shape[1], "gate_proj": step.intermediate,
            "up_proj": step.intermediate, "down_proj": step.embed.shape[1],
        }  # fmt: skip
        self.layers = []
        for i in range(len(step.layers)):
            group_tensors = []
            for group in GROUPS:
                parts = [[w.get((i, name)) for name in group] for w in adapters]
                outs = [sizes[name] for name in group]
                group_tensors.append(self._stack(parts, outs))
            self.layers.append(tuple(group_tensors))
        self.head = self._stack([[w.get(HEAD)] for w in adapters], [step.head.shape[0]])

    def _stack(self, parts: list[list], outs: list[int]):
        if all(p is None for per_adapter in parts for p in per_adapter):
            return None
        first = next(p for per_adapter in parts for p in per_adapter if p is not None)
        width = first[0].shape[1]
        r, n, count = self.rank, len(outs), self.count
        a_all = first[0].new_zeros(n * count * r, width)
        b_parts = tuple(first[0].new_zeros(count * r, out) for out in outs)
        for k, per_adapter in enumerate(parts):
            for p, pair in enumerate(per_adapter):
                if pair is not None:
                    a, b = pair
                    col = (p * count + k) * r
                    a_all[col : col + a.shape[0]] = a
                    b_parts[p][k * r : k * r + a.shape[0]] = b.t()
        return a_all, b_parts

    def tensors(self, slot_adapter: list[int | None], device) -> tuple:
        """The step's ``lora`` argument for slots whose adapters are ``slot_adapter`` (index
        into this stack's adapters, -1: the base model, None: a free slot). With one adapter
        and no base row there are no masks: a free slot's output is never read."""
        if self.count == 1 and all(owner in (0, None) for owner in slot_adapter):
            return None, tuple(self.layers), self.head
        index = torch.tensor([-1 if o is None else o for o in slot_adapter], device=device)
        masks = [None]
        for parts in (1, 2, 3):
            owner = torch.arange(parts * self.count * self.rank, device=device)
            owner = owner // self.rank % self.count  # part-major columns (``_stack``)
            masks.append((owner.unsqueeze(0) == index.unsqueeze(-1)).float())
        return tuple(masks), tuple(self.layers), self.head


class SlotBatch(DecodeBatch):
    """Rows decoding together on ``LlamaStep`` (see the module docstring).

    ``activate(key) -> (module, adapter or None)`` makes the HF module prefill for sampler
    ``key``; ``lora_weights(adapter)`` reads that adapter's LoRA; ``accepts(key)`` says
    whether this kind of batch can decode sampler ``key`` (else it needs the HF path)."""

    def __init__(
        self,
        step: Compiled,
        *,
        activate: Callable[[str | None], tuple[torch.nn.Module, str | None]],
        lora_weights: Callable[[str], LoraWeights],
        accepts: Callable[[str | None], bool],
        max_length: int,
        device: torch.device,
        pad_id: int,
        decode,
    ) -> None:
        super().__init__(None, device=device, pad_id=pad_id, decode=decode)
        self.can_join = True
        self.compiled, self.step_module = step, step.step
        self._activate, self._lora_weights, self._accepts = activate, lora_weights, accepts
        self.max_length = max_length
        self.capacity = 0
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: list[int] = []  # per row, its slot
        self.adapters: list[str | None] = []  # per row, its peft adapter (None: base)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # per slot
        # keys, values and positions are views of the first ``capacity`` slots of this
        # allocation (``_use``): (keys, values, positions) for ``_store_rows`` slots
        self._store: tuple | None = None
        self._store_rows = 0
        self._loras: dict[str, LoraWeights] = {}  # adapter -> weights, read once
        self._stack: LoraStack | None = None
        self._stack_names: list[str] = []
        self._lora_args = None
        self.prefills = 0  # prefill rows run (distinct prompt x sampler)
        # A prompt already in a running row's slot is not prefilled again for a request that
        # joins later (the cookbook sends a GRPO group as requests of one sample each): per
        # row its (sampler, prompt) key, and per key the first draw's logits.
        self.prompt_keys: list[tuple] = []
        self._first_logits: dict[tuple, torch.Tensor] = {}
        self.reused = 0  # prompts copied from a running row instead of prefilled
        self.shared_tokens = 0  # prompt tokens not prefilled again: a shared prefix's copies

    def accepts(self, key: str | None) -> bool:
        return self._accepts(key)

    @torch.inference_mode()
    def admit(self, jobs: list[SampleJob], tickets: list[Any]) -> list[tuple[Any, SampleOutput]]:
        """Prefill each distinct (sampler, prompt) of ``jobs`` once, give their rows slots;
        returns the requests already done (max_tokens=0)."""
        groups: dict[str | None, list[int]] = {}
        for j, job in enumerate(jobs):
            groups.setdefault(job.sampler, []).append(j)
        done, placed, loras = [], [], {}
        # Every group is prefilled before any row is placed: a failing group (an expired
        # sampler) leaves the batch as it was, so the batcher can retry each request alone.
        for key, members in groups.items():
            module, adapter = self._activate(key)
            if adapter is not None and adapter not in self._loras:
                loras[adapter] = self._lora_weights(adapter)
            unique: dict[bytes, int] = {}
            sources = [unique.setdefault(jobs[j].prompt.tobytes(), len(unique)) for j in members]
            prompts = [None] * len(unique)
            for j, u in zip(members, sources, strict=True):
                prompts[u] = jobs[j].prompt
            group = [jobs[j] for j in members]
            want_prompt = any(job.wants_prompt for job in group)
            keys = [(adapter, prompt) for prompt in unique]  # unique: bytes, in u order
            if not want_prompt and all(k in self._first_logits for k in keys):
                # every prompt is in a running row's slot: its K/V are copied from there
                logits, layers, width = None, None, 0
                last = torch.stack([self._first_logits[k] for k in keys])
                self.reused += len(prompts)
            else:
                logits, layers, width = self._prefill(module, prompts, logits_to_keep(group))
                last = logits[:, -1, :].float()
            group_done, rows, expand = self._prepare(
                group, [tickets[j] for j in members],
                lambda u, n, all_=logits: prompt_rows(all_, u, n), sources,
            )  # fmt: skip
            done.extend(group_done)
            if rows:
                placed.append((rows, expand, prompts, layers, last, width, adapter, keys))
        self._loras.update(loras)
        for group in placed:
            self._place(*group)
        self._row_params()
        return done

    def _prefill(self, module, prompts, keep: int):
        """The HF forward over left-padded ``prompts``, logits for the last ``keep`` positions
        (0: all): (logits, per layer (K, V), width). Prompts that open alike (a document before
        several questions about it) prefill their common opening once (``prefix_groups``,
        ``_shared_prefill``); the groups' outputs are stacked back in ``prompts``' order."""
        parts = [
            (rows, self._shared_prefill(module, [prompts[u] for u in rows], keep, shared)
             if shared else self._plain_prefill(module, [prompts[u] for u in rows], keep))
            for rows, shared in prefix_groups(prompts, keep)
        ]  # fmt: skip
        if len(parts) == 1:
            return parts[0][1]
        return _stacked(parts, len(prompts))

    def _plain_prefill(self, module, prompts, keep: int):
        from transformers.cache_utils import DynamicCache

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(prompts), width, dtype=torch.long)
        for u, prompt in enumerate(prompts):
            input_ids[u, width - len(prompt) :] = torch.from_numpy(prompt)
            attention[u, width - len(prompt) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        out = module(
            input_ids=input_ids.to(dev),
            attention_mask=attention.to(dev),
            position_ids=positions.to(dev),
            past_key_values=DynamicCache(),
            logits_to_keep=keep,
        )
        self.prefills += len(prompts)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return out.logits, layers, width

    def _shared_prefill(self, module, prompts, keep: int, shared: int):
        """``_prefill`` with the prompts' first ``shared`` tokens run once: the prefix alone,
        then every prompt's rest (left-padded) over a copy of its K/V per row. The K/V come
        back laid out as ``_prefill``'s (each row's prompt the last of ``width`` positions)."""
        from transformers.cache_utils import DynamicCache

        dev, rows = self.device, len(prompts)
        head = torch.from_numpy(prompts[0][:shared]).unsqueeze(0).to(dev)
        cache = DynamicCache()
        module(
            input_ids=head,
            attention_mask=torch.ones_like(head),
            position_ids=torch.arange(shared, device=dev).unsqueeze(0),
            past_key_values=cache,
            logits_to_keep=1,
        )
        for layer in cache.layers:
            layer.keys = layer.keys.expand(rows, -1, -1, -1).contiguous()
            layer.values = layer.values.expand(rows, -1, -1, -1).contiguous()
        rests = [p[shared:] for p in prompts]
        rest_width = max(len(r) for r in rests)
        input_ids = torch.full((rows, rest_width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(rows, shared + rest_width, dtype=torch.long)
        attention[:, :shared] = 1
        for u, rest in enumerate(rests):
            input_ids[u, rest_width - len(rest) :] = torch.from_numpy(rest)
            attention[u, shared + rest_width - len(rest) :] = 1
        positions = shared + (attention[:, shared:].cumsum(-1) - 1).clamp(min=0)
        out = module(
            input_ids=input_ids.to(dev),
            attention_mask=attention.to(dev),
            position_ids=positions.to(dev),
            past_key_values=cache,
            logits_to_keep=keep,
        )
        self.prefills += rows
        self.shared_tokens += shared * (rows - 1)
        width = shared + rest_width
        layers = []
        for layer in out.past_key_values.layers:
            pair = []
            for t in (layer.keys, layer.values):
                laid = torch.zeros_like(t)  # [rows, heads, width, dim]: prefix next to its rest
                for u, rest in enumerate(rests):
                    pad = rest_width - len(rest)
                    laid[u, :, pad : pad + shared] = t[u, :, :shared]
                    laid[u, :, pad + shared :] = t[u, :, shared + pad :]
                pair.append(laid)
            layers.append(tuple(pair))
        return out.logits, layers, width

    def _place(self, rows, expand, prompts, layers, last_logits, width, adapter, keys) -> None:
        """Give ``rows`` free slots and copy their prompt's K/V into them: from the prefill's
        ``layers``, or (None) from the slot of a running row with the same ``keys`` entry."""
        lengths = [len(prompts[u]) for u in expand]
        need = max(n + 1 for n in lengths)
        if self.rows:
            need = max(need, int(self.positions[self.slots].max()) + 1)
        self._resize(len(self.rows) + len(rows), need)
        free = sorted(set(range(self.capacity)) - set(self.slots))
        for u, n, slot in zip(expand, lengths, free, strict=False):
            # Keys past a row's position are never attended to: what a freed slot left
            # there is overwritten before it is read. A row never writes below its prompt's
            # length, so a running row's slot still holds its prompt's K/V.
            if layers is None:
                source = self.slots[self.prompt_keys.index(keys[u])]
                for cache in (*self.keys, *self.values):
                    cache[slot, :, :n] = cache[source, :, :n]
            else:
                for (k, v), ks, vs in zip(layers, self.keys, self.values, strict=True):
                    ks[slot, :, :n] = k[u, :, width - n :]
                    vs[slot, :, :n] = v[u, :, width - n :]
            self.positions[slot] = n
            self.slots.append(slot)
            self.adapters.append(adapter)
            self.prompt_keys.append(keys[u])
            self._first_logits.setdefault(keys[u], last_logits[u])
        index = torch.tensor(expand, device=self.device)
        new_logits = last_logits[index]
        self._next_logits = (
            new_logits if self._next_logits is None else torch.cat([self._next_logits, new_logits])
        )
        self.rows.extend(rows)
        self._lora_args = None

    def _resize(self, rows: int, length: int, shrink: bool = False) -> None:
        """Slots for ``rows`` rows and room for positions below ``length`` (rounded up to
        ``LENGTH_STEP``); only ``shrink`` makes the length smaller. A compiled step runs a
        bucket of slots (a graph each), so its slots only grow but when ``shrink``; an eager
        one runs exactly ``rows`` slots. Within the allocation this is a view of its first
        slots; else the cache is reallocated (room for ``bucket(rows)`` rows) and the rows
        keep their K/V, packed into the first slots."""
        if length > self.max_length:
            raise ValueError(f"a row would pass the model's {self.max_length} positions")
        compiled = self.compiled.compiling
        capacity = bucket(rows) if compiled else rows
        length = min(-(-length // LENGTH_STEP) * LENGTH_STEP, self.max_length)
        if not shrink:
            length = max(length, self.length)
            capacity = max(capacity, self.capacity) if compiled else capacity
        if length == self.length and capacity <= self._store_rows and not shrink:
            self._use(capacity)
            return
        store_rows = capacity if compiled else bucket(rows)
        keys, values = self.step_module.new_cache(store_rows, length)
        count = len(self.slots)
        positions = torch.zeros(store_rows, dtype=torch.long, device=self.device)
        if count:
            old = torch.tensor(self.slots, device=self.device)
            keep = min(length, self.length)
            for new, cur in ((keys, self.keys), (values, self.values)):
                for n, c in zip(new, cur, strict=True):
                    n[:count, :, :keep] = c[old, :, :keep]
            positions[:count] = self.positions[old]
        self._store, self._store_rows = (keys, values, positions), store_rows
        self.slots, self.length = list(range(count)), length
        self._use(capacity)

    def _use(self, capacity: int) -> None:
        """The step runs on the allocation's first ``capacity`` slots (views)."""
        keys, values, positions = self._store
        self.keys = [k[:capacity] for k in keys]
        self.values = [v[:capacity] for v in values]
        self.positions = positions[:capacity]
        self.capacity = capacity
        self._lora_args = None

    def _compact(self) -> None:
        """Eager: rows in slots past the row count move (their K/V up to their position) into
        the free slots below it, and the step runs on just those: a finished row stops
        costing its share of every step, for the copy of a few rows' K/V."""
        count = len(self.slots)
        free = iter(sorted(set(range(count)) - set(self.slots)))
        for r, slot in enumerate(self.slots):
            if slot >= count:
                new, top = next(free), int(self.positions[slot])
                for cache in (*self.keys, *self.values):
                    cache[new, :, :top] = cache[slot, :, :top]
                self.positions[new] = self.positions[slot]
                self.slots[r] = new
        self._use(count)

    def _forward(self, chosen: torch.Tensor) -> None:
        slots = torch.tensor(self.slots, device=self.device)
        top = int(self.positions[slots].max())
        if top >= self.length:  # out of room: LENGTH_STEP more
            self._resize(len(self.rows), top + 1)
            slots = torch.tensor(self.slots, device=self.device)
        tokens = torch.zeros(self.capacity, dtype=torch.long, device=self.device)
        tokens[slots] = chosen
        logits = self.compiled(
            tokens, self.positions, self.keys, self.values, self._lora(), attend=top + 1
        )
        self.positions[slots] += 1
        self._next_logits = logits[slots]

    def _lora(self):
        """The step's LoRA argument for the current rows (None: all rows are the base's)."""
        if self._lora_args is not None:
            return self._lora_args[0]
        names = sorted({a for a in self.adapters if a is not None})
        if not names:
            self._lora_args = (None,)
            return None
        if names != self._stack_names:
            self._stack = LoraStack(self.step_module, [self._loras[n] for n in names])
            self._stack_names = names
        owner: list[int | None] = [None] * self.capacity
        for slot, adapter in zip(self.slots, self.adapters, strict=True):
            owner[slot] = -1 if adapter is None else names.index(adapter)
        self._lora_args = (self._stack.tensors(owner, self.device),)
        return self._lora_args[0]

    def _keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` stay and their slots are freed. An eager step then runs on
        just the rows' slots (``_compact``); a compiled one shrinks to a smaller bucket when
        at most a quarter are in use (a graph per bucket). A free slot still costs its share
        of a step: SmolLM2 bf16 at ~350 positions, rank-32 LoRA, took 71 / 54 / 46 / 40 ms a
        step at 16 / 8 / 4 / 2 slots, and an RL batch's rows end at different lengths
        (GSM8K: 146-195 tokens on average, 256 at most)."""
        self.rows = [self.rows[r] for r in keep]
        self.slots = [self.slots[r] for r in keep]
        self.adapters = [self.adapters[r] for r in keep]
        self.prompt_keys = [self.prompt_keys[r] for r in keep]
        live = set(self.prompt_keys)
        self._first_logits = {k: v for k, v in self._first_logits.items() if k in live}
        self._lora_args = None
        if not keep:
            self._next_logits = None
            self.keys, self.values, self.capacity, self.length = [], [], 0, 0
            self.positions = self.positions[:0]
            self._store, self._store_rows = None, 0
            return
        self._next_logits = self._next_logits[torch.tensor(keep, device=self.device)]
        if not self.compiled.compiling:
            self._compact()
        elif len(keep) <= self.capacity // 4:
            top = int(self.positions[self.slots].max())
            self._resize(len(keep), top + 1, shrink=True)
        self._row_params()

    def _row_params(self) -> None:
        if self.rows:
            super()._row_params()


__all__ = ["SlotBatch", "LoraStack", "ATTN", "MLP"]
