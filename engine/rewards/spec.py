"""Which functions score a task: ``module:function`` strings (or ``rl:<name>`` built-ins),
their weights, and whether they take one sample or a whole batch.

A spec is a string so that a spawned worker process can import the same function.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import stat
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from engine.errors import ConfigError

BUILTIN_PREFIX = "rl:"
BUILTIN_MODULE = "engine.rewards.builtin"


@dataclass(frozen=True)
class RewardFnSpec:
    name: str            # what the user wrote (shown in errors, logs and metrics)
    target: str          # importable module:qualname
    weight: float = 1.0
    batched: bool = False
    role: str = "reward"  # "reward" (summed with its weight) or "correct" (accuracy only)


def builtin_names() -> list[str]:
    from engine.rewards import builtin

    return sorted(builtin.BUILTINS)


def target_of(spec: str, key: str) -> str:
    """``rl:math_boxed`` -> ``engine.rewards.builtin:math_boxed``; ``pkg.mod:fn`` unchanged."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        names = builtin_names()
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean `rl:{close[0]}`?" if close else ""
            raise ConfigError(f"`{key}={spec}`: no built-in reward `{name}`.{hint} Built-ins: "
                              f"{', '.join('rl:' + n for n in names)}.", title="invalid config value")
        return f"{BUILTIN_MODULE}:{name}"
    if ":" not in spec or not spec.split(":", 1)[0] or not spec.split(":", 1)[1]:
        raise ConfigError(f"`{key}={spec}` must look like `module:function` (e.g. mypkg.rewards:exact_match) or "
                          f"name a built-in (`rl:math_boxed`, `rl:gsm8k`, `rl:exact_match`, ...).",
                          title="invalid config value")
    module = spec.rsplit(":", 1)[0]
    if is_file_module(module):  # a file path (verl's custom_reward_function.path)
        from engine.user_paths import file_kind, shown, stat_path

        file = Path(os.path.expanduser(module))
        fix = ("Give the path of a Python file and the function in it (`path/to/rewards.py:score`), or an "
               "importable `module:function`.")
        where = f" (from {os.getcwd()})" if not file.is_absolute() else ""
        st = stat_path(file, f"`{key}={spec}`: the file {shown(file)}", error=ConfigError,
                       title="invalid config value")
        if st is None:
            raise ConfigError(f"`{key}={spec}` names the file {shown(file)}, which does not exist{where}. {fix}",
                              title="invalid config value")
        if not stat.S_ISREG(st.st_mode):
            fn = spec.rsplit(":", 1)[1]
            inside = _python_files(file, fn) if stat.S_ISDIR(st.st_mode) else []
            hint = (f" It holds {', '.join(inside)}: e.g. `{key}={module.rstrip('/')}/{inside[0]}:{fn}`."
                    if inside else "")
            raise ConfigError(f"`{key}={spec}` names {shown(file)}{where}, which is {file_kind(st)}, not a Python "
                              f"file.{hint} {fix}", title="invalid config value")
        return f"{file.resolve()}:{spec.rsplit(':', 1)[1]}"
    return spec


def _python_files(folder: Path, fn: str) -> list[str]:
    """Up to 3 .py files in ``folder``, one that defines ``fn`` first (for a message)."""
    try:
        names = sorted(p.name for p in folder.glob("*.py"))[:20]
    except OSError:
        return []

    def defines(name: str) -> bool:
        try:
            return f"def {fn.split('.')[0]}(" in (folder / name).read_text(errors="replace")[:1_000_000]
        except OSError:
            return False

    return sorted(names, key=lambda n: not defines(n))[:3]


def is_file_module(module: str) -> bool:
    """``path/to/rewards.py`` (or any path with a separator), not a dotted module name."""
    return module.endswith(".py") or "/" in module or "\\" in module


def _import_file(path: str):
    """The module in the Python file ``path``, loaded once per process under a name derived from
    the path (so two files called rewards.py stay apart), with its directory importable for its
    own imports."""
    import hashlib
    import importlib.util

    name = "rl_reward_file_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_target(target: str, name: Optional[str] = None, key: str = "task.reward_fn") -> Callable:
    """Import ``module:qualname`` (or ``/path/to/file.py:qualname``); the current directory is
    importable (as in TRL scripts)."""
    shown = name or target
    mod_name, attr = target.rsplit(":", 1) if is_file_module(target.rsplit(":", 1)[0]) else target.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = _import_file(mod_name) if is_file_module(mod_name) else importlib.import_module(mod_name)
    except ImportError as e:
        if e.name and e.name != mod_name and not mod_name.startswith(e.name + "."):  # found; what it imports is not
            raise ConfigError(f"`{key}={shown}`: importing `{mod_name}` failed: it imports `{e.name}`, which is not "
                              f"installed ({e}){_at(e)}. Install `{e.name}` in this environment, or remove that "
                              f"import.", title="invalid config value") from None
        raise ConfigError(f"`{key}={shown}`: cannot import `{mod_name}` ({e}). Run `rl` from the directory that "
                          f"contains it, or install it.", title="invalid config value") from None
    except SyntaxError as e:
        raise ConfigError(f"`{key}={shown}`: `{mod_name}` has a syntax error: {e.msg} ({e.filename}:{e.lineno}). Fix "
                          f"the file; nothing was run.", title="invalid config value") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own top-level code may raise anything
        raise ConfigError(f"`{key}={shown}`: importing `{mod_name}` raised {type(e).__name__}: {e}{_at(e)}. Fix the "
                          f"module's top-level code (importing it must only define functions); nothing was "
                          f"trained.", title="invalid config value") from None
    parent = obj
    for part in attr.split("."):
        parent, obj = obj, getattr(obj, part, None)
    if not callable(obj):
        names = [n for n in dir(parent) if not n.startswith("_") and callable(getattr(parent, n, None))]
        close = difflib.get_close_matches(attr.rsplit(".", 1)[-1], names, n=1)
        hint = f" Did you mean `{mod_name}:{attr.rsplit('.', 1)[0] + '.' if '.' in attr else ''}{close[0]}`?" \
            if close else ""
        what = f"no function `{attr}`" if obj is None else f"`{attr}`, but it is a {type(obj).__name__}, not a function"
        raise ConfigError(f"`{key}={shown}`: `{mod_name}` has {what}.{hint}", title="invalid config value")
    return obj


def _at(exc: BaseException) -> str:
    """ " (at file:line)" of the innermost frame outside the import machinery, or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
              and "importlib" not in f.filename and not f.filename.endswith("/engine/rewards/spec.py")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def named_targets(task_cfg) -> list[tuple[str, str]]:
    """(config key, module:function) of every user function the task config names, resolved
    (``rl:`` built-ins included) but not imported."""
    out = []
    for key, names in (("task.reward_fn", [task_cfg.reward_fn]), ("task.reward_fns", list(task_cfg.reward_fns or [])),
                       ("task.correct_fn", [task_cfg.correct_fn])):
        for n in names:
            if n and ":" in str(n):
                out.append((key, target_of(str(n), key)))
    return out


def import_locations(target: str) -> list[Path]:
    """The files or package directories ``module`` of ``module:function`` would be imported from
    (the current directory importable, as for :func:`import_target`), found without running any
    of its code: the top-level name's spec (a namespace package: every portion). Empty when it is
    built in, already imported from nowhere, or not found."""
    top = target.split(":", 1)[0].split(".")[0]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    places = [Path(p) for p in (spec.submodule_search_locations or [])]
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        places.append(Path(spec.origin))
    return places


def refuse_code_inside(task_cfg, root: Path, what: str) -> None:
    """Refuse a reward or correctness function that would be imported from inside ``root`` (a run
    directory being resumed): code that arrives with a run or checkpoint is never run, only code
    the user has on their own import path. ``what`` names where the config was read."""
    root = Path(root).resolve()
    for key, target in named_targets(task_cfg):
        for place in import_locations(target):
            try:
                inside = place.resolve().is_relative_to(root)
            except OSError:
                inside = False
            if inside:
                raise ConfigError(
                    f"`{key}` in {what} names `{target}`, whose module would be imported from {place}, inside the "
                    f"run directory {root}. rl never runs code that comes with a run or checkpoint (it may have been "
                    f"copied from anywhere). If you wrote that function, move it out of the run directory and run "
                    f"`rl resume` from the directory that holds it (or install it); nothing was imported.",
                    title="code inside the run directory")


def user_reward_specs(task_cfg) -> list[RewardFnSpec]:
    """The reward (and correctness) functions a dataset task's config names, validated."""
    single, several = task_cfg.reward_fn, list(task_cfg.reward_fns or [])
    if single and several:
        raise ConfigError(f"Set either `task.reward_fn` or `task.reward_fns`, not both (got reward_fn={single} and "
                          f"reward_fns={several}). Put every function in reward_fns.", title="invalid config")
    names = several or ([single] if single else [])
    if not names and not (task_cfg.reward_model.path or task_cfg.reward_url):  # those score alone
        raise ConfigError("A dataset task needs a reward function: `task.reward_fn=mypkg.rewards:exact_match`, a "
                          "built-in such as `task.reward_fn=rl:math_boxed` (`rl:by_data_source` for verl data: each "
                          "row by its data_source, as verl's default), or several with "
                          "`'task.reward_fns=[mod:fmt,mod:acc]'`. The current directory is importable.",
                          title="invalid config")
    weights = list(task_cfg.reward_weights or [])
    if weights and len(weights) != len(names):
        raise ConfigError(f"`task.reward_weights` has {len(weights)} value(s) for {len(names)} reward function(s) "
                          f"({', '.join(names)}): give one weight per function, or none (1.0 each).",
                          title="invalid config")
    try:
        weights = [float(w) for w in weights] or [1.0] * len(names)
    except (TypeError, ValueError):
        raise ConfigError(f"`task.reward_weights={task_cfg.reward_weights}` must be numbers.",
                          title="invalid config value") from None
    key = "task.reward_fns" if several else "task.reward_fn"
    specs = [RewardFnSpec(n, target_of(str(n), key), w, bool(task_cfg.reward_batched)) for n, w in zip(names, weights)]
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError(f"`task.reward_fns` lists a function twice ({', '.join(names)}); use one entry and its "
                          f"weight.", title="invalid config")
    if task_cfg.correct_fn:
        specs.append(RewardFnSpec(task_cfg.correct_fn, target_of(task_cfg.correct_fn, "task.correct_fn"), 0.0,
                                  False, role="correct"))
    checked = []
    for s in specs:
        fn = import_target(s.target, s.name, "task.correct_fn" if s.role == "correct" else key)
        s = with_detected_convention(s, fn) if s.role == "reward" else s
        check_signature(s, fn)
        checked.append(s)
    return checked


def spec_for(fn: Callable, role: str = "reward") -> RewardFnSpec:
    """A spec for a module-level function (built-in tasks)."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    return RewardFnSpec(target.split(":", 1)[1], target, 1.0, False, role)


PER_SAMPLE_ARGS = ("prompt", "response", "answer")
BATCHED_ARGS = ("prompts", "completions")


def with_detected_convention(spec: RewardFnSpec, fn: Callable) -> RewardFnSpec:
    """TRL's reward functions (``def f(completions, **kwargs)``, ``def f(prompts, completions, ...)``)
    are batched whether or not task.reward_batched says so: their parameter names say it."""
    from dataclasses import replace

    from engine.rewards.call import is_keyword_batched, is_verl_style

    if not spec.batched and is_keyword_batched(fn) and not is_verl_style(fn):
        return replace(spec, batched=True)
    return spec


def check_signature(spec: RewardFnSpec, fn: Callable, columns: Optional[set[str]] = None) -> None:
    """Refuse a function that cannot be called with the convention its spec says.

    Per sample: ``fn(prompt, response, answer, **row)``; batched: ``fn(prompts, completions,
    **columns)``. Extra parameters must be dataset columns (when ``columns`` is known), have a
    default, or be swallowed by ``**kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: nothing to check
    params = list(sig.parameters.values())
    from engine.rewards.call import CALL_ARGS, TRL_ARGS, VERL_ARGS, is_keyword_batched, is_verl_style

    keyword_names = None  # the names a keyword-called function may take (verl's and TRL's conventions)
    if not spec.batched and is_verl_style(fn):
        keyword_names, convention = set(VERL_ARGS), "verl: compute_score(data_source, solution_str, ground_truth, extra_info)"
    elif spec.batched and is_keyword_batched(fn):
        keyword_names, convention = set(TRL_ARGS + CALL_ARGS) | {"answer"}, \
            "TRL: fn(prompts=, completions=, completion_ids=, trainer_state=, **columns)"
    if keyword_names is not None:
        required = [p.name for p in params if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
        known = keyword_names | (set(columns) if columns is not None else set())
        unknown = [n for n in required if n not in known]
        if unknown and columns is not None:
            raise ConfigError(f"reward function `{spec.name}{sig}` ({convention}) needs {', '.join(unknown)}, which "
                              f"the call does not pass (dataset columns: {', '.join(sorted(columns or [])) or 'none'}). "
                              f"Give the parameter a default, or add the column.", title="invalid reward function")
        return
    base = BATCHED_ARGS if spec.batched else PER_SAMPLE_ARGS
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    convention = ("batched: fn(prompts, completions, **columns) -> list[float]" if spec.batched
                  else "per sample: fn(prompt, response, answer, **row) -> float")
    flip = ("; if it scores one sample at a time, drop task.reward_batched=true" if spec.batched
            else "; if it takes whole batches (TRL style), set task.reward_batched=true")
    if len(positional) < len(base) and not var_pos:
        raise ConfigError(f"reward function `{spec.name}{sig}` takes {len(positional)} positional argument(s); the "
                          f"{convention} convention passes {len(base)} ({', '.join(base)}){flip}.",
                          title="invalid reward function")
    if spec.batched is False and positional and positional[0].name in ("prompts", "completions"):
        raise ConfigError(f"reward function `{spec.name}{sig}` looks batched (first argument `{positional[0].name}`)"
                          f" but is called per sample{flip}.", title="invalid reward function")
    if spec.batched and positional and (positional[0].name == "prompt" or
                                        any(p.name == "response" for p in positional[:3])):
        raise ConfigError(f"reward function `{spec.name}{sig}` looks per-sample (it takes `prompt`/`response`) but "
                          f"task.reward_batched=true calls it with whole batches{flip}.",
                          title="invalid reward function")
    extra_required = [p.name for p in params[len(base):] if p.default is p.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if columns is not None and not var_kw:
        missing = [n for n in extra_required if n not in columns and n not in CALL_ARGS]
        if missing:
            raise ConfigError(f"reward function `{spec.name}{sig}` needs {', '.join(missing)}, which the dataset "
                              f"does not have (columns: {', '.join(sorted(columns)) or 'none'}). Give the "
                              f"parameter a default, or add the column.", title="invalid reward function")
