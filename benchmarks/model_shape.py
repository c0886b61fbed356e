"""A model folder of another model's exact architecture and tokenizer with random weights.

For timings where the weights' values do not matter (fixed-length decoding with no stop, a
training step) on a machine the real weights cannot reach: ``device_check.sh`` carries
SmolLM2-135M-Instruct's config and tokenizer (3.5 MB) where its weights (538 MB) do not fit.

    python benchmarks/model_shape.py SHAPE_DIR OUT_DIR [--seed 0]

SHAPE_DIR holds config.json and the tokenizer files; OUT_DIR gets them and float32 safetensors.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "special_tokens_map.json",
)  # fmt: skip


def build(shape: Path, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (shape / "config.json").exists():
        raise SystemExit(f"model_shape: {shape} has no config.json")
    config = AutoConfig.from_pretrained(shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in FILES:
        if (shape / name).exists():
            shutil.copy(shape / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.shape, args.out, args.seed))


if __name__ == "__main__":
    main()
