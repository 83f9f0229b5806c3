"""task=sort (engine/tasks/sort_digits.py): rewards by hand, held-out prompts never trained on."""

from engine.config.schema import TaskConfig
from engine.tasks.registry import make_task
from engine.tasks.sort_digits import sort_correct, sort_reward


def test_sort_reward_by_hand():
    assert sort_reward("5281:", "1258", "1258") == 1.0
    assert sort_reward("5281:", "1250", "1258") == 0.5 * 3 / 4      # three positions right
    assert sort_reward("5281:", "125888", "1258") == 0.5 * 4 / 6    # running on past the answer costs credit
    assert sort_reward("5281:", "", "1258") == 0.0
    assert sort_correct("5281:", " 1258 ", "1258") and not sort_correct("5281:", "12580", "1258")


def test_sort_task_splits_and_answers():
    t = make_task(TaskConfig(name="sort", num_train=200, num_val=30), seed=3)
    assert len(t.train) == 200 and len(t.val) == 30
    assert not {e.prompt for e in t.train} & {e.prompt for e in t.val}
    for e in t.train[:20]:
        assert e.answer == "".join(sorted(e.prompt.rstrip(":")))
    assert make_task(TaskConfig(name="sort", num_train=200, num_val=30), seed=3).train == t.train


def test_sort_length_sets_the_difficulty():
    """task.sort_length: prompts of that many digits, still never trained on held-out ones; a
    held-out set that covers every possible prompt is refused, not looped on."""
    import pytest

    from engine.errors import ConfigError

    t = make_task(TaskConfig(name="sort", sort_length=2, num_train=50, num_val=20), seed=1)
    assert {len(e.prompt) for e in t.train + t.val} == {3}
    assert not {e.prompt for e in t.train} & {e.prompt for e in t.val}
    with pytest.raises(ConfigError, match="sort_length"):
        make_task(TaskConfig(name="sort", sort_length=2, num_train=5, num_val=5000), seed=1)
