"""Probe environments: tiny pure-Python text tasks with a known right behaviour (the RL debugging ladder).

Each probe isolates one thing a learning method must get right (docs/probes.md):

    probe-constant   one fixed action always wins, whatever the observation says (can the method learn at all?)
    probe-copy       the winning action copies a word from the observation (does the policy read its input?)
    probe-trap       two steps, delayed reward: 'take coin' pays a little now and dead-ends, 'open door' pays
                     nothing now and 'walk through' then wins (credit assignment, critic, GAE)
    probe-hindsight  the password of a vault is only revealed after a wrong answer (in the next observation and so
                     in RSD's hindsight / precedents); the observation never carries it
    probe-guide      three lights in a row; each observation says whether the last press was right, so a guide
                     verdict that reads it predicts the reward (Self-Guide)

`expert_noise` (0 by default) makes a fixed, hashed fraction of the expert demos take a wrong (or the trap)
action, so BC on the demos gives an imperfect start that an RL step must improve on.
"""

from __future__ import annotations

import hashlib
from typing import Any

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal
from agentevo.errors import AgentevoError, ConfigError

INVALID_PREFIX = "Invalid action"
INVALID_PATTERNS = (INVALID_PREFIX,)

COLOURS = ("red", "green", "blue", "yellow")
# Decoration words: they vary the observation of probe-constant / probe-trap without changing the right action.
ROOMS = ("hall", "cellar", "attic", "kitchen", "garden", "study", "library", "porch")
VAULTS = ("north", "south", "east", "west", "iron", "stone", "glass", "oak",
          "copper", "silver", "marble", "cedar", "brass", "slate", "pine", "clay")
# Split sizes when n_<split> is null: small, so every list is cheap to build and to evaluate.
_DEFAULT_SIZES = {"train": 32, "dev": 16, "test": 16}
_SPLIT_SALT = {"train": 0, "dev": 1000, "test": 2000}


def _unit(*parts: object) -> float:
    """A fixed pseudo-random number in [0, 1) from the parts (stable across Python runs, unlike hash())."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _pick(seq: tuple[str, ...], *parts: object) -> str:
    return seq[int(_unit(*parts) * len(seq))]


class _Probe:
    """Shared bookkeeping: fixed hashed task lists, the episode state, signals and the expert-noise switch."""

    name = ""
    task_type = ""
    instruction_text = ""
    default_max_steps = 1
    final_reward_mode = "last"

    def __init__(
        self,
        max_steps: int | None = None,
        expert_noise: float = 0.0,
        n_train: int | None = None,
        n_dev: int | None = None,
        n_test: int | None = None,
    ) -> None:
        steps = self.default_max_steps if max_steps is None else max_steps
        if steps < self.default_max_steps:
            raise ConfigError(f"{self.name}: max_steps must be >= {self.default_max_steps} (got {steps}); "
                              "the probe cannot be solved in fewer steps")
        if not 0.0 <= expert_noise <= 1.0:
            raise ConfigError(f"{self.name}: expert_noise must be in [0, 1] (got {expert_noise})")
        self.max_steps = steps
        self.expert_noise = float(expert_noise)
        self.sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        self._task: Task | None = None
        self._state: dict[str, Any] = {}

    # -- task lists ----------------------------------------------------------------------------------------------
    def task_params(self, split: str, k: int) -> dict[str, Any]:
        """The parameters that fix episode k of a split (subclasses)."""
        raise NotImplementedError

    def tasks(self, split: str) -> TaskList:
        """The first n_<split> tasks of the fixed list of this split (32 / 16 / 16 when null)."""
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        n = self.sizes[split] or _DEFAULT_SIZES[split]
        tasks = tuple(
            Task(self.name, f"{self.name}/{split}/{k}", split, self.task_type,
                 {"index": k, **self.task_params(split, _SPLIT_SALT[split] + k)}, self.max_steps)
            for k in range(n)
        )
        return TaskList(self.name, split, tasks)

    # -- episodes ------------------------------------------------------------------------------------------------
    def _need_task(self) -> Task:
        if self._task is None:
            raise AgentevoError(f"{self.name}: step() before reset()")
        return self._task

    def _info(self, score: float, success: bool) -> dict[str, Any]:
        return {"score": score, "success": success, "won": success, "task_type": self.task_type}

    def noisy(self, task: Task) -> bool:
        """Whether this task's expert demo is one of the expert_noise fraction that acts wrongly."""
        # A golden-ratio sequence over the task index: every prefix of a split gets close to the exact fraction
        # (a hash would leave 8 demos at noise 0.5 anywhere between 1 and 7 noisy).
        return (int(task.params["index"]) * 0.6180339887498949 + 0.5) % 1.0 < self.expert_noise

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        """Format / invalid ('Invalid action ...') / repeat (unchanged observation) / none."""
        return classify_signal(prev_obs, next_obs, parse_ok, INVALID_PATTERNS)

    def instruction(self) -> str:
        """The task-independent instruction shown at the top of every prompt."""
        return self.instruction_text

    def close(self) -> None:
        """Nothing to release: the probes are pure Python."""
        self._task = None


class ConstantProbe(_Probe):
    """One step; 'press button' always wins, 'wait' always loses; the room named in the observation is irrelevant."""

    name = "probe-constant"
    task_type = "constant"
    instruction_text = ("A probe task. Reply with one line 'Thought: <reasoning>' and one line 'Action: <command>'. "
                        "Commands: press button, wait.")

    def task_params(self, split: str, k: int) -> dict[str, Any]:
        return {"room": _pick(ROOMS, "room", k)}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Show the room and the two commands."""
        self._task = task
        goal = "Make the bell ring."
        obs = f"{goal} You are in the {task.params['room']}. There is a button here. Commands: press button, wait."
        return obs, {"goal": goal, **self._info(0.0, False)}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Any command ends the episode; only 'press button' scores."""
        self._need_task()
        act = action.strip().lower()
        if act == "press button":
            return "The bell rings. You win.", 1.0, True, self._info(1.0, True)
        if act == "wait":
            return "Nothing happens. The episode is over.", 0.0, True, self._info(0.0, False)
        return f"{INVALID_PREFIX}: use press button or wait.", 0.0, True, self._info(0.0, False)

    def expert(self, task: Task) -> list[str]:
        """'press button' (or 'wait' for a noisy demo)."""
        return ["wait" if self.noisy(task) else "press button"]


class CopyProbe(_Probe):
    """One step; the observation names a colour and 'say <colour>' wins; another colour loses."""

    name = "probe-copy"
    task_type = "copy"
    # The colour words appear nowhere else in the prompt: the observation's colour is the one to find.
    instruction_text = ("A probe task. Reply with one line 'Thought: <reasoning>' and one line 'Action: <command>'. "
                        "Command: say <colour>.")

    def task_params(self, split: str, k: int) -> dict[str, Any]:
        return {"colour": COLOURS[k % len(COLOURS)]}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Show the colour to copy."""
        self._task = task
        goal = f"Say the colour of the light: {task.params['colour']}."
        return goal, {"goal": goal, **self._info(0.0, False)}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Any command ends the episode; only the shown colour scores."""
        task = self._need_task()
        act = action.strip().lower()
        said = act[4:].strip() if act.startswith("say ") else ""
        if said == task.params["colour"]:
            return "Correct. You win.", 1.0, True, self._info(1.0, True)
        if said in COLOURS:
            return "Wrong colour. The episode is over.", 0.0, True, self._info(0.0, False)
        return f"{INVALID_PREFIX}: use say <colour>.", 0.0, True, self._info(0.0, False)

    def expert(self, task: Task) -> list[str]:
        """'say <the colour>' (or the next colour for a noisy demo)."""
        colour = task.params["colour"]
        if self.noisy(task):
            colour = COLOURS[(COLOURS.index(colour) + 1) % len(COLOURS)]
        return [f"say {colour}"]


TRAP_COIN_SCORE = 0.3


class TrapProbe(_Probe):
    """Two steps. 'take coin' scores 0.3 at once but locks the door (step 2 cannot win: final 0.3); 'open door'
    scores 0 at once and 'walk through' then wins (final 1.0). A method that maximises the immediate reward falls
    for the trap; one that assigns the delayed reward to step 1 does not."""

    name = "probe-trap"
    task_type = "trap"
    default_max_steps = 2
    instruction_text = ("A probe task. Reply with one line 'Thought: <reasoning>' and one line 'Action: <command>'. "
                        "Commands: take coin, open door, walk through, wait.")

    def task_params(self, split: str, k: int) -> dict[str, Any]:
        return {"room": _pick(ROOMS, "room", k)}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """The room with a coin and a closed door."""
        self._task = task
        self._state = {"where": "start", "score": 0.0}
        goal = "Leave the room."
        obs = (f"{goal} You are in the {task.params['room']}. There is a coin on the floor and a closed door. "
               "Commands: take coin, open door.")
        return obs, {"goal": goal, **self._info(0.0, False)}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Step 1 chooses the branch; step 2 wins only on the door branch."""
        self._need_task()
        act = action.strip().lower()
        where, score = self._state["where"], self._state["score"]
        if where == "start":
            if act == "take coin":
                self._state.update(where="coin", score=TRAP_COIN_SCORE)
                return ("You take the coin. The door slams shut and locks. Commands: walk through, wait.",
                        TRAP_COIN_SCORE, False, self._info(TRAP_COIN_SCORE, False))
            if act == "open door":
                self._state.update(where="door")
                return "The door is open. Commands: walk through, wait.", 0.0, False, self._info(0.0, False)
            # Invalid: nothing changes (the engine ends the episode at max_steps).
            return f"{INVALID_PREFIX}: use take coin or open door.", 0.0, False, self._info(score, False)
        if where == "door" and act == "walk through":
            return "You walk through the door and leave. You win.", 1.0 - score, True, self._info(1.0, True)
        if where == "coin":
            # The dead end: whatever is done now, the episode ends with the coin's score; walking through the
            # locked door is an invalid action, so the trap path carries a retrospective (aux) label as well.
            text = "The door is locked. You are stuck. The episode is over."
            if act == "walk through":
                text = f"{INVALID_PREFIX}: the door is locked. You are stuck. The episode is over."
            return text, 0.0, True, self._info(score, False)
        if act == "wait":
            return "You stay in the room. The episode is over.", 0.0, True, self._info(score, False)
        return f"{INVALID_PREFIX}: use walk through or wait.", 0.0, False, self._info(score, False)

    def expert(self, task: Task) -> list[str]:
        """'open door', 'walk through' (a noisy demo takes the coin)."""
        return ["take coin", "walk through"] if self.noisy(task) else ["open door", "walk through"]


# Each vault's fixed password, the same in every split; every colour is the password of four of the first 16 vaults
# (no answer is a safe default). Vaults share a password so that a vault whose demos are all wrong (expert_noise)
# still has its password said by a solved demo of another vault: a model that learns to read it from hindsight there
# can read it for the unsolved vault too (RSD's premise), whereas one that only memorised vault -> password cannot.
VAULT_PASSWORDS = {"north": "yellow", "south": "blue", "east": "red", "west": "green",
                   "iron": "blue", "stone": "green", "glass": "yellow", "oak": "red",
                   "copper": "red", "silver": "green", "marble": "yellow", "cedar": "blue",
                   "brass": "green", "slate": "red", "pine": "blue", "clay": "yellow"}
MAX_VAULTS = len(VAULTS) ** 2


_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")


def _made_up_names(n: int) -> tuple[str, ...]:
    """VAULTS, then made-up one-word names of three syllables ('labofi'), fixed per index and all different, so a
    vault is one content word for retrieval and the tiny tokenizer splits it into pieces."""
    names = list(VAULTS)
    while len(names) < n:
        i, attempt, name = len(names), 0, ""
        while not name or name in names:
            units = [_unit("vault-name", i, j, attempt) if attempt else _unit("vault-name", i, j) for j in range(3)]
            name = "".join(_ONSETS[int(u * len(_ONSETS))] + _VOWELS[int(u * len(_ONSETS) * len(_VOWELS)) % 5]
                           for u in units)
            attempt += 1
        names.append(name)
    return tuple(names)


VAULT_NAMES = _made_up_names(MAX_VAULTS)


def _vault_name(i: int) -> str:
    """Vault i (the 16 words of VAULTS first)."""
    return VAULT_NAMES[i]


def _more_passwords() -> dict[str, str]:
    """Passwords of vaults 16..255: each block of four consecutive vaults holds every colour once, in a hashed
    order, so any n_vaults that is a multiple of 4 is balanced and a vault's password does not depend on n_vaults."""
    out = {}
    for start in range(len(VAULTS), MAX_VAULTS, len(COLOURS)):
        order = sorted(COLOURS, key=lambda c, s=start: _unit("vault-password", s, c))
        out.update({_vault_name(start + j): c for j, c in enumerate(order)})
    return out


VAULT_PASSWORDS.update(_more_passwords())


def vault_password(vault: str) -> str:
    """The fixed password of a vault (one of COLOURS), the same in every split."""
    return VAULT_PASSWORDS[vault]


class HindsightProbe(_Probe):
    """One step; 'say <password>' opens the vault. The password is fixed per vault (the same vaults recur in every
    split) but never shown before acting: every answer ends the episode with an observation that names it ('The
    vault opens. The password was <p>. You win.' or 'Wrong password. The password was <p>.'), so only hindsight
    (the next observation, precedents of the same vault) carries it.

    n_vaults (default 16, a multiple of 4 up to 256) sets how many vaults the tasks cycle through. With many vaults
    each vault recurs rarely, so a model that must name passwords from context finds reading them cheaper than
    remembering one per vault (docs/probes.md, RSD)."""

    name = "probe-hindsight"
    task_type = "hindsight"
    instruction_text = ("A probe task. Reply with one line 'Thought: <reasoning>' and one line 'Action: <command>'. "
                        "Commands: say red, say green, say blue, say yellow.")

    def __init__(self, max_steps: int | None = None, expert_noise: float = 0.0, n_train: int | None = None,
                 n_dev: int | None = None, n_test: int | None = None, n_vaults: int = len(VAULTS)) -> None:
        super().__init__(max_steps, expert_noise, n_train, n_dev, n_test)
        if not (len(COLOURS) <= n_vaults <= MAX_VAULTS and n_vaults % len(COLOURS) == 0):
            raise ConfigError(f"{self.name}: n_vaults must be a multiple of {len(COLOURS)} in "
                              f"[{len(COLOURS)}, {MAX_VAULTS}] (got {n_vaults}); every colour is then the password "
                              "of as many vaults as every other")
        self.n_vaults = n_vaults

    def task_params(self, split: str, k: int) -> dict[str, Any]:
        return {"vault": _vault_name(k % self.n_vaults)}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Name the vault; not its password."""
        self._task = task
        goal = f"Open the {task.params['vault']} vault by saying its password."
        return goal, {"goal": goal, **self._info(0.0, False)}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Any command ends the episode; a wrong one reveals the password."""
        task = self._need_task()
        act = action.strip().lower()
        password = vault_password(task.params["vault"])
        said = act[4:].strip() if act.startswith("say ") else ""
        if said == password:
            # The password is named on success too, so every episode's hindsight carries it verbatim: a model
            # that learns to read it from a solved demo's future can read it from a failed attempt's as well.
            return f"The vault opens. The password was {password}. You win.", 1.0, True, self._info(1.0, True)
        prefix = "Wrong password." if said in COLOURS else f"{INVALID_PREFIX}: use say <colour>."
        return f"{prefix} The password was {password}.", 0.0, True, self._info(0.0, False)

    def expert(self, task: Task) -> list[str]:
        """'say <password>' (a noisy demo says another colour)."""
        password = vault_password(task.params["vault"])
        if self.noisy(task):
            password = COLOURS[(COLOURS.index(password) + 1) % len(COLOURS)]
        return [f"say {password}"]


GUIDE_LIGHTS = 3
GUIDE_REWARDS = ("score", "success")
GUIDE_NOISE_AT = ("second", "random")


class GuideProbe(_Probe):
    """A row of lights (n_lights, default 3); at each one 'press <colour>' with the light's colour is right. Every
    observation says whether the last press was right ('Correct.' / 'Wrong button.'); success = every press right.
    The verdict on the last step is readable from the observation, so a guide that states it predicts the reward.

    reward 'score' (default): the score is the fraction of right presses so far and each right press pays
    1 / n_lights. reward 'success': score and reward stay 0 until the last light and are 1 only if every press was
    right, so the outcome says nothing about which press was wrong and only a step-level signal (Self-Guide's
    verdicts) can tell the steps apart.

    noise_at: where a noisy expert demo presses the wrong colour. 'second' (default) always errs at light 2, so a
    policy imitating the demos errs there too and a failed outcome still points at that light; 'random' errs at a
    fixed, hashed light per task (uniform over the row), so a failure does not say which press was wrong.

    demo_errors (noise_at 'random' only): how many presses a noisy demo gets wrong, at distinct hashed lights. A
    policy imitating demos that all err at k of n lights errs at each light with probability k/n, so it wins an
    episode with probability (1 - k/n)^n: with 12 lights and 4 errors, 0.8%. Then nearly every group of a few
    rollouts is all failure and outcome-only GRPO has no gradient, while step verdicts still tell right presses
    from wrong ones: the regime in which Self-Guide's step-level reward is the only learning signal."""

    name = "probe-guide"
    task_type = "guide"
    default_max_steps = GUIDE_LIGHTS
    instruction_text = ("A probe task. Reply with one line 'Thought: <reasoning>' and one line 'Action: <command>'. "
                        "Commands: press red, press green, press blue, press yellow.")

    def __init__(self, max_steps: int | None = None, expert_noise: float = 0.0, n_train: int | None = None,
                 n_dev: int | None = None, n_test: int | None = None, n_lights: int = GUIDE_LIGHTS,
                 reward: str = "score", noise_at: str = "second", demo_errors: int = 1) -> None:
        if not 2 <= n_lights <= 12:
            raise ConfigError(f"{self.name}: n_lights must be in [2, 12] (got {n_lights})")
        if reward not in GUIDE_REWARDS:
            raise ConfigError(f"{self.name}: reward must be one of {', '.join(GUIDE_REWARDS)} (got {reward!r})")
        if noise_at not in GUIDE_NOISE_AT:
            raise ConfigError(f"{self.name}: noise_at must be one of {', '.join(GUIDE_NOISE_AT)} (got {noise_at!r})")
        if not 1 <= demo_errors <= n_lights or (demo_errors > 1 and noise_at != "random"):
            raise ConfigError(f"{self.name}: demo_errors must be in [1, n_lights = {n_lights}], and above 1 only with "
                              f"noise_at: random (got {demo_errors} with noise_at: {noise_at})")
        self.default_max_steps = n_lights  # the instance's floor for max_steps and its default
        super().__init__(max_steps, expert_noise, n_train, n_dev, n_test)
        self.n_lights = n_lights
        self.reward = reward
        self.noise_at = noise_at
        self.demo_errors = demo_errors

    def task_params(self, split: str, k: int) -> dict[str, Any]:
        return {"lights": [_pick(COLOURS, "light", k, i) for i in range(self.n_lights)]}

    def _light(self, i: int) -> str:
        return f"Light {i + 1} of {self.n_lights} is {self._need_task().params['lights'][i]}."

    def _score(self, right: int, done: bool) -> float:
        if self.reward == "success":
            return 1.0 if done and right == self.n_lights else 0.0
        return right / self.n_lights

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """The first light."""
        self._task = task
        self._state = {"i": 0, "right": 0}
        goal = "Press the button of each light's colour."
        return f"{goal} {self._light(0)}", {"goal": goal, **self._info(0.0, False)}

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Judge the press, move to the next light; the last light ends the episode."""
        task = self._need_task()
        act = action.strip().lower()
        i, right = self._state["i"], self._state["right"]
        pressed = act[6:].strip() if act.startswith("press ") else ""
        before = self._score(right, False)
        if pressed not in COLOURS:
            # Invalid: the same light stays and the score does not move, so the step is wasted (the engine ends
            # the episode at max_steps).
            return f"{INVALID_PREFIX}: use press <colour>. {self._light(i)}", 0.0, False, self._info(before, False)
        ok = pressed == task.params["lights"][i]
        right += ok
        self._state.update(i=i + 1, right=right)
        last = i + 1 == self.n_lights
        score = self._score(right, last)
        verdict = "Correct." if ok else "Wrong button."
        if last:
            won = right == self.n_lights
            end = "You win." if won else "The episode is over."
            return f"{verdict} {end}", score - before, True, self._info(score, won)
        return f"{verdict} {self._light(i + 1)}", score - before, False, self._info(score, False)

    def error_light(self, task: Task) -> int:
        """The light (0-based) at which this task's noisy demo presses the wrong colour (see noise_at)."""
        if self.noise_at == "second":
            return 1
        return int(_unit("error-light", task.task_id) * self.n_lights)

    def error_lights(self, task: Task) -> list[int]:
        """The demo_errors lights (0-based, ascending) where this task's noisy demo errs: error_light(task) and, past
        one error, the next lights in a fixed hashed order of the row."""
        first = self.error_light(task)
        rest = sorted((i for i in range(self.n_lights) if i != first), key=lambda i: _unit("error-lights", task.task_id, i))
        return sorted([first, *rest[: self.demo_errors - 1]])

    def expert(self, task: Task) -> list[str]:
        """Press each light's colour (a noisy demo presses the wrong colour at error_lights(task))."""
        lights = list(task.params["lights"])
        if self.noisy(task):
            for i in self.error_lights(task):
                lights[i] = COLOURS[(COLOURS.index(lights[i]) + 1) % len(COLOURS)]
        return [f"press {c}" for c in lights]
