"""``train opsd``'s seams in the cookbook's on-policy distillation: the prompts dataset and the
teacher clients (the hint, a teacher on another server, SkyRL's short logprob lists)."""

from __future__ import annotations

# ---- On-policy distillation (train opsd) -----------------------------------------------------
#
# tinker-cookbook 0.5.7 ``distillation/train_on_policy.py``: ``prepare_minibatch`` calls the
# module-level ``incorporate_kl_penalty(data_D, teacher_clients_D, dataset_indices_D,
# kl_penalty_coef, kl_discount_factor)``, which asks each datum's teacher client for
# ``compute_logprobs_async(model_input + last target)`` (the student's prompt and sampled
# tokens) and reads ``teacher_logprobs[1:]`` against the sampled logprobs, one value per
# token. That call is the seam: rlcli swaps each teacher client for a ``Teacher`` (the hint,
# a teacher on another server, SkyRL's short answers), and copies none of the recipe's setup.
# tests/test_compat.py checks the seam is still there.


def prompts_dataset(prompts: list[dict], batch_size: int, group_size: int, renderer, tokenizer):
    """The cookbook's ``PromptOnlyDataset`` (no reward; the teacher's KL is the signal), with
    each prompt's own context turns (``{"prompt", "context"}`` rows) instead of one prefix for
    all. Relies on ``PromptOnlyEnv(prompt, renderer, convo_prefix=...)`` and
    ``ProblemGroupBuilder(env_thunk, num_envs, dataset_name)``."""
    from functools import partial

    from tinker_cookbook.distillation.datasets import PromptOnlyDataset, PromptOnlyEnv
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    class _PromptsWithContext(PromptOnlyDataset):
        def get_batch(self, index: int):
            rows = prompts[index * self.batch_size : (index + 1) * self.batch_size]
            assert rows, "batch index past the end of the prompts"
            return [
                ProblemGroupBuilder(
                    env_thunk=partial(
                        PromptOnlyEnv, row["prompt"], self.renderer, convo_prefix=row["context"]
                    ),
                    num_envs=self.group_size,
                    dataset_name=self.dataset_name,
                )
                for row in rows
            ]

    return _PromptsWithContext(
        prompts=[p["prompt"] for p in prompts],
        batch_size=batch_size,
        group_size=group_size,
        renderer=renderer,
        tokenizer=tokenizer,
        max_prompt_tokens=None,
    )


def align_prompt_logprobs(values: list, tokens: int) -> list:
    """One logprob per token, the first None: SkyRL 0.4.0 answered ``compute_logprobs`` with one
    value fewer than tokens (none for the first), which the recipe's ``[1:]`` would misalign."""
    values = list(values)
    if len(values) == tokens - 1:
        values = [None, *values]
    if len(values) != tokens:
        raise RuntimeError(
            f"the teacher's server returned {len(values)} logprobs for {tokens} tokens"
        )
    return values


class Teacher:
    """A teacher sampling client as the distillation recipe uses it (``compute_logprobs_async``
    only). With ``hinted`` (the student's rendered prompt -> the teacher's rendered prompt with
    the hint), the teacher scores hint + prompt + the student's answer, and the answer's
    logprobs are returned at the student's positions (the prompt's, which the recipe masks out,
    as 0.0)."""

    def __init__(self, client, hinted: dict[tuple[int, ...], list[int]] | None = None) -> None:
        self.client, self.hinted = client, hinted
        self.lengths = sorted({len(k) for k in hinted or {}}, reverse=True)

    async def compute_logprobs_async(self, sequence):
        """What the recipe calls; the SDK's own ``compute_logprobs`` does the work."""
        import tinker

        if isinstance(self.client, tinker.APIFuture):  # tinker 0.38: the recipe's client is
            self.client = await self.client  # a future of it, deprecated as the client itself
        tokens = sequence.to_ints()
        if not self.hinted:
            return align_prompt_logprobs(await self.client.compute_logprobs(sequence), len(tokens))
        prompt_len, teacher_prompt = self._match(tokens)
        teacher_tokens = [*teacher_prompt, *tokens[prompt_len:]]
        scored = align_prompt_logprobs(
            await self.client.compute_logprobs(tinker.ModelInput.from_ints(teacher_tokens)),
            len(teacher_tokens),
        )
        return [None, *[0.0] * (prompt_len - 1), *scored[len(teacher_prompt) :]]

    def _match(self, tokens: list[int]) -> tuple[int, list[int]]:
        """The longest known prompt the sequence starts with."""
        for length in self.lengths:
            found = self.hinted.get(tuple(tokens[:length]))  # type: ignore[union-attr]
            if found is not None:
                return length, found
        raise RuntimeError("--teacher-hint: a sampled sequence starts with none of the prompts")


# The recipe logs ``teacher_kl``, the mean of log p - log q over the student's sampled tokens
# (p the student, q the teacher): the "k1" estimate of KL(p || q), unbiased but negative on a
# batch where the teacher happens to like the samples more than the student does (-0.003 read
# as a bug). rlcli logs beside it the "k3" estimate of the same KL, mean (r - 1) - log r with
# r = q / p: also unbiased under the student's samples, and never negative per token
# (Schulman, "Approximating KL divergence", 2020). The progress line and the summary show k3.
TEACHER_KL_K3 = "rlcli/teacher_kl_k3"


class _Recorded:
    """One datum's teacher, remembering the logprobs it returned (the recipe keeps them)."""

    def __init__(self, teacher) -> None:
        self.teacher, self.values = teacher, None

    async def compute_logprobs_async(self, sequence):
        self.values = await self.teacher.compute_logprobs_async(sequence)
        return self.values


def kl_k3(data_D, teacher_logprobs_D) -> float:
    """Mean over the student's sampled tokens (the recipe's mask) of exp(d) - 1 - d, with
    d = log q - log p: teacher logprob minus the student's sampled logprob."""
    import torch

    total, count = 0.0, 0.0
    for datum, teacher in zip(data_D, teacher_logprobs_D, strict=True):
        sampled = datum.loss_fn_inputs["logprobs"].to_torch().double()
        mask = datum.loss_fn_inputs["mask"].to_torch().double()
        scored = torch.tensor([v or 0.0 for v in teacher[1:]], dtype=torch.float64)
        d = (scored - sampled) * mask  # masked tokens: d = 0, so their term is 0
        total += float((torch.expm1(d) - d).sum())
        count += float(mask.sum())
    return total / count if count else 0.0


def score_teachers_with(teacher_for) -> None:
    """Make the distillation recipe score with ``teacher_for(teacher_client)`` instead of the
    teacher client it built (see the comment above), and log ``TEACHER_KL_K3`` beside its
    ``teacher_kl``."""
    from tinker_cookbook.distillation import train_on_policy

    original = train_on_policy.incorporate_kl_penalty

    async def incorporate_kl_penalty(data_D, teacher_clients_D, *args, **kwargs):
        teachers = [_Recorded(teacher_for(client)) for client in teacher_clients_D]
        metrics = await original(data_D, teachers, *args, **kwargs)
        metrics[TEACHER_KL_K3] = kl_k3(data_D, [t.values for t in teachers])
        return metrics

    train_on_policy.incorporate_kl_penalty = incorporate_kl_penalty
