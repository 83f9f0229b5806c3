"""Multi-turn rollouts on vLLM (rollout=vllm): the stop token ends a turn there too, and the
rollout's log-probs on the whole multi-turn sequence (tool tokens masked) equal the training
engine's recompute. One vLLM start (~20-60 s on 2 cores)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.test_agents_loop import ALPHABET, add
from tests.test_vllm import VLLM_TINY, vllm_importable  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _vllm_multi_turn(rank, world):
    from engine.agents.environment import ToolEnvironment
    from engine.agents.loop import run_episodes
    from engine.agents.parsers import CompactParser
    from engine.agents.render import PlainRenderer
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.model.tokenizer import CharTokenizer
    from engine.rollout.vllm_sampler import VLLMSampler

    tok = CharTokenizer(ALPHABET)
    cfg = load_run_config(["rollout=vllm", "trainer.device=cpu", *VLLM_TINY, "rollout.temperature=0.8",
                           "rollout.max_new_tokens=8", "engine.cpu_matmul=aten"]).config
    eng = FSDPEngine(cfg, "", tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"),
                     updates_per_step=1)
    eng.build()
    close = tok.stoi["]"]
    with torch.no_grad():  # make "]" likely, so turns end in calls (before vLLM copies the weights)
        h = eng.model.model(torch.tensor([tok.encode("12+30=[]0123")])).last_hidden_state[0].mean(0)
        eng.model.lm_head.weight[close] += 2.5 * h / h.norm() ** 2
    vocab = {"size": tok.vocab_size, "pad": tok.pad_token_id, "eos": tok.eos_token_id, "stops": [close]}
    sampler = VLLMSampler.from_engine(cfg, eng, "", vocab, eng.device, rank)
    try:
        gen = torch.Generator().manual_seed(5)
        prompts = [tok.encode("12+30="), tok.encode("7+5="), tok.encode("100+23=")]
        out = run_episodes(lambda p, n: sampler.generate(None, p, n, gen), prompts, [None] * 3, 4,
                           lambda: ToolEnvironment({"add": add}, CompactParser()), PlainRenderer(tok), tok.decode,
                           max_turns=3, max_tokens=60, pad_token_id=tok.pad_token_id)
    finally:
        sampler.shutdown()
    recomputed, _ = eng.compute_log_probs(out.batch)
    return out.batch, recomputed, out.metrics(), close


def test_vllm_multi_turn_log_probs_equal_the_engine(vllm_importable):  # noqa: F811
    (batch, recomputed, metrics, close), = run_ranks(_vllm_multi_turn, 1)
    assert len(batch) == 12 and metrics["turns_max"] >= 2 and metrics["tool_calls"] > 0
    mask = batch.response_mask
    assert torch.allclose(batch.rollout_log_probs * mask, recomputed * mask, atol=1e-4), \
        (batch.rollout_log_probs * mask - recomputed * mask).abs().max()
    for i in range(len(batch)):  # a model turn ends at EOS, at "]" (kept) or at max_new_tokens
        p, n = int(batch.prompt_lengths[i]), int(batch.attention_mask[i].sum())
        ids, m = batch.input_ids[i, p:n].tolist(), mask[i, p:n].tolist()
        turn = []
        for j, (t, w) in enumerate(zip(ids, m)):
            if w:
                turn.append(t)
            if turn and (not w or j == len(ids) - 1):
                assert close not in turn[:-1] and 1 not in turn[:-1]
                if not w:
                    assert turn[-1] == close or len(turn) == 8
                turn = []
