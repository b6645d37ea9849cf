"""Request validation -> SamplingParams, error bodies and response pieces (pure, no server)."""

from __future__ import annotations

import pytest

from pipeline.frontend import requests as reqs
from pipeline.frontend import responses as resp
from pipeline.frontend.errors import APIError
from pipeline.output.request_output import RequestOutput


def completion(**kw):
    return reqs.parse_completion_request({"prompt": "hi", **kw})


def chat(**kw):
    return reqs.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **kw})


def error_of(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kw)
    return info.value


def test_completion_request_maps_openai_names_to_sampling_params():
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=11, stop="##",
                     stop_token_ids=[5], ignore_eos=True, min_tokens=2, logprobs=3,
                     include_stop_str_in_output=True)
    p = reqs.to_sampling_params(req, prompt_len=10, max_model_len=100)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 40, 11)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_new_tokens) == (["##"], [5], True, 2)
    assert (p.logprobs, p.include_stop_str_in_output) == (3, True)


def test_chat_logprobs_bool_and_top_logprobs_become_top_n():
    assert reqs.to_sampling_params(chat(logprobs=True, top_logprobs=4), 5, 100).logprobs == 4
    assert reqs.to_sampling_params(chat(logprobs=True), 5, 100).logprobs == 0
    assert reqs.to_sampling_params(chat(), 5, 100).logprobs is None


def test_chat_max_completion_tokens_wins_and_default_fills_the_context():
    assert reqs.to_sampling_params(chat(max_completion_tokens=3, max_tokens=9), 5, 100) \
        .max_new_tokens == 3
    assert reqs.to_sampling_params(chat(), 30, 100).max_new_tokens == 70
    assert reqs.to_sampling_params(completion(), 30, 100).max_new_tokens == 16


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", -1, "max_tokens"),
    ("max_tokens", "5", "max_tokens"),
    ("max_tokens", 1.5, "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("temperature", True, "temperature"),
    ("top_p", [1], "top_p"),
    ("n", 0, "n"),
    ("n", 10**6, "n"),
    ("logprobs", 21, "logprobs"),
    ("logprobs", -1, "logprobs"),
    ("stop", 5, "stop"),
    ("stop_token_ids", ["a"], "stop_token_ids"),
    ("stream", "yes", "stream"),
    ("stream_options", {"include_usage": True}, "stream_options"),  # without stream
    ("echo", True, "echo"),
    ("presence_penalty", 0.5, "presence_penalty"),
    ("logit_bias", {"5": 1.0}, "logit_bias"),
    ("prompt", "", "prompt"),
    ("prompt", [], "prompt"),
    ("prompt", "a\x00b", "prompt"),
    ("prompt", "a\ud800b", "prompt"),
    ("prompt", {"text": "x"}, "prompt"),
    ("stop", ["ok", "\udc00"], "stop"),
])
def test_bad_completion_fields_name_the_parameter(field, value, param):
    def parse():
        req = completion(**{field: value})
        reqs.completion_prompts(req)
    err = error_of(parse)
    assert err.status_code == 400
    assert err.param is not None and err.param.startswith(param)
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw,param", [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 513]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 95}, "max_tokens"),  # 10 prompt + 95 > 100
])
def test_out_of_range_values_are_400_naming_the_parameter(kw, param):
    err = error_of(lambda: reqs.to_sampling_params(completion(**kw), 10, 100))
    assert (err.status_code, err.param) == (400, param)
    assert param in err.message


def test_prompt_longer_than_the_context_is_context_length_exceeded():
    err = error_of(reqs.to_sampling_params, completion(), 100, 100)
    assert (err.status_code, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    err = error_of(reqs.to_sampling_params, chat(), 120, 100)
    assert (err.param, err.code) == ("messages", "context_length_exceeded")


@pytest.mark.parametrize("kw,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\x00"}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_fields_name_the_parameter(kw, param):
    data = {"messages": [{"role": "user", "content": "hi"}], **kw}
    err = error_of(reqs.parse_chat_request, data)
    assert (err.status_code, err.param) == (400, param)


def test_chat_content_parts_and_developer_role_render_as_plain_messages():
    req = reqs.parse_chat_request({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})
    assert reqs.chat_messages_as_dicts(req) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]


def test_parse_json_body_rejects_non_objects_and_deep_nesting():
    assert reqs.parse_json_body(b'{"a": 1}') == {"a": 1}
    assert error_of(reqs.parse_json_body, b"[1]").status_code == 400
    assert error_of(reqs.parse_json_body, b"{nope").status_code == 400
    assert error_of(reqs.parse_json_body, b'{"a":' + b"[" * 100 + b"]" * 100 + b"}") \
        .message == "request body is nested too deeply"


def test_batched_prompts_and_token_id_prompts():
    assert reqs.completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    assert reqs.completion_prompts(completion(prompt=[1, 2])) == [[1, 2]]
    assert reqs.completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    err = error_of(reqs.check_prompt_ids, [1, 300], 256, "prompt")
    assert err.param == "prompt" and "300" in err.message


def test_seeds_are_derived_per_choice():
    seeds = [reqs.choice_seed(7, i) for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert all(0 <= s < 2**63 for s in seeds)
    assert reqs.choice_seed(None, 3) is None


@pytest.mark.parametrize(("kind", "matched", "expected"), [
    ("stop_string", "##", "##"),
    ("stop_token", 9, 9),  # also an EOS id the request listed in stop_token_ids
    ("eos", 2, None),  # EOS is not a stop reason
    ("grammar", None, None),
    ("length", None, None),
    ("abort", None, None),
])
def test_stop_reason_follows_vllm(kind, matched, expected):
    c = resp.ChoiceState(index=0)
    c.add(RequestOutput("r", finished=True, finish_reason="length" if kind == "length" else "stop",
                        finish_kind=kind, matched_stop=matched))
    assert resp.stop_reason(c) == expected


def test_choice_state_accumulates_deltas_and_keeps_cumulative_spec_stats():
    c = resp.ChoiceState(index=0)
    c.add(RequestOutput("r", [1, 2], "ab", [-0.1, -0.2], None, spec_verify_ct=1,
                        spec_accepted_tokens=1, spec_acceptance_histogram=[0, 1]))
    c.add(RequestOutput("r", [3], "c", [-0.3], None, finished=True, finish_reason="stop",
                        matched_stop="x", spec_verify_ct=2, spec_accepted_tokens=1,
                        spec_acceptance_histogram=[1, 1], spec_draft_tokens=3))
    assert (c.text, c.token_ids, c.logprobs) == ("abc", [1, 2, 3], [-0.1, -0.2, -0.3])
    assert (c.finish_reason, c.matched_stop) == ("stop", "x")
    assert c.spec_stats() == {"verify_ct": 2, "accepted_tokens": 1, "acceptance_histogram": [1, 1],
                              "draft_tokens": 3}


def test_logprob_tables():
    tok = {5: "a", 6: "bb", 7: "é"}.__getitem__
    legacy = resp.completion_logprobs([5, 6], [-0.5, float("-inf")], [[(5, -0.5), (6, -1.0)], []],
                                       tok, offset=3)
    assert legacy == {"tokens": ["a", "bb"], "token_logprobs": [-0.5, -9999.0],
                      "top_logprobs": [{"a": -0.5, "bb": -1.0}, None], "text_offset": [3, 4]}
    chat_lp = resp.chat_logprobs([7], [-0.25], [[(7, -0.25)]], tok)
    assert chat_lp == {"content": [{"token": "é", "logprob": -0.25, "bytes": [195, 169],
                                    "top_logprobs": [{"token": "é", "logprob": -0.25,
                                                      "bytes": [195, 169]}]}]}


def test_sse_framing():
    assert resp.sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
    assert resp.SSE_DONE == "data: [DONE]\n\n"
