"""The local WebShop: BM25, catalogue, pages and clickables, WebShop's purchase reward, splits and the expert."""

from __future__ import annotations

import math

import pytest

from agentevo.envs import make_env
from agentevo.envs.base import SIGNAL_FORMAT, SIGNAL_INVALID, SIGNAL_NONE, SIGNAL_REPEAT, Task, TextEnv
from agentevo.envs.bm25 import BM25, tokenize
from agentevo.envs.webshop import INVALID_OBSERVATION, LocalWebShop, WebShopEnv
from agentevo.envs.webshop_catalogue import CATEGORIES, Product, check_catalogue, purchase_reward
from agentevo.errors import ConfigError, MissingDependencyError


@pytest.fixture(scope="module")
def env() -> WebShopEnv:
    return WebShopEnv(backend="local")


def _play(env: WebShopEnv, task: Task, actions: list[str]) -> tuple[str, float, bool, dict]:
    env.reset(task)
    out: tuple[str, float, bool, dict] = ("", 0.0, False, {})
    for a in actions:
        out = env.step(a)
    return out


# -- BM25 ---------------------------------------------------------------------------------------------------
def test_bm25_hand_computed() -> None:
    docs = [["apple", "banana"], ["apple", "apple", "cherry"], ["cherry"]]
    bm = BM25(docs)  # k1 = 1.5, b = 0.75, avgdl = 6 / 3 = 2
    # idf(apple) = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln(1.6)
    idf = math.log(1.6)
    # doc 0: tf 1, |D| = 2 -> norm = 1.5 * (0.25 + 0.75 * 2 / 2) = 1.5 -> 1 * 2.5 / (1 + 1.5) = 1
    # doc 1: tf 2, |D| = 3 -> norm = 1.5 * (0.25 + 0.75 * 1.5) = 2.0625 -> 2 * 2.5 / 4.0625
    expected = [idf * 1.0, idf * 5.0 / 4.0625, 0.0]
    assert bm.scores(["apple"]) == pytest.approx(expected)
    assert [i for i, _ in bm.top(["apple"], 5)] == [1, 0]  # doc 2 scores 0 and is not returned
    # idf(cherry) = ln(1 + 1.5 / 2.5) as well; doc 2 is short (|D| = 1) so it beats doc 1 on 'cherry'.
    assert [i for i, _ in bm.top(["cherry"], 5)] == [2, 1]
    assert bm.top(["durian"], 5) == []
    assert tokenize("Clip-In, 12 Ounce!") == ["clip", "in", "12", "ounce"]


# -- catalogue and reward -----------------------------------------------------------------------------------
def test_catalogue_is_consistent(env: WebShopEnv) -> None:
    cat = env.impl.cat
    assert len(cat.products) == 600
    assert {p.category for p in cat.products} == set(CATEGORIES)
    assert len({p.asin for p in cat.products}) == 600
    assert check_catalogue(cat) == []


def _product(**kw: object) -> Product:
    base: dict = dict(
        asin="B000000001", category="beauty", department="skin care", product_type="face cream", brand="Velora",
        title="Velora Face Cream, Paraben Free, Cruelty Free", attributes=("paraben free", "cruelty free", "non greasy"),
        options={"size": ("1.7 ounce", "3.4 ounce"), "scent": ("lavender", "vanilla")}, price=18.0,
        description="A cream.", features=("PARABEN FREE - made with care",), reviews=("Rating: 5 out of 5",),
    )
    base.update(kw)
    return Product(**base)


GOAL = {
    "asin": "B000000001", "instruction": "...", "category": "beauty", "department": "skin care",
    "product_type": "face cream", "name_nouns": ["cream", "face", "velora"],
    "attributes": ["paraben free", "non greasy"], "options": {"size": "3.4 ounce", "scent": "vanilla"},
    "price_upper": 30.0,
}


def test_reward_hand_made_cases() -> None:
    p = _product()
    right = {"size": "3.4 ounce", "scent": "vanilla"}
    # all 2 attributes + 2 options + price match, type matches: 5 / 5
    assert purchase_reward(p, GOAL, 18.0, right)[0] == 1.0
    # a wrong option: (2 + 1 + 1) / 5
    assert purchase_reward(p, GOAL, 18.0, {"size": "1.7 ounce", "scent": "vanilla"})[0] == pytest.approx(0.8)
    # over the price bound: (2 + 2 + 0) / 5
    assert purchase_reward(p, GOAL, 31.0, right)[0] == pytest.approx(0.8)
    # no option chosen at all: (2 + 0 + 1) / 5
    assert purchase_reward(p, GOAL, 18.0, {})[0] == pytest.approx(0.6)
    # one attribute missing and one wrong option: (1 + 1 + 1) / 5
    q = _product(attributes=("paraben free", "cruelty free"), features=())
    assert purchase_reward(q, GOAL, 18.0, {"size": "3.4 ounce", "scent": "lavender"})[0] == pytest.approx(0.6)


def test_reward_type_term() -> None:
    right = {"size": "3.4 ounce", "scent": "vanilla"}
    # Same department, but no noun of the target name in the title: title_score 0 -> r_type 0.
    lotion = _product(product_type="body lotion", brand="Kelmi", title="Kelmi Body Lotion, Paraben Free, Non Greasy")
    r, parts = purchase_reward(lotion, GOAL, 18.0, right)
    assert (r, parts["category_match"], parts["title_score"]) == (0.0, True, 0.0)
    # Another category, but the brand is one of three nouns: title_score 1/3 > 0.2 -> r_type 1.
    shampoo = _product(category="food", department="snacks", product_type="trail mix", title="Velora Trail Mix")
    assert purchase_reward(shampoo, GOAL, 18.0, right)[1]["r_type"] == 1.0
    # No query / category match and title_score 1/6 (between 0.1 and 0.2): r_type 0.5 -> 0.5 * 5 / 5.
    goal6 = {**GOAL, "name_nouns": ["velora", "face", "cream", "jar", "pot", "tube"], "product_type": "x",
             "department": "y", "category": "z"}
    r, parts = purchase_reward(_product(title="Velora Thing, Paraben Free, Non Greasy"), goal6, 18.0, right)
    assert parts["title_score"] == pytest.approx(1 / 6)
    assert r == pytest.approx(0.5)


# -- pages and clickables -----------------------------------------------------------------------------------
def test_pages_clickables_and_signals() -> None:
    env = WebShopEnv(backend="local", max_steps=50)  # this walk takes more than the default 15 steps
    task = env.tasks("dev")[0]
    start, info = env.reset(task)
    assert start.startswith("WebShop [SEP] Instruction: [SEP] ") and info["goal"] in start
    assert info["task_type"] == task.params["goal"]["category"]

    # Invalid click / empty search / click[search]: the page is unchanged -> repeat.
    for bad in ("click[Buy Now]", "search[   ]", "click[search]"):
        obs, r, done, _ = env.step(bad)
        assert (obs, r, done) == (start, 0.0, False)
        assert env.signals(start, bad, obs, True) == SIGNAL_REPEAT
    # Neither search[...] nor click[...]: the fixed invalid string; the page stays where it was.
    obs, _, _, _ = env.step("buy the cheapest one")
    assert obs == INVALID_OBSERVATION and env.signals(start, "x", obs, True) == SIGNAL_INVALID
    assert env.signals(start, "x", obs, False) == SIGNAL_FORMAT

    page1, _, _, info = env.step("search[free]")
    assert "Page 1 (Total results: 50)" in page1 and "Next >" in page1 and "< Prev" not in page1
    assert env.signals(start, "search[free]", page1, True) == SIGNAL_NONE
    assert info["available_actions"]["clickables"][:2] == ["back to search", "next >"]
    page2, _, _, _ = env.step("CLICK[next >]")  # verb and value are case-insensitive
    assert page2.startswith("Back to Search [SEP] Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >")
    for _ in range(3):
        last, _, _, _ = env.step("click[Next >]")
    assert "Page 5" in last and "Next >" not in last
    assert env.step("click[Next >]")[0] == last  # no Next > on the last page
    for _ in range(4):
        obs, _, _, _ = env.step("click[< Prev]")
    assert obs == page1

    asin = page1.split(" [SEP] ")[3]
    item, _, _, _ = env.step(f"click[{asin.lower()}]")
    assert item.startswith("Back to Search [SEP] < Prev") and item.endswith("Buy Now")
    product = env.impl.cat.by_asin[asin]
    value = next(iter(product.options.values()))[0]
    chosen, _, _, _ = env.step(f"click[{value}]")
    assert f"You have clicked {value}." in chosen
    assert env.step(f"click[{value}]")[0] == chosen  # clicking it again changes nothing
    desc, _, _, _ = env.step("click[Description]")
    assert desc == f"Back to Search [SEP] < Prev [SEP] {product.description}"
    assert env.step("click[< Prev]")[0] == chosen  # back to the item page, options kept
    assert env.step("click[< Prev]")[0] == page1  # back to the results page
    assert env.step("click[Back to Search]")[0] == start


def test_max_steps_truncates() -> None:
    shop = WebShopEnv(backend="local", max_steps=3)
    task = shop.tasks("test")[0]
    shop.reset(task)
    results = [shop.step("click[nothing]") for _ in range(3)]
    assert [d for _, _, d, _ in results] == [False, False, True]
    assert results[-1][3]["truncated"] and results[-1][3]["score"] == 0.0
    assert shop.step("search[x]")[2] is True  # stays done


def test_wrong_option_through_the_env(env: WebShopEnv) -> None:
    task = env.tasks("test")[1]
    goal = task.params["goal"]
    product = env.impl.cat.by_asin[goal["asin"]]
    group = next(iter(goal["options"]))
    wrong = next(v for v in product.options[group] if v != goal["options"][group])
    actions = [a if a != f"click[{goal['options'][group]}]" else f"click[{wrong}]" for a in env.expert(task)]
    obs, reward, done, info = _play(env, task, actions)
    n_opt = len(goal["options"])
    assert done and info["bought"] and not info["success"]
    assert reward == pytest.approx((2 + n_opt - 1 + 1) / (2 + n_opt + 1))
    assert obs.startswith("Thank you for shopping with us!")


# -- splits, expert, backends -------------------------------------------------------------------------------
def test_splits_are_fixed_and_disjoint(env: WebShopEnv) -> None:
    other = WebShopEnv(backend="local")
    ids = {}
    for split, n in (("train", 450), ("dev", 50), ("test", 100)):
        tl = env.tasks(split)
        assert len(tl) == n and tl.hash == other.tasks(split).hash
        assert {t.task_type for t in tl.head(5)} == set(CATEGORIES)  # heads cover every category
        ids[split] = {t.params["goal"]["asin"] for t in tl}
    assert not (ids["train"] & ids["dev"]) and not (ids["train"] & ids["test"]) and not (ids["dev"] & ids["test"])
    assert WebShopEnv(backend="local", seed=1).tasks("test").hash != env.tasks("test").hash
    assert len(WebShopEnv(backend="local", n_test=7).tasks("test")) == 7


@pytest.mark.parametrize("split", ["train", "dev", "test"])
def test_expert_reaches_reward_one(env: WebShopEnv, split: str) -> None:
    for task in env.tasks(split):  # every goal, including those whose target is on results page 2
        actions = env.expert(task)
        assert len(actions) <= task.max_steps
        _, reward, done, info = _play(env, task, actions)
        assert done and reward == 1.0 and info["success"] and info["won"], task.task_id


def test_backends_and_errors(env: WebShopEnv) -> None:
    with pytest.raises(MissingDependencyError, match="setup.sh"):
        WebShopEnv(backend="real")
    assert WebShopEnv(backend="auto").backend == "local"  # web_agent_site is not installed here
    with pytest.raises(ConfigError):
        WebShopEnv(backend="amazon")
    small = LocalWebShop(n_products=60)
    with pytest.raises(ConfigError, match="catalogue"):
        small.reset(env.tasks("dev")[0])
    with pytest.raises(ConfigError):
        env.tasks("valid")
    built = make_env("webshop", backend="local", n_dev=3)
    assert isinstance(built, TextEnv) and built.final_reward_mode == "last"
    assert len(built.tasks("dev")) == 3 and "search[" in built.instruction()


def test_expert_paginates_and_the_shop_needs_reading(env: WebShopEnv) -> None:
    assert any("click[Next >]" in env.expert(t) for t in env.tasks("train"))
    # A shopper who buys the first result with the stated options succeeds on only part of the goals: near-twin
    # products (same attributes, other options and price) make the item page worth reading.
    wins = []
    for task in env.tasks("test"):
        goal = task.params["goal"]
        env.reset(task)
        page, _, _, _ = env.step(f"search[{' '.join(goal['attributes'])} {goal['product_type']}]")
        env.step(f"click[{page.split(' [SEP] ')[3]}]")
        for value in goal["options"].values():
            env.step(f"click[{value}]")
        wins.append(env.step("click[Buy Now]")[1] == 1.0)
    assert 0.3 < sum(wins) / len(wins) < 0.8
