"""``rlcli export --push-to-hub REPO``: what ``export`` wrote (an adapter or model folder, or a
.gguf file) uploaded to a Hugging Face model repository through ``huggingface_hub``.

Everything that can refuse is asked before the export starts (the repo id, offline mode, a
token, the hub answering and accepting it), so a push that cannot happen is one line and
nothing is written. The endpoint is read when the command runs (``HF_ENDPOINT``), not when
``huggingface_hub`` was imported. The repository is created if missing, with the hub's default
visibility (public) unless ``private``.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlcli.errors import RlcliError

DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 10  # the whoami probe: a hub that does not answer within it is refused


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check(repo: str) -> str:
    """The user the token belongs to; ``RlcliError`` (one line) if the push cannot happen."""
    import httpx
    from huggingface_hub import get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        first = str(e).strip().splitlines()[0]
        raise RlcliError(f"--push-to-hub {repo!r}: not a repository id ({first})") from None
    if _offline():
        raise RlcliError(f"--push-to-hub {repo}: HF_HUB_OFFLINE is set; nothing was exported")
    token = get_token()
    if not token:
        raise RlcliError(
            f"--push-to-hub {repo}: no Hugging Face token (`hf auth login`, or HF_TOKEN); "
            "nothing was exported"
        )
    endpoint = _endpoint()
    try:  # huggingface_hub's own client has no timeout: the probe is bounded here
        answer = httpx.get(
            f"{endpoint}/api/whoami-v2",
            headers={"authorization": f"Bearer {token}"},
            timeout=TIMEOUT_S,
        )
    except httpx.HTTPError as e:
        raise RlcliError(
            f"--push-to-hub {repo}: cannot reach {endpoint} ({type(e).__name__}); "
            "nothing was exported"
        ) from None
    if answer.status_code != 200:
        why = "refused the token" if answer.status_code in (401, 403) else "answered"
        raise RlcliError(
            f"--push-to-hub {repo}: {endpoint} {why} (HTTP {answer.status_code}); "
            "nothing was exported"
        )
    try:
        return str(answer.json().get("name") or "?")
    except ValueError:
        raise RlcliError(
            f"--push-to-hub {repo}: {endpoint} is not a Hugging Face hub (whoami is not JSON)"
        ) from None


def push(out: Path, repo: str, private: bool = False, say=lambda _: None) -> str:
    """Upload ``out`` (a folder's files, or one file) to ``repo``; its URL."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint())
    say(f"pushing {out} to {repo} on {_endpoint()}")
    url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
    if out.is_dir():
        api.upload_folder(folder_path=str(out), repo_id=repo, commit_message="rlcli export")
    else:
        api.upload_file(
            path_or_fileobj=str(out), path_in_repo=out.name, repo_id=repo,
            commit_message="rlcli export",
        )  # fmt: skip
    return str(url)
