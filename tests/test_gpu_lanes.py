"""scripts/gpu_lanes.py: the plan parser and the check that no two lanes use one GPU at the same time."""

import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("gpu_lanes", Path(__file__).parents[1] / "scripts" / "gpu_lanes.py")
gpu_lanes = importlib.util.module_from_spec(spec)
sys.modules["gpu_lanes"] = gpu_lanes  # dataclasses look their module up there
spec.loader.exec_module(gpu_lanes)


def test_a_plan_parses_into_lanes_items_and_waits():
    lanes = gpu_lanes.parse_plan("0:09;1:04,1:01@chk;2-3:07,2:08;w07-3:03")
    assert [len(lane.items) for lane in lanes] == [1, 2, 2, 1]
    assert lanes[1].items[1] == gpu_lanes.Item((1,), "01", "chk")
    assert lanes[2].items[0].gpus == (2, 3) and lanes[3].waits_for == "out_07"
    assert gpu_lanes.validate(lanes) == []
    assert gpu_lanes.cores(lanes[2].items[0], 16) == "32-63" and gpu_lanes.cores(lanes[3].items[0], 16) == "48-63"


@pytest.mark.parametrize("plan, problem", [
    ("2-3:07,2:08;3:03", "lanes 1 and 2 can use GPU(s) [3]"),          # the plan that cost a re-run on 2026-11-27
    ("0:09;0:04", "lanes 1 and 2 can use GPU(s) [0]"),
    ("2-3:07,3:08;w07-3:03", "lanes 1 and 2 can use GPU(s) [3]"),      # chapter 8 on GPU 3 after 7, beside 3
    ("0:09;w05-0:04", "waits for out_05, which no lane runs"),
    ("0:09;1:09", "the same chapter and tag appear twice"),
])
def test_unsafe_plans_are_refused(plan, problem):
    problems = gpu_lanes.validate(gpu_lanes.parse_plan(plan))
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("plan", ["0:9", "0:09@x", "a:09", "0-:09", "0:09;;1:04", "w07-", "3-2:07"])
def test_malformed_plans_say_what_is_wrong(plan):
    with pytest.raises(ValueError):
        gpu_lanes.parse_plan(plan)


def test_check_prints_the_lanes_or_refuses(capsys):
    assert gpu_lanes.main(["check", "0:09;1:04,1:01"]) == 0
    assert "out_04 on GPU(s) [1], cores 16-31, then out_01" in capsys.readouterr().out
    assert gpu_lanes.main(["check", "2-3:07;3:03"]) == 2
    assert "plan refused" in capsys.readouterr().err


def test_a_check_copy_runs_from_a_private_copy_of_the_chapter_folder(tmp_path):
    # Two executions of one chapter in one folder write the same relative files (chapter 8's traces): on
    # 2026-11-28 the check copy crashed reading a trace the other run was rewriting.
    src = tmp_path / "repo" / "notebooks"
    (src / "scripts").mkdir(parents=True)
    (src / "traces").mkdir()
    (src / "08_profiling.ipynb").write_text("{}")
    (src / "scripts" / "bench.py").write_text("print(1)")
    (src / "traces" / "old.json.gz").write_text("x")
    copy = Path(gpu_lanes.private_copy(str(src / "08_profiling.ipynb"), tmp_path / "res" / "tree_chk_08"))
    assert copy == tmp_path / "res" / "tree_chk_08" / "notebooks" / "08_profiling.ipynb"
    assert copy.read_text() == "{}" and (copy.parent / "scripts" / "bench.py").exists()
    assert not (copy.parent / "traces").exists()  # the other run's files are not carried over
    (copy.parent / "stale.txt").write_text("from an earlier call")
    again = Path(gpu_lanes.private_copy(str(src / "08_profiling.ipynb"), tmp_path / "res" / "tree_chk_08"))
    assert again == copy and not (copy.parent / "stale.txt").exists()  # a fresh copy each time
