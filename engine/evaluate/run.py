"""`evaluate(PATH, overrides)`: locate the model (engine/evaluate/model_source.py) -> compose the
config (engine/evaluate/config.py) -> the task's prompts (its held-out or train split, encoded as
the trainer encodes them) -> a greedy pass and/or a sampled pass (the torch sampler, or vLLM with
``rollout=vllm``) -> every response scored by the task's own reward functions (engine/rewards)
-> per data source and overall: accuracy, mean reward, pass@k -> eval.jsonl.

One process, no Ray, no process group: the model is a transformers causal LM loaded from the
directory, on ``trainer.device``."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from engine.errors import ConfigError
from engine.evaluate.config import eval_config
from engine.evaluate.model_source import open_model
from engine.evaluate.pass_at_k import default_ks, mean_pass_at_k
from engine.evaluate.records import check_output, write_rows
from engine.evaluate.result import EvalResult, Scores


def evaluate(path: str, overrides: Optional[list[str]] = None,
             on_phase: Optional[Callable[[str], None]] = None) -> EvalResult:
    """Evaluate the model at ``path`` (an rl checkpoint, an `rl export` output or a Hugging Face
    causal-LM directory); ``on_phase(text)`` hears what is being done (for a progress line)."""
    t0 = time.perf_counter()
    say = on_phase or (lambda _text: None)
    say("reading the model")
    with open_model(path) as src:
        cfg = eval_config(list(overrides or []), src.saved_config)
        if cfg.eval.output:
            check_output(cfg.eval.output)
        return _evaluate(cfg, src, say, t0)


def _evaluate(cfg, src, say, t0: float) -> EvalResult:
    from engine.data.prompts import encode_split
    from engine.model.tokenizer import HFTokenizer
    from engine.rewards.compute import make_runner
    from engine.tasks.registry import make_task

    e = cfg.eval
    task = make_task(cfg.task, cfg.trainer.seed)
    examples = task.val if e.split == "held-out" else task.train
    if e.max_prompts:
        examples = examples[:e.max_prompts]
    if not examples:
        raise ConfigError(_no_prompts(cfg, task), title="no prompts")
    tok = HFTokenizer(src.model_dir)
    enc = encode_split(tok, examples, split=e.split, max_len=cfg.data.max_prompt_length,
                       filter_overlong=cfg.data.filter_overlong_prompts, chat_template=cfg.task.chat_template)
    examples, prompts = enc.examples, enc.ids
    if not prompts:
        raise ConfigError(f"Every {e.split} prompt is longer than data.max_prompt_length={cfg.data.max_prompt_length} "
                          f"tokens and was dropped. Raise data.max_prompt_length.", title="prompt too long")
    from engine.agents.setup import agent_setup

    agent = agent_setup(cfg, tok, task.tools, task.environment)  # multi-turn with tools: the loop rl train runs
    if agent is not None:
        prompts = agent.encode_prompts(examples, prompts)
    _check_fits(src, tok, prompts, cfg.rollout.max_new_tokens)
    from engine.reward_model.build import scorers_for

    runner = make_runner(task, cfg.task, scorers_for(cfg, tok))  # a reward model scores in this process
    if agent is not None:
        agent.use_reward_executors(runner)
    k_list = sorted(set(e.k)) if e.k else default_ks(e.n)
    sampler_cfg = replace(cfg.rollout, temperature=e.temperature, top_p=e.top_p, ignore_eos=False)
    cfg = replace(cfg, rollout=sampler_cfg)
    generate, device, close = _sampler(cfg, src.model_dir, tok, len(prompts) * max(e.n, 1), say, agent, examples)
    rows: list[dict] = []
    failures = 0
    has_check = False  # the task's functions say what is correct (else: reward >= eval.pass_threshold)
    sources = [_data_source(ex, task) for ex in examples]
    greedy_correct = greedy_reward = sampled = None
    try:
        if e.greedy:
            say(f"greedy pass: {len(prompts)} prompts")
            responses, ids = generate(prompts, 1, True)
            say(f"scoring {len(responses)} greedy responses")
            scored, correct = _score(runner, examples, responses, ids, 1, e.pass_threshold)
            failures += len(scored.failures)
            has_check = scored.correct is not None
            greedy_correct, greedy_reward = correct, scored.total
            rows += _rows("greedy", examples, sources, responses, scored, correct, 1)
        if e.n:
            say(f"sampled pass: {len(prompts)} prompts x {e.n} at temperature {e.temperature:g}")
            responses, ids = generate(prompts, e.n, False)
            say(f"scoring {len(responses)} sampled responses")
            scored, correct = _score(runner, examples, responses, ids, e.n, e.pass_threshold)
            failures += len(scored.failures)
            has_check = has_check or scored.correct is not None
            sampled = (correct, scored.total)
            rows += _rows("sampled", examples, sources, responses, scored, correct, e.n)
    finally:
        close()
        runner.close()
    names = sorted(set(sources))
    by_source = [_scores(name, [i for i, s in enumerate(sources) if s == name], greedy_correct, greedy_reward,
                         sampled, e.n, k_list) for name in names]
    overall = _scores("all", list(range(len(sources))), greedy_correct, greedy_reward, sampled, e.n, k_list)
    if e.output:
        say(f"writing {e.output}")
        write_rows(e.output, rows)
    return EvalResult(
        source=src.to_json(), task=cfg.task.name, split=e.split, prompts=len(prompts), greedy=e.greedy, n=e.n,
        k=k_list if e.n else [], temperature=e.temperature, top_p=e.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
        sampler=cfg.rollout.name, device=str(device),
        correct_from="the task's correctness check" if has_check else f"reward >= {e.pass_threshold:g}",
        overall=overall, by_source=by_source, responses=len(rows), reward_failures=failures,
        output=str(Path(e.output)) if e.output else None, seconds=time.perf_counter() - t0,
        reward=runner.describe())


def _no_prompts(cfg, task) -> str:
    """Why the split eval.split names is empty, and what fills it."""
    split, num_val, t = cfg.eval.split, cfg.task.num_val, cfg.task
    if split != "held-out":
        return f"The task's {split} split has no prompts. Evaluate the held-out split (eval.split=held-out)."
    if num_val == 0:
        return ("The task holds no prompts out: task.num_val=0. Hold some out (task.num_val=64), or evaluate on "
                "the train split (eval.split=train).")
    info = task.data_info or {}
    if info.get("val_split"):
        return (f"The dataset's held-out split task.val_split={info['val_split']} has no rows. Point "
                f"task.val_split at a split with rows, or evaluate on the train split (eval.split=train).")
    if info.get("rows"):  # a dataset task without task.val_split: its held-out rows come from the train split
        rows = info["rows"]["train"] + info["rows"]["val"]
        return (f"The dataset holds no prompts out: it has {rows} row{'s' if rows != 1 else ''}, and without "
                f"task.val_split the held-out prompts are a fifth of the train split's rows at most (min("
                f"task.num_val={num_val}, rows // 5)), so data of fewer than 5 rows holds none out. Name a held-out "
                f"split with task.val_split, use data of at least 5 rows, or evaluate on the train split "
                f"(eval.split=train).")
    return (f"The task's held-out split has no prompts (task.num_val={num_val}). Evaluate on the train split "
            f"(eval.split=train).")


def _check_fits(src, tok, prompts: list[list[int]], max_new_tokens: int) -> None:
    from engine.model.source import check_vocab, context_length

    model_dir = src.model_dir
    check_vocab(model_dir, tok, prompts)
    limit, key = context_length(model_dir)
    longest = max(len(p) for p in prompts)
    if limit and longest + max_new_tokens > limit:
        if src.kind == "checkpoint":  # model_dir is this eval's temporary export: name the checkpoint's model
            key = key.replace(f"{model_dir}/config.json", f"the model's (in {src.step_dir})")
        room = limit - max_new_tokens  # the longest prompt that fits these responses
        drop = (f", or drop long prompts with data.max_prompt_length={room} data.filter_overlong_prompts=true"
                if room > 0 else "")
        raise ConfigError(f"prompt ({longest} tokens) + rollout.max_new_tokens ({max_new_tokens}) exceeds {key} "
                          f"({limit}): the model has no positions past {limit}, and `rl eval` evaluates it as it "
                          f"is. Lower rollout.max_new_tokens (at most {max(limit - longest, 1)}){drop}.",
                          title="prompt too long")


def _sampler(cfg, model_dir: str, tok, rows: int, say, agent=None, examples=None):
    """(generate(prompts, n, greedy) -> (decoded responses, their token ids), device, close).
    With ``agent`` (engine/agents/setup.py): the multi-turn loop, the responses the model's last
    turns (what the reward scores), the ids every model token of the trajectory."""
    import torch

    from engine.device import cuda_available, resolve_device
    from engine.model.build import build_hf_model

    if cfg.trainer.device == "cuda" and not cuda_available():
        raise ConfigError("trainer.device=cuda, but this machine has no CUDA device. Evaluate with "
                          "trainer.device=cpu (or auto).", title="invalid config")
    device = resolve_device(cfg.trainer.device)
    say(f"loading {model_dir}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI shows what is being done; no tqdm bar on stderr
    model = build_hf_model(cfg.model, model_dir, tok.vocab_size, cfg.trainer.seed, tok.pad_token_id,
                           tok.eos_token_id).eval()
    generator = torch.Generator().manual_seed(cfg.eval.seed)
    if cfg.rollout.name == "vllm":
        from engine.rollout.vllm_sampler import VLLMSampler

        say("starting vLLM")
        # the weights stay on the host: vLLM takes its share of the GPU from the memory free when it
        # starts, and a copy of the model there would only shrink its KV cache (or fail its start)
        sampler = VLLMSampler(cfg, model.config, model.state_dict(), tok.pad_token_id, tok.eos_token_id, device,
                              0, rows)
        model = None  # vLLM holds its own copy
    else:
        from engine.rollout.torch_sampler import TorchSampler

        model = model.to(device)
        sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, device)

    sampler.set_ends({"eos": tok.eos_token_id, "ends": tok.end_token_ids,
                      "stops": agent.stop_ids if agent is not None else ()})

    def generate(prompts: list[list[int]], n: int, greedy: bool) -> tuple[list[str], list[list[int]]]:
        if agent is not None:
            out = agent.run(lambda p, k: sampler.generate(model, p, k, generator, greedy=greedy), prompts, examples,
                            n, tok)
            batch = out.batch
            ids = [batch.input_ids[i][batch.response_mask[i] > 0].tolist() for i in range(len(batch))]
            return out.responses(), ids
        batch = sampler.generate(model, prompts, n, generator, greedy=greedy)
        ids = [batch.input_ids[i][batch.response_mask[i] > 0].tolist() for i in range(len(batch))]
        return [tok.decode(x) for x in ids], ids

    return generate, device, sampler.shutdown


def _score(runner, examples: list, responses: list[str], ids: list, n: int, threshold: float):
    from engine.rewards.compute import samples_of

    scored = runner.score(samples_of(examples, responses, n, ids))  # trainer_state: zeros (not training)
    correct = scored.correct if scored.correct is not None else [r >= threshold for r in scored.total]
    return scored, correct


def _data_source(example, task) -> str:
    value = (example.row or {}).get("data_source")
    if value is not None and value != "":
        return str(value)
    source = (task.data_info or {}).get("source")
    return Path(str(source)).name if source else task.name


def _rows(mode: str, examples: list, sources: list[str], responses: list[str], scored, correct: list, n: int):
    several = len(scored.per_sample_fn) > 1
    out = []
    for j, response in enumerate(responses):
        i = j // n
        row = {"eval": mode, "index": i, "sample": j % n, "data_source": sources[i], "prompt": examples[i].prompt,
               "answer": examples[i].answer, "response": response, "reward": scored.total[j],
               "correct": bool(correct[j])}
        if several:
            row["rewards"] = {name: values[j] for name, values in scored.per_sample_fn.items()}
        out.append(row)
    return out


def _mean(xs: list) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def _scores(name: str, idx: list[int], greedy_correct, greedy_reward, sampled, n: int, ks: list[int]) -> Scores:
    s = Scores(name, len(idx))
    if greedy_reward is not None:
        s.greedy_accuracy = _mean([float(greedy_correct[i]) for i in idx])
        s.greedy_reward = _mean([greedy_reward[i] for i in idx])
    if sampled is not None:
        correct, reward = sampled
        rows = [i * n + j for i in idx for j in range(n)]
        s.sampled_accuracy = _mean([float(correct[r]) for r in rows])
        s.sampled_reward = _mean([reward[r] for r in rows])
        counts = [(n, sum(bool(correct[i * n + j]) for j in range(n))) for i in idx]
        s.pass_at_k = {k: mean_pass_at_k(counts, k) for k in ks}
    return s
