"""An agentevo environment plug-in: make a counter show a target number."""

from agentevo.envs.base import SPLITS, Task, TaskList, classify_signal


class CounterEnv:
    """Counter: make the counter show the target with 'add 1' / 'add 2' (a plug-in example)."""

    name = "counter"
    final_reward_mode = "last"  # the trajectory's reward is the score after its last step

    def __init__(self, max_steps: int = 6, n_train: int | None = None, n_dev: int | None = None,
                 n_test: int | None = None) -> None:
        self.max_steps = max_steps
        self.sizes = {"train": n_train or 20, "dev": n_dev or 5, "test": n_test or 10}
        self.value, self.target = 0, 0

    def tasks(self, split: str) -> TaskList:
        salt = SPLITS.index(split) * 7  # fixed lists: the same tasks on every machine and every run
        return TaskList(self.name, split, tuple(
            Task(self.name, f"counter/{split}/{k}", split, "count", {"target": 2 + (salt + k) % 4}, self.max_steps)
            for k in range(self.sizes[split])))

    def reset(self, task: Task) -> tuple[str, dict]:
        self.value, self.target = 0, task.params["target"]
        goal = f"make the counter show {self.target}"
        return f"Your task is to {goal}. The counter shows 0.", {"goal": goal, "task_type": task.task_type}

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if action not in ("add 1", "add 2"):
            return "Invalid action. Say 'add 1' or 'add 2'.", 0.0, False, {"score": 0.0, "success": False}
        self.value += int(action[-1])
        won = self.value == self.target
        return f"The counter shows {self.value}.", float(won), self.value >= self.target, {
            "score": float(won), "success": won}

    def expert(self, task: Task) -> list[str]:  # the gold actions BC learns from
        return ["add 2"] * (task.params["target"] // 2) + ["add 1"] * (task.params["target"] % 2)

    def signals(self, prev_obs: str, action: str, next_obs: str, parse_ok: bool) -> str:
        return classify_signal(prev_obs, next_obs, parse_ok, ("Invalid action",))

    def instruction(self) -> str:
        return "Make the counter show the target number. Reply with one line: 'Action: add 1' or 'Action: add 2'."

    def close(self) -> None:
        pass
