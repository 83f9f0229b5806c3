"""The multi-turn rollout: sample, let the environment answer, append, sample again.

Works with any sampler through ``generate(prompts, n) -> SequenceBatch`` (the ranks' torch
sampler or vLLM): turn 1 samples ``n`` responses per prompt; every trajectory still live gets
its environment's messages appended (the chat template's tokens, engine/agents/render.py), and
its whole context so far becomes the next turn's prompt (n=1, rows kept in order, so the batch
stays prompt-major). A trajectory ends when the environment says so (a turn without a tool
call), at ``max_turns`` model turns, or when its tokens after the prompt reach ``max_tokens``.

The rows it returns: the prompt, then the model's tokens (``response_mask`` 1, the sampler's
log-probs) interleaved with the environment's (``response_mask`` 0, log-prob 0): only what the
model generated carries loss, and everything stays in the context the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batch import SequenceBatch
from engine.rewards.main_thread import needs_main_thread, where_called

STOP_REASONS = ("done", "turn_limit", "token_limit")


@dataclass
class Trajectory:
    prompt: list[int]
    messages: list[dict]
    env: object
    ids: list[int] = field(default_factory=list)      # after the prompt
    mask: list[float] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    reward: float | None = None
    stop: str = ""
    last_answer: str = ""     # the model's last turn, as text (what the task's reward scores)


@dataclass
class AgentRollout:
    batch: SequenceBatch
    trajectories: list[Trajectory]

    def responses(self) -> list[str]:
        return [t.last_answer for t in self.trajectories]

    def env_rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    def metrics(self) -> dict:
        ts = self.trajectories
        k = max(len(ts), 1)
        out = {"turns_mean": sum(t.turns for t in ts) / k, "turns_max": max((t.turns for t in ts), default=0),
               "tool_calls": sum(t.tool_calls for t in ts) / k, "tool_errors": sum(t.tool_errors for t in ts) / k,
               "tool_timeouts": sum(t.tool_timeouts for t in ts) / k}
        for r in STOP_REASONS:
            out[f"stop_{r}"] = sum(t.stop == r for t in ts) / k
        return out


def run_episodes(generate, prompts: list[list[int]], rows: list, n: int, make_env, renderer, decode,
                 *, max_turns: int, max_tokens: int = 0, pad_token_id: int = 0, run_tools=None) -> AgentRollout:
    """``make_env()`` -> a fresh Environment per trajectory; ``decode(ids)`` -> text of one turn;
    ``run_tools([(function, ToolCall)]) -> [ToolResult]`` runs a turn's tool calls, every
    trajectory's together (engine/agents/tool_calls.py; default: here, one after another)."""
    from engine.agents.tool_calls import ToolRunner

    run_tools = run_tools or ToolRunner()
    trajs = []
    for p, row in zip(prompts, rows):
        for _ in range(n):
            env = make_env()
            opening = _env_call(env, "reset", row)
            prompt = list(p) if opening is None else renderer.prompt(opening)
            trajs.append(Trajectory(prompt, list(opening or []), env))
    live = list(range(len(trajs)))
    first = True
    while live:
        heads = [trajs[i].prompt for i in range(0, len(trajs), n)]
        if first and all(trajs[i].prompt == heads[i // n] for i in live):
            batch = generate(heads, n)  # n samples per prompt, as a single-turn rollout draws them
            first = False
        else:
            first = False
            batch = generate([trajs[i].prompt + trajs[i].ids for i in live], 1)
        waiting = []  # (trajectory, its pending step): every live trajectory's tool calls run together
        for row, i in enumerate(live):
            t = trajs[i]
            m = batch.response_mask[row] > 0
            ids = batch.input_ids[row][m].tolist()
            t.ids += ids
            t.mask += [1.0] * len(ids)
            t.logps += batch.rollout_log_probs[row][m].tolist()
            t.turns += 1
            t.last_answer = decode(ids)
            t.messages.append({"role": "assistant", "content": t.last_answer})
            if max_tokens and len(t.ids) >= max_tokens:
                _cut(t, max_tokens)
                t.stop = "token_limit"
                continue
            waiting.append((i, _env_call(t.env, "begin", t.messages)))
        results = iter(run_tools([c for _, p in waiting for c in p.calls]))
        still = []
        for i, pending in waiting:
            t = trajs[i]
            step = _env_call(t.env, "finish", pending, [next(results) for _ in pending.calls])
            t.tool_calls += step.tool_calls
            t.tool_errors += step.tool_errors
            t.tool_timeouts += step.tool_timeouts
            if step.reward is not None:
                t.reward = (t.reward or 0.0) + float(step.reward)
            if step.done:
                t.stop = "done"
                continue
            if t.turns >= max_turns:
                t.stop = "turn_limit"
                continue
            extra = renderer.delta(step.messages)
            if max_tokens and len(t.ids) + len(extra) >= max_tokens:
                t.stop = "token_limit"
                continue
            t.messages += step.messages
            t.ids += extra
            t.mask += [0.0] * len(extra)
            t.logps += [0.0] * len(extra)
            still.append(i)
        live = still
    return AgentRollout(to_batch(trajs, pad_token_id), trajs)


def _env_call(env, what: str, *args):
    """``env.reset(row)`` / ``env.begin(messages)`` / ``pending.finish(results)``; a user environment
    that raises stops the run with an EnvironmentFailed naming it and what it was doing."""
    from engine.agents.environment import ToolEnvironment

    try:
        if what == "finish":
            return args[0].finish(args[1])
        return getattr(env, what)(*args)
    except Exception as e:
        if isinstance(env, ToolEnvironment) and type(env).__module__.startswith("engine."):
            raise  # rl's own: a bug, with its traceback
        from engine.errors import EnvironmentFailed

        name = f"{type(env).__module__}:{type(env).__qualname__}"
        doing = {"reset": "reset(row)", "begin": "step(messages)", "finish": "step(messages)"}[what]
        fix = "fix it, or catch what the model can cause and return it as a message"
        where = where_called(watched=False) if needs_main_thread(str(e)) else ""
        if where:  # (an environment always runs on the driver: no pool to send it to)
            fix = (f"it sets a signal handler, which Python allows only on a process's main thread, and rl called "
                   f"it {where}: time its calls out without signal.alarm, or use trainer.mode=sync")
        raise EnvironmentFailed(f"the environment {name} raised in {doing}: {type(e).__name__}: {e}. An "
                                f"environment's own errors stop the run (a tool's errors go back to the model "
                                f"instead); {fix}.") from e


def _cut(t: Trajectory, k: int) -> None:
    t.ids, t.mask, t.logps = t.ids[:k], t.mask[:k], t.logps[:k]


def to_batch(trajs: list[Trajectory], pad_token_id: int) -> SequenceBatch:
    B = len(trajs)
    T = max(len(t.prompt) + len(t.ids) for t in trajs)
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    rmask = torch.zeros((B, T))
    lp = torch.zeros((B, T))
    for i, t in enumerate(trajs):
        p, r = len(t.prompt), len(t.ids)
        ids[i, :p + r] = torch.tensor(t.prompt + t.ids, dtype=torch.long)
        attn[i, :p + r] = 1
        rmask[i, p:p + r] = torch.tensor(t.mask)
        lp[i, p:p + r] = torch.tensor(t.logps)
    return SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=rmask,
                         prompt_lengths=torch.tensor([len(t.prompt) for t in trajs]), rollout_log_probs=lp)
