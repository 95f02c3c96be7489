"""ALFWorld-style games generated from the assets the `alfworld` wheel ships (no download needed).

The real ALFWorld data (ALFRED scene states) cannot be fetched offline, but the wheel ships everything else:
the receptacles of all 120 AI2-THOR floor plans (`gen/layouts`), the object types each scene holds, which object
types fit which receptacle types (`gen/constants.py`), the goal PDDL and templates of the six task types
(`gen/goal_library.py`), the PDDL domain (`alfred.pddl`) and the text grammar (`alfred.twl2`).

A game here = a floor plan's receptacles + its object types placed at random into compatible receptacles + one
goal from the goal library that is not satisfied at the start. Each game is written in the real data layout
(`json_2.1.1/<split>/<task dir>/<trial>/game.tw-pddl` + a `traj_data.json` stub) so it loads through exactly the
same path as real ALFWorld games, and it is kept only if the fast-downward planner finds a walkthrough that,
replayed through ALFWorld's own TextWorld wrappers, wins the game.

Everything is deterministic from (split, index, seed); games are cached on disk, so each is generated once.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentevo.errors import ConfigError, MissingDependencyError

# Part of every generated task's path, params and cache dir: bump it whenever a change alters generated games, so
# task-list hashes and caches never mix games of different generator versions.
GENERATOR_VERSION = 1
INSTALL_HINT = "install it with `pip install 'agentevo[alfworld]'` (or `pip install alfworld`)"

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Directory names of the real data's splits; agentevo maps train/dev/test onto them.
DATA_SPLITS = ("train", "valid_seen", "valid_unseen")

# Default split sizes for generated games: the real ALFWorld sizes (train 3321, valid_seen 140, valid_unseen 134).
# Listing a split is cheap; each game is generated (one planner call, ~1-10 s) the first time it is reset.
DEFAULT_SIZES = {"train": 3321, "valid_seen": 140, "valid_unseen": 134}

# Where the generated games go when no cache dir is given.
DEFAULT_CACHE_DIR = Path("~/.cache/agentevo/alfworld").expanduser()

# The appliance each state-change task needs (the domain only cleans in a SinkBasin).
_APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_ACTION_CLASS = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
_LAMPS = ("DeskLamp", "FloorLamp")
# The wheel lists no receptacle for lamps (THOR keeps them on the floor or on furniture); the text game needs the
# lamp "in" a receptacle to be used, so lamps stand on furniture with a top.
_LAMP_RECEPTACLES = ("Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "TVStand", "DiningTable")
# Receptacle types that exist in a scene's object list but have no entry in its layout file get this many copies.
_SYNTH_COUNT = {"StoveBurner": 4}
# Objects present per type in a scene (real ALFRED scenes have 1-3; the target type gets at least 1, or 2 for
# pick_two). Fewer objects keep the planner and the admissible-command computation fast.
MAX_INSTANCES = 2

_IMPORT_LOCK = threading.Lock()
_ASSETS: dict[str, Any] = {}


def _alfworld_assets() -> dict[str, Any]:
    """Import the wheel's generation assets once (constants, goal library, domain, grammar, layout dir)."""
    with _IMPORT_LOCK:
        if not _ASSETS:
            try:
                import alfworld.gen.constants as constants
                import alfworld.gen.goal_library as goal_library
                from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH
            except ImportError as exc:
                raise MissingDependencyError(f"ALFWorld is not installed; {INSTALL_HINT}") from exc
            _ASSETS.update(
                constants=constants,
                goals=goal_library.gdict,
                domain=Path(ALFRED_PDDL_PATH).read_text(),
                grammar=Path(ALFRED_TWL2_PATH).read_text(),
                layouts=Path(constants.__file__).parent / "layouts",
            )
    return _ASSETS


# ----------------------------------------------------------------------------------------------------------
# Scene content
# ----------------------------------------------------------------------------------------------------------


def _type_of_id(thor_id: str) -> str:
    """'Cabinet|+00.68|+00.50|-02.20' -> 'Cabinet'; 'Sink|...|SinkBasin' -> 'SinkBasin'."""
    parts = thor_id.split("|")
    return parts[4] if len(parts) == 5 else parts[0]


def mangle(thor_id: str) -> str:
    """THOR id -> PDDL-safe name, with the same escapes ALFWorld's Demangler undoes."""
    out = thor_id
    for char, word in (("|", "_bar_"), ("+", "_plus_"), ("-", "_minus_"), (".", "_dot_"), (",", "_comma_")):
        out = out.replace(char, word)
    return out


def _scene_kind(floor_plan: int) -> str:
    return {0: "Kitchen", 2: "LivingRoom", 3: "Bedroom", 4: "Bathroom"}[floor_plan // 100]


@functools.cache
def floor_plans(split: str) -> tuple[int, ...]:
    """Floor plans of a split: seen (train, valid_seen) = the wheel's train scenes, unseen = its test scenes."""
    constants = _alfworld_assets()["constants"]
    numbers = constants.TEST_SCENE_NUMBERS if split == "valid_unseen" else constants.TRAIN_SCENE_NUMBERS
    layouts = _alfworld_assets()["layouts"]
    return tuple(sorted(n for n in numbers if (layouts / f"FloorPlan{n}-openable.json").exists()))


@dataclass(frozen=True)
class _Scene:
    receptacles: dict[str, tuple[str, str]]  # THOR id -> (type, location id)
    object_types: tuple[str, ...]  # pickupable object types present in the scene
    lamps: tuple[str, ...]  # lamp types present


def _pickupable_types() -> set[str]:
    constants = _alfworld_assets()["constants"]
    static = set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES)
    types: set[str] = set()
    for contents in constants.VAL_RECEPTACLE_OBJECTS.values():
        types |= contents
    return {t for t in types if not t.endswith("Sliced") and t not in static}


def _location(x: float, z: float, rotation: int, horizon: int) -> str:
    # Same shape as ALFWorld's location ids: grid position (0.25 m steps), rotation / 90, camera horizon.
    return f"loc|{int(round(x / 0.25))}|{int(round(z / 0.25))}|{int(rotation) // 90 % 4}|{int(horizon)}"


@functools.cache
def load_scene(floor_plan: int) -> _Scene:
    """The receptacles and object types of one floor plan, from the wheel's layout files."""
    assets = _alfworld_assets()
    constants = assets["constants"]
    layouts: Path = assets["layouts"]
    poses = json.loads((layouts / f"FloorPlan{floor_plan}-openable.json").read_text())
    present = set(json.loads((layouts / f"FloorPlan{floor_plan}-objects.json").read_text()))
    static = set(constants.RECEPTACLES) - set(constants.MOVABLE_RECEPTACLES)
    receptacles: dict[str, tuple[str, str]] = {}
    for thor_id in sorted(poses):
        x, z, rotation, horizon = poses[thor_id]
        receptacles[thor_id] = (_type_of_id(thor_id), _location(x, z, rotation, horizon))
    # The layout files list only receptacles with a precomputed interaction pose; stove burners, coffee machines,
    # toasters and most garbage cans are missing although the scene has them. Add them at made-up positions,
    # deterministic per floor plan, keeping the 'Sink|...|SinkBasin' id form the Demangler expects.
    have = {rtype for rtype, _ in receptacles.values()}
    rng = random.Random(f"alfworld-gen-synth:{floor_plan}")
    for rtype in sorted((present & static) - have):
        for _ in range(_SYNTH_COUNT.get(rtype, 1)):
            x, y, z = (round(rng.uniform(-3.0, 3.0), 2) for _ in range(3))
            base = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}.get(rtype, rtype)
            thor_id = f"{base}|{x:+06.2f}|{abs(y):+06.2f}|{z:+06.2f}"
            if rtype in ("SinkBasin", "BathtubBasin"):
                thor_id += f"|{rtype}"
            receptacles[thor_id] = (rtype, _location(x, z, rng.choice((0, 90, 180, 270)), 30))
    object_types = tuple(sorted(present & _pickupable_types()))
    lamps = tuple(t for t in _LAMPS if t in present)
    return _Scene(receptacles=receptacles, object_types=object_types, lamps=lamps)


def _fits(rtype: str, otype: str) -> bool:
    constants = _alfworld_assets()["constants"]
    if otype in _LAMPS:
        return rtype in _LAMP_RECEPTACLES
    return otype in constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ())


# ----------------------------------------------------------------------------------------------------------
# Game specs: cheap, deterministic descriptions of what to generate
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GameSpec:
    """What one generated game is: split, task type, floor plan, goal arguments and placement seed."""

    split: str
    index: int
    task_type: str
    floor_plan: int
    object_target: str
    parent_target: str
    toggle_target: str
    seed: int

    @property
    def rel_dir(self) -> str:
        """Path under json_2.1.1/, shaped like the real data's '<task>-<obj>-<mrecep>-<parent>-<scene>/<trial>'."""
        parent = self.toggle_target if self.task_type == "look_at_obj_in_light" else self.parent_target
        task_dir = f"{self.task_type}-{self.object_target}-None-{parent}-{self.floor_plan}"
        return f"{self.split}/{task_dir}/trial_gen{GENERATOR_VERSION}_{self.index:05d}_s{self.seed}"


@functools.cache
def _goal_candidates(task_type: str, floor_plan: int) -> tuple[tuple[str, str, str], ...]:
    """All (object, parent receptacle, toggle) goal arguments a floor plan supports for a task type, sorted."""
    constants = _alfworld_assets()["constants"]
    scene = load_scene(floor_plan)
    rtypes = sorted({rtype for rtype, _ in scene.receptacles.values()})
    out: list[tuple[str, str, str]] = []
    if task_type == "look_at_obj_in_light":
        lamp_ok = [lamp for lamp in scene.lamps if any(_fits(r, lamp) for r in rtypes)]
        for lamp in lamp_ok:
            for otype in scene.object_types:
                if any(_fits(r, otype) for r in rtypes):
                    out.append((otype, "", lamp))
        return tuple(out)
    appliance = _APPLIANCE.get(task_type)
    if appliance is not None and appliance not in rtypes:
        return ()
    for otype in scene.object_types:
        if task_type in _ACTION_CLASS and otype not in constants.VAL_ACTION_OBJECTS[_ACTION_CLASS[task_type]]:
            continue
        for parent in rtypes:
            if parent == appliance or parent in ("SinkBasin", "BathtubBasin") and appliance is not None:
                continue
            if not _fits(parent, otype):
                continue
            # The objects must start somewhere that is not the goal receptacle (and not the appliance).
            if not any(_fits(r, otype) for r in rtypes if r not in (parent, appliance)):
                continue
            out.append((otype, parent, ""))
    return tuple(out)


def spec_at(split: str, index: int, seed: int = 0) -> GameSpec:
    """Game spec i of a split; it depends only on (split, i, seed), so split lists extend stably."""
    if split not in DATA_SPLITS:
        raise ConfigError(f"unknown ALFWorld data split {split!r}; choose one of {', '.join(DATA_SPLITS)}")
    constants = _alfworld_assets()["constants"]
    task_type = TASK_TYPES[index % len(TASK_TYPES)]  # balanced, fixed order of task types
    rng = random.Random(f"alfworld-gen:{seed}:{split}:{index}")
    kinds = constants.GOALS_VALID[task_type]
    choices = [fp for fp in floor_plans(split) if _scene_kind(fp) in kinds]
    rng.shuffle(choices)
    for fp in choices:
        candidates = _goal_candidates(task_type, fp)
        if candidates:
            obj, parent, toggle = rng.choice(candidates)
            return GameSpec(split, index, task_type, fp, obj, parent, toggle, rng.randrange(10**6))
    raise ConfigError(f"no floor plan of split {split} supports {task_type}")  # pragma: no cover


def plan_split(split: str, n: int, seed: int = 0) -> list[GameSpec]:
    """The first n game specs of a split (cheap: nothing is generated)."""
    return [spec_at(split, index, seed) for index in range(n)]


# ----------------------------------------------------------------------------------------------------------
# PDDL problem + game file
# ----------------------------------------------------------------------------------------------------------


def _place_objects(spec: GameSpec, scene: _Scene, rng: random.Random) -> list[tuple[str, str, str]]:
    """(THOR id, type, receptacle id) for every object instance; the goal is never satisfied at the start."""
    appliance = _APPLIANCE.get(spec.task_type)
    placed: list[tuple[str, str, str]] = []
    used_ids: set[str] = set()
    types = list(scene.object_types) + list(scene.lamps)  # every lamp of the scene, not only the goal's
    for otype in types:
        if otype == spec.object_target:
            count = (
                rng.randint(2, MAX_INSTANCES + 1)
                if spec.task_type == "pick_two_obj_and_place"
                else rng.randint(1, MAX_INSTANCES)
            )
            banned = {spec.parent_target, appliance}
        elif otype in _LAMPS:
            count, banned = 1, set()
        else:
            count = rng.randint(1, MAX_INSTANCES)
            banned = set()
        options = [r for r, (rtype, _) in scene.receptacles.items() if _fits(rtype, otype) and rtype not in banned]
        if not options:
            continue
        for _ in range(count):
            while True:  # unique THOR-like id
                x, y, z = (round(rng.uniform(-3.0, 3.0), 2) for _ in range(3))
                thor_id = f"{otype}|{x:+06.2f}|{abs(y):+06.2f}|{z:+06.2f}"
                if thor_id not in used_ids:
                    used_ids.add(thor_id)
                    break
            placed.append((thor_id, otype, rng.choice(options)))
    return placed


def build_problem(spec: GameSpec, planning: bool = False) -> str:
    """The PDDL problem of a spec: the scene's receptacles, objects placed at random, the goal-library goal.

    planning=True keeps only the goal's object types (as ALFRED's own planner problems do): other objects cannot
    matter to the plan, and leaving them out makes fast-downward's search seconds instead of tens of seconds."""
    assets = _alfworld_assets()
    constants = assets["constants"]
    scene = load_scene(spec.floor_plan)
    rng = random.Random(f"alfworld-gen-place:{spec.floor_plan}:{spec.seed}")
    placed = _place_objects(spec, scene, rng)
    action = constants.VAL_ACTION_OBJECTS
    receptacle_locs = {loc for _, loc in scene.receptacles.values()}
    start = "loc|0|0|0|0"
    while start in receptacle_locs:  # the agent starts "in the middle of the room", next to no receptacle
        start = f"loc|{rng.randint(-20, 20)}|{rng.randint(-20, 20)}|{rng.randint(0, 3)}|30"
    if planning:
        placed = [p for p in placed if p[1] in (spec.object_target, spec.toggle_target)]
    otypes = sorted({otype for _, otype, _ in placed} | {spec.object_target} | ({spec.toggle_target} - {""}))
    rtypes = sorted({rtype for rtype, _ in scene.receptacles.values()} | ({spec.parent_target} - {""}))
    objects = ["agent1 - agent"]
    objects += [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in rtypes]
    objects += [f"{mangle(o)} - object" for o, _, _ in placed]
    objects += [f"{mangle(r)} - receptacle" for r in scene.receptacles]
    objects += [f"{mangle(loc)} - location" for loc in sorted(receptacle_locs | {start})]
    init = [f"(atLocation agent1 {mangle(start)})"]
    for r, (rtype, loc) in scene.receptacles.items():
        init.append(f"(receptacleType {mangle(r)} {rtype}Type)")
        init.append(f"(receptacleAtLocation {mangle(r)} {mangle(loc)})")
        if rtype in constants.OPENABLE_CLASS_SET:
            init.append(f"(openable {mangle(r)})")
    for o, otype, r in placed:
        name = mangle(o)
        init += [
            f"(objectType {name} {otype}Type)",
            f"(inReceptacle {name} {mangle(r)})",
            f"(objectAtLocation {name} {mangle(scene.receptacles[r][1])})",
        ]
        if otype in _LAMPS:
            init.append(f"(toggleable {name})")
            continue
        init.append(f"(pickupable {name})")
        if otype in constants.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {name})")
        for cls, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if otype in action[cls]:
                init.append(f"({pred} {name})")
        if scene.receptacles[r][0] == "Fridge" and otype in action["Coolable"]:
            init.append(f"(isCool {name})")  # as in ALFRED: what starts in the fridge is already cold
    for rtype in rtypes:
        for otype in otypes:
            if _fits(rtype, otype) and otype not in _LAMPS:
                init.append(f"(canContain {rtype}Type {otype}Type)")
    goal = (
        assets["goals"][spec.task_type]["pddl"]
        .format(obj=spec.object_target, recep=spec.parent_target, toggle=spec.toggle_target, mrecep="")
        .replace("#", "-")
    )  # the goal library writes '#' for PDDL's type dash so that str.format works
    nl = "\n        "
    return (
        f"(define (problem gen_{spec.split}_{spec.index})\n    (:domain alfred)\n"
        f"    (:objects{nl}{nl.join(objects)}\n    )\n"
        f"    (:init{nl}{nl.join(init)}\n    )\n{goal}\n"
    )


def goal_text(spec: GameSpec, rng: random.Random) -> str:
    """A goal-library template filled in, lower-cased like ALFWorld's templated goals."""
    templates = _alfworld_assets()["goals"][spec.task_type]["templates"]
    return rng.choice(templates).format(
        obj=spec.object_target.lower(), recep=spec.parent_target.lower(), toggle=spec.toggle_target.lower(), mrecep=""
    )


def traj_data(spec: GameSpec, desc: str) -> dict[str, Any]:
    """The traj_data.json stub: the fields ALFWorld's loaders and hand-coded expert read."""
    return {
        "task_id": f"gen{GENERATOR_VERSION}_{spec.split}_{spec.index:05d}_s{spec.seed}",
        "task_type": spec.task_type,
        "pddl_params": {
            "object_target": spec.object_target,
            "parent_target": spec.parent_target,
            "toggle_target": spec.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"floor_plan": f"FloorPlan{spec.floor_plan}", "scene_num": spec.floor_plan, "random_seed": spec.seed},
        "turk_annotations": {"anns": [{"task_desc": desc, "assignment_id": "generated", "high_descs": []}]},
        "agentevo_generated": {"generator_version": GENERATOR_VERSION, "split": spec.split, "index": spec.index},
    }


def _solve_here(gamefile: str, planfile: str) -> list[str]:
    """Planner walkthrough (found on planfile) if replaying it in gamefile through ALFWorld's wrappers wins."""
    from agentevo.envs.alfworld import replay_walkthrough  # local import: alfworld.py imports this module

    return replay_walkthrough(Path(gamefile), Path(planfile))


def _solve(gamefile: Path, planfile: Path) -> list[str]:
    """_solve_here in a child interpreter: after fast-downward has planned, the interpreter that ran it segfaults
    in native teardown at exit, which would turn every successful run into exit status 139."""
    out = subprocess.run(
        [sys.executable, "-m", "agentevo.envs.alfworld_gen", "--solve", str(gamefile), str(planfile)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("WALKTHROUGH ")]
    if not lines:
        raise RuntimeError(f"the ALFWorld planner process failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return list(json.loads(lines[-1][len("WALKTHROUGH ") :]))


_WRITE_LOCK = threading.Lock()


def generate_game(spec: GameSpec, root: Path, max_tries: int = 20) -> Path:
    """Write the spec's game under root/json_2.1.1/ (if not cached) and return its game.tw-pddl path."""
    game_dir = Path(root) / "json_2.1.1" / spec.rel_dir
    gamefile = game_dir / "game.tw-pddl"
    if gamefile.exists():
        return gamefile
    assets = _alfworld_assets()
    rng = random.Random(f"alfworld-gen-text:{spec.seed}")
    desc = goal_text(spec, rng)
    # Each try re-draws the placement with a derived seed; the spec (and so the task id) stays the same.
    for attempt in range(max_tries):
        tried = spec if attempt == 0 else _reseed(spec, attempt)
        data = {
            "pddl_domain": assets["domain"],
            "grammar": assets["grammar"].replace("UNKNOWN GOAL", desc),
            "pddl_problem": build_problem(tried),
            "solvable": False,
            "walkthrough": None,
        }
        tmp_dir = game_dir.with_name(game_dir.name + f".tmp{os.getpid()}_{threading.get_ident()}")
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp_game = tmp_dir / "game.tw-pddl"
        tmp_game.write_text(json.dumps(data))
        tmp_plan = tmp_dir / "plan.tw-pddl"
        tmp_plan.write_text(json.dumps({**data, "pddl_problem": build_problem(tried, planning=True)}))
        walkthrough = _solve(tmp_game, tmp_plan)
        tmp_plan.unlink()
        if walkthrough:
            data.update(solvable=True, walkthrough=walkthrough, agentevo_placement_attempt=attempt)
            tmp_game.write_text(json.dumps(data))
            (tmp_dir / "traj_data.json").write_text(json.dumps(traj_data(spec, desc), indent=1))
            with _WRITE_LOCK:
                if not gamefile.exists():
                    try:
                        os.replace(tmp_dir, game_dir)  # atomic: a half-written game is never visible
                    except OSError:
                        if not gamefile.exists():  # not a concurrent writer that finished first
                            raise
            _rmtree(tmp_dir)
            return gamefile
        _rmtree(tmp_dir)
    raise ConfigError(f"could not generate a solvable ALFWorld game for {spec} in {max_tries} tries")


def _reseed(spec: GameSpec, attempt: int) -> GameSpec:
    return GameSpec(
        spec.split,
        spec.index,
        spec.task_type,
        spec.floor_plan,
        spec.object_target,
        spec.parent_target,
        spec.toggle_target,
        spec.seed * 100 + attempt,
    )


def _rmtree(path: Path) -> None:
    if path.exists():
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def generate(root: Path | str | None, split: str, n: int, seed: int = 0) -> list[Path]:
    """Generate (or reuse from the cache) the first n games of a split; returns their game files in order."""
    root = Path(root) if root is not None else DEFAULT_CACHE_DIR / f"seed{seed}"
    return [generate_game(spec, root) for spec in plan_split(split, n, seed)]


if __name__ == "__main__":
    # `python -m agentevo.envs.alfworld_gen --solve GAME PLAN`: the planner process used by _solve
    if len(sys.argv) == 4 and sys.argv[1] == "--solve":
        print("WALKTHROUGH " + json.dumps(_solve_here(sys.argv[2], sys.argv[3])), flush=True)
        os._exit(0)  # skip the native teardown that crashes after planning
