"""Documents for ``rlcli internalize``: read them (files, folders, stdin), refuse what is not
text, and cut them into sentences and into chunks that fit the teacher's context window.

A document is refused whole, in one line naming it, when it is empty, binary (a NUL byte, or
not UTF-8) or larger than ``MAX_DOCUMENT_BYTES``: nothing is read into a run from it.

Chunking (``chunks``) packs whole paragraphs, then whole sentences, greedily into pieces of at
most ``max_tokens`` tokens; a sentence longer than that is cut at a token boundary. The
teacher then answers each probe with the one chunk it came from (a templated probe) or the
chunk sharing the most words with it (a question from ``--questions``; ``best_chunk``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rlcli.errors import RlcliError

MAX_DOCUMENT_BYTES = 2_000_000  # about 500k tokens: far past what one adapter should hold
MAX_FOLDER_FILES = 1000
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_WORD = re.compile(r"[A-Za-z0-9]+")


@dataclass
class Document:
    name: str  # the file's path as given (or "stdin")
    text: str


def _decode(data: bytes, where: str) -> str:
    if len(data) > MAX_DOCUMENT_BYTES:
        raise RlcliError(
            f"{where}: {len(data):,} bytes, more than the {MAX_DOCUMENT_BYTES:,} a document may "
            "have; split it into several documents"
        )
    if b"\x00" in data:
        raise RlcliError(f"{where}: a binary file (it holds NUL bytes), not a text document")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RlcliError(f"{where}: not UTF-8 text (byte {e.start}); convert it first") from None
    if not text.strip():
        raise RlcliError(f"{where}: the document is empty")
    return text


def read_documents(paths: list[str], stdin=None) -> list[Document]:
    """Every document named: a file, each regular file of a folder (sorted, hidden ones
    skipped), or ``-`` for stdin (once). Any bad one refuses them all."""
    if not paths:
        raise RlcliError("missing DOCUMENT: name a file, a folder, or - for stdin")
    docs: list[Document] = []
    for given in paths:
        if given == "-":
            if stdin is None or stdin.isatty():
                raise RlcliError(
                    "DOCUMENT -: stdin is a terminal, nothing was piped in (`... | rlcli "
                    "internalize - ...`)"
                )
            data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
            docs.append(Document("stdin", _decode(data, "DOCUMENT - (stdin)")))
            continue
        path = Path(given).expanduser()
        if path.is_dir():
            files = sorted(
                p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))
            )
            if not files:
                raise RlcliError(f"DOCUMENT {given}: a folder with no files in it")
            if len(files) > MAX_FOLDER_FILES:
                raise RlcliError(
                    f"DOCUMENT {given}: {len(files)} files, more than {MAX_FOLDER_FILES}"
                )
            docs += [Document(str(p), _decode(p.read_bytes(), f"DOCUMENT {p}")) for p in files]
        elif path.is_file():
            docs.append(Document(str(path), _decode(path.read_bytes(), f"DOCUMENT {given}")))
        else:
            raise RlcliError(f"DOCUMENT {given}: no such file or folder")
    names = [d.name for d in docs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise RlcliError(f"DOCUMENT {twice}: named twice")
    return docs


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def sentences(text: str) -> list[str]:
    """The text's sentences, paragraph by paragraph (a line break inside a paragraph is a
    space)."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        out += [s.strip() for s in _SENTENCE_END.split(flat) if s.strip()]
    return out


def chunks(text: str, count_tokens, max_tokens: int) -> list[str]:
    """``text`` in pieces of at most ``max_tokens`` tokens (``count_tokens(str) -> int``),
    cut between paragraphs where possible, else between sentences, else inside one."""
    pieces: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            pieces.append(" ".join(current))
            current.clear()

    for sentence in sentences(text):
        if count_tokens(sentence) > max_tokens:
            flush()
            pieces += _cut(sentence, count_tokens, max_tokens)
            continue
        if current and count_tokens(" ".join([*current, sentence])) > max_tokens:
            flush()
        current.append(sentence)
    flush()
    return pieces


def _cut(sentence: str, count_tokens, max_tokens: int) -> list[str]:
    """A sentence too long for one chunk, cut between words."""
    out, words = [], sentence.split()
    current: list[str] = []
    for word in words:
        if current and count_tokens(" ".join([*current, word])) > max_tokens:
            out.append(" ".join(current))
            current = []
        current.append(word)
    if current:
        out.append(" ".join(current))
    return out


def words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text) if len(w) > 2}


def best_chunk(pieces: list[str], text: str) -> int:
    """The chunk sharing the most words with ``text`` (the first on a tie)."""
    wanted = words(text)
    scores = [len(wanted & words(piece)) for piece in pieces]
    return scores.index(max(scores))
