"""What one sample request asks of the engine, and what it answers: plain records with no torch,
so the HTTP process builds and reads them without loading the model's code."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    stop_at_eos: bool = True  # False: a tinker>=0.38 `stop=[]`, no stop at all
    # tinker>=0.38 extras, all from the one prefill (prompt) or decode (samples) pass:
    prompt_logprobs_last_n: int | None = None  # score only the last N prompt tokens
    topk_sample_logprobs: int = 0  # top-k logprobs at every sampled token
    target_prompt: np.ndarray | None = None  # int64 [N - 1, K] token ids, -1: nothing asked
    target_sparse: tuple[np.ndarray, np.ndarray] | None = None  # the request's CSR layout
    prompt_alt_k: int = 0  # draws per prompt position at the request's temperature
    stream: bool = False  # report each drawn token as it is drawn (DecodeBatch.partials)

    @property
    def wants_prompt(self) -> bool:
        return bool(
            self.prompt_logprobs or self.topk_prompt_logprobs or self.prompt_alt_k
            or self.target_prompt is not None
        )  # fmt: skip


@dataclass
class SampleOutput:
    sequences: list[tuple[np.ndarray, np.ndarray, str]]  # (tokens int32, logprobs f32, reason)
    prompt_logprobs: np.ndarray | None = None  # float32 [N], NaN first
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None  # ([N, k] int32, [N, k] f32)
    # Per sequence, ([T, k] int32, [T, k] f32): topk_sample_logprobs.
    topk_sampled: list[tuple[np.ndarray, np.ndarray]] | None = None
    target_prompt: np.ndarray | None = None  # float32 [N - 1, K], 0.0 where nothing was asked
    target_layout: tuple[np.ndarray, np.ndarray] | None = None  # answered sparse, like asked
    prompt_alt: tuple[np.ndarray, np.ndarray] | None = None  # ([N - 1, k] int32, f32)
