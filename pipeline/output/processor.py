"""The output path: verify steps in, per-request RequestOutput deltas out (docs/contracts.md).
A step is four passes over the batch, none per token in Python on the common path: select the
requests and the few windows that might finish, token-level finishes of those, one batched
decode with stop strings, then commit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.grammar import grammar_end, grammar_error, new_matcher
from pipeline.output.detokenizer import Detokenizer
from pipeline.output.finish import Finish, FinishKind, StopRules, find_finish
from pipeline.output.request_output import RequestOutput
from pipeline.output.request_state import RequestState, RequestStatus
from pipeline.output.text import (
    StopStrings,
    TextRequest,
    TextState,
    TextUpdate,
    decode_windows,
    find_stop,
    release,
    settled_text,
    stop_text,
)
from pipeline.params import SamplingParams
from pipeline.protocol import ProtocolError, StepColumns, decode_columns

FINISHED_MEMORY = 1 << 16  # finished rids remembered to tell late steps from unknown requests
STOP_TABLE_MAX = 1 << 22

_BY_TOKEN = (FinishKind.EOS, FinishKind.STOP_TOKEN)
_STATUS = {
    FinishKind.GRAMMAR_ERROR: RequestStatus.FINISHED_ERROR,
    FinishKind.EOS: RequestStatus.FINISHED_STOP,
    FinishKind.STOP_TOKEN: RequestStatus.FINISHED_STOP,
    FinishKind.STOP_STRING: RequestStatus.FINISHED_STOP,
    FinishKind.GRAMMAR: RequestStatus.FINISHED_STOP,
    FinishKind.LENGTH: RequestStatus.FINISHED_LENGTH,
}


class OutputProcessor:
    """See docs/contracts.md, *Output path*."""

    def __init__(
        self,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
        finished_memory: int = FINISHED_MEMORY,
    ) -> None:
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.dropped_steps = 0
        self.dropped_unknown = 0
        self._requests: dict[str, RequestState] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory
        self._stop_refs: dict[int, int] = {}  # stop/EOS id -> running requests that stop on it
        self._stop_table: np.ndarray | None = None
        # The last step's states per row: the same objects later mean the same requests.
        self.step_rows: list[RequestState | None] = []

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def get_state(self, rid: str) -> RequestState | None:
        return self._requests.get(rid)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"rid: must be a non-empty string, got {rid!r}")
        if rid in self._requests:
            raise ValueError(f"rid: request {rid!r} is already running")
        if not isinstance(params, SamplingParams):
            raise TypeError("params: must be a SamplingParams")
        if params.stop and self.detokenizer is None:
            raise ValueError("stop: stop strings need an OutputProcessor with a tokenizer")
        st = RequestState(
            rid=rid,
            params=params,
            rules=StopRules.from_params(params, self.eos_token_ids),
            num_prompt_tokens=len(prompt_ids),
            text=TextState() if self.detokenizer is not None else None,
            stops=StopStrings.build(params.stop),
            grammar=(new_matcher(params.grammar, self.detokenizer and self.detokenizer.tokenizer)
                     if params.grammar is not None else None),
        )
        self._finished.pop(rid, None)
        self._requests[rid] = st
        for t in st.rules.stop_ids:
            n = self._stop_refs.get(t, 0)
            self._stop_refs[t] = n + 1
            if n == 0:
                self._stop_table = None

    def abort(self, rid: str) -> RequestOutput | None:
        st = self._requests.get(rid)
        if st is None:
            return None
        text = ""
        if st.text is not None:
            req = (st.text, st.output_ids, [], st.params.skip_special_tokens)
            text = settled_text(st.text, decode_windows(self.detokenizer, [req])[0])
        st.status = RequestStatus.FINISHED_ABORTED
        st.finish_kind = "abort"
        st.finished_len = len(st.output_ids)
        self._retire(st)
        want_lp = st.params.logprobs
        no_lp = None if want_lp is None else []
        return _delta(st, [], text, no_lp, None if not want_lp else [])

    def _retire(self, st: RequestState) -> None:
        del self._requests[st.rid]
        self._finished[st.rid] = None
        if len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        for t in st.rules.stop_ids:
            n = self._stop_refs[t] - 1
            if n:
                self._stop_refs[t] = n
            else:
                del self._stop_refs[t]
                self._stop_table = None

    def process(self, payload: bytes) -> list[RequestOutput]:
        return self.process_columns(decode_columns(payload))

    def process_columns(self, cols: StepColumns) -> list[RequestOutput]:
        step = self._select(cols)
        if step.slow:
            self._token_finishes(step)
        if self.detokenizer is not None and step.live:
            self._texts(step)
        outs = self._commit(step)
        self.step_rows = step.rows
        return outs

    def _select(self, cols: StepColumns) -> _Step:
        """Pass 1: which requests are in the step, and which might finish. Changes only the
        dropped counts, so a ProtocolError here leaves every request as it was."""
        step = _Step(cols, cols.offsets.tolist(), cols.tokens.tolist())
        offs, live, slow, tops = step.offs, step.live, step.slow, step.tops
        hits = self._stop_token_hits(cols)
        get = self._requests.get
        states = step.rows = [get(r) for r in cols.rids]
        dropped = 0
        step_id = cols.step
        want_lp = False
        for i, st in enumerate(states):
            if st is None or step_id <= st.last_step:
                dropped += 1
                continue
            live.append((i, st))
            n_lp = st.params.logprobs
            if n_lp is not None:
                want_lp = True
                if n_lp:
                    tops.append((i, n_lp))
            if (
                st.grammar is not None
                or i in hits
                or offs[i + 1] - offs[i] >= st.rules.max_new_tokens - len(st.output_ids)
            ):
                slow.append((i, st))
        step.want_lp = want_lp
        if want_lp and cols.logprobs is None:
            raise ProtocolError("a request in the step asked for logprobs; the step has none")
        if tops:
            self._check_top(cols, tops)
        if dropped:
            self.dropped_steps += dropped
            self.dropped_unknown += sum(
                1 for r, st in zip(cols.rids, states) if st is None and r not in self._finished
            )
        return step

    @staticmethod
    def _token_finishes(step: _Step) -> None:
        offs, toks = step.offs, step.toks
        for i, st in step.slow:
            window = toks[offs[i] : offs[i + 1]]
            gi = grammar_end(st.grammar, window) if st.grammar is not None else None
            error = None
            if gi is not None:
                error = grammar_error(st.grammar)
                step.grammar_at[i] = gi
                if error is not None:
                    step.grammar_errors[i] = error
            fin = find_finish(window, len(st.output_ids), st.rules, None, gi, error)
            if fin is not None:
                step.fins[i] = fin

    def _texts(self, step: _Step) -> None:
        """Pass 3: text deltas; a stop string completing before a token-level finish moves it."""
        detok = self.detokenizer
        special = detok.special_ids
        offs, toks, fins = step.offs, step.toks, step.fins
        reqs: list[TextRequest] = []
        for i, st in step.live:
            fin = fins.get(i) if fins else None
            end = offs[i + 1]
            if fin is not None:
                end = offs[i] + fin.pos - len(st.output_ids) + 1
                if fin.kind in _BY_TOKEN and fin.matched in special:
                    end -= 1
            reqs.append((st.text, st.output_ids, toks[offs[i] : end], st.params.skip_special_tokens))
        texts = step.texts
        for (i, st), wt in zip(step.live, decode_windows(detok, reqs)):
            ts, params = st.text, st.params
            fin = fins.get(i) if fins else None
            if st.stops is not None:
                match = find_stop(detok, ts, st.output_ids, wt, st.stops,
                                  st.rules.min_new_tokens, params.skip_special_tokens)
                if match is not None:
                    window = toks[offs[i] : offs[i + 1]]
                    fin = fins[i] = find_finish(window, len(st.output_ids), st.rules, match.hit,
                                                step.grammar_at.get(i),
                                                step.grammar_errors.get(i))
                    if fin.kind is FinishKind.STOP_STRING:
                        stop = params.include_stop_str_in_output
                        texts[i] = (stop_text(ts, wt, match, stop), None)
                        continue
            if fin is not None:
                texts[i] = (settled_text(ts, wt), None)
            else:
                end = len(st.output_ids) + len(wt.window)
                texts[i] = release(detok, ts, wt, st.stops, params.include_stop_str_in_output, end)

    def _commit(self, step: _Step) -> list[RequestOutput]:
        cols, offs, toks, fins, texts = step.cols, step.offs, step.toks, step.fins, step.texts
        drafted = cols.drafted.tolist()
        lps = cols.logprobs.tolist() if step.want_lp else None
        if step.tops:
            # All (id, logprob) pairs in one C-level pass; a token's entries are a slice.
            pairs = list(zip(cols.top_ids.tolist(), cols.top_logprobs.tolist()))
            top_n = cols.top_n.tolist()
            top_offs = cols.top_offsets.tolist()
        outs: list[RequestOutput] = []
        append = outs.append
        for i, st in step.live:
            a = offs[i]
            n = offs[i + 1] - a
            fin = fins.get(i) if fins else None
            keep = n if fin is None else fin.pos - len(st.output_ids) + 1
            ids = toks[a : a + keep]
            # docs/contracts.md, *Speculative statistics*: a first step counts only if it drafted.
            verified = len(st.output_ids) > 0 or drafted[i] > 0
            st.output_ids.extend(ids)
            st.last_step = cols.step
            n_lp = st.params.logprobs
            out_lp = out_top = None
            if n_lp is not None:
                out_lp = lps[a : a + keep]
                st.logprobs_sent += keep
                if n_lp:
                    tn = top_n[i]
                    t0 = top_offs[i]
                    out_top = [pairs[j : j + n_lp] for j in range(t0, t0 + keep * tn, tn)]
            if verified:
                st.stats.add(keep, drafted[i])
            text = ""
            if st.text is not None:
                text, update = texts[i]
                if update is not None:
                    st.text.apply(update)
            if fin is not None:
                self._finish(st, fin, cols.step)
            append(_delta(st, ids, text, out_lp, out_top))
        return outs

    def _finish(self, st: RequestState, fin: Finish, step: int) -> None:
        st.status = _STATUS[fin.kind]
        st.finish_kind = fin.kind_name
        st.finished_len = fin.finished_len
        st.matched_stop = fin.matched
        st.finish_step = step
        st.error = fin.error
        self._retire(st)

    @staticmethod
    def _check_top(cols: StepColumns, tops: list[tuple[int, int]]) -> None:
        have = [0] * len(cols.rids) if cols.top_n is None else cols.top_n.tolist()
        for i, n_lp in tops:
            if have[i] < n_lp:
                raise ProtocolError(
                    f"request {cols.rids[i]!r} asked for top-{n_lp} logprobs; "
                    f"the step carries {have[i]}"
                )

    def _stop_token_hits(self, cols: StepColumns) -> set[int]:
        """Rows whose window holds a stop/EOS id of any running request."""
        if not self._stop_refs or not len(cols.tokens):
            return set()
        table = self._stop_table
        if table is None:
            ids = np.fromiter(self._stop_refs, dtype=np.int64)
            if int(ids.max()) < STOP_TABLE_MAX:
                table = np.zeros(int(ids.max()) + 2, dtype=bool)  # last entry: "any larger id"
                table[ids] = True
            else:
                table = np.sort(ids)
            self._stop_table = table
        if table.dtype == bool:
            mask = table[np.minimum(cols.tokens, len(table) - 1)]
        else:
            mask = np.isin(cols.tokens, table, assume_unique=False)
        where = np.flatnonzero(mask)
        if not len(where):
            return set()
        return set((np.searchsorted(cols.offsets, where, side="right") - 1).tolist())


def _delta(
    st: RequestState,
    ids: list[int],
    text: str,
    logprobs: list[float] | None,
    top_logprobs: list[list[tuple[int, float]]] | None,
) -> RequestOutput:
    """The one place a RequestOutput is built."""
    stats = st.stats
    status = st.status
    finished = status is not RequestStatus.RUNNING
    # Positional, in field order: keywords cost a dataclass constructor ~2 us more a call, about
    # half the ids path's per-request cost.
    return RequestOutput(
        st.rid,
        ids,
        text,
        logprobs,
        top_logprobs,
        finished,
        status.value if finished else None,  # finish_reason
        st.finish_kind,
        st.matched_stop,
        st.finished_len,
        st.finish_step,
        stats.verify_ct,
        stats.accepted_tokens,
        stats.histogram.copy(),
        stats.draft_tokens,
        st.error,
    )


@dataclass(slots=True)
class _Step:
    """One step's columns as Python lists, and what each pass found (by row)."""

    cols: StepColumns
    offs: list[int]
    toks: list[int]
    rows: list[RequestState | None] = field(default_factory=list)
    live: list[tuple[int, RequestState]] = field(default_factory=list)  # known, not stale
    slow: list[tuple[int, RequestState]] = field(default_factory=list)  # might finish
    tops: list[tuple[int, int]] = field(default_factory=list)
    want_lp: bool = False
    fins: dict[int, Finish] = field(default_factory=dict)
    grammar_at: dict[int, int] = field(default_factory=dict)  # window index the grammar ended
    grammar_errors: dict[int, str] = field(default_factory=dict)
    texts: dict[int, tuple[str, TextUpdate | None]] = field(default_factory=dict)
