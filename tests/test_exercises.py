"""The exercise checker: the book's answers pass, typical wrong answers fail, and no message gives the answer away."""

import math
import re

import pytest

from helpers import exercises

KEYS = exercises.keys()


def ref(key, **inputs):
    return exercises.EXERCISES[key].reference(**inputs)


def test_at_least_twenty_exercises_over_seven_chapters():
    assert len(KEYS) >= 20
    assert {k.split(".")[0] for k in KEYS} >= {"1", "2", "3", "4", "6", "7", "8"}


@pytest.mark.parametrize("key", KEYS)
def test_the_books_answer_is_right(key):
    g = exercises.grade(key, ref(key))
    assert g.verdict == "right" and g.ok, g.message


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("factor", [2.0, 0.5, 10.0])
def test_off_by_a_factor_is_wrong(key, factor):
    g = exercises.grade(key, ref(key) * factor)
    assert g.verdict == "wrong" and not g.ok, g.message


MEMORY_KEYS = [k for k in KEYS if exercises.EXERCISES[k].unit in ("GiB", "MiB")]


@pytest.mark.parametrize("key", MEMORY_KEYS)
def test_unit_slips_are_named(key):
    r = ref(key)
    assert "GB (10⁹ bytes) against GiB" in exercises.grade(key, r * 2**30 / 1e9).message
    assert "1,024" in exercises.grade(key, r * 1024).message
    assert "bits against bytes" in exercises.grade(key, r * 8).message
    assert "factor of 2" in exercises.grade(key, r / 2).message


def formatted(value):
    """The ways a reader would recognise the answer in a message."""
    forms = {f"{value:.3g}", f"{value:.2f}", f"{value:,.0f}", f"{value:.4g}"}
    return {f for f in forms if len(re.sub(r"\D", "", f)) >= 2 and f not in {"0.00", "00"}}


@pytest.mark.parametrize("key", KEYS)
def test_no_message_contains_the_answer(key):
    r = ref(key)
    for answer in (r * 1.05, r * 1.3, r * 2, r / 3, r + 1, r - 1, r * 100):
        message = exercises.grade(key, answer).message
        for form in formatted(r):
            assert form not in message, (key, answer, message)


def test_close_answers_are_told_close():
    assert exercises.grade("1.3", ref("1.3") * 1.05).verdict == "close"  # outside ±2%, inside ±10%
    assert exercises.grade("7.4a", ref("7.4a") - 1).verdict == "close"  # one GPU short: rounded down


def test_integer_answers_must_be_exact():
    assert exercises.grade("4.1a", ref("4.1a") + 0.4).verdict != "right"
    assert exercises.grade("7.4b", ref("7.4b") + 5).verdict == "wrong"


def test_exercise_specific_traps():
    assert "squared error" in exercises.grade("2.1", ref("2.1") ** 2).message
    assert "worst case of one element" in exercises.grade("2.3", 2**-4).message
    assert "one block" in exercises.grade("6.1", ref("6.1") / 24).message
    assert "every parameter" in exercises.grade("6.2", ref("6.2") * 1331810304 / 1207959552).message


def test_reference_values_follow_the_formulas():
    """Independent arithmetic for the values the chapters' answers quote."""
    n = 1_331_810_304  # the 1.3B GPT-NeoX (chapter 1, section 1.5)
    assert ref("1.3") == pytest.approx(2 * n / 2**30)
    assert ref("1.4") == pytest.approx(34 * 256 * 16 * 2048 * 24 / 2**30)
    assert ref("2.1") == pytest.approx(10.0)  # the normal bulk stays under 5, so the step is set by the outliers
    assert ref("2.2") == 0.5
    assert 0.03 < ref("2.3") < 0.045  # between 2^-5 and 2^-4.5
    assert ref("2.4") == pytest.approx(4096 * 0.0026998, rel=1e-4)
    assert (ref("4.1a"), ref("4.1b"), ref("4.1c")) == (16, 32, 32896)
    assert ref("4.1b", n_layers=64) == 16  # chapter 4's own N = 64 (section 4.1's table)
    assert ref("4.3") == pytest.approx(1 / 6)
    assert ref("6.1") == 16 * 8 * 2048 * 24
    assert ref("6.2") == pytest.approx(1_207_959_552 * 0.373 / 8 / 2**20, rel=2e-3)
    assert ref("7.1") == pytest.approx(2 * ref("7.2"))
    assert ref("7.3") == pytest.approx(3 / 11)
    assert (ref("7.4a"), ref("7.4b")) == (8, 126)
    assert ref("3.2") == pytest.approx(20480 / (69632 + 20480))  # 5·16·256 against 34·2048: about 0.23
    assert ref("8.3") == 512


def test_inputs_the_reader_passes():
    assert ref("6.1", r=16) == 2 * ref("6.1")
    assert exercises.grade("7.3", 3 / 35, m=32).ok
    assert not exercises.grade("7.3", 3 / 35).ok
    with pytest.raises(ValueError, match="accepted inputs: m, p"):
        exercises.grade("7.3", 0.3, stages=4)


@pytest.mark.parametrize("key", ["2.2", "ch02.2", "ch2.2", "02.2", " 2.2 "])
def test_key_spellings(key):
    assert exercises.grade(key, 0.5).ok


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="accepted: 1.1"):
        exercises.grade("9.9", 1.0)
    with pytest.raises(ValueError, match="wants a number"):
        exercises.grade("2.2", "half a byte")
    with pytest.raises(ValueError, match="finite"):
        exercises.grade("2.2", math.nan)


def test_check_prints_one_line_and_returns_nothing(capsys):
    assert exercises.check("2.2", 0.5) is None
    out = capsys.readouterr().out
    assert out.startswith("✓ 2.2") and out.count("\n") == 1


def test_questions_name_their_unit():
    for key in KEYS:
        assert re.search(r"\(in .+\)$", exercises.question(key)), key


def test_every_registered_exercise_is_named_in_its_chapter():
    """Each key appears in its chapter's exercise text as the line to run."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "notebooks"
    for key in KEYS:
        chapter = int(key.split(".")[0])
        twin = next(root.glob(f"{chapter:02d}_*.py")).read_text()
        assert f'exercises.check("{key}", ' in twin, f"chapter {chapter} does not name exercise {key}"
