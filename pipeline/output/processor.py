"""The output path: verify steps in, per-request RequestOutput deltas out (DESIGN.md).

One step, in passes over the batch (nothing is per token in Python on the common path):

1. look up each request; check the step can serve what it asked (logprobs) -> ProtocolError before
   any state changes; a vectorised stop-token/EOS mask over the step's flat token array marks the
   few windows that might finish, together with `window >= remaining` (length: one int compare in
   the rid lookup loop that runs anyway; gathering the counters into an array would cost the same);
2. for those, grammar matchers are fed and `pipeline.output.finish.find_finish` gives the token-level
   finish; the window is cut there;
3. one batched decode of the (cut) windows of all requests with text; stop strings are searched in
   the new text only and map back to their token only when they match, which may cut the window
   earlier;
4. commit: ids, the logprob boundary, spec statistics, text offsets, and the deltas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from pipeline.grammar import grammar_end
from pipeline.output.detokenizer import REPLACEMENT, DecodedWindow, Detokenizer, StopStrings
from pipeline.output.finish import Finish, FinishKind, StopRules, StopStringHit, find_finish
from pipeline.output.request_output import RequestOutput
from pipeline.output.request_state import RequestState, RequestStatus, TextState
from pipeline.params import SamplingParams
from pipeline.protocol import ProtocolError, StepColumns, decode_columns

FINISHED_MEMORY = 1 << 16  # finished rids remembered to tell late steps from unknown requests
STOP_TABLE_MAX = 1 << 22  # stop ids below this are found with a bool lookup table

_STATUS = {
    FinishKind.STOP_TOKEN: RequestStatus.FINISHED_STOP,
    FinishKind.STOP_STRING: RequestStatus.FINISHED_STOP,
    FinishKind.GRAMMAR: RequestStatus.FINISHED_STOP,
    FinishKind.LENGTH: RequestStatus.FINISHED_LENGTH,
}


class OutputProcessor:
    """Turns verify steps into RequestOutput deltas; see DESIGN.md, *Contract: pipeline.output.processor*.

    `tokenizer=None` turns text off (deltas carry ids and logprobs only; stop strings are refused).
    """

    def __init__(
        self,
        tokenizer: Any = None,
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
        tops: list[tuple[int, int]] = []
        dropped = 0
        want_lp = False
        step = cols.step
        for i, st in enumerate(states):
            if st is None or step <= st.last_step:
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
        if want_lp and cols.logprobs is None:
            raise ProtocolError("a request in the step asked for logprobs; the step has none")
        if tops:
            self._check_top(cols, tops)
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
        texts: dict[int, tuple[str, tuple | None]] = {}
        if self.detokenizer is not None and live:
            self._detokenize(live, offs, toks, fins, grammar_at, texts)

        # Pass 4: commit and emit.
        drafted = cols.drafted.tolist()
        lps = cols.logprobs.tolist() if want_lp else None
        if tops:
            # All (id, logprob) pairs of the step in one C-level pass; a token's entries are a slice.
            pairs = list(zip(cols.top_ids.tolist(), cols.top_logprobs.tolist()))
            top_n = cols.top_n.tolist()
            top_offs = cols.top_offsets.tolist()
        outs: list[RequestOutput] = []
        append = outs.append
        for i, st in live:
            a = offs[i]
            n = offs[i + 1] - a
            fin = fins.get(i) if fins else None
            keep = n if fin is None else fin.pos - len(st.output_ids) + 1
            ids = toks[a : a + keep]
            st.output_ids.extend(ids)
            st.last_step = step
            n_lp = st.params.logprobs
            out_lp = out_top = None
            if n_lp is not None:
                out_lp = lps[a : a + keep]
                st.logprobs_sent += keep
                if n_lp:
                    tn = top_n[i]
                    t0 = top_offs[i]
                    out_top = [pairs[j : j + n_lp] for j in range(t0, t0 + keep * tn, tn)]
            stats = st.stats
            if drafted[i]:
                stats.add(keep if keep < n else n - 1)
            text = ""
            ts = st.text
            if ts is not None:
                text, update = texts[i]
                if update is not None:
                    ts.prefix_offset, ts.read_offset, ts.extra, ts.tail, ts.pending = update
                ts.chars_sent += len(text)
            if fin is None:
                done, reason, matched, flen, fstep = False, None, None, None, None
            else:
                done, reason, matched, flen, fstep = (
                    True, fin.reason, fin.matched, fin.finished_len, step
                )  # fmt: skip
                st.status = _STATUS[fin.kind]
                st.finished_len = flen
                st.matched_stop = matched
                st.finish_step = step
                self._retire(st)
            append(
                RequestOutput(
                    st.rid, ids, text, out_lp, out_top, done, reason, matched, flen, fstep,
                    stats.verify_ct, stats.accepted_tokens, stats.histogram.copy(),
                )
            )  # fmt: skip
        return outs

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _check_top(cols: StepColumns, tops: list[tuple[int, int]]) -> None:
        """Every request asking for top-N logprobs gets at least N per token from this step."""
        have = [0] * len(cols.rids) if cols.top_n is None else cols.top_n.tolist()
        for i, n_lp in tops:
            if have[i] < n_lp:
                raise ProtocolError(
                    f"request {cols.rids[i]!r} asked for top-{n_lp} logprobs; "
                    f"the step carries {have[i]}"
                )

    def _stop_token_hits(self, cols: StepColumns) -> set[int]:
        """Indices of the step's requests whose window holds a token that is a stop/EOS id of some
        running request: one vectorised lookup over the flat token array."""
        if not self._stop_refs or not len(cols.tokens):
            return set()
        table = self._stop_table
        if table is None:
            ids = np.fromiter(self._stop_refs, dtype=np.int64)
            if int(ids.max()) < STOP_TABLE_MAX:
                table = np.zeros(int(ids.max()) + 2, dtype=bool)  # last entry: "any larger id"
                table[ids] = True
            else:  # a huge id: keep a sorted id array instead of a huge table
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

    def _detokenize(
        self,
        live: list[tuple[int, RequestState]],
        offs: list[int],
        toks: list[int],
        fins: dict[int, Finish],
        grammar_at: dict[int, int],
        texts: dict[int, tuple[str, tuple | None]],
    ) -> None:
        """Fill `texts[i] = (text delta, new text offsets or None when finishing)`; may move a
        finish earlier (`fins`) when a stop string completes before it."""
        detok = self.detokenizer
        special = detok.special_ids
        context_free = detok.context_free
        byte_tokens = detok.byte_tokens
        seqs: list[list[int]] = []
        skips: list[bool] = []
        jobs = []
        for i, st in live:
            a = offs[i]
            fin = fins.get(i) if fins else None
            if fin is None:
                window = toks[a : offs[i + 1]]
            else:
                n_text = fin.pos - len(st.output_ids) + 1
                if fin.kind is FinishKind.STOP_TOKEN and fin.matched in special:
                    n_text -= 1  # a special stop token's text is not emitted
                window = toks[a : a + n_text]
            ts = st.text
            ids = st.output_ids
            p = ts.prefix_offset
            s0 = len(seqs)
            seq = ids[p:].tolist() + window if p < len(ids) else window
            seqs.append(seq)
            skip = st.params.skip_special_tokens
            skips.append(skip)
            if not context_free:
                seqs.append(ids[p : ts.read_offset].tolist())
                skips.append(skip)
            s_run = -1  # the decode without a trailing byte-fallback run, when there is one
            if byte_tokens and fin is None and seq and seq[-1] in byte_tokens:
                s_run = len(seqs)
                seqs.append(seq[: len(seq) - detok.trailing_byte_run(seq)])
                skips.append(skip)
            jobs.append((i, st, window, s0, s_run))
        decoded = detok.decode_batch(seqs, skips)

        for i, st, window, s0, s_run in jobs:
            ts = st.text
            full = decoded[s0]
            base = ts.extra if context_free else len(decoded[s0 + 1]) + ts.extra
            # Commit all but trailing U+FFFD (detokenizer.stable_len, inlined on this per-request
            # path), and none of a trailing byte-fallback run's text (a later byte may turn it
            # into U+FFFDs).
            stable = len(full.rstrip(REPLACEMENT)) if full.endswith(REPLACEMENT) else len(full)
            if s_run >= 0:
                stable = min(stable, len(decoded[s_run]))
            new = full[base:stable] if stable > base else ""
            start = len(st.output_ids)
            fin = fins.get(i) if fins else None
            stops = st.stops
            if stops is not None:
                tail = ts.tail
                context_text = tail + new
                hit = None
                if new and stops.may_complete(new):
                    hit = stops.find(context_text, len(tail))
                if hit is not None:  # rare: map it to its token, honour min_new_tokens
                    found = detok.first_stop(
                        ts, st.output_ids, window, DecodedWindow(full, base), stops, hit,
                        st.rules.min_new_tokens, st.params.skip_special_tokens,
                    )  # fmt: skip
                    if found is not None:
                        pos, (m_start, m_end, matched) = found
                        full_window = toks[offs[i] : offs[i + 1]]
                        sh = StopStringHit(pos, matched)
                        fin = fins[i] = find_finish(
                            full_window, start, st.rules, sh, grammar_at.get(i)
                        )
                        if fin.kind is FinishKind.STOP_STRING:
                            sent = len(tail) - len(ts.pending)  # where the unsent text starts
                            cut = m_end if st.params.include_stop_str_in_output else m_start
                            texts[i] = (context_text[sent:cut], None)
                            continue
            if fin is not None:  # settle: the decode of the retained ids, all of it
                texts[i] = (ts.pending + full[base:], None)
                continue
            text = ts.pending + new if ts.pending else new
            pending = tail = ""
            if stops is not None:
                if not st.params.include_stop_str_in_output:
                    hold = min(stops.held_len(context_text), len(text))
                    if hold:
                        pending = text[len(text) - hold :]
                        text = text[: len(text) - hold]
                if stops.max_len > 1:
                    tail = context_text[1 - stops.max_len :]
            offsets = detok.advance(ts, full, base, stable, start + len(window))
            texts[i] = (text, (*offsets, tail, pending))
