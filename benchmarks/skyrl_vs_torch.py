"""The same training steps on rlcli's torch backend and on SkyRL 0.4.0's jax backend.

Both servers run the same tiny model on this machine's CPU, started as ``rlcli serve start``
starts them; the tinker SDK sends each the same batches with the same LoRA (rank, seed):
- SFT: ``forward_backward(cross_entropy)`` + ``optim_step`` on ``--batch`` sequences of
  ``--seq-len`` tokens;
- RL: ``forward_backward(importance_sampling)`` + ``optim_step`` on the same sequences with fixed
  sampled logprobs and advantages (a train step of ``train rl``);
- sampling: ``--batch`` completions of ``--max-tokens`` tokens from the base model (the
  rollouts of an RL step).
Blocks of steps alternate between the two servers so machine noise hits both alike; JAX's
compilation happens in the warm-up steps. The ratio is SkyRL time / torch time (above 1: SkyRL
is slower). The first step's metrics are kept: the two report the loss differently (SkyRL jax
averages over datums and tokens, Tinker sums; docs/skyrl.md).

    RLCLI_SKYRL_CACHE=... python benchmarks/skyrl_vs_torch.py [--batch 8] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402


@contextlib.contextmanager
def skyrl_server(model: str, tmp: str, wait: float = 900):
    """SkyRL's jax server for ``model`` (installed once into ``$RLCLI_SKYRL_CACHE``)."""
    from rlcli.demo.run import free_port
    from rlcli.launch import process, skyrl

    home = Path(tmp) / "skyrl-home"
    options = skyrl.SkyRLOptions(
        backend="jax",
        base_model=model,
        port=free_port(),
        checkpoints_dir=str(home / "skyrl" / "checkpoints"),
        database=str(home / "skyrl" / "tinker.db"),
    )
    started = time.monotonic()
    result = skyrl.start(home, options, wait=wait, foreground=False, dry_run=False)
    try:
        yield result["base_url"], time.monotonic() - started
    finally:
        process.stop(home)


def datums(seqs, loss: str):
    from tinker import types

    out = []
    for s in seqs:
        inputs = {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}
        if loss == "importance_sampling":
            inputs = {
                "target_tokens": s[1:],
                "logprobs": [-2.0] * (len(s) - 1),
                "advantages": [0.5 if i % 2 else -0.5 for i in range(len(s) - 1)],
            }
        out.append(
            types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs=inputs)
        )
    return out


def steppers(base_url: str, model: str, seqs, prompts, rank: int, max_tokens: int):
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(base_model=model, rank=rank, seed=0).result()
    sampler = service.create_sampling_client(base_model=model).result()
    adam = types.AdamParams(learning_rate=1e-5)
    first: dict = {}

    def train(loss: str):
        data = datums(seqs, loss)

        def step():
            fb = trainer.forward_backward(data, loss)
            opt = trainer.optim_step(adam)
            metrics = fb.result().metrics
            opt.result()
            first.setdefault(loss, metrics)

        return step

    def sample():
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1)
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=1, sampling_params=params)
            for p in prompts
        ]
        for f in futures:
            f.result()

    return {
        "sft": train("cross_entropy"),
        "rl": train("importance_sampling"),
        "sample": sample,
    }, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RLCLI_SKYRL_CACHE", str(Path.home() / ".cache/rlcli-tests/skyrl"))

    import numpy as np

    from rlcli.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "m"))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        rng = np.random.default_rng(0)
        seqs = [rng.integers(3, vocab, size=args.seq_len + 1).tolist() for _ in range(args.batch)]
        prompts = [rng.integers(3, vocab, size=16).tolist() for _ in range(args.batch)]
        with (
            _receipt.local_server(model, tmp) as torch_record,
            skyrl_server(model, tmp) as (skyrl_url, skyrl_start_s),
        ):
            steps = {
                "torch": steppers(
                    torch_record.base_url, model, seqs, prompts, args.rank, args.max_tokens
                ),
                "skyrl_jax": steppers(skyrl_url, model, seqs, prompts, args.rank, args.max_tokens),
            }
            raw = {b: {k: [] for k in ("sft", "rl", "sample")} for b in steps}
            for step, _ in steps.values():  # warm up (JAX compiles each shape once)
                for kind in ("sft", "rl", "sample"):
                    _receipt.timed(step[kind], 2)
            for _ in range(args.rounds):
                for kind in ("sft", "rl", "sample"):
                    for backend, (step, _) in steps.items():
                        raw[backend][kind] += _receipt.timed(step[kind], args.steps)
            first_metrics = {b: first for b, (_, first) in steps.items()}

    train_tokens = args.batch * args.seq_len
    sampled_tokens = args.batch * args.max_tokens  # at most: a sequence may stop early
    result = {}
    for kind, tokens in (("sft", train_tokens), ("rl", train_tokens), ("sample", sampled_tokens)):
        t, s = _receipt.summary(raw["torch"][kind]), _receipt.summary(raw["skyrl_jax"][kind])
        result[kind] = {
            "torch_step_s": t,
            "skyrl_jax_step_s": s,
            "torch_tokens_per_s": tokens / t["median"],
            "skyrl_jax_tokens_per_s": tokens / s["median"],
            "ratio_skyrl_over_torch": s["median"] / t["median"],
        }
    path = _receipt.write(
        "skyrl_vs_torch",
        {
            "what": "same SFT / RL (importance_sampling) / sampling steps: torch backend vs "
            "SkyRL 0.4.0 jax backend, both on this CPU, same tiny model and batches",
            "model": "rlcli tiny Qwen3 (build_tiny_model defaults)",
            "batch": args.batch,
            "seq_len": args.seq_len,
            "max_tokens": args.max_tokens,
            "lora_rank": args.rank,
            "skyrl_start_s": skyrl_start_s,
            **result,
            "first_step_metrics": first_metrics,
            "raw": raw,
        },
    )
    for kind in ("sft", "rl", "sample"):
        r = result[kind]
        print(
            f"{kind:6s} torch {r['torch_step_s']['median'] * 1e3:8.1f} ms  "
            f"skyrl-jax {r['skyrl_jax_step_s']['median'] * 1e3:8.1f} ms  "
            f"ratio {r['ratio_skyrl_over_torch']:.2f}"
        )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
