"""Progress of `rl train` / `rl resume` on the console: step k/N, elapsed, ETA.

What is protected: the ETA is the moving average of the last steps' wall times times the steps
left (engine/tracking/eta.py, checked against hand-computed values, a slow first step fading out
of the window, a resume counting from its checkpoint's step); on a terminal the step bar shows
those numbers under the step rows, each row printed once; on a pipe or a log the output stays
one plain line per step, with no cursor or colour codes and no bar (a rich Console in process,
and real `rl train` runs on a pseudo-terminal and on a pipe)."""

from __future__ import annotations

import io
import os
import re
import subprocess

import pytest
from rich.console import Console

from engine.tracking.eta import StepClock, eta_seconds, moving_average
from engine.events import RunProgress, StepRecord
from rlcli.render.progress import LiveArea, StepBar, clock, per_step
from rlcli.render.train import PhaseDisplay, StepPrinter

ESC = "\x1b"


class FakeTime:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------------
# The numbers (engine)
# ---------------------------------------------------------------------------------------------

def test_moving_average_and_eta_from_first_principles():
    assert moving_average([]) is None and eta_seconds([], 5) is None
    assert moving_average([4.0, 2.0]) == 3.0
    assert moving_average([9.0, 1.0, 2.0, 3.0], window=3) == 2.0  # only the last 3
    assert eta_seconds([1.0, 3.0], 10) == 20.0                     # mean 2 s x 10 steps
    assert eta_seconds([5.0], 0) == 0.0                             # nothing left


def test_step_clock_eta_follows_the_recent_pace():
    """Steps of 10 s, 2 s, 2 s, 2 s with a window of 3 over 10 steps: the ETA after each step is
    mean(last 3 step times) x (10 - step): 10x9=90, 6x8=48, (14/3)x7, 2x6=12 (the slow first
    step has left the window); elapsed is the sum so far."""
    now = FakeTime()
    c = StepClock(0, 10, window=3, now=now)
    first = c.start()
    assert (first.step, first.total_steps, first.elapsed_s, first.eta_s, first.step_s) == (0, 10, 0.0, None, None)
    seen = []
    for step, dt in enumerate([10.0, 2.0, 2.0, 2.0], start=1):
        now.t += dt
        seen.append(c.tick(step))
    assert [p.step for p in seen] == [1, 2, 3, 4]
    assert [p.elapsed_s for p in seen] == [10.0, 12.0, 14.0, 16.0]
    assert [p.step_s for p in seen] == pytest.approx([10.0, 6.0, 14 / 3, 2.0])
    assert [p.eta_s for p in seen] == pytest.approx([90.0, 48.0, 14 / 3 * 7, 12.0])


def test_step_clock_on_resume_counts_from_the_checkpoint():
    """Resumed at step 20 of 40: the first step run is 21, 19 steps are left after it."""
    now = FakeTime()
    c = StepClock(20, 40, now=now)
    assert c.start().step == 20
    now.t += 3.0
    p = c.tick(21)
    assert (p.step, p.start_step, p.elapsed_s, p.eta_s) == (21, 20, 3.0, 57.0)
    now.t += 3.0
    assert c.tick(40).eta_s == 0.0


def test_time_between_steps_counts_in_the_next_step():
    """A checkpoint save after step 1 (5 s) is wall time the run spends: it lands in step 2."""
    now = FakeTime()
    c = StepClock(0, 4, window=10, now=now)
    now.t += 1.0
    c.tick(1)
    now.t += 5.0 + 1.0  # the save, then step 2
    p = c.tick(2)
    assert p.step_s == 3.5 and p.eta_s == 7.0


def test_clock_formatting():
    assert clock(None) == "-:--:--" and clock(0) == "0:00:00" and clock(3725.4) == "1:02:05"
    assert per_step(None) == "" and per_step(1.234) == "1.23 s/step" and per_step(125) == "0:02:05/step"


# ---------------------------------------------------------------------------------------------
# Rendering (rlcli): terminal vs pipe, in process
# ---------------------------------------------------------------------------------------------

def _record(step: int) -> StepRecord:
    return StepRecord(step=step, reward_mean=0.25 * step, accuracy=None, kl=None, pg_loss=0.1, entropy=None,
                      grad_norm=1.0, lr=1e-3, response_len_mean=3.0, rollout_tokens_per_s=10.0,
                      update_tokens_per_s=10.0, step_time_s=2.0, peak_mem_bytes=1000, pad_fraction=0.1,
                      distinct_shapes=1)


def _draw(console: Console, steps: int = 3, total: int = 5) -> str:
    """What run_and_render draws for `steps` steps of 2 s each of a `total`-step run."""
    area = LiveArea(console)
    printer, bar, phases = StepPrinter(console, area=area), StepBar(area), PhaseDisplay(console, area)
    now = FakeTime()
    c = StepClock(0, total, now=now)
    bar.update(c.start())
    for step in range(1, steps + 1):
        now.t += 2.0
        printer.step(_record(step))
        bar.update(c.tick(step))
    bar.close()
    phases.close()
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_a_terminal_shows_step_elapsed_and_eta_under_the_rows():
    out = _draw(Console(file=io.StringIO(), force_terminal=True, width=120, color_system="standard"))
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out).replace("\r", "\n")  # `\r`: the bar redraws in place
    assert "step 0/5" in plain and "ETA -:--:--" in plain  # before the first step: no ETA yet
    assert "step 3/5" in plain and "elapsed 0:00:06" in plain and "ETA 0:00:04" in plain and "2.00 s/step" in plain
    assert "step 1/5" in plain and "ETA 0:00:08" in plain
    for step, reward in ((1, "0.250"), (2, "0.500"), (3, "0.750")):  # each row printed once, bar redraws apart
        assert len(re.findall(rf"^\s+{step}\s+{reward}\s", plain, re.M)) == 1, plain
    assert out.endswith("\x1b[?25h") or "\x1b[?25h" in out[-40:]  # the cursor is given back


def test_a_pipe_gets_one_plain_line_per_step():
    out = _draw(Console(file=io.StringIO(), force_terminal=False, width=80))
    assert ESC not in out and "ETA" not in out and "step 3/5" not in out
    lines = out.splitlines()
    assert len(lines) == 1 + 3, out  # the header, then one row per step
    assert [int(line.split()[0]) for line in lines[1:]] == [1, 2, 3]


def test_the_bar_is_off_when_the_console_logger_is():
    """trainer.loggers without console: no rows, and no bar either."""
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bar = StepBar(LiveArea(console), enabled=False)
    bar.update(RunProgress(step=1, total_steps=5, start_step=0, elapsed_s=2.0, step_s=2.0, eta_s=8.0))
    bar.close()
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Real runs: a pseudo-terminal and a pipe
# ---------------------------------------------------------------------------------------------

RUN = ["train", "trainer.total_steps=3", "data.train_batch_size=4", "algorithm.rollout_n=2",
       "checkpoint.save_freq=0"]


def _on_a_pty(args: list[str], cwd) -> tuple[int, str]:
    """`rl ARGS` with stdout and stderr on a pseudo-terminal (as in an interactive shell)."""
    from tests.cli_utils import _rl_argv, _rl_env

    master, slave = os.openpty()
    env = _rl_env({"COLUMNS": "160", "TERM": "xterm-256color"})
    p = subprocess.Popen(_rl_argv(args, ""), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd, env=env)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        p.wait(timeout=300)
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
    return p.returncode, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_a_real_run_on_a_terminal_and_on_a_pipe(tmp_path):
    """On a pseudo-terminal `rl train` draws the step bar from the trainer's own RunProgress events
    (step 3/3 and an ETA appear); piped, the same run prints one plain row per step and no
    escape code."""
    from tests.cli_utils import rl

    code, tty = _on_a_pty(RUN + [f"checkpoint.dir={tmp_path / 'tty'}"], tmp_path)
    assert code == 0, tty[-3000:]
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty)
    assert "step 0/3" in plain and "step 3/3" in plain and re.search(r"ETA \d:\d\d:\d\d", plain), plain[-3000:]
    assert re.search(r"elapsed \d:\d\d:\d\d", plain) and "s/step" in plain

    piped = rl(*RUN, f"checkpoint.dir={tmp_path / 'pipe'}", cwd=tmp_path, timeout=300, own_process=True)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert ESC not in piped.stdout and "ETA" not in piped.stdout, piped.stdout
    rows = [line for line in piped.stdout.splitlines() if re.match(r"^\s+\d+\s+-?\d+\.\d{3}\s", line)]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3], piped.stdout
