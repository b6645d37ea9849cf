"""The output path: verify steps in, per-request RequestOutput deltas out (DESIGN.md).

One step, in passes over the batch (nothing is per token in Python on the common path):

1. look up each request; check the step can serve what it asked (logprobs) -> ProtocolError before
   any state changes; a vectorised stop-token/EOS mask over the step's flat token array marks the
   few windows that might finish, together with `window >= remaining` (length);
2. for those, grammar matchers are fed and `pipeline.finish.find_finish` gives the token-level
   finish; the window is cut there;
3. one batched decode of the (cut) windows of all requests with text; stop strings are searched in
   the new text only and map back to their token only when they match, which may cut the window
   earlier;
4. commit: ids, the logprob boundary, spec statistics, text offsets, and the deltas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from pipeline.detokenizer import Detokenizer, StopStrings
from pipeline.finish import Finish, FinishKind, StopRules, StopStringHit, find_finish
from pipeline.grammar import grammar_end
from pipeline.params import SamplingParams
from pipeline.protocol import ProtocolError, StepColumns, decode_columns
from pipeline.request_output import RequestOutput
from pipeline.request_state import RequestState, RequestStatus, TextState

FINISHED_MEMORY = 1 << 16  # finished rids remembered to tell late steps from unknown requests

_STATUS = {
    FinishKind.STOP_TOKEN: RequestStatus.FINISHED_STOP,
    FinishKind.STOP_STRING: RequestStatus.FINISHED_STOP,
    FinishKind.GRAMMAR: RequestStatus.FINISHED_STOP,
    FinishKind.LENGTH: RequestStatus.FINISHED_LENGTH,
}


class OutputProcessor:
    """Turns verify steps into RequestOutput deltas; see DESIGN.md, *Contract: pipeline.output*.

    `tokenizer=None` turns text off (deltas carry ids and logprobs only; stop strings are refused).
    """

    def __init__(
        self,
        tokenizer=None,
        eos_token_ids: Iterable[int] = (),
        finished_memory: int = FINISHED_MEMORY,
    ) -> None:
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.dropped_steps = 0  # step entries of finished/aborted/unknown requests, dropped whole
        self.dropped_unknown = 0  # of those, rids never added (or forgotten)
        self._requests: dict[str, RequestState] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory
        self._stop_refs: dict[int, int] = {}  # stop/EOS id -> running requests that stop on it
        self._stop_table: np.ndarray | None = None  # bool [max id + 2]; rebuilt when refs change

    # -- requests -------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests still running."""
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
            grammar=params.grammar() if params.grammar is not None else None,
        )
        self._finished.pop(rid, None)
        self._requests[rid] = st
        for t in st.rules.stop_ids:
            n = self._stop_refs.get(t, 0)
            self._stop_refs[t] = n + 1
            if n == 0:
                self._stop_table = None

    def abort(self, rid: str) -> RequestOutput | None:
        """End a running request ("abort"); its held-back text is settled. None if not running."""
        st = self._requests.get(rid)
        if st is None:
            return None
        text = ""
        if st.text is not None:
            detok = self.detokenizer
            skip = st.params.skip_special_tokens
            seqs = detok.sequences(st.text, st.output_ids, [])
            dw = detok.window(st.text, detok.decode_batch(seqs, [skip] * len(seqs)))
            text = st.text.pending + dw.full[dw.base :]
        st.status = RequestStatus.FINISHED_ABORTED
        st.finished_len = len(st.output_ids)
        self._retire(st)
        want_lp = st.params.logprobs
        return RequestOutput(
            st.rid,
            [],
            text,
            None if want_lp is None else [],
            None if want_lp is None or want_lp == 0 else [],
            True,
            "abort",
            None,
            st.finished_len,
            None,
            st.stats.verify_ct,
            st.stats.accepted_tokens,
            list(st.stats.histogram),
        )

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

    # -- steps ----------------------------------------------------------------------------------

    def process(self, payload: bytes) -> list[RequestOutput]:
        """Apply one VerifyStep message. Raises ProtocolError, changing nothing, when malformed."""
        return self.process_columns(decode_columns(payload))

    def process_columns(self, cols: StepColumns) -> list[RequestOutput]:
        """Apply one validated step (see `process`)."""
        rids = cols.rids
        get = self._requests.get
        states = [get(r) for r in rids]
        offs = cols.offsets.tolist()
        toks = cols.tokens.tolist()
        hits = self._stop_token_hits(cols)

        # Pass 1: which requests are in the step, and which might finish. No state changes, so a
        # ProtocolError here leaves everything as it was.
        live: list[tuple[int, RequestState]] = []
        slow: list[tuple[int, RequestState]] = []
        dropped = 0
        want_lp = want_top = False
        for i, st in enumerate(states):
            if st is None:
                dropped += 1
                continue
            live.append((i, st))
            n_lp = st.params.logprobs
            if n_lp is not None:
                want_lp = True
                if n_lp:
                    want_top = True
                    self._check_top(cols, i, n_lp)
            if st.grammar is not None or i in hits or offs[i + 1] - offs[i] >= st.remaining:
                slow.append((i, st))
        if want_lp and cols.logprobs is None:
            raise ProtocolError("a request in the step asked for logprobs; the step has none")
        if dropped:
            self.dropped_steps += dropped
            self.dropped_unknown += sum(
                1 for r, st in zip(rids, states) if st is None and r not in self._finished
            )

        # Pass 2: token-level finish (stop token / EOS, grammar, length) of the few candidates.
        fins: dict[int, Finish] = {}
        grammar_at: dict[int, int] = {}
        for i, st in slow:
            window = toks[offs[i] : offs[i + 1]]
            gi = grammar_end(st.grammar, window) if st.grammar is not None else None
            if gi is not None:
                grammar_at[i] = gi
            fin = find_finish(window, len(st.output_ids), st.rules, None, gi)
            if fin is not None:
                fins[i] = fin

        # Pass 3: text (one batched decode), stop strings, hold-back.
        texts: dict[int, tuple[str, TextState]] = {}
        if self.detokenizer is not None and live:
            self._detokenize(live, offs, toks, fins, grammar_at, texts)

        # Pass 4: commit and emit.
        drafted = cols.drafted.tolist()
        lps = cols.logprobs.tolist() if want_lp else None
        if want_top:
            top_ids = cols.top_ids.tolist()
            top_lps = cols.top_logprobs.tolist()
            top_n = cols.top_n.tolist()
            top_offs = cols.top_offsets.tolist()
        step = cols.step
        outs: list[RequestOutput] = []
        for i, st in live:
            a = offs[i]
            n = offs[i + 1] - a
            fin = fins.get(i)
            keep = n if fin is None else fin.pos - len(st.output_ids) + 1
            ids = toks[a : a + keep]
            st.output_ids.extend(ids)
            n_lp = st.params.logprobs
            if n_lp is None:
                out_lp = out_top = None
            else:
                out_lp = lps[a : a + keep]
                st.logprobs_sent += keep
                if n_lp:
                    tn = top_n[i]
                    t0 = top_offs[i]
                    out_top = [
                        list(zip(top_ids[j : j + n_lp], top_lps[j : j + n_lp]))
                        for j in range(t0, t0 + keep * tn, tn)
                    ]
                else:
                    out_top = None
            stats = st.stats
            if drafted[i]:
                stats.add(min(keep, n - 1))
            text = ""
            if st.text is not None:
                text, st.text = texts[i]
                st.text.chars_sent += len(text)
            if fin is None:
                outs.append(
                    RequestOutput(
                        st.rid,
                        ids,
                        text,
                        out_lp,
                        out_top,
                        False,
                        None,
                        None,
                        None,
                        None,
                        stats.verify_ct,
                        stats.accepted_tokens,
                        list(stats.histogram),
                    )
                )
                continue
            st.status = _STATUS[fin.kind]
            st.finished_len = fin.finished_len
            st.matched_stop = fin.matched
            st.finish_step = step
            self._retire(st)
            outs.append(
                RequestOutput(
                    st.rid,
                    ids,
                    text,
                    out_lp,
                    out_top,
                    True,
                    fin.reason,
                    fin.matched,
                    fin.finished_len,
                    step,
                    stats.verify_ct,
                    stats.accepted_tokens,
                    list(stats.histogram),
                )
            )
        return outs

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _check_top(cols: StepColumns, i: int, n_lp: int) -> None:
        if cols.top_n is None or int(cols.top_n[i]) < n_lp:
            have = 0 if cols.top_n is None else int(cols.top_n[i])
            raise ProtocolError(
                f"request {cols.rids[i]!r} asked for top-{n_lp} logprobs; the step carries {have}"
            )

    def _stop_token_hits(self, cols: StepColumns) -> set[int]:
        """Indices of the step's requests whose window holds a token that is a stop/EOS id of some
        running request: one table lookup over the flat token array."""
        if not self._stop_refs or not len(cols.tokens):
            return set()
        table = self._stop_table
        if table is None:
            ids = np.fromiter(self._stop_refs, dtype=np.int64)
            table = np.zeros(int(ids.max()) + 2, dtype=bool)  # last entry: "any larger id"
            table[ids] = True
            self._stop_table = table
        mask = table[np.minimum(cols.tokens, len(table) - 1)]
        where = np.flatnonzero(mask)
        if not len(where):
            return set()
        return set((np.searchsorted(cols.offsets, where, side="right") - 1).tolist())

    def _detokenize(
        self,
        live: list[tuple[int, RequestState]],
        offs: list[int],
        toks: list[int],
        fins: dict[int, Finish],
        grammar_at: dict[int, int],
        texts: dict[int, tuple[str, TextState]],
    ) -> None:
        detok = self.detokenizer
        special = detok.special_ids
        seqs: list[list[int]] = []
        skips: list[bool] = []
        jobs = []
        for i, st in live:
            a = offs[i]
            fin = fins.get(i)
            n_text = offs[i + 1] - a if fin is None else fin.pos - len(st.output_ids) + 1
            if fin is not None and fin.kind is FinishKind.STOP_TOKEN and fin.matched in special:
                n_text -= 1  # a special stop token's text is not emitted
            window = toks[a : a + n_text]
            skip = st.params.skip_special_tokens
            part = detok.sequences(st.text, st.output_ids, window)
            jobs.append((i, st, window, len(seqs), len(part)))
            seqs.extend(part)
            skips.extend([skip] * len(part))
        decoded = detok.decode_batch(seqs, skips)

        for i, st, window, s0, ns in jobs:
            ts = st.text
            dw = detok.window(ts, decoded[s0 : s0 + ns])
            new = dw.committed
            start = len(st.output_ids)
            fin = fins.get(i)
            stops = st.stops
            hit = None
            if stops is not None and new:
                context = ts.tail + new
                hit = stops.find(context, len(ts.tail))
                while hit is not None:
                    k = detok.locate(
                        ts,
                        st.output_ids,
                        window,
                        dw,
                        hit[1] - len(ts.tail),
                        st.params.skip_special_tokens,
                    )
                    pos = start + k - 1
                    if pos >= st.rules.min_new_tokens:
                        break
                    hit = stops.find(context, hit[1])
            if hit is not None:
                full_window = toks[offs[i] : offs[i + 1]]
                fin = find_finish(
                    full_window, start, st.rules, StopStringHit(pos, hit[2]), grammar_at.get(i)
                )
                fins[i] = fin
            if fin is not None and fin.kind is FinishKind.STOP_STRING:
                sent = len(ts.tail) - len(ts.pending)
                cut = hit[1] if st.params.include_stop_str_in_output else hit[0]
                texts[i] = (context[sent:cut], ts)
            elif fin is not None:
                texts[i] = (ts.pending + dw.full[dw.base :], ts)
            else:
                nts = detok.advance(ts, dw, start + len(window))
                text = ts.pending + new
                if stops is not None:
                    context = ts.tail + new
                    hold = 0
                    if not st.params.include_stop_str_in_output:
                        hold = min(stops.held_len(context), len(text))
                    nts.pending = text[len(text) - hold :] if hold else ""
                    text = text[: len(text) - hold]
                    nts.tail = context[-(stops.max_len - 1) :] if stops.max_len > 1 else ""
                texts[i] = (text, nts)
