"""Server overhead: one training step through the server vs the same step done in-process.

Server step: the tinker SDK's ``forward_backward(cross_entropy)`` + ``optim_step`` against a real
torch-backend process on 127.0.0.1. Baseline: the same LoRA (rank, targets, alpha), the same
batch, the same forward / backward / AdamW written directly with transformers + peft in this
process. Blocks of steps alternate between the two so machine noise hits both alike.
Target (issue 2): overhead <= 10% at batch 8 x 256 tokens on the tiny model.

    python benchmarks/server_overhead.py [--batch 8] [--seq-len 256] [--rounds 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _receipt  # noqa: E402


def make_batch(vocab: int, batch: int, seq_len: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=seq_len + 1).tolist() for _ in range(batch)]


def server_stepper(base_url: str, model: str, seqs, rank: int):
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-dummy")
    trainer = service.create_lora_training_client(base_model=model, rank=rank, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    adam = types.AdamParams(learning_rate=1e-5)

    def step() -> float:
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(adam)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    return step


def inprocess_stepper(model_path: str, seqs, rank: int, device: str = "cpu"):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlcli.server.engine.core import LORA_ALPHA, lora_layer_groups

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.eval()
    model.requires_grad_(False)
    targets = sorted(set().union(*lora_layer_groups(model).values()))
    torch.manual_seed(0)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets)
    )
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-12, weight_decay=0)
    tokens = torch.tensor([s[:-1] for s in seqs], device=device)
    targets_t = torch.tensor([s[1:] for s in seqs], device=device)
    weights = torch.ones_like(targets_t, dtype=torch.float32)

    def step() -> float:
        logits = peft_model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        logits = logits.float()
        logp = logits.gather(-1, targets_t.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        loss = -(logp * weights).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)  # on CUDA this waits for the step: the timing is the step's

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--hidden", type=int, default=64, help="width of the built model")
    parser.add_argument("--layers", type=int, default=2, help="layers of the built model")
    parser.add_argument("--name", default="server_overhead", help="receipt name")
    args = parser.parse_args()

    from rlcli.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(
            build_tiny_model(Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers)
        )
        with _receipt.local_server(model, tmp, wait=300) as record:
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model).vocab_size
            seqs = make_batch(vocab, args.batch, args.seq_len)
            server_step = server_stepper(record.base_url, model, seqs, args.rank)
            local_step = inprocess_stepper(model, seqs, args.rank)
            timed = _receipt.timed
            timed(server_step, 3), timed(local_step, 3)  # warm up both
            server_s, local_s = [], []
            for _ in range(args.rounds):
                server_s += timed(server_step, args.steps)
                local_s += timed(local_step, args.steps)

    tokens = args.batch * args.seq_len
    s, b = _receipt.summary(server_s), _receipt.summary(local_s)
    overhead = s["median"] / b["median"] - 1
    path = _receipt.write(
        args.name,
        {
            "what": "forward_backward(cross_entropy)+optim_step: server vs in-process peft",
            "model": f"rlcli tiny Qwen3, hidden {args.hidden}, {args.layers} layers",
            "batch": args.batch,
            "seq_len": args.seq_len,
            "lora_rank": args.rank,
            "server_step_s": s,
            "inprocess_step_s": b,
            "server_tokens_per_s": tokens / s["median"],
            "inprocess_tokens_per_s": tokens / b["median"],
            "overhead_fraction": overhead,
            "target_overhead_fraction": 0.10,
            "meets_target": overhead <= 0.10,
            "raw": {"server_s": server_s, "inprocess_s": local_s},
        },
    )
    print(f"server {s['median'] * 1e3:.1f} ms/step, in-process {b['median'] * 1e3:.1f} ms/step,")
    print(f"overhead {overhead * 100:+.1f}% (target <= 10%)  -> {path}")


if __name__ == "__main__":
    main()
