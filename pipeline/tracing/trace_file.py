"""Spans as OTLP JSON lines, as the Collector's `file` exporter writes them (from the official
protobuf encoder, ids as hex), and a reader that also takes base64 ids and snake_case keys."""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


# ---------------------------------------------------------------------------------------- writing


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    doc = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return doc


def _hex_ids(obj: dict[str, Any]) -> None:
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()


class JsonLinesSpanExporter(SpanExporter):
    """One line per export batch; `{pid}` in the path is the process id. A line is one `write`
    on an O_APPEND descriptor, so processes sharing a file never interleave inside a line."""

    def __init__(self, path: str) -> None:
        self.path = path.replace("{pid}", str(os.getpid()))
        self._fd: int | None = None
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = json.dumps(spans_to_otlp_json(spans), separators=(",", ":")) + "\n"
        data = line.encode()
        with self._lock:
            try:
                if self._fd is None:
                    parent = os.path.dirname(os.path.abspath(self.path))
                    os.makedirs(parent, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(self._fd, data)
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# ---------------------------------------------------------------------------------------- reading


@dataclass
class EventRecord:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class LinkRecord:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpanRecord:
    """Ids are lowercase hex, "" when absent."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[EventRecord] = field(default_factory=list)
    links: list[LinkRecord] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)


def read_spans(paths: Iterable[str]) -> list[SpanRecord]:
    out: list[SpanRecord] = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line: {e}") from None
                out.extend(spans_from_otlp_json(doc))
    return out


def spans_from_otlp_json(doc: dict[str, Any]) -> Iterator[SpanRecord]:
    for rs in _get(doc, "resourceSpans", "resource_spans") or ():
        resource = _attrs(_get(rs.get("resource") or {}, "attributes", "attributes"))
        # Very old exporters called scopeSpans "instrumentationLibrarySpans".
        scopes = (
            _get(rs, "scopeSpans", "scope_spans") or rs.get("instrumentationLibrarySpans") or ()
        )
        for ss in scopes:
            for sp in ss.get("spans") or ():
                yield SpanRecord(
                    trace_id=_id(_get(sp, "traceId", "trace_id")),
                    span_id=_id(_get(sp, "spanId", "span_id")),
                    parent_span_id=_id(_get(sp, "parentSpanId", "parent_span_id")),
                    name=sp.get("name", ""),
                    start_ns=int(_get(sp, "startTimeUnixNano", "start_time_unix_nano") or 0),
                    end_ns=int(_get(sp, "endTimeUnixNano", "end_time_unix_nano") or 0),
                    attributes=_attrs(sp.get("attributes")),
                    events=[
                        EventRecord(
                            name=ev.get("name", ""),
                            time_ns=int(_get(ev, "timeUnixNano", "time_unix_nano") or 0),
                            attributes=_attrs(ev.get("attributes")),
                        )
                        for ev in sp.get("events") or ()
                    ],
                    links=[
                        LinkRecord(
                            trace_id=_id(_get(ln, "traceId", "trace_id")),
                            span_id=_id(_get(ln, "spanId", "span_id")),
                            attributes=_attrs(ln.get("attributes")),
                        )
                        for ln in sp.get("links") or ()
                    ],
                    resource=resource,
                )


def _get(d: dict[str, Any], camel: str, snake: str) -> Any:
    v = d.get(camel)
    return d.get(snake) if v is None else v


def _id(raw: Any) -> str:
    if not raw:
        return ""
    s = str(raw)
    if len(s) in (16, 32):
        try:
            int(s, 16)
            return s.lower()
        except ValueError:
            pass
    try:
        return base64.b64decode(s, validate=True).hex()
    except (binascii.Error, ValueError):
        raise ValueError(f"id {s!r} is neither hex nor base64") from None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value") or {}) for kv in kvs or ()}


def _value(v: dict[str, Any]) -> Any:
    if "stringValue" in v or "string_value" in v:
        return _get(v, "stringValue", "string_value")
    if "boolValue" in v or "bool_value" in v:
        return bool(_get(v, "boolValue", "bool_value"))
    if "intValue" in v or "int_value" in v:
        return int(_get(v, "intValue", "int_value"))
    if "doubleValue" in v or "double_value" in v:
        return float(_get(v, "doubleValue", "double_value"))
    if "arrayValue" in v or "array_value" in v:
        return [_value(x) for x in (_get(v, "arrayValue", "array_value") or {}).get("values", ())]
    if "kvlistValue" in v or "kvlist_value" in v:
        return _attrs((_get(v, "kvlistValue", "kvlist_value") or {}).get("values"))
    if "bytesValue" in v or "bytes_value" in v:
        return _get(v, "bytesValue", "bytes_value")
    return None
