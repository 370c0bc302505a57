"""How one journal record is framed on disk, and how a journal file is read back after a crash.

A record is one line: ``<length:8 hex> <crc32:8 hex> <JSON>\\n``. The length and checksum cover the JSON bytes, so
a line cut short by a crash (a torn tail) or damaged on disk is recognized and skipped with a log line instead of
being parsed as a different record, or crashing the server that reads it.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rtx.journal")

# "xxxxxxxx xxxxxxxx " before the JSON.
_HEADER_LEN = 18


def encode_record(record: dict[str, Any]) -> bytes:
    # ensure_ascii: the JSON holds no raw newline or other line break, so one record is always one line.
    body = json.dumps(record, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return b"%08x %08x " % (len(body), zlib.crc32(body)) + body + b"\n"


@dataclass(slots=True)
class ReadResult:
    records: list[dict[str, Any]]
    # Bytes up to the end of the last complete line: where appending may continue (a torn tail is cut off there).
    valid_end: int
    num_corrupt: int = 0
    torn_tail: bool = False


def decode_records(data: bytes, where: str = "journal") -> ReadResult:
    """Every intact record of ``data``; damaged lines are logged and skipped, never raised."""
    records: list[dict[str, Any]] = []
    result = ReadResult(records, 0)
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:  # no newline: the write of the last record was cut short
            result.torn_tail = True
            log.warning("%s: torn last record at byte %d (%d bytes) ignored", where, offset, len(data) - offset)
            break
        record = _parse_line(data[offset:end])
        if record is None:
            result.num_corrupt += 1
            log.warning("%s: corrupt record at byte %d skipped", where, offset)
        else:
            records.append(record)
        offset = end + 1
        result.valid_end = offset
    return result


def _parse_line(line: bytes) -> dict[str, Any] | None:
    if len(line) < _HEADER_LEN or line[8:9] != b" " or line[17:18] != b" ":
        return None
    try:
        length, crc = int(line[:8], 16), int(line[9:17], 16)
    except ValueError:
        return None
    body = line[_HEADER_LEN:]
    if len(body) != length or zlib.crc32(body) != crc:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not isinstance(record.get("t"), str):
        return None
    return record
