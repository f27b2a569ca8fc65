"""A dist-info RECORD (pip's list of an installed package's files) read and rewritten with new content."""

from __future__ import annotations

import base64
import csv
import hashlib
import io


def record_rows(data: bytes) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(data.decode())) if row]


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_with(data: bytes, files: dict[str, bytes | None], extra: list[str]) -> bytes:
    """RECORD with `files` (path -> new content, None: removed) and `extra` paths (listed, no hash)."""
    text = data.decode()
    newline = "\r\n" if "\r\n" in text else "\n"
    rows = [row for row in record_rows(data) if row[0] not in files and row[0] not in extra]
    for path, content in sorted(files.items()):
        if content is not None:
            rows.append([path, record_hash(content), str(len(content))])
    rows += [[path, "", ""] for path in extra]
    buf = io.StringIO()
    csv.writer(buf, lineterminator=newline).writerows(rows)
    return buf.getvalue().encode()
