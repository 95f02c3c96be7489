"""SearchQA behind the TextEnv contract: search[query] over a local BM25 corpus, answer[text] scored by exact match.

The corpus and questions come from JSONL files (corpus: {"id","title","text"}; questions: {"id","question",
"answers":[...],"split":"train|dev|test","type"?,"gold_passage_ids"?}) or, with no paths, from a small corpus of
fictional people, cities and companies generated from a seed, so tests and demos run offline.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.envs.bm25 import BM25, tokenize
from agentevo.errors import ConfigError

INVALID_OBSERVATION = "Invalid action! Use search[<query>] or answer[<short answer>]."
INVALID_PATTERNS = ("Invalid action!",)
NO_RESULTS_OBSERVATION = "No passages found for this query."

INSTRUCTION = (
    "Answer a factual question using a local encyclopedia. Actions: search[<query>] returns the top passages for "
    "the query; answer[<text>] ends the episode with your final answer, which must be short (a name, place, "
    "year or phrase) and is scored by exact match. Reply with one line 'Thought: <your reasoning>' and one line "
    "'Action: <action>'."
)

_ACTION = re.compile(r"^\s*(search|answer)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: list[str]) -> float:
    """SQuAD token F1 of the prediction, maximised over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for ans in answers:
        gold = normalize_answer(ans).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        if common == 0:
            continue
        precision, recall = common / len(pred), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def parse_action(action: str) -> tuple[str, str] | None:
    """('search' | 'answer', argument) for a well-formed action, None otherwise."""
    m = _ACTION.match(action)
    if m is None:
        return None
    return m.group(1).lower(), m.group(2).strip()


@dataclass(frozen=True)
class Passage:
    """One corpus passage."""

    id: str
    title: str
    text: str


# -- the generated corpus ---------------------------------------------------------------------------------------
_SYL = ["ka", "lo", "mi", "ren", "sa", "tor", "vel", "dra", "nu", "bel", "fi", "gor", "ha", "zen", "ul", "vo",
        "ri", "an", "te", "mor"]
_COUNTRIES = ["Valdoria", "Esteran", "Korvania", "Miraleth", "Ostrelle", "Tavinor", "Quenmark", "Zephyria"]
_RIVERS = ["Arlen", "Brisk", "Cendra", "Dorvel", "Elmira", "Fenwick", "Galen", "Hollis", "Istra", "Juno"]
_CITY_SUFFIX = ["ford", "heim", "grad", "ton", "mouth", "vale", "burg", "port"]
_PROFESSIONS = ["painter", "astronomer", "architect", "composer", "botanist", "novelist", "engineer",
                "cartographer", "sculptor", "physician"]
_PRODUCTS = ["clocks", "bicycles", "telescopes", "ceramics", "sailcloth", "maps", "lanterns", "typewriters"]
_COMPANY_SUFFIX = ["Industries", "Works", "Labs", "Foundry", "Mills"]
_GEN_SPLIT = {"test": 0.2, "dev": 0.1}


def _name(rng: random.Random, used: set[str], parts: int, suffixes: list[str] | None = None) -> str:
    while True:
        word = "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()
        if suffixes:
            word += rng.choice(suffixes)
        if word not in used:
            used.add(word)
            return word


def generate_dataset(
    seed: int = 0, n_people: int = 60, n_cities: int = 24, n_companies: int = 30
) -> tuple[list[Passage], list[dict[str, Any]]]:
    """A fictional encyclopedia (one passage per person / city / company) and questions about it, with splits.

    Question types: "person" (birth city, birth year, profession), "city" (country, river, founding year),
    "company" (founder, product, headquarters) and "bridge" (birth city of a company's founder: two passages).
    """
    rng = random.Random(seed)
    used: set[str] = set()
    passages: list[Passage] = []
    questions: list[dict[str, Any]] = []

    def add_passage(title: str, text: str) -> str:
        pid = f"p{len(passages):04d}"
        passages.append(Passage(pid, title, text))
        return pid

    def ask(qtype: str, question: str, answer: str, gold: list[str]) -> None:
        questions.append({"id": f"q{len(questions):04d}", "question": question, "answers": [answer],
                          "type": qtype, "gold_passage_ids": gold})

    cities = []
    for _ in range(n_cities):
        city = {"name": _name(rng, used, 2, _CITY_SUFFIX), "country": rng.choice(_COUNTRIES),
                "river": rng.choice(_RIVERS), "founded": str(rng.randint(900, 1700))}
        city["pid"] = add_passage(city["name"], (
            f"{city['name']} is a city in {city['country']}, on the banks of the {city['river']} river. "
            f"It was founded in {city['founded']} and is known for its markets and old bridges."))
        cities.append(city)
    people = []
    for _ in range(n_people):
        first, last = _name(rng, used, 2), _name(rng, used, rng.choice((2, 3)))
        city = rng.choice(cities)
        person = {"name": f"{first} {last}", "city": city["name"], "year": str(rng.randint(1750, 1990)),
                  "profession": rng.choice(_PROFESSIONS)}
        person["pid"] = add_passage(person["name"], (
            f"{person['name']} (born {person['year']}) is a {person['profession']} from {city['name']}, "
            f"{city['country']}. {first} was born in {city['name']} in {person['year']}."))
        people.append(person)
    companies = []
    for _ in range(n_companies):
        founder, hq = rng.choice(people), rng.choice(cities)
        comp = {"name": f"{_name(rng, used, 2)} {rng.choice(_COMPANY_SUFFIX)}", "founder": founder,
                "hq": hq["name"], "product": rng.choice(_PRODUCTS), "year": str(rng.randint(1850, 2015))}
        comp["pid"] = add_passage(comp["name"], (
            f"{comp['name']} is a maker of {comp['product']} founded in {comp['year']} by {founder['name']}. "
            f"Its headquarters are in {hq['name']}."))
        companies.append(comp)

    for p in people:
        ask("person", f"In which city was {p['name']} born?", p["city"], [p["pid"]])
        ask("person", f"In what year was {p['name']} born?", p["year"], [p["pid"]])
        ask("person", f"What is the profession of {p['name']}?", p["profession"], [p["pid"]])
    for c in cities:
        ask("city", f"In which country is the city of {c['name']}?", c["country"], [c["pid"]])
        ask("city", f"Which river flows through {c['name']}?", c["river"], [c["pid"]])
        ask("city", f"In what year was {c['name']} founded?", c["founded"], [c["pid"]])
    for c in companies:
        ask("company", f"Who founded {c['name']}?", c["founder"]["name"], [c["pid"]])
        ask("company", f"What does {c['name']} make?", c["product"], [c["pid"]])
        ask("company", f"In which city is {c['name']} headquartered?", c["hq"], [c["pid"]])
        ask("bridge", f"In which city was the founder of {c['name']} born?", c["founder"]["city"],
            [c["pid"], c["founder"]["pid"]])

    # Fixed splits: per type, shuffle then cut (20% test, 10% dev, rest train).
    split_rng = random.Random(f"splits-{seed}")
    for qtype in sorted({q["type"] for q in questions}):
        group = [q for q in questions if q["type"] == qtype]
        split_rng.shuffle(group)
        n_test, n_dev = round(len(group) * _GEN_SPLIT["test"]), round(len(group) * _GEN_SPLIT["dev"])
        for k, q in enumerate(group):
            q["split"] = "test" if k < n_test else "dev" if k < n_test + n_dev else "train"
    return passages, questions


# -- file loading ---------------------------------------------------------------------------------------------
def _read_jsonl(path: str, what: str) -> tuple[list[dict[str, Any]], str]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"SearchQA {what} file not found: {path}")
    raw = p.read_bytes()
    rows = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"SearchQA {what} file {path}, line {n}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"SearchQA {what} file {path}, line {n}: expected a JSON object")
        rows.append(row)
    if not rows:
        raise ConfigError(f"SearchQA {what} file {path} is empty")
    return rows, hashlib.sha256(raw).hexdigest()[:16]


def _load_corpus(path: str) -> tuple[list[Passage], str]:
    rows, digest = _read_jsonl(path, "corpus")
    passages, seen = [], set()
    for n, row in enumerate(rows, start=1):
        missing = [k for k in ("id", "title", "text") if k not in row]
        if missing:
            raise ConfigError(f"SearchQA corpus file {path}, record {n}: missing key(s) {', '.join(missing)}")
        pid = str(row["id"])
        if pid in seen:
            raise ConfigError(f"SearchQA corpus file {path}: duplicate passage id {pid!r}")
        seen.add(pid)
        passages.append(Passage(pid, str(row["title"]), str(row["text"])))
    return passages, digest


def _load_questions(path: str, passage_ids: set[str]) -> list[dict[str, Any]]:
    rows, _ = _read_jsonl(path, "questions")
    out, seen = [], set()
    for n, row in enumerate(rows, start=1):
        where = f"SearchQA questions file {path}, record {n}"
        missing = [k for k in ("id", "question", "answers", "split") if k not in row]
        if missing:
            raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
        answers = row["answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise ConfigError(f"{where}: 'answers' must be a non-empty list of strings")
        if row["split"] not in SPLITS:
            raise ConfigError(f"{where}: split {row['split']!r} is not one of {', '.join(SPLITS)}")
        gold = [str(g) for g in row.get("gold_passage_ids", [])]
        unknown = [g for g in gold if g not in passage_ids]
        if unknown:
            raise ConfigError(f"{where}: gold_passage_ids not in the corpus: {', '.join(unknown)}")
        qid = str(row["id"])
        if qid in seen:
            raise ConfigError(f"SearchQA questions file {path}: duplicate question id {qid!r}")
        seen.add(qid)
        out.append({"id": qid, "question": str(row["question"]), "answers": list(answers), "split": row["split"],
                    "type": str(row.get("type", "qa")), "gold_passage_ids": gold})
    return out


def _interleave_by_type(questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Round-robin over types (in order of first appearance) so any head of a split covers every type.
    groups: dict[str, list[dict[str, Any]]] = {}
    for q in questions:
        groups.setdefault(q["type"], []).append(q)
    lists = list(groups.values())
    longest = max((len(x) for x in lists), default=0)
    return [x[k] for k in range(longest) for x in lists if k < len(x)]


class SearchQAEnv:
    """Retrieval QA: search[query] shows the top_k BM25 passages, answer[text] ends the episode (reward = EM)."""

    name = "searchqa"
    final_reward_mode = "last"

    def __init__(
        self,
        corpus_path: str | None = None,
        questions_path: str | None = None,
        top_k: int = 3,
        max_steps: int = 5,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        seed: int = 0,
    ) -> None:
        if (corpus_path is None) != (questions_path is None):
            raise ConfigError("SearchQA needs both corpus_path and questions_path, or neither (generated data)")
        if top_k < 1:
            raise ConfigError(f"top_k must be >= 1 (got {top_k})")
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (got {max_steps})")
        if corpus_path is None or questions_path is None:
            self.passages, questions = generate_dataset(seed)
            self.corpus_key = f"generated:seed={seed}"
        else:
            self.passages, digest = _load_corpus(corpus_path)
            questions = _load_questions(questions_path, {p.id for p in self.passages})
            self.corpus_key = f"file:{digest}"
        self.by_id = {p.id: p for p in self.passages}
        # Title and text are indexed together, so a query naming an entity finds its passage.
        self.index = BM25([tokenize(f"{p.title} {p.text}") for p in self.passages])
        self.questions = {s: _interleave_by_type([q for q in questions if q["split"] == s]) for s in SPLITS}
        self.top_k = top_k
        self.max_steps = max_steps
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self._task: Task | None = None
        self._steps = 0
        self._done = False
        self._retrieved: list[str] = []
        self._info: dict[str, Any] = {}

    def tasks(self, split: str) -> TaskList:
        """The split's questions (types interleaved), first n_<split> of them."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        qs = self.questions[split]
        limit = self.limits[split]
        if limit is not None:
            qs = qs[:limit]
        tasks = tuple(
            Task(
                env=self.name,
                task_id=f"searchqa/{split}/{q['id']}",
                split=split,
                task_type=q["type"],
                params={"corpus": self.corpus_key, "question": q["question"], "answers": q["answers"],
                        "gold_passage_ids": q["gold_passage_ids"]},
                max_steps=self.max_steps,
            )
            for q in qs
        )
        return TaskList(self.name, split, tasks)

    def search(self, query: str) -> list[Passage]:
        """The top_k passages for a query (BM25 over title + text)."""
        return [self.passages[i] for i, _ in self.index.top(tokenize(query), self.top_k)]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Show the question."""
        if task.params.get("corpus") != self.corpus_key:
            raise ConfigError(
                f"task {task.task_id} was made for corpus {task.params.get('corpus')!r}, but this env serves "
                f"{self.corpus_key!r}; build the env with the same files or seed"
            )
        self._task = task
        self._steps = 0
        self._done = False
        self._retrieved = []
        self._info = {"score": 0.0, "success": False, "won": False}
        question = task.params["question"]
        return f"Question: {question}", {"goal": question, "task_type": task.task_type, **self._info}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """search[...] returns passages; answer[...] ends the episode with reward EM (F1, support in info)."""
        if self._task is None:
            raise ConfigError("call reset(task) before step()")
        if self._done:
            return "The episode is over.", 0.0, True, dict(self._info)
        self._steps += 1
        parsed = parse_action(action)
        reward = 0.0
        if parsed is None or not parsed[1]:
            obs = INVALID_OBSERVATION
        elif parsed[0] == "search":
            hits = self.search(parsed[1])
            self._retrieved += [p.id for p in hits if p.id not in self._retrieved]
            obs = "\n".join(f"Doc {k} (Title: {p.title}) {p.text}" for k, p in enumerate(hits, 1))
            obs = obs or NO_RESULTS_OBSERVATION
        else:
            answer = parsed[1]
            answers = self._task.params["answers"]
            em = exact_match(answer, answers)
            norm = normalize_answer(answer)
            # RSD's precedent filter: the answer is "supported" if it occurs in a passage the agent retrieved.
            supported = bool(norm) and any(
                f" {norm} " in f" {normalize_answer(self.by_id[pid].title + ' ' + self.by_id[pid].text)} "
                for pid in self._retrieved
            )
            reward = em
            self._info.update(score=em, success=em == 1.0, won=em == 1.0, em=em, f1=f1_score(answer, answers),
                              supported=supported, answer=answer)
            self._done = True
            obs = f"Your answer: {answer}. Episode finished."
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            self._info.update(truncated=True, em=0.0, f1=0.0, supported=False)
        info = {**self._info, "steps": self._steps, "retrieved": list(self._retrieved)}
        return obs, reward, self._done, info

    def expert(self, task: Task) -> list[str]:
        """Search the question, then the title of each gold passage not yet retrieved, then give the gold answer."""
        actions = [f"search[{task.params['question']}]"]
        seen = {p.id for p in self.search(task.params["question"])}
        for pid in task.params.get("gold_passage_ids", []):
            if pid not in seen and len(actions) < self.max_steps - 1:
                title = self.by_id[pid].title
                actions.append(f"search[{title}]")
                seen |= {p.id for p in self.search(title)}
        actions.append(f"answer[{task.params['answers'][0]}]")
        return actions

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid (INVALID_OBSERVATION) / repeat (same passages again) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        return INSTRUCTION

    def close(self) -> None:
        """Nothing to release."""
