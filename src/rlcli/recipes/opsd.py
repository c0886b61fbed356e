"""On-policy self-distillation from a prompts file: rlcli's layer over the cookbook's
``distillation.train_on_policy``.

The student samples answers to the prompts; a teacher (by default the student's own base model,
optionally seeing a ``--teacher-hint`` the student never sees) scores the student's tokens, and
the negative reverse KL is each token's advantage for an ``importance_sampling`` update. No
reward is needed. ``prepare`` validates the prompts and plans without a server; ``check_server``
checks the student's and the teacher's servers; ``run_in_child`` runs the recipe with the
teacher seam of ``distill.score_teachers_with`` (the hint, a teacher on another server, SkyRL's
short logprob lists). The pedagogical version of the loop is the cookbook's
``recipes/distillation/on_policy_distillation.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rlcli.client import endpoint
from rlcli.compat import distill
from rlcli.compat.renderer_choice import resolve_renderer
from rlcli.data.prompts import read_prompts, shuffled_prompts
from rlcli.errors import RlcliError
from rlcli.flags import option, retune
from rlcli.recipes import base, loss_guard, preflight
from rlcli.recipes.base import Plan, Recipe
from rlcli.recipes.options import PolicyOptions, TrainOptions
from rlcli.recipes.preflight import check_model_arg, check_renderer
from rlcli.recipes.rl import check_policy_server, parse_loss_config, seed_sampling
from rlcli.runs.runner import metric_values

DATASET_FILE = "prompts.jsonl"  # stdin's prompts, kept in the run folder
HINT_SEPARATOR = "\n\n"  # the teacher sees: hint, blank line, prompt
TEACHER_KL = "teacher_kl"  # the cookbook's per-step mean of log p - log q: can be negative
TEACHER_KL_K3 = distill.TEACHER_KL_K3  # the same KL estimated so it never is (shown as "kl")
SAMPLED_TOKENS = "env/all/total_ac_tokens"


@dataclass(kw_only=True)
class OpsdOptions(PolicyOptions):
    dataset: str = option(help="Prompts JSONL ({'prompt'} or {'messages'}) or - for stdin.")
    teacher: str | None = option(
        None,
        "Teacher: a base model, or a tinker:// sampler checkpoint of --model (default: --model).",
    )
    teacher_base_url: str | None = option(
        None, "Server that hosts the teacher (default: the student's server)."
    )
    teacher_hint: str | None = option(
        None, "Text only the teacher sees before each prompt (hint, blank line, prompt)."
    )
    kl_coef: float = option(1.0, "Weight of the negative reverse KL in the advantages.", gt=0)
    kl_discount: float = option(
        0.0, "Discount summing future per-token KL into each advantage (0: per token).", min=0, lt=1
    )
    batch_size: int = option(32, "Prompts per step.", min=1)
    group_size: int = retune(PolicyOptions, "group_size", 4)
    max_tokens: int = retune(PolicyOptions, "max_tokens", 1024)
    lr: float = retune(TrainOptions, "lr", 1e-4)
    max_steps: int | None = option(
        None, "Stop after this many steps (default: one pass over the prompts).",
        flags=("--steps",), min=1,
    )  # fmt: skip


@dataclass
class OpsdPlan(Plan):
    dataset_path: str
    prompts: int
    prompts_with_context: int
    prompts_per_step: int
    samples_per_step: int
    teacher_model: str
    teacher_checkpoint: str | None
    teacher_sees_hint: bool


def load_prompts(opts: OpsdOptions, run_dir: Path, stdin) -> tuple[list[dict], Path]:
    """The validated prompts and the file the recipe will read (``base.read_input``)."""
    return base.read_input(opts.dataset, run_dir / DATASET_FILE, stdin, read_prompts)


def as_line(prompt: dict) -> dict:
    """A prompt as a ``{"messages"}`` line that ``read_prompts`` reads back unchanged."""
    return {"messages": [*prompt["context"], {"role": "user", "content": prompt["prompt"]}]}


def teacher_of(opts: OpsdOptions) -> tuple[str, str | None]:
    """(the teacher's base model, its sampler checkpoint or None)."""
    teacher = opts.teacher or opts.model
    if teacher.startswith("tinker://"):
        return opts.model, teacher
    return teacher, None


def check_same_tokenizer(student_tokenizer, teacher_model: str) -> None:
    """The teacher scores the student's token ids, so another base model must share the
    student's vocabulary. Skipped when either tokenizer cannot be loaded here: a hub id the
    cache lacks while the hub is unreachable is decided in seconds (``models/hub.py``), and the
    teacher's server check says what is wrong in one line."""
    from rlcli.models import hub

    if student_tokenizer is None:
        return
    teacher_tokenizer = hub.tokenizer(teacher_model)
    if teacher_tokenizer is None:
        return
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise RlcliError(
            f"--teacher {teacher_model}: its tokenizer differs from --model's; the teacher "
            "scores the student's tokens, so both need the same tokenizer"
        )


def check_teacher_model(server, model: str, own_url: bool) -> None:
    """The teacher's server must host its base model: one line naming what it hosts."""
    if server.serves(model):
        return
    served = server.served
    where = "--teacher-base-url" if own_url else "the student's server (--base-url)"
    raise RlcliError(
        f"--teacher {model}: the server at {server.base_url} ({where}) hosts only "
        f"{', '.join(served)}; start a server for the teacher (rlcli serve start --base-model "
        f"{model} --port ...) and pass its URL as --teacher-base-url"
    )


def teacher_elsewhere(spec: dict) -> bool:
    opts = spec["options"]
    return opts["teacher_base_url"].rstrip("/") != opts["base_url"].rstrip("/")


def hinted_prompts(spec: dict) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's tokens as the student sees them -> the tokens the teacher sees (the hint,
    a blank line, then the prompt, in the same user turn, rendered by the same renderer)."""
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    opts, plan = spec["options"], spec["plan"]
    renderer = renderers.get_renderer(plan["renderer"], get_tokenizer(opts["model"]))
    table = {}
    for p in shuffled_prompts(plan["dataset_path"], 0):
        student = [*p["context"], {"role": "user", "content": p["prompt"]}]
        hinted = opts["teacher_hint"] + HINT_SEPARATOR + p["prompt"]
        teacher = [*p["context"], {"role": "user", "content": hinted}]
        key = tuple(renderer.build_generation_prompt(student).to_ints())
        table[key] = renderer.build_generation_prompt(teacher).to_ints()
    return table


def make_teacher_seam(spec: dict):
    """The function ``distill.score_teachers_with`` applies to the recipe's teacher client."""
    opts, plan = spec["options"], spec["plan"]
    hinted = hinted_prompts(spec) if opts["teacher_hint"] is not None else None
    remote = None
    if teacher_elsewhere(spec):
        import tinker

        service = tinker.ServiceClient(base_url=opts["teacher_base_url"])
        remote = service.create_sampling_client(
            base_model=plan["teacher_model"], model_path=plan["teacher_checkpoint"]
        ).result()
    teachers: dict[int, distill.Teacher] = {}

    def teacher_for(client):
        if id(client) not in teachers:
            teachers[id(client)] = distill.Teacher(remote or client, hinted)
        return teachers[id(client)]

    return teacher_for


class Opsd(Recipe):
    name = "opsd"
    options = OpsdOptions
    help = "On-policy self-distillation from a prompts file: a teacher's reverse KL, no reward."
    show = {TEACHER_KL_K3: "kl"}
    tokens_key = SAMPLED_TOKENS

    def prepare(self, opts: OpsdOptions, stdin=None, dry_run=False) -> tuple[OpsdPlan, list]:
        """Check flags, model, renderer and every prompt, and count the steps; no server, no
        writes."""
        parse_loss_config(opts.loss_config)
        loss_guard.check_backend_hint(opts.backend, opts.loss)
        if opts.kl_penalty_coef or opts.kl_reference:
            raise RlcliError(
                "--kl-penalty-coef/--kl-reference: not used by opsd (the teacher's KL weight is "
                "--kl-coef)"
            )
        if opts.eval_every:
            raise RlcliError("--eval-every: opsd has no evaluation set; leave it at 0")
        if opts.init_checkpoint and not opts.init_checkpoint.startswith("tinker://"):
            raise RlcliError(f"--init-checkpoint {opts.init_checkpoint}: expected a tinker:// path")
        if opts.teacher_hint is not None and not opts.teacher_hint.strip():
            raise RlcliError("--teacher-hint: empty; give the text the teacher should see")
        check_model_arg(opts.model)
        check_renderer(opts.renderer)
        teacher_model, teacher_checkpoint = teacher_of(opts)
        if teacher_model != opts.model and not teacher_checkpoint:
            try:
                check_model_arg(teacher_model)
            except RlcliError as e:
                raise RlcliError(str(e).replace("--model", "--teacher", 1)) from None
        run_dir = self.run_dir_of(opts)
        prompts, dataset_path = load_prompts(opts, run_dir, stdin)
        renderer, source, tokenizer = resolve_renderer(opts.model, opts.renderer)
        if teacher_model != opts.model:
            check_same_tokenizer(tokenizer, teacher_model)
        per_step = min(opts.batch_size, len(prompts))
        plan = OpsdPlan(
            run_dir=str(run_dir),
            dataset_path=str(dataset_path),
            prompts=len(prompts),
            prompts_with_context=sum(1 for p in prompts if p["context"]),
            prompts_per_step=per_step,
            samples_per_step=per_step * opts.group_size,
            steps=base.capped(math.ceil(len(prompts) / opts.batch_size), opts),  # the last: partial
            teacher_model=teacher_model,
            teacher_checkpoint=teacher_checkpoint,
            teacher_sees_hint=opts.teacher_hint is not None,
            renderer=renderer,
            renderer_source=source,
            resuming=base.resuming(run_dir),
        )
        return plan, prompts

    def check_server(self, server, opts: OpsdOptions, plan: OpsdPlan, report) -> str:
        """The student's server: sampling length and the loss; then the teacher's server hosts
        the teacher (its base model, and the checkpoint when one is named)."""
        config = parse_loss_config(opts.loss_config)
        served_by = check_policy_server(server, opts, config, report, note=False)
        teacher_url = (opts.teacher_base_url or server.base_url).rstrip("/")
        teacher_server = server
        if teacher_url != server.base_url:
            endpoint.check_server(
                teacher_url, model=plan.teacher_model, source="--teacher-base-url"
            )
            teacher_server = preflight.Server(teacher_url)
        check_teacher_model(teacher_server, plan.teacher_model, opts.teacher_base_url is not None)
        teacher_server.check_checkpoint(plan.teacher_checkpoint, "--teacher", "sampler")
        return served_by

    def resolved_fields(self, opts: OpsdOptions, plan: OpsdPlan, base_url: str) -> dict:
        """The teacher and its server named, and the data file."""
        return {
            "teacher_base_url": (opts.teacher_base_url or base_url).rstrip("/"),
            "teacher": opts.teacher or opts.model,
            "dataset": plan.dataset_path,
        }

    def commit(self, opts: OpsdOptions, plan: OpsdPlan, prompts: list[dict]) -> None:
        """Keep stdin's prompts in the run folder for the recipe and for resume."""
        if opts.dataset == "-":
            base.keep_lines(Path(plan.dataset_path), [as_line(p) for p in prompts])

    def describe(self, plan: OpsdPlan, served_by: str = "") -> str:
        teacher = plan.teacher_checkpoint or plan.teacher_model
        hint = " with the hint" if plan.teacher_sees_hint else ""
        return (
            f"{plan.prompts} prompts, {plan.steps} steps of {plan.samples_per_step} samples; "
            f"teacher {teacher}{hint}"
        )

    def cookbook_config(self, spec: dict):
        from tinker_cookbook.distillation import train_on_policy
        from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

        from rlcli.recipes.prompts_builder import PromptsBuilder

        opts, plan = spec["options"], spec["plan"]
        builder = PromptsBuilder(
            dataset_path=plan["dataset_path"],
            **base.dataset_kwargs(spec, "batch_size", "group_size", "seed"),
        )
        if teacher_elsewhere(spec):  # scored by the teacher's own server (run_in_child)
            teacher = TeacherConfig(base_model=opts["model"])
        else:
            teacher = TeacherConfig(
                base_model=plan["teacher_model"], load_checkpoint_path=plan["teacher_checkpoint"]
            )
        dataset = DistillationDatasetConfig(
            dataset_builder=builder, teacher_config=teacher, groups_per_batch=opts["batch_size"]
        )
        return train_on_policy.Config(
            **self.cookbook_kwargs(spec),
            dataset_configs=[dataset],
            **base.picked(opts, "max_tokens", "temperature"),
            kl_penalty_coef=opts["kl_coef"],
            kl_discount_factor=opts["kl_discount"],
            loss_fn=opts["loss"],
            loss_fn_config=opts["loss_config"],
            eval_every=0,
            load_checkpoint_path=opts["init_checkpoint"],
            max_steps=plan["steps"],
        )

    def run_in_child(self, spec: dict) -> dict:
        import asyncio

        from tinker_cookbook.distillation import train_on_policy

        config = self.cookbook_config(spec)
        distill.score_teachers_with(make_teacher_seam(spec))
        seed_sampling(spec["options"]["seed"])
        asyncio.run(train_on_policy.main(config))
        series = metric_values(Path(config.log_path), TEACHER_KL_K3, TEACHER_KL)
        about = {"teacher": spec["options"]["teacher"]}
        names = {"teacher_kl": TEACHER_KL_K3, "teacher_logp_diff": TEACHER_KL}
        return base.summary_of(config.log_path, about, **base.first_last(series, names))
