"""Every torch rollout path samples from the distribution it claims, checked against first
principles, not against another path of the sampler (which a shared bias would pass):

- the first token of G=4096 samples of one prompt follows softmax(logits / T) (a chi-square
  test, a total-variation bound, and the shares of EOS and of tokens below 1e-3 within binomial
  bounds), and the top-p nucleus renormalised when top-p is on;
- every later token too: the probability integral transform of each sampled token under the
  model's own full forward (a plain Hugging Face forward over prompt + response, written here) is
  uniform (a Kolmogorov-Smirnov bound) -- this sees EOS sampled too rarely at any step, rows that
  leave the batch with the wrong cache, and positions off by one;
- the rollout's per-token log-probs equal that plain forward's, EOS included, and the response
  mask is 1 up to and including EOS and 0 after it, with EOS != pad != BOS, a pad token sampled
  mid-response (a real token), and left-padded prompts of different lengths.

Paths: the plain loop (``fast=False``), the fast path with prompt-shared prefill on a
preallocated cache (static decode), the same through the model's own forward, and two decode
lanes. The vLLM sampler gets the same check of whole responses and the log-prob parity on its one
engine start in tests/test_vllm.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.config.schema import RolloutConfig
from engine.rollout.torch_sampler import TorchSampler

PAD, BOS, EOS, VOCAB = 0, 1, 2, 64
G = 4096
PATHS = {
    "plain": dict(fast=False),
    "static_decode": dict(fast=True, static_cache=True, lanes=1),
    "model_forward": dict(fast=True, static_cache=False, lanes=1),
    "two_lanes": dict(fast=True, static_cache=True, lanes=2),
}


def _model():
    """A tiny Llama whose next-token distributions are far from uniform: many tokens below 1e-3,
    EOS a few percent, and the pad token likely enough to be sampled mid-response."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(cfg).eval()
    m.model.embed_tokens.padding_idx = None  # a sampled pad is a real token (rl's models train its row)
    with torch.no_grad():
        head = m.lm_head.weight
        head.mul_(20.0)  # spread the logits: a long tail of tokens below 1e-3
        # EOS and pad: copies of the rows of the two tokens most likely on average, scaled down, so
        # that both are sampled often enough to test (EOS a few percent per step) yet not certain
        ctx = torch.randint(3, VOCAB, (64, 8), generator=torch.Generator().manual_seed(0))
        top = m(ctx).logits.softmax(-1).mean((0, 1)).topk(2).indices
        head[EOS] = head[top[0]]
        head[PAD] = 0.8 * head[top[1]]
    return m


def _sampler(path: str, **rollout) -> TorchSampler:
    p = PATHS[path]
    cfg = dataclasses.replace(RolloutConfig(), decode_lanes=p.get("lanes", 0), **rollout)
    return TorchSampler(cfg, PAD, EOS, torch.device("cpu"), fast=p["fast"], static_cache=p.get("static_cache", True))


def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution, written from its definition: softmax(logits / T), then the
    smallest set of most likely tokens whose mass reaches top_p (a token is kept while the mass
    of the tokens more likely than it is below top_p), renormalised. [..., V] -> [..., V]."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    kept = torch.zeros_like(p).scatter(-1, order, (before < top_p).double())
    out = p * kept
    return out / out.sum(-1, keepdim=True)


def _plain_logits(model, batch) -> torch.Tensor:
    """[B, T, V] logits of the rows as the trainer lays them out (prompt then response,
    right-padded; positions count from each row's first token)."""
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()


def _chi_square_bound(dof: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; z = 3.719)."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


PROMPTS = [[BOS, 5, 9, 12], [BOS, 7, 3, 11, 20, 33, 4]]  # different lengths: the short one is left-padded


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_first_token_follows_the_sampling_distribution(path, temperature, top_p):
    model = _model()
    n = G
    batch = _sampler(path, max_new_tokens=1, temperature=temperature, top_p=top_p).generate(
        model, PROMPTS, n, torch.Generator().manual_seed(11))
    logits = _plain_logits(model, batch)
    for k, prompt in enumerate(PROMPTS):
        rows = slice(k * n, (k + 1) * n)
        target = _target(logits[k * n, len(prompt) - 1][None], temperature, top_p)[0]
        counts = torch.bincount(batch.input_ids[rows, len(prompt)], minlength=VOCAB).double()
        expected = target * n
        assert counts[target == 0].sum() == 0, "a token outside the nucleus was sampled"
        # chi-square over tokens expected at least 5 times, the rest pooled into one cell
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        assert chi2 < _chi_square_bound(int(keep.sum()) - 1), (path, k, chi2)
        # total variation against what n exact draws give: E|count/n - p| ~ sqrt(2 p (1 - p) / (pi n))
        tv = 0.5 * float((counts / n - target).abs().sum())
        tv_exact = 0.5 * float((2 * target * (1 - target) / (math.pi * n)).sqrt().sum())
        assert tv < 1.5 * tv_exact, (path, k, tv, tv_exact)
        # the shares that matter for learning to stop: EOS, and the long tail of rare tokens
        for name, cell in (("eos", target.new_zeros(VOCAB, dtype=torch.bool).index_fill(0, torch.tensor([EOS]), True)),
                           ("below 1e-3", (target < 1e-3) & (target > 0))):
            p = float(target[cell].sum())
            got = float(counts[cell].sum())
            assert abs(got - p * n) <= 4 * math.sqrt(n * p * (1 - p)) + 1, (path, k, name, got, p * n)
    if temperature == 1.0 and top_p == 1.0:  # the test has teeth: EOS and rare tokens do occur
        p = torch.softmax(logits[n, len(PROMPTS[1]) - 1], -1)
        assert 0.1 < float(p[EOS]) < 0.3
        assert float(p[p < 1e-3].sum()) * n > 20


def _pit(logits: torch.Tensor, batch, temperature: float, top_p: float, seed: int = 5) -> torch.Tensor:
    """The randomised probability integral transform of every sampled response token under the
    target distribution given the row's sampled prefix (``logits``: a plain forward's over the
    batch): F(token - 1) + V p(token), V ~ U(0, 1). Uniform on (0, 1) exactly when each token
    was drawn from that distribution."""
    mask = batch.response_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)
    target = _target(logits[rows, cols - 1], temperature, top_p)         # [n, V]
    tok = batch.input_ids[rows, cols]
    p_tok = target.gather(-1, tok[:, None]).squeeze(-1)
    below = target.cumsum(-1).gather(-1, tok[:, None]).squeeze(-1) - p_tok
    v = torch.rand(len(tok), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return below + v * p_tok


def check_responses_follow(logits: torch.Tensor, batch, temperature: float, top_p: float, eos: int,
                           max_new_tokens: int, what: str = "") -> None:
    """Every response token of ``batch`` was drawn from the sampling distribution that ``logits``
    (a plain forward over the batch, [B, T, V]) define: the PIT is uniform (Kolmogorov-Smirnov at
    alpha = 0.001), and at every step the number of rows that end with EOS matches the sum of their
    EOS probabilities (a Poisson-binomial: variance sum p (1 - p)), counting only rows live then."""
    u = _pit(logits.double(), batch, temperature, top_p)
    bound = 1.95 / math.sqrt(len(u))
    assert _ks(u) < bound, (what, _ks(u), bound, len(u))
    lengths = batch.response_mask.sum(-1)
    for t in range(max_new_tokens):
        live = (lengths > t).nonzero().squeeze(-1)
        if live.numel() == 0:
            break
        cols = batch.prompt_lengths[live] + t
        target = _target(logits[live, cols - 1].double(), temperature, top_p)[:, eos]
        got = int((batch.input_ids[live, cols] == eos).sum())
        want, var = float(target.sum()), float((target * (1 - target)).sum())
        assert abs(got - want) <= 4 * math.sqrt(var) + 1, (what, t, got, want)


def _ks(u: torch.Tensor) -> float:
    u = u.sort().values
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_every_response_token_follows_the_sampling_distribution(path, temperature, top_p):
    model = _model()
    batch = _sampler(path, max_new_tokens=6, temperature=temperature, top_p=top_p).generate(
        model, PROMPTS, G // 2, torch.Generator().manual_seed(3))
    lengths = batch.response_mask.sum(-1)
    assert int((lengths < 6).sum()) > 500, "rows must finish at different steps for the test to see EOS"
    check_responses_follow(_plain_logits(model, batch), batch, temperature, top_p, EOS, 6, path)


@pytest.mark.parametrize("path", list(PATHS))
def test_rollout_log_probs_and_mask_equal_a_plain_forward(path):
    model = _model()
    prompts = [[BOS, 5, 9], [BOS, 7, 3, 11, 20, 33, 4, 8, 6], [BOS, 40]]
    batch = _sampler(path, max_new_tokens=10, temperature=0.9).generate(model, prompts, 16,
                                                                       torch.Generator().manual_seed(7))
    logits = _plain_logits(model, batch)
    ref = torch.log_softmax(logits[:, :-1] / 0.9, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ref = torch.nn.functional.pad(ref, (1, 0))
    mask = batch.response_mask
    plen = batch.prompt_lengths
    ended = sampled_pad = 0
    for i in range(len(batch)):
        cols = mask[i].nonzero().squeeze(-1)
        assert cols.numel() > 0 and int(cols[0]) == int(plen[i]), "the response starts right after the prompt"
        assert (cols == torch.arange(int(plen[i]), int(plen[i]) + cols.numel())).all(), "mask is contiguous"
        resp = batch.input_ids[i, cols]
        eos_at = (resp == EOS).nonzero()
        if eos_at.numel():
            assert int(eos_at[0]) == cols.numel() - 1, "the mask ends at the first EOS, which it includes"
            ended += 1
        else:
            assert cols.numel() == 10, "a response without EOS runs to max_new_tokens"
        sampled_pad += int((resp == PAD).sum())
        assert int(batch.attention_mask[i].sum()) == int(plen[i]) + cols.numel(), "nothing after the response"
        assert (batch.input_ids[i, int(plen[i]) + cols.numel():] == PAD).all()
    assert ended > 5 and ended < len(batch) - 5, ended
    assert sampled_pad > 0, "the test needs a pad token sampled mid-response"
    got = batch.rollout_log_probs * mask
    want = ref.float() * mask
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    assert (batch.rollout_log_probs * (1 - mask)).abs().max() == 0
