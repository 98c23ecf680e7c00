"""services/common/plan.py: the one timer, statistic, tie rule, log line and pin syntax of every fast path."""
from __future__ import annotations

import logging

import pytest

from services.common import plan
from services.common.plan import AUTO, ExecutionPlan, Pins, Timing


def test_pins_parse_names_and_candidates():
    pins = Pins.parse(" Linear=plain, attention=torch ,screen=auto,")
    assert pins.values == {"linear": "plain", "attention": "torch"}
    assert pins.get("linear") == "plain" and pins.get("screen") == AUTO and pins.get("glue") == AUTO
    assert str(pins) == "linear=plain,attention=torch"
    assert Pins.parse("") == Pins.parse(None) == Pins({})
    assert Pins.parse({"gemv": "off"}).get("gemv") == "off"


@pytest.mark.parametrize("text, message", [
    ("fastest=on", "unknown path 'fastest'"),
    ("linear=fast", "linear='fast': expected auto or one of plain, packed"),
    ("screen=on,screen=off", "names screen twice"),
    ("attention", "attention='': expected auto"),
])
def test_a_bad_pin_is_one_line_naming_it(text, message):
    with pytest.raises(ValueError, match=message) as refused:
        Pins.parse(text)
    assert "\n" not in str(refused.value)


def test_a_service_accepts_only_its_own_paths():
    assert Pins.parse("encoder_attention=cpp", plan.POOLING).get("encoder_attention") == "cpp"
    with pytest.raises(ValueError,
                       match="unknown path 'screen'; choose from linear, split_products, encoder_attention, malloc"):
        Pins.parse("screen=on", plan.POOLING)
    for name in plan.DECODER + plan.POOLING:
        assert name in plan.help_for(plan.DECODER + plan.POOLING)


def test_the_timer_interleaves_warms_up_and_keeps_the_minimum(monkeypatch):
    calls, clock = [], iter(range(100))
    monkeypatch.setattr(plan.time, "perf_counter", lambda: float(next(clock)))
    took = plan.fastest({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3           # one warm-up each, then interleaved rounds
    assert took == {"a": 1.0, "b": 1.0}
    calls.clear()
    plan.fastest({"a": lambda: calls.append("a")}, reps=3, warm=False)
    assert calls == ["a"] * 3


def test_the_minimum_ignores_a_stalled_round(monkeypatch):
    durations = iter([5.0, 1.0, 9.0, 1.0, 1.0, 1.0])   # a: 5, 9, 1; b: 1, 1, 1 (per round a then b)
    now = [0.0]

    def perf_counter():
        return now[0]

    def timed():
        now[0] += next(durations)
    monkeypatch.setattr(plan.time, "perf_counter", perf_counter)
    took = plan.fastest({"a": timed, "b": timed}, reps=3, warm=False)
    assert took == {"a": 1.0, "b": 1.0}


def test_the_tie_rule_keeps_the_default():
    assert plan.beats(1.0, 1.0 * (1 + plan.TIE) + 0.01) and not plan.beats(1.0, 1.0 + plan.TIE / 2)
    assert plan.tied(1.0, 1.0 + plan.TIE / 2) and not plan.tied(1.0, 2.0)
    assert plan.pick({"old": 1.0, "new": 0.98}, "old") == "old"     # within the margin: the default stays
    assert plan.pick({"old": 1.0, "new": 0.5}, "old") == "new"
    assert plan.pick({"old": 0.5, "new": 1.0}, "old") == "old"


def test_each_choice_is_one_log_line_and_one_record(caplog):
    record = ExecutionPlan("screen=off")
    with caplog.at_level(logging.INFO, "tessera.plan"):
        record.record("screen", "off")
        record.record("attention", "cpp", [Timing("cpp", 1e-4, 1), Timing("torch", 2e-4, 1)], "timed")
        record.record("attention", "torch", reason="again")      # a later choice of a name replaces it
    assert [r.getMessage() for r in caplog.records] == [
        "fast path screen: off (pinned by --fast-paths screen=off)",
        "fast path attention: cpp (timed) [1 row: cpp 0.100 ms, torch 0.200 ms]",
        "fast path attention: torch (again)"]
    assert [c.name for c in record.choices] == ["screen", "attention"]
    assert record.chosen("attention") == "torch" and record.summary() == "screen: off; attention: torch"
    with pytest.raises(KeyError):
        record.chosen("glue.norm")
    assert plan.path_of("linear 576x576") == "linear" and plan.path_of("glue.norm") == "glue"


def test_the_plan_goes_on_the_wire():
    record = ExecutionPlan("linear=plain")
    record.record("linear 8x4", "plain")
    record.record("gemv 8x4", "on rows<=2", [Timing("off", 2e-6, 1), Timing("on", 1e-6, 1)])
    msg = record.to_proto()
    assert msg.pins == "linear=plain"
    assert [(c.name, c.chosen) for c in msg.choices] == [("linear 8x4", "plain"), ("gemv 8x4", "on rows<=2")]
    assert msg.choices[0].reason == "pinned by --fast-paths linear=plain"
    assert [(t.candidate, t.rows, t.seconds) for t in msg.choices[1].timings] == [("off", 1, 2e-6), ("on", 1, 1e-6)]


def test_a_plan_refuses_a_pin_of_another_service():
    with pytest.raises(ValueError, match="unknown path 'encoder_attention'"):
        ExecutionPlan("encoder_attention=cpp", plan.DECODER)
    assert ExecutionPlan("encoder_attention=cpp", plan.POOLING).pinned("encoder_attention") == "cpp"
