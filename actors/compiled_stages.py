"""CompiledStages: the engine's stages over Ray Compiled Graphs (`step_transport: compiled`).

One step is one execution of a graph compiled once per stage build:

    plan bytes -> draft.propose -> every verifier rank's verify -> (outcome, payload, rank reports)

and the step's payload then goes to the output actor as a plain `process` call, as with
`step_transport: calls`. Not inside the graph: a graph's outputs of one execution are read
together, so step s's outcome would arrive only after its output was processed, and the engine
could not plan step s + 1 while the output stage works on step s (`overlap`). Not a second
one-node graph either: measured, it was no faster with overlap (the output call runs beside the
next step), and it would put the output actor's `process` on Ray's graph thread beside its plain
calls (docs/reliability.md, "Compiled step graphs"). Messages are pipeline.protocol's msgpack
bytes, so they travel over Ray's shared-memory channels (one node); stages that exchanged GPU
tensors would mark those edges `with_tensor_transport("nccl")` instead.

Ray's limits, and how they are met:
- only the process that compiled a graph may execute it, and execute is not thread-safe: the
  graph is executed from one thread of its own (a one-worker executor), only for the engine's
  step loop; add_request, abort, dropped_steps, ping and process stay plain actor calls. A
  stage actor in a graph still answers plain calls, on its main thread, while the graph runs its
  methods on Ray's `_ray_system` thread; the draft and verifier actors get only `ping` that way.
- not `enable_asyncio`: its writer retries a timed-out write whole, which can desynchronise a
  channel with readers on two nodes (see compile_step_graph); the blocking execute and read run
  on that thread instead, off the event loop.
- stages on several nodes: not yet; the step after the first batch hangs (docs/reliability.md).
- an execution is refused once `_max_inflight_executions` have not been read; the loop keeps at
  most one step in flight (it reads step s's outcome before it plans step s + 1), so
  MAX_INFLIGHT has one to spare.
- Ray's submit/get timeouts (10 s by default) are raised past `step_timeout_s`, so a slow but
  alive step is ended by the engine's stall bound, never earlier by Ray.
- a stage actor's death tears the graph down (Ray's monitor thread), but the pending read may
  end only later. So each step also waits on the actors' execution loops
  (`watch_actor_loops`); a loop that ends fails the step at once with EngineDeadError, the
  engine fails its requests and rebuilds its stages, and the rebuild compiles a new graph
  (before the old stage actors are killed, `close` tears the old graph down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from actors.engine import RayStages, StageActors
from pipeline.config import EngineConfig
from pipeline.errors import EngineDeadError
from pipeline.protocol import StepOutcome, StepPlan, decode_outcome, decode_rank_report, encode_plan
from pipeline.verify.ranks import check_rank_reports

log = logging.getLogger(__name__)

# Executions of one graph submitted and not yet read (each is a shared-memory buffer per edge).
MAX_INFLIGHT = 2
# Beyond the step timeout before Ray's own submit/get timeouts would fire.
RAY_TIMEOUT_MARGIN_S = 30
# How long a teardown may take before the stage actors are killed anyway (a wedged actor).
TEARDOWN_WAIT_S = 5.0


def ray_timeout_s(config: EngineConfig) -> int:
    """Ray's submit/get timeout for the graphs: past the longest stall bound."""
    return math.ceil(config.step_timeout_s) + RAY_TIMEOUT_MARGIN_S


def compile_step_graph(actors: StageActors, timeout_s: int, drafting: bool = True) -> Any:
    """plan -> propose -> verify on every rank; outputs rank 0's outcome and payload, then each
    other rank's (report, None)."""
    from ray.dag import InputNode, MultiOutputNode

    with InputNode() as plan:
        # `draft: none`: no draft node; the ranks verify without a proposal
        proposal = actors.draft.propose.bind(plan) if drafting else None
        outputs = []
        for verifier in actors.verifiers:
            # every output of a graph node must be read: a rank's None payload is too
            outputs.extend(verifier.verify.options(num_returns=2).bind(plan, proposal))
        dag = MultiOutputNode(outputs)
    # Not enable_asyncio: Ray 2.60's asyncio writer writes each input with a 1 s timeout and
    # retries the whole write when a channel times out (ray/experimental/channel/common.py); with
    # readers on two nodes the retry writes the plan again to the channel that had taken it, and
    # that reader falls out of step. The blocking writer waits up to `_submit_timeout` and never
    # retries. (This was not the cause of the multi-node hang in docs/reliability.md, which
    # remains.)
    return dag.experimental_compile(_submit_timeout=timeout_s,
                                    _max_inflight_executions=MAX_INFLIGHT)


def set_ray_timeouts(timeout_s: int) -> None:
    """Ray's get timeout is process-wide (DAGContext): the engine actor holds one engine."""
    from ray.dag import DAGContext

    ctx = DAGContext.get_current()
    ctx.submit_timeout = max(ctx.submit_timeout, timeout_s)
    ctx.get_timeout = max(ctx.get_timeout, timeout_s)


class CompiledStages(RayStages):
    """RayStages whose run_step executes the compiled step graph, from one thread of its own:
    Ray's execute is not thread-safe, and its blocking reads must not hold the event loop."""

    sends_ahead = False  # one execution at a time: a step sent ahead would wait in the thread

    def __init__(self, actors: StageActors, config: EngineConfig) -> None:
        super().__init__(actors, config)
        timeout_s = ray_timeout_s(config)
        set_ray_timeouts(timeout_s)
        self._graph: Any = compile_step_graph(actors, timeout_s, self.drafting)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-graph")
        self._loop_ended = watch_actor_loops(self._graph)

    async def run_step(self, plan: StepPlan) -> StepOutcome:
        values = await self._execute(encode_plan(plan))
        outcome = decode_outcome(values[0])
        # values: rank 0's outcome and payload, then each other rank's report and None
        check_rank_reports(outcome, [decode_rank_report(r) for r in values[2::2]])
        outcome.payload = values[1]  # the VerifyStep bytes, for the plain `process` call
        return outcome

    async def _execute(self, plan: bytes) -> list[Any]:
        """One execution's outputs; EngineDeadError when a stage raised or died."""
        if self._loop_ended.done():  # a stage died between steps
            raise EngineDeadError(graph_death(self._loop_ended))
        results = asyncio.get_running_loop().run_in_executor(self._thread, _run, self._graph,
                                                             plan)
        try:
            await asyncio.wait({results, self._loop_ended}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():  # a stage died: Ray may not end this execution for a while
                raise EngineDeadError(graph_death(self._loop_ended))
            return results.result()
        except EngineDeadError:
            raise
        except Exception as e:  # a stage raised, or the graph's reader saw it die
            raise EngineDeadError(f"compiled step graph failed: {type(e).__name__}: "
                                  f"{_first_line(e)}") from e

    async def close(self) -> None:
        """Tear the graph down, before the stage actors are killed: the actors stay usable, and
        Ray's monitor does not report each kill as a graph failure. In a thread, bounded: a
        wedged actor must not hold the engine's loop, and killing it next ends the teardown."""
        graph, self._graph = self._graph, None
        if graph is None:
            return
        self._loop_ended.cancel()
        task = asyncio.ensure_future(asyncio.to_thread(_teardown, graph))
        done, _ = await asyncio.wait({task}, timeout=TEARDOWN_WAIT_S)
        if not done:
            log.warning("compiled step graph teardown still running after %.0fs; killing the "
                        "stage actors", TEARDOWN_WAIT_S)
        self._thread.shutdown(wait=False)  # a read the teardown closed ends on its own


def watch_actor_loops(graph: Any) -> asyncio.Future:
    """Done when any actor's execution loop of `graph` ends: the actor died (or the graph was torn
    down). The step waits on it beside its read: after an actor's death Ray tears the graph down
    from its monitor thread, and a pending read may end only much later (or, with asyncio
    graphs, never: the monitor cancels their reader task from another thread)."""
    loops = [asyncio.wrap_future(ref.future()) for ref in graph.worker_task_refs.values()]
    for loop in loops:  # read here, so a teardown's errors are not logged as never retrieved
        loop.add_done_callback(lambda f: f.cancelled() or f.exception())
    return asyncio.ensure_future(asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED))


def graph_death(ended: asyncio.Future) -> str:
    """Why the graph's loops ended (the first loop's error)."""
    done, _ = ended.result()
    errors = [f.exception() for f in done if f.exception() is not None]
    why = f"{type(errors[0]).__name__}: {_first_line(errors[0])}" if errors else \
        "its execution loop ended"
    return f"compiled step graph failed: a stage actor is gone: {why}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _run(graph: Any, plan: bytes) -> list[Any]:
    """One execution: submit the plan, read every output (they arrive together)."""
    return [ref.get() for ref in graph.execute(plan)]


def _teardown(graph: Any) -> None:
    with contextlib.suppress(Exception):  # torn down already (an actor died), or an actor gone
        graph.teardown()
