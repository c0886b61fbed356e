"""Context distillation through the Tinker API: the teacher's answers as top-K targets, the
datums that train a LoRA toward them, and the scoring of answers (``rlcli internalize``).

The teacher is a sampling client that sees a chunk of the document before the question; the
student sees the question alone. For each training probe:

- with a reference answer (and ``targets`` "auto"), the teacher is scored on the reference,
  teacher-forced (``topk_prompt_logprobs``), and each answer token's target is
  ``w * onehot(reference) + (1 - w) * teacher's top-K`` (renormalised), so where the teacher
  disagrees the reference wins (``w`` >= 0.5); "reference" is the one-hot alone;
- without one (or with ``targets`` "teacher"), the teacher answers greedily and its own tokens,
  with their top-K distributions (``topk_sample_logprobs``), are the targets.

A target row is K token ids and K weights; ``cross_entropy`` with ``[T, K]`` target tokens and
weights is then the top-K forward KL of Snell et al. (2022) up to a constant (the reference
design: SakanaAI/doc-to-lora, ``modeling/context_distillation.py``). Rows are plain JSON so a
resumed run reads them back instead of asking the teacher again.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TEACHER_TEMPLATE = "{document}\n\n{question}"  # what the teacher's user turn holds
GREEDY = 1e-4  # a temperature the Tinker API accepts and that samples the top token


@dataclass
class Renderer:
    """The chat renderer the student and teacher share, as token lists."""

    renderer: object

    def prompt(self, question: str, document: str | None = None) -> list[int]:
        text = question if document is None else teacher_text(document, question)
        return self.renderer.build_generation_prompt([{"role": "user", "content": text}]).to_ints()

    def completion(self, question: str, answer: str) -> list[int]:
        """The tokens the assistant turn adds after the generation prompt (the end token too)."""
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        model_input, weights = self.renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        prompt = self.prompt(question)
        if tokens[: len(prompt)] == prompt:
            return tokens[len(prompt) :]
        first = next(i for i, w in enumerate(weights.tolist()) if w > 0)
        return tokens[first:]

    def stop(self):
        return self.renderer.get_stop_sequences()


def teacher_text(document: str, question: str) -> str:
    return TEACHER_TEMPLATE.format(document=document, question=question)


def _row(pairs, k: int) -> tuple[list[int], list[float]]:
    """Top-K (token, logprob) pairs as K ids and K probabilities summing to 1."""
    pairs = sorted(pairs, key=lambda p: -p[1])[:k]
    probs = [math.exp(lp) for _, lp in pairs]
    total = sum(probs) or 1.0
    return [int(t) for t, _ in pairs], [p / total for p in probs]


def mix(ids: list[int], probs: list[float], reference: int, weight: float, k: int):
    """``weight`` on the reference token plus ``1 - weight`` of the teacher's distribution,
    in K columns (the reference takes the last column when the teacher's top-K lacks it)."""
    table = {t: (1 - weight) * p for t, p in zip(ids, probs, strict=True)}
    if reference not in table and len(table) >= k:
        dropped = min(table, key=table.get)
        del table[dropped]
        total = sum(table.values()) or 1.0
        table = {t: v * (1 - weight) / total for t, v in table.items()}
    table[reference] = table.get(reference, 0.0) + weight
    return list(table), list(table.values())


def padded(ids: list[int], weights: list[float], k: int) -> tuple[list[int], list[float]]:
    fill = k - len(ids)
    return ids + [ids[0]] * fill, weights + [0.0] * fill


async def teacher_row(
    teacher, render: Renderer, probe: dict, document: str, k: int, targets: str,
    reference_weight: float, max_tokens: int,
) -> dict:  # fmt: skip
    """One training row: the student's prompt, the answer tokens, and per answer token K target
    ids and weights (see the module docstring)."""
    import tinker

    question, reference = probe["question"], probe.get("answer")
    student = render.prompt(question)
    teacher_prompt = render.prompt(question, document)
    if reference and targets != "teacher":
        answer = render.completion(question, reference)
        if targets == "reference":
            rows = [([t], [1.0]) for t in answer]
        else:
            sequence = tinker.ModelInput.from_ints(teacher_prompt + answer)
            response = await teacher.sample(
                prompt=sequence,
                num_samples=1,
                sampling_params=tinker.SamplingParams(max_tokens=1, temperature=GREEDY),
                include_prompt_logprobs=True,
                topk_prompt_logprobs=k,
                prompt_logprobs_last_n=len(answer),
            )
            top = response.topk_prompt_logprobs[len(teacher_prompt) :]
            rows = [
                mix(*_row(pairs or [(token, 0.0)], k), token, reference_weight, k)
                for pairs, token in zip(top, answer, strict=True)
            ]
        kind = "reference" if targets == "reference" else "reference+teacher"
    else:
        response = await teacher.sample(
            prompt=tinker.ModelInput.from_ints(teacher_prompt),
            num_samples=1,
            sampling_params=tinker.SamplingParams(
                max_tokens=max_tokens, temperature=GREEDY, stop=render.stop()
            ),
            topk_sample_logprobs=k,
        )
        sequence = response.sequences[0]
        answer = list(sequence.tokens)
        rows = [
            _row(pairs or [(t, 0.0)], k)
            for pairs, t in zip(sequence.topk_logprobs, answer, strict=True)
        ]
        kind = "teacher"
    ids, weights = zip(*(padded(list(i), list(w), k) for i, w in rows), strict=True)
    return {
        "question": question,
        "prompt": student,
        "answer": answer,
        "target_ids": [list(r) for r in ids],
        "target_weights": [list(r) for r in weights],
        "targets": kind,
    }


def datum(row: dict):
    """A training datum of ``row``: the prompt and answer, with ``[T, K]`` target tokens and
    weights (zero on the prompt)."""
    import numpy as np
    import tinker

    tokens = row["prompt"] + row["answer"]
    k = len(row["target_ids"][0])
    n = len(tokens) - 1
    ids = np.zeros((n, k), dtype=np.int64)
    weights = np.zeros((n, k), dtype=np.float32)
    start = len(row["prompt"]) - 1  # position i predicts token i + 1
    for j, (t, w) in enumerate(zip(row["target_ids"], row["target_weights"], strict=True)):
        ids[start + j] = t
        weights[start + j] = w
    ids[:start] = np.array(tokens[1 : start + 1], dtype=np.int64)[:, None]
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(ids),
            "weights": tinker.TensorData.from_numpy(weights),
        },
    )


async def answer(client, render: Renderer, question: str, document: str | None, max_tokens: int):
    """The client's greedy answer to ``question`` (with ``document`` before it, or none)."""
    import tinker

    response = await client.sample(
        prompt=tinker.ModelInput.from_ints(render.prompt(question, document)),
        num_samples=1,
        sampling_params=tinker.SamplingParams(
            max_tokens=max_tokens, temperature=GREEDY, stop=render.stop()
        ),
    )
    return render.renderer.parse_response(response.sequences[0].tokens)[0]["content"]


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def correct(response: str, probe: dict, in_context: str | None) -> bool:
    """Right by the probe's reference (its ``check``, else ``answer``, found in the response),
    else by agreeing with the in-context answer (one contains the other)."""
    said = normalize(response if isinstance(response, str) else str(response))
    expected = probe.get("check") or probe.get("answer")
    if expected:
        return bool(normalize(expected)) and f" {normalize(expected)} " in f" {said} "
    reference = normalize(in_context or "")
    return bool(reference and said) and (reference in said or said in reference)
