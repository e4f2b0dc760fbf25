"""Grading table (math-verify through epirl.rewards), answer extraction policies, DAPO overlong shaping."""

import pytest

from epirl.rewards import extract_answer, grade, normalize_gold, overlong_penalty

# (completion, gold, expected reward) for style "boxed"
BOXED_TABLE = [
    # equivalent forms of fractions and decimals
    (r"So the answer is \boxed{\dfrac{3}{4}}.", r"\frac{3}{4}", 1.0),
    (r"\boxed{0.75}", r"\frac34", 1.0),
    (r"\boxed{\frac12}", "0.5", 1.0),
    (r"\boxed{\tfrac{1}{2}}", "1/2", 1.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    (r"\boxed{1000}", "1,000", 1.0),
    (r"\boxed{-3}", "3", 0.0),
    (r"\boxed{\frac{3}{5}}", r"\frac{5}{3}", 0.0),
    # intervals: endpoints' openness matters
    (r"\boxed{(1, 2]}", "(1,2]", 1.0),
    (r"\boxed{[1, 2]}", "(1,2]", 0.0),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", 1.0),
    # units are dropped
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{5 cm}", "5", 1.0),
    (r"\boxed{5\,\mathrm{cm}}", "5", 1.0),
    (r"\boxed{6 \text{ cm}}", "5", 0.0),
    # percentages: 25% equals both 25 (the gold's convention) and 0.25
    (r"\boxed{25\%}", "25", 1.0),
    (r"\boxed{25\%}", "0.25", 1.0),
    # equations and sets
    (r"\boxed{x = 7}", "7", 1.0),
    (r"\boxed{2, 3}", "3,2", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{\text{(B)}}", "B", 1.0),
    # several boxes: the LAST box is the answer (math-verify alone would build the set {3, 5})
    (r"First \boxed{3}, wait, no: \boxed{5}", "5", 1.0),
    (r"First \boxed{3}, wait, no: \boxed{5}", "3", 0.0),
    # no answer, malformed LaTeX, truncated box
    ("I do not know the answer.", "5", 0.0),
    ("The answer is 5.", "5", 0.0),  # a bare number is not a boxed answer
    (r"\boxed{\frac{1}{}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{\frac{1}{2", r"\frac{1}{2}", 0.0),
    (r"\boxed{)(}", "1", 0.0),
    # gold forms: OlympiadBench wraps in $...$, some golds arrive boxed
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"$\frac{\sqrt{3}}{2}$", 1.0),
    (r"\boxed{12}", r"\boxed{12}", 1.0),
    (r"\boxed{12}", "", 0.0),
    # brace-less and \fbox variants
    (r"\boxed 7 is the answer", "7", 1.0),
    (r"\fbox{7}", "7", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", BOXED_TABLE)
def test_grade_boxed_table(completion, gold, expected):
    assert grade(completion, gold, "boxed") == expected


DAPO_TABLE = [
    ("Let me compute.\n2+2=4\nAnswer: 4", "4", 1.0),
    ("answer: $\\frac{1}{2}$", "0.5", 1.0),
    ("Answer: 3\nOn second thought...\nAnswer: 4", "4", 1.0),  # the last Answer: line counts
    ("Answer: 3\nOn second thought...\nAnswer: 4", "3", 0.0),
    ("Answer: \\boxed{12}.", "12", 1.0),
    ("ANSWER : 7", "7", 1.0),
    ("The answer is 5", "5", 0.0),  # no "Answer:" line
    (r"\boxed{5}", "5", 0.0),  # a box alone is not DAPO format
    ("Answer: 5 cm", "5", 1.0),
    ("Answer: 6", "5", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", DAPO_TABLE)
def test_grade_dapo_table(completion, gold, expected):
    assert grade(completion, gold, "dapo") == expected


@pytest.mark.parametrize(
    "completion,style,expected",
    [
        (r"a \boxed{1} b \boxed{\frac{2}{3}} c", "boxed", r"\frac{2}{3}"),
        (r"\boxed{\{1,2\}}", "boxed", r"\{1,2\}"),
        (r"\boxed{ }", "boxed", None),
        (r"\boxed{unclosed", "boxed", None),
        ("no box here", "boxed", None),
        (r"\boxedfoo{3}", "boxed", None),
        ("Answer: $x^2$.", "dapo", "x^2"),
        ("Answer:   ", "dapo", None),
        ("Answer: 1\nAnswer: \\boxed{2}", "dapo", "2"),
        ("nothing", "dapo", None),
    ],
)
def test_extract_answer(completion, style, expected):
    assert extract_answer(completion, style) == expected


def test_normalize_gold_unwraps_dollars_and_boxes():
    assert normalize_gold("$\\frac{1}{2}$") == "\\frac{1}{2}"
    assert normalize_gold("\\boxed{7}") == "7"
    assert normalize_gold(" 42 ") == "42"


def test_unknown_style_is_an_error():
    with pytest.raises(ValueError, match="answer style"):
        grade(r"\boxed{1}", "1", "gsm8k")


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (768, 0.0),  # exactly max - buffer: no penalty
        (769, -1 / 256),
        (896, -0.5),  # halfway through the buffer
        (1024, -1.0),  # at max_tokens: the full factor
        (1500, -1.0),  # floored at -factor
    ],
)
def test_overlong_penalty_values(length, expected):
    assert overlong_penalty(length, max_tokens=1024, buffer=256, factor=1.0) == pytest.approx(expected)


def test_overlong_penalty_scales_with_factor_and_can_be_off():
    assert overlong_penalty(896, max_tokens=1024, buffer=256, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(1024, max_tokens=1024, buffer=0, factor=1.0) == 0.0


@pytest.mark.parametrize("kwargs", [dict(buffer=-1), dict(buffer=2000), dict(factor=-1.0), dict(max_tokens=0)])
def test_overlong_penalty_rejects_bad_settings(kwargs):
    settings = dict(response_len=10, max_tokens=1024, buffer=256, factor=1.0) | kwargs
    with pytest.raises(ValueError):
        overlong_penalty(**settings)


NUMBER_TABLE = [
    ("12 + 13 = 25", "25", 1.0),
    ("8 - 11 = -3.", "-3", 1.0),
    ("8 - 11 = 3", "-3", 0.0),
    ("Half of 5 is 2.5", "5/2", 1.0),
    ("x = 3/4", "0.75", 1.0),
    ("First I thought 7, but it is 9", "7", 0.0),  # the last number counts
    ("I cannot tell.", "4", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", NUMBER_TABLE)
def test_grade_number_table(completion, gold, expected):
    """Style "number" (synthetic arithmetic task): the last number in the completion."""
    assert grade(completion, gold, "number") == expected


def test_number_style_extraction():
    assert extract_answer("5-3=2", "number") == "2"
    assert extract_answer("no digits", "number") is None
