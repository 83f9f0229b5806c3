"""Multi-turn rollouts with tools (engine/agents): tool calls are read from the model's output in
its template's format; the loop appends tool results masked out of the loss but kept in the
context; and the rollout's per-token log-probs on the whole multi-turn sequence equal what the
training engine recomputes (prompt-shared forward, and length buckets)."""

from __future__ import annotations

import string

import pytest
import torch

from engine.agents.environment import ToolEnvironment
from engine.agents.parsers import CompactParser, HermesParser, make_parser
from engine.agents.tools import load_tool, tool_schema
from engine.errors import ConfigError
from tests.dist_utils import run_ranks

ALPHABET = string.digits + "+=[]"


def add(expr: str) -> str:
    """Adds two whole numbers.

    Args:
        expr: two numbers joined by '+', like 12+30
    """
    a, _, b = expr.partition("+")
    if not (a.isdigit() and b.isdigit()):
        raise ValueError("no")
    return str(int(a) + int(b))


def test_hermes_parser_reads_calls_and_reports_unreadable_ones():
    tools = {"add": add}
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"expr": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"expr\\": \\"3+4\\"}"}</tool_call>'
            '<tool_call>{"name": add}</tool_call>')
    p = HermesParser().parse(text, tools)
    assert [(c.name, c.arguments) for c in p.calls] == [("add", {"expr": "1+2"}), ("add", {"expr": "3+4"})]
    assert len(p.errors) == 1 and "unreadable" in p.errors[0]
    assert not HermesParser().parse("the answer is 3", tools).wants_tools


def test_compact_parser_calls_the_one_tool_with_the_bracketed_text():
    p = CompactParser().parse("12[30+4]", {"add": add})
    assert [(c.name, c.arguments) for c in p.calls] == [("add", {"expr": "30+4"})]
    assert CompactParser().parse("5+6]", {"add": add}).calls[0].arguments == {"expr": "5+6"}
    assert not CompactParser().parse("34", {"add": add}).wants_tools


def test_tool_environment_returns_results_and_counts_errors():
    env = ToolEnvironment({"add": add}, CompactParser())
    ok = env.step([{"role": "assistant", "content": "[30+4]"}])
    assert not ok.done and ok.messages[0]["content"] == "34" and (ok.tool_calls, ok.tool_errors) == (1, 0)
    bad = env.step([{"role": "assistant", "content": "[3+]"}])
    assert not bad.done and bad.messages[0]["content"].startswith("error: ValueError") and bad.tool_errors == 1
    assert env.step([{"role": "assistant", "content": "34"}]).done


def test_tool_schema_is_transformers_and_bad_tools_are_refused():
    assert tool_schema(add)["function"]["parameters"]["properties"]["expr"]["type"] == "string"

    def no_doc(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="docstring"):
        tool_schema(no_doc)
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_tool("no_such_module_xyz:f")
    assert load_tool("tests.test_agents_loop:add")("1+2") == "3"


def test_auto_parser_is_compact_for_the_character_tokenizer():
    from engine.model.tokenizer import CharTokenizer

    assert make_parser("auto", CharTokenizer(ALPHABET)).name == "compact"
    with pytest.raises(ConfigError, match="not a known parser"):
        make_parser("nope", CharTokenizer(ALPHABET))


def _multi_turn(rank, world, overrides):
    """A tiny random model whose `]` (the compact format's call end) is likely, sampling 3 turns
    at most with the add tool; the engine's recompute of the same rows."""
    from engine.agents.loop import run_episodes
    from engine.agents.render import PlainRenderer
    from engine.backends.fsdp import FSDPEngine
    from engine.config.load import load_run_config
    from engine.model.tokenizer import CharTokenizer
    from engine.rollout.torch_sampler import TorchSampler

    tok = CharTokenizer(ALPHABET)
    # aten matmuls: onednn packs the weights at build, and the test edits lm_head after it
    cfg = load_run_config(["rollout.max_new_tokens=8", "rollout.temperature=0.8", "engine.cpu_matmul=aten",
                           *overrides]).config
    eng = FSDPEngine(cfg, "", tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"),
                     updates_per_step=1)
    eng.build()
    close = tok.stoi["]"]
    with torch.no_grad():  # make "[" and "]" likely, so turns end in calls
        w = eng.model.lm_head.weight
        h = eng.model.model(torch.tensor([tok.encode("12+30=[]0123")])).last_hidden_state[0].mean(0)
        w[close] += 2.5 * h / h.norm() ** 2  # its logit up by about 2.5 where the state looks like these
    sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device)
    sampler.stop_token_ids = (close,)
    gen = torch.Generator().manual_seed(5)
    prompts = [tok.encode("12+30="), tok.encode("7+5="), tok.encode("100+23=")]
    with eng.generation_model() as m:  # 3 prompts x 4 samples
        out = run_episodes(lambda p, n: sampler.generate(m, p, n, gen), prompts, [None] * 3, 4,
                           lambda: ToolEnvironment({"add": add}, CompactParser()), PlainRenderer(tok), tok.decode,
                           max_turns=3, max_tokens=60, pad_token_id=tok.pad_token_id)
    recomputed, _ = eng.compute_log_probs(out.batch)
    return out.batch, recomputed, out.metrics(), [(t.messages, t.stop, t.turns) for t in out.trajectories]


@pytest.mark.parametrize("overrides", [[], ["engine.pad_to_length=true", "engine.pad_to_length_bucket=16",
                                              "engine.micro_batch_size=5"]], ids=["shared_prefill", "buckets"])
def test_multi_turn_log_probs_equal_the_engine_and_tool_tokens_are_masked(overrides):
    from engine.model.tokenizer import CharTokenizer

    tok = CharTokenizer(ALPHABET)
    (batch, recomputed, metrics, trajs), = run_ranks(_multi_turn, 1, overrides)
    assert len(batch) == 12 and metrics["turns_max"] >= 2 and metrics["tool_calls"] > 0
    mask = batch.response_mask
    assert torch.allclose(batch.rollout_log_probs * mask, recomputed * mask, atol=1e-5), \
        (batch.rollout_log_probs * mask - recomputed * mask).abs().max()
    for i, (messages, stop, turns) in enumerate(trajs):
        p, n = int(batch.prompt_lengths[i]), int(batch.attention_mask[i].sum())
        tail = batch.input_ids[i, p:n].tolist()
        m = mask[i, p:n].tolist()
        # the context is the model's turns and the tools' messages, in order, each exactly once
        pieces, j = [], 0
        while j < len(tail):
            k = j
            while k < len(tail) and m[k] == m[j]:
                k += 1
            pieces.append((m[j], tail[j:k]))
            j = k
        tool_ids = [ids for w, ids in pieces if w == 0]
        assert tool_ids == [tok.encode(x["content"]) for x in messages if x["role"] == "tool"]
        assert sum(w == 1 for w, _ in pieces) <= turns <= 3
        assert (batch.rollout_log_probs[i, p:n][mask[i, p:n] == 0] == 0).all()  # tool tokens: no log-prob
        assert stop in ("done", "turn_limit", "token_limit") and n - p <= 60
    # some trajectory really had tool tokens inside it (interior zeros of response_mask)
    interior = [(mask[i, int(batch.prompt_lengths[i]):int(batch.attention_mask[i].sum())] == 0).any()
                for i in range(len(batch))]
    assert any(interior)


# a Qwen2.5-style ChatML template with tools (Hermes calls), as the Qwen2.5 instruct models ship it, trimmed
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hermes_tokenizer():
    from engine.model.presets import resolve_model_path
    from engine.config.schema import ModelConfig

    try:
        path = resolve_model_path(ModelConfig(preset="smollm2-135m"))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no SmolLM2 tokenizer here ({e})")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = HERMES_TEMPLATE
    return tok


def test_chat_delta_continues_the_context_exactly_as_the_template_renders_the_conversation(hermes_tokenizer):
    """prompt tokens + the model's turn (as sampled, ending at EOS) + the renderer's delta for two
    tool messages == the template's own tokens of the whole conversation (with the next
    generation prompt): nothing re-tokenized, nothing missing (the newline after <|im_end|>)."""
    from engine.agents.render import ChatRenderer, make_renderer

    tok = hermes_tokenizer
    schemas = [tool_schema(add)]
    assert make_parser("auto", tok).name == "hermes"
    r = make_renderer(tok, schemas)
    assert isinstance(r, ChatRenderer)
    user = [{"role": "user", "content": "What is 12+30 and 7+5?"}]
    call = ('<tool_call>{"name": "add", "arguments": {"expr": "12+30"}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"expr": "7+5"}}</tool_call>')
    tools = [{"role": "tool", "name": "add", "content": "42"}, {"role": "tool", "name": "add", "content": "12"}]
    prompt = r.prompt(user)
    turn = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]  # what the sampler returns
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": call}] + tools, tools=schemas,
                                    tokenize=False, add_generation_prompt=True)
    assert prompt + turn + r.delta(tools) == tok.encode(whole, add_special_tokens=False)
    env = ToolEnvironment({"add": add}, make_parser("auto", tok))
    step = env.step(user + [{"role": "assistant", "content": call}])
    assert [m["content"] for m in step.messages] == ["42", "12"] and not step.done


def test_a_multi_turn_rollout_keeps_the_ranks_engines_awake_between_turns_and_sleeps_them_once():
    """The ranks' vLLM engine slept after every generate call, so each turn of a multi-turn rollout
    moved its weights to the host and back. generate_turns asks every turn to keep it awake and
    puts it to sleep once, after the last turn, before the phases that need the memory; a
    single-turn rollout is one call that sleeps by itself."""
    from types import SimpleNamespace

    from engine.trainer.trainer import generate_turns

    calls = []

    class Workers:  # the WorkerGroup calls generate_turns makes, recorded
        def generate(self, prompts, n, greedy=False, keep_awake=False):
            calls.append(("generate", len(prompts), keep_awake))
            return SimpleNamespace(extras={}), [{"time": 1.0}]

        def sleep_samplers(self):
            calls.append(("sleep",))

    class Agent:  # three turns, as the loop calls its sampler
        def run(self, generate, prompts, examples, n, tokenizer):
            batch = None
            for _ in range(3):
                batch = generate(prompts, n)
            return SimpleNamespace(batch=batch, responses=list, env_rewards=list, metrics=dict, trajectories=[])

    inputs = SimpleNamespace(agent=Agent(), task=SimpleNamespace(train=["a", "b"], val=[]), tokenizer=None)
    _, stats = generate_turns(inputs, Workers(), [[1], [2]], 2, idx=[0, 1])
    assert calls == [("generate", 2, True)] * 3 + [("sleep",)]
    assert stats == [{"time": 3.0}]
    calls.clear()
    generate_turns(SimpleNamespace(agent=None), Workers(), [[1]], 2)
    assert calls == [("generate", 1, False)]
