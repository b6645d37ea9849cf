"""What crosses a Ray actor boundary between the engine and its stages is msgpack bytes, never a
pickled dataclass. Checked without starting Ray: the actor classes are plain classes (Ray wraps
them with `ray.remote`), so `actors.engine.RayStages` drives them here through stand-in handles
that record every argument and result, and the engine's output must equal the in-process one."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import msgpack
import pytest

import actors.engine as ray_engine
import actors.output
from actors.draft import DraftWorker
from actors.output import OutputActor
from actors.verifier import TargetVerifier
from pipeline.config import load_config
from pipeline.engine.core import EngineCore
from pipeline.engine.local import build_local_engine, collect
from pipeline.params import SamplingParams

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

# The methods that carry step messages, and the messages they take and give.
MESSAGE_METHODS = {
    (DraftWorker, "propose"): (["plan"], "bytes"),
    (TargetVerifier, "verify"): (["plan", "proposal"], "tuple[bytes | None, bytes | None]"),
    (OutputActor, "add_request"): (["request"], "None"),
    (OutputActor, "process"): (["payload"], "bytes"),
    (OutputActor, "abort"): ([], "bytes"),
}
SCALARS = (str, int, float, bool, type(None))


class Ref:
    """An object ref stand-in: awaitable, and resolved when passed to another call."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


class Method:
    def __init__(self, actor: str, fn: Any, log: list, num_returns: int = 1) -> None:
        self.actor, self.fn, self.log, self.num_returns = actor, fn, log, num_returns

    def options(self, num_returns: int = 1, **_: Any) -> Method:
        return Method(self.actor, self.fn, self.log, num_returns)

    def remote(self, *args: Any) -> Any:
        args = tuple(a.value if isinstance(a, Ref) else a for a in args)
        result = self.fn(*args)
        self.log.append((f"{self.actor}.{self.fn.__name__}", args, result))
        if self.num_returns == 2:
            return tuple(Ref(r) for r in result)
        return Ref(result)


class Handle:
    """`handle.method.remote(*args)` runs the plain actor object's method and logs the call."""

    def __init__(self, name: str, actor: Any, log: list) -> None:
        self._name, self._actor, self._log = name, actor, log

    def __getattr__(self, method: str) -> Method:
        return Method(self._name, getattr(self._actor, method), self._log)


def test_stage_methods_declare_bytes_for_every_step_message():
    for (cls, name), (params, returns) in MESSAGE_METHODS.items():
        sig = inspect.signature(getattr(cls, name))
        for param in params:
            assert sig.parameters[param].annotation in ("bytes", "bytes | None"), (cls, param)
        assert sig.return_annotation == returns, (cls, name)


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy and seeded-sampling requests (seeded drafts are coupled to the target's sample, so
    they send no draft probabilities)."""
    return [
        ("g0", [5, 6, 7, 8, 5, 6], SamplingParams(max_new_tokens=12)),
        ("g1", [100, 101], SamplingParams(max_new_tokens=9, logprobs=2)),
        ("s0", [30, 31, 32], SamplingParams(max_new_tokens=10, temperature=0.8, seed=7)),
        ("s1", [17], SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.9, seed=3)),
    ]


def test_the_ray_stages_send_only_bytes_and_give_the_in_process_output(monkeypatch):
    config = load_config("configs/tiny.yaml", {"overlap": False})
    monkeypatch.setattr(actors.output, "setup_tracing", lambda *a, **k: None)
    monkeypatch.setattr(ray_engine.ray, "put", Ref)
    log: list = []
    verifier = TargetVerifier(config, 0)
    info = verifier.load(None)
    stage_actors = ray_engine.StageActors(
        draft=Handle("draft", DraftWorker(config), log),
        verifiers=[Handle("verifier", verifier, log)],
        output=Handle("output", OutputActor(config), log), placement_group=None, info=info)
    core = EngineCore(config, ray_engine.RayStages(stage_actors, config), info["vocab_size"])
    # an unseeded sampled request sends its draft probabilities; its tokens are not reproducible
    unseeded = ("u0", [40, 41], SamplingParams(max_new_tokens=8, temperature=0.9))
    over_stages = asyncio.run(collect(core, [*requests(), unseeded]))
    in_process = asyncio.run(collect(build_local_engine(config), requests()))

    assert over_stages.pop("u0").token_ids  # it ran (a stop token may end it early)
    assert {rid: c.token_ids for rid, c in over_stages.items()} == \
        {rid: c.token_ids for rid, c in in_process.items()}
    assert over_stages["g1"].logprobs == pytest.approx(in_process["g1"].logprobs, abs=1e-5)
    tops = [over_stages["g1"].top_logprobs, in_process["g1"].top_logprobs]
    assert [[i for i, _ in t] for t in tops[0]] == [[i for i, _ in t] for t in tops[1]]
    assert [x for t in tops[0] for _, x in t] == pytest.approx(
        [x for t in tops[1] for _, x in t], abs=1e-5)
    # the finish crosses too (the drafting statistics follow the adaptive k, which sees timings)
    ends = [(c["g0"].last.finish_reason, c["g0"].last.finish_kind, c["g0"].last.finished_len)
            for c in (over_stages, in_process)]
    assert ends[0] == ends[1] and ends[0][0] is not None
    calls = {name for name, _, _ in log}
    assert {"draft.propose", "verifier.verify", "output.add_request", "output.process"} <= calls
    for name, args, result in log:
        assert all(isinstance(a, (bytes, *SCALARS)) for a in args), (name, args)
        if name in ("draft.propose", "verifier.verify", "output.process", "output.abort"):
            flat = result if isinstance(result, tuple) else (result,)
            assert all(isinstance(r, bytes) for r in flat), (name, result)
    sampled = [args[1] for name, args, _ in log
               if name == "verifier.verify" and msgpack.unpackb(args[1])["pq"]]
    assert sampled, "no proposal carried draft probabilities"
