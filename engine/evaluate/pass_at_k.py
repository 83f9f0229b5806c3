"""pass@k: the chance that at least one of k responses, drawn without replacement from the n
sampled for a prompt, is correct, estimated without bias from c correct of n (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as the product form 1 - prod_{i=n-c+1..n} (1 - k / i), which never forms the binomials
(no overflow at large n). The estimate over a set of prompts is the mean over prompts."""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct of n={n} samples")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself (eval.k=[] with eval.n=n)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """The mean of pass@k over prompts, each given as (n, c)."""
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) if counts else 0.0
