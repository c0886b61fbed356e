"""``rlcli eval rl``: score a policy (a base model or a sampler checkpoint) on an environment of
the registry (``rlcli.envs``) and report reward statistics.

The tasks are the environment's test problems for ``seed`` (a data split shuffled by it, a
generated one drawn from its test stream), each turned into the same cookbook ``ProblemEnv``
that ``train rl`` trains on: ``initial_observation()`` is the prompt, ``step(tokens)`` the
reward, so training and evaluation grade identically. Every task's request is sent at once
(at most ``concurrency`` in flight) through the tinker SDK's ``sample``, so the server
batches across tasks; each carries a seed derived from ``seed`` and the task's id, and
temperature 0 is greedy. ``compare`` scores the base model and the checkpoint on the same
tasks, one after the other (each side's time is its own).

Harbor tasks (a ``multi_turn`` environment, ``envs/harbor.py``) are scored by one episode per
task instead: the cookbook's bash-tool episode in a Docker container, the policy a cookbook
``TinkerTokenCompleter`` (a seed per task and turn), the reward the verifier's, exactly as
``train harbor`` rolls out; at most ``concurrency`` episodes at once, the daemon checked and the
images built before any sampling, every container removed at the end.

An environment whose prompt is a context document then a question (niah: the haystack, then
"What is the magic number of X?"; ``Environment.has_context``) can be scored without the
document in the prompt: ``without_context`` asks the question alone (to score an adapter that
``rlcli internalize`` made from such documents, ``--checkpoint``), and ``hypernet`` first turns
each task's document into its own adapter with one forward pass of a doc-to-LoRA hypernetwork
(``client/d2l.py``; the server chunks documents longer than the model's window) and asks the
question alone through it. A task's adapter is asked for under a session key made of the
task's id and a hash of its document, so the same task (same seed and index, same settings)
reuses its adapter instead of recomputing it, within and across evaluations, while it lives.
The result says which (``context``: ``prompt``, ``removed`` or ``hypernet``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rlcli import envs
from rlcli.errors import RlcliError
from rlcli.flags import BASE_URL_HELP, option

MAX_GENERATED_TASKS = 10_000  # a generated environment (arithmetic, niah) has no size of its own
Report = Callable[[str, int, int], None]  # (policy label, tasks done, tasks in all)
CONCURRENCY = 64  # sample requests in flight (the server batches across them)
HARBOR_CONCURRENCY = 8  # episodes at once: each is a container with its own CPUs and memory


@dataclass(kw_only=True)
class EvalOptions:
    env: str = option(
        help="Environment: gsm8k (test split), arithmetic, niah[:words=N,depth=D], a JSONL "
        'file of {"question", "answer"} pairs, or Harbor tasks (a task folder, a folder of '
        "them, or name@version from the Harbor cache): one bash-tool episode per task in Docker."
    )
    model: str | None = option(
        None,
        "Base model (default with --checkpoint: the checkpoint's base model; with --hypernet: "
        "the server's).",
    )
    checkpoint: str | None = option(
        None,
        "Sampler checkpoint to score: tinker://RUN/sampler_weights/NAME or an alias (default: "
        "the base).",
    )
    compare: bool = option(
        False, "Score the base model and --checkpoint (or --hypernet) side by side."
    )
    without_context: bool = option(
        False,
        "Ask each task's question without its context document in the prompt (niah: the "
        "haystack), e.g. to score an adapter rlcli internalize made (--checkpoint).",
    )
    hypernet: str | None = option(
        None,
        "Internalize each task's context document (niah: its haystack, chunked by the server) "
        "with this doc-to-LoRA hypernetwork, tinker://ID/hypernet_weights/NAME (rlcli train "
        "d2l), and ask the question alone through that task's adapter (rlcli's own server).",
    )
    tasks: int = option(
        100, "Tasks to score (at most the split's size; Harbor: the first by name).", min=1
    )
    max_new_tokens: int = option(
        256, "Longest answer, in tokens (Harbor: per turn).", flags=("--max-tokens",), min=1
    )
    temperature: float = option(0.0, "Sampling temperature (0: greedy).", min=0)
    seed: int = option(0, "Seed for task selection and sampling (same seed, same numbers).", min=0)
    pass_threshold: float = option(1.0, "A task passes when its reward is at least this.")
    gsm8k_dir: str | None = option(
        None, "Folder with GSM8K train.jsonl/test.jsonl (env: RLCLI_GSM8K_DIR; else the hub)."
    )
    renderer: str | None = option(None, "Chat renderer (default: recommended for the model).")
    concurrency: int | None = option(
        None,
        f"Sample requests in flight at once (default {CONCURRENCY}); Harbor: episodes (containers)"
        f" at once (default {HARBOR_CONCURRENCY}).",
        min=1,
    )
    task_filter: str | None = option(
        None, "Harbor: only tasks whose folder name matches (a name or glob; comma-separated)."
    )
    max_turns: int = option(10, "Harbor: most model turns (bash tool calls) per episode.", min=1)
    command_timeout: int = option(
        120, "Harbor: seconds one bash command may run before it is killed.", min=1
    )
    env_timeout: int = option(
        3600, "Harbor: seconds an episode's container may live (it is removed after).", min=1
    )
    base_url: str | None = option(None, BASE_URL_HELP)
    config: str | None = option(
        None, "YAML or TOML file of options (flags override it).", saved=False
    )
    json: bool = option(False, "Print results as JSON (with every task).", saved=False)


@dataclass
class TaskResult:
    id: str
    prompt: str
    response: str
    reward: float
    passed: bool
    tokens: int
    turns: int  # model turns: 1, or the episode's (Harbor)
    prompt_tokens: int | None = None  # the prompt sent (Harbor: None, one per turn)
    adapter: str | None = None  # --hypernet: the task's adapter (a sampler checkpoint)


@dataclass
class PolicyResult:
    policy: str  # "base" or "checkpoint"
    model: str
    checkpoint: str | None
    tasks: int
    mean_reward: float
    std_reward: float
    pass_rate: float
    passed: int
    tokens_generated: int
    seconds: float
    tasks_per_s: float
    tokens_per_s: float
    per_task: list[TaskResult]

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "per_task"}


@dataclass
class Task:
    id: str
    question: str
    env: object  # the cookbook ProblemEnv
    prompt: object  # tinker.ModelInput
    stop: list
    document: str | None = None  # the context kept out of the prompt (without_context, hypernet)


_TASKS_DEFAULT = next(f.default for f in dataclasses.fields(EvalOptions) if f.name == "tasks")


def task_seed(seed: int, task_id: str) -> int:
    """A sampling seed per task: the same for a task whatever else runs beside it."""
    digest = hashlib.sha256(f"{seed}/{task_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def evaluate(opts: EvalOptions, report: Report | None = None, info=None) -> dict:
    """Run the evaluation ``opts`` describes; the result as a JSON-able dict (``per_task`` in
    each side). ``report(label, done, total)`` is called as tasks finish; ``info(line)`` gets
    what was resolved (server, renderer)."""
    import asyncio

    from rlcli.client import aliases, endpoint, sample_chat  # lazy: imports httpx

    say = info or (lambda line: None)
    if opts.compare and not (opts.checkpoint or opts.hypernet):
        raise RlcliError(
            "--compare: pass --checkpoint tinker://RUN/sampler_weights/NAME (or --hypernet) too"
        )
    if opts.checkpoint and not aliases.is_alias_name(opts.checkpoint):
        sample_chat.split_tinker_path(opts.checkpoint)  # the form, before anything else
    if opts.model:
        from rlcli.recipes.preflight import check_model_arg  # lazy: imports httpx

        check_model_arg(opts.model)
    env = envs.get(opts.env, gsm8k_dir=opts.gsm8k_dir, harbor=True, task_filter=opts.task_filter)
    if opts.task_filter and not env.multi_turn:
        raise RlcliError(f"--task-filter: only for Harbor tasks, not --env {opts.env}")
    mode = _context_mode(opts, env)
    if env.generated and opts.tasks > MAX_GENERATED_TASKS:
        raise RlcliError(
            f"--tasks {opts.tasks}: at most {MAX_GENERATED_TASKS} for a generated environment "
            f"({opts.env}); scoring more tells no more and takes hours"
        )
    problems = env.problems("test", opts.seed, opts.tasks)
    if len(problems) < opts.tasks != _TASKS_DEFAULT:  # asked for more than there is
        say(f"--tasks {opts.tasks}: {opts.env} has {len(problems)} test tasks; scoring all of them")
    url, source = endpoint.resolve_base_url(opts.base_url)
    hypernets = None
    if opts.hypernet:
        from rlcli.client import d2l  # lazy: imports httpx

        endpoint.check_server(url, source=source)
        hypernets = d2l.Hypernets(url)  # a server without hypernetworks: one line, here
    model = opts.model or (hypernets.server.served[0] if hypernets else None)
    target = sample_chat.resolve_target(url, source, model, opts.checkpoint)
    context = _check_max_tokens(url, opts.max_new_tokens)
    say(endpoint.describe(url, source))
    renderer, renderer_name, why = _renderer(target.base_model, opts.renderer)
    if not opts.renderer:
        say(f"renderer: {renderer_name} ({why})")
    if env.multi_turn:
        env.prepare(say)  # the daemon and every image, before any sampling
        tasks = [Task(str(row["id"]), row["question"], None, None, []) for row in problems]
    else:
        tasks = asyncio.run(_tasks(env, problems, renderer, mode))
    adapters, internalized = {}, None
    if hypernets is not None:
        adapters, internalized = _internalize(hypernets, opts.hypernet, env, tasks, say)
    sides = [("base", None)] if not opts.checkpoint else [("checkpoint", target.checkpoint)]
    if opts.hypernet:
        sides = [("hypernet", None)]
    if opts.compare:
        sides.insert(0, ("base", None))
    results = []
    for label, checkpoint in sides:
        per_task = adapters if label == "hypernet" else None
        with _episodes(env, opts, target.base_model, renderer_name, context) as play:
            scored = _score(
                opts, target, label, checkpoint, tasks, renderer, report, play, per_task
            )
            results.append(asyncio.run(scored))
    common = {
        "env": opts.env,
        "source": env.source,
        "tasks": len(tasks),
        "seed": opts.seed,
        "temperature": opts.temperature,
        "max_new_tokens": opts.max_new_tokens,
        "pass_threshold": opts.pass_threshold,
        "renderer": renderer_name,
        "base_url": url,
        "context": mode,
    }
    if internalized is not None:
        common |= {"hypernet": opts.hypernet, "internalized": internalized}
    if env.multi_turn:
        keys = ("max_turns", "command_timeout", "env_timeout")
        common |= {key: getattr(opts, key) for key in keys}
    if not opts.compare:
        return {**common, **asdict(results[0])}
    base, trained = results
    keys = ("mean_reward", "std_reward", "pass_rate", "passed", "tokens_generated")
    return {
        **common,
        "base": asdict(base),
        "checkpoint": asdict(trained),  # its policy: "checkpoint", or "hypernet"
        "difference": {k: getattr(trained, k) - getattr(base, k) for k in keys},
    }


def _context_mode(opts: EvalOptions, env) -> str:
    """Where each task's context document goes: ``prompt`` (as the environment builds it),
    ``removed`` (--without-context) or ``hypernet`` (internalized); one line for a mix that
    cannot be scored."""
    if not (opts.hypernet or opts.without_context):
        return "prompt"
    given = "--hypernet" if opts.hypernet else "--without-context"
    if not env.has_context:
        raise RlcliError(
            f"{given}: --env {opts.env} has no context document apart from its question "
            "(niah has: its haystack)"
        )
    if not opts.hypernet:
        return "removed"
    from rlcli.client.d2l import check_hypernet_path  # lazy: imports httpx

    check_hypernet_path(opts.hypernet)
    if opts.checkpoint:
        raise RlcliError(
            "--hypernet with --checkpoint: the hypernetwork makes each task's adapter; score "
            "one or the other (--checkpoint with --without-context scores one adapter for all)"
        )
    return "hypernet"


def _internalize(hypernets, hypernet: str, env, tasks: list[Task], say):
    """Each task's document into its adapter, once: the session key is the environment, the
    task's id (seed and index) and a hash of the document, so an evaluation of the same tasks
    reuses the adapters while they live, and other settings (another haystack) never do.
    Returns (task id -> adapter path, what the result reports)."""
    say(f"internalizing {len(tasks)} documents with {hypernet}")
    adapters, made, reused, tokens = {}, 0, 0, []
    start, every = time.perf_counter(), max(1, len(tasks) // 10)
    for done, task in enumerate(tasks, start=1):
        digest = hashlib.sha256((task.document or "").encode()).hexdigest()[:16]
        try:
            out = hypernets.internalize(
                hypernet, task.document or "", session_key=f"{env.name}/{task.id}/{digest}"
            )
        except RlcliError as e:
            raise RlcliError(f"task {task.id}: {e}") from None
        adapters[task.id] = out["path"]
        reused += bool(out.get("reused"))
        made += not out.get("reused")
        if out.get("tokens"):
            tokens.append(out["tokens"])
        if done % every == 0 and done < len(tasks):  # a long one (a slow CPU) is never quiet
            say(f"internalized {done}/{len(tasks)} documents")
    seconds = time.perf_counter() - start
    say(f"internalized {len(tasks)} documents: {made} adapters made, {reused} reused, "
        f"{seconds:.1f} s")  # fmt: skip
    return adapters, {
        "adapters": len(adapters),
        "made": made,
        "reused": reused,
        "document_tokens_max": max(tokens, default=None),
        "seconds": seconds,
    }


def _check_max_tokens(url: str, max_tokens: int) -> int | None:
    """``max_tokens`` is one the server samples; the served model's context, when it says."""
    from rlcli.client.server_info import Server  # lazy: imports httpx

    caps = Server(url).caps
    top = caps.get("max_sample_tokens")
    if isinstance(top, int) and max_tokens > top:
        raise RlcliError(
            f"--max-new-tokens {max_tokens}: the server at {url} samples at most {top}"
        )
    lengths = [m.get("max_context_length") for m in caps.get("supported_models") or []]
    return next((n for n in lengths if isinstance(n, int) and n > 0), None)


def _renderer(model: str, requested: str | None):
    from tinker_cookbook import renderers

    from rlcli.compat.renderer_choice import resolve_renderer  # lazy: rlcli --help does not load it
    from rlcli.recipes.preflight import check_renderer  # lazy: imports httpx

    check_renderer(requested)
    name, why, tokenizer = resolve_renderer(model, requested)
    if tokenizer is None:
        raise RlcliError(
            f"cannot load the tokenizer of {model} here (the policy's base model); pass --model "
            "with a local copy or its hub id"
        )
    return renderers.get_renderer(name, tokenizer), name, why


def _episodes(env, opts: EvalOptions, model: str, renderer_name: str, context: int | None):
    """Harbor: ``env.episodes`` (yields the episode function; removes the containers after);
    else nothing (``None``). ``context``: the model's, where an episode that outgrows it ends
    (the cookbook's context-overflow reward) instead of a refused sample request."""
    import contextlib

    if not env.multi_turn:
        return contextlib.nullcontext(None)
    return env.episodes(
        model, renderer_name, max_turns=opts.max_turns, command_timeout=opts.command_timeout,
        env_timeout=opts.env_timeout, max_tokens=opts.max_new_tokens, context=context,
    )  # fmt: skip


class SeededClient:
    """A sampling client whose every call carries a seed from (``seed``, call number): the
    cookbook's ``TinkerTokenCompleter`` sends none, and an episode's turns are its calls, so
    one per episode makes a task's turns sample the same tokens run to run."""

    def __init__(self, client, seed: int) -> None:
        self.client, self.seed, self.calls = client, seed, 0

    async def sample_async(self, prompt, num_samples, sampling_params, **kwargs):
        """What the cookbook's completer calls; the SDK's own ``sample`` does the work."""
        self.calls += 1
        seed = task_seed(self.seed, f"turn-{self.calls}")
        params = sampling_params.model_copy(update={"seed": seed})
        return await self.client.sample(prompt, num_samples, params, **kwargs)


async def _tasks(env, problems, renderer, mode: str = "prompt") -> list[Task]:
    """Each problem's env and prompt; without its context document where ``mode`` says
    (the document kept on the task for ``hypernet``)."""
    out = []
    for row in problems:
        document = None
        if mode != "prompt":
            document, query = env.context_parts(row)
            row = {**row, "question": query}
        problem = env.make_env(row, renderer)
        prompt, stop = await problem.initial_observation()
        out.append(Task(str(row["id"]), problem.get_question(), problem, prompt, stop, document))
    return out


async def _score(
    opts, target, label, checkpoint, tasks, renderer, report, play=None, adapters=None
) -> PolicyResult:
    """Every task sampled once through the SDK (bounded concurrency) and graded by its env; or,
    with ``play`` (Harbor), one episode per task through the cookbook's rollout. ``adapters``
    (task id -> sampler path, ``--hypernet``): each task through its own adapter."""
    import asyncio

    import tinker
    from tinker import types
    from tinker_cookbook.renderers import get_text_content

    from rlcli.client import endpoint, sample_chat  # lazy: imports httpx
    from rlcli.compat import skyrl_client  # lazy: rlcli --help does not load it

    side = sample_chat.Target(target.base_url, target.base_model, checkpoint)
    skyrl_client.accept_unnumbered_samples()  # a SkyRL server answers samples the 0.25 way
    service = tinker.ServiceClient(base_url=target.base_url, api_key=endpoint.api_key())
    clients = {}
    try:
        if adapters:
            paths = [adapters[t.id] for t in tasks]
            made = await asyncio.gather(
                *(service.create_sampling_client(model_path=p) for p in paths)
            )
            clients = {t.id: c for t, c in zip(tasks, made, strict=True)}
            client = None
        elif checkpoint:
            client = await service.create_sampling_client(model_path=checkpoint)
        else:
            client = await service.create_sampling_client(base_model=target.base_model)
    except tinker.APIStatusError as e:
        raise RlcliError(f"{side.label}: the server refused it: {e}") from None
    default = HARBOR_CONCURRENCY if play else CONCURRENCY
    gate = asyncio.Semaphore(opts.concurrency or default)
    done = 0

    async def episode(task: Task) -> TaskResult:
        """One Harbor episode; its reward is the verifier's (see ``envs/harbor.py``)."""
        nonlocal done
        from tinker_cookbook.completers import TinkerTokenCompleter

        seeded = SeededClient(client, task_seed(opts.seed, task.id))
        policy = TinkerTokenCompleter(seeded, opts.max_new_tokens, opts.temperature)
        async with gate:
            try:
                played = await play({"id": task.id}, policy)
            except RlcliError:
                raise
            except (tinker.APIStatusError, tinker.APIConnectionError) as e:
                raise RlcliError(f"task {task.id}: {sample_chat.sample_error(side, e)}") from None
            except Exception as e:
                raise RlcliError(f"task {task.id}: the episode failed: {e}") from None
        done += 1
        if report:
            report(label, done, len(tasks))
        return TaskResult(
            id=task.id,
            prompt=task.question,
            response=played.response,
            reward=played.reward,
            passed=played.reward >= opts.pass_threshold,
            tokens=played.tokens,
            turns=played.turns,
        )

    async def one(task: Task) -> TaskResult:
        nonlocal done
        params = types.SamplingParams(
            max_tokens=opts.max_new_tokens,
            temperature=opts.temperature,
            seed=task_seed(opts.seed, task.id),
            stop=task.stop,
        )
        async with gate:
            try:
                response = await clients.get(task.id, client).sample(task.prompt, 1, params)
            except Exception as e:
                error = sample_chat.sample_error(side, e)
                raise RlcliError(f"task {task.id}: {error}") from None
        tokens = list(response.sequences[0].tokens)
        step = await task.env.step(tokens)
        message, _ = renderer.parse_response(tokens)
        done += 1
        if report:
            report(label, done, len(tasks))
        reward = float(step.reward)
        return TaskResult(
            id=task.id,
            prompt=task.question,
            response=get_text_content(message),
            reward=reward,
            passed=reward >= opts.pass_threshold,
            tokens=len(tokens),
            turns=1,
            prompt_tokens=task.prompt.length,
            adapter=(adapters or {}).get(task.id),
        )

    if report:
        report(label, 0, len(tasks))
    start = time.perf_counter()
    try:
        per_task = list(await asyncio.gather(*((episode if play else one)(t) for t in tasks)))
        seconds = time.perf_counter() - start
    finally:  # stop the session's heartbeat thread now (a library caller lives on)
        close = getattr(getattr(service, "holder", None), "close", None)
        if close:
            close()
    rewards = [t.reward for t in per_task]
    passed = sum(t.passed for t in per_task)
    tokens = sum(t.tokens for t in per_task)
    return PolicyResult(
        policy=label,
        model=target.base_model,
        checkpoint=checkpoint,
        tasks=len(per_task),
        mean_reward=statistics.fmean(rewards),
        std_reward=statistics.pstdev(rewards),
        pass_rate=passed / len(per_task),
        passed=passed,
        tokens_generated=tokens,
        seconds=seconds,
        tasks_per_s=len(per_task) / seconds if seconds > 0 else math.inf,
        tokens_per_s=tokens / seconds if seconds > 0 else math.inf,
        per_task=per_task,
    )
