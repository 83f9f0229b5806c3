"""Optimizer coverage: which parameters carry optimizer state, which don't, and orphans.

Two naming schemes are recognised, both read from entry names only:

* `rl` / torch flattened state dicts: ``model.<fqn>`` and ``optim.state.<fqn>.<name>``,
  ``optim.param_groups.<fqn>.<key>`` (docs/checkpoint-format.md);
* Megatron dist_checkpointing: ``<fqn>`` and ``optimizer.state.<name>.<fqn>``.

An `rl` manifest's ``optimizer.param_state`` tells which parameters are trainable and
which legitimately have no state yet (no gradient so far): those are what ``rl resume``
backfills.
"""

from __future__ import annotations

from typing import Iterable, Optional

from engine.inspect.report import OptimizerCoverage

MEGATRON_STATE_NAMES = ("exp_avg", "exp_avg_sq", "fp32_param", "momentum_buffer", "step")


def _lookup(param_state: dict, fqn: str):
    """Manifest entry for ``fqn`` (manifests may key by fqn or by the ``model.`` key)."""
    for k in (fqn, f"model.{fqn}"):
        if k in param_state:
            return param_state[k]
    if fqn.startswith("model.") and fqn[6:] in param_state:
        return param_state[fqn[6:]]
    return None


def _classify(params: list[str], states: dict[str, set[str]], orphans: dict[str, str],
              param_state: Optional[dict], source: str) -> OptimizerCoverage:
    """``orphans``: entry name -> the parameter name it refers to."""
    names = sorted(set().union(*states.values())) if states else []
    cov = OptimizerCoverage(state_names=names, source=source, orphans=sorted(orphans),
                            orphan_params=sorted(set(orphans.values())),
                            manifest=param_state is not None)
    for fqn in params:
        if param_state is not None:
            flag = _lookup(param_state, fqn)
            if flag is None:
                continue  # not trainable per the manifest (frozen parameter or buffer)
        else:
            flag = None
        cov.params += 1
        have = states.get(fqn, set())
        if not have:
            (cov.none_expected if flag is False else cov.none_unexpected).append(fqn)
        elif set(names) - have:
            cov.partial[fqn] = sorted(set(names) - have)
        else:
            cov.full.append(fqn)
    return cov


def rl_coverage(entry_names: Iterable[str], param_state: Optional[dict]) -> Optional[OptimizerCoverage]:
    """Coverage for names in the `rl` scheme; None if there is no optimizer entry at all."""
    names = list(entry_names)
    params = [n[len("model."):] for n in names if n.startswith("model.")]
    param_set = set(params)
    states: dict[str, set[str]] = {}
    orphans: dict[str, str] = {}
    seen_optim = False
    for n in names:
        if n.startswith("optim.state."):
            seen_optim = True
            fqn, _, state = n[len("optim.state."):].rpartition(".")
            if fqn in param_set:
                states.setdefault(fqn, set()).add(state)
            else:
                orphans[n] = fqn
        elif n.startswith("optim.param_groups."):
            seen_optim = True
            fqn = n[len("optim.param_groups."):].rpartition(".")[0]
            if fqn not in param_set:
                orphans[n] = fqn
    if not seen_optim and not param_state:
        return None
    return _classify(params, states, orphans, param_state,
                     "rl (optim.state.<fqn>.<name>)")


def megatron_coverage(tensor_names: Iterable[str]) -> Optional[OptimizerCoverage]:
    """Coverage for Megatron's ``optimizer.state.<name>.<fqn>`` naming; None if absent."""
    names = list(tensor_names)
    params = [n for n in names if not n.startswith("optimizer.") and "rng_state" not in n]
    param_set = set(params)
    states: dict[str, set[str]] = {}
    orphans: dict[str, str] = {}
    seen = False
    for n in names:
        if not n.startswith("optimizer.state."):
            continue
        rest = n[len("optimizer.state."):]
        state, _, fqn = rest.partition(".")
        if state not in MEGATRON_STATE_NAMES:
            continue
        seen = True
        if fqn in param_set:
            states.setdefault(fqn, set()).add(state)
        else:
            orphans[n] = fqn
    if not seen:
        return None
    return _classify(params, states, orphans, None, "megatron (optimizer.state.<name>.<fqn>)")
