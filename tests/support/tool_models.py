"""Tool-calling test tokenizers: the fake engine's byte tokenizer with a Hermes / Qwen2.5-style
chat template that takes `tools=` (rendered by transformers' own Jinja renderer), and scripted
model outputs that hold tool calls."""

from __future__ import annotations

import json
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from pipeline.tiny_tokenizer import ByteTokenizer
from support.server_fakes import ByteTok

# Qwen2.5's tool template, shortened: tools in the system turn, calls as <tool_call> JSON, tool
# results as <tool_response> in a user turn. With a byte tokenizer the markers are plain text.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or \
(message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PLAIN_TEMPLATE = """{% for m in messages %}{{ m.role }}: {{ m.content }}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"""


class TemplateByteTok(ByteTok):
    def __init__(self, template: str = HERMES_TEMPLATE) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **_: Any) -> Any:
        rendered = render_jinja_template([messages], tools=tools, chat_template=self.chat_template,
                                         add_generation_prompt=add_generation_prompt)
        text = rendered[0][0] if isinstance(rendered, tuple) else rendered[0]
        return self.encode(text) if tokenize else text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


def hermes_output(content: str, calls: list[tuple[str, dict]]) -> str:
    """What a Hermes-template model writes: content, then one <tool_call> block per call."""
    return content + "".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
        for n, a in calls)


class TemplateTinyTok(ByteTokenizer):
    """The tiny models' tokenizer with the Hermes template (for the in-process tiny engine)."""

    def __init__(self, template: str = HERMES_TEMPLATE) -> None:
        super().__init__()
        self.chat_template = template

    apply_chat_template = TemplateByteTok.apply_chat_template


# Llama 3.1's JSON tool template, shortened: tools in the first user turn, calls as bare JSON,
# results in an ipython turn.
LLAMA3_TEMPLATE = """\
<|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|>
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, respond with a JSON for a function call with its proper \
arguments. Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": \
{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def llama3_output(calls: list[tuple[str, dict]], tag: bool = False) -> str:
    """What a Llama-3-template model writes for calls: JSON objects joined by "; "."""
    body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return ("<|python_tag|>" if tag else "") + body


# Mistral's v3 (pre-v11) tool template, shortened: tools before the last user turn, calls as
# [TOOL_CALLS] and a JSON array, results in [TOOL_RESULTS]. With a byte tokenizer the control
# tokens are plain text.
MISTRAL_TEMPLATE = """\
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{{- '<s>' }}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and m == user_messages[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]\
{%- endif %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][\
{%- for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif m.role == 'assistant' %}{{ m.content }}</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""


def mistral_output(content: str, calls: list[tuple[str, dict]]) -> str:
    """What a Mistral-template model writes: content, then [TOOL_CALLS] and the calls' array."""
    return content + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
