"""A small Okapi BM25 ranker (numpy only, no retrieval library) shared by the WebShop and SearchQA environments."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens (punctuation splits words: 'clip-in' -> 'clip', 'in')."""
    return _TOKEN.findall(text.lower())


class BM25:
    """Okapi BM25 over pre-tokenised documents.

    score(D, Q) = sum over query tokens q of idf(q) * tf(q, D) * (k1 + 1) / (tf(q, D) + k1 * (1 - b + b * |D| / avgdl))
    with idf(q) = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5)) -- the Lucene form, which is never negative, so a term
    that occurs in most documents still adds a little instead of pushing matching documents below non-matching ones.
    """

    def __init__(self, docs: Sequence[Sequence[str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1 = k1
        self.b = b
        self.n_docs = len(docs)
        self.doc_len = [len(d) for d in docs]
        self.avgdl = (sum(self.doc_len) / self.n_docs) if self.n_docs else 0.0
        # Inverted index term -> (doc ids, weights). The weight of a (term, doc) pair does not depend on the query,
        # so it is computed once here and a query is a few vectorised adds (fast even for 100k passages).
        rows: dict[str, tuple[list[int], list[int]]] = {}
        for i, doc in enumerate(docs):
            for term, tf in Counter(doc).items():
                ids, tfs = rows.setdefault(term, ([], []))
                ids.append(i)
                tfs.append(tf)
        lens = np.asarray(self.doc_len, dtype=np.float64)
        self.idf: dict[str, float] = {}
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for term, (ids, tfs) in rows.items():
            idx = np.asarray(ids, dtype=np.int64)
            tf = np.asarray(tfs, dtype=np.float64)
            idf = math.log(1.0 + (self.n_docs - len(ids) + 0.5) / (len(ids) + 0.5))
            norm = k1 * (1.0 - b + b * lens[idx] / self.avgdl)
            self.idf[term] = idf
            self.postings[term] = (idx, idf * tf * (k1 + 1.0) / (tf + norm))

    def _scores(self, query: Sequence[str]) -> np.ndarray:
        out = np.zeros(self.n_docs, dtype=np.float64)
        for term in query:
            hit = self.postings.get(term)
            if hit is not None:
                out[hit[0]] += hit[1]  # doc ids are unique within a posting list, so fancy-index add is exact
        return out

    def scores(self, query: Sequence[str]) -> list[float]:
        """BM25 score of every document for the query tokens (repeated query tokens count again)."""
        return self._scores(query).tolist()

    def top(self, query: Sequence[str], k: int) -> list[tuple[int, float]]:
        """The k best (doc index, score) pairs with a positive score; ties keep corpus order, so results are stable."""
        scores = self._scores(query)
        idx = np.flatnonzero(scores > 0.0)
        order = np.lexsort((idx, -scores[idx]))[:k]  # primary key: score descending; then doc index
        return [(int(idx[j]), float(scores[idx[j]])) for j in order]
