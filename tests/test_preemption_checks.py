"""The preemption-check schedule: about every N seconds, whatever a step takes."""

from orchestrator.worker.preemption_checks import PreemptionChecks


def run_schedule(step_s: float, steps: int, every_s: float = 1.0, start: int = 0,
                 check_s: float = 0.0) -> list[int]:
    """Steps at which checks happen when every step takes step_s and every check check_s
    (rank 0 = every rank)."""
    checks = PreemptionChecks(every_s, start, now=0.0)
    at, now = [], 0.0
    for step in range(start + 1, start + steps + 1):
        now += step_s
        if checks.due(step):
            at.append(step)
            checks.agreed(step, checks.propose(step, now), now, check_s)
            now += check_s
    return at


def test_fast_steps_check_about_once_a_second_not_every_few_steps():
    at = run_schedule(step_s=0.005, steps=2000)  # 10 s of 5 ms steps
    assert at[:4] == [1, 5, 21, 85]  # right after the first step, then at most 4x a check
    gaps = [b - a for a, b in zip(at[3:], at[4:], strict=False)]
    assert gaps and all(199 <= gap <= 200 for gap in gaps)  # 1 s / 5 ms
    assert len(at) <= 15  # the old fixed 10-step schedule made 200 barriers here


def test_slow_steps_check_after_every_step():
    assert run_schedule(step_s=2.0, steps=5) == [1, 2, 3, 4, 5]


def test_the_schedule_starts_at_the_resumed_step():
    assert run_schedule(step_s=0.5, steps=6, start=100)[:3] == [101, 103, 105]  # 2 steps a second


def test_a_slowdown_shortens_the_next_interval():
    checks = PreemptionChecks(1.0, 0, now=0.0)
    checks.agreed(100, 100, now=1.0)  # 10 ms steps: next check 100 steps on
    assert checks.due(200) and not checks.due(199)
    # those 100 steps took 10 s (100 ms each): the next check comes 10 steps on
    assert checks.propose(200, now=11.0) == 10


def test_a_check_that_takes_long_is_spaced_out_to_a_fifth_of_the_time_not_made_every_step():
    # 10 ms steps, and each check 2 s (its barrier at ~1,000 ranks on a small machine): counting
    # the check itself, a 1-s period would make every step a check (training at 0.5%).
    at = run_schedule(step_s=0.01, steps=20000, check_s=2.0)
    gaps = [b - a for a, b in zip(at[7:], at[8:], strict=False)]
    # a check every 10 s of wall time (2 s of it the check): 800 steps of training between
    assert gaps and all(780 <= gap <= 800 for gap in gaps), gaps
    # a quick check (10 ms) is still made about once a second, its own time counted
    at = run_schedule(step_s=0.005, steps=2000, check_s=0.01)
    assert all(195 <= b - a <= 198 for a, b in zip(at[4:], at[5:], strict=False))
