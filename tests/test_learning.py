"""rl learns, on a job where stopping matters: the fast subset of bench/learning.py that CI runs.

A random-init tiny Llama with a byte-level BPE tokenizer built offline (pad 0, BOS 1, EOS 2: all
different), the ``count`` job (``count ab cd ef=`` -> ``3``: a one-digit answer, so a response that
never ends scores badly on length), partial-credit reward, GRPO 8 prompts x 8 samples, at most 16
new tokens, rl's default loss aggregation (token-mean), lr 3e-3 with no warm-up, two seeds, through
the real ``rl train`` command. Each seed must learn to stop (the mean response length falls from
~16 to under 10) and the reward must rise several-fold. A sampler that draws EOS too rarely, a
response mask without EOS, a loss of the wrong sign or normalisation, or advantages attached to the
wrong rows each stop this from happening (tests/test_sampling_parity.py and
tests/test_update_parity.py check those pieces one by one against their formulas).

~25 s a seed on 2 cores; the whole suite (jobs x seeds x TRL beside rl) is
``python bench/learning.py`` (docs/benchmarks.md, "Learning").
"""

from __future__ import annotations

import json

import pytest

from tests.cli_utils import rl
from tests.learning_job import count_job
STEPS, NEW_TOKENS = 30, 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return count_job(tmp_path_factory, "learning")


@pytest.mark.slow
@pytest.mark.parametrize("seed,mode", [(0, "sync"), (1, "sync"), (0, "one_step_off"), (0, "streamed")])
def test_rl_learns_to_stop(job, seed, mode, tmp_path):
    """(one_step_off: every sample after step 1 one policy version old; streamed: the update runs on
    chunks of prompt groups as they complete, the normaliser applied at the end; docs/async.md. Each
    must still learn)"""
    from bench.learning import rl_overrides

    work, job_dir = job
    run_dir = tmp_path / "run"
    r = rl("train", *rl_overrides(job_dir, work / "model", seed, STEPS, loss="token-mean", new_tokens=NEW_TOKENS),
           "optim.lr=3e-3", "trainer.threads_per_rank=1", "checkpoint.save_final=false", f"checkpoint.dir={run_dir}",
           f"trainer.mode={mode}", cwd=job_dir)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == STEPS
    length = [x["response_len_mean"] for x in rows]
    reward = [x["reward_mean"] for x in rows]
    first_len, first_reward = sum(length[:3]) / 3, sum(reward[:3]) / 3
    assert first_len > 14, "at the start almost every response runs to the limit"
    assert min(length[-10:]) < 10, f"seed {seed} never learnt to stop: lengths {length}"
    last_reward = sum(reward[-5:]) / 5
    assert last_reward > max(0.3, 3 * first_reward), f"seed {seed}: reward {reward}"
