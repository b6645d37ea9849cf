"""The `openai` client on the app in-process, for the tool-calling tests of each parser."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai

from pipeline.frontend.app import ServerSettings, create_app
from support.server_fakes import FakeEngine

USER = [{"role": "user", "content": "Weather in Paris?"}]


def both(engine: Any, tok: Any, parser: str, **kw: Any) -> tuple[Any, Any]:
    """The non-streamed completion and the streamed one reassembled by the SDK's helper."""
    async def go():
        app = create_app(engine, tok, ServerSettings(tool_call_parser=parser))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=100) as http:
            c = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http)
            kw.update(model=kw.get("model", "fake-model"), messages=kw.get("messages", USER))
            full = await c.chat.completions.create(**kw)
            async with c.chat.completions.stream(**kw) as s:
                streamed = await s.get_final_completion()
            return full, streamed
    return asyncio.run(go())


def fake(script: str, window: int = 3) -> FakeEngine:
    """The fake engine writing `script`, then EOS, `window` tokens a step."""
    return FakeEngine(script=script, eos_after=len(script.encode()), window=window,
                      max_model_len=4096)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
