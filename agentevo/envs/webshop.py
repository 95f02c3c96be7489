"""WebShop behind the TextEnv contract: a local generated shop that speaks WebShop's text protocol, or the real one.

Protocol (both backends): actions are `search[keywords]` and `click[value]`, where value is one of the clickables
on the current page (case-insensitive). An invalid click or an empty search does nothing: the page text comes back
unchanged, which the repeat rule labels. An action that is neither search[...] nor click[...] returns
INVALID_OBSERVATION and leaves the page as it was. The episode ends at click[Buy Now] (reward = WebShop's purchase
score) or after max_steps steps (reward 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.envs.webshop_catalogue import (
    Catalogue,
    Product,
    get_catalogue,
    instruction_keywords,
    purchase_reward,
    split_goal_indices,
)
from agentevo.errors import ConfigError, MissingDependencyError

INVALID_OBSERVATION = "Invalid action! Use search[<keywords>] or click[<value>] with a value shown on the page."
INVALID_PATTERNS = ("Invalid action!",)
RESULTS_PER_PAGE = 10
MAX_RESULTS = 50  # WebShop's search engine returns the top 50 products
SUB_PAGES = ("Description", "Features", "Reviews")
SEP = " [SEP] "

INSTRUCTION = (
    "You are shopping on a website for a customer. Each page is shown as text with [SEP] between its elements. "
    "Actions: search[<keywords>] runs a search (it works on any page); click[<value>] clicks a button, product id "
    "or option shown on the current page (e.g. click[Back to Search], click[Next >], click[< Prev], click[B0XXXXXXXX], "
    "click[<option>], click[Description], click[Buy Now]). A click on something not on the page, or an empty search, "
    "does nothing. Choose the product and options that match the instruction, then click[Buy Now]. "
    "Reply with one line 'Thought: <your reasoning>' and one line 'Action: <action>'."
)

_ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """('search' | 'click', argument) for a well-formed action, None otherwise."""
    m = _ACTION.match(action)
    if m is None:
        return None
    return m.group(1).lower(), m.group(2).strip()


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


@dataclass(frozen=True)
class _Page:
    """Where the shopper is; the observation is a pure function of this (plus the catalogue)."""

    kind: str  # "search" | "results" | "item" | "sub" | "done"
    keywords: str = ""
    results: tuple[str, ...] = ()
    page_no: int = 1
    asin: str = ""
    sub: str = ""
    options: tuple[tuple[str, str], ...] = field(default=())  # (group, value) in the product's group order


class LocalWebShop:
    """The generated shop: search page, results pages, item pages with options and sub-pages, Buy Now."""

    name = "webshop"
    final_reward_mode = "last"
    backend = "local"

    def __init__(
        self,
        n_products: int = 600,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        max_steps: int = 15,
        seed: int = 0,
    ) -> None:
        if n_products < 30:
            raise ConfigError(f"n_products must be >= 30 so every category has products in every split (got {n_products})")
        if max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1 (got {max_steps})")
        self.cat: Catalogue = get_catalogue(seed, n_products)
        self.seed = seed
        self.max_steps = max_steps
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self._splits = split_goal_indices(self.cat, seed)
        self._task: Task | None = None
        self._goal: dict[str, Any] = {}
        self._page = _Page("search")
        self._steps = 0
        self._done = False
        self._info: dict[str, Any] = {}

    # -- tasks ---------------------------------------------------------------------------------
    def tasks(self, split: str) -> TaskList:
        """One goal per held-out product of the split, categories interleaved; the first n_<split> of them."""
        _check_split(split)
        idx = self._splits[split]
        limit = self.limits[split]
        if limit is not None:
            idx = idx[:limit]
        tasks = tuple(
            Task(
                env=self.name,
                task_id=f"webshop/{split}/{self.cat.goals[i]['asin']}",
                split=split,
                task_type=self.cat.goals[i]["category"],
                params={"catalogue": self.cat.key, "goal": self.cat.goals[i]},
                max_steps=self.max_steps,
            )
            for i in idx
        )
        return TaskList(self.name, split, tasks)

    # -- rendering -----------------------------------------------------------------------------
    def _product(self, asin: str) -> Product:
        return self.cat.by_asin[asin]

    def _render(self, page: _Page) -> str:
        if page.kind == "search":
            return SEP.join(["WebShop", "Instruction:", self._goal["instruction"], "Search"])
        if page.kind == "results":
            start = (page.page_no - 1) * RESULTS_PER_PAGE
            parts = ["Back to Search", f"Page {page.page_no} (Total results: {len(page.results)})"]
            if page.page_no > 1:
                parts.append("< Prev")
            if start + RESULTS_PER_PAGE < len(page.results):
                parts.append("Next >")
            for asin in page.results[start : start + RESULTS_PER_PAGE]:
                p = self._product(asin)
                parts += [p.asin, p.title, f"${p.price:.2f}"]
            return SEP.join(parts)
        p = self._product(page.asin)
        if page.kind == "item":
            # The real text mode does not show which options are selected; we do, so that a valid option click
            # changes the page and only a no-op click is a repeat.
            parts = ["Back to Search", "< Prev"] + [f"You have clicked {v}." for _, v in page.options]
            for group, values in p.options.items():
                parts += [group, *values]
            parts += [p.title, f"Price: ${p.price:.2f}", "Rating: N.A.", *SUB_PAGES, "Buy Now"]
            return SEP.join(parts)
        if page.kind == "sub":
            body = {"Description": [p.description], "Features": list(p.features), "Reviews": list(p.reviews)}[page.sub]
            return SEP.join(["Back to Search", "< Prev", *body])
        chosen = ", ".join(f"{g}: {v}" for g, v in page.options) or "none"
        return SEP.join([
            "Thank you for shopping with us!", "Purchased", p.asin, p.title, f"Options: {chosen}",
            "Your score (min 0.0, max 1.0)", f"{self._info.get('score', 0.0):.2f}",
        ])

    def clickables(self, page: _Page | None = None) -> list[str]:
        """Lower-cased clickable values of a page (the current one by default), as WebShop's get_available_actions."""
        page = page or self._page
        if page.kind == "results":
            start = (page.page_no - 1) * RESULTS_PER_PAGE
            out = ["back to search"]
            if page.page_no > 1:
                out.append("< prev")
            if start + RESULTS_PER_PAGE < len(page.results):
                out.append("next >")
            return out + [a.lower() for a in page.results[start : start + RESULTS_PER_PAGE]]
        if page.kind == "item":
            values = [v for vals in self._product(page.asin).options.values() for v in vals]
            return ["back to search", "< prev", *values, *(s.lower() for s in SUB_PAGES), "buy now"]
        if page.kind == "sub":
            return ["back to search", "< prev"]
        return []

    # -- transitions ---------------------------------------------------------------------------
    def _search(self, keywords: str) -> _Page:
        results = tuple(p.asin for p in self.cat.search(keywords, MAX_RESULTS))
        return _Page("results", keywords=keywords, results=results, page_no=1)

    def _click(self, page: _Page, value: str) -> _Page:
        if value == "back to search":
            return _Page("search")
        if page.kind == "results":
            if value == "next >":
                return replace(page, page_no=page.page_no + 1)
            if value == "< prev":
                return replace(page, page_no=page.page_no - 1)
            return replace(page, kind="item", asin=value.upper(), options=())
        if page.kind == "item":
            if value == "< prev":
                return replace(page, kind="results", asin="", options=())
            if value in ("description", "features", "reviews"):
                return replace(page, kind="sub", sub=value.capitalize())
            if value == "buy now":
                return replace(page, kind="done")
            groups = self._product(page.asin).options
            chosen = dict(page.options)
            chosen[next(g for g, vals in groups.items() if value in vals)] = value
            return replace(page, options=tuple((g, chosen[g]) for g in groups if g in chosen))
        # sub page: "< prev" goes back to the item page with its options
        return replace(page, kind="item", sub="")

    # -- contract ------------------------------------------------------------------------------
    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Open the shop's search page for the task's goal."""
        if task.params.get("catalogue") != self.cat.key:
            raise ConfigError(
                f"task {task.task_id} was made for catalogue {task.params.get('catalogue')!r}, but this env serves "
                f"{self.cat.key!r}; build the env with the same seed and n_products"
            )
        self._task = task
        self._goal = task.params["goal"]
        self._page = _Page("search")
        self._steps = 0
        self._done = False
        self._info = {"score": 0.0, "success": False, "won": False, "bought": False}
        info = {"goal": self._goal["instruction"], "task_type": task.task_type, **self._info,
                "available_actions": self.available_actions()}
        return self._render(self._page), info

    def available_actions(self) -> dict[str, Any]:
        """WebShop's available-actions dict: whether a search bar is shown, and the page's clickables."""
        return {"has_search_bar": self._page.kind == "search", "clickables": self.clickables()}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply one action; reward is WebShop's purchase score on click[Buy Now], 0 otherwise."""
        if self._task is None:
            raise ConfigError("call reset(task) before step()")
        if self._done:
            return self._render(self._page), 0.0, True, dict(self._info)
        self._steps += 1
        parsed = parse_action(action)
        reward = 0.0
        if parsed is None:
            obs = INVALID_OBSERVATION
        else:
            verb, arg = parsed
            if verb == "search" and arg:
                self._page = self._search(arg)
            elif verb == "click" and arg.lower() in self.clickables():
                self._page = self._click(self._page, arg.lower())
            # anything else (unknown click target, empty search) leaves the page as it was
            if self._page.kind == "done":
                product = self._product(self._page.asin)
                reward, parts = purchase_reward(product, self._goal, product.price, dict(self._page.options))
                self._info.update(
                    score=reward, success=reward == 1.0, won=reward == 1.0, bought=True, reward_parts=parts,
                    purchased={"asin": product.asin, "options": dict(self._page.options)},
                )
                self._done = True
            obs = self._render(self._page)
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            self._info["truncated"] = True
        info = {**self._info, "steps": self._steps, "available_actions": self.available_actions()}
        return obs, reward, self._done, info

    def expert(self, task: Task) -> list[str]:
        """Search the goal's key words, page to the target, click it, choose the goal's options, Buy Now."""
        goal = task.params["goal"]
        target = goal["asin"]
        query = instruction_keywords(goal)
        ranked = [p.asin for p in self.cat.search(query, MAX_RESULTS)]
        if target not in ranked:  # a weak query: fall back to the product's own title, which ranks it first
            query = self._product(target).title
            ranked = [p.asin for p in self.cat.search(query, MAX_RESULTS)]
        pos = ranked.index(target)
        actions = [f"search[{query}]"]
        actions += ["click[Next >]"] * (pos // RESULTS_PER_PAGE)
        actions.append(f"click[{target}]")
        actions += [f"click[{goal['options'][g]}]" for g in self._product(target).options if g in goal["options"]]
        actions.append("click[Buy Now]")
        return actions

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid (INVALID_OBSERVATION) / repeat (page unchanged: bad click, empty search) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        return INSTRUCTION

    def close(self) -> None:
        """Nothing to release (the catalogue is shared and read-only)."""


# WebShop's own split convention over its goal list (used by its IL/RL baselines): test 0-499, dev 500-1499, rest train.
_REAL_SPLITS = {"test": (0, 500), "dev": (500, 1500), "train": (1500, None)}

_INSTALL_HINT = (
    "the real WebShop is not installed: clone https://github.com/princeton-nlp/WebShop, run its `setup.sh` "
    "(it downloads the product data and builds the search index, see the WebShop README), and install it into this "
    "environment so that `web_agent_site` is importable; or use backend='local'"
)


def _import_real() -> Any:
    try:
        from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
    except ImportError as exc:
        raise MissingDependencyError(_INSTALL_HINT) from exc
    return WebAgentTextEnv


class RealWebShop:
    """Thin adapter over WebShop's `WebAgentTextEnv` (observation_mode="text"). Untested here: it needs the
    WebShop repository, its data files and a spaCy model, none of which can be installed in our CI."""

    name = "webshop"
    final_reward_mode = "last"
    backend = "real"

    def __init__(
        self,
        n_products: int | None = 1000,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        max_steps: int = 15,
        human_goals: bool = True,
    ) -> None:
        cls = _import_real()
        self.max_steps = max_steps
        self.limits = {"train": n_train, "dev": n_dev, "test": n_test}
        self._env = cls(observation_mode="text", num_products=n_products, human_goals=human_goals)
        self._n_goals = len(self._env.server.goals)
        self._task: Task | None = None
        self._steps = 0
        self._done = False

    def tasks(self, split: str) -> TaskList:
        """Goal (session) indices of WebShop's split ranges, first n_<split> of them; task_type is its category."""
        _check_split(split)
        lo, hi = _REAL_SPLITS[split]
        idx = list(range(lo, min(hi if hi is not None else self._n_goals, self._n_goals)))
        limit = self.limits[split]
        if limit is not None:
            idx = idx[:limit]
        goals = self._env.server.goals
        tasks = tuple(
            Task(
                env=self.name,
                task_id=f"webshop-real/{split}/{i}",
                split=split,
                task_type=str(goals[i].get("category", "webshop")),
                params={"session": i, "instruction": goals[i]["instruction_text"]},
                max_steps=self.max_steps,
            )
            for i in idx
        )
        return TaskList(self.name, split, tasks)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start WebShop session number task.params['session']."""
        self._task = task
        self._steps = 0
        self._done = False
        obs, _ = self._env.reset(session=int(task.params["session"]))
        goal = self._env.instruction_text
        return obs, {"goal": goal, "task_type": task.task_type, "score": 0.0, "success": False, "won": False}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One WebShop step; unparseable actions return INVALID_OBSERVATION without touching the page."""
        if self._task is None:
            raise ConfigError("call reset(task) before step()")
        if self._done:
            return "The episode is over.", 0.0, True, {"score": 0.0, "success": False, "won": False}
        self._steps += 1
        reward, done = 0.0, False
        if parse_action(action) is None:
            obs = INVALID_OBSERVATION
        else:
            try:
                obs, reward, done, _ = self._env.step(action)
            except AssertionError:  # WebShop asserts on some malformed clicks; QLASS's wrapper treats them as invalid
                obs, reward, done = INVALID_OBSERVATION, 0.0, False
            reward = float(reward)
        bought = bool(done)
        done = bought or self._steps >= self.max_steps
        self._done = done
        info = {"score": reward, "success": reward == 1.0, "won": reward == 1.0, "bought": bought,
                "steps": self._steps, "truncated": done and not bought}
        return obs, reward, done, info

    def expert(self, task: Task) -> None:
        """No scripted expert for the real shop (WebShop's human demonstrations are a separate download)."""
        return None

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid / repeat / none, as for the local shop."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        return INSTRUCTION

    def close(self) -> None:
        """Close the underlying gym env."""
        self._env.close()


def _real_importable() -> bool:
    try:
        _import_real()
    except MissingDependencyError:
        return False
    except OSError:  # installed, but e.g. the spaCy model that goal.py loads at import time is missing
        return False
    return True


class WebShopEnv:
    """WebShop by backend: "real" (princeton-nlp/WebShop, when installed), "local" (generated shop) or "auto"."""

    name = "webshop"
    final_reward_mode = "last"

    def __init__(
        self,
        backend: str = "auto",
        n_products: int | None = None,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
        max_steps: int = 15,
        seed: int = 0,
        human_goals: bool = True,
    ) -> None:
        if backend not in ("auto", "local", "real"):
            raise ConfigError(f"unknown WebShop backend {backend!r}; choose auto, local or real")
        if backend == "auto":
            backend = "real" if _real_importable() else "local"
        self.backend = backend
        self._impl: LocalWebShop | RealWebShop
        if backend == "real":
            self._impl = RealWebShop(n_products if n_products is not None else 1000, n_train, n_dev, n_test,
                                     max_steps, human_goals)
        else:
            self._impl = LocalWebShop(n_products if n_products is not None else 600, n_train, n_dev, n_test,
                                      max_steps, seed)

    @property
    def impl(self) -> LocalWebShop | RealWebShop:
        """The backend object (LocalWebShop exposes the catalogue and page clickables for tests and tools)."""
        return self._impl

    def tasks(self, split: str) -> TaskList:
        """Fixed goal list of the split."""
        return self._impl.tasks(split)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start the task's episode on the search page."""
        return self._impl.reset(task)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """One search[...] / click[...] action."""
        return self._impl.step(action)

    def expert(self, task: Task) -> list[str] | None:
        """Scripted expert actions (local backend); None for the real shop."""
        return self._impl.expert(task)

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid / repeat / none."""
        return self._impl.signals(prev_obs, action, next_obs, parse_ok)

    def instruction(self) -> str:
        """The task-independent instruction."""
        return self._impl.instruction()

    def close(self) -> None:
        """Release the backend."""
        self._impl.close()
