"""Session workloads of real text, for real models.

A session is a sequence of requests whose domain follows a list (what a server sees);
`kairox.synth.topic_prompts` writes them for the synthetic models.

Four domains, none of them text a pack's offline profile has seen:
  novel, detective, economics  the held-out tails (`kairox prepare --heldout`, 15%) of the
                               bundled calibration corpus's three works (data/calib/SOURCES.md)
  code                         kairox's own Python sources, which no calibration reads
Requests of one domain take consecutive pieces of its text, so a session that returns to a
domain continues where it left it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

TEXT_DOMAINS = ("code", "novel", "detective", "economics")
_CALIB_FILE = {"novel": "01-", "detective": "02-", "economics": "03-"}


def domain_text(domain: str) -> str:
    """The text of one of TEXT_DOMAINS."""
    from .prepare import PrepareConfig, default_corpus, split_document

    if domain == "code":
        root = resources.files("kairox")
        files = sorted((p for p in root.iterdir() if p.name.endswith(".py")), key=lambda p: p.name)
        return "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    if domain not in _CALIB_FILE:
        raise ValueError(f"unknown text domain {domain!r}: one of {', '.join(TEXT_DOMAINS)}")
    doc = next(d for d in default_corpus() if d.name.startswith(_CALIB_FILE[domain]))
    return split_document(doc.text, PrepareConfig.heldout)[1]  # the tail `kairox prepare` holds out


def text_requests(tokenize: Callable[[str], Sequence[int]], domains: Sequence[str], per: int,
                  bos: int | None = None) -> list[list[int]]:
    """One request of `per` tokens for each entry of `domains`, in order: `bos` (where the
    model has one), then the next piece of the domain's text (tokenized once, without BOS),
    so that the k-th request of a domain continues where its (k-1)-th stopped."""
    head = [] if bos is None else [bos]
    body = per - len(head)
    if body < 1:
        raise ValueError(f"per must leave room for text, got {per}")
    tokens: dict[str, list[int]] = {}
    used: dict[str, int] = {}
    out = []
    for d in domains:
        if d not in tokens:
            tokens[d] = list(tokenize(domain_text(d)))
            used[d] = 0
        lo = used[d]
        if lo + body > len(tokens[d]):
            raise ValueError(f"the {d} text holds {len(tokens[d])} tokens: {list(domains).count(d)} requests of "
                             f"{body} do not fit; ask for fewer or shorter requests")
        out.append(head + tokens[d][lo:lo + body])
        used[d] = lo + body
    return out


def model_requests(model_path: str | Path, sessions: Sequence[Sequence[str]], per: int,
                   threads: int | None = None) -> list[list[list[int]]]:
    """text_requests for each session (a list of domains), with the model's own tokenizer and
    BOS; the model is loaded once for all of them."""
    from .profile import Profiler

    with Profiler(model_path, n_ctx=16, threads=threads) as prof:
        return [text_requests(lambda t: prof.tokenize(t).tolist(), doms, per, prof.bos()) for doms in sessions]


__all__ = ["TEXT_DOMAINS", "domain_text", "model_requests", "text_requests"]
