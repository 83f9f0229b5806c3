"""One policy update equals the algorithm's formulas, written here in plain PyTorch from the
papers (no rl code on the reference side): the advantages of GRPO, Dr. GRPO, DAPO, RLOO and PPO
(GAE, whitened), the PPO-clip token loss, and each ``loss_agg_mode``'s aggregation; then the
gradient of that loss through a plain Hugging Face forward, against the gradient the FSDP engine's
``train_step`` produces (read just before its optimizer step) on a real one-rank gloo group.

The batch has what the engine treats specially: responses that end with EOS at different
positions and responses cut at the limit, prompts of different lengths, G samples per prompt (so
the update shares each prompt's forward), a group whose rewards are all equal (its rows' backward
is skipped, but they still count in the normaliser), several micro-batches, and old log-probs
away from the current ones so that the clip is active on some tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import full_tensor, run_ranks

VOCAB, PAD, EOS, G, MAX_NEW = 12, 0, 1, 4, 6
REWARDS = [0.1, 0.5, 0.9, 0.3, 1.0, 1.0, 1.0, 1.0, 0.2, 0.0, 0.7, 0.4]

# name -> (rl overrides, loss_agg_mode, clip low, clip high)
CASES = {
    "grpo-token-mean": (["algorithm.name=grpo"], "token-mean", 0.2, 0.2),
    "grpo-seq-mean-token-mean": (["algorithm.name=grpo"], "seq-mean-token-mean", 0.2, 0.2),
    "grpo-seq-mean-token-sum": (["algorithm.name=grpo"], "seq-mean-token-sum", 0.2, 0.2),
    "dr_grpo": (["algorithm.name=dr_grpo"], "seq-mean-token-sum", 0.2, 0.2),
    "dapo": (["algorithm.name=dapo"], "token-mean", 0.2, 0.28),
    "rloo": (["algorithm.name=rloo"], "token-mean", 0.2, 0.2),
    "ppo": (["algorithm.name=ppo"], "token-mean", 0.2, 0.2),
}


def _batch():
    """12 rows: 3 prompts (2, 3 and 4 tokens) x 4 samples; responses of 1-6 tokens, EOS-ended or cut."""
    from bench.reference_grpo import right_padded
    from engine.batch import SequenceBatch

    g = torch.Generator().manual_seed(0)
    prompts = [[3, 4], [5, 6, 7], [8, 9, 10, 11]]
    resp_len = [6, 2, 4, 6, 1, 3, 6, 5, 6, 6, 2, 4]
    ended = [False, True, True, False, True, True, False, True, False, False, True, True]
    rows = []
    for i, (n, e) in enumerate(zip(resp_len, ended)):
        r = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        if e:
            r[-1] = EOS
        rows.append((prompts[i // G], r))
    ids, attn, resp = right_padded(rows, PAD)
    return SequenceBatch(input_ids=ids, attention_mask=attn, response_mask=resp,
                         prompt_lengths=torch.tensor([len(p) for p, _ in rows]))


# ---- the reference: formulas, plain PyTorch ----------------------------------------------------
def _group_baseline_advantages(name: str, rewards: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(rewards)
    for k in range(0, len(rewards), G):
        r = rewards[k:k + G]
        if name in ("grpo", "dapo"):  # (r - mean) / (std + eps), std with Bessel's correction
            mean = r.sum() / G
            std = ((r - mean) ** 2).sum().div(G - 1).sqrt()
            out[k:k + G] = (r - mean) / (std + 1e-6)
        elif name == "dr_grpo":       # r - mean
            out[k:k + G] = r - r.sum() / G
        elif name == "rloo":          # r - mean of the other samples
            out[k:k + G] = r - (r.sum() - r) / (G - 1)
    return out


def _ppo_advantages(rewards, mask, values, gamma=1.0, lam=0.95):
    """GAE on the outcome reward placed on the last response token, then whitened over the
    response tokens (mean 0, unit variance with Bessel's correction)."""
    B, T = mask.shape
    adv = torch.zeros(B, T)
    for i in range(B):
        cols = mask[i].nonzero().squeeze(-1).tolist()
        running = 0.0
        for j in reversed(range(len(cols))):
            t = cols[j]
            r = float(rewards[i]) if j == len(cols) - 1 else 0.0
            v_next = float(values[i, cols[j + 1]]) if j + 1 < len(cols) else 0.0
            delta = r + gamma * v_next - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
    m = mask.bool()
    x = adv[m]
    adv[m] = (x - x.mean()) / (x.var(unbiased=True) + 1e-8).sqrt()
    return adv


def _reference_loss(model, batch, adv, old, mode, lo, hi):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros(len(lp), 1), lp], dim=1)
    m = batch.response_mask
    ratio = torch.exp(lp - old)
    tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - lo, 1 + hi))
    if mode == "token-mean":
        return (tok * m).sum() / m.sum()
    per_seq = (tok * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / m.sum(-1)
    return per_seq.mean()


def _cases(rank, world, names):
    import transformers

    from engine.algorithms.estimators import compute_advantages
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config

    results = {}
    for name in names:
        overrides, mode, lo, hi = CASES[name]
        cfg = load_run_config(overrides + [f"algorithm.loss_agg_mode={mode}", f"algorithm.clip_ratio_low={lo}",
                                           f"algorithm.clip_ratio_high={hi}", "optim.grad_clip=0",
                                           "algorithm.kl_coef=0", "algorithm.entropy_coef=0",
                                           f"algorithm.rollout_n={G}", "engine.micro_batch_size=5",
                                           f"rollout.max_new_tokens={MAX_NEW}"]).config
        eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
        eng.build()
        ref = transformers.AutoModelForCausalLM.from_config(eng.model.config)
        ref.load_state_dict({k: full_tensor(v).detach().clone() for k, v in eng.export_hf_state_dict().items()})
        ref.get_input_embeddings().padding_idx = None  # a sampled pad is a real token in rl (its row trains)
        batch = _batch()
        rewards = torch.tensor(REWARDS)
        mask = batch.response_mask
        values = None
        if name == "ppo":
            values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
            want_adv = _ppo_advantages(rewards, mask, values)
        else:
            want_adv = _group_baseline_advantages(cfg.algorithm.name, rewards)[:, None] * mask
        got = compute_advantages(cfg.algorithm, rewards, mask, G, values=values, max_len=MAX_NEW)
        adv_err = float((got.advantages - want_adv).abs().max())
        with torch.no_grad():  # old log-probs: the current ones, moved by +-0.3 so that the clip bites
            logits = ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
            lp = torch.cat([torch.zeros(len(lp), 1), lp], dim=1)
        noise = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.6
        old = (lp + noise) * mask
        batch.advantages, batch.old_log_probs = want_adv, old
        if name == "ppo":
            batch.values, batch.returns = values, got.returns
        ref_loss = _reference_loss(ref, batch, want_adv, old, mode, lo, hi)
        ref_loss.backward()
        ratio = torch.exp(lp - old)
        clipped = ((ratio < 1 - lo) | (ratio > 1 + hi)) & (mask > 0)
        grads = {}
        step = eng.optimizer.step

        def capture(*a, **k):
            for n, p in eng.model.named_parameters():
                grads[n] = full_tensor(p.grad).detach().clone()
            return step(*a, **k)

        eng.optimizer.step = capture
        stats = eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        ref_grads = dict(ref.named_parameters())
        num = den = 0.0
        matched = 0
        for n, g in grads.items():
            key = n.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", "")
            r = ref_grads[key].grad
            num += float((g - r).pow(2).sum())
            den += float(r.pow(2).sum())
            matched += 1
        results[name] = {"adv_err": adv_err, "loss": float(ref_loss), "engine_loss": stats.metrics["pg_loss"],
                         "grad_rel_err": (num / den) ** 0.5, "grad_norm": den ** 0.5, "params": matched,
                         "clipped_tokens": int(clipped.sum()), "skipped": stats.metrics.get("rows_skipped", 0.0)}
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 1, list(CASES))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_update_equals_the_formulas(results, name):
    r = results[name]
    assert r["params"] > 10
    assert r["clipped_tokens"] > 0, "the clip must be active on some tokens for the test to see it"
    assert r["adv_err"] < 1e-5, r
    assert abs(r["engine_loss"] - r["loss"]) < 1e-5 * max(1.0, abs(r["loss"])), r
    assert r["grad_norm"] > 1e-3, r
    assert r["grad_rel_err"] < 1e-4, r
    if name.startswith("grpo"):  # the all-equal group trained nothing and was skipped, yet counted
        assert r["skipped"] == G, r
