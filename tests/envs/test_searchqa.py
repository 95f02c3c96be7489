"""SearchQA: answer normalisation, EM/F1, generated and file-based data, splits, the expert and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentevo.envs import make_env
from agentevo.envs.base import SIGNAL_INVALID, SIGNAL_REPEAT, TextEnv
from agentevo.envs.searchqa import (
    INVALID_OBSERVATION,
    NO_RESULTS_OBSERVATION,
    SearchQAEnv,
    exact_match,
    f1_score,
    normalize_answer,
)
from agentevo.errors import ConfigError


@pytest.fixture(scope="module")
def env() -> SearchQAEnv:
    return SearchQAEnv()


def test_normalisation_em_and_f1() -> None:
    assert normalize_answer("  The Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("A cat, an apple and the dog.") == "cat apple and dog"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert exact_match("the River Arlen.", ["river arlen"]) == 1.0
    assert exact_match("Arlen river", ["river arlen"]) == 0.0
    assert exact_match("1905", ["1904", "1905"]) == 1.0
    # pred 'big red car' vs gold 'red car': precision 2/3, recall 1 -> F1 = 0.8
    assert f1_score("big red car", ["red car"]) == pytest.approx(0.8)
    assert f1_score("big red car", ["blue bike", "the red car"]) == pytest.approx(0.8)  # max over answers
    assert f1_score("nothing", ["red car"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to empty


def test_generated_splits_are_fixed_and_disjoint(env: SearchQAEnv) -> None:
    other = SearchQAEnv()
    ids = {}
    for split in ("train", "dev", "test"):
        tl = env.tasks(split)
        assert len(tl) > 30 and tl.hash == other.tasks(split).hash
        assert {t.task_type for t in tl.head(4)} == {"person", "city", "company", "bridge"}
        ids[split] = {t.task_id.split("/")[-1] for t in tl}
    assert not (ids["train"] & ids["dev"]) and not (ids["train"] & ids["test"]) and not (ids["dev"] & ids["test"])
    assert SearchQAEnv(seed=1).tasks("test").hash != env.tasks("test").hash
    assert len(SearchQAEnv(n_dev=4).tasks("dev")) == 4


@pytest.mark.parametrize("split", ["dev", "test"])
def test_expert_reaches_em_one(env: SearchQAEnv, split: str) -> None:
    for task in env.tasks(split):
        env.reset(task)
        for action in env.expert(task):
            obs, reward, done, info = env.step(action)
        assert done and reward == 1.0 and info["em"] == 1.0 and info["f1"] == 1.0, task.task_id
        assert info["supported"] and info["success"], task.task_id


def test_actions_and_signals(env: SearchQAEnv) -> None:
    task = env.tasks("dev")[0]
    first, info = env.reset(task)
    assert first == f"Question: {info['goal']}" and info["task_type"] == task.task_type
    for bad in ("look around", "search[]", "answer[ ]"):
        obs, r, done, _ = env.step(bad)
        assert (obs, r, done) == (INVALID_OBSERVATION, 0.0, False)
        assert env.signals(first, bad, obs, True) == SIGNAL_INVALID
    obs, _, _, info = env.step(f"search[{task.params['question']}]")
    assert obs.startswith("Doc 1 (Title: ") and obs.count("\nDoc ") == 2  # top_k = 3
    again, _, _, _ = env.step(f"SEARCH[{task.params['question']}]")
    assert env.signals(obs, "search", again, True) == SIGNAL_REPEAT
    assert env.step("answer[somewhere else]")[2] is True  # an answer always ends the episode


def test_wrong_answer_and_truncation(env: SearchQAEnv) -> None:
    task = env.tasks("test")[0]
    env.reset(task)
    _, reward, done, info = env.step(f"answer[{task.params['answers'][0]} city]")
    assert done and reward == 0.0 and info["em"] == 0.0 and 0.0 < info["f1"] < 1.0
    assert info["supported"] is False  # nothing was retrieved
    short = SearchQAEnv(max_steps=2)
    short.reset(short.tasks("test")[0])
    assert short.step("search[zzzz qqqq]")[0] == NO_RESULTS_OBSERVATION
    _, _, done, info = short.step("search[again]")
    assert done and info["truncated"] and info["score"] == 0.0


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


CORPUS = [
    {"id": "d1", "title": "Mount Vell", "text": "Mount Vell is the highest peak of the Oron range."},
    {"id": "d2", "title": "Oron range", "text": "The Oron range lies in northern Tavia."},
    {"id": "d3", "title": "Tavia", "text": "Tavia is a small country whose capital is Lume."},
    {"id": "d4", "title": "Lume", "text": "Lume is a port city with a famous lighthouse."},
]
QUESTIONS = [
    {"id": "a", "question": "Which range is Mount Vell part of?", "answers": ["the Oron range", "Oron"],
     "split": "train", "type": "geo", "gold_passage_ids": ["d1"]},
    {"id": "b", "question": "What is the capital of Tavia?", "answers": ["Lume"], "split": "dev"},
    {"id": "c", "question": "In which country is the range of Mount Vell?", "answers": ["Tavia"], "split": "test",
     "type": "bridge", "gold_passage_ids": ["d1", "d2"]},
]


def test_files_by_path(tmp_path: Path) -> None:
    corpus = _write(tmp_path / "corpus.jsonl", CORPUS)
    questions = _write(tmp_path / "questions.jsonl", QUESTIONS)
    qa = make_env("searchqa", corpus_path=corpus, questions_path=questions, top_k=2)
    assert isinstance(qa, TextEnv) and qa.final_reward_mode == "last"
    assert [len(qa.tasks(s)) for s in ("train", "dev", "test")] == [1, 1, 1]
    assert qa.tasks("dev")[0].task_type == "qa" and qa.tasks("test")[0].task_type == "bridge"
    assert [p.id for p in qa.search("Mount Vell range")] == ["d1", "d2"]
    for split in ("train", "dev", "test"):
        task = qa.tasks(split)[0]
        qa.reset(task)
        for action in qa.expert(task):
            _, reward, done, info = qa.step(action)
        assert done and reward == 1.0, task.task_id
    # the same files give the same hashes; a changed corpus changes them (tasks carry the corpus digest)
    assert SearchQAEnv(corpus, questions).tasks("test").hash == qa.tasks("test").hash
    changed = _write(tmp_path / "corpus2.jsonl", CORPUS + [{"id": "d5", "title": "x", "text": "y"}])
    other = SearchQAEnv(changed, questions)
    assert other.tasks("test").hash != qa.tasks("test").hash
    with pytest.raises(ConfigError, match="corpus"):
        other.reset(qa.tasks("test")[0])


@pytest.mark.parametrize(
    ("corpus_rows", "question_rows", "message"),
    [
        (CORPUS, [{"id": "x", "question": "q", "answers": ["a"]}], "missing key"),
        (CORPUS, [{"id": "x", "question": "q", "answers": [], "split": "dev"}], "non-empty list"),
        (CORPUS, [{"id": "x", "question": "q", "answers": ["a"], "split": "valid"}], "split 'valid'"),
        (CORPUS, [{**QUESTIONS[0], "gold_passage_ids": ["d9"]}], "d9"),
        (CORPUS, QUESTIONS + [QUESTIONS[0]], "duplicate question id"),
        ([{"id": "d1", "text": "no title"}], QUESTIONS, "missing key"),
        (CORPUS + [CORPUS[0]], QUESTIONS, "duplicate passage id"),
    ],
)
def test_invalid_files(tmp_path: Path, corpus_rows: list, question_rows: list, message: str) -> None:
    corpus = _write(tmp_path / "c.jsonl", corpus_rows)
    questions = _write(tmp_path / "q.jsonl", question_rows)
    with pytest.raises(ConfigError, match=message):
        SearchQAEnv(corpus, questions)


def test_missing_and_broken_paths(tmp_path: Path) -> None:
    questions = _write(tmp_path / "q.jsonl", QUESTIONS)
    with pytest.raises(ConfigError, match="corpus file not found: .*nope.jsonl"):
        SearchQAEnv(str(tmp_path / "nope.jsonl"), questions)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(CORPUS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match="line 2: not valid JSON"):
        SearchQAEnv(str(broken), questions)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        SearchQAEnv(str(empty), questions)
    with pytest.raises(ConfigError, match="both corpus_path and questions_path"):
        SearchQAEnv(corpus_path=questions)
    with pytest.raises(ConfigError):
        SearchQAEnv().step("search[x]")
