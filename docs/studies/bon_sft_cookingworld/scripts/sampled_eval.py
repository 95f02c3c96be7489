"""Held-out success of a checkpoint when sampling at T (not the greedy protocol): does the policy know more than
its greedy decode shows? Usage:
python docs/studies/bon_sft_cookingworld/scripts/sampled_eval.py RUN_DIR CHECKPOINT SEED [T] [N_SAMPLES]
(the study: runs/bc-s0 bc 0 0.7 1). Writes runs/diag/<run>-<checkpoint>-T<T>."""
import json
import shutil
import sys
from pathlib import Path

from agentevo.config import load_config
from agentevo.eval.metrics import summarize
from agentevo.models.backend import Sampling
from agentevo.rollout.engine import EpisodeRequest, PolicyActor
from agentevo.run import Run

src, ckpt, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
temp = float(sys.argv[4]) if len(sys.argv) > 4 else 0.7
n = int(sys.argv[5]) if len(sys.argv) > 5 else 1
name = f"{src.name}-{ckpt}-T{temp}"
cfg = load_config("configs/study/qevolve_cookingworld.yaml", [f"seed={seed}", "bc.warm_start_from=null"], method="bc",
                  name=name, output_dir="runs/diag")
run = Run.create(cfg, quiet=True, overwrite=True)
shutil.copytree(src / "checkpoints" / ckpt, run.checkpoint_dir(ckpt), dirs_exist_ok=True)
actor = PolicyActor(run.rollout_policy(ckpt), run.signal_env.instruction(), cfg.agent.history_window,
                    Sampling(temp, cfg.rollout.top_p, cfg.agent.max_new_tokens, seed=seed * 31 + 1))
tasks = list(run.tasks("test"))
reqs = [EpisodeRequest(t, k * n + i) for k, t in enumerate(tasks) for i in range(n)]
trajs = run.collect(actor, reqs, "sampled/test", "sampled")
m = summarize(trajs)
solved = {t.task.task_id for t in trajs if t.success}
print(json.dumps({"run": str(src), "ckpt": ckpt, "T": temp, "n": n, "success": m["success_rate"],
                  "invalid": m["invalid_rate"], f"pass@{n}": len(solved) / len(tasks)}))
run.close()
