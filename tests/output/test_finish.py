"""pipeline.output.finish.find_finish (the normative finish rules) and pipeline.grammar."""

from __future__ import annotations

import pytest

from pipeline.grammar import TokenSequenceMatcher, choice_grammar, grammar_end, grammar_error
from pipeline.output.finish import Finish, FinishKind, StopRules, StopStringHit, find_finish
from pipeline.params import SamplingParams

EOS = 2


def rules(max_new=100, min_new=0, stop_ids=(EOS,)) -> StopRules:
    return StopRules(frozenset(stop_ids), min_new, max_new)


def test_nothing_finishes_inside_budget_without_stops():
    assert find_finish([5, 6, 7], 0, rules()) is None


def test_stop_token_gives_its_position_and_id():
    assert find_finish([5, EOS, 7], 10, rules()) == Finish(11, FinishKind.STOP_TOKEN, EOS)


def test_the_earliest_stop_token_wins():
    assert find_finish([5, 9, EOS, 9], 0, rules(stop_ids=(EOS, 9))).pos == 1


def test_length_finishes_at_max_new_tokens_minus_one():
    assert find_finish([5, 6, 7, 8], 8, rules(max_new=10)) == Finish(9, FinishKind.LENGTH, None)


def test_stop_token_inside_budget_beats_an_overshooting_window():
    fin = find_finish([5, EOS, 7, 8, 9], 0, rules(max_new=3))
    assert (fin.pos, fin.reason, fin.matched) == (1, "stop", EOS)


def test_stop_token_before_min_new_tokens_is_an_ordinary_token():
    fin = find_finish([EOS, 6, EOS, 8], 0, rules(min_new=2))
    assert (fin.pos, fin.matched) == (2, EOS)


def test_min_new_tokens_counts_output_positions_not_window_indices():
    assert find_finish([EOS, 6], 5, rules(min_new=6)) is None
    assert find_finish([EOS, 6], 6, rules(min_new=6)).pos == 6


def test_tie_order_at_one_position_is_stop_token_stop_string_grammar_length():
    window = [5, 6, EOS]
    r = rules(max_new=3)
    hit = StopStringHit(2, "x")
    assert find_finish(window, 0, r, hit, 2).kind is FinishKind.STOP_TOKEN
    r2 = rules(max_new=3, stop_ids=())
    assert find_finish(window, 0, r2, hit, 2) == Finish(2, FinishKind.STOP_STRING, "x")
    assert find_finish(window, 0, r2, None, 2) == Finish(2, FinishKind.GRAMMAR, None)
    assert find_finish(window, 0, r2, None, None) == Finish(2, FinishKind.LENGTH, None)


def test_an_earlier_stop_string_beats_a_later_stop_token():
    fin = find_finish([5, 6, EOS], 0, rules(), StopStringHit(1, "ab"))
    assert (fin.pos, fin.reason, fin.matched, fin.finished_len) == (1, "stop", "ab", 2)


def test_grammar_finish_is_reason_stop_with_no_matched_stop():
    fin = find_finish([5, 6, 7], 0, rules(), None, 1)
    assert (fin.pos, fin.reason, fin.matched) == (1, "stop", None)


def test_stop_string_hit_outside_the_window_is_a_caller_bug():
    with pytest.raises(ValueError):
        find_finish([5, 6], 10, rules(), StopStringHit(3, "x"))


def test_stop_rules_add_eos_unless_ignore_eos():
    p = SamplingParams(stop_token_ids=[7])
    assert StopRules.from_params(p, [EOS]).stop_ids == {7, EOS}
    p2 = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert StopRules.from_params(p2, [EOS]).stop_ids == {7}


def test_choice_grammar_terminates_after_a_complete_choice():
    m = TokenSequenceMatcher([[1, 2, 3], [1, 4]])
    assert m.accept_token(1) and not m.is_terminated()
    assert m.accept_token(4) and m.is_terminated()
    assert not m.accept_token(9)


def test_choice_grammar_waits_while_a_longer_choice_is_possible():
    m = TokenSequenceMatcher([[1], [1, 2]])
    assert m.accept_token(1) and not m.is_terminated()
    assert m.accept_token(2) and m.is_terminated()


def test_rejected_token_terminates_the_matcher():
    m = TokenSequenceMatcher([[1, 2]])
    assert not m.accept_token(5)
    assert m.is_terminated()


def test_grammar_end_feeds_up_to_the_ending_token_only():
    m = choice_grammar([[1, 2]])()
    assert grammar_end(m, [1, 2, 3, 4]) == 1
    assert grammar_end(choice_grammar([[1, 2, 3]])(), [1, 2]) is None
    assert grammar_end(choice_grammar([[1, 2, 3]])(), [1, 9, 3]) == 1  # rejected token ends it


def test_a_grammar_error_beats_every_other_finish_at_its_position_but_not_an_earlier_one():
    r = rules(max_new=3)
    err = find_finish([5, EOS, 7], 0, r, None, 1, "a token the grammar does not allow")
    assert err == Finish(1, FinishKind.GRAMMAR_ERROR, None, "a token the grammar does not allow")
    assert (err.reason, err.kind_name) == ("error", "grammar_error")
    assert find_finish([EOS, 6, 7], 0, r, None, 1, "x").kind is FinishKind.STOP_TOKEN
    assert find_finish([5, 6, 7], 0, rules(max_new=2), None, 1, "x").kind is \
        FinishKind.GRAMMAR_ERROR  # length at the same position
    assert find_finish([5, 6, 7], 0, rules(max_new=1), None, 1, "x").kind is FinishKind.LENGTH


def test_grammar_error_says_why_a_choice_matcher_ended():
    m = choice_grammar([[1, 2]])()
    assert grammar_end(m, [1, 2]) == 1 and grammar_error(m) is None  # accepted
    m = choice_grammar([[1, 2]])()
    assert grammar_end(m, [1, 9]) == 1 and grammar_error(m) == "a token the grammar does not allow"


def test_choice_grammar_factory_returns_fresh_matchers():
    factory = choice_grammar([[1, 2]])
    a, b = factory(), factory()
    a.accept_token(1)
    assert a is not b and b.accept_token(1)


def test_empty_choice_is_rejected():
    with pytest.raises(ValueError):
        choice_grammar([[]])
