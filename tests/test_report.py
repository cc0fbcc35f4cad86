"""Metrics: JSONL lines, TensorBoard events, the console line and the reward plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.report import MetricsLog, format_line, plot_rewards, read_metrics


def test_log_writes_jsonl_tensorboard_and_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = MetricsLog(tmp_path, total_steps=2, display=False)
    log.log({"step": 0, "eval_reward": 0.25}, kind="eval")
    log.log(
        {"step": 1, "reward": 0.5, "pass_rate": 0.5, "break_causes": {"bpe": 2}, "t_update": 1.5}
    )
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["eval", "train"]
    assert records[1]["reward"] == 0.5 and records[1]["break_causes"] == {"bpe": 2}
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    out = capsys.readouterr().out
    assert "train step   1 | reward 0.500 | pass 50%" in out and "causes bpe=2" in out


def test_read_metrics_skips_a_torn_last_line(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"kind": "train", "step": 1, "reward": 0.1}\n{"kind": "tra')
    assert read_metrics(p) == [{"kind": "train", "step": 1, "reward": 0.1}]


def test_format_line_shows_only_present_numbers() -> None:
    line = format_line({"kind": "train", "step": 3, "reward": 0.125, "tokens_per_s": 99.6})
    assert line == "train step   3 | reward 0.125 | tok/s 100"


def test_plot_rewards(tmp_path: Path) -> None:
    records = [
        {"kind": "eval", "step": 0, "eval_reward": 0.2},
        {"kind": "train", "step": 1, "reward": 0.3},
        {"kind": "train", "step": 2, "reward": 0.4},
        {"kind": "eval", "step": 2, "eval_reward": 0.45},
    ]
    png = plot_rewards(records, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no train or eval records"):
        plot_rewards([], tmp_path / "empty.png")


def test_the_eval_line_and_the_plot_name_the_best_eval_and_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = {"kind": "eval", "step": 4, "eval_reward": 0.25, "eval_reward_best": 0.5}
    line = format_line({**record, "best_step": 2})
    assert line == "eval step   4 | eval 0.250 | best 0.500 | at step 2"
    import matplotlib.pyplot as plt

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its legend
    records = [{"kind": "eval", "step": s, "eval_reward": r} for s, r in ((0, 0.2), (2, 0.5))]
    plot_rewards(records, tmp_path / "reward.png", best=(2, 0.5))
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert "best held-out eval 0.500 at step 2" in legend
    figures[0].clf()
