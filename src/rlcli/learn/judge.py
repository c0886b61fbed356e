"""``rlcli learn --judge MODEL``: the gate's scores from a judge model, pairwise.

Why pairwise: a judge asked for an absolute grade ("rate this answer 1-10") drifts with the
wording and the answer's length and is hard to calibrate across rounds; asked which of two
answers to the same question is better, it makes the one comparison the gate needs (is the
candidate better than what is served now?) and needs no right answer, so traces judged only
by a score can gate a round too.

Why both orders: judges, small ones most, prefer the first (or the second) answer they see
whatever it says. Each question is asked twice, the current adapter's answer as A and then as
B; only a verdict that names the same answer both times counts. One that names a position
both times (A then A), or that cannot be read as A or B, is a tie.

The candidate scores 1 for a win, 0.5 for a tie, 0 for a loss, and the current adapter 1
minus that, so ``gate.decide`` (``--margin``, ``--max-regression``, the intervals) reads
these scores as it reads exact-match ones: all ties are 0 points of gain, never a promotion.

The judge is any OpenAI-compatible ``/v1`` server (ours by default: the model may be an
alias, a checkpoint or the base model); ``check`` asks it once, within a bounded time, before
a round trains, so a dead or wrong judge is one line with nothing written.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlcli.errors import RlcliError

# The whole prompt, in one place (docs/learn.md quotes it).
PROMPT = (
    "Which answer to the question is better: correct first, then helpful and concise? "
    "Reply with one letter: A or B.\n\n"
    "Question:\n{question}\n\nAnswer A:\n{a}\n\nAnswer B:\n{b}"
)
MAX_TOKENS = 16  # the verdict is a letter; a few tokens allow "Answer A." or "**B**"
CHECK_TIMEOUT_S = 30.0  # the most the check before a round waits to connect, or for a read
ANSWER_TIMEOUT_S = 120.0  # per verdict, during the evaluation
EXAMPLES = 3  # verdicts kept in the receipt, per set
_VERDICT = re.compile(r"^\W*(?:(?i:answer|option)\W*)?([AB])\b")


@dataclass
class Judge:
    model: str
    base_url: str  # the server's root; requests go to {base_url}/v1
    api_key: str | None = None

    def describe(self) -> dict:
        """What the plan and receipt record (never the key)."""
        return {"model": self.model, "base_url": self.base_url, "prompt": PROMPT}


def make(model: str, base_url: str | None, api_key: str | None, server_url: str) -> Judge:
    """The judge of ``--judge MODEL --judge-base-url URL --judge-api-key KEY``: the server
    ``learn`` trains on unless another is given. The key: KEY; else, on the server learn
    trains on, the key rlcli sends it (``$TINKER_API_KEY``); else ``$OPENAI_API_KEY``, as
    the openai client reads it."""
    from rlcli.client import endpoint

    url = (base_url or server_url).rstrip("/").removesuffix("/v1")
    if api_key:
        return Judge(model, url, api_key)
    if url == server_url:
        return Judge(model, url, endpoint.api_key())
    return Judge(model, url, os.environ.get("OPENAI_API_KEY") or "none")


def _client(judge: Judge, timeout: float, retries: int):
    import openai

    return openai.OpenAI(
        base_url=f"{judge.base_url}/v1", api_key=judge.api_key, timeout=timeout,
        max_retries=retries,
    )  # fmt: skip


def check(judge: Judge, timeout: float | None = None) -> None:
    """One line unless the judge answers a first question (a short one, one verdict) within
    ``timeout`` seconds (``CHECK_TIMEOUT_S``): the server is reached, knows the model and
    answers no error."""
    import openai

    timeout = timeout or CHECK_TIMEOUT_S
    where = f"--judge {judge.model} at {judge.base_url}/v1"
    client = _client(judge, timeout, 0)
    try:
        _ask(client, judge.model, "Is 2 + 2 = 4?", "Yes.", "No.")
    except openai.APIConnectionError as e:  # refused, unresolvable, or past the timeout
        raise RlcliError(f"{where}: no answer within {timeout:g} s ({_cause(e)})") from None
    except openai.APIStatusError as e:
        if e.status_code == 404 and not isinstance(e.body, dict):  # no OpenAI error: a web page
            raise RlcliError(
                f"{where}: the server answered 404 to /v1/chat/completions with no OpenAI "
                "error: is it an OpenAI-compatible server? (check --judge-base-url)"
            ) from None
        if e.status_code == 404:
            raise RlcliError(
                f"{where}: the server does not know this model{_listed(client)}"
            ) from None
        raise RlcliError(f"{where}: the server answered {_status(e)}") from None


def _listed(client) -> str:
    """The models the server lists, for the message, if it lists any."""
    try:
        names = [m.id for m in client.models.list()]
    except Exception:  # a server without a model list: the message says less
        return ""
    more = ", ..." if len(names) > 5 else ""
    return f" (it serves {', '.join(names[:5])}{more})" if names else ""


def _cause(e: Exception) -> str:
    inner = e.__cause__ or e
    return type(inner).__name__


def _status(e) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    message = (body.get("error") or body).get("message") if isinstance(body, dict) else None
    return f"{e.status_code}: {message or e.message}".splitlines()[0]


def _ask(client, model: str, question: str, a: str, b: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT.format(question=question, a=a, b=b)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def conversation(prompt: list[dict]) -> str:
    """The question as the judge sees it: the user's message, or every turn before the answer
    (``role: text``) when there are more."""
    if len(prompt) == 1:
        return str(prompt[0].get("content") or "")
    return "\n".join(f"{m.get('role')}: {m.get('content') or ''}" for m in prompt)


def parse(text: str) -> str | None:
    """``"A"`` or ``"B"`` from the judge's reply, or None when it names neither first."""
    found = _VERDICT.match(text or "")
    return found.group(1) if found else None


def score(current_first: str, candidate_first: str) -> float:
    """The candidate's score from the two raw verdicts: asked with the current answer as A,
    then with the candidate's as A. 1 when both pick the candidate, 0 when both pick the
    current one, 0.5 otherwise (a tie: unreadable, or the two orders disagree)."""
    first, second = parse(current_first), parse(candidate_first)
    if first == "B" and second == "A":
        return 1.0
    if first == "A" and second == "B":
        return 0.0
    return 0.5


def compare(
    judge: Judge, questions: list[str], current: list[str], candidate: list[str], workers: int = 8
) -> dict:
    """Both orders for every question: the candidate's scores, the raw verdicts, counts."""
    import openai

    client = _client(judge, ANSWER_TIMEOUT_S, 2)
    asks = [(q, c, n) for q, c, n in zip(questions, current, candidate, strict=True)]
    asks = [x for q, c, n in asks for x in ((q, c, n), (q, n, c))]  # current as A, then as B
    try:
        with ThreadPoolExecutor(workers) as pool:
            raw = list(pool.map(lambda x: _ask(client, judge.model, *x), asks))
    except openai.APIError as e:
        raise RlcliError(f"--judge {judge.model} at {judge.base_url}/v1 failed: {e}") from None
    verdicts = [[raw[2 * i], raw[2 * i + 1]] for i in range(len(questions))]
    scores = [score(*v) for v in verdicts]
    return {"scores": scores, "verdicts": verdicts, **counts(scores, verdicts)}


def counts(scores: list[float], verdicts: list[list[str]]) -> dict:
    """Wins, ties and losses of the candidate, and why the ties were ties."""
    tally = Counter({1.0: "wins", 0.5: "ties", 0.0: "losses"}[s] for s in scores)
    unread = sum(any(parse(v) is None for v in pair) for pair in verdicts)
    return {
        "wins": tally["wins"],
        "ties": tally["ties"],
        "losses": tally["losses"],
        "unreadable": unread,  # ties where a verdict named neither A nor B
        "split": tally["ties"] - unread,  # ties where the two orders disagreed
    }


def examples(result: dict, questions: list[str], current: list[str], candidate: list[str]):
    """A few verdicts for the receipt: a win, a loss and a tie where there are some."""
    scores = result["scores"]
    firsts = [scores.index(s) for s in (1.0, 0.0, 0.5) if s in scores]
    picked = (firsts + [i for i in range(len(scores)) if i not in firsts])[:EXAMPLES]
    return [
        {
            "question": questions[i],
            "current": current[i],
            "candidate": candidate[i],
            "verdicts": {
                "current_as_a": result["verdicts"][i][0],
                "candidate_as_a": result["verdicts"][i][1],
            },
            "candidate_score": result["scores"][i],
        }  # fmt: skip
        for i in picked
    ]
