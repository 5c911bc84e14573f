"""Scoring functions against values computed by hand (the arithmetic is in each comment)."""

import pytest

from eval import metrics


def test_normalize_answer():
    assert metrics.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert metrics.normalize_answer("An apple a day.") == "apple day"


def test_qa_f1():
    # "cat sat on mat" vs "cat on mat": 3 common; P = 3/4, R = 3/3; F1 = 2*.75*1/1.75 = 6/7
    assert metrics.qa_f1("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    assert metrics.qa_f1("Paris", "paris.") == 1.0
    assert metrics.qa_f1("London", "Paris") == 0.0
    assert metrics.qa_f1("", "Paris") == 0.0
    # repeated tokens count as a multiset:
    # "x x y" vs "x y y": common = {x:1, y:1} = 2; P = 2/3, R = 2/3, F1 = 2/3
    assert metrics.qa_f1("x x y", "x y y") == pytest.approx(2 / 3)


def test_lcs_and_rouge_l():
    assert metrics.lcs_length("ABCBDAB", "BDCABA") == 4  # the textbook example (CLRS 15.4)
    # LCS = "the cat was under the bed" (6 tokens); P = 6/7, R = 1; F = 2*(6/7)/(13/7) = 12/13
    assert metrics.rouge_l("the cat was found under the bed", "the cat was under the bed") == pytest.approx(12 / 13)
    assert metrics.rouge_l("", "abc") == 0.0
    assert metrics.rouge_l("a b c", "c b a") == pytest.approx(1 / 3)  # LCS 1: P = R = 1/3


def test_classification():
    classes = ["Entity", "Entity Abbreviation", "Location"]
    assert metrics.classification("Entity Abbreviation", "Entity Abbreviation", classes) == 1.0  # "Entity" dropped
    assert metrics.classification("Location or Entity Abbreviation", "Entity Abbreviation", classes) == 0.5
    assert metrics.classification("Location", "Entity Abbreviation", classes) == 0.0


def test_edit_and_code_similarity():
    # kitten/sitting: LCS "ittn" = 4 chars; 2*4/(6+7) = 8/13 (fuzz.ratio rounds this to 62)
    assert metrics.edit_similarity("kitten", "sitting") == pytest.approx(8 / 13)
    assert metrics.edit_similarity("", "") == 1.0
    assert metrics.edit_similarity("abc", "") == 0.0
    # first non-comment, non-fence line is "x = 1"; LCS with "x = 2" is "x = " (4); 8/10
    assert metrics.code_similarity("```python\n# comment\nx = 1\n```", "x = 2") == pytest.approx(0.8)


def test_count_and_retrieval():
    assert metrics.count_score("There are 3 paragraphs, not 4", "3") == 0.5
    assert metrics.count_score("none", "3") == 0.0
    assert metrics.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert metrics.retrieval_score("Paragraph 1 or 12", "Paragraph 12") == 0.5
    with pytest.raises(ValueError, match="Paragraph N"):
        metrics.retrieval_score("1", "12")


def test_string_match():
    assert metrics.string_match_all("The numbers are 12 and 34", ["12", "34", "56"]) == pytest.approx(2 / 3)
    assert metrics.string_match_part("The numbers are 12 and 34", ["56", "34"]) == 1.0
    assert metrics.string_match_all("APPLE pie", ["apple"]) == 1.0  # case-insensitive
    with pytest.raises(ValueError, match="references"):
        metrics.string_match_all("x", [])
