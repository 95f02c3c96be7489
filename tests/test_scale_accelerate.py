"""Training under `accelerate launch`: 2 CPU processes (gloo) follow the single-process loss curve."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agentevo.errors import ConfigError
from agentevo.train.loop import rank_micro_batches

REPO = Path(__file__).resolve().parents[1]

# Trains the model saved in argv[1] twice (full fine-tuning; LoRA with gradient checkpointing) and writes what
# every rank saw to argv[2]/rank<k>.json. Run as one process, or under `accelerate launch --num_processes 2 --cpu`.
SCRIPT = r'''
import json, sys
from pathlib import Path

import torch
from accelerate import PartialState

from agentevo.agent.prompt import expert_reply, parse_action
from agentevo.algorithms.bc import nll_loss
from agentevo.config import OptimConfig
from agentevo.data.tensors import trajectory_samples
from agentevo.data.types import Step, Trajectory
from agentevo.envs.base import Task
from agentevo.models.backend import TransformersPolicy, load_pretrained

torch.set_num_threads(1)
init, out = Path(sys.argv[1]), Path(sys.argv[2])
state = PartialState(cpu=True)


def samples(policy):
    r, rows = policy.renderer, []
    for k in range(8):
        task = Task("twx-cookingworld", f"t{k}", "train", "cookingworld", {}, 20)
        actions = ["take knife", "open fridge", "slice carrot"][: 1 + k % 3]
        steps = [Step(t, f"obs {k} {t}", expert_reply(a), r.encode_reply(expert_reply(a)), None, parse_action(a),
                      "next", 0.0, False) for t, a in enumerate(actions, start=1)]
        rows.extend(trajectory_samples(r, Trajectory(task, "expert", "expert", "Instr.", steps, 1.0, True, goal="g"),
                                       k, 10, 1024))
    return rows


from agentevo.train.loop import train  # noqa: E402

cfg = OptimConfig(lr=5e-3, epochs=3, batch_size=4, micro_batch_size=1, warmup_ratio=0.1, save_every=0)
result = {"world": state.num_processes, "rank": state.process_index}
for mode in ("full", "lora"):
    model, tok = load_pretrained(init)
    policy = TransformersPolicy(model, tok, "init")
    rows = samples(policy)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(1)  # the adapters' random init must not depend on what ran before in this process
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    losses = []
    train(model, rows, nll_loss, cfg, policy.pad_id, out / f"work-{mode}", seed=0, tokenizer=tok,
          on_step=lambda s, n, rec: losses.append([rec["loss"], rec["grad_norm"], rec["tokens"]]),
          gradient_checkpointing=(mode == "lora"), save_to=out / f"final-{mode}")
    result[mode] = losses
    result[mode + "_checksum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
(out / f"rank{state.process_index}.json").write_text(json.dumps(result))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def test_rank_micro_batches_deal_each_step_round_robin() -> None:
    # 3 optimiser steps of 4 micro-batches over 2 processes: each runs 2 of every step's 4
    assert rank_micro_batches(12, 4, 2, 0) == [0, 2, 4, 6, 8, 10]
    assert rank_micro_batches(12, 4, 2, 1) == [1, 3, 5, 7, 9, 11]
    assert rank_micro_batches(12, 4, 2, 1, start_step=2) == [9, 11]  # resumed after step 2
    assert rank_micro_batches(12, 4, 1, 0, start_step=1) == list(range(4, 12))
    with pytest.raises(ConfigError, match="4 micro-batches per optimiser step cannot be shared by 3 processes"):
        rank_micro_batches(12, 4, 3, 0)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_accelerate_configs_parse(name: str) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
    assert cfg.mixed_precision == "bf16" and cfg.num_processes == 8
    expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP"}.get(name, "DEEPSPEED")
    assert str(cfg.distributed_type).endswith(expected)
    if name.startswith("deepspeed"):
        assert "gradient_accumulation_steps" not in cfg.deepspeed_config  # the loop sets it
        assert cfg.deepspeed_config["gradient_clipping"] == 1.0  # = optim.grad_clip's default


@pytest.mark.slow
def test_two_gloo_processes_follow_the_single_process_loss_curve(tiny_policy, tmp_path) -> None:  # noqa: ANN001
    """`accelerate launch --num_processes 2` with the DDP config, on CPUs: same losses, gradients and weights."""
    tiny_policy.save(tmp_path / "init")
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    subprocess.run([sys.executable, str(script), str(tmp_path / "init"), str(one)], check=True, env=_env(),
                   cwd=REPO, timeout=600)
    # With the DDP config, accelerate starts the processes through torchrun; on a machine without GPUs the loop's
    # Accelerator(cpu=True) then joins them over gloo. (`--cpu` alone would start one process unless mpirun is used.)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()), "--num_cpu_threads_per_process", "1",
              str(script), str(tmp_path / "init"), str(two)]
    subprocess.run(launch, check=True, env=_env(), cwd=REPO, timeout=600)
    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert single["world"] == 1 and [r["world"] for r in ranks] == [2, 2]
    for mode in ("full", "lora"):
        ref = torch.tensor(single[mode], dtype=torch.float64)
        assert len(ref) == 6  # 8 trajectories -> 24 micro-batches of 1 (3 epochs) -> 6 steps of 4
        assert ref[-1, 0] < ref[0, 0]  # it learned
        for r in ranks:  # every rank logs the same step means, equal to the single process's
            got = torch.tensor(r[mode], dtype=torch.float64)
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5), (mode, got, ref)
            assert r[mode + "_checksum"] == pytest.approx(single[mode + "_checksum"], rel=1e-5)
        # save_to wrote one folder, from rank 0, that loads back as a normal model
        assert (two / f"final-{mode}").is_dir() and not (two / f"final-{mode}.tmp").exists()
    from agentevo.models.backend import load_pretrained

    model, _ = load_pretrained(two / "final-full")
    assert float(sum(p.detach().double().sum() for p in model.parameters())) == pytest.approx(
        ranks[0]["full_checksum"], rel=1e-5)


RECIPE_SMALL = [
    "--config", "configs/demo_twx_bc.yaml",
    "--set", "env.n_train=4", "--set", "env.n_test=4", "--set", "env.params.max_steps=3",
    "--set", "optim.epochs=2", "--set", "optim.batch_size=2", "--set", "optim.micro_batch_size=1",
    "--set", "model.tiny.hidden_size=32", "--set", "model.tiny.num_layers=1", "--set", "model.tiny.num_heads=2",
    "--set", "model.tiny.intermediate_size=64", "--set", "rollout.n_parallel=2", "--set", "agent.max_new_tokens=6",
    "--set", "model.torch_threads=1", "--quiet",
]


def _launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", str(nproc), "--mixed_precision",
              "no", "--main_process_port", str(_free_port()), "--num_cpu_threads_per_process", "1",
              "-m", "agentevo.cli", *args]
    return subprocess.run(launch, env=_env(), cwd=REPO, timeout=900, capture_output=True, text=True)


def _one_and_two(args: list[str], tmp_path: Path) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """`agentevo train ARGS` as one process (run "one") and as 2 accelerate processes (run "two"); their state.json
    files, and the 2-process run's output."""
    one = subprocess.run([sys.executable, "-m", "agentevo.cli", "train", *args, "--name", "one",
                          "--output-dir", str(tmp_path)], env=_env(), cwd=REPO, timeout=900, capture_output=True,
                         text=True)
    assert one.returncode == 0, one.stderr
    two = _launch(2, ["train", *args, "--name", "two", "--output-dir", str(tmp_path)])
    assert two.returncode == 0, two.stderr
    return {k: json.loads((tmp_path / k / "state.json").read_text()) for k in ("one", "two")}, two


@pytest.mark.slow
def test_bc_recipe_under_two_processes_matches_one(tmp_path) -> None:  # noqa: ANN001
    """`accelerate launch -m agentevo.cli train bc`: rank 0 collects and evaluates once, both ranks train."""
    import sqlite3

    from transformers import AutoModelForCausalLM

    states, two = _one_and_two(RECIPE_SMALL, tmp_path)
    assert (states["one"]["bc"]["processes"], states["two"]["bc"]["processes"]) == (1, 2)
    assert states["two"]["bc"]["loss"] == pytest.approx(states["one"]["bc"]["loss"], rel=1e-4)
    assert states["two"]["eval/bc"] == states["one"]["eval/bc"]
    with sqlite3.connect(tmp_path / "two" / "experience.db") as conn:
        counts = dict(conn.execute("SELECT collection, COUNT(*) FROM trajectories GROUP BY collection").fetchall())
    assert counts == {"expert": 4, "eval/init/test": 4, "eval/bc/test": 4}  # played once, not once per rank
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / k / "checkpoints" / "bc") for k in ("one", "two")]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert two.stdout.count("success") == 1  # one summary table, from rank 0

    refused = _launch(2, ["train", "qlass", *RECIPE_SMALL, "--name", "g", "--output-dir", str(tmp_path)])
    assert refused.returncode != 0
    assert "recipe 'qlass' does not run under accelerate launch yet" in refused.stderr


@pytest.mark.slow
def test_automatic_threads_under_two_processes_share_the_cores(tmp_path) -> None:  # noqa: ANN001
    """Without model.torch_threads each of 2 ranks takes half of the idle cores rank 0 saw (not all of them each)."""
    args = [a if a != "model.torch_threads=1" else "model.torch_threads=null" for a in RECIPE_SMALL]  # the demo pins 2
    two = _launch(2, ["train", *args, "--name", "auto", "--output-dir", str(tmp_path)])
    assert two.returncode == 0, two.stderr
    (start,) = json.loads((tmp_path / "auto" / "state.json").read_text())["machine"]
    assert 1 <= start["threads"] <= max(1, round((os.cpu_count() or 1) / 2))


QEVOLVE_SMALL = [
    "qevolve", "--config", "configs/qevolve_twx.yaml", *RECIPE_SMALL[2:],
    "--set", "qevolve.n_iters=1", "--set", "qevolve.n_self_per_task=2", "--set", "qevolve.critic_hidden=16",
    "--set", "qevolve.critic_batch_size=4", "--set", "qevolve.critic_micro_batch_size=2",
    "--set", "qevolve.policy_batch_size=4", "--set", "qevolve.policy_micro_batch_size=1",
    "--set", "qevolve.policy_epochs=2", "--set", "qevolve.policy_lr=1e-3", "--set", "agent.history_window=3",
]


@pytest.mark.slow
def test_qevolve_under_two_processes_matches_one(tmp_path) -> None:  # noqa: ANN001
    """Q-Evolve: rank 0 collects, fits the critic and labels; both ranks run the policy update (finetune)."""
    import sqlite3

    from transformers import AutoModelForCausalLM

    states, two = _one_and_two(QEVOLVE_SMALL, tmp_path)
    policy = {k: states[k]["round-1/policy"] for k in states}
    assert (policy["one"]["processes"], policy["two"]["processes"]) == (1, 2)
    assert policy["one"]["samples"] == policy["two"]["samples"] > 0
    for key in ("loss", "kl_ref", "kl_old", "tokens"):
        assert policy["two"][key] == pytest.approx(policy["one"][key], rel=1e-4, abs=1e-6), key
    critic = {k: {m: v for m, v in states[k]["round-1/critic"].items() if v is not None} for k in states}
    assert critic["two"] == pytest.approx(critic["one"], rel=1e-5)  # fitted once, on rank 0
    assert states["two"]["eval/round-1"] == states["one"]["eval/round-1"]
    with sqlite3.connect(tmp_path / "two" / "experience.db") as conn:
        counts = dict(conn.execute("SELECT collection, COUNT(*) FROM trajectories GROUP BY collection").fetchall())
    assert counts["round-1/self"] == 8  # 4 tasks x 2, played once, not once per rank
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / k / "checkpoints" / "round-1") for k in ("one", "two")]
    moved = 0.0
    bc = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "checkpoints" / "bc")
    for a, b, c in zip(models[0].parameters(), models[1].parameters(), bc.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
        moved = max(moved, float((a - c).detach().abs().max()))
    assert moved > 1e-4  # the update changed the policy


GRPO_SMALL = [
    "grpo", "--config", "configs/grpo_twx.yaml", *RECIPE_SMALL[2:],
    "--set", "grpo.n_updates=2", "--set", "grpo.tasks_per_update=2", "--set", "grpo.group_size=3",
    "--set", "grpo.batch_size=5", "--set", "grpo.micro_batch_size=1", "--set", "grpo.eval_every=2",
    "--set", "grpo.lr=1e-3", "--set", "grpo.ppo_epochs=2", "--set", "agent.history_window=3",
    # The untrained tiny model never succeeds, so every group's outcome advantages are 0: a per-step penalty on its
    # format errors gives the update a gradient to share.
    "--set", "grpo.invalid_penalty=0.5", "--set", "grpo.penalty_mode=step",
]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["grpo", "selfguide"])
def test_grpo_updates_under_two_processes_match_one(recipe: str, tmp_path) -> None:  # noqa: ANN001
    """GRPO / Self-Guide: rank 0 rolls out and labels, both ranks run the DDP update; 6 rows per update = batches
    of 5 and 1, so the short batch gives one rank a zero-weight stand-in micro-batch."""
    from transformers import AutoModelForCausalLM

    args = GRPO_SMALL if recipe == "grpo" else [
        "selfguide", "--config", "configs/selfguide_twx.yaml", *GRPO_SMALL[3:], "--set", "selfguide.guide_max_tokens=8"]
    states, two = _one_and_two(args, tmp_path)
    for k in (1, 2):
        a, b = states["one"][f"update-{k}"], states["two"][f"update-{k}"]
        assert a["rollout_n"] == b["rollout_n"] == 6
        assert a["grad_norm"] > 0.1
        for key in ("loss", "pg_loss", "kl", "tokens", "grad_norm", "rollout_success_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (k, key)
    assert states["two"]["eval/update-2"] == states["one"]["eval/update-2"]
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / k / "checkpoints" / "update-2") for k in ("one", "two")]
    bc = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "checkpoints" / "bc")
    moved = 0.0
    for a, b, c in zip(models[0].parameters(), models[1].parameters(), bc.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
        moved = max(moved, float((a - c).detach().abs().max()))
    assert moved > 1e-4  # the updates changed the policy
