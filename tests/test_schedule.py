"""training/schedule.py: the learning rate at each step under each train.lr_schedule, its validation, and a run
that trains with the rate it says."""
import math
import types

import pytest

import train as train_mod
from config import ConfigError, load_config
from tests.test_train import cfg_for, metrics
from training.schedule import lr_at


def conf(schedule="cosine", lr=1.0, min_lr=0.1, warmup=10, max_iters=100, decay_iters=0, frac=0.2):
    return types.SimpleNamespace(lr_schedule=schedule, learning_rate=lr, min_lr=min_lr, warmup_iters=warmup,
                                 max_iters=max_iters, lr_decay_iters=decay_iters, lr_decay_frac=frac)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_every_schedule_warms_up_the_same_way(schedule):
    t = conf(schedule)
    warm = [lr_at(i, t) for i in range(10)]
    assert warm == pytest.approx([(i + 1) / 11 for i in range(10)])
    assert lr_at(10, t) == pytest.approx(1.0)                     # the first step after warmup: the full rate


def test_cosine_is_half_a_cosine_from_the_warmup_to_the_decay_end():
    t = conf("cosine", decay_iters=60)
    for i in range(10, 60):
        ratio = (i - 10) / 50
        assert lr_at(i, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * ratio)))
    assert lr_at(35, t) == pytest.approx(0.55)                    # halfway: the mean of the two rates
    assert [lr_at(i, t) for i in (60, 99, 500)] == [0.1] * 3


def test_linear_falls_in_a_straight_line():
    t = conf("linear")
    assert lr_at(55, t) == pytest.approx(0.55) and lr_at(10, t) == pytest.approx(1.0)
    steps = [lr_at(i, t) for i in range(10, 100)]
    diffs = [a - b for a, b in zip(steps, steps[1:])]
    assert diffs == pytest.approx([0.01] * len(diffs))            # 0.9 over 90 steps
    assert lr_at(100, t) == 0.1


def test_wsd_holds_then_decays_over_its_last_fraction():
    t = conf("wsd", frac=0.2)                                     # the last 20 of 100 steps decay
    assert [lr_at(i, t) for i in range(10, 80)] == [1.0] * 70
    assert lr_at(90, t) == pytest.approx(0.55) and lr_at(99, t) == pytest.approx(0.145)
    assert lr_at(100, t) == 0.1
    short = conf("wsd", warmup=90, frac=0.5)                      # the decay never starts inside the warmup
    assert lr_at(90, short) == pytest.approx(1.0) and lr_at(95, short) == pytest.approx(0.55)


def test_constant_keeps_the_rate_past_every_end():
    t = conf("constant", decay_iters=50)
    assert [lr_at(i, t) for i in (10, 49, 50, 100, 1000)] == [1.0] * 5


@pytest.mark.parametrize("override, needle", [
    ("--lr_schedule=cosin", "train.lr_schedule='cosin': must be one of cosine, linear, wsd, constant"),
    ("--lr_decay_frac=0", "train.lr_decay_frac=0.0: must be in (0, 1]"),
    ("--lr_decay_frac=1.5", "train.lr_decay_frac=1.5: must be in (0, 1]"),
])
def test_bad_schedule_settings_are_one_line(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == needle


def test_a_run_trains_with_the_schedules_rates(tmp_path):
    """Every step's logged lr is lr_at of that step: warmup 5, stable, then the last 4 of 12 steps decay."""
    cfg = cfg_for(tmp_path, "--max_iters=12", "--eval_interval=12", "--lr_schedule=wsd", "--lr_decay_frac=0.34")
    train_mod.train(cfg)
    logged = [r["lr"] for r in metrics(cfg.train.out_dir) if "lr" in r]
    assert logged == pytest.approx([lr_at(i, cfg.train) for i in range(12)])
    assert logged[5:9] == [3e-3] * 4 and logged[-1] < logged[9] < 3e-3             # steps 8-11 decay from step 8
