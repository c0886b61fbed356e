"""Hypernetworks hosted beside the base model: train them, save and load them, and turn a
document into a sampler adapter with one forward pass.

The engine's frozen base model does all the reading: with every adapter switched off it gives
the document's hidden states per layer (no gradient), ``hypernet.Hypernet`` makes a LoRA of
them, and for training the same base model runs the question and answer with that LoRA added
to each layer's down_proj by a forward hook, so the answer's cross-entropy reaches the
hypernetwork only (the base's weights have no gradient). What internalizing makes is an
ordinary peft LoRA written as a sampler checkpoint (``store/checkpoints.write_adapter``) and
put in the sampler cache, so ``asample``, ``/v1``, export and the rest serve it like any
adapter.

A hypernetwork checkpoint is its own kind of folder, ``<id>/hypernet_weights/<name>``
(``hypernet.safetensors`` + ``hypernet.json``: the config, whose ``base_model`` binds it), and
is written through ``checkpoints.write_files``, so invariant 3 holds for it too.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcli.server.engine.hypernet import (
    Hypernet,
    HypernetConfig,
    lora_delta,
    merge_chunks,
    merge_documents,
    parameter_count,
)
from rlcli.server.errors import UserError
from rlcli.server.store import checkpoints

WEIGHTS_FILE, CONFIG_FILE = "hypernet.safetensors", "hypernet.json"
KIND = "hypernet_weights"
MAX_LOADED = 4  # hypernetworks read from checkpoints, kept loaded for internalizing (LRU)
# A training step keeps every chunk's hidden states (float32) for the backward pass: a batch
# of 8 documents of 8 chunks on SmolLM2's 30 layers is 4.5 GB. Above this, refused.
MAX_STEP_FEATURE_BYTES = 4 << 30
TARGET = "down_proj"
# A training split's shortest piece, in tokens (the reference's ``min_ctx_chunk_len``).
MIN_SPLIT_TOKENS = 25


@dataclass
class Hosted:
    net: Hypernet
    optimizer: torch.optim.Optimizer | None  # None: loaded to internalize only
    steps: int = 0


def is_hypernet(version: Path) -> bool:
    return (Path(version) / CONFIG_FILE).is_file()


class Hypernets:
    """The engine's hypernetworks: training ones by id, checkpoints loaded to internalize."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.training: dict[str, Hosted] = {}
        self.loaded: OrderedDict[str, Hypernet] = OrderedDict()  # version folder -> net

    # ---- the base model's shapes ------------------------------------------------------------
    def _layers(self):
        return self.engine.model.model.layers

    def shape(self, lora_layers: int = 0) -> dict[str, int]:
        """The base model's sizes; the LoRA on its last ``lora_layers`` layers (0: all). Fewer
        layers make training cheaper: the backward pass stops below the first adapted one."""
        config = self.engine.model.config
        total = int(config.num_hidden_layers)
        n = total if not lora_layers else min(lora_layers, total)
        return {
            "n_layers": n,
            "first_layer": total - n,
            "hidden": int(config.hidden_size),
            "d_in": int(config.intermediate_size),
        }

    # ---- training ---------------------------------------------------------------------------
    def create(self, hypernet_id: str, settings: dict[str, Any], seed: int | None) -> dict:
        if hypernet_id in self.training:
            raise UserError(f"hypernet_id {hypernet_id!r} already exists")
        settings = dict(settings)
        shape = self.shape(int(settings.pop("lora_layers", 0) or 0))
        config = HypernetConfig(base_model=self.engine.base_model, **shape, **settings)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if seed is not None else time.time_ns() % 2**31)
            net = Hypernet(config).to(self.engine.device)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
        self.training[hypernet_id] = Hosted(net, optimizer)
        return {"hypernet_id": hypernet_id, "params": parameter_count(net), **config.to_dict()}

    def remove(self, hypernet_id: str) -> dict:
        self._training(hypernet_id)
        del self.training[hypernet_id]
        return {"hypernet_id": hypernet_id}

    def step(
        self, hypernet_id: str, examples: list[dict], lr: float, l1: float, train: bool
    ) -> dict:
        """One step on (document, question, answer) examples: the answers' mean cross-entropy
        with each row's document internalized (and an optimizer step when ``train``). A
        document of several chunks trains as it is internalized, its chunks' LoRAs summed, so
        the hypernetwork learns what a haystack's filler chunks should add: little."""
        hosted = self._training(hypernet_id)
        net = hosted.net
        started = time.perf_counter()
        docs = [
            self._document_ids(e["document"], net.config, "examples", e.get("chunks"))
            for e in examples
        ]
        pairs = [(c, i) for i, doc in enumerate(docs) for c in doc]  # (chunk, its document)
        size = len(pairs) * net.config.n_layers * net.config.hidden * 4
        size *= max(len(c) for c, _ in pairs)
        if size > MAX_STEP_FEATURE_BYTES:
            raise UserError(
                f"examples: {len(examples)} documents of {len(pairs)} chunks in all; their hidden "
                f"states would take {size / 2**30:.1f} GiB (at most {MAX_STEP_FEATURE_BYTES >> 30}"
                "): fewer examples a step or shorter documents"
            )
        pairs.sort(key=lambda p: -len(p[0]))  # longest first: _features pads a run at most 2x
        chunks, owners = [c for c, _ in pairs], [i for _, i in pairs]
        first = net.config.first_layer
        features, mask = self._features(chunks, first)
        net.train(train)
        with torch.set_grad_enabled(train):
            a, b = net(features, mask)
            a, b = a.float(), b.float()
            penalty = net.weight_l1(a, b)
            a, b = merge_documents(a, b, owners, net.bias())  # as generate() merges them
            ce, tokens = self._answer_loss(examples, a, b, net.scaling, first)
            loss = ce + l1 * penalty
        if train:
            for group in hosted.optimizer.param_groups:
                group["lr"] = lr
            hosted.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in net.parameters() if p.grad is not None]
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                hosted.optimizer.zero_grad(set_to_none=True)  # invariant 1: nothing non-finite
                raise UserError("the step's gradients are not finite; nothing was applied")
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            hosted.optimizer.step()
            hosted.steps += 1
        else:
            norm = torch.tensor(0.0)
        net.eval()
        return {
            "loss": float(ce.detach()),
            "l1": float(penalty.detach()),
            "grad_norm": float(norm),
            "answer_tokens": tokens,
            "chunks": len(pairs),  # the documents' chunks read (split ones: their pieces)
            "steps": hosted.steps,
            "seconds": time.perf_counter() - started,
        }

    def _answer_loss(self, examples: list[dict], a, b, scale, first) -> tuple[torch.Tensor, int]:
        """The answers' mean cross-entropy with each row's LoRA on; the output layer runs on
        the answer positions only (SmolLM2's 49k-word head on every token was half a step)."""
        rows = [self._qa_ids(e["question"], e["answer"]) for e in examples]
        width = max(len(ids) for ids, _ in rows)
        pad = self.engine.pad_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        targets = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (seq, start) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            targets[i, start - 1 : len(seq) - 1] = torch.tensor(seq[start:])
        device = self.engine.device
        with self._lora(a, b, scale, first):
            hidden = self.engine.model.model(
                input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False
            ).last_hidden_state  # one pass, no K/V cache to keep
        where = (targets != -100).to(device)
        head = self.engine.model.get_output_embeddings()
        logits = head(hidden[where]).float()
        ce = torch.nn.functional.cross_entropy(logits, targets.to(device)[where])
        return ce, int(where.sum())

    def _lora(self, a: torch.Tensor, b: torch.Tensor, scale: float, first: int):
        """A context in which the base model's down_proj of layer i adds row j's LoRA
        (``a[j, i]``, ``b[j, i]``) to row j of the batch."""
        import contextlib

        self.engine._activate(None)  # every adapter off: the base model
        layers = self._layers()[first : first + a.shape[1]]

        def hook(i):
            def add(module, inputs, output):
                return output + lora_delta(inputs[0], a[:, i], b[:, i], scale).to(output.dtype)

            return add

        def plain(module, inputs, output):
            """The embeddings without grad: the engine's model makes them require it
            (transformers' ``enable_input_require_grads``, for its LoRA training), so the
            question's pass built a graph through every layer and the backward ran it all
            (a SmolLM2 step with the last 4 of 30 layers adapted: 1.39 s; 0.69 s without).
            Without it, the graph starts at the first adapted layer's LoRA. (Detaching at
            that layer instead left the graph below it unreachable but alive: 0.3 GB a
            step.) Runs after that hook, registered after it."""
            return output.detach()

        @contextlib.contextmanager
        def hooked():
            handles = [
                getattr(layer.mlp, TARGET).register_forward_hook(hook(i))
                for i, layer in enumerate(layers)
            ]
            embed = self.engine.model.get_input_embeddings()
            handles.append(embed.register_forward_hook(plain))
            try:
                yield
            finally:
                for h in handles:
                    h.remove()

        return hooked()

    # ---- reading a document -------------------------------------------------------------------
    def _document_ids(
        self, text: str, config: HypernetConfig, field: str, pieces: int | None = None
    ) -> list[list[int]]:
        """The document's tokens in chunks of at most ``chunk_tokens``; refused when empty or
        longer than ``max_chunks`` chunks. ``pieces`` (training): ``split_ids`` instead."""
        ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise UserError(f"{field}: the document has no tokens")
        size = config.chunk_tokens
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        if len(chunks) > config.max_chunks:
            raise UserError(
                f"{field}: the document has {len(ids)} tokens, {len(chunks)} chunks of "
                f"{size}; this hypernetwork takes at most {config.max_chunks} "
                f"({config.max_chunks * size} tokens)"
            )
        return split_ids(ids, pieces, config) if pieces else chunks

    def _qa_ids(self, question: str, answer: str) -> tuple[list[int], int]:
        """The question as a chat prompt, then the answer and the end of turn: (tokens, where
        the answer starts). The same rendering ``/v1`` and the chat_template renderer use."""
        tok = self.engine.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
        end = self.engine.eos_ids[-1:] if answer_ids else []
        from rlcli.models.tokenizer import end_of_turn_id

        turn = end_of_turn_id(tok)
        end = [turn] if turn is not None else end
        return prompt_ids + answer_ids + end, len(prompt_ids)

    @torch.no_grad()
    def _features(
        self, chunks: list[list[int]], first: int, by_length: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapted layers' (from ``first`` on) output states of each chunk, from the
        frozen base model: ([chunks, layers, tokens, hidden] float32, mask [chunks, tokens];
        past a chunk's end they are zeros or the padding's, masked either way). The last
        layer's are after the final norm, as transformers' ``hidden_states`` give them.

        Only the decoder runs (``model.model``: no output layer, so no logits; the
        hypernetwork reads up to the top layer, so every layer is needed), without a K/V
        cache. ``by_length`` (one document's chunks: all full but the last) runs each run of
        chunks of one length together, unpadded and without an attention mask; else (a
        training batch's chunks, longest first) a padded batch per run of chunks at least half
        as long as the run's first, so padding at most doubles a chunk. On SmolLM2 the forward
        is ~97% of an internalization: its matmuls and attention (docs/d2l.md, "Measured")."""
        self.engine._activate(None)
        device = self.engine.device
        config = self.engine.model.config
        width = max(len(c) for c in chunks)
        n_layers = int(config.num_hidden_layers) - first
        states = torch.empty((len(chunks), n_layers, width, int(config.hidden_size)), device=device)
        mask = torch.zeros((len(chunks), width), dtype=torch.long)
        for i, chunk in enumerate(chunks):
            mask[i, : len(chunk)] = 1
        # runs of consecutive chunks: of one length each (by_length), else of lengths within 2x
        runs, start = [], 0
        for i in range(1, len(chunks) + 1):
            if i == len(chunks) or (
                len(chunks[i]) != len(chunks[start])
                if by_length
                else 2 * len(chunks[i]) < len(chunks[start])
            ):
                runs.append(range(start, i))
                start = i
        for rows in runs:
            at = slice(rows.start, rows.stop)  # a plain copy into states, not a scatter
            t = max(len(chunks[i]) for i in rows)
            ids = torch.full((len(rows), t), self.engine.pad_id, dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : len(chunks[i])] = torch.tensor(chunks[i])
            padded = bool((mask[at, :t] == 0).any())
            out = self.engine.model.model(
                input_ids=ids.to(device),
                attention_mask=mask[at, :t].to(device) if padded else None,
                output_hidden_states=True,
                use_cache=False,  # nothing is decoded after it: no K/V cache to build
            )
            for j, h in enumerate(out.hidden_states[1 + first :]):
                states[at, j, :t] = h.float()
            if t < width:
                states[at, :, t:] = 0.0
            del out
        return states, mask.to(device)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, hypernet_id: str, directory: str, meta: dict) -> dict:
        from safetensors.torch import save_file

        hosted = self._training(hypernet_id)
        staging = checkpoints.staging_dir(Path(directory).parents[2]) / f"hn-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        try:
            state = {k: v.detach().cpu().contiguous() for k, v in hosted.net.state_dict().items()}
            save_file(state, staging / WEIGHTS_FILE)
            record = {"config": hosted.net.config.to_dict(), "steps": hosted.steps}
            (staging / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
            optimizer = staging / "optimizer.pt"
            torch.save(hosted.optimizer.state_dict(), optimizer)
            version = checkpoints.write_files(
                directory,
                {WEIGHTS_FILE: staging / WEIGHTS_FILE, CONFIG_FILE: staging / CONFIG_FILE,
                 "optimizer.pt": optimizer},
                {**meta, "steps": hosted.steps},
            )  # fmt: skip
        finally:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
        return {"path": meta["tinker_path"], "size_bytes": checkpoints.folder_size(version)}

    def _read(self, directory: str, path: str) -> tuple[Path, Hypernet, dict]:
        """The checkpoint's version, its net (on the engine's device) and its record; a
        checkpoint of another kind or of another base model is refused, naming both."""
        from safetensors.torch import load_file

        version = checkpoints.resolve(Path(directory))
        if version is None:
            raise UserError(f"hypernet: no hypernetwork checkpoint at {path}")
        if not is_hypernet(version):
            raise UserError(f"hypernet: {path} is a LoRA adapter, not a hypernetwork")
        record = json.loads((version / CONFIG_FILE).read_text())
        config = HypernetConfig.from_dict(record["config"])
        if (
            config.base_model != self.engine.base_model
            or config.first_layer + config.n_layers != self.shape()["n_layers"]
        ):
            raise UserError(
                f"hypernet: {path} was trained on {config.base_model}; this server's base model "
                f"is {self.engine.base_model}"
            )
        net = Hypernet(config)
        net.load_state_dict(load_file(version / WEIGHTS_FILE, device="cpu"))
        return version, net.to(self.engine.device).eval(), record

    def load(self, hypernet_id: str, directory: str, path: str, optimizer: bool) -> dict:
        """A training hypernetwork from a checkpoint (a resume)."""
        if hypernet_id in self.training:
            raise UserError(f"hypernet_id {hypernet_id!r} already exists")
        version, net, record = self._read(directory, path)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
        if optimizer and (version / "optimizer.pt").exists():
            opt.load_state_dict(torch.load(version / "optimizer.pt", weights_only=True))
        self.training[hypernet_id] = Hosted(net, opt, int(record.get("steps", 0)))
        return {"hypernet_id": hypernet_id, "steps": int(record.get("steps", 0))}

    def _net_of(self, directory: str, path: str) -> Hypernet:
        version = checkpoints.resolve(Path(directory))
        key = str(version)
        if version is not None and key in self.loaded:
            self.loaded.move_to_end(key)
            return self.loaded[key]
        version, net, _ = self._read(directory, path)
        self.loaded[str(version)] = net
        while len(self.loaded) > MAX_LOADED:
            self.loaded.popitem(last=False)
        return net

    # ---- internalizing ------------------------------------------------------------------------
    def generate(self, net: Hypernet, document: str) -> tuple[dict, Any, dict]:
        """A document -> (peft state dict, LoraConfig, facts) of its adapter: one forward pass
        of the base model over its chunks, one of the hypernetwork."""
        from peft import LoraConfig

        started = time.perf_counter()
        chunks = self._document_ids(document, net.config, "document")
        with torch.no_grad():
            read = time.perf_counter()
            features, mask = self._features(chunks, net.config.first_layer, by_length=True)
            made = time.perf_counter()
            a, b = merge_chunks(*net(features, mask), net.bias())
            done = time.perf_counter()
        rank = a.shape[1]
        # The scale is folded into B (alpha = rank: peft's scale is 1), so the chunks' summed
        # updates each keep the hypernetwork's alpha / r.
        b = b * net.scaling
        state = {}
        for i in range(net.config.n_layers):
            prefix = f"base_model.model.model.layers.{net.config.first_layer + i}.mlp.{TARGET}"
            state[f"{prefix}.lora_A.weight"] = a[i].float().cpu().contiguous()
            state[f"{prefix}.lora_B.weight"] = b[i].T.float().cpu().contiguous()
        layers = list(range(net.config.first_layer, net.config.first_layer + net.config.n_layers))
        config = LoraConfig(
            r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=[TARGET],
            layers_to_transform=None if net.config.first_layer == 0 else layers,
        )  # fmt: skip
        facts = {
            "tokens": sum(len(c) for c in chunks),
            "chunks": len(chunks),
            "rank": rank,
            "seconds": time.perf_counter() - started,
            "forward_seconds": made - read,  # the base model over the chunks
            "hypernet_seconds": done - made,
        }
        return state, config, facts

    def internalize(
        self, hypernet_id: str | None, directory: str | None, path: str, document: str,
        target: str, meta: dict,
    ) -> dict:  # fmt: skip
        """Make the document's adapter and save it as sampler checkpoint ``target``, kept in
        the sampler cache; a training hypernetwork (``hypernet_id``) or a checkpoint."""
        started = time.perf_counter()
        if hypernet_id is not None:
            net = self._training(hypernet_id).net
        else:
            net = self._net_of(directory or "", path)
        state, config, facts = self.generate(net, document)
        version = checkpoints.write_adapter(
            target, state, config, self.engine.base_model, meta={**meta, **facts}
        )
        self.engine.samplers.put(target, config, state, str(version))
        return {
            "path": meta["tinker_path"],
            **facts,
            "total_seconds": time.perf_counter() - started,
        }

    def _training(self, hypernet_id: str) -> Hosted:
        hosted = self.training.get(hypernet_id)
        if hosted is None:
            raise UserError(f"unknown hypernet_id {hypernet_id!r}")
        return hosted


def split_ids(ids: list[int], pieces: int, config: HypernetConfig) -> list[list[int]]:
    """A training document's tokens as ``pieces`` runs of about equal length: the reference's
    training split (``split_too_long_ctx``: a chunk count drawn per document, equal parts), so
    a document read as one chunk and as eight must give the same answer, and the LoRAs of a
    haystack's filler chunks learn to add little. As many pieces as ``chunk_tokens`` needs at
    least; at most ``max_chunks``, and none shorter than ``MIN_SPLIT_TOKENS`` (one piece
    when the document is shorter than two)."""
    least = math.ceil(len(ids) / config.chunk_tokens)
    n = max(least, min(pieces, config.max_chunks, len(ids) // MIN_SPLIT_TOKENS))
    per = math.ceil(len(ids) / n)
    return [ids[i : i + per] for i in range(0, len(ids), per)]
