"""Session workloads of real text (kairox.workload)."""
from __future__ import annotations

import pytest

from kairox.prepare import PrepareConfig, default_corpus, split_document
from kairox.workload import TEXT_DOMAINS, domain_text, text_requests


def test_prose_domains_are_the_held_out_tails_code_is_kairoxs_sources() -> None:
    heads = [split_document(d.text, PrepareConfig.heldout)[0] for d in default_corpus()]
    for d in TEXT_DOMAINS:
        text = domain_text(d)
        assert len(text) > 5000, d
        # nothing a default pack was profiled on
        assert all(text[:200] not in h for h in heads), d
    assert "def text_requests" in domain_text("code")
    with pytest.raises(ValueError, match="unknown text domain"):
        domain_text("poetry")


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def test_requests_continue_their_domains_text() -> None:
    reqs = text_requests(words, ["novel", "code", "novel"], 5, bos=1)
    assert [len(r) for r in reqs] == [5, 5, 5] and all(r[0] == 1 for r in reqs)
    novel = words(domain_text("novel"))
    assert reqs[0][1:] + reqs[2][1:] == novel[:8]
    assert reqs[1][1:] == words(domain_text("code"))[:4]
    assert text_requests(words, ["novel"], 3) == [novel[:3]]


def test_requests_that_do_not_fit_are_refused() -> None:
    n = len(words(domain_text("detective")))
    with pytest.raises(ValueError, match="do not fit"):
        text_requests(words, ["detective"] * 2, n // 2 + 1)
    with pytest.raises(ValueError, match="room"):
        text_requests(words, ["novel"], 1, bos=1)
