"""The smoke test a new user runs first: tiny model, real server, a few real training steps.

Everything goes through the same parts as real use: ``serve``'s process supervision, the
torch backend over HTTP, and the unmodified tinker SDK.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

CONVERSATIONS = [
    [("user", "What is 2 + 3?"), ("assistant", "The answer is 5.")],
    [("user", "What is 10 - 4?"), ("assistant", "The answer is 6.")],
    [("user", "What is 7 * 3?"), ("assistant", "The answer is 21.")],
    [("user", "Say hello."), ("assistant", "hello world")],
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sft_datums(tokenizer) -> list:
    """Chat examples as tinker Datums: learn the assistant turn, not the prompt."""
    from tinker import types

    datums = []
    for turns in CONVERSATIONS:
        messages = [{"role": r, "content": c} for r, c in turns]
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages)
        prompt, full = list(_ids(prompt)), list(_ids(full))
        weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    return datums


def _ids(encoded):
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def run_demo(
    home: Path, steps: int, learning_rate: float, report: Callable[[str], None]
) -> list[float]:
    """Returns the per-token training loss of each step."""
    import tinker
    from tinker import types

    from rlcli.backends import process
    from rlcli.backends import torch as torch_backend
    from rlcli.models import build_tiny_model, is_local_model

    model_dir = home / "models" / "tiny"
    if not is_local_model(str(model_dir)):
        report(f"building the tiny model in {model_dir}")
        build_tiny_model(model_dir)
    demo_home = home / "demo"
    demo_home.mkdir(parents=True, exist_ok=True)
    process.stop(demo_home)  # a demo interrupted earlier may have left one behind
    port = free_port()
    options = torch_backend.TorchServerOptions(base_model=str(model_dir), port=port, device="cpu")
    report(f"starting a server on 127.0.0.1:{port}")
    started = time.monotonic()
    record, healthy = torch_backend.start(demo_home, options, wait=120)
    losses = []
    try:
        if not healthy:
            raise RuntimeError(f"server not healthy after 120 s; see {record.log_path}")
        report(f"server healthy after {time.monotonic() - started:.1f}s")
        service = tinker.ServiceClient(base_url=record.base_url, api_key="tml-dummy")
        trainer = service.create_lora_training_client(base_model=str(model_dir), rank=8, seed=0)
        datums = sft_datums(trainer.get_tokenizer())
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].data) for d in datums)
        for step in range(steps):
            t0 = time.monotonic()
            result = trainer.forward_backward(datums, "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
            losses.append(result.metrics["loss:sum"] / n_tokens)
            report(f"step {step + 1}/{steps}  loss {losses[-1]:.4f}  {time.monotonic() - t0:.2f}s")
    finally:
        process.stop(demo_home)
        report("server stopped")
    return losses
