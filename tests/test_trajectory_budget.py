"""A multi-turn row is bounded: every trajectory stops at its budget (rollout.max_trajectory_tokens,
or max_turns x max_new_tokens when 0), however long the tools' output, and the length every
consumer is sized for (buckets, vLLM's context, the model's positions, the memory estimate) is
that bound. Before, tool output made rows longer than the buckets' top (a warning on every
multi-turn run, and a vLLM context too short for a second turn)."""

from __future__ import annotations

import string

import torch

from engine.config.lengths import longest_sequence, sampler_context, trajectory_tokens
from engine.config.load import load_run_config
from tests.dist_utils import run_ranks


def _cfg(*overrides):
    return load_run_config(list(overrides)).config


def test_a_single_turn_row_is_a_prompt_and_one_response():
    c = _cfg("rollout.max_new_tokens=12", "data.max_prompt_length=30")
    assert (trajectory_tokens(c), longest_sequence(c), sampler_context(c)) == (12, 42, 42)


def test_a_multi_turn_row_is_the_prompt_and_the_trajectory_budget():
    c = _cfg("task=tool_add", "rollout.max_new_tokens=9", "rollout.max_turns=3", "data.max_prompt_length=20")
    assert trajectory_tokens(c) == 27 and longest_sequence(c) == 47
    assert sampler_context(c) == 47 + 9  # one more turn may start just under the budget
    c = _cfg("task=tool_add", "rollout.max_new_tokens=9", "rollout.max_trajectory_tokens=15",
             "data.max_prompt_length=20")
    assert trajectory_tokens(c) == 15 and longest_sequence(c) == 35


def _long_tool_rollout(rank, world):
    """The tiny model with a tool whose result is 40 characters, 3 turns of 8 tokens (budget 24),
    prompts of at most 8 tokens: a row may be 32 tokens, twice a single-turn row (16)."""
    from engine.agents.environment import ToolEnvironment
    from engine.agents.loop import run_episodes
    from engine.agents.parsers import CompactParser
    from engine.agents.render import PlainRenderer
    from engine.backends.fsdp import FSDPEngine
    from engine.model.tokenizer import CharTokenizer
    from engine.rollout.torch_sampler import TorchSampler

    tok = CharTokenizer(string.digits + "+=[]")

    def echo(expr: str) -> str:
        """Repeats its argument.

        Args:
            expr: any text
        """
        return "1234567890" * 4

    cfg = _cfg("task=tool_add", "rollout.max_new_tokens=8", "rollout.max_turns=3", "engine.cpu_matmul=aten",
               "engine.pad_to_length=true", "engine.pad_to_length_bucket=8", "data.max_prompt_length=8")
    eng = FSDPEngine(cfg, "", tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"),
                     updates_per_step=1)
    eng.build()
    close = tok.stoi["]"]
    sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device)
    sampler.stop_token_ids = (close,)
    gen = torch.Generator().manual_seed(0)
    prompts = [tok.encode("12+30="), tok.encode("7+5=")]
    with eng.generation_model() as m:
        out = run_episodes(lambda p, n: sampler.generate(m, p, n, gen), prompts, [None] * 2, 4,
                           lambda: ToolEnvironment({"echo": echo}, CompactParser()), PlainRenderer(tok), tok.decode,
                           max_turns=cfg.rollout.max_turns, max_tokens=trajectory_tokens(cfg),
                           pad_token_id=tok.pad_token_id)
    eng.compute_log_probs(out.batch)
    lengths = out.batch.attention_mask.sum(-1).tolist()
    return lengths, longest_sequence(cfg), eng.bucket_policy.max_length, eng.bucket_policy.overflows, out.metrics()


def test_long_tool_output_stops_the_trajectory_at_the_budget_and_rows_fit_the_buckets():
    (lengths, longest, top, overflows, metrics), = run_ranks(_long_tool_rollout, 1)
    assert top == longest                     # the engine's buckets are sized for the longest row
    assert max(lengths) <= longest and overflows == 0
    assert metrics["tool_calls"] > 0 and metrics["stop_token_limit"] > 0  # the 40-char results hit the budget
